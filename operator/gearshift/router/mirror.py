"""Mirrored warm-up traffic: copies of live requests to a warming shadow's head pods, answers dropped.

FlexPipe's executor warms a shadow gear on a share of live traffic before it serves
(docs/sources.md#shift-executor).

While a gear shift is ``Warming`` the operator labels the target gear's head pods
``gearshift.io/warming: "true"`` with the annotation ``gearshift.io/mirror-rps`` (its ``mirror_rps``:
``warmupShare`` × the gear's predicted pipeline throughput ÷ head pods ÷ router replicas;
gearshift.k8s.warming.mirror_rps). The router's pod poll
(router/membership.py) finds those pods of its own PDService (:func:`warming_targets`) and hands them to
:class:`Mirror`; for each live request the proxy then offers a copy (:meth:`Mirror.offer`):

- per role with warming pods, one copy to one pod (:func:`pick`: round robin over the pods with a token);
- each pod's copies are bounded by a token bucket at its ``mirror_rps`` (:class:`TokenBucket`: that many
  tokens/s, a burst of one second's worth, at least one), and at most :data:`MAX_IN_FLIGHT` copies are out
  at once per router; over either bound the copy is not sent and is counted (``dropped``, ``busy``);
- a prefill shadow gets the prefill leg without ``kv_transfer_params`` (one output token, its KV freed at
  once: no decode pod will pull it), a decode shadow the client's request without them (it prefills and
  decodes itself, streamed if the client streams); both under ``X-Request-Id`` ``<id>-mirror``;
- fire and forget: the copy runs in its own task; its answer, streamed or not, is read to the end and
  dropped; it is never retried, its errors are only counted (``gearshift_router_mirror_requests_total``),
  and nothing of it reaches the client or the pod's routing record (signals, outlier detection);
- a pod the router already routes to (one the role Service selects: the tick between the switch and the
  operator's unmarking) gets no copy.

With no warming pod, the cost on the request path is one attribute test (``Mirror.active``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge

from gearshift.k8s.names import (
    COMPONENT_ENGINE,
    LABEL_COMPONENT,
    LABEL_GEAR,
    LABEL_ROLE,
    LABEL_SERVICE,
    LABEL_STAGE,
    LABEL_WARMING,
    parse_mirror_rps,
)
from gearshift.router.legs import leg_headers, prefill_leg_body

log = logging.getLogger(__name__)

#: Copies out at once per router, over every warming pod; more are not sent (``busy``).
MAX_IN_FLIGHT = 64
#: A bucket's burst, in seconds of its rate (at least one token).
BURST_S = 1.0
#: Appended to the live request's id: a copy's ``X-Request-Id`` (engine logs tell the two apart).
MIRROR_ID_SUFFIX = "-mirror"
#: The engine's port when a pod names no ``http`` container port (gearshift.k8s.engine.ENGINE_PORT).
DEFAULT_PORT = 8000

# ``outcome`` values of gearshift_router_mirror_requests_total.
OK, FAILED, DROPPED, BUSY = "ok", "failed", "dropped", "busy"


class TokenBucket:
    """``rate`` tokens/s up to ``burst`` (default: one second's worth, at least 1); starts full. Pure: the
    caller passes the time."""

    def __init__(self, rate: float, now: float, burst: float | None = None) -> None:
        self.rate = max(0.0, rate)
        self.burst = max(1.0, self.rate * BURST_S) if burst is None else burst
        self.tokens = self.burst
        self.at = now

    def refill(self, now: float) -> None:
        if now > self.at:
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = max(self.at, now)

    def take(self, now: float) -> bool:
        """Take one token if there is one."""
        self.refill(now)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


@dataclass(frozen=True)
class MirrorTarget:
    """One warming head pod: where copies go and how many per second at most."""

    name: str
    role: str
    gear: str
    url: str
    mirror_rps: float


def _ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    return status.get("phase") == "Running" and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ()
    )


def _http_port(pod: Mapping[str, Any]) -> int:
    for c in (pod.get("spec") or {}).get("containers") or ():
        for p in c.get("ports") or ():
            if p.get("name") == "http" and isinstance(p.get("containerPort"), int):
                return int(p["containerPort"])
    return DEFAULT_PORT


def warming_targets(pods: Iterable[Mapping[str, Any]], service: str) -> list[MirrorTarget]:
    """The Ready, Running head pods of PDService ``service`` labelled warming with a positive ``mirror_rps``
    (:func:`gearshift.k8s.names.parse_mirror_rps`), sorted by name (pod API JSON in; pure). One that is
    absent, ``0`` or unreadable: no target."""
    out: list[MirrorTarget] = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        if (
            labels.get(LABEL_WARMING) != "true"
            or labels.get(LABEL_SERVICE) != service
            or labels.get(LABEL_COMPONENT) != COMPONENT_ENGINE
            or labels.get(LABEL_STAGE) != "0"
            or labels.get(LABEL_ROLE) not in ("prefill", "decode", "both")
            or meta.get("deletionTimestamp")
            or not _ready(pod)
        ):
            continue
        ip = (pod.get("status") or {}).get("podIP")
        mirror_rps = parse_mirror_rps(meta.get("annotations") or {})
        if not ip or mirror_rps <= 0:
            continue
        host = f"[{ip}]" if ":" in ip else ip
        out.append(
            MirrorTarget(
                name=str(meta.get("name")),
                role=str(labels[LABEL_ROLE]),
                gear=str(labels.get(LABEL_GEAR, "")),
                url=f"http://{host}:{_http_port(pod)}",
                mirror_rps=mirror_rps,
            )
        )
    return sorted(out, key=lambda t: t.name)


def mirror_body(role: str, body: Mapping[str, Any], chat: bool) -> dict[str, Any]:
    """The copy a warming pod of ``role`` gets of the client's ``body`` (not changed): for prefill, the
    prefill leg (:func:`gearshift.router.legs.prefill_leg_body`: one output token, not streamed) without
    ``kv_transfer_params``, so its KV blocks are freed when it finishes rather than held for a decode pod
    that never comes; for decode, the client's request without ``kv_transfer_params`` (the pod prefills
    it itself, as a decode pod does for a plain request)."""
    leg = prefill_leg_body(body, chat) if role == "prefill" else dict(body)
    leg.pop("kv_transfer_params", None)
    return leg


@dataclass
class _Slot:
    target: MirrorTarget
    bucket: TokenBucket
    children: dict[str, Any]
    """Counter children by outcome (label lookups once per pod, not per copy)."""


def pick(slots: Sequence[_Slot], start: int, now: float, routed: Callable[[str], bool]) -> int | None:
    """Round robin from ``start``: the index of the first slot whose pod the router does not route to and
    whose bucket gives a token (taken), else None. Pure but for the buckets it draws from."""
    n = len(slots)
    for k in range(n):
        i = (start + k) % n
        s = slots[i]
        if not routed(s.target.name) and s.bucket.take(now):
            return i
    return None


@dataclass
class MirrorMetrics:
    """The mirror's collectors (names start with ``gearshift_router_mirror_``)."""

    requests: Counter
    inflight: Gauge
    targets: Gauge


