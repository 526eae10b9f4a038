"""The sandbox's local pod runner: runs opted-in pods' containers as local processes on their pod IPs.

A pod opts in with the label ``gearshift.io/sandbox-run: "true"``. kwok gives such a pod its loopback IP
and leaves it Pending (see ``stages``); the runner then, for each container:

  - builds the command line (only gearshift's console scripts, resolved in the sandbox's virtualenv) and
    the environment (``podspec``), plus ``GEARSHIFT_HOST`` (the pod IP, unless the pod sets it),
    ``GEARSHIFT_POD_IP``, ``GEARSHIFT_TERMINATION_LOG`` (the file that stands for
    ``terminationMessagePath``), ``HOSTNAME``, ``KUBECONFIG`` (the sandbox's admin one: there is no
    in-cluster service account; a pod annotated ``gearshift.io/sandbox-credentials: serviceaccount``
    instead gets a kubeconfig with a TokenRequest token of its ServiceAccount, bound to the pod, so RBAC
    applies to it as in a cluster), ``GEARSHIFT_SANDBOX_GPU_MODEL`` (the node's ``gearshift.io/gpu-model``
    annotation) and ``GEARSHIFT_SANDBOX_GPUS`` (the container's ``nvidia.com/gpu`` limit): the simulated
    device;
  - starts it in its own process group, output to ``<pods-dir>/<ns>_<pod>_<uid8>/<container>.log``;
  - reports to the pod status: Running once started, Ready once its readinessProbe (httpGet/tcpSocket on
    the pod IP) passes ``successThreshold`` times (no probe: once started); before the first success the
    probe runs every ``min(periodSeconds, 1 s)`` so pods become Ready quickly, then every periodSeconds;
  - on exit: ``restartPolicy`` Always restarts with back-off (1 s doubling to 30 s, reset after 60 s of
    running) and counts restarts, ``lastState.terminated`` and ``CrashLoopBackOff`` as the kubelet shows
    them; Never/OnFailure (Job pods) end in phase Succeeded/Failed with ``state.terminated`` {exitCode,
    reason, message}, the message read from the termination-log file (``podspec.termination_message``);
  - on deletion: SIGTERM to the process group, SIGKILL after ``terminationGracePeriodSeconds`` (at most
    10 s), then the pod is deleted for good (grace 0, UID precondition). A replacement pod (same name, new
    UID) is a new run.

Pods that cannot run (a program not allowed, an unsupported env source) get a clear message in their
status: Job pods fail, others stay Pending with ``CreateContainerConfigError`` as the kubelet does.

*Light* mode (``--light``, ``gearshift sandbox up --light-pods``: the fleet-scale benchmark's 1,000 probe
Jobs and hundreds of engine pods on 2 cores) starts no program: each container is a fork of the runner
(no interpreter start, no imports, pages shared with the runner). A simulated probe
(``gearshift-probe`` with ``GEARSHIFT_PROBE_SIMULATED``) runs the probe's own ``main`` in the fork, with
the container's arguments and environment, so its termination message is the one the program writes;
any other container's fork sleeps until it is stopped and counts as Ready at once (no engine, no HTTP:
readiness probes are not run). Everything else (pod IPs, status, exit codes, deletion) is as above, and
pods are supervised every ``LIGHT_SUPERVISE_S`` instead of every ``TICK_S``.
Run as ``python -m gearshift.dev.sandbox.podrunner`` (``gearshift sandbox up`` does).

This module is the runner's watch loop and its API writes; a container's process (start, probe, exit,
stop) is :mod:`~gearshift.dev.sandbox.containers`, the status it reports
:mod:`~gearshift.dev.sandbox.podstatus`, what it reads from the API for a pod
:mod:`~gearshift.dev.sandbox.podinputs`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import functools
import json
import os
import queue
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from gearshift.dev.sandbox import containers, podspec
from gearshift.dev.sandbox.containers import ContainerRun, PodRun, advance_probe, exited, kill, spawn
from gearshift.dev.sandbox.nodes import SANDBOX_RUN_LABEL
from gearshift.dev.sandbox.podinputs import credentials, lookup
from gearshift.dev.sandbox.podstatus import pod_phase, pod_status
from gearshift.dev.sandbox.runlog import log, utc_now
from gearshift.k8s.names import GPU_RESOURCE

LABEL_SELECTOR = f"{SANDBOX_RUN_LABEL}=true"
TICK_S = 0.1
#: Longest time one pass of the main loop handles watch events before it supervises the runs, s.
MAX_EVENTS_S = 1.0
MAX_GRACE_S = 10.0
#: A pod whose start failed on something other than its spec (the API server refused a lookup) is tried
#: again after this long, s.
START_RETRY_S = 2.0
WATCH_TIMEOUT_S = 60
#: Light mode: seconds between two supervision passes over the runs (each pass polls every process).
LIGHT_SUPERVISE_S = 1.0


def _api_error(exc: Exception) -> str:
    """One line for a failed API call: the status code and the API server's own message when it sent a
    Status, not the client's multi-line dump of headers."""
    status, body = getattr(exc, "status", None), getattr(exc, "body", None)
    if status is not None:
        try:
            message = json.loads(body or "{}").get("message") or body
        except (ValueError, AttributeError):
            message = body
        return f"{status}: {str(message)[:500]}"
    return f"{type(exc).__name__}: {str(exc)[:300]}"


