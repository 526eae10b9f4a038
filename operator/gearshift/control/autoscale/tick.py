"""The autoscaler tick's rules over the API's objects: what one tick of
:mod:`gearshift.handlers.autoscale` observes and decides, the handler only reading, calling these, writing
and recording. Pure: no clock (``now`` is passed in, epoch s), no I/O.

:mod:`gearshift.control.autoscale.scaling` is the algorithm over plain numbers (recommendation, windows,
placement, drain primitives) that the virtual-time benchmark also runs; this module maps a GearSet and its
PDService onto it and its results back onto the GearSet:

- which gear and knobs apply (:func:`scope_of`), which latency metric and SLO the sample compares
  (:func:`latency_signal`) and the PromQL of a sample (:func:`sample_queries`, :func:`sample_from`);
- what the tick reads off the cluster's objects: ready pipelines, head pods, what a new replica needs
  (:func:`ready_pipelines`, :func:`head_pods`, :func:`stage_needs`), the decision memory
  (:func:`state_from_status`), the router's rejections since the last read (:func:`with_rejections`);
- a drain in progress: aborted by a shift (:func:`abort_drain`) or continued until the pods are empty or
  the shift policy's ``drainTimeoutS`` (:func:`continue_drain`);
- what a decision writes (:func:`act_on`): ``spec.replicas``, the head pods that get the draining label,
  ``status.scaling``, the ``ScalingActive`` condition and the events; the status patch itself
  (:func:`status_patch`) and when a condition change is announced (:func:`announce_condition`).

``status.scaling`` travels as its JSON (camelCase keys, as :meth:`ScalingStatus.to_json` gives it); a
``None`` value deletes the key in the merge patch that writes it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from gearshift.api.common import (
    COND_SCALING_ACTIVE,
    REASON_SCALED_DOWN,
    REASON_SCALED_UP,
    ConditionStatus,
)
from gearshift.api.gearset import Gear, GearSet
from gearshift.api.gearset_status import ScalingStatus
from gearshift.api.pdservice import PDService, SLOSpec
from gearshift.control.autoscale import scaling as sc
from gearshift.control.reconcile.state import SHIFT_STEPS
from gearshift.control.signals import GearSelector, quantile_query, queue_query, running_query, scalar
from gearshift.facts.rfc3339 import from_time, to_time
from gearshift.k8s import names

#: Seconds the router gets to drop a labelled pod before its in-flight count is trusted: its pod poll
#: (router.membership.POD_POLL_S, 2 s) plus a scrape and a margin.
DRAIN_GRACE_S = 6.0
#: Condition reasons (``ScalingActive``) and event reasons of the autoscaler's own.
REASON_ACTIVE = "ScalingActive"
REASON_NO_FREE_GPU = "NoFreeGPU"
REASON_SCALE_DOWN_DRAINING = "ScaleDownDraining"
REASON_DRAIN_ABORTED = "DrainAborted"
#: The latency histograms a role's P99 is read from: the SLO each role is held to (TTFT, ITL).
TTFT_METRIC = "vllm:time_to_first_token_seconds"
ITL_METRIC = "vllm:inter_token_latency_seconds"
#: The rate window of the P99 query (a minute: enough requests for a quantile at low load).
P99_WINDOW = "1m"
#: vLLM's gauges of a pod's requests; a drain is over when both are 0 on the leaving pods.
RUNNING_GAUGE = "vllm:num_requests_running"
WAITING_GAUGE = "vllm:num_requests_waiting"
#: Longest message the autoscaler puts in ``status.scaling`` and its condition, characters.
MESSAGE_CHARS = 4000

#: ``(status, reason, message)`` of the ``ScalingActive`` condition.
ScalingCondition = tuple[ConditionStatus, str, str]


class ScaleEvent(NamedTuple):
    """An Event to record on the GearSet."""

    reason: str
    message: str
    warning: bool = False


# --- what a tick works on ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Skip:
    """A tick that does nothing: why, and whether nothing changes until the spec does (``idle``)."""

    reason: str
    idle: bool = False


@dataclass(frozen=True)
class LatencySignal:
    """The latency a role's P99 is measured by: histogram ``metric`` (s) against ``slo_ms`` (ms)."""

    metric: str
    slo_ms: float


