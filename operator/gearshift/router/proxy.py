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
   each held request once, at its first miss. Then send the prefill pod the request with
   ``max_tokens: 1``, ``stream: false`` and
   ``kv_transfer_params: {do_remote_decode: true, do_remote_prefill: false}``; send the decode pod the
   client's request plus the ``kv_transfer_params`` the prefill pod returned, streaming it back as it comes
   (vLLM's NixlConnector proxy protocol). With only ``both`` pods: forward the request as is;
3. a failed *connect* (nothing sent, nothing received) is retried on another pod of the same role, and
   counts towards ejecting the pod; anything after the first byte of a response is not retried;
4. every request has a deadline (``request_timeout_s``): 504 when it passes before the response started.

Errors are OpenAI-shaped JSON: ``{"error": {"message", "type", "code"}}``.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from gearshift.router import policies as P
from gearshift.router.metrics import RouterMetrics
from gearshift.router.pool import Backend, Pool
from gearshift.router.signals import record_failure, record_success

log = logging.getLogger(__name__)

#: Retried on another pod: the connection never carried the request.
CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError)
#: Characters per token when the prompt is text (OpenAI's rule of thumb: ~4 characters per English token).
CHARS_PER_TOKEN = 4.0


@dataclass
class ProxyConfig:
    """Limits and knobs of the request path."""

    max_inflight: int = 512
    max_queue: int = 1024
    queue_timeout_s: float = 10.0
    request_timeout_s: float = 300.0
    connect_timeout_s: float = 2.0
    retries: int = 2
    eject_after: int = 1
    eject_s: float = 5.0
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


def error_response(status: int, message: str, err_type: str, code: str | None = None) -> web.Response:
    """OpenAI-style JSON error."""
    return web.json_response(
        {"error": {"message": message, "type": err_type, "code": code or status}}, status=status
    )


