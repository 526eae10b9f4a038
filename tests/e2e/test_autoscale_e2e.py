"""Pipeline-replica autoscaling on the sandbox twin: the decode-headroom trigger, scale-down with a
drain, and a scale-up blocked by a full fleet that proceeds when a node appears.

The operator runs as a subprocess watching only this module's namespace (the cluster-wide GPUProfile and
node handlers disabled: ``gearshift.dev.sandbox.harness.OperatorProcess``); the test makes its own GPU
nodes in two unique node pools (``harness.GpuNodes``, podCIDR indices 100-149, away from the fleet's and
the other tests') with datasheet GPUProfiles, and deletes them afterwards. One PDService, engine ``sim``,
router policy ``pd-score``:

- prefill: one A10 node, one pipeline replica;
- decode: a T4 pool, ``scaling: {minReplicas: 1, maxReplicas: 2}``. The model is Llama-2-7B-shaped
  (32 layers, hidden 4096, 32 KV heads: 512 KiB of KV cache per token) so that on a 16 GB T4 the weights
  leave a KV pool of 3776 tokens: about six requests of 512 + 128 tokens. Under a few requests/s the
  router's seed-000 filter (free KV >= 1.2 x the request's KV) finds no decode pod for a request: the
  router holds it (FIFO, up to its ``--headroom-wait`` of 30 s, then 503 "scale-up requested") and
  counts ``gearshift_router_no_decode_headroom_total`` once at its first miss — the autoscaler's
  immediate scale-up signal. A small Llama-1B-shaped model would hold ~380k tokens on the same card and
  never run out.

Windows stated for the test: ``scaleUpS`` 300 (so the KV-usage path cannot be what scales up here: only the
router's rejections are immediate), ``scaleDownS`` 6, ``scaleToMinDelayS`` 6; ITL SLO 250 ms (a 7B model on
a T4 decodes at ~65 ms per step, so the P99/SLO ratio stays low and does not hold replicas up).

Tests, in order on the same service:

1. decode-headroom trigger: requests held for headroom → ``GearSet.spec.replicas`` 1 → 2 (reason
   ``NoDecodeHeadroom``) and the second decode pipeline replica Ready on the second T4 node; time to scale
   up measured (from the first miss);
2. scale-down: the heavy load stops, a light load runs through the router with the load generator
   (``gearshift.dev.loadgen.run_load``); the autoscaler labels the ordinal-1 head ``gearshift.io/draining``,
   waits for it to drain, and replicas fall to 1 with zero failed requests;
3. no free GPU: the spare T4 node is deleted (the only decode node holds replica 0), heavy load again →
   ``ScalingActive=False`` reason ``NoFreeGPU``, ``spec.replicas`` stays 1 and no pod of the service is
   evicted (names and UIDs unchanged); a new T4 node in the pool → the scale-up proceeds onto it.

With ``GEARSHIFT_AUTOSCALE_RESULTS=path`` the measured figures are merged into that JSON file under
``sandbox_e2e`` (bench/results/autoscale.json keeps its virtual-time results beside them).
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gearshift.dev.loadgen import TraceRequest, run_load
from gearshift.dev.sandbox.harness import GpuNodes, OperatorProcess, holds, pod_ready, pods, teardown_run
from gearshift.k8s.services import ROUTER_PORT
from gearshift.testing import manifests as build

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SERVICE = "asc"
PREFILL_GS = f"{SERVICE}-prefill"
DECODE_GS = f"{SERVICE}-decode"
#: Llama-2-7B's shape (its config.json): 32 layers, hidden 4096, 32 heads and 32 KV heads of 128.
MODEL = {
    "name": "meta-llama/Llama-2-7b-hf",
    "numLayers": 32,
    "hiddenSize": 4096,
    "numHeads": 32,
    "numKvHeads": 32,
    "headDim": 128,
    "intermediateSize": 11008,
    "vocabSize": 32000,
    "dtype": "bfloat16",
}
POLICY = {"sampleIntervalS": 1, "drainTimeoutS": 40, "warmupTimeoutS": 120, "dwellS": 600}
SCALING = {
    "minReplicas": 1,
    "maxReplicas": 2,
    "windows": {"scaleUpS": 300, "scaleDownS": 6, "scaleToMinDelayS": 6},
}
#: Heavy load: requests of 512 prompt tokens and 128 output tokens at this rate overflow one T4's KV pool.
HEAVY_RPS = 3.0
HEAVY_PROMPT, HEAVY_OUTPUT = 512, 128
#: Light load during the scale-down (fits one replica easily).
LIGHT_RPS = 1.0
LIGHT_PROMPT, LIGHT_OUTPUT = 64, 16
HEAD0 = "gearshift.io/stage=0"


def manifests(ns: str, prefill_node: str, decode_pool: str, prom_url: str | None) -> list[dict[str, Any]]:
    """The two explicit GearSets (prefill on the A10 node, decode on the T4 pool) and the PDService."""
    prefill = build.gearset(PREFILL_GS, ns, {
        "serviceName": SERVICE,
        "role": "prefill",
        "mode": "explicit",
        "gears": [
            {"name": "p", "intent": "balanced", "microBatch": 4, "maxBatch": 64,
             "stages": [{"layers": [0, 32], "nodes": [prefill_node], "gpuModel": "A10-24GB"}]},
        ],
        "policy": POLICY,
    })  # fmt: skip
    decode = build.gearset(DECODE_GS, ns, {
        "serviceName": SERVICE,
        "role": "decode",
        "mode": "explicit",
        "gears": [
            {"name": "d", "intent": "balanced", "microBatch": 8, "maxBatch": 64,
             "stages": [{"layers": [0, 32], "nodeSelector": {"gearshift.io/node-pool": decode_pool},
                         "gpuModel": "T4-16GB"}]},
        ],
        "policy": POLICY,
    })  # fmt: skip
    spec: dict[str, Any] = {
        "model": MODEL,
        "engine": "sim",
        "prefill": {"gearSetRef": {"name": PREFILL_GS}},
        "decode": {"gearSetRef": {"name": DECODE_GS}, "scaling": SCALING},
        "slo": {"ttftMs": 2000, "itlMs": 250},
        "router": {"policy": "pd-score"},
    }
    if prom_url:
        spec["prometheusUrl"] = prom_url
    pds = build.pdservice(SERVICE, ns, spec)
    return [prefill, decode, pds]


class HeavyLoad:
    """Requests at a fixed rate through the router pod until stopped (bounded by ``max_s``); counts answers:
    ``ok``, ``headroom`` (503 "scale-up requested": held for decode KV headroom past the router's
    headroom wait, then refused) and ``other``."""

    def __init__(self, url: str, rps: float, max_s: float) -> None:
        assert url.startswith("http://127."), url  # loopback only
        self.url, self.rps, self.max_s = url, rps, max_s
        self.ok = self.headroom = self.cut = 0
        self.other: list[str] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self.thread.start()

    async def _one(self, session: Any) -> None:
        body = {"model": MODEL["name"], "prompt": [1000 + i for i in range(HEAVY_PROMPT)],
                "max_tokens": HEAVY_OUTPUT, "stream": False}  # fmt: skip
        try:
            async with session.post(f"{self.url}/v1/completions", json=body) as r:
                text = await r.text()
                if r.status == 200:
                    self.ok += 1
                elif r.status == 503 and "scale-up requested" in text:
                    self.headroom += 1
                else:
                    self.other.append(f"{r.status}: {text[:200]}")
        except Exception as exc:
            self.other.append(f"{type(exc).__name__}: {exc}")

    async def _run(self) -> None:
        import aiohttp

        start = time.monotonic()
        tasks: list[asyncio.Task[None]] = []
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            i = 0
            while not self._stop.is_set() and time.monotonic() - start < self.max_s:
                tasks.append(asyncio.create_task(self._one(session)))
                i += 1
                await asyncio.sleep(max(0.0, start + i / self.rps - time.monotonic()))
            if tasks:
                await asyncio.wait(tasks, timeout=30)
            for t in tasks:  # still running after 30 s: cut (counted apart)
                if not t.done():
                    self.cut += 1
                    t.cancel()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(60)
        assert not self.thread.is_alive(), "the heavy load did not finish"


def _decode_heads(sandbox: Any, ns: str) -> list[dict[str, Any]]:
    return pods(sandbox, ns, f"gearshift.io/service={SERVICE},gearshift.io/role=decode,{HEAD0}")


def _gs(sandbox: Any, ns: str) -> dict[str, Any]:
    return dict(sandbox.kubectl_json("get", "gearset", DECODE_GS, "-n", ns))


def _cond(gs: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in (gs.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def _get(url: str, timeout: float = 5.0) -> str:
    assert url.startswith("http://127."), url  # loopback only
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return str(r.read().decode())


def _router_metric(router: str, name: str) -> float:
    """The sum of the router's samples of ``name`` (unlabelled counters and gauges: the one value)."""
    total = 0.0
    for line in _get(router + "/metrics").splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _no_headroom_total(router: str) -> float:
    return _router_metric(router, "gearshift_router_no_decode_headroom_total")


