"""Pieces for runs on a shared sandbox: private GPU nodes with GPUProfiles, and the operator as a subprocess.

The e2e tests and the sandbox benchmarks (``bench/*_sandbox.py``) share one sandbox with other users, so
each run makes its own GPU nodes in node pools of its own (a random tag in the pool name), gives every
node a datasheet GPUProfile (Ready at once, no probe pod), optionally declares a time window on it
(``gearshift.io/available-until``), and runs ``gearshift operator`` on its own namespace only,
with the cluster-scoped GPUProfile and Node handlers off (the test writes the profiles itself, and an
operator serving them cluster-wide would race with other users' operators).

Everything here talks to the API server through a :class:`Kubectl` (the pinned kubectl of the sandbox):
tests pass their ``sandbox`` fixture, benchmarks a :class:`gearshift.dev.demo.kube.Kube`-backed adapter from
:func:`kubectl_for_layout`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from gearshift.api import crdgen
from gearshift.api.gpuprofile import GPUProfileStatus
from gearshift.dev.sandbox.nodes import gpu_node_manifest
from gearshift.facts.fleet import FleetNode
from gearshift.facts.gpus import gpu_spec
from gearshift.k8s import names
from gearshift.k8s.apply_text import apply_text
from gearshift.planner.inputs import datasheet_gpuprofile
from gearshift.profiling.profiles import node_view
from gearshift.profiling.window import window_step

T = TypeVar("T")

#: The annotation that declares a node's time window, RFC 3339.
AVAILABLE_UNTIL = "gearshift.io/available-until"


class Kubectl(Protocol):
    """What the harness needs of a cluster: the tests' ``Cluster`` fixture satisfies it."""

    env: dict[str, str]
    kubeconfig: Path
    octet: int | None

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]: ...


#: Llama-3.2-1B's shape (its config.json): 16 layers, hidden 2048, 32/8 heads, head dim 64; the simulated
#: engine's model in the sandbox e2e tests (``PDService.spec.model``).
LLAMA_3_2_1B: dict[str, Any] = {
    "name": "meta-llama/Llama-3.2-1B",
    "numLayers": 16,
    "hiddenSize": 2048,
    "numHeads": 32,
    "numKvHeads": 8,
    "headDim": 64,
    "intermediateSize": 8192,
    "vocabSize": 128256,
    "dtype": "bfloat16",
}


class HarnessError(RuntimeError):
    """A kubectl call of the harness failed; the message carries kubectl's stderr."""


class LayoutKubectl:
    """:class:`Kubectl` over a sandbox :class:`~gearshift.dev.sandbox.layout.Layout` (for benchmarks)."""

    def __init__(self, layout: Any) -> None:
        self.env: dict[str, str] = layout.subprocess_env()
        self.kubeconfig = Path(layout.kubeconfig)
        self.octet: int | None = layout.octet
        self._bin = str(layout.binary("kubectl"))

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run the sandbox's kubectl; raises :class:`HarnessError` on a non-zero exit when ``check``."""
        proc = subprocess.run(
            [self._bin, "--kubeconfig", str(self.kubeconfig), *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env,
            check=False,
        )
        if check and proc.returncode != 0:
            raise HarnessError(f"`kubectl {' '.join(args)}` exited {proc.returncode}: {proc.stderr[-1500:]}")
        return proc


def kubectl_for_layout(layout: Any) -> LayoutKubectl:
    """The harness's view of the sandbox at ``layout`` (``Layout.from_env()`` for the default one)."""
    return LayoutKubectl(layout)


def apply(
    cluster: Kubectl, manifest: dict[str, Any] | list[dict[str, Any]], namespace: str | None = None
) -> str:
    """``kubectl apply -f -`` of one manifest or several (sent as JSON); returns kubectl's output."""
    ns = ("-n", namespace) if namespace else ()
    return cluster.kubectl("apply", *ns, "-f", "-", input=apply_text(manifest)).stdout


def install_crds(cluster: Kubectl) -> None:
    """Apply gearshift's CRDs as this code generates them (server-side) and wait until they are Established.

    A sandbox may hold older CRDs whose schema would prune status fields newer code writes.
    """
    docs = [crdgen.crd(kind) for kind in crdgen.KINDS]
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=apply_text(docs))
    for kind in crdgen.KINDS:
        cluster.kubectl("wait", "--for=condition=Established", f"crd/{kind.name}", "--timeout=60s")


