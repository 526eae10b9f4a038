"""What the gear-shifting tick writes to ``GearSet.status``: the decision state's codec (``status.control``),
the shown signals (``status.signals``), the history and gear-health entries of the executor's actions, and
the whole status patch of one tick.

Pure: plain data in, JSON-ready dicts out (camelCase keys as the CRD stores them); times are epoch seconds
in, RFC 3339 strings out. The handler (:mod:`gearshift.handlers.shifting`) writes what these return.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from gearshift.api.common import MAX_HISTORY, inputs_hash
from gearshift.api.gearset import Gear
from gearshift.api.gearset_status import SKIPPED_MAX_CHARS, ControlState, GearHealth, GearSignals
from gearshift.control.shifting.capacity import CapacityEstimate
from gearshift.control.shifting.decide import DecisionState, TriggerTrack
from gearshift.control.shifting.executor import ShiftState
from gearshift.control.shifting.executor_actions import Action, MarkUnhealthy, RecordShift
from gearshift.control.shifting.executor_status import executor_to_status
from gearshift.control.shifting.policy import ShiftRules
from gearshift.control.shifting.triggers import TRIGGERS, Trigger
from gearshift.control.signals import Reading
from gearshift.control.smoothing import Sample
from gearshift.facts.rfc3339 import from_time, to_time

#: Longest ``message`` of a history or gear-health entry, characters (a status stays well under etcd's
#: object size limit however long the executor's messages get).
MESSAGE_LIMIT = 4000

_SAMPLE_KEYS = {
    "at": "at",
    "queue": "queue",
    "running": "running",
    "qps": "qps",
    "arrival_rps": "arrivalRps",
    "ttft_p50_ms": "ttftP50Ms",
    "ttft_p99_ms": "ttftP99Ms",
    "itl_p50_ms": "itlP50Ms",
    "itl_p99_ms": "itlP99Ms",
    "e2e_p50_ms": "e2eP50Ms",
    "e2e_p99_ms": "e2eP99Ms",
    "prompt_tokens_mean": "promptTokensMean",
    "output_tokens_mean": "outputTokensMean",
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


#: ``status.control.ema`` key of Holt's trend of the arrival rate (requests/s per s): smoothed state
#: like the averages, though no field of a sample.
TREND_KEY = "arrivalTrendRpsPerS"
#: ``status.control.ema`` key of when the trend's current run of whole windows began (Unix s).
TREND_SINCE_KEY = "trendSince"


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
        arrival_trend_rps_per_s=float(c.ema.get(TREND_KEY, 0.0)),
        trend_since=c.ema.get(TREND_SINCE_KEY),
        capacity={
            e.gear: CapacityEstimate(
                e.predicted_rps,
                e.measured_low_rps,
                e.measured_high_rps,
                from_time(e.updated_time),
                e.pending_low_rps,
                from_time(e.pending_since),
                e.pending_high_rps,
                from_time(e.pending_high_since),
            )
            for e in c.capacity
        },
    )


def control_to_status(d: DecisionState, policy: ShiftRules) -> dict[str, Any]:
    """``status.control`` (camelCase JSON) of ``d``; ``dwellUntil`` is informational (last shift + dwell)."""
    tracks: Mapping[Trigger, TriggerTrack] = d.tracks
    return {
        "ema": ({} if d.smoothed is None else _sample_to_ema(d.smoothed))
        | ({TREND_KEY: d.arrival_trend_rps_per_s} if math.isfinite(d.arrival_trend_rps_per_s) else {})
        | ({TREND_SINCE_KEY: d.trend_since} if d.trend_since is not None else {}),
        "streaks": {t.value: tr.on for t, tr in tracks.items()},
        "offStreaks": {t.value: tr.off for t, tr in tracks.items()},
        "latched": [t.value for t, tr in tracks.items() if tr.latched],
        "thresholdSteps": {t.value: tr.level for t, tr in tracks.items()},
        "lastShiftTime": to_time(d.last_shift_at),
        "dwellUntil": None if d.last_shift_at is None else to_time(d.last_shift_at + policy.dwell_s),
        "lastRetriggerTime": to_time(d.last_retrigger_at),
        "capacity": [
            {
                "gear": g,
                "predictedRps": _finite(e.predicted_rps),
                "measuredLowRps": _finite(e.measured_low_rps),
                "measuredHighRps": _finite(e.measured_high_rps),
                "capacityRps": _finite(e.capacity_rps),
                "updatedTime": to_time(e.updated_at),
                "pendingLowRps": _finite(e.pending_low_rps),
                "pendingSince": to_time(e.pending_since),
                "pendingHighRps": _finite(e.pending_high_rps),
                "pendingHighSince": to_time(e.pending_high_since),
            }
            for g, e in d.capacity.items()
        ],
    }


#: ``status.signals`` keys of latency percentiles: they describe completed requests, so a sample window
#: without any has none of them (camelCase, as stored).
LATENCY_SIGNAL_KEYS = ("p99Ms", "p50TtftMs", "p99TtftMs", "p50ItlMs", "p99ItlMs", "p50E2eMs", "p99E2eMs")
#: ``status.signals`` keys that only some samples have (always sent, ``null`` when unknown).
OPTIONAL_SIGNAL_KEYS = (
    *LATENCY_SIGNAL_KEYS,
    "stageUtilizationSource",
    "pipelineUtilization",
    "promptTokensMean",
    "outputTokensMean",
)


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
    ``stageUtilization`` is empty rather than the average of an earlier one. ``promptTokensMean`` and
    ``outputTokensMean`` are the smoothed traffic mix (tokens, to 0.1), ``null`` until one is measured;
    an idle window keeps the last mix (it still describes the service's requests, where a latency
    would be stale). The optional keys are
    always present (``null`` when unknown) because a JSON merge patch leaves out-of-patch keys as they
    were. Non-finite numbers are written as ``null``."""
    no_traffic = raw is not None and raw.qps <= 0.0

    def shown(smoothed: float | None, measured: float | None) -> float | None:
        if raw is not None and (no_traffic or measured is None):
            return None
        return _round(smoothed)

    def tokens(smoothed: float | None) -> float | None:
        return None if (v := _finite(smoothed)) is None else round(v, 1)

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
        prompt_tokens_mean=tokens(s.prompt_tokens_mean),
        output_tokens_mean=tokens(s.output_tokens_mean),
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


