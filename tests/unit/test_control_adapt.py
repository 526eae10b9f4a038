"""From the GearSet API models to the control code's policy and gear views."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

import pytest
from pydantic import ValidationError

from gearshift.api.gearset import Gear, GearPrediction, Stage
from gearshift.api.gearset_status import GearHealth
from gearshift.api.shift_policy import ShiftPolicy as ApiShiftPolicy
from gearshift.control.shifting.adapt import gear_views, policy_from_api, shift_request
from gearshift.control.shifting.decide import Decision, DecisionKind
from gearshift.control.shifting.policy import GearTable, Intent, ShiftRules
from gearshift.control.smoothing import LatencyMetric
from gearshift.facts.errors import PolicyError
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
    # The triggers need p99HighRatio above 1: the schema refuses 0.9 first, and rules built without the
    # API refuse it too, naming the field.
    with pytest.raises(ValidationError, match="p99HighRatio"):
        ApiShiftPolicy.model_validate({"p99HighRatio": 0.9})
    with pytest.raises(PolicyError, match=r"spec\.policy\.p99HighRatio"):
        ShiftRules(p99_high_ratio=0.9)


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


#: A value of every ``spec.policy`` field, none of them the default: the mapping must carry each one.
NOT_DEFAULT = {
    "sample_interval_s": 3.0,
    "ema_alpha": 0.5,
    "enter_samples": 4,
    "exit_samples": 5,
    "dwell_s": 100.0,
    "imbalance_high_utilization": 0.8,
    "imbalance_low_utilization": 0.5,
    "p99_high_ratio": 1.5,
    "p99_low_ratio": 0.6,
    "saturation_queue": 2.0,
    "target_p99_ms": 123.0,
    "retrigger_step": 0.1,
    "min_benefit_cost_ratio": 2.0,
    "warmup_share": 0.3,
    "warm_s": 10.0,
    "warmup_timeout_s": 300.0,
    "max_retrigger_steps": 2,
    "transfer_gbps": 4.0,
    "avg_context_tokens": 512,
    "drain_timeout_s": 60.0,
    "rollback_window_s": 30.0,
    "rollback_p99_ratio": 3.0,
    "expected_arrival_rps": 5.0,
    "capacity_headroom": 0.8,
    "downshift_ratio": 0.5,
    "choice": "thresholds",
    "upshift_dwell_s": 30.0,
    "allow_degraded": False,
}


def test_every_api_policy_field_reaches_the_rules():
    # A field added to ShiftPolicy fails here until NOT_DEFAULT and policy_from_api name it.
    assert set(NOT_DEFAULT) == set(ApiShiftPolicy.model_fields)
    api = ApiShiftPolicy(**NOT_DEFAULT)
    rules = policy_from_api(api, role="decode", ttft_slo_ms=200, itl_slo_ms=50)
    for name, value in NOT_DEFAULT.items():
        assert getattr(api, name) == value != getattr(ApiShiftPolicy(), name), name
        assert getattr(rules, name) == value, name
    assert {f.name for f in fields(ShiftRules)} == set(NOT_DEFAULT) | {"latency_metric"}


def test_the_rules_defaults_are_the_apis():
    rules, api = ShiftRules(), ApiShiftPolicy()
    assert all(getattr(rules, n) == getattr(api, n) for n in NOT_DEFAULT if n != "target_p99_ms")


def _bounds(name: str) -> list[float]:
    """Values either side of each bound the API schema puts on ``name``."""
    node = ApiShiftPolicy.model_json_schema(by_alias=False)["properties"][name]
    node = next((n for n in node.get("anyOf", []) if n.get("type") != "null"), node)
    out: list[float] = []
    for key in ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"):
        if key in node:
            b = node[key]
            step = 1 if node.get("type") == "integer" else 1e-9
            out += [b - step, b, b + step]
    return out


def _accepts(cls: Any, **kw: Any) -> bool:
    try:
        cls(**kw)
    except ValueError:  # pydantic's ValidationError and PolicyError alike
        return False
    return True


@pytest.mark.parametrize("name", sorted(n for n in NOT_DEFAULT if n != "allow_degraded"))
def test_schema_and_rules_agree_on_each_bound(name: str):
    # Every value the schema lets through, the control code can use; at the lower bounds they refuse
    # the same values (above the schema's upper limits, which only bound typos, the rules still accept).
    node = ApiShiftPolicy.model_json_schema(by_alias=False)["properties"][name]
    upper = next((n for n in node.get("anyOf", [node]) if n.get("type") != "null"), node)
    top = upper.get("maximum", upper.get("exclusiveMaximum", math.inf))
    for value in _bounds(name):
        schema_ok, rules_ok = _accepts(ApiShiftPolicy, **{name: value}), _accepts(ShiftRules, **{name: value})
        assert rules_ok if schema_ok else (not rules_ok or value >= top), (name, value, schema_ok, rules_ok)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"imbalance_low_utilization": 0.9},
        {"imbalance_low_utilization": 0.5, "imbalance_high_utilization": 0.4},
        {"retrigger_step": 0.3},
        {"p99_low_ratio": 0.15},
        {"p99_low_ratio": 0.1500001},
        {"max_retrigger_steps": 14},
        {"max_retrigger_steps": 13},
    ],
)
def test_schema_and_rules_agree_on_cross_field_rules(kwargs: dict[str, Any]):
    assert _accepts(ApiShiftPolicy, **kwargs) == _accepts(ShiftRules, **kwargs), kwargs
