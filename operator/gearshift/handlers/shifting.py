"""The gear-shifting loop: per GearSet, every ``spec.policy.sampleIntervalS``, signals → decision → executor.

One tick (:func:`tick`, synchronous, over :class:`~gearshift.handlers.kubeapi.KubeApi`):

1. read the GearSet and its PDService fresh; skip until the reconciler has set ``status.activeGear``;
2. observe the role's world: StatefulSets and pods per gear (Ready, Ready since, OOM/crash loops), the
   gear the role Service ``<pds>-<role>`` selects, whether free GPUs hold a full shadow of another gear;
3. fetch one sample of the serving gear from Prometheus (``PDService.spec.prometheusUrl``, else the
   operator's ``--prometheus-url``) with the queries of the PDService's ``spec.engine``
   (:func:`gearshift.control.signals.signal_queries`): the sim exports per-stage utilisation, for vLLM
   it is derived from the head's metrics and the gear's ``predictedTimeMs``
   (:func:`gearshift.control.signals.derived_stage_utilization`); during ``Draining`` also the old
   gear's in-flight requests, during ``RollingBack`` the failed gear's
   (:func:`~gearshift.control.executor.draining_gear`). No Prometheus, an error or a missing series →
   ``SignalsAvailable=False`` and the decision holds (no shift starts; a shift already running still
   finishes, its steps need no signals). A vLLM sample without derivable stage utilisation (a
   multi-stage gear without stage times, or no completions yet) is still a sample:
   ``SignalsAvailable=True`` with reason ``StageBalanceUnavailable`` and the imbalance trigger off;
4. :func:`gearshift.control.decide.decide` → :func:`gearshift.control.adapt.shift_request` →
   :func:`gearshift.control.executor.step`; when the active gear holds stages on a time-limited node the
   reconciler reports past its leaveBy (``status.windowedNodes`` ``Leaving``), :func:`window_request`
   replaces the decision's request with a shift (trigger ``window``) to the reconciler's window-free
   replacement, signals or not (issue 13);
5. persist the new executor and decision state, smoothed signals, history, gear health and the
   condition in ``GearSet.status`` (under the reconciler's per-service lock, so a concurrent reconcile
   sees either the old or the new executor step, never a half), *then* apply the actions through the
   reconciler's :func:`~gearshift.handlers.reconcile.ensure_gear_sync`, ``select_gear_sync`` and
   ``delete_gear_sync`` and record events.

Persisting before acting is what makes a restart safe: the executor step is level-triggered and re-emits
whatever the world still lacks (a gear to create, a selector to set, a leftover to delete), so an
operator killed between the two steps, or anywhere in a phase, resumes from ``status``.

Times: the loop passes wall-clock seconds (``time.time()``) as ``now`` because the state outlives the
process; status stores them as RFC 3339 times.

The kopf side is a *daemon* per GearSet rather than a ``kopf.timer``: a timer's interval is fixed when it
is registered, while ``spec.policy.sampleIntervalS`` is per object and may be edited; the daemon re-reads
it every turn. Both need kopf's finalizer on the GearSet.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, Protocol

import kopf

from gearshift.adapters import prometheus
from gearshift.api.common import (
    COND_SIGNALS_AVAILABLE,
    GROUP,
    MAX_HISTORY,
    REASON_SIGNALS_MISSING,
    REASON_WINDOW_NO_TARGET,
    VERSION,
    inputs_hash,
)
from gearshift.api.gearset import ControlState, Gear, GearHealth, GearSet, GearSignals
from gearshift.control.adapt import gear_views, policy_from_api, shift_request
from gearshift.control.decide import (
    MANUAL,
    Decision,
    DecisionKind,
    DecisionState,
    Overrides,
    TriggerTrack,
    decide,
)
from gearshift.control.executor import (
    Action,
    DeleteGear,
    EnsureGear,
    Event,
    GearObservation,
    MarkUnhealthy,
    Outcome,
    Phase,
    RecordShift,
    SelectGear,
    ShiftRequest,
    ShiftState,
    World,
    draining_gear,
    step,
)
from gearshift.control.executor_status import executor_from_status, executor_to_status, from_time, to_time
from gearshift.control.policy import GearTable, LatencyMetric, PolicyError, ShiftRules
from gearshift.control.reconcile import SHIFT_STEPS
from gearshift.control.signals import (
    E2E,
    ITL,
    TTFT,
    Engine,
    GearSelector,
    PipelineShape,
    Reading,
    SignalsUnavailable,
    UtilizationSource,
)
from gearshift.control.smoothing import Sample
from gearshift.control.triggers import TRIGGERS, Trigger
from gearshift.control.windows import TRIGGER_WINDOW, closing_nodes, uses, vacate_target
from gearshift.handlers import metrics
from gearshift.handlers.common import ConditionBook, conditions_from, emit, patch_status
from gearshift.handlers.kubeapi import GS, NODE, POD, STS, SVC, KubeApi, KubeApiError
from gearshift.handlers.loop import every_sample_interval, load_gearset_and_service
from gearshift.handlers.reconcile import (
    NotYet,
    Settings,
    delete_gear_sync,
    ensure_gear_sync,
    select_gear_sync,
    service_lock,
)
from gearshift.k8s import names
from gearshift.k8s.placement import GPU_RESOURCE
from gearshift.planner.inputs import node_gpus

log = logging.getLogger(__name__)

PLURAL = "gearsets"
#: Condition reason when signals are there.
REASON_SIGNALS_OK = "SignalsOk"
#: Condition reason (SignalsAvailable=True) when a sample has no per-stage utilisation: vLLM exports none
#: and the gear's stage times, which the derivation needs, are unknown (or nothing completed yet); the
#: imbalance trigger is off, the others run.
REASON_STAGE_BALANCE_UNAVAILABLE = "StageBalanceUnavailable"
#: Condition reason (SignalsAvailable=True, a Warning event) when requests are served but the latency
#: metric the P99 triggers read has no data: its histogram is not exported or not scraped (#20 row 3).
REASON_LATENCY_UNAVAILABLE = "LatencyUnavailable"
#: The histogram each latency metric is read from (vLLM's names).
LATENCY_HISTOGRAM = {
    LatencyMetric.TTFT: TTFT,
    LatencyMetric.ITL: ITL,
    LatencyMetric.E2E: E2E,
}
#: Condition reason when neither the PDService nor the operator names a Prometheus.
REASON_NO_PROMETHEUS = "NoPrometheus"
#: The shortest loop period, s, whatever ``sampleIntervalS`` says (keeps a typo from spinning the loop).
MIN_INTERVAL_S = 0.2
#: Container waiting/terminated reasons that mark a gear as failed (seed 002: OOM, crash loops).
FAILURE_REASONS = ("OOMKilled", "CrashLoopBackOff")


_SAMPLE_KEYS = {
    "at": "at",
    "queue": "queue",
    "running": "running",
    "qps": "qps",
    "ttft_p50_ms": "ttftP50Ms",
    "ttft_p99_ms": "ttftP99Ms",
    "itl_p50_ms": "itlP50Ms",
    "itl_p99_ms": "itlP99Ms",
    "e2e_p50_ms": "e2eP50Ms",
    "e2e_p99_ms": "e2eP99Ms",
}


def _sample_to_ema(s: Sample) -> dict[str, float]:
    # Non-finite values are no data: JSON has no NaN/Inf, and the API server would refuse the patch.
    out = {key: float(v) for f, key in _SAMPLE_KEYS.items() if _finite(v := getattr(s, f)) is not None}
    if all(math.isfinite(u) for u in s.stage_utilization):
        out |= {f"stage{k}": float(u) for k, u in enumerate(s.stage_utilization)}
    return out


def _finite(v: float | None) -> float | None:
    """``v`` when it is a finite number, else ``None`` (NaN and ±Inf mean no data)."""
    return v if v is not None and math.isfinite(v) else None


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, ±Inf) replaced by ``None``, recursively through dicts,
    lists and tuples: the last guard before a status patch, whose JSON encoding refuses them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def _ema_to_sample(ema: Mapping[str, float]) -> Sample | None:
    if "at" not in ema:
        return None
    stages: list[float] = []
    while f"stage{len(stages)}" in ema:
        stages.append(float(ema[f"stage{len(stages)}"]))
    values: dict[str, Any] = {f: ema.get(key) for f, key in _SAMPLE_KEYS.items()}
    for f in ("queue", "running", "qps"):
        values[f] = values[f] or 0.0
    return Sample(stage_utilization=tuple(stages), **values)


def control_from_status(c: ControlState | None) -> DecisionState:
    """The decision's :class:`DecisionState` from ``status.control`` (``None``: the initial state)."""
    if c is None:
        return DecisionState()
    tracks = {
        t: TriggerTrack(
            on=c.streaks.get(t.value, 0),
            off=c.off_streaks.get(t.value, 0),
            latched=t.value in c.latched,
            level=c.threshold_steps.get(t.value, 0),
        )
        for t in TRIGGERS
    }
    return DecisionState(
        smoothed=_ema_to_sample(c.ema),
        tracks=tracks,
        last_shift_at=from_time(c.last_shift_time),
        last_retrigger_at=from_time(c.last_retrigger_time),
    )


