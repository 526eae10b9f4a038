"""The gear-shift decision: a pure function of the persisted decision state and one new sample.

Per sample (every ``sampleIntervalSeconds``, docs/sources.md#shift-signals):

1. no sample (Prometheus down, series missing) → ``NoSignals``; the consecutive counts restart, so a
   shift needs ``enterSamples`` fresh samples after the signals return. A sample some of whose series
   have no value while requests flow (``unavailable``,
   :func:`gearshift.control.signals.unavailable_series`) holds the triggers that read them
   (:func:`held_triggers`): their streaks neither grow nor reset and they do not fire, since the moving
   average would otherwise go on from the last value as if it were fresh; the other triggers run;
2. EMA of the sample (:func:`~gearshift.control.smoothing.smooth`);
3. hysteresis per trigger: its condition must hold ``enterSamples`` samples in a row to *latch*, and
   fail ``exitSamples`` in a row to unlatch;
4. ``spec.paused`` holds everything, a shift in progress holds the decision, ``spec.forceGear`` shifts
   to that gear at once (no dwell, no cost check) and otherwise holds on it;
5. the latched triggers in priority order (imbalance, saturation, p99-high, p99-low) whose gear intent
   differs from the active gear's; saturation wants the healthy gear with the most predicted throughput
   above the active gear's, whatever its intent, and while saturation's condition holds p99-high passes
   over latency gears with less predicted throughput than the active one (gearshift extension, see
   :mod:`gearshift.control.shifting.triggers`); a trigger whose gears are all unhealthy is skipped (the next
   one is tried);
6. inside the dwell (``dwellSeconds`` since the last shift *ended*: each sample taken while a shift is in
   progress restarts the streaks and the dwell) a latched trigger does not shift: its
   threshold goes up one step (at most ``maxRetriggerSteps``) and it unlatches. Levels return to 0
   after a whole dwell with no re-trigger;
7. the cost–benefit check (:mod:`gearshift.control.shifting.cost`) may veto; otherwise ``Shift``.

The function never reads the clock: ``now`` (s) is passed in.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from gearshift.control.shifting import capacity
from gearshift.control.shifting.capacity import CapacityEstimate
from gearshift.control.shifting.cost import CostBenefit, cost_benefit
from gearshift.control.shifting.policy import GearTable, GearView, Intent, ShiftRules
from gearshift.control.shifting.triggers import (
    LOAD_TRIGGERS,
    TRIGGER_INTENT,
    TRIGGER_REASON,
    TRIGGERS,
    Thresholds,
    Trigger,
    conditions,
    saturated,
    thresholds,
)
from gearshift.control.signals import sample_window_s
from gearshift.control.smoothing import LatencyMetric, Sample, p99_field, smooth

#: The trigger of a shift asked for through ``spec.forceGear``.
MANUAL = "forced"


class DecisionKind(StrEnum):
    """What :func:`decide` concluded; the value is the event reason."""

    HOLD = "Hold"
    """Nothing to do (see ``Decision.reason`` for why)."""
    SHIFT = "Shift"
    """Start a shift to ``Decision.target``."""
    THRESHOLD_RAISED = "ThresholdRaised"
    """A trigger fired inside the dwell; its threshold went up one step instead of a shift."""
    VETOED = "ShiftVetoed"
    """The cost–benefit check refused the shift."""
    NO_SIGNALS = "SignalsMissing"
    """No sample this time; nothing decided."""


# --- reasons of HOLD decisions (CamelCase, for events and conditions) --------------------------------
REASON_STEADY = "Steady"
REASON_FORCE = "ForceGear"
REASON_PAUSED = "Paused"
REASON_SHIFT_IN_PROGRESS = "ShiftInProgress"
REASON_FORCED = "ForcedGear"
REASON_FORCE_UNKNOWN = "ForceGearUnknown"
REASON_FORCE_UNHEALTHY = "ForceGearUnhealthy"
REASON_NO_HEALTHY_GEAR = "NoHealthyGear"
REASON_DWELL = "DwellNotOver"
REASON_UNFIXABLE = "LatencyUnfixable"
"""``p99-high`` latched but no gear prefills the long prompts of this mix sooner than the active one."""

#: Holt's trend (docs/sources.md#rate-trend) of
#: the smoothed arrival rate averages its slope over about this long, s: a few samples' noise in the
#: rate must not read as a rise, and a real rise shows within a minute.
TREND_WINDOW_S = 180.0
#: Least rise over a shift's lead time, as a share of the rate, that counts as a trend rather than noise.
TREND_MIN_RISE = 0.1
#: Share of requests whose prompts no gear can prefill within the target above which a ``p99-high``
#: that no gear would fix is reported rather than shifted on: a P99 reads the slowest 1 %.
UNFIXABLE_SHARE = 0.01


@dataclass(frozen=True)
class Decision:
    """The outcome of one :func:`decide` call."""

    kind: DecisionKind
    reason: str
    """CamelCase: the trigger's (``TRIGGER_REASON``) for SHIFT/THRESHOLD_RAISED/VETOED, ``ForceGear`` for a
    forced shift, a ``REASON_*`` for HOLD."""
    message: str = ""
    target: str | None = None
    trigger: str | None = None
    """A :class:`Trigger` value, or ``"Manual"``."""
    cost: CostBenefit | None = None
    skipped: tuple[str, ...] = ()
    """Gears a latched trigger wanted but that are unhealthy."""
    p99_ms: float | None = None
    """The active gear's smoothed P99 (the policy's latency metric) at this decision, ms: the baseline a
    shift's new gear is judged against in the rollback window."""
    qps: float | None = None
    """The active gear's smoothed served rate (completed requests/s, ``Sample.qps``) at this decision: a
    ``saturation`` shift's new gear serving at least this much is not rolled back on P99."""
    why: str = ""
    """A SHIFT's account of what it was decided on (rate, token mix, P99, each gear's capacity), for the
    ShiftStarted event (:func:`_why`)."""


