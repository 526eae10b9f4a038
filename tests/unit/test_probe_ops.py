"""The probe's timing loop and measured operators, run for real on the CPU (NumPy; torch CPU if installed)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from gearshift.facts.model import ModelArch
from gearshift.probe import ops
from gearshift.probe.backends import NumpyBackend, torch_available
from gearshift.probe.timing import Deadline, ProbeTimeoutError, summarize, time_op

# Attention-heavy shape: the s x s scores (4·b·n_q·s² bytes) dwarf everything else, so the activation
# peak can be counted by hand.
SCORES_HEAVY = ModelArch("scores-heavy", 2, 64, 4, 2, 16, 128, 1000)
SMALL = ModelArch("small", 2, 64, 4, 2, 16, 96, 1000)


def backends() -> list[Any]:
    params = [pytest.param("numpy", id="numpy")]
    params.append(
        pytest.param(
            "torch",
            id="torch-cpu",
            marks=pytest.mark.skipif(not torch_available(), reason="torch not installed (extra 'probe')"),
        )
    )
    return params


def make_backend(name: str) -> Any:
    if name == "numpy":
        return NumpyBackend()
    from gearshift.probe.backends import TorchBackend

    return TorchBackend("cpu")


def to_np(x: Any) -> np.ndarray:
    return x.numpy() if hasattr(x, "numpy") else np.asarray(x)


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class TestSummarize:
    def test_median_min_max_iqr(self):
        t = summarize([4.0, 1.0, 100.0, 3.0, 2.0], warmup=2)
        # Inclusive quartiles of 1,2,3,4,100: p25 = 2, p75 = 4.
        assert (t.median_ms, t.min_ms, t.max_ms, t.iqr_ms, t.reps, t.warmup) == (3.0, 1.0, 100.0, 2.0, 5, 2)
        assert t.spread == pytest.approx(2.0 / 3.0)

    def test_single_sample_has_no_spread(self):
        assert summarize([5.0]).iqr_ms == 0.0

    @pytest.mark.parametrize("bad", [[], [-1.0], [float("inf")], [float("nan")]])
    def test_refuses_bad_samples(self, bad):
        with pytest.raises(ValueError):
            summarize(bad)


class TestTimeOp:
    def test_warmup_untimed_then_reps(self):
        calls: list[str] = []
        timed: list[int] = []

        def timer(fn: Any) -> float:
            fn()
            timed.append(len(calls))
            return float(len(timed))

        t = time_op(lambda: calls.append("x"), timer, deadline=Deadline(60), what="op", warmup=3, reps=5)
        assert len(calls) == 8
        assert timed == [4, 5, 6, 7, 8]
        assert (t.reps, t.warmup, t.median_ms) == (5, 3, 3.0)

    def test_deadline_stops_after_min_reps(self):
        clock = FakeClock()
        deadline = Deadline(10, clock=clock)

        def timer(fn: Any) -> float:
            clock.t += 4.0  # each repetition takes 4 s of the 10 s budget
            return 1.0

        t = time_op(lambda: None, timer, deadline=deadline, what="op", warmup=0, reps=100, min_reps=3)
        assert t.reps == 3

    def test_deadline_before_min_reps_raises_naming_the_op(self):
        clock = FakeClock()
        deadline = Deadline(1, clock=clock)

        def timer(fn: Any) -> float:
            clock.t += 1.0
            return 1.0

        with pytest.raises(ProbeTimeoutError, match="matmul"):
            time_op(lambda: None, timer, deadline=deadline, what="matmul", warmup=0, reps=10, min_reps=3)

    def test_bad_rep_counts(self):
        with pytest.raises(ValueError, match="min_reps"):
            time_op(lambda: None, lambda fn: 1.0, deadline=Deadline(1), what="x", reps=2, min_reps=3)


def naive_attention(x: np.ndarray, w: dict[str, np.ndarray], arch: ModelArch) -> np.ndarray:
    """Per-sequence, per-head loops: an independent statement of grouped-query attention."""
    b, s, _ = x.shape
    d, group = arch.head_dim, arch.num_heads // arch.num_kv_heads
    out = np.zeros((b, s, arch.num_heads * d))
    for i in range(b):
        q, k, v = x[i] @ w["wq"], x[i] @ w["wk"], x[i] @ w["wv"]
        for hd in range(arch.num_heads):
            kv = hd // group
            qh, kh, vh = q[:, hd * d : (hd + 1) * d], k[:, kv * d : (kv + 1) * d], v[:, kv * d : (kv + 1) * d]
            sc = qh @ kh.T / np.sqrt(d)
            p = np.exp(sc - sc.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            out[i, :, hd * d : (hd + 1) * d] = p @ vh
    return out @ w["wo"]


@pytest.fixture(params=backends())
def bk(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A CPU backend, active: one BLAS/torch thread, as the probe runs it."""
    backend = make_backend(request.param)
    with backend.active():
        yield backend