def control_to_status(d: DecisionState, policy: ShiftRules) -> dict[str, Any]:
    """``status.control`` (camelCase JSON) of ``d``; ``dwellUntil`` is informational (last shift + dwell)."""
    tracks: Mapping[Trigger, TriggerTrack] = d.tracks
    return {
        "ema": {} if d.smoothed is None else _sample_to_ema(d.smoothed),
        "streaks": {t.value: tr.on for t, tr in tracks.items()},
        "offStreaks": {t.value: tr.off for t, tr in tracks.items()},
        "latched": [t.value for t, tr in tracks.items() if tr.latched],
        "thresholdSteps": {t.value: tr.level for t, tr in tracks.items()},
        "lastShiftTime": to_time(d.last_shift_at),
        "dwellUntil": None if d.last_shift_at is None else to_time(d.last_shift_at + policy.dwell_s),
        "lastRetriggerTime": to_time(d.last_retrigger_at),
    }


#: ``status.signals`` keys of latency percentiles: they describe completed requests, so a sample window
#: without any has none of them (camelCase, as stored).
LATENCY_SIGNAL_KEYS = ("p99Ms", "p50TtftMs", "p99TtftMs", "p50ItlMs", "p99ItlMs", "p50E2eMs", "p99E2eMs")
#: ``status.signals`` keys that only some samples have (always sent, ``null`` when unknown).
OPTIONAL_SIGNAL_KEYS = (*LATENCY_SIGNAL_KEYS, "stageUtilizationSource", "pipelineUtilization")


