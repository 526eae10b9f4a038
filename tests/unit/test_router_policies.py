"""Policy choices checked against scores computed by hand from seeds 000 and 003, not by the code tested."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import ClassVar

import pytest

from gearshift.facts.errors import PolicyError
from gearshift.router import policies as P
from gearshift.router.outlier import OutlierConfig
from gearshift.router.pool import BackendInfo, PolicyConfig, Pool

KV_PER_TOKEN = 131072  # Llama-3-8B: 2 (K, V) × 8 kv heads × 128 dims × 2 bytes × 32 layers


def pv(name: str, **kw: object) -> P.PodView:
    return P.PodView(name=name, **kw)  # type: ignore[arg-type]


class TestPrefillScore:
    """Three prefill pods and a decode peer; every term computed by hand."""

    decode = pv("d", role="decode", node="n-d", nic_gbps=100.0)
    req = P.RequestView(prompt_tokens=1000, max_tokens=200, kv_bytes_per_token=KV_PER_TOKEN)

    def pods(self, a_busy: bool = False) -> list[P.PodView]:
        a = pv(
            "a-h100",
            role="prefill",
            gpu_model="H100-80GB",
            node="n-a",
            nic_gbps=200.0,
            gpu_util=1.0 if a_busy else 0.5,
            kv_usage=0.25,
            running=8 if a_busy else 2,
            waiting=8 if a_busy else 2,
            inflight=1,
        )
        b = pv("b-a10", role="prefill", gpu_model="A10-24GB", node="n-b", nic_gbps=25.0)
        c = pv(
            "c-a100x4",
            role="prefill",
            gpu_model="A100-80GB",
            gpu_count=4,
            tp_size=4,
            node="n-c",
            nic_gbps=100.0,
            gpu_util=0.9,
            kv_usage=0.5,
            running=8,
            waiting=8,
        )
        return [a, b, c]

    @staticmethod
    def expected(a_busy: bool) -> dict[str, float]:
        # compute: seed prior × 0.85 (TP>1) × sqrt(gpus), divided by the largest (C: 0.75 × 0.85 × 2 = 1.275)
        comp = {"a": 1.0 / 1.275, "b": 0.30 / 1.275, "c": 1.275 / 1.275}
        load = {
            "a": 1 - (0.6 * (1.0 if a_busy else 0.5) + 0.4 * 0.25),
            "b": 1.0,
            "c": 1 - (0.6 * 0.9 + 0.4 * 0.5),
        }
        queue = {"a": 1 - (16 / 16 if a_busy else 4 / 16), "b": 1.0, "c": 0.0}
        prompt_bytes = 1000 * 131072
        # A and C reach D over 100 Gb/s (D's NIC), B over its own 25 Gb/s; latency 10 µs = 0.01 ms.
        t100 = prompt_bytes / (100e9 / 8) * 1000 + 0.01
        t25 = prompt_bytes / (25e9 / 8) * 1000 + 0.01
        net = {"a": 1 - t100 / 100, "b": 1 - t25 / 100, "c": 1 - t100 / 100}
        return {
            k: 0.30 * comp[k] + 0.25 * load[k] + 0.20 * queue[k] + 0.15 * net[k] + 0.10 * 1.0 for k in "abc"
        }

    def test_scores_match_hand_computation(self) -> None:
        scored = P.score_prefill(self.pods(), self.req, self.decode)
        exp = self.expected(False)
        assert [round(s.score, 9) for s in scored] == [round(exp[k], 9) for k in "abc"]
        # A ≈ 0.7696, B ≈ 0.7077, C ≈ 0.5993
        assert exp["a"] == pytest.approx(0.76955, abs=1e-4)
        assert P.best(scored).pod.name == "a-h100"

    def test_busy_fast_pod_loses_to_idle_slow_pod(self) -> None:
        scored = P.score_prefill(self.pods(a_busy=True), self.req, self.decode)
        exp = self.expected(True)
        assert [s.score for s in scored] == pytest.approx([exp[k] for k in "abc"], abs=1e-12)
        assert max(exp, key=exp.__getitem__) == "b"
        assert P.best(scored).pod.name == "b-a10"

    def test_no_decode_peer_gives_seed_default_network(self) -> None:
        scored = P.score_prefill(self.pods(), self.req, None)
        assert all(s.terms["network"] == 0.5 for s in scored)

    def test_same_node_transfer_is_free(self) -> None:
        peer = pv("d", node="n-a")
        assert P.network_score(1e9, self.pods()[0], peer) == 1.0

    def test_weights_are_configurable(self) -> None:
        # Only the queue term counts: B (empty queue) wins even though A is faster.
        w = {"compute": 0, "load": 0, "queue": 1, "network": 0, "cache": 0}
        scored = P.score_prefill(self.pods(), self.req, self.decode, w)
        assert [s.score for s in scored] == pytest.approx([0.75, 1.0, 0.0])
        assert P.best(scored).pod.name == "b-a10"


class TestDecodeScore:
    req = P.RequestView(prompt_tokens=1000, max_tokens=200, kv_bytes_per_token=KV_PER_TOKEN)

    def pods(self) -> list[P.PodView]:
        x = pv(
            "x-h100",
            role="decode",
            gpu_model="H100-80GB",
            kv_capacity_bytes=10 * 2**30,
            kv_usage=0.5,
            itl_ms=40.0,
            running=20,
            max_batch=32,
        )
        y = pv(
            "y-a10",
            role="decode",
            gpu_model="A10-24GB",
            kv_capacity_bytes=2 * 2**30,
            kv_usage=0.9,
            itl_prior_ms=30.0,
            running=2,
            max_batch=32,
        )
        z = pv("z-t4", role="decode", gpu_model="T4-16GB", kv_capacity_bytes=2**30, kv_usage=0.95)
        return [x, y, z]

    def test_headroom_filter_and_scores(self) -> None:
        kv = 1200 * 131072  # 157 286 400 bytes; Z has 53.7 MB free < 1.2 × kv → filtered
        scored = P.score_decode(self.pods(), self.req)
        assert [s.pod.name for s in scored] == ["x-h100", "y-a10"]
        ratio_y = 2 * 2**30 * 0.1 / kv
        itl = {"x": (1 + (50 - 40) / 50 * 0.2) / 1.2, "y": (1 + (50 - 30) / 50 * 0.2) / 1.2}
        mem = {"x": 1.0, "y": (ratio_y - 1.2) / 0.8 * 0.5}
        batch = {"x": 1 - abs(20 - 22.4) / 22.4, "y": 1 - abs(2 - 22.4) / 22.4}
        share = {"x": 3350 / 21, "y": 600 / 3}
        bw = {k: share[k] / max(share.values()) for k in share}
        exp = {k: 0.35 * itl[k] + 0.25 * mem[k] + 0.20 * batch[k] + 0.15 * bw[k] + 0.05 * 0.5 for k in "xy"}
        assert [s.score for s in scored] == pytest.approx([exp["x"], exp["y"]], abs=1e-12)
        assert exp["x"] == pytest.approx(0.87655, abs=1e-4)
        assert P.best(scored).pod.name == "x-h100"

    def test_a_request_between_the_pool_over_1_2_and_the_pool_takes_an_idle_pod(self) -> None:
        cap = 2**30
        req = P.RequestView(
            prompt_tokens=0, max_tokens=int(0.9 * cap / KV_PER_TOKEN), kv_bytes_per_token=KV_PER_TOKEN
        )
        assert cap / 1.2 < req.kv_bytes <= cap  # fits the pool, not with the 1.2 margin
        idle = pv("idle", role="decode", kv_capacity_bytes=cap, kv_usage=0.0)
        busy = pv("busy", role="decode", kv_capacity_bytes=cap, kv_usage=0.05)
        assert [s.pod.name for s in P.score_decode([idle, busy], req)] == ["idle"]
        # below 1/1.2 of the pool the PD guide's margin holds as it was: 1.2 × kv, not the whole pool
        half = P.RequestView(
            prompt_tokens=0, max_tokens=int(0.5 * cap / KV_PER_TOKEN), kv_bytes_per_token=KV_PER_TOKEN
        )
        assert P.has_headroom(pv("a", role="decode", kv_capacity_bytes=cap, kv_usage=0.35), half.kv_bytes)
        assert not P.has_headroom(pv("b", role="decode", kv_capacity_bytes=cap, kv_usage=0.45), half.kv_bytes)

    def test_no_headroom_anywhere_is_empty(self) -> None:
        big = P.RequestView(prompt_tokens=100_000, max_tokens=100_000, kv_bytes_per_token=KV_PER_TOKEN)
        assert P.score_decode(self.pods(), big) == []

    @pytest.mark.parametrize(
        ("itl", "seed_value"),
        [(0.0, 1.2), (25.0, 1.1), (50.0, 1.0), (75.0, 0.5), (100.0, 0.0), (500.0, 0.0)],
    )
    def test_itl_score_is_seed_over_1_2(self, itl: float, seed_value: float) -> None:
        assert P.itl_score(itl) == pytest.approx(seed_value / 1.2)
        assert 0.0 <= P.itl_score(itl) <= 1.0

    @pytest.mark.parametrize(
        ("ratio", "expected"),
        [(1.0, 0.0), (1.2, 0.0), (1.6, 0.25), (2.0, 0.5), (4.0, 0.75), (6.0, 1.0), (60, 1.0)],
    )
    def test_memory_score_piecewise(self, ratio: float, expected: float) -> None:
        assert P.memory_score(ratio * 1000.0, 1000.0) == pytest.approx(expected)

    def test_batch_score_zero_max_is_guarded(self) -> None:
        assert P.batch_score(3, 0) == 0.0
        assert P.batch_score(7, 10) == 1.0
        assert P.batch_score(0, 10) == 0.0


class FixedRng(random.Random):
    def __init__(self, u: float, pair: tuple[int, int] = (0, 1)) -> None:
        super().__init__(0)
        self.u, self.pair = u, pair

    def random(self) -> float:
        return self.u

    def sample(self, population, k, *, counts=None):  # type: ignore[no-untyped-def, override]
        return list(self.pair)


class TestFastChatPolicies:
    pods: ClassVar[list[P.PodView]] = [
        pv("h100", role="prefill", gpu_model="H100-80GB", queue_length=3),
        pv("a10", role="prefill", gpu_model="A10-24GB", queue_length=1),
        pv("a100", role="prefill", gpu_model="A100-80GB", queue_length=2),
    ]
    # datasheet bf16 TFLOPS / H100 SXM's 989
    speeds: ClassVar[list[float]] = [1.0, 125 / 989, 312 / 989]

    def test_shortest_queue_uses_profile_speed(self) -> None:
        keys = [3 / self.speeds[0], 1 / self.speeds[1], 2 / self.speeds[2]]  # 3, 7.91, 6.34
        assert P.shortest_queue(self.pods, "prefill") == keys.index(min(keys)) == 0

    def test_shortest_queue_speed_one_is_fastchat(self) -> None:
        assert P.shortest_queue(self.pods, "prefill", speed_one=True) == 1

    def test_decode_speed_is_hbm_bandwidth(self) -> None:
        assert P.pod_speed(self.pods[1], "decode") == pytest.approx(600 / 3350)
        assert P.pod_speed(pv("x", gpu_model="A10-24GB", gpu_count=2), "prefill") == pytest.approx(
            125 / 989 * 2 * 0.85
        )

    @pytest.mark.parametrize(("u", "index"), [(0.5, 0), (0.70, 1), (0.9, 2), (0.0, 0), (0.9999, 2)])
    def test_lottery_cumulative_choice(self, u: float, index: int) -> None:
        total = sum(self.speeds)  # 1.4419: boundaries at 1.0 and 1.1264 → u = 0.6935 and 0.7812
        acc, want = 0.0, None
        for i, s in enumerate(self.speeds):
            acc += s
            if u * total < acc:
                want = i
                break
        assert want == index
        assert P.lottery(self.pods, "prefill", FixedRng(u)) == index

    def test_lottery_frequencies(self) -> None:
        rng = random.Random(1234)
        n = 20000
        counts = [0, 0, 0]
        for _ in range(n):
            counts[P.lottery(self.pods, "prefill", rng)] += 1
        total = sum(self.speeds)
        for c, s in zip(counts, self.speeds, strict=True):
            p = s / total
            assert abs(c / n - p) < 4 * math.sqrt(p * (1 - p) / n)

    def test_lottery_zero_speed_refuses(self) -> None:
        with pytest.raises(P.NoPodError):
            P.lottery([pv("x", speed=0.0)], "prefill", random.Random(0))

    def test_no_pod_message_says_what_the_pool_does(self) -> None:
        assert (
            str(P.NoPodError("both", "no healthy pod"))
            == "no serving (role both) pod available: no healthy pod"
        )
        assert str(P.NoPodError("decode", "x")) == "no decode pod available: x"

    def test_power_of_two_and_least_request(self) -> None:
        pods = [pv("p0", inflight=5), pv("p1", inflight=2), pv("p2", inflight=1)]
        assert P.power_of_two(pods, "prefill", FixedRng(0, (0, 1))) == 1
        assert P.power_of_two(pods, "prefill", FixedRng(0, (2, 1))) == 2
        assert P.power_of_two([pv("a", inflight=1), pv("b", inflight=1)], "prefill", FixedRng(0, (1, 0))) == 1
        assert P.least_request(pods, "prefill") == 2
        assert [P.round_robin(pods, "prefill", n) for n in range(4)] == [0, 1, 2, 0]

    def test_pipeline_speed(self) -> None:
        # 16 layers on an H100 (1.0) + 16 on an A10 (125/989): 32 / (16 + 16 · 989/125)
        assert P.pipeline_speed([(16, 1.0), (16, 125 / 989)]) == pytest.approx(32 / (16 + 16 * 989 / 125))
        with pytest.raises(ValueError, match="positive"):
            P.pipeline_speed([(0, 1.0)])


class TestPoolPick:
    def pool(self, policy: str, speed_one: bool = False) -> Pool:
        pool = Pool(PolicyConfig(policy=policy, speed_one=speed_one), random.Random(7))
        pool.set_members(
            [
                BackendInfo("fast", "http://127.0.0.1:1", "prefill", gpu_model="H100-80GB"),
                BackendInfo("slow", "http://127.0.0.1:2", "prefill", gpu_model="T4-16GB"),
            ]
        )
        return pool

    def test_shortest_queue_counts_the_pick(self) -> None:
        # speed 1 (FastChat): picks alternate because each pick adds 1 to the chosen queue.
        pool = self.pool("shortest-queue", speed_one=True)
        req = P.RequestView(prompt_tokens=10)
        names = [pool.pick("prefill", req, 0.0).info.name for _ in range(4)]
        assert names == ["fast", "slow", "fast", "slow"]

    def test_shortest_queue_with_speed_prefers_fast(self) -> None:
        # FastChat: an empty queue scores 0 whatever the speed, so pick 2 goes to the empty T4. Then the
        # T4's key is 1 / (65/989) = 15.2 and the H100 (speed 1) takes picks while its queue is ≤ 15.
        pool = self.pool("shortest-queue")
        req = P.RequestView(prompt_tokens=10)
        names = [pool.pick("prefill", req, 0.0).info.name for _ in range(18)]
        assert names == ["fast", "slow"] + ["fast"] * 15 + ["slow"]

    def test_ejected_pods_are_skipped_until_panic(self) -> None:
        pool = self.pool("round-robin")
        pool.backends["fast"].ejected_until = 10.0
        req = P.RequestView(prompt_tokens=10)
        # 1 of 2 available = 50 %: not below Envoy's 50 % panic threshold, so the ejected pod is skipped.
        assert {pool.pick("prefill", req, 5.0).info.name for _ in range(3)} == {"slow"}
        assert pool.panic["prefill"] is False
        assert {pool.pick("prefill", req, 11.0).info.name for _ in range(2)} == {"fast", "slow"}
        # 0 of 2 available: panic mode routes to both rather than refusing.
        pool.backends["slow"].healthy = False
        pool.backends["fast"].ejected_until = 20.0
        assert {pool.pick("prefill", req, 12.0).info.name for _ in range(2)} == {"fast", "slow"}
        assert pool.panic["prefill"] is True
        # with panic mode off (threshold 0) nothing is routable
        pool.outlier = OutlierConfig(panic_threshold_percent=0)
        with pytest.raises(P.NoPodError, match="no prefill pod available: every pod was tried already"):
            pool.pick("prefill", req, 12.0)

    def test_bad_policy_and_weights_name_the_field(self) -> None:
        with pytest.raises(PolicyError, match=r"router\.policy"):
            PolicyConfig(policy="fastest")
        with pytest.raises(PolicyError, match=r"router\.weights\.prefill\.speed"):
            PolicyConfig(prefill_weights={"speed": 1.0})
        with pytest.raises(PolicyError, match=r"router\.weights\.decode\.itl"):
            PolicyConfig(decode_weights={"itl": -1.0})


class TestQueueAsExpectedFinish:
    """Correction 8: the prefill queue term is ``1 − (depth + 1) × service_ms / target_ttft_ms`` (by hand)."""

    # 30 ms prefill on the reference card; the A10 is given speed 0.125 (8× slower), so 240 ms there.
    req = P.RequestView(prompt_tokens=1000, max_tokens=16, prefill_ms_ref=30.0)

    @staticmethod
    def h100(depth: int, util: float = 1.0) -> P.PodView:
        return pv("h100", role="prefill", gpu_model="H100-80GB", speed=1.0, gpu_util=util, waiting=depth)

    @staticmethod
    def a10(depth: int, util: float = 1.0) -> P.PodView:
        return pv("a10", role="prefill", gpu_model="A10-24GB", speed=0.125, gpu_util=util, waiting=depth)

    @staticmethod
    def seed_score(compute: float, util: float, queue: float) -> float:
        # the PD guide weights (docs/sources.md#prefill-score); no decode peer → network 0.5; model cached →
        # 1.0; kv_usage 0
        return 0.30 * compute + 0.25 * (1 - 0.6 * util) + 0.20 * queue + 0.15 * 0.5 + 0.10 * 1.0

    def test_term_values(self) -> None:
        assert P.queue_score(self.h100(4), self.req) == pytest.approx(1 - 5 * 30 / 200)  # 0.25
        assert P.queue_score(self.a10(0), self.req) == pytest.approx(1 - 240 / 200)  # −0.2, not clamped
        assert P.queue_score(self.h100(4), self.req, target_ttft_ms=400) == pytest.approx(1 - 150 / 400)
        # unknown prefill time → the PD guide's count form 1 − min(depth / 16, 1)
        assert P.queue_score(self.h100(4), P.RequestView(prompt_tokens=1000)) == pytest.approx(0.75)
        assert P.queue_score(self.h100(40), None) == 0.0

    def test_fast_pod_keeps_a_moderate_queue(self) -> None:
        # H100 busy with 4 queued (finish 150 ms); A10 idle (finish 240 ms).
        pods = [self.h100(4), self.a10(0, util=0.0)]
        scored = P.score_prefill(pods, self.req)
        h = self.seed_score(1.0, 1.0, 0.25)  # 0.30 + 0.10 + 0.05 + 0.075 + 0.10 = 0.625
        a = self.seed_score(0.3, 0.0, -0.2)  # 0.09 + 0.25 − 0.04 + 0.075 + 0.10 = 0.475
        assert [s.score for s in scored] == pytest.approx([h, a])
        assert (round(h, 6), round(a, 6)) == (0.625, 0.475)
        assert P.best(scored).pod.name == "h100"

    def test_deep_fast_queue_spills_to_slow_pod(self) -> None:
        # Both busy; H100 has 20 queued (finish 630 ms), A10 one (finish 480 ms).
        pods = [self.h100(20), self.a10(1)]
        scored = P.score_prefill(pods, self.req)
        h = self.seed_score(1.0, 1.0, 1 - 21 * 30 / 200)  # 0.30 + 0.10 − 0.43 + 0.175 = 0.145
        a = self.seed_score(0.3, 1.0, 1 - 2 * 240 / 200)  # 0.09 + 0.10 − 0.28 + 0.175 = 0.085
        assert (round(h, 6), round(a, 6)) == (0.145, 0.085)
        assert [s.score for s in scored] == pytest.approx([h, a])
        # 630 ms vs 480 ms: within the compute term's ~210 ms preference, the H100 still wins ...
        assert P.best(scored).pod.name == "h100"
        # ... at 30 queued (finish 930 ms, 450 ms later than the A10) it no longer does.
        deeper = P.score_prefill([self.h100(30), self.a10(1)], self.req)
        assert deeper[0].score == pytest.approx(self.seed_score(1.0, 1.0, 1 - 31 * 30 / 200))  # −0.155
        assert P.best(deeper).pod.name == "a10"
        # The PD guide's saturating count form keeps the H100 at any depth: 0.575 against 0.5525.
        seed = P.score_prefill([self.h100(30), self.a10(1)], P.RequestView(prompt_tokens=1000))
        assert [s.score for s in seed] == pytest.approx([0.575, 0.5525])
        assert P.best(seed).pod.name == "h100"


def test_prefill_ms_per_token_is_the_roofline() -> None:
    from gearshift.router.settings import prefill_ms_per_token

    # Llama-3-8B per layer: attention 2·4096² + 2·4096·1024, MLP 3·4096·14336; 2 FLOPs per weight;
    # 32 layers; H100 SXM 989 TFLOPS bf16 at MFU 0.5.
    h, kv, ff = 4096, 1024, 14336
    flops = 32 * 2 * (2 * h * h + 2 * h * kv + 3 * h * ff)
    expected_ms = flops / (989e12 * 0.5) * 1e3
    model = Path(__file__).resolve().parents[2] / "examples" / "models" / "llama-3-8b.json"
    assert prefill_ms_per_token(str(model)) == pytest.approx(expected_ms, rel=1e-9)
    assert 1155 * expected_ms == pytest.approx(32.6, abs=0.1)
    assert prefill_ms_per_token(None) == 0.0
