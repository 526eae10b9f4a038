"""``gearshift operator``: run the gearshift operator (kopf, in-process) against a cluster.

Credentials: ``--kubeconfig`` (also exported as ``KUBECONFIG`` so every client in the process agrees),
else in-cluster, else ``$KUBECONFIG`` / ``~/.kube/config`` (kopf's and the kubernetes client's own order).
Scope: ``--namespace`` (repeatable, globs allowed as kopf allows them) or every namespace.
Health: kopf's liveness endpoint ``http://<probe-host>:<probe-port>/healthz`` (answers once the operator
runs; the chart uses it for liveness and readiness). Metrics: the operator's own Prometheus metrics
(:mod:`gearshift.handlers.metrics`) on ``--metrics-port``. High availability: ``--peering NAME`` runs
kopf's peering so that of several replicas only the highest-priority one handles resources (needs kopf's
``KopfPeering``/``ClusterKopfPeering`` CRDs, installed by the chart); ``--standalone`` (default) skips it.

kopf's finalizer and bookkeeping annotations live under the ``gearshift.io`` domain
(``gearshift.io/finalizer``, ``gearshift.io/last-handled-configuration``, ``gearshift.io/<handler>``),
as Twingate's operator does in its startup handler, rather than under ``kopf.zalando.org``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
from pathlib import Path
from typing import Any

from gearshift.k8s.names import DOMAIN

#: Handler modules the operator loads; each registers its kopf handlers on import. Other features add a
#: line here.
HANDLER_MODULES: tuple[str, ...] = (
    "gearshift.handlers.pdservice",
    "gearshift.handlers.gearset",
    "gearshift.handlers.nodes",
    "gearshift.handlers.gpuprofile",
    "gearshift.handlers.shifting",
    "gearshift.handlers.autoscale",
    "gearshift.handlers.replicas",
)

FINALIZER = f"{DOMAIN}/finalizer"
#: Exit status when the installed CRDs are older than the operator (a config error, like a bad flag: 2).
EXIT_STALE_CRDS = 3
#: Left out of kopf's diff base (``AnnotationsDiffBaseStorage(ignored_fields=...)``): see operator_startup.
DIFFBASE_IGNORED = ("metadata.annotations", "metadata.labels")

log = logging.getLogger("gearshift.operator")


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``gearshift operator`` to the CLI."""
    p = sub.add_parser("operator", help="run the gearshift operator (kopf) against a cluster")
    add_arguments(p)
    p.set_defaults(func=run)


#: Range of ``--priority random``: wide enough that two replicas practically never draw the same one.
RANDOM_PRIORITY_MAX = 2**30


def priority_arg(text: str) -> int:
    """Parse ``--priority``: an integer, or ``random`` for one drawn in ``[1, RANDOM_PRIORITY_MAX]``.

    Replicas of one Deployment share their arguments, but kopf runs only the highest-priority peer and lets
    peers of *equal* priority all run (with a warning), so active/standby needs distinct priorities.

    Raises:
        argparse.ArgumentTypeError: neither an integer nor ``random``.
    """
    if text == "random":
        import secrets

        return 1 + secrets.randbelow(RANDOM_PRIORITY_MAX)
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--priority {text!r}: give an integer or 'random'") from None


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
    peer = p.add_mutually_exclusive_group()
    peer.add_argument("--peering", metavar="NAME", default=None, help="kopf peering object (active/standby)")
    peer.add_argument("--standalone", action="store_true", help="no peering (the default without --peering)")
    p.add_argument(
        "--priority",
        type=priority_arg,
        default=0,
        help="peering priority (the highest one is active), or 'random' for replicas of one Deployment",
    )
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


#: kopf's peering resources (group kopf.dev): ``kopfpeerings`` serve namespaced operators (one object per
#: watched namespace), ``clusterkopfpeerings`` cluster-wide ones.
PEERING_GROUP, PEERING_VERSION = "kopf.dev", "v1"


