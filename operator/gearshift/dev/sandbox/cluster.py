"""Bring the sandbox up, tear it down, report its status.

``up`` is idempotent and repairs what it finds: it checks each part (the kwokctl cluster's control-plane
processes, the nodes, Prometheus, the pod runner), keeps what is healthy and (re)starts what is not, so
a second ``up`` on a healthy sandbox takes about a second and a crashed one is cleaned up and replaced.
``down`` stops only what this sandbox started: kwokctl's processes of *this* cluster name (kwokctl keeps
their pids in the state directory), and the pid-file-recorded Prometheus, pod runner and pod processes.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import hashlib
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gearshift.dev.sandbox import procs
from gearshift.dev.sandbox.layout import REPO_ROOT, Layout, SandboxConfigError
from gearshift.dev.sandbox.nodes import sandbox_nodes
from gearshift.dev.sandbox.prometheus import prometheus_argv, prometheus_config
from gearshift.dev.sandbox.stages import (
    kwok_configuration,
    kwokctl_configuration,
    load_default_stages,
    sandbox_stages,
)
from gearshift.facts.fleet import load_fleet

DEFAULT_FLEET = REPO_ROOT / "examples" / "fleets/mixed.yaml"
#: Control-plane components kwokctl runs for us; all must be alive for the sandbox to count as up.
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok-controller")
#: Annotation on the nodes ``up`` created from the fleet file (value: the sandbox name).
MANAGED_ANNOTATION = "gearshift.io/sandbox"
CREATE_TIMEOUT_S = 180
NODES_READY_TIMEOUT_S = 60
PROMETHEUS_READY_TIMEOUT_S = 30

Say = Callable[[str], None]


@dataclass
class Progress:
    """Prints progress lines with the seconds since start."""

    quiet: bool = False
    start: float = field(default_factory=time.monotonic)

    def __call__(self, msg: str) -> None:
        if not self.quiet:
            print(f"[sandbox {time.monotonic() - self.start:5.1f}s] {msg}", file=sys.stderr, flush=True)


class SandboxError(RuntimeError):
    """The sandbox could not be brought up; the message says what failed and where its log is."""


# --------------------------------------------------------------------------------------------- state


def read_state(layout: Layout) -> dict[str, Any]:
    """The sandbox's recorded state (``state.json``), or ``{}`` when there is none."""
    try:
        data = json.loads(layout.state_file.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_state(layout: Layout, state: dict[str, Any]) -> None:
    layout.state_dir.mkdir(parents=True, exist_ok=True)
    tmp = layout.state_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2, sort_keys=True))
    tmp.replace(layout.state_file)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


# ------------------------------------------------------------------------------------- control plane


def component_pids(layout: Layout) -> dict[str, int | None]:
    """Pid of each control-plane component kwokctl started for this sandbox, None when not alive."""
    out: dict[str, int | None] = {}
    for comp in COMPONENTS:
        pid: int | None = None
        try:
            candidate = int((layout.cluster_dir / "pids" / f"{comp}.pid").read_text().strip())
            cmd = Path(f"/proc/{candidate}/cmdline").read_bytes().split(b"\0")[0].decode()
            # kwokctl starts the binary through a symlink named after the component.
            if Path(cmd).name in (comp, "kwok") or comp in cmd:
                pid = candidate
        except (OSError, ValueError):
            pid = None
        out[comp] = pid
    return out


def _kwokctl(
    layout: Layout, *args: str, check: bool = True, timeout: float = 300
) -> subprocess.CompletedProcess:
    env = layout.subprocess_env()
    argv = [str(layout.binary("kwokctl")), "--name", layout.name, *args]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise SandboxError(f"`kwokctl {' '.join(args)}` failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc


def api_ready(layout: Layout, timeout: float = 3.0) -> bool:
    """True when the sandbox's API server answers ``/readyz``."""
    if not layout.kubeconfig.exists():
        return False
    proc = subprocess.run(
        [str(layout.binary("kubectl")), "--kubeconfig", str(layout.kubeconfig), "get", "--raw", "/readyz"],
        capture_output=True,
        text=True,
        timeout=timeout + 5,
        check=False,
        env=layout.subprocess_env(),
    )
    return proc.returncode == 0 and proc.stdout.strip() == "ok"


def _control_plane_healthy(layout: Layout) -> bool:
    return all(component_pids(layout).values()) and api_ready(layout)


def _create_cluster(layout: Layout, say: Say) -> None:
    kube_version = layout.versions["KUBE_VERSION"]
    binaries = {
        n: layout.binary(n)
        for n in ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "etcd", "kwok")
    }
    docs = [
        kwokctl_configuration(binaries, kube_version),
        kwok_configuration(layout.octet),
        *sandbox_stages(load_default_stages(layout.kwok_stages_dir)),
    ]
    cfg = layout.state_dir / "kwok-config.yaml"
    cfg.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    say(f"creating cluster {layout.name} (kwokctl, binary runtime, Kubernetes {kube_version})")
    _kwokctl(
        layout,
        "--config",
        str(cfg),
        "create",
        "cluster",
        "--runtime",
        "binary",
        # Keep the user's ~/.kube/config untouched: the sandbox has its own kubeconfig.
        "--kubeconfig",
        "",
        "--wait",
        f"{CREATE_TIMEOUT_S}s",
        timeout=CREATE_TIMEOUT_S + 60,
    )


