"""The ``gearshift-router`` process: the aiohttp app, its background loops, and ``main()``.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming passed through),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (the router's own, prometheus_client),
``GET /debug/pods`` (every pod's signals and counters), ``GET /debug/decisions`` (the latest
:mod:`gearshift.control.adaptive_batch.pd_balance` round). The router applies the round's rebalancing itself
(new requests spare the pods it names, unless ``--no-apply-rebalance``); the adaptive-batch proposals are the
operator's to apply (:mod:`gearshift.handlers.adaptive_batch` reads this endpoint and writes each decode head
pod's ``gearshift.io/max-batch``, which the router then enforces as a per-pod cap: requests beyond it wait
here, none reaches the engine's queue). The JSON contract is in docs/ARCHITECTURE.md, "Router decisions →
operator".

Membership: with ``--service`` the router watches the role Services' EndpointSlices; where those hold no
endpoint (the sandbox: the API server refuses loopback pod IPs) it falls back to the Services' selectors
and the Ready pods they select (router/membership.py; tests/e2e/test_router.py runs this path).
The same poll finds a warming shadow's pods (``gearshift.io/warming``), to which the router mirrors a
share of live requests, answers dropped (router/mirror.py; tests/e2e/test_warmup_mirror_e2e.py).

Background loops: membership (EndpointSlice watch or static ``--backend`` list), signal scraping (pods'
``/metrics`` or ``--prometheus``), active health checks, and the 5 s balance round.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gearshift.control.adaptive_batch import pd_balance
from gearshift.router import outlier
from gearshift.router.errors import error_response
from gearshift.router.membership import EndpointSliceMembership
from gearshift.router.metrics import RouterMetrics, make_metrics
from gearshift.router.mirror import Mirror, make_mirror_metrics
from gearshift.router.pool import Pool
from gearshift.router.proxy import Proxy
from gearshift.router.settings import RouterSettings, add_arguments, settings_from_args
from gearshift.router.signals import HealthChecker, PrometheusSource, Scraper

log = logging.getLogger("gearshift.router")


def _report_crash(task: asyncio.Task[Any]) -> None:
    """A background loop (scrapes, health checks, membership) that ends by an exception stops its signals
    silently otherwise: log it loudly."""
    if not task.cancelled() and task.exception() is not None:
        log.error("router background task %s died", task.get_coro(), exc_info=task.exception())


def balance_round(
    pool: Pool, now: float, target_itl_ms: float, waiting: Mapping[str, int] | None = None
) -> pd_balance.Decisions:
    """One :mod:`gearshift.control.adaptive_batch.pd_balance` round over the pool's live signals (the
    operator's hook).

    ITL P99 per pod comes from the ITL histogram delta since the previous round (kept in ``extra``), or,
    with signals from Prometheus, from its 30 s ``histogram_quantile`` (``extra["itl_p99_ms"]``). A pod's
    max batch is its batch cap where the operator set one (the value the adaptive rule steps from), its
    hard max the engine's own (``GEARSHIFT_PIPELINE`` ``maxBatch``): a router-side cap cannot exceed what
    the engine was started with. ``waiting``: requests the router holds per role for batch room, shared
    equally among the role's pods in their queue depth (with a cap, the backlog waits here, not in the
    engine, and the PD guide's grow rule reads a queue).
    """
    loads = []
    waiting = waiting or {}
    for b in pool.backends.values():
        hist = b.extra.get("itl_hist")
        prev = b.extra.get("itl_hist_balance")
        p99 = None
        if hist is not None:
            q = (hist.minus(prev) if prev is not None else hist).quantile(0.99)
            p99 = q * 1000 if q is not None else None
            b.extra["itl_hist_balance"] = hist
        elif "itl_p99_ms" in b.extra:
            # Signals from Prometheus (--prometheus): its 30 s histogram_quantile, taken once per round.
            p99 = b.extra.pop("itl_p99_ms")
        loads.append(
            pd_balance.PodLoad(
                name=b.info.name,
                role=b.info.role,
                gpu_util=b.gpu_util,
                # Unknown KV usage: judged by GPU load alone rather than as an empty cache.
                memory_util=b.kv_usage if b.kv_usage is not None else b.gpu_util,
                itl_p99_ms=p99,
                queue_depth=b.waiting
                + b.running
                + waiting.get(b.info.role, 0) / max(1, len(pool.members(b.info.role))),
                max_batch=b.info.batch_cap if b.info.batch_cap is not None else b.info.max_batch,
                hard_max_batch=b.info.max_batch,
            )
        )
    return pd_balance.evaluate(loads, now, target_itl_ms)


class Router:
    """One router: the pool, the proxy, the loops and the aiohttp application."""

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.metrics: RouterMetrics = make_metrics()
        self.mirror_metrics = make_mirror_metrics(self.metrics.registry)
        self.mirror: Mirror | None = None
        self.pool = Pool(settings.policy, random.Random(settings.seed), settings.outlier)
        self.pool.set_members(settings.backends)
        self.session: aiohttp.ClientSession | None = None
        self.proxy: Proxy | None = None
        self.decisions: pd_balance.Decisions | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._membership: EndpointSliceMembership | None = None

    @staticmethod
    def clock() -> float:
        """Monotonic seconds for latencies, deadlines and ejection times. Not the loop's ``time()``: uvloop's
        is libuv's ``uv_now``, in whole milliseconds and mostly cached per loop iteration (measured: five
        calls in a row read the same value), which rounds sub-millisecond router latencies and the ITLs
        of chunks read in one iteration to zero."""
        return time.monotonic()

    # --- lifecycle -------------------------------------------------------------------------------
    async def start(self, _app: web.Application | None = None) -> None:
        s = self.settings
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        self.proxy = Proxy(self.pool, self.session, self.metrics, s.proxy, self.clock)
        if s.service:
            self.mirror = Mirror(
                self.session,
                self.mirror_metrics,
                self.clock,
                routed=lambda pod: pod in self.pool.backends,
                timeout_s=s.proxy.request_timeout_s,
            )
            self.proxy.mirror = self.mirror
            self._membership = EndpointSliceMembership(
                s.service,
                s.namespace,
                self.pool.set_members,
                asyncio.get_running_loop(),
                s.kubeconfig,
                on_warming=self.mirror.set_targets,
                roles=s.roles,
            )
            self._membership.start()
        if s.prometheus_url:
            self._spawn(
                PrometheusSource(
                    self.pool, s.prometheus_url, kv_bytes_per_token=s.proxy.kv_bytes_per_token
                ).run()
            )
        else:
            self._spawn(
                Scraper(
                    self.pool,
                    self.session,
                    s.scrape_interval_s,
                    kv_bytes_per_token=s.proxy.kv_bytes_per_token,
                    clock=self.clock,
                ).run()
            )
        self._spawn(HealthChecker(self.pool, self.session, s.health_interval_s, self.clock).run())
        self._spawn(self._balance_loop())

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        task.add_done_callback(_report_crash)
        self._tasks.append(task)

    async def stop(self, _app: web.Application | None = None) -> None:
        if self._membership:
            self._membership.stop()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        if self.mirror is not None:
            await self.mirror.close()
        if self.session:
            await self.session.close()

    async def _balance_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.balance_interval_s)
            waiting = self.proxy.batch_waiting if self.proxy is not None else None
            self.decisions = balance_round(
                self.pool, self.clock(), self.settings.policy.target_itl_ms, waiting
            )
            if self.settings.apply_rebalance:
                self.pool.avoid = set(self.decisions.avoid)
            for d in self.decisions.rebalance:
                if d.imbalanced:
                    log.info("rebalance %s: %s; avoid %s", d.role, d.reason, ",".join(d.avoid) or "-")

    # --- handlers --------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        assert self.proxy is not None
        return await self.proxy.handle(request)

    async def model(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{id}`` (OpenAI's retrieve-model; the openai SDK's ``models.retrieve``): the card
        of ``/v1/models`` with that id, else a 404 in vLLM's error shape naming it."""
        listing = await self.models(request)
        if listing.status != 200 or listing.body is None:
            return listing
        model_id = request.match_info["model_id"]
        assert isinstance(listing.body, bytes | bytearray)
        for card in json.loads(listing.body).get("data") or ():
            if card.get("id") == model_id:
                return web.json_response(card)
        return error_response(404, f"The model `{model_id}` does not exist.", "NotFoundError", "model")

    async def models(self, _request: web.Request) -> web.Response:
        """``GET /v1/models``: the pods' model list, asked of every routable pod at once, with one
        ``max_model_len`` for the service, the smallest any pod advertises (a request must fit whichever
        pod it meets); else a card for ``--served-model-name``."""
        assert self.session is not None
        session = self.session
        backends = self.pool.candidates("decode", self.clock()) + self.pool.candidates(
            "prefill", self.clock()
        )

        async def ask(url: str) -> Any:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                async with session.get(url + "/v1/models", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return await r.json()
            return None

        answers = [
            a for a in await asyncio.gather(*(ask(b.info.url) for b in backends)) if isinstance(a, dict)
        ]
        if answers:
            return web.json_response(one_model_list(answers))
        if self.settings.served_model_name:
            name = self.settings.served_model_name
            return web.json_response(
                {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "gearshift"}]}
            )
        return error_response(
            503, "no pod answered /v1/models and no --served-model-name is set", "service_unavailable"
        )

    def _role_counts(self) -> tuple[dict[str, int], dict[str, int], dict[str, int], dict[str, bool]]:
        """Per role: member pods, available pods (healthy, not ejected), routable pods, and whether in panic
        mode."""
        now = self.clock()
        count, available, routable, panic = {}, {}, {}, {}
        for role in ("prefill", "decode", "both"):
            members = [b for b in self.pool.backends.values() if b.info.role == role]
            count[role] = len(members)
            available[role] = sum(1 for b in members if b.available(now))
            idx, panic[role] = outlier.routable(members, now, self.pool.outlier)
            routable[role] = len(idx)
            self.metrics.pods_available.labels(role).set(available[role])
            self.metrics.panic.labels(role).set(1.0 if panic[role] else 0.0)
        return count, available, routable, panic

    async def health(self, _request: web.Request) -> web.Response:
        """Ready while each role has a routable pod. Panic mode routes to pods failing their checks, so the
        router stays ready while pods exist: dropping it from its Service would refuse every request,
        where a slow pod may still answer (Envoy's panic threshold)."""
        members, available, routable, panic = self._role_counts()
        ready = (routable["prefill"] > 0 and routable["decode"] > 0) or routable["both"] > 0
        body = {
            "status": "ok" if ready else "unavailable",
            "pods": available,
            "available": available,
            "members": members,
            "routable": routable,
            "panic": sorted(r for r, p in panic.items() if p),
            "policy": self.pool.config.policy,
        }
        return web.json_response(body, status=200 if ready else 503)

    async def prom(self, _request: web.Request) -> web.Response:
        self._role_counts()
        return web.Response(
            body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def debug_pods(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {"policy": self.pool.config.policy, "pods": self.pool.snapshot(self.clock())}
        )

    async def debug_decisions(self, _request: web.Request) -> web.Response:
        assert self.proxy is not None
        body: dict[str, Any] = (
            self.decisions.to_dict() if self.decisions else {"at": None, "rebalance": [], "batch": []}
        )
        body["applied"] = {
            "avoid": sorted(self.pool.avoid) if self.settings.apply_rebalance else None,
            "batchCap": {
                b.info.name: b.info.batch_cap
                for b in self.pool.backends.values()
                if b.info.batch_cap is not None
            },
            "batchWaiting": dict(self.proxy.batch_waiting),
        }
        body["scaleUp"] = {
            "requests": self.proxy.scale_up_requests,
            "lastKvBytes": self.proxy.last_scale_up_kv_bytes,
            "held": self.proxy.headroom_held,
        }
        return web.json_response(body)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20, middlewares=[json_errors])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        # Served names often hold a slash (meta-llama/Meta-Llama-3-8B): the id is the rest of the path.
        app.router.add_get("/v1/models/{model_id:.+}", self.model)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prom)
        app.router.add_get("/debug/pods", self.debug_pods)
        app.router.add_get("/debug/decisions", self.debug_decisions)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.stop)
        return app


