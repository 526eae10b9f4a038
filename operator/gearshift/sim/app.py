"""The HTTP layer of one simulated pod: vLLM's OpenAI-compatible API over :class:`Engine`.

Endpoints of a head pod: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with SSE streaming
as vLLM does it: ``data: {json}`` chunks, ``data: [DONE]``, usage with ``stream_options.include_usage``,
on every chunk too with ``continuous_usage_stats``),
``GET /v1/models``, ``/health``, ``/metrics`` and ``/sim/stats`` (the simulator's own step accounting).
A worker pod (stage k>0, ``--worker``) has ``/health`` and ``/metrics`` only.

A request is read by :mod:`gearshift.sim.request`; its PD fields and ids follow
:mod:`gearshift.sim.protocol`. A ``prefill`` pod answers any request after one token. The response ``id`` is
``cmpl-<X-Request-Id>`` (``chatcmpl-`` for chat), the header's value, else the body's ``request_id``, else
a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from gearshift.sim.config import SimConfig
from gearshift.sim.engine import Engine, RequestRejected, SimRequest
from gearshift.sim.looplag import LoopLagMonitor
from gearshift.sim.perfmodel import PerfModel
from gearshift.sim.protocol import (
    engine_request_id,
    prefill_kv_transfer_params,
    remote_prefill_tokens,
    response_id,
)
from gearshift.sim.request import TOKEN_TEXT, BadRequest, parse_request, stop_point

ENGINE_KEY = web.AppKey("engine", Engine)
ENGINE_ID_KEY = web.AppKey("engine_id", str)
CONFIG_KEY = web.AppKey("config", SimConfig)
REGISTRY_KEY = web.AppKey("registry", CollectorRegistry)
log = logging.getLogger(__name__)


def _error(
    status: int, message: str, param: str | None = None, kind: str = "BadRequestError"
) -> web.Response:
    # vLLM's ErrorResponse (vllm/entrypoints/serve/engine/protocol.py, 0.32): {"error": {message, type,
    # param, code}} with the HTTP status as code.
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.json_response(body, status=status)


# --- handlers ------------------------------------------------------------------------------------
def _usage(req: SimRequest) -> dict[str, int]:
    return {
        "prompt_tokens": req.prompt_tokens,
        "completion_tokens": req.generated,
        "total_tokens": req.prompt_tokens + req.generated,
    }


def _text(start: int, end: int, stop_at: tuple[int, int] | None) -> str:
    """The output text of tokens ``start..end`` (0-based, end exclusive), cut at a stop string."""
    full_end = len(TOKEN_TEXT) * end if stop_at is None else min(len(TOKEN_TEXT) * end, stop_at[1])
    return (TOKEN_TEXT * end)[len(TOKEN_TEXT) * start : full_end]


def _finish(req: SimRequest, stop_at: tuple[int, int] | None) -> str | None:
    """vLLM's finish_reason: ``stop`` when a stop string ended the output, else the engine's."""
    if req.finish_reason is not None and stop_at is not None and req.generated >= stop_at[0]:
        return "stop"
    return req.finish_reason


def _choice(chat: bool, text: str, finish: str | None, delta: bool) -> dict[str, Any]:
    if chat:
        # vLLM sends the role once, in the first (empty) delta of a stream; a whole message carries it.
        if delta:
            return {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
        msg = {"role": "assistant", "content": text}
        return {"index": 0, "message": msg, "logprobs": None, "finish_reason": finish}
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}


async def _completion(request: web.Request, chat: bool) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    cfg = request.app[CONFIG_KEY]
    try:
        body = await request.json()
    except json.JSONDecodeError:
        return _error(400, "the request body is not valid JSON")
    try:
        pr = parse_request(body, chat)
    except BadRequest as exc:
        return _error(400, str(exc), exc.param)
    if pr.model is not None and pr.model != cfg.served_model_name:
        return _error(404, f"The model `{pr.model}` does not exist.", "model", "NotFoundError")
    ktp = pr.kv_transfer_params or {}
    remote_kv = remote_prefill_tokens(ktp, pr.prompt_tokens)
    if ktp.get("do_remote_prefill") and not remote_kv:
        log.warning("Got invalid KVTransferParams: %s. This request will not utilize KVTransfer", ktp)
    remote_decode = bool(ktp.get("do_remote_decode"))
    prefill_only = remote_decode or cfg.role == "prefill"
    max_tokens = 1 if prefill_only else pr.max_tokens
    stop_at = None if prefill_only else stop_point(pr.stop, max_tokens, pr.include_stop)
    if stop_at is not None:
        max_tokens = stop_at[0]
    try:
        req = engine.new_request(
            pr.prompt_tokens, max_tokens, remote_kv_tokens=remote_kv, prefill_only=prefill_only
        )
    except RequestRejected as exc:
        return _error(400, str(exc), exc.param)
    created = int(time.time())
    rid = response_id(request.headers, pr, chat)
    obj = "chat.completion" if chat else "text_completion"
    try:
        if not pr.stream:
            await req.wait_finished()
            out: dict[str, Any] = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": cfg.served_model_name,
                "choices": [
                    _choice(chat, _text(0, req.generated, stop_at), _finish(req, stop_at), delta=False)
                ],
                "usage": _usage(req),
            }
            if remote_decode:
                stages = cfg.pipeline.stages
                out["kv_transfer_params"] = prefill_kv_transfer_params(
                    engine_id=request.app[ENGINE_ID_KEY],
                    request_id=engine_request_id(rid, chat),
                    host=cfg.host,
                    block_ids=range(req.first_block, req.first_block + _blocks(engine, req)),
                    num_tokens=req.prompt_tokens,
                    tp_size=stages[0].gpus,
                    pp_size=len(stages),
                )
            return web.json_response(out)
        return await _stream(
            request,
            engine,
            req,
            chat,
            rid,
            obj,
            created,
            pr.include_usage,
            cfg.served_model_name,
            stop_at,
            continuous_usage=pr.continuous_usage,
        )
    except (asyncio.CancelledError, ConnectionResetError):
        engine.abort(req)
        raise


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, chat=False)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await _completion(request, chat=True)


def _blocks(engine: Engine, req: SimRequest) -> int:
    # The blocks the prompt's KV occupied (freed on finish, so recomputed from the token count).
    return -(-req.prompt_tokens // engine.block_size)


async def _stream(
    request: web.Request,
    engine: Engine,
    req: SimRequest,
    chat: bool,
    rid: str,
    obj: str,
    created: int,
    include_usage: bool,
    model: str,
    stop_at: tuple[int, int] | None = None,
    *,
    continuous_usage: bool = False,
) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    base = {"id": rid, "object": f"{obj}.chunk" if chat else obj, "created": created, "model": model}

    def so_far(tokens: int) -> dict[str, Any]:
        # continuous_usage_stats: the usage up to this chunk on every chunk, as vLLM's serving layers do
        # (openai/completion/serving.py and chat_completion/serving.py, 0.32; 0 tokens on chat's role chunk).
        if not continuous_usage:
            return {}
        total = req.prompt_tokens + tokens
        return {
            "usage": {"prompt_tokens": req.prompt_tokens, "completion_tokens": tokens, "total_tokens": total}
        }

    if chat:
        delta = {"role": "assistant", "content": ""}
        first = {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]}
        await resp.write(b"data: " + json.dumps({**first, **so_far(0)}).encode() + b"\n\n")
    sent = 0
    try:
        async for n in req.token_batches():
            text = _text(sent, sent + n, stop_at)
            sent += n
            finish = _finish(req, stop_at) if req.finished and sent >= req.generated else None
            chunk = {**base, "choices": [_choice(chat, text, finish, delta=True)], **so_far(sent)}
            # One write per step: all the tokens this request got from the step go in one chunk.
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if include_usage:
            tail = {**base, "choices": [], "usage": _usage(req)}
            await resp.write(b"data: " + json.dumps(tail).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    except ConnectionResetError:
        # The client went away mid-stream (as vLLM does, the request is aborted and its blocks freed).
        engine.abort(req)
    return resp


async def _models(request: web.Request) -> web.Response:
    cfg = request.app[CONFIG_KEY]
    engine = request.app.get(ENGINE_KEY)
    card = {
        "id": cfg.served_model_name,
        "object": "model",
        "created": 0,
        "owned_by": "gearshift-sim",
        "root": cfg.arch.name,
        "max_model_len": engine.max_model_len if engine else None,
    }
    return web.json_response({"object": "list", "data": [card]})


async def _health(_: web.Request) -> web.Response:
    return web.Response(text="")


async def _metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[REGISTRY_KEY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _stats(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    cfg = request.app[CONFIG_KEY]
    doc = {"listen": cfg.listen, "role": cfg.role, "engineId": request.app[ENGINE_ID_KEY], **engine.stats()}
    return web.json_response(doc)


@web.middleware
async def fastapi_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """An unknown route or method answered as vLLM's server (FastAPI) answers it: JSON ``{"detail": ...}``
    with 404 or 405, not aiohttp's ``text/plain``, so a client pointed at the sim sees what vLLM sends."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return web.json_response({"detail": "Not Found"}, status=404)
    except web.HTTPMethodNotAllowed as exc:
        allow = ", ".join(sorted(exc.allowed_methods))
        return web.json_response({"detail": "Method Not Allowed"}, status=405, headers={"Allow": allow})


