"""``gearshift operator``: run the gearshift operator (kopf, in-process) against a cluster.

Credentials: ``--kubeconfig`` (also exported as ``KUBECONFIG`` so every client in the process agrees),
else in-cluster, else ``$KUBECONFIG`` / ``~/.kube/config`` (kopf's and the kubernetes client's own order).
Scope: ``--namespace`` (repeatable, globs allowed as kopf allows them) or every namespace.
Health: kopf's liveness endpoint ``http://<probe-host>:<probe-port>/healthz`` (answers once the operator
runs; the chart uses it for liveness and readiness). Metrics: the operator's own Prometheus metrics
(:mod:`gearshift.adapters.metrics`) on ``--metrics-port``. High availability: ``--leader-elect`` makes
replicas campaign for a Lease (:mod:`gearshift.adapters.leader`); a standby answers ``/healthz`` itself and
starts kopf only once it leads. Without the flag the operator runs alone.

Losing the Lease: the write fence (:mod:`gearshift.adapters.kube`) refuses every write from
that moment, then the process re-executes itself in place (``os.execve`` of its own interpreter and
command line): same PID, same container, a fresh kopf with no state, a standby again. It campaigns anew
after :class:`~gearshift.adapters.leader.Backoff` (4 s doubling to 60 s over a run of short terms), keeping
its Lease identity, so while the Lease still names it (no standby took it) it leads again at its first try
instead of waiting out a lease duration. The attempt, the identity and the loss count cross the exec in
``$GEARSHIFT_LEADER_REEXEC`` (:class:`Reexec`). Only when the exec itself fails does it exit (status 4).

Why not exit and let the kubelet restart the container, as controller-runtime does: each exit is a
container restart, and the kubelet waits 10 s, 20 s, 40 s ... up to 5 min before the next
(CrashLoopBackOff, reset after 10 min of running), so a starved API server that costs a few Leases in a
row keeps the operator down for minutes and shows as a crash loop. Measured on the busy sandbox with two
12 s API server outages, each requiring a loss (``bench/lease.py``, ``bench/results/reliability.json``
``lease``; controller-runtime's times): exiting, 2 restarts and 64.8 s without a leader; re-executing,
0 restarts and 19.3 s (the back-off, the outage's rest and the start-up). A shift in flight resumes under
the next leader from its GearSet's status, as after any restart (both runs completed 2/2).

State: one :class:`~gearshift.handlers.runtime.Runtime` (settings from the flags, the API, what the handlers
remember per object), built here before any handler module is imported and handed to kopf as
``kopf.run(memo=kopf.Memo(runtime=...))``: every handler finds it in its ``memo`` kwarg.

kopf's finalizer and bookkeeping annotations live under the ``gearshift.io`` domain
(``gearshift.io/finalizer``, ``gearshift.io/last-handled-configuration``, ``gearshift.io/<handler>``),
as Twingate's operator does in its startup handler, rather than under ``kopf.zalando.org``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gearshift.adapters.kube import FENCE, install_kopf_fence
from gearshift.adapters.leader import Backoff, LeaderElector, LeaseTimes, standby_health
from gearshift.adapters.metrics import LEADER, LEADER_LOSSES
from gearshift.api.enginespec import DNS_SUBDOMAIN_PATTERN
from gearshift.k8s.names import DOMAIN

if TYPE_CHECKING:
    from gearshift.handlers.runtime import Runtime

#: Handler modules the operator loads; each registers its kopf handlers on import. Other features add a
#: line here.
HANDLER_MODULES: tuple[str, ...] = (
    "gearshift.handlers.pdservice",
    "gearshift.handlers.gearset",
    "gearshift.handlers.nodes",
    "gearshift.handlers.gpuprofile",
    "gearshift.handlers.shifting",
    "gearshift.handlers.autoscale",
    "gearshift.handlers.adaptive_batch",
    "gearshift.handlers.replicas",
    "gearshift.handlers.crdwatch",
)

FINALIZER = f"{DOMAIN}/finalizer"
#: Exit status when the installed CRDs are older than the operator (a config error, like a bad flag: 2).
EXIT_STALE_CRDS = 3
#: Exit status when this replica lost its Lease and could not re-execute itself (the kubelet restarts it).
EXIT_LEADERSHIP_LOST = 4
#: What a re-executed operator inherits from the image it replaced (:class:`Reexec`, JSON).
REEXEC_ENV = "GEARSHIFT_LEADER_REEXEC"
#: The re-campaign back-off (:class:`~gearshift.adapters.leader.Backoff`).
BACKOFF = Backoff()
#: Left out of kopf's diff base (``AnnotationsDiffBaseStorage(ignored_fields=...)``): see operator_startup.
DIFFBASE_IGNORED = ("metadata.annotations", "metadata.labels")

log = logging.getLogger("gearshift.operator")


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``gearshift operator`` to the CLI."""
    p = sub.add_parser("operator", help="run the gearshift operator (kopf) against a cluster")
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The operator's flags."""
    env = os.environ.get
    p.add_argument(
        "--kubeconfig", default=None, help="kubeconfig file (default: in-cluster, else $KUBECONFIG)"
    )
    p.add_argument(
        "--namespace",
        action="append",
        default=[],
        help="namespace to watch (repeatable; default: all namespaces)",
    )
    lead = p.add_argument_group("leader election (a coordination.k8s.io Lease; client-go's semantics)")
    lead.add_argument(
        "--leader-elect", action="store_true", help="campaign for the Lease; only its holder acts"
    )
    lead.add_argument("--leader-election-id", default="gearshift-operator", metavar="NAME", help="the Lease")
    lead.add_argument(
        "--leader-election-namespace",
        default=env("GEARSHIFT_NAMESPACE"),
        metavar="NS",
        help="the Lease's namespace (default: $GEARSHIFT_NAMESPACE, which the chart sets)",
    )
    lead.add_argument(
        "--lease-duration", type=int, default=LeaseTimes.lease_duration_s, metavar="S",
        help="a standby takes the Lease when its holder has not renewed it for this long",
    )  # fmt: skip
    lead.add_argument(
        "--renew-deadline", type=float, default=LeaseTimes.renew_deadline_s, metavar="S",
        help="a leader that could not renew for this long stops writing and re-executes itself",
    )  # fmt: skip
    lead.add_argument(
        "--retry-period", type=float, default=LeaseTimes.retry_period_s, metavar="S",
        help="how often candidates try and the leader renews",
    )  # fmt: skip
    p.add_argument(
        "--probe-host", default=env("GEARSHIFT_PROBE_HOST", "127.0.0.1"), help="health endpoint host"
    )
    p.add_argument("--probe-port", type=int, default=8080, help="health endpoint port (/healthz); 0 disables")
    p.add_argument("--metrics-host", default=env("GEARSHIFT_METRICS_HOST", "127.0.0.1"))
    p.add_argument("--metrics-port", type=int, default=9090, help="Prometheus metrics port; 0 disables")
    p.add_argument("--prometheus-url", default=env("GEARSHIFT_PROMETHEUS_URL"), help="Prometheus for signals")
    p.add_argument(
        "--vllm-image", default=None, help="engine image for engine: vllm when a PDService names none"
    )
    p.add_argument(
        "--sim-image", default=None, help="engine image for engine: sim when a PDService names none"
    )
    p.add_argument("--router-image", default=None, help="router image when a PDService names none")
    p.add_argument(
        "--disable",
        action="append",
        default=[],
        metavar="MODULE",
        help="skip a handler module (e.g. gearshift.handlers.gpuprofile); repeatable",
    )
    p.add_argument("--workers", type=int, default=8, help="threads for synchronous handlers")
    p.add_argument("--log-level", default=env("GEARSHIFT_LOG_LEVEL", "INFO"))