def get_json(cluster: Kubectl, *args: str) -> Any:
    """``kubectl get <args> -o json``, parsed."""
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def pod_ready(pod: dict[str, Any]) -> bool:
    """True when the pod's Ready condition is True and it is not being deleted."""
    conds = (pod.get("status") or {}).get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)
    return ready and not pod["metadata"].get("deletionTimestamp")


def pods(cluster: Kubectl, namespace: str, selector: str) -> list[dict[str, Any]]:
    """The pods of ``namespace`` matching the label ``selector``."""
    return list(get_json(cluster, "pods", "-n", namespace, "-l", selector)["items"])


class GpuNodes:
    """GPU nodes private to one run, in pools ``<prefix>-<tag>-<role>``, each with a datasheet GPUProfile.

    Args:
        cluster: the sandbox.
        prefix: the run's name in pool and node names (``e2e-as``, ``bench-tf``, …).
        cidr_base: first of the 50 podCIDR indices this run's nodes take (the fleet's nodes use indices
            from 1; each user of the shared sandbox keeps to its own block so pod IPs do not collide).
        gpu_replicas: ``nvidia.com/gpu`` advertised per card (2 lets a shadow share a card during a shift).
    """

    def __init__(self, cluster: Kubectl, prefix: str, cidr_base: int = 150, gpu_replicas: int = 1) -> None:
        if cluster.octet is None:
            raise HarnessError("private GPU nodes need the gearshift sandbox (its pod-IP octet is unknown)")
        self.cluster = cluster
        self.prefix = prefix
        self.tag = uuid.uuid4().hex[:6]
        self.cidr_base = cidr_base
        self.gpu_replicas = gpu_replicas
        self.made: list[str] = []
        self._count = 0

    def pool(self, role: str) -> str:
        """The node pool (label ``gearshift.io/node-pool``) of this run's nodes for ``role``."""
        return f"{self.prefix}-{self.tag}-{role}"

    def add(self, model: str, role: str, until: datetime | None = None) -> str:
        """Create one GPU node of ``model`` (a ``gearshift.facts.gpus`` name, e.g. ``A10-24GB``) in
        ``role``'s pool.

        ``until`` declares its time window (annotation and the GPUProfile's ``availableUntil``, as the
        GPUProfile handler would write them). Returns the node's name.
        """
        octet = self.cluster.octet
        assert octet is not None
        name = f"gpu-{self.pool(role)}-{self._count}"
        index = self.cidr_base + (int(self.tag, 16) + self._count) % 50
        self._count += 1
        node = gpu_node_manifest(
            FleetNode(name, self.pool(role), gpu_spec(model), 1, 25, 10),
            index,
            octet,
            gpu_replicas=self.gpu_replicas,
        )
        if until is not None:
            node["metadata"].setdefault("annotations", {})[AVAILABLE_UNTIL] = until.isoformat()
        status = node.pop("status")
        apply(self.cluster, node)
        self.made.append(name)
        self._patch_status("node", name, status)
        prof = datasheet_gpuprofile({**node, "status": status})
        if until is not None:
            step = window_step(
                GPUProfileStatus.model_validate(prof["status"]),
                node_view({**node, "status": status}),  # type: ignore[arg-type]
                None,
                now=datetime.now(UTC),
                generation=None,
            )
            if step is None or step.status.available_until is None:
                raise HarnessError(f"node {name}: the window {until.isoformat()} was not read")
            prof["status"] = step.status.to_json()
        apply(self.cluster, {k: prof[k] for k in ("apiVersion", "kind", "metadata", "spec")})
        self._patch_status("gpuprofile", name, prof["status"])
        return name

    def _patch_status(self, kind: str, name: str, status: dict[str, Any]) -> None:
        self.cluster.kubectl(
            "patch", kind, name, "--subresource=status", "--type=merge", "-p", json.dumps({"status": status})
        )

    def delete(self, name: str) -> None:
        """Delete one node made here and its GPUProfile (without waiting)."""
        for kind in ("node", "gpuprofile"):
            self.cluster.kubectl("delete", kind, name, "--wait=false", "--ignore-not-found")
        if name in self.made:
            self.made.remove(name)

    def delete_all(self) -> list[str]:
        """Delete every node and profile made; returns those the API server still has (should be [])."""
        for name in self.made:
            for kind in ("node", "gpuprofile"):
                self.cluster.kubectl("delete", kind, name, "--wait=false", "--ignore-not-found", check=False)
        left = []
        for name in self.made:
            for kind in ("node", "gpuprofile"):
                r = self.cluster.kubectl("get", kind, name, "--ignore-not-found", "-o", "name", check=False)
                if r.stdout.strip():
                    left.append(f"{kind}/{name}")
        return left