def build_app(cfg: SimConfig, lag: LoopLagMonitor | None = None) -> web.Application:
    """The aiohttp app of one simulated pod (head or worker); the engine runs while the app does.

    Raises:
        EngineConfigError: the pipeline leaves no KV-cache memory.
    """
    app = web.Application(middlewares=[fastapi_errors])
    app[CONFIG_KEY] = cfg
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    if cfg.worker:
        reg = CollectorRegistry()

        class _Worker:
            def collect(self) -> Any:
                g = GaugeMetricFamily("gearshift:sim_worker", "A simulated stage k>0 pod.", labels=["stage"])
                g.add_metric([str(cfg.stage)], 1.0)
                yield g

        reg.register(_Worker())
        if lag is not None:
            reg.register(lag.collector)
        app[REGISTRY_KEY] = reg
        return app
    engine = Engine(
        PerfModel(cfg.arch, cfg.pipeline, cfg.params),
        role=cfg.role,
        model_name=cfg.served_model_name,
        max_model_len=cfg.max_model_len,
        kv_link=cfg.kv_link,
    )
    if lag is not None:
        engine.metrics.add_collector(lag.collector)
    app[ENGINE_KEY] = engine
    # NixlConnector's engine id: kv_transfer_config.engine_id, by default a new uuid4 per engine
    # (vllm/config/kv_transfer.py).
    app[ENGINE_ID_KEY] = str(uuid.uuid4())
    app[REGISTRY_KEY] = engine.metrics.registry
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/sim/stats", _stats)

    async def engine_ctx(app: web.Application) -> Any:
        task = asyncio.get_running_loop().create_task(engine.run())
        if lag is not None:
            lag.start()
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app.cleanup_ctx.append(engine_ctx)
    return app
