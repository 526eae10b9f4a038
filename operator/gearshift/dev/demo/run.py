"""The demo's orchestration: sandbox, operator, profiles, service, replay with a live line, report.

Thin on purpose: each step calls the sandbox, kubectl, the load generator or a pure helper, and prints
what it did. Traffic goes only to loopback addresses: the router's pod IP and Prometheus on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

import gearshift
from gearshift.dev.demo import cost, goals, live, plots, report, series, summary
from gearshift.dev.demo import trace as tracewin
from gearshift.dev.demo.gears import gearset_table, stage_nodes
from gearshift.dev.demo.kube import DemoError, Kube, Prometheus, http_get, wait_until
from gearshift.dev.sandbox.layout import env_prefix
from gearshift.k8s import names

#: Namespace of the operator (chart release or local process) and of the probe Jobs.
SYSTEM_NAMESPACE = "gearshift-system"
HELM_RELEASE = "gearshift"
#: The chart's operator metrics port (``ports.metrics``), named again in its pod's scrape annotations.
CHART_METRICS_PORT = 9090
#: Whether ``--install auto`` uses the Helm chart (its sandbox install is covered by tests/e2e/test_helm.py);
#: False makes the demo run ``gearshift operator`` as a local process instead (the code the chart's pod runs).
CHART_READY = True
#: Live-line refresh and router scrape interval, s (the sandbox's Prometheus scrapes every 2 s too).
TICK_S = 2.0
#: Window of the live line's QPS and P99, s.
LIVE_WINDOW_S = 20.0
#: Time-series bin of the report's wire measurements, s.
BIN_S = 10.0
#: Seconds to wait for requests still in flight when issuing stops.
DRAIN_S = 60.0
PROFILE_TIMEOUT_S = 300.0
PLAN_TIMEOUT_S = 120.0


class Say:
    """Step-by-step output on stderr with the seconds since the demo started."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    def __call__(self, msg: str) -> None:
        print(f"[demo {time.monotonic() - self.start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    def block(self, text: str) -> None:
        print(text.rstrip(), flush=True)


@dataclass(frozen=True)
class Inputs:
    """What :func:`_preflight` read and checked, before the cluster was touched."""

    window: tracewin.Window
    """The requests the replay sends, at its time scale."""
    docs: list[dict[str, Any]]
    """The example's documents (with ``--model``'s architecture in the PDService)."""


@dataclass
class Ctx:
    """What the steps share."""

    args: argparse.Namespace
    say: Say
    layout: Any
    kube: Kube
    prom: Prometheus | None
    state: dict[str, Any]
    service: str = ""
    slo: dict[str, float] = field(default_factory=dict)
    install: str = "local"
    notes: list[str] = field(default_factory=list)
    operator: subprocess.Popen[bytes] | None = None
    """The local ``gearshift operator`` process, when the demo started one."""
    metrics_target: Path | None = None
    """The sandbox Prometheus' target file of the local operator's ``/metrics``, while it runs."""
    inputs: Inputs | None = None
    """The checked trace window and example (:func:`_preflight`)."""


# ------------------------------------------------------------------------------ 1. sandbox, operator


def _sandbox(args: argparse.Namespace, say: Say) -> tuple[Any, dict[str, Any]]:
    from gearshift.dev.sandbox import cluster
    from gearshift.dev.sandbox.layout import Layout

    layout = Layout.from_env()
    say(f"sandbox: bringing up {layout.name} with fleet {args.fleet} (reused when already up)")
    state = cluster.up(layout, fleet_path=args.fleet, say=lambda m: say(f"  sandbox: {m}"))
    return layout, state


def chart_installable(layout: Any) -> bool:
    """Whether the Helm chart is complete enough to install (templates present, helm built)."""
    chart = names_repo() / "charts" / "gearshift"
    return (
        (chart / "Chart.yaml").exists() and (chart / "templates").is_dir() and layout.binary("helm").exists()
    )


def names_repo() -> Path:
    from gearshift.dev.demo import REPO_ROOT

    return REPO_ROOT


def _start_operator(ctx: Ctx) -> None:
    """Install the chart, or start ``gearshift operator`` as a local child process of the demo."""
    want = ctx.args.install
    if want == "auto":
        want = "helm" if CHART_READY and chart_installable(ctx.layout) else "local"
    ctx.install = want
    ctx.kube.ensure_namespace(SYSTEM_NAMESPACE)
    # The chart binds its namespaced permissions in each watched namespace: it must exist first.
    ctx.kube.ensure_namespace(ctx.args.namespace)
    if want == "helm":
        chart = names_repo() / "charts" / "gearshift"
        # Helm installs a chart's crds/ once and never upgrades them: on a reused sandbox the API server
        # would keep an older schema and prune the status fields newer code writes.
        ctx.kube.run("apply", "--server-side", "--force-conflicts", "-f", str(chart / "crds"))
        ctx.say(f"operator: helm upgrade --install {HELM_RELEASE} {chart} -n {SYSTEM_NAMESPACE}")
        argv = [
            str(ctx.layout.binary("helm")),
            "--kubeconfig",
            str(ctx.layout.kubeconfig),
            "upgrade",
            "--install",
            HELM_RELEASE,
            str(chart),
            "-n",
            SYSTEM_NAMESPACE,
            "--set",
            "sandbox.enabled=true",
            # One replica: the sandbox shares two cores with everything else; a second would only wait as a
            # standby for the Lease.
            "--set",
            "replicaCount=1",
            # The sandbox's fake nodes have little allocatable CPU to spare for the operator pod.
            "--set",
            "resources.requests.cpu=10m",
            "--set",
            "resources.requests.memory=32Mi",
            # Only the demo's namespace: PDServices of other users of a shared sandbox are left alone.
            "--set",
            f"watchNamespaces[0]={ctx.args.namespace}",
            "--set",
            f"prometheusUrl={ctx.state.get('prometheus_url') or ''}",
            # The sandbox Prometheus' pod job scrapes annotated pods: the operator's gearshift_operator_*
            # series (the dashboard's shift panel) come from its pod IP.
            "--set",
            f"ports.metrics={CHART_METRICS_PORT}",
            "--set-string",
            "podAnnotations.prometheus\\.io/scrape=true",
            "--set-string",
            f"podAnnotations.prometheus\\.io/port={CHART_METRICS_PORT}",
            # The operator pod runs this checkout's code: a digest of it rolls the pod when the code changed
            # since the last run on a kept sandbox (Helm's "automatically roll deployments" checksum
            # annotation); otherwise the new code would wait for the pod's next restart.
            "--set-string",
            f"podAnnotations.gearshift\\.io/code-digest={_code_digest()}",
            "--wait",
            "--timeout",
            "180s",
        ]
        proc = subprocess.run(
            argv, capture_output=True, text=True, env=ctx.kube.env, timeout=240, check=False
        )
        if proc.returncode != 0:
            raise DemoError(f"helm install failed: {proc.stderr.strip()[-1500:]}")
        return
    # The CRDs come with the chart; a local operator needs them applied first.
    ctx.kube.run("apply", "--server-side", "--force-conflicts", "-f", str(names_repo() / "crds"))
    log = Path(ctx.layout.logs_dir) / "demo-operator.log"
    # With the sandbox's Prometheus the operator serves its metrics on a loopback port, scraped through a
    # local target file (the dashboard's shift panel reads them); without it, none.
    from gearshift.dev.sandbox.cluster import free_port

    metrics_port = free_port() if ctx.state.get("prometheus_url") else 0
    argv = [
        str(Path(sys.executable).parent / "gearshift"),
        "operator",
        "--kubeconfig",
        str(ctx.layout.kubeconfig),
        "--probe-port",
        "0",
        "--metrics-port",
        str(metrics_port),
        # Only the demo's namespace: PDServices elsewhere (other users of a shared sandbox) are left
        # alone. Nodes and GPUProfiles are cluster-scoped, and kopf serves those cluster-wide regardless.
        "--namespace",
        ctx.args.namespace,
    ]
    if ctx.state.get("prometheus_url"):
        argv += ["--prometheus-url", str(ctx.state["prometheus_url"])]
    env = ctx.layout.subprocess_env()
    # Sandbox mode: probe pods run on the pod runner with the simulated device; profiles are Ready in
    # seconds rather than minutes.
    env.update({"GEARSHIFT_SANDBOX": "1", "GEARSHIFT_PROBE_NAMESPACE": SYSTEM_NAMESPACE})
    log.parent.mkdir(parents=True, exist_ok=True)
    # The demo holds the process handle and stops it by that pid (its own session) when it ends.
    with log.open("ab") as out:
        ctx.operator = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    ctx.say(
        f"operator: started `gearshift operator` locally (pid {ctx.operator.pid}, log {log}); no Helm chart"
    )
    if metrics_port:
        ctx.metrics_target = _announce_local_operator(ctx, metrics_port)
    ctx.notes.append(
        "The operator ran as a local `gearshift operator` process (sandbox mode), not from the Helm chart."
    )


def _announce_local_operator(ctx: Ctx, port: int) -> Path:
    """Write the sandbox Prometheus' target file of the local operator's metrics on ``127.0.0.1:port``,
    labelled as the chart's operator pod would be (namespace, component), one file per demo namespace so
    concurrent demos keep theirs; returns its path (removed by :func:`_stop_operator`)."""
    from gearshift.dev.sandbox.cluster import local_targets_dir
    from gearshift.dev.sandbox.prometheus import label_name, local_target
    from gearshift.dev.sandbox.promsd import write_groups

    labels = {
        "namespace": SYSTEM_NAMESPACE,
        "pod": f"local-operator-{ctx.args.namespace}",
        label_name(names.LABEL_NAME): "gearshift",
        label_name(names.LABEL_COMPONENT): "operator",
    }
    path = local_targets_dir(ctx.layout) / f"operator-{ctx.args.namespace}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_groups(path, local_target(f"127.0.0.1:{port}", labels))
    ctx.say(f"operator: metrics on http://127.0.0.1:{port}/metrics, scraped by the sandbox's Prometheus")
    return path


def _stop_operator(ctx: Ctx) -> None:
    """Stop the local operator the demo started (SIGTERM to its session, SIGKILL after 15 s) and remove
    its Prometheus target file."""
    target, ctx.metrics_target = ctx.metrics_target, None
    try:
        _stop_operator_process(ctx)
    finally:
        # Removed after the process stopped, so Prometheus keeps scraping it to the end.
        if target is not None:
            target.unlink(missing_ok=True)


def _stop_operator_process(ctx: Ctx) -> None:
    proc = ctx.operator
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)
    ctx.say("operator: local process stopped (the cluster and its resources stay)")


