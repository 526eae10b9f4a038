"""The router's request path: admission, pod choice, PD forwarding (docs/ARCHITECTURE.md), retries, streaming.

Flow of one ``/v1/completions`` or ``/v1/chat/completions`` request:

1. admission: at most ``max_inflight`` requests are forwarded at once; up to ``max_queue`` more wait (for
   at most ``queue_timeout_s``); beyond that the client gets 429 (queue full) or 503 (waited too long);
2. with prefill and decode pods: pick a decode pod, then a prefill pod (pd-score's prefill network term
   needs the decode peer). When no decode pod has KV headroom for the request (pd-score's seed-000
   filter), the request is *held*, not refused: it joins a FIFO of such requests (at most ``max_queue``)
   and placement is retried, head first, until headroom appears (requests finish, a scale-up's new pod
   joins) or ``headroom_wait_s`` passes (then 503, "scale-up requested"). The
   ``gearshift_router_no_decode_headroom`` counter — the autoscaler's immediate scale-up signal — counts
   each held request once, at its first miss. Then the two legs of vLLM's disaggregated-prefill protocol,
   exactly as vLLM's own proxy sends them (see :func:`prefill_leg_body`, :func:`decode_leg_body`,
   :func:`leg_headers`): the prefill leg, then the decode leg streamed back as it comes, both under one
   ``X-Request-Id``. A prefill leg that fails (an HTTP error, or a body that is not JSON) ends the request
   with an OpenAI-shaped error naming the prefill pod; the decode pod is not called. With only ``both``
   pods (an aggregated PDService, or ``--backend both=URL``): one pod per request, placed as a decode pod
   is (batch cap, pd-score's decode score and KV headroom hold), and the client's bytes forwarded as they
   are (with the ``X-Request-Id`` header): no second leg;
3. retries on another pod of the same role (Envoy's ``retry_on`` with the ``previous_hosts`` predicate): a
   failed *connect* (nothing sent) of either leg, and a 5xx answer of the prefill leg, which is idempotent
   (one token, nothing reached the client, the decode pod not yet called). A decode leg's 5xx is relayed,
   not retried: its pod may hold the request's transferred KV. Nothing after the first byte of the
   client's response is retried. Every 5xx answer and failed connect counts towards ejecting the pod
   (:mod:`gearshift.router.outlier`: Envoy's consecutive-5xx ejection, ejection cap and panic threshold);
4. every request has a deadline (``request_timeout_s``): 504 when it passes before the response started.

Every response to the client carries the request's ``X-Request-Id`` (the client's, or the one generated
for it), as vLLM's ``--enable-request-id-headers`` does. Errors are OpenAI-shaped JSON:
``{"error": {"message", "type", "code"}}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from gearshift.facts import fastjson
from gearshift.facts.lax import LAX_BOOL, LAX_INT, read_lax
from gearshift.router import policies as P
from gearshift.router.metrics import SLO_MET, SLO_MISSED, RouterMetrics, observe_many, slo_met
from gearshift.router.outlier import record_success
from gearshift.router.pool import Backend, Pool

if TYPE_CHECKING:
    from gearshift.router.mirror import Mirror

log = logging.getLogger(__name__)

#: Retried on another pod: the connection never carried the request.
#: Failures to reach a pod, retried on another one and counted for outlier detection. A connect that does
#: not finish within ``connect_timeout_s`` is one too (Envoy's ``connect-failure`` retry covers connect
#: timeouts): aiohttp raises ``ConnectionTimeoutError``, a ``TimeoutError``, which the handler otherwise
#: answered as its own overall timeout (504 "no complete answer within 300 s", seen in bench/router_peers).
CONNECT_ERRORS = (
    aiohttp.ClientConnectorError,
    aiohttp.ServerDisconnectedError,
    aiohttp.ConnectionTimeoutError,
)
#: Characters per token when the prompt is text (OpenAI's rule of thumb: ~4 characters per English token).
CHARS_PER_TOKEN = 4.0

#: The header both legs of one PD request share. vLLM's serving layer takes the engine request id from it
#: (``_base_request_id``: vllm/entrypoints/openai/serving_engine.py, 0.11-0.12;
#: vllm/entrypoints/serve/engine/serving.py, 0.32). On vLLM 0.11-0.12 the decode side's NixlConnector
#: tells the prefill side to free the request's KV blocks under *its own* request id, so two different ids
#: leave the prefill pod holding them until ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` passes (120 s there;
#: vllm/envs.py). Later versions also send ``remote_request_id`` in ``kv_transfer_params``
#: (NIXL_CONNECTOR_VERSION 2, vllm/distributed/kv_transfer/kv_connector/v1/nixl/metadata.py); one id
#: for both legs is still what vLLM's toy proxy sends
#: (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py).
REQUEST_ID_HEADER = "X-Request-Id"


def prefill_kv_transfer_params() -> dict[str, Any]:
    """The ``kv_transfer_params`` of a prefill leg: vLLM's toy proxy's, key for key
    (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py, ``send_request_to_service``).
    ``do_remote_decode: true`` makes the prefill pod's NixlConnector keep the prompt's KV blocks for a decode
    pod to pull and answer with the parameters that pod needs (``request_finished`` in
    vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py; nixl/pull_scheduler.py in 0.32)."""
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


def is_chat(path: str) -> bool:
    """Whether ``path`` is the chat completions endpoint."""
    return path.endswith("/chat/completions")


def prefill_leg_body(body: Mapping[str, Any], chat: bool) -> dict[str, Any]:
    """The prefill leg's body: the client's request with the changes vLLM's toy proxy makes
    (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py, ``send_request_to_service``):

    - ``kv_transfer_params`` = :func:`prefill_kv_transfer_params` (replacing any the client sent);
    - ``stream: false`` (the router reads the prefill pod's ``kv_transfer_params`` from one JSON body;
      vLLM returns them in the non-streamed response, vllm/entrypoints/openai/protocol.py
      ``CompletionResponse.kv_transfer_params``);
    - ``max_tokens: 1``, and ``max_completion_tokens: 1`` where the client sent it — always for chat, where
      vLLM's ``ChatCompletionRequest`` reads ``max_completion_tokens`` before ``max_tokens``; completions
      has no such field, so it is only overwritten there, never added;
    - ``stream_options`` removed (vLLM refuses it when ``stream`` is false: ``validate_stream_options``
      in vllm/entrypoints/openai/protocol.py);
    - ``min_tokens`` and ``min_completion_tokens`` removed ("not supported for P": a minimum above the
      one token would fail vLLM's ``min_tokens <= max_tokens`` check in vllm/sampling_params.py).

    The client's ``body`` is not changed (the decode leg is built from it). (vllm/entrypoints/openai/
    protocol.py is split into openai/completion/protocol.py and openai/chat_completion/protocol.py by 0.32.)
    """
    leg = dict(body)
    leg["kv_transfer_params"] = prefill_kv_transfer_params()
    leg["stream"] = False
    leg["max_tokens"] = 1
    if chat or "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    leg.pop("stream_options", None)
    leg.pop("min_tokens", None)
    leg.pop("min_completion_tokens", None)
    return leg


def decode_leg_body(body: Mapping[str, Any], prefill_response: Any) -> dict[str, Any]:
    """The decode leg's body: the client's request as it came, with ``kv_transfer_params`` set to what the
    prefill pod's response returned, when it returned any (vLLM's toy proxy,
    tests/v1/kv_connector/nixl_integration/toy_proxy_server.py, ``_handle_completions``). Without them (a
    prefill pod with no KV connector answers ``kv_transfer_params: null``) the decode pod gets the plain
    request and prefills it itself, as there."""
    leg = dict(body)
    ktp = prefill_response.get("kv_transfer_params") if isinstance(prefill_response, dict) else None
    if ktp:
        leg["kv_transfer_params"] = ktp
    return leg


class RequestIds:
    """Fresh request ids, 32 hex digits like vLLM's ``random_uuid`` (``uuid4().hex``, vllm/utils): a random
    20-digit prefix per router process and a 12-digit sequence number. Unique across routers and restarts
    by the prefix; cheaper than a ``uuid4`` per request (no ``getrandom`` call on the hot path)."""

    def __init__(self) -> None:
        self._prefix = uuid.uuid4().hex[:20]
        self._seq = itertools.count()

    def __call__(self) -> str:
        return f"{self._prefix}{next(self._seq) % 16**12:012x}"


def request_id_for(
    headers: Mapping[str, str], body: Mapping[str, Any], fresh: Callable[[], str] = lambda: uuid.uuid4().hex
) -> str:
    """The request's id: the client's ``X-Request-Id`` header, else the ``request_id`` of its body (vLLM's
    own request field, vllm/entrypoints/openai/protocol.py, which vLLM uses when no header is given), else
    ``fresh()`` (by default ``uuid4().hex``, as vLLM's ``random_uuid``; the router's is
    :class:`RequestIds`)."""
    rid = headers.get(REQUEST_ID_HEADER)
    if rid and rid.strip():
        return rid
    rid = body.get("request_id")
    if isinstance(rid, str) and rid.strip():
        return rid
    return fresh()


def leg_headers(request_id: str, authorization: str | None = None) -> dict[str, str]:
    """Headers of a leg to an engine: JSON, the shared ``X-Request-Id`` and the client's
    ``Authorization`` (vLLM's toy proxy sends ``Authorization: Bearer $OPENAI_API_KEY``; passing the
    client's through serves engines started with ``--api-key`` the same way)."""
    h = {"Content-Type": "application/json", REQUEST_ID_HEADER: request_id}
    if authorization:
        h["Authorization"] = authorization
    return h


#: Share of the KV lease (``ProxyConfig.kv_lease_s``) within which a PD request's decode leg must go to a
#: decode pod that answers (its ``/health``, asked while the prefill leg runs). vLLM 0.32's NIXL connector
#: frees a finished request's KV on the prefill pod when the lease runs out unless the decode engine that
#: holds the request renews it (heartbeats every lease/6, ``nixl/base_scheduler.py``); a decode engine that
#: gets the request later reads freed blocks (pull: "Potentially invalid KV blocks ... were retrieved",
#: measured on the sandbox) or waits for a push that never comes. So the router hands the leg over within
#: half the lease, which leaves the first heartbeat (lease/6) and a NIXL handshake (5 s, ``zmq.RCVTIMEO`` in
#: ``nixl/base_worker.py``) room; past it the decode pod gets the client's request without
#: ``kv_transfer_params`` and prefills the prompt itself (``gearshift_router_kv_reprefills``).
KV_HANDOFF_SHARE = 0.5
#: Seconds a non-streamed PD decode leg that was handed the KV may take per requested token, on top of the
#: KV lease, before the router presumes it waits for KV that will never come (:func:`kv_wait_bound_s`).
#: Generous on purpose: 1 s a token is slower than any engine the router serves (the sandbox's CPU vLLM
#: decodes the tiny model at ~0.05 s a token), so only a stuck leg reaches the bound.
DECODE_SLACK_S_PER_TOKEN = 1.0


def kv_wait_bound_s(kv_lease_s: float, max_tokens: int) -> float | None:
    """How long a non-streamed decode leg handed ``kv_transfer_params`` may take before the router gives
    it up and sends the client's request to a decode pod without them (which prefills the prompt), s;
    None (no bound) when the lease is unknown (0).

    Why: vLLM 0.32's push-mode decode engine never fails a request whose KV does not come (the D-side
    watchdog in ``nixl/push_scheduler.py`` only drops the registration), and the prefill frees the blocks
    at the end of the lease, so past the lease such a leg can only hang until the client's timeout.
    Measured on the sandbox (2 cores, two-stage prefill, 20 s lease): the prefill's P->D handshake timed
    out (``push_handshake_failed``) or a rank never saw the decode's PUSH_REG, and the decode leg hung
    until the test's 180 s timeout. The bound is the lease plus :data:`DECODE_SLACK_S_PER_TOKEN` per
    requested token, so a leg that got its KV and is still generating is never cut.
    """
    if kv_lease_s <= 0:
        return None
    return kv_lease_s + DECODE_SLACK_S_PER_TOKEN * max(1, max_tokens)


#: A decode pod's ``/health`` answer at most this old when the prefill leg ends counts as current, s;
#: an older one (a long prefill) is asked again within the hand-off bound.
HANDOFF_FRESH_S = 1.0


@dataclass
class ProxyConfig:
    """Limits and knobs of the request path."""

    max_inflight: int = 512
    max_queue: int = 1024
    queue_timeout_s: float = 10.0
    request_timeout_s: float = 300.0
    connect_timeout_s: float = 2.0
    retries: int = 2
    kv_bytes_per_token: float = 0.0
    prefill_ms_per_token: float = 0.0
    """Prefill ms per prompt token on the reference card (speed 1); 0 → unknown (pd-score's seed queue)."""
    headroom_wait_s: float = 30.0
    """How long a request no decode pod has KV headroom for is held while placement is retried, s; 0 →
    refused at once (503). Longer than the admission ``queue_timeout_s`` because it must cover what frees
    headroom: requests finishing (a decode of a few hundred tokens takes seconds) or a scale-up's new pod
    (on the sandbox ~10 s from the first miss to the router picking it; real engines take minutes to load
    weights, so there the hold covers transient exhaustion; a sustained one still ends in 503s)."""
    headroom_poll_s: float = 0.05
    """Period of the held head request's placement retries, s (signals change every scrape, 0.5-2 s)."""
    default_max_tokens: int = 16
    text_tokens: str = "chars"
    """How text prompts are counted: ``chars`` (÷4, real tokenizers) or ``words`` (gearshift-sim)."""
    kv_lease_s: float = 0.0
    """How long prefill pods hold a finished request's KV for its decode pod (PDService ``kvLeaseS``,
    vLLM's ``kv_lease_duration``), s; 0: unknown, no hand-off bound (:data:`KV_HANDOFF_SHARE`)."""
    service: str = ""
    """The PDService whose arrivals ``gearshift_router_arrivals`` counts (``--service``; empty with
    ``--backend``)."""
    roles: tuple[str, ...] = ("prefill", "decode")
    """The roles whose pods serve each request (``--roles``): each arrival is counted once per role."""


def error_body(status: int, message: str, err_type: str, param: str | None = None) -> dict[str, Any]:
    """An error as vLLM answers one: ``{"error": {"message", "type", "param", "code"}}`` with the HTTP
    status as ``code`` (``ErrorResponse``/``ErrorInfo``, vllm/entrypoints/serve/engine/protocol.py, 0.32)."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def error_response(status: int, message: str, err_type: str, param: str | None = None) -> web.Response:
    """:func:`error_body` as a JSON response of that status."""
    return web.json_response(error_body(status, message, err_type, param), status=status)


def _read_choices(doc: dict[str, Any]) -> tuple[bool, str | None]:
    """Of a completion document's ``choices``: whether one carries content (``text``, or chat's
    ``delta.content`` / ``reasoning_content`` / ``tool_calls``) and the first string ``finish_reason``.
    Exact ``dict``/``list`` checks, not ``Mapping``: JSON parses to them, and an ABC check costs more than
    the parse on the per-event path."""
    choices = doc.get("choices")
    if type(choices) is not list:
        return False, None
    content, reason = False, None
    for choice in choices:
        if type(choice) is not dict:
            continue
        if not content:
            delta = choice.get("delta")
            content = bool(
                choice.get("text")
                or (
                    type(delta) is dict
                    and (delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"))
                )
            )
        if reason is None and type(fr := choice.get("finish_reason")) is str:
            reason = fr
    return content, reason


@dataclass
class StreamScan:
    """What the complete server-sent events of a stream's bytes say: token events, and the last
    ``finish_reason`` and ``usage`` seen."""

    tokens: int = 0
    finish_reason: str | None = None
    usage: Mapping[str, Any] | None = None
    done: bool = False
    """``data: [DONE]`` seen: the answer is complete (a client may close its connection now)."""


def scan_sse(buffer: bytes) -> tuple[StreamScan, bytes]:
    """Scan the complete server-sent events in ``buffer``; return what they say and the unfinished tail
    (bytes after the last blank line) to prepend to the next chunk.

    A token event is a ``data:`` JSON chunk with a non-empty ``choices[].text`` (completions) or
    ``choices[].delta.content`` / ``reasoning_content`` / ``tool_calls`` (chat). Not tokens: chat's first
    chunk, which carries only the role (vLLM sends it before the first token is computed, so a TTFT timed
    from it is too low), a usage-only chunk (``choices: []``), ``[DONE]`` and anything that is not JSON.
    """
    if b"\r" in buffer:
        buffer = buffer.replace(b"\r\n", b"\n")
    *events, rest = buffer.split(b"\n\n")
    scan = StreamScan()
    for ev in events:
        # vLLM's events are one ``data:`` line each: the common case skips the line split.
        lines = (ev,) if b"\n" not in ev else ev.split(b"\n")
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                scan.done = True
                continue
            if not payload:
                continue
            try:
                doc = fastjson.loads(payload)
            except ValueError:
                continue
            if type(doc) is not dict:
                continue
            content, reason = _read_choices(doc)
            if content:
                scan.tokens += 1
            scan.finish_reason = reason or scan.finish_reason
            usage = doc.get("usage")
            if type(usage) is dict:
                scan.usage = usage
    return scan, rest


def usage_withheld(body: Mapping[str, Any]) -> bool:
    """Whether a streamed request asked for no usage chunk (no ``stream_options.include_usage``): the
    router then asks the engine for one anyway (:func:`with_usage_requested`), counts its tokens, and keeps
    it from the client (:func:`complete_events`), so the token series count every stream."""
    if not read_lax(LAX_BOOL, body.get("stream") or False):
        return False
    opts = body.get("stream_options")
    if opts is None:
        return True
    if not isinstance(opts, Mapping):
        return False  # not vLLM's StreamOptions: the engine refuses the request, leave it as it came
    include = read_lax(LAX_BOOL, opts.get("include_usage") or False)
    # None: a value vLLM refuses ("maybe"); the engine answers it with its 400, so the body goes as it came.
    return include is False


def with_usage_requested(body: Mapping[str, Any]) -> dict[str, Any]:
    """``body`` with ``stream_options.include_usage: true`` (vLLM's ``should_include_usage``,
    vllm/entrypoints/serve/utils/api_utils.py: one usage-only chunk before ``[DONE]``, no usage on the
    others: ``continuous_usage_stats`` is dropped); ``body`` itself is not changed."""
    given = body.get("stream_options")
    opts = dict(given) if isinstance(given, Mapping) else {}
    # Without include_usage the client's continuous_usage_stats did nothing; with it, every chunk would
    # carry usage the client did not ask for.
    opts.pop("continuous_usage_stats", None)
    return {**body, "stream_options": {**opts, "include_usage": True}}


def _usage_only(event: bytes) -> bool:
    for line in event.split(b"\n"):
        if line.startswith(b"data:") and b'"usage"' in line:
            try:
                doc = fastjson.loads(line[5:])
            except ValueError:
                return False
            return (
                isinstance(doc, Mapping)
                and doc.get("choices") == []
                and isinstance(doc.get("usage"), Mapping)
            )
    return False


def complete_events(buffer: bytes, drop_usage: bool) -> tuple[bytes, bytes]:
    """Split ``buffer`` into its complete server-sent events (to write now) and the unfinished tail (to
    prepend to the next chunk), as :func:`scan_sse` splits it; with ``drop_usage``, usage-only chunks
    (``choices: []``) are left out of what is written."""
    if not drop_usage and b"\r" not in buffer:
        # Nothing to leave out: cut after the last blank line, no split (the bytes are the same).
        cut = buffer.rfind(b"\n\n") + 2
        return (buffer[:cut], buffer[cut:]) if cut >= 2 else (b"", buffer)
    *events, rest = buffer.replace(b"\r\n", b"\n").split(b"\n\n")
    if drop_usage:
        events = [ev for ev in events if not _usage_only(ev)]
    return b"".join(ev + b"\n\n" for ev in events), rest


def _body_scan(data: bytes) -> StreamScan:
    """:class:`StreamScan` of a whole (unstreamed) completion body."""
    try:
        doc = fastjson.loads(data)
    except ValueError:
        return StreamScan()
    if type(doc) is not dict:
        return StreamScan()
    usage = doc.get("usage")
    content, reason = _read_choices(doc)
    return StreamScan(int(content), reason, usage if type(usage) is dict else None)


class StreamEnded(Exception):
    """A stream the router had started ended early: the client went away (``client_disconnected``) or the
    engine broke off (``upstream_error``, told to the client as a last SSE ``error`` event, as vLLM does).
    Nothing more can be sent: the status line went out with the first byte."""

    def __init__(self, outcome: str, response: web.StreamResponse) -> None:
        super().__init__(outcome)
        self.outcome, self.response = outcome, response


class RequestError(Exception):
    """A request the router answers itself with an error (status, message, type)."""

    def __init__(
        self, status: int, message: str, err_type: str, outcome: str, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.err_type, self.outcome = status, message, err_type, outcome
        self.param = param


def _upstream_error_text(text: str) -> tuple[str, str | None, str | None]:
    """The message, type and param of an engine's error body: vLLM's ``{"error": {"message", "type",
    "param", ..}}`` (``ErrorResponse``, vllm/entrypoints/serve/engine/protocol.py), its older flat
    ``{"object": "error", "message", "type"}``, or the raw text."""
    try:
        doc = json.loads(text)
    except ValueError:
        return text.strip()[:500] or "(empty body)", None, None
    if isinstance(doc, dict):
        error = doc.get("error")
        inner = error if isinstance(error, dict) else doc
        msg = inner.get("message")
        if isinstance(msg, str):
            typ, param = inner.get("type"), inner.get("param")
            return msg, typ if isinstance(typ, str) else None, param if isinstance(param, str) else None
    return text.strip()[:500], None, None


def prefill_failed(pod: str, status: int, text: str, max_tokens: int | None = None) -> RequestError:
    """The error the client gets when the prefill leg fails: the engine's 4xx (the request itself is
    wrong for the model, e.g. too long) keeps its status, type and message, with a note that the prefill leg
    asked for one output token (an engine's context-length message counts that one, not the client's
    ``max_tokens``); the pod is named in the router's log, not to the client. Anything else is a 502."""
    msg, typ, param = _upstream_error_text(text)
    if 400 <= status < 500:
        log.info("prefill pod %s refused a request (HTTP %d): %s", pod, status, msg[:200])
        asked = f"; this request's max_tokens is {max_tokens}" if max_tokens is not None else ""
        return RequestError(
            status,
            f"{msg} (from the prefill leg of this PD request, which asks for 1 output token{asked})",
            typ or "BadRequestError",
            "client_error",
            param,
        )
    return RequestError(
        502,
        f"prefill pod {pod} failed (HTTP {status}): {msg}; the decode pod was not called",
        "upstream_error",
        "upstream_error",
    )


