"""E2E fixtures: a Kubernetes cluster for the tests — the gearshift sandbox, or the user's own cluster.

Which cluster:
  - ``KUBECONFIG`` set in the environment and not the sandbox's own file → that cluster is used as it is
    (e.g. kind); ``sandbox.is_sandbox`` is False, ``prometheus_url`` comes from
    ``GEARSHIFT_PROMETHEUS_URL`` (or is None), and nothing is started or stopped.
  - otherwise the sandbox is brought up with ``gearshift sandbox up`` semantics (``cluster.up``), which
    reuses a sandbox already up (a test cycle then takes seconds), and it is **left up** after the session
    so the next run is fast. Tear it down with ``make sandbox-down`` (``gearshift sandbox down``).

Fixtures (names are stable; other tests rely on them):

``sandbox`` (session) — a :class:`Cluster` with
    ``kubeconfig`` (Path), ``env`` (dict for subprocesses: KUBECONFIG, pinned binaries first on PATH),
    ``bin_dirs`` (list[Path]), ``is_sandbox`` (bool), ``prometheus_url`` (str | None, loopback),
    ``octet`` (the sandbox's pod-IP second octet, or None), ``fleet_file`` (Path | None),
    ``kubectl(*args, check=True, input=None, timeout=60) -> CompletedProcess[str]`` (the pinned kubectl),
    ``kubectl_json(*args) -> dict`` (``kubectl ... -o json``),
    ``apply(manifest: dict | list | str, namespace=None)`` (``kubectl apply -f -``),
    ``helm(*args, check=True, input=None, timeout=180) -> CompletedProcess[str]``,
    ``api_client() -> kubernetes.client.ApiClient`` (a new client each call),
    ``prometheus_query(expr) -> list[dict]`` (instant query's ``data.result``; loopback only),
    ``wait_for(predicate, timeout, what, interval=0.2)``.
``k8s`` (session) — a factory: ``k8s()`` returns a new ``kubernetes.client.ApiClient`` for the cluster.
``namespace`` (function) — creates a unique namespace ``e2e-<test>-<random>`` and deletes it after the
    test (without waiting for it to go).
``wait_for`` (session) — the function below.
``fleet_profiles`` (function) — ``fleet_profiles(api)`` gives the GPU nodes without a GPUProfile one from
    the datasheet, and a gpu-model label (for tests that run no profiling).

``GEARSHIFT_E2E_LOAD=one-core-busy`` runs the whole session with one core taken by a CPU hog
(``harness.machine_load``, the busy machine of ``bench/reliability.py``; "run the failure classes of the
robustness work there too"), e.g. ``GEARSHIFT_E2E=1 GEARSHIFT_E2E_LOAD=one-core-busy .venv/bin/pytest
tests/e2e/test_api_limits.py``. Unset or ``quiet``: the machine as it is.

``wait_for(predicate, timeout, what, interval=0.2)`` calls ``predicate()`` until it returns a truthy value
(returned) or the deadline passes (``AssertionError`` naming ``what`` and the last value or exception).
Tests wait on conditions with it, never with fixed sleeps.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gearshift.api import crdgen
from gearshift.api.common import API_VERSION
from gearshift.k8s import names
from gearshift.k8s.apply_text import apply_text
from gearshift.planner.inputs import datasheet_gpuprofile


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
    """Poll ``predicate`` until truthy (returned) or ``timeout`` s pass (AssertionError naming ``what``)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = predicate()
            if last:
                return last
        except Exception as exc:  # a predicate may fail while the object does not exist yet
            last = exc
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")
        time.sleep(interval)


def _is_loopback_url(url: str) -> bool:
    host = urllib.parse.urlparse(url).hostname or ""
    return host in ("localhost", "::1") or host.startswith("127.")