# --- history and gear health ---------------------------------------------------------------------------
def same_shift(entry: Mapping[str, Any], to_gear: str | None, started_at: float | None) -> bool:
    """Whether the history ``entry`` is the shift to ``to_gear`` started at ``started_at`` (Unix s; its
    ``startedAt`` within 1 ms: the status keeps milliseconds)."""
    started = from_time(entry.get("startedAt"))
    return (
        entry.get("to") == to_gear
        and started is not None
        and started_at is not None
        and abs(started - started_at) < 1e-3
    )


def history_with(
    raw: Sequence[Mapping[str, Any]], rec: RecordShift, message_limit: int = MESSAGE_LIMIT
) -> list[dict[str, Any]]:
    """``status.history`` with ``rec``'s entry: it replaces the entry of the same shift (same ``to`` gear,
    ``startedAt`` within 1 ms) or is appended; the last :data:`~gearshift.api.common.MAX_HISTORY` kept."""
    entry = {
        "from": rec.from_gear,
        "to": rec.to_gear,
        "trigger": rec.trigger,
        "startedAt": to_time(rec.started_at),
        "finishedAt": to_time(rec.finished_at),
        "outcome": rec.outcome.value,
        "message": rec.message[:message_limit],
    }
    out = [dict(h) for h in raw]
    for i, h in enumerate(out):
        if same_shift(h, rec.to_gear, rec.started_at):
            out[i] = entry
            break
    else:
        out.append(entry)
    return out[-MAX_HISTORY:]


#: Reason of the Warning event for each history entry :func:`close_orphans` closes.
REASON_SHIFT_ABANDONED = "ShiftAbandoned"
#: Why a history entry was closed by :func:`close_orphans`.
ORPHAN_MESSAGE = (
    "closed by the operator: its progress (status.executor) was lost before it ended, as when an older "
    "GearSet CRD pruned it under the running operator; the executor no longer runs it and its shadow gear "
    "is freed"
)