class RequestError(Exception):
    """A request the router answers itself with an error (status, message, type)."""

    def __init__(self, status: int, message: str, err_type: str, outcome: str) -> None:
        super().__init__(message)
        self.status, self.message, self.err_type, self.outcome = status, message, err_type, outcome


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
        raise RequestError(400, "request body must be a JSON object", "invalid_request_error", "client_error")
    if path.endswith("/chat/completions"):
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            raise RequestError(
                400,
                "'messages' must be a non-empty list of {role, content}",
                "invalid_request_error",
                "client_error",
            )
    elif "prompt" not in body:
        raise RequestError(
            400,
            "'prompt' is required (a string or a list of token ids)",
            "invalid_request_error",
            "client_error",
        )
    mt = body.get("max_tokens", body.get("max_completion_tokens"))
    if mt is not None and (not isinstance(mt, int) or isinstance(mt, bool) or mt < 1):
        raise RequestError(
            400,
            f"'max_tokens' must be a positive integer, got {mt!r}",
            "invalid_request_error",
            "client_error",
        )
    return body


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

    # --- decode placement with a hold for KV headroom ----------------------------------------------
    @property
    def headroom_held(self) -> int:
        """Requests held now for decode KV headroom."""
        return len(self._headroom_q)

    def _try_decode(self, req: P.RequestView) -> Backend | None:
        """One decode pick; None when pd-score's headroom filter left no pod.

        Raises:
            RequestError: 503 when there is no healthy decode pod at all.
        """
        try:
            b = self.pool.pick("decode", req, self.clock(), None, ())
        except P.NoDecodeCapacityError:
            return None
        except P.NoPodError as exc:
            self.metrics.rejects.labels("no_decode_pod").inc()
            raise RequestError(503, str(exc), "service_unavailable", "no_pod") from exc
        self.metrics.picks.labels(self.pool.config.policy, "decode", b.info.name).inc()
        return b

    def _refuse_no_headroom(self, req: P.RequestView, why: str) -> RequestError:
        self.metrics.rejects.labels("no_kv_capacity").inc()
        return RequestError(
            503,
            f"{P.NoDecodeCapacityError(req.kv_bytes)}{why}; scale-up requested",
            "service_unavailable",
            "no_pod",
        )

    async def _place_decode(self, req: P.RequestView) -> Backend:
        """The decode pod of a PD request, holding the request while no pod has KV headroom for it.

        FIFO: while requests are held, a new one joins the end instead of trying (it would overtake them),
        and only the head retries; when it leaves, the next one tries at once.

        Raises:
            RequestError: 503 when no decode pod exists, when the hold passes ``headroom_wait_s``, or when
                ``max_queue`` requests are held already.
        """
        if not self._headroom_q:
            b = self._try_decode(req)
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
                b = self._try_decode(req)
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

    async def _open(
        self,
        role: P.Role,
        req: P.RequestView,
        peer: Backend | None,
        path: str,
        body: dict[str, Any],
        client_timeout: aiohttp.ClientTimeout,
        first: Backend | None = None,
        raw: bytes | None = None,
    ) -> tuple[Backend, aiohttp.ClientResponse]:
        """POST to ``first`` (or a freshly picked pod); on a failed connect retry on another pod.

        Returns the pod and the open response. The pod's in-flight count is raised here; the caller lowers it.
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
                    headers={"Content-Type": "application/json"},
                    timeout=client_timeout,
                )
            except CONNECT_ERRORS as exc:
                b.inflight -= 1
                tried.add(b.info.name)
                record_failure(b, self.clock(), self.cfg.eject_after, self.cfg.eject_s)
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
            record_success(b)
            return b, resp
        raise AssertionError("unreachable")

    # --- the handler -----------------------------------------------------------------------------
    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Serve one OpenAI completion request (see the module docstring)."""
        policy = self.pool.config.policy
        labels = {"prefill": "-", "decode": "-"}
        t_in = self.clock()
        try:
            try:
                body = validate_body(await request.json(), request.path)
            except json.JSONDecodeError as exc:
                raise RequestError(
                    400, f"request body is not JSON: {exc}", "invalid_request_error", "client_error"
                ) from None
            await self.admit()
        except RequestError as err:
            self.metrics.requests.labels(policy, "-", "-", err.outcome).inc()
            return error_response(err.status, err.message, err.err_type)
        self.inflight += 1
        self.metrics.inflight.inc()
        outcome = "ok"
        try:
            # asyncio.timeout, unlike wait_for, runs the request in this task (no task per request).
            async with asyncio.timeout(self.cfg.request_timeout_s):
                return await self._forward(request, body, labels, t_in)
        except RequestError as err:
            outcome = err.outcome
            return error_response(err.status, err.message, err.err_type)
        except TimeoutError:
            outcome = "timeout"
            return error_response(
                504, f"no complete answer within {self.cfg.request_timeout_s:g} s", "timeout"
            )
        except (aiohttp.ClientError, ConnectionResetError) as exc:
            outcome = "upstream_error"
            return error_response(502, f"upstream failed: {exc}", "upstream_error")
        finally:
            self.inflight -= 1
            self.metrics.inflight.dec()
            self.release()
            self.metrics.requests.labels(policy, labels["prefill"], labels["decode"], outcome).inc()
            self.metrics.e2e.labels(policy).observe(self.clock() - t_in)

    async def _forward(
        self, request: web.Request, body: dict[str, Any], labels: dict[str, str], t_in: float
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
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_timeout_s)
        pd = self.pool.has_role("prefill") and self.pool.has_role("decode")
        upstream_body = body
        decode_peer: Backend | None = None
        decode_choice: Backend | None = None
        if pd:
            decode_choice = await self._place_decode(req)
            prefill_body = copy.deepcopy(body)
            prefill_body.update(
                max_tokens=1,
                stream=False,
                kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False},
            )
            prefill_body.pop("max_completion_tokens", None)
            prefill_body.pop("stream_options", None)
            pb, presp = await self._open("prefill", req, decode_choice, request.path, prefill_body, timeout)
            labels["prefill"] = pb.info.name
            try:
                if presp.status != 200:
                    text = await presp.text()
                    return web.Response(status=presp.status, body=text, content_type=presp.content_type)
                pjson = await presp.json()
            finally:
                presp.release()
                pb.inflight -= 1
            upstream_body = dict(body)
            upstream_body["kv_transfer_params"] = pjson.get("kv_transfer_params") or {}
            decode_peer = pb
        db, dresp = await self._open(
            "decode" if pd else "both",
            req,
            decode_peer,
            request.path,
            upstream_body,
            timeout,
            first=decode_choice if pd else None,
            # Plain mode forwards the client's bytes unchanged: no re-encoding on the hot path.
            raw=None if pd else await request.read(),
        )
        labels["decode"] = db.info.name
        if not pd:
            labels["prefill"] = db.info.name
        try:
            return await self._relay(request, dresp, t_in, policy)
        finally:
            dresp.release()
            db.inflight -= 1

    async def _relay(
        self, request: web.Request, resp: aiohttp.ClientResponse, t_in: float, policy: str
    ) -> web.StreamResponse:
        """Copy the upstream response to the client, streaming SSE as it arrives; observe TTFT and ITL."""
        ctype = resp.headers.get("Content-Type", "application/json")
        if not ctype.startswith("text/event-stream"):
            data = await resp.read()
            t = self.clock()
            if resp.status == 200:
                # Non-streamed: the first token reaches the client with the last; ITL is not observable here.
                self.metrics.ttft.labels(policy).observe(t - t_in)
            return web.Response(status=resp.status, body=data, headers={"Content-Type": ctype})
        out = web.StreamResponse(
            status=resp.status, headers={"Content-Type": ctype, "Cache-Control": "no-cache"}
        )
        await out.prepare(request)
        last: float | None = None
        ttft_h, itl_h = self.metrics.ttft.labels(policy), self.metrics.itl.labels(policy)
        async for chunk in resp.content.iter_any():
            now = self.clock()
            events = chunk.count(b"data:")
            if events:
                if last is None:
                    ttft_h.observe(now - t_in)
                    events -= 1
                else:
                    gap = (now - last) / events
                    for _ in range(events):
                        itl_h.observe(gap)
                last = now
            await out.write(chunk)
        await out.write_eof()
        return out
