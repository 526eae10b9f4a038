"""The operator of a demo run: the Helm chart installed on the sandbox, or ``gearshift operator`` as a local
child process of the demo (stopped with it), whose ``/metrics`` the sandbox Prometheus scrapes through a
target file of its own."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import gearshift
from gearshift.dev.demo.context import Ctx
from gearshift.dev.demo.kube import DemoError
from gearshift.k8s import names

#: Namespace of the operator (chart release or local process) and of the probe Jobs.
SYSTEM_NAMESPACE = "gearshift-system"
HELM_RELEASE = "gearshift"
#: The chart's operator metrics port (``ports.metrics``), named again in its pod's scrape annotations.
CHART_METRICS_PORT = 9090
#: Whether ``--install auto`` uses the Helm chart (its sandbox install is covered by tests/e2e/test_helm.py);
#: False makes the demo run ``gearshift operator`` as a local process instead (the code the chart's pod runs).
CHART_READY = True


def chart_installable(layout: Any) -> bool:
    """Whether the Helm chart is complete enough to install (templates present, helm built)."""
    chart = names_repo() / "charts" / "gearshift"
    return (
        (chart / "Chart.yaml").exists() and (chart / "templates").is_dir() and layout.binary("helm").exists()
    )


def names_repo() -> Path:
    from gearshift.dev.demo import REPO_ROOT

    return REPO_ROOT


def start_operator(ctx: Ctx) -> None:
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
            f"podAnnotations.gearshift\\.io/code-digest={code_digest()}",
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
    concurrent demos keep theirs; returns its path (removed by :func:`stop_operator`)."""
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


def stop_operator(ctx: Ctx) -> None:
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


def code_digest() -> str:
    """A SHA-256 (first 16 hex digits) of the gearshift package's Python sources, names and contents."""
    root = Path(gearshift.__file__).resolve().parent
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]
