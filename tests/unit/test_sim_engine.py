"""The simulated engine: scheduler and KV pool driven step by step, and the HTTP server in process."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from vllm_ref import vllm_protocol

from gearshift.facts.model import GIB, ModelArch, load_hf_config
from gearshift.sim.app import ENGINE_KEY, build_app
from gearshift.sim.config import SimConfigError, config_from_env, on_own_card
from gearshift.sim.engine import Engine, RequestRejected
from gearshift.sim.perfmodel import Link, PerfModel, PerfParams, Work, parse_pipeline
from gearshift.sim.protocol import REMOTE_PREFILL_KEYS, engine_request_id, remote_prefill_tokens
from gearshift.sim.request import BadRequest, parse_request

REPO = Path(__file__).resolve().parents[2]
LLAMA8B_PATH = str(REPO / "examples" / "models" / "llama-3-8b.json")
LLAMA8B = load_hf_config(LLAMA8B_PATH)
#: The prefill leg's kv_transfer_params as vLLM's toy proxy sends them (and the router does).
TOY_PROXY_PREFILL_KTP = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
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


class TestTokenHistograms:
    """``vllm:request_prompt_tokens`` and ``vllm:request_generation_tokens``: one observation per finished
    request, in vLLM's 1-2-5 buckets up to the engine's ``max_model_len``; read back from the exposition
    text with prometheus_client's own parser."""

    @staticmethod
    def _families(engine: Engine) -> dict[str, dict[str, float]]:
        """``{histogram: {le or "sum"/"count": value}}`` of the two token histograms."""
        from prometheus_client import generate_latest
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[str, dict[str, float]] = {}
        for family in text_string_to_metric_families(generate_latest(engine.metrics.registry).decode()):
            if family.name in ("vllm:request_prompt_tokens", "vllm:request_generation_tokens"):
                for sample in family.samples:
                    if sample.name.endswith("_created"):
                        continue
                    key = sample.labels.get("le") or sample.name.rsplit("_", 1)[1]
                    out.setdefault(family.name, {})[key] = sample.value
        return out

    def test_every_finished_request_is_observed_once(self) -> None:
        e = tiny_engine(100)  # 1600 tokens of KV: max_model_len 1600
        assert e.max_model_len == 1600
        whole = [(40, 5), (90, 3), (300, 12), (7, 1)]  # (prompt, max_tokens)
        reqs = [e.new_request(p, n) for p, n in whole]
        leg = e.new_request(600, 50, prefill_only=True)  # a PD prefill leg: one token
        gone = e.new_request(20, 9)
        t = 0.0
        while not all(r.finished for r in [*reqs, leg]):
            t += 1.0
            e.complete(e.schedule(t), t)
            if t == 2.0:
                e.abort(gone)  # finished too, as vLLM counts an aborted request (after 2 tokens here)
        prompts = [p for p, _ in whole] + [600, 20]
        outputs = [n for _, n in whole] + [1, 2]
        assert gone.generated == 2

        fams = self._families(e)
        ladder = [m * 10**k for k in range(5) for m in (1, 2, 5) if m * 10**k <= 1600]
        assert ladder[-1] == 1000
        for name, values in (
            ("vllm:request_prompt_tokens", prompts),
            ("vllm:request_generation_tokens", outputs),
        ):
            got = fams[name]
            assert got["count"] == len(values) and got["sum"] == sum(values)
            assert {le: n for le, n in got.items() if le not in ("sum", "count")} == {
                **{f"{float(le)}": sum(v <= le for v in values) for le in ladder},
                "+Inf": len(values),
            }