def _gpu_nodes(ctx: Ctx) -> list[str]:
    fleet_nodes = set(ctx.state.get("nodes") or [])
    out = []
    for n in ctx.kube.json("get", "nodes")["items"]:
        gpus = int((n.get("status", {}).get("capacity") or {}).get("nvidia.com/gpu", "0") or 0)
        if gpus > 0 and (not fleet_nodes or n["metadata"]["name"] in fleet_nodes):
            out.append(n["metadata"]["name"])
    return sorted(out)


def _wait_profiles(ctx: Ctx) -> str:
    nodes = _gpu_nodes(ctx)
    ctx.say(f"profiles: waiting for a Ready GPUProfile of each of {len(nodes)} GPU nodes")
    shown: dict[str, int] = {"n": -1}

    def ready() -> bool:
        items = ctx.kube.json("get", "gpuprofiles")["items"]
        done = {
            (p.get("spec") or {}).get("nodeName") or p["metadata"]["name"]
            for p in items
            if (p.get("status") or {}).get("phase") == "Ready"
        }
        n = len(set(nodes) & done)
        if n != shown["n"]:
            shown["n"] = n
            ctx.say(f"  profiles: {n}/{len(nodes)} Ready")
        return n == len(nodes)

    wait_until(ready, PROFILE_TIMEOUT_S, "every GPU node's GPUProfile to be Ready", interval_s=2.0)
    table = ctx.kube.run("get", "gpup").stdout
    ctx.say.block("$ kubectl get gpup\n" + table)
    return table