#: Runs ``gearshift operator`` from this interpreter, whatever console scripts are installed.
_OPERATOR_CODE = (
    "import argparse, sys; from gearshift.handlers import main as m; "
    "p = argparse.ArgumentParser(); m.add_arguments(p); sys.exit(m.run(p.parse_args(sys.argv[1:])))"
)


class OperatorProcess:
    """``gearshift operator`` as a subprocess on one namespace, its output in ``log``; stopped by its pid.

    The GPUProfile and Node handlers are disabled (see the module docstring); ``extra_args`` are added
    to the command line (e.g. ``["--prometheus-url", url]``).
    """

    def __init__(
        self, cluster: Kubectl, namespace: str, log: Path, extra_args: list[str] | None = None
    ) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.log = log
        self.extra_args = list(extra_args or [])
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        """Start the process (again, after :meth:`kill`); output appends to ``log``."""
        argv = [
            sys.executable, "-c", _OPERATOR_CODE, "--kubeconfig", str(self.cluster.kubeconfig),
            "--namespace", self.namespace, "--probe-port", "0", "--metrics-port", "0",
            "--disable", "gearshift.handlers.gpuprofile", "--disable", "gearshift.handlers.nodes",
            *self.extra_args,
        ]  # fmt: skip
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=self.cluster.env)

    @property
    def running(self) -> bool:
        """The process was started and has not exited."""
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL (a crash, for restart tests)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 20 s."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def log_tail(self, chars: int = 4000) -> str:
        """The last ``chars`` characters of the operator's output."""
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


def teardown_run(
    cluster: Kubectl,
    namespace: str,
    operator: OperatorProcess | None = None,
    nodes: GpuNodes | None = None,
    wait_s: float = 30.0,
) -> list[str]:
    """Remove one run: its PDServices and GearSets, the operator, the namespace, then its nodes.

    The custom resources go first, while ``operator`` still runs, so that its finalizers release them;
    after ``wait_s`` s (or at once without an operator) whatever is left loses its finalizers, since no
    operator will serve them and a namespace holding them stays Terminating in a shared sandbox. The
    namespace is deleted without waiting. Returns the nodes and profiles the API server still has
    (``GpuNodes.delete_all``; should be ``[]``).
    """
    kinds = "pdservice,gearset"
    cluster.kubectl("delete", kinds, "--all", "-n", namespace, "--wait=false", check=False)
    deadline = time.monotonic() + (wait_s if operator is not None and operator.running else 0.0)

    def left() -> list[str]:
        r = cluster.kubectl("get", kinds, "-n", namespace, "-o", "name", check=False)
        return r.stdout.split() if r.returncode == 0 else []

    while left() and time.monotonic() < deadline:
        time.sleep(1.0)
    if operator is not None:
        operator.stop()
    for obj in left():
        cluster.kubectl(
            "patch",
            obj,
            "-n",
            namespace,
            "--type=merge",
            "-p",
            '{"metadata":{"finalizers":null}}',
            check=False,
        )
    cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
    return nodes.delete_all() if nodes is not None else []