def load_handlers(disabled: list[str]) -> list[str]:
    """Import the handler modules (registering their handlers); returns those loaded.

    Raises:
        SystemExit: a ``--disable`` names no known module (a typo would silently keep it on).
    """
    unknown = sorted(set(disabled) - set(HANDLER_MODULES))
    if unknown:
        raise SystemExit(
            f"--disable {', '.join(unknown)}: not a handler module; known: {', '.join(HANDLER_MODULES)}"
        )
    loaded = []
    for name in HANDLER_MODULES:
        if name in disabled:
            continue
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            # A feature whose handlers are not built yet must not stop the others.
            if exc.name == name:
                log.warning("handler module %s not found; skipped", name)
                continue
            raise
        loaded.append(name)
    return loaded


@dataclass(frozen=True)
class Reexec:
    """What crosses a re-exec after a lost Lease: the Lease identity, the back-off attempt (0: this
    process image was not re-executed), and the losses so far (for
    :data:`~gearshift.adapters.metrics.LEADER_LOSSES`)."""

    identity: str | None = None
    attempt: int = 0
    losses: int = 0

    @classmethod
    def take(cls, environ: dict[str, str] | os._Environ[str]) -> Reexec:
        """Read and remove :data:`REEXEC_ENV` (nothing the operator starts inherits it); a value that does
        not parse counts as none (logged)."""
        raw = environ.pop(REEXEC_ENV, None)
        if not raw:
            return cls()
        try:
            d = json.loads(raw)
            return cls(str(d["identity"]), int(d["attempt"]), int(d["losses"]))
        except (ValueError, KeyError, TypeError):
            log.warning("ignored $%s=%r: not what a re-exec writes", REEXEC_ENV, raw[:200])
            return cls()

    def env(self) -> str:
        return json.dumps({"identity": self.identity, "attempt": self.attempt, "losses": self.losses})