def _delete_cluster(layout: Layout, say: Say) -> None:
    if layout.cluster_dir.exists():
        say(f"deleting cluster {layout.name}")
        proc = _kwokctl(layout, "delete", "cluster", check=False, timeout=120)
        if proc.returncode != 0:
            say(f"kwokctl delete failed ({proc.stderr.strip()[-300:]}); stopping its recorded processes")
            for pid in component_pids(layout).values():
                if pid:
                    procs.terminate(pid)
        shutil.rmtree(layout.cluster_dir, ignore_errors=True)


# --------------------------------------------------------------------------------------------- nodes


def kube_client(kubeconfig: Path) -> Any:
    """A ``kubernetes.client.ApiClient`` for ``kubeconfig`` (imported lazily: ``gearshift`` starts fast)."""
    from kubernetes import config as kconfig

    return kconfig.new_client_from_config(config_file=str(kubeconfig))


def sync_nodes(layout: Layout, manifests: list[dict[str, Any]], say: Say) -> None:
    """Create or update the sandbox nodes to match ``manifests``; delete sandbox nodes not listed.

    Labels, annotations, taints and status (capacity, allocatable, addresses) are patched in place; a node
    whose podCIDR must change (immutable) is recreated. Only nodes carrying ``MANAGED_ANNOTATION`` (set
    here) are ever deleted.
    """
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    core = client.CoreV1Api(kube_client(layout.kubeconfig))
    existing: dict[str, client.V1Node] = {n.metadata.name: n for n in core.list_node().items}  # type: ignore[union-attr,misc]  # a stored object always has metadata.name
    created = updated = 0
    for m in manifests:
        m = copy.deepcopy(m)
        # Marks the nodes `up` owns: nodes that tests add themselves are never removed here.
        m["metadata"]["annotations"][MANAGED_ANNOTATION] = layout.name
        name = m["metadata"]["name"]
        node = existing.pop(name, None)
        if node is not None and node.spec.pod_cidr != m["spec"]["podCIDR"]:  # type: ignore[union-attr]  # a Node always has a spec
            core.delete_node(name)
            node = None
        if node is None:
            try:
                core.create_node(m)  # type: ignore[arg-type]  # the client sends a dict body as it is
                created += 1
            except ApiException as exc:
                if exc.status != 409:
                    raise
        elif _node_differs(node, m):
            live = [{"key": t.key, "value": t.value, "effect": t.effect} for t in node.spec.taints or []]  # type: ignore[union-attr]  # a Node always has a spec
            # Taints are replaced as a list: keep the ones others set (node lifecycle, tests).
            taints = live + [t for t in m["spec"].get("taints", []) if t not in live]
            core.patch_node(name, {"metadata": m["metadata"], "spec": {"taints": taints or None}})
            updated += 1
        else:
            continue
        # Node status is a subresource: creation keeps it, but updates go through it.
        core.patch_node_status(name, {"status": m["status"]})
    stale = [n for n, obj in existing.items() if MANAGED_ANNOTATION in (obj.metadata.annotations or {})]  # type: ignore[union-attr]  # a stored object always has metadata
    for name in stale:
        core.delete_node(name)
    say(f"nodes: {created} created, {updated} updated, {len(stale)} removed")


#: Node annotations a controller owns once the node exists: kube-controller-manager's TTL controller sets
#: ``node.alpha.kubernetes.io/ttl`` by cluster size (0 s up to 100 nodes, then 15, 30, 60), so comparing
#: it made a second ``up`` of a 1,000-node sandbox rewrite every node (6.5 min), and the controller set
#: it back.
CONTROLLER_OWNED_ANNOTATIONS = frozenset({"node.alpha.kubernetes.io/ttl"})