def math_ceil(a: int, b: int) -> int:
    return -(-a // b)


class TestPdProtocol:
    def test_remote_prefill_needs_blocks_and_the_four_keys(self) -> None:
        full = {"do_remote_prefill": True, "remote_block_ids": [[1]], "remote_engine_id": "e",
                "remote_request_id": "r", "remote_host": "h", "remote_port": 1}  # fmt: skip
        assert remote_prefill_tokens(full, 50) == 50  # the decode request's own prompt, as vLLM counts
        assert remote_prefill_tokens({**full, "do_remote_prefill": False}, 50) == 0
        assert remote_prefill_tokens({**full, "remote_block_ids": []}, 50) == 0
        for key in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port"):
            assert remote_prefill_tokens({k: v for k, v in full.items() if k != key}, 50) == 0
        assert remote_prefill_tokens({}, 50) == 0

    def test_engine_request_ids(self) -> None:
        assert re.fullmatch(r"cmpl-a-0-[0-9a-f]{8}", engine_request_id("cmpl-a", chat=False))
        assert re.fullmatch(r"chatcmpl-a-[0-9a-f]{8}", engine_request_id("chatcmpl-a", chat=True))


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


def spy_new_requests(engine: Engine) -> list[dict[str, Any]]:
    """The keyword arguments of every ``engine.new_request`` call from now on (the engine still runs it)."""
    calls: list[dict[str, Any]] = []
    real = engine.new_request

    def spy(*args: Any, **kw: Any) -> Any:
        calls.append(kw)
        return real(*args, **kw)

    engine.new_request = spy  # type: ignore[method-assign]
    return calls


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
        # No token comes before the model's time; the gaps alone may sum to less when a loaded machine
        # delivered the first token late and the engine's timeline caught up (CI: 104.5 ms of 107.5).
        assert ttft_pred + sum(itls_pred) - 0.003 <= times[-1] - t0 < ttft_pred + sum(itls_pred) + 0.3
        assert sum(gaps) < sum(itls_pred) + 0.15
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
        assert json.loads(events[0])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        # as vLLM: the role only in the first chunk, then content deltas only
        deltas = [json.loads(e)["choices"][0]["delta"] for e in events[1:-2]]
        assert deltas and all(set(d) == {"content"} and d["content"] for d in deltas)

    async def test_pd_prefill_then_decode_skips_prefill_and_charges_transfer(self, client_for: Any) -> None:
        prefill = await client_for(a10_env(GEARSHIFT_ROLE="prefill"))
        decode = await client_for(a10_env(GEARSHIFT_ROLE="decode", GEARSHIFT_KV_LINK='{"gbps": 10}'))
        body = {"prompt": [3] * 1000, "max_tokens": 3}
        r = await prefill.post(
            "/v1/completions",
            json={**body, "max_tokens": 1, "stream": False, "kv_transfer_params": TOY_PROXY_PREFILL_KTP},
            headers={"X-Request-Id": "rid-7"},
        )
        doc = await r.json()
        assert doc["id"] == "cmpl-rid-7"  # vLLM: cmpl-<X-Request-Id>
        ktp = doc["kv_transfer_params"]
        (blocks,) = ktp["remote_block_ids"]  # one KV-cache group
        assert blocks == list(range(blocks[0], blocks[0] + math_ceil(1000, 16)))
        assert re.fullmatch(r"cmpl-rid-7-0-[0-9a-f]{8}", ktp["remote_request_id"])
        stats = await (await prefill.get("/sim/stats")).json()
        assert ktp == {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [blocks],
            "remote_engine_id": stats["engineId"],
            "remote_request_id": ktp["remote_request_id"],
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": 1000,
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
        }
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

    async def test_chat_prefill_ids_and_a_pipeline_tp_pp(self, client_for: Any) -> None:
        stage = {"gpu": "A10-24GB", "gpus": 2}
        doc = {"stages": [{"layers": [0, 16], **stage}, {"layers": [16, 32], **stage}]}
        prefill = await client_for(a10_env(GEARSHIFT_ROLE="prefill", GEARSHIFT_PIPELINE=json.dumps(doc)))
        body = {
            "messages": [{"role": "user", "content": "a b c"}],
            "max_tokens": 1,
            "max_completion_tokens": 1,
            "stream": False,
            "kv_transfer_params": TOY_PROXY_PREFILL_KTP,
        }
        out = await (
            await prefill.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "c1"})
        ).json()
        assert out["id"] == "chatcmpl-c1"
        ktp = out["kv_transfer_params"]
        assert re.fullmatch(r"chatcmpl-c1-[0-9a-f]{8}", ktp["remote_request_id"])
        assert (ktp["tp_size"], ktp["pp_size"], ktp["remote_num_tokens"]) == (2, 2, 3)

    async def test_ids_from_the_body_or_new(self, client_for: Any) -> None:
        client = await client_for(a10_env())
        out = await (await client.post("/v1/completions", json={"prompt": "a", "request_id": "b-2"})).json()
        assert out["id"] == "cmpl-b-2"
        out = await (await client.post("/v1/completions", json={"prompt": "a"})).json()
        assert re.fullmatch(r"cmpl-[0-9a-f]{32}", out["id"])

    async def test_kv_transfer_params_only_for_a_remote_decode_request(self, client_for: Any) -> None:
        # vLLM's NixlConnector returns them only for a request that asked (request_finished: no params, no
        # answer); a prefill pod still answers a plain request after one token (the simulator's role rule).
        prefill = await client_for(a10_env(GEARSHIFT_ROLE="prefill"))
        out = await (await prefill.post("/v1/completions", json={"prompt": "a b", "max_tokens": 4})).json()
        assert "kv_transfer_params" not in out and out["usage"]["completion_tokens"] == 1

    async def test_decode_with_invalid_params_prefills_itself(self, client_for: Any) -> None:
        decode = await client_for(a10_env(GEARSHIFT_ROLE="decode"))
        calls = spy_new_requests(decode.server.app[ENGINE_KEY])
        # vLLM 0.11's shape lacks remote_request_id: 0.32 ignores such params ("Got invalid KVTransferParams")
        old = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1, 2],
               "remote_engine_id": "e", "remote_host": "h", "remote_port": 5600, "tp_size": 1}  # fmt: skip
        body = {"prompt": [1] * 40, "max_tokens": 2}
        assert (await decode.post("/v1/completions", json={**body, "kv_transfer_params": old})).status == 200
        good = {**old, "remote_request_id": "cmpl-x-0-abcdefgh"}
        assert (await decode.post("/v1/completions", json={**body, "kv_transfer_params": good})).status == 200
        assert [c["remote_kv_tokens"] for c in calls] == [0, 40]

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
        err = (await r.json())["error"]
        assert r.status == 400 and (err["param"], err["code"], err["type"]) == (
            "max_tokens",
            400,
            "BadRequestError",
        )
        r = await client.post("/v1/completions", json={"prompt": "x", "model": "other"})
        err = (await r.json())["error"]
        assert r.status == 404 and (err["param"], err["code"], err["type"]) == ("model", 404, "NotFoundError")
        # vLLM's own ErrorResponse reads it, with no field it does not define
        assert vllm_protocol().call("error", body=await r.json())["extra"] == []

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