@dataclass(frozen=True)
class TriggerTrack:
    """Hysteresis and threshold level of one trigger."""

    on: int = 0
    """Consecutive samples meeting the condition."""
    off: int = 0
    """Consecutive samples not meeting it."""
    latched: bool = False
    level: int = 0


@dataclass(frozen=True)
class DecisionState:
    """What :func:`decide` keeps between samples; plain data, persisted in ``GearSet.status``."""

    smoothed: Sample | None = None
    tracks: dict[Trigger, TriggerTrack] = field(default_factory=lambda: {t: TriggerTrack() for t in TRIGGERS})
    last_shift_at: float | None = None
    last_retrigger_at: float | None = None
    capacity: dict[str, CapacityEstimate] = field(default_factory=dict)
    """Each gear's SLO capacity, predicted and measured (:mod:`gearshift.control.shifting.capacity`), in
    requests/s of the workload it was planned for (:func:`.capacity.mix_factor`)."""
    arrival_trend_rps_per_s: float = 0.0
    """Holt's trend of the smoothed arrival rate, requests/s per s (:data:`TREND_WINDOW_S`)."""
    latency_unfixable: str | None = None
    """Why the TTFT target is out of every gear's reach for this sample's mix (:func:`_unfixable`), while
    ``p99-high`` is latched; ``None`` otherwise. Derived every sample, not persisted."""
    trend_since: float | None = None
    """Since when the rate has been read over whole windows with no shift running, s: the trend counts
    only a window after it (the rate of a role's first minute fills its window from 0, and a shift's
    samples mix two gears)."""

    def levels(self) -> dict[Trigger, int]:
        return {t: self.tracks[t].level for t in TRIGGERS}

    def thresholds(self, policy: ShiftRules) -> Thresholds:
        """The effective thresholds now (for status)."""
        return thresholds(policy, self.levels())

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form; :meth:`from_dict` restores it exactly."""
        return {
            "smoothed": None if self.smoothed is None else self.smoothed.to_dict(),
            "tracks": {t.value: vars(tr).copy() for t, tr in self.tracks.items()},
            "lastShiftAt": self.last_shift_at,
            "lastRetriggerAt": self.last_retrigger_at,
            "capacity": {g: e.to_dict() for g, e in self.capacity.items()},
            "arrivalTrendRpsPerS": self.arrival_trend_rps_per_s,
            "trendSince": self.trend_since,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> DecisionState:
        """Inverse of :meth:`to_dict`; ``None`` or ``{}`` gives the initial state."""
        if not data:
            return cls()
        tracks = {t: TriggerTrack(**data.get("tracks", {}).get(t.value, {})) for t in TRIGGERS}
        smoothed = data.get("smoothed")
        return cls(
            smoothed=None if smoothed is None else Sample.from_dict(smoothed),
            tracks=tracks,
            last_shift_at=data.get("lastShiftAt"),
            last_retrigger_at=data.get("lastRetriggerAt"),
            capacity={g: CapacityEstimate.from_dict(e) for g, e in (data.get("capacity") or {}).items()},
            arrival_trend_rps_per_s=float(data.get("arrivalTrendRpsPerS") or 0.0),
            trend_since=data.get("trendSince"),
        )


@dataclass(frozen=True)
class Overrides:
    """The user's manual controls from the GearSet spec."""

    force_gear: str | None = None
    paused: bool = False


