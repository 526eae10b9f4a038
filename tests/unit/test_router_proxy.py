"""The router's request path against small in-process aiohttp engines on loopback (PD protocol, errors).

The PD legs are checked against values written out here from vLLM's toy proxy
(tests/v1/kv_connector/nixl_integration/toy_proxy_server.py), and, where the vLLM venv is installed
(``tests/unit/vllm_ref.py``), against vLLM's own request models.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from multidict import CIMultiDict
from vllm_ref import vllm_protocol

from gearshift.router.config import ProxyConfig
from gearshift.router.outlier import OutlierConfig
from gearshift.router.pool import BackendInfo, PolicyConfig
from gearshift.router.server import Router
from gearshift.router.settings import RouterSettings

#: The prefill leg's kv_transfer_params, as vLLM's toy proxy writes them (send_request_to_service).
TOY_PROXY_PREFILL_KTP = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def nixl_params(engine: str) -> dict[str, Any]:
    """kv_transfer_params in the shape vLLM 0.32's NixlConnector returns from a prefill (pull mode)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[4, 5]],
        "remote_engine_id": f"engine-{engine}",
        "remote_request_id": f"cmpl-x-0-{engine}",
        "remote_host": "127.0.0.9",
        "remote_port": 5600,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": 2,
        "remote_blocks_expiry_time": None,
        "transfer_mode": "pull",
    }


@dataclass
class FakeEngine:
    """A PD engine that records what it got: prefill answers kv_transfer_params, decode streams tokens."""

    name: str
    delay_s: float = 0.0
    tokens: int = 3
    running: int = 0
    kv_usage: float = 0.25
    prefill_status: int = 200
    prefill_reply: Any = None
    """The prefill answer's body: None → a completion with :func:`nixl_params`; a str → that text."""
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[CIMultiDict[str]] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        return app

    async def health(self, _r: web.Request) -> web.Response:
        return web.json_response({})

    async def models(self, _r: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m"}]})

    async def metrics(self, _r: web.Request) -> web.Response:
        text = (
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="m"}} {self.running}\n'
            "# TYPE vllm:num_requests_waiting gauge\n"
            'vllm:num_requests_waiting{model_name="m"} 2\n'
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{model_name="m"}} {self.kv_usage}\n'
        )
        return web.Response(text=text, content_type="text/plain")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(CIMultiDict(request.headers))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        ktp = body.get("kv_transfer_params") or {}
        if ktp.get("do_remote_decode"):
            reply = self.prefill_reply
            if reply is None:
                reply = {"choices": [{"text": "t"}], "kv_transfer_params": nixl_params(self.name)}
            if isinstance(reply, str):
                return web.Response(status=self.prefill_status, text=reply, content_type="text/plain")
            return web.json_response(reply, status=self.prefill_status)
        if body.get("stream"):
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            for i in range(self.tokens):
                await out.write(
                    f"data: {json.dumps({'choices': [{'text': f' t{i}'}], 'by': self.name})}\n\n".encode()
                )
                await asyncio.sleep(0.002)
            await out.write(b"data: [DONE]\n\n")
            await out.write_eof()
            return out
        return web.json_response(
            {"choices": [{"text": " t0 t1 t2"}], "by": self.name, "usage": {"completion_tokens": 3}}
        )


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


Factory = Callable[..., Awaitable[tuple[TestClient, Router, dict[str, FakeEngine]]]]


@pytest.fixture
async def make_router() -> AsyncIterator[Factory]:
    servers: list[TestServer] = []
    clients: list[TestClient] = []

    async def factory(
        engines: dict[str, tuple[str, FakeEngine | None]],
        policy: str = "round-robin",
        proxy: ProxyConfig | None = None,
        outlier: OutlierConfig | None = None,
        health_interval_s: float = 30.0,
        handler_cancellation: bool = True,
    ) -> tuple[TestClient, Router, dict[str, FakeEngine]]:
        infos = []
        for name, (role, eng) in engines.items():
            if eng is None:
                url = f"http://127.0.0.1:{closed_port()}"
            else:
                srv = TestServer(eng.app(), host="127.0.0.1")
                await srv.start_server()
                servers.append(srv)
                url = str(srv.make_url("")).rstrip("/")
            infos.append(BackendInfo(name, url, role))  # type: ignore[arg-type]
        settings = RouterSettings(
            backends=infos,
            policy=PolicyConfig(policy=policy),
            proxy=proxy or ProxyConfig(),
            scrape_interval_s=0.05,
            health_interval_s=health_interval_s,
            outlier=outlier or OutlierConfig(),
            seed=1,
        )
        router = Router(settings)
        # aiohttp's TestServer cancels a handler whose client left; web.run_app (the router's) does not.
        server = TestServer(router.app(), host="127.0.0.1", handler_cancellation=handler_cancellation)
        client = TestClient(server)
        await client.start_server()
        clients.append(client)
        return client, router, {n: e for n, (_, e) in engines.items() if e is not None}

    yield factory
    for c in clients:
        await c.close()
    for s in servers:
        await s.close()


def pd_engines(**prefill: Any) -> dict[str, tuple[str, FakeEngine | None]]:
    return {"p0": ("prefill", FakeEngine("p0", **prefill)), "d0": ("decode", FakeEngine("d0"))}


#: A completions request with every field the prefill leg changes.
COMPLETION = {
    "model": "m",
    "prompt": "hello world",
    "max_tokens": 7,
    "min_tokens": 2,
    "temperature": 0.5,
    "stream": True,
    "stream_options": {"include_usage": True},
}


