"""The simulated engine: scheduler and KV pool driven step by step, and the HTTP server in process."""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from gearshift.model import GIB, ModelArch, load_hf_config
from gearshift.sim.config import SimConfigError, config_from_env, on_own_card
from gearshift.sim.engine import Engine, RequestRejected
from gearshift.sim.perfmodel import Link, PerfModel, PerfParams, Work, parse_pipeline
from gearshift.sim.server import BadRequest, build_app, parse_request

REPO = Path(__file__).resolve().parents[2]
LLAMA8B_PATH = str(REPO / "examples" / "models" / "llama-3-8b.json")
LLAMA8B = load_hf_config(LLAMA8B_PATH)
ARCH = ModelArch("tiny", num_layers=4, hidden_size=1024, num_heads=8, num_kv_heads=2, head_dim=128,
                 intermediate_size=4096, vocab_size=1000)  # fmt: skip


def tiny_engine(blocks: int, max_batch: int = 8, **kw: Any) -> Engine:
    """An engine over the tiny model whose KV pool holds exactly ``blocks`` blocks of 16 tokens."""
    probe = PerfModel(ARCH, parse_pipeline({"stages": [{"layers": [0, 4], "gpu": "H100-80GB"}]}, ARCH))
    need = probe.stage_weight_bytes(0) + (blocks * 16 + 0.5) * ARCH.kv_bytes_per_token
    doc = {"stages": [{"layers": [0, 4], "gpu": "H100-80GB"}], "maxBatch": max_batch}
    pipe = parse_pipeline(doc, ARCH, [{"memoryGiB": need / 0.9 / GIB}])
    engine = Engine(PerfModel(ARCH, pipe), clock=lambda: 0.0, **kw)
    assert engine.total_blocks == blocks
    return engine


class TestScheduler:
    def test_continuous_batching_admits_new_requests_beside_running_ones(self) -> None:
        e = tiny_engine(100)
        r1 = e.new_request(40, 5)
        assert e.schedule(0.0) == [(r1, 40)]
        e.complete([(r1, 40)], 1.0)
        assert (r1.generated, r1.first_token_at) == (1, 1.0)
        r2 = e.new_request(20, 5)
        batch = e.schedule(1.0)
        assert batch == [(r1, 1), (r2, 20)]  # r1 decodes while r2 prefills in the same step
        e.complete(batch, 2.0)
        assert (r1.generated, r2.generated) == (2, 1)
        assert r1.blocks == math_ceil(41, 16) and r2.blocks == math_ceil(20, 16)

    def test_request_waits_when_its_blocks_are_not_free(self) -> None:
        e = tiny_engine(4)
        r1 = e.new_request(40, 2)  # 3 blocks
        r2 = e.new_request(40, 2)  # would need 3 more
        assert e.schedule(0.0) == [(r1, 40)]
        e.complete([(r1, 40)], 1.0)
        assert e.num_waiting() == 1 and r2.blocks == 0
        batch = e.schedule(1.0)
        assert batch == [(r1, 1)]
        e.complete(batch, 2.0)
        assert r1.finished and e.free_blocks == 4  # blocks return to the pool
        assert e.schedule(2.0) == [(r2, 40)]

    def test_growth_without_free_blocks_preempts_the_newest_running_request(self) -> None:
        e = tiny_engine(4)
        r1 = e.new_request(32, 10)  # 2 blocks, full
        r2 = e.new_request(30, 10)  # 2 blocks
        batch = e.schedule(0.0)
        assert batch == [(r1, 32), (r2, 30)]
        e.complete(batch, 1.0)
        # r1 now caches its 33rd token: a third block; none is free, so r2 (newest) is preempted.
        batch = e.schedule(1.0)
        assert batch == [(r1, 1)]
        assert list(e.waiting) == [r2] and r2.blocks == 0 and r2.preemptions == 1
        assert r2.prefill_target == 30 + 1  # recompute the prompt and the token it already produced
        assert e.metrics.preemptions._value.get() == 1

    def test_scheduler_respects_max_batch(self) -> None:
        e = tiny_engine(100, max_batch=2)
        reqs = [e.new_request(10, 3) for _ in range(3)]
        assert [r for r, _ in e.schedule(0.0)] == reqs[:2]

    def test_prefill_only_request_ends_after_first_token(self) -> None:
        e = tiny_engine(100)
        r = e.new_request(50, 100, prefill_only=True)
        e.complete(e.schedule(0.0), 1.0)
        assert r.finished and r.generated == 1 and e.free_blocks == 100

    def test_remote_prefill_waits_for_kv_then_decodes_without_prefill_compute(self) -> None:
        e = tiny_engine(100, kv_link=Link(gbps=1, latency_us=0))
        r = e.new_request(64, 3, remote_kv_tokens=64)
        assert e.schedule(0.0) == []  # transferring, no compute
        ready = 64 * ARCH.kv_bytes_per_token * 8 / 1e9
        assert r.ready_at == pytest.approx(ready)
        assert e.schedule(ready / 2) == []
        assert e.schedule(ready) == [(r, 1)]  # straight to a decode step over 64 cached tokens
        assert e.model.step([Work(1, r.computed)]).period_s == e.model.decode_step_s(64)

    def test_too_long_requests_are_rejected_with_the_field(self) -> None:
        e = tiny_engine(4)
        with pytest.raises(RequestRejected) as exc:
            e.new_request(60, 10)
        assert exc.value.param == "max_tokens"