def wait_until(predicate: Callable[[], T | None], timeout_s: float, what: str, interval_s: float = 2.0) -> T:
    """Poll ``predicate`` every ``interval_s`` s until it returns something truthy, which is returned.

    Raises:
        TimeoutError: ``timeout_s`` s passed; the message names ``what``.
    """
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def serving_router_url(
    cluster: Kubectl, namespace: str, service: str, heads: int, describe: Callable[[], str] = lambda: ""
) -> str:
    """Wait until ``heads`` pipeline heads (stage-0 pods) of PDService ``service`` and its router pod are
    Ready; return the router's URL on its (loopback) pod IP.

    Raises:
        AssertionError: a wait timed out (heads 240 s, router 180 s) or the pod IP is not loopback; the
            message ends with ``describe()`` (e.g. the operator's log).
    """
    from gearshift.k8s.services import ROUTER_PORT

    head_sel = f"{names.LABEL_SERVICE}={service},{names.LABEL_STAGE}=0"
    router_sel = f"{names.LABEL_SERVICE}={service},{names.LABEL_COMPONENT}={names.COMPONENT_ROUTER}"

    def router_ip() -> str | None:
        ready = [p for p in pods(cluster, namespace, router_sel) if pod_ready(p)]
        return str(ready[0]["status"]["podIP"]) if ready else None

    try:
        wait_until(lambda: sum(map(pod_ready, pods(cluster, namespace, head_sel))) == heads, 240,
                   f"{heads} pipeline heads Ready", interval_s=0.5)  # fmt: skip
        ip = wait_until(router_ip, 180, "the router pod Ready", interval_s=0.5)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\n{describe()}") from None
    assert ip.startswith("127."), f"router pod IP {ip} is not loopback"
    return f"http://{ip}:{ROUTER_PORT}"


def burner(seconds: float) -> subprocess.Popen[bytes]:
    """One process that keeps one core busy for ``seconds`` s: a Python busy loop in its own session, to be
    ended by its process id (the busy machine of ``bench/reliability.py`` and the status-truth e2e tests)."""
    code = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


@contextlib.contextmanager
def machine_load(load: str, seconds: float = 600.0) -> Iterator[str]:
    """``"quiet"``: the machine as it is; ``"one-core-busy"``: with one :func:`burner` for the block (at
    most ``seconds`` s), ended by its process id on the way out.

    Raises:
        ValueError: another ``load``.
    """
    if load not in ("quiet", "one-core-busy"):
        raise ValueError(f"load {load!r}: use 'quiet' or 'one-core-busy'")
    hog = burner(seconds) if load == "one-core-busy" else None
    try:
        yield load
    finally:
        if hog is not None:
            os.killpg(hog.pid, signal.SIGTERM)
            hog.wait(10)


def holds(predicate: Callable[[], object], duration_s: float, what: str, interval_s: float = 0.5) -> None:
    """Check ``predicate`` every ``interval_s`` s for ``duration_s`` s: it must stay truthy throughout.

    For "nothing happens" (no object moved, no replica added): a fixed sleep followed by one look would
    miss a change undone within the window, and would wait out the window even after a failure.

    Raises:
        AssertionError: ``predicate`` was falsy at some check (the message names ``what`` and when).
    """
    start = time.monotonic()
    while True:
        if not predicate():
            raise AssertionError(f"{what}: no longer true after {time.monotonic() - start:.1f} s")
        if time.monotonic() - start >= duration_s:
            return
        time.sleep(interval_s)


def settled(read: Callable[[], T], quiet_s: float, interval_s: float = 0.5) -> T | None:
    """``read()``'s value once it stayed the same for ``quiet_s`` s, else ``None`` (it moved): for
    :func:`wait_until` or the e2e ``wait_for``, to wait until reconciles settle instead of sleeping."""
    first = read()
    end = time.monotonic() + quiet_s
    while time.monotonic() < end:
        time.sleep(interval_s)
        if read() != first:
            return None
    return first


class Periodic(Generic[T]):
    """Calls ``sample()`` every ``interval_s`` s on a daemon thread between :meth:`start` and :meth:`stop`.

    Results go to ``samples`` in order; a call that raises is counted in ``errors`` and sampling goes on
    (a slow API server on a busy machine must not end a benchmark's timeline).
    """

    def __init__(self, sample: Callable[[], T], interval_s: float) -> None:
        self._sample = sample
        self.interval_s = interval_s
        self.samples: list[T] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                self.samples.append(self._sample())
            except Exception:
                self.errors += 1
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - t0)))

    def start(self) -> None:
        """Start sampling (the first sample at once)."""
        self._thread = threading.Thread(target=self._loop, name="sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop and wait for the thread (at most 30 s)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
