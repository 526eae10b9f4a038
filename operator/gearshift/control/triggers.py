"""The three shift triggers of seed 002 and their thresholds, raised one step per re-trigger in a dwell.

  - ``imbalance``: some stage's utilisation > ``imbalanceHighUtilization`` (0.9) while every other stage's is
    < ``imbalanceLowUtilization`` (0.6) → the throughput gear;
  - ``p99-high``: P99 > ``p99HighRatio`` (1.2) × target → the latency gear;
  - ``p99-low``: P99 < ``p99LowRatio`` (0.7) × target → the balanced gear.
The order above is the priority when several hold at once (seed 002's decision pseudo-code checks
them in that order). A threshold *level* n makes a trigger harder to meet: the high thresholds move up
and the low ones down by n steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from gearshift.control.policy import Intent, ShiftPolicy
from gearshift.control.smoothing import Sample


class Trigger(StrEnum):
    """Why a shift is wanted; the values are ``ShiftRecord.trigger``'s (:mod:`gearshift.api.gearset`)."""

    IMBALANCE = "imbalance"
    LATENCY_HIGH = "p99-high"
    LATENCY_LOW = "p99-low"


#: Priority order (seed 002).
TRIGGERS: tuple[Trigger, ...] = (Trigger.IMBALANCE, Trigger.LATENCY_HIGH, Trigger.LATENCY_LOW)

#: CamelCase event reasons of the triggers.
TRIGGER_REASON: dict[Trigger, str] = {
    Trigger.IMBALANCE: "Imbalance",
    Trigger.LATENCY_HIGH: "P99High",
    Trigger.LATENCY_LOW: "P99Low",
}

#: The intent of the gear each trigger asks for.
TRIGGER_INTENT: dict[Trigger, Intent] = {
    Trigger.IMBALANCE: Intent.THROUGHPUT,
    Trigger.LATENCY_HIGH: Intent.LATENCY,
    Trigger.LATENCY_LOW: Intent.BALANCED,
}


@dataclass(frozen=True)
class Thresholds:
    """Effective thresholds at given levels: utilisation fractions and P99 ratios to the target."""

    imbalance_high: float
    imbalance_low: float
    p99_high_ratio: float
    p99_low_ratio: float


def thresholds(policy: ShiftPolicy, levels: Mapping[Trigger, int]) -> Thresholds:
    """The thresholds after raising each trigger ``levels[trigger]`` steps of ``retriggerStep`` (0 = the
    policy's own). The utilisation thresholds stay in [0, 1]: at 1.0 the imbalance trigger cannot fire.
    """
    step = policy.retrigger_step
    imb = levels.get(Trigger.IMBALANCE, 0) * step
    return Thresholds(
        imbalance_high=min(1.0, policy.imbalance_high_utilization + imb),
        imbalance_low=max(0.0, policy.imbalance_low_utilization - imb),
        p99_high_ratio=policy.p99_high_ratio + levels.get(Trigger.LATENCY_HIGH, 0) * step,
        p99_low_ratio=policy.p99_low_ratio - levels.get(Trigger.LATENCY_LOW, 0) * step,
    )


def imbalanced(utilization: tuple[float, ...], high: float, low: float) -> bool:
    """True when one stage is above ``high`` and all the others are below ``low``; needs >= 2 stages."""
    if len(utilization) < 2:
        return False
    hot = max(range(len(utilization)), key=utilization.__getitem__)
    others = utilization[:hot] + utilization[hot + 1 :]
    return utilization[hot] > high and all(u < low for u in others)


def conditions(smoothed: Sample, policy: ShiftPolicy, levels: Mapping[Trigger, int]) -> dict[Trigger, bool]:
    """Which triggers' conditions the (smoothed) sample meets, at the given threshold levels.

    A missing P99 (no traffic in the window) meets neither latency condition.
    """
    th = thresholds(policy, levels)
    p99 = smoothed.p99_ms(policy.latency_metric)
    target = policy.target_p99_ms
    return {
        Trigger.IMBALANCE: imbalanced(smoothed.stage_utilization, th.imbalance_high, th.imbalance_low),
        Trigger.LATENCY_HIGH: p99 is not None and p99 > th.p99_high_ratio * target,
        Trigger.LATENCY_LOW: p99 is not None and p99 < th.p99_low_ratio * target,
    }