def math_ceil(a: int, b: int) -> int:
    return -(-a // b)


class TestParsing:
    def test_token_ids_count_exactly_and_text_counts_words(self) -> None:
        assert parse_request({"prompt": [5] * 37}, chat=False).prompt_tokens == 37
        assert parse_request({"prompt": "one two  three"}, chat=False).prompt_tokens == 3
        chat = {
            "messages": [{"role": "user", "content": "a b"}, {"role": "user", "content": [{"text": "c"}]}]
        }
        assert parse_request(chat, chat=True).prompt_tokens == 3

    @pytest.mark.parametrize(
        ("body", "chat", "param"),
        [
            ({"prompt": ["a", "b"]}, False, "prompt"),
            ({"prompt": "x", "max_tokens": 0}, False, "max_tokens"),
            ({"messages": []}, True, "messages"),
            ({"prompt": "x", "kv_transfer_params": 3}, False, "kv_transfer_params"),
        ],
    )
    def test_bad_bodies_name_the_field(self, body: dict, chat: bool, param: str) -> None:
        with pytest.raises(BadRequest) as exc:
            parse_request(body, chat)
        assert exc.value.param == param

    def test_config_errors_name_the_variable(self) -> None:
        with pytest.raises(SimConfigError, match="GEARSHIFT_MODEL"):
            config_from_env({})
        with pytest.raises(SimConfigError, match="GEARSHIFT_PIPELINE"):
            config_from_env({"GEARSHIFT_MODEL": json.dumps(ARCH.to_dict()), "GEARSHIFT_PIPELINE": "{"})
        with pytest.raises(SimConfigError, match="GEARSHIFT_ROLE"):
            config_from_env({"GEARSHIFT_MODEL": json.dumps(ARCH.to_dict()), "GEARSHIFT_ROLE": "x"})


class TestOwnCard:
    """A replicated stage planned for the slowest card runs, per pod, on the card under it."""

    def test_the_node_card_times_the_pod_and_sizes_its_kv(self) -> None:
        planned = config_from_env(a10_env())
        on_h100 = config_from_env(a10_env(GEARSHIFT_SANDBOX_GPU_MODEL="H100-80GB"))
        assert on_h100.pipeline.stages[0].gpu == "H100-80GB"
        # KV tokens from memory: (80 GiB * util - weights) vs (24 GiB * util - weights), per token bytes
        # the same, so the H100 pod must hold (80u - w) / (24u - w) times the A10 pod's tokens.
        util = PerfParams().gpu_memory_utilization
        held = PerfModel(LLAMA8B, planned.pipeline).stage_weight_bytes(0)
        gib = 1024**3
        want = (80 * gib * util - held) / (24 * gib * util - held)
        a10_tokens = PerfModel(LLAMA8B, planned.pipeline).stage_kv_tokens(0)
        h100_tokens = PerfModel(LLAMA8B, on_h100.pipeline).stage_kv_tokens(0)
        assert h100_tokens / a10_tokens == pytest.approx(want, rel=1e-3)

    def test_only_the_own_stage_changes(self) -> None:
        doc = {"stages": [{"layers": [0, 16], "gpu": "A10-24GB"}, {"layers": [16, 32], "gpu": "T4-16GB"}]}
        assert on_own_card(doc, 1, "L4-24GB")["stages"] == [
            doc["stages"][0],
            {"layers": [16, 32], "gpu": "L4-24GB"},
        ]
        assert doc["stages"][1]["gpu"] == "T4-16GB"  # the input is not mutated

    @pytest.mark.parametrize("card", ["", "cpu", "NoSuchGPU"])
    def test_unknown_or_absent_card_keeps_the_plan(self, card: str) -> None:
        doc = {"stages": [{"layers": [0, 32], "gpu": "A10-24GB"}]}
        assert on_own_card(doc, 0, card) is doc


def a10_env(**extra: str) -> dict[str, str]:
    return {
        "GEARSHIFT_MODEL": LLAMA8B_PATH,
        "GEARSHIFT_SERVED_MODEL_NAME": "llama",
        "GEARSHIFT_PIPELINE": json.dumps({"stages": [{"layers": [0, 32], "gpu": "A10-24GB"}]}),
        **extra,
    }


@pytest.fixture
async def client_for() -> AsyncIterator[Any]:
    clients: list[TestClient] = []

    async def make(env: dict[str, str]) -> TestClient:
        cfg = config_from_env(env)
        client = TestClient(TestServer(build_app(cfg), host="127.0.0.1"))
        await client.start_server()
        clients.append(client)
        return client

    yield make
    for c in clients:
        await c.close()


async def _stream(client: TestClient, body: dict) -> tuple[list[dict], list[float], float]:
    """Chunks of a streamed completion, the arrival time of each content chunk, and the send time."""
    import time

    t0 = time.perf_counter()
    resp = await client.post("/v1/completions", json={**body, "stream": True})
    assert resp.status == 200
    chunks, times, buf = [], [], b""
    async for data in resp.content.iter_any():
        buf += data
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            payload = ev.removeprefix(b"data: ")
            if payload == b"[DONE]":
                chunks.append({"done": True})
                continue
            doc = json.loads(payload)
            chunks.append(doc)
            if doc["choices"] and doc["choices"][0]["text"]:
                times.append(time.perf_counter())
    return chunks, times, t0


class TestServer_:
    async def test_lone_request_timing_follows_the_model(self, client_for: Any) -> None:
        client = await client_for(a10_env())
        model = PerfModel(
            LLAMA8B, parse_pipeline({"stages": [{"layers": [0, 32], "gpu": "A10-24GB"}]}, LLAMA8B)
        )
        ttft_pred, itls_pred = model.single_request(300, 4)
        chunks, times, t0 = await _stream(client, {"prompt": [7] * 300, "max_tokens": 4})
        ttft = times[0] - t0
        gaps = [b - a for a, b in itertools.pairwise(times)]
        assert ttft_pred <= ttft < ttft_pred + 0.15
        assert len(gaps) == 3
        assert sum(itls_pred) - 0.003 <= sum(gaps) < sum(itls_pred) + 0.15
        assert chunks[-1] == {"done": True}
        texts = "".join(c["choices"][0]["text"] for c in chunks[:-1] if c.get("choices"))
        assert len(texts.split()) == 4

    async def test_usage_chunk_and_chat_stream(self, client_for: Any) -> None:
        client = await client_for(a10_env())
        body = {"messages": [{"role": "user", "content": "a b c"}], "max_tokens": 2, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        resp = await client.post("/v1/chat/completions", json=body)
        events = [e.removeprefix("data: ") for e in (await resp.text()).split("\n\n") if e]
        assert events[-1] == "[DONE]"
        usage = json.loads(events[-2])["usage"]
        assert usage == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        assert json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"

    async def test_pd_prefill_then_decode_skips_prefill_and_charges_transfer(self, client_for: Any) -> None:
        prefill = await client_for(a10_env(GEARSHIFT_ROLE="prefill"))
        decode = await client_for(a10_env(GEARSHIFT_ROLE="decode", GEARSHIFT_KV_LINK='{"gbps": 10}'))
        body = {"prompt": [3] * 1000, "max_tokens": 3}
        r = await prefill.post(
            "/v1/completions",
            json={
                **body,
                "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
            },
        )
        doc = await r.json()
        ktp = doc["kv_transfer_params"]
        assert ktp["do_remote_prefill"] is True and ktp["num_prompt_tokens"] == 1000
        assert len(ktp["remote_block_ids"]) == math_ceil(1000, 16)
        assert doc["usage"]["completion_tokens"] == 1

        model = PerfModel(
            LLAMA8B, parse_pipeline({"stages": [{"layers": [0, 32], "gpu": "A10-24GB"}]}, LLAMA8B)
        )
        transfer = model.kv_transfer_s(1000, Link(gbps=10))
        expected = transfer + model.decode_step_s(1000)
        assert expected + 0.15 < transfer + model.prefill_time_s(1000)  # so timing can tell them apart
        _, times, t0 = await _stream(decode, {**body, "kv_transfer_params": ktp})
        assert expected <= times[0] - t0 < expected + 0.15
        assert len(times) == 3

    async def test_metrics_use_vllm_names_and_count(self, client_for: Any) -> None:
        client = await client_for(a10_env())
        for _ in range(2):
            assert (
                await client.post("/v1/completions", json={"prompt": "a b", "max_tokens": 2})
            ).status == 200
        text = await (await client.get("/metrics")).text()
        assert (
            'vllm:request_success_total{engine="0",finished_reason="length",model_name="llama"} 2.0' in text
        )
        assert 'vllm:time_to_first_token_seconds_count{engine="0",model_name="llama"} 2.0' in text
        assert 'vllm:inter_token_latency_seconds_count{engine="0",model_name="llama"} 2.0' in text
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                     "vllm:e2e_request_latency_seconds_bucket", "vllm:request_time_per_output_token_seconds",
                     'gearshift:stage_utilization{engine="0",model_name="llama",stage="0"}'):  # fmt: skip
            assert name in text
        models = await (await client.get("/v1/models")).json()
        assert models["data"][0]["id"] == "llama"

    async def test_cache_config_info_sizes_the_kv_pool_for_the_router(self, client_for: Any) -> None:
        # The router's decode headroom filter reads the pool from vllm:cache_config_info (as from vLLM);
        # without it the filter passes every pod and no "no decode headroom" scale-up is ever requested.
        from gearshift.router.signals import parse_metrics
        from gearshift.sim.config import config_from_env
        from gearshift.sim.perfmodel import PerfModel

        env = a10_env()
        client = await client_for(env)
        text = await (await client.get("/metrics")).text()
        assert "vllm:cache_config_info{" in text
        cfg = config_from_env(env)
        model = PerfModel(cfg.arch, cfg.pipeline, cfg.params)
        expected = model.kv_capacity_blocks() * model.params.block_size
        assert parse_metrics(text).kv_capacity_tokens == expected > 0

    async def test_errors_are_openai_shaped(self, client_for: Any) -> None:
        client = await client_for(a10_env(GEARSHIFT_MAX_MODEL_LEN="100"))
        r = await client.post("/v1/completions", json={"prompt": [1] * 90, "max_tokens": 20})
        assert r.status == 400 and (await r.json())["param"] == "max_tokens"
        r = await client.post("/v1/completions", json={"prompt": "x", "model": "other"})
        assert r.status == 404

    async def test_worker_pod_serves_health_and_metrics_only(self, client_for: Any) -> None:
        doc = {"stages": [{"layers": [0, 16], "gpu": "A10-24GB"}, {"layers": [16, 32], "gpu": "T4-16GB"}]}
        client = await client_for(a10_env(GEARSHIFT_STAGE="1", GEARSHIFT_PIPELINE=json.dumps(doc)))
        assert (await client.get("/health")).status == 200
        assert 'gearshift:sim_worker{stage="1"} 1.0' in await (await client.get("/metrics")).text()
        assert (await client.post("/v1/completions", json={"prompt": "x"})).status == 404


def test_listen_flags_make_one_engine_config_per_listener() -> None:
    from gearshift.sim.server import build_arg_parser, configs_from_args

    args = build_arg_parser().parse_args(["--listen", "127.0.0.2:8000", "--listen", "127.0.0.3:8000"])
    cfgs = configs_from_args(args, a10_env())
    assert [c.listen for c in cfgs] == ["127.0.0.2:8000", "127.0.0.3:8000"]
    assert cfgs[0] == replace(cfgs[1], host="127.0.0.2")