#: The triggers that read the policy's latency P99, and those that read the arrival rate.
P99_TRIGGERS = (Trigger.SATURATION, Trigger.LATENCY_HIGH, Trigger.LATENCY_LOW)
ARRIVAL_TRIGGERS = LOAD_TRIGGERS
#: The traffic-mix fields of a :class:`Sample`: the load triggers read each gear's capacity for the mix.
MIX_FIELDS = ("prompt_tokens_mean", "output_tokens_mean")


def held_triggers(unavailable: Collection[str], metric: LatencyMetric) -> frozenset[Trigger]:
    """The triggers that read one of the ``unavailable`` :class:`Sample` fields: the P99 triggers when the
    P99 of the policy's latency ``metric`` has no value, the load triggers when the arrival rate has
    none or the traffic mix (:data:`MIX_FIELDS`) has none."""
    held: set[Trigger] = set()
    if p99_field(metric) in unavailable:
        held |= set(P99_TRIGGERS)
    if "arrival_rps" in unavailable or any(f in unavailable for f in MIX_FIELDS):
        held |= set(ARRIVAL_TRIGGERS)
    return frozenset(held)


def _hysteresis(track: TriggerTrack, met: bool, policy: ShiftRules) -> TriggerTrack:
    if met:
        on = track.on + 1
        return replace(track, on=on, off=0, latched=track.latched or on >= policy.enter_samples)
    off = track.off + 1
    return replace(track, on=0, off=off, latched=track.latched and off < policy.exit_samples)


def _unlatched(track: TriggerTrack, level: int | None = None) -> TriggerTrack:
    return TriggerTrack(level=track.level if level is None else level)


def best_gear(gears: tuple[GearView, ...], intent: Intent, exclude: str) -> tuple[GearView | None, list[str]]:
    """The healthy gear of ``intent`` to shift to, and the unhealthy ones passed over.

    Among several: the latency gear with the lowest predicted P99, otherwise the highest predicted
    throughput (unknown predictions rank last; ties keep spec order).
    """
    candidates = [g for g in gears if g.intent == intent and g.name != exclude]
    skipped = [g.name for g in candidates if not g.healthy]
    healthy = [g for g in candidates if g.healthy]
    if not healthy:
        return None, skipped
    if intent is Intent.LATENCY:
        key = lambda g: g.predicted_p99_ms if g.predicted_p99_ms is not None else float("inf")  # noqa: E731
    else:
        key = lambda g: -(g.predicted_throughput_rps or 0.0)  # noqa: E731
    return min(healthy, key=key), skipped


def capacity_gear(gears: tuple[GearView, ...], active: GearView) -> tuple[GearView | None, list[str]]:
    """The healthy gear with the highest predicted throughput above ``active``'s, and the unhealthy gears
    with more predicted throughput passed over. Gears without a prediction, or an active gear without
    one, give no candidate (capacity cannot be compared); ties keep spec order."""
    base = active.predicted_throughput_rps
    if base is None:
        return None, []
    bigger = [
        g
        for g in gears
        if g.name != active.name
        and g.predicted_throughput_rps is not None
        and g.predicted_throughput_rps > base
    ]
    skipped = [g.name for g in bigger if not g.healthy]
    healthy = [g for g in bigger if g.healthy]
    if not healthy:
        return None, skipped
    return max(healthy, key=lambda g: g.predicted_throughput_rps or 0.0), skipped


def _target(
    trigger: Trigger, table: GearTable, active: GearView, overloaded: bool
) -> tuple[GearView | None, list[str]]:
    """The gear ``trigger`` asks for (``None``: none fits) and the unhealthy ones passed over."""
    intent = TRIGGER_INTENT[trigger]
    if intent is None:
        return capacity_gear(table.gears, active)
    if intent == active.intent:
        return None, []
    gears = table.gears
    if trigger is Trigger.LATENCY_HIGH and overloaded and active.predicted_throughput_rps is not None:
        # Under overload a latency gear with less capacity would deepen the queue: pass over it.
        floor = active.predicted_throughput_rps
        gears = tuple(
            g for g in gears if g.predicted_throughput_rps is not None and g.predicted_throughput_rps >= floor
        )
    return best_gear(gears, intent, exclude=active.name)