def run(args: argparse.Namespace) -> int:
    """Run the operator until interrupted; returns the exit code."""
    _configure_logging(args.log_level)
    reexec = Reexec.take(os.environ)
    if reexec.losses:
        LEADER_LOSSES.inc(reexec.losses)
    if args.kubeconfig:
        os.environ["KUBECONFIG"] = str(Path(args.kubeconfig).resolve())
    times = lease_times(args)

    import kopf

    from gearshift.handlers.runtime import MEMO_KEY

    rt = build_runtime(args)
    loaded = load_handlers(args.disable)
    log.info("handler modules: %s", ", ".join(loaded))
    _register_startup(args.workers)
    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr=args.metrics_host)
        log.info("metrics on http://%s:%d/metrics", args.metrics_host, args.metrics_port)
    # Before kopf starts: against older CRDs the API server would prune what the handlers write.
    from gearshift.handlers.crds import StaleCRDs, check_installed_crds

    try:
        _until_answered(lambda: check_installed_crds(rt.api), retry=reexec.attempt > 0)
    except StaleCRDs as exc:
        log.error("%s", exc)
        return EXIT_STALE_CRDS
    elector = None
    if args.leader_elect:
        install_kopf_fence()
        elector = campaign(args, times, rt.api.client, reexec)  # type: ignore[attr-defined]
    else:
        LEADER.set(1)  # alone: it handles resources
    liveness = f"http://{args.probe_host}:{args.probe_port}/healthz" if args.probe_port else None
    try:
        kopf.run(
            standalone=True,
            clusterwide=not args.namespace,
            namespaces=args.namespace,
            liveness_endpoint=liveness,
            memo=kopf.Memo({MEMO_KEY: rt}),
        )
    finally:
        if elector is not None:
            elector.release()
            LEADER.set(0)
    return 0


#: After a re-exec, how often the start-up's API call is tried again while the API server does not answer, s.
STARTUP_RETRY_S = 2.0


