"""The simulated engine's HTTP server (``gearshift-sim``): vLLM's OpenAI-compatible API over :class:`Engine`.

Endpoints of a head pod: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with SSE streaming
as vLLM does it: ``data: {json}`` chunks, ``data: [DONE]``, usage with ``stream_options.include_usage``,
on every chunk too with ``continuous_usage_stats``),
``GET /v1/models``, ``/health``, ``/metrics`` and ``/sim/stats`` (the simulator's own step accounting).
A worker pod (stage k>0, ``--worker``) has ``/health`` and ``/metrics`` only.

Token counting (the simulator has no tokenizer): a ``prompt`` given as a list of token ids counts one
token per id, exactly as vLLM does; text counts one token per whitespace-separated word (for chat, the
words of every message's content). Output is the word ``tok`` once per generated token, so a client
counting words gets the same count. There is no EOS: a request always generates ``max_tokens`` tokens
(vLLM with ``ignore_eos: true``); ``max_tokens`` defaults to 16 for completions (OpenAI's default) and
:data:`DEFAULT_CHAT_MAX_TOKENS` for chat.

PD protocol (docs/ARCHITECTURE.md), as vLLM's NixlConnector speaks it (see :func:`prefill_kv_transfer_params`
and :func:`remote_prefill_tokens`): a request with ``kv_transfer_params.do_remote_decode`` is prefilled
and answered after one token with the ``kv_transfer_params`` a decode pod needs, in NixlConnector's
shape; a request with valid ``kv_transfer_params.do_remote_prefill`` skips prefill and pulls its prompt's
KV over the KV link first. A ``prefill`` pod answers any request after one token. Request ids follow
vLLM's serving layer: the response ``id`` is ``cmpl-<X-Request-Id>`` (``chatcmpl-`` for chat), the
header's value, else the body's ``request_id``, else a new one.

One process can serve many pods: ``--listen HOST:PORT`` repeated (same engine settings, one engine per
listener) or ``--pods FILE`` (YAML/JSON list of ``{listen: HOST:PORT, env: {GEARSHIFT_...}}``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pydantic
import yaml
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

from gearshift.facts.lax import LAX_BOOL, LAX_FLOAT, LAX_INT, read_lax
from gearshift.sim.config import SimConfig, SimConfigError, config_from_env
from gearshift.sim.engine import Engine, EngineConfigError, RequestRejected, SimRequest
from gearshift.sim.metrics import LoopLagCollector
from gearshift.sim.perfmodel import PerfModel

DEFAULT_CHAT_MAX_TOKENS = 256
TOKEN_TEXT = " tok"
ENGINE_KEY = web.AppKey("engine", Engine)
ENGINE_ID_KEY = web.AppKey("engine_id", str)
CONFIG_KEY = web.AppKey("config", SimConfig)
REGISTRY_KEY = web.AppKey("registry", CollectorRegistry)
log = logging.getLogger(__name__)
#: vLLM's default NIXL side-channel port, ``VLLM_NIXL_SIDE_CHANNEL_PORT`` (vllm/envs.py), which a prefill
#: pod's ``kv_transfer_params`` name as ``remote_port`` (the simulator opens no side channel).
NIXL_SIDE_CHANNEL_PORT = 5600
#: What a decode request's ``kv_transfer_params`` must hold besides non-empty ``remote_block_ids`` for
#: vLLM to pull the KV (``update_state_after_alloc`` in
#: vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py, 0.32).
REMOTE_PREFILL_KEYS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")


# --- request parsing (pure) ----------------------------------------------------------------------
@dataclass(frozen=True)
class ParsedRequest:
    """What the engine needs from an OpenAI request body."""

    prompt_tokens: int
    max_tokens: int
    stream: bool
    include_usage: bool
    model: str | None
    kv_transfer_params: Mapping[str, Any] | None
    request_id: str | None = None
    """The body's ``request_id`` (vLLM's own field; the ``X-Request-Id`` header comes first)."""
    stop: tuple[str, ...] = ()
    """``stop`` strings: the output ends before the first one (after it with ``include_stop``)."""
    include_stop: bool = False
    """``include_stop_str_in_output`` (vLLM's extra field)."""
    continuous_usage: bool = False
    """``stream_options.continuous_usage_stats`` with ``include_usage``: every chunk carries the usage so
    far (vLLM's ``should_include_usage``, vllm/entrypoints/serve/utils/api_utils.py)."""


class BadRequest(ValueError):
    """A malformed request body; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _count_text(text: str) -> int:
    return len(text.split())


def count_prompt_tokens(prompt: Any) -> int:
    """Tokens of a completions ``prompt``: ids in a list of ints, else words of the text.

    Raises:
        BadRequest: a batch of prompts (a list of strings or of lists) or a wrong type.
    """
    if isinstance(prompt, str):
        return _count_text(prompt)
    if isinstance(prompt, list):
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return len(prompt)
        if len(prompt) == 1:
            return count_prompt_tokens(prompt[0])
        raise BadRequest("batched prompts are not supported by the simulator; send one per request", "prompt")
    raise BadRequest("prompt must be a string or a list of token ids", "prompt")


def count_chat_tokens(messages: Any) -> int:
    """Tokens of chat ``messages``: the words of every message's text content.

    Raises:
        BadRequest: ``messages`` not a non-empty list of ``{role, content}`` objects.
    """
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list of {role, content} objects", "messages")
    total = 0
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise BadRequest(f"messages[{i}] must be an object with role and content", "messages")
        content = msg.get("content")
        if isinstance(content, str):
            total += _count_text(content)
        elif isinstance(content, list):
            total += sum(_count_text(p.get("text", "")) for p in content if isinstance(p, dict))
        elif content is not None:
            raise BadRequest(f"messages[{i}].content must be a string or a list of parts", "messages")
    return total


#: Fields that change what a completion returns and the simulator does not produce, with the values that
#: ask for nothing (vLLM's defaults): a request asking for more is refused naming the field, not answered
#: as if it had been applied.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "prompt_logprobs": (None,),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "use_beam_search": (None, False),
    "stop_token_ids": (None, []),
    "tools": (None, []),
    "response_format": (None, {"type": "text"}),
    "structured_outputs": (None,),
}

INCLUDE_STOP = "include_stop_str_in_output"

#: Sampling fields the simulator does not use but checks as vLLM does, so a request vLLM refuses is refused
#: here too: name → (type, the range vLLM allows, that range in vLLM's words). Types from vLLM's request
#: models (pydantic, lax), ranges from ``SamplingParams._verify_args`` (vllm/sampling_params.py, 0.32).
SAMPLING_RULES: dict[str, tuple[pydantic.TypeAdapter[Any], Callable[[Any], bool], str]] = {
    "temperature": (LAX_FLOAT, lambda v: 0 <= v <= 2, "in [0, 2]"),
    "top_p": (LAX_FLOAT, lambda v: 0 < v <= 1, "in (0, 1]"),
    "top_k": (LAX_INT, lambda v: v in (-1, 0) or v >= 1, "0 (disable), or at least 1"),
    "min_p": (LAX_FLOAT, lambda v: 0 <= v <= 1, "in [0, 1]"),
    "presence_penalty": (LAX_FLOAT, lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "frequency_penalty": (LAX_FLOAT, lambda v: -2 <= v <= 2, "in [-2, 2]"),
    "repetition_penalty": (LAX_FLOAT, lambda v: v > 0, "greater than zero"),
    "seed": (LAX_INT, lambda _v: True, "an integer"),
    "ignore_eos": (LAX_BOOL, lambda _v: True, "a boolean"),
    "skip_special_tokens": (LAX_BOOL, lambda _v: True, "a boolean"),
    "min_tokens": (LAX_INT, lambda v: v >= 0, "greater than or equal to 0"),
}


def check_sampling(body: Mapping[str, Any], max_tokens: int) -> None:
    """Refuse what vLLM refuses among :data:`SAMPLING_RULES`' fields (None is vLLM's default: passes),
    and a ``min_tokens`` above ``max_tokens``.

    Raises:
        BadRequest: naming the field, in vLLM's words.
    """
    for name, (adapter, allowed, rule) in SAMPLING_RULES.items():
        if body.get(name) is None:
            continue
        value = _lax(adapter, body[name], name, "a number" if adapter is LAX_FLOAT else rule)
        if not allowed(value):
            raise BadRequest(f"{name} must be {rule}, got {value}.", name)
        if name == "min_tokens" and value > max_tokens:
            raise BadRequest(
                f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {value}.", name
            )


def _lax(adapter: pydantic.TypeAdapter[Any], value: Any, field: str, what: str) -> Any:
    """``value`` read as vLLM reads it (:func:`gearshift.facts.lax.read_lax`).

    Raises:
        BadRequest: naming ``field``.
    """
    read = read_lax(adapter, value)
    if read is None:
        raise BadRequest(f"{field} must be {what}, got {value!r}", field)
    return read


def stream_options(body: Mapping[str, Any]) -> tuple[bool, bool]:
    """``(include_usage, continuous_usage)`` of a request's ``stream_options``, read as vLLM reads them:
    an object of lax booleans (``StreamOptions``, vllm/entrypoints/generate/base/protocol.py, 0.32; the
    string ``"false"`` is False), continuous usage only with ``include_usage`` (``should_include_usage``).

    Raises:
        BadRequest: ``stream_options`` given (truthy) on a request whose raw ``stream`` is falsy, with
            vLLM's message (its ``validate_stream_options`` before-validator tests the raw values, so
            ``"stream": "false"`` lets options through and ``{}`` passes with ``stream: false``); not an
            object; a value that is not a boolean.
    """
    opts = body.get("stream_options")
    if opts and not body.get("stream"):
        raise BadRequest("Stream options can only be defined when `stream=True`.", "stream_options")
    if opts is None:
        return False, False
    if not isinstance(opts, dict):
        raise BadRequest(
            f'stream_options must be an object such as {{"include_usage": true}}, got {opts!r}',
            "stream_options",
        )
    flags = []
    for name in ("include_usage", "continuous_usage_stats"):
        raw = opts.get(name)
        value = False if raw is None else read_lax(LAX_BOOL, raw)
        if value is None:
            raise BadRequest(f"stream_options.{name} must be a boolean, got {raw!r}", "stream_options")
        flags.append(bool(value))
    return flags[0], flags[0] and flags[1]


def _stop_strings(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,) if value else ()
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(v for v in value if v)
    raise BadRequest(f"stop must be a string or a list of strings, got {value!r}", "stop")


def stop_point(stop: Sequence[str], max_tokens: int, include_stop: bool = False) -> tuple[int, int] | None:
    """Where ``stop`` ends the simulator's output (``TOKEN_TEXT`` repeated): ``(tokens, chars)``, the
    tokens generated up to the one that completes the first stop string and the characters of text
    returned (up to that string, or through it with ``include_stop``), as vLLM's detokenizer stops
    (vllm/v1/engine/detokenizer.py ``check_stop_strings``); None when no stop string occurs within
    ``max_tokens`` tokens."""
    best: tuple[int, int] | None = None
    for s in stop:
        # The output is periodic: a string that occurs at all occurs within its length plus two tokens.
        for k in range(1, min(max_tokens, len(s) // len(TOKEN_TEXT) + 2) + 1):
            at = (TOKEN_TEXT * k).find(s)
            if at >= 0:
                cut = at + len(s) if include_stop else at
                if best is None or (k, cut) < best:
                    best = (k, cut)
                break
    return best


def parse_request(body: Any, chat: bool) -> ParsedRequest:
    """Read the fields the simulator uses from a completions (``chat=False``) or chat body.

    Raises:
        BadRequest: naming the field.
    """
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    prompt = count_chat_tokens(body.get("messages")) if chat else count_prompt_tokens(body.get("prompt"))
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    default = DEFAULT_CHAT_MAX_TOKENS if chat else 16
    max_tokens = body.get(key)
    max_tokens = default if max_tokens is None else _lax(LAX_INT, max_tokens, key, "a positive integer")
    if max_tokens < 1:
        raise BadRequest(f"{key} must be a positive integer, got {max_tokens!r}", key)
    check_sampling(body, max_tokens)
    if _lax(LAX_INT, body.get("n", 1), "n", "an integer") != 1:
        raise BadRequest(
            "n: gearshift-sim returns one choice per request; send n=1 (or several requests)", "n"
        )
    for name, neutral in UNSUPPORTED_FIELDS.items():
        # by type as well: completions' logprobs=0 asks for the sampled token's logprob (0 == False)
        if name in body and not any(body[name] == n and type(body[name]) is type(n) for n in neutral):
            raise BadRequest(
                f"{name} is not supported by gearshift-sim (it returns placeholder text of the right length "
                "and timing); leave it out, or serve the model with engine: vllm",
                name,
            )
    include_usage, continuous_usage = stream_options(body)
    ktp = body.get("kv_transfer_params")
    if ktp is not None and not isinstance(ktp, dict):
        raise BadRequest("kv_transfer_params must be an object", "kv_transfer_params")
    model = body.get("model")
    rid = body.get("request_id")
    return ParsedRequest(
        prompt_tokens=prompt,
        max_tokens=max_tokens,
        stream=_lax(LAX_BOOL, body.get("stream") or False, "stream", "a boolean"),
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        model=model if isinstance(model, str) else None,
        kv_transfer_params=ktp,
        request_id=rid if isinstance(rid, str) and rid else None,
        stop=_stop_strings(body.get("stop")),
        include_stop=_lax(
            LAX_BOOL,
            body.get("include_stop_str_in_output") or False,
            "include_stop_str_in_output",
            "a boolean",
        ),
    )


# --- PD protocol (pure) --------------------------------------------------------------------------
def response_id(headers: Mapping[str, str], pr: ParsedRequest, chat: bool) -> str:
    """The response ``id``: ``cmpl-<id>`` or ``chatcmpl-<id>``, ``<id>`` being the ``X-Request-Id``
    header, else the body's ``request_id``, else a new one (vLLM's serving layer: ``_base_request_id``
    in vllm/entrypoints/serve/engine/serving.py, used by openai/completion/serving.py and
    openai/chat_completion/serving.py)."""
    base = headers.get("X-Request-Id") or pr.request_id or uuid.uuid4().hex
    return ("chatcmpl-" if chat else "cmpl-") + base


def engine_request_id(rid: str, chat: bool) -> str:
    """The engine's internal id of a request whose response id is ``rid``: completions add the prompt's
    index (``f"{request_id}-{i}"``, vllm/entrypoints/openai/completion/serving.py), and the engine adds 8
    random characters (``assign_request_id`` in vllm/v1/engine/input_processor.py). A prefill pod returns
    it as ``remote_request_id``."""
    return f"{rid if chat else rid + '-0'}-{uuid.uuid4().hex[:8]}"


def prefill_kv_transfer_params(
    *,
    engine_id: str,
    request_id: str,
    host: str,
    block_ids: Sequence[int],
    num_tokens: int,
    tp_size: int,
    pp_size: int,
) -> dict[str, Any]:
    """What a prefill pod answers a ``do_remote_decode`` request with: the dict NixlConnector's scheduler
    returns from ``request_finished`` (vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py,
    0.32; nixl_connector.py before), key for key. ``remote_block_ids`` holds one list per KV-cache group
    (one group here: every layer is full attention); ``remote_host``/``remote_port`` are the pod's NIXL side
    channel (``VLLM_NIXL_SIDE_CHANNEL_HOST``, the pod IP, and :data:`NIXL_SIDE_CHANNEL_PORT`);
    ``tp_size`` is the GPUs of a stage (vLLM: the same TP on every stage)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [list(block_ids)],
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": NIXL_SIDE_CHANNEL_PORT,
        "tp_size": tp_size,
        "dcp_size": 1,
        "pp_size": pp_size,
        "remote_num_tokens": num_tokens,
        "remote_blocks_expiry_time": None,
        "transfer_mode": "pull",
    }


