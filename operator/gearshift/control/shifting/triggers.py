"""The shift triggers (FlexPipe's three and one gearshift extension, docs/sources.md#shift-triggers) and their
thresholds, raised one
step per re-trigger in a dwell.

  - ``imbalance``: some stage's utilisation > ``imbalanceHighUtilization`` (0.9) while every other stage's is
    < ``imbalanceLowUtilization`` (0.6) → the throughput gear (docs/sources.md#shift-triggers). Utilisation is
    the engine's own per stage (the sim) or, for vLLM, derived from the head's seat occupancy and the
    planner's stage times (:mod:`gearshift.control.signals`); without either the trigger cannot fire;
  - ``saturation`` (gearshift extension): P99 > ``p99HighRatio`` × target *and* more than
    ``saturationQueue`` requests waiting per pipeline replica (smoothed) → the healthy gear with the
    highest predicted throughput, if it is higher than the active gear's. FlexPipe's triggers
    (docs/sources.md#shift-triggers) cannot leave an overloaded gear that has one stage (imbalance needs two)
    and is the latency gear (p99-high points at it): a queue that keeps growing is not a latency problem that
    a lower-latency gear fixes; it needs capacity;
  - ``p99-high``: P99 > ``p99HighRatio`` (1.2) × target → the latency gear (docs/sources.md#shift-triggers).
    While the saturation condition holds it passes over latency gears with less predicted throughput than the
    active gear (trading capacity for latency under overload would deepen the queue and ping-pong);
  - ``p99-low``: P99 < ``p99LowRatio`` (0.7) × target → the balanced gear (docs/sources.md#shift-triggers),
    but not while more than ``saturationQueue`` requests wait per pipeline replica (gearshift: a low P99 of
    the requests the engines admitted says nothing about those still queued).
  - ``load-high`` (with the arrival rate known): the smoothed arrival rate is above the active
    gear's SLO capacity (:mod:`gearshift.control.shifting.capacity`) → the gear with the fewest GPUs that fits
    it;
  - ``load-low``: a gear with fewer GPUs fits the smoothed arrival rate within
    ``downshiftRatio`` of its capacity, and the P99 is within target with no backlog → that gear.
Priority when several hold at once (:data:`TRIGGERS`): ``load-high`` first (the arrival rate leads every
latency signal: it asks for capacity before the queue grows), then FlexPipe's three
(docs/sources.md#shift-triggers) in its order with saturation before p99-high (both hold under overload and
only the capacity move helps), ``load-low`` last (saving GPUs waits for everything else). A threshold *level*
n makes a trigger harder to meet: the high thresholds move up and the low ones down by n steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from gearshift.control.shifting.policy import Intent, ShiftRules
from gearshift.control.smoothing import Sample


class Trigger(StrEnum):
    """Why a shift is wanted; the values are ``ShiftRecord.trigger``'s
    (:mod:`gearshift.api.gearset_status`)."""

    IMBALANCE = "imbalance"
    SATURATION = "saturation"
    LATENCY_HIGH = "p99-high"
    LATENCY_LOW = "p99-low"
    LOAD_HIGH = "load-high"
    LOAD_LOW = "load-low"


#: Priority order (FlexPipe's three in its order, docs/sources.md#shift-triggers; the capacity triggers around
#: them: more capacity first, fewer GPUs last).
TRIGGERS: tuple[Trigger, ...] = (
    Trigger.LOAD_HIGH,
    Trigger.IMBALANCE,
    Trigger.SATURATION,
    Trigger.LATENCY_HIGH,
    Trigger.LATENCY_LOW,
    Trigger.LOAD_LOW,
)
#: The triggers of the capacity controller (:mod:`gearshift.control.shifting.capacity`): they need the arrival
# : rate and each gear's capacity, so :func:`conditions` leaves them to
# :func:`gearshift.control.shifting.decide`.
LOAD_TRIGGERS = (Trigger.LOAD_HIGH, Trigger.LOAD_LOW)

#: CamelCase event reasons of the triggers.
TRIGGER_REASON: dict[Trigger, str] = {
    Trigger.IMBALANCE: "Imbalance",
    Trigger.SATURATION: "Saturation",
    Trigger.LATENCY_HIGH: "P99High",
    Trigger.LATENCY_LOW: "P99Low",
    Trigger.LOAD_HIGH: "LoadHigh",
    Trigger.LOAD_LOW: "LoadLow",
}

#: The intent of the gear each trigger asks for (saturation asks for capacity, whatever the intent).
TRIGGER_INTENT: dict[Trigger, Intent | None] = {
    Trigger.IMBALANCE: Intent.THROUGHPUT,
    Trigger.SATURATION: None,
    Trigger.LATENCY_HIGH: Intent.LATENCY,
    Trigger.LATENCY_LOW: Intent.BALANCED,
    Trigger.LOAD_HIGH: None,
    Trigger.LOAD_LOW: None,
}


@dataclass(frozen=True)
class Thresholds:
    """Effective thresholds at given levels: utilisation fractions and P99 ratios to the target."""

    imbalance_high: float
    imbalance_low: float
    saturation_p99_ratio: float
    p99_high_ratio: float
    p99_low_ratio: float


def thresholds(policy: ShiftRules, levels: Mapping[Trigger, int]) -> Thresholds:
    """The thresholds after raising each trigger ``levels[trigger]`` steps of ``retriggerStep`` (0 = the
    policy's own). The utilisation thresholds stay in [0, 1]: at 1.0 the imbalance trigger cannot fire.
    """
    step = policy.retrigger_step
    imb = levels.get(Trigger.IMBALANCE, 0) * step
    return Thresholds(
        imbalance_high=min(1.0, policy.imbalance_high_utilization + imb),
        imbalance_low=max(0.0, policy.imbalance_low_utilization - imb),
        saturation_p99_ratio=policy.p99_high_ratio + levels.get(Trigger.SATURATION, 0) * step,
        p99_high_ratio=policy.p99_high_ratio + levels.get(Trigger.LATENCY_HIGH, 0) * step,
        p99_low_ratio=policy.p99_low_ratio - levels.get(Trigger.LATENCY_LOW, 0) * step,
    )


def imbalanced(utilization: tuple[float, ...], high: float, low: float) -> bool:
    """True when one stage is above ``high`` and all the others are below ``low``; needs >= 2 stages.

    An empty ``utilization`` (not known this sample: a vLLM gear whose stage times are unknown, see
    :func:`gearshift.control.signals.derived_stage_utilization`) never fires.
    """
    if len(utilization) < 2:
        return False
    hot = max(range(len(utilization)), key=utilization.__getitem__)
    others = utilization[:hot] + utilization[hot + 1 :]
    return utilization[hot] > high and all(u < low for u in others)


def saturated(smoothed: Sample, policy: ShiftRules, pipelines: int) -> bool:
    """True when more than ``saturationQueue`` requests wait per pipeline replica (smoothed)."""
    return smoothed.queue / max(1, pipelines) > policy.saturation_queue


def conditions(
    smoothed: Sample, policy: ShiftRules, levels: Mapping[Trigger, int], pipelines: int = 1
) -> dict[Trigger, bool]:
    """Which triggers' conditions the (smoothed) sample meets, at the given threshold levels.

    ``pipelines``: the active gear's pipeline replicas (the saturation queue is per replica). A missing
    P99 (no traffic in the window) meets no latency condition, saturation included.
    """
    th = thresholds(policy, levels)
    p99 = smoothed.p99_ms(policy.latency_metric)
    target = policy.target_p99_ms
    return {
        Trigger.IMBALANCE: imbalanced(smoothed.stage_utilization, th.imbalance_high, th.imbalance_low),
        Trigger.SATURATION: p99 is not None
        and p99 > th.saturation_p99_ratio * target
        and saturated(smoothed, policy, pipelines),
        Trigger.LATENCY_HIGH: p99 is not None and p99 > th.p99_high_ratio * target,
        # Not while requests wait: the engines' P99 only covers admitted requests, so a backlog (on
        # these pods, or behind them) can sit beside a healthy-looking P99 (the demo's wrong-way shift).
        Trigger.LATENCY_LOW: p99 is not None
        and p99 < th.p99_low_ratio * target
        and not saturated(smoothed, policy, pipelines),
        Trigger.LOAD_HIGH: False,
        Trigger.LOAD_LOW: False,
    }