def _with_id(resp: web.Response, rid: str | None) -> web.Response:
    """``resp`` with the request's ``X-Request-Id`` header, when the request has one yet."""
    if rid:
        resp.headers[REQUEST_ID_HEADER] = rid
    return resp


def _text_tokens(text: str, mode: str) -> int:
    if mode == "words":
        return max(1, len(text.split()))
    return max(1, round(len(text) / CHARS_PER_TOKEN))


def estimate_prompt_tokens(body: dict[str, Any], text_mode: str = "chars") -> int:
    """Prompt length in tokens: exact for token-id prompts; for text ``chars / 4`` (OpenAI's rule of thumb,
    ``text_mode="chars"``) or one token per word (``"words"``: gearshift-sim's count, no tokenizer)."""
    prompt = body.get("prompt")
    if prompt is None and isinstance(body.get("messages"), list):
        text = " ".join(str(m.get("content", "")) for m in body["messages"] if isinstance(m, dict))
        return _text_tokens(text, text_mode)
    if isinstance(prompt, list):
        if prompt and all(isinstance(t, int) for t in prompt):
            return len(prompt)
        if prompt and isinstance(prompt[0], list):
            return max(1, sum(len(p) for p in prompt))
        return _text_tokens(" ".join(str(p) for p in prompt), text_mode)
    return _text_tokens(str(prompt or ""), text_mode)