def remote_prefill_tokens(ktp: Mapping[str, Any], prompt_tokens: int) -> int:
    """Prompt tokens whose KV a decode request pulls instead of computing: all of them when
    ``kv_transfer_params`` asks for a remote prefill and names the blocks and where they are, else 0 (vLLM
    logs "Got invalid KVTransferParams" and the request does not use KV transfer). vLLM counts the decode
    request's own prompt, not a number sent along (``get_num_new_matched_tokens`` and
    ``update_state_after_alloc`` in vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py)."""
    if not ktp.get("do_remote_prefill"):
        return 0
    if not ktp.get("remote_block_ids") or not all(k in ktp for k in REMOTE_PREFILL_KEYS):
        return 0
    return prompt_tokens


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


# --- app construction ----------------------------------------------------------------------------
class LoopLagMonitor:
    """Measures the process's event-loop lag with a periodic timer (one per process)."""

    def __init__(self, interval_s: float = 0.05) -> None:
        self.interval_s = interval_s
        self.last = 0.0
        self.worst = 0.0
        self.samples: list[float] = []
        self._task: asyncio.Task[None] | None = None
        self.collector = LoopLagCollector(lambda: (self.last, self.worst))

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(self.interval_s)
            self.last = max(0.0, time.monotonic() - t0 - self.interval_s)
            self.worst = max(self.worst, self.last)
            if len(self.samples) < 100_000:
                self.samples.append(self.last)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


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


