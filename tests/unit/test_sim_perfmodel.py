"""The simulated engine's performance model against hand-computed roofline values."""

from __future__ import annotations

import math

import pytest

from gearshift.facts.model import GIB, ModelArch
from gearshift.sim.perfmodel import (
    Link,
    PerfModel,
    PerfParams,
    PipelineConfigError,
    Work,
    parse_pipeline,
    single_stage_pipeline,
)

# A small GQA model whose numbers are easy to redo by hand.
H, NQ, NKV, D, FF, V, L = 1024, 8, 2, 128, 4096, 1000, 4
ARCH = ModelArch(
    name="tiny",
    num_layers=L,
    hidden_size=H,
    num_heads=NQ,
    num_kv_heads=NKV,
    head_dim=D,
    intermediate_size=FF,
    vocab_size=V,
)
ATTN = H * NQ * D + 2 * H * NKV * D + NQ * D * H  # q, k, v, o
MLP = 3 * H * FF  # gate, up, down
LAYER_BYTES = (ATTN + MLP + 2 * H) * 2  # + two norms, bf16
LM_HEAD_BYTES = V * H * 2
KV_TOKEN_LAYER = 2 * NKV * D * 2
H100_FLOPS = 989e12
H100_BW = 3350e9


class TestSingleStage:
    def test_prefill_is_compute_bound_and_matches_hand_roofline(self) -> None:
        m = PerfModel(ARCH, single_stage_pipeline(ARCH, "H100-80GB"), PerfParams(mfu=0.5, mbu=0.7))
        p = 2000
        flops = L * (p * 2 * (ATTN + MLP) + 4 * NQ * D * (p * (p - 1) / 2)) + 2 * V * H
        read = L * LAYER_BYTES + LM_HEAD_BYTES + L * KV_TOKEN_LAYER * p
        expected = max(flops / (H100_FLOPS * 0.5), read / (H100_BW * 0.7))
        assert flops / (H100_FLOPS * 0.5) > read / (H100_BW * 0.7)  # the test's premise
        assert m.prefill_time_s(p) == pytest.approx(expected, rel=1e-12)

    def test_decode_is_memory_bound_and_grows_with_context(self) -> None:
        m = PerfModel(ARCH, single_stage_pipeline(ARCH, "A100-80GB"), PerfParams(mbu=0.8))
        ctx, batch = 3000, 4
        read = L * LAYER_BYTES + LM_HEAD_BYTES + L * KV_TOKEN_LAYER * batch * (ctx + 1)
        assert m.decode_step_s(ctx, batch) == pytest.approx(read / (2039e9 * 0.8), rel=1e-12)
        assert m.decode_step_s(ctx + 1000, batch) > m.decode_step_s(ctx, batch)

    def test_single_request_gaps_use_the_cache_that_exists(self) -> None:
        m = PerfModel(ARCH, single_stage_pipeline(ARCH, "H100-80GB"))
        ttft, itls = m.single_request(100, 4)
        assert ttft == m.prefill_time_s(100)
        # Token 2 computes token 1 over the 100-token prompt; token 4 over 102 cached tokens.
        assert itls == [m.decode_step_s(100), m.decode_step_s(101), m.decode_step_s(102)]

    def test_kv_capacity_is_what_weights_leave_of_90_percent(self) -> None:
        m = PerfModel(ARCH, single_stage_pipeline(ARCH, "A10-24GB"))
        weights = L * LAYER_BYTES + 2 * LM_HEAD_BYTES  # embedding + untied LM head
        tokens = (24 * GIB * 0.9 - weights) // (KV_TOKEN_LAYER * L)
        assert m.kv_capacity_blocks() == int(tokens) // 16

    def test_tensor_parallel_stage_gets_seed_efficiency(self) -> None:
        one = PerfModel(ARCH, single_stage_pipeline(ARCH, "H100-80GB", 1))
        two = PerfModel(ARCH, single_stage_pipeline(ARCH, "H100-80GB", 2))
        assert one.prefill_time_s(4000) / two.prefill_time_s(4000) == pytest.approx(2 * 0.85, rel=1e-9)