def latency_signal(role: str, slo: SLOSpec) -> LatencySignal:
    """Prefill is held to time to first token, decode to inter-token latency; an aggregated pipeline
    (both) to time to first token, where its queue shows (as its gear shifting reads it)."""
    if role in ("prefill", "both"):
        return LatencySignal(TTFT_METRIC, slo.ttft_ms)
    return LatencySignal(ITL_METRIC, slo.itl_ms)


@dataclass(frozen=True)
class ScaleScope:
    """One tick's GearSet role, its active gear and the PDService's knobs for it."""

    service: str
    role: str
    gear: Gear
    policy: sc.ScalingPolicy
    compute_classes: tuple[str, ...]
    """Compute classes new replicas may go to (empty: any)."""
    current: int
    """Pipeline replicas asked for now (``GearSet.spec.replicas``)."""
    drain_timeout_s: float
    """The shift policy's ``drainTimeoutS``: a drain cuts in-flight requests after this long, s."""
    latency: LatencySignal
    prometheus_url: str | None
    """The PDService's ``prometheusUrl``, else the operator's; None: no Prometheus sample."""
    shift_in_flight: bool
    """A gear shift of the role is in flight (an executor shift step): no scaling, a drain aborts."""

    def pod_labels(self) -> dict[str, str]:
        """Label selector of the active gear's pods and StatefulSets."""
        return {
            names.LABEL_SERVICE: self.service,
            names.LABEL_ROLE: self.role,
            names.LABEL_GEAR: self.gear.name,
        }

    def selector(self, namespace: str) -> GearSelector:
        """The active gear's series in Prometheus."""
        return GearSelector(namespace, self.service, self.role, self.gear.name)


def scope_of(gs: GearSet, pds: PDService, prometheus_url: str | None) -> ScaleScope | Skip:
    """What a tick of ``gs`` scales, or why it skips (its role has no ``scaling``: idle; no active gear).

    ``prometheus_url``: the operator's default, used when the PDService names none.
    """
    if gs.spec.role not in pds.spec.roles:
        return Skip(f"the PDService has no role {gs.spec.role}", idle=True)
    role_spec = pds.spec.role_spec(gs.spec.role)
    if role_spec.scaling is None:
        return Skip("no scaling section: replicas stay as spec.replicas says", idle=True)
    gear = {g.name: g for g in gs.gears()}.get(gs.status.active_gear or "")
    if gear is None:
        return Skip("no active gear yet")
    return ScaleScope(
        service=gs.spec.service_name,
        role=gs.spec.role,
        gear=gear,
        policy=sc.ScalingPolicy.from_spec(role_spec.scaling),
        compute_classes=tuple(role_spec.scaling.compute_classes),
        current=gs.spec.replicas,
        drain_timeout_s=gs.spec.policy.drain_timeout_s,
        latency=latency_signal(gs.spec.role, pds.spec.slo),
        prometheus_url=pds.spec.prometheus_url or prometheus_url,
        shift_in_flight=gs.status.executor is not None and gs.status.executor.step in SHIFT_STEPS,
    )


# --- what a tick observes ------------------------------------------------------------------------------
def sample_queries(sel: GearSelector, metric: str) -> dict[str, str]:
    """PromQL of one sample of ``sel``'s head pods, by key: ``kv`` (fullest pod's KV-cache usage, 0..1),
    ``waiting`` and ``running`` (requests, summed), ``p99`` (of histogram ``metric`` over
    :data:`P99_WINDOW`, s)."""
    return {
        "kv": sc.kv_usage_query(sel.matchers()),
        "waiting": queue_query(sel),
        "running": running_query(sel),
        "p99": quantile_query(metric, 0.99, sel, window=P99_WINDOW),
    }


def sample_from(
    queries: Mapping[str, str], results: Mapping[str, Sequence[Mapping[str, Any]]], slo_ms: float, at: float
) -> sc.ScaleSample:
    """The sample of :func:`sample_queries`' ``queries`` from their instant-vector ``results`` (by query).

    KV usage and P99 may be missing (None); while requests run or wait, each that is missing or not a
    number is named in ``missing`` (missing is never fine; the P99 also when no request finished in
    its window, which holds only a scale-down). ``p99_ratio`` = P99 (ms) / ``slo_ms``.

    Raises:
        SignalsUnavailable: the waiting or running series are missing (the pods are not scraped).
    """
    out = {key: scalar(results[q], q, required=key in ("waiting", "running")) for key, q in queries.items()}
    p99 = out["p99"]
    busy = (out["running"] or 0.0) + (out["waiting"] or 0.0) > 0
    labels = {"kv": "KV-cache usage", "p99": "P99"}
    missing = tuple(f"{label} ({queries[key]})" for key, label in labels.items() if busy and out[key] is None)
    return sc.ScaleSample(
        missing=missing,
        at=at,
        kv_cache_usage=out["kv"],
        waiting=out["waiting"] or 0.0,
        running=out["running"] or 0.0,
        p99_ratio=None if p99 is None else p99 * 1000.0 / slo_ms,
    )