def signals_to_status(
    s: Sample,
    policy: ShiftRules,
    replicas: int,
    raw: Sample | None = None,
    reading: Reading | None = None,
) -> dict[str, Any]:
    """``status.signals`` from the smoothed sample ``s`` (``queueLength`` per pipeline replica).

    ``raw`` is the sample ``s`` was smoothed from. The moving average keeps a latency through samples
    that have none (the triggers want that), but shown in ``kubectl get gearsets`` it is stale: when
    ``raw`` has no completed request in its window (``qps`` 0, requests/s), or no value for a
    percentile, that percentile is written as ``null``. ``reading`` (the raw sample's) gives
    ``stageUtilizationSource`` (engine, derived, none) and, for vLLM, ``pipelineUtilization`` (this
    sample's seat occupancy of the head, not smoothed). When the raw sample has no stage utilisation,
    ``stageUtilization`` is empty rather than the average of an earlier one. The optional keys are
    always present (``null`` when unknown) because a JSON merge patch leaves out-of-patch keys as they
    were. Non-finite numbers are written as ``null``."""
    no_traffic = raw is not None and raw.qps <= 0.0

    def shown(smoothed: float | None, measured: float | None) -> float | None:
        if raw is not None and (no_traffic or measured is None):
            return None
        return _round(smoothed)

    stages = s.stage_utilization
    if raw is not None and not raw.stage_utilization:
        stages = ()

    metric = policy.latency_metric
    sig = GearSignals(
        sample_time=datetime.fromtimestamp(s.at, UTC),
        qps=_finite(round(s.qps, 3)),
        p99_ms=shown(s.p99_ms(metric), raw.p99_ms(metric) if raw else None),
        p50_ttft_ms=shown(s.ttft_p50_ms, raw.ttft_p50_ms if raw else None),
        p99_ttft_ms=shown(s.ttft_p99_ms, raw.ttft_p99_ms if raw else None),
        p50_itl_ms=shown(s.itl_p50_ms, raw.itl_p50_ms if raw else None),
        p99_itl_ms=shown(s.itl_p99_ms, raw.itl_p99_ms if raw else None),
        p50_e2e_ms=shown(s.e2e_p50_ms, raw.e2e_p50_ms if raw else None),
        p99_e2e_ms=shown(s.e2e_p99_ms, raw.e2e_p99_ms if raw else None),
        queue_length=_finite(round(s.queue / max(replicas, 1), 3)),
        stage_utilization=[round(u, 4) for u in stages] if all(math.isfinite(u) for u in stages) else [],
        stage_utilization_source=None if reading is None else reading.source.value,
        pipeline_utilization=None
        if reading is None or _finite(reading.pipeline_utilization) is None
        else round(reading.pipeline_utilization, 4),  # type: ignore[arg-type]
    )
    return {k: None for k in OPTIONAL_SIGNAL_KEYS} | json_safe(sig.to_json())


def _round(v: float | None) -> float | None:
    return None if v is None or not math.isfinite(v) else round(v, 2)


# --- the observed world (pure) -------------------------------------------------------------------------
def _pod_ready_since(pod: Mapping[str, Any]) -> float | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready":
            if c.get("status") != "True":
                return None
            return from_time(c.get("lastTransitionTime")) or 0.0
    return None


def _pod_failure(pod: Mapping[str, Any]) -> str | None:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in FAILURE_REASONS:
            return str(waiting["reason"])
        for st in ((cs.get("state") or {}).get("terminated"), (cs.get("lastState") or {}).get("terminated")):
            if st and st.get("reason") in FAILURE_REASONS:
                return str(st["reason"])
    return None


