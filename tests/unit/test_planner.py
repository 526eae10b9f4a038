"""Unit tests of gearshift.planner: profile parsing, cost model, exact partitioner, gears, simulator, CLI."""

from __future__ import annotations

import itertools
import json
import math
import random
from dataclasses import replace
from pathlib import Path

import pytest

from gearshift.cli import main
from gearshift.facts.model import GIB, load_hf_config
from gearshift.planner import (
    EmptyFleetError,
    LayerCosts,
    LayerTooLargeError,
    ModelTooLargeError,
    NoLinkError,
    PlanInputError,
    RooflineAssumptions,
    RooflineCostModel,
    evaluate,
    even_split,
    load_cluster,
    min_bottleneck,
    parse_layer_costs,
    parse_profile,
    plan,
)
from gearshift.planner.simulate import simulate
from gearshift.sim.perfmodel import PerfModel, PerfParams, single_stage_pipeline

ROOT = Path(__file__).resolve().parents[2]
SEED_PROFILE = ROOT / "examples" / "planner/profile-seed002.yaml"
SEED_LAYERS = ROOT / "examples" / "planner/layers-seed002.json"


def profile_of(nodes: list[tuple[str, float, float]], links: dict[tuple[str, str], float]) -> object:
    """Build a profile from (id, score, memory) and {(a, b): Gb/s} (latency 10 µs)."""
    doc = {
        "nodes": [
            {
                "node_id": nid,
                "memory_gb": mem,
                "compute_score": score,
                "max_batch_microbatch": 16,
                "interconnect": {
                    b: {"bandwidth_gbps": bw, "latency_us": 10} for (a, b), bw in links.items() if a == nid
                },
            }
            for nid, score, mem in nodes
        ]
    }
    return parse_profile(doc)


def full_links(ids: list[str], bw: float = 100.0) -> dict[tuple[str, str], float]:
    return {(a, b): bw for a, b in itertools.combinations(ids, 2)}


def enumerate_optimum(profile, costs: LayerCosts) -> float:
    """Independent reference: every ordered node subset × every composition of the layers."""
    L = costs.num_layers
    best = math.inf
    ids = [n.node_id for n in profile.nodes]
    for k in range(1, len(ids) + 1):
        for order in itertools.permutations(ids, k):
            if any(profile.link(a, b) is None for a, b in itertools.pairwise(order)):
                continue
            for cuts in itertools.combinations(range(1, L), k - 1):
                bounds = [0, *cuts, L]
                value = 0.0
                for (a, b), nid in zip(itertools.pairwise(bounds), order, strict=True):
                    node = profile.node(nid)
                    if sum(costs.weight_gb[a:b]) + sum(costs.kv_gb[a:b]) > node.memory_gb:
                        value = math.inf
                        break
                    value = max(value, sum(costs.compute_ms[a:b]) / node.compute_score)
                for a, b in itertools.pairwise(order):
                    link = profile.link(a, b)
                    value = max(value, costs.activation_mb * 8 / link.bandwidth_gbps / 0.7)
                best = min(best, value)
    return best


class TestProfile:
    def test_seed_format_with_to_prefixed_peers(self) -> None:
        p = load_cluster(SEED_PROFILE)
        assert [n.node_id for n in p.nodes] == ["gpu_001", "gpu_002", "gpu_003", "gpu_004"]
        link = p.link("gpu_004", "gpu_003")
        assert link is not None and link.bandwidth_gbps == 25
        assert p.link("gpu_001", "gpu_004") == p.link("gpu_004", "gpu_001")

    def test_fleet_file_is_detected_and_converted(self) -> None:
        p = load_cluster(ROOT / "examples" / "fleets/mixed.yaml")
        h100 = p.node("gpu-h100-0")
        assert h100.compute_score == pytest.approx(1.0)
        assert p.node("gpu-t4-0").compute_score == pytest.approx(65 / 989, rel=1e-5)
        assert len(p.nodes) == 10
        # NIC-bound links: the slower end (25 Gb/s) bounds an H100–T4 link.
        assert p.link("gpu-h100-0", "gpu-t4-1").bandwidth_gbps == 25

    def test_bad_field_is_named(self) -> None:
        with pytest.raises(PlanInputError, match=r"nodes\[0\]\.memory_gb must be > 0"):
            parse_profile({"nodes": [{"node_id": "a", "memory_gb": 0, "compute_score": 1}]})

    def test_unknown_peer_is_named(self) -> None:
        doc = {"nodes": [{"node_id": "a", "memory_gb": 8, "compute_score": 1, "interconnect": {"zz": {}}}]}
        with pytest.raises(PlanInputError, match="no node 'zz'"):
            parse_profile(doc)

    def test_empty_fleet(self) -> None:
        with pytest.raises(EmptyFleetError, match="no nodes"):
            parse_profile({"nodes": []})


