"""A leader on a starved API server, re-executing in place (this branch) against exiting (main).

The busy machine of ``bench/reliability.py`` (its CPU hog takes one core for the whole run) and, on top, the
sandbox's kube-apiserver starved by SIGSTOP/SIGCONT (``tests/e2e/test_lease_starved.py``'s ``Starver``):
answering slowly (stopped 0.6 s of every 1 s) for ``--starve`` s, and stopped outright for ``--outage`` s
(longer than the renew deadline: a Lease loss is then required). One ``gearshift operator --leader-elect``
with controller-runtime's times (lease 15 s, renew deadline 10 s, retry 2 s) serves a PDService on the sim
engine; two forced shifts (``one`` → ``two`` → ``one``) are each caught in Warming by an outage, while a
client sends steady requests through the service's router pod. Two modes, same script:

- ``reexec``: this checkout's operator (on a loss: fence, re-exec in place, re-campaign after 4 s);
- ``exit``: main's operator (``--main`` a checkout of main; a temporary ``git worktree`` of it by default),
  which exits with status 4 on a loss; a stand-in for the kubelet restarts it after CrashLoopBackOff's
  delays (10 s, doubling to 300 s: ``pkg/kubelet/kuberuntime``), as a Deployment's pod would be.

Measured per mode: Lease losses (the operator's "leader election lost" lines), restarts (process exits the
kubelet stand-in saw), seconds without a leader (from each loss to the next "leading: acquired" line,
summed), shifts completed (``Succeeded`` in the GearSet's history within the time limit), and the client's
failed requests. Written as the ``lease`` section of ``bench/results/reliability.json`` (the other sections
are kept), with :data:`GOAL` judged on the ``reexec`` run (the busy run): no restart, no failed request,
every shift completed, no more Lease losses than outages past the renew deadline (``--judge-only``
judges a written section again).

Run: ``.venv/bin/python bench/lease.py [--modes reexec,exit] [--outage 12] [--starve 20]`` with the sandbox
up (``make sandbox-up``). About 2 to 3 minutes per mode on 2 cores (105 s and 149 s measured, plus set-up).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib, also when loaded by file

from benchlib import write_result

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench/results/reliability.json"
#: kubelet's CrashLoopBackOff: 10 s doubling, at most 300 s.
KUBELET_BACKOFF_S = (10.0, 300.0)
LEASE = "gearshift-bench-lease"
REQ_RPS = 2.0


def _load(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Client:
    """Steady completions through the router pod (it keeps its own view of the pods while the API server
    is stopped); every failure counted."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.ok, self.failed = 0, 0
        self.errors: dict[str, int] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _one(self) -> None:
        body = json.dumps({"model": self.model, "prompt": "hello " * 16, "max_tokens": 8}).encode()
        req = urllib.request.Request(self.url, body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                r.read()
            with self._lock:
                self.ok += 1
        except Exception as exc:
            with self._lock:
                self.failed += 1
                key = f"{type(exc).__name__}: {str(exc)[:80]}"
                self.errors[key] = self.errors.get(key, 0) + 1

    def _run(self) -> None:
        threads: list[threading.Thread] = []
        next_at = time.monotonic()
        while not self._stop.is_set():
            t = threading.Thread(target=self._one, daemon=True)
            t.start()
            threads.append(t)
            next_at += 1 / REQ_RPS
            self._stop.wait(max(0.0, next_at - time.monotonic()))
        for t in threads:
            t.join(70)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(120)


def run_mode(
    mode: str, sandbox: Any, e2e: Any, harness: Any, main_tree: Path | None, a: Any
) -> dict[str, Any]:
    """One run: the service, two shifts each caught by an outage, the figures."""
    harness.install_crds(sandbox)
    ns = f"bench-lease-{mode}-{uuid.uuid4().hex[:6]}"
    sandbox.kubectl("create", "namespace", ns)
    nodes = harness.GpuNodes(sandbox, f"bench-ls{mode[0]}", cidr_base=200, gpu_replicas=2)
    env = dict(sandbox.env)
    if mode == "exit":
        assert main_tree is not None
        env["PYTHONPATH"] = str(main_tree / "operator")
    starver = e2e.Starver(Path(sandbox.kubeconfig))
    log = Path(tempfile.mkdtemp(prefix=f"gs-lease-{mode}-")) / "operator.log"
    args = ["--leader-elect", "--leader-election-namespace", ns, "--leader-election-id", LEASE,
            "--workers", "4"]  # fmt: skip
    op: Any = None
    restarts: list[float] = []
    stop_kubelet = threading.Event()
    client: Client | None = None
    t0 = time.monotonic()
    shifts: list[dict[str, Any]] = []
    try:
        for _ in range(2):
            nodes.add("A10-24GB", "a10")
        nodes.add("T4-16GB", "t4")
        pool = "gearshift.io/node-pool"
        sandbox.apply(
            e2e._manifests(ns, sandbox.prometheus_url, {pool: nodes.pool("a10")}, {pool: nodes.pool("t4")})
        )
        # OperatorProcess reads only the cluster's kubeconfig and environment: main's code in "exit" mode.
        op = harness.OperatorProcess(SimpleNamespace(kubeconfig=sandbox.kubeconfig, env=env), ns, log, args)

        def kubelet() -> None:
            """Restart the process when it exits, after CrashLoopBackOff's delay."""
            while not stop_kubelet.wait(0.2):
                if op.proc is not None and op.proc.poll() is not None:
                    restarts.append(time.monotonic())
                    first, most = KUBELET_BACKOFF_S
                    delay = min(most, first * 2 ** (len(restarts) - 1))
                    if stop_kubelet.wait(delay):
                        return
                    op.start()

        threading.Thread(target=kubelet, daemon=True).start()
        for role in ("prefill", "decode"):
            sandbox.wait_for(lambda r=role: e2e._role_ready(sandbox, ns, r), 300, f"{role} gear Ready")
        sandbox.wait_for(lambda: e2e._signals_ok(sandbox, ns), 180, "SignalsAvailable=True")
        router = sandbox.wait_for(lambda: _router_ip(sandbox, ns), 120, "the router pod Ready")
        model = e2e.LLAMA_3_2_1B["name"]
        client = Client(f"http://{router}:8000/v1/completions", model)
        time.sleep(5)
        starver.starve(a.starve, stopped_s=0.6, period_s=1.0)
        for target in ("two", "one"):
            ts = time.monotonic()
            sandbox.kubectl(
                "patch", "gearset", e2e.PREFILL_GS, "-n", ns, "--type=merge", "-p",
                f'{{"spec":{{"forceGear":"{target}"}}}}',
            )  # fmt: skip
            sandbox.wait_for(lambda: e2e._status(sandbox, ns).get("phase") == "Warming", 120, "Warming", 0.2)
            starver.outage(a.outage)
            done = None
            end = time.monotonic() + a.shift_limit
            while time.monotonic() < end:
                try:
                    st = e2e._status(sandbox, ns)
                except Exception:
                    st = {}
                hist = st.get("history") or []
                if st.get("phase") == "Stable" and hist and hist[-1]["to"] == target:
                    done = hist[-1]
                    break
                time.sleep(1)
            shifts.append({"to": target, "outcome": done["outcome"] if done else "not finished",
                           "s": round(time.monotonic() - ts, 1)})  # fmt: skip
        time.sleep(5)
    finally:
        starver.cont()
        stop_kubelet.set()
        if client is not None:
            client.stop()
        text = log.read_text(errors="replace") if log.exists() else ""
        harness.teardown_run(sandbox, ns, op, nodes)
    losses = [e2e._stamp(t) for t in e2e.LOST.findall(text)]
    leads = [e2e._stamp(t) for t, _ in e2e.LEADING.findall(text)]
    without = 0.0
    for lost in losses:
        nxt = [t for t in leads if t > lost]
        without += (nxt[0] if nxt else time.time()) - lost
    return {
        "operator": "this branch (re-exec in place)"
        if mode == "reexec"
        else "main (exit 4, kubelet restarts)",
        "lease_losses": len(losses),
        "restarts": len(restarts),
        "without_leader_s": round(without, 1),
        "shifts_completed": f"{sum(1 for s in shifts if s['outcome'] == 'Succeeded')}/{len(shifts)}",
        "shifts": shifts,
        "requests": {
            "ok": client.ok if client else 0,
            "failed": client.failed if client else 0,
            "errors": client.errors if client else {},
        },
        "wall_s": round(time.monotonic() - t0, 1),
    }


def _router_ip(sandbox: Any, ns: str) -> str | None:
    items = sandbox.kubectl_json("get", "pods", "-n", ns, "-l", "app.kubernetes.io/component=router")["items"]
    for p in items:
        conds = p.get("status", {}).get("conditions") or []
        if p["status"].get("podIP") and any(c["type"] == "Ready" and c["status"] == "True" for c in conds):
            return str(p["status"]["podIP"])
    return None


class Sandbox:
    """What the e2e helpers use of the tests' cluster fixture, over the sandbox's layout."""

    def __init__(self) -> None:
        from gearshift.dev.sandbox import cluster
        from gearshift.dev.sandbox.harness import kubectl_for_layout
        from gearshift.dev.sandbox.layout import Layout

        layout = Layout.from_env()
        st = cluster.status(layout)
        if not st.get("up"):
            raise SystemExit("the sandbox is not up: make sandbox-up")
        self._k = kubectl_for_layout(layout)
        self.env, self.kubeconfig, self.octet = self._k.env, self._k.kubeconfig, self._k.octet
        self.prometheus_url = st["prometheus_url"]
        self.is_sandbox = True

    def kubectl(self, *args: str, check: bool = True, input: str | None = None, timeout: float = 60) -> Any:
        return self._k.kubectl(*args, check=check, input=input, timeout=timeout)

    def kubectl_json(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def apply(self, objs: list[dict[str, Any]]) -> None:
        from gearshift.dev.sandbox.harness import apply

        apply(self, objs)

    @staticmethod
    def wait_for(pred: Any, timeout: float, what: str, interval: float = 0.5) -> Any:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                if v := pred():
                    return v
            except Exception:  # a kubectl call failed while the API server was stopped: try again
                pass
            time.sleep(interval)
        raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


#: What the busy run must show: the operator never exits, every shift completes, and no
#: request fails, however many Leases the outages cost.
GOAL = {"restarts": 0, "failed_requests": 0, "shifts_completed": "all", "lease_losses": "<= required"}


def judge(section: dict[str, Any]) -> dict[str, Any]:
    """The ``reexec`` run against :data:`GOAL`, and the summary the busy run records."""
    r = section.get("reexec")
    if not r:
        return {"goal": GOAL, "goal_met": False}
    done, total = (int(x) for x in r["shifts_completed"].split("/"))
    # A loss is required only by an outage past the renew deadline (the leader cannot know it still holds
    # the Lease); starved but answering costs none.
    required = section["outages"] if section["outage_s"] > section["lease_times_s"]["renew_deadline"] else 0
    met = (
        r["restarts"] == 0 and r["requests"]["failed"] == 0 and done == total > 0
        and r["lease_losses"] <= required
    )  # fmt: skip
    busy = {"lease_losses": r["lease_losses"], "failed_requests": r["requests"]["failed"],
            "restarts": r["restarts"]}  # fmt: skip
    return {"busy_run": busy, "lease_losses_required": required, "goal": GOAL, "goal_met": met}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default="reexec,exit")
    ap.add_argument("--outage", type=float, default=12.0, help="API server stopped, s (renew deadline 10 s)")
    ap.add_argument("--starve", type=float, default=20.0, help="API server answering slowly, s")
    ap.add_argument("--shift-limit", type=float, default=300.0, help="time a shift may take, s")
    ap.add_argument("--main", type=Path, default=None, help="a checkout of main (default: a git worktree)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--judge-only", action="store_true", help="re-judge --out's lease section (no runs)")
    a = ap.parse_args(argv)
    if a.judge_only:
        kept = json.loads(a.out.read_text())
        kept["lease"].update(judge(kept["lease"]))
        a.out.write_text(json.dumps(kept, indent=1, ensure_ascii=False) + "\n")
        return 0 if kept["lease"]["goal_met"] else 1
    sys.path.insert(0, str(REPO / "tests/e2e"))
    e2e = _load("gs_e2e_lease_starved", REPO / "tests/e2e/test_lease_starved.py")
    from gearshift.dev.sandbox import harness

    sandbox = Sandbox()
    modes = a.modes.split(",")
    main_tree, made = a.main, False
    if "exit" in modes and main_tree is None:
        main_tree = Path(tempfile.mkdtemp(prefix="gs-lease-main-")) / "main"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(main_tree), "main"],
                       check=True, capture_output=True)  # fmt: skip
        made = True
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    main_rev: str | None = None
    hog = harness.burner(3600)
    results: dict[str, Any] = {}
    try:
        for mode in modes:
            results[mode] = run_mode(mode, sandbox, e2e, harness, main_tree, a)
            print(mode, json.dumps(results[mode]), flush=True)
    finally:
        os.killpg(hog.pid, signal.SIGTERM)
        hog.wait(10)
        if main_tree is not None and main_tree.exists():
            main_rev = subprocess.run(["git", "-C", str(main_tree), "rev-parse", "--short", "HEAD"],
                                      capture_output=True, text=True).stdout.strip()  # fmt: skip
        if made and main_tree is not None:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(main_tree)], check=False
            )
    section = {
        "command": ".venv/bin/python bench/lease.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "started": started,
        "machine": {
            "cpus": os.cpu_count(),
            "background_load": "1 busy-loop process (one core), as the busy run",
        },
        "lease_times_s": {"lease": 15, "renew_deadline": 10, "retry": 2},
        "api_server": f"answering slowly (stopped 0.6 s of every 1 s) for {a.starve:g} s, then stopped "
        f"{a.outage:g} s in the Warming of each of two forced shifts",
        "outages": 2,
        "outage_s": a.outage,
        "kubelet_backoff_s": list(KUBELET_BACKOFF_S),
        "main_commit": main_rev,
        **results,
    }
    section.update(judge(section))
    write_result(a.out, "lease", section, indent=1, ensure_ascii=False)
    return 0 if section["goal_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