def observe_gear(
    gear: Gear | None, statefulsets: Sequence[Mapping[str, Any]], pods: Sequence[Mapping[str, Any]]
) -> GearObservation:
    """One gear's :class:`GearObservation` from its StatefulSets and pods (all stages).

    Ready: a StatefulSet for every stage of ``gear`` (when known), each with all its replicas Ready, and
    every pod Ready; ``ready_since`` is the latest pod Ready transition (s). A pod whose container is
    OOM-killed or in a crash loop sets ``failure``.
    """
    if not statefulsets:
        return GearObservation(exists=False)
    failure = next((f for p in pods if (f := _pod_failure(p))), None)
    stages = {int((s["metadata"].get("labels") or {}).get(names.LABEL_STAGE, "0")) for s in statefulsets}
    complete = gear is None or stages >= set(range(len(gear.stages)))
    want = 0
    sts_ready = True
    for s in statefulsets:
        n = int((s.get("spec") or {}).get("replicas") or 0)
        want += n
        if int((s.get("status") or {}).get("readyReplicas") or 0) < n:
            sts_ready = False
    live = [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]
    since = [_pod_ready_since(p) for p in live]
    ready = complete and sts_ready and len(live) >= want and all(t is not None for t in since)
    return GearObservation(
        exists=True,
        ready=ready,
        ready_since=max((t for t in since if t is not None), default=None) if ready else None,
        failure=failure,
    )


def selected_gear(role_service: Mapping[str, Any] | None) -> str | None:
    """The gear the role Service's selector names, or ``None`` (no Service yet)."""
    if not role_service:
        return None
    return ((role_service.get("spec") or {}).get("selector") or {}).get(names.LABEL_GEAR)


def _gpu_requests(pod: Mapping[str, Any]) -> int:
    total = 0
    for c in (pod.get("spec") or {}).get("containers") or []:
        res = c.get("resources") or {}
        raw = (res.get("limits") or {}).get(GPU_RESOURCE) or (res.get("requests") or {}).get(GPU_RESOURCE)
        total += int(str(raw)) if raw else 0
    return total


def shadow_fits(
    gear: Gear, pipeline_replicas: int, nodes: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]]
) -> bool:
    """Whether free GPUs hold every pod of ``gear`` beside everything running now.

    Free GPUs of a node = allocatable ``nvidia.com/gpu`` − GPUs of its unfinished pods. Stages take nodes
    greedily in order (a named node list, else the nodes matching the stage's selector, else any GPU
    node), one pod per node for a stage (the builders' anti-affinity). GPUs are whole devices here, so
    "memory short for a full shadow" means "not enough free cards" (a first fit, not an optimal packing).
    """
    node_list = list(nodes)
    free = {n["metadata"]["name"]: node_gpus(n) for n in node_list}
    for p in pods:
        phase = (p.get("status") or {}).get("phase")
        host = (p.get("spec") or {}).get("nodeName")
        if host in free and phase not in ("Succeeded", "Failed"):
            free[host] -= _gpu_requests(p)
    labels = {n["metadata"]["name"]: (n["metadata"].get("labels") or {}) for n in node_list}
    for st in gear.stages:
        if st.nodes:
            cands = [n for n in st.nodes if n in free]
        else:
            cands = [n for n in free if all(labels[n].get(k) == v for k, v in st.node_selector.items())]
        need = st.replicas * max(pipeline_replicas, 1)
        for n in sorted(cands, key=lambda x: -free[x]):
            if need == 0:
                break
            if free[n] >= st.gpus:
                free[n] -= st.gpus
                need -= 1
        if need > 0:
            return False
    return True


# --- signals -----------------------------------------------------------------------------------------
class SignalSource(Protocol):
    """Where a tick gets its numbers (Prometheus in the operator, a fake in unit tests)."""

    def sample(
        self, url: str, sel: GearSelector, at: float, *, engine: Engine, shape: PipelineShape | None
    ) -> Reading:
        """One raw reading of ``sel``'s gear served by ``engine`` (``shape``: its stages, for vLLM's
        derived stage utilisation); raises SignalsUnavailable."""
        ...

    def in_flight(self, url: str, sel: GearSelector) -> int:
        """Requests running or waiting on ``sel``'s head pods; raises SignalsUnavailable."""
        ...


class PrometheusSignals:
    """:class:`SignalSource` over Prometheus' HTTP API (prometheus-api-client, no retries)."""

    def __init__(self, timeout_s: float = 2.0) -> None:
        self.timeout_s = timeout_s

    def sample(
        self, url: str, sel: GearSelector, at: float, *, engine: Engine, shape: PipelineShape | None
    ) -> Reading:
        return prometheus.fetch_reading(url, sel, at, engine=engine, shape=shape, timeout_s=self.timeout_s)

    def in_flight(self, url: str, sel: GearSelector) -> int:
        return prometheus.in_flight(url, sel, self.timeout_s)


def pipeline_shape(gear: Gear) -> PipelineShape:
    """What vLLM's derived stage utilisation needs of ``gear``: the planner's per-stage times
    (``predictedTimeMs``, ms; ``None`` where not given), per-stage replicas and ``maxBatch``
    (``--max-num-seqs``)."""
    return PipelineShape(
        gear=gear.name,
        stage_times_ms=tuple(s.predicted_time_ms for s in gear.stages),
        stage_replicas=tuple(s.replicas for s in gear.stages),
        max_num_seqs=gear.max_batch,
    )