# ---------------------------------------------------------------------------- 2. service and gears


def load_example(path: Path, model_config: Path | None) -> list[dict[str, Any]]:
    """The example's documents; with ``model_config`` (an HF config.json) the PDService serves that model."""
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    if model_config is not None:
        from gearshift.api.modelspec import ModelSpec

        cfg = json.loads(model_config.read_text())
        name = str(cfg.get("_name_or_path") or model_config.stem)
        model = ModelSpec.from_hf_config(name, cfg).to_json()
        for d in docs:
            if d.get("kind") == "PDService":
                d["spec"]["model"] = model
    return docs


#: PDService spec section → the role of the GearSet it names (aggregated ``serving``: role ``both``).
SECTION_ROLES = {"prefill": "prefill", "decode": "decode", "serving": "both"}


def service_gearsets(pds: dict[str, Any]) -> dict[str, str]:
    """Role → GearSet name of a PDService document: ``prefill`` and ``decode`` (disaggregated) or ``both``
    (aggregated, ``spec.serving``), in that order."""
    spec = pds.get("spec") or {}
    return {
        role: str(spec[section]["gearSetRef"]["name"])
        for section, role in SECTION_ROLES.items()
        if isinstance(spec.get(section), dict) and "gearSetRef" in spec[section]
    }


def _remove_previous_run(ctx: Ctx, docs: list[dict[str, Any]]) -> None:
    """Delete the example's objects left by an earlier demo in the namespace and wait for their pods.

    A rerun on a kept cluster would otherwise replay onto the gears the last run shifted to, with
    its GearSet history and engines' queues, and its report would not be of a fresh service.
    """
    ns = ctx.args.namespace
    if ctx.kube.get("pdservice", ctx.service, "-n", ns) is None:
        return
    ctx.say(
        f"service: removing {ctx.service} of an earlier run in {ns}, so this run starts on its initial gears"
    )
    for d in docs:
        ctx.kube.run(
            "delete", d["kind"].lower(), d["metadata"]["name"], "-n", ns, "--ignore-not-found", "--wait=true",
            timeout=PLAN_TIMEOUT_S,
        )  # fmt: skip
    sel = f"{names.LABEL_SERVICE}={ctx.service}"
    wait_until(
        lambda: not ctx.kube.json("get", "pods", "-n", ns, "-l", sel)["items"],
        PLAN_TIMEOUT_S,
        f"the earlier run's pods of {ctx.service} to be gone",
        2.0,
    )


def _apply_service(ctx: Ctx) -> dict[str, dict[str, Any]]:
    assert ctx.inputs is not None  # main sets it from _preflight
    docs = ctx.inputs.docs
    pds = next(d for d in docs if d.get("kind") == "PDService")
    ctx.service = pds["metadata"]["name"]
    slo = pds["spec"].get("slo") or {}
    ctx.slo = {k: float(v) for k, v in slo.items() if isinstance(v, int | float)}
    ns = ctx.args.namespace
    ctx.kube.ensure_namespace(ns)
    _remove_previous_run(ctx, docs)
    ctx.say(
        f"service: applying {ctx.args.example.name} to namespace {ns} "
        f"(model {pds['spec']['model'].get('name')})"
    )
    ctx.say.block(ctx.kube.apply_docs(docs, namespace=ns))
    refs = service_gearsets(pds)

    def planned() -> dict[str, dict[str, Any]] | None:
        out = {}
        for role, gs in refs.items():
            obj = ctx.kube.get("gearset", gs, "-n", ns)
            st = (obj or {}).get("status") or {}
            gears = (obj or {}).get("spec", {}).get("gears") or st.get("plannedGears")
            if not obj or not gears or not st.get("activeGear"):
                return None
            out[role] = obj
        return out

    gearsets = wait_until(
        planned, PLAN_TIMEOUT_S, "the GearSets to hold planned gears and an active gear", 2.0
    )
    models = _node_models(ctx)
    for role, gs in gearsets.items():
        ctx.say.block(gearset_table(role, gs, models))
    return gearsets