class TestOperators:
    def test_attention_matches_naive(self, bk):
        w = ops.make_layer(bk, SMALL)
        x = bk.randn((2, 8, SMALL.hidden_size))
        got = to_np(ops.attention_block(bk, w, x, SMALL))
        want = naive_attention(
            to_np(x).astype(np.float64), {k: to_np(v).astype(np.float64) for k, v in w.items()}, SMALL
        )
        np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-6)

    def test_ffn_is_swiglu(self, bk):
        w = ops.make_layer(bk, SMALL)
        x = bk.randn((2, 5, SMALL.hidden_size))
        xn = to_np(x).astype(np.float64)
        g, u = xn @ to_np(w["w_gate"]), xn @ to_np(w["w_up"])
        want = (g / (1 + np.exp(-g)) * u) @ to_np(w["w_down"])
        np.testing.assert_allclose(to_np(ops.ffn_block(bk, w, x, SMALL)), want, rtol=1e-3, atol=1e-7)

    def test_matmul_tflops_is_flops_over_median(self, bk):
        r = ops.measure_matmul(bk, 128, Deadline(30), ops.Repeats(warmup=1, reps=5))
        assert r["flops"] == 2 * 128**3
        assert r["tflops"] == pytest.approx(2 * 128**3 / (r["timing"]["medianMs"] / 1e3) / 1e12)
        # Independent timing of the same product: the fastest repetitions agree in order of magnitude
        # (the minimum, not the median: other processes share these cores).
        a, b = bk.randn((128, 128)), bk.randn((128, 128))
        best = min(_timed(lambda: a @ b) for _ in range(5))
        assert 0.02 < r["timing"]["minMs"] / best < 50
        assert r["timing"]["minMs"] <= r["timing"]["medianMs"] <= r["timing"]["maxMs"]

    def test_copies_follow_stream_convention(self, bk):
        r = ops.measure_copies(bk, 4 << 20, Deadline(30), ops.Repeats(warmup=1, reps=4))
        assert r["bytes"] == 4 << 20
        d2d = r["deviceToDevice"]
        assert d2d["copyGBps"] == pytest.approx((4 << 20) / 1e9 / (d2d["timing"]["medianMs"] / 1e3))
        assert d2d["memoryGBps"] == pytest.approx(2 * d2d["copyGBps"])
        for key in ("hostToDevice", "deviceToHost"):
            assert r[key]["GBps"] == pytest.approx((4 << 20) / 1e9 / (r[key]["timing"]["medianMs"] / 1e3))


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


class TestFlopCounts:
    def test_attention_flops_by_matmul_shapes(self):
        a, b, s = SMALL, 3, 10
        h, d, nq, nkv = a.hidden_size, a.head_dim, a.num_heads, a.num_kv_heads
        projections = (
            2 * (b * s) * h * (nq * d) + 2 * 2 * (b * s) * h * (nkv * d) + 2 * (b * s) * (nq * d) * h
        )
        scores_and_values = 2 * (b * nq) * s * s * d * 2
        assert ops.attention_flops(a, b, s) == projections + scores_and_values

    def test_ffn_flops_three_matmuls(self):
        assert ops.ffn_flops(SMALL, 3, 10) == 3 * 2 * 30 * 64 * 96

    def test_moe_ffn_counts_active_experts(self):
        moe = ModelArch("moe", 2, 64, 4, 2, 16, 96, 1000, num_experts=8, experts_per_token=2)
        assert ops.ffn_flops(moe, 1, 10) == 2 * ops.ffn_flops(SMALL, 1, 10)