def state_from_status(s: ScalingStatus | None) -> sc.ScaleState:
    """The decision memory from ``status.scaling``."""
    if s is None:
        return sc.ScaleState()
    return sc.ScaleState(
        up_since=from_time(s.up_since),
        up_floor=s.up_floor,
        down_since=from_time(s.down_since),
        down_ceiling=s.down_ceiling,
        idle_since=from_time(s.idle_since),
        last_scale_at=from_time(s.last_scale_time),
        last_reason=s.last_reason or "",
    )


def _labels(obj: Mapping[str, Any]) -> Mapping[str, str]:
    return (obj.get("metadata") or {}).get("labels") or {}


def ready_pipelines(
    gear: Gear, statefulsets: Mapping[str, Mapping[str, Any]], service: str, role: str
) -> int:
    """Ready pipeline replicas of ``gear``: the least over stages of ready pods / pods per replica.

    ``statefulsets``: the gear's StatefulSet objects by name (a missing one counts 0 ready).
    """
    ready = None
    for k, st in enumerate(gear.stages):
        obj = statefulsets.get(names.stage_statefulset_name(service, role, gear.name, k)) or {}
        r = int((obj.get("status") or {}).get("readyReplicas") or 0) // max(st.replicas, 1)
        ready = r if ready is None else min(ready, r)
    return ready or 0