@dataclass
class Cluster:
    """The cluster under test and the pinned tools to reach it (see the module docstring)."""

    kubeconfig: Path
    env: dict[str, str]
    bin_dirs: list[Path]
    is_sandbox: bool
    prometheus_url: str | None = None
    octet: int | None = None
    fleet_file: Path | None = None
    state: dict[str, Any] = field(default_factory=dict)

    def _run(
        self, tool: str, args: tuple[str, ...], check: bool, input: str | None, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [tool, *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env,
            check=False,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"`{Path(tool).name} {' '.join(args)}` exited {proc.returncode}\n"
                f"stdout: {proc.stdout[-2000:]}\nstderr: {proc.stderr[-2000:]}"
            )
        return proc

    def _tool(self, name: str) -> str:
        for d in self.bin_dirs:
            if (d / name).exists():
                return str(d / name)
        return name

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run the pinned kubectl against the cluster."""
        return self._run(
            self._tool("kubectl"), ("--kubeconfig", str(self.kubeconfig), *args), check, input, timeout
        )

    def kubectl_json(self, *args: str, timeout: float = 60) -> Any:
        """``kubectl <args> -o json``, parsed."""
        return json.loads(self.kubectl(*args, "-o", "json", timeout=timeout).stdout)

    def apply(
        self, manifest: dict[str, Any] | list[dict[str, Any]] | str, namespace: str | None = None
    ) -> None:
        """``kubectl apply -f -`` of one manifest, a list of them, or YAML text."""
        text = manifest if isinstance(manifest, str) else apply_text(manifest)
        ns = ("-n", namespace) if namespace else ()
        self.kubectl("apply", *ns, "-f", "-", input=text)

    def helm(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 180
    ) -> subprocess.CompletedProcess[str]:
        """Run the pinned helm against the cluster."""
        return self._run(
            self._tool("helm"), ("--kubeconfig", str(self.kubeconfig), *args), check, input, timeout
        )

    def api_client(self) -> Any:
        """A new ``kubernetes.client.ApiClient`` for the cluster."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def prometheus_query(self, expr: str, timeout: float = 5) -> list[dict[str, Any]]:
        """An instant PromQL query; returns ``data.result``. Only loopback Prometheus URLs are queried."""
        if not self.prometheus_url:
            raise AssertionError("no Prometheus for this cluster (set GEARSHIFT_PROMETHEUS_URL)")
        if not _is_loopback_url(self.prometheus_url):
            raise AssertionError(f"refusing to query non-loopback Prometheus {self.prometheus_url}")
        url = f"{self.prometheus_url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            body = json.loads(resp.read())
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    @staticmethod
    def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
        """See :func:`wait_for`."""
        return wait_for(predicate, timeout, what, interval)


def _start_sandbox() -> Cluster:
    from gearshift.dev.sandbox import cluster
    from gearshift.dev.sandbox.layout import Layout, SandboxConfigError

    layout = Layout.from_env()
    user_kubeconfig = os.environ.get("KUBECONFIG")
    bin_dirs = layout.bin_dirs
    if user_kubeconfig and Path(user_kubeconfig).resolve() != layout.kubeconfig.resolve():
        env = dict(os.environ)
        env["PATH"] = os.pathsep.join([*(str(d) for d in bin_dirs if d.exists()), env.get("PATH", "")])
        url = os.environ.get("GEARSHIFT_PROMETHEUS_URL") or None
        return Cluster(Path(user_kubeconfig), env, bin_dirs, is_sandbox=False, prometheus_url=url)
    try:
        state = cluster.up(layout, say=cluster.Progress())
    except (SandboxConfigError, cluster.SandboxError, OSError) as exc:
        pytest.fail(f"the sandbox could not be brought up: {exc}", pytrace=False)
    return Cluster(
        kubeconfig=layout.kubeconfig,
        env=layout.subprocess_env(),
        bin_dirs=bin_dirs,
        is_sandbox=True,
        prometheus_url=state.get("prometheus_url"),
        octet=layout.octet,
        fleet_file=Path(state["fleet"]) if state.get("fleet") else None,
        state=state,
    )


#: Labels of the chart's operator Deployment (charts/gearshift/templates/_helpers.tpl).
OPERATOR_SELECTOR = "app.kubernetes.io/name=gearshift,app.kubernetes.io/component=operator"
#: Labels of the engine StatefulSets the operator builds (gearshift.k8s.names).
ENGINE_SELECTOR = "app.kubernetes.io/managed-by=gearshift,app.kubernetes.io/component=engine"


def _pause_installed_operators(cluster: Cluster) -> dict[tuple[str, str, str], int]:
    """Scale every gearshift operator Deployment already in the sandbox to 0; returns what to restore.

    ``make demo`` leaves its Helm-installed operator running, and it handles every GPUProfile and node
    of the cluster: beside the tests' own operators it would probe their private nodes (taking their
    GPUs) and race them on profiles. Its pods are waited out, so none is left acting. The engine
    StatefulSets of its services are scaled to 0 as well (their pods hold GPUs the tests need)."""
    listed = cluster.kubectl_json("get", "deployments", "-A", "-l", OPERATOR_SELECTOR)["items"]
    paused = {}
    for d in listed:
        ns, name = d["metadata"]["namespace"], d["metadata"]["name"]
        if d["spec"].get("replicas", 1):
            paused[("deployment", ns, name)] = int(d["spec"].get("replicas", 1))
            cluster.kubectl("scale", "deployment", name, "-n", ns, "--replicas", "0")
            print(f"e2e: paused the gearshift operator {ns}/{name} for the session (restored afterwards)")
    if paused:
        # With the operator paused nothing reconciles its services: their engine StatefulSets are scaled
        # to 0 too, so that the demo's pods do not hold the GPUs the tests place pods on.
        for sts in cluster.kubectl_json("get", "statefulsets", "-A", "-l", ENGINE_SELECTOR)["items"]:
            ns, name = sts["metadata"]["namespace"], sts["metadata"]["name"]
            if sts["spec"].get("replicas", 1):
                paused[("statefulset", ns, name)] = int(sts["spec"].get("replicas", 1))
                cluster.kubectl("scale", "statefulset", name, "-n", ns, "--replicas", "0")
        if any(k[0] == "statefulset" for k in paused):
            print("e2e: scaled the paused operator's engine StatefulSets to 0 (restored afterwards)")
    for _kind, ns, _name in [k for k in paused if k[0] == "deployment"]:
        wait_for(
            lambda ns=ns: not cluster.kubectl_json("get", "pods", "-n", ns, "-l", OPERATOR_SELECTOR)["items"],
            60,
            f"the paused operator's pods in {ns} to be gone",
            1.0,
        )
    return paused


@pytest.fixture(scope="session", autouse=True)
def session_load() -> Iterator[str]:
    """The machine load the session runs under (``GEARSHIFT_E2E_LOAD``, see the module docstring); the
    hog is bounded to 3 h and ended by its process id."""
    from gearshift.dev.sandbox.harness import machine_load

    with machine_load(os.environ.get("GEARSHIFT_E2E_LOAD") or "quiet", seconds=3 * 3600) as load:
        yield load


@pytest.fixture(scope="session")
def sandbox() -> Iterator[Cluster]:
    """The cluster under test (see the module docstring). The sandbox is left up afterwards; a gearshift
    operator installed in it before the session (``make demo``'s) is paused for the session."""
    cluster = _start_sandbox()
    paused = _pause_installed_operators(cluster) if cluster.is_sandbox else {}
    yield cluster
    # StatefulSets first: the operator, once back, finds its services as it left them.
    for (kind, ns, name), replicas in sorted(paused.items(), key=lambda kv: kv[0][0] != "statefulset"):
        cluster.kubectl("scale", kind, name, "-n", ns, "--replicas", str(replicas), check=False)


@pytest.fixture(scope="session")
def k8s(sandbox: Cluster) -> Callable[[], Any]:
    """Factory of ``kubernetes.client.ApiClient`` objects for the cluster under test."""
    return sandbox.api_client


@pytest.fixture(scope="session", name="wait_for")
def wait_for_fixture() -> Callable[..., Any]:
    """:func:`wait_for` as a fixture."""
    return wait_for


#: The repository the tests run from (its generated CRDs).
REPO = Path(__file__).resolve().parents[2]


def establish_crds(cluster: Cluster) -> None:
    """The generated CRDs applied (``kubectl apply -f crds/``) and established. A custom resource sent
    before its CRD is established is refused NotFound: on a fresh sandbox, test_reconcile's first
    GPUProfile raced the CRDs its operator was installing."""
    cluster.kubectl("apply", "-f", str(REPO / "crds"))
    for kind in crdgen.KINDS:
        cluster.kubectl("wait", "--for=condition=Established", f"crd/{kind.name}", "--timeout=60s")


@pytest.fixture(scope="session", name="establish_crds")
def establish_crds_fixture() -> Callable[[Cluster], None]:
    """:func:`establish_crds` as a fixture."""
    return establish_crds


@pytest.fixture
def fleet_profiles(sandbox: Cluster) -> Callable[[Any], None]:
    """``ensure(api)``: datasheet GPUProfiles and gpu-model labels for the GPU nodes that have none yet
    (profiling is off, or the probe operator has not written them); ``api`` is a ``RestKubeApi`` on the
    cluster under test. The CRDs are established first."""
    establish_crds(sandbox)

    def ensure(api: Any) -> None:
        for node in api.list("v1", "Node"):
            if not (node["status"].get("allocatable") or {}).get("nvidia.com/gpu"):
                continue
            name = node["metadata"]["name"]
            prof = datasheet_gpuprofile(node)
            if api.get(API_VERSION, "GPUProfile", None, name) is None:
                sandbox.apply({k: prof[k] for k in ("apiVersion", "kind", "metadata", "spec")})
                api.patch_status(API_VERSION, "GPUProfile", None, name, prof["status"])
            if names.NODE_GPU_MODEL not in (node["metadata"].get("labels") or {}):
                sandbox.kubectl("label", "node", name, f"{names.NODE_GPU_MODEL}={prof['status']['gpuModel']}")

    return ensure


@pytest.fixture
def namespace(sandbox: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace for one test, deleted afterwards (without waiting)."""
    slug = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:30].strip("-")
    name = f"e2e-{slug}-{uuid.uuid4().hex[:6]}"
    sandbox.kubectl("create", "namespace", name)
    sandbox.wait_for(
        lambda: sandbox.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0,
        30,
        f"the default service account of {name}",
    )
    try:
        yield name
    finally:
        sandbox.kubectl("delete", "namespace", name, "--wait=false", check=False)
