"""The router's OpenAI surface as vLLM serves it, and its request metrics on what a client sees.

- errors in vLLM's one shape (``ErrorResponse``, read by vLLM's own model), JSON for unknown routes,
  ``GET /v1/models/{id}``;
- TTFT from the first token event (not chat's role-only first chunk), ITL between token events only;
- a client that goes away mid-stream is ``client_disconnected``, not ``upstream_error``; an engine that
  breaks off a started stream ends it with an SSE error event instead of a second response.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiohttp import web
from test_router_proxy import Factory, FakeEngine, make_router  # noqa: F401  (the fixture)
from vllm_ref import vllm_protocol

from gearshift.router.errors import error_body
from gearshift.router.sse import complete_events, scan_sse
from gearshift.sim.app import build_app
from gearshift.sim.config import config_from_env

LLAMA = Path(__file__).resolve().parents[2] / "examples" / "models" / "llama-3-8b.json"
ROLE_DELAY_S = 0.25
"""How long the chat engine below waits between its role-only chunk and its first token, s."""


def _metric(text: str, name: str, outcome: str | None = None) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (outcome is None or f'outcome="{outcome}"' in line):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _metrics(client: object) -> str:
    return await (await client.get("/metrics")).text()  # type: ignore[attr-defined]


def test_token_events_are_counted_across_chunk_boundaries() -> None:
    role = b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n'
    tok = b'data: {"choices": [{"index": 0, "delta": {"content": " a"}}]}\n\n'
    usage = b'data: {"choices": [], "usage": {"completion_tokens": 2}}\n\n'
    done = b"data: [DONE]\n\n"
    whole = role + tok + tok + usage + done
    scan, rest = scan_sse(whole)
    assert (scan.tokens, scan.usage, rest) == (2, {"completion_tokens": 2}, b"")
    # cut anywhere: the counts of the pieces add up to the whole's, the tail carried over
    for cut in range(1, len(whole)):
        s1, rest = scan_sse(whole[:cut])
        s2, rest2 = scan_sse(rest + whole[cut:])
        assert (s1.tokens + s2.tokens, rest2) == (2, b""), cut
    completion = b'data: {"choices": [{"text": " x"}]}\r\n\r\ndata: {"choices": [{"text": ""}]}\n\n'
    assert scan_sse(completion)[0].tokens == 1
    assert scan_sse(b"data: not json\n\n: comment\n\n")[0].tokens == 0
    last = b'data: {"choices": [{"text": " y", "finish_reason": "length"}]}\n\n'
    assert scan_sse(completion + last)[0].finish_reason == "length"


@dataclass
class ChatEngine(FakeEngine):
    """A decode engine that streams chat as vLLM does: the role-only chunk at once, tokens later."""

    async def completions(self, request: web.Request) -> web.StreamResponse:
        if request.path != "/v1/chat/completions":
            return await super().completions(request)
        body = await request.json()
        self.requests.append(body)
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)

        def ev(doc: object) -> bytes:
            return b"data: " + json.dumps(doc).encode() + b"\n\n"

        await out.write(ev({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}))
        await asyncio.sleep(ROLE_DELAY_S)
        for i in range(self.tokens):
            await out.write(ev({"choices": [{"index": 0, "delta": {"content": f" t{i}"}}]}))
            await asyncio.sleep(0.01)
        await out.write(ev({"choices": [], "usage": {"completion_tokens": self.tokens}}))
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out


async def test_chat_ttft_starts_at_the_first_token_not_the_role_chunk(make_router: Factory) -> None:  # noqa: F811
    client, _router, _ = await make_router({"b0": ("both", ChatEngine("b0", tokens=4))})
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    t0 = time.perf_counter()
    resp = await client.post("/v1/chat/completions", json=body)
    first_token_at = None
    buf = b""
    async for chunk in resp.content.iter_any():
        buf += chunk
        if first_token_at is None and b'"content": " t0"' in buf:
            first_token_at = time.perf_counter() - t0
    assert first_token_at is not None
    m = await _metrics(client)
    ttft = _metric(m, "gearshift_router_upstream_ttft_seconds_sum")
    assert _metric(m, "gearshift_router_upstream_ttft_seconds_count") == 1
    # the router's TTFT is the client's time to the first token (within 10%), not to the role chunk
    assert ROLE_DELAY_S <= ttft <= first_token_at * 1.1
    # 4 tokens: 3 gaps; the usage chunk and [DONE] are no gaps
    assert _metric(m, "gearshift_router_upstream_itl_seconds_count") == 3


@pytest.mark.parametrize("cancelled", [False, True], ids=["run_app", "handler_cancellation"])
async def test_a_client_that_leaves_mid_stream_is_not_an_upstream_error(
    make_router: Factory,  # noqa: F811
    cancelled: bool,
) -> None:
    # web.run_app (the router's): the next write fails; with handler_cancellation the handler is cancelled
    engines = {"b0": ("both", FakeEngine("b0", tokens=200))}
    client, _router, _ = await make_router(engines, handler_cancellation=cancelled)
    resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 200, "stream": True})
    assert resp.status == 200
    await resp.content.readline()
    resp.close()  # the client goes away after the first line
    deadline = time.monotonic() + 10
    m = ""
    while time.monotonic() < deadline:
        m = await _metrics(client)
        if _metric(m, "gearshift_router_requests_total", "client_disconnected"):
            break
        await asyncio.sleep(0.05)
    assert _metric(m, "gearshift_router_requests_total", "client_disconnected") == 1, [
        ln for ln in m.splitlines() if ln.startswith("gearshift_router_requests_total")
    ]
    assert _metric(m, "gearshift_router_requests_total", "upstream_error") == 0


@dataclass
class BreakingEngine(FakeEngine):
    """Streams two tokens, then drops the connection without ending the stream."""

    async def completions(self, request: web.Request) -> web.StreamResponse:
        await request.json()
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i in range(2):
            await out.write(f"data: {json.dumps({'choices': [{'text': f' t{i}'}]})}\n\n".encode())
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.close()
        return out


async def test_an_engine_that_breaks_off_ends_the_stream_with_an_error_event(make_router: Factory) -> None:  # noqa: F811
    client, _router, _ = await make_router({"b0": ("both", BreakingEngine("b0"))})
    resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 9, "stream": True})
    assert resp.status == 200  # the status line went out with the first token
    events = [e.removeprefix("data: ") for e in (await resp.text()).split("\n\n") if e]
    assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == [" t0", " t1"]
    last = json.loads(events[-1])
    assert last["error"]["code"] == 502 and "broke off" in last["error"]["message"]
    assert vllm_protocol().call("error", body=last)["extra"] == []
    m = await _metrics(client)
    assert _metric(m, "gearshift_router_requests_total", "upstream_error") == 1


async def test_errors_and_unknown_routes_are_vllm_errors(make_router: Factory) -> None:  # noqa: F811
    vllm = vllm_protocol()
    client, _router, _ = await make_router({"b0": ("both", FakeEngine("b0"))})
    for method, path, status in [
        ("GET", "/v1/embeddings", 404),
        ("POST", "/v1/responses", 404),
        ("GET", "/v1/completions", 405),
    ]:
        resp = await client.request(method, path)
        assert resp.status == status and resp.headers["Content-Type"].startswith("application/json")
        doc = await resp.json()
        assert doc["error"]["code"] == status and path in doc["error"]["message"]
        assert vllm.call("error", body=doc)["extra"] == []
    bad = await client.post("/v1/completions", data=b"{not json")
    doc = await bad.json()
    assert bad.status == 400 and vllm.call("error", body=doc)["error"]["code"] == 400
    assert error_body(400, "m", "BadRequestError", "max_tokens")["error"]["param"] == "max_tokens"


async def test_get_one_model(make_router: Factory) -> None:  # noqa: F811
    client, _router, _ = await make_router({"b0": ("both", FakeEngine("b0"))})
    assert (await (await client.get("/v1/models/m")).json())["id"] == "m"
    resp = await client.get("/v1/models/other")
    doc = await resp.json()
    assert resp.status == 404 and doc["error"]["param"] == "model"
    assert re.search("`other` does not exist", doc["error"]["message"])


async def test_client_facing_metrics_under_vllm_names_agree_with_the_client(make_router: Factory) -> None:  # noqa: F811
    client, _router, _ = await make_router({"b0": ("both", ChatEngine("b0", tokens=5))})
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
    ttfts, e2es = [], []
    for _ in range(4):
        t0 = time.perf_counter()
        resp = await client.post("/v1/chat/completions", json=body)
        buf, first = b"", None
        async for chunk in resp.content.iter_any():
            buf += chunk
            if first is None and b'"content": " t0"' in buf:
                first = time.perf_counter() - t0
        e2es.append(time.perf_counter() - t0)
        assert first is not None
        ttfts.append(first)
    m = await _metrics(client)

    def mean(name: str) -> float:
        return _metric(m, f"vllm:{name}_sum") / _metric(m, f"vllm:{name}_count")

    # the client's own clock on the same requests: within 10 % (the router's side is the earlier one)
    assert abs(mean("time_to_first_token_seconds") - sum(ttfts) / 4) <= 0.1 * sum(ttfts) / 4
    assert abs(mean("e2e_request_latency_seconds") - sum(e2es) / 4) <= 0.1 * sum(e2es) / 4
    assert _metric(m, "vllm:inter_token_latency_seconds_count") == 4 * 4
    assert 'vllm:request_success_total{finished_reason="unknown",model_name="m"} 4.0' in m
    assert _metric(m, "vllm:generation_tokens_total") == 4 * 5  # from the stream's usage chunk
    assert _metric(m, "vllm:request_generation_tokens_count") == 4


async def test_an_unstreamed_answer_counts_its_usage_and_finish_reason(make_router: Factory) -> None:  # noqa: F811
    client, _router, _ = await make_router({"b0": ("both", FakeEngine("b0"))})
    for _ in range(3):
        assert (await client.post("/v1/completions", json={"model": "m", "prompt": "x"})).status == 200
    m = await _metrics(client)
    assert _metric(m, "vllm:e2e_request_latency_seconds_count") == 3
    assert _metric(m, "vllm:time_to_first_token_seconds_count") == 0  # not seen on a whole answer
    # nor in the router's own series: a whole answer's E2E there inflated its TTFT (new-user review)
    assert _metric(m, "gearshift_router_upstream_ttft_seconds_count") == 0
    assert _metric(m, "vllm:generation_tokens_total") == 3 * 3  # FakeEngine's usage.completion_tokens
    assert _metric(m, "vllm:request_success_total") == 3


@dataclass
class LingeringEngine(FakeEngine):
    """Streams its tokens and [DONE], then keeps the stream open a while before ending it (as a busy
    engine may): a client that stops at [DONE] closes while the router still waits for the end."""

    async def completions(self, request: web.Request) -> web.StreamResponse:
        await request.json()
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i in range(3):
            await out.write(f"data: {json.dumps({'choices': [{'text': f' t{i}'}]})}\n\n".encode())
        await out.write(b"data: [DONE]\n\n")
        await asyncio.sleep(0.5)
        with contextlib.suppress(ConnectionResetError):
            await out.write_eof()
        return out


@pytest.mark.parametrize("cancelled", [False, True], ids=["run_app", "handler_cancellation"])
async def test_a_client_that_closes_after_done_got_its_answer(
    make_router: Factory,  # noqa: F811
    cancelled: bool,
) -> None:
    client, _router, _ = await make_router(
        {"b0": ("both", LingeringEngine("b0"))}, handler_cancellation=cancelled
    )
    resp = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
    buf = b""
    while b"[DONE]" not in buf:
        buf += await asyncio.wait_for(resp.content.readany(), 5)
    resp.close()  # as guidellm does: it stops reading at [DONE]
    deadline, m = time.monotonic() + 10, ""
    while time.monotonic() < deadline:
        m = await _metrics(client)
        if _metric(m, "gearshift_router_requests_total"):
            break
        await asyncio.sleep(0.05)
    assert _metric(m, "gearshift_router_requests_total", "ok") == 1, m
    assert _metric(m, "vllm:request_success_total") == 1
    assert _metric(m, "vllm:e2e_request_latency_seconds_count") == 1


@dataclass
class OrgModelEngine(FakeEngine):
    async def models(self, _r: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "meta-llama/Meta-Llama-3-8B"}]})


async def test_a_model_id_with_a_slash(make_router: Factory) -> None:  # noqa: F811
    client, _router, _ = await make_router({"b0": ("both", OrgModelEngine("b0"))})
    resp = await client.get("/v1/models/meta-llama/Meta-Llama-3-8B")
    assert resp.status == 200 and (await resp.json())["id"] == "meta-llama/Meta-Llama-3-8B"
    assert (await client.get("/v1/models/meta-llama/other")).status == 404


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--retries", "-3"], "--retries must be at least 0"),
        (["--max-inflight", "0"], "--max-inflight must be at least 1"),
        (["--max-queue", "-1"], "--max-queue must be at least 0"),
        (["--request-timeout", "-1"], "--request-timeout must be a finite number"),
        (["--queue-timeout", "nan"], "--queue-timeout must be a finite number"),
        (["--headroom-wait", "-2"], "--headroom-wait must be a finite number"),
    ],
)
def test_router_flags_that_would_break_every_request_are_refused(flags: list[str], named: str) -> None:
    import argparse

    from gearshift.facts.errors import SettingsError
    from gearshift.router.settings import add_arguments, settings_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--backend", "both=http://127.0.0.1:9", *flags])
    with pytest.raises(SettingsError, match=re.escape(named)):
        settings_from_args(args)
    # the same flags with sane values pass
    settings_from_args(parser.parse_args(["--backend", "both=http://127.0.0.1:9"]))


@dataclass
class LimitEngine(FakeEngine):
    """Advertises its own context limit, as each sim pod does from its KV pool."""

    limit: int = 8192

    async def models(self, _r: web.Request) -> web.Response:
        card = {"id": "m", "object": "model", "max_model_len": self.limit}
        return web.json_response({"object": "list", "data": [card]})


async def test_the_service_advertises_one_context_limit_the_smallest_pods(make_router: Factory) -> None:  # noqa: F811
    client, _router, _ = await make_router(
        {
            "p0": ("prefill", LimitEngine("p0", limit=54400)),
            "d0": ("decode", LimitEngine("d0", limit=8192)),
            "d1": ("decode", LimitEngine("d1", limit=467280)),
        }
    )
    for _ in range(3):  # whichever pod answers first, the same limit
        doc = await (await client.get("/v1/models")).json()
        assert [c["max_model_len"] for c in doc["data"]] == [8192]
    assert (await (await client.get("/v1/models/m")).json())["max_model_len"] == 8192


# --- token counts for every stream ---------------------------------------------------------------------
def test_complete_events_withhold_only_the_usage_chunk_wherever_the_stream_is_cut() -> None:
    tok = b'data: {"choices": [{"index": 0, "text": " a"}]}\r\n\r\n'
    usage = b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}\n\n'
    done = b"data: [DONE]\n\n"
    whole = tok + tok + usage + done
    want = tok.replace(b"\r\n", b"\n") * 2 + done
    for cut in range(1, len(whole)):
        head, rest = complete_events(whole[:cut], drop_usage=b'"usage"' in whole[:cut])
        tail, rest2 = complete_events(rest + whole[cut:], drop_usage=True)
        assert (head + tail, rest2) == (want, b""), cut
    # a token chunk that carries usage (continuous_usage_stats) is a token, not withheld
    cont = b'data: {"choices": [{"text": " b"}], "usage": {"completion_tokens": 1}}\n\n'
    assert complete_events(cont, drop_usage=True) == (cont, b"")


class SimEngine(FakeEngine):
    """The project's simulated engine (vLLM's OpenAI surface and its ``stream_options``), in-process."""

    def app(self) -> web.Application:
        pipeline = json.dumps({"stages": [{"layers": [0, 32], "gpu": "A10-24GB"}]})
        env = {
            "GEARSHIFT_MODEL": str(LLAMA),
            "GEARSHIFT_SERVED_MODEL_NAME": "m",
            "GEARSHIFT_PIPELINE": pipeline,
        }
        return build_app(config_from_env(env))


async def _stream(client: object, body: dict[str, object]) -> list[dict[str, object]]:
    resp = await client.post("/v1/completions", json=body)  # type: ignore[attr-defined]
    assert resp.status == 200, await resp.text()
    text = (await resp.read()).decode()
    assert text.rstrip().endswith("data: [DONE]")
    return [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]


@pytest.mark.parametrize("mode", ["both", "pd"])
async def test_a_stream_without_include_usage_is_counted_and_gets_no_usage_chunk(
    make_router: Factory,  # noqa: F811
    mode: str,
) -> None:
    """The vLLM-named token series count every stream, not only those that ask for usage: the router asks
    the engine for the usage chunk and keeps it from a client that did not ask (vLLM's own server sends
    none then), and passes it to one that did, once."""
    engines = {"b0": ("both", SimEngine("b0"))} if mode == "both" else {
        "p0": ("prefill", SimEngine("p0")), "d0": ("decode", SimEngine("d0"))}  # fmt: skip
    client, _router, _ = await make_router(engines)
    body = {
        "model": "m",
        "prompt": [11, 12, 13, 14, 15, 16, 17],
        "max_tokens": 5,
        "ignore_eos": True,
        "stream": True,
    }
    plain = await _stream(client, body)
    assert [e for e in plain if "usage" in e] == []
    assert sum(1 for e in plain if e["choices"] and e["choices"][0].get("text")) == 5  # type: ignore[index]
    cont = await _stream(
        client, {**body, "stream_options": {"include_usage": False, "continuous_usage_stats": True}}
    )
    assert [e for e in cont if "usage" in e] == []
    asked = await _stream(client, {**body, "stream_options": {"include_usage": True}})
    usages = [e["usage"] for e in asked if "usage" in e]
    assert usages == [{"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}]
    m = await _metrics(client)
    assert _metric(m, "vllm:prompt_tokens_total") == 3 * 7
    assert _metric(m, "vllm:generation_tokens_total") == 3 * 5
    assert _metric(m, "vllm:request_generation_tokens_count") == 3


async def test_lax_types_as_vllm_reads_them_and_an_engine_refusal_is_a_client_error(
    make_router: Factory,  # noqa: F811
) -> None:
    """``"stream": "false"`` is false to vLLM: the router must not add ``stream_options`` (vLLM refuses
    them on an unstreamed request); ``"max_tokens": "3"`` is 3; a 400 the engine gives (min_tokens above
    max_tokens) counts as ``client_error``, not ``ok``."""
    client, _router, eng = await make_router({"b0": ("both", FakeEngine("b0"))})
    assert (await client.post("/v1/completions", json={"prompt": "x", "stream": "false"})).status == 200
    assert "stream_options" not in eng["b0"].requests[-1]
    want = vllm_protocol().call("request", kind="completion", body={"prompt": "x", "stream": "false"})
    assert want["ok"] and want["stream"] is False
    client, _router, _ = await make_router({"s0": ("both", SimEngine("s0"))})
    resp = await client.post("/v1/completions", json={"model": "m", "prompt": "a b", "max_tokens": "3"})
    assert resp.status == 200 and (await resp.json())["usage"]["completion_tokens"] == 3
    bad = {"model": "m", "prompt": "a b", "max_tokens": 3, "min_tokens": 5}
    assert (await client.post("/v1/completions", json=bad)).status == 400
    m = await _metrics(client)
    assert _metric(m, "gearshift_router_requests_total", "client_error") == 1
    assert _metric(m, "gearshift_router_requests_total", "ok") == 1


async def test_the_router_reads_max_tokens_and_include_usage_as_vllm_does(
    make_router: Factory,  # noqa: F811
) -> None:
    """``"max_tokens": true`` is 1 to vLLM's lax int, so the router serves it; ``"include_usage": "maybe"`` is
    refused by vLLM, so the router leaves the body as it came (no usage chunk asked for in its place) and the
    engine's 400 reaches the client. Both checked against vLLM's own request models."""
    proto = vllm_protocol()
    assert proto.call("request", kind="completion", body={"prompt": "x", "max_tokens": True})["ok"]
    maybe = {"prompt": "x", "stream": True, "stream_options": {"include_usage": "maybe"}}
    assert not proto.call("request", kind="completion", body=maybe)["ok"]
    client, _router, _ = await make_router({"s0": ("both", SimEngine("s0"))})
    resp = await client.post("/v1/completions", json={"model": "m", "prompt": "a b", "max_tokens": True})
    assert resp.status == 200 and (await resp.json())["usage"]["completion_tokens"] == 1
    resp = await client.post("/v1/completions", json={"model": "m", **maybe})
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == "stream_options"


async def test_the_sim_answers_unknown_routes_as_vllm_fastapi_does() -> None:
    """vLLM's server is FastAPI: an unknown route is JSON ``{"detail": "Not Found"}`` (404), a wrong method
    ``{"detail": "Method Not Allowed"}`` (405) with ``Allow``; the sim said so in text/plain."""
    from aiohttp.test_utils import TestClient, TestServer

    client = TestClient(TestServer(SimEngine("s0").app(), host="127.0.0.1"))
    await client.start_server()
    try:
        resp = await client.get("/v1/embeddings")
        assert resp.status == 404 and await resp.json() == {"detail": "Not Found"}
        resp = await client.get("/v1/completions")
        assert resp.status == 405 and await resp.json() == {"detail": "Method Not Allowed"}
        assert "POST" in resp.headers["Allow"]
    finally:
        await client.close()