def decide(
    state: DecisionState,
    sample: Sample | None,
    policy: ShiftRules,
    table: GearTable,
    now: float,
    *,
    overrides: Overrides = Overrides(),
    busy: bool = False,
    unavailable: Collection[str] = (),
    signals_configured: bool = True,
) -> tuple[DecisionState, Decision]:
    """Fold one sample into the decision state and say whether to shift, and where.

    Args:
        state: the previous state (``DecisionState()`` at first).
        sample: the raw signals of the active gear, or ``None`` when Prometheus gave none.
        policy: the shifting policy.
        table: the gears, their health and predictions, the active gear and the served model.
        now: the current time, s (same origin as ``Sample.at``).
        overrides: ``spec.forceGear`` and ``spec.paused``.
        busy: a shift is in progress (the executor is not ``Stable``); signals are still smoothed, the
            trigger streaks restart and the dwell restarts at ``now``.
        unavailable: :class:`Sample` fields of ``sample`` that should have had a value and have none
            (:func:`gearshift.control.signals.unavailable_series`); the triggers that read them hold
            (:func:`held_triggers`).
        signals_configured: a signal source is configured (a Prometheus URL). Without one, a forced gear
            shifts with no sample (the user runs without signals; ``forceGear`` is their one way to
            shift); with one that gave no sample (a fault), every shift holds, forced ones too: the
            rollback window could not see a regression.

    Returns:
        ``(new_state, decision)``. On ``SHIFT`` the new state starts the dwell at ``now``.

    Raises:
        KeyError: ``table.active`` names no gear of the table.
    """
    active = table.active_gear
    if sample is None:
        tracks = {t: _unlatched(tr) for t, tr in state.tracks.items()}
        if overrides.force_gear and not signals_configured and not overrides.paused and not busy:
            # No Prometheus at all: spec.forceGear, the user's own instruction, is how this cluster shifts
            # (as kubectl scale needs no metrics where an HPA does).
            return _forced(replace(state, tracks=tracks), table, overrides.force_gear, now, policy)
        return replace(state, tracks=tracks), Decision(
            DecisionKind.NO_SIGNALS, DecisionKind.NO_SIGNALS.value, "no signals from Prometheus; holding"
        )

    smoothed = smooth(state.smoothed, sample, policy.ema_alpha)
    tracks = dict(state.tracks)
    last_retrigger = state.last_retrigger_at
    if last_retrigger is not None and now - last_retrigger >= policy.dwell_s:
        # A whole dwell without re-triggering: the thresholds are back to the policy's.
        tracks = {t: replace(tr, level=0) for t, tr in tracks.items()}
        last_retrigger = None
    met = conditions(smoothed, policy, {t: tr.level for t, tr in tracks.items()}, active.pipelines)
    overloaded = saturated(smoothed, policy, active.pipelines)
    measured = smoothed.p99_ms(policy.latency_metric)
    before = tracks
    held = held_triggers(unavailable, policy.latency_metric)
    tracks = {t: before[t] if t in held else _hysteresis(before[t], met[t], policy) for t in TRIGGERS}
    # A P99 set by prompts no gear prefills in time says nothing of whether the gear keeps up: the
    # capacity then reads the backlog alone, and no prefill headroom (no utilisation meets that target).
    mix_bound = _unfixable(table, smoothed, policy) is not None
    planned = capacity.estimates_for(
        table.gears, state.capacity, policy, None if mix_bound else smoothed.prompt_tokens_mean
    )
    factors = {
        g.name: capacity.mix_factor(g, smoothed.prompt_tokens_mean, smoothed.output_tokens_mean)
        for g in table.gears
    }
    load = smoothed.arrival_rps
    # The trend restarts with the rate: at its first value and after every shift.
    since = None if load is None or busy else (state.trend_since if state.trend_since is not None else now)
    trend = (
        _trend(state, smoothed, now)
        if since is not None and now - since >= sample_window_s(None, now)
        else 0.0
    )
    capacity_mode = (
        policy.choice == "capacity" and load is not None and planned[active.name].capacity_rps is not None
    )
    alarm = None if mix_bound else measured
    if capacity_mode and load is not None and not busy and not held:
        # Only a settled active gear measures its own capacity: while a shift runs, the samples mix
        # the old gear's, the new one's and the transition's; and only from fresh numbers (a held
        # series' average is its last value). What it measures is kept in requests/s of its planned
        # workload, so it still counts when the mix changes.
        f = factors[active.name]
        planned[active.name] = capacity.observe(
            planned[active.name],
            arrival_rps=load * f,
            completed_rps=smoothed.qps * f,
            keeping_up=(mix_bound or measured is not None)
            and (alarm is None or alarm <= policy.p99_high_ratio * policy.target_p99_ms)
            and not overloaded,
            overloaded=tracks[Trigger.SATURATION].latched,
            saturated=overloaded,
            now=now,
        )
    # Every comparison below is in requests/s of the observed mix.
    estimates = {g: capacity.at_mix(e, factors.get(g, 1.0)) for g, e in planned.items()}
    if capacity_mode and load is not None:
        ahead = _ahead(load, trend, _lead_s(table, policy))
        load_met = _load_conditions(load, ahead, active, table, estimates, policy, alarm, overloaded)
        tracks |= {t: _hysteresis(before[t], load_met[t], policy) for t in LOAD_TRIGGERS if t not in held}
    last_shift = state.last_shift_at
    if capacity_mode and last_shift is None:
        # The first gear counts as shifted to at the first sample with an arrival rate, so the dwell
        # guards it too: the first samples' rates span a few seconds and can be far off (the x8 bench
        # read 25 req/s of 47 at 8 s and moved to a gear with half the capacity).
        last_shift = now
    new = replace(
        state,
        smoothed=smoothed,
        tracks=tracks,
        last_retrigger_at=last_retrigger,
        capacity=planned,
        last_shift_at=last_shift,
        arrival_trend_rps_per_s=trend,
        trend_since=since,
        latency_unfixable=_unfixable(table, smoothed, policy)
        if tracks[Trigger.LATENCY_HIGH].latched
        else None,
    )

    def hold(reason: str, message: str, skipped: tuple[str, ...] = ()) -> tuple[DecisionState, Decision]:
        return new, Decision(DecisionKind.HOLD, reason, message, skipped=skipped)

    if overrides.paused:
        return hold(REASON_PAUSED, "spec.paused is true; no shifts")
    if busy:
        # The dwell counts from the end of a shift, not its start: a shift takes warm-up + drain +
        # the rollback window, and a trigger latched on the old gear's (or the transition's) samples
        # would otherwise move off the new gear the moment it settles. So every streak restarts and
        # the dwell is re-armed on each busy sample; levels stay.
        busy_state = replace(new, tracks={t: _unlatched(tr) for t, tr in tracks.items()}, last_shift_at=now)
        return busy_state, Decision(DecisionKind.HOLD, REASON_SHIFT_IN_PROGRESS, "a shift is in progress")
    if overrides.force_gear:
        return _forced(new, table, overrides.force_gear, now, policy)

    skipped: list[str] = []
    for trigger in TRIGGERS:
        if not tracks[trigger].latched or trigger in held:
            continue
        if trigger is Trigger.LATENCY_HIGH:
            unfixable = _unfixable(table, smoothed, policy)
            if unfixable is not None:
                # No gear lowers a P99 set by prompts too long for any of them: shifting would only
                # spend a shift (and mark a good gear unhealthy when the P99 stays up). It stays latched,
                # so the hold (and its one event) lasts while the miss does; the other triggers still run.
                continue
        if capacity_mode and load is not None:
            target, passed = _capacity_target(trigger, table, active, estimates, load, policy)
        elif trigger in LOAD_TRIGGERS:
            continue
        else:
            target, passed = _target(trigger, table, active, overloaded)
        skipped += passed
        if target is None:
            continue
        upshift = capacity_mode and _more_capacity(target, active, estimates)
        dwell = policy.upshift_dwell_s if upshift else policy.dwell_s
        why = _why(smoothed, policy, active, target, estimates if capacity_mode else None)
        if new.last_shift_at is not None and now - new.last_shift_at < dwell:
            left = dwell - (now - new.last_shift_at)
            if trigger in LOAD_TRIGGERS:
                # The capacity triggers wait out the dwell latched: the load, not a noisy signal, is
                # what they read, so a higher threshold would only delay the move the load needs.
                return new, Decision(
                    DecisionKind.HOLD,
                    REASON_DWELL,
                    f"{trigger.value} wants gear {target.name!r} in {left:.0f} s, when the dwell ends "
                    f"({why})",
                    target=target.name,
                    trigger=trigger.value,
                )
            level = min(tracks[trigger].level + 1, policy.max_retrigger_steps)
            tracks[trigger] = _unlatched(tracks[trigger], level)
            return replace(new, tracks=tracks, last_retrigger_at=now), Decision(
                DecisionKind.THRESHOLD_RAISED,
                TRIGGER_REASON[trigger],
                f"{trigger.value} wants gear {target.name!r} {left:.0f} s before the dwell ends; "
                f"threshold raised to level {level}",
                target=target.name,
                trigger=trigger.value,
            )
        cb = cost_benefit(trigger, active, target, smoothed, policy, table.arch)
        if cb.veto:
            tracks[trigger] = _unlatched(tracks[trigger])
            return replace(new, tracks=tracks), Decision(
                DecisionKind.VETOED,
                TRIGGER_REASON[trigger],
                f"{trigger.value}: shift to {target.name!r} vetoed: it {cb.describe()}",
                target=target.name,
                trigger=trigger.value,
                cost=cb,
            )
        return _shifted(new, now), Decision(
            DecisionKind.SHIFT,
            TRIGGER_REASON[trigger],
            f"{trigger.value}: shift {active.name!r} → {target.name!r} ({why}); it {cb.describe()}",
            target=target.name,
            trigger=trigger.value,
            cost=cb,
            p99_ms=measured,
            qps=smoothed.qps,
            why=why,
        )
    if new.latency_unfixable is not None and Trigger.LATENCY_HIGH not in held:
        return hold(REASON_UNFIXABLE, new.latency_unfixable)
    if skipped:
        names = ", ".join(sorted(set(skipped)))
        return hold(
            REASON_NO_HEALTHY_GEAR, f"wanted gears are unhealthy: {names}", tuple(sorted(set(skipped)))
        )
    if held:
        names = ", ".join(t.value for t in TRIGGERS if t in held)
        return hold(REASON_STEADY, f"no trigger latched; held for series without a value: {names}")
    return hold(REASON_STEADY, "no trigger latched")


