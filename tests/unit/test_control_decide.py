"""The pure shift decision: EMA, triggers, hysteresis, dwell with threshold steps, cost–benefit, health.

Sequences are synthetic samples every 2 s; each test asserts the exact decision sequence, written out by
hand from the rules (docs/sources.md#shift-triggers), not produced by the code under test.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from gearshift.control.shifting.cost import cost_benefit, shift_cost_bytes
from gearshift.control.shifting.decide import (
    REASON_FORCE_UNHEALTHY,
    REASON_FORCE_UNKNOWN,
    REASON_FORCED,
    REASON_NO_HEALTHY_GEAR,
    REASON_PAUSED,
    REASON_SHIFT_IN_PROGRESS,
    Decision,
    DecisionKind,
    DecisionState,
    Overrides,
    decide,
)
from gearshift.control.shifting.policy import GearTable, GearView, Intent, ShiftRules, StageView
from gearshift.control.shifting.triggers import Trigger, conditions, imbalanced, saturated, thresholds
from gearshift.control.smoothing import Sample, ema, smooth
from gearshift.facts.errors import PolicyError
from gearshift.facts.model import load_hf_config

MODELS = Path(__file__).resolve().parents[2] / "examples" / "models"
ARCH = load_hf_config(MODELS / "llama-3-8b.json")
TARGET = 200.0  # ms
NO_OVERRIDES = Overrides()

H, S, R, V, N = "H", "S", "R", "V", "N"  # Hold, Shift, threshold Raised, Vetoed, No signals
CODE = {
    DecisionKind.HOLD: H,
    DecisionKind.SHIFT: S,
    DecisionKind.THRESHOLD_RAISED: R,
    DecisionKind.VETOED: V,
    DecisionKind.NO_SIGNALS: N,
}


def stages(*bounds: int, replicas: int = 1) -> tuple[StageView, ...]:
    return tuple(StageView(a, b, replicas) for a, b in itertools.pairwise(bounds))


def gears(**health: str) -> tuple[GearView, ...]:
    """latency (2 stages), balanced (4), throughput (8) gears; ``name="reason"`` marks one unhealthy."""
    base = (
        GearView("lat", Intent.LATENCY, stages(0, 16, 32), 10.0, 120.0),
        GearView("bal", Intent.BALANCED, stages(0, 8, 16, 24, 32), 16.0, 180.0),
        GearView("thr", Intent.THROUGHPUT, stages(0, 4, 8, 12, 16, 20, 24, 28, 32), 30.0, 400.0),
    )
    return tuple(
        replace(g, healthy=False, unhealthy_reason=health[g.name]) if g.name in health else g for g in base
    )


def table(active: str = "bal", **health: str) -> GearTable:
    return GearTable(gears(**health), active, ARCH)


def smp(
    t: float,
    p99: float | None = 150.0,
    util: tuple[float, ...] = (0.5, 0.5, 0.5, 0.5),
    running: float = 0,
    queue: float = 0.0,
    qps: float = 0.0,
) -> Sample:
    return Sample(at=t, stage_utilization=util, ttft_p99_ms=p99, running=running, queue=queue, qps=qps)


# Signals no trigger reacts to, and each trigger's condition met by a wide margin.
CALM = {"p99": 150.0}
HOT_STAGE = {"p99": 150.0, "util": (0.97, 0.3, 0.3, 0.3)}
SLOW = {"p99": 400.0}
FAST = {"p99": 60.0}
OVERLOAD = {"p99": 400.0, "queue": 5.0}  # P99 2 × target and 5 requests waiting (replicas 1)


def run(
    script: list[dict | None],
    *,
    policy: ShiftRules | None = None,
    active: str = "bal",
    state: DecisionState | None = None,
    t0: float = 0.0,
    follow: bool = True,
    overrides: Overrides = NO_OVERRIDES,
    **health: str,
) -> tuple[str, list[Decision], DecisionState, str]:
    """Feed one sample per 2 s; ``follow`` makes a SHIFT take effect at once (as a finished executor)."""
    policy = policy or ShiftRules(target_p99_ms=TARGET)
    state = state or DecisionState()
    codes, decisions = [], []
    for i, kw in enumerate(script):
        now = t0 + 2.0 * i
        sample = None if kw is None else smp(now, **kw)
        state, d = decide(state, sample, policy, table(active, **health), now, overrides=overrides)
        codes.append(CODE[d.kind])
        decisions.append(d)
        if d.kind is DecisionKind.SHIFT and follow:
            active = d.target
    return "".join(codes), decisions, state, active


class TestEma:
    def test_alpha_weights_the_newest_sample(self):
        assert ema(None, 100.0, 0.3) == 100.0
        assert ema(100.0, 200.0, 0.3) == pytest.approx(130.0)  # 0.3·200 + 0.7·100
        assert ema(130.0, 200.0, 0.3) == pytest.approx(151.0)  # 0.3·200 + 0.7·130

    def test_missing_and_nan_keep_the_average(self):
        assert ema(130.0, None, 0.3) == 130.0
        assert ema(130.0, math.nan, 0.3) == 130.0

    def test_smooth_per_stage_and_restart_on_new_stage_count(self):
        a = smooth(None, Sample(at=0, stage_utilization=(1.0, 0.0), ttft_p99_ms=math.nan), 0.3)
        assert a.ttft_p99_ms is None
        b = smooth(a, Sample(at=2, stage_utilization=(0.0, 1.0), ttft_p99_ms=100.0), 0.3)
        assert b.stage_utilization == pytest.approx((0.7, 0.3))
        assert b.ttft_p99_ms == 100.0
        c = smooth(b, Sample(at=4, stage_utilization=(0.2, 0.2, 0.2), qps=3.0), 0.3)
        assert c.stage_utilization == (0.2, 0.2, 0.2)
        assert c.ttft_p99_ms == 100.0  # traffic, but no quantile this time: the average stands

    def test_an_idle_window_drops_the_latency_average(self):
        # The demo's replay ended with the P99 over the alarm; an average kept through idle samples held
        # p99-high latched on a service nobody used.
        busy = smooth(None, Sample(at=0, ttft_p99_ms=900.0, itl_p99_ms=40.0, qps=12.0, running=5.0), 0.3)
        idle = smooth(busy, Sample(at=2, ttft_p99_ms=math.nan, qps=0.0), 0.3)
        assert idle.ttft_p99_ms is None and idle.itl_p99_ms is None
        waiting = smooth(busy, Sample(at=2, ttft_p99_ms=math.nan, qps=0.0, queue=3.0), 0.3)
        assert waiting.ttft_p99_ms == 900.0  # requests wait: the quantile is missing, not meaningless


class TestTriggers:
    @pytest.mark.parametrize(
        ("util", "fires"),
        [
            ((0.95, 0.5, 0.5), True),
            ((0.5, 0.95, 0.59), True),
            ((0.95, 0.6, 0.5), False),  # another stage not below 0.6
            ((0.9, 0.1, 0.1), False),  # not above 0.9
            ((0.95,), False),  # one stage cannot be imbalanced
            ((0.95, 0.95), False),
        ],
    )
    def test_imbalance(self, util, fires):
        assert imbalanced(util, 0.9, 0.6) is fires

    def test_levels_move_each_threshold_one_step(self):
        th = thresholds(ShiftRules(), {Trigger.IMBALANCE: 1, Trigger.LATENCY_HIGH: 2, Trigger.LATENCY_LOW: 3})
        assert (th.imbalance_high, th.imbalance_low) == pytest.approx((0.95, 0.55))
        assert th.p99_high_ratio == pytest.approx(1.3)
        assert th.p99_low_ratio == pytest.approx(0.55)
        assert thresholds(ShiftRules(), {Trigger.IMBALANCE: 3}).imbalance_high == 1.0

    @pytest.mark.parametrize(
        ("p99", "high", "low"),
        [
            (241.0, True, False),
            (240.0, False, False),
            (139.0, False, True),
            (140.0, False, False),
            (None, False, False),
        ],
    )
    def test_latency_against_target(self, p99, high, low):
        met = conditions(smp(0, p99), ShiftRules(target_p99_ms=TARGET), {})
        assert (met[Trigger.LATENCY_HIGH], met[Trigger.LATENCY_LOW]) == (high, low)


class TestHysteresis:
    @pytest.mark.parametrize(
        ("script", "expected"),
        [
            ([HOT_STAGE] * 3, "HHS"),
            # The calm sample pulls the hot stage's EMA to 0.829; it is back over 0.9 only at the second
            # hot sample after it (0.871, 0.913, 0.930, 0.942): three in a row at the seventh sample.
            ([HOT_STAGE, HOT_STAGE, CALM] + [HOT_STAGE] * 4, "HHHHHHS"),
            ([SLOW] * 4, "HHSH"),
            ([FAST] * 3, "HHH"),  # the balanced gear is already active
            ([CALM] * 5, "HHHHH"),
        ],
    )
    def test_enter_needs_consecutive_samples(self, script, expected):
        codes, _decisions, _, _ = run(script)
        assert codes == expected

    def test_targets_follow_the_trigger_intent(self):
        _, d1, _, _ = run([HOT_STAGE] * 3)
        _, d2, _, _ = run([SLOW] * 3)
        _, d3, _, _ = run([FAST] * 3, active="thr")
        assert (d1[-1].target, d1[-1].trigger) == ("thr", "imbalance")
        assert (d2[-1].target, d2[-1].trigger) == ("lat", "p99-high")
        assert (d3[-1].target, d3[-1].trigger) == ("bal", "p99-low")

    def test_imbalance_has_priority_over_latency(self):
        _, d, _, _ = run([{"p99": 400.0, "util": (0.97, 0.3, 0.3, 0.3)}] * 3)
        assert d[-1].target == "thr"

    def test_missing_signals_restart_the_count(self):
        codes, decisions, _, _ = run([HOT_STAGE, HOT_STAGE, None, HOT_STAGE, HOT_STAGE, HOT_STAGE])
        assert codes == "HHNHHS"
        assert decisions[2].reason == "SignalsMissing"

    def test_exit_samples_unlatch(self):
        # Latched by three hot samples while paused (no shift), then kept through two calm ones, dropped
        # by the third: the first unpaused hot sample after that does not shift.
        policy = ShiftRules(target_p99_ms=TARGET)
        state = DecisionState()
        for i in range(3):
            state, _ = decide(
                state, smp(2 * i, 400.0), policy, table(), 2 * i, overrides=Overrides(paused=True)
            )
        assert state.tracks[Trigger.LATENCY_HIGH].latched
        state, d = decide(state, smp(6, 150.0), policy, table(), 6)
        assert d.kind is DecisionKind.SHIFT  # still latched after one calm sample (EMA 0.3·150+0.7·400 > 240)
        state = DecisionState()
        for i in range(3):
            state, _ = decide(
                state, smp(2 * i, 400.0), policy, table(), 2 * i, overrides=Overrides(paused=True)
            )
        for i in range(3, 9):
            state, _ = decide(
                state, smp(2 * i, 100.0), policy, table(), 2 * i, overrides=Overrides(paused=True)
            )
        assert not state.tracks[Trigger.LATENCY_HIGH].latched


class TestNoPingPong:
    def test_alternating_noise_at_the_threshold_never_shifts(self):
        # Raw P99 alternates 220/260 around 1.2 × 200 = 240 ms: every other raw sample is over the
        # threshold, but the EMA (220, 232, 228.4, 237.9, 232.5, 240.8, 234.5, 242.2, 235.5, ...) is over
        # it at most every other sample, never three in a row.
        script = [{"p99": 220.0 if i % 2 == 0 else 260.0} for i in range(300)]
        codes, _, _, _ = run(script)
        assert codes == "H" * 300

    def test_without_smoothing_and_hysteresis_the_same_noise_would_shift(self):
        script = [{"p99": 220.0 if i % 2 == 0 else 260.0} for i in range(10)]
        raw = ShiftRules(target_p99_ms=TARGET, ema_alpha=1.0, enter_samples=1)
        assert run(script)[0] == "H" * 10
        assert run(script, policy=raw)[0][:2] == "HS"

    def test_random_noise_around_both_thresholds_shifts_at_most_once_per_dwell(self):
        # 40 minutes of P99 that swings between too slow (≈1.2× target) and too fast (≈0.7×) every 30 s,
        # with Gaussian noise; the active gear follows every SHIFT at once.
        rng = np.random.default_rng(7)
        script = []
        for i in range(1200):
            centre = 240.0 if (i // 15) % 2 == 0 else 140.0
            script.append({"p99": float(centre + rng.normal(0, 40))})
        codes, _decisions, _, _ = run(script)
        shift_times = [2.0 * i for i, c in enumerate(codes) if c == S]
        assert all(b - a >= 600.0 for a, b in itertools.pairwise(shift_times))
        assert len(shift_times) <= 2400 / 600 + 1
        assert R in codes  # re-triggers inside the dwell raised thresholds instead of shifting


class TestDwell:
    # No smoothing here (alpha 1), so each raw sample is what the triggers see; the EMA has its own tests.
    POLICY = ShiftRules(target_p99_ms=TARGET, ema_alpha=1.0)

    def test_retrigger_in_dwell_raises_that_threshold_and_a_quiet_dwell_resets_it(self):
        # t=0..4 slow → shift to the latency gear at t=4 (dwell until 604). t=6..10 fast → p99-low fires
        # at t=10 inside the dwell: level 1, threshold 0.65 × 200 = 130 ms. From t=12 P99 is 134 ms
        # (0.67 × target): over 130, so nothing fires, until t=610 when a whole dwell has passed since the
        # re-trigger and the threshold is back to 140 ms: met at 610, 612, 614 → shift at t=614.
        script = [SLOW] * 3 + [FAST] * 3 + [{"p99": 134.0}] * 305
        codes, decisions, state, active = run(script, policy=self.POLICY)
        assert codes[:6] == "HHSHHR"
        assert decisions[5].target == "bal" and decisions[5].trigger == "p99-low"
        assert [i for i, c in enumerate(codes) if c in "SR"] == [2, 5, 307]
        assert codes[307] == S and active == "bal"
        assert state.tracks[Trigger.LATENCY_LOW].level == 0

    def test_threshold_after_one_step(self):
        _, _, state, _ = run([SLOW] * 3 + [FAST] * 3, policy=self.POLICY)
        assert state.tracks[Trigger.LATENCY_LOW].level == 1
        assert state.thresholds(self.POLICY).p99_low_ratio == pytest.approx(0.65)
        assert state.last_retrigger_at == 10.0

    def test_dwell_counts_from_the_end_of_the_shift(self):
        # Shift at t=4 to the latency gear; the executor is busy (warm-up, drain, rollback window) for
        # 700 s, longer than the 600 s dwell, with P99 high all along. Counted from the shift's start the
        # dwell would be over when it settles and p99-high, latched on the transition's samples, would
        # move off the new gear at once. Counted from the end: no shift for a whole dwell after the last
        # busy sample, then enterSamples (3) fresh samples.
        policy = self.POLICY
        codes, _, state, active = run([SLOW] * 3, policy=policy)
        assert codes == "HHS" and active == "lat"
        t = 6.0
        for _ in range(350):  # busy from t=6 to t=704
            state, d = decide(state, smp(t, 400.0), policy, table("lat"), t, busy=True)
            assert d.reason == REASON_SHIFT_IN_PROGRESS
            t += 2.0
        last_busy = t - 2.0
        assert state.last_shift_at == last_busy
        assert not any(tr.latched or tr.on for tr in state.tracks.values())
        # Settled on "lat"; P99 now low enough for p99-low (towards "bal") on every sample.
        kinds = []
        while t <= last_busy + policy.dwell_s + 10:
            state, d = decide(state, smp(t, 20.0), policy, table("lat"), t)
            kinds.append((t, d.kind))
            t += 2.0
        shifts = [at for at, k in kinds if k is DecisionKind.SHIFT]
        raised = [at for at, k in kinds if k is DecisionKind.THRESHOLD_RAISED]
        # The first latch (3rd fresh sample) falls inside the new dwell: threshold raised, no shift.
        assert raised and raised[0] == last_busy + 6.0
        assert all(at >= last_busy + policy.dwell_s for at in shifts)

    def test_levels_stop_at_max(self):
        policy = replace(self.POLICY, max_retrigger_steps=2)
        codes, _, state, _ = run([SLOW] * 3 + [{"p99": 20.0}] * 12, policy=policy)
        assert codes == "HHS" + "HHR" * 4
        assert state.tracks[Trigger.LATENCY_LOW].level == 2


class TestCostBenefit:
    def test_bytes_moved_match_the_published_parameter_count(self):
        # Llama-3-8B: 8.03e9 parameters (model card) in bf16; a 2-stage gear loads every weight once,
        # the embedding and the LM head once each.
        lat = gears()[0]
        weights, kv = shift_cost_bytes(lat, ARCH, running=0, avg_context_tokens=1024)
        assert weights == pytest.approx(8.03e9 * 2, rel=0.01)
        assert kv == 0
        # KV of 10 running requests × 1024 tokens: 2 (K, V) · 8 kv heads · 128 dims · 2 B · 32 layers.
        _, kv = shift_cost_bytes(lat, ARCH, running=10, avg_context_tokens=1024)
        assert kv == 10 * 1024 * 2 * 8 * 128 * 2 * 32

    def test_replicated_stage_loads_its_weights_per_replica(self):
        one = GearView("a", Intent.LATENCY, stages(0, 16, 32))
        two = GearView("b", Intent.LATENCY, (StageView(0, 16, 2), StageView(16, 32, 1)))
        assert two.weight_bytes(ARCH) - one.weight_bytes(ARCH) == ARCH.stage_weight_bytes(0, 16)

    def test_small_gain_is_vetoed(self):
        # thr predicts 0.1 % more throughput than bal: gain 0.001 × 600 s = 0.6 s. Its 8 pods load at once,
        # so the cost is its largest pod's: the first or last 4 layers with the embedding or LM head
        # (128256 × 4096 bf16 = 1.05 GB) ≈ 1.9 GB / 2 GB/s ≈ 0.96 s.
        g = (gears()[1], replace(gears()[2], predicted_throughput_rps=16.016))
        policy = ShiftRules(target_p99_ms=TARGET)
        state = DecisionState()
        codes = ""
        for i in range(3):
            state, d = decide(state, smp(2 * i, **HOT_STAGE), policy, GearTable(g, "bal", ARCH), 2 * i)
            codes += CODE[d.kind]
        assert codes == "HHV"
        assert d.cost is not None and d.cost.gain_s == pytest.approx(0.6)
        layer = (8.03e9 - 2 * 128256 * 4096) * 2 / 32  # Llama-3-8B's bytes per decoder layer
        assert d.cost.cost_s == pytest.approx((4 * layer + 128256 * 4096 * 2) / 2e9, rel=0.02)
        assert d.cost.weight_bytes == pytest.approx(8.03e9 * 2, rel=0.01)  # every byte is still reported
        assert d.reason == "Imbalance"

    def test_pods_load_at_once_so_the_largest_stage_sets_the_cost(self):
        # Both gears move the whole model, but the 8-stage gear's pods each load an eighth of it in parallel.
        policy = ShiftRules(target_p99_ms=TARGET)
        lat = cost_benefit(Trigger.IMBALANCE, gears()[1], gears()[0], smp(0), policy, ARCH)
        thr = cost_benefit(Trigger.IMBALANCE, gears()[1], gears()[2], smp(0), policy, ARCH)
        assert lat.weight_bytes == pytest.approx(thr.weight_bytes, rel=1e-9)
        assert lat.cost_s == pytest.approx(ARCH.stage_weight_bytes(0, 16) / 2e9)
        assert thr.cost_s == pytest.approx(
            max(ARCH.stage_weight_bytes(a, a + 4) for a in range(0, 32, 4)) / 2e9
        )
        assert thr.cost_s < lat.cost_s / 1.5

    def test_large_gain_passes_and_latency_gain_uses_the_measured_p99(self):
        policy = ShiftRules(target_p99_ms=TARGET)
        cb = cost_benefit(Trigger.LATENCY_HIGH, gears()[1], gears()[0], smp(0, 400.0), policy, ARCH)
        assert cb.improvement == pytest.approx((400 - 120) / 400)
        assert cb.gain_s == pytest.approx(0.7 * 600)
        assert not cb.veto

    def test_no_prediction_cannot_veto(self):
        unknown = replace(gears()[2], predicted_throughput_rps=None)
        cb = cost_benefit(Trigger.IMBALANCE, gears()[1], unknown, smp(0), ShiftRules(), ARCH)
        assert cb.gain_s is None and not cb.veto


class TestHealthAndOverrides:
    def test_unhealthy_target_is_skipped(self):
        codes, decisions, _, active = run([HOT_STAGE] * 4, thr="OOMKilled")
        assert codes == "HHHH" and active == "bal"
        assert decisions[-1].reason == REASON_NO_HEALTHY_GEAR and decisions[-1].skipped == ("thr",)

    def test_unhealthy_target_falls_through_to_the_next_trigger(self):
        codes, _decisions, _, active = run(
            [{"p99": 400.0, "util": (0.97, 0.3, 0.3, 0.3)}] * 3, thr="OOMKilled"
        )
        assert codes == "HHS" and active == "lat"

    def test_force_gear_shifts_at_once_even_in_dwell_and_then_holds(self):
        codes, decisions, state, active = run([SLOW] * 3)
        assert active == "lat"
        codes, decisions, _, active = run(
            [CALM] * 3, state=state, active=active, t0=6, overrides=Overrides("thr")
        )
        assert codes == "SHH" and active == "thr"
        assert decisions[0].trigger == "forced" and decisions[1].reason == REASON_FORCED

    @pytest.mark.parametrize(
        ("force", "health", "reason"),
        [("nope", {}, REASON_FORCE_UNKNOWN), ("thr", {"thr": "OOMKilled"}, REASON_FORCE_UNHEALTHY)],
    )
    def test_force_gear_refused(self, force, health, reason):
        codes, decisions, _, _ = run([CALM], overrides=Overrides(force), **health)
        assert codes == "H" and decisions[0].reason == reason

    def test_without_a_signal_source_a_forced_gear_shifts_unsampled(self):
        def unsampled(overrides: Overrides, busy: bool = False, configured: bool = False) -> Decision:
            return decide(
                DecisionState(), None, ShiftRules(), table(), 0,
                overrides=overrides, busy=busy, signals_configured=configured,
            )[1]  # fmt: skip

        d = unsampled(Overrides("thr"))
        assert d.kind is DecisionKind.SHIFT and d.target == "thr" and d.trigger == "forced"
        assert d.p99_ms is None and d.qps is None  # nothing measured
        assert unsampled(Overrides("thr", paused=True)).kind is DecisionKind.NO_SIGNALS
        assert unsampled(Overrides("thr"), busy=True).kind is DecisionKind.NO_SIGNALS
        assert unsampled(Overrides()).kind is DecisionKind.NO_SIGNALS  # no instruction: hold
        # A configured source that gave no sample is a fault: the forced shift waits for it.
        assert unsampled(Overrides("thr"), configured=True).kind is DecisionKind.NO_SIGNALS

    def test_paused_and_busy_hold(self):
        codes, decisions, _state, _ = run([SLOW] * 5, overrides=Overrides(paused=True))
        assert codes == "HHHHH" and decisions[-1].reason == REASON_PAUSED
        _s, d = decide(DecisionState(), smp(0, 400.0), ShiftRules(), table(), 0, busy=True)
        assert d.reason == REASON_SHIFT_IN_PROGRESS


class TestState:
    def test_restart_mid_sequence_gives_the_same_decisions(self):
        script = [HOT_STAGE, HOT_STAGE] + [SLOW] * 3 + [FAST] * 5 + [{"p99": 132.0}] * 4
        whole, _, _, _ = run(script)
        first, _, state, active = run(script[:6])
        stored = json.loads(json.dumps(state.to_dict()))
        second, _, _, _ = run(script[6:], state=DecisionState.from_dict(stored), active=active, t0=12.0)
        assert first + second == whole
        assert DecisionState.from_dict(stored) == state

    def test_empty_status_is_the_initial_state(self):
        assert DecisionState.from_dict(None) == DecisionState()
        assert DecisionState.from_dict({}) == DecisionState()


class TestPolicy:
    @pytest.mark.parametrize(
        ("kwargs", "field"),
        [
            ({"ema_alpha": 0}, "spec.policy.emaAlpha"),
            ({"imbalance_low_utilization": 0.95}, "spec.policy.imbalanceHighUtilization"),
            ({"p99_high_ratio": 0.9}, "spec.policy.p99HighRatio"),
            ({"retrigger_step": 0.3}, "spec.policy.retriggerStep"),
            ({"warmup_share": 1.5}, "spec.policy.warmupShare"),
        ],
    )
    def test_bad_values_name_the_field(self, kwargs, field):
        with pytest.raises(PolicyError, match=field):
            ShiftRules(**kwargs)


class TestSaturation:
    """gearshift's saturation trigger: P99 > 1.2 × target and > saturationQueue waiting per replica → the
    healthy gear with the most predicted throughput above the active gear's (lat 10, bal 16, thr 30 rps)."""

    @pytest.mark.parametrize(
        ("active", "script", "health", "codes", "target", "trigger"),
        [
            # the defect: an overloaded one-intent-of-its-own latency gear is left for capacity
            ("lat", [OVERLOAD] * 3, {}, "HHS", "thr", "saturation"),
            # P99 high without a queue on the latency gear: p99-high points at it, saturation needs a queue
            ("lat", [SLOW] * 4, {}, "HHHH", None, None),
            # a queue with P99 within target is not saturation
            ("lat", [{"p99": 150.0, "queue": 5.0}] * 4, {}, "HHHH", None, None),
            # the biggest gear unhealthy: the next bigger one
            ("lat", [OVERLOAD] * 3, {"thr": "OOMKilled"}, "HHS", "bal", "saturation"),
            # from bal the only bigger gear is thr
            ("bal", [OVERLOAD] * 3, {}, "HHS", "thr", "saturation"),
            # on the biggest gear under overload p99-high does not trade capacity for latency: hold
            ("thr", [OVERLOAD] * 4, {}, "HHHH", None, None),
            # ... while without a queue it is FlexPipe's p99-high (docs/sources.md#shift-triggers) as before
            ("thr", [SLOW] * 3, {}, "HHS", "lat", "p99-high"),
        ],
    )
    def test_table(self, active, script, health, codes, target, trigger):
        got, decisions, _, _ = run(script, active=active, **health)
        assert got == codes
        if target is not None:
            assert (decisions[-1].target, decisions[-1].trigger) == (target, trigger)
            assert decisions[-1].reason == "Saturation" if trigger == "saturation" else True

    def test_shift_carries_the_smoothed_served_rate(self):
        # EMA (alpha 0.3) of 10, 12, 14 req/s: 10 → 0.3·12 + 0.7·10 = 10.6 → 0.3·14 + 0.7·10.6 = 11.62;
        # P99 400 ms on every sample, so the smoothed P99 is 400.
        script = [{**OVERLOAD, "qps": q} for q in (10.0, 12.0, 14.0)]
        codes, decisions, _, _ = run(script, active="lat")
        assert codes == "HHS"
        assert decisions[-1].trigger == "saturation"
        assert decisions[-1].qps == pytest.approx(11.62) and decisions[-1].p99_ms == pytest.approx(400.0)

    def test_all_bigger_gears_unhealthy(self):
        codes, decisions, _, active = run([OVERLOAD] * 4, active="lat", thr="OOMKilled", bal="P99Regression")
        assert codes == "HHHH" and active == "lat"
        assert decisions[-1].reason == REASON_NO_HEALTHY_GEAR and decisions[-1].skipped == ("bal", "thr")

    @pytest.mark.parametrize(("queue", "replicas", "met"), [(3.0, 2, True), (2.0, 2, False), (1.5, 1, True)])
    def test_queue_is_per_pipeline_replica(self, queue, replicas, met):
        assert saturated(smp(0, queue=queue), ShiftRules(), replicas) is met
        got = conditions(smp(0, 400.0, queue=queue), ShiftRules(target_p99_ms=TARGET), {}, replicas)
        assert got[Trigger.SATURATION] is met

    def test_replicas_of_the_active_gear_count(self):
        two = tuple(
            replace(g, stages=stages(0, 16, 32, replicas=2)) if g.name == "lat" else g for g in gears()
        )
        policy = ShiftRules(target_p99_ms=TARGET)
        state, codes = DecisionState(), ""
        for i in range(3):  # 2 waiting over 2 replicas = 1.0 per replica: not above 1
            state, d = decide(state, smp(2 * i, 400.0, queue=2.0), policy, GearTable(two, "lat", ARCH), 2 * i)
            codes += CODE[d.kind]
        assert codes == "HHH"

    def test_threshold_level_moves_its_p99_ratio(self):
        th = thresholds(ShiftRules(), {Trigger.SATURATION: 2})
        assert th.saturation_p99_ratio == pytest.approx(1.3) and th.p99_high_ratio == pytest.approx(1.2)

    def test_decision_carries_the_measured_p99_for_the_rollback_baseline(self):
        _, decisions, _, _ = run([OVERLOAD] * 3, active="lat")
        assert decisions[-1].p99_ms == pytest.approx(400.0)

    def test_retrigger_inside_the_dwell_raises_the_saturation_threshold(self):
        # lat → thr at t=4 (dwell to 604); thr overloaded (4 waiting, P99 400) and no bigger gear: hold.
        # Back on lat by force is not needed: run with follow off, lat stays active, saturation re-fires
        # at t=10 inside the dwell of the t=4 shift → level 1 (P99 ratio 1.25).
        policy = ShiftRules(target_p99_ms=TARGET, ema_alpha=1.0)
        codes, decisions, state, _ = run([OVERLOAD] * 6, active="lat", policy=policy, follow=False)
        assert codes == "HHSHHR"
        assert decisions[-1].trigger == "saturation" and state.tracks[Trigger.SATURATION].level == 1


