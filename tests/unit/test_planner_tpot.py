"""TPOT of aggregated (role ``both``) gears: the model in :mod:`gearshift.planner.tpot`, the planner's use of
it (decode priced with continuous batching, capacity capped by a TPOT target, prompts not queued behind
earlier requests' decodes), and its agreement with the simulated engine (the twin) at steady loads."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from gearshift import planner
from gearshift.api.shift_policy import ShiftPolicy
from gearshift.control.shifting.adapt import policy_from_api
from gearshift.dev.twin.constants import Slo
from gearshift.dev.twin.gears import fleet_profile, gears_from_api
from gearshift.dev.twin.trace import Trace
from gearshift.dev.twin.variant import run_variant
from gearshift.facts.model import load_hf_config
from gearshift.planner.inputs import api_gear
from gearshift.planner.partition import evaluate
from gearshift.planner.simulate import simulate
from gearshift.planner.tpot import DecodeTimes, period_ms, tpot_capacity, tpot_ms

ROOT = Path(__file__).resolve().parents[2]
FLEET = ROOT / "examples" / "fleets" / "mixed.yaml"
ARCH_70B = load_hf_config(ROOT / "examples" / "models" / "llama-3-70b.json")
PROMPT, OUTPUT = 1155, 211  # the demo's workload (the trace's means)


def _flat(step: float = 10.0, prefill: float = 50.0, stages: int = 2, link: float = 0.0) -> DecodeTimes:
    return DecodeTimes(lambda d: [step] * stages, lambda d: link, [prefill] * stages)


class TestModel:
    def test_period_is_the_trip_or_the_micro_batches_on_the_slowest_stage(self) -> None:
        t = DecodeTimes(lambda d: [10.0, 30.0], lambda d: 2.0, [0.0, 0.0])
        assert period_ms(t, 1) == pytest.approx(42.0)  # one micro-batch: its trip over stages and link
        assert period_ms(t, 5) == pytest.approx(60.0)  # two in flight: 2 × the 30 ms stage

    def test_prompts_stretch_the_period_by_the_share_they_take(self) -> None:
        # 4 req/s × 50 ms of prompt on the bottleneck stage = 20 % of its time: 20 ms / 0.8 = 25 ms.
        assert tpot_ms(_flat(), 4.0, 128, 64) == pytest.approx(25.0)
        assert tpot_ms(_flat(), 0.0, 128, 64) == pytest.approx(20.0)
        assert tpot_ms(_flat(), 20.0, 128, 64) == math.inf  # prompts alone fill the stage

    def test_running_sequences_and_tpot_meet_at_littles_law(self) -> None:
        # A step costs 10 ms + 1 ms per sequence of the micro-batch: TPOT and N = λ (o − 1) TPOT depend on
        # each other; the answer must satisfy both.
        t = DecodeTimes(lambda d: [10.0 + d, 10.0 + d], lambda d: 0.0, [0.0, 0.0])
        lam, out = 3.0, 101
        tpot = tpot_ms(t, lam, out, 256)
        running = lam * (out - 1) * tpot / 1000.0
        assert tpot == pytest.approx(period_ms(t, running), rel=1e-6)
        assert running > 2  # two micro-batches of several sequences: the case the fixed point is for

    def test_capacity_is_where_tpot_reaches_the_target(self) -> None:
        # 20 ms / (1 − 0.05 λ) ≤ 24 ms  ⇔  λ ≤ 10/3 req/s.
        assert tpot_capacity(_flat(), 24.0, 128, 64, 100.0) == pytest.approx(10 / 3, rel=1e-6)
        assert tpot_capacity(_flat(), 19.0, 128, 64, 100.0) == 0.0  # a lone request is already too slow
        assert tpot_capacity(_flat(), 1e6, 128, 64, 7.0) == 7.0  # never binding below the busy rate

    def test_capacity_keeps_the_decoding_sequences_within_the_max_batch(self) -> None:
        # Flat 10 ms steps on 2 stages with no prompt cost: TPOT is 20 ms at any load, so the TPOT target
        # never binds; Little's law does: λ · (101 − 1) · 20 ms ≤ 8 sequences  ⇔  λ ≤ 4 req/s.
        flat = _flat(prefill=0.0)
        assert tpot_capacity(flat, 150.0, 101, 8, 100.0) == pytest.approx(4.0, rel=1e-6)
        assert tpot_capacity(flat, 150.0, 101, 16, 100.0) == pytest.approx(8.0, rel=1e-6)

    def test_bad_arguments_are_refused(self) -> None:
        with pytest.raises(ValueError, match="rps >= 0"):
            tpot_ms(_flat(), -1.0, 128, 64)
        with pytest.raises(ValueError, match="target_ms > 0"):
            tpot_capacity(_flat(), 0.0, 128, 64, 1.0)


class TestSimulatorSlack:
    def test_decode_work_trailing_a_prompt_does_not_hold_the_next_prompt(self) -> None:
        # One stage: a prompt passes in 10 ms but its decode keeps the stage 100 ms busy. At 8 req/s the
        # stage is 80 % busy. One batch at a time (no slack), each prompt waits for every earlier request's
        # whole decode; with the decode spread over 1 s (continuous batching), prompts pass in ~10 ms.
        stage = [[[10.0]]]
        busy = [[[100.0]]]
        held = simulate(stage, [], 1, 1, 8.0, busy_ms=busy, requests=3000)
        spread = simulate(stage, [], 1, 1, 8.0, busy_ms=busy, busy_slack_ms=1000.0, requests=3000)
        assert spread.p50_ms == pytest.approx(10.0, abs=0.5)
        assert held.p50_ms > 5 * spread.p50_ms
        # over capacity (12 req/s × 100 ms), the work outruns any slack and queues grow either way
        over = simulate(stage, [], 1, 1, 12.0, busy_ms=busy, busy_slack_ms=1000.0, requests=3000)
        assert over.saturated


class TestPlanner:
    def _cost(self, role: str = "both") -> planner.RooflineCostModel:
        return planner.RooflineCostModel(
            ARCH_70B, planner.RooflineAssumptions(prompt_tokens=PROMPT, output_tokens=OUTPUT, role=role)
        )

    def test_a_pipelines_decode_batches_its_running_sequences_over_its_stages(self) -> None:
        profile = planner.load_cluster(FLEET)
        cost = self._cost()
        result = planner.plan(profile, cost)
        kv = cost.assumptions.kv_sequences
        for g in result.gears:
            k = len(g.stages)
            assert k > 1  # 70B fits no card of the fleet
            per_step = cost.at(g.micro_batch, math.ceil(kv / k))
            bottleneck, _, _ = evaluate(profile, per_step, [(*s.layers, s.nodes) for s in g.stages])
            assert g.bottleneck_ms == pytest.approx(bottleneck, rel=1e-9)

    def test_a_tpot_target_caps_capacity_and_every_gear_meets_it(self) -> None:
        profile = planner.load_cluster(FLEET)
        free = planner.plan(profile, self._cost())
        capped = planner.plan(profile, self._cost(), itl_target_ms=150.0)
        assert max(g.predicted.throughput_rps for g in capped.gears) <= max(
            g.predicted.throughput_rps for g in free.gears
        ) * (1 + 1e-9)
        for g in capped.gears:
            if g.predicted.throughput_rps > 0:
                assert g.predicted.itl_ms is not None and g.predicted.itl_ms <= 150.0
        tight = planner.plan(profile, self._cost(), itl_target_ms=1.0)  # no pipeline gives a token a ms
        assert all(g.predicted.throughput_rps == 0 for g in tight.gears)
        with pytest.raises(planner.PlanError, match="itl_target_ms"):
            planner.plan(profile, self._cost(), itl_target_ms=-1.0)

    def test_smaller_kv_budgets_compete_only_under_a_tpot_target(self) -> None:
        cost = self._cost()
        budgets = [m.assumptions.kv_sequences for m in planner.candidates.kv_budgets(cost)]
        k, expected = cost.assumptions.kv_sequences, []
        while k >= planner.candidates.MIN_KV_SEQUENCES:
            expected.append(k)
            k //= 2
        assert budgets == expected and budgets[0] == cost.assumptions.kv_sequences
        assert planner.candidates.kv_budgets(self._cost("decode")) == [self._cost("decode")]
        profile = planner.load_cluster(FLEET)
        free = planner.plan(profile, cost)
        assert {g.max_batch for g in free.gears} == {cost.assumptions.kv_sequences}
        capped = planner.plan(profile, cost, itl_target_ms=150.0)
        for g in capped.gears:
            assert g.max_batch in expected
            # each stage is sized for its gear's own budget, and every node of it holds that
            own = replace(cost, assumptions=replace(cost.assumptions, kv_sequences=g.max_batch))
            costs = own.at(g.micro_batch)
            for st in g.stages:
                need = sum(costs.memory_gb(i) for i in range(*st.layers))
                assert st.memory_gb == pytest.approx(need, rel=1e-9)
                assert all(need <= profile.node(n).memory_gb * (1 + 1e-12) for n in st.nodes)
        # the budget is a trade the planner makes: a smaller one lets some gear use fewer cards
        assert min(len(g.stages) for g in capped.gears) < min(len(g.stages) for g in free.gears)

    def test_the_prediction_agrees_with_the_simulated_engine(self) -> None:
        # The twin (gearshift.sim's engine in virtual time) serves the planned gear at steady Poisson loads;
        # the planner's mean TPOT must sit at or a little above the engine's median (it stretches every
        # step by the prompts' mean share), and its capacity where the engine's TTFT starts to run away.
        rules = policy_from_api(ShiftPolicy(), role="both", ttft_slo_ms=2500, itl_slo_ms=150)
        _, doc, profile = fleet_profile(FLEET)  # the profile the twin plans on (usable memory)
        for lam in (0.5, 1.5):
            gear = planner.plan(profile, self._cost(), itl_target_ms=150.0, qps=lam).gear("latency")
            (spec,) = gears_from_api([api_gear(gear, gear.name, doc, {})], ARCH_70B, rules, FLEET)
            n = int(lam * 600)
            t = np.cumsum(np.random.default_rng(1).exponential(1 / lam, n))
            trace = Trace(t, np.full(n, PROMPT), np.full(n, OUTPUT))
            out = run_variant(
                "agree", ARCH_70B, trace, rules, [spec], spec.name, dynamic=False, slo=Slo(2.5, 0.15)
            )
            engine_p50 = out["tpot_ms"]["p50"]
            assert gear.predicted.itl_ms is not None
            assert engine_p50 * 0.98 <= gear.predicted.itl_ms <= engine_p50 * 1.25, (lam, engine_p50)
            assert out["failed"] == 0
            # within the planned capacity the engine keeps TTFT well under the 2.5 s target
            assert lam < gear.predicted.throughput_rps and out["ttft_ms"]["p99"] < 2500