# --- one tick ------------------------------------------------------------------------------------------
@dataclass
class TickResult:
    """What one tick did (for logs, metrics and tests)."""

    skipped: str = ""
    """Why nothing was decided (no active gear yet, GearSet gone, ...); empty when it ran."""
    idle: bool = False
    """Nothing to decide until the spec changes (one gear, scaled to zero): the loop waits longer."""
    phase: Phase | None = None
    decision: Decision | None = None
    actions: list[Action] = field(default_factory=list)
    signals_ok: bool = False
    message: str = ""


_last_hold: dict[tuple[str, str], str] = {}
_last_window: dict[tuple[str, str], str] = {}
_hold_lock = threading.Lock()


def _history(raw: list[dict[str, Any]], rec: RecordShift, message_limit: int = 4000) -> list[dict[str, Any]]:
    entry = {
        "from": rec.from_gear,
        "to": rec.to_gear,
        "trigger": rec.trigger,
        "startedAt": to_time(rec.started_at),
        "finishedAt": to_time(rec.finished_at),
        "outcome": rec.outcome.value,
        "message": rec.message[:message_limit],
    }
    out = list(raw)
    for i, h in enumerate(out):
        same_start = (
            from_time(h.get("startedAt")) is not None
            and abs((from_time(h.get("startedAt")) or 0.0) - rec.started_at) < 1e-3
        )
        if same_start and h.get("to") == rec.to_gear:
            out[i] = entry
            break
    else:
        out.append(entry)
    return out[-MAX_HISTORY:]


def gear_fingerprint(gear: Gear) -> str:
    """A stable hash of a gear's spec, for :class:`GearHealth` marks."""
    return inputs_hash(gear.model_dump(mode="json", by_alias=True))


def forced_shift_reverted(gs: GearSet, state: ShiftState) -> str | None:
    """Why a shift ``spec.forceGear`` started is no longer wanted, or None: the field now names another
    gear or none (#20 row 6). The executor cancels it only before the switch."""
    if not state.busy or state.trigger != MANUAL or gs.spec.force_gear == state.to_gear:
        return None
    now_forced = f"names {gs.spec.force_gear!r}" if gs.spec.force_gear else "was cleared"
    return f"spec.forceGear {now_forced}"


def current_marks(gs: GearSet) -> list[GearHealth]:
    """The health marks that still hold (seed 002: a gear is unhealthy until the model or the profiles
    change): marked under the current GPUProfiles, and on the gear as it is now — an edited gear is a new
    gear and is tried again, as the ``ForceGearUnhealthy`` hold tells users."""
    st = gs.status
    gears = {g.name: gear_fingerprint(g) for g in gs.gears()}
    return [
        h
        for h in st.gear_health
        if h.profiles_hash in (None, st.profiles_hash) and h.gear_hash in (None, gears.get(h.gear))
    ]


def _health(
    raw: list[dict[str, Any]],
    mark: MarkUnhealthy,
    now: float,
    profiles_hash: str | None,
    gear_hash: str | None,
) -> list:
    entry = {
        "gear": mark.gear,
        "healthy": False,
        "reason": mark.reason,
        "message": mark.message[:4000],
        "since": to_time(now),
        "profilesHash": profiles_hash,
        "gearHash": gear_hash,
    }
    return [h for h in raw if h.get("gear") != mark.gear] + [entry]