def _cap(estimates: dict[str, CapacityEstimate], gear: GearView) -> float:
    value = estimates.get(gear.name, CapacityEstimate()).capacity_rps
    return 0.0 if value is None else value


def _more_capacity(target: GearView, active: GearView, estimates: dict[str, CapacityEstimate]) -> bool:
    return _cap(estimates, target) > _cap(estimates, active)


def _load_conditions(
    load: float,
    ahead: float,
    active: GearView,
    table: GearTable,
    estimates: dict[str, CapacityEstimate],
    policy: ShiftRules,
    p99_ms: float | None,
    overloaded: bool,
) -> dict[Trigger, bool]:
    """``load-high``: the arrival rate now or ``ahead`` (requests/s: where its trend takes it by the time
    a shadow could serve, :func:`_lead_s`) is above the active gear's capacity and some healthy gear has
    more, so a shift up starts while the active gear still keeps up; ``load-low``: a healthy gear with
    fewer GPUs fits both within ``downshiftRatio``, while the P99 is under the p99-high alarm (or
    unmeasured: no traffic) and nothing waits."""
    others = [g for g in table.gears if g.name != active.name and g.healthy]
    peak = max(load, ahead)
    high = not capacity.fits(estimates[active.name], peak) and any(
        _more_capacity(g, active, estimates) for g in others
    )
    # Keeping up, as the capacity reads it: no backlog and the P99 under the p99-high alarm (a bigger gear
    # can sit a little over target at any load, e.g. the benchmark's 4-card gear with A100 heads).
    calm = (p99_ms is None or p99_ms <= policy.p99_high_ratio * policy.target_p99_ms) and not overloaded
    cheaper = [g for g in others if g.gpus < active.gpus]
    low = calm and capacity.cheapest(cheaper, estimates, peak, policy.downshift_ratio) is not None
    return {Trigger.LOAD_HIGH: high, Trigger.LOAD_LOW: low}