def _node_models(ctx: Ctx) -> dict[str, str | None]:
    """Node → GPU model from the GPUProfiles (a GearSet stage names one ``gpuModel`` even when its
    replicas sit on different cards); empty when they cannot be read, so the tables fall back to it."""
    try:
        return {r.name: r.gpu_model for r in _fleet_rows(ctx)}
    except (DemoError, KeyError, ValueError):
        return {}


def _router_url(ctx: Ctx) -> str:
    """Wait for the PDService to be Ready and return ``http://<router pod IP>:<port>`` (never a ClusterIP)."""
    from gearshift.k8s.services import ROUTER_PORT

    ns = ctx.args.namespace
    last: dict[str, str] = {"msg": ""}

    def ready() -> str | None:
        pds = ctx.kube.get("pdservice", ctx.service, "-n", ns) or {}
        st = pds.get("status") or {}
        cond = {c.get("type"): c for c in st.get("conditions") or []}
        why = (cond.get("Ready") or {}).get("message", "")
        msg = f"phase {st['phase']}: {why}" if st.get("phase") else "not reconciled by the operator yet"
        if msg != last["msg"]:
            last["msg"] = msg
            ctx.say(f"  service: {msg}")
        if st.get("phase") != "Ready":
            return None
        sel = f"{names.LABEL_COMPONENT}={names.COMPONENT_ROUTER},{names.LABEL_SERVICE}={ctx.service}"
        for pod in ctx.kube.json("get", "pods", "-n", ns, "-l", sel)["items"]:
            conds = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions") or []}
            ip = pod.get("status", {}).get("podIP")
            if ip and conds.get("Ready") == "True":
                return f"http://{ip}:{ROUTER_PORT}"
        return None

    ctx.say(f"service: waiting for {ctx.service} to be Ready (pods, router)")
    url = wait_until(ready, ctx.args.ready_timeout, f"PDService {ns}/{ctx.service} to be Ready", 2.0)
    ctx.say(f"service: Ready; the router's pod IP is {url} (loopback in the sandbox)")
    return str(url)


# ------------------------------------------------------------------------------------- 3. replay


@dataclass
class Replay:
    """What the replay measured, kept for the report."""

    t0: float
    """Unix time the replay started."""
    perf0: float
    run_s: float
    result: Any
    scrapes: list[series.RouterScrape]
    first_gears: dict[str, str]
    cards: list[cost.CardSample] = field(default_factory=list)
    """The physical cards the service's engine pods held, polled through the run."""


def _card_sample(ctx: Ctx, nodes: dict[str, cost.NodeCards], t: float) -> cost.CardSample:
    """The cards the service's engine pods hold now (every gear's: active, shadow and draining)."""
    sel = f"{names.LABEL_SERVICE}={ctx.service},{names.LABEL_COMPONENT}={names.COMPONENT_ENGINE}"
    pods = ctx.kube.json("get", "pods", "-n", ctx.args.namespace, "-l", sel)["items"]
    return cost.CardSample(t, cost.cards_held(pods, nodes))


def _gear_states(ctx: Ctx, refs: dict[str, str]) -> dict[str, live.GearState]:
    out = {}
    items = {
        g["metadata"]["name"]: g for g in ctx.kube.json("get", "gearsets", "-n", ctx.args.namespace)["items"]
    }
    for role, name in refs.items():
        st = (items.get(name) or {}).get("status") or {}
        out[role] = live.GearState(st.get("activeGear"), st.get("phase"), st.get("targetGear"))
    return out


