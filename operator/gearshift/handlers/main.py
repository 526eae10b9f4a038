"""``gearshift operator``: run the gearshift operator (kopf, in-process) against a cluster.

Credentials: ``--kubeconfig`` (also exported as ``KUBECONFIG`` so every client in the process agrees),
else in-cluster, else ``$KUBECONFIG`` / ``~/.kube/config`` (kopf's and the kubernetes client's own order).
Scope: ``--namespace`` (repeatable, globs allowed as kopf allows them) or every namespace.
Health: kopf's liveness endpoint ``http://<probe-host>:<probe-port>/healthz`` (answers once the operator
runs; the chart uses it for liveness and readiness). Metrics: the operator's own Prometheus metrics
(:mod:`gearshift.handlers.metrics`) on ``--metrics-port``. High availability: ``--leader-elect`` makes
replicas campaign for a Lease (:mod:`gearshift.adapters.leader`); a standby answers ``/healthz`` itself and
starts kopf only once it leads. Without the flag the operator runs alone.

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
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gearshift.adapters.leader import LeaderElector, LeaseTimes
from gearshift.api.pdservice import DNS_SUBDOMAIN_PATTERN
from gearshift.handlers.metrics import LEADER
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
#: Exit status when this replica led and could not renew its Lease (the kubelet restarts it as a standby).
EXIT_LEADERSHIP_LOST = 4
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
        help="a leader that could not renew for this long exits (status 4)",
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


def run(args: argparse.Namespace) -> int:
    """Run the operator until interrupted; returns the exit code."""
    _configure_logging(args.log_level)
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
        check_installed_crds(rt.api)
    except StaleCRDs as exc:
        log.error("%s", exc)
        return EXIT_STALE_CRDS
    elector = None
    if args.leader_elect:
        elector = campaign(args, times, rt.api.client)  # type: ignore[attr-defined]
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


def build_runtime(args: argparse.Namespace) -> Runtime:
    """The operator's :class:`~gearshift.handlers.runtime.Runtime` from the flags: the images and the
    Prometheus URL; the API is built on first use (``--kubeconfig`` exported before), the probe settings
    read from the environment when the GPUProfile handlers start."""
    from gearshift.handlers.runtime import Runtime, Settings
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
        # all annotations and every patch failed "Too long" (#20 row 4). No handler reacts to annotations.
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


def campaign(args: argparse.Namespace, times: LeaseTimes, api_client: Any) -> LeaderElector:
    """Block until this replica holds the Lease; meanwhile answer ``/healthz`` (200: a standby is ready to
    take over, and a rolling update with ``maxUnavailable: 0`` waits for the new pod to be Ready before it
    stops the old leader). Returns the elector, still renewing."""
    ns, name = args.leader_election_namespace, args.leader_election_id
    elector = LeaderElector(api_client, ns, name, times, on_lost=_exit_lost)
    try:
        server = _standby_health(args.probe_host, args.probe_port, elector) if args.probe_port else None
    except OSError as exc:
        print(
            f"gearshift operator: --probe-port {args.probe_port} on {args.probe_host}: {exc}", file=sys.stderr
        )
        raise SystemExit(2) from None
    LEADER.set(0)
    elector.start()
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


def _exit_lost() -> None:
    LEADER.set(0)
    sys.stderr.flush()
    # kopf's handlers cannot be stopped from this thread, and a deposed leader must stop acting now.
    os._exit(EXIT_LEADERSHIP_LOST)


def _standby_health(host: str, port: int, elector: LeaderElector) -> ThreadingHTTPServer:
    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # http.server's name
            if self.path.split("?")[0] != "/healthz":
                self.send_error(404)
                return
            body = json.dumps({"leader": False, "lease": f"{elector.namespace}/{elector.name}",
                               "holder": elector.holder()}).encode()  # fmt: skip
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:  # the kubelet probes every 10 s
            pass

    server = ThreadingHTTPServer((host, port), Health)
    threading.Thread(target=server.serve_forever, name="standby /healthz", daemon=True).start()
    return server