def _unfixable(table: GearTable, smoothed: Sample, policy: ShiftRules) -> str | None:
    """Why ``p99-high`` should not shift, or ``None``: the policy reads the TTFT, at least
    :data:`UNFIXABLE_SHARE` of the requests have prompts longer than any healthy gear prefills within
    ``targetP99Ms`` when idle (:func:`.capacity.prompt_tokens_within`), so the P99 stays over target on
    every gear; the message names that share."""
    if policy.latency_metric is not LatencyMetric.TTFT:
        return None
    longest = capacity.prompt_tokens_within(table.gears, policy.target_p99_ms)
    share = None if longest is None else capacity.share_above(smoothed.prompt_tokens_buckets, longest)
    if longest is None or share is None or share < UNFIXABLE_SHARE:
        return None
    # Rounded (5 %, 100 tokens), so that the condition and its event change with the traffic, not with
    # each window's sampling noise (they came every 2 s with a new figure).
    rounded = max(UNFIXABLE_SHARE, round(share * 20) / 20)
    return (
        f"p99-high: about {rounded:.0%} of requests have prompts longer than the {round(longest, -2):.0f} "
        f"tokens any gear prefills within {policy.target_p99_ms:.0f} ms; no gear can serve them in time, "
        "so no shift"
    )


def _ahead(load: float, trend: float, lead_s: float) -> float:
    """The arrival rate ``lead_s`` from now on the rising ``trend`` (requests/s per s), requests/s;
    ``load`` when the rise over the lead is under :data:`TREND_MIN_RISE` of it (the rate's noise: a
    Poisson minute of 20 req/s moves its average by about a request a second)."""
    rise = max(0.0, trend) * lead_s
    return load + rise if rise >= TREND_MIN_RISE * load else load


