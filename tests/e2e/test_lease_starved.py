"""On the sandbox: a starved API server costs no crash loop, and a shift in flight completes.

The machine is the busy one of ``bench/reliability.py``: one core taken by ``harness.machine_load``'s CPU hog
(one busy-loop process, ended by its pid) for the whole module. The API server is starved on top of that by
stopping and continuing the sandbox's ``kube-apiserver`` (SIGSTOP/SIGCONT to the pid the sandbox recorded):
while stopped it answers nothing, as a server starved of CPU at load 30 did (the leader exited with
status 4, "not renewed for 10 s"). One ``gearshift operator --leader-elect`` (lease 6 s, renew deadline 4 s,
retry 1 s: short but valid, so a loss is quick to provoke), on this module's namespace:

1. a starved but answering API server (stopped 0.6 s of every 1 s for 20 s: each request waits up to
   0.6 s) costs no Lease; then an outage longer than the renew deadline (7 s) must cost one (the leader
   cannot know it still holds it), and costs exactly one: the operator stops writing, re-executes itself
   (same pid: no container restart, the process never exits) and leads again within the back-off (4 s)
   plus a few retries;
2. a forced shift caught in Warming by such an outage completes (``Succeeded``) under the next leader,
   with the process never exiting.

On main the first outage ends the process (status 4) and nothing restarts it here, as nothing but the
kubelet's CrashLoopBackOff would in a cluster: both tests fail there.
"""

from __future__ import annotations

import os
import re
import signal
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from gearshift.dev.sandbox.harness import (
    LLAMA_3_2_1B,
    GpuNodes,
    OperatorProcess,
    install_crds,
    machine_load,
    pod_ready,
    pods,
    teardown_run,
    wait_until,
)
from gearshift.testing import manifests as build

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
LEASE = "gearshift-e2e-starved"
LEASE_S, RENEW_S, RETRY_S = 6, 4, 1
#: The outage: longer than the renew deadline, shorter than the control plane's own patience.
OUTAGE_S = 7.0
#: The re-campaign back-off's first step (gearshift.adapters.leader.Backoff.first_s), written out.
BACKOFF_S = 4.0
LEADING = re.compile(r"^(\S+ \S+) INFO gearshift\.operator: leading: acquired Lease \S+ as (\S+)", re.M)
LOST = re.compile(r"^(\S+ \S+) ERROR gearshift\.leader: leader election lost", re.M)
SERVICE, PREFILL_GS, DECODE_GS = "starved", "starved-prefill", "starved-decode"
POLICY = {"sampleIntervalS": 1, "warmS": 4, "rollbackWindowS": 6, "drainTimeoutS": 30, "warmupTimeoutS": 120,
          "dwellS": 600}  # fmt: skip