def _replay(ctx: Ctx, url: str, gearsets: dict[str, dict[str, Any]]) -> tuple[Replay, tracewin.Window]:
    from gearshift.dev.loadgen import run_load

    assert ctx.inputs is not None  # main sets it from _preflight
    win = ctx.inputs.window
    scale = win.time_scale
    due = win.due_s
    ctx.say(
        f"replay: {len(win.requests)} requests of {ctx.args.trace.name} (trace {win.start_s:.0f}–"
        f"{win.start_s + win.span_s:.0f} s) at {scale:g}× → {win.run_s:.0f} s, "
        f"mean {win.mean_rate():.1f} req/s, to {url}"
    )
    refs = {role: gs["metadata"]["name"] for role, gs in gearsets.items()}
    first = {role: str(gs["status"]["activeGear"]) for role, gs in gearsets.items()}
    box: dict[str, Any] = {}
    nodes = cost.node_cards(ctx.kube.json("get", "nodes")["items"])
    cards: list[cost.CardSample] = []
    perf0 = time.perf_counter()
    t0 = time.time()

    def load() -> None:
        try:
            box["result"] = asyncio.run(
                run_load(
                    [url],
                    list(win.requests),
                    time_scale=scale,
                    max_requests=len(win.requests),
                    max_duration_s=win.run_s + 1.0,
                    drain_s=DRAIN_S,
                    stream=True,
                    slo_ttft_ms=ctx.slo.get("ttftMs"),
                    slo_itl_ms=ctx.slo.get("itlMs"),
                )
            )
        except Exception as exc:  # reported by the main thread
            box["error"] = exc

    thread = threading.Thread(target=load, name="loadgen", daemon=True)
    thread.start()
    scrapes: list[series.RouterScrape] = []
    tty = sys.stdout.isatty()
    last_print = 0.0
    gears = {r: live.GearState(g) for r, g in first.items()}
    tick = 0
    while thread.is_alive():
        now = time.perf_counter() - perf0
        # A missed scrape leaves a gap; the next one covers the window.
        with contextlib.suppress(OSError, ValueError, DemoError):
            scrapes.append(series.parse_router_metrics(http_get(url + "/metrics").decode(), now))
        if tick % 2 == 0:
            with contextlib.suppress(DemoError, ValueError):
                gears = _gear_states(ctx, refs)
            # A missed poll leaves the previous sample standing until the next one.
            with contextlib.suppress(DemoError, ValueError, subprocess.TimeoutExpired):
                cards.append(_card_sample(ctx, nodes, time.perf_counter() - perf0))
        tick += 1
        recent = [s for s in scrapes if s.t >= now - LIVE_WINDOW_S]
        w = series.router_window(recent[0], recent[-1]) if len(recent) >= 2 else {}
        line = live.status_line(
            now,
            win.run_s,
            tracewin.issued_by(due, now),
            len(due),
            gears,
            w.get("qps"),
            w.get("ttft_p99_ms"),
            w.get("itl_p99_ms"),
        )
        if tty:
            print("\r" + line, end="", flush=True)
        elif now - last_print >= 15.0:
            print(line, flush=True)
            last_print = now
        thread.join(TICK_S)
    with contextlib.suppress(OSError, ValueError, DemoError):
        scrapes.append(
            series.parse_router_metrics(http_get(url + "/metrics").decode(), time.perf_counter() - perf0)
        )
    if tty:
        print()
    if "error" in box:
        raise DemoError(f"the load generator failed: {box['error']}")
    res = box["result"]
    from gearshift.dev.loadgen import format_table

    ctx.say("replay: done; the load generator measured on the wire:")
    ctx.say.block(format_table(res))
    return Replay(t0, perf0, res.duration_s, res, scrapes, first, cards), win


# ------------------------------------------------------------------------------------- 4. report


def _prom_util(ctx: Ctx, rep: Replay) -> dict[str, list[series.Series]]:
    if ctx.prom is None:
        return {}
    sel = f'namespace="{ctx.args.namespace}",gearshift_io_service="{ctx.service}"'
    expr = f"max by (gearshift_io_role, gearshift_io_gear, stage) (gearshift:stage_utilization{{{sel}}})"
    try:
        res = ctx.prom.query_range(expr, rep.t0, rep.t0 + rep.run_s, TICK_S)
    except (DemoError, OSError) as exc:
        ctx.notes.append(f"Prometheus range query for stage utilisation failed: {exc}")
        return {}
    out: dict[str, list[series.Series]] = {}
    for role in (*names.ROLES, "both"):
        part = [r for r in res if (r.get("metric") or {}).get("gearshift_io_role") == role]
        # An aggregated service has no prefill or decode pods: name only the roles that have series.
        if part:
            out[role] = series.matrix_series(part, rep.t0, ["gearshift_io_gear", "stage"])
    return out


def _prom_engine(ctx: Ctx, rep: Replay) -> dict[str, float]:
    """P99 TTFT on the prefill pods and P99 ITL on the decode pods over the run, from the engines' own
    histograms in Prometheus."""
    if ctx.prom is None:
        return {}
    rng = f"{max(1, math.ceil(rep.run_s))}s"
    sel = f'namespace="{ctx.args.namespace}",gearshift_io_service="{ctx.service}"'
    out = {}
    for key, metric, role in (
        ("prefill_ttft_p99_ms", "vllm:time_to_first_token_seconds_bucket", "prefill"),
        ("decode_itl_p99_ms", "vllm:inter_token_latency_seconds_bucket", "decode"),
        ("decode_ttft_p99_ms", "vllm:time_to_first_token_seconds_bucket", "decode"),
        ("both_ttft_p99_ms", "vllm:time_to_first_token_seconds_bucket", "both"),
        ("both_itl_p99_ms", "vllm:inter_token_latency_seconds_bucket", "both"),
    ):
        pick = f'{metric}{{{sel},gearshift_io_role="{role}"}}'
        expr = f"histogram_quantile(0.99, sum by (le) (increase({pick}[{rng}])))"
        try:
            res = ctx.prom.query(expr, at=rep.t0 + rep.run_s)
            if res:
                v = float(res[0]["value"][1]) * 1e3
                if not math.isnan(v):
                    out[key] = v
        except (DemoError, OSError, ValueError, KeyError, IndexError):
            continue
    return out


