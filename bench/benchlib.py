"""Helpers the benchmarks share: progress lines, a results file's one key, local ports and CPU time, and
the parts of a sandbox run (clients, the router pod, a sampler thread, the replay on its own thread, the
teardown).

A benchmark runs as ``python bench/<name>.py`` (this folder is then first on ``sys.path``); one that a unit
test loads by file puts this folder on ``sys.path`` itself. Imports of gearshift and the Kubernetes client
are made where they are used, so a benchmark that needs only the plain helpers does not load them.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
import threading
from collections.abc import Callable, Coroutine, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from gearshift.dev.loadgen import LoadResult
    from gearshift.dev.sandbox.harness import GpuNodes, LayoutKubectl, OperatorProcess, Periodic

T = TypeVar("T")


# --- plain helpers ------------------------------------------------------------------------------------
def sayer(tag: str) -> Callable[[str], None]:
    """A ``say(msg)`` that writes ``[<tag> HH:MM:SS] msg`` (UTC wall clock) on stderr."""

    def say(msg: str) -> None:
        print(f"[{tag} {datetime.now(UTC).strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    return say


def write_result(path: Path, key: str, entry: Any, *, indent: int = 2, ensure_ascii: bool = True) -> None:
    """Replace ``key`` of the results JSON at ``path`` with ``entry``, keeping its other keys (a missing
    file starts empty); written with ``indent`` and a final newline."""
    data = json.loads(path.read_text()) if path.exists() else {}
    data[key] = entry
    path.write_text(json.dumps(data, indent=indent, ensure_ascii=ensure_ascii) + "\n")


def free_port() -> int:
    """A TCP port on 127.0.0.1 free at the time of the call."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, s (``/proc/<pid>/stat`` fields 14 and 15).

    Raises:
        OSError: no such process (or no ``/proc``).
    """
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def within_slo(ok: bool, ttft_ms: float | None, tpot_ms: float | None, slo: Mapping[str, float]) -> bool:
    """The load generator's SLO test on one request: answered, TTFT ≤ ``slo["ttftMs"]`` and TPOT (when
    the request had one: two or more output tokens) ≤ ``slo["itlMs"]``; times in ms."""
    return (
        bool(ok)
        and ttft_ms is not None
        and ttft_ms <= slo["ttftMs"]
        and (tpot_ms is None or tpot_ms <= slo["itlMs"])
    )


# --- sandbox runs -------------------------------------------------------------------------------------
def kube_clients(kc: LayoutKubectl) -> tuple[Any, Any]:
    """The Kubernetes client's ``CoreV1Api`` and ``CustomObjectsApi`` on the sandbox's kubeconfig."""
    from kubernetes import client as kclient
    from kubernetes import config as kconfig

    api = kconfig.new_client_from_config(config_file=str(kc.kubeconfig))
    return kclient.CoreV1Api(api), kclient.CustomObjectsApi(api)


def ready_router_ip(core: Any, ns: str, service: str) -> str | None:
    """The pod IP of the first Ready, not deleting router pod of PDService ``service`` in ``ns``; None
    while there is none."""
    from gearshift.k8s import names

    sel = f"{names.LABEL_SERVICE}={service},{names.LABEL_COMPONENT}={names.COMPONENT_ROUTER}"
    for p in core.list_namespaced_pod(ns, label_selector=sel).items:
        conds = {c.type: c.status for c in p.status.conditions or []}
        if p.status.pod_ip and conds.get("Ready") == "True" and not p.metadata.deletion_timestamp:
            return str(p.status.pod_ip)
    return None


class PeriodicSampler(Generic[T]):
    """Calls :meth:`once` every ``interval_s`` s on a thread between :meth:`start` and :meth:`stop`
    (:class:`gearshift.dev.sandbox.harness.Periodic`); a subclass writes :meth:`once`."""

    interval_s: float = 1.0
    _runner: Periodic[T] | None = None

    def once(self) -> T:
        raise NotImplementedError

    def start(self) -> None:
        from gearshift.dev.sandbox.harness import Periodic

        self._runner = Periodic(self.once, self.interval_s)
        self._runner.start()

    def stop(self) -> None:
        if self._runner is not None:
            self._runner.stop()

    @property
    def samples(self) -> list[T]:
        return self._runner.samples if self._runner is not None else []

    @property
    def errors(self) -> int:
        return self._runner.errors if self._runner is not None else 0


def replay(load: Callable[[], Coroutine[Any, Any, LoadResult]], timeout_s: float) -> LoadResult:
    """Run ``load()`` (the load generator's coroutine) on a thread of its own, with its own event loop;
    wait at most ``timeout_s`` s for it.

    Raises:
        RuntimeError: it raised, or did not finish in time.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["r"] = asyncio.run(load())
        except Exception as exc:
            box["e"] = exc

    th = threading.Thread(target=run, name="loadgen", daemon=True)
    th.start()
    th.join(timeout=timeout_s)
    if th.is_alive() or "e" in box:
        raise RuntimeError(f"the load did not finish: {box.get('e')!r}")
    result: LoadResult = box["r"]
    return result


def teardown(
    kc: LayoutKubectl, ns: str, op: OperatorProcess | None, nodes: GpuNodes, say: Callable[[str], None]
) -> None:
    """Delete the run's resources (while its operator still runs), the operator, namespace and nodes;
    ``say`` what was left."""
    from gearshift.dev.sandbox.harness import teardown_run

    left = teardown_run(kc, ns, op, nodes)
    if left:
        say(f"WARNING: not deleted: {left}")