class TestSaturationNoPingPong:
    def test_queue_noise_around_the_threshold_never_latches(self):
        # Queue alternates 0/2 (mean 1 = the threshold) with P99 400: its EMA (0, 0.6, 0.42, 0.894, 0.626,
        # 1.038, 0.727, 1.109, ...) tends to 1.176 / 0.824 in turn, never above 1 twice in a row.
        script = [{"p99": 400.0, "queue": 0.0 if i % 2 == 0 else 2.0} for i in range(300)]
        codes, _, _, active = run(script, active="lat")
        assert codes == "H" * 300 and active == "lat"

    def test_bursts_shift_at_most_once_per_dwell_and_never_back_under_overload(self):
        # 60 minutes: every 5 minutes a 90 s burst (P99 ≈ 500 ms, queue ≈ 8) on noisy calm traffic
        # (P99 ≈ 150 ms, queue ≈ 0.2). The active gear follows each SHIFT at once.
        rng = np.random.default_rng(11)
        script = []
        for i in range(1800):
            burst = (2.0 * i) % 300 < 90
            p99 = (500.0 if burst else 150.0) + float(rng.normal(0, 30))
            queue = max(0.0, (8.0 if burst else 0.2) + float(rng.normal(0, 0.5)))
            script.append({"p99": p99, "queue": queue})
        _codes, decisions, _, _ = run(script, active="lat")
        shifts = [
            (2.0 * i, d.target, d.trigger) for i, d in enumerate(decisions) if d.kind is DecisionKind.SHIFT
        ]
        assert shifts and shifts[0][1:] == ("thr", "saturation")
        assert all(b[0] - a[0] >= 600.0 for a, b in itertools.pairwise(shifts))
        assert len(shifts) <= 3600 / 600 + 1
        # no shift to the gear with less capacity while a burst is on (p99-high passes over lat); after a
        # burst the 1-minute P99 lags the emptied queue, so FlexPipe's p99-high
        # (docs/sources.md#shift-triggers) may still pick lat then
        assert all((t % 300) >= 90 for t, target, _ in shifts if target == "lat")


