"""The PD router as the PDService's router pod on the sandbox twin, serving a slice of the shared trace.

The operator runs as a subprocess watching only this module's namespace (the cluster-wide GPUProfile and
node handlers disabled; ``gearshift.dev.sandbox.harness.OperatorProcess``). The test makes its own GPU nodes
with datasheet GPUProfiles (``harness.GpuNodes``: unique node pools, podCIDR indices 200-249, so the
shared sandbox's other users keep theirs): two A10 nodes for a prefill gear with two stage-0 replicas
and one T4 node for the decode gear — fast and slow cards on the two sides of the PD split. The PDService
(engine ``sim``, a Llama-3.2-1B-shaped model, policy ``pd-score``) makes the operator deploy the router
Deployment; the sandbox pod runner runs ``gearshift-router`` on a loopback pod IP with its
ServiceAccount's token, so its Role applies.

Membership path proven here: the API server refuses loopback addresses in EndpointSlices ("may not be in
the loopback range"), so the role Services' EndpointSlices hold no endpoint and the router falls back to
the Services' selectors and the Ready pods they select (router/membership.py, commit 138e328). The test
asserts that the slices are empty and that the router still knows every head pod by its loopback IP.

Checked: the router pod gets Ready; a bounded slice of the bundled trace
(``gearshift.dev.loadgen.DEFAULT_TRACE``) (40 requests, outputs clipped to 16 tokens, prompts to 512)
replayed through the router pod's IP with
``gearshift.dev.loadgen.run_load`` (streamed) all succeed; the router's ``/metrics`` counts picks on both
prefill pods and on the decode pod; a streamed request yields several SSE ``data:`` chunks and
``[DONE]`` through the router.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gearshift.dev.loadgen import DEFAULT_TRACE as TRACE
from gearshift.dev.loadgen import TraceRequest, load_trace, run_load
from gearshift.dev.sandbox.harness import (
    LLAMA_3_2_1B,
    GpuNodes,
    OperatorProcess,
    pods,
    serving_router_url,
    teardown_run,
)
from gearshift.testing import manifests as build

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SERVICE = "rt"
MODEL = LLAMA_3_2_1B
N_REQUESTS = 40
MAX_OUTPUT = 16
MAX_PROMPT = 512
#: Mean request rate of the replayed slice, requests/s (the trace's own gaps, scaled in time).
TARGET_RPS = 4.0


def manifests(ns: str, prefill_nodes: list[str], decode_nodes: list[str]) -> list[dict[str, Any]]:
    """Two explicit GearSets pinned to the test's nodes, and the PDService (router policy pd-score)."""
    prefill = build.gearset(f"{SERVICE}-prefill", ns, {
        "serviceName": SERVICE,
        "role": "prefill",
        "mode": "explicit",
        "gears": [
            {"name": "p", "intent": "balanced", "microBatch": 4, "maxBatch": 64,
             "stages": [{"layers": [0, 16], "replicas": 2, "nodes": prefill_nodes,
                         "gpuModel": "A10-24GB"}]},
        ],
    })  # fmt: skip
    decode = build.gearset(f"{SERVICE}-decode", ns, {
        "serviceName": SERVICE,
        "role": "decode",
        "mode": "explicit",
        "gears": [
            {"name": "d", "intent": "balanced", "microBatch": 8, "maxBatch": 64,
             "stages": [{"layers": [0, 16], "nodes": decode_nodes, "gpuModel": "T4-16GB"}]},
        ],
    })  # fmt: skip
    pds = build.pdservice(SERVICE, ns, {
        "model": MODEL,
        "engine": "sim",
        "prefill": {"gearSetRef": {"name": f"{SERVICE}-prefill"}},
        "decode": {"gearSetRef": {"name": f"{SERVICE}-decode"}},
        "slo": {"ttftMs": 200, "itlMs": 50},
        "router": {"policy": "pd-score"},
    })  # fmt: skip
    return [prefill, decode, pds]


def _get(url: str, timeout: float = 5.0) -> str:
    assert url.startswith("http://127."), url  # loopback only
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return str(r.read().decode())


def _diagnose(sandbox: Any, ns: str, selector: str, operator_log: Path) -> str:
    """What a failed wait needs: the router Deployment and pods, their logs, events, the operator's log."""
    out = []
    for args in (
        ("get", "deploy,pods", "-n", ns, "-o", "wide"),
        ("describe", "pods", "-n", ns, "-l", selector),
        ("logs", "-n", ns, "-l", selector, "--tail", "40"),
        ("get", "events", "-n", ns, "--sort-by", ".lastTimestamp"),
    ):
        r = sandbox.kubectl(*args, check=False)
        out.append(f"$ kubectl {' '.join(args)}\n{r.stdout[-3000:]}{r.stderr[-1000:]}")
    out.append("operator log (tail):\n" + operator_log.read_text(errors="replace")[-3000:])
    return "\n".join(out)