def close_orphans(
    history: Sequence[Mapping[str, Any]], state: ShiftState, now: float
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(history, closed)``: ``history`` with every ``InProgress`` entry that is not the shift ``state``
    runs closed as ``Aborted`` at ``now`` (s) with :data:`ORPHAN_MESSAGE`, and the entries so closed.

    An entry stays ``InProgress`` forever otherwise: nothing else ends a shift the executor has
    forgotten, and ``kubectl get gs -o yaml`` would show it running for good."""
    out, closed = [dict(h) for h in history], []
    for i, h in enumerate(out):
        if h.get("outcome") != "InProgress":
            continue
        if not (state.busy and same_shift(h, state.to_gear, state.started_at)):
            out[i] = {**h, "outcome": "Aborted", "finishedAt": to_time(now), "message": ORPHAN_MESSAGE}
            closed.append(out[i])
    return out, closed


def gear_fingerprint(gear: Gear) -> str:
    """A stable hash of a gear's spec, for :class:`GearHealth` marks."""
    return inputs_hash(gear.model_dump(mode="json", by_alias=True))


def health_with(
    raw: Sequence[Mapping[str, Any]],
    mark: MarkUnhealthy,
    now: float,
    profiles_hash: str | None,
    gear_hash: str | None,
) -> list[dict[str, Any]]:
    """``status.gearHealth`` with ``mark``'s gear marked unhealthy since ``now`` (s), replacing its entry;
    ``profiles_hash`` and ``gear_hash`` say what the mark holds for (it lapses when either changes)."""
    entry = {
        "gear": mark.gear,
        "healthy": False,
        "reason": mark.reason,
        "message": mark.message[:MESSAGE_LIMIT],
        "since": to_time(now),
        "profilesHash": profiles_hash,
        "gearHash": gear_hash,
    }
    return [dict(h) for h in raw if h.get("gear") != mark.gear] + [entry]


def records_to_status(
    history: Sequence[Mapping[str, Any]],
    health: Sequence[Mapping[str, Any]],
    actions: Iterable[Action],
    *,
    marks: Iterable[GearHealth],
    gears: Mapping[str, Gear],
    now: float,
    profiles_hash: str | None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(status.history, status.gearHealth)`` after the step's :class:`RecordShift` and
    :class:`MarkUnhealthy` actions, from the stored lists.

    Health entries of gears without a mark in ``marks`` (the marks that still hold, see
    :func:`gearshift.control.shifting.tick.current_marks`) leave: ``kubectl get`` must not show a gear as
    unhealthy that is tried again, or serving. ``gears`` (spec gears by name) give a new mark's gear hash.
    """
    out_history = [dict(h) for h in history]
    held = {m.gear for m in marks}
    out_health = [dict(h) for h in health if h.get("gear") in held]
    for a in actions:
        if isinstance(a, RecordShift):
            out_history = history_with(out_history, a)
        elif isinstance(a, MarkUnhealthy):
            marked = gears.get(a.gear)
            gear_hash = gear_fingerprint(marked) if marked is not None else None
            out_health = health_with(out_health, a, now, profiles_hash, gear_hash)
    return out_history, out_health


# --- the patch -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Signals:
    """This tick's sample as the status shows it: the raw sample, its reading, the smoothed one."""

    smoothed: Sample | None
    """The decision's moving average after this sample (``DecisionState.smoothed``)."""
    raw: Sample | None
    """This tick's sample; ``None`` when the signals were unavailable (``status.signals`` stays)."""
    reading: Reading | None
    replicas: int
    """Pipeline replicas (``GearSet.spec.replicas``): ``queueLength`` is per replica."""
    at: float = 0.0
    """When the tick sampled, Unix time s: ``sampleTime`` of a tick without a sample."""
    skipped: str | None = None
    """Why there is no sample (the SignalsAvailable condition's message); ``None`` when there is one."""
    missed_samples: int = 0
    """Sample instants the loop let pass since the operator started (``missedSamples``)."""


def status_patch(
    state: ShiftState,
    decision: DecisionState,
    policy: ShiftRules,
    *,
    in_flight_old: int | None,
    history: list[dict[str, Any]],
    health: list[dict[str, Any]],
    conditions: list[dict[str, Any]],
    generation: int | None,
    signals: Signals,
) -> dict[str, Any]:
    """The merge patch of ``GearSet.status`` after one tick (camelCase JSON; not yet :func:`json_safe`).

    ``state`` and ``decision`` are the executor's and the decision's new states; ``in_flight_old`` the
    drained gear's in-flight requests (``None``: unknown or no drain); ``targetGear`` is set only while a
    shift runs. ``signals`` is written only when there was a sample and a smoothed one.
    """
    patch: dict[str, Any] = {
        "phase": state.phase.value,
        "activeGear": state.active,
        "targetGear": state.to_gear if state.busy else None,
        "executor": executor_to_status(state, in_flight_old),
        "control": control_to_status(decision, policy),
        "history": history,
        "gearHealth": health,
        "conditions": conditions,
        "observedGeneration": generation,
    }
    if signals.smoothed is not None and signals.raw is not None:
        shown = signals_to_status(signals.smoothed, policy, signals.replicas, signals.raw, signals.reading)
        patch["signals"] = shown | {"skipped": None, "missedSamples": signals.missed_samples}
    else:
        patch["signals"] = skipped_signals(signals.at, signals.skipped, signals.missed_samples)
    return patch


def skipped_signals(at: float, why: str | None, missed_samples: int) -> dict[str, Any]:
    """``status.signals`` of a tick without a sample (the status advances every sample interval and
    says so, rather than keeping the last sample's values as if current): ``sampleTime`` ``at`` (Unix s),
    ``skipped`` ``why`` (cut to ``SKIPPED_MAX_CHARS``), every value ``null`` (``stageUtilization``
    empty): a JSON merge patch keeps keys it leaves out, so each is sent."""
    values: dict[str, Any] = {(f.alias or name): None for name, f in GearSignals.model_fields.items()}
    values["stageUtilization"] = []
    return values | {
        "sampleTime": to_time(at),
        "skipped": (why or "no sample this tick")[:SKIPPED_MAX_CHARS],
        "missedSamples": missed_samples,
    }


#: How long a tick that would change nothing but ``status.signals.sampleTime`` may leave the status
#: unwritten, s: the kubelet's ``nodeStatusReportFrequency`` default (5 min), the period after which a
#: node with nothing to report writes its status anyway (KEP-589 "Efficient Node Heartbeats").
STATUS_HEARTBEAT_S = 300.0


def _merge_changes(
    current: Any, patch: Any, ignore: frozenset[tuple[str, ...]], path: tuple[str, ...]
) -> bool:
    if path in ignore:
        return False
    if isinstance(patch, Mapping):
        if not isinstance(current, Mapping):
            return True  # the merge makes an object here
        return any(
            (
                k in current and (*path, k) not in ignore
            )  # a JSON merge patch's null removes the key (RFC 7386)
            if v is None
            else _merge_changes(current.get(k), v, ignore, (*path, k))
            for k, v in patch.items()
        )
    return bool(current != patch)


def heartbeat_only(current: Mapping[str, Any], patch: Mapping[str, Any], now: float) -> bool:
    """Whether a tick's status merge patch can be left unwritten: applied to ``current`` (``GearSet.status``
    as read, JSON) it would change nothing but ``signals.sampleTime``, and the stored ``sampleTime`` is
    younger than :data:`STATUS_HEARTBEAT_S` (``now``: Unix s). ``patch`` is :func:`json_safe`'d JSON.

    So an idle GearSet writes when something changes, and at least every 5 minutes, not every tick: writes
    follow changes, as Kubernetes made node status (KEP-589). A stored ``sampleTime`` that does not parse
    counts as old.
    """
    if _merge_changes(current, patch, frozenset({("signals", "sampleTime")}), ()):
        return False
    try:
        stored = from_time((current.get("signals") or {}).get("sampleTime"))
    except (TypeError, ValueError):
        return False
    return stored is not None and 0 <= now - stored < STATUS_HEARTBEAT_S
