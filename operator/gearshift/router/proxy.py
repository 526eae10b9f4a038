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
   each held request once, at its first miss (admission and placement: :mod:`gearshift.router.placement`).
   Then the two legs of vLLM's disaggregated-prefill protocol, exactly as vLLM's own proxy sends them
   (:mod:`gearshift.router.legs`): the prefill leg, then the decode leg streamed back as it comes
   (:mod:`gearshift.router.relay`), both under one ``X-Request-Id``. A prefill leg that fails (an HTTP
   error, or a body that is not JSON) ends the request with an OpenAI-shaped error naming the prefill pod;
   the decode pod is not called. With only ``both`` pods (an aggregated PDService, or ``--backend
   both=URL``): one pod per request, placed as a decode pod is (batch cap, pd-score's decode score and KV
   headroom hold), and the client's bytes forwarded as they are (with the ``X-Request-Id`` header): no
   second leg;
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
import json
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from gearshift.facts import fastjson
from gearshift.router import policies as P
from gearshift.router.config import ProxyConfig
from gearshift.router.errors import (
    RequestError,
    StreamEnded,
    error_response,
    prefill_failed,
    validate_body,
    with_request_id,
)
from gearshift.router.legs import (
    REQUEST_ID_HEADER,
    RequestIds,
    decode_leg_body,
    is_chat,
    leg_headers,
    prefill_leg_body,
    request_id_for,
)
from gearshift.router.metrics import RouterMetrics
from gearshift.router.outlier import record_success
from gearshift.router.placement import Placement
from gearshift.router.pool import Backend, Pool
from gearshift.router.relay import Relay, Relayer, SeriesChildren, end_stream
from gearshift.router.sse import usage_withheld, with_usage_requested
from gearshift.router.tokens import estimate_prompt_tokens

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


class Proxy:
    """Forwarding over a :class:`Pool` (legs, retries, the KV hand-off), after its :class:`Placement` admits
    and places each request; one per router process."""

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
        self.placement = Placement(pool, metrics, config, clock)
        self._new_id = RequestIds()
        # The legs' timeout, made once: a connect within connect_timeout_s, no overall bound (the handler's).
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=config.connect_timeout_s)
        self.mirror: Mirror | None = None
        """Copies of live requests for warming shadow pods (gearshift.router.mirror); None: none."""
        self._child = SeriesChildren(metrics)
        self._relayer = Relayer(pool, metrics, self._child, clock)

    # --- what the router's /debug pages read of placement ------------------------------------------
    @property
    def headroom_held(self) -> int:
        """Requests held now for decode KV headroom."""
        return self.placement.headroom_held

    @property
    def batch_waiting(self) -> dict[str, int]:
        """Requests waiting for a serving pod below its batch cap, per role."""
        return self.placement.batch_waiting

    @property
    def scale_up_requests(self) -> int:
        """Requests that found no decode pod with KV headroom (each counted once): scale-up asked."""
        return self.placement.scale_up_requests

    @property
    def last_scale_up_kv_bytes(self) -> float | None:
        """The KV bytes of the last request that asked for a scale-up; None before the first."""
        return self.placement.last_scale_up_kv_bytes

    # --- upstream calls --------------------------------------------------------------------------
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
                    b = self.placement.pick(role, req, peer, tried)
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
            await self.placement.admit()
        except RequestError as err:
            self.metrics.requests.labels(policy, "-", "-", err.outcome).inc()
            return with_request_id(error_response(err.status, err.message, err.err_type, err.param), rid)
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
            return with_request_id(error_response(err.status, err.message, err.err_type, err.param), rid)
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
            return with_request_id(error_response(502, f"upstream failed: {why}", "upstream_error"), rid)
        except TimeoutError:
            outcome = "timeout"
            if (started := relay.response) is not None:
                await end_stream(started, f"no complete answer within {self.cfg.request_timeout_s:g} s")
                return started
            return with_request_id(
                error_response(504, f"no complete answer within {self.cfg.request_timeout_s:g} s", "timeout"),
                rid,
            )
        finally:
            self.placement.unhold(relay)
            self.inflight -= 1
            self.metrics.inflight.dec()
            self.placement.release()
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
        serving = await self.placement.place_serving("decode" if pd else "both", req, relay)
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
            return await self._relayer.relay(
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