@pytest.fixture(scope="module")
def env(sandbox: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if not getattr(sandbox, "is_sandbox", False):
        pytest.skip("needs the gearshift sandbox (loopback pod IPs run by the sandbox pod runner)")
    ns = f"e2e-router-{uuid.uuid4().hex[:6]}"
    sandbox.kubectl("create", "namespace", ns)
    gpus = GpuNodes(sandbox, "e2e-rt", cidr_base=200)
    op: OperatorProcess | None = None
    try:
        nodes = [gpus.add("A10-24GB", "p"), gpus.add("A10-24GB", "p"), gpus.add("T4-16GB", "d")]
        op = OperatorProcess(sandbox, ns, tmp_path_factory.mktemp("operator") / "operator.log")
        sandbox.apply(manifests(ns, nodes[:2], nodes[2:]))
        heads = f"gearshift.io/service={SERVICE},gearshift.io/stage=0"
        router_sel = f"gearshift.io/service={SERVICE},app.kubernetes.io/component=router"
        log = op.log
        url = serving_router_url(sandbox, ns, SERVICE, 3, lambda: _diagnose(sandbox, ns, router_sel, log))
        yield {"ns": ns, "router": url, "heads": heads, "nodes": nodes}
    finally:
        left = teardown_run(sandbox, ns, op, gpus)
        assert left == [], f"teardown left {left}"


def test_membership_falls_back_to_service_selectors(sandbox: Any, env: dict[str, Any]) -> None:
    ns = env["ns"]
    slices = sandbox.kubectl_json("get", "endpointslices", "-n", ns)["items"]
    addresses = [a for s in slices for e in (s.get("endpoints") or []) for a in e.get("addresses", [])]
    assert addresses == [], "the API server took loopback addresses: the fallback is not what is tested"
    heads = {p["metadata"]["name"]: p for p in pods(sandbox, ns, env["heads"])}

    def router_pods() -> list[dict[str, Any]] | None:
        known = json.loads(_get(env["router"] + "/debug/pods"))["pods"]
        return known if len(known) == 3 else None

    known = sandbox.wait_for(router_pods, 60, "the router to know the 3 head pods")
    by_name = {p["name"]: p for p in known}
    assert set(by_name) == set(heads)
    for name, pod in heads.items():
        assert by_name[name]["url"] == f"http://{pod['status']['podIP']}:8000"
        assert by_name[name]["role"] == pod["metadata"]["labels"]["gearshift.io/role"]
    assert {p["gpuModel"] for p in known if p["role"] == "prefill"} == {"A10-24GB"}
    assert {p["gpuModel"] for p in known if p["role"] == "decode"} == {"T4-16GB"}


def _trace_slice(n: int) -> list[TraceRequest]:
    rows = load_trace(TRACE, limit=n)
    return [
        TraceRequest(t.offset_s, min(t.prompt_tokens, MAX_PROMPT), max(1, min(t.output_tokens, MAX_OUTPUT)))
        for t in rows
    ]


def test_trace_slice_through_the_router_pod(sandbox: Any, env: dict[str, Any]) -> None:
    if not TRACE.exists():
        pytest.skip(f"{TRACE} is not on this machine")
    trace = _trace_slice(N_REQUESTS)
    span = trace[-1].offset_s - trace[0].offset_s
    scale = max(span, 1e-9) / (len(trace) - 1) * TARGET_RPS  # mean gap → 1 / TARGET_RPS s
    res = asyncio.run(
        run_load(
            [env["router"]],
            trace,
            time_scale=scale,
            max_requests=N_REQUESTS,
            max_duration_s=60,
            drain_s=60,
            stream=True,
            model=MODEL["name"],
        )
    )
    assert res.issued == N_REQUESTS
    assert (res.completed, res.failed, res.incomplete) == (N_REQUESTS, 0, 0), res.errors
    assert res.ttft_ms is not None and res.itl_ms is not None  # streamed: a first token, then gaps
    # The router's own counters: picks by pod and role.
    metrics = _get(env["router"] + "/metrics")
    picks: dict[tuple[str, str], float] = {}
    for line in metrics.splitlines():
        if line.startswith("gearshift_router_picks_total{"):
            labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1 : line.index("}")].split(","))
            key = (labels["role"].strip('"'), labels["pod"].strip('"'))
            picks[key] = picks.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    heads = pods(sandbox, env["ns"], env["heads"])
    prefill = [
        p["metadata"]["name"] for p in heads if p["metadata"]["labels"]["gearshift.io/role"] == "prefill"
    ]
    decode = [
        p["metadata"]["name"] for p in heads if p["metadata"]["labels"]["gearshift.io/role"] == "decode"
    ]
    assert len(prefill) == 2 and len(decode) == 1
    for name in prefill:
        assert picks.get(("prefill", name), 0) > 0, picks
    assert picks.get(("decode", decode[0]), 0) >= N_REQUESTS, picks
    assert sum(v for (role, _), v in picks.items() if role == "prefill") >= N_REQUESTS


def test_streaming_end_to_end(env: dict[str, Any]) -> None:
    body = {"model": MODEL["name"], "prompt": " ".join(["hello"] * 64), "max_tokens": 8, "stream": True}
    req = urllib.request.Request(
        env["router"] + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    assert req.full_url.startswith("http://127.")
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = [ln[6:] for ln in r.read().decode().splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = [c["choices"][0]["text"] for c in chunks if c.get("choices")]
    assert len(text) >= 2 and "".join(text)  # several chunks: streamed, not one buffered answer
