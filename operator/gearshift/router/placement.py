"""Where a request may go and when: admission (at most ``max_inflight`` forwarded, ``max_queue`` more
waiting), the operator's batch cap per serving pod, and the decode pod's choice, which holds a request no
decode pod has KV headroom for until headroom appears (pd-score's filter, docs/ARCHITECTURE.md). Every
refusal is a :class:`~gearshift.router.errors.RequestError` (429 or 503) and counts in the router's metrics;
:mod:`gearshift.router.proxy` forwards what is placed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable

from gearshift.router import policies as P
from gearshift.router.config import ProxyConfig
from gearshift.router.errors import RequestError
from gearshift.router.metrics import RouterMetrics
from gearshift.router.pool import Backend, Pool
from gearshift.router.relay import Relay


class Placement:
    """Admission, batch slots and pod choice over a :class:`Pool`; one per router process."""

    def __init__(
        self, pool: Pool, metrics: RouterMetrics, config: ProxyConfig, clock: Callable[[], float]
    ) -> None:
        self.pool, self.metrics, self.cfg, self.clock = pool, metrics, config, clock
        self.queued = 0
        self._slots = asyncio.Semaphore(config.max_inflight)
        self.scale_up_requests = 0
        self.last_scale_up_kv_bytes: float | None = None
        # Requests held for decode KV headroom, oldest first; an event is set when its holder may try.
        self._headroom_q: deque[asyncio.Event] = deque()
        # Requests waiting for a serving pod below its batch cap, per role; set when a slot frees.
        self.batch_waiting: dict[str, int] = {}
        self._batch_freed = asyncio.Event()

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

    async def place_serving(self, role: P.Role, req: P.RequestView, relay: Relay) -> Backend:
        """The serving pod of a request (decode under PD, else a ``both`` pod) below its batch cap; the
        request holds one of its slots until :meth:`unhold`."""
        await self._batch_room(role)
        b = await self._place_decode(req, role)
        b.held += 1
        relay.held = b
        return b

    def unhold(self, relay: Relay) -> None:
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

    # --- a pod of a role, for a leg or its retry --------------------------------------------------
    def pick(self, role: P.Role, req: P.RequestView, peer: Backend | None, tried: set[str]) -> Backend:
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