def _code_digest() -> str:
    """A SHA-256 (first 16 hex digits) of the gearshift package's Python sources, names and contents."""
    root = Path(gearshift.__file__).resolve().parent
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _twin(
    ctx: Ctx, rep: Replay, win: tracewin.Window, gearsets: dict[str, dict[str, Any]]
) -> dict[str, Any] | None:
    """The twin's replays of the window (virtual time; CPU only): the shifting loop, each static gear and
    each peer layout, or None with a note. The model is the PDService's, the policy and workload those of
    its aggregated GearSet (or its prefill GearSet, for a PD service), the initial gear the one the live run
    started on."""
    from gearshift.api.modelspec import ModelSpec
    from gearshift.dev import twin

    assert ctx.inputs is not None  # main sets it from _preflight
    pds = next(d for d in ctx.inputs.docs if d.get("kind") == "PDService")
    role = "both" if "both" in gearsets else "prefill"
    gs = gearsets.get(role) or {}
    spec = gs.get("spec") or {}
    planned = (
        spec.get("gears") if spec.get("mode") == "explicit" else (gs.get("status") or {}).get("plannedGears")
    )
    wl = (spec.get("plan") or {}).get("workload") or {}
    workload = (int(wl["promptTokens"]), int(wl["outputTokens"])) if wl else None
    ctx.say(
        f"twin: replaying the same {len(win.requests)} requests with the shifting loop, on each static gear "
        "and on each peer layout (virtual time)"
    )
    t = time.monotonic()
    try:
        out = cost.twin_compare(
            win.requests,
            win.time_scale,
            arch=ModelSpec.model_validate(pds["spec"]["model"]).to_model_arch(),
            fleet=ctx.args.fleet,
            slo_ttft_ms=float(ctx.slo.get("ttftMs") or twin.SLO_TTFT_S * 1000),
            slo_itl_ms=float(ctx.slo.get("itlMs") or twin.SLO_ITL_S * 1000),
            role=role,
            policy=spec.get("policy") or {},
            workload=workload,
            # The shifting loop starts where the live run started (its initialGear, else the capacity
            # controller's pick at the policy's expectedArrivalRps), so both runs face the window alike.
            initial_gear=(spec.get("initialGear") or rep.first_gears.get(role)) if role == "both" else None,
            max_model_len=rep.result.max_model_len,
            # An aggregated service's own gears are what the twin's combined engines run; a PD service's
            # prefill gears hold only prefill's share of the fleet, so the twin plans the whole fleet.
            planned=(planned or None) if role == "both" else None,
        )
    except (ValueError, OSError) as exc:  # a bad --model or --fleet (ModelConfigError is a ValueError)
        ctx.notes.append(f"The twin could not replay the window: {exc}")
        return None
    ctx.say(f"twin: {len(out['rows'])} replays in {time.monotonic() - t:.0f} s")
    return out


def _fleet_rows(ctx: Ctx) -> list[plots.NodeRow]:
    rows = []
    for p in ctx.kube.json("get", "gpuprofiles")["items"]:
        st = p.get("status") or {}
        name = (p.get("spec") or {}).get("nodeName") or p["metadata"]["name"]
        if name not in set(ctx.state.get("nodes") or [name]):
            continue
        rows.append(
            plots.NodeRow(
                name=name,
                gpu_model=str(st.get("gpuModel") or "?"),
                gpus=int(st.get("gpuCount") or 1),
                memory_gib=st.get("memoryGiB"),
                score=st.get("computeScore"),
            )
        )
    return sorted(rows, key=lambda r: (-(r.score or 0.0), r.name))