async def test_pd_completions_legs_are_vllm_toy_proxy_legs(make_router: Factory) -> None:
    client, _router, eng = await make_router(pd_engines())
    resp = await client.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": "client-id-1"})
    assert resp.status == 200
    await resp.read()
    assert resp.headers["X-Request-Id"] == "client-id-1"
    (pre,) = eng["p0"].requests
    assert pre == {
        "model": "m",
        "prompt": "hello world",
        "max_tokens": 1,
        "temperature": 0.5,
        "stream": False,
        "kv_transfer_params": TOY_PROXY_PREFILL_KTP,
    }
    (dec,) = eng["d0"].requests
    assert dec == {**COMPLETION, "kv_transfer_params": nixl_params("p0")}
    (pre_h,), (dec_h,) = eng["p0"].headers, eng["d0"].headers
    assert pre_h["X-Request-Id"] == dec_h["X-Request-Id"] == "client-id-1"
    assert pre_h["Content-Type"] == dec_h["Content-Type"] == "application/json"
    assert "Authorization" not in pre_h and "Authorization" not in dec_h


CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi there"}],
    "max_completion_tokens": 9,
    "min_tokens": 3,
    "stream": True,
    "stream_options": {"include_usage": True, "continuous_usage_stats": True},
}


@pytest.mark.parametrize(
    ("client_body", "prefill_max"),
    [
        (CHAT, {"max_tokens": 1, "max_completion_tokens": 1}),
        # legacy max_tokens only: the chat prefill leg still caps max_completion_tokens (vLLM reads it first)
        (
            {**CHAT, "max_completion_tokens": None, "max_tokens": 9},
            {"max_tokens": 1, "max_completion_tokens": 1},
        ),
    ],
)
async def test_pd_chat_legs_share_a_generated_request_id(
    make_router: Factory, client_body: dict[str, Any], prefill_max: dict[str, int]
) -> None:
    body = {k: v for k, v in client_body.items() if v is not None}
    client, _router, eng = await make_router(pd_engines())
    resp = await client.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer k1"})
    assert resp.status == 200
    await resp.read()
    (pre,) = eng["p0"].requests
    expected = {k: v for k, v in body.items() if k not in ("min_tokens", "stream_options")}
    assert pre == {**expected, **prefill_max, "stream": False, "kv_transfer_params": TOY_PROXY_PREFILL_KTP}
    (dec,) = eng["d0"].requests
    assert dec == {**body, "kv_transfer_params": nixl_params("p0")}
    (pre_h,), (dec_h,) = eng["p0"].headers, eng["d0"].headers
    rid = pre_h["X-Request-Id"]
    assert len(rid) == 32 and int(rid, 16) >= 0  # uuid4().hex, as vLLM's random_uuid
    assert dec_h["X-Request-Id"] == rid == resp.headers["X-Request-Id"]
    assert pre_h["Authorization"] == dec_h["Authorization"] == "Bearer k1"


async def test_each_request_gets_its_own_id(make_router: Factory) -> None:
    client, _router, eng = await make_router(pd_engines())
    for _ in range(3):
        assert (await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})).status == 200
    pre_ids = [h["X-Request-Id"] for h in eng["p0"].headers]
    assert pre_ids == [h["X-Request-Id"] for h in eng["d0"].headers]
    assert len(set(pre_ids)) == 3


async def test_body_request_id_is_the_id_without_a_header(make_router: Factory) -> None:
    client, _router, eng = await make_router(pd_engines())
    body = {"prompt": "x", "max_tokens": 2, "request_id": "body-id-5"}
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200 and resp.headers["X-Request-Id"] == "body-id-5"
    assert eng["p0"].headers[0]["X-Request-Id"] == eng["d0"].headers[0]["X-Request-Id"] == "body-id-5"
    assert eng["p0"].requests[0]["request_id"] == eng["d0"].requests[0]["request_id"] == "body-id-5"


async def test_prefill_without_kv_params_sends_decode_the_plain_request(
    make_router: Factory,
) -> None:
    # A prefill pod without a KV connector answers kv_transfer_params: null; the decode pod prefills itself.
    client, _router, eng = await make_router(
        pd_engines(prefill_reply={"choices": [{"text": "t"}], "kv_transfer_params": None})
    )
    body = {"model": "m", "prompt": "a b", "max_tokens": 4}
    assert (await client.post("/v1/completions", json=body)).status == 200
    assert eng["d0"].requests == [body]