# --- the simulated engine against vLLM's own code ------------------------------------------------------
class TestAgainstVllm:
    async def test_prefill_answers_parse_as_vllm_responses_with_nixl_keys(self, client_for: Any) -> None:
        vllm = vllm_protocol()
        nixl = vllm.nixl()
        prefill = await client_for(a10_env(GEARSHIFT_ROLE="prefill"))
        decode = await client_for(a10_env(GEARSHIFT_ROLE="decode"))
        legs = {
            "completion": ("/v1/completions", {"model": "llama", "prompt": "a b c", "max_tokens": 5}),
            "chat": (
                "/v1/chat/completions",
                {
                    "model": "llama",
                    "messages": [{"role": "user", "content": "a b"}],
                    "max_completion_tokens": 5,
                },
            ),
        }
        for kind, (path, body) in legs.items():
            ask = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": TOY_PROXY_PREFILL_KTP}
            if kind == "chat":
                ask["max_completion_tokens"] = 1
            r = await prefill.post(path, json=ask, headers={"X-Request-Id": f"v-{kind}"})
            assert r.status == 200
            doc = await r.json()
            parsed = vllm.response(kind, doc)
            ktp = doc["kv_transfer_params"]
            assert parsed["kv_transfer_params"] == ktp
            # the keys NixlConnector's scheduler returns (request_finished), no more, no fewer
            assert sorted(ktp) == sorted(nixl["prefill_returns"]), nixl["source"]
            # what vLLM's decode side requires before it pulls (update_state_after_alloc)
            assert list(REMOTE_PREFILL_KEYS) == nixl["decode_requires"]
            # the decode leg the router builds from it reaches vLLM's engine with these params
            dec = {**body, "kv_transfer_params": ktp}
            seen = vllm.request(kind, dec)
            assert seen["extra"] == [] and seen["kv_transfer_params"] == ktp and seen["max_tokens"] == 5
            r = await decode.post(path, json=dec, headers={"X-Request-Id": f"v-{kind}"})
            assert r.status == 200
            assert (
                vllm.response(kind, await r.json())["id"]
                == ("chatcmpl-" if kind == "chat" else "cmpl-") + f"v-{kind}"
            )


async def test_router_and_sim_speak_one_protocol(client_for: Any) -> None:
    """The router in front of a simulated prefill and decode pod: the decode pod pulls the KV of the
    prompt (no prefill of its own) under the client's request id."""
    from gearshift.router.pool import BackendInfo, PolicyConfig
    from gearshift.router.server import Router
    from gearshift.router.settings import RouterSettings

    prefill = await client_for(a10_env(GEARSHIFT_ROLE="prefill"))
    decode = await client_for(a10_env(GEARSHIFT_ROLE="decode"))
    calls = spy_new_requests(decode.server.app[ENGINE_KEY])
    router = Router(
        RouterSettings(
            backends=[
                BackendInfo("p0", str(prefill.make_url("")).rstrip("/"), "prefill"),
                BackendInfo("d0", str(decode.make_url("")).rstrip("/"), "decode"),
            ],
            policy=PolicyConfig(policy="round-robin"),
            scrape_interval_s=0.05,
            health_interval_s=30.0,
            seed=1,
        )
    )
    client = TestClient(TestServer(router.app(), host="127.0.0.1"))
    await client.start_server()
    try:
        body = {"model": "llama", "prompt": [5] * 64, "max_tokens": 3, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        resp = await client.post("/v1/completions", json=body, headers={"X-Request-Id": "e2e-1"})
        assert resp.status == 200 and resp.headers["X-Request-Id"] == "e2e-1"
        events = [e.removeprefix("data: ") for e in (await resp.text()).split("\n\n") if e]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert {c["id"] for c in chunks} == {"cmpl-e2e-1"}
        assert chunks[-1]["usage"] == {"prompt_tokens": 64, "completion_tokens": 3, "total_tokens": 67}
        assert calls == [{"remote_kv_tokens": 64, "prefill_only": False}]
    finally:
        await client.close()