class TestPipeline:
    def doc(self, micro_batch: int) -> dict:
        return {
            "stages": [{"layers": [0, 1], "gpu": "H100-80GB"}, {"layers": [1, 4], "gpu": "A10-24GB"}],
            "links": [{"gbps": 100, "latencyUs": 20}],
            "microBatch": micro_batch,
        }

    def test_period_is_max_of_latency_and_micro_batches_times_bottleneck(self) -> None:
        pipe = parse_pipeline(self.doc(2), ARCH)
        m = PerfModel(ARCH, pipe, PerfParams(mbu=0.7))
        batch, ctx = 3, 500
        mbs = 2  # ceil(3 / 2)
        per_mb = batch / mbs
        s0 = (1 * LAYER_BYTES + 1 * KV_TOKEN_LAYER * per_mb * (ctx + 1)) / (3350e9 * 0.7)
        s1 = (3 * LAYER_BYTES + LM_HEAD_BYTES + 3 * KV_TOKEN_LAYER * per_mb * (ctx + 1)) / (600e9 * 0.7)
        link = 20e-6 + H * 2 * per_mb * 8 / 100e9
        t = m.step([Work(1, ctx)] * batch)
        assert t.micro_batches == mbs
        assert t.latency_s == pytest.approx(s0 + s1 + link, rel=1e-9)
        assert t.period_s == pytest.approx(max(s0 + s1 + link, mbs * max(s0, s1)), rel=1e-9)
        assert t.stage_busy_s == pytest.approx([mbs * s0, mbs * s1], rel=1e-9)

    def test_at_most_one_micro_batch_per_stage_is_in_flight(self) -> None:
        # vLLM V1's batch queue holds pipeline-parallel-size batches: 8 sequences at micro-batch 2 on two
        # stages run as 2 micro-batches of 4 (each stage reads its weights twice per step), not 4 of 2.
        pipe = parse_pipeline(self.doc(2), ARCH)
        m = PerfModel(ARCH, pipe, PerfParams(mbu=0.7))
        batch, ctx = 8, 500
        per_mb = batch / 2
        s0 = (1 * LAYER_BYTES + 1 * KV_TOKEN_LAYER * per_mb * (ctx + 1)) / (3350e9 * 0.7)
        s1 = (3 * LAYER_BYTES + LM_HEAD_BYTES + 3 * KV_TOKEN_LAYER * per_mb * (ctx + 1)) / (600e9 * 0.7)
        t = m.step([Work(1, ctx)] * batch)
        assert t.micro_batches == 2
        assert t.stage_busy_s == pytest.approx([2 * s0, 2 * s1], rel=1e-9)

    def test_kv_pool_is_bounded_by_the_tightest_stage(self) -> None:
        m = PerfModel(ARCH, parse_pipeline(self.doc(1), ARCH))
        a10_tokens = (24 * GIB * 0.9 - (3 * LAYER_BYTES + LM_HEAD_BYTES)) // (KV_TOKEN_LAYER * 3)
        h100_tokens = (80 * GIB * 0.9 - (LAYER_BYTES + LM_HEAD_BYTES)) // KV_TOKEN_LAYER
        assert m.kv_capacity_blocks() == int(min(a10_tokens, h100_tokens)) // 16

    def test_kv_transfer_charges_prompt_kv_over_the_link(self) -> None:
        m = PerfModel(ARCH, single_stage_pipeline(ARCH))
        link = Link(gbps=10, latency_us=50)
        assert m.kv_transfer_s(1000, link) == pytest.approx(50e-6 + 1000 * KV_TOKEN_LAYER * L * 8 / 10e9)

    def test_gpu_profile_overrides_datasheet(self) -> None:
        doc = {"stages": [{"layers": [0, 4], "gpu": "H100-80GB"}]}
        fast = PerfModel(ARCH, parse_pipeline(doc, ARCH))
        slow = PerfModel(ARCH, parse_pipeline(doc, ARCH, [{"hbmGBps": 3350 / 2}]))
        assert slow.decode_step_s(10) == pytest.approx(2 * fast.decode_step_s(10))

    @pytest.mark.parametrize(
        ("doc", "field"),
        [
            ({"stages": []}, "pipeline.stages"),
            ({"stages": [{"layers": [0, 3], "gpu": "H100-80GB"}]}, "cover layers [0, 3)"),
            ({"stages": [{"layers": [1, 4], "gpu": "H100-80GB"}]}, "pipeline.stages[0].layers"),
            ({"stages": [{"layers": [0, 4], "gpu": "B300"}]}, "pipeline.stages[0].gpu"),
            (
                {
                    "stages": [{"layers": [0, 2], "gpu": "T4-16GB"}, {"layers": [2, 4], "gpu": "T4-16GB"}],
                    "links": [{}],
                },
                "pipeline.links[0].gbps",
            ),
            ({"stages": [{"layers": [0, 4], "gpu": "H100-80GB"}], "microBatch": 0}, "pipeline.microBatch"),
        ],
    )
    def test_bad_pipelines_name_the_field(self, doc: dict, field: str) -> None:
        with pytest.raises(PipelineConfigError, match=field.replace("[", r"\[").replace(")", r"\)")):
            parse_pipeline(doc, ARCH)


def test_empty_step_takes_no_time() -> None:
    m = PerfModel(ARCH, single_stage_pipeline(ARCH))
    assert m.step([]).period_s == 0.0
    assert math.isfinite(m.decode_step_s(0))