def _write_report(
    ctx: Ctx,
    rep: Replay,
    win: tracewin.Window,
    fleet_table: str,
    gearsets_start: dict[str, dict[str, Any]],
) -> Path:
    out_dir = ctx.args.report_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    ns = ctx.args.namespace
    gs_end = {g["metadata"]["name"]: g for g in ctx.kube.json("get", "gearsets", "-n", ns)["items"]}
    marks: list[series.ShiftMark] = []
    spans: list[series.GearSpan] = []
    gearsets_end = {}
    for role, gs in gearsets_start.items():
        end = gs_end.get(gs["metadata"]["name"], gs)
        gearsets_end[role] = end
        m = series.shift_marks(role, (end.get("status") or {}).get("history") or [], rep.t0)
        marks += m
        spans += series.gear_spans(role, rep.first_gears[role], m, rep.run_s)
    marks.sort(key=lambda m: m.started_s)
    perf_records = series.wire_records(rep.result.records, rep.perf0)
    wire = series.bin_wire(perf_records, BIN_S, rep.run_s)
    router = series.router_series(rep.scrapes, LIVE_WINDOW_S)
    centres, offered = tracewin.offered_rate(win.due_s, BIN_S, rep.run_s)
    offered_s = series.Series("offered", centres, offered)
    title = f"{ctx.service} on the sandbox fleet: {len(win.requests)} requests at {win.time_scale:g}×"
    files: dict[str, str] = {}
    plots.plot_traffic(
        plots.TrafficData(
            run_s=rep.run_s,
            offered_qps=offered_s,
            wire=wire,
            router=router,
            spans=spans,
            marks=marks,
            slo_ttft_ms=ctx.slo.get("ttftMs"),
            slo_itl_ms=ctx.slo.get("itlMs"),
            title=title,
        ),
        out_dir / "traffic.png",
    )
    files["QPS and P99 latency over time, gear shifts marked"] = "traffic.png"
    util = _prom_util(ctx, rep)
    plots.plot_utilization(util, marks, rep.run_s, out_dir / "utilization.png", spans=spans)
    files["Per-stage utilisation over time (Prometheus)"] = "utilization.png"
    ran = {(s.role, s.gear) for s in spans}
    cells = [
        plots.StageCell(role, gear, k, layers, node, (role, gear) in ran)
        for role, gs in gearsets_end.items()
        for gear, k, layers, node in stage_nodes(gs)
    ]
    plots.plot_placement(_fleet_rows(ctx), cells, out_dir / "placement.png")
    files["The fleet and the placement of every gear's stages"] = "placement.png"
    first, last = (rep.scrapes[0], rep.scrapes[-1]) if len(rep.scrapes) >= 2 else (None, None)
    totals: dict[str, float] = {}
    if first and last:
        w = series.router_window(first, last)
        totals = {
            "requests": last.total - first.total,
            "ok": last.ok - first.ok,
            "ttft_p99_ms": w["ttft_p99_ms"],
            "itl_p99_ms": w["itl_p99_ms"],
        }
    mean_util = {
        role: {s.name: sum(s.finite()) / len(s.finite()) for s in ss if s.finite()}
        for role, ss in util.items()
    }
    spend: dict[str, Any] = {}
    if rep.cards:
        # Over the whole run, as the load generator's goodput: the cards serve the requests issued last
        # until they finish, and those count as SLO-met.
        run_s = rep.result.duration_s
        spend = {
            "run": {**cost.run_cost(rep.cards, run_s, rep.result.slo_met), "failed": rep.result.failed},
            "span_s": round(run_s, 1),
        }
        ctx.say(
            f"cost: {spend['run']['gpu_hours']:.4f} GPU-hours over {run_s:.0f} s "
            f"(mean {spend['run']['mean_gpus']} cards, peak {spend['run']['peak_gpus']})"
        )
    else:
        ctx.notes.append("No poll of the service's pods succeeded: the run's GPU-hours are not known.")
    twin_rows = _twin(ctx, rep, win, gearsets_end)
    if twin_rows is not None:
        spend["twin"] = twin_rows
    for role, gs in gearsets_end.items():
        times = summary.policy_times(gs["spec"].get("policy") or {}, win.time_scale)
        if times:
            parts = ", ".join(
                f"{k.removesuffix('S')} {v['run_s']:g} s ({v['trace_s']:g} s)" for k, v in times.items()
            )
            ctx.notes.append(
                f"{role} shifting policy in run seconds (trace seconds at {win.time_scale:g}×): {parts}. "
                "The demo's example scales seed 002's 10-minute dwell down to fit a replay of minutes."
            )
    env_cmd = "gearshift sandbox env"
    explore = [
        f'eval "$(.venv/bin/{env_cmd})"        # KUBECONFIG and PATH for kubectl',
        "kubectl get gearshift -A                # PDServices, GearSets and GPUProfiles",
        f"kubectl get gearsets -n {ns}            # active gear, phase, P99, QPS",
        f"kubectl describe pdservice {ctx.service} -n {ns}",
        f"kubectl get pods -n {ns} -o wide        # stages and the nodes they run on",
        "kubectl get gpup                        # the measured fleet",
        ".venv/bin/gearshift demo --down          # or: make sandbox-down (tear everything down)",
    ]
    data = report.ReportData(
        title="gearshift demo report",
        started=datetime.fromtimestamp(rep.t0, UTC).isoformat(timespec="seconds"),
        command="gearshift demo " + " ".join(shlex.quote(a) for a in sys.argv[2:]),
        cluster=f"sandbox {ctx.layout.name} ({len(ctx.state.get('nodes') or [])} nodes, fleet "
        f"{Path(str(ctx.state.get('fleet', ''))).name}); operator via {ctx.install}",
        namespace=ns,
        service=ctx.service,
        model=str(next(iter(gearsets_start.values()))["spec"].get("serviceName", ctx.service)),
        trace=str(ctx.args.trace),
        window_start_s=win.start_s,
        window_span_s=win.span_s,
        time_scale=win.time_scale,
        requests=len(win.requests),
        run_s=rep.run_s,
        fleet_table=fleet_table,
        gear_tables={role: gearset_table(role, gs, _node_models(ctx)) for role, gs in gearsets_start.items()},
        load=rep.result.to_dict(),
        router_totals=totals,
        marks=marks,
        spans=spans,
        utilization=mean_util,
        engine=_prom_engine(ctx, rep),
        cost=spend,
        plots=files,
        explore=explore,
        notes=ctx.notes,
    )
    (out_dir / "load.json").write_text(json.dumps(rep.result.to_dict(), indent=2))
    wall_s = time.monotonic() - ctx.say.start
    shift_list = summary.shifts(
        {role: (gs.get("status") or {}).get("history") or [] for role, gs in gearsets_end.items()}, rep.t0
    )
    met = goals.evaluate(
        rows=(twin_rows or {}).get("rows") or [],
        live_slo_met=rep.result.slo_met,
        live_failed=rep.result.failed,
        shifts=shift_list,
        issue_s=win.run_s,
        wall_s=wall_s,
    )
    (out_dir / "report.md").write_text(report.render(data) + report.goal_lines(met))
    doc = summary.build(
        command=data.command,
        started=data.started,
        wall_s=wall_s,
        time_scale=win.time_scale,
        window_start_s=win.start_s,
        window_span_s=win.span_s,
        load=data.load,
        router_totals=totals,
        engine=data.engine,
        shift_list=shift_list,
        policies={role: gs["spec"].get("policy") or {} for role, gs in gearsets_end.items()},
        first_gears=rep.first_gears,
        final_gears={role: (gs.get("status") or {}).get("activeGear") for role, gs in gearsets_end.items()},
        cost=spend,
        notes=ctx.notes,
        goals=met,
    )
    text = json.dumps(doc, indent=2) + "\n"
    (out_dir / "summary.json").write_text(text)
    if ctx.args.results is not None:
        ctx.args.results.parent.mkdir(parents=True, exist_ok=True)
        ctx.args.results.write_text(text)
        ctx.say(f"results: {ctx.args.results}")
    return out_dir / "report.md"