def _until_answered(
    call: Callable[[], None], retry: bool, sleep: Callable[[float], None] = time.sleep
) -> None:
    """Run ``call``; when ``retry``, again every :data:`STARTUP_RETRY_S` while the API server gives no
    answer (no connection, a time-out, a 5xx), instead of ending the process.

    Only after a re-exec (``retry``): the Lease was lost because the API server did not answer, and it may
    still not, and an exit there is the container restart the re-exec avoids. The kubelet's liveness
    probe has no ``/healthz`` to ask meanwhile (the chart's: 3 failures 20 s apart), so it restarts the
    container only when the API server stays away about a minute. A first start fails at once, as before.

    Raises:
        Exception: whatever ``call`` raises that is an answer (a 4xx, a stale CRD) or no API error at
            all (a bug), or anything when not ``retry``.
    """
    import urllib3

    from gearshift.adapters.kube import KubeApiError

    while True:
        try:
            call()
            return
        except KubeApiError as exc:
            if not retry or 0 < exc.status < 500:
                raise
            problem = str(exc)
        except (OSError, urllib3.exceptions.HTTPError) as exc:  # no connection, a time-out: no answer at all
            if not retry:
                raise
            problem = f"{type(exc).__name__}: {exc}"
        log.warning("the API server does not answer (%s); trying again in %g s", problem, STARTUP_RETRY_S)
        sleep(STARTUP_RETRY_S)


def build_runtime(args: argparse.Namespace) -> Runtime:
    """The operator's :class:`~gearshift.handlers.runtime.Runtime` from the flags: the images and the
    Prometheus URL; the API is built on first use (``--kubeconfig`` exported before), the probe settings
    read from the environment when the GPUProfile handlers start."""
    from gearshift.control.reconcile.settings import Settings
    from gearshift.handlers.runtime import Runtime
    from gearshift.k8s.desired import Images

    images = Images()
    images = Images(
        vllm=args.vllm_image or images.vllm, sim=args.sim_image or images.sim, router=args.router_image
    )
    settings = Settings(
        images=images,
        prometheus_url=args.prometheus_url,
        namespaces=tuple(args.namespace),
        profiles="gearshift.handlers.gpuprofile" not in args.disable,
    )
    return Runtime(settings=settings)


def _configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if logging.getLogger().level > logging.DEBUG:
        # kopf logs every event handler's success at INFO: one line per watched Node/GPUProfile change.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
        # One access line per kubelet probe of kopf's /healthz (every 10 s) says nothing.
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def _register_startup(workers: int) -> None:
    """kopf's settings for this operator, applied when kopf starts."""
    import kopf

    @kopf.on.startup()
    def operator_startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.persistence.finalizer = FINALIZER
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=DOMAIN)
        # The diff base is the spec only: kopf's default essence also copies metadata.annotations, so a
        # user annotation of 150 KiB made the last-handled annotation pass the API's 256 KiB limit for
        # all annotations and every patch failed "Too long". No handler reacts to annotations.
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=DOMAIN, key="last-handled-configuration", ignored_fields=DIFFBASE_IGNORED
        )
        # Our own events say what happened; kopf's per-handler events would double them.
        settings.posting.level = logging.WARNING
        settings.execution.max_workers = workers
        # Server-side watch timeouts keep watches from hanging silently on a dropped connection
        # (kopf docs, "Configuration: API timeouts"; nolar/kopf#232).
        settings.watching.server_timeout = 300
        settings.watching.client_timeout = 330


def lease_times(args: argparse.Namespace) -> LeaseTimes:
    """The election's times from the flags.

    Raises:
        SystemExit: (status 2, like a bad flag) times client-go would refuse, or ``--leader-elect``
            without a namespace for the Lease; the message names the flags.
    """
    times = LeaseTimes(args.lease_duration, args.renew_deadline, args.retry_period)
    problems = times.problems() if args.leader_elect else []
    lease = args.leader_election_id or ""
    if args.leader_elect and not (len(lease) <= 253 and re.fullmatch(DNS_SUBDOMAIN_PATTERN, lease)):
        problems.append(
            f"--leader-election-id {args.leader_election_id!r}: a Lease name is a DNS-1123 subdomain "
            "(lower-case letters, digits, '-' and '.', at most 253 characters)"
        )
    if args.leader_elect and not args.leader_election_namespace:
        problems.append(
            "--leader-election-namespace: required with --leader-elect (or set GEARSHIFT_NAMESPACE)"
        )
    if problems:
        print("gearshift operator: " + "; ".join(problems), file=sys.stderr)
        raise SystemExit(2)
    return times