class TestCosts:
    def test_layer_file_scales_linearly(self) -> None:
        m = parse_layer_costs(json.loads(SEED_LAYERS.read_text()))
        c4 = m.at(4)
        assert c4.compute_ms[0] == pytest.approx(40.0)
        assert c4.activation_mb == pytest.approx(8.0)
        assert c4.weight_gb == m.at(1).weight_gb

    def test_layer_file_errors_name_the_field(self) -> None:
        with pytest.raises(PlanInputError, match=r"layers\[1\]\.compute_ms"):
            parse_layer_costs(
                {"activation_mb": 1, "layers": [{"compute_ms": 1, "weight_gb": 1}, {"weight_gb": 1}]}
            )

    def test_roofline_matches_hand_computation(self) -> None:
        arch = load_hf_config(ROOT / "examples" / "models" / "llama-3-8b.json")
        a = RooflineAssumptions(
            prompt_tokens=256, output_tokens=33, kv_sequences=8, kv_context_tokens=1024, mfu=0.5, mbu=0.8
        )
        costs = RooflineCostModel(arch, a).at(2)
        h, i, nq, nkv, d = 4096, 14336, 32, 8, 128
        params = h * nq * d + 2 * h * nkv * d + nq * d * h + 3 * h * i
        weight_bytes = (params + 2 * h) * 2
        kv_tok = 2 * nkv * d * 2
        peak_f, peak_b = 989e12 * 0.5, 3350e9 * 0.8
        # prefill of 2 prompts of 256 tokens, causal attention: token j attends to j earlier positions
        tokens = 2 * 256
        flops = tokens * 2 * params + 4 * nq * d * (2 * 256 * 255 / 2)
        prefill = max(flops / peak_f, (weight_bytes + tokens * kv_tok) / peak_b) * 1e3
        # one decode step of the 2 sequences at the mean context 256 + 33/2, weights read once per step
        ctx = 256 + 33 / 2
        step_flops = 2 * 2 * params + 4 * nq * d * 2 * ctx
        step = max(step_flops / peak_f, (weight_bytes + kv_tok * (2 * ctx + 2)) / peak_b) * 1e3
        # each request decodes 32 tokens after the first: 2 x 32 / 2 steps of 2 sequences
        assert costs.compute_ms[1] == pytest.approx(prefill + 32 * step, rel=1e-12)
        assert costs.latency_ms is not None and costs.latency_ms[1] == pytest.approx(prefill, rel=1e-12)
        assert costs.kv_gb[3] == pytest.approx(8 * 1024 * 2 * nkv * d * 2 / GIB)
        assert costs.activation_mb == pytest.approx(2 * (256 + 32) * h * 2 / 1e6)
        # embedding on the first stage, LM head on the last
        assert costs.weight_gb[0] - costs.weight_gb[1] == pytest.approx(128256 * h * 2 / GIB)
        assert costs.weight_gb[-1] - costs.weight_gb[1] == pytest.approx(128256 * h * 2 / GIB)
        assert costs.compute_ms[-1] > costs.compute_ms[1]
        # a PD prefill pod runs only the prompts
        pre = RooflineCostModel(arch, replace(a, role="prefill")).at(2)
        assert pre.compute_ms[1] == pytest.approx(prefill, rel=1e-12)

    def test_decode_batch_amortises_the_weight_reads(self) -> None:
        # Decode is memory-bound: a step of 64 sequences reads the weights once, 16 steps of 4 read them
        # 16 times, so per request the batch of 64 costs far less.
        arch = load_hf_config(ROOT / "examples" / "models" / "llama-3-8b.json")
        model = RooflineCostModel(arch, RooflineAssumptions(prompt_tokens=1024, output_tokens=200))
        small, big = model.at(4), model.at(4, decode_batch=64)
        assert sum(big.compute_ms) < 0.5 * sum(small.compute_ms)
        assert big.latency_ms == small.latency_ms

    def test_one_physical_model_with_the_simulated_engine(self) -> None:
        # The planner's per-layer decode step, summed over the model with the LM head, is the simulated
        # engine's decode step of a one-stage H100 pipeline at the same batch and context.
        arch = load_hf_config(ROOT / "examples" / "models" / "llama-3-8b.json")
        a = RooflineAssumptions(prompt_tokens=1000, output_tokens=200, role="decode")
        one = RooflineCostModel(arch, a).at(8)  # latency_ms: one decode step of 8 sequences
        assert one.latency_ms is not None
        engine = PerfModel(arch, single_stage_pipeline(arch), PerfParams())
        step_s = engine.decode_step_s(context=1100, batch=8)
        # the engine takes one max over the stage, the planner one per layer plus the head's: equal when
        # layers and head are both memory-bound, as in decode
        assert sum(one.latency_ms) == pytest.approx(step_s * 1e3, rel=1e-9)


