"""Time-limited GPU nodes ("time fragments", issue 13) on the sandbox twin: used while free, vacated
before the deadline through shadow → drain → switch, with zero failed requests.

Real here: the kube-apiserver, scheduler, StatefulSet and garbage controllers of the sandbox, the operator
(a subprocess watching only this module's namespace, with the GPUProfile and node handlers disabled as
in test_router.py), the router pod and the simulated engines (``gearshift-sim`` processes on loopback pod
IPs, run by the sandbox pod runner), and the HTTP load through the router pod's IP
(``gearshift.loadgen.run_load``). Simulated: the GPUs (fake kwok nodes with datasheet figures, engines
that model time instead of computing), and the window itself: the node carries the annotation
``gearshift.io/available-until``, and since the GPUProfile handler is disabled here (it would probe the
shared sandbox's nodes), the test writes ``status.availableUntil`` with the operator's own
``probe_lifecycle.window_step`` — the code the handler runs. Nothing reclaims the node at the deadline;
the test checks that no pod of the service is on it by then.

The nodes are the test's own (a unique node pool, podCIDR indices 150-199, 2 time-sliced
``nvidia.com/gpu`` per card so a shadow sits beside the active pod): one A10 for an explicit prefill
gear, two A10s for the auto decode role, one of them windowed ~170 s ahead. The planner makes the
decode latency gear one stage replicated on both (replica 0 on the durable node, the extra on the
windowed one). Short policy: dwellS 20, warmS 5, drainTimeoutS 15, rollbackWindowS 10, windowMarginS 45
→ leaveBy = deadline − 45 − max(20, 5 + 15 + 10) = deadline − 75 s.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from gearshift.api import crdgen
from gearshift.api.gpuprofile import GPUProfileStatus
from gearshift.fleet import FleetNode
from gearshift.gpus import gpu_spec
from gearshift.k8s.services import ROUTER_PORT
from gearshift.loadgen import LoadResult, TraceRequest, run_load
from gearshift.planner_input import datasheet_gpuprofile
from gearshift.probe_lifecycle import window_step
from gearshift.profiles import node_view
from gearshift.sandbox.nodes import gpu_node_manifest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SERVICE = "tf"
DECODE_GS = f"{SERVICE}-decode"
#: Llama-3.2-1B's shape (its config.json): 16 layers, hidden 2048, 32/8 heads, head dim 64.
MODEL = {
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
POLICY = {"dwellS": 20, "warmS": 5, "drainTimeoutS": 15, "rollbackWindowS": 10, "sampleIntervalS": 1}
MARGIN_S = 45
#: The window closes this long after the test declares it.
DEADLINE_S = 170
#: Steady load through the router: requests/s, prompt and output tokens.
RPS, PROMPT, OUTPUT = 2.0, 128, 16


def manifests(ns: str, prefill_node: str, decode_pool: str, prom_url: str | None) -> list[dict[str, Any]]:
    """Explicit prefill on one node, auto decode on the decode pool (short policy), the PDService."""
    prefill = {
        "apiVersion": "gearshift.io/v1alpha1",
        "kind": "GearSet",
        "metadata": {"name": f"{SERVICE}-prefill", "namespace": ns},
        "spec": {
            "serviceName": SERVICE, "role": "prefill", "mode": "explicit",
            "gears": [{"name": "p", "intent": "balanced", "microBatch": 4, "maxBatch": 64,
                       "stages": [{"layers": [0, 16], "nodes": [prefill_node], "gpuModel": "A10-24GB"}]}],
        },
    }  # fmt: skip
    decode = {
        "apiVersion": "gearshift.io/v1alpha1",
        "kind": "GearSet",
        "metadata": {"name": DECODE_GS, "namespace": ns},
        "spec": {
            "serviceName": SERVICE, "role": "decode", "mode": "auto",
            "plan": {"constraints": {"nodeSelector": {"gearshift.io/node-pool": decode_pool},
                                     "windowMarginS": MARGIN_S}},
            "policy": POLICY,
        },
    }  # fmt: skip
    spec: dict[str, Any] = {
        "model": MODEL,
        "engine": "sim",
        "prefill": {"gearSetRef": {"name": f"{SERVICE}-prefill"}},
        "decode": {"gearSetRef": {"name": DECODE_GS}},
        "slo": {"ttftMs": 200, "itlMs": 50},
    }
    if prom_url:
        spec["prometheusUrl"] = prom_url  # in-flight counts end the drain early; not needed to vacate
    pds = {"apiVersion": "gearshift.io/v1alpha1", "kind": "PDService",
           "metadata": {"name": SERVICE, "namespace": ns}, "spec": spec}  # fmt: skip
    return [prefill, decode, pds]


class Nodes:
    """GPU nodes private to this module (unique pools), each with a datasheet GPUProfile; deletes checked."""

    def __init__(self, sandbox: Any) -> None:
        self.sandbox = sandbox
        self.tag = uuid.uuid4().hex[:6]
        self.made: list[str] = []

    def pool(self, role: str) -> str:
        return f"e2e-tf-{self.tag}-{role}"

    def add(self, model: str, role: str, until: datetime | None = None) -> str:
        sb = self.sandbox
        i = len(self.made)
        name = f"gpu-{self.pool(role)}-{i}"
        index = 150 + (int(self.tag, 16) + i) % 50
        node = gpu_node_manifest(
            FleetNode(name, self.pool(role), gpu_spec(model), 1, 25, 10), index, sb.octet, gpu_replicas=2
        )
        if until is not None:
            node["metadata"].setdefault("annotations", {})["gearshift.io/available-until"] = until.isoformat()
        status = node.pop("status")
        sb.apply(node)
        self.made.append(name)
        sb.kubectl("patch", "node", name, "--subresource=status", "--type=merge", "-p",
                   json.dumps({"status": status}))  # fmt: skip
        prof = datasheet_gpuprofile({**node, "status": status})
        if until is not None:  # what the GPUProfile handler's window_step writes for the annotation
            step = window_step(
                GPUProfileStatus.model_validate(prof["status"]),
                node_view({**node, "status": status}),  # type: ignore[arg-type]
                None,
                now=datetime.now(UTC),
                generation=None,
            )
            assert step is not None and step.status.available_until is not None
            prof["status"] = step.status.to_json()
        sb.apply({k: prof[k] for k in ("apiVersion", "kind", "metadata", "spec")})
        sb.kubectl("patch", "gpuprofile", name, "--subresource=status", "--type=merge", "-p",
                   json.dumps({"status": prof["status"]}))  # fmt: skip
        return name

    def delete_all(self) -> list[str]:
        """Delete every node and profile made; returns the ones the API server still has (should be [])."""
        for name in self.made:
            for kind in ("node", "gpuprofile"):
                self.sandbox.kubectl("delete", kind, name, "--wait=false", "--ignore-not-found", check=False)
        left = []
        for name in self.made:
            for kind in ("node", "gpuprofile"):
                r = self.sandbox.kubectl("get", kind, name, "--ignore-not-found", "-o", "name", check=False)
                if r.stdout.strip():
                    left.append(f"{kind}/{name}")
        return left


class Operator:
    """The operator as a subprocess on one namespace; stopped by its pid."""

    def __init__(self, sandbox: Any, ns: str, log: Path) -> None:
        code = (
            "import argparse, sys; from gearshift import operator_main as m; "
            "p = argparse.ArgumentParser(); m.add_arguments(p); sys.exit(m.run(p.parse_args(sys.argv[1:])))"
        )
        argv = [
            sys.executable, "-c", code, "--kubeconfig", str(sandbox.kubeconfig), "--namespace", ns,
            "--standalone", "--probe-port", "0", "--metrics-port", "0",
            "--disable", "gearshift.handlers.gpuprofile", "--disable", "gearshift.handlers.nodes",
        ]  # fmt: skip
        self.log = log
        self._fh = log.open("wb")
        self.proc = subprocess.Popen(argv, stdout=self._fh, stderr=subprocess.STDOUT, env=sandbox.env)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._fh.close()


def _ready(pod: dict[str, Any]) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds) and not pod["metadata"].get(
        "deletionTimestamp"
    )


def _pods(sandbox: Any, ns: str, selector: str) -> list[dict[str, Any]]:
    return list(sandbox.kubectl_json("get", "pods", "-n", ns, "-l", selector)["items"])


def _diagnose(sandbox: Any, ns: str, operator_log: Path) -> str:
    out = []
    for args in (
        ("get", "pods", "-n", ns, "-o", "wide"),
        ("get", "gearset", DECODE_GS, "-n", ns, "-o", "jsonpath={.status}"),
        ("get", "events", "-n", ns, "--sort-by", ".lastTimestamp"),
    ):
        r = sandbox.kubectl(*args, check=False)
        out.append(f"$ kubectl {' '.join(args)}\n{r.stdout[-4000:]}{r.stderr[-1000:]}")
    out.append("operator log (tail):\n" + operator_log.read_text(errors="replace")[-4000:])
    return "\n".join(out)


@pytest.fixture(scope="module")
def env(sandbox: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if not getattr(sandbox, "is_sandbox", False):
        pytest.skip("needs the gearshift sandbox (loopback pod IPs run by the sandbox pod runner)")
    # The repo's CRDs (status.windowedNodes and its states are recent; a stale CRD would prune them).
    sandbox.kubectl("apply", "-f", str(REPO / "crds"))
    for kind in crdgen.KINDS:
        sandbox.kubectl("wait", "--for=condition=Established", f"crd/{kind.name}", "--timeout=60s")
    ns = f"e2e-tf-{uuid.uuid4().hex[:6]}"
    sandbox.kubectl("create", "namespace", ns)
    nodes = Nodes(sandbox)
    op: Operator | None = None
    try:
        deadline = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=DEADLINE_S)
        prefill_node = nodes.add("A10-24GB", "p")
        durable = nodes.add("A10-24GB", "d")
        windowed = nodes.add("A10-24GB", "d", until=deadline)
        op = Operator(sandbox, ns, tmp_path_factory.mktemp("operator") / "operator.log")
        sandbox.apply(manifests(ns, prefill_node, nodes.pool("d"), sandbox.prometheus_url))
        heads = f"gearshift.io/service={SERVICE},gearshift.io/stage=0"
        router_sel = f"gearshift.io/service={SERVICE},app.kubernetes.io/component=router"

        def up() -> str | None:
            pods = _pods(sandbox, ns, heads)
            on_w = [p for p in pods if p["spec"].get("nodeName") == windowed and _ready(p)]
            routers = [p for p in _pods(sandbox, ns, router_sel) if _ready(p)]
            if sum(_ready(p) for p in pods) >= 3 and on_w and routers:
                return str(routers[0]["status"]["podIP"])
            return None

        try:
            ip = sandbox.wait_for(up, 100, "prefill, 2 decode replicas (one on the windowed node), router")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{_diagnose(sandbox, ns, op.log)}") from None
        assert ip.startswith("127."), ip
        yield {
            "ns": ns,
            "router": f"http://{ip}:{ROUTER_PORT}",
            "windowed": windowed,
            "durable": durable,
            "deadline": deadline,
            "log": op.log,
        }
    finally:
        if op is not None:
            op.stop()
        sandbox.kubectl("delete", "pdservice,gearset", "--all", "-n", ns, "--wait=false", check=False)
        for kind, name in (
            ("pdservice", SERVICE),
            ("gearset", f"{SERVICE}-prefill"),
            ("gearset", DECODE_GS),
        ):
            sandbox.kubectl("patch", kind, name, "-n", ns, "--type=merge", "-p",
                            '{"metadata":{"finalizers":null}}', check=False)  # fmt: skip
        r = sandbox.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        assert r.returncode == 0, f"deleting namespace {ns}: {r.stderr}"
        left = nodes.delete_all()
        assert not left, f"not deleted: {left}"


def test_windowed_node_used_then_vacated_without_failed_requests(sandbox: Any, env: dict[str, Any]) -> None:
    ns, windowed, deadline = env["ns"], env["windowed"], env["deadline"]
    gs = sandbox.kubectl_json("get", "gearset", DECODE_GS, "-n", ns)
    st = gs["status"]
    (w,) = st["windowedNodes"]
    assert w["node"] == windowed and w["state"] == "InUse", w
    active = st["activeGear"]
    assert f"{active}/s0" in w["stages"], (active, w)
    leave_by = datetime.fromisoformat(w["leaveBy"])
    assert leave_by == deadline - timedelta(seconds=MARGIN_S + 30)

    # Steady load through the router pod's IP until just past the deadline.
    span = (deadline - datetime.now(UTC)).total_seconds() + 5
    n = max(1, int(span * RPS))
    trace = [TraceRequest(i / RPS, PROMPT, OUTPUT) for i in range(n)]
    result: dict[str, LoadResult] = {}

    def load() -> None:
        result["r"] = asyncio.run(
            run_load([env["router"]], trace, max_requests=n, max_duration_s=span + 5, drain_s=30,
                     stream=True, model=MODEL["name"])
        )  # fmt: skip

    th = threading.Thread(target=load, daemon=True)
    th.start()
    # Watch the windowed node until the deadline (bounded: the deadline is ≤ DEADLINE_S away).
    vacated_at: datetime | None = None
    while datetime.now(UTC) < deadline:
        on_w = sandbox.kubectl_json("get", "pods", "-n", ns, "--field-selector", f"spec.nodeName={windowed}")[
            "items"
        ]
        if not on_w and vacated_at is None:
            vacated_at = datetime.now(UTC)
        elif on_w:
            vacated_at = None
        time.sleep(2)
    on_w = sandbox.kubectl_json("get", "pods", "-n", ns, "--field-selector", f"spec.nodeName={windowed}")
    th.join(timeout=span + 60)
    assert not th.is_alive(), "the load did not finish"
    res = result["r"]
    gs = sandbox.kubectl_json("get", "gearset", DECODE_GS, "-n", ns)
    diag = "" if not on_w["items"] and vacated_at else _diagnose(sandbox, ns, env["log"])
    assert on_w["items"] == [], f"pods still on {windowed} at the deadline\n{diag}"
    assert vacated_at is not None and vacated_at <= deadline, diag
    st = gs["status"]
    hist = [h for h in st.get("history") or [] if h["trigger"] == "window"]
    assert hist and hist[-1]["outcome"] == "Succeeded" and hist[-1]["from"] == active, st.get("history")
    assert hist[-1]["to"].startswith(f"{active}-w")
    # After the move the ordinary triggers may shift again (e.g. p99-low → balanced); whatever serves now
    # is a gear planned without the windowed node, which the empty node above already shows.
    history = st.get("history") or []
    later = history[history.index(hist[-1]) + 1 :]
    assert st["activeGear"] in {hist[-1]["to"]} | {g for h in later for g in (h["from"], h["to"])}
    (w,) = st["windowedNodes"]
    assert w["state"] == "Left" and w["stages"] == []
    # Zero failed requests through the whole move.
    assert res.issued == n
    assert (res.completed, res.failed, res.incomplete) == (n, 0, 0), dict(list(res.errors.items())[:5])
    print(
        f"\ntime fragments: {n} requests at {RPS} rps, 0 failed; leaveBy {leave_by.isoformat()}, "
        f"vacated {vacated_at.isoformat()} ({(deadline - vacated_at).total_seconds():.0f} s before the "
        f"deadline); shift {hist[-1]['startedAt']} → {hist[-1]['finishedAt']}"
    )
