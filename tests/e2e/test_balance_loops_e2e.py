"""The PD guide's two balance loops (docs/sources.md#rebalancing, docs/sources.md#adaptive-batch) closed on
the sandbox twin: the router applies its
rebalancing by default, and the operator applies the router's adaptive-batch proposals.

The operator runs as a subprocess watching only this module's namespace; the test makes its own GPU
nodes (``harness.GpuNodes``, podCIDR indices 160-209): one A10 for a
one-pod prefill gear and two T4s for a decode gear of two pods (``maxBatch`` 16, ``microBatch`` 2: floor
``max(1, 2, ⌈16 / 4⌉)`` = 4). The PDService (engine ``sim``, a Llama-3.2-1B-shaped model) routes by
``round-robin``, a policy blind to load, so where requests go changes only by rebalancing.

1. **Rebalancing on by default.** One decode pod is overloaded by requests sent straight to its pod IP (the
   router does not see them: its signals do). The operator-deployed router (no rebalancing flag: the
   builder passes none) names that pod in ``/debug/decisions`` ``applied.avoid`` and sends the next
   requests to the other pod; a second router started here on loopback over the same pods with
   ``--no-apply-rebalance`` splits the same requests evenly.
2. **Adaptive batch applied.** The SLO's ITL target is 8 ms: the sim's decode step for this model on a
   T4 is at least 11 ms (``gearshift.sim.perfmodel``), so any load runs over 1.2 × target and the routers
   propose × 0.9. Under 40 concurrent streams through the router the operator lowers the gear's effective
   max batch in bounded steps (16 → 14 → 12, one per 30 s cooldown), recorded in
   ``status.adaptiveBatch`` and the ``BatchAdapted`` condition and events, and writes each head pod's
   ``gearshift.io/max-batch``; the requests each decode pod runs (``vllm:num_requests_running`` +
   ``waiting`` on its own ``/metrics``, sampled every 0.2 s) never exceed the cap in force, and every
   stream completes (the rest waits in the router).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gearshift.control.adaptive_batch import tick as ab
from gearshift.dev.sandbox.harness import (
    LLAMA_3_2_1B,
    GpuNodes,
    OperatorProcess,
    install_crds,
    pods,
    serving_router_url,
    teardown_run,
)
from gearshift.facts.rfc3339 import from_time
from gearshift.k8s import names
from gearshift.testing import manifests as build

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SERVICE = "bl"
MODEL = LLAMA_3_2_1B
MAX_BATCH = 16
ITL_TARGET_MS = 8.0


def manifests(ns: str, prefill_nodes: list[str], decode_nodes: list[str]) -> list[dict[str, Any]]:
    prefill = build.gearset(f"{SERVICE}-prefill", ns, {
        "serviceName": SERVICE, "role": "prefill", "mode": "explicit",
        "gears": [{"name": "p", "intent": "balanced", "microBatch": 4, "maxBatch": 64,
                   "stages": [{"layers": [0, 16], "nodes": prefill_nodes, "gpuModel": "A10-24GB"}]}],
    })  # fmt: skip
    decode = build.gearset(f"{SERVICE}-decode", ns, {
        "serviceName": SERVICE, "role": "decode", "mode": "explicit",
        "gears": [{"name": "d", "intent": "balanced", "microBatch": 2, "maxBatch": MAX_BATCH,
                   "stages": [{"layers": [0, 16], "replicas": 2, "nodes": decode_nodes,
                               "gpuModel": "T4-16GB"}]}],
    })  # fmt: skip
    pds = build.pdservice(SERVICE, ns, {
        "model": MODEL,
        "engine": "sim",
        "prefill": {"gearSetRef": {"name": f"{SERVICE}-prefill"}},
        "decode": {"gearSetRef": {"name": f"{SERVICE}-decode"}},
        "slo": {"ttftMs": 2000, "itlMs": ITL_TARGET_MS},
        "router": {"policy": "round-robin"},
    })  # fmt: skip
    return [prefill, decode, pds]


def _get(url: str, timeout: float = 5.0) -> str:
    assert url.startswith("http://127."), url  # loopback only
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return str(r.read().decode())


def _metric(text: str, name: str) -> float:
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name + "{"))


def _decode_picks(router_url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in _get(router_url + "/metrics").splitlines():
        if line.startswith("gearshift_router_picks_total{") and 'role="decode"' in line:
            labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1 : line.index("}")].split(","))
            pod = labels["pod"].strip('"')
            out[pod] = out.get(pod, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


class Streams:
    """``n`` concurrent streamed completions to ``url``, one after another each, in a thread of its own."""

    def __init__(self, url: str, n: int, max_tokens: int) -> None:
        assert url.startswith("http://127."), url
        self.url, self.n, self.max_tokens = url, n, max_tokens
        self.ok = self.failed = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._thread.start()

    async def _one(self, session: aiohttp.ClientSession) -> None:
        body = {
            "model": MODEL["name"],
            "prompt": "hello " * 32,
            "max_tokens": self.max_tokens,
            "stream": True,
        }
        while not self._stop.is_set():
            try:
                async with session.post(self.url + "/v1/completions", json=body) as r:
                    text = await r.text()
                    if r.status == 200 and "[DONE]" in text:
                        self.ok += 1
                    else:
                        self.failed += 1
                        self.errors.append(f"{r.status} {text[:200]}")
            except (aiohttp.ClientError, TimeoutError) as exc:
                if not self._stop.is_set():
                    self.failed += 1
                    self.errors.append(repr(exc))

    async def _main(self) -> None:
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await asyncio.gather(*(self._one(session) for _ in range(self.n)))

    def stop(self) -> None:
        """Let every worker finish its request in flight, then end."""
        self._stop.set()
        self._thread.join(timeout=150)


def _send(url: str, n: int) -> None:
    """``n`` short requests through ``url``, two at a time; all must succeed."""

    async def main() -> list[int]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            sem = asyncio.Semaphore(2)

            async def one() -> int:
                async with sem:
                    body = {"model": MODEL["name"], "prompt": "hi there", "max_tokens": 4}
                    async with s.post(url + "/v1/completions", json=body) as r:
                        await r.read()
                        return r.status

            return await asyncio.gather(*(one() for _ in range(n)))

    assert asyncio.run(main()) == [200] * n


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def env(sandbox: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if not getattr(sandbox, "is_sandbox", False):
        pytest.skip("needs the gearshift sandbox (loopback pod IPs run by the sandbox pod runner)")
    install_crds(sandbox)  # status.adaptiveBatch must not be pruned by an older CRD
    ns = f"e2e-balance-{uuid.uuid4().hex[:6]}"
    sandbox.kubectl("create", "namespace", ns)
    gpus = GpuNodes(sandbox, "e2e-bl", cidr_base=160)
    op: OperatorProcess | None = None
    try:
        nodes = [gpus.add("A10-24GB", "p"), gpus.add("T4-16GB", "d"), gpus.add("T4-16GB", "d")]
        op = OperatorProcess(sandbox, ns, tmp_path_factory.mktemp("operator") / "operator.log")
        sandbox.apply(manifests(ns, nodes[:1], nodes[1:]))
        url = serving_router_url(sandbox, ns, SERVICE, 3, lambda: op.log.read_text(errors="replace")[-3000:])
        heads = pods(sandbox, ns, f"{names.LABEL_SERVICE}={SERVICE},{names.LABEL_STAGE}=0")
        by_role: dict[str, list[dict[str, Any]]] = {}
        for p in heads:
            by_role.setdefault(p["metadata"]["labels"][names.LABEL_ROLE], []).append(p)
        decode = sorted(by_role["decode"], key=lambda p: p["metadata"]["name"])
        sandbox.wait_for(
            lambda: len(json.loads(_get(url + "/debug/pods"))["pods"]) == 3, 60, "the router to know 3 pods"
        )
        yield {"ns": ns, "router": url, "prefill": by_role["prefill"][0], "decode": decode, "op": op}
    finally:
        left = teardown_run(sandbox, ns, op, gpus)
        assert left == [], f"teardown left {left}"


def _url(pod: dict[str, Any]) -> str:
    return f"http://{pod['status']['podIP']}:8000"


def test_rebalancing_on_by_default_steers_requests_off_an_overloaded_pod(
    sandbox: Any, env: dict[str, Any], tmp_path: Path
) -> None:
    hot, cool = (p["metadata"]["name"] for p in env["decode"])
    router = env["router"]
    port = _free_port()
    argv = [sys.executable, "-m", "gearshift.router.server", "--host", "127.0.0.1", "--port", str(port),
            "--policy", "round-robin", "--no-apply-rebalance", "--target-itl-ms", f"{ITL_TARGET_MS:g}",
            "--backend", f"prefill={_url(env['prefill'])};name={env['prefill']['metadata']['name']}",
            *(a for p in env["decode"]
              for a in ("--backend", f"decode={_url(p)};name={p['metadata']['name']}"))]  # fmt: skip
    log = (tmp_path / "router-off.log").open("wb")
    plain = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=sandbox.env)
    plain_url = f"http://127.0.0.1:{port}"
    overload: Streams | None = None
    try:
        sandbox.wait_for(lambda: _get(plain_url + "/health", 2) and True, 30, "the second router")
        # Overload one decode pod behind the routers' backs: 24 long streams straight to its pod IP.
        overload = Streams(_url(env["decode"][0]), 24, max_tokens=400)

        def avoided(url: str) -> list[str] | None:
            doc = json.loads(_get(url + "/debug/decisions"))
            rb = [r for r in doc["rebalance"] if r["role"] == "decode" and r["imbalanced"]]
            return rb[0]["avoid"] if rb and hot in rb[0]["avoid"] else None

        assert sandbox.wait_for(lambda: avoided(router), 30, "the deployed router to spare the hot pod")
        assert json.loads(_get(router + "/debug/decisions"))["applied"]["avoid"] == [hot]
        assert sandbox.wait_for(lambda: avoided(plain_url), 30, "the second router to see the imbalance")
        assert json.loads(_get(plain_url + "/debug/decisions"))["applied"]["avoid"] is None
        n = 30
        results = {}
        for name, url in (("on", router), ("off", plain_url)):
            before = _decode_picks(url)
            _send(url, n)
            after = _decode_picks(url)
            results[name] = {p: after.get(p, 0) - before.get(p, 0) for p in (hot, cool)}
        print(f"decode picks of {n} requests with one pod overloaded: {results}")
        assert results["on"][hot] <= 0.1 * n and results["on"][cool] >= 0.9 * n, results
        assert abs(results["off"][hot] - results["off"][cool]) <= 2, results
    finally:
        if overload is not None:
            overload.stop()
        plain.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            plain.wait(timeout=10)
        if plain.poll() is None:
            plain.kill()
        log.close()


def test_itl_over_target_lowers_the_max_batch_in_bounded_steps_and_the_cap_holds(
    sandbox: Any, env: dict[str, Any]
) -> None:
    ns = env["ns"]

    def batch_status() -> dict[str, Any]:
        gs = sandbox.kubectl_json("get", "gearset", f"{SERVICE}-decode", "-n", ns)
        return dict((gs.get("status") or {}).get("adaptiveBatch") or {})

    start = batch_status()
    assert start.get("planned") == MAX_BATCH, start
    first = start["effective"]
    load = Streams(env["router"], 40, max_tokens=48)
    samples: list[tuple[str, float, int | None]] = []  # (pod, in flight at the pod, cap in force)
    stop = threading.Event()

    def sample() -> None:
        caps: dict[str, tuple[int, float]] = {}
        while not stop.is_set():
            now = time.monotonic()
            for p in pods(sandbox, ns, f"{names.LABEL_SERVICE}={SERVICE},{names.LABEL_ROLE}=decode"):
                name = p["metadata"]["name"]
                raw = (p["metadata"].get("annotations") or {}).get(names.ANNOTATION_MAX_BATCH)
                if raw is not None and (name not in caps or caps[name][0] != int(raw)):
                    caps[name] = (int(raw), now)
                text = _get(_url(p) + "/metrics", 2)
                inflight = _metric(text, "vllm:num_requests_running") + _metric(
                    text, "vllm:num_requests_waiting"
                )
                # A lowered cap binds once the router read it (its poll: 2 s) and the requests above it ended.
                cap = caps[name][0] if name in caps and now - caps[name][1] > 4.0 else None
                samples.append((name, inflight, cap))
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        try:
            lowered = sandbox.wait_for(
                lambda: (
                    (st := batch_status()).get("effective", MAX_BATCH) <= ab.lowered(ab.lowered(first, 4), 4)
                    and st
                ),
                4 * ab.COOLDOWN_S + 30,
                "two bounded lowering steps",
                1.0,
            )
        except AssertionError as exc:
            decisions = _get(env["router"] + "/debug/decisions")
            log = env["op"].log.read_text(errors="replace")[-2000:]
            raise AssertionError(
                f"{exc}\nstatus {batch_status()}\nrouter {decisions}\noperator {log}"
            ) from None
    finally:
        stop.set()
        sampler.join(timeout=10)
        load.stop()
    changes = [c for c in lowered["history"] if c.get("from") is not None]
    steps = [(c["from"], c["to"]) for c in changes]
    print(f"max batch steps: {steps}; history {lowered['history']}")
    assert len(changes) >= 2
    for c in changes:
        assert c["reason"] == ab.REASON_ITL_HIGH and c["to"] == ab.lowered(c["from"], lowered["floor"]), c
    # Each head pod steps from its own proposals, at most once per cooldown.
    assert all(c.get("pod") for c in changes), changes
    gaps = [
        (from_time(b["time"]) or 0) - (from_time(a["time"]) or 0)
        for pod in {c["pod"] for c in changes}
        for a, b in itertools.pairwise([c for c in changes if c["pod"] == pod])
    ]
    assert all(g >= ab.COOLDOWN_S - 1 for g in gaps), gaps
    assert {p["pod"] for p in lowered["pods"]} == {p["metadata"]["name"] for p in env["decode"]}
    assert lowered["effective"] == min(p["effective"] for p in lowered["pods"])
    gs = sandbox.kubectl_json("get", "gearset", f"{SERVICE}-decode", "-n", ns)
    cond = next(c for c in gs["status"]["conditions"] if c["type"] == "BatchAdapted")
    assert cond["status"] == "True" and cond["reason"] == ab.REASON_ITL_HIGH, cond
    events = sandbox.kubectl_json("get", "events", "-n", ns, "--field-selector", "reason=MaxBatchLowered")
    assert len(events["items"]) >= 2
    # The cap held at the pods: counted where the requests run.
    bound = [(pod, n, cap) for pod, n, cap in samples if cap is not None]
    over = [(pod, n, cap) for pod, n, cap in bound if n > cap]
    most = {(pod, cap): max(n for p, n, c in bound if (p, c) == (pod, cap)) for pod, _, cap in bound}
    print(f"{len(samples)} samples, {len(bound)} under a settled cap; most in flight per (pod, cap): {most}")
    assert bound and over == [], over[:10]
    assert load.failed == 0 and load.ok > 0, load.errors[:5]