class TestPartition:
    def test_seed002_scenario_is_4_6_10_12(self) -> None:
        p = load_cluster(SEED_PROFILE)
        costs = parse_layer_costs(json.loads(SEED_LAYERS.read_text())).at(1)
        pipe = min_bottleneck(p, costs)
        assert pipe.exact
        assert sorted(pipe.layer_counts) == [4, 6, 10, 12]
        assert pipe.bottleneck_ms == pytest.approx(40.0)
        assert pipe.lower_bound_ms == pytest.approx(320 / 8.0)
        even, _, _ = evaluate(p, costs, even_split(costs, pipe.node_ids))
        assert even == pytest.approx(80.0)  # 8 layers × 10 ms on the score-1.0 card

    def test_cost_model_contract(self) -> None:
        p = profile_of([("a", 2.0, 10.0), ("b", 0.5, 10.0)], {("a", "b"): 8.0})
        costs = LayerCosts("m", 1.4, (1.0, 2.0, 3.0), (1.0, 1.0, 1.0), (0.5, 0.5, 0.5))
        bottleneck, times, transfers = evaluate(p, costs, [(0, 2, ["a"]), (2, 3, ["b"])])
        assert times == [pytest.approx(1.5), pytest.approx(6.0)]
        assert transfers == [pytest.approx(1.4 * 8 / 8 + 0.01)]
        assert bottleneck == pytest.approx(6.0)

    def test_link_cap_enters_bottleneck(self) -> None:
        p = profile_of([("a", 1.0, 10.0), ("b", 1.0, 10.0)], {("a", "b"): 1.0})
        costs = LayerCosts("m", 1.0, (1.0,) * 4, (1.0,) * 4, (0.0,) * 4)
        # split: 2 ms stages, but 1 MB over 1 Gb/s at 70% needs ≥ 8/0.7 ms; a single node (4 ms) wins.
        pipe = min_bottleneck(p, costs)
        assert pipe.bottleneck_ms == pytest.approx(4.0)
        assert len(pipe.stages) == 1

    @pytest.mark.parametrize("seed", range(12))
    def test_matches_exhaustive_enumeration(self, seed: int) -> None:
        rng = random.Random(seed)
        n, L = rng.randint(2, 4), rng.randint(4, 9)
        nodes = [(f"n{i}", round(rng.uniform(0.3, 2.0), 3), rng.choice([3.0, 4.0, 6.0])) for i in range(n)]
        links = {k: rng.choice([5.0, 20.0]) for k in full_links([x[0] for x in nodes]) if rng.random() < 0.8}
        p = profile_of(nodes, links)
        costs = LayerCosts(
            "r",
            rng.uniform(0.5, 3.0),
            tuple(rng.uniform(0.5, 2.0) for _ in range(L)),
            tuple(rng.uniform(0.3, 1.2) for _ in range(L)),
            (0.1,) * L,
        )
        ref = enumerate_optimum(p, costs)
        if math.isinf(ref):
            with pytest.raises((LayerTooLargeError, NoLinkError, ModelTooLargeError)):
                min_bottleneck(p, costs)
        else:
            got = min_bottleneck(p, costs)
            assert got.bottleneck_ms == pytest.approx(ref, rel=1e-9)
            assert evaluate(p, costs, [(s.start, s.end, s.node_ids) for s in got.stages])[0] == pytest.approx(
                got.bottleneck_ms
            )

    def test_identical_pools_stay_exact_beyond_16_nodes(self) -> None:
        ids = [f"big{i}" for i in range(10)] + [f"small{i}" for i in range(10)]
        nodes = [(x, 1.0 if x.startswith("big") else 0.25, 40.0) for x in ids]
        p = profile_of(nodes, full_links(ids, 400.0))
        costs = LayerCosts("m", 0.1, (1.0,) * 40, (0.5,) * 40, (0.0,) * 40)
        pipe = min_bottleneck(p, costs)
        assert pipe.exact
        # 40 ms of work over 10 × 1.0 + 10 × 0.25 = 12.5 score → 3.2 ms; layer granularity: 4 layers
        # on a big card (4 ms) or 1 on a small one (4 ms) reaches 4.0, and 10·4 + 10·1 = 50 ≥ 40 layers.
        assert pipe.bottleneck_ms == pytest.approx(4.0)

    def test_layer_too_large_names_layer_and_shortfall(self) -> None:
        p = profile_of([("a", 1.0, 4.0), ("b", 1.0, 6.0)], full_links(["a", "b"]))
        costs = LayerCosts("m", 1.0, (1.0, 1.0), (2.0, 7.0), (0.0, 0.5))
        with pytest.raises(
            LayerTooLargeError, match=r"layer 1 needs 7\.50 GiB.*b, has 6\.00 GiB: short by 1\.50"
        ):
            min_bottleneck(p, costs)

    def test_missing_link_is_named(self) -> None:
        p = profile_of([("a", 1.0, 4.0), ("b", 1.0, 4.0)], {})
        costs = LayerCosts("m", 1.0, (1.0,) * 2, (3.0, 3.0), (0.0, 0.0))
        with pytest.raises(NoLinkError, match=r"no link (a–b|b–a)"):
            min_bottleneck(p, costs)

    def test_model_too_large_says_by_how_much(self) -> None:
        p = profile_of([("a", 1.0, 4.0), ("b", 1.0, 4.0)], full_links(["a", "b"]))
        costs = LayerCosts("m", 1.0, (1.0,) * 3, (3.0, 3.0, 3.0), (0.0,) * 3)
        with pytest.raises(ModelTooLargeError, match=r"needs 9\.00 GiB.*hold 8\.00 GiB: short by 1\.00"):
            min_bottleneck(p, costs)