def _uids(sandbox: Any, ns: str) -> dict[str, str]:
    return {
        p["metadata"]["name"]: p["metadata"]["uid"]
        for p in pods(sandbox, ns, f"gearshift.io/service={SERVICE}")
        if not p["metadata"].get("deletionTimestamp")
    }


def _diagnose(sandbox: Any, ns: str, operator_log: Path) -> str:
    out = []
    for args in (
        ("get", "gearset,statefulset,pods", "-n", ns, "-o", "wide"),
        ("get", "gearset", DECODE_GS, "-n", ns, "-o", "jsonpath={.status}"),
        ("get", "events", "-n", ns, "--sort-by", ".lastTimestamp"),
    ):
        r = sandbox.kubectl(*args, check=False)
        out.append(f"$ kubectl {' '.join(args)}\n{r.stdout[-3000:]}{r.stderr[-500:]}")
    out.append("operator log (tail):\n" + operator_log.read_text(errors="replace")[-3000:])
    return "\n".join(out)


def _wait(
    sandbox: Any, env: dict[str, Any], predicate: Any, timeout: float, what: str, interval: float = 0.25
) -> Any:
    """``sandbox.wait_for`` that adds the service's objects, events and the operator's log on a timeout."""
    try:
        return sandbox.wait_for(predicate, timeout, what, interval)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_diagnose(sandbox, env['ns'], env['op'].log)}") from None


