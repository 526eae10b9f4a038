"""From the GearSet API models to the control code's policy and gear views."""

from __future__ import annotations

import pytest

from gearshift.api.gearset import Gear, GearPrediction, Stage
from gearshift.api.gearset_status import GearHealth
from gearshift.api.shift_policy import ShiftPolicy as ApiShiftPolicy
from gearshift.control.adapt import gear_views, policy_from_api, shift_request
from gearshift.control.decide import Decision, DecisionKind
from gearshift.control.policy import GearTable, Intent, LatencyMetric, PolicyError
from gearshift.facts.model import ModelArch

ARCH = ModelArch("m", 32, 4096, 32, 8, 128, 14336, 128256)


def test_policy_copies_the_api_numbers_and_takes_the_role_slo():
    api = ApiShiftPolicy(dwell_s=300, retrigger_step=0.02, warmup_share=0.1, rollback_p99_ratio=3)
    p = policy_from_api(api, role="decode", ttft_slo_ms=200, itl_slo_ms=50)
    assert (p.dwell_s, p.retrigger_step, p.warmup_share, p.rollback_p99_ratio) == (300, 0.02, 0.1, 3)
    assert (p.target_p99_ms, p.latency_metric) == (50, LatencyMetric.ITL)
    assert (p.ema_alpha, p.enter_samples, p.exit_samples) == (0.3, 3, 3)
    p = policy_from_api(ApiShiftPolicy(target_p99_ms=150), role="prefill", ttft_slo_ms=200, itl_slo_ms=50)
    assert (p.target_p99_ms, p.latency_metric) == (150, LatencyMetric.TTFT)


def test_an_aggregated_pipeline_is_judged_by_ttft_against_the_ttft_slo():
    # Role both: each request's prefill runs through every stage, so the gear shows in TTFT first, and
    # TTFT is what the planner predicts for it.
    p = policy_from_api(ApiShiftPolicy(), role="both", ttft_slo_ms=200, itl_slo_ms=50)
    assert (p.target_p99_ms, p.latency_metric) == (200, LatencyMetric.TTFT)


def test_policy_errors_name_the_field():
    with pytest.raises(ValueError, match="role"):
        policy_from_api(ApiShiftPolicy(), role="encode", ttft_slo_ms=200, itl_slo_ms=50)
    # The API allows p99HighRatio 0.9 (> 0) but the triggers need it above 1.
    with pytest.raises(PolicyError, match=r"spec\.policy\.p99HighRatio"):
        policy_from_api(ApiShiftPolicy(p99_high_ratio=0.9), role="prefill", ttft_slo_ms=200, itl_slo_ms=50)


def test_gear_views_with_health_and_predictions():
    gears = [
        Gear(
            name="lat",
            intent="latency",
            stages=[Stage(layers=[0, 16], replicas=2), Stage(layers=[16, 32])],
            predicted=GearPrediction(throughput_qps=10, p99_ms=120),
        ),
        Gear(name="thr", intent="throughput", stages=[Stage(layers=[0, 32])]),
    ]
    views = gear_views(gears, [GearHealth(gear="thr", healthy=False, reason="OOMKilled")])
    lat, thr = views
    assert lat.intent is Intent.LATENCY and [(s.start, s.end, s.replicas) for s in lat.stages] == [
        (0, 16, 2),
        (16, 32, 1),
    ]
    assert (lat.predicted_throughput_rps, lat.predicted_p99_ms, lat.healthy) == (10, 120, True)
    assert (thr.healthy, thr.unhealthy_reason, thr.predicted_p99_ms) == (False, "OOMKilled", None)
    table = GearTable(views, "thr", ARCH)
    req = shift_request(Decision(DecisionKind.SHIFT, "P99High", target="lat", trigger="p99-high"), table)
    assert (req.target, req.trigger, req.predicted_p99_ms) == ("lat", "p99-high", 120)
    assert shift_request(Decision(DecisionKind.HOLD, "Steady"), table) is None
    sat = Decision(
        DecisionKind.SHIFT, "Saturation", target="lat", trigger="saturation", p99_ms=3365.0, qps=11.5
    )
    req = shift_request(sat, table)
    assert (req.trigger, req.baseline_p99_ms, req.baseline_qps) == ("saturation", 3365.0, 11.5)