def make_mirror_metrics(reg: CollectorRegistry) -> MirrorMetrics:
    """The mirror's collectors, in ``reg`` (the router's registry)."""
    return MirrorMetrics(
        requests=Counter(
            "gearshift_router_mirror_requests",
            "Copies of live requests for warming shadow pods, by role, pod and outcome: ok (sent, answered "
            "2xx, the answer read and dropped), failed (sent; an error, a non-2xx answer or a timeout: never "
            "retried), dropped (not sent: the pod's mirror-rps, warmupShare x its predicted throughput, "
            "was reached), busy (not sent: too many copies in flight).",
            ["role", "pod", "outcome"],
            registry=reg,
        ),
        inflight=Gauge("gearshift_router_mirror_inflight", "Copies sent and not finished.", registry=reg),
        targets=Gauge(
            "gearshift_router_mirror_targets", "Warming pods copies go to, by role.", ["role"], registry=reg
        ),
    )


class Mirror:
    """The warming pods of one router and the copies sent to them (see the module docstring)."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        metrics: MirrorMetrics,
        clock: Callable[[], float],
        routed: Callable[[str], bool],
        timeout_s: float = 300.0,
        max_in_flight: int = MAX_IN_FLIGHT,
    ) -> None:
        self.session, self.metrics, self.clock, self.routed = session, metrics, clock, routed
        self.max_in_flight = max_in_flight
        self.active = False
        """Some warming pod to copy to: the request path's one test."""
        self.in_flight = 0
        self._by_role: dict[str, list[_Slot]] = {}
        self._next: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=2.0)

    @property
    def targets(self) -> list[MirrorTarget]:
        return [s.target for slots in self._by_role.values() for s in slots]

    def set_targets(self, targets: Iterable[MirrorTarget]) -> None:
        """The warming pods now; a pod whose URL and ``mirror_rps`` are unchanged keeps its bucket."""
        now = self.clock()
        old = {s.target.name: s for slots in self._by_role.values() for s in slots}
        by_role: dict[str, list[_Slot]] = {}
        for t in targets:
            s = old.get(t.name)
            if s is None or s.target != t:
                children = {
                    o: self.metrics.requests.labels(t.role, t.name, o) for o in (OK, FAILED, DROPPED, BUSY)
                }
                s = _Slot(t, TokenBucket(t.mirror_rps, now), children)
            by_role.setdefault(t.role, []).append(s)
        for role in ("prefill", "decode", "both"):
            self.metrics.targets.labels(role).set(len(by_role.get(role, ())))
        if {n for n in old} != {s.target.name for v in by_role.values() for s in v}:
            log.info("mirroring to warming pods: %s", ", ".join(sorted(t.name for t in targets)) or "none")
        self._by_role = by_role
        self.active = bool(by_role)

    def offer(self, path: str, body: Mapping[str, Any], request_id: str, authorization: str | None) -> None:
        """Send a copy of one live request to one warming pod per role, if the caps allow; returns at once."""
        now = self.clock()
        chat = path.endswith("/chat/completions")
        for role, slots in self._by_role.items():
            start = self._next.get(role, 0)
            i = pick(slots, start, now, self.routed)
            if i is None:
                # Counted on the pod next in turn (the one a token would have sent the copy to).
                if not self.routed(slots[start % len(slots)].target.name):
                    slots[start % len(slots)].children[DROPPED].inc()
                continue
            self._next[role] = i + 1
            slot = slots[i]
            if self.in_flight >= self.max_in_flight:
                slot.children[BUSY].inc()
                continue
            headers = leg_headers(request_id + MIRROR_ID_SUFFIX, authorization)
            self.in_flight += 1
            self.metrics.inflight.inc()
            task = asyncio.get_running_loop().create_task(
                self._send(slot, path, mirror_body(role, body, chat), headers)
            )
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, slot: _Slot, path: str, body: dict[str, Any], headers: dict[str, str]) -> None:
        outcome = FAILED
        try:
            async with self.session.post(
                slot.target.url + path, json=body, headers=headers, timeout=self._timeout
            ) as resp:
                async for _ in resp.content.iter_any():  # streamed or not: read to the end, dropped
                    pass
                if 200 <= resp.status < 300:
                    outcome = OK
        except (aiohttp.ClientError, TimeoutError, ConnectionError, OSError, ValueError) as exc:
            log.debug("mirror to %s failed: %s", slot.target.name, exc)
        finally:
            self.in_flight -= 1
            self.metrics.inflight.dec()
            slot.children[outcome].inc()

    async def close(self) -> None:
        """Cancel the copies still out (router shutdown)."""
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await t