VLLM_TOO_LONG = {
    "error": {
        "message": "This model's maximum context length is 8 tokens. However, you requested 12 tokens.",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
}


@pytest.mark.parametrize(
    ("status", "reply", "client_status", "message", "err_type"),
    [
        (
            400,
            VLLM_TOO_LONG,
            400,
            "This model's maximum context length is 8 tokens. However, you requested 12 tokens. (from the "
            "prefill leg of this PD request, which asks for 1 output token; this request's max_tokens is 7)",
            "BadRequestError",
        ),
        (
            400,
            {"object": "error", "message": "bad model", "type": "NotFoundError", "param": None, "code": 404},
            400,
            "bad model (from the prefill leg of this PD request, which asks for 1 output token; this "
            "request's max_tokens is 7)",
            "NotFoundError",
        ),
        (
            500,
            "Internal Server Error",
            502,
            "prefill pod p0 failed (HTTP 500): Internal Server Error; the decode pod was not called",
            "upstream_error",
        ),
        (
            200,
            "<html>not json</html>",
            502,
            "prefill pod p0 answered HTTP 200 with a body that is not JSON; the decode pod was not called",
            "upstream_error",
        ),
    ],
)
async def test_failed_prefill_is_an_openai_error_and_decode_is_not_called(
    make_router: Factory, status: int, reply: Any, client_status: int, message: str, err_type: str
) -> None:
    client, _router, eng = await make_router(pd_engines(prefill_status=status, prefill_reply=reply))
    resp = await client.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": "r-9"})
    assert resp.status == client_status
    assert resp.headers["X-Request-Id"] == "r-9"
    want = {"message": message, "type": err_type, "param": None, "code": client_status}
    assert await resp.json() == {"error": want}
    assert len(eng["p0"].requests) == 1
    assert eng["d0"].requests == []
    metrics = await (await client.get("/metrics")).text()
    outcome = "client_error" if client_status == 400 else "upstream_error"
    assert f'decode_pod="-",outcome="{outcome}",policy="round-robin",prefill_pod="p0"}} 1.0' in metrics


async def test_plain_mode_forwards_the_bytes_with_a_request_id(make_router: Factory) -> None:
    client, _router, eng = await make_router({"b0": ("both", FakeEngine("b0"))})
    raw = b'{"prompt": "x",   "max_tokens": 2, "min_tokens": 1}'
    resp = await client.post(
        "/v1/completions", data=raw, headers={"Content-Type": "application/json", "X-Request-Id": "p-1"}
    )
    assert resp.status == 200 and resp.headers["X-Request-Id"] == "p-1"
    assert eng["b0"].requests == [json.loads(raw)]
    assert eng["b0"].headers[0]["X-Request-Id"] == "p-1"


# --- against vLLM's own request models -----------------------------------------------------------------
async def test_vllm_reads_the_completions_legs_as_intended(make_router: Factory) -> None:
    vllm = vllm_protocol()
    client, _router, eng = await make_router(pd_engines())
    assert (await client.post("/v1/completions", json=COMPLETION)).status == 200
    (pre,), (dec,) = eng["p0"].requests, eng["d0"].requests
    p = vllm.request("completion", pre)
    assert p["extra"] == []  # every field is one vLLM reads
    assert (p["max_tokens"], p["min_tokens"], p["stream"], p["stream_options"]) == (1, 0, False, None)
    assert p["kv_transfer_params"] == TOY_PROXY_PREFILL_KTP
    d = vllm.request("completion", dec)
    assert d["extra"] == []
    assert (d["max_tokens"], d["min_tokens"], d["stream"]) == (7, 2, True)
    assert d["stream_options"]["include_usage"] is True
    assert d["kv_transfer_params"] == nixl_params("p0")


async def test_vllm_reads_the_chat_legs_as_intended(make_router: Factory) -> None:
    vllm = vllm_protocol()
    client, _router, eng = await make_router(pd_engines())
    assert (await client.post("/v1/chat/completions", json=CHAT)).status == 200
    (pre,), (dec,) = eng["p0"].requests, eng["d0"].requests
    p = vllm.request("chat", pre)
    assert p["extra"] == []
    assert (p["max_tokens"], p["min_tokens"], p["stream"], p["stream_options"]) == (1, 0, False, None)
    assert p["kv_transfer_params"] == TOY_PROXY_PREFILL_KTP
    d = vllm.request("chat", dec)
    assert d["extra"] == []
    assert (d["max_tokens"], d["min_tokens"], d["stream"]) == (9, 3, True)
    assert d["kv_transfer_params"] == nixl_params("p0")


async def test_vllm_refuses_the_prefill_leg_had_stream_options_or_min_tokens_stayed() -> None:
    # Why the prefill leg drops them: vLLM refuses stream_options on a non-streamed request, and a
    # min_tokens above the leg's max_tokens of 1.
    vllm = vllm_protocol()
    out = vllm.call("request", kind="completion", body={"prompt": "x", "stream": False, "stream_options": {}})
    assert out["ok"] is True  # an empty stream_options is falsy, so allowed
    body = {"prompt": "x", "stream": False, "stream_options": {"include_usage": True}}
    out = vllm.call("request", kind="completion", body=body)
    assert out["ok"] is False and "stream_options" in out["error"]
    out = vllm.call("request", kind="chat", body={**CHAT, "stream": False, "stream_options": None,
                                                  "max_tokens": 1, "max_completion_tokens": 1})  # fmt: skip
    assert out["ok"] is False and "min_tokens must be less than or equal to" in out["error"]


async def test_streaming_passthrough_and_metrics(make_router: Factory) -> None:
    client, _router, _eng = await make_router(
        {"p0": ("prefill", FakeEngine("p0")), "d0": ("decode", FakeEngine("d0", tokens=4))}
    )
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    text = await resp.text()
    events = [e for e in text.split("\n\n") if e]
    assert len(events) == 5 and events[-1] == "data: [DONE]"
    assert json.loads(events[0][len("data: ") :])["choices"][0]["text"] == " t0"
    metrics = await (await client.get("/metrics")).text()
    assert (
        'gearshift_router_requests_total{decode_pod="d0",outcome="ok",'
        'policy="round-robin",prefill_pod="p0"} 1.0' in metrics
    )
    assert 'gearshift_router_upstream_ttft_seconds_count{policy="round-robin"} 1.0' in metrics
    # 4 token events: the first is the TTFT, 3 ITL gaps follow ([DONE] carries no token)
    assert 'gearshift_router_upstream_itl_seconds_count{policy="round-robin"} 3.0' in metrics


async def test_retry_on_failed_connect_and_ejection_after_consecutive_errors(make_router: Factory) -> None:
    client, router, eng = await make_router(
        {
            "d0": ("decode", FakeEngine("d0")),
            "p-dead": ("prefill", None),
            "p-ok": ("prefill", FakeEngine("p-ok")),
        }
    )
    # round-robin over sorted names ["p-dead", "p-ok"] picks the dead pod first
    resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert resp.status == 200
    assert len(eng["p-ok"].requests) == 1
    # the retried prefill leg keeps the request's id: the decode leg carries the same one
    assert eng["p-ok"].headers[0]["X-Request-Id"] == eng["d0"].headers[0]["X-Request-Id"]
    dead = router.pool.backends["p-dead"]
    # one failed connect is not an outlier (Envoy consecutive_5xx: 5)
    assert dead.failures == 1 and dead.ejected_until == 0.0
    sent = 1
    while dead.ejected_until == 0.0 and sent < 20:
        assert (await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})).status == 200
        sent += 1
    assert dead.ejected_until > 0, "5 consecutive failed connects did not eject the pod"
    metrics = await (await client.get("/metrics")).text()
    assert 'gearshift_router_retries_total{pod="p-dead",role="prefill"} 5.0' in metrics
    assert 'gearshift_router_ejections_total{pod="p-dead",role="prefill"} 1.0' in metrics
    # ejected for base_ejection_time × 1 (30 s): the dead pod is not tried again; every request served
    assert 29 < dead.ejected_until - router.clock() <= 30
    for _ in range(3):
        assert (await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})).status == 200
    metrics = await (await client.get("/metrics")).text()
    assert 'gearshift_router_retries_total{pod="p-dead",role="prefill"} 5.0' in metrics
    assert len(eng["p-ok"].requests) == sent + 3


