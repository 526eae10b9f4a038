"""The pod runner's state machine with real local processes and a recording stand-in for the API server.

The processes are ``gearshift sandbox exit-with`` (the real console script); only the Kubernetes API is
replaced, by an object that records the status patches. The e2e tests run the same code against the
sandbox's API server.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from gearshift.dev.sandbox.podrunner import PodRunner

VENV_BIN = Path(sys.executable).parent
NODE = {"metadata": {"name": "gpu-t4-0", "annotations": {"gearshift.io/gpu-model": "T4-16GB"}}}


class RecordingApi:
    """Just enough of ApiClient + CoreV1Api: statuses are merged into the stored pod and recorded."""

    def __init__(self) -> None:
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.patches: list[dict[str, Any]] = []
        self.deleted: list[str] = []

    def sanitize_for_serialization(self, obj: Any) -> Any:
        return obj.raw if isinstance(obj, SimpleNamespace) else obj

    def list_node(self, **_: Any) -> Any:
        return SimpleNamespace(items=[SimpleNamespace(metadata=SimpleNamespace(name="gpu-t4-0"), raw=NODE)])

    def patch_namespaced_pod_status(
        self, name: str, ns: str, body: dict[str, Any], _content_type: str | None = None
    ) -> dict[str, Any]:
        from kubernetes.client.rest import ApiException

        pod = self.pods[(ns, name)]
        status = {**pod["status"], **body["status"]}
        if _content_type != "application/merge-patch+json" and "podIPs" in body["status"]:
            # The client's default for a dict body is a strategic merge patch: podIPs merge by "ip"
            # (patchMergeKey), and the API server refuses two IPs of one family (measured on the
            # sandbox's kube-apiserver 1.34: 422 "may specify no more than one IP for each IP family").
            merged = list(body["status"]["podIPs"])
            merged += [i for i in pod["status"].get("podIPs") or [] if i not in merged]
            if len(merged) > 1:
                raise ApiException(status=422, reason="Unprocessable Entity")
            status["podIPs"] = merged
        self.patches.append(body["status"])
        pod["status"] = status
        return pod

    def delete_namespaced_pod(self, name: str, ns: str, body: Any = None) -> None:
        self.deleted.append(name)


def make_runner(tmp_path: Path) -> tuple[PodRunner, RecordingApi]:
    api = RecordingApi()
    runner = PodRunner.__new__(PodRunner)
    PodRunner.__init__(runner, api, tmp_path / "kubeconfig", tmp_path / "pods", VENV_BIN)
    runner.core = api  # the stand-in answers CoreV1Api's calls too
    return runner, api


def pod(name: str, command: list[str], restart: str = "Never") -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": f"uid-{name}",
            "labels": {"gearshift.io/sandbox-run": "true"},
        },
        "spec": {
            "nodeName": "gpu-t4-0",
            "restartPolicy": restart,
            "containers": [
                {
                    "name": "c",
                    "image": "w",
                    "command": command,
                    "resources": {"limits": {"nvidia.com/gpu": "1"}},
                }
            ],
        },
        "status": {"phase": "Pending", "podIP": "127.77.1.5", "hostIP": "127.77.0.1"},
    }


def drive(runner: PodRunner, until, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, "the runner did not reach the expected state"
        for run in list(runner.runs.values()):
            runner._supervise(run)
        time.sleep(0.05)


def test_job_pod_ends_failed_with_exit_code_and_message(tmp_path):
    runner, api = make_runner(tmp_path)
    p = pod(
        "probe",
        [
            "gearshift",
            "sandbox",
            "exit-with",
            "--code",
            "3",
            "--message",
            "no device: $(GEARSHIFT_SANDBOX_GPU_MODEL)",
        ],
    )
    api.pods[("ns", "probe")] = p
    runner._handle("ADDED", p)
    drive(runner, lambda: api.patches and api.patches[-1]["phase"] in ("Succeeded", "Failed"))
    final = api.patches[-1]
    term = final["containerStatuses"][0]["state"]["terminated"]
    assert final["phase"] == "Failed"
    # $(VAR) expansion sees the runner's variables too: the node's GPU model.
    assert (term["exitCode"], term["reason"], term["message"]) == (3, "Error", "no device: T4-16GB")
    phases = [p["phase"] for p in api.patches]
    assert [ph for i, ph in enumerate(phases) if i == 0 or phases[i - 1] != ph] == [
        "Pending",
        "Running",
        "Failed",
    ]
    assert "uid-probe" in runner.finished and not runner.runs


def test_disallowed_program_fails_without_running(tmp_path):
    runner, api = make_runner(tmp_path)
    p = pod("evil", ["python3", "-c", "print(1)"])
    api.pods[("ns", "evil")] = p
    runner._handle("ADDED", p)
    final = api.patches[-1]
    assert final["phase"] == "Failed"
    msg = final["containerStatuses"][0]["state"]["terminated"]["message"]
    assert "'python3' is not allowed" in msg
    assert not list((tmp_path / "pods").glob("*/*.pid"))


def test_always_pod_restarts_and_counts(tmp_path):
    runner, api = make_runner(tmp_path)
    p = pod(
        "crash", ["gearshift", "sandbox", "exit-with", "--code", "2", "--message", "bye"], restart="Always"
    )
    api.pods[("ns", "crash")] = p
    runner._handle("ADDED", p)
    drive(
        runner,
        lambda: api.patches and api.patches[-1]["containerStatuses"][0]["restartCount"] >= 2,
        timeout=30,
    )
    cs = api.patches[-1]["containerStatuses"][0]
    assert cs["lastState"]["terminated"]["exitCode"] == 2
    assert cs["lastState"]["terminated"]["message"] == "bye"
    assert api.patches[-1]["phase"] == "Running"
    waits = [s["containerStatuses"][0]["state"].get("waiting", {}).get("reason") for s in api.patches]
    assert "CrashLoopBackOff" in waits
    runner._shutdown()


def test_deletion_stops_the_process(tmp_path):
    runner, api = make_runner(tmp_path)
    p = pod("slow", ["gearshift", "sandbox", "exit-with", "--sleep", "60"], restart="Always")
    api.pods[("ns", "slow")] = p
    runner._handle("ADDED", p)
    drive(runner, lambda: runner.runs["uid-slow"].containers[0].proc is not None)
    proc = runner.runs["uid-slow"].containers[0].proc
    gone = {**p, "metadata": {**p["metadata"], "deletionTimestamp": "2026-01-01T00:00:00Z"}}
    runner._handle("MODIFIED", gone)
    drive(runner, lambda: api.deleted == ["slow"])
    assert proc.poll() is not None


def test_pod_ip_changed_under_a_running_pod_is_restored(tmp_path):
    """kwok played its assign stage twice on one pod (two status patches 17 ms apart, two IPs from the
    node's pool); the runner had started the engine on the first. As the kubelet, it owns the pod IP: the
    next status it writes puts back the IP its processes listen on, so Endpoints and routers reach them."""
    runner, api = make_runner(tmp_path)
    p = pod("eng", ["gearshift", "sandbox", "exit-with", "--sleep", "60"], restart="Always")
    api.pods[("ns", "eng")] = p
    runner._handle("ADDED", p)
    drive(runner, lambda: runner.runs["uid-eng"].containers[0].proc is not None)
    assert api.patches[-1]["podIP"] == "127.77.1.5"
    sent = len(api.patches)
    moved = {**p, "status": {**api.pods[("ns", "eng")]["status"], "podIP": "127.77.1.6"}}
    moved["status"]["podIPs"] = [{"ip": "127.77.1.6"}]
    api.pods[("ns", "eng")] = moved
    runner._handle("MODIFIED", moved)
    drive(runner, lambda: api.pods[("ns", "eng")]["status"]["podIP"] == "127.77.1.5")
    assert len(api.patches) == sent + 1
    assert api.pods[("ns", "eng")]["status"]["podIPs"] == [{"ip": "127.77.1.5"}]
    # Nothing changes after that: no patch per tick.
    for _ in range(5):
        runner._supervise(runner.runs["uid-eng"])
    assert len(api.patches) == sent + 1
    runner._shutdown()


def make_light_runner(tmp_path: Path) -> tuple[PodRunner, RecordingApi]:
    api = RecordingApi()
    runner = PodRunner.__new__(PodRunner)
    PodRunner.__init__(runner, api, tmp_path / "kubeconfig", tmp_path / "pods", VENV_BIN, light=True)
    runner.core = api
    return runner, api


def test_light_mode_runs_the_simulated_probe_in_a_fork(tmp_path):
    """Light mode (the fleet benchmark's 1,000 probe Jobs): the probe's own main in a fork of the runner;
    its termination message is the probe's compact report of the node's datasheet GPU."""
    runner, api = make_light_runner(tmp_path)
    p = pod("probe", ["gearshift-probe", "device"])
    c = p["spec"]["containers"][0]
    c["env"] = [
        {"name": "GEARSHIFT_PROBE_SIMULATED", "value": "1"},
        {"name": "GEARSHIFT_NODE_NAME", "value": "gpu-t4-0"},
        {"name": "GEARSHIFT_GPU_COUNT", "value": "1"},
        {"name": "GEARSHIFT_NODE_ANNOTATIONS", "value": '{"gearshift.io/gpu-model": "T4-16GB"}'},
    ]
    api.pods[("ns", "probe")] = p
    runner._handle("ADDED", p)
    drive(runner, lambda: api.patches and api.patches[-1]["phase"] in ("Succeeded", "Failed"))
    term = api.patches[-1]["containerStatuses"][0]["state"]["terminated"]
    assert api.patches[-1]["phase"] == "Succeeded", term
    doc = json.loads(term["message"])
    got = (doc["probe"], doc["kind"], doc["gpuModel"], doc["node"])
    assert got == ("device", "simulated", "T4-16GB", "gpu-t4-0")


def test_light_mode_other_containers_sleep_ready_until_deleted(tmp_path):
    runner, api = make_light_runner(tmp_path)
    p = pod("engine", ["gearshift-sim", "--port", "8000"], restart="Always")
    p["spec"]["containers"][0]["readinessProbe"] = {"httpGet": {"path": "/health", "port": 8000}}
    api.pods[("ns", "engine")] = p
    runner._handle("ADDED", p)
    drive(runner, lambda: api.patches and api.patches[-1]["phase"] == "Running")
    ready = {c["type"]: c["status"] for c in api.patches[-1]["conditions"]}
    assert ready["Ready"] == "True"  # no readiness probe runs against a sleeping fork
    (run,) = runner.runs.values()
    proc = run.containers[0].proc
    assert proc is not None and proc.poll() is None
    runner._delete(run)
    assert proc.poll() is not None and api.deleted == ["engine"]


class SlowToDie:
    """A process that outlives SIGKILL for longer than the runner waits (a 4 GB vLLM engine's mount
    namespace being torn down on a loaded host): ``wait`` times out until ``gone`` is set."""

    def __init__(self) -> None:
        self.pid = 2**22 + 7  # no such process: killpg finds none, as for a process already exiting
        self.returncode: int | None = None
        self.gone = False
        self.waits: list[float | None] = []

    def poll(self) -> int | None:
        if self.gone:
            self.returncode = -9
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self.waits.append(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired("vllm", timeout or 0.0)
        return -9


def test_a_process_that_outlives_sigkill_does_not_end_the_runner(tmp_path, monkeypatch):
    """CI, 2026-12-06: a deleted pipeline rank's engine was not reaped 5 s after SIGKILL; the wait raised
    out of the runner's loop, and the runner's shutdown stopped every other pod's processes (the decode
    engine, the router) while their pods still read Ready. The stop now goes on and the process is reaped
    later; the other pods keep running and a new pod still starts."""
    monkeypatch.setattr("gearshift.dev.sandbox.containers.KILL_WAIT_S", 0.05)
    runner, api = make_runner(tmp_path)
    keep = pod("keep", ["gearshift", "sandbox", "exit-with", "--sleep", "60"], restart="Always")
    dying = pod("dying", ["gearshift", "sandbox", "exit-with", "--sleep", "60"], restart="Always")
    for p in (keep, dying):
        api.pods[("ns", p["metadata"]["name"])] = p
        runner._handle_safely("ADDED", p)
    drive(runner, lambda: all(r.containers[0].proc is not None for r in runner.runs.values()))
    real = runner.runs["uid-dying"].containers[0].proc
    stuck = SlowToDie()
    runner.runs["uid-dying"].containers[0].proc = stuck

    runner._handle_safely("DELETED", dying)  # deleted with its process alive: the RESYNC/force path
    for t in runner.stop_threads:
        t.join(timeout=10)
    assert "uid-dying" not in runner.runs and stuck in runner.dying
    assert len(stuck.waits) == 2  # the grace, then KILL_WAIT_S after SIGKILL; no third, no raise
    keep_proc = runner.runs["uid-keep"].containers[0].proc
    assert keep_proc is not None and keep_proc.poll() is None

    stuck.gone = True
    runner._reap()
    assert runner.dying == []
    fresh = pod("fresh", ["gearshift", "sandbox", "exit-with", "--sleep", "60"], restart="Always")
    api.pods[("ns", "fresh")] = fresh
    runner._handle_safely("ADDED", fresh)
    drive(runner, lambda: "uid-fresh" in runner.runs and runner.runs["uid-fresh"].containers[0].proc)
    real.kill()
    real.wait()
    runner._shutdown()


def test_a_start_that_the_api_refuses_is_retried_not_fatal(tmp_path):
    """A ConfigMap lookup answered 500 (an API server restarting under load) is no fault of the pod's
    spec: the pod is not failed, the runner goes on, and the start is tried again until it succeeds."""
    from kubernetes.client.rest import ApiException

    runner, api = make_runner(tmp_path)
    answers: list[Any] = [ApiException(status=500, reason="storage is (re)initializing")]

    def read_namespaced_config_map(name: str, ns: str) -> Any:
        if answers:
            raise answers.pop()
        return SimpleNamespace(data={"model": "tiny"})

    api.read_namespaced_config_map = read_namespaced_config_map  # type: ignore[attr-defined]
    p = pod("eng", ["gearshift", "sandbox", "exit-with", "--sleep", "60"], restart="Always")
    p["spec"]["containers"][0]["env"] = [
        {"name": "MODEL", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "model"}}}
    ]
    api.pods[("ns", "eng")] = p
    runner._handle_safely("ADDED", p)
    assert "uid-eng" not in runner.runs and "uid-eng" in runner.waiting and not api.patches
    runner.retry_at["uid-eng"] = 0.0  # the retry is due
    runner._handle_safely("RETRY", runner.waiting["uid-eng"])
    drive(runner, lambda: runner.runs["uid-eng"].containers[0].proc is not None)
    assert runner.runs["uid-eng"].containers[0].env["MODEL"] == "tiny"
    assert api.patches[-1]["phase"] == "Running" and "uid-eng" not in runner.waiting
    runner._shutdown()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_container_s_processes_end_with_its_main_process(tmp_path):
    """A child the container's main process leaves behind is killed when that process exits, as the kernel
    ends a PID namespace's processes with its init: an orphaned vLLM EngineCore would hold cores and ports."""
    runner, api = make_runner(tmp_path)
    p = pod("leaver", ["gearshift", "sandbox", "exit-with", "--code", "1", "--leave-child", "120"])
    api.pods[("ns", "leaver")] = p
    runner._handle("ADDED", p)
    drive(runner, lambda: api.patches and api.patches[-1]["phase"] == "Failed")
    logs = list((tmp_path / "pods").glob("*/c.log"))
    (child,) = [
        int(line.split()[1]) for line in logs[0].read_text().splitlines() if line.startswith("child ")
    ]
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), f"pid {child} outlived its container"