def validate_body(body: Any, path: str) -> dict[str, Any]:
    """Check the fields the router relies on.

    Raises:
        RequestError: 400 naming the field and the fix.
    """
    if not isinstance(body, dict):
        raise RequestError(400, "request body must be a JSON object", "BadRequestError", "client_error")
    if path.endswith("/chat/completions"):
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            raise RequestError(
                400,
                "'messages' must be a non-empty list of {role, content}",
                "BadRequestError",
                "client_error",
                "messages",
            )
    elif "prompt" not in body:
        raise RequestError(
            400,
            "'prompt' is required (a string or a list of token ids)",
            "BadRequestError",
            "client_error",
            "prompt",
        )
    mt = body.get("max_tokens", body.get("max_completion_tokens"))
    # Lax as vLLM's models read it: "3" is 3 and true is 1 (measured on vLLM 0.32's CompletionRequest).
    n = None if mt is None else read_lax(LAX_INT, mt)
    if mt is not None and (n is None or n < 1):
        raise RequestError(
            400,
            f"'max_tokens' must be a positive integer, got {mt!r}",
            "BadRequestError",
            "client_error",
            "max_tokens",
        )
    return body


@dataclass
class Relay:
    """One client request's stream, once it has begun: an error after that point cannot be a new
    response, only a last event on this one; and once the answer is delivered (``[DONE]`` written) a
    client closing its connection is a client done reading, not one that left."""

    response: web.StreamResponse | None = None
    delivered: bool = False
    held: Backend | None = None
    """The serving pod whose batch slot (:attr:`Backend.held`) this request holds until it ends."""