async def test_all_pods_dead_is_502_and_never_no_pod(make_router: Factory) -> None:
    client, router, _ = await make_router({"b0": ("both", None), "b1": ("both", None)})
    resp = await client.post("/v1/completions", json={"prompt": "x"})
    assert resp.status == 502
    assert "could not connect to any both pod (tried b0, b1)" in (await resp.json())["error"]["message"]
    # At most 10 % of a role (at least one pod) is ejected: b0 goes after 5 errors, b1 never, so the
    # router keeps trying and answers 502 (upstream down), not 503 "no pod".
    for _ in range(6):
        resp = await client.post("/v1/completions", json={"prompt": "x"})
        assert resp.status == 502, await resp.text()
    ejected = [n for n, b in router.pool.backends.items() if b.ejected_until > router.clock()]
    assert len(ejected) == 1
    health = await client.get("/health")
    assert health.status == 200
    assert (await health.json())["routable"]["both"] == 1


@dataclass
class SlowHealth(FakeEngine):
    """An engine whose /health answers after ``health_delay_s`` (a loaded machine)."""

    health_delay_s: float = 0.0
    health_status: int = 200

    async def health(self, _r: web.Request) -> web.Response:
        await asyncio.sleep(self.health_delay_s)
        return web.json_response({}, status=self.health_status)


async def test_a_slow_health_check_does_not_take_the_only_decode_pod_out(make_router: Factory) -> None:
    """The CI failure of the robustness work: vLLM's /health took more than the old 1 s on a loaded machine,
    the one
    decode pod was marked unhealthy and requests got 503 "no decode pod available"."""
    slow = SlowHealth("d0", health_delay_s=0.3)
    client, router, eng = await make_router(
        {"p0": ("prefill", FakeEngine("p0")), "d0": ("decode", slow)},
        outlier=OutlierConfig(check_timeout_s=0.1, unhealthy_threshold=3, healthy_threshold=2),
        health_interval_s=0.05,
    )
    d0 = router.pool.backends["d0"]
    for _ in range(200):
        if not d0.healthy:
            break
        await asyncio.sleep(0.02)
    assert not d0.healthy, "3 checks slower than the timeout did not mark the pod unhealthy"
    # the only decode pod fails its checks: panic mode still routes to it, and it answers
    resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert resp.status == 200, await resp.text()
    assert len(eng["d0"].requests) == 1
    health = await (await client.get("/health")).json()
    assert health["panic"] == ["decode"] and health["pods"]["decode"] == 0
    metrics = await (await client.get("/metrics")).text()
    assert 'gearshift_router_panic{role="decode"} 1.0' in metrics
    # it answers in time again: healthy after healthy_threshold passes
    slow.health_delay_s = 0.0
    for _ in range(200):
        if d0.healthy:
            break
        await asyncio.sleep(0.02)
    assert d0.healthy and d0.check_passes >= 2


async def test_one_slow_check_is_not_unhealthy(make_router: Factory) -> None:
    slow = SlowHealth("d0")
    _client, router, _ = await make_router(
        {"p0": ("prefill", FakeEngine("p0")), "d0": ("decode", slow), "d1": ("decode", FakeEngine("d1"))},
        outlier=OutlierConfig(check_timeout_s=0.5, unhealthy_threshold=3),
        health_interval_s=0.05,
    )
    d0 = router.pool.backends["d0"]
    slow.health_delay_s = 1.0
    for _ in range(100):
        if d0.check_failures:
            break
        await asyncio.sleep(0.02)
    slow.health_delay_s = 0.0
    assert d0.check_failures >= 1
    for _ in range(100):
        if d0.check_failures == 0:
            break
        await asyncio.sleep(0.02)
    assert d0.healthy and d0.check_failures == 0


async def test_prefill_5xx_is_retried_on_another_prefill_pod(make_router: Factory) -> None:
    client, router, eng = await make_router(
        {
            "d0": ("decode", FakeEngine("d0")),
            "p-a": ("prefill", FakeEngine("p-a", prefill_status=503, prefill_reply="busy")),
            "p-b": ("prefill", FakeEngine("p-b")),
        }
    )
    resp = await client.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers={"X-Request-Id": "r1"}
    )
    assert resp.status == 200, await resp.text()
    assert len(eng["p-a"].requests) == 1 and len(eng["p-b"].requests) == 1
    # the retry and the decode leg carry the client's id
    assert [h["X-Request-Id"] for h in eng["p-b"].headers + eng["d0"].headers] == ["r1", "r1"]
    assert router.pool.backends["p-a"].failures == 1
    metrics = await (await client.get("/metrics")).text()
    assert 'gearshift_router_retries_total{pod="p-a",role="prefill"} 1.0' in metrics


async def test_decode_5xx_is_relayed_not_retried(make_router: Factory) -> None:
    @dataclass
    class FailingDecode(FakeEngine):
        async def completions(self, request: web.Request) -> web.StreamResponse:
            body = await request.json()
            if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
                return await super().completions(request)
            self.requests.append(body)
            return web.json_response(
                {"error": {"message": "engine dead", "type": "InternalServerError"}}, status=500
            )

    client, router, eng = await make_router(
        {
            "p0": ("prefill", FakeEngine("p0")),
            "d-a": ("decode", FailingDecode("d-a")),
            "d-b": ("decode", FakeEngine("d-b")),
        }
    )
    resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert resp.status == 500
    assert (await resp.json())["error"]["message"] == "engine dead"
    assert len(eng["d-a"].requests) == 1 and eng["d-b"].requests == []
    assert router.pool.backends["d-a"].failures == 1