def _trend(state: DecisionState, smoothed: Sample, now: float) -> float:
    """Holt's trend of the smoothed arrival rate after this sample, requests/s per s: the slope since the
    previous smoothed rate, averaged with weight ``Δt / TREND_WINDOW_S``; 0 with no earlier rate."""
    prev = state.smoothed
    if prev is None or prev.arrival_rps is None or smoothed.arrival_rps is None or now <= prev.at:
        return state.arrival_trend_rps_per_s
    dt = now - prev.at
    beta = min(1.0, dt / TREND_WINDOW_S)
    slope = (smoothed.arrival_rps - prev.arrival_rps) / dt
    return beta * slope + (1.0 - beta) * state.arrival_trend_rps_per_s


def _lead_s(table: GearTable, policy: ShiftRules) -> float:
    """How long a shift up takes before the new gear serves, s: the largest stage pod's weights of the
    biggest other gear at ``transferGbps``, its warm-up, and the executor's next two samples."""
    pods = [g.pod_weight_bytes(table.arch) for g in table.gears if g.name != table.active]
    load_s = max(pods, default=0) / (policy.transfer_gbps * 1e9)
    return load_s + policy.warm_s + 2 * policy.sample_interval_s


def _p99_high_ratio(
    gear: GearView, active: GearView, estimates: dict[str, CapacityEstimate], policy: ShiftRules
) -> float:
    """Share of ``gear``'s capacity the load may use for ``p99-high`` to move to it: ``downshiftRatio``
    (load-low's margin) when the move is down to fewer GPUs onto a gear whose capacity is a measured
    saturation bound, else all of it. A gear seen to fall behind at 15.3 req/s, entered at 14, is left
    again by load-high after its dwell (the demo flapped so: throughput → latency → throughput in 110 s);
    a predicted capacity already sits ``capacityHeadroom`` below the busy rate (bench/gears.py x4-own-pace
    returns to latency at 98% of its predicted 25.9 req/s and stays: with the margin there too it held
    the 4-card gear 600 s longer, 2.83 instead of 2.50 GPU-hours, for no goodput)."""
    est = estimates.get(gear.name)
    if gear.gpus < active.gpus and est is not None and est.saturated:
        return policy.downshift_ratio
    return 1.0