class Proxy:
    """Admission and forwarding over a :class:`Pool`; one per router process."""

    def __init__(
        self,
        pool: Pool,
        session: aiohttp.ClientSession,
        metrics: RouterMetrics,
        config: ProxyConfig,
        clock: Callable[[], float],
    ) -> None:
        self.pool, self.session, self.metrics, self.cfg, self.clock = pool, session, metrics, config, clock
        self.inflight = 0
        self.queued = 0
        self._slots = asyncio.Semaphore(config.max_inflight)
        self.scale_up_requests = 0
        self.last_scale_up_kv_bytes: float | None = None
        # Requests held for decode KV headroom, oldest first; an event is set when its holder may try.
        self._headroom_q: deque[asyncio.Event] = deque()
        # Requests waiting for a serving pod below its batch cap, per role; set when a slot frees.
        self.batch_waiting: dict[str, int] = {}
        self._batch_freed = asyncio.Event()
        self._new_id = RequestIds()
        # The legs' timeout, made once: a connect within connect_timeout_s, no overall bound (the handler's).
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=config.connect_timeout_s)
        self.mirror: Mirror | None = None
        """Copies of live requests for warming shadow pods (gearshift.router.mirror); None: none."""
        # Labelled children of the per-request series, by label value: ``labels()`` validates and locks on
        # every call (~2.7 us of the ~5.4 us an observation costs here, measured).
        self._children: dict[tuple[str, ...], Any] = {}

    # --- admission -------------------------------------------------------------------------------
    async def admit(self) -> float:
        """Wait for a slot; returns the queue time, s.

        Raises:
            RequestError: 429 when the queue is full, 503 after ``queue_timeout_s``.
        """
        if not self._slots.locked():
            # A free slot: acquire() returns without suspending, so no other request can overtake.
            await self._slots.acquire()
            self.metrics.queue_time.observe(0.0)
            return 0.0
        if self.queued >= self.cfg.max_queue:
            self.metrics.rejects.labels("queue_full").inc()
            raise RequestError(
                429,
                f"router queue is full ({self.cfg.max_queue} waiting, {self.cfg.max_inflight} in flight); "
                "retry later or add pods",
                "rate_limit_exceeded",
                "rejected",
            )
        t0 = self.clock()
        self.queued += 1
        self.metrics.queued.inc()
        try:
            await asyncio.wait_for(self._slots.acquire(), self.cfg.queue_timeout_s)
        except TimeoutError:
            self.metrics.rejects.labels("queue_timeout").inc()
            raise RequestError(
                503,
                f"request waited {self.cfg.queue_timeout_s:g} s queued; the service is overloaded",
                "service_unavailable",
                "rejected",
            ) from None
        finally:
            self.queued -= 1
            self.metrics.queued.dec()
        waited = self.clock() - t0
        self.metrics.queue_time.observe(waited)
        return waited

    def release(self) -> None:
        self._slots.release()

    # --- the operator's batch cap (adaptive max batch) ------------------------------------------------
    async def _batch_room(self, role: P.Role) -> None:
        """Wait until a ``role`` pod is below its batch cap (``BackendInfo.batch_cap``), at most
        ``queue_timeout_s``. A newcomer waits behind requests already waiting; woken waiters re-check in
        the order they began to wait, and the pick that follows takes the slot without yielding in between.

        Raises:
            RequestError: 503 when no slot freed in time.
        """
        if not self.batch_waiting.get(role) and self.pool.has_room(role, self.clock()):
            return
        deadline = self.clock() + self.cfg.queue_timeout_s
        self.batch_waiting[role] = self.batch_waiting.get(role, 0) + 1
        try:
            while not self.pool.has_room(role, self.clock()):
                remaining = deadline - self.clock()
                if remaining <= 0:
                    self.metrics.rejects.labels("batch_full").inc()
                    raise RequestError(
                        503,
                        f"every {role} pod held its max batch for {self.cfg.queue_timeout_s:g} s; "
                        "the service is overloaded",
                        "service_unavailable",
                        "rejected",
                    )
                self._batch_freed.clear()
                # A cap raised by membership frees room without a request ending: poll as well.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._batch_freed.wait(), min(remaining, 0.25))
        finally:
            self.batch_waiting[role] -= 1

    async def _place_serving(self, role: P.Role, req: P.RequestView, relay: Relay) -> Backend:
        """The serving pod of a request (decode under PD, else a ``both`` pod) below its batch cap; the
        request holds one of its slots until :meth:`_unhold`."""
        await self._batch_room(role)
        b = await self._place_decode(req, role)
        b.held += 1
        relay.held = b
        return b

    def _unhold(self, relay: Relay) -> None:
        if relay.held is not None:
            relay.held.held -= 1
            relay.held = None
            self._batch_freed.set()

    # --- decode placement with a hold for KV headroom ----------------------------------------------
    @property
    def headroom_held(self) -> int:
        """Requests held now for decode KV headroom."""
        return len(self._headroom_q)

    def _try_decode(self, req: P.RequestView, role: P.Role = "decode") -> Backend | None:
        """One pick of the pod that decodes (``decode``, or ``both`` aggregated); None when pd-score's
        headroom filter left no pod.

        Raises:
            RequestError: 503 when there is no healthy decode pod at all.
        """
        try:
            b = self.pool.pick(role, req, self.clock(), None, ())
        except (P.NoDecodeCapacityError, P.BatchFullError):
            # BatchFullError only while held for headroom (placement waits for batch room first).
            return None
        except P.NoPodError as exc:
            self.metrics.rejects.labels("no_decode_pod").inc()
            raise RequestError(503, str(exc), "service_unavailable", "no_pod") from exc
        self.metrics.picks.labels(self.pool.config.policy, role, b.info.name).inc()
        return b

    def _refuse_if_never_fits(self, req: P.RequestView) -> None:
        """Refuse at once (400, as the engine would) a request whose KV cache is larger than the whole KV
        pool of every decode pod: no wait and no scale-up makes room for it. Unknown capacities pass.

        Raises:
            RequestError: 400 naming ``max_tokens`` and the prompt's and the largest pod's sizes in tokens.
        """
        caps = [b.kv_capacity for b in self.pool.members("decode")]
        if not caps or any(c is None for c in caps) or req.kv_bytes_per_token <= 0:
            return
        largest = max(c for c in caps if c is not None)
        if req.kv_bytes <= largest:
            return
        fits = int(largest // req.kv_bytes_per_token)
        self.metrics.rejects.labels("too_long").inc()
        raise RequestError(
            400,
            f"This request needs the KV cache of {req.prompt_tokens + req.max_tokens} tokens "
            f"({req.prompt_tokens} in the prompt, max_tokens {req.max_tokens}), but the largest decode pod "
            f"holds {fits} tokens: shorten the prompt or lower max_tokens.",
            "BadRequestError",
            "client_error",
            "max_tokens",
        )

    def _refuse_no_headroom(self, req: P.RequestView, why: str) -> RequestError:
        self.metrics.rejects.labels("no_kv_capacity").inc()
        return RequestError(
            503,
            f"{P.NoDecodeCapacityError(req.kv_bytes)}{why}; scale-up requested",
            "service_unavailable",
            "no_pod",
        )

    async def _place_decode(self, req: P.RequestView, role: P.Role = "decode") -> Backend:
        """The decode pod of a PD request (or the ``both`` pod of an aggregated one, which holds the
        request's KV as a decode pod does), holding the request while no pod has KV headroom for it.

        FIFO: while requests are held, a new one joins the end instead of trying (it would overtake them),
        and only the head retries; when it leaves, the next one tries at once.

        Raises:
            RequestError: 503 when no decode pod exists, when the hold passes ``headroom_wait_s``, or when
                ``max_queue`` requests are held already.
        """
        self._refuse_if_never_fits(req)
        if not self._headroom_q:
            b = self._try_decode(req, role)
            if b is not None:
                return b
        # The first miss of this request: the autoscaler's immediate scale-up signal, once per request.
        self.scale_up_requests += 1
        self.last_scale_up_kv_bytes = req.kv_bytes
        self.metrics.no_decode_headroom.inc()
        wait_s = self.cfg.headroom_wait_s
        if wait_s <= 0:
            raise self._refuse_no_headroom(req, "")
        if len(self._headroom_q) >= self.cfg.max_queue:
            raise self._refuse_no_headroom(req, f" and {len(self._headroom_q)} requests wait for it already")
        turn = asyncio.Event()
        if not self._headroom_q:
            turn.set()
        self._headroom_q.append(turn)
        self.metrics.headroom_held.inc()
        deadline = self.clock() + wait_s
        try:
            while (remaining := deadline - self.clock()) > 0:
                if not turn.is_set():
                    try:
                        await asyncio.wait_for(turn.wait(), remaining)
                    except TimeoutError:
                        break
                    continue
                b = self._try_decode(req, role)
                if b is not None:
                    return b
                await asyncio.sleep(min(self.cfg.headroom_poll_s, remaining))
            raise self._refuse_no_headroom(req, f" within {wait_s:g} s")
        finally:
            was_head = self._headroom_q[0] is turn
            self._headroom_q.remove(turn)
            self.metrics.headroom_held.dec()
            if was_head and self._headroom_q:
                self._headroom_q[0].set()

    # --- upstream calls --------------------------------------------------------------------------
    def _pick(self, role: P.Role, req: P.RequestView, peer: Backend | None, tried: set[str]) -> Backend:
        try:
            b = self.pool.pick(role, req, self.clock(), peer, tried)
        except P.NoDecodeCapacityError as exc:
            self.scale_up_requests += 1
            self.last_scale_up_kv_bytes = exc.kv_bytes
            self.metrics.rejects.labels("no_kv_capacity").inc()
            self.metrics.no_decode_headroom.inc()
            raise RequestError(
                503, str(exc) + "; scale-up requested", "service_unavailable", "no_pod"
            ) from exc
        except P.NoPodError as exc:
            self.metrics.rejects.labels(f"no_{role}_pod").inc()
            raise RequestError(503, str(exc), "service_unavailable", "no_pod") from exc
        self.metrics.picks.labels(self.pool.config.policy, role, b.info.name).inc()
        return b

    def _count_error(self, role: P.Role, b: Backend) -> None:
        """One 5xx answer or failed connect of ``b``: outlier detection may eject it."""
        if self.pool.record_error(b, self.clock()):
            self.metrics.ejections.labels(role, b.info.name).inc()
            log.warning(
                "%s pod %s ejected for %.0f s after %d consecutive errors",
                role,
                b.info.name,
                b.ejected_until - self.clock(),
                self.pool.outlier.consecutive_errors,
            )

    async def _open(
        self,
        role: P.Role,
        req: P.RequestView,
        peer: Backend | None,
        path: str,
        body: dict[str, Any],
        client_timeout: aiohttp.ClientTimeout,
        headers: Mapping[str, str],
        first: Backend | None = None,
        raw: bytes | None = None,
        retry_5xx: bool = False,
    ) -> tuple[Backend, aiohttp.ClientResponse]:
        """POST to ``first`` (or a freshly picked pod); on a failed connect — and, with ``retry_5xx`` (the
        prefill leg), on a 5xx answer — retry on a pod not tried yet, with the same body and headers (the
        same ``X-Request-Id``), at most ``retries`` times.

        Returns the pod and the open response (a 5xx one when no other pod is left to try). The pod's
        in-flight count is raised here; the caller lowers it.

        Raises:
            RequestError: 503 when no pod of ``role`` is routable; 502 when no connect succeeded.
        """
        tried: set[str] = set()
        payload = raw if raw is not None else json.dumps(body).encode()
        for attempt in range(self.cfg.retries + 1):
            if attempt == 0 and first is not None:
                b = first
            else:
                try:
                    b = self._pick(role, req, peer, tried)
                except RequestError:
                    if not tried:
                        raise
                    raise RequestError(
                        502,
                        f"could not connect to any {role} pod (tried {', '.join(sorted(tried))})",
                        "upstream_error",
                        "upstream_error",
                    ) from None
            b.inflight += 1
            try:
                resp = await self.session.post(
                    b.info.url + path,
                    data=payload,
                    headers=headers,
                    timeout=client_timeout,
                )
            except CONNECT_ERRORS as exc:
                b.inflight -= 1
                tried.add(b.info.name)
                self._count_error(role, b)
                log.warning(
                    "connect to %s pod %s failed (%s), attempt %d", role, b.info.name, exc, attempt + 1
                )
                if attempt == self.cfg.retries:
                    raise RequestError(
                        502,
                        f"could not connect to a {role} pod after {attempt + 1} tries: {exc}",
                        "upstream_error",
                        "upstream_error",
                    ) from exc
                self.metrics.retries.labels(role, b.info.name).inc()
                continue
            except BaseException:
                b.inflight -= 1
                raise
            if resp.status < 500:
                record_success(b)
                return b, resp
            self._count_error(role, b)
            if (
                not retry_5xx
                or attempt == self.cfg.retries
                or not self.pool.candidates(role, self.clock(), tried | {b.info.name})
            ):
                return b, resp
            try:
                text = await resp.text()
            except (aiohttp.ClientError, ConnectionResetError) as exc:
                text = f"(body lost: {exc})"
            finally:
                resp.release()
                b.inflight -= 1
            tried.add(b.info.name)
            log.warning(
                "%s pod %s answered HTTP %d (%s), attempt %d: retrying on another pod",
                role,
                b.info.name,
                resp.status,
                text[:200],
                attempt + 1,
            )
            self.metrics.retries.labels(role, b.info.name).inc()
        raise AssertionError("unreachable")

    def _child(self, series: str, *values: str) -> Any:
        """``self.metrics.<series>`` (or ``self.metrics.client.<series>`` for ``client.*``) labelled with
        ``values``, cached. A model name comes from the client: past 256 cached children, no more are kept."""
        key = (series, *values)
        child = self._children.get(key)
        if child is None:
            name = series.removeprefix("client.")
            owner: Any = self.metrics.client if series.startswith("client.") else self.metrics
            child = getattr(owner, name).labels(*values)
            if len(self._children) < 256:
                self._children[key] = child
        return child

    # --- the handler -----------------------------------------------------------------------------
    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Serve one OpenAI completion request (see the module docstring)."""
        policy = self.pool.config.policy
        labels = {"prefill": "-", "decode": "-"}
        t_in = self.clock()
        rid: str | None = request.headers.get(REQUEST_ID_HEADER)
        try:
            try:
                body = validate_body(await request.json(loads=fastjson.loads), request.path)
            except json.JSONDecodeError as exc:
                raise RequestError(
                    400, f"request body is not JSON: {exc}", "BadRequestError", "client_error"
                ) from None
            rid = request_id_for(request.headers, body, self._new_id)
            for role in self.cfg.roles:
                self._child("arrivals", self.cfg.service, role).inc()
            await self.admit()
        except RequestError as err:
            self.metrics.requests.labels(policy, "-", "-", err.outcome).inc()
            return _with_id(error_response(err.status, err.message, err.err_type, err.param), rid)
        self.inflight += 1
        self.metrics.inflight.inc()
        mirror = self.mirror
        if mirror is not None and mirror.active:  # a warming shadow: a copy, fire and forget
            mirror.offer(request.path, body, rid, request.headers.get("Authorization"))
        outcome = "ok"
        relay = Relay()
        try:
            # asyncio.timeout, unlike wait_for, runs the request in this task (no task per request).
            async with asyncio.timeout(self.cfg.request_timeout_s):
                answer = await self._forward(request, body, rid, labels, t_in, relay)
            # The engine's own refusal (a 400 for min_tokens > max_tokens) is the client's, not a success.
            if answer.status >= 500:
                outcome = "upstream_error"
            elif answer.status >= 400:
                outcome = "client_error"
            return answer
        except RequestError as err:
            outcome = err.outcome
            return _with_id(error_response(err.status, err.message, err.err_type, err.param), rid)
        except StreamEnded as ended:
            outcome = ended.outcome
            return ended.response
        except asyncio.CancelledError:
            # aiohttp cancels a handler whose client closed the connection (handler_cancellation), as it
            # does every handler at shutdown: only the first is the client's doing.
            gone = request.transport is None or request.transport.is_closing()
            outcome = "ok" if relay.delivered else "client_disconnected" if gone else "cancelled"
            raise
        except (aiohttp.ClientError, ConnectionResetError) as exc:
            # before TimeoutError: aiohttp's socket timeouts are both, and are the upstream's, not ours
            outcome = "upstream_error"
            why = str(exc) or type(exc).__name__
            return _with_id(error_response(502, f"upstream failed: {why}", "upstream_error"), rid)
        except TimeoutError:
            outcome = "timeout"
            if (started := relay.response) is not None:
                await self._end_stream(started, f"no complete answer within {self.cfg.request_timeout_s:g} s")
                return started
            return _with_id(
                error_response(504, f"no complete answer within {self.cfg.request_timeout_s:g} s", "timeout"),
                rid,
            )
        finally:
            self._unhold(relay)
            self.inflight -= 1
            self.metrics.inflight.dec()
            self.release()
            self.metrics.requests.labels(policy, labels["prefill"], labels["decode"], outcome).inc()
            self._child("e2e", policy).observe(self.clock() - t_in)

    async def _forward(
        self,
        request: web.Request,
        body: dict[str, Any],
        rid: str,
        labels: dict[str, str],
        t_in: float,
        relay: Relay,
    ) -> web.StreamResponse:
        policy = self.pool.config.policy
        max_tokens = (
            body.get("max_tokens") or body.get("max_completion_tokens") or self.cfg.default_max_tokens
        )
        prompt_tokens = estimate_prompt_tokens(body, self.cfg.text_tokens)
        req = P.RequestView(
            prompt_tokens=prompt_tokens,
            max_tokens=int(max_tokens),
            kv_bytes_per_token=self.cfg.kv_bytes_per_token,
            model=body.get("model"),
            prefill_ms_ref=prompt_tokens * self.cfg.prefill_ms_per_token
            if self.cfg.prefill_ms_per_token > 0
            else None,
        )
        timeout = self._timeout
        # A --service router knows its service's shape (--roles): a PD service whose prefill pods are all
        # gone (a rollout) is still PD, and says "no prefill pod", not "no serving (role both) pod".
        if self.cfg.service:
            pd = "prefill" in self.cfg.roles
        else:
            pd = self.pool.has_role("prefill") and self.pool.has_role("decode")
        # One X-Request-Id for both legs (and for a retry of either): see REQUEST_ID_HEADER.
        headers = leg_headers(rid, request.headers.get("Authorization"))
        withhold = usage_withheld(body)
        # What the client asked, as an engine gets it; the decode leg adds the prefill's KV parameters.
        client_body = upstream_body = with_usage_requested(body) if withhold else body
        decode_peer: Backend | None = None
        decode_choice: Backend | None = None
        serving = await self._place_serving("decode" if pd else "both", req, relay)
        if pd:
            decode_choice = serving
            handoff_s = self.cfg.kv_lease_s * KV_HANDOFF_SHARE
            # Asked while the prefill leg runs, so a live decode pod costs the request nothing.
            alive = asyncio.create_task(self._alive(serving, handoff_s)) if handoff_s > 0 else None
            try:
                pb, pjson = await self._prefill_leg(
                    req, decode_choice, request, body, timeout, headers, labels
                )
                if alive is None or await self._handed_off(alive, serving, handoff_s):
                    upstream_body = decode_leg_body(upstream_body, pjson)
                else:
                    # The decode pod did not answer within half the lease: it must not get KV the prefill
                    # may free before it reads it; the client's request, prefilled there, is served instead.
                    log.warning(
                        "decode pod %s did not answer within %g s of prefill pod %s's answer (half the "
                        "%g s KV lease): request %s is prefilled on the decode pod",
                        serving.info.name,
                        handoff_s,
                        pb.info.name,
                        self.cfg.kv_lease_s,
                        rid,
                    )
                    self.metrics.kv_reprefills.labels(serving.info.name).inc()
                    pjson = {}
            finally:
                if alive is not None:
                    alive.cancel()
            if pjson and upstream_body.get("kv_transfer_params") is body.get("kv_transfer_params"):
                log.warning(
                    "prefill pod %s returned no kv_transfer_params (no KV connector?); "
                    "decode pod %s prefills request %s itself",
                    pb.info.name,
                    decode_choice.info.name,
                    rid,
                )
            decode_peer = pb
        open_decode = self._open(
            "decode" if pd else "both",
            req,
            decode_peer,
            request.path,
            upstream_body,
            timeout,
            headers,
            first=serving,
            # Plain mode forwards the client's bytes unchanged unless the usage chunk is asked for.
            raw=None if pd or withhold else await request.read(),
        )
        bound = kv_wait_bound_s(self.cfg.kv_lease_s, req.max_tokens)
        handed_kv = pd and upstream_body.get("kv_transfer_params") is not body.get("kv_transfer_params")
        if handed_kv and bound is not None and not body.get("stream"):
            # A non-streamed answer's headers come with its last token: no headers within the bound means
            # the leg is stuck on KV (see kv_wait_bound_s). Cancelling closes the connection, which vLLM
            # takes as an abort and frees the decode's blocks.
            try:
                db, dresp = await asyncio.wait_for(open_decode, bound)
            except TimeoutError:
                assert decode_choice is not None and decode_peer is not None
                log.warning(
                    "decode pod %s gave no answer within %g s (the %g s KV lease + %g s a token for %d "
                    "tokens) of the KV from prefill pod %s: request %s is prefilled on a decode pod",
                    decode_choice.info.name,
                    bound,
                    self.cfg.kv_lease_s,
                    DECODE_SLACK_S_PER_TOKEN,
                    req.max_tokens,
                    decode_peer.info.name,
                    rid,
                )
                self.metrics.kv_reprefills.labels(decode_choice.info.name).inc()
                db, dresp = await self._open(
                    "decode",
                    req,
                    None,
                    request.path,
                    client_body,
                    timeout,
                    headers,
                    first=serving,
                )
        else:
            db, dresp = await open_decode
        labels["decode"] = db.info.name
        if not pd:
            labels["prefill"] = db.info.name
        try:
            model = body.get("model")
            return await self._relay(
                request, dresp, t_in, policy, rid, relay, model if isinstance(model, str) else "", withhold
            )
        finally:
            dresp.release()
            db.inflight -= 1

    async def _prefill_leg(
        self,
        req: P.RequestView,
        decode_choice: Backend,
        request: web.Request,
        body: dict[str, Any],
        client_timeout: aiohttp.ClientTimeout,
        headers: Mapping[str, str],
        labels: dict[str, str],
    ) -> tuple[Backend, dict[str, Any]]:
        """The prefill leg of a PD request (vLLM's toy proxy: ``max_tokens`` 1, ``do_remote_decode``):
        the prefill pod and its JSON answer (holding the ``kv_transfer_params`` of the decode leg);
        ``labels["prefill"]`` names the pod as soon as one answers.

        Raises:
            RequestError: 502 when the answer broke off or is not JSON; the prefill pod's own status
                (``prefill_failed``) when it is not 200.
        """
        prefill_body = prefill_leg_body(body, is_chat(request.path))
        pb, presp = await self._open(
            "prefill", req, decode_choice, request.path, prefill_body, client_timeout, headers, retry_5xx=True
        )
        labels["prefill"] = pb.info.name
        try:
            text = await presp.text()
        except (aiohttp.ClientError, ConnectionResetError) as exc:
            raise RequestError(
                502,
                f"prefill pod {pb.info.name} broke off its answer: {exc}; the decode pod was not called",
                "upstream_error",
                "upstream_error",
            ) from exc
        finally:
            presp.release()
            pb.inflight -= 1
        if presp.status != 200:
            raise prefill_failed(pb.info.name, presp.status, text, req.max_tokens)
        try:
            pjson = fastjson.loads(text)
        except ValueError:
            raise RequestError(
                502,
                f"prefill pod {pb.info.name} answered HTTP 200 with a body that is not JSON; "
                "the decode pod was not called",
                "upstream_error",
                "upstream_error",
            ) from None
        if not isinstance(pjson, dict):
            raise RequestError(
                502,
                f"prefill pod {pb.info.name} answered HTTP 200 with JSON that is not an object; "
                "the decode pod was not called",
                "upstream_error",
                "upstream_error",
            )
        return pb, pjson

    async def _alive(self, b: Backend, timeout_s: float) -> float | None:
        """When ``b``'s ``/health`` answered 200 (this router's clock); None: no 200 within ``timeout_s``."""
        try:
            async with self.session.get(
                b.info.url + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                return self.clock() if resp.status == 200 else None
        except (aiohttp.ClientError, ConnectionResetError, TimeoutError):
            return None

    async def _handed_off(self, alive: asyncio.Task[float | None], b: Backend, bound_s: float) -> bool:
        """True when decode pod ``b`` answered ``/health`` within ``bound_s`` of the prefill leg's end (now):
        ``alive`` is the check started with the prefill leg; an answer older than :data:`HANDOFF_FRESH_S`
        is asked again within what is left of the bound."""
        t_kv = self.clock()
        try:
            answered = await asyncio.wait_for(asyncio.shield(alive), bound_s)
        except TimeoutError:
            return False
        if answered is None:
            return False
        if t_kv - answered <= HANDOFF_FRESH_S:
            return True
        left = bound_s - (self.clock() - t_kv)
        return left > 0 and await self._alive(b, left) is not None

    async def _relay(
        self,
        request: web.Request,
        resp: aiohttp.ClientResponse,
        t_in: float,
        policy: str,
        rid: str,
        relay: Relay,
        model: str = "",
        withhold_usage: bool = False,
    ) -> web.StreamResponse:
        """Copy the upstream response to the client, streaming SSE as it arrives; observe TTFT and ITL
        (the router's own series, and the client-facing ones under vLLM's names: :func:`_record_client`).
        With ``withhold_usage`` (:func:`usage_withheld`) whole events are written, the usage-only one left
        out; otherwise the engine's bytes are copied as they come."""
        ctype = resp.headers.get("Content-Type", "application/json")
        if not ctype.startswith("text/event-stream"):
            data = await resp.read()
            t = self.clock()
            if resp.status == 200:
                # Non-streamed: the first token reaches the client with the last, so neither TTFT nor ITL
                # is observable here (its E2E is; counting it as a TTFT inflated the TTFT series).
                self._record_client(model, t - t_in, None, _body_scan(data))
            return web.Response(
                status=resp.status, body=data, headers={"Content-Type": ctype, REQUEST_ID_HEADER: rid}
            )
        out = web.StreamResponse(
            status=resp.status,
            headers={"Content-Type": ctype, "Cache-Control": "no-cache", REQUEST_ID_HEADER: rid},
        )
        await out.prepare(request)
        relay.response = out
        first: float | None = None
        last: float | None = None
        ttft_h, itl_h = self._child("ttft", policy), self._child("itl", policy)
        c_itl = self._child("client.itl", model)
        seen = StreamScan()
        tail = pending = b""
        chunks = resp.content.iter_any()
        while True:
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                if pending:  # an engine's last event without its blank line goes out as it came
                    with contextlib.suppress(ConnectionResetError):
                        await out.write(pending)
                break
            except (aiohttp.ClientError, ConnectionResetError) as exc:
                await self._end_stream(out, f"the engine broke off the stream: {exc}")
                raise StreamEnded("upstream_error", out) from exc
            now = self.clock()
            # TTFT and ITL count token events only: the clock of a chat stream starts at its first content.
            scan, tail = scan_sse(tail + chunk)
            events = scan.tokens
            seen = StreamScan(
                seen.tokens + events,
                scan.finish_reason or seen.finish_reason,
                scan.usage or seen.usage,
                seen.done or scan.done,
            )
            if events:
                if last is None:
                    first = now
                    ttft_h.observe(now - t_in)
                    events -= 1
                else:
                    gap = (now - last) / events
                    observe_many(itl_h, gap, events)
                    observe_many(c_itl, gap, events)
                last = now
            if withhold_usage:
                chunk, pending = complete_events(pending + chunk, drop_usage=scan.usage is not None)
            try:
                if chunk:
                    await out.write(chunk)
            except ConnectionResetError as exc:
                if relay.delivered:
                    return out
                raise StreamEnded("client_disconnected", out) from exc
            if seen.done and not relay.delivered:
                # Recorded at [DONE], not at the upstream's end: a client may close as soon as it reads it.
                relay.delivered = True
                if resp.status == 200:
                    ttft_s = None if first is None else first - t_in
                    self._record_client(model, self.clock() - t_in, ttft_s, seen)
        try:
            await out.write_eof()
        except ConnectionResetError as exc:
            if relay.delivered:
                return out
            raise StreamEnded("client_disconnected", out) from exc
        if resp.status == 200 and not relay.delivered:
            self._record_client(model, self.clock() - t_in, None if first is None else first - t_in, seen)
        relay.delivered = True
        return out

    def _record_client(self, model: str, e2e_s: float, ttft_s: float | None, scan: StreamScan) -> None:
        """One finished client request in the vLLM-named series (:class:`~.metrics.ClientMetrics`): E2E,
        TTFT (streams only: a whole answer's first token is not seen), success by finish reason, and the
        token counts and time per output token from the answer's ``usage`` (an engine's whole answer has
        it; a stream has it since the router asks for it, :func:`usage_withheld`); a stream also counts in
        ``gearshift_router_slo_requests_total`` against the PDService's SLO (``--target-ttft-ms``,
        ``--target-itl-ms``)."""
        child = self._child
        child("client.e2e", model).observe(e2e_s)
        if ttft_s is not None:
            child("client.ttft", model).observe(ttft_s)
        self.metrics.client.success.labels(model, scan.finish_reason or "unknown").inc()
        usage = scan.usage or {}
        prompt, generated = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(prompt, int):
            child("client.prompt_tokens", model).inc(prompt)
            child("client.request_prompt_tokens", model).observe(prompt)
        if isinstance(generated, int):
            child("client.generation_tokens", model).inc(generated)
            child("client.request_generation_tokens", model).observe(generated)
            if ttft_s is not None and generated > 1:
                child("client.tpot", model).observe((e2e_s - ttft_s) / (generated - 1))
        if ttft_s is not None:
            # Goodput as the load generator counts it: output tokens from usage, else the token events.
            tokens = generated if isinstance(generated, int) else scan.tokens
            tpot = (e2e_s - ttft_s) / (tokens - 1) if tokens > 1 else None
            slo = self.pool.config
            met = slo_met(ttft_s, tpot, slo.target_ttft_ms, slo.target_itl_ms)
            self.metrics.slo_requests.labels(model, SLO_MET if met else SLO_MISSED).inc()

    @staticmethod
    async def _end_stream(out: web.StreamResponse, message: str) -> None:
        """Tell a client whose stream broke why, as vLLM's server does: a last ``data: {"error": ...}``."""
        event = b"data: " + json.dumps(error_body(502, message, "upstream_error")).encode() + b"\n\n"
        with contextlib.suppress(ConnectionResetError):
            await out.write(event)
            await out.write_eof()