def ensure_peering(api_client: Any, name: str, namespaces: list[str]) -> list[str]:
    """Create kopf's peering object ``name`` where this operator peers: a ``KopfPeering`` in each of
    ``namespaces``, or one ``ClusterKopfPeering`` when it watches the whole cluster. kopf only patches an
    existing peering object's status; without the object the replicas would not see each other.

    Returns the objects created (``ns/name`` or ``name``); those that exist already are left alone.

    Raises:
        kubernetes.client.exceptions.ApiException: any refusal but 409 (already exists).
    """
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    api = client.CustomObjectsApi(api_client)
    created = []
    targets: list[str | None] = list(namespaces) if namespaces else [None]
    for ns in targets:
        kind = "KopfPeering" if ns else "ClusterKopfPeering"
        body = {"apiVersion": f"{PEERING_GROUP}/{PEERING_VERSION}", "kind": kind, "metadata": {"name": name}}
        try:
            if ns:
                api.create_namespaced_custom_object(PEERING_GROUP, PEERING_VERSION, ns, "kopfpeerings", body)
            else:
                api.create_cluster_custom_object(PEERING_GROUP, PEERING_VERSION, "clusterkopfpeerings", body)
        except ApiException as exc:
            if exc.status == 409:
                continue
            raise
        created.append(f"{ns}/{name}" if ns else name)
    return created


def run(args: argparse.Namespace) -> int:
    """Run the operator until interrupted; returns the exit code."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if logging.getLogger().level > logging.DEBUG:
        # kopf logs every event handler's success at INFO: one line per watched Node/GPUProfile change.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    if args.kubeconfig:
        os.environ["KUBECONFIG"] = str(Path(args.kubeconfig).resolve())

    import kopf

    from gearshift.handlers import pdservice
    from gearshift.handlers.reconcile import Settings
    from gearshift.k8s.desired import Images

    images = Images()
    images = Images(
        vllm=args.vllm_image or images.vllm, sim=args.sim_image or images.sim, router=args.router_image
    )
    pdservice.configure(Settings(images=images, prometheus_url=args.prometheus_url))
    loaded = load_handlers(args.disable)
    log.info("handler modules: %s", ", ".join(loaded))

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
        settings.execution.max_workers = args.workers
        # Server-side watch timeouts keep watches from hanging silently on a dropped connection
        # (kopf docs, "Configuration: API timeouts"; nolar/kopf#232).
        settings.watching.server_timeout = 300
        settings.watching.client_timeout = 330
        settings.peering.priority = args.priority
        if args.peering:
            settings.peering.name = args.peering
            settings.peering.mandatory = True
            from kubernetes import client, config
            from kubernetes.client.exceptions import ApiException

            try:
                config.load_incluster_config()
                api_client = client.ApiClient()
            except config.ConfigException:
                api_client = config.new_client_from_config()
            try:
                created = ensure_peering(api_client, args.peering, args.namespace)
            except ApiException as exc:
                # The peering CRD may be seconds from established (installed with the chart): retry.
                raise kopf.TemporaryError(
                    f"cannot create peering {args.peering}: {exc.status} {exc.reason}", delay=5
                ) from None
            if created:
                log.info("created kopf peering object(s): %s", ", ".join(created))

    if args.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(args.metrics_port, addr=args.metrics_host)
        log.info("metrics on http://%s:%d/metrics", args.metrics_host, args.metrics_port)
    # Before kopf starts: against older CRDs the API server would prune what the handlers write.
    from gearshift.handlers.crds import StaleCRDs, check_installed_crds

    try:
        check_installed_crds(pdservice.api())
    except StaleCRDs as exc:
        log.error("%s", exc)
        return EXIT_STALE_CRDS
    liveness = f"http://{args.probe_host}:{args.probe_port}/healthz" if args.probe_port else None
    kopf.run(
        standalone=not args.peering,
        peering_name=args.peering,
        priority=args.priority,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=liveness,
    )
    return 0
