"""The PD guide's rebalancing and adaptive-batch rules (docs/sources.md#rebalancing,
docs/sources.md#adaptive-batch), table-driven, with the corrections pinned."""

from __future__ import annotations

import pytest

from gearshift.control.adaptive_batch.pd_balance import (
    PodLoad,
    adapt_batch,
    detect_imbalance,
    evaluate,
    rebalance,
)


def pod(name: str, util: float, mem: float = 0.0, role: str = "decode", **kw: object) -> PodLoad:
    return PodLoad(name=name, role=role, gpu_util=util, memory_util=mem, **kw)  # type: ignore[arg-type]


class TestDetectImbalance:
    @pytest.mark.parametrize(
        ("loads", "imbalanced"),
        [
            ([0.5], False),
            ([0.95], False),  # one pod: nowhere to shed load (seed)
            ([0.5, 0.7], False),  # spread 0.2
            ([0.5, 0.81], True),  # spread 0.31 > 0.3
            ([0.85, 0.91], True),  # a pod > 0.9
            ([0.7, 0.9], False),  # max exactly 0.9: the test is strict
        ],
    )
    def test_table(self, loads: list[float], imbalanced: bool) -> None:
        assert detect_imbalance(loads)[0] is imbalanced


class TestRebalance:
    def test_load_is_seed_mix(self) -> None:
        assert pod("a", 0.5, 0.25).load == pytest.approx(0.6 * 0.5 + 0.4 * 0.25)

    def test_spread_spares_busiest(self) -> None:
        # loads: a 0.6·1.0 + 0.4·0.5 = 0.8, b 0.6·0.2 = 0.12, c 0.6·0.5 = 0.3 → spread 0.68
        d = rebalance(
            "decode", [pod("a", 1.0, 0.5), pod("b", 0.2), pod("c", 0.5), pod("p", 1.0, role="prefill")]
        )
        assert d.imbalanced and d.busiest == "a" and d.idlest == "b"
        assert d.spread == pytest.approx(0.68)
        assert d.avoid == ("a",) and d.migrate == 5

    def test_overloaded_pods_spared_while_another_is_not(self) -> None:
        # loads 0.6·1 + 0.4·0.9 = 0.96, 0.6·1 + 0.4·0.8 = 0.92, 0.6·1 + 0.4·0.7 = 0.88: spread 0.08
        d = rebalance(
            "prefill", [pod(n, 1.0, m, role="prefill") for n, m in (("x", 0.9), ("y", 0.8), ("z", 0.7))]
        )
        assert d.imbalanced and d.avoid == ("x", "y") and d.migrate == 0

    def test_all_overloaded_spares_only_the_busiest(self) -> None:
        d = rebalance("decode", [pod("x", 1.0, 0.9), pod("y", 1.0, 0.8)])
        assert d.avoid == ("x",)

    def test_balanced(self) -> None:
        d = rebalance("decode", [pod("x", 0.5), pod("y", 0.6)])
        assert not d.imbalanced and d.avoid == ()


class TestAdaptBatch:
    @pytest.mark.parametrize(
        ("max_batch", "itl", "queue", "proposed"),
        [
            (100, 61.0, 0, 90),  # > 1.2 × 50 → × 0.9
            (100, 60.0, 0, 100),  # exactly 1.2 × target: no change
            (100, 39.0, 11, 110),  # < 0.8 × 50 and queue > 10 → × 1.1
            (100, 39.0, 10, 100),  # queue not > 10
            (9, 39.0, 20, 10),  # correction: int(9 × 1.1) = 9 would never grow; +1
            (5, 100.0, 0, 4),  # correction: int(5 × 0.9) = 4 anyway; at least −1
            (1, 100.0, 0, 1),  # never below 1
            (1000, 10.0, 50, 1024),  # capped at the hard max
            (2000, 10.0, 50, 2000),  # a grow rule never shrinks
        ],
    )
    def test_rule(self, max_batch: int, itl: float, queue: float, proposed: int) -> None:
        d = adapt_batch(pod("d", 0.5, itl_p99_ms=itl, queue_depth=queue, max_batch=max_batch), 50.0)
        assert d.proposed == proposed
        assert d.changed is (proposed != max_batch)

    def test_no_itl_no_change(self) -> None:
        assert adapt_batch(pod("d", 0.5, max_batch=8), 50.0).proposed == 8


def test_evaluate_round_shape() -> None:
    pods = [pod("p0", 0.9, role="prefill"), pod("p1", 0.1, role="prefill"), pod("d0", 0.5, itl_p99_ms=80.0)]
    dec = evaluate(pods, now=12.5)
    out = dec.to_dict()
    assert out["at"] == 12.5
    assert [r["role"] for r in out["rebalance"]] == ["decode", "prefill"]
    assert dec.avoid == frozenset({"p0"})
    assert [(b["pod"], b["proposed"], b["changed"]) for b in out["batch"]] == [("d0", 230, True)]