def load_pods_file(path: str | Path, base_env: Mapping[str, str]) -> list[SimConfig]:
    """Read a ``--pods`` file: a list of ``{listen: "HOST:PORT", env: {GEARSHIFT_...: ..}}``; each pod's
    env is laid over ``base_env``. Non-string env values (objects, numbers) are JSON-encoded.

    Raises:
        SimConfigError: naming the entry and field.
    """
    with Path(path).open() as fh:
        doc = yaml.safe_load(fh)
    pods = doc.get("pods") if isinstance(doc, dict) else doc
    if not isinstance(pods, list) or not pods:
        raise SimConfigError(f"{path}: expected a list of pods (or {{pods: [...]}})")
    out = []
    for i, pod in enumerate(pods):
        if not isinstance(pod, dict) or "listen" not in pod:
            raise SimConfigError(f"{path}: pods[{i}] needs 'listen: HOST:PORT'")
        env = dict(base_env)
        for k, v in (pod.get("env") or {}).items():
            env[str(k)] = v if isinstance(v, str) else json.dumps(v)
        host, port = _split_listen(str(pod["listen"]), f"pods[{i}].listen")
        env["GEARSHIFT_HOST"], env["GEARSHIFT_PORT"] = host, str(port)
        try:
            out.append(config_from_env(env))
        except SimConfigError as exc:
            raise SimConfigError(f"{path}: pods[{i}]: {exc}") from None
    return out


