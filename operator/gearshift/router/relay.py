"""One client's answer, copied from the engine's: streamed server-sent events as they come (or a whole
body), the router's TTFT and ITL series and the client-facing ones under vLLM's names, and a last SSE
``error`` event when a started stream breaks. :mod:`gearshift.router.proxy` opens the upstream response.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from gearshift.router.errors import StreamEnded, error_body
from gearshift.router.legs import REQUEST_ID_HEADER
from gearshift.router.metrics import SLO_MET, SLO_MISSED, RouterMetrics, observe_many, slo_met
from gearshift.router.pool import Backend, Pool
from gearshift.router.sse import StreamScan, body_scan, complete_events, scan_sse


@dataclass
class Relay:
    """One client request's stream, once it has begun: an error after that point cannot be a new
    response, only a last event on this one; and once the answer is delivered (``[DONE]`` written) a
    client closing its connection is a client done reading, not one that left."""

    response: web.StreamResponse | None = None
    delivered: bool = False
    held: Backend | None = None
    """The serving pod whose batch slot (:attr:`Backend.held`) this request holds until it ends."""


class SeriesChildren:
    """Labelled children of the per-request series, by label value: ``labels()`` validates and locks on
    every call (~2.7 us of the ~5.4 us an observation costs here, measured)."""

    def __init__(self, metrics: RouterMetrics) -> None:
        self.metrics = metrics
        self._children: dict[tuple[str, ...], Any] = {}

    def __call__(self, series: str, *values: str) -> Any:
        """``metrics.<series>`` (or ``metrics.client.<series>`` for ``client.*``) labelled with ``values``,
        cached. A model name comes from the client: past 256 cached children, no more are kept."""
        key = (series, *values)
        child = self._children.get(key)
        if child is None:
            name = series.removeprefix("client.")
            owner: Any = self.metrics.client if series.startswith("client.") else self.metrics
            child = getattr(owner, name).labels(*values)
            if len(self._children) < 256:
                self._children[key] = child
        return child


class Relayer:
    """Copies engines' answers to clients and records what each client saw; one per router process."""

    def __init__(
        self,
        pool: Pool,
        metrics: RouterMetrics,
        child: SeriesChildren,
        clock: Callable[[], float],
    ) -> None:
        self.pool, self.metrics, self.child, self.clock = pool, metrics, child, clock

    async def relay(
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
        (the router's own series, and the client-facing ones under vLLM's names: :meth:`record_client`).
        With ``withhold_usage`` (:func:`~gearshift.router.sse.usage_withheld`) whole events are written, the
        usage-only one left out; otherwise the engine's bytes are copied as they come."""
        ctype = resp.headers.get("Content-Type", "application/json")
        if not ctype.startswith("text/event-stream"):
            data = await resp.read()
            t = self.clock()
            if resp.status == 200:
                # Non-streamed: the first token reaches the client with the last, so neither TTFT nor ITL
                # is observable here (its E2E is; counting it as a TTFT inflated the TTFT series).
                self.record_client(model, t - t_in, None, body_scan(data))
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
        ttft_h, itl_h = self.child("ttft", policy), self.child("itl", policy)
        c_itl = self.child("client.itl", model)
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
                await end_stream(out, f"the engine broke off the stream: {exc}")
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
                    self.record_client(model, self.clock() - t_in, ttft_s, seen)
        try:
            await out.write_eof()
        except ConnectionResetError as exc:
            if relay.delivered:
                return out
            raise StreamEnded("client_disconnected", out) from exc
        if resp.status == 200 and not relay.delivered:
            self.record_client(model, self.clock() - t_in, None if first is None else first - t_in, seen)
        relay.delivered = True
        return out

    def record_client(self, model: str, e2e_s: float, ttft_s: float | None, scan: StreamScan) -> None:
        """One finished client request in the vLLM-named series (:class:`~.metrics.ClientMetrics`): E2E,
        TTFT (streams only: a whole answer's first token is not seen), success by finish reason, and the
        token counts and time per output token from the answer's ``usage`` (an engine's whole answer has
        it; a stream has it since the router asks for it, :func:`~gearshift.router.sse.usage_withheld`); a
        stream also counts in ``gearshift_router_slo_requests_total`` against the PDService's SLO
        (``--target-ttft-ms``, ``--target-itl-ms``)."""
        child = self.child
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


async def end_stream(out: web.StreamResponse, message: str) -> None:
    """Tell a client whose stream broke why, as vLLM's server does: a last ``data: {"error": ...}``."""
    event = b"data: " + json.dumps(error_body(502, message, "upstream_error")).encode() + b"\n\n"
    with contextlib.suppress(ConnectionResetError):
        await out.write(event)
        await out.write_eof()