def tick(
    api: KubeApi,
    namespace: str,
    name: str,
    *,
    now: float,
    settings: Settings,
    signals: SignalSource,
) -> TickResult:
    """One turn of the shifting loop for GearSet ``namespace/name`` (see the module docstring).

    Raises:
        KubeApiError: the API server refused a read or write (the loop retries next turn).
    """
    loaded = load_gearset_and_service(api, namespace, name)
    if isinstance(loaded, str):
        return TickResult(skipped=loaded)
    gs_body, gs, pds = loaded
    role, service = gs.spec.role, gs.spec.service_name
    gears = gs.gears()
    gear_names = [g.name for g in gears]
    st = gs.status
    if not gears or not st.active_gear:
        return TickResult(skipped="no active gear yet (the reconciler sets it)")
    if st.active_gear not in gear_names:
        return TickResult(skipped=f"active gear {st.active_gear!r} is not among {gear_names}")
    # A shift in flight must run to its end whatever the gear count says now.
    # A window on one of its nodes may call for a vacating shift to a gear the reconciler adds.
    if gs.spec.replicas == 0 and _settled(gs_body):
        return TickResult(skipped="scaled to zero: no signals", idle=True)
    try:
        policy = policy_from_api(gs.spec.policy, role=role, ttft_slo_ms=pds.spec.slo.ttft_ms,
                                 itl_slo_ms=pds.spec.slo.itl_ms)  # fmt: skip
    except PolicyError as exc:
        emit(api, gs_body, "InvalidPolicy", str(exc), True)
        return TickResult(skipped=str(exc))

    state = executor_from_status(st.active_gear, st.executor)
    dstate = control_from_status(st.control)

    # --- observe -------------------------------------------------------------------------------------
    labels = {names.LABEL_SERVICE: service, names.LABEL_ROLE: role}
    sts_all = api.list(*STS, namespace, {**labels, names.LABEL_COMPONENT: names.COMPONENT_ENGINE})
    pods_all = api.list(*POD, namespace, labels)
    by_gear: dict[str, list[dict[str, Any]]] = {}
    for s in sts_all:
        by_gear.setdefault((s["metadata"].get("labels") or {}).get(names.LABEL_GEAR, ""), []).append(s)
    selected = selected_gear(api.get(*SVC, namespace, names.role_service_name(service, role)))
    url = pds.spec.prometheus_url or settings.prometheus_url
    sample_gear = selected if selected in by_gear else state.active
    spec_gears = {g.name: g for g in gears}
    engine: Engine = pds.spec.engine
    sample: Sample | None = None
    reading: Reading | None = None
    why = ""
    if not url:
        why = "no Prometheus URL: set PDService spec.prometheusUrl or the operator's --prometheus-url"
    else:
        shape = pipeline_shape(spec_gears[sample_gear]) if sample_gear in spec_gears else None
        try:
            reading = signals.sample(
                url, GearSelector(namespace, service, role, sample_gear), now, engine=engine, shape=shape
            )
            sample = reading.sample
        except SignalsUnavailable as exc:
            why = str(exc)
    # The gear being drained: the old one while Draining, the failed one while RollingBack.
    drained = draining_gear(state)
    in_flight_old: int | None = None
    if drained is not None and drained in by_gear and url:
        try:
            in_flight_old = signals.in_flight(url, GearSelector(namespace, service, role, drained))
        except SignalsUnavailable as exc:
            log.info("GearSet %s/%s: in-flight requests of %s unknown: %s", namespace, name, drained, exc)
    observations: dict[str, GearObservation] = {}
    for gname, objs in by_gear.items():
        pods = [p for p in pods_all if (p["metadata"].get("labels") or {}).get(names.LABEL_GEAR) == gname]
        obs = observe_gear(spec_gears.get(gname), objs, pods)
        if gname == drained:
            # Unknown in-flight counts hold the drain until its timeout rather than cut requests off.
            obs = replace(obs, in_flight=1 if in_flight_old is None else in_flight_old)
        if sample is not None and gname == sample_gear:
            obs = replace(obs, p99_ms=sample.p99_ms(policy.latency_metric), qps=sample.qps)
        observations[gname] = obs
    # --- decide and step -----------------------------------------------------------------------------
    marks = current_marks(gs)
    table = GearTable(gear_views(gears, marks), active=state.active, arch=pds.spec.model.to_model_arch())
    t0 = time.perf_counter()
    overrides = Overrides(force_gear=gs.spec.force_gear, paused=gs.spec.paused)
    new_dstate, decision = decide(dstate, sample, policy, table, now, overrides=overrides, busy=state.busy)
    metrics.DECISION_SECONDS.observe(time.perf_counter() - t0)
    request = shift_request(decision, table)
    vacate = window_request(gs, table, state)
    if isinstance(vacate, ShiftRequest):
        request = vacate  # the node's deadline comes before any trigger, dwell or forced gear
    fits = True
    if (
        request is not None
        and not state.busy
        and request.target in spec_gears
        and request.target not in by_gear
    ):
        # Only a shift about to start needs the cluster-wide view of free GPUs.
        fits = shadow_fits(spec_gears[request.target], gs.spec.replicas, api.list(*NODE), api.list(*POD))
    world = World(now=now, gears=observations, selected=selected, full_shadow_fits=fits)
    new_state, actions = step(
        state, world, policy, request=request, paused=gs.spec.paused, cancel=forced_shift_reverted(gs, state)
    )

    # --- status --------------------------------------------------------------------------------------
    gen = gs_body["metadata"].get("generation")
    book = ConditionBook(conditions_from([c.to_json() for c in st.conditions]), gen, _now_dt(now))
    if reading is not None and reading.source is UtilizationSource.NONE:
        book.set(
            COND_SIGNALS_AVAILABLE,
            "True",
            REASON_STAGE_BALANCE_UNAVAILABLE,
            f"Prometheus at {url} answers (engine {engine}); {reading.note}: the imbalance trigger is off "
            "for this gear, the saturation and P99 triggers run",
        )
    elif sample is not None and sample.qps > 0 and sample.p99_ms(policy.latency_metric) is None:
        metric = policy.latency_metric
        book.set(
            COND_SIGNALS_AVAILABLE,
            "True",
            REASON_LATENCY_UNAVAILABLE,
            f"Prometheus at {url} answers and the gear serves requests, but {metric.value} P99 has no data: "
            f"is {LATENCY_HISTOGRAM[metric]}_bucket exported by the head pods and scraped? "
            "The P99 triggers are off; the saturation and imbalance triggers run",
            warning=True,
        )
    elif sample is not None:
        book.set(COND_SIGNALS_AVAILABLE, "True", REASON_SIGNALS_OK, f"Prometheus at {url} answers")
    else:
        reason = REASON_NO_PROMETHEUS if not url else REASON_SIGNALS_MISSING
        book.set(COND_SIGNALS_AVAILABLE, "False", reason, f"{why}; no gear shift starts", warning=True)
    raw = gs_body.get("status") or {}
    history = list(raw.get("history") or [])
    # Marks that no longer hold (the gear or the profiles changed) leave the status: `kubectl get` must
    # not show a gear as unhealthy that is tried again, or serving.
    held = {m.gear for m in marks}
    health = [h for h in raw.get("gearHealth") or [] if h.get("gear") in held]
    for a in actions:
        if isinstance(a, RecordShift):
            history = _history(history, a)
            if a.outcome is not Outcome.IN_PROGRESS:
                metrics.SHIFTS.labels(role, a.outcome.value).inc()
        elif isinstance(a, MarkUnhealthy):
            marked = spec_gears.get(a.gear)
            health = _health(
                health, a, now, st.profiles_hash, gear_fingerprint(marked) if marked is not None else None
            )
    patch: dict[str, Any] = {
        "phase": new_state.phase.value,
        "activeGear": new_state.active,
        "targetGear": new_state.to_gear if new_state.busy else None,
        "executor": executor_to_status(new_state, in_flight_old),
        "control": control_to_status(new_dstate, policy),
        "history": history,
        "gearHealth": health,
        "conditions": book.as_json(),
        "observedGeneration": gen,
    }
    if new_dstate.smoothed is not None and sample is not None:
        patch["signals"] = signals_to_status(new_dstate.smoothed, policy, gs.spec.replicas, sample, reading)
    with service_lock(namespace, service):
        patch["conditions"] = _keep_other_conditions(api, namespace, name, patch["conditions"])
        patch_status(api, *GS, namespace, name, json_safe(patch))

    # --- act -----------------------------------------------------------------------------------------
    for a in actions:
        match a:
            case EnsureGear(gear=g):
                ensure_gear_sync(api, namespace, service, role, g, settings)
            case SelectGear(gear=g):
                select_gear_sync(api, namespace, service, role, g)
            case DeleteGear(gear=g):
                delete_gear_sync(api, namespace, service, role, g)
            case Event(reason=r, message=m, warning=w):
                emit(api, gs_body, r, m, w)
            case _:
                pass
    for reason, message, warning in book.changes:
        emit(api, gs_body, reason, message, warning)
    if isinstance(vacate, str):
        _once(api, gs_body, namespace, name, REASON_WINDOW_NO_TARGET, vacate, True)
    _decision_event(api, gs_body, namespace, name, decision)
    return TickResult(
        phase=new_state.phase, decision=decision, actions=actions, signals_ok=sample is not None, message=why
    )


