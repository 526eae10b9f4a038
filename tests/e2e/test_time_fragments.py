"""Time-limited GPU nodes ("time fragments") on the sandbox twin: used while free, vacated
before the deadline through shadow → drain → switch, with zero failed requests.

Real here: the kube-apiserver, scheduler, StatefulSet and garbage controllers of the sandbox, the operator
(a subprocess watching only this module's namespace, with the GPUProfile and node handlers disabled as
in test_router.py), the router pod and the simulated engines (``gearshift-sim`` processes on loopback pod
IPs, run by the sandbox pod runner), and the HTTP load through the router pod's IP
(``gearshift.dev.loadgen.run_load``). Simulated: the GPUs (fake kwok nodes with datasheet figures, engines
that model time instead of computing), and the window itself: the node carries the annotation
``gearshift.io/available-until``, and since the GPUProfile handler is disabled here (it would probe the
shared sandbox's nodes), the test writes ``status.availableUntil`` with the operator's own
``profiling.window.window_step`` — the code the handler runs. Nothing reclaims the node at the deadline;
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
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from gearshift.dev.loadgen import LoadResult, TraceRequest, run_load
from gearshift.dev.sandbox.harness import (
    LLAMA_3_2_1B,
    GpuNodes,
    OperatorProcess,
    install_crds,
    pod_ready,
    pods,
    teardown_run,
)
from gearshift.k8s.services import ROUTER_PORT
from gearshift.testing import manifests as build

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SERVICE = "tf"
DECODE_GS = f"{SERVICE}-decode"
MODEL = LLAMA_3_2_1B
POLICY = {"dwellS": 20, "warmS": 5, "drainTimeoutS": 15, "rollbackWindowS": 10, "sampleIntervalS": 1}
MARGIN_S = 45
#: The window closes this long after the test declares it.
DEADLINE_S = 170
#: Steady load through the router: requests/s, prompt and output tokens.
RPS, PROMPT, OUTPUT = 2.0, 128, 16


def manifests(ns: str, prefill_node: str, decode_pool: str, prom_url: str | None) -> list[dict[str, Any]]:
    """Explicit prefill on one node, auto decode on the decode pool (short policy), the PDService."""
    prefill = build.gearset(f"{SERVICE}-prefill", ns, {
        "serviceName": SERVICE, "role": "prefill", "mode": "explicit",
        "gears": [{"name": "p", "intent": "balanced", "microBatch": 4, "maxBatch": 64,
                   "stages": [{"layers": [0, 16], "nodes": [prefill_node], "gpuModel": "A10-24GB"}]}],
    })  # fmt: skip
    decode = build.gearset(DECODE_GS, ns, {
        "serviceName": SERVICE, "role": "decode", "mode": "auto",
        "plan": {"constraints": {"nodeSelector": {"gearshift.io/node-pool": decode_pool},
                                 "windowMarginS": MARGIN_S}},
        "policy": POLICY,
    })  # fmt: skip
    spec: dict[str, Any] = {
        "model": MODEL,
        "engine": "sim",
        "prefill": {"gearSetRef": {"name": f"{SERVICE}-prefill"}},
        "decode": {"gearSetRef": {"name": DECODE_GS}},
        "slo": {"ttftMs": 200, "itlMs": 50},
    }
    if prom_url:
        spec["prometheusUrl"] = prom_url  # in-flight counts end the drain early; not needed to vacate
    pds = build.pdservice(SERVICE, ns, spec)
    return [prefill, decode, pds]


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
    # This code's CRDs (status.windowedNodes and its states are recent; a stale CRD would prune them).
    install_crds(sandbox)
    ns = f"e2e-tf-{uuid.uuid4().hex[:6]}"
    sandbox.kubectl("create", "namespace", ns)
    nodes = GpuNodes(sandbox, "e2e-tf", cidr_base=150, gpu_replicas=2)
    op: OperatorProcess | None = None
    try:
        deadline = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=DEADLINE_S)
        prefill_node = nodes.add("A10-24GB", "p")
        durable = nodes.add("A10-24GB", "d")
        windowed = nodes.add("A10-24GB", "d", until=deadline)
        op = OperatorProcess(sandbox, ns, tmp_path_factory.mktemp("operator") / "operator.log")
        sandbox.apply(manifests(ns, prefill_node, nodes.pool("d"), sandbox.prometheus_url))
        heads = f"gearshift.io/service={SERVICE},gearshift.io/stage=0"
        router_sel = f"gearshift.io/service={SERVICE},app.kubernetes.io/component=router"

        def up() -> str | None:
            engines = pods(sandbox, ns, heads)
            on_w = [p for p in engines if p["spec"].get("nodeName") == windowed and pod_ready(p)]
            routers = [p for p in pods(sandbox, ns, router_sel) if pod_ready(p)]
            if sum(pod_ready(p) for p in engines) >= 3 and on_w and routers:
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
        left = teardown_run(sandbox, ns, op, nodes)
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
