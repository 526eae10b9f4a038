"""Adapters from the GearSet API models (:mod:`gearshift.api.gearset`) to the control code's plain types."""

from __future__ import annotations

from collections.abc import Sequence

from gearshift.api.gearset import Gear, GearSet
from gearshift.api.gearset_status import GearHealth
from gearshift.api.pdservice import PDService
from gearshift.api.shift_policy import ShiftPolicy
from gearshift.control.shifting.decide import Decision, DecisionKind
from gearshift.control.shifting.executor import ShiftRequest
from gearshift.control.shifting.policy import GearTable, GearView, Intent, ShiftRules, StageView
from gearshift.control.smoothing import LatencyMetric

#: The P99 each role's latency triggers read (DESIGN.md: prefill is judged by TTFT, decode by ITL). An
#: aggregated pipeline (``both``) by TTFT: what a deeper or shallower gear changes most (every stage adds
#: to a prompt's time), and what the planner predicts for it (``RooflineCostModel``'s ``latency_ms``).
ROLE_METRIC = {"prefill": LatencyMetric.TTFT, "decode": LatencyMetric.ITL, "both": LatencyMetric.TTFT}


def policy_from_api(policy: ShiftPolicy, *, role: str, ttft_slo_ms: float, itl_slo_ms: float) -> ShiftRules:
    """The control policy from ``GearSet.spec.policy``: every field of the API model, named once here
    (``tests/unit/test_control_adapt.py`` fails when a field of :class:`ShiftPolicy` is left out), plus
    the role's latency metric. ``targetP99Ms`` unset means the role's SLO from the PDService
    (``ttft_slo_ms`` for prefill and both, ``itl_slo_ms`` for decode, ms).

    Raises:
        ValueError: ``role`` is none of ``prefill``, ``decode``, ``both``.
        PolicyError: an SLO the triggers cannot aim at (not > 0 ms), naming ``spec.policy.targetP99Ms``
            (the schema already refused every bad ``spec.policy`` value).
    """
    if role not in ROLE_METRIC:
        raise ValueError(f"role must be one of {', '.join(ROLE_METRIC)}, got {role!r}")
    slo_ms = itl_slo_ms if role == "decode" else ttft_slo_ms
    return ShiftRules(
        target_p99_ms=slo_ms if policy.target_p99_ms is None else policy.target_p99_ms,
        latency_metric=ROLE_METRIC[role],
        sample_interval_s=policy.sample_interval_s,
        ema_alpha=policy.ema_alpha,
        enter_samples=policy.enter_samples,
        exit_samples=policy.exit_samples,
        dwell_s=policy.dwell_s,
        imbalance_high_utilization=policy.imbalance_high_utilization,
        imbalance_low_utilization=policy.imbalance_low_utilization,
        p99_high_ratio=policy.p99_high_ratio,
        p99_low_ratio=policy.p99_low_ratio,
        saturation_queue=policy.saturation_queue,
        retrigger_step=policy.retrigger_step,
        max_retrigger_steps=policy.max_retrigger_steps,
        min_benefit_cost_ratio=policy.min_benefit_cost_ratio,
        transfer_gbps=policy.transfer_gbps,
        avg_context_tokens=policy.avg_context_tokens,
        warmup_share=policy.warmup_share,
        warm_s=policy.warm_s,
        warmup_timeout_s=policy.warmup_timeout_s,
        drain_timeout_s=policy.drain_timeout_s,
        rollback_window_s=policy.rollback_window_s,
        rollback_p99_ratio=policy.rollback_p99_ratio,
        expected_arrival_rps=policy.expected_arrival_rps,
        capacity_headroom=policy.capacity_headroom,
        choice=policy.choice,
        downshift_ratio=policy.downshift_ratio,
        upshift_dwell_s=policy.upshift_dwell_s,
        allow_degraded=policy.allow_degraded,
    )


def gearset_rules(gs: GearSet, pds: PDService) -> ShiftRules:
    """The rules of ``gs``'s role: its ``spec.policy`` with the PDService's SLO as the default target.

    Raises:
        PolicyError: a combination of values the control code cannot use, naming the field.
    """
    return policy_from_api(
        gs.spec.policy, role=gs.spec.role, ttft_slo_ms=pds.spec.slo.ttft_ms, itl_slo_ms=pds.spec.slo.itl_ms
    )


def gear_view(gear: Gear, health: GearHealth | None = None) -> GearView:
    """One API gear as the decision sees it: intent, stage ranges and replicas, predictions, health."""
    predicted = gear.predicted
    return GearView(
        name=gear.name,
        intent=Intent(gear.intent),
        stages=tuple(StageView(s.start, s.end, s.replicas, s.gpus) for s in gear.stages),
        predicted_throughput_rps=None if predicted is None else predicted.throughput_qps,
        predicted_p99_ms=None if predicted is None else predicted.p99_ms,
        prompt_tokens_per_s=None if predicted is None else predicted.prompt_tokens_per_s,
        output_tokens_per_s=None if predicted is None else predicted.output_tokens_per_s,
        ttft_ms_per_prompt_token=None if predicted is None else predicted.ttft_ms_per_prompt_token,
        healthy=True if health is None else health.healthy,
        unhealthy_reason="" if health is None or health.healthy else health.reason,
    )


def gear_views(gears: Sequence[Gear], health: Sequence[GearHealth] = ()) -> tuple[GearView, ...]:
    """All gears with their ``status.gearHealth`` marks (a gear without a mark is healthy)."""
    marks = {h.gear: h for h in health}
    return tuple(gear_view(g, marks.get(g.name)) for g in gears)


def shift_request(decision: Decision, table: GearTable) -> ShiftRequest | None:
    """The executor's request for a SHIFT decision, else ``None``: the target's predicted P99 and the active
    gear's measured P99 and served rate at the decision (the rollback check's baselines)."""
    if decision.kind is not DecisionKind.SHIFT or decision.target is None or decision.trigger is None:
        return None
    target = table.get(decision.target)
    return ShiftRequest(
        decision.target,
        decision.trigger,
        None if target is None else target.predicted_p99_ms,
        baseline_p99_ms=decision.p99_ms,
        baseline_qps=decision.qps,
        why=decision.why,
    )