def window_request(gs: GearSet, table: GearTable, state: ShiftState) -> ShiftRequest | str | None:
    """The shift that vacates time-limited nodes, when the active gear holds stages on one the reconciler
    reports past its leaveBy (``status.windowedNodes`` state ``Leaving``); issue 13.

    Returns a :class:`ShiftRequest` with trigger ``window`` to the reconciler's window-free replacement
    (:func:`gearshift.control.windows.vacate_target`), a message when no healthy gear is off those nodes,
    or ``None`` (nothing to vacate, or a shift already runs: it finishes first).
    """
    if state.busy:
        return None
    closing = closing_nodes(w.to_json() for w in gs.status.windowed_nodes)
    if not closing:
        return None
    gears = gs.gears()
    unhealthy = {g.name for g in table.gears if not g.healthy}
    target = vacate_target(gears, state.active, closing, unhealthy)
    if target is None:
        cur = next((g for g in gears if g.name == state.active), None)
        if cur is None or not uses(cur, closing):
            return None
        return (
            f"gear {state.active!r} runs on node(s) {', '.join(sorted(closing))} past their leaveBy and no "
            "healthy gear is off them to shift to; it stays until the node goes (then: node loss)"
        )
    view = table.get(target)
    return ShiftRequest(target, TRIGGER_WINDOW, None if view is None else view.predicted_p99_ms)


def _once(
    api: KubeApi, body: Mapping[str, Any], namespace: str, name: str, reason: str, message: str, warning: bool
) -> None:
    """Emit an event unless the last one of this GearSet had the same reason (the loop ticks every few s)."""
    key = (namespace, name)
    with _hold_lock:
        if _last_window.get(key) == message:
            return
        _last_window[key] = message
    emit(api, body, reason, message, warning)