class PodRunner:
    """Watches opted-in pods and runs them (see the module docstring)."""

    def __init__(
        self,
        api_client: Any,
        kubeconfig: Path,
        pods_dir: Path,
        venv_bin: Path,
        vllm_bin: Path | None = None,
        hostpath_root: Path | None = None,
        light: bool = False,
    ) -> None:
        from kubernetes import client

        self.api = api_client
        self.core = client.CoreV1Api(api_client)
        self.kubeconfig = kubeconfig
        self.pods_dir = pods_dir
        self.venv_bin = venv_bin
        self.vllm_bin = vllm_bin
        self.hostpath_root = hostpath_root or pods_dir / "hostpath"
        #: Cluster DNS of pods under headless Services (``uid -> (ip, names)``), served to containers in
        #: a mount namespace as their ``/etc/hosts`` (see ``mountns``); rewritten in place on change so
        #: that every bind mount of it sees the new records.
        self.dns: dict[str, tuple[str, list[str]]] = {}
        self.hosts_path = pods_dir / "hosts"
        self.hosts_base = Path("/etc/hosts").read_text() if Path("/etc/hosts").is_file() else ""
        self.next_core = 0
        self.runs: dict[str, PodRun] = {}
        self.finished: set[str] = set()
        self.events: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        self.stop = threading.Event()
        self.probes = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="probe")
        self.nodes: dict[str, dict[str, Any]] = {}
        self.waiting: dict[str, dict[str, Any]] = {}
        #: Pods whose start failed for a transient reason: ``uid -> monotonic time of the next try``.
        self.retry_at: dict[str, float] = {}
        #: Processes that outlived SIGKILL + ``KILL_WAIT_S``: polled until reaped.
        self.dying: list[Any] = []
        self.stop_threads: list[threading.Thread] = []
        self.nodes_listed = 0.0
        self.light = light
        if light:
            # Imported before any fork: a fork imports nothing (the import lock may be another thread's).
            import gearshift.api.probedoc
            import gearshift.probe.__main__
            import gearshift.probe.run
            import gearshift.probe.simulated  # noqa: F401
        #: The runner's own command line: the pid file of a fork records it (``procs`` checks it).
        self.own_argv = [a.decode() for a in Path("/proc/self/cmdline").read_bytes().split(b"\0")[:-1]]

    # ------------------------------------------------------------------------------------ watching

    def _watch(self) -> None:
        from kubernetes import watch

        while not self.stop.is_set():
            try:
                listing = self.core.list_pod_for_all_namespaces(label_selector=LABEL_SELECTOR)
                uids = set()
                for pod in listing.items:
                    d = self.api.sanitize_for_serialization(pod)
                    uids.add(d["metadata"]["uid"])
                    self.events.put(("SYNC", d))
                self.events.put(("RESYNC", {"uids": sorted(uids)}))
                w = watch.Watch()
                for ev in w.stream(
                    self.core.list_pod_for_all_namespaces,
                    label_selector=LABEL_SELECTOR,
                    resource_version=listing.metadata.resource_version,  # type: ignore[union-attr]  # the API server always sets a list's metadata
                    timeout_seconds=WATCH_TIMEOUT_S,
                ):
                    if self.stop.is_set():
                        w.stop()
                        break
                    if ev["type"] == "ERROR":
                        break  # expired resourceVersion: list again
                    self.events.put((ev["type"], self.api.sanitize_for_serialization(ev["object"])))
            except Exception as exc:  # the API server restarting must not end the runner
                if self.stop.is_set():
                    break
                log(f"watch failed ({type(exc).__name__}: {exc}); retrying in 1 s")
                self.stop.wait(1.0)

    def _node(self, name: str) -> dict[str, Any] | None:
        if name not in self.nodes and time.monotonic() - self.nodes_listed > 1.0:
            self.nodes_listed = time.monotonic()
            # Every node of the sandbox is kwok's; the pod IP check (loopback only) guards the rest.
            nodes = self.core.list_node()
            self.nodes = {n.metadata.name: self.api.sanitize_for_serialization(n) for n in nodes.items}  # type: ignore[union-attr,misc]  # a stored object always has metadata.name
        return self.nodes.get(name)

    # ----------------------------------------------------------------------------------- main loop

    def run(self) -> None:
        """Run until ``self.stop`` is set; then stop every process it started."""
        watcher = threading.Thread(target=self._watch, name="watch", daemon=True)
        watcher.start()
        log(f"pod runner watching pods with {LABEL_SELECTOR}{' (light mode)' if self.light else ''}")
        supervised = 0.0
        try:
            while not self.stop.is_set():
                try:
                    kind, obj = self.events.get(timeout=TICK_S)
                    self._handle_safely(kind, obj)
                    # Bounded: a steady stream of events (a thousand probe pods at once) must not starve
                    # the supervision below, which starts the containers.
                    until = time.monotonic() + MAX_EVENTS_S
                    while time.monotonic() < until:
                        kind, obj = self.events.get_nowait()
                        self._handle_safely(kind, obj)
                except queue.Empty:
                    pass
                now = time.monotonic()
                for uid, pod in list(self.waiting.items()):
                    if self.retry_at.get(uid, 0.0) <= now:
                        self._handle_safely("RETRY", pod)
                self._reap()
                if self.light and time.monotonic() - supervised < LIGHT_SUPERVISE_S:
                    continue
                supervised = time.monotonic()
                for run in list(self.runs.values()):
                    try:
                        self._supervise(run)
                    except Exception as exc:
                        log(f"{run.key}: supervise failed: {type(exc).__name__}: {exc}")
        finally:
            self._shutdown()

    def _handle_safely(self, kind: str, obj: dict[str, Any]) -> None:
        """``_handle``, logged instead of raised: the runner is every pod's kubelet, and an exception out
        of its loop would stop all their processes (``_shutdown``), not just the one event's."""
        try:
            self._handle(kind, obj)
        except Exception:
            name = (obj.get("metadata") or {}).get("name", "?")
            log(f"{kind} {name}: handling failed; going on\n{traceback.format_exc().rstrip()}")

    def _reap(self) -> None:
        """Poll the processes that outlived a stop until the kernel has torn them down."""
        for proc in list(self.dying):
            if proc.poll() is not None:
                self.dying.remove(proc)
                log(f"pid {proc.pid}: reaped (exit {proc.returncode})")

    def _update_dns(self, kind: str, pod: dict[str, Any]) -> None:
        if kind == "RESYNC":
            gone = set(self.dns) - set(pod["uids"])
            changed = bool(gone)
            for uid in gone:
                del self.dns[uid]
        else:
            uid = pod["metadata"]["uid"]
            ip = (pod.get("status") or {}).get("podIP")
            names = podspec.cluster_dns_names(pod)
            record = (ip, names) if ip and names and kind != "DELETED" else None
            changed = self.dns.get(uid) != record
            if record is None:
                self.dns.pop(uid, None)
            else:
                self.dns[uid] = record
        if changed or not self.hosts_path.exists():
            self.hosts_path.parent.mkdir(parents=True, exist_ok=True)
            text = podspec.hosts_file(self.hosts_base, self.dns)
            # In place (same inode): bind mounts of the file see the rewrite.
            with self.hosts_path.open("a+") as f:
                f.seek(0)
                f.truncate()
                f.write(text)

    def _handle(self, kind: str, pod: dict[str, Any]) -> None:
        if kind in ("SYNC", "ADDED", "MODIFIED", "DELETED", "RESYNC"):
            self._update_dns(kind, pod)
        if kind == "RESYNC":
            # Pods gone while the watch was down.
            for uid in set(self.runs) - set(pod["uids"]):
                self._forget(self.runs[uid], "pod no longer exists")
            return
        meta = pod["metadata"]
        uid = meta["uid"]
        run = self.runs.get(uid)
        if kind == "DELETED":
            self.waiting.pop(uid, None)
            self.retry_at.pop(uid, None)
            if run:
                self._forget(run, "pod deleted")
            self.finished.discard(uid)
            return
        if meta.get("deletionTimestamp"):
            if run and not run.deleting:
                run.deleting = True
                threading.Thread(target=self._delete, args=(run,), daemon=True).start()
            elif not run:
                # Nothing runs for it (finished, or never started): let it go now.
                self._force_delete(meta["namespace"], meta["name"], uid)
            return
        if run:
            run.pod = pod
            seen = (pod.get("status") or {}).get("podIP")
            if run.pod_ip and seen != run.pod_ip:
                # kwok can play its assign stage twice on one pod before its cache sees the first patch,
                # each play taking a new IP from the node's pool (measured: two patches 17 ms apart, the
                # engine bound to the first IP, the EndpointSlice and router got the second, and every
                # request to the pod failed to connect). The process listens on the first: say so again.
                log(f"{run.key}: pod IP in the API is {seen}, its containers run on {run.pod_ip}: restoring")
                run.last_sent = ""
            return
        if uid in self.finished or pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
            return
        node = pod.get("spec", {}).get("nodeName")
        if not node or not pod.get("status", {}).get("podIP"):
            return  # not scheduled or no IP from kwok yet; a later event brings it
        node_obj = self._node(node)
        if node_obj is None:
            # A node created a moment ago may be missing from the cache: retry on the next ticks.
            self.waiting[uid] = pod
            return
        self.waiting.pop(uid, None)
        try:
            self._start_pod(pod, node_obj)
        except Exception as exc:
            # Not the pod's spec (that is a PodSpecError, reported in its status): a refused API call or a
            # file the runner could not write. The pod waits and is tried again, as a kubelet retries
            # a sync that failed.
            self.runs.pop(uid, None)
            self.waiting[uid] = pod
            self.retry_at[uid] = time.monotonic() + START_RETRY_S
            log(f"{meta.get('namespace')}/{meta.get('name')}: start failed ({type(exc).__name__}: {exc}); "
                 f"retrying in {START_RETRY_S:.0f} s")  # fmt: skip
            return
        self.retry_at.pop(uid, None)

    # ------------------------------------------------------------------------------------ starting

    def _start_pod(self, pod: dict[str, Any], node: dict[str, Any]) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        uid, ns, name = meta["uid"], meta["namespace"], meta["name"]
        pod_dir = self.pods_dir / podspec.pod_dir_name(pod)
        pod_dir.mkdir(parents=True, exist_ok=True)
        restart_policy = spec.get("restartPolicy", "Always")
        prev = {c["name"]: c for c in pod.get("status", {}).get("containerStatuses") or []}
        run = PodRun(uid, ns, name, pod, [], restart_policy)
        self.runs[uid] = run
        try:
            ip = podspec.check_pod_ip(pod.get("status", {}).get("podIP"))
            run.pod_ip = ip
            if spec.get("initContainers"):
                raise podspec.PodSpecError("spec.initContainers are not supported by the sandbox runner")
            gpu_model = (node.get("metadata", {}).get("annotations") or {}).get("gearshift.io/gpu-model", "")
            kubeconfig = credentials(self.core, self.kubeconfig, pod, pod_dir)
            for c in spec.get("containers", []):
                env = podspec.container_env(pod, c, functools.partial(lookup, self.core))
                msg_file = pod_dir / f"{c['name']}.termination-log"
                limits = (c.get("resources") or {}).get("limits") or {}
                extra = {
                    "GEARSHIFT_POD_IP": ip,
                    "GEARSHIFT_TERMINATION_LOG": str(msg_file),
                    "GEARSHIFT_SANDBOX_GPU_MODEL": gpu_model,
                    "GEARSHIFT_SANDBOX_GPUS": str(limits.get(GPU_RESOURCE, "0")),
                }
                full = {
                    "PATH": f"{self.venv_bin}:/usr/local/bin:/usr/bin:/bin",
                    "HOME": os.environ.get("HOME", "/tmp"),
                    "LANG": "C.UTF-8",
                    "PYTHONUNBUFFERED": "1",
                    "HOSTNAME": name,
                    **({"KUBECONFIG": str(kubeconfig)} if kubeconfig else {}),
                    "GEARSHIFT_HOST": ip,
                    **env,
                    **extra,
                }
                argv = podspec.container_argv(c, full, self.venv_bin, self.vllm_bin)
                is_vllm = Path(argv[0]).name == podspec.VLLM_COMMAND
                if is_vllm:
                    core = self.next_core % (os.cpu_count() or 1)
                    full.update(podspec.vllm_cpu_env(core, full.get("PYTHONPATH", "")))
                    full["PATH"] = f"{self.vllm_bin}:{full['PATH']}"
                    self.next_core += 1
                # Volumes and cluster DNS for vLLM pods (model cache, /dev/shm, --master-addr); gearshift's
                # own programs keep running on the host's filesystem as they always have.
                mounts = podspec.mount_plan(pod, c, pod_dir, self.hostpath_root) if is_vllm else []
                if is_vllm:
                    plan_file = pod_dir / f"{c['name']}.mounts.json"
                    plan_file.write_text(json.dumps({"mounts": mounts, "hosts": str(self.hosts_path)}))
                    argv = [
                        "unshare",
                        "--mount",
                        "--propagation",
                        "private",
                        "--",
                        sys.executable,
                        "-m",
                        "gearshift.dev.sandbox.mountns",
                        str(plan_file),
                        "--",
                        *argv,
                    ]
                cr = ContainerRun(
                    name=c["name"],
                    image=c.get("image", ""),
                    argv=argv,
                    env=full,
                    probe=None if self.light else podspec.readiness_target(c, ip),
                    log=pod_dir / f"{c['name']}.log",
                    message_file=msg_file,
                    pidfile=pod_dir / f"{c['name']}.pid",
                    message_policy=c.get("terminationMessagePolicy", "File"),
                    restarts=int(prev.get(c["name"], {}).get("restartCount", 0)),
                )
                cr.next_start = time.monotonic()
                run.containers.append(cr)
        except podspec.PodSpecError as exc:
            run.error = str(exc)
            run.containers = []
            log(f"{run.key}: cannot run: {exc}")
        log(f"{run.key}: accepted on {spec.get('nodeName')} ({pod['status'].get('podIP')})")
        if not self.light or run.error is not None:
            # Light mode starts the container on the next pass: its Running report is the first (one
            # status write fewer per pod; the runner writes them one at a time).
            self._report(run)

    def _supervise(self, run: PodRun) -> None:
        if run.deleting:
            return
        now = time.monotonic()
        for c in run.containers:
            if c.done:
                continue
            if c.proc is None:
                if c.next_start is not None and now >= c.next_start and run.error is None:
                    spawn(run, c, self.light, self.own_argv)
                continue
            code = c.proc.poll()
            if code is not None:
                exited(run, c, code)
                continue
            if c.probe:
                advance_probe(c, now, self.probes)
        self._report(run)
        if run.containers and all(c.done for c in run.containers):
            self.finished.add(run.uid)
            del self.runs[run.uid]
            log(f"{run.key}: finished ({pod_phase(run)})")

    def _report(self, run: PodRun) -> None:
        """Write the pod's status (:func:`~gearshift.dev.sandbox.podstatus.pod_status`) when it changed."""
        body, updates = pod_status(run)
        # Compare without timestamps so only real changes are written.
        fingerprint = json.dumps([body, {k: v[0] for k, v in updates.items()}], sort_keys=True)
        if fingerprint == run.last_sent:
            return
        current = run.pod.get("status", {}).get("conditions") or []
        body["conditions"] = podspec.merge_conditions(current, updates, utc_now())
        try:
            # A JSON merge patch, as the kubelet's status manager sends the whole status: the client's
            # default for a dict is a strategic merge, which merges ``podIPs`` by ``ip``. When kwok's
            # double assign (above) left another IP there, that made two IPv4 addresses, and the API
            # server refused every write with 422 "may specify no more than one IP for each IP family":
            # the pod never left ContainerCreating (CI, test (g), 20 min).
            pod = self.core.patch_namespaced_pod_status(
                run.name, run.namespace, {"status": body}, _content_type="application/merge-patch+json"
            )
            run.pod = self.api.sanitize_for_serialization(pod)
            run.last_sent = fingerprint
        except Exception as exc:
            log(f"{run.key}: status update failed: {_api_error(exc)}")

    # ------------------------------------------------------------------------------------- stopping

    # ------------------------------------------------------------------------------------- stopping

    def _delete(self, run: PodRun) -> None:
        grace = float(run.pod.get("spec", {}).get("terminationGracePeriodSeconds", 30))
        for c in run.containers:
            kill(c, min(grace, MAX_GRACE_S), self.dying)
        log(f"{run.key}: stopped for deletion")
        self._force_delete(run.namespace, run.name, run.uid)

    def _force_delete(self, ns: str, name: str, uid: str) -> None:
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        try:
            self.core.delete_namespaced_pod(
                name,
                ns,
                body=client.V1DeleteOptions(
                    grace_period_seconds=0, preconditions=client.V1Preconditions(uid=uid)
                ),
            )
        except ApiException as exc:
            if exc.status not in (404, 409):
                log(f"{ns}/{name}: delete failed: {exc.status} {exc.reason}")

    def _forget(self, run: PodRun, why: str) -> None:
        """Drop a run whose pod is gone; its processes are stopped on a thread, so that a slow stop
        (2 s grace, then SIGKILL) never holds up every other pod's events and supervision."""
        self.runs.pop(run.uid, None)
        live = [c for c in run.containers if c.proc is not None and c.proc.poll() is None]
        if not live:
            log(f"{run.key}: {why}; processes stopped")
            return

        def stop() -> None:
            for c in live:
                kill(c, 2.0, self.dying)
            log(f"{run.key}: {why}; processes stopped")

        t = threading.Thread(target=stop, name=f"stop-{run.name}", daemon=True)
        self.stop_threads = [x for x in self.stop_threads if x.is_alive()] + [t]
        t.start()

    def _shutdown(self) -> None:
        # Signal every process first, then wait once: stopping is not serialised over the pods.
        started = [c for run in self.runs.values() for c in run.containers if c.proc is not None]
        for c in started:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(c.proc.pid, signal.SIGTERM)  # type: ignore[union-attr]
        deadline = time.monotonic() + 5.0
        for c in started:
            kill(c, max(0.1, deadline - time.monotonic()), self.dying)
        for t in self.stop_threads:
            t.join(timeout=max(0.1, deadline + containers.KILL_WAIT_S - time.monotonic()))
        self.probes.shutdown(wait=False, cancel_futures=True)
        log("pod runner stopped")


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m gearshift.dev.sandbox.podrunner --kubeconfig K --pods-dir D --venv-bin B``."""
    parser = argparse.ArgumentParser(prog="gearshift-sandbox-podrunner", description=__doc__.split("\n")[0])
    parser.add_argument("--kubeconfig", type=Path, required=True, help="the sandbox's kubeconfig")
    parser.add_argument("--pods-dir", type=Path, required=True, help="per-pod logs and files")
    parser.add_argument(
        "--venv-bin", type=Path, default=Path(sys.executable).parent, help="console scripts dir"
    )
    parser.add_argument("--vllm-bin", type=Path, default=None, help="the vLLM CPU venv's bin dir")
    parser.add_argument(
        "--hostpath-root", type=Path, default=None, help="where hostPath volumes live (default: pods dir)"
    )
    parser.add_argument(
        "--light", action="store_true", help="containers are forks of the runner (see the module docstring)"
    )
    args = parser.parse_args(argv)
    from kubernetes import config as kconfig

    api = kconfig.new_client_from_config(config_file=str(args.kubeconfig))
    runner = PodRunner(
        api,
        args.kubeconfig.resolve(),
        args.pods_dir.resolve(),
        args.venv_bin,
        vllm_bin=args.vllm_bin,
        hostpath_root=args.hostpath_root,
        light=args.light,
    )
    signal.signal(signal.SIGTERM, lambda *_: runner.stop.set())
    signal.signal(signal.SIGINT, lambda *_: runner.stop.set())
    runner.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