def head_pods(pods: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The stage-0 pods among ``pods`` (a gear's): where requests enter, what the router picks."""
    return [p for p in pods if _labels(p).get(names.LABEL_STAGE) == "0"]


def stage_needs(gear: Gear, pods: Sequence[Mapping[str, Any]]) -> list[sc.StageNeed]:
    """What each stage of ``gear`` needs per new pipeline replica; ``pods``: the gear's pods now."""
    out = []
    for k, st in enumerate(gear.stages):
        occupied = frozenset(
            str((p.get("spec") or {}).get("nodeName"))
            for p in pods
            if _labels(p).get(names.LABEL_STAGE) == str(k) and (p.get("spec") or {}).get("nodeName")
        )
        out.append(sc.StageNeed(st.gpus, st.replicas, tuple(st.nodes), dict(st.node_selector), occupied))
    return out


def with_rejections(
    sample: sc.ScaleSample | None, previous: float | None, value: float | None, now: float
) -> sc.ScaleSample | None:
    """``sample`` with the router's no-headroom rejections since the last read (counter ``previous`` →
    ``value``, None: unread). Without a Prometheus sample, rejections alone make one (a busy role: the
    immediate trigger works without Prometheus)."""
    delta = sc.counter_delta(previous, value)
    if sample is not None:
        return replace(sample, no_headroom=delta)
    if delta > 0:
        return sc.ScaleSample(at=now, no_headroom=delta, running=1.0)
    return None


def observed(
    scaling: Mapping[str, Any], *, unavailable: str | None, rejections: float | None
) -> dict[str, Any]:
    """``status.scaling`` after the sample: why Prometheus gave none (``unavailable``), the router counter's
    reading as the next tick's baseline (``rejections``, None: unread)."""
    st = dict(scaling)
    if unavailable is not None:
        st["lastMessage"] = unavailable[:MESSAGE_CHARS]
    if rejections is not None:
        st["routerRejections"] = rejections
    return st


# --- a drain in progress --------------------------------------------------------------------------------
@dataclass(frozen=True)
class DrainStep:
    """What a tick does about the drain in ``status.scaling.draining``."""

    scaling: dict[str, Any]
    """``status.scaling`` (JSON) after it."""
    events: tuple[ScaleEvent, ...] = ()
    replicas: int | None = None
    """``spec.replicas`` to write: the drain ended."""
    unlabel: tuple[str, ...] = ()
    """Pods whose draining label goes."""
    draining: tuple[str, ...] = ()
    """Pods still draining after this tick."""


_DRAIN_CLEARED: dict[str, Any] = {"draining": [], "drainTarget": None, "drainStartedAt": None}


def abort_drain(scaling: Mapping[str, Any], draining: Sequence[str]) -> DrainStep:
    """A gear shift started during a drain: the pods keep serving (labels removed), replicas unchanged."""
    return DrainStep(
        dict(scaling) | _DRAIN_CLEARED,
        (ScaleEvent(REASON_DRAIN_ABORTED, "a gear shift started; the scale-down drain is aborted"),),
        unlabel=tuple(draining),
    )


def drain_in_flight(running: float | None, waiting: float | None, pods_left: int) -> int | None:
    """Requests running + waiting on the draining pods (None: unknown); 0 once the pods are gone."""
    if pods_left == 0:
        return 0
    return None if running is None or waiting is None else int(running + waiting)


def continue_drain(
    old: ScalingStatus,
    *,
    in_flight: int | None,
    now: float,
    current: int,
    timeout_s: float,
    grace_s: float = DRAIN_GRACE_S,
) -> DrainStep:
    """One tick of the drain in ``old`` (:func:`gearshift.control.autoscale.scaling.drain_done`): hold, or
    write ``spec.replicas`` = the drain's target (``current`` when none is stored) and clear the drain.

    ``in_flight``: :func:`drain_in_flight`; ``timeout_s``, ``grace_s``: s.
    """
    started = from_time(old.drain_started_at) or now
    d = sc.drain_done(started, now, in_flight, grace_s=grace_s, timeout_s=timeout_s)
    st = old.to_json() | {"lastMessage": d.message}
    if not d.done:
        return DrainStep(st, draining=tuple(old.draining))
    target = old.drain_target if old.drain_target is not None else current
    st |= _DRAIN_CLEARED | {"lastScaleTime": to_time(now), "desiredReplicas": target}
    event = ScaleEvent(
        REASON_SCALED_DOWN,
        f"{current} -> {target} pipeline replicas: {d.message}",
        d.reason == "DrainTimeout",
    )
    return DrainStep(st, (event,), replicas=target)


# --- what a decision writes -----------------------------------------------------------------------------
@dataclass(frozen=True)
class ScaleActions:
    """What one decision writes."""

    scaling: dict[str, Any]
    """``status.scaling`` (JSON), before ``readyReplicas`` (:func:`status_patch`)."""
    condition: ScalingCondition
    events: tuple[ScaleEvent, ...] = ()
    replicas: int | None = None
    """``spec.replicas`` to write, if any."""
    label: tuple[str, ...] = ()
    """Head pods to label draining (a scale-down's drain starts)."""


def _decision_status(decision: sc.ScaleDecision, state: sc.ScaleState, desired: int) -> dict[str, Any]:
    return {
        "desiredReplicas": desired,
        "lastDecision": decision.kind.value,
        "lastReason": decision.reason,
        "lastMessage": decision.message[:MESSAGE_CHARS],
        "upSince": to_time(state.up_since),
        "upFloor": state.up_floor,
        "downSince": to_time(state.down_since),
        "downCeiling": state.down_ceiling,
        "idleSince": to_time(state.idle_since),
        "lastScaleTime": to_time(state.last_scale_at),
    }


def _scale_up(
    decision: sc.ScaleDecision, placement: sc.Placement, current: int, st: dict[str, Any]
) -> tuple[int | None, list[ScaleEvent], ScalingCondition | None]:
    """What of a scale-up is placed: ``spec.replicas`` (None: nothing fits), events, NoFreeGPU condition."""
    desired = current + placement.replicas
    events: list[ScaleEvent] = []
    cond: ScalingCondition | None = None
    if placement.replicas > 0:
        where = "; ".join(",".join(r) for r in placement.nodes)
        st["placement"] = f"new replicas on: {where}"[:MESSAGE_CHARS]
        events.append(
            ScaleEvent(
                REASON_SCALED_UP,
                f"{current} -> {desired} pipeline replicas ({decision.reason}): "
                f"{decision.message}; nodes {where}",
            )
        )
    if placement.short:
        cond = (
            "False",
            REASON_NO_FREE_GPU,
            f"{decision.reason} asks {decision.target} replicas, {desired} placed: {placement.short}; "
            "retried when nodes appear, nothing is evicted",
        )
    return (desired if placement.replicas > 0 else None), events, cond


def _scale_down(
    decision: sc.ScaleDecision, heads: Sequence[str], pods_per_replica: int, current: int, now: float
) -> tuple[int | None, tuple[str, ...], list[ScaleEvent], dict[str, Any]]:
    """A scale-down: the leaving heads start draining, or (none to drain) ``spec.replicas`` goes down."""
    leaving = sc.pods_to_drain(heads, decision.target, pods_per_replica)
    if not leaving:
        event = ScaleEvent(REASON_SCALED_DOWN, f"{current} -> {decision.target} pipeline replicas")
        return decision.target, (), [event], {}
    event = ScaleEvent(
        REASON_SCALE_DOWN_DRAINING,
        f"{current} -> {decision.target}: draining {', '.join(leaving)} "
        f"({decision.reason}: {decision.message})",
    )
    drain = {"draining": leaving, "drainTarget": decision.target, "drainStartedAt": to_time(now)}
    return None, tuple(leaving), [event], drain


def act_on(
    decision: sc.ScaleDecision,
    *,
    before: sc.ScaleState,
    after: sc.ScaleState,
    scaling: Mapping[str, Any],
    current: int,
    placement: sc.Placement | None,
    heads: Sequence[str],
    pods_per_replica: int,
    now: float,
) -> ScaleActions:
    """What ``decision`` (of :func:`gearshift.control.autoscale.scaling.decide_scale`, state ``before`` →
    ``after``) writes, from ``status.scaling`` = ``scaling`` and ``current`` pipeline replicas.

    A scale-up adds what ``placement`` fits (nothing fits: the windows' memory stays ``before``'s so the
    next tick retries at once); a scale-down drains the ``heads`` (stage-0 pod names) whose ordinals go,
    ``pods_per_replica`` to a pipeline replica, from time ``now`` (s).

    Raises:
        ValueError: a scale-up without ``placement``.
    """
    st = dict(scaling)
    replicas: int | None = None
    label: tuple[str, ...] = ()
    events: list[ScaleEvent] = []
    cond: ScalingCondition | None = None
    if decision.kind is sc.ScaleKind.UP:
        if placement is None:
            raise ValueError("a scale-up needs its placement")
        replicas, events, cond = _scale_up(decision, placement, current, st)
        if replicas is None and placement.short:
            after = replace(
                after, up_since=before.up_since, up_floor=before.up_floor, last_scale_at=before.last_scale_at
            )
    elif decision.kind is sc.ScaleKind.DOWN:
        replicas, label, events, drain = _scale_down(decision, heads, pods_per_replica, current, now)
        st.update(drain)
    elif decision.reason == sc.REASON_SERIES_MISSING:
        # A missing series is said (ScalingActive=False, one Warning event per episode), not read as
        # low load; the next sample with every series clears it.
        cond = ("False", sc.REASON_SERIES_MISSING, decision.message[:MESSAGE_CHARS])
    active: ScalingCondition = (
        "True",
        REASON_ACTIVE,
        f"{decision.reason}: {decision.message}"[:MESSAGE_CHARS],
    )
    desired = replicas if replicas is not None else current
    st.update(_decision_status(decision, after, desired))
    return ScaleActions(st, cond if cond is not None else active, tuple(events), replicas, label)


# --- the status write -----------------------------------------------------------------------------------
def status_patch(scaling: Mapping[str, Any], ready: int) -> dict[str, Any]:
    """The GearSet status patch of a tick (conditions apart): ``scaling`` with ``readyReplicas``, and
    ``replicas`` (the scale subresource's status) = ``ready`` pipeline replicas."""
    return {"scaling": dict(scaling) | {"readyReplicas": ready}, "replicas": ready}


def announce_condition(raw: Sequence[Mapping[str, Any]] | None, status: ConditionStatus) -> bool:
    """Whether a change of ``ScalingActive`` to ``status`` is worth events: always when False (a problem),
    else only when the status flips (``raw``: the stored conditions), not for each new message."""
    if status == "False":
        return True
    old = next((c for c in raw or [] if c.get("type") == COND_SCALING_ACTIVE), None)
    return old is None or old.get("status") != status
