"""Which gear the load needs: each gear's SLO capacity, predicted and then corrected online.

A gear's **SLO capacity** is the highest arrival rate (requests/s) it keeps up with: no backlog building
and the P99 under the ``p99-high`` alarm (``p99HighRatio`` × target). It is a capacity, not a latency
verdict: a P99 a little over target at a load far below saturation comes from the request mix (long
prompts), and a gear with more cards need not lower it (on the benchmark's fleet the 4-card gear has a
*higher* TTFT P99 than the 2-card one until the latter saturates); the ``p99-high`` trigger, not the
capacity, answers it (:mod:`gearshift.control.shifting.decide`).

Before a gear has served, its capacity is predicted as ``capacityHeadroom`` × the planner's predicted
throughput (``GearView.predicted_throughput_rps``, the rate at which the simulated pipeline is busy all
the time): queueing delay grows without bound as utilisation nears 1 (M/M/1 waiting time ∝ ρ/(1 − ρ),
Kleinrock, *Queueing Systems* vol. 1 §3.2), so a latency SLO is met only some way below the busy rate.
Continuous batching keeps the delay flat until close to that rate, so the default is 0.9 (measured on
``bench/gears.py``: see :attr:`gearshift.control.shifting.policy.ShiftRules.capacity_headroom`). A gear whose
planner-predicted P99 is above the target already at the planner's own load is not predicted to meet it
at any rate.

While a gear serves, what it measures corrects the prediction (docs/sources.md#planner: the simulator's times
are only a start; online measurements correct them). Each sample of the active gear, after its shift has
settled,
gives a bound:

  - the smoothed P99 under the alarm and no backlog (``saturationQueue`` per replica) at a smoothed
    arrival rate of at least λ for ``CONFIRM_S`` (one Prometheus window: the P99 of the last minute
    lags a rise in load by up to that long): the gear keeps up with λ, so the capacity is at least λ
    (``measured_low_rps``);
  - a latched ``saturation`` trigger at λ: it does not, so the capacity is below λ and below what it
    completed per second (``measured_high_rps``).

The estimate is the prediction clamped into ``[low, high]``; a new bound that contradicts the other one
(a low above the high, or the reverse) replaces it: load and request shapes drift, and the newest
evidence wins.

Pure: no clock, no I/O; times are the caller's (s).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from gearshift.control.shifting.policy import GearView, ShiftRules
from gearshift.control.smoothing import LatencyMetric

#: How long a higher arrival rate must be served within the SLO before it counts as a lower bound, s: the
#: 1-minute window of the latency queries (gearshift.control.signals), so the P99 covers that load.
CONFIRM_S = 60.0


@dataclass(frozen=True)
class CapacityEstimate:
    """One gear's SLO capacity: the prediction and the bounds it measured while active, requests/s."""

    predicted_rps: float | None = None
    """``capacityHeadroom`` × predicted throughput; 0 when the predicted P99 misses the target; ``None``
    when the planner predicted nothing."""
    measured_low_rps: float | None = None
    """Highest smoothed arrival rate served within the SLO with no backlog."""
    measured_high_rps: float | None = None
    """Lowest smoothed arrival rate (or completion rate, under saturation) at which it missed the SLO."""
    updated_at: float | None = None
    """When a bound last changed, s (the caller's clock)."""
    pending_low_rps: float | None = None
    """Least arrival rate of the current run of within-SLO samples above ``measured_low_rps``."""
    pending_since: float | None = None
    """When that run started, s; it becomes the low bound after ``CONFIRM_S``."""
    pending_high_rps: float | None = None
    """Most the gear completed per second (or, not backed up, the least arrival rate) in the current run
    of overloaded samples; it becomes the high bound after ``CONFIRM_S`` of overload."""
    pending_high_since: float | None = None
    """When that run started, s."""

    @property
    def capacity_rps(self) -> float | None:
        """The estimate: the prediction clamped into the measured bounds; ``None`` when nothing is known."""
        value = self.predicted_rps
        if self.measured_low_rps is not None:
            value = self.measured_low_rps if value is None else max(value, self.measured_low_rps)
        if self.measured_high_rps is not None:
            value = self.measured_high_rps if value is None else min(value, self.measured_high_rps)
        return value

    @property
    def measured(self) -> bool:
        """Whether any bound was measured."""
        return self.measured_low_rps is not None or self.measured_high_rps is not None

    @property
    def saturated(self) -> bool:
        """Whether the estimate is a measured saturation bound: the gear was seen to fall behind at this
        rate, so unlike a prediction (already ``capacityHeadroom`` below the busy rate) it has no margin."""
        high = self.measured_high_rps
        return high is not None and self.capacity_rps == high

    def to_dict(self) -> dict[str, Any]:
        """JSON-able (``GearSet.status``); :meth:`from_dict` restores it."""
        return {
            "predictedRps": self.predicted_rps,
            "measuredLowRps": self.measured_low_rps,
            "measuredHighRps": self.measured_high_rps,
            "updatedAt": self.updated_at,
            "pendingLowRps": self.pending_low_rps,
            "pendingSince": self.pending_since,
            "pendingHighRps": self.pending_high_rps,
            "pendingHighSince": self.pending_high_since,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CapacityEstimate:
        """Inverse of :meth:`to_dict` (unknown keys ignored)."""

        def num(key: str) -> float | None:
            v = data.get(key)
            return None if v is None or not math.isfinite(float(v)) else float(v)

        return cls(
            num("predictedRps"),
            num("measuredLowRps"),
            num("measuredHighRps"),
            num("updatedAt"),
            num("pendingLowRps"),
            num("pendingSince"),
            num("pendingHighRps"),
            num("pendingHighSince"),
        )


#: How much of the TTFT target the queueing of prefills may take: a request's TTFT is its own prefill ``S``
#: plus its wait behind other prompts, which grows with the utilisation ``ρ`` and with ``S``; the gear keeps
#: the SLO while ``ρ × S / T`` stays under this (``T`` the target). Measured in the twin by
#: ``bench/prefill_headroom.py`` (the latency gear of the benchmark's fleet, uniform arrivals for 300 s at
#: 0.3, 0.45, … 0.9 of its busy rate; ``bench/results/prefill_headroom.json``): the highest fraction with
#: 99 % of requests meeting TTFT 200 ms was 0.6, 0.45, 0.3 for prompts of 1,500, 2,048, 3,000 tokens
#: (``S / T`` 0.22, 0.30, 0.44: ``ρ × S / T`` 0.13 on that grid, and 0.97-0.998 met one step above it),
#: and 0.9 for the conversation trace's mean of 1,155 (0.17). 0.145 sits between the grid's steps; at
#: 1,155 tokens it credits 0.86 of the busy rate, a little under the 0.9 that was met.
PREFILL_WAIT_SHARE = 0.145
#: The least share of its busy rate a gear is credited, however long the prompts (a gear whose every
#: prompt misses the target still serves requests; the measured bounds then tell how many).
MIN_HEADROOM = 0.1


def headroom(gear: GearView, policy: ShiftRules, prompt_tokens: float | None = None) -> float:
    """The share of its busy rate a gear is predicted to keep up with within the SLO: ``capacityHeadroom``,
    lowered for a TTFT policy to :data:`PREFILL_WAIT_SHARE` ``/ (S / T)`` when the mean prompt of
    ``prompt_tokens`` takes ``S`` ms to prefill (the gear's ``ttft_ms_per_prompt_token``)."""
    per_token = gear.ttft_ms_per_prompt_token
    if prompt_tokens is None or per_token is None or policy.latency_metric is not LatencyMetric.TTFT:
        return policy.capacity_headroom
    share = prompt_tokens * per_token / policy.target_p99_ms
    if share <= 0:
        return policy.capacity_headroom
    return max(MIN_HEADROOM, min(policy.capacity_headroom, PREFILL_WAIT_SHARE / share))


def predicted_capacity(
    gear: GearView, policy: ShiftRules, prompt_tokens: float | None = None
) -> float | None:
    """:func:`headroom` × the gear's predicted throughput, requests/s of its planned workload; 0 when its
    predicted P99 is above ``targetP99Ms`` (ms); ``None`` without a throughput prediction."""
    if gear.predicted_throughput_rps is None:
        return None
    if gear.predicted_p99_ms is not None and gear.predicted_p99_ms > policy.target_p99_ms:
        return 0.0
    return headroom(gear, policy, prompt_tokens) * gear.predicted_throughput_rps


def estimates_for(
    gears: Iterable[GearView],
    known: Mapping[str, CapacityEstimate],
    policy: ShiftRules,
    prompt_tokens: float | None = None,
) -> dict[str, CapacityEstimate]:
    """Every gear's estimate: the measured bounds kept from ``known``, the prediction from the gear now for
    prompts of ``prompt_tokens`` on average (a re-planned gear gets its new prediction; gears no longer
    listed are dropped)."""
    out = {}
    for g in gears:
        old = known.get(g.name, CapacityEstimate())
        out[g.name] = replace(old, predicted_rps=predicted_capacity(g, policy, prompt_tokens))
    return out


def observe(
    est: CapacityEstimate,
    *,
    arrival_rps: float | None,
    completed_rps: float,
    keeping_up: bool,
    overloaded: bool,
    saturated: bool = False,
    now: float,
) -> CapacityEstimate:
    """Fold one settled sample of the *active* gear into its estimate (see the module docstring).

    Args:
        est: the gear's estimate so far.
        arrival_rps: smoothed arrival rate, requests/s (``None``: not known; nothing changes).
        completed_rps: smoothed completions, requests/s.
        keeping_up: smoothed P99 ≤ ``p99HighRatio`` × target and no backlog.
        overloaded: the capacity is exceeded: the ``saturation`` trigger is latched.
        saturated: requests are backing up (the saturation trigger's queue condition): the completion rate
            is then what the gear can serve, a tighter bound than the arrival rate.
        now: the sample's time, s.
    """
    if arrival_rps is None or not math.isfinite(arrival_rps) or arrival_rps <= 0:
        return est
    low, high = est.measured_low_rps, est.measured_high_rps
    pending, since = est.pending_low_rps, est.pending_since
    pending_high, high_since = est.pending_high_rps, est.pending_high_since
    changed = False
    if overloaded:
        pending = since = None
        bound = min(arrival_rps, completed_rps) if saturated and completed_rps > 0 else arrival_rps
        # A burst shorter than the rates' window reads as a low rate (the window still holds the calm
        # before it: the code-assistant trace's minutes swing 0 to 78 req/s): only an overload that lasts
        # a whole window bounds the capacity, by the most the gear served in it.
        pending_high = bound if pending_high is None else max(pending_high, bound)
        high_since = now if high_since is None else high_since
        if now - high_since >= CONFIRM_S and (high is None or pending_high < high):
            high, changed = pending_high, True
            if low is not None and low >= high:
                low = None
    elif keeping_up and (low is None or arrival_rps > low):
        pending_high = high_since = None
        pending = arrival_rps if pending is None else min(pending, arrival_rps)
        since = now if since is None else since
        if now - since >= CONFIRM_S:
            low, changed = pending, True
            pending = since = None
            if high is not None and high <= low:
                high = None
    else:
        pending = since = pending_high = high_since = None
    if not changed and (pending, since, pending_high, high_since) == (
        est.pending_low_rps,
        est.pending_since,
        est.pending_high_rps,
        est.pending_high_since,
    ):
        return est
    return CapacityEstimate(
        est.predicted_rps,
        low,
        high,
        now if changed else est.updated_at,
        pending,
        since,
        pending_high,
        high_since,
    )


def fits(est: CapacityEstimate | None, arrival_rps: float, ratio: float = 1.0) -> bool:
    """Whether the gear is expected to meet the SLO at ``arrival_rps`` (requests/s) using at most ``ratio``
    of its capacity; a gear without an estimate never fits."""
    cap = None if est is None else est.capacity_rps
    return cap is not None and cap > 0 and arrival_rps <= ratio * cap


def cheapest(
    gears: Iterable[GearView],
    estimates: Mapping[str, CapacityEstimate],
    arrival_rps: float,
    ratio: float = 1.0,
) -> GearView | None:
    """The healthy gear with the fewest GPUs that fits ``arrival_rps`` at ``ratio`` of its capacity; among
    equally many GPUs the one with the most capacity, then spec order. ``None`` when none fits."""
    best: tuple[int, float, int] | None = None
    pick = None
    for i, g in enumerate(gears):
        est = estimates.get(g.name)
        if not g.healthy or not fits(est, arrival_rps, ratio):
            continue
        assert est is not None and est.capacity_rps is not None
        key = (g.gpus, -est.capacity_rps, i)
        if best is None or key < best:
            best, pick = key, g
    return pick


def largest(gears: Iterable[GearView], estimates: Mapping[str, CapacityEstimate]) -> GearView | None:
    """The healthy gear with the most estimated capacity (fewest GPUs on a tie), or ``None``."""
    pick, best = None, None
    for g in gears:
        cap = estimates.get(g.name, CapacityEstimate()).capacity_rps
        if not g.healthy or cap is None:
            continue
        key = (cap, -g.gpus)
        if best is None or key > best:
            pick, best = g, key
    return pick


def initial_gear(gears: Sequence[GearView], policy: ShiftRules) -> str | None:
    """The gear a role starts in when ``spec.initialGear`` is unset: the healthy one with the fewest GPUs
    predicted to meet the SLO at ``policy.expectedArrivalRps`` (requests/s), else (a load above every
    gear) the one with the most capacity; ``None`` when no gear has a prediction (or every predicted P99
    misses the target): the caller falls back to the planner's choice."""
    est = estimates_for(gears, {}, policy)
    pick = cheapest(gears, est, policy.expected_arrival_rps) or largest(gears, est)
    return None if pick is None or not est[pick.name].capacity_rps else pick.name


# --- the traffic mix -----------------------------------------------------------------------------------
def mix_factor(gear: GearView, prompt_tokens: float | None, output_tokens: float | None) -> float:
    """How much heavier (> 1) or lighter (< 1) a request of the observed mix is for ``gear`` than one of the
    workload it was planned for: its predicted throughput over its busy rate for the mix
    (:meth:`GearView.busy_rps`); 1 when the mix or the gear's work model is not known.

    Estimates are kept in requests/s *of the planned workload*, so what a gear measured under one mix
    still speaks for it under another: an arrival rate ``λ`` of the observed mix counts as ``λ ×
    mix_factor`` there, and a capacity ``c`` there serves ``c / mix_factor`` of the observed mix.
    """
    planned = gear.predicted_throughput_rps
    busy = gear.busy_rps(prompt_tokens, output_tokens)
    if planned is None or busy is None or busy <= 0 or planned <= 0:
        return 1.0
    return planned / busy


def at_mix(est: CapacityEstimate, factor: float) -> CapacityEstimate:
    """``est`` (requests/s of the planned workload) in requests/s of a mix ``factor`` times as heavy
    (:func:`mix_factor`)."""
    if factor == 1.0 or factor <= 0 or not math.isfinite(factor):
        return est

    def scaled(v: float | None) -> float | None:
        return None if v is None else v / factor

    return replace(
        est,
        predicted_rps=scaled(est.predicted_rps),
        measured_low_rps=scaled(est.measured_low_rps),
        measured_high_rps=scaled(est.measured_high_rps),
        pending_low_rps=scaled(est.pending_low_rps),
        pending_high_rps=scaled(est.pending_high_rps),
    )


def prompt_tokens_within(gears: Iterable[GearView], target_ms: float) -> float | None:
    """The longest prompt, tokens, whose first token some healthy gear can give within ``target_ms``
    (ms) when idle: ``target_ms`` over the least ``ttft_ms_per_prompt_token``; ``None`` when no gear
    states it."""
    rates = [g.ttft_ms_per_prompt_token for g in gears if g.healthy and g.ttft_ms_per_prompt_token]
    return None if not rates else target_ms / min(r for r in rates if r is not None)


def share_above(buckets: Sequence[tuple[float, float]], tokens: float) -> float | None:
    """Share of requests whose prompt is longer than ``tokens``, from a cumulative histogram
    (``(le, cumulative rate)`` pairs, rising ``le``, ``+Inf`` last), interpolating linearly inside the
    bucket that holds ``tokens`` as Prometheus' ``histogram_quantile`` does; ``None`` with no requests."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    below, prev_le, prev_n = 0.0, 0.0, 0.0
    for le, n in buckets:
        if tokens < le:
            inside = 0.0 if math.isinf(le) else (n - prev_n) * (tokens - prev_le) / (le - prev_le)
            below = prev_n + inside
            break
        prev_le, prev_n = le, n
    else:
        below = total
    return min(1.0, max(0.0, 1.0 - below / total))