async def test_queue_full_is_429(make_router: Factory) -> None:
    client, _router, _ = await make_router(
        {"b0": ("both", FakeEngine("b0", delay_s=0.5))}, proxy=ProxyConfig(max_inflight=1, max_queue=1)
    )
    tasks = [asyncio.create_task(client.post("/v1/completions", json={"prompt": "x"})) for _ in range(3)]
    statuses = sorted([(await t).status for t in tasks])
    assert statuses == [200, 200, 429]
    metrics = await (await client.get("/metrics")).text()
    assert 'gearshift_router_rejects_total{reason="queue_full"} 1.0' in metrics


async def test_arrivals_count_every_request_per_role_refused_ones_too(make_router: Factory) -> None:
    # Three requests at a router that admits one and queues one: all three arrived (one refused with 429),
    # which is the load the operator must see; the engines served only two of them.
    cfg = ProxyConfig(max_inflight=1, max_queue=1, service="svc", roles=("both",))
    client, _router, _ = await make_router({"b0": ("both", FakeEngine("b0", delay_s=0.5))}, proxy=cfg)
    tasks = [asyncio.create_task(client.post("/v1/completions", json={"prompt": "x"})) for _ in range(3)]
    assert sorted([(await t).status for t in tasks]) == [200, 200, 429]
    metrics = await (await client.get("/metrics")).text()
    assert (
        'gearshift_router_arrivals_total{gearshift_io_role="both",gearshift_io_service="svc"} 3.0' in metrics
    )
    # a PD router counts each request once for each role that serves it
    pd = ProxyConfig(service="svc", roles=("prefill", "decode"))
    client, _router, _ = await make_router(
        {"p0": ("prefill", FakeEngine("p0")), "d0": ("decode", FakeEngine("d0"))}, proxy=pd
    )
    for _ in range(2):
        assert (await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})).status == 200
    metrics = await (await client.get("/metrics")).text()
    for role in ("prefill", "decode"):
        assert (
            f'gearshift_router_arrivals_total{{gearshift_io_role="{role}",gearshift_io_service="svc"}} 2.0'
            in metrics
        )


async def test_a_pd_service_without_prefill_pods_says_so(make_router: Factory) -> None:
    """A PD service's prefill gear rolling out leaves only decode pods: a --service router knows the
    service's shape and answers 503 naming the prefill role (a new user saw "no serving (role both) pod"
    from a PD service)."""
    pd = ProxyConfig(service="svc", roles=("prefill", "decode"))
    client, _router, _ = await make_router({"d0": ("decode", FakeEngine("d0"))}, proxy=pd)
    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    body = await r.json()
    assert r.status == 503 and "no prefill pod available" in body["error"]["message"], body
    assert "role both" not in body["error"]["message"]


async def test_queue_timeout_is_503_and_request_timeout_504(make_router: Factory) -> None:
    client, _router, _ = await make_router(
        {"b0": ("both", FakeEngine("b0", delay_s=0.4))},
        proxy=ProxyConfig(max_inflight=1, max_queue=5, queue_timeout_s=0.1, request_timeout_s=0.2),
    )
    first = asyncio.create_task(client.post("/v1/completions", json={"prompt": "x"}))
    await asyncio.sleep(0.02)
    second = await client.post("/v1/completions", json={"prompt": "x"})
    assert second.status == 503
    assert "queued" in (await second.json())["error"]["message"]
    assert (await first).status == 504


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/completions", {"model": "m"}, "'prompt'"),
        ("/v1/chat/completions", {"messages": []}, "'messages'"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "'max_tokens'"),
        ("/v1/completions", [1, 2], "JSON object"),
    ],
)
async def test_bad_requests_name_the_field(make_router: Factory, path: str, body: Any, field: str) -> None:
    client, _router, eng = await make_router({"b0": ("both", FakeEngine("b0"))})
    resp = await client.post(path, json=body)
    assert resp.status == 400
    assert field in (await resp.json())["error"]["message"]
    assert eng["b0"].requests == []


async def test_scrape_updates_signals_and_debug(make_router: Factory) -> None:
    eng = FakeEngine("b0", running=7)
    client, router, _ = await make_router({"b0": ("both", eng)})
    for _ in range(50):
        if router.pool.backends["b0"].last_scrape is not None:
            break
        await asyncio.sleep(0.02)
    b = router.pool.backends["b0"]
    assert (b.running, b.waiting, b.kv_usage, b.fc_queue) == (7, 2, 0.25, 9)
    pods = (await (await client.get("/debug/pods")).json())["pods"]
    assert pods[0]["running"] == 7
    dec = await (await client.get("/debug/decisions")).json()
    assert set(dec) >= {"rebalance", "batch", "scaleUp"}
    models = await (await client.get("/v1/models")).json()
    assert models["data"][0]["id"] == "m"


async def test_pd_score_end_to_end_prefers_idle_fast_pod(make_router: Factory) -> None:
    client, router, eng = await make_router(
        {
            "p-fast": ("prefill", FakeEngine("p-fast")),
            "p-slow": ("prefill", FakeEngine("p-slow")),
            "d0": ("decode", FakeEngine("d0")),
        },
        policy="pd-score",
    )
    router.pool.backends["p-fast"].info = BackendInfo(
        "p-fast", router.pool.backends["p-fast"].info.url, "prefill", gpu_model="H100-80GB"
    )
    router.pool.backends["p-slow"].info = BackendInfo(
        "p-slow", router.pool.backends["p-slow"].info.url, "prefill", gpu_model="T4-16GB"
    )
    resp = await client.post("/v1/completions", json={"prompt": "x y z", "max_tokens": 2})
    assert resp.status == 200
    assert len(eng["p-fast"].requests) == 1 and eng["p-slow"].requests == []