# ----------------------------------------------------------------------------------------- main


def _preflight(args: argparse.Namespace) -> Inputs:
    """Read and check the inputs the run uses, before it touches the cluster: the trace and its window,
    the model's config and the example. A mistake costs nothing then: the previous run's service stays.

    Raises:
        DemoError: naming the flag and what is wrong with it.
        TraceError: a bad trace row or column (it names the file and the line).
    """
    from gearshift.dev.loadgen import load_trace

    if not args.trace.exists():
        raise DemoError(f"trace {args.trace} not found (--trace)")
    trace = load_trace(args.trace)
    try:
        scale = args.time_scale or tracewin.auto_time_scale(trace, args.duration)
        window = tracewin.window(trace, scale, args.duration, args.start, getattr(args, "keep_every", 1))
    except ValueError as exc:
        raise DemoError(f"--start/--duration/--time-scale/--keep-every: {exc}") from None
    if args.model is not None:
        from gearshift.facts.model import load_hf_config

        try:
            load_hf_config(args.model)
        except (OSError, ValueError) as exc:
            raise DemoError(f"--model {args.model}: not a readable HF config.json ({exc})") from None
    try:
        docs = load_example(args.example, args.model)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise DemoError(f"--example {args.example}: {exc}") from None
    if not any(d.get("kind") == "PDService" for d in docs):
        raise DemoError(f"--example {args.example}: no PDService in it")
    return Inputs(window, docs)


@contextlib.contextmanager
def _one_demo_at_a_time(state_dir: Path) -> Iterator[None]:
    """Hold the sandbox's demo lock (``<state dir>/demo.lock``, flock) for the run: a second demo would
    delete the first one's service under its replay.

    Raises:
        DemoError: another demo holds it (its pid in the message).
    """
    import fcntl

    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / "demo.lock"
    with path.open("a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "?"
            raise DemoError(
                f"another gearshift demo is running on this sandbox (pid {holder}); wait for it to end, "
                "or stop it (Ctrl-C), then run again"
            ) from None
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def main(args: argparse.Namespace) -> int:
    """Run the demo; returns the exit code."""
    from gearshift.dev.loadgen import LoadgenError
    from gearshift.dev.sandbox import cluster
    from gearshift.dev.sandbox.layout import Layout, SandboxConfigError
    from gearshift.dev.tracefile import TraceError
    from gearshift.facts.fleet import FleetError

    say = Say()
    ctx: Ctx | None = None
    code = 1
    lock = contextlib.ExitStack()
    held = False
    try:
        inputs = _preflight(args)
        lock.enter_context(_one_demo_at_a_time(Layout.from_env().state_dir))
        held = True
        layout, state = _sandbox(args, say)
        kube = Kube(layout.kubeconfig, layout.subprocess_env(), str(layout.binary("kubectl")))
        url = state.get("prometheus_url")
        ctx = Ctx(args, say, layout, kube, Prometheus(url) if url else None, state, inputs=inputs)
        if ctx.prom is None:
            ctx.notes.append("The sandbox ran without Prometheus: no per-stage utilisation plot.")
        _start_operator(ctx)
        fleet_table = _wait_profiles(ctx)
        gearsets = _apply_service(ctx)
        router = _router_url(ctx)
        rep, win = _replay(ctx, router, gearsets)
        path = _write_report(ctx, rep, win, fleet_table, gearsets)
        say(f"report: {path} (and PNG plots beside it)")
        code = 0
    except (
        DemoError,
        SandboxConfigError,
        cluster.SandboxError,
        FleetError,
        LoadgenError,
        TraceError,
        OSError,
        ValueError,
    ) as exc:
        say(f"failed: {exc}")
    except KeyboardInterrupt:
        say("interrupted")
        code = 130
    finally:
        if ctx is not None:
            _stop_operator(ctx)
        lock.close()
        # A run that never held the lock (a bad flag, another demo running) leaves the cluster as it
        # found it, --down included.
        if held and args.down:
            cluster.down(Layout.from_env(), say=lambda m: say(f"  sandbox: {m}"))
            say("sandbox: down")
        elif ctx is not None:
            say("the cluster stays up. Explore it with:")
            lines = [
                f'  eval "$({env_prefix()}.venv/bin/gearshift sandbox env)"',
                "  kubectl get gearshift -A",
                f"  kubectl get gearsets,pods -n {args.namespace} -o wide",
            ]
            if ctx.install == "local":
                # The local operator stopped with the demo: resources stay as they are, and deleting them
                # waits for its finalizers. Say how to run it again.
                lines += [
                    "  the operator stopped with the demo; to keep reconciling (and to delete the service):",
                    f"    GEARSHIFT_SANDBOX=1 .venv/bin/gearshift operator --namespace {args.namespace} \\",
                    f"      --kubeconfig {ctx.layout.kubeconfig} --probe-port 0 --metrics-port 0",
                ]
            lines.append(f"tear down: {env_prefix()}.venv/bin/gearshift sandbox down")
            say.block("\n".join(lines))
    return code