def campaign(
    args: argparse.Namespace, times: LeaseTimes, api_client: Any, reexec: Reexec | None = None
) -> LeaderElector:
    """Block until this replica holds the Lease; meanwhile answer ``/healthz`` (200: a standby is ready to
    take over, and a rolling update with ``maxUnavailable: 0`` waits for the new pod to be Ready before it
    stops the old leader). After a re-exec (``reexec``) the first try waits the back-off and uses the same
    identity. Returns the elector, still renewing, with :data:`~gearshift.adapters.kube.FENCE` guarded by
    it."""
    ns, name = args.leader_election_namespace, args.leader_election_id
    reexec = reexec or Reexec()
    delay = BACKOFF.delay_s(reexec.attempt)
    made: list[LeaderElector] = []  # on_lost needs the elector it is given to
    elector = LeaderElector(
        api_client, ns, name, times, on_lost=lambda: _lost(made[0], reexec),
        identity=reexec.identity, delay_s=delay,
    )  # fmt: skip
    made.append(elector)
    FENCE.guard(elector.may_act)
    try:
        server = standby_health(args.probe_host, args.probe_port, elector) if args.probe_port else None
    except OSError as exc:
        print(
            f"gearshift operator: --probe-port {args.probe_port} on {args.probe_host}: {exc}", file=sys.stderr
        )
        raise SystemExit(2) from None
    LEADER.set(0)
    elector.start()
    if delay:
        log.info(
            "re-executed after losing the Lease (%d in a row): campaigning again in %g s",
            reexec.attempt, delay,
        )  # fmt: skip
    log.info("campaigning for Lease %s/%s as %s", ns, name, elector.identity)
    seen: str | None = None
    while not elector.wait_leading(times.retry_period_s):
        holder = elector.holder()
        if holder and holder != seen:
            log.info("standby: Lease %s/%s is held by %s", ns, name, holder)
            seen = holder
    if server is not None:
        server.shutdown()
        server.server_close()  # kopf's own /healthz binds the same port next
    LEADER.set(1)
    log.info("leading: acquired Lease %s/%s as %s", ns, name, elector.identity)
    return elector


def _lost(elector: LeaderElector, reexec: Reexec) -> None:
    """The elector lost the Lease (or its campaign failed): fence every write, then re-execute in place
    (see the module docstring); exit with :data:`EXIT_LEADERSHIP_LOST` only when the exec fails."""
    FENCE.close()  # first: kopf's handlers run on in other threads until the exec replaces the image
    LEADER.set(0)
    led = elector.led_since is not None
    term_s = time.monotonic() - elector.led_since if elector.led_since is not None else None
    if led:
        LEADER_LOSSES.inc()
    nxt = Reexec(elector.identity, BACKOFF.next_attempt(reexec.attempt, term_s), reexec.losses + int(led))
    log.error(
        "re-executing the operator (pid %d kept) to campaign again in %g s; %d Lease losses so far",
        os.getpid(), BACKOFF.delay_s(nxt.attempt), nxt.losses,
    )  # fmt: skip
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, list(sys.orig_argv), {**os.environ, REEXEC_ENV: nxt.env()})
    except OSError as exc:
        log.error("re-exec failed (%s): exiting with status %d", exc, EXIT_LEADERSHIP_LOST)
        sys.stderr.flush()
    # kopf's handlers cannot be stopped from this thread, and a deposed leader must stop acting now.
    os._exit(EXIT_LEADERSHIP_LOST)