def _node_differs(node: Any, manifest: dict[str, Any]) -> bool:
    """True when the live node lacks a label, annotation (but those of
    :data:`CONTROLLER_OWNED_ANNOTATIONS`), taint or capacity figure of ``manifest``."""
    meta, live_status = manifest["metadata"], node.status
    labels, annotations = node.metadata.labels or {}, node.metadata.annotations or {}
    if any(labels.get(k) != v for k, v in meta["labels"].items()):
        return True
    mine = {k: v for k, v in meta["annotations"].items() if k not in CONTROLLER_OWNED_ANNOTATIONS}
    if any(annotations.get(k) != v for k, v in mine.items()):
        return True
    taints = [{"key": t.key, "value": t.value, "effect": t.effect} for t in node.spec.taints or []]
    if any(t not in taints for t in manifest["spec"].get("taints", [])):
        return True
    capacity = live_status.capacity or {}
    return any(capacity.get(k) != v for k, v in manifest["status"]["capacity"].items())


def _ready_timeout(nodes: int) -> float:
    """How long ``up`` waits for the nodes to be Ready: 60 s, or 0.1 s a node for large fleets."""
    return max(NODES_READY_TIMEOUT_S, nodes / 10)


def wait_nodes_ready(layout: Layout, names: list[str], timeout_s: float = NODES_READY_TIMEOUT_S) -> None:
    """Wait until every node of ``names`` has condition Ready=True. Raises SandboxError at the deadline."""
    from kubernetes import client

    core = client.CoreV1Api(kube_client(layout.kubeconfig))
    deadline = time.monotonic() + timeout_s
    pending = set(names)
    while time.monotonic() < deadline:
        for n in core.list_node().items:
            conds = {c.type: c.status for c in (n.status.conditions or [])}  # type: ignore[union-attr]  # a Node always has a status
            if conds.get("Ready") == "True":
                pending.discard(n.metadata.name)  # type: ignore[union-attr]  # a stored object always has metadata
        if not pending:
            return
        time.sleep(0.5)
    raise SandboxError(
        f"nodes not Ready after {timeout_s:.0f}s: {sorted(pending)}; see {layout.cluster_dir}/logs"
    )


# ---------------------------------------------------------------------------------------- prometheus


def _prometheus_binary() -> str | None:
    return shutil.which("prometheus") or (
        "/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists() else None
    )


def prometheus_ready(url: str, timeout: float = 2.0) -> bool:
    """True when the Prometheus at ``url`` (a loopback URL) answers ``/-/ready``."""
    try:
        with urllib.request.urlopen(f"{url}/-/ready", timeout=timeout) as resp:
            return int(resp.status) == 200
    except OSError:
        return False


def local_targets_dir(layout: Layout) -> Path:
    """Where local processes (the demo's ``gearshift operator``) put their ``file_sd`` files for the
    sandbox Prometheus' ``gearshift-local`` job (``prometheus.local_target``)."""
    return layout.state_dir / "prometheus" / "local-targets"


def _ensure_prometheus(layout: Layout, state: dict[str, Any], say: Say) -> str:
    binary = _prometheus_binary()
    if binary is None:
        raise SandboxError(
            "prometheus is not installed: run `apt-get install -y --no-install-recommends prometheus` "
            "(Debian's package), or `gearshift sandbox up --no-prometheus`"
        )
    pdir = layout.state_dir / "prometheus"
    pdir.mkdir(parents=True, exist_ok=True)
    targets = pdir / "pod-targets.json"
    sd_pidfile = layout.run_dir / "promsd.pid"
    sd_code = code_fingerprint("promsd", "prometheus")
    if procs.running(sd_pidfile) is None or state.get("promsd_code") != sd_code:
        procs.stop(sd_pidfile)
        state["promsd_code"] = sd_code
        sd_argv = [
            sys.executable,
            "-m",
            "gearshift.dev.sandbox.promsd",
            "--kubeconfig",
            str(layout.kubeconfig),
            "--out",
            str(targets),
        ]
        procs.start(sd_pidfile, sd_argv, layout.logs_dir / "promsd.log")
        say("prometheus: pod discovery (API server → file_sd) started")
    local = local_targets_dir(layout)
    local.mkdir(exist_ok=True)
    cfg = pdir / "prometheus.yml"
    text = yaml.safe_dump(prometheus_config(targets, local_targets_dir=local), sort_keys=False)
    changed = not cfg.exists() or cfg.read_text() != text
    cfg.write_text(text)
    pidfile = layout.run_dir / "prometheus.pid"
    port = state.get("prometheus_port")
    url = f"http://127.0.0.1:{port}" if port else ""
    if port and procs.running(pidfile) and prometheus_ready(url):
        if changed:
            req = urllib.request.Request(f"{url}/-/reload", method="POST")
            urllib.request.urlopen(req, timeout=5).close()
            say("prometheus: configuration reloaded")
        return url
    procs.stop(pidfile)
    if not (isinstance(port, int) and _port_free(port)):
        port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = prometheus_argv(binary, cfg, pdir / "data", port)
    proc = procs.start(pidfile, argv, layout.logs_dir / "prometheus.log")
    state["prometheus_port"] = port
    deadline = time.monotonic() + PROMETHEUS_READY_TIMEOUT_S
    while not prometheus_ready(url):
        code = proc.poll()
        if code is not None or time.monotonic() > deadline:
            why = (
                f"exited with {code}"
                if code is not None
                else f"not ready after {PROMETHEUS_READY_TIMEOUT_S}s"
            )
            raise SandboxError(f"prometheus {why}; see {layout.logs_dir / 'prometheus.log'}")
        time.sleep(0.3)
    say(f"prometheus: started at {url}")
    return url