class TestSimulator:
    def test_single_server_matches_m_d_1(self) -> None:
        # One stage, one server, deterministic 10 ms, micro-batch 1: an M/D/1 queue with mean
        # sojourn D + ρD / (2(1 - ρ)) (Pollaczek–Khinchine).
        qps, service = 50.0, 10.0
        r = simulate([[[service]]], [], 1, 10**6, qps, requests=40000, seed=1)
        rho = qps * service / 1000
        assert r.mean_ms == pytest.approx(service + rho * service / (2 * (1 - rho)), rel=0.05)
        assert not r.saturated

    def test_overload_is_flagged(self) -> None:
        r = simulate([[[10.0]]], [], 1, 10**6, 200.0, requests=4000, seed=1)
        assert r.saturated
        assert r.achieved_rps == pytest.approx(100.0, rel=0.05)

    def test_seeded_runs_repeat(self) -> None:
        args = ([[[5.0, 8.0]], [[4.0, 6.0]]], [[1.0, 1.5]], 2, 4, 100.0)
        assert simulate(*args, requests=500, seed=3) == simulate(*args, requests=500, seed=3)


class TestPlan:
    @pytest.mark.parametrize("kv_context_tokens", [None, 4096])
    def test_three_gears_cover_the_model_with_distinct_nodes(self, kv_context_tokens: int | None) -> None:
        profile = load_cluster(ROOT / "examples" / "fleets/mixed.yaml")
        model = RooflineCostModel(
            load_hf_config(ROOT / "examples" / "models" / "llama-3-8b.json"),
            RooflineAssumptions(kv_context_tokens=kv_context_tokens),
        )
        result = plan(profile, model, sim_requests=400)
        assert [g.name for g in result.gears] == ["latency", "balanced", "throughput"]
        for g in result.gears:
            assert g.stages[0].layers[0] == 0 and g.stages[-1].layers[1] == 32
            assert all(a.layers[1] == b.layers[0] for a, b in itertools.pairwise(g.stages))
            used = [n for s in g.stages for n in s.nodes]
            assert len(used) == len(set(used))
            assert g.bottleneck_ms >= g.lower_bound_ms * (1 - 1e-9)
            assert g.predicted.throughput_rps == pytest.approx(g.micro_batch * 1000 / g.effective_ms)
        if kv_context_tokens is None:
            # The default workload (512 + 128 tokens) reserves 64 × 768 tokens: 6 GiB beside 15 GiB of
            # weights fits every card but the T4s (16 GB), so the throughput gear (the most capacity)
            # replicates the whole model over all of them, and the latency gear over some of them.
            holders = {n.node_id for n in profile.nodes if not n.node_id.startswith("gpu-t4")}
            thr = result.gear("throughput")
            assert [s.layers for s in thr.stages] == [(0, 32)]
            assert set(thr.stages[0].nodes) == holders
            assert [s.layers for s in result.gear("latency").stages] == [(0, 32)]
            assert set(result.gear("latency").stages[0].nodes) <= holders
            return
        # With 64 × 4096 tokens (32 GiB) only the H100s hold the whole model and the balanced gear is a
        # pipeline: the throughput gear is the deepest pipeline with the most capacity; a one-stage latency
        # gear may have more (it decodes its whole batch per weight read, pipelines one micro-batch per read).
        thr = result.gear("throughput")
        assert len(result.gear("balanced").stages) > 1
        assert thr.predicted.throughput_rps >= result.gear("balanced").predicted.throughput_rps - 1e-9

    def test_single_pipeline_throughput_is_the_exact_partition(self) -> None:
        profile = load_cluster(SEED_PROFILE)
        model = parse_layer_costs(json.loads(SEED_LAYERS.read_text()))
        g = plan(profile, model, intents=["throughput"], single_pipeline=True, sim_requests=300).gears[0]
        ref = min_bottleneck(profile, model.at(g.micro_batch))
        assert g.bottleneck_ms == pytest.approx(ref.bottleneck_ms)
        assert all(s.replicas == 1 for s in g.stages)

    def test_json_cli_output_shape(self, capsys: pytest.CaptureFixture[str]) -> None:
        argv = ["plan", "--cluster", str(SEED_PROFILE), "--model", str(SEED_LAYERS), "--gear", "throughput"]
        assert main([*argv, "--single-pipeline", "-o", "json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        gear = doc["gears"][0]
        assert {
            "name",
            "stages",
            "micro_batch",
            "max_batch",
            "bottleneck_ms",
            "lower_bound_ms",
            "predicted",
        } <= set(gear)
        assert sorted(s["layers"][1] - s["layers"][0] for s in gear["stages"]) == [4, 6, 10, 12]
        assert {"node", "nodes", "replicas"} <= set(gear["stages"][0])

    def test_cli_reports_infeasible_input(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        layers = tmp_path / "big.json"
        layers.write_text(json.dumps({"activation_mb": 1, "layers": [{"compute_ms": 1, "weight_gb": 100}]}))
        assert main(["plan", "--cluster", str(SEED_PROFILE), "--model", str(layers)]) == 1
        assert "short by 52.00 GiB" in capsys.readouterr().err


class TestWorthHaving:
    """Only gears worth having: one layout under two names is one gear, and a gear that holds more cards
    for no more capacity is left out (``plan(worthwhile_only=True)``)."""

    def test_the_mixed_fleet_offers_no_gear_that_costs_more_for_less(self) -> None:
        profile = load_cluster(ROOT / "examples" / "fleets/mixed.yaml")
        model = RooflineCostModel(
            load_hf_config(ROOT / "examples" / "models" / "llama-3-8b.json"),
            RooflineAssumptions(prompt_tokens=1155, output_tokens=211),
        )
        every = plan(profile, model, sim_requests=400)
        kept = plan(profile, model, sim_requests=400, worthwhile_only=True)
        cards = {g.name: sum(len(s.nodes) for s in g.stages) for g in every.gears}
        cap = {g.name: g.predicted.throughput_rps for g in every.gears}
        # Worked out from the one-per-intent plan: a pick is left out exactly when another holds fewer
        # cards and serves at least as much.
        expected = [
            n for n in cards if not any(cards[m] < cards[n] and cap[m] >= cap[n] for m in cards if m != n)
        ]
        assert [g.name for g in kept.gears] == expected
        assert set(kept.left_out) == set(cards) - set(expected)
        assert "balanced" in kept.left_out and "cards" in kept.left_out["balanced"]
        for g in kept.gears:  # the same gears; only the load ranges are shared out among fewer
            assert {**g.to_dict(), "qps_range": None} == {**every.gear(g.name).to_dict(), "qps_range": None}

    def test_one_layout_under_two_names_is_one_gear(self) -> None:
        profile = load_cluster(ROOT / "examples" / "fleets/mixed.yaml")
        model = RooflineCostModel(load_hf_config(ROOT / "examples" / "models" / "llama-3-8b.json"))
        every = plan(profile, model, sim_requests=400)
        layout = {g.name: [(s.layers, s.nodes) for s in g.stages] for g in every.gears}
        assert layout["balanced"] == layout["throughput"]  # at the default 512 + 128 tokens
        kept = plan(profile, model, sim_requests=400, worthwhile_only=True)
        assert "balanced" not in [g.name for g in kept.gears]
        assert kept.left_out["balanced"] == "is the same layout as throughput"