def _record(key: str, value: Any) -> None:
    """Merge a figure into ``$GEARSHIFT_AUTOSCALE_RESULTS`` (JSON) under ``sandbox_e2e``; print it anyway."""
    print(f"autoscale e2e: {key} = {value}")
    path = os.environ.get("GEARSHIFT_AUTOSCALE_RESULTS")
    if not path:
        return
    p = Path(path)
    doc = json.loads(p.read_text()) if p.exists() else {}
    doc.setdefault("sandbox_e2e", {})[key] = value
    p.write_text(json.dumps(doc, indent=2) + "\n")


@pytest.fixture(scope="module")
def env(sandbox: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if not getattr(sandbox, "is_sandbox", False):
        pytest.skip("needs the gearshift sandbox (loopback pod IPs run by the sandbox pod runner)")
    if not sandbox.prometheus_url:
        pytest.skip("needs the sandbox's Prometheus (the autoscaler's KV/waiting/P99 signals)")
    ns = f"e2e-autoscale-{uuid.uuid4().hex[:6]}"
    sandbox.kubectl("create", "namespace", ns)
    nodes = GpuNodes(sandbox, "e2e-as", cidr_base=100)
    op: OperatorProcess | None = None
    try:
        prefill_node = nodes.add("A10-24GB", "p")
        decode_nodes = [nodes.add("T4-16GB", "d"), nodes.add("T4-16GB", "d")]
        op = OperatorProcess(sandbox, ns, tmp_path_factory.mktemp("operator") / "operator.log")
        sandbox.apply(manifests(ns, prefill_node, nodes.pool("d"), sandbox.prometheus_url))
        heads = f"gearshift.io/service={SERVICE},{HEAD0}"
        router_sel = f"gearshift.io/service={SERVICE},app.kubernetes.io/component=router"

        def router_ip() -> str | None:
            if sum(pod_ready(p) for p in pods(sandbox, ns, heads)) < 2:
                return None
            ready = [p for p in pods(sandbox, ns, router_sel) if pod_ready(p)]
            return ready[0]["status"]["podIP"] if ready else None

        try:
            ip = sandbox.wait_for(router_ip, 150, "prefill + decode heads and the router pod Ready", 0.5)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{_diagnose(sandbox, ns, op.log)}") from None
        assert ip.startswith("127."), ip
        router = f"http://{ip}:{ROUTER_PORT}"
        # The router knows both heads (selector fallback) before load starts.
        sandbox.wait_for(
            lambda: len(json.loads(_get(router + "/debug/pods"))["pods"]) == 2, 60, "router pods"
        )
        yield {"ns": ns, "router": router, "nodes": nodes, "decode_nodes": decode_nodes, "op": op}
    finally:
        left = teardown_run(sandbox, ns, op, nodes)
        assert left == [], f"teardown left {left}"


def test_decode_headroom_misses_scale_up(sandbox: Any, env: dict[str, Any]) -> None:
    ns, router = env["ns"], env["router"]
    gs = _gs(sandbox, ns)
    assert gs["spec"].get("replicas", 1) == 1
    before = _no_headroom_total(router)
    held_seen: list[float] = []
    load = HeavyLoad(router, HEAVY_RPS, max_s=120)

    def first_miss() -> float | None:
        held_seen.append(_router_metric(router, "gearshift_router_headroom_held"))
        return time.monotonic() if _no_headroom_total(router) > before else None

    try:
        try:
            t_first = sandbox.wait_for(
                first_miss, 60, "the router to find no decode KV headroom for a request", 0.25
            )
        except AssertionError as exc:
            known = _get(router + "/debug/pods")
            raise AssertionError(
                f"{exc}\nload ok={load.ok} other={load.other[:3]}\nrouter /debug/pods: {known[:3000]}"
            ) from None
        t_spec = _wait(
            sandbox,
            env,
            lambda: time.monotonic() if _gs(sandbox, ns)["spec"].get("replicas") == 2 else None,
            45,
            "GearSet spec.replicas 2",
            0.25,
        )

        def two_ready() -> float | None:
            heads = _decode_heads(sandbox, ns)
            return time.monotonic() if sum(pod_ready(p) for p in heads) == 2 else None

        t_ready = _wait(sandbox, env, two_ready, 90, "a second decode pipeline replica Ready", 0.5)
        # The router takes the new replica (selector fallback over Ready pods).
        _wait(
            sandbox,
            env,
            lambda: sum(p["role"] == "decode" for p in json.loads(_get(router + "/debug/pods"))["pods"]) == 2,
            30,
            "the router to know two decode pods",
        )
        # Read while the load still runs: with scaleDownS 6 a slow machine's next reads could already see
        # the scale-down that a stopped load rightly starts (CI: lastDecision ScaleDown, drain started).
        st = _gs(sandbox, ns)["status"]
    finally:
        load.stop()
    assert st["scaling"]["lastDecision"] in ("ScaleUp", "Hold"), st["scaling"]
    events = sandbox.kubectl_json(
        "get", "events", "-n", ns, "--field-selector", f"involvedObject.name={DECODE_GS}"
    )
    scaled = [e for e in events["items"] if e["reason"] == "ScaledUp"]
    assert scaled and "NoDecodeHeadroom" in scaled[-1]["message"], [e["message"] for e in events["items"]]
    new = [p for p in _decode_heads(sandbox, ns) if p["metadata"]["name"].endswith("-1")]
    assert new and new[0]["spec"]["nodeName"] in env["decode_nodes"]
    assert load.ok > 0, (load.ok, load.headroom, load.other[:3])
    # Requests that missed headroom were held and then served, not refused at once: the router counts
    # each miss once, and more requests missed than were refused (after the hold) or cut by the test.
    # Refusing at the first miss would make every miss a refusal. The held gauge is momentary: recorded.
    misses = _no_headroom_total(router) - before
    held_seen.append(_router_metric(router, "gearshift_router_headroom_held"))
    assert misses > load.headroom + load.cut, (misses, load.headroom, load.cut, held_seen)
    assert load.other == [], load.other[:5]
    _record("decode_headroom_scale_up", {
        "first_miss_to_spec_replicas_s": round(t_spec - t_first, 2),
        "first_miss_to_replica_ready_s": round(t_ready - t_first, 2),
        "requests": {"ok": load.ok, "refused_no_headroom_after_hold": load.headroom,
                     "other_failures": len(load.other), "held_max_sampled": max(held_seen),
                     "headroom_misses": misses, "cut": load.cut},
        "load": {"rps": HEAVY_RPS, "prompt_tokens": HEAVY_PROMPT, "output_tokens": HEAVY_OUTPUT},
        "decode": "T4-16GB, Llama-2-7B shape (KV pool 3776 tokens), sampleIntervalS 1",
    })  # fmt: skip


def test_scale_down_drains_without_failed_requests(sandbox: Any, env: dict[str, Any]) -> None:
    ns, router = env["ns"], env["router"]
    assert _gs(sandbox, ns)["spec"].get("replicas") == 2
    seen_draining: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.3):
            try:
                for p in _decode_heads(sandbox, ns):
                    name = p["metadata"]["name"]
                    labels = p["metadata"].get("labels") or {}
                    if labels.get("gearshift.io/draining") == "true" and name not in seen_draining:
                        seen_draining.append(name)
            except Exception:  # a kubectl hiccup: the next poll looks again
                continue

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    n = int(40 * LIGHT_RPS)
    trace = [TraceRequest(i / LIGHT_RPS, LIGHT_PROMPT, LIGHT_OUTPUT) for i in range(n)]
    t0 = time.monotonic()
    out: dict[str, Any] = {}

    def load() -> None:
        out["res"] = asyncio.run(
            run_load([router], trace, max_requests=n, max_duration_s=45, drain_s=30, stream=True,
                     model=MODEL["name"])
        )  # fmt: skip
        out["end"] = time.monotonic()

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    try:
        t_down = _wait(
            sandbox,
            env,
            lambda: time.monotonic() if _gs(sandbox, ns)["spec"].get("replicas") == 1 else None,
            40,
            "spec.replicas back to 1 while the light load runs",
            0.5,
        )
        _wait(sandbox, env, lambda: len(_decode_heads(sandbox, ns)) == 1, 30, "the drained head pod gone")
        t_gone = time.monotonic()
        loader.join(90)
        assert not loader.is_alive(), "the load generator did not finish"
    finally:
        stop.set()
        watcher.join(10)
    res = out["res"]
    assert t_gone < out["end"], "the drain finished after the load: it was not tested under load"
    assert (res.issued, res.failed, res.incomplete) == (n, 0, 0), res.errors
    assert res.completed == n
    assert seen_draining and all(p.endswith("-1") for p in seen_draining), seen_draining
    events = sandbox.kubectl_json(
        "get", "events", "-n", ns, "--field-selector", f"involvedObject.name={DECODE_GS}"
    )
    reasons = [e["reason"] for e in events["items"]]
    assert "ScaleDownDraining" in reasons and "ScaledDown" in reasons, reasons
    _record("scale_down", {"light_load_start_to_spec_replicas_1_s": round(t_down - t0, 2),
                           "light_load_start_to_pod_gone_s": round(t_gone - t0, 2),
                           "load_s": round(out["end"] - t0, 2), "failed_requests": res.failed,
                           "requests": res.completed, "drained": seen_draining})  # fmt: skip


