"""The traffic mix in the shifting decision: each gear's capacity for the observed prompt and output tokens
(a linear work model from the planner, what a gear measured kept across mixes), a shift up started from
the rate's trend, and a TTFT miss that no gear would fix reported instead of shifted on."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from gearshift.api.gearset_status import ControlState
from gearshift.control.shifting import capacity as cap
from gearshift.control.shifting.adapt import gear_view, shift_request
from gearshift.control.shifting.capacity import CapacityEstimate
from gearshift.control.shifting.decide import (
    REASON_UNFIXABLE,
    DecisionKind,
    DecisionState,
    decide,
    held_triggers,
)
from gearshift.control.shifting.executor import shift_started_message
from gearshift.control.shifting.policy import GearTable, GearView, Intent, ShiftRules, StageView
from gearshift.control.shifting.shift_status import control_from_status, control_to_status
from gearshift.control.shifting.tick import latency_condition
from gearshift.control.shifting.triggers import Trigger
from gearshift.control.smoothing import LatencyMetric, Sample, smooth
from gearshift.dev.twin import MODEL, plan_gears
from gearshift.facts.model import load_hf_config
from gearshift.planner import RooflineAssumptions, RooflineCostModel, load_cluster, plan
from gearshift.planner.inputs import api_gear

ARCH = load_hf_config(Path(__file__).resolve().parents[2] / "examples" / "models" / "llama-3-8b.json")
RULES = ShiftRules(target_p99_ms=200.0, capacity_headroom=0.8)


def gear(
    name: str, cards: int, thr: float, pt: float | None, ot: float | None, per_token: float = 0.03
) -> GearView:
    return GearView(
        name,
        Intent.LATENCY,
        (StageView(0, 32, replicas=cards),),
        thr,
        90.0,
        prompt_tokens_per_s=pt,
        output_tokens_per_s=ot,
        ttft_ms_per_prompt_token=per_token,
    )


# Planned for 1,000 prompt + 200 output tokens: 1000/50000 + 200/10000 = 0.04 s busy per request → 25 req/s.
SMALL = gear("small", 2, 25.0, 50_000.0, 10_000.0)
# Twice the cards, twice the rates: 50 req/s at the planned mix.
LARGE = gear("large", 4, 50.0, 100_000.0, 20_000.0)


class TestWorkModel:
    def test_busy_rate_follows_the_mix(self) -> None:
        assert SMALL.busy_rps(1000, 200) == pytest.approx(25.0)
        # 2,000-token prompts, 30 outputs: 0.04 + 0.003 s → 23.26 req/s, computed by hand.
        assert SMALL.busy_rps(2000, 30) == pytest.approx(1 / (2000 / 50_000 + 30 / 10_000))
        # Without a mix or a work model the planner's requests/s stand.
        assert SMALL.busy_rps(None, 30) == 25.0
        assert gear("blind", 2, 25.0, None, None).busy_rps(2000, 30) == 25.0

    def test_mix_factor_and_capacity_at_the_mix(self) -> None:
        f = cap.mix_factor(SMALL, 4000, 200)  # 0.08 + 0.02 = 0.1 s: 10 req/s, 2.5x heavier than planned
        assert f == pytest.approx(2.5)
        e = cap.at_mix(CapacityEstimate(20.0, measured_low_rps=15.0), f)
        assert (e.predicted_rps, e.measured_low_rps) == (pytest.approx(8.0), pytest.approx(6.0))
        assert e.capacity_rps == pytest.approx(8.0)
        assert cap.mix_factor(SMALL, None, None) == 1.0

    def test_a_measured_bound_carries_over_to_another_mix(self) -> None:
        """Saturated at 8 req/s of 4,000-token prompts (20 req/s of the planned mix), the gear is not
        credited its prediction of 20 × 0.8 / 2.5 = 8 … but 8 × 2.5 / 1.0 = 20 req/s of the planned mix,
        and 20 / 0.4 = 50 req/s of 300-token prompts with 20 outputs (a mix 0.4x as heavy)."""
        heavy, light = cap.mix_factor(SMALL, 4000, 200), cap.mix_factor(SMALL, 300, 20)
        assert light == pytest.approx(25.0 / (1 / (300 / 50_000 + 20 / 10_000)))
        planned = CapacityEstimate(cap.predicted_capacity(SMALL, RULES))
        for now in (0.0, cap.CONFIRM_S):  # an overload that lasts a whole window
            planned = cap.observe(
                planned,
                arrival_rps=8.0 * heavy,
                completed_rps=7.0 * heavy,
                keeping_up=False,
                overloaded=True,
                saturated=True,
                now=now,
            )
        assert planned.measured_high_rps == pytest.approx(7.0 * heavy)
        assert cap.at_mix(planned, heavy).capacity_rps == pytest.approx(7.0)
        assert cap.at_mix(planned, light).capacity_rps == pytest.approx(min(20.0, 17.5) / light)


class TestPrefillHeadroom:
    def test_long_prompts_lower_the_share_of_the_busy_rate(self) -> None:
        # 0.03 ms a token: 2,000 tokens take 60 ms of the 200 ms target, 0.3; 0.145 / 0.3 = 0.483.
        assert cap.headroom(SMALL, RULES, 2000.0) == pytest.approx(cap.PREFILL_WAIT_SHARE / 0.3)
        # Short prompts keep the policy's headroom; so does a gear without the figure, or an ITL policy.
        assert cap.headroom(SMALL, RULES, 500.0) == RULES.capacity_headroom
        assert cap.headroom(gear("x", 1, 1.0, 1.0, 1.0, per_token=None), RULES, 4000.0) == 0.8  # type: ignore[arg-type]
        itl = ShiftRules(target_p99_ms=50.0, latency_metric=LatencyMetric.ITL, capacity_headroom=0.8)
        assert cap.headroom(SMALL, itl, 4000.0) == 0.8
        assert cap.headroom(SMALL, RULES, 1e6) == cap.MIN_HEADROOM
        assert cap.predicted_capacity(SMALL, RULES, 2000.0) == pytest.approx(25.0 * 0.145 / 0.3)

    def test_thresholds_choice_has_no_capacity_triggers(self) -> None:
        rules = ShiftRules(target_p99_ms=200.0, choice="thresholds")
        table = GearTable((SMALL, LARGE), "small", ARCH)
        st = DecisionState(last_shift_at=-10_000.0)
        for k in range(10):  # 40 req/s on a gear of 20: load-high would fire in capacity mode
            s = Sample(at=2.0 * k, ttft_p99_ms=100.0, arrival_rps=40.0, qps=40.0)
            st, d = decide(st, s, rules, table, 2.0 * k)
            assert d.kind is DecisionKind.HOLD
        assert not st.tracks[Trigger.LOAD_HIGH].latched


class TestUnservablePrompts:
    # Cumulative requests/s at le = 1000, 2000, 5000, 10000, +Inf.
    BUCKETS = ((1000.0, 4.0), (2000.0, 7.0), (5000.0, 9.0), (10000.0, 9.5), (math.inf, 10.0))

    def test_share_above_interpolates_inside_a_bucket(self) -> None:
        assert cap.share_above(self.BUCKETS, 2000.0) == pytest.approx(0.3)
        # 3,500 tokens: halfway through (2000, 5000]: 7 + 1 = 8 of 10 below.
        assert cap.share_above(self.BUCKETS, 3500.0) == pytest.approx(0.2)
        assert cap.share_above(self.BUCKETS, 20000.0) == pytest.approx(0.05)
        assert cap.share_above((), 10.0) is None

    def test_longest_prompt_any_gear_prefills_in_time(self) -> None:
        fast = gear("fast", 2, 25.0, 1.0, 1.0, per_token=0.025)
        assert cap.prompt_tokens_within((SMALL, fast), 200.0) == pytest.approx(8000.0)
        assert cap.prompt_tokens_within((gear("x", 1, 1.0, 1.0, 1.0, per_token=None),), 200.0) is None  # type: ignore[arg-type]

    def test_p99_high_that_no_gear_fixes_holds_and_says_why(self) -> None:
        """Both gears prefill 0.03 ms a token: nothing past 6,667 tokens meets 200 ms; 10 % of this mix
        is past 5,000 and 5 % past 10,000, so about 8 % cannot meet it on any gear."""
        table = GearTable((SMALL, LARGE), "small", ARCH)
        st = DecisionState(last_shift_at=-10_000.0)
        sample = Sample(
            at=0.0,
            ttft_p99_ms=900.0,
            arrival_rps=5.0,
            qps=5.0,
            prompt_tokens_mean=1800.0,
            output_tokens_mean=30.0,
            prompt_tokens_buckets=self.BUCKETS,
        )
        kinds = []
        for k in range(RULES.enter_samples + 2):
            st, d = decide(st, Sample(**{**sample.__dict__, "at": 2.0 * k}), RULES, table, 2.0 * k)
            kinds.append((d.kind, d.reason))
        # Latched at the enterSamples-th sample, and held (one reason, one event) while the miss lasts.
        assert kinds[RULES.enter_samples - 1 :] == [(DecisionKind.HOLD, REASON_UNFIXABLE)] * 3
        share = 0.1 - 0.05 * (6666.67 - 5000) / 5000  # 8.3 %, interpolated as histogram_quantile would
        assert f"about {round(share * 20) / 20:.0%} of requests" in d.message  # to 5 %: 10 %
        assert "longer than the 6700 tokens" in d.message
        # The GearSet says so in a condition too (the tick writes it beside SignalsAvailable).
        cond = latency_condition(st)
        assert (cond.type, cond.status, cond.reason, cond.warning) == (
            "LatencyAttainable",
            "False",
            "PromptsTooLong",
            True,
        )
        assert cond.message == d.message
        assert latency_condition(DecisionState()).status == "True"

    def test_itl_policy_never_calls_a_ttft_miss_unfixable(self) -> None:
        rules = ShiftRules(target_p99_ms=50.0, latency_metric=LatencyMetric.ITL)
        table = GearTable((SMALL, LARGE), "small", ARCH)
        st = DecisionState(last_shift_at=-10_000.0)
        for k in range(rules.enter_samples + 1):
            s = Sample(at=2.0 * k, itl_p99_ms=200.0, qps=5.0, prompt_tokens_buckets=self.BUCKETS)
            st, d = decide(st, s, rules, table, 2.0 * k)
        assert d.reason != REASON_UNFIXABLE


class TestTrendAndMixSignals:
    def test_a_rising_rate_starts_the_shift_up_before_the_gear_falls_behind(self) -> None:
        """SMALL keeps up with 0.8 × 25 = 20 req/s of the planned mix. 4 req/s for two minutes (the trend
        counts from a whole window after the first rate), then a climb of 0.25 req/s a second: Holt's
        trend times the lead (the other gear's load, warmS, two samples) starts the shift while the
        smoothed rate is still under 20, before the gear falls behind."""
        table = GearTable((SMALL, LARGE), "small", ARCH)
        st = DecisionState(last_shift_at=-10_000.0)
        shifted_at = rate_then = None
        for k in range(200):
            t = 2.0 * k
            rate = 4.0 + 0.25 * max(0.0, t - 120.0)
            s = Sample(at=t, ttft_p99_ms=100.0, arrival_rps=rate, qps=rate, prompt_tokens_mean=1000.0,
                       output_tokens_mean=200.0)  # fmt: skip
            st, d = decide(st, s, RULES, table, t)
            if t < 60.0:
                assert st.arrival_trend_rps_per_s == 0.0  # the first window's rate is still filling
            if d.kind is DecisionKind.SHIFT:
                shifted_at, rate_then = t, st.smoothed.arrival_rps if st.smoothed else None
                break
        assert shifted_at is not None and d.target == "large"
        assert rate_then is not None and rate_then < 20.0
        # The ShiftStarted event says what the decision read: the rate, the mix, each gear's capacity.
        req = shift_request(d, table)
        assert req is not None
        started = shift_started_message(req.trigger, "small", req.target, False, req.why)
        assert started.startswith(f"load-high ({rate_then:.1f} req/s arriving, 1,000 prompt / 200 output ")
        assert "'small' 20.0 req/s on 2 GPUs, 'large' 40.0 req/s on 4): shifting from gear 'small'" in started
        assert 0.0 < st.arrival_trend_rps_per_s <= 0.25 * 1.01  # an average of the slope, still rising to it

    def test_noise_is_no_trend(self) -> None:
        """A flat 18 req/s with ±1 req/s of noise: no shift up, however the noise falls."""
        table = GearTable((SMALL, LARGE), "small", ARCH)
        st = DecisionState(last_shift_at=-10_000.0)
        for k in range(300):
            t = 2.0 * k
            rate = 18.0 + (1.0 if k % 3 == 0 else -0.5)
            s = Sample(at=t, ttft_p99_ms=100.0, arrival_rps=rate, qps=rate, prompt_tokens_mean=1000.0,
                       output_tokens_mean=200.0)  # fmt: skip
            st, d = decide(st, s, RULES, table, t)
            assert d.kind is not DecisionKind.SHIFT, (t, d.message)

    def test_missing_mix_holds_the_load_triggers(self) -> None:
        assert held_triggers({"prompt_tokens_mean"}, LatencyMetric.TTFT) == {
            Trigger.LOAD_HIGH,
            Trigger.LOAD_LOW,
        }
        assert held_triggers({"output_tokens_mean"}, LatencyMetric.TTFT) >= {Trigger.LOAD_HIGH}

    def test_mix_is_smoothed_and_round_trips(self) -> None:
        a = Sample(
            at=0.0,
            prompt_tokens_mean=1000.0,
            output_tokens_mean=100.0,
            prompt_tokens_buckets=((10.0, 1.0), (math.inf, 2.0)),
        )
        b = Sample(at=2.0, prompt_tokens_mean=2000.0, output_tokens_mean=None)
        s = smooth(a, b, 0.3)
        assert s.prompt_tokens_mean == pytest.approx(1300.0)
        assert s.output_tokens_mean == 100.0
        assert s.prompt_tokens_buckets == a.prompt_tokens_buckets  # the latest window that had one
        assert Sample.from_dict(a.to_dict()) == a
        st = DecisionState(arrival_trend_rps_per_s=0.5)
        assert DecisionState.from_dict(st.to_dict()).arrival_trend_rps_per_s == 0.5


def test_trend_and_pending_overload_survive_the_status_round_trip() -> None:
    """What an operator restart reads back from ``status.control`` (through the API model, as stored)."""
    est = CapacityEstimate(20.0, 15.0, None, 100.0, None, None, 22.5, 130.0)
    state = DecisionState(
        smoothed=Sample(at=200.0, arrival_rps=18.0, prompt_tokens_mean=900.0, output_tokens_mean=150.0),
        capacity={"small": est},
        arrival_trend_rps_per_s=0.04,
    )
    stored = ControlState.model_validate(control_to_status(state, RULES))
    back = control_from_status(stored)
    assert back.arrival_trend_rps_per_s == pytest.approx(0.04)
    assert back.capacity["small"].pending_high_rps == 22.5
    assert back.capacity["small"].pending_high_since == pytest.approx(130.0)
    assert back.smoothed is not None and back.smoothed.prompt_tokens_mean == 900.0


def test_the_planners_work_model_predicts_the_gear_planned_for_another_mix() -> None:
    """The same whole-model gear (one H100 per pipeline) planned for 1,155/211 tokens and, apart, for
    1,732/211 and 1,155/316 (1.5x each side): the linear work model fitted on the first plan predicts the
    others' planned throughput within 6 % (5.2 % high for the longer prompts: attention grows with the
    square of the prompt, which a line fitted at 2x overstates in between)."""
    arch = load_hf_config(MODEL)
    base = {g.name: g for g in plan_gears(arch, RULES, (1155, 211), even=False)[0]}["latency"]
    view = gear_view(base.api)
    for mix in ((1732, 211), (1155, 316)):
        other = {g.name: g for g in plan_gears(arch, RULES, mix, even=False)[0]}["latency"]
        assert [st.nodes for st in other.api.stages] == [st.nodes for st in base.api.stages]
        assert view.busy_rps(*mix) == pytest.approx(other.predicted_rps, rel=0.06)


def test_a_pd_role_reads_its_own_side_of_the_mix() -> None:
    """A prefill gear's work is its prompts', a decode gear's its outputs': planned for 1,155 / 211 tokens,
    a prefill gear serves half as many 2,310-token prompts whatever the outputs, a decode gear half as
    many 422-token outputs whatever the prompts."""
    profile = load_cluster(Path(__file__).resolve().parents[2] / "examples" / "fleets" / "mixed.yaml")
    arch = load_hf_config(MODEL)
    for role, side in (("prefill", "prompt"), ("decode", "output")):
        cost = RooflineCostModel(arch, RooflineAssumptions(prompt_tokens=1155, output_tokens=211, role=role))
        g = plan(profile, cost, sim_requests=200, intents=("latency",)).gears[0]
        view = gear_view(api_gear(g, "latency", {"nodes": []}, {}))
        thr = g.predicted.throughput_rps
        if side == "prompt":
            assert view.output_tokens_per_s is None and view.ttft_ms_per_prompt_token is not None
            assert view.busy_rps(2310, 5) == pytest.approx(thr / 2, rel=1e-3)
        else:
            assert view.prompt_tokens_per_s is None and view.ttft_ms_per_prompt_token is None
            assert view.busy_rps(8000, 422) == pytest.approx(thr / 2, rel=1e-3)