async def test_connection_errors_are_not_leaked(make_router: Factory) -> None:
    client, router, _ = await make_router({"b0": ("both", FakeEngine("b0"))})
    for _ in range(5):
        assert (await client.post("/v1/completions", json={"prompt": "x"})).status == 200
    b = router.pool.backends["b0"]
    assert b.inflight == 0
    assert router.proxy is not None and router.proxy.inflight == 0


def test_session_type_is_aiohttp() -> None:
    # guards the import used by CONNECT_ERRORS
    assert issubclass(aiohttp.ClientConnectorError, aiohttp.ClientError)


# --- the hold for decode KV headroom ---------------------------------------------------------------------
#: KV bytes per token of these tests; with a 1000-byte pool a request of p prompt + m output tokens needs
#: 1.2 x (p + m) bytes free on a decode pod (the PD guide's headroom filter, docs/sources.md#decode-headroom).
KV_POOL_BYTES = 1000.0


async def _pd_router(
    make_router: Factory, decode_kv_usage: float, **proxy: Any
) -> tuple[TestClient, Router, dict[str, FakeEngine]]:
    """pd-score over one prefill and one decode pod whose KV pool is ``KV_POOL_BYTES`` (1 byte a token)."""
    client, router, eng = await make_router(
        {"p0": ("prefill", FakeEngine("p0")), "d0": ("decode", FakeEngine("d0", kv_usage=decode_kv_usage))},
        policy="pd-score",
        proxy=ProxyConfig(kv_bytes_per_token=1.0, **proxy),
    )
    d0 = router.pool.backends["d0"]
    d0.info = BackendInfo("d0", d0.info.url, "decode", kv_capacity_bytes=KV_POOL_BYTES)
    for _ in range(100):  # the first scrape sets the decode pod's KV usage
        if d0.last_scrape is not None:
            break
        await asyncio.sleep(0.02)
    assert d0.kv_usage == decode_kv_usage
    return client, router, eng