def test_no_free_gpu_never_evicts_and_resumes_when_a_node_appears(sandbox: Any, env: dict[str, Any]) -> None:
    ns, router, nodes = env["ns"], env["router"], env["nodes"]
    assert _gs(sandbox, ns)["spec"].get("replicas") == 1
    (only,) = _decode_heads(sandbox, ns)
    spare = [n for n in env["decode_nodes"] if n != only["spec"]["nodeName"]]
    for name in spare:  # the decode pool is now one node, and its GPU is taken by replica 0
        nodes.delete(name)
    _wait(
        sandbox,
        env,
        lambda: all(
            sandbox.kubectl("get", "node", n, "--ignore-not-found", "-o", "name").stdout == "" for n in spare
        ),
        30,
        "the spare decode node gone",
    )
    uids = _uids(sandbox, ns)
    assert len(uids) >= 3, uids  # prefill head, decode head, router
    load = HeavyLoad(router, HEAVY_RPS, max_s=120)
    try:

        def blocked() -> dict[str, Any] | None:
            c = _cond(_gs(sandbox, ns), "ScalingActive")
            return c if c.get("status") == "False" and c.get("reason") == "NoFreeGPU" else None

        try:
            cond = _wait(sandbox, env, blocked, 60, "ScalingActive=False NoFreeGPU", 0.25)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{_diagnose(sandbox, ns, env['op'].log)}") from None
        assert "nothing is evicted" in cond["message"], cond
        # A few more ticks while blocked (1 s each): still nothing evicted, no replica added.
        holds(
            lambda: _gs(sandbox, ns)["spec"].get("replicas") == 1 and _uids(sandbox, ns) == uids,
            3, "blocked: no replica added, nothing evicted",
        )  # fmt: skip
        # A node with a free GPU appears in the decode pool: the scale-up proceeds onto it.
        t_node = time.monotonic()
        fresh = nodes.add("T4-16GB", "d")
        t_spec = _wait(
            sandbox,
            env,
            lambda: time.monotonic() if _gs(sandbox, ns)["spec"].get("replicas") == 2 else None,
            45,
            "spec.replicas 2 once a node appears",
            0.25,
        )
        t_ready = _wait(
            sandbox,
            env,
            lambda: time.monotonic() if sum(pod_ready(p) for p in _decode_heads(sandbox, ns)) == 2 else None,
            90,
            "the second decode replica Ready on the new node",
            0.5,
        )
        _wait(
            sandbox,
            env,
            lambda: _cond(_gs(sandbox, ns), "ScalingActive").get("status") == "True",
            30,
            "ScalingActive",
        )
    finally:
        load.stop()
    new = [p for p in _decode_heads(sandbox, ns) if p["metadata"]["name"] not in uids]
    assert [p["spec"]["nodeName"] for p in new] == [fresh]
    after = _uids(sandbox, ns)
    assert all(after.get(name) == uid for name, uid in uids.items()), (uids, after)  # none evicted
    assert load.other == [], load.other[:5]
    _record("no_free_gpu", {"node_added_to_spec_replicas_s": round(t_spec - t_node, 2),
                            "node_added_to_replica_ready_s": round(t_ready - t_node, 2),
                            "evicted_pods": 0})  # fmt: skip