class TestHeldTriggers:
    """A series that should have a value and has none holds the triggers that read it; the moving
    average would otherwise go on from its last value as if it were fresh."""

    def test_which_triggers_read_what(self):
        from gearshift.control.shifting.decide import held_triggers
        from gearshift.control.smoothing import LatencyMetric

        p99 = {Trigger.SATURATION, Trigger.LATENCY_HIGH, Trigger.LATENCY_LOW}
        assert held_triggers(["ttft_p99_ms"], LatencyMetric.TTFT) == p99
        assert held_triggers(["ttft_p99_ms"], LatencyMetric.ITL) == set()  # decode reads ITL
        assert held_triggers(["itl_p99_ms", "ttft_p50_ms"], LatencyMetric.ITL) == p99
        assert held_triggers(["arrival_rps"], LatencyMetric.TTFT) == {Trigger.LOAD_HIGH, Trigger.LOAD_LOW}
        assert held_triggers(["e2e_p50_ms"], LatencyMetric.TTFT) == set()

    def test_a_latched_p99_trigger_does_not_fire_on_a_missing_p99(self):
        policy = ShiftRules(target_p99_ms=TARGET)
        state, now = DecisionState(), 0.0
        for i in range(2):  # two slow samples: p99-high one short of latching (enterSamples 3)
            now = 2.0 * i
            state, d = decide(state, smp(now, p99=400.0, qps=3.0), policy, table(), now)
            assert d.kind is DecisionKind.HOLD
        before = state.tracks[Trigger.LATENCY_HIGH]
        assert (before.on, before.latched) == (2, False)
        # Three samples whose P99 is missing while requests flow: the EMA still reads 400 ms (its last
        # value), but the P99 triggers neither count nor fire; the streak is kept for when it returns.
        for i in range(2, 5):
            now = 2.0 * i
            state, d = decide(
                state, smp(now, p99=None, qps=3.0), policy, table(), now, unavailable=("ttft_p99_ms",)
            )
            assert (d.kind, d.reason) == (DecisionKind.HOLD, "Steady")
            assert "held for series without a value: saturation, p99-high, p99-low" in d.message
            assert state.smoothed is not None and state.smoothed.ttft_p99_ms == 400.0
            assert state.tracks[Trigger.LATENCY_HIGH] == before
        # The P99 is back and still slow: the third sample in a row latches and shifts to the latency gear.
        state, d = decide(state, smp(10.0, p99=400.0, qps=3.0), policy, table(), 10.0)
        assert (d.kind, d.trigger, d.target) == (DecisionKind.SHIFT, "p99-high", "lat")

    def test_without_the_hold_the_stale_average_would_shift(self):
        # The same samples, the missing P99 not reported (as before): the EMA's last value latches.
        policy = ShiftRules(target_p99_ms=TARGET)
        codes, _, _, _ = run([SLOW, SLOW, {"p99": None, "qps": 3.0}], policy=policy)
        assert codes == "HHS"

    def test_other_triggers_run_while_the_p99_is_held(self):
        policy = ShiftRules(target_p99_ms=TARGET)
        state, d = DecisionState(), None
        for i in range(3):
            now = 2.0 * i
            sample = smp(now, p99=None, util=(0.97, 0.3, 0.3, 0.3), qps=3.0)
            state, d = decide(state, sample, policy, table(), now, unavailable=("ttft_p99_ms",))
        assert d is not None and (d.kind, d.trigger, d.target) == (DecisionKind.SHIFT, "imbalance", "thr")