def _metric(text: str, name: str) -> float:
    """The value of an unlabelled sample ``name`` in exposition ``text`` (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def _body(prompt_tokens: int, max_tokens: int) -> dict[str, Any]:
    return {"prompt": list(range(1000, 1000 + prompt_tokens)), "max_tokens": max_tokens}


async def test_no_headroom_holds_the_request_until_headroom_appears(make_router: Factory) -> None:
    # 2% of 1000 bytes free = 20 < 1.2 x (10 + 10) = 24: no headroom.
    client, _router, eng = await _pd_router(make_router, decode_kv_usage=0.98)
    task = asyncio.create_task(client.post("/v1/completions", json=_body(10, 10)))
    await asyncio.sleep(0.5)  # ten scrapes and placement retries, all misses
    assert not task.done()
    metrics = await (await client.get("/metrics")).text()
    assert _metric(metrics, "gearshift_router_no_decode_headroom_total") == 1.0  # once, not per retry
    assert _metric(metrics, "gearshift_router_headroom_held") == 1.0
    assert eng["d0"].requests == [] and eng["p0"].requests == []
    eng["d0"].kv_usage = 0.5  # 500 bytes free >= 24: the next scrape lets it through
    resp = await asyncio.wait_for(task, 5)
    assert resp.status == 200
    assert len(eng["d0"].requests) == 1 and len(eng["p0"].requests) == 1
    metrics = await (await client.get("/metrics")).text()
    assert _metric(metrics, "gearshift_router_no_decode_headroom_total") == 1.0
    assert _metric(metrics, "gearshift_router_headroom_held") == 0.0
    assert 'gearshift_router_rejects_total{reason="no_kv_capacity"}' not in metrics
    decisions = await (await client.get("/debug/decisions")).json()
    assert decisions["scaleUp"] == {"requests": 1, "lastKvBytes": 20.0, "held": 0}


async def test_held_request_is_refused_after_the_headroom_wait(make_router: Factory) -> None:
    client, _router, eng = await _pd_router(make_router, decode_kv_usage=0.98, headroom_wait_s=0.3)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    resp = await client.post("/v1/completions", json=_body(10, 10))
    waited = loop.time() - t0
    assert resp.status == 503
    message = (await resp.json())["error"]["message"]
    assert "within 0.3 s" in message and "scale-up requested" in message
    assert 0.3 <= waited < 2.0
    metrics = await (await client.get("/metrics")).text()
    assert 'gearshift_router_rejects_total{reason="no_kv_capacity"} 1.0' in metrics
    assert _metric(metrics, "gearshift_router_no_decode_headroom_total") == 1.0
    assert _metric(metrics, "gearshift_router_headroom_held") == 0.0
    assert eng["d0"].requests == []


async def test_headroom_wait_zero_refuses_at_once(make_router: Factory) -> None:
    client, _router, _ = await _pd_router(make_router, decode_kv_usage=0.98, headroom_wait_s=0.0)
    resp = await client.post("/v1/completions", json=_body(10, 10))
    assert resp.status == 503
    message = (await resp.json())["error"]["message"]
    assert message.endswith("free KV memory; scale-up requested"), message
    metrics = await (await client.get("/metrics")).text()
    assert _metric(metrics, "gearshift_router_no_decode_headroom_total") == 1.0


async def test_held_requests_are_placed_in_arrival_order(make_router: Factory) -> None:
    # 5% free = 50 bytes: the big request (1.2 x 60 = 72) does not fit, the small one (1.2 x 20 = 24) would.
    client, router, eng = await _pd_router(make_router, decode_kv_usage=0.95)
    big = asyncio.create_task(client.post("/v1/completions", json=_body(50, 10)))
    await asyncio.sleep(0.2)
    small = asyncio.create_task(client.post("/v1/completions", json=_body(10, 10)))
    await asyncio.sleep(0.3)
    # The small one fits but does not overtake the held big one: both wait, each counted once.
    assert not big.done() and not small.done()
    assert eng["d0"].requests == []
    metrics = await (await client.get("/metrics")).text()
    assert _metric(metrics, "gearshift_router_no_decode_headroom_total") == 2.0
    assert _metric(metrics, "gearshift_router_headroom_held") == 2.0
    assert router.proxy is not None and router.proxy.headroom_held == 2
    eng["d0"].kv_usage = 0.0
    assert (await asyncio.wait_for(big, 5)).status == 200
    assert (await asyncio.wait_for(small, 5)).status == 200
    # The decode pod got the big one's prefill handoff first (placement order = arrival order).
    assert [len(r["prompt"]) for r in eng["p0"].requests] == [50, 10]


async def test_a_request_larger_than_every_decode_kv_pool_is_refused_at_once(make_router: Factory) -> None:
    # 1000-byte pool, 1 byte a token: 990 + 20 tokens can never be held, even by an empty pod
    client, _router, eng = await _pd_router(make_router, decode_kv_usage=0.0)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    resp = await client.post("/v1/completions", json=_body(990, 20))
    assert resp.status == 400 and loop.time() - t0 < 1.0  # no hold
    err = (await resp.json())["error"]
    assert (
        err["param"] == "max_tokens" and "1010 tokens" in err["message"] and "1000 tokens" in err["message"]
    )
    metrics = await (await client.get("/metrics")).text()
    assert _metric(metrics, "gearshift_router_no_decode_headroom_total") == 0.0  # no scale-up asked
    assert eng["d0"].requests == [] and eng["p0"].requests == []
    # one that fits an empty pod is served
    assert (await client.post("/v1/completions", json=_body(700, 20))).status == 200


async def test_a_connect_timeout_is_a_failed_connect_retried_elsewhere_not_a_504(
    make_router: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """aiohttp's connect timeout is a TimeoutError: it was answered as the router's own request timeout
    (504 "no complete answer within 300 s", bench/router_peers at 95 % load) and not retried."""
    client, router, eng = await make_router(
        {"b-slow": ("both", FakeEngine("b-slow")), "b-ok": ("both", FakeEngine("b-ok"))}
    )
    slow_url = router.pool.backends["b-slow"].info.url
    real_post = router.session.post

    def post(url: str, **kw: Any) -> Any:
        if url.startswith(slow_url):
            raise aiohttp.ConnectionTimeoutError(f"Connection timeout to host {slow_url}")
        return real_post(url, **kw)

    monkeypatch.setattr(router.session, "post", post)
    # round-robin over sorted names ["b-ok", "b-slow"]: the second request meets the slow pod first
    for _ in range(2):
        resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert resp.status == 200, await resp.text()
    assert len(eng["b-ok"].requests) == 2 and router.pool.backends["b-slow"].failures == 1
    metrics = await (await client.get("/metrics")).text()
    assert 'gearshift_router_retries_total{pod="b-slow",role="both"} 1.0' in metrics
    # no pod reachable: a 502 naming the connect failure, never the 504 of the router's own timeout
    monkeypatch.setattr(router.session, "post", lambda url, **kw: (_ for _ in ()).throw(
        aiohttp.ConnectionTimeoutError("Connection timeout to host")))  # fmt: skip
    resp = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    doc = await resp.json()
    assert resp.status == 502 and "could not connect" in doc["error"]["message"], doc


async def test_decode_pod_that_does_not_answer_within_half_the_kv_lease_prefills_the_prompt_itself(
    make_router: Factory,
) -> None:
    """A decode pod held back past half the KV lease never gets the prefill's kv_transfer_params (the
    prefill may free those blocks before it reads them): it gets the client's request and prefills it."""
    held = SlowHealth("d0", health_delay_s=5.0)
    client, router, eng = await make_router(
        {"p0": ("prefill", FakeEngine("p0")), "d0": ("decode", held)},
        proxy=ProxyConfig(kv_lease_s=0.4),
    )
    body = {"model": "m", "prompt": "hello world", "max_tokens": 3, "temperature": 0}
    t0 = asyncio.get_running_loop().time()
    resp = await client.post("/v1/completions", json=body)
    waited = asyncio.get_running_loop().time() - t0
    assert resp.status == 200, await resp.text()
    (pre,) = eng["p0"].requests
    assert pre["kv_transfer_params"]["do_remote_decode"] is True
    (dec,) = eng["d0"].requests
    assert dec == body  # the client's request, no KV handed over
    assert 0.2 <= waited < 2.0, waited  # the bound (half of 0.4 s), not the held pod's 5 s health delay
    metrics = await (await client.get("/metrics")).text()
    assert 'gearshift_router_kv_reprefills_total{pod="d0"} 1.0' in metrics
    assert router.pool.backends["d0"].inflight == 0


@dataclass
class HeldAfter(FakeEngine):
    """A decode engine whose /health answers its first ``answers`` checks at once, then is held back."""

    answers: int = 1
    checks: int = 0

    async def health(self, _r: web.Request) -> web.Response:
        self.checks += 1
        if self.checks > self.answers:
            await asyncio.sleep(5.0)
        return web.json_response({})