class TestMaxMicroBatch:
    S = 256

    def hand_peak_per_sequence(self) -> int:
        """Bytes per sequence at the attention peak: x, q, k, v, o (b·s·(h + 4·n_q·d)) and the scores."""
        a, s = SCORES_HEAVY, self.S
        return 4 * (s * (a.hidden_size + 4 * a.num_heads * a.head_dim) + a.num_heads * s * s)

    def test_measured_peak_close_to_hand_count(self):
        bk = NumpyBackend()
        budget = 10 * self.hand_peak_per_sequence()
        r = ops.measure_max_micro_batch(bk, SCORES_HEAVY, self.S, budget, Deadline(60), cap=4)
        assert r["method"] == "measured"
        assert [st["microBatch"] for st in r["steps"]] == [1, 2, 4]
        for st in r["steps"]:
            scores_only = 4 * st["microBatch"] * SCORES_HEAVY.num_heads * self.S**2
            assert st["peakBytes"] >= scores_only
            assert st["peakBytes"] == pytest.approx(
                st["microBatch"] * self.hand_peak_per_sequence(), rel=0.15
            )

    def test_largest_fitting_micro_batch_from_hand_formula(self):
        # 6 sequences' worth of budget: 4 fits, 8 does not.
        budget = 6 * self.hand_peak_per_sequence()
        r = ops.measure_max_micro_batch(NumpyBackend(), SCORES_HEAVY, self.S, budget, Deadline(60), cap=64)
        assert r["maxMicroBatch"] == 4
        assert [(st["microBatch"], st["fits"]) for st in r["steps"]] == [
            (1, True),
            (2, True),
            (4, True),
            (8, False),
        ]

    def test_nothing_fits_gives_zero(self):
        budget = self.hand_peak_per_sequence() // 2
        r = ops.measure_max_micro_batch(NumpyBackend(), SCORES_HEAVY, self.S, budget, Deadline(60))
        assert r["maxMicroBatch"] == 0

    def test_estimate_guard_skips_a_step_far_past_the_budget(self):
        budget = self.hand_peak_per_sequence() // 10
        r = ops.measure_max_micro_batch(NumpyBackend(), SCORES_HEAVY, self.S, budget, Deadline(60))
        assert r["steps"] == [
            {
                "microBatch": 1,
                "peakBytes": ops.layer_activation_elements(SCORES_HEAVY, 1, self.S) * 4,
                "fits": False,
                "why": "estimate",
            }
        ]

    def test_out_of_memory_stops_the_ramp_and_releases(self):
        class OomFrom4(NumpyBackend):
            """Runs the step for real, then reports out-of-memory for micro-batches of 4 and more."""

            released = 0
            last_batch = 0

            def randn(self, shape: tuple[int, ...]) -> np.ndarray:
                if len(shape) == 3:
                    self.last_batch = shape[0]
                return super().randn(shape)

            def peak_memory(self, fn: Any) -> int:
                peak = super().peak_memory(fn)
                if self.last_batch >= 4:
                    raise MemoryError("simulated out of memory")
                return peak

            def release(self) -> None:
                self.released += 1

        bk = OomFrom4()
        r = ops.measure_max_micro_batch(bk, SCORES_HEAVY, 32, 1 << 30, Deadline(60), cap=64)
        assert r["maxMicroBatch"] == 2
        assert r["steps"][-1] == {"microBatch": 4, "peakBytes": None, "fits": False, "why": "out of memory"}
        assert bk.released == 2  # once after the OOM, once on the way out

    @pytest.mark.parametrize("cap,budget", [(0, 1), (1, 0)])
    def test_bad_arguments(self, cap, budget):
        with pytest.raises(ValueError):
            ops.measure_max_micro_batch(NumpyBackend(), SCORES_HEAVY, 8, budget, Deadline(1), cap=cap)


class TestCpuThreads:
    def test_numpy_backend_caps_blas_threads_while_active(self):
        from threadpoolctl import threadpool_info

        bk = NumpyBackend(threads=1)
        with bk.active():
            assert {p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"} == {1}
        assert bk.describe()["threads"] == 1

    @pytest.mark.skipif(not torch_available(), reason="torch not installed (extra 'probe')")
    def test_torch_cpu_threads_restored_after(self):
        import torch

        from gearshift.probe.backends import TorchBackend

        before = torch.get_num_threads()
        with TorchBackend("cpu", threads=1).active():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == before
