"""The cost–benefit check of a shift (docs/sources.md#shift-cost: a shift moves tens of GB; it must pay for
itself).

Both sides are in *seconds of full service*:

  - cost = the time the shift moves bytes at ``transferGbps``: the new gear's pods load at once, each its
    own stage on its own node (``transferGbps`` is one node's load rate: "a local NVMe read"), so the
    largest stage's weights (``ModelArch.stage_weight_bytes``) set it, plus the KV cache of the requests
    running now (``running × avgContextTokens × kv_bytes_per_token``), which the new gear must rebuild
    (counted whole, as if one pod rebuilt it all). During that time the shadow competes with the serving
    gear (docs/sources.md#shift-executor), so we charge it whole. The twin times a shadow's load the same way
    (:mod:`gearshift.dev.twin.gears`: the largest stage over ``transferGbps``); charging every pod's bytes
    in series instead vetoed Llama-3-70B's escape from a saturated two-H100 gear to a three-card one (146 GB,
    73 s, against a 72 s gain) while the twin loaded that gear in 29 s: in the twin's replay of the demo's
    window at ``--keep-every 40`` the shifting loop stayed on the two H100s and met the SLO for 47 of 485
    requests (377 with this cost). The event still reports every byte moved.
  - gain = relative improvement × ``dwellSeconds``, the least time the new gear will serve:
    throughput gears (``imbalance``, ``saturation``, ``p99-low``): ``(thr_new − thr_old) / thr_old``
    from the gears' predicted throughput; the latency gear (``p99-high``): ``(p99_now − p99_new) /
    p99_now`` with the measured (smoothed) P99 and the new gear's predicted P99; ``load-low`` (a gear
    with fewer GPUs): ``(gpus_old − gpus_new) / gpus_old``, the share of the cards it frees;
    ``load-high`` as the throughput gears.
The shift is vetoed when ``gain < minBenefitCostRatio × cost``.
"""

from __future__ import annotations

from dataclasses import dataclass

from gearshift.control.shifting.policy import GearView, ShiftRules
from gearshift.control.shifting.triggers import Trigger
from gearshift.control.smoothing import Sample
from gearshift.facts.model import ModelArch

GB = 1e9


@dataclass(frozen=True)
class CostBenefit:
    """The two sides of the check; ``gain_s`` is ``None`` when the gears carry no prediction."""

    weight_bytes: int
    kv_bytes: int
    cost_s: float
    improvement: float | None
    """Relative improvement the new gear promises (0.25 = 25 % better); ``None`` if not predictable."""
    gain_s: float | None
    veto: bool

    @property
    def moved_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes

    def describe(self) -> str:
        """One line for events: GB moved, cost and gain in s."""
        gain = "unknown" if self.gain_s is None else f"{self.gain_s:.0f} s"
        return f"moves {self.moved_bytes / GB:.1f} GB (cost {self.cost_s:.0f} s) for a gain of {gain}"


def shift_cost_bytes(
    new: GearView, arch: ModelArch, running: float, avg_context_tokens: int
) -> tuple[int, int]:
    """``(weight_bytes, kv_bytes)`` a shift to ``new`` moves (see the module docstring)."""
    kv = int(max(0.0, running) * avg_context_tokens * arch.kv_bytes_per_token)
    return new.weight_bytes(arch), kv


def improvement(
    trigger: Trigger, old: GearView, new: GearView, smoothed: Sample, policy: ShiftRules
) -> float | None:
    """Relative improvement of ``new`` over ``old`` for what ``trigger`` asks; ``None`` if unknown."""
    if trigger is Trigger.LOAD_LOW:
        # A shift down gains GPU time, not speed: the share of the cards it frees.
        return (old.gpus - new.gpus) / old.gpus if old.gpus > 0 else None
    if trigger is Trigger.LATENCY_HIGH:
        now = smoothed.p99_ms(policy.latency_metric)
        if now is None or now <= 0 or new.predicted_p99_ms is None:
            return None
        return (now - new.predicted_p99_ms) / now
    if not old.predicted_throughput_rps or new.predicted_throughput_rps is None:
        return None
    return (new.predicted_throughput_rps - old.predicted_throughput_rps) / old.predicted_throughput_rps


def cost_benefit(
    trigger: Trigger, old: GearView, new: GearView, smoothed: Sample, policy: ShiftRules, arch: ModelArch
) -> CostBenefit:
    """Weigh a shift from ``old`` to ``new``; ``veto`` is set when the gain does not pay for the cost.

    With no prediction the check cannot judge and does not veto (the event says so).
    """
    weights, kv = shift_cost_bytes(new, arch, smoothed.running, policy.avg_context_tokens)
    cost_s = (new.pod_weight_bytes(arch) + kv) / (policy.transfer_gbps * GB)
    imp = improvement(trigger, old, new, smoothed, policy)
    gain_s = None if imp is None else imp * policy.dwell_s
    veto = gain_s is not None and gain_s < policy.min_benefit_cost_ratio * cost_s
    return CostBenefit(weights, kv, cost_s, imp, gain_s, veto)