class Starver:
    """Stops and continues the sandbox's kube-apiserver; always continues it on the way out."""

    def __init__(self, kubeconfig: Path) -> None:
        pid_file = kubeconfig.parent / "pids" / "kube-apiserver.pid"
        self.pid = int(pid_file.read_text().strip())
        comm = Path(f"/proc/{self.pid}/comm").read_text().strip()
        assert comm.startswith("kube-apiserver"), f"pid {self.pid} is {comm}, not the API server"

    def stop(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def cont(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def outage(self, seconds: float) -> None:
        self.stop()
        try:
            time.sleep(seconds)
        finally:
            self.cont()

    def starve(self, seconds: float, stopped_s: float, period_s: float) -> None:
        """Stopped ``stopped_s`` of every ``period_s`` for ``seconds``."""
        end = time.monotonic() + seconds
        try:
            while time.monotonic() < end:
                self.stop()
                time.sleep(stopped_s)
                self.cont()
                time.sleep(period_s - stopped_s)
        finally:
            self.cont()


def _stamp(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


class Leader:
    """One ``gearshift operator --leader-elect`` on the namespace; its log read as the record."""

    def __init__(self, sandbox: Any, ns: str, log: Path) -> None:
        self.op = OperatorProcess(
            sandbox, ns, log,
            ["--leader-elect", "--leader-election-namespace", ns, "--leader-election-id", LEASE,
             "--lease-duration", str(LEASE_S), "--renew-deadline", str(RENEW_S),
             "--retry-period", str(RETRY_S), "--workers", "4"],
        )  # fmt: skip
        assert self.op.proc is not None
        self.pid = self.op.proc.pid

    def log(self) -> str:
        return self.op.log_tail(2_000_000)

    def terms(self) -> list[tuple[float, str]]:
        return [(_stamp(t), ident) for t, ident in LEADING.findall(self.log())]

    def losses(self) -> list[float]:
        return [_stamp(t) for t in LOST.findall(self.log())]

    def exited(self) -> bool | None:
        """True once the process has exited (None while it runs, for ``wait_until``)."""
        return True if self.op.proc is not None and self.op.proc.poll() is not None else None

    def assert_never_exited(self) -> None:
        """Restart count 0: the process the test started still runs (a re-exec keeps its pid)."""
        assert self.op.proc is not None and self.op.proc.pid == self.pid
        code = self.op.proc.poll()
        assert code is None, f"the operator exited with status {code}:\n{self.log()[-3000:]}"


@pytest.fixture(scope="module")
def busy() -> Iterator[None]:
    with machine_load("one-core-busy", 1800):
        yield


@pytest.fixture()
def starver(sandbox: Any, busy: None) -> Iterator[Starver]:
    if not getattr(sandbox, "is_sandbox", False):
        pytest.skip("stops the sandbox's own API server process")
    s = Starver(Path(sandbox.kubeconfig))
    try:
        yield s
    finally:
        s.cont()


def _ns(sandbox: Any) -> str:
    install_crds(sandbox)
    ns = f"e2e-starved-{uuid.uuid4().hex[:6]}"
    sandbox.kubectl("create", "namespace", ns)
    return ns


def _holder(sandbox: Any, ns: str) -> str | None:
    r = sandbox.kubectl("get", "lease", LEASE, "-n", ns, "-o", "jsonpath={.spec.holderIdentity}", check=False)
    return r.stdout.strip() or None if r.returncode == 0 else None


def test_starved_api_server_costs_no_lease_and_an_outage_one_without_exit(
    sandbox: Any, starver: Starver, tmp_path: Path
) -> None:
    ns = _ns(sandbox)
    leader: Leader | None = None
    try:
        leader = Leader(sandbox, ns, tmp_path / "operator.log")
        lead = leader
        wait_until(lambda: lead.terms() or None, 120, "the operator leads")
        (_, identity), *_ = leader.terms()

        # Starved but answering: every request waits up to 0.6 s. One PUT per renewal, paced from its
        # sending, keeps within the 4 s deadline: no loss.
        starver.starve(20, stopped_s=0.6, period_s=1.0)
        time.sleep(2 * RETRY_S)
        assert leader.losses() == [], leader.log()[-3000:]
        leader.assert_never_exited()

        # An outage past the renew deadline: exactly one loss, then the same process leads again.
        t_out = time.time()
        starver.outage(OUTAGE_S)
        wait_until(lambda: len(lead.terms()) >= 2 or lead.exited(), 60, "the operator leads again")
        leader.assert_never_exited()
        (lost_at,) = leader.losses()
        _, (relead_at, again) = leader.terms()
        leader.assert_never_exited()
        assert again == identity  # the Lease identity crosses the re-exec
        assert "re-executing the operator (pid " + str(leader.pid) + " kept)" in leader.log()
        # Lost within the renew deadline of the last renewal sent before the outage (at most one retry
        # period before it), plus the watchdog's poll and the log's flush.
        assert lost_at - t_out <= RENEW_S + 1.0, lost_at - t_out
        without = relead_at - lost_at
        print(f"outage {OUTAGE_S:g} s: lost {lost_at - t_out:.1f} s in, led again {without:.1f} s later")
        # Back-off, then the first try after the API server answers again (the Lease still names this
        # replica, so no lease duration is waited out); the outage's rest is part of it.
        assert BACKOFF_S <= without <= BACKOFF_S + OUTAGE_S + 4 * RETRY_S, without
        wait_until(lambda: _holder(sandbox, ns) == identity or None, 30, "the Lease names the leader")
        time.sleep(LEASE_S)  # a full lease duration more on the busy machine: still one loss, same process
        assert len(leader.losses()) == 1, leader.log()[-3000:]
        leader.assert_never_exited()
    finally:
        starver.cont()
        teardown_run(sandbox, ns, leader.op if leader else None)


# --- 2: a shift in flight ------------------------------------------------------------------------------
def _manifests(ns: str, prom_url: str, a10: dict[str, str], t4: dict[str, str]) -> list[dict[str, Any]]:
    """Two explicit prefill gears on this run's A10 nodes, one decode gear on its T4, the PDService."""
    stage = {"layers": [0, 16], "nodeSelector": a10, "gpuModel": "A10-24GB"}
    halves = [{"layers": [0, 8], "nodeSelector": a10, "gpuModel": "A10-24GB"},
              {"layers": [8, 16], "nodeSelector": a10, "gpuModel": "A10-24GB"}]  # fmt: skip
    prefill = build.gearset(PREFILL_GS, ns, {
        "serviceName": SERVICE, "role": "prefill", "mode": "explicit", "initialGear": "one",
        "gears": [{"name": "one", "intent": "balanced", "microBatch": 4, "maxBatch": 64, "stages": [stage]},
                  {"name": "two", "intent": "latency", "microBatch": 2, "maxBatch": 32, "stages": halves}],
        "policy": POLICY,
    })  # fmt: skip
    decode = build.gearset(DECODE_GS, ns, {
        "serviceName": SERVICE, "role": "decode", "mode": "explicit",
        "gears": [{"name": "d", "intent": "balanced", "microBatch": 8, "maxBatch": 64,
                   "stages": [{**stage, "nodeSelector": t4, "gpuModel": "T4-16GB"}]}],
        "policy": POLICY,
    })  # fmt: skip
    pds = build.pdservice(SERVICE, ns, {
        "model": LLAMA_3_2_1B, "engine": "sim", "prefill": {"gearSetRef": {"name": PREFILL_GS}},
        "decode": {"gearSetRef": {"name": DECODE_GS}}, "slo": {"ttftMs": 200, "itlMs": 50},
        "prometheusUrl": prom_url,
    })  # fmt: skip
    return [prefill, decode, pds]


def _status(sandbox: Any, ns: str) -> dict[str, Any]:
    return dict(sandbox.kubectl_json("get", "gearset", PREFILL_GS, "-n", ns).get("status") or {})


def _role_ready(sandbox: Any, ns: str, role: str) -> bool:
    svc = sandbox.kubectl_json("get", "service", f"{SERVICE}-{role}", "-n", ns)
    label = ",".join(f"{k}={v}" for k, v in svc["spec"]["selector"].items())
    heads = pods(sandbox, ns, label)
    return bool(heads) and all(pod_ready(p) for p in heads)


def _signals_ok(sandbox: Any, ns: str) -> bool:
    conds = _status(sandbox, ns).get("conditions") or []
    return any(c["type"] == "SignalsAvailable" and c["status"] == "True" for c in conds)


def test_a_shift_in_flight_completes_under_the_next_leader(
    sandbox: Any, starver: Starver, tmp_path: Path
) -> None:
    if not sandbox.prometheus_url:
        pytest.skip("a shift needs the sandbox's Prometheus (signals)")
    ns = _ns(sandbox)
    nodes = GpuNodes(sandbox, "e2e-starved", cidr_base=200, gpu_replicas=2)
    leader: Leader | None = None
    try:
        for _ in range(2):
            nodes.add("A10-24GB", "a10")
        nodes.add("T4-16GB", "t4")
        pool = "gearshift.io/node-pool"
        sandbox.apply(
            _manifests(ns, sandbox.prometheus_url, {pool: nodes.pool("a10")}, {pool: nodes.pool("t4")})
        )
        leader = Leader(sandbox, ns, tmp_path / "operator.log")
        for role in ("prefill", "decode"):
            sandbox.wait_for(lambda r=role: _role_ready(sandbox, ns, r), 240, f"{role} gear Ready")
        sandbox.wait_for(lambda: _signals_ok(sandbox, ns), 120, "SignalsAvailable=True")
        sandbox.kubectl(
            "patch", "gearset", PREFILL_GS, "-n", ns, "--type=merge", "-p", '{"spec":{"forceGear":"two"}}'
        )
        sandbox.wait_for(lambda: _status(sandbox, ns).get("phase") == "Warming", 120, "Warming", interval=0.2)
        starver.outage(OUTAGE_S)  # the leader cannot renew: it loses the Lease in mid-shift
        lead = leader
        wait_until(lambda: len(lead.losses()) >= 1 or None, 30, "the Lease lost in mid-shift")
        wait_until(lambda: len(lead.terms()) >= 2 or lead.exited(), 60, "the next leader")
        leader.assert_never_exited()

        def done() -> bool:
            st = _status(sandbox, ns)
            return st.get("phase") == "Stable" and bool(st.get("history"))

        sandbox.wait_for(done, 240, "the shift to finish under the next leader")
        st = _status(sandbox, ns)
        h = st["history"][-1]
        assert (h["from"], h["to"], h["trigger"], h["outcome"]) == ("one", "two", "forced", "Succeeded"), h
        assert st["activeGear"] == "two"
        assert _role_ready(sandbox, ns, "prefill")
        leader.assert_never_exited()
        print(f"Lease losses {len(leader.losses())}, terms {len(leader.terms())}")
    finally:
        starver.cont()
        left = teardown_run(sandbox, ns, leader.op if leader else None, nodes)
        assert not left, f"not deleted: {left}"