# ---------------------------------------------------------------------------------------- pod runner


def _runner_argv(layout: Layout, light: bool = False) -> list[str]:
    return [
        sys.executable,
        "-m",
        "gearshift.dev.sandbox.podrunner",
        "--kubeconfig",
        str(layout.kubeconfig),
        "--pods-dir",
        str(layout.pods_dir),
        "--venv-bin",
        str(layout.venv_bin),
        "--hostpath-root",
        str(layout.hostpath_root),
        *(["--vllm-bin", str(layout.vllm_bin)] if layout.vllm_installed else []),
        *(["--light"] if light else []),
    ]


def code_fingerprint(*modules: str) -> str:
    """A hash of the sandbox modules' sources: a helper process started from older code is restarted."""
    h = hashlib.sha256()
    for name in modules:
        h.update((Path(__file__).parent / f"{name}.py").read_bytes())
    return h.hexdigest()[:12]


def _ensure_runner(layout: Layout, state: dict[str, Any], say: Say, light: bool = False) -> int:
    pidfile = layout.run_dir / "podrunner.pid"
    code = code_fingerprint(
        "podrunner", "containers", "podstatus", "podinputs", "runlog", "podspec", "procs", "nodes", "mountns"
    )
    code += "+vllm" if layout.vllm_installed else ""
    code += "+light" if light else ""
    pid = procs.running(pidfile)
    if pid is not None and state.get("podrunner_code") == code:
        return pid
    if procs.stop(pidfile):
        say("pod runner: code changed, restarting (its pods' processes restart too)")
    pid = procs.start(pidfile, _runner_argv(layout, light), layout.logs_dir / "podrunner.log").pid
    state["podrunner_code"] = code
    say(f"pod runner: started (pid {pid}, log {layout.logs_dir / 'podrunner.log'})")
    return pid


# ------------------------------------------------------------------------------------------ commands


@contextlib.contextmanager
def _locked(layout: Layout, say: Say) -> Iterator[None]:
    """Hold the sandbox's lock: concurrent ``up``/``down`` (parallel test sessions) run one at a time."""
    layout.state_dir.mkdir(parents=True, exist_ok=True)
    with (layout.state_dir / "lock").open("w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say("waiting for another `gearshift sandbox` command on this sandbox")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def up(
    layout: Layout,
    fleet_path: Path = DEFAULT_FLEET,
    cpu_nodes: int = 2,
    prometheus: bool = True,
    say: Say | None = None,
    light_pods: bool = False,
) -> dict[str, Any]:
    """Bring the sandbox up (or check and repair it) and return its state.

    ``light_pods`` runs the pod runner in light mode (containers are forks of it, see ``podrunner``):
    for fleets of hundreds of nodes, whose probe Jobs and engine pods could not run as programs.

    Raises:
        SandboxConfigError: binaries missing (names them and the build command).
        FleetError: a bad fleet file.
        SandboxError: a part did not start; names its log.
    """
    say = say or Progress()
    with _locked(layout, say):
        return _up(layout, fleet_path, cpu_nodes, prometheus, say, light_pods)