def one_model_list(answers: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The first pod's ``/v1/models`` list, each card's ``max_model_len`` the smallest any pod gave for
    that id (pods of one service may hold different KV pools: the service serves what all of them can)."""
    least: dict[str, int] = {}
    for doc in answers:
        for card in doc.get("data") or ():
            if isinstance(card, Mapping) and isinstance(card.get("max_model_len"), int):
                mid = str(card.get("id"))
                least[mid] = min(least.get(mid, card["max_model_len"]), card["max_model_len"])
    out = dict(answers[0])
    out["data"] = [
        {**card, "max_model_len": least[str(card.get("id"))]} if str(card.get("id")) in least else card
        for card in answers[0].get("data") or ()
        if isinstance(card, Mapping)
    ]
    return out


@web.middleware
async def json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """aiohttp's own 404 and 405 (a route or method the router does not serve) as JSON errors in vLLM's
    shape, so an OpenAI client reads them as it reads every other error of the router."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return error_response(
            404, f"{request.method} {request.path} is not served here", "NotFoundError", "path"
        )
    except web.HTTPMethodNotAllowed as exc:
        allowed = ", ".join(sorted(exc.allowed_methods))
        return error_response(
            405, f"{request.method} is not allowed on {request.path} (allowed: {allowed})", "MethodNotAllowed"
        )


# --- command line ------------------------------------------------------------------------------------


def run(a: argparse.Namespace) -> int:
    """Serve until interrupted; returns the exit code (2 on bad settings)."""
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = settings_from_args(a)
    except ValueError as exc:
        print(f"gearshift-router: {exc}", file=sys.stderr)
        return 2
    router = Router(settings)
    log.info(
        "router on %s:%d, policy %s, %d static pods, service %s",
        a.host,
        a.port,
        settings.policy.policy,
        len(settings.backends),
        settings.service or "-",
    )
    try:
        import uvloop

        loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux; stay correct without it
        loop = asyncio.new_event_loop()
    try:
        web.run_app(router.app(), host=a.host, port=a.port, access_log=None, print=None, loop=loop)
    except OSError as exc:  # the listening socket: a port in use, an address not on this host
        print(
            f"gearshift-router: cannot listen on {a.host}:{a.port}: {exc.strerror or exc}; choose another "
            "--port/--host",
            file=sys.stderr,
        )
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``gearshift-router`` console script."""
    p = argparse.ArgumentParser(
        prog="gearshift-router", description="gearshift's PD router (OpenAI API proxy)."
    )
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
