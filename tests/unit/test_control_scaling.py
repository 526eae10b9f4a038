"""The autoscaler's pure decisions (control/autoscale/scaling.py): recommendation, stabilisation windows,
immediate scale-up, scale-to-min, coordination with shifts, placement, drain, counters. Expected values are
worked out by hand in each case's comment."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from gearshift.api.rolespec import ScalingSpec
from gearshift.control.autoscale import scaling as S
from gearshift.control.autoscale.scaling import (
    NodeView,
    ScaleKind,
    ScaleSample,
    ScaleState,
    ScalingPolicy,
    StageNeed,
)

P = ScalingPolicy(
    min_replicas=1,
    max_replicas=4,
    kv_cache_usage=0.8,
    waiting_per_replica=4.0,
    slo_ratio=1.0,
    scale_up_s=30,
    scale_down_s=60,
    scale_to_min_delay_s=120,
)
BUSY = {"running": 3.0}  # a non-idle role


def smp(t: float, **kw: Any) -> ScaleSample:
    return ScaleSample(at=t, **kw)


class TestFromSpec:
    def test_copies_every_knob(self) -> None:
        spec = ScalingSpec.model_validate(
            {
                "minReplicas": 2,
                "maxReplicas": 6,
                "targets": {"kvCacheUsage": 0.7, "waitingPerReplica": 2, "sloRatio": 1.5},
                "windows": {"scaleUpS": 5, "scaleDownS": 50, "scaleToMinDelayS": 500},
            }
        )
        assert ScalingPolicy.from_spec(spec) == ScalingPolicy(2, 6, 0.7, 2.0, 1.5, 5.0, 50.0, 500.0)


class TestRecommend:
    @pytest.mark.parametrize(
        ("current", "sample", "want", "reason"),
        [
            # kv 0.4 / 0.8 = 0.5; ceil(2 × 0.5) = 1
            (2, {"kv_cache_usage": 0.4}, 1, S.REASON_LOW_LOAD),
            # 0.84 / 0.8 = 1.05, inside the 10% tolerance
            (2, {"kv_cache_usage": 0.84}, 2, S.REASON_STEADY),
            # 1.0 / 0.8 = 1.25; ceil(2.5) = 3
            (2, {"kv_cache_usage": 1.0}, 3, S.REASON_KV_CACHE),
            # waiting 20 / 2 replicas = 10 per replica / 4 = 2.5; ceil(5) = 5 -> max 4
            (2, {"waiting": 20.0}, 4, S.REASON_WAITING),
            # P99 1.5 × SLO / sloRatio 1 = 1.5; ceil(1.5) = 2
            (1, {"p99_ratio": 1.5}, 2, S.REASON_SLO),
            # kv 0.5 -> ceil(2 × 0.625) = 2, but 3 rejections ask current + 1 = 3
            (2, {"kv_cache_usage": 0.5, "no_headroom": 3}, 3, S.REASON_NO_HEADROOM),
            # no load at all: ratio 0 -> ceil(0) = 0 -> floor max(min 1, 1) = 1
            (3, {}, 1, S.REASON_LOW_LOAD),
            # exactly on target: 0.8 / 0.8 = 1
            (3, {"kv_cache_usage": 0.8}, 3, S.REASON_STEADY),
            # the largest ratio governs: kv 0.625, waiting 12/3/4 = 1, P99 2.0 -> ceil(6) = 6 -> max 4
            (3, {"kv_cache_usage": 0.5, "waiting": 12.0, "p99_ratio": 2.0}, 4, S.REASON_SLO),
            # P99 well inside the SLO is no load measure: kv 0.4 / 0.8 = 0.5 scales 2 -> 1 regardless
            (2, {"kv_cache_usage": 0.4, "p99_ratio": 0.65}, 1, S.REASON_LOW_LOAD),
            # ... nor does it hold replicas up on its own (decode ITL barely falls with load)
            (2, {"p99_ratio": 0.65}, 1, S.REASON_LOW_LOAD),
            # near the SLO (0.95 within the band) a scale-down would breach it: hold
            (2, {"kv_cache_usage": 0.4, "p99_ratio": 0.95}, 2, S.REASON_STEADY),
            # inside the band but not above it, the P99 asks for no scale-up either
            (2, {"kv_cache_usage": 0.8, "p99_ratio": 1.05}, 2, S.REASON_STEADY),
        ],
    )
    def test_table(self, current: int, sample: dict[str, Any], want: int, reason: str) -> None:
        r = S.recommend(smp(0, **sample), current, P)
        assert (r.replicas, r.reason) == (want, reason)

    def test_floor_is_one_even_with_min_zero(self) -> None:
        assert S.recommend(smp(0), 2, replace(P, min_replicas=0)).replicas == 1

    def test_waiting_target_zero_disables_it(self) -> None:
        assert S.recommend(smp(0, waiting=100.0), 1, replace(P, waiting_per_replica=0)).replicas == 1


# (t, sample fields or None for "signals missing", shifting) -> (kind, target, reason) per step.
Step = tuple[float, dict[str, Any] | None, bool]
Want = tuple[ScaleKind, int, str]
H, U, D = ScaleKind.HOLD, ScaleKind.UP, ScaleKind.DOWN

SEQUENCES: dict[str, tuple[ScalingPolicy, int, list[Step], list[Want]]] = {
    # kv 1.0 -> ceil(1 × 1.25) = 2 must hold scaleUpS 30 s: up at t=30
    "up-after-window": (
        P,
        1,
        [(t, {"kv_cache_usage": 1.0}, False) for t in (0, 10, 20, 30)],
        [(H, 1, S.REASON_UP_WINDOW)] * 3 + [(U, 2, S.REASON_KV_CACHE)],
    ),
    # from 2: kv 1.6 -> 4, kv 1.0 -> ceil(2.5) = 3, kv 1.6 -> 4: the run's lowest (3) wins at t=30
    "up-takes-run-minimum": (
        P,
        2,
        [
            (0, {"kv_cache_usage": 1.6}, False),
            (10, {"kv_cache_usage": 1.0}, False),
            (30, {"kv_cache_usage": 1.6}, False),
        ],
        [(H, 2, S.REASON_UP_WINDOW), (H, 2, S.REASON_UP_WINDOW), (U, 3, S.REASON_KV_CACHE)],
    ),
    # a steady sample at t=10 restarts the run: t=20 starts anew, 40 is 20 s in, 50 is 30 s in
    "crossing-restarts-window": (
        P,
        1,
        [
            (0, {"kv_cache_usage": 1.0}, False),
            (10, {"kv_cache_usage": 0.8}, False),
            (20, {"kv_cache_usage": 1.0}, False),
            (40, {"kv_cache_usage": 1.0}, False),
            (50, {"kv_cache_usage": 1.0}, False),
        ],
        [
            (H, 1, S.REASON_UP_WINDOW),
            (H, 1, S.REASON_STEADY),
            (H, 1, S.REASON_UP_WINDOW),
            (H, 1, S.REASON_UP_WINDOW),
            (U, 2, S.REASON_KV_CACHE),
        ],
    ),
    # router rejections: +1 at once, no window; the next rejection (new replica Ready) adds another
    "no-headroom-immediate": (
        P,
        1,
        [
            (0, {"no_headroom": 2, **BUSY}, False),
            (2, {"no_headroom": 1, **BUSY}, False),
            (4, {"kv_cache_usage": 0.8, **BUSY}, False),
        ],
        [(U, 2, S.REASON_NO_HEADROOM), (U, 3, S.REASON_NO_HEADROOM), (H, 3, S.REASON_STEADY)],
    ),
    # kv 0.2 from 3: ceil(3 × 0.25) = 1, held scaleDownS 60 s (busy, so not idle)
    "down-after-window": (
        P,
        3,
        [(t, {"kv_cache_usage": 0.2, **BUSY}, False) for t in (0, 30, 60)],
        [(H, 3, S.REASON_DOWN_WINDOW), (H, 3, S.REASON_DOWN_WINDOW), (D, 1, S.REASON_LOW_LOAD)],
    ),
    # KV usage missing while requests run reads as no load (waiting 0): without the hold it would
    # drain 3 -> 1 after 60 s. Held while missing (the run restarts), then the window runs from t=90.
    "missing-series-is-not-low-load": (
        P,
        3,
        [
            (0, {"missing": ("KV-cache usage (q)",), **BUSY}, False),
            (30, {"missing": ("KV-cache usage (q)",), **BUSY}, False),
            (60, {"missing": ("KV-cache usage (q)",), **BUSY}, False),
            (90, {"kv_cache_usage": 0.2, **BUSY}, False),
            (150, {"kv_cache_usage": 0.2, **BUSY}, False),
        ],
        [
            (H, 3, S.REASON_SERIES_MISSING),
            (H, 3, S.REASON_SERIES_MISSING),
            (H, 3, S.REASON_SERIES_MISSING),
            (H, 3, S.REASON_DOWN_WINDOW),
            (D, 1, S.REASON_LOW_LOAD),
        ],
    ),
    # a scale-up on what is known still goes: waiting 12 on 1 replica (4 per replica) with the P99 missing
    "missing-series-still-scales-up": (
        P,
        1,
        [(t, {"waiting": 12.0, "missing": ("P99 (q)",), **BUSY}, False) for t in (0, 30)],
        [(H, 1, S.REASON_UP_WINDOW), (U, 3, S.REASON_WAITING)],
    ),
    # from 4: kv 0.2 -> 1, kv 0.5 -> ceil(2.5) = 3, kv 0.2 -> 1: the run's highest (3) wins at t=60
    "down-takes-run-maximum": (
        P,
        4,
        [
            (0, {"kv_cache_usage": 0.2, **BUSY}, False),
            (30, {"kv_cache_usage": 0.5, **BUSY}, False),
            (60, {"kv_cache_usage": 0.2, **BUSY}, False),
        ],
        [(H, 4, S.REASON_DOWN_WINDOW), (H, 4, S.REASON_DOWN_WINDOW), (D, 3, S.REASON_LOW_LOAD)],
    ),
    # min 0: idle from t=0; the down window (60 s) brings 2 -> 1 (the load path's floor); idle 120 s
    # reaches min 0; idle at 0 holds; one waiting request activates 1 at once
    "idle-scale-to-zero-and-activate": (
        replace(P, min_replicas=0),
        2,
        [
            (0, {}, False),
            (60, {}, False),
            (90, {}, False),
            (120, {}, False),
            (130, {}, False),
            (140, {"waiting": 1.0}, False),
        ],
        [
            (H, 2, S.REASON_DOWN_WINDOW),
            (D, 1, S.REASON_LOW_LOAD),
            (H, 1, S.REASON_STEADY),
            (D, 0, S.REASON_IDLE),
            (H, 0, S.REASON_STEADY),
            (U, 1, S.REASON_ACTIVATE),
        ],
    ),
    # a shift in flight holds and restarts the window: run from 30, up at 60 (not at 30)
    "shift-holds-and-restarts": (
        P,
        1,
        [
            (0, {"kv_cache_usage": 1.0}, False),
            (20, {"kv_cache_usage": 1.0}, True),
            (30, {"kv_cache_usage": 1.0}, False),
            (50, {"kv_cache_usage": 1.0}, False),
            (60, {"kv_cache_usage": 1.0}, False),
        ],
        [
            (H, 1, S.REASON_UP_WINDOW),
            (H, 1, S.REASON_SHIFT),
            (H, 1, S.REASON_UP_WINDOW),
            (H, 1, S.REASON_UP_WINDOW),
            (U, 2, S.REASON_KV_CACHE),
        ],
    ),
    # a shift in flight also holds the immediate trigger
    "shift-holds-headroom": (
        P,
        1,
        [(0, {"no_headroom": 5, **BUSY}, True), (2, {"no_headroom": 5, **BUSY}, False)],
        [(H, 1, S.REASON_SHIFT), (U, 2, S.REASON_NO_HEADROOM)],
    ),
    # missing signals hold and restart the window
    "signals-missing": (
        P,
        1,
        [
            (0, {"kv_cache_usage": 1.0}, False),
            (20, None, False),
            (30, {"kv_cache_usage": 1.0}, False),
            (60, {"kv_cache_usage": 1.0}, False),
        ],
        [
            (H, 1, S.REASON_UP_WINDOW),
            (H, 1, S.REASON_NO_SIGNALS),
            (H, 1, S.REASON_UP_WINDOW),
            (U, 2, S.REASON_KV_CACHE),
        ],
    ),
    # below min / above max are corrected at once, whatever the load
    "below-min": (replace(P, min_replicas=2), 1, [(0, {}, False)], [(U, 2, S.REASON_BELOW_MIN)]),
    "above-max": (P, 6, [(0, {"kv_cache_usage": 1.0}, False)], [(D, 4, S.REASON_ABOVE_MAX)]),
    # at max, more load holds with AtMaxReplicas (never above max)
    "at-max": (P, 4, [(0, {"kv_cache_usage": 1.0}, False)], [(H, 4, S.REASON_AT_MAX)]),
}


class TestDecideSequences:
    @pytest.mark.parametrize("case", sorted(SEQUENCES))
    def test_sequence(self, case: str) -> None:
        policy, start, steps, want = SEQUENCES[case]
        samples = [smp(t, **kw) if kw is not None else None for t, kw, _ in steps]
        state, current, got = ScaleState(), start, []
        for (t, _, busy), s in zip(steps, samples, strict=True):
            state, d = S.decide_scale(
                state, s, policy, current=current, ready=current, now=t, shift_in_flight=busy
            )
            got.append((d.kind, d.target, d.reason))
            current = d.target
        assert got == want

    @pytest.mark.parametrize("case", sorted(SEQUENCES))
    def test_never_outside_min_max_after_first_step(self, case: str) -> None:
        policy, start, steps, _ = SEQUENCES[case]
        state, current = ScaleState(), start
        for t, kw, busy in steps:
            s = smp(t, **kw) if kw is not None else None
            state, d = S.decide_scale(
                state, s, policy, current=current, ready=current, now=t, shift_in_flight=busy
            )
            assert policy.min_replicas <= d.target <= policy.max_replicas
            current = d.target

    def test_pending_replicas_hold_further_scale_up(self) -> None:
        _, d = S.decide_scale(ScaleState(), smp(0, no_headroom=3), P, current=2, ready=1, now=0)
        assert (d.kind, d.target, d.reason) == (H, 2, S.REASON_PENDING)

    def test_pending_replicas_do_not_hold_scale_down(self) -> None:
        st = ScaleState(down_since=0.0, down_ceiling=1)
        _, d = S.decide_scale(st, smp(60, kv_cache_usage=0.1, **BUSY), P, current=3, ready=1, now=60)
        assert (d.kind, d.target) == (D, 1)

    def test_run_decisions_matches_stepping(self) -> None:
        policy, start, steps, want = SEQUENCES["up-after-window"]
        got = S.run_decisions(policy, [smp(t, **(kw or {})) for t, kw, _ in steps], start)
        assert [(d.kind, d.target, d.reason) for d in got] == want


N = [
    NodeView("h100-a", 8, 1.0, "high"),
    NodeView("a100-a", 4, 0.75, "mid"),
    NodeView("a10-a", 2, 0.3, "low"),
]


class TestPlaceReplicas:
    @pytest.mark.parametrize(
        ("stages", "add", "nodes", "classes", "placed", "short_has"),
        [
            # highest compute per GPU first; h100-a has 8 free, room for both 2-GPU pods
            ([StageNeed(gpus=2)], 2, N, (), (("h100-a",), ("h100-a",)), ""),
            # high excluded: a100-a (4 free = two pods) then a10-a (2 free = one pod)
            ([StageNeed(gpus=2)], 3, N, ("mid", "low"), (("a100-a",), ("a100-a",), ("a10-a",)), ""),
            # a fourth 2-GPU pod of mid/low has no room
            ([StageNeed(gpus=2)], 4, N, ("mid", "low"), (("a100-a",), ("a100-a",), ("a10-a",)), "stage 0"),
            # named nodes, n1 already holds the stage (anti-affinity): n3 (0.9) then n2 (0.5), then none
            (
                [StageNeed(nodes=("n1", "n2", "n3"), occupied=frozenset({"n1"}))],
                3,
                [NodeView("n1", 1, 1.0), NodeView("n2", 1, 0.5), NodeView("n3", 1, 0.9)],
                (),
                (("n3",), ("n2",)),
                "nodes ['n1', 'n2', 'n3']",
            ),
            # all stages or none: stage 1 (A10) has room for one replica only
            (
                [StageNeed(selector={"m": "H100"}), StageNeed(selector={"m": "A10"})],
                2,
                [NodeView("h", 2, 1.0, labels={"m": "H100"}), NodeView("a", 1, 0.3, labels={"m": "A10"})],
                (),
                (("h", "a"),),
                "stage 1",
            ),
            # equal compute: the tighter fit (2 free) wins over 4 free
            (
                [StageNeed(gpus=2)],
                1,
                [NodeView("big", 4, 0.5), NodeView("small", 2, 0.5)],
                (),
                (("small",),),
                "",
            ),
            # hot stage: 2 pods per replica on distinct-free capacity
            ([StageNeed(pods=2)], 1, [NodeView("x", 1, 1.0), NodeView("y", 1, 0.9)], (), (("x", "y"),), ""),
            # nothing free at all
            ([StageNeed()], 1, [NodeView("x", 0, 1.0)], (), (), "no node"),
        ],
    )
    def test_table(
        self,
        stages: list[StageNeed],
        add: int,
        nodes: list[NodeView],
        classes: tuple[str, ...],
        placed: tuple[tuple[str, ...], ...],
        short_has: str,
    ) -> None:
        p = S.place_replicas(stages, add, nodes, classes)
        assert p.nodes == placed
        assert p.replicas == len(placed)
        assert short_has in p.short
        assert bool(p.short) == (len(placed) < add)


class TestDrain:
    @pytest.mark.parametrize(
        ("heads", "target", "per", "want"),
        [
            (["x-s0-0", "x-s0-1", "x-s0-2"], 1, 1, ["x-s0-1", "x-s0-2"]),
            (["x-s0-0", "x-s0-1", "x-s0-2"], 3, 1, []),
            ([f"x-s0-{i}" for i in range(6)], 2, 2, ["x-s0-4", "x-s0-5"]),
            (["x-s0-10", "x-s0-2", "weird"], 0, 1, ["x-s0-10", "x-s0-2"]),
        ],
    )
    def test_pods_to_drain(self, heads: list[str], target: int, per: int, want: list[str]) -> None:
        assert S.pods_to_drain(heads, target, per) == want

    @pytest.mark.parametrize(
        ("waited", "in_flight", "done", "reason"),
        [
            (1.0, 0, False, "Draining"),  # inside the grace: the router may still pick the pod
            (6.0, 2, False, "Draining"),
            (6.0, None, False, "Draining"),  # unknown holds
            (6.0, 0, True, "Drained"),
            (120.0, 3, True, "DrainTimeout"),
        ],
    )
    def test_drain_done(self, waited: float, in_flight: int | None, done: bool, reason: str) -> None:
        d = S.drain_done(100.0, 100.0 + waited, in_flight, grace_s=5.0, timeout_s=120.0)
        assert (d.done, d.reason) == (done, reason)


class TestCounters:
    TEXT = (
        "# HELP gearshift_router_no_decode_headroom_total x\n"
        "# TYPE gearshift_router_no_decode_headroom_total counter\n"
        "gearshift_router_no_decode_headroom_total 7.0\n"
        "gearshift_router_no_decode_headroom_created 1.7e9\n"
        'gearshift_router_rejects_total{reason="no_kv_capacity"} 7.0\n'
    )

    def test_parse(self) -> None:
        assert S.parse_counter(self.TEXT, "gearshift_router_no_decode_headroom_total") == 7.0
        assert S.parse_counter(self.TEXT, "gearshift_router_rejects_total") == 7.0
        assert S.parse_counter(self.TEXT, "missing_total") is None

    @pytest.mark.parametrize(
        ("prev", "value", "want"),
        [(None, 5.0, 0), (5.0, 8.0, 3), (8.0, 2.0, 2), (3.0, None, 0), (4.0, 4.0, 0)],
    )
    def test_delta(self, prev: float | None, value: float | None, want: int) -> None:
        assert S.counter_delta(prev, value) == want