def _up(
    layout: Layout, fleet_path: Path, cpu_nodes: int, prometheus: bool, say: Say, light_pods: bool = False
) -> dict[str, Any]:
    missing = layout.missing_binaries()
    if missing:
        raise SandboxConfigError(
            f"missing sandbox binaries: {', '.join(missing)}; build them with `make binaries` "
            "(bash e2e/sandbox/build.sh; 15-40 min cold on 2 cores, cached afterwards)"
        )
    fleet = load_fleet(fleet_path)
    manifests = sandbox_nodes(fleet, layout.octet, cpu_nodes)
    layout.state_dir.mkdir(parents=True, exist_ok=True)
    state = read_state(layout)
    if _control_plane_healthy(layout):
        say(f"cluster {layout.name}: already up")
    else:
        if layout.cluster_dir.exists():
            say(f"cluster {layout.name}: found but not healthy; cleaning up")
        _stop_local(layout, say)
        _delete_cluster(layout, say)
        _create_cluster(layout, say)
        state = {k: v for k, v in state.items() if k == "prometheus_port"}
        state["created"] = time.time()
    sync_nodes(layout, manifests, say)
    wait_nodes_ready(layout, [m["metadata"]["name"] for m in manifests], _ready_timeout(len(manifests)))
    state.update(
        {
            "name": layout.name,
            "octet": layout.octet,
            "kubeconfig": str(layout.kubeconfig),
            "fleet": str(Path(fleet_path).resolve()),
            "nodes": [m["metadata"]["name"] for m in manifests],
            "bin_dirs": [str(d) for d in layout.bin_dirs],
        }
    )
    if prometheus:
        state["prometheus_url"] = _ensure_prometheus(layout, state, say)
    else:
        procs.stop(layout.run_dir / "prometheus.pid")
        procs.stop(layout.run_dir / "promsd.pid")
        state["prometheus_url"] = None
    state["podrunner_pid"] = _ensure_runner(layout, state, say, light_pods)
    state["light_pods"] = light_pods
    _write_state(layout, state)
    return state


def _stop_local(layout: Layout, say: Say) -> None:
    """Stop the pod runner, the pod processes it left and Prometheus (only processes we recorded)."""
    if procs.stop(layout.run_dir / "podrunner.pid"):
        say("pod runner: stopped")
    # The runner stops its pods on SIGTERM; pid files left behind mean it died first.
    for pidfile in sorted(layout.pods_dir.glob("*/*.pid")) if layout.pods_dir.exists() else []:
        if procs.stop(pidfile, timeout_s=5):
            say(f"pod process {pidfile.parent.name}: stopped")
    if procs.stop(layout.run_dir / "prometheus.pid"):
        say("prometheus: stopped")
    if procs.stop(layout.run_dir / "promsd.pid"):
        say("prometheus pod discovery: stopped")


def down(layout: Layout, say: Say | None = None) -> None:
    """Stop everything this sandbox started and delete its cluster; keeps ``logs/`` for post-mortems."""
    say = say or Progress()
    with _locked(layout, say):
        _stop_local(layout, say)
        _delete_cluster(layout, say)
        shutil.rmtree(layout.pods_dir, ignore_errors=True)
        shutil.rmtree(layout.state_dir / "prometheus", ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            layout.state_file.unlink()
    say("down")


def status(layout: Layout) -> dict[str, Any]:
    """A snapshot of the sandbox: components alive, API ready, Prometheus and runner, node count."""
    state = read_state(layout)
    comps = component_pids(layout)
    ready = api_ready(layout) if all(comps.values()) else False
    url = state.get("prometheus_url")
    return {
        "name": layout.name,
        "state_dir": str(layout.state_dir),
        "kubeconfig": str(layout.kubeconfig),
        "octet": layout.octet,
        "components": comps,
        "api_ready": ready,
        "prometheus_url": url,
        "prometheus_ready": bool(url and prometheus_ready(url)),
        "podrunner_pid": procs.running(layout.run_dir / "podrunner.pid"),
        "nodes": state.get("nodes", []),
        "up": ready and bool(state),
    }


def env_lines(layout: Layout) -> list[str]:
    """Shell lines that point a user's shell at the sandbox (``eval "$(gearshift sandbox env)"``)."""
    path = ":".join(str(d) for d in layout.bin_dirs)
    lines = [f"export KUBECONFIG={layout.kubeconfig}", f'export PATH={path}:"$PATH"']
    url = read_state(layout).get("prometheus_url")
    if url:
        lines.append(f"export GEARSHIFT_PROMETHEUS_URL={url}")
    return lines