def _keep_other_conditions(
    api: KubeApi, namespace: str, name: str, mine: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """``mine`` plus the conditions of other types as stored now (the autoscaler writes ScalingActive
    between this tick's read and its write; a stale copy must not drop it)."""
    fresh = api.get(*GS, namespace, name) or {}
    types = {c.get("type") for c in mine}
    others = [c for c in (fresh.get("status") or {}).get("conditions") or [] if c.get("type") not in types]
    return list(mine) + others


def _now_dt(now: float) -> datetime:
    return datetime.fromtimestamp(now, UTC).replace(microsecond=0)


def _decision_event(
    api: KubeApi, body: Mapping[str, Any], namespace: str, name: str, decision: Decision
) -> None:
    """Events for decisions that did something (raised a threshold, vetoed) or a hold that changed why."""
    if decision.kind in (DecisionKind.THRESHOLD_RAISED, DecisionKind.VETOED):
        emit(api, body, decision.kind.value, decision.message, decision.kind is DecisionKind.VETOED)
        return
    if decision.kind is not DecisionKind.HOLD:
        return
    key = (namespace, name)
    with _hold_lock:
        changed = _last_hold.get(key) != decision.reason
        _last_hold[key] = decision.reason
    notable = decision.reason not in ("Steady", "ShiftInProgress", "ForcedGear")
    if changed and notable:
        emit(api, body, decision.reason, decision.message, decision.reason.startswith("Force"))


# --- kopf ----------------------------------------------------------------------------------------------
_signals: SignalSource = PrometheusSignals()


def configure(signals: SignalSource) -> None:
    """Swap the signal source (tests)."""
    global _signals
    _signals = signals


def run_tick(namespace: str, name: str) -> TickResult:
    """One tick with the operator's API client and settings (see :func:`tick`)."""
    from gearshift.handlers import pdservice

    return tick(
        pdservice.api(), namespace, name, now=time.time(), settings=pdservice.settings(), signals=_signals
    )


def _settled(body: Mapping[str, Any]) -> bool:
    """No shift in flight, none forced, no time-limited node to leave: nothing for the executor to do."""
    spec, st = body.get("spec") or {}, body.get("status") or {}
    return (
        (st.get("executor") or {}).get("step") not in SHIFT_STEPS
        and not spec.get("forceGear")
        and not st.get("windowedNodes")
    )


def _serving_or_busy(body: kopf.Body, **_: Any) -> bool:
    """kopf runs the daemon only for GearSets with replicas to sample or a shift to finish: a namespace of
    services scaled to zero costs no sampling (issue 6: no hot loop when idle)."""
    return (body.get("spec") or {}).get("replicas", 1) != 0 or not _settled(body)


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=10.0, when=_serving_or_busy)  # type: ignore[arg-type]  # namespaced kind: kopf's namespace (str | None) is a str
async def gearset_shifting(
    namespace: str, name: str, body: kopf.Body, stopped: kopf.DaemonStopped, **_: Any
) -> None:
    """Every ``spec.policy.sampleIntervalS``: one :func:`tick` (in a thread: the API client is sync)."""
    await every_sample_interval(
        namespace,
        name,
        body,
        stopped,
        run_tick,
        what="shifting tick",
        floor_s=MIN_INTERVAL_S,
        expected=(KubeApiError, NotYet, KeyError),
    )


def gears_to_free(sts: Sequence[Mapping[str, Any]], selected: str | None, active: str | None) -> list[str]:
    """Gears of a deleted GearSet's role whose StatefulSets go with it: every gear but the one serving
    (the role Service's, else ``status.activeGear``), sorted. Pure.

    The serving gear stays: deleting its pods would drop requests, and the PDService's own deletion (owner
    references) or a new GearSet decides its fate. A shadow or a drained old gear holds GPUs for nothing.
    """
    keep = selected or active
    gears = {(s.get("metadata", {}).get("labels") or {}).get(names.LABEL_GEAR) for s in sts}
    return sorted(g for g in gears if g and g != keep)


def free_gears_of_deleted_gearset(api: KubeApi, namespace: str, body: Mapping[str, Any]) -> list[str]:
    """On a GearSet's deletion: delete its role's StatefulSets of gears not serving; returns those gears."""
    spec, st = body.get("spec") or {}, body.get("status") or {}
    service, role = spec.get("serviceName"), spec.get("role")
    if not service or not role:
        return []
    labels = {
        names.LABEL_SERVICE: service,
        names.LABEL_ROLE: role,
        names.LABEL_COMPONENT: names.COMPONENT_ENGINE,
    }
    sts = api.list(*STS, namespace, labels)
    selected = selected_gear(api.get(*SVC, namespace, names.role_service_name(service, role)))
    freed = gears_to_free(sts, selected, st.get("activeGear"))
    for gear in freed:
        delete_gear_sync(api, namespace, service, role, gear)
    if freed:
        log.info("GearSet %s/%s deleted: freed gear(s) %s", namespace, body["metadata"]["name"], freed)
    return freed


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)  # type: ignore[arg-type]  # namespaced kind: kopf's namespace (str | None) is a str
def gearset_deleted(namespace: str, body: kopf.Body, **_: Any) -> None:
    """#20 row 6: a GearSet deleted mid-shift left its shadow StatefulSets (and their GPUs) behind."""
    from gearshift.handlers import pdservice

    free_gears_of_deleted_gearset(pdservice.api(), namespace, body)