def _split_listen(value: str, where: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise SimConfigError(f"{where} must be HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


async def serve(configs: Sequence[SimConfig], stop: asyncio.Event | None = None) -> None:
    """Serve every pod of ``configs`` in this event loop until ``stop`` is set (or SIGINT/SIGTERM)."""
    lag = LoopLagMonitor()
    runners = []
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        for cfg in configs:
            # Cancelling a handler whose client left aborts its request, as vLLM does; shutdown does not
            # wait for simulated requests that may run for minutes.
            runner = web.AppRunner(
                build_app(cfg, lag),
                access_log=None,
                handle_signals=False,
                handler_cancellation=True,
                shutdown_timeout=1.0,
            )
            await runner.setup()
            await web.TCPSite(runner, cfg.host, cfg.port, backlog=1024).start()
            runners.append(runner)
            kind = "worker" if cfg.worker else f"head role={cfg.role}"
            name = cfg.served_model_name
            print(f"gearshift-sim: serving {name} ({kind}) on http://{cfg.listen}", flush=True)
        await stop.wait()
    finally:
        for runner in runners:
            await runner.cleanup()
        await lag.stop()


def build_arg_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Flags of ``gearshift-sim`` (also ``gearshift sim``); each overrides its ``GEARSHIFT_*`` variable."""
    p = parser or argparse.ArgumentParser(prog="gearshift-sim", description=__doc__.split("\n")[0])
    p.add_argument("--host", help="listen address (GEARSHIFT_HOST; default 127.0.0.1)")
    p.add_argument("--port", help="listen port (GEARSHIFT_PORT; default 8000)")
    p.add_argument("--role", choices=["prefill", "decode", "both"], help="GEARSHIFT_ROLE (default both)")
    p.add_argument("--stage", help="GEARSHIFT_STAGE: this pod's stage index (0 = head)")
    p.add_argument("--model", help="GEARSHIFT_MODEL: ModelArch JSON or path to an HF config.json")
    p.add_argument("--served-model-name", help="GEARSHIFT_SERVED_MODEL_NAME")
    p.add_argument("--pipeline", help="GEARSHIFT_PIPELINE JSON")
    p.add_argument("--gpu-profile", help="GEARSHIFT_GPU_PROFILE JSON")
    p.add_argument("--kv-link", help='GEARSHIFT_KV_LINK JSON {"gbps": .., "latencyUs": ..}')
    p.add_argument("--max-model-len", help="GEARSHIFT_MAX_MODEL_LEN")
    p.add_argument("--mfu", help="GEARSHIFT_SIM_MFU: prefill FLOPs utilisation (default 0.5)")
    p.add_argument("--mbu", help="GEARSHIFT_SIM_MBU: decode bandwidth utilisation (default 0.7)")
    p.add_argument("--worker", action="store_true", help="a stage k>0 pod: /health and /metrics only")
    p.add_argument(
        "--listen", action="append", metavar="HOST:PORT", help="serve one engine per listener (repeatable)"
    )
    p.add_argument("--pods", metavar="FILE", help="serve many pods: YAML list of {listen, env}")
    return p


_FLAG_ENV = {
    "host": "GEARSHIFT_HOST",
    "port": "GEARSHIFT_PORT",
    "role": "GEARSHIFT_ROLE",
    "stage": "GEARSHIFT_STAGE",
    "model": "GEARSHIFT_MODEL",
    "served_model_name": "GEARSHIFT_SERVED_MODEL_NAME",
    "pipeline": "GEARSHIFT_PIPELINE",
    "gpu_profile": "GEARSHIFT_GPU_PROFILE",
    "kv_link": "GEARSHIFT_KV_LINK",
    "max_model_len": "GEARSHIFT_MAX_MODEL_LEN",
    "mfu": "GEARSHIFT_SIM_MFU",
    "mbu": "GEARSHIFT_SIM_MBU",
}


def configs_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> list[SimConfig]:
    """The pods to serve from parsed flags over ``environ``.

    Raises:
        SimConfigError: a bad variable or flag, naming it.
    """
    env = dict(environ)
    for attr, var in _FLAG_ENV.items():
        value = getattr(args, attr, None)
        if value is not None:
            env[var] = str(value)
    if getattr(args, "worker", False):
        env["GEARSHIFT_WORKER"] = "1"
    if getattr(args, "pods", None):
        return load_pods_file(args.pods, env)
    base = config_from_env(env)
    if not getattr(args, "listen", None):
        return [base]
    out = []
    for i, item in enumerate(args.listen):
        host, port = _split_listen(item, f"--listen[{i}]")
        out.append(replace(base, host=host, port=port))
    return out


def run_from_args(args: argparse.Namespace) -> int:
    """Run the server(s) described by ``args``; returns the exit code (2 on configuration errors)."""
    try:
        configs = configs_from_args(args, os.environ)
        asyncio.run(serve(configs))
    except (SimConfigError, EngineConfigError) as exc:
        print(f"gearshift-sim: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the listening socket: a port in use, an address not on this host
        print(
            f"gearshift-sim: cannot listen: {exc.strerror or exc}; choose another --port/--host",
            file=sys.stderr,
        )
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``gearshift-sim``."""
    args = build_arg_parser().parse_args(argv)
    return run_from_args(args)


if __name__ == "__main__":
    sys.exit(main())
