"""Unit tests of time-limited nodes in the planner: gearshift.planner.windows and plan(windows=).

The fleets are chosen so that the expected placement follows from the rules by hand: a one-layer model
has exactly one stage, so the partitioner's choice is "the fastest allowed node", replicated pipelines
need identical nodes, and extras are ordered by the preference rule (cheap-only first, then speed).
"""

from __future__ import annotations

import random

import pytest

from gearshift.planner import PlanError, Windows, parse_layer_costs, parse_profile, plan

DWELL_S, MARGIN_S = 600.0, 300.0


def fleet(nodes: list[tuple[str, float, float]]) -> object:
    """A profile of (id, compute score, memory GiB) nodes, fully linked at 100 Gb/s."""
    ids = [n[0] for n in nodes]
    links = {a: {b: {"bandwidth_gbps": 100, "latency_us": 10} for b in ids if b > a} for a in ids}
    return parse_profile(
        {
            "nodes": [
                {
                    "node_id": nid,
                    "memory_gb": mem,
                    "compute_score": score,
                    "max_batch_microbatch": 16,
                    "interconnect": links[nid],
                }
                for nid, score, mem in nodes
            ]
        }
    )


def one_layer(weight_gb: float = 10.0) -> object:
    """A model of one layer (10 ms per micro-batch on a score-1 node): every gear has exactly one stage."""
    return parse_layer_costs(
        {"name": "one", "activation_mb": 1, "layers": [{"compute_ms": 10, "weight_gb": weight_gb}]}
    )


def win(**left: float) -> Windows:
    return Windows(left_s=left, dwell_s=DWELL_S, margin_s=MARGIN_S)


def stage_nodes(result: object, gear: str) -> list[tuple[str, ...]]:
    return [s.nodes for s in result.gear(gear).stages]  # type: ignore[attr-defined]


class TestWindows:
    @pytest.mark.parametrize(
        ("left", "usable"),
        [(None, True), (DWELL_S + MARGIN_S, True), (DWELL_S + MARGIN_S - 1, False), (0.0, False)],
    )
    def test_usable_needs_dwell_plus_margin(self, left: float | None, usable: bool) -> None:
        w = win() if left is None else win(n=left)
        assert w.usable("n") is usable
        assert w.excluded(["n"]) == (frozenset() if usable else frozenset({"n"}))
        assert w.cheap_only(["n"]) == (frozenset({"n"}) if usable and left is not None else frozenset())


class TestPlanWithWindows:
    def test_window_closing_within_dwell_plus_margin_leaves_the_node_out(self) -> None:
        prof = fleet([("d0", 1.0, 80), ("w0", 1.0, 80)])
        short = plan(prof, one_layer(), intents=["latency"], sim_requests=200, windows=win(w0=899))
        assert stage_nodes(short, "latency") == [("d0",)]
        enough = plan(prof, one_layer(), intents=["latency"], sim_requests=200, windows=win(w0=900))
        # Usable, as a hot-stage extra behind the durable copy.
        assert stage_nodes(enough, "latency") == [("d0", "w0")]

    def test_never_the_only_copy_of_a_stage(self) -> None:
        prof = fleet([("d0", 1.0, 80), ("w0", 4.0, 80)])
        free = plan(prof, one_layer(), intents=["throughput"], sim_requests=200)
        # Without a window the fastest node holds the stage; the throughput gear takes the other as an
        # extra (the most capacity).
        assert stage_nodes(free, "throughput") == [("w0", "d0")]
        windowed = plan(
            prof, one_layer(), intents=["latency", "throughput"], sim_requests=200, windows=win(w0=3600)
        )
        assert stage_nodes(windowed, "throughput") == [("d0", "w0")]
        assert stage_nodes(windowed, "latency") == [("d0", "w0")]

    def test_extras_prefer_time_limited_nodes(self) -> None:
        # s0 fastest (holds the stage), then d0 (1.1) is faster than w0 (1.0). The throughput gear takes
        # every extra (the most capacity), so the order is the preference rule's alone; the latency gear
        # may leave extras out when they do not lower its P99.
        prof = fleet([("s0", 1.5, 80), ("d0", 1.1, 80), ("w0", 1.0, 80)])
        free = plan(prof, one_layer(), intents=["throughput"], sim_requests=200)
        assert stage_nodes(free, "throughput") == [("s0", "d0", "w0")]
        windowed = plan(prof, one_layer(), intents=["throughput"], sim_requests=200, windows=win(w0=3600))
        assert stage_nodes(windowed, "throughput") == [("s0", "w0", "d0")]

    def test_replicated_pipeline_keeps_a_durable_replica_zero(self) -> None:
        prof = fleet([("w0", 1.0, 80), ("w1", 1.0, 80), ("d0", 1.0, 80)])
        res = plan(prof, one_layer(), intents=["throughput"], sim_requests=200, windows=win(w0=3600, w1=3600))
        gear = res.gear("throughput")
        # Three identical nodes: three pipeline replicas are the most capacity; replica 0 is the durable one.
        assert gear.pipelines == 3
        (nodes,) = stage_nodes(res, "throughput")
        assert nodes[0] == "d0" and set(nodes) == {"d0", "w0", "w1"}

    def test_only_time_limited_nodes_fit_the_model(self) -> None:
        prof = fleet([("d0", 1.0, 40), ("w0", 1.0, 80)])
        assert stage_nodes(plan(prof, one_layer(60), intents=["latency"], sim_requests=200), "latency") == [
            ("w0",)
        ]
        with pytest.raises(PlanError):
            plan(prof, one_layer(60), intents=["latency"], sim_requests=200, windows=win(w0=3600))

    def test_every_window_too_short(self) -> None:
        prof = fleet([("w0", 1.0, 80)])
        with pytest.raises(PlanError, match="w0"):
            plan(prof, one_layer(), sim_requests=200, windows=win(w0=10))

    def test_no_windows_changes_nothing(self) -> None:
        prof = fleet([(f"n{i}", 1.0 + 0.1 * i, 80) for i in range(4)])
        a = plan(prof, one_layer(), sim_requests=200)
        b = plan(prof, one_layer(), sim_requests=200, windows=win())
        assert a.to_dict() == b.to_dict()

    @pytest.mark.parametrize("seed", range(4))
    def test_invariant_durable_first_in_every_stage(self, seed: int) -> None:
        rng = random.Random(seed)
        nodes = [(f"n{i}", rng.choice([0.5, 1.0, 2.0]), rng.choice([40, 80])) for i in range(6)]
        prof = fleet(nodes)
        layers = [{"compute_ms": 5, "weight_gb": 8} for _ in range(8)]
        model = parse_layer_costs({"name": "eight", "activation_mb": 1, "layers": layers})
        windowed = {n[0]: 3600.0 for n in nodes if rng.random() < 0.5}
        try:
            res = plan(prof, model, sim_requests=200, windows=Windows(windowed, DWELL_S, MARGIN_S))
        except PlanError:
            return  # the durable nodes alone cannot hold the model: nothing to check
        for g in res.gears:
            # Pipeline replica 0 (nodes[0] of every stage) is wholly durable; replicas r < pipelines keep
            # durable nodes first.
            for st in g.stages:
                assert st.nodes[0] not in windowed, (g.name, st.nodes, windowed)
                flags = [n in windowed for n in st.nodes[: g.pipelines]]
                assert flags == sorted(flags)