def _capacity_target(
    trigger: Trigger,
    table: GearTable,
    active: GearView,
    estimates: dict[str, CapacityEstimate],
    load: float,
    policy: ShiftRules,
) -> tuple[GearView | None, list[str]]:
    """The gear a latched trigger asks for when capacities are known: every trigger that says
    the active gear cannot keep up (``load-high``, ``saturation``, ``imbalance``) wants the gear with the
    fewest GPUs among those with more capacity than the active one that fit ``load`` (requests/s), else
    the one with the most capacity; ``p99-high`` (docs/sources.md#shift-triggers: the latency gear) the gear
    with the lowest predicted P99, below the active gear's, among those that fit ``load``
    (:func:`_p99_high_ratio`: a move down onto a measured saturation bound keeps load-low's margin);
    ``load-low`` the gear with the fewest GPUs that fits ``load`` within ``downshiftRatio``; ``p99-low``
    nothing (``load-low`` decides the way down)."""
    if trigger is Trigger.LATENCY_LOW:
        return None, []
    others = [g for g in table.gears if g.name != active.name]
    if trigger is Trigger.LATENCY_HIGH:
        mine = active.predicted_p99_ms
        per_token = active.ttft_ms_per_prompt_token
        faster = [
            g
            for g in others
            if g.predicted_p99_ms is not None
            and (mine is None or g.predicted_p99_ms < mine)
            # A gear that prefills this mix's prompts slower cannot lower a TTFT they set.
            and (
                per_token is None
                or g.ttft_ms_per_prompt_token is None
                or g.ttft_ms_per_prompt_token <= per_token
            )
            and capacity.fits(estimates.get(g.name), load, _p99_high_ratio(g, active, estimates, policy))
        ]
        skipped = [g.name for g in faster if not g.healthy]
        healthy = [g for g in faster if g.healthy]
        return min(healthy, key=lambda g: (g.predicted_p99_ms or 0.0, g.gpus), default=None), skipped
    if trigger is Trigger.LOAD_LOW:
        cheaper = [g for g in others if g.gpus < active.gpus]
        skipped = [g.name for g in cheaper if not g.healthy]
        return capacity.cheapest(cheaper, estimates, load, policy.downshift_ratio), skipped
    bigger = [g for g in others if _more_capacity(g, active, estimates)]
    skipped = [g.name for g in bigger if not g.healthy]
    pick = capacity.cheapest(bigger, estimates, load) or capacity.largest(bigger, estimates)
    return pick, skipped


def _why(
    smoothed: Sample,
    policy: ShiftRules,
    active: GearView,
    target: GearView,
    estimates: dict[str, CapacityEstimate] | None,
) -> str:
    """What a shift is decided on, for its events: ``31.2 req/s arriving, 1,155 prompt / 211 output
    tokens a request, TTFT P99 310 ms (target 200); 'latency' 23.0 req/s on 2 GPUs, 'throughput' 30.4
    req/s on 4`` (each capacity for that mix; without ``estimates`` the cards alone)."""
    parts = []
    if smoothed.arrival_rps is not None:
        parts.append(f"{smoothed.arrival_rps:.1f} req/s arriving")
    if smoothed.prompt_tokens_mean is not None and smoothed.output_tokens_mean is not None:
        parts.append(
            f"{smoothed.prompt_tokens_mean:,.0f} prompt / {smoothed.output_tokens_mean:,.0f} output tokens a "
            "request"
        )
    p99 = smoothed.p99_ms(policy.latency_metric)
    if p99 is not None:
        parts.append(
            f"{policy.latency_metric.value.upper()} P99 {p99:.0f} ms (target {policy.target_p99_ms:.0f})"
        )
    if estimates is None:
        gears = f"{active.name!r} on {active.gpus} GPUs, {target.name!r} on {target.gpus}"
    else:
        gears = (
            f"{active.name!r} {_cap(estimates, active):.1f} req/s on {active.gpus} GPUs, {target.name!r} "
            f"{_cap(estimates, target):.1f} req/s on {target.gpus}"
        )
    return ", ".join(parts) + ("; " if parts else "") + gears


def _shifted(state: DecisionState, now: float) -> DecisionState:
    # The new gear's signals owe nothing to the old gear's: every count restarts, levels stay.
    return replace(state, tracks={t: _unlatched(tr) for t, tr in state.tracks.items()}, last_shift_at=now)


def _forced(
    state: DecisionState, table: GearTable, name: str, now: float, policy: ShiftRules
) -> tuple[DecisionState, Decision]:
    gear = table.get(name)
    if gear is None:
        known = [g.name for g in table.gears]
        return state, Decision(
            DecisionKind.HOLD,
            REASON_FORCE_UNKNOWN,
            f"spec.forceGear {name!r} names no gear of this GearSet; use one of {known}",
        )
    if name == table.active:
        return state, Decision(DecisionKind.HOLD, REASON_FORCED, f"held on gear {name!r} by spec.forceGear")
    if not gear.healthy:
        return state, Decision(
            DecisionKind.HOLD,
            REASON_FORCE_UNHEALTHY,
            f"spec.forceGear {name!r} is unhealthy ({gear.unhealthy_reason}); clear its entry in "
            "status.gearHealth or change the gear to retry",
        )
    smoothed = state.smoothed
    return _shifted(state, now), Decision(
        DecisionKind.SHIFT,
        MANUAL,
        f"spec.forceGear: shift {table.active!r} → {name!r}",
        target=name,
        trigger=MANUAL,
        p99_ms=None if smoothed is None else smoothed.p99_ms(policy.latency_metric),
        qps=None if smoothed is None else smoothed.qps,
    )
