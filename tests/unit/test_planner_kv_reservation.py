"""The planner's KV-cache reservation follows the workload: max batch × (prompt + output) × 1.2 headroom.

Figures computed here from Llama-3-8B's config (32 layers, 8 KV heads of 128 dims, bf16: 4096 bytes of
KV per token per layer) and the A100-40GB's usable memory (40 GiB × vLLM's 0.9), not from the planner.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from gearshift.facts.fleet import datasheet_profile, load_fleet
from gearshift.facts.model import GIB, load_hf_config
from gearshift.planner.costs import KV_HEADROOM, RooflineAssumptions, RooflineCostModel
from gearshift.planner.errors import InfeasibleError
from gearshift.planner.gears import plan
from gearshift.planner.partition import fewest_stages, min_bottleneck
from gearshift.planner.profile import parse_profile
from gearshift.router import policies
from gearshift.sim.perfmodel import PerfModel, single_stage_pipeline

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ARCH = load_hf_config(EXAMPLES / "models" / "llama-3-8b.json")
KV_BYTES_TOKEN_LAYER = 2 * 8 * 128 * 2  # K and V, 8 KV heads × 128 dims, 2 bytes
A100_USABLE_GIB = 40 * 0.9
TRACE = {"prompt_tokens": 1155, "output_tokens": 211}  # the Azure conv trace's means (bench/gears.py)


def _one_node(memory_gb: float) -> dict:
    return {
        "nodes": [
            {"node_id": "a100", "generation": "A100-40GB", "memory_gb": memory_gb, "compute_score": 0.32}
        ]
    }


class TestTokensPerSequence:
    def test_headroom_is_the_routers_seed_000_factor(self) -> None:
        # One constant (gearshift.facts.model), the PD guide's 1.2, read by the planner and the router alike.
        assert KV_HEADROOM == 1.2 and policies.KV_HEADROOM is KV_HEADROOM

    @pytest.mark.parametrize(
        ("prompt", "output", "role", "want"),
        [
            (512, 128, "both", 768),  # the API defaults: 1.2 × 640
            (1155, 211, "both", 1640),  # ceil(1.2 × 1366 = 1639.2)
            (1155, 211, "decode", 1640),  # a decode pod holds the prompt's KV and every output token's
            (1155, 211, "prefill", 1388),  # a prefill pod only the prompt and first token: ceil(1.2 × 1156)
        ],
    )
    def test_from_the_workload(self, prompt: int, output: int, role: str, want: int) -> None:
        a = RooflineAssumptions(prompt_tokens=prompt, output_tokens=output, role=role)
        assert a.kv_tokens_per_sequence == want

    def test_an_explicit_context_wins(self) -> None:
        assert RooflineAssumptions(kv_context_tokens=4096, **TRACE).kv_tokens_per_sequence == 4096

    def test_kv_gb_per_layer(self) -> None:
        costs = RooflineCostModel(ARCH, RooflineAssumptions(**TRACE)).at(1)
        want = 64 * 1640 * KV_BYTES_TOKEN_LAYER / GIB  # 0.40 GiB per layer, 12.8 GiB for 32 layers
        assert costs.kv_gb == pytest.approx((want,) * 32, rel=1e-12)


class TestA100HoldsTheWholeModel:
    def test_at_the_trace_workload_but_not_at_64_x_4096(self) -> None:
        weights = (
            ARCH.num_layers * ARCH.layer_weight_bytes + 2 * ARCH.vocab_size * ARCH.hidden_size * 2
        ) / GIB
        fits = weights + 64 * math.ceil(1.2 * 1366) * KV_BYTES_TOKEN_LAYER * 32 / GIB
        old = weights + 64 * 4096 * KV_BYTES_TOKEN_LAYER * 32 / GIB
        assert fits < A100_USABLE_GIB < old  # ~27.8 < 36 < 47.0 GiB
        profile = parse_profile(_one_node(A100_USABLE_GIB))
        workload = RooflineCostModel(ARCH, RooflineAssumptions(**TRACE))
        assert fewest_stages(profile, workload.at(1)) == 1
        p = min_bottleneck(profile, workload.at(1))
        assert [(s.start, s.end) for s in p.stages] == [(0, 32)]
        assert p.stages[0].memory_gb == pytest.approx(fits, rel=1e-9)
        fixed = RooflineCostModel(ARCH, RooflineAssumptions(kv_context_tokens=4096, **TRACE))
        with pytest.raises(InfeasibleError):
            min_bottleneck(profile, fixed.at(1))

    def test_the_engine_pool_holds_the_reserved_batch(self) -> None:
        # The simulated engine's pool is what 90 % of the card leaves after its weights; the planner's
        # reservation must fit in it, or the gear's max batch would preempt on the engine.
        model = PerfModel(ARCH, single_stage_pipeline(ARCH, "A100-40GB", 1))
        assert model.stage_kv_tokens(0) >= 64 * 1640
        assert model.stage_kv_tokens(0) < 64 * 4096

    def test_mixed_fleet_a100s_join_the_throughput_gear_not_the_latency_gear(self) -> None:
        doc = datasheet_profile(load_fleet(EXAMPLES / "fleets/mixed.yaml"))
        for n in doc["nodes"]:  # usable memory, as gearshift.planner.inputs.datasheet_profile
            n["memory_gb"] *= 0.9
        profile = parse_profile(doc)
        a100s, h100s = {"gpu-a100-0", "gpu-a100-1"}, {"gpu-h100-0", "gpu-h100-1"}

        def whole_model_nodes(kv_context_tokens: int | None, gear: str) -> set[str]:
            a = RooflineAssumptions(kv_context_tokens=kv_context_tokens, **TRACE)
            res = plan(profile, RooflineCostModel(ARCH, a), intents=[gear], sim_requests=200)
            return {n for s in res.gears[0].stages if s.layers == (0, 32) for n in s.nodes}

        # At the trace workload the A100s hold the whole model (test above) but run it slower than the
        # H100s: they add capacity (throughput gear) without lowering P99 (latency gear keeps to H100s).
        assert whole_model_nodes(None, "latency") == h100s
        assert whole_model_nodes(None, "throughput") == h100s | a100s
        # At 64 × 4096 tokens they cannot hold it: no gear replicates the whole model onto them.
        assert not a100s & whole_model_nodes(4096, "throughput")