async def test_decode_pod_that_answers_gets_the_kv_and_a_stale_answer_is_asked_again(
    make_router: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A live decode pod gets the KV; when the prefill leg outlasts HANDOFF_FRESH_S the router asks the
    decode pod again after it, and a pod held back since its first answer does not get the KV."""
    from gearshift.router import proxy as proxy_mod

    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    client, _router, eng = await make_router(
        {"p0": ("prefill", FakeEngine("p0", delay_s=0.3)), "d0": ("decode", HeldAfter("d0", answers=10))},
        proxy=ProxyConfig(kv_lease_s=2.0),
    )
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200
    assert eng["d0"].requests[-1]["kv_transfer_params"] == nixl_params("p0")

    monkeypatch.setattr(proxy_mod, "HANDOFF_FRESH_S", 0.1)
    held = HeldAfter("d1", answers=1)
    client, _router, eng = await make_router(
        {"p0": ("prefill", FakeEngine("p0", delay_s=0.3)), "d1": ("decode", held)},
        proxy=ProxyConfig(kv_lease_s=2.0),
    )
    resp = await client.post("/v1/completions", json=body)
    assert resp.status == 200
    assert held.checks >= 2, held.checks
    assert eng["d1"].requests[-1] == body


async def test_no_kv_lease_means_no_hand_off_check(make_router: Factory) -> None:
    held = SlowHealth("d0", health_delay_s=5.0)
    client, _router, eng = await make_router(
        {"p0": ("prefill", FakeEngine("p0")), "d0": ("decode", held)}, proxy=ProxyConfig(kv_lease_s=0.0)
    )
    resp = await client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})
    assert resp.status == 200
    assert eng["d0"].requests[-1]["kv_transfer_params"] == nixl_params("p0")


# --- aggregated serving (role both): whole requests, placed as decode pods are ---------------------------
async def _both_router(
    make_router: Factory, kv_usage: dict[str, float], **proxy: Any
) -> tuple[TestClient, Router, dict[str, FakeEngine]]:
    """pd-score over ``both`` pods (an aggregated PDService) whose KV pools are ``KV_POOL_BYTES``."""
    client, router, eng = await make_router(
        {n: ("both", FakeEngine(n, kv_usage=u)) for n, u in kv_usage.items()},
        policy="pd-score",
        proxy=ProxyConfig(kv_bytes_per_token=1.0, **proxy),
    )
    for n, b in router.pool.backends.items():
        b.info = BackendInfo(n, b.info.url, "both", kv_capacity_bytes=KV_POOL_BYTES)
    for _ in range(100):  # the first scrape sets every pod's KV usage
        if all(b.last_scrape is not None for b in router.pool.backends.values()):
            break
        await asyncio.sleep(0.02)
    assert {n: b.kv_usage for n, b in router.pool.backends.items()} == kv_usage
    return client, router, eng


async def test_aggregated_pd_score_sends_whole_requests_to_a_pod_with_kv_headroom(
    make_router: Factory,
) -> None:
    # b-full: 2% of 1000 bytes free = 20 < 1.2 x (10 + 10) = 24, so the PD guide's decode filter leaves it out
    # (docs/sources.md#decode-headroom).
    client, _router, eng = await _both_router(make_router, {"b-full": 0.98, "b-ok": 0.5})
    for _ in range(4):
        assert (await client.post("/v1/completions", json=_body(10, 10))).status == 200
    assert eng["b-full"].requests == []
    # one leg per request: the client's body as sent, no kv_transfer_params, max_tokens untouched
    assert eng["b-ok"].requests == [_body(10, 10)] * 4
    metrics = await (await client.get("/metrics")).text()
    assert 'gearshift_router_picks_total{pod="b-ok",policy="pd-score",role="both"} 4.0' in metrics


async def test_aggregated_request_is_held_until_a_pod_has_kv_headroom(make_router: Factory) -> None:
    client, _router, eng = await _both_router(make_router, {"b0": 0.98})
    task = asyncio.create_task(client.post("/v1/completions", json=_body(10, 10)))
    await asyncio.sleep(0.5)
    assert not task.done() and eng["b0"].requests == []
    metrics = await (await client.get("/metrics")).text()
    assert _metric(metrics, "gearshift_router_no_decode_headroom_total") == 1.0  # the scale-up signal
    eng["b0"].kv_usage = 0.5
    assert (await asyncio.wait_for(task, 5)).status == 200
    assert eng["b0"].requests == [_body(10, 10)]


@dataclass
class KvNeverComes(FakeEngine):
    """A decode engine that, like vLLM 0.32's push-mode decode whose KV never arrives, never answers a
    request that carries ``kv_transfer_params``; it answers the client's own request at once."""

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body.get("kv_transfer_params"):
            self.requests.append(body)
            await asyncio.sleep(30.0)
        return await super().completions(request)


async def test_decode_leg_stuck_waiting_for_kv_is_prefilled_on_a_decode_pod_after_the_lease(
    make_router: Factory,
) -> None:
    """A non-streamed decode leg handed the KV that gives no answer within the lease + 1 s a token is given
    up (its connection closed) and the client's request goes to a decode pod without the KV."""
    from gearshift.router import proxy as proxy_mod

    stuck = KvNeverComes("d0")
    client, router, eng = await make_router(
        {"p0": ("prefill", FakeEngine("p0")), "d0": ("decode", stuck)}, proxy=ProxyConfig(kv_lease_s=0.3)
    )
    body = {"model": "m", "prompt": "hello world", "max_tokens": 2, "temperature": 0}
    bound = proxy_mod.kv_wait_bound_s(0.3, 2)
    assert bound == pytest.approx(0.3 + 2 * proxy_mod.DECODE_SLACK_S_PER_TOKEN)
    t0 = asyncio.get_running_loop().time()
    resp = await client.post("/v1/completions", json=body)
    waited = asyncio.get_running_loop().time() - t0
    assert resp.status == 200, await resp.text()
    first, second = eng["d0"].requests
    assert first["kv_transfer_params"] == nixl_params("p0")
    assert second == body  # the client's request, no KV
    assert bound <= waited < bound + 2.0, (waited, bound)
    metrics = await (await client.get("/metrics")).text()
    assert 'gearshift_router_kv_reprefills_total{pod="d0"} 1.0' in metrics
    assert router.pool.backends["d0"].inflight == 0
    # an unknown lease (0) bounds nothing
    assert proxy_mod.kv_wait_bound_s(0.0, 2) is None
