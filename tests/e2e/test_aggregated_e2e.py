"""Aggregated serving on the sandbox twin: one GearSet of role ``both`` serves whole requests through the
PDService's router pod and shifts gear live with no failed request.

The operator runs as a subprocess watching only this module's namespace, on private GPU nodes
(``harness.GpuNodes``: two A10s, 2 time-sliced ``nvidia.com/gpu`` each, so a shadow fits beside the serving
gear). The PDService (sim engine, a Llama-3.2-1B-shaped model of 16 layers) has ``spec.serving`` only;
its GearSet has a one-stage gear ``one`` (where it starts) and an uneven two-stage gear ``two``
(layers 10 + 6), which predicts ``throughputQps: 10`` so that the shadow gets warm-up copies
(``warmupShare`` 0.2: 2 requests/s). The router (the sandbox pod runner, a loopback pod IP) watches the
one role Service ``<pds>-both`` (``--roles both``) and sends each request whole to a head pod.

Checked: under steady load through the router pod's IP, ``spec.forceGear: two`` runs Warming → Draining →
Switching → Stable with the shift recorded as Succeeded; every request is answered (0 failed); the role
Service selects a gear whose head pods are all Ready at every poll; the router picked head pods of both
gears (it followed the switch) and mirrored copies to the warming shadow (role ``both``); the PDService's
``status.serving`` and ``kubectl get gearsets`` show the new gear.
"""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gearshift.dev.sandbox.harness import (
    LLAMA_3_2_1B,
    GpuNodes,
    OperatorProcess,
    install_crds,
    pod_ready,
    pods,
    serving_router_url,
    teardown_run,
)
from gearshift.testing import manifests as build

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SERVICE = "agg"
GEARSET = "agg"
MODEL = LLAMA_3_2_1B
#: Shortened policy (stated in the test): warm 6 s, rollback window 6 s; signals every 1 s.
POLICY = {"sampleIntervalS": 1, "warmS": 6, "rollbackWindowS": 6, "drainTimeoutS": 30, "warmupTimeoutS": 120,
          "dwellS": 600, "warmupShare": 0.2}  # fmt: skip
LOAD_RPS = 4.0


def manifests(ns: str, prom_url: str, a10: dict[str, str]) -> list[dict[str, Any]]:
    """The aggregated GearSet (1-stage ``one``, 2-stage ``two``) on the ``a10`` selector, the PDService."""
    layers = MODEL["numLayers"]
    gearset = build.gearset(GEARSET, ns, {
        "serviceName": SERVICE,
        "role": "both",
        "mode": "explicit",
        "initialGear": "one",
        "gears": [
            {"name": "one", "intent": "latency", "microBatch": 4, "maxBatch": 64,
             "stages": [{"layers": [0, layers], "nodeSelector": a10, "gpuModel": "A10-24GB"}]},
            {"name": "two", "intent": "balanced", "microBatch": 4, "maxBatch": 64,
             "predicted": {"throughputQps": 10},
             "stages": [{"layers": [0, 10], "nodeSelector": a10, "gpuModel": "A10-24GB"},
                        {"layers": [10, layers], "nodeSelector": a10, "gpuModel": "A10-24GB"}]},
        ],
        "policy": POLICY,
    })  # fmt: skip
    pds = build.pdservice(SERVICE, ns, {
        "model": MODEL,
        "engine": "sim",
        "serving": {"gearSetRef": {"name": GEARSET}},
        "router": {"policy": "shortest-queue"},
        "slo": {"ttftMs": 200, "itlMs": 50},
        "prometheusUrl": prom_url,
    })  # fmt: skip
    return [gearset, pds]


def _get(url: str, timeout: float = 5.0) -> str:
    assert url.startswith("http://127."), url  # loopback only
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return str(r.read().decode())


def _samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """``{sorted labels: value}`` of the samples of ``name`` in Prometheus exposition ``text``."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


class RouterLoad:
    """``LOAD_RPS`` whole requests through the router pod for ``seconds``; every failure is recorded."""

    def __init__(self, url: str, seconds: float) -> None:
        self.url, self.n = url, int(seconds * LOAD_RPS)
        self.ok = 0
        self.failed: list[str] = []
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self.thread.start()

    async def _one(self, session: Any, i: int) -> None:
        import aiohttp

        body = {"model": MODEL["name"], "prompt": " ".join(["hello"] * 32), "max_tokens": 8}
        if i % 2:
            body["stream"] = True
        try:
            async with session.post(
                f"{self.url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=60)
            ) as r:
                text = await r.text()
                if r.status != 200:
                    raise RuntimeError(f"{r.status}: {text[:300]}")
                assert ("[DONE]" in text) if body.get("stream") else '"text"' in text, text[:300]
            self.ok += 1
        except Exception as exc:
            self.failed.append(f"request {i}: {type(exc).__name__}: {exc}")

    async def _run(self) -> None:
        import aiohttp

        start = time.monotonic()
        async with aiohttp.ClientSession() as session:
            tasks = []
            for i in range(self.n):
                await asyncio.sleep(max(0.0, start + i / LOAD_RPS - time.monotonic()))
                tasks.append(asyncio.create_task(self._one(session, i)))
            await asyncio.gather(*tasks)

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "load did not finish"


def _selection_ok(sandbox: Any, ns: str) -> tuple[str, bool]:
    """The gear ``<pds>-both`` selects, and whether every one of its head pods is Ready (and some exist)."""
    sel = sandbox.kubectl_json("get", "service", f"{SERVICE}-both", "-n", ns)["spec"]["selector"]
    heads = pods(sandbox, ns, ",".join(f"{k}={v}" for k, v in sel.items()))
    return sel["gearshift.io/gear"], bool(heads) and all(pod_ready(p) for p in heads)


def _diagnose(sandbox: Any, ns: str, operator_log: Path) -> str:
    out = []
    for args in (("get", "pods,svc", "-n", ns, "-o", "wide"), ("get", "events", "-n", ns)):
        r = sandbox.kubectl(*args, check=False)
        out.append(f"$ kubectl {' '.join(args)}\n{r.stdout[-3000:]}{r.stderr[-1000:]}")
    out.append("operator log (tail):\n" + operator_log.read_text(errors="replace")[-3000:])
    return "\n".join(out)


@pytest.fixture(scope="module")
def env(sandbox: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if not sandbox.prometheus_url:
        pytest.skip("needs the sandbox's Prometheus")
    if not getattr(sandbox, "is_sandbox", False):
        pytest.skip("needs the gearshift sandbox (private GPU nodes on loopback pod IPs)")
    install_crds(sandbox)
    ns = f"e2e-agg-{uuid.uuid4().hex[:6]}"
    sandbox.kubectl("create", "namespace", ns)
    nodes = GpuNodes(sandbox, "e2e-agg", cidr_base=200, gpu_replicas=2)
    op: OperatorProcess | None = None
    try:
        for _ in range(2):
            nodes.add("A10-24GB", "a10")
        sandbox.apply(manifests(ns, sandbox.prometheus_url, {"gearshift.io/node-pool": nodes.pool("a10")}))
        op = OperatorProcess(
            sandbox, ns, tmp_path_factory.mktemp("operator") / "operator.log", extra_args=["--workers", "4"]
        )
        log = op.log
        url = serving_router_url(sandbox, ns, SERVICE, 1, lambda: _diagnose(sandbox, ns, log))
        sandbox.wait_for(
            lambda: '"both"' in _get(url + "/debug/pods"), 60, "the router to know the serving head pod"
        )
        yield {"ns": ns, "router": url, "op": op}
    finally:
        left = teardown_run(sandbox, ns, op, nodes)
        assert not left, f"not deleted: {left}"


def test_aggregated_service_serves_through_the_router_and_shifts_without_failed_requests(
    sandbox: Any, env: dict[str, Any]
) -> None:
    ns, router = env["ns"], env["router"]
    gs = sandbox.kubectl_json("get", "gearset", GEARSET, "-n", ns)
    assert (gs["spec"]["role"], gs["status"]["activeGear"]) == ("both", "one")
    load = RouterLoad(router, seconds=75)
    bad: list[str] = []
    seen: list[str] = []
    phases: list[str] = []
    mix: list[tuple[Any, Any]] = []  # (promptTokensMean, outputTokensMean) at each poll
    try:
        sandbox.wait_for(lambda: load.ok >= 4, 60, "load flowing through the router before the shift")
        sandbox.kubectl("patch", "gearset", GEARSET, "-n", ns, "--type=merge", "-p",
                        '{"spec":{"forceGear":"two"}}')  # fmt: skip

        def progressed() -> bool:
            gear, ok = _selection_ok(sandbox, ns)
            if not seen or seen[-1] != gear:
                seen.append(gear)
            if not ok:
                bad.append(gear)
            st = sandbox.kubectl_json("get", "gearset", GEARSET, "-n", ns).get("status") or {}
            if st.get("phase") and (not phases or phases[-1] != st["phase"]):
                phases.append(st["phase"])
            signals = st.get("signals") or {}
            mix.append((signals.get("promptTokensMean"), signals.get("outputTokensMean")))
            return st.get("phase") == "Stable" and st.get("activeGear") == "two"

        sandbox.wait_for(progressed, 150, "the shift one -> two to finish", interval=0.3)
    finally:
        load.join(150)
    assert load.failed == [], load.failed[:5]
    assert load.ok == load.n
    assert bad == [], f"the role Service selected a gear whose heads were not all Ready: {bad}"
    assert seen == ["one", "two"], seen
    assert "Warming" in phases and phases[-1] == "Stable", phases
    # The traffic mix in the GearSet's status while the load flowed: positive token counts (the router's
    # client histograms; each request has a 32-word prompt and asks for 8 tokens).
    positive = [(p, o) for p, o in mix if isinstance(p, int | float) and isinstance(o, int | float)]
    positive = [(p, o) for p, o in positive if p > 0 and o > 0]
    assert positive, f"no promptTokensMean/outputTokensMean > 0 in {len(mix)} polls: {mix[-5:]}"
    st = sandbox.kubectl_json("get", "gearset", GEARSET, "-n", ns)["status"]
    h = st["history"][-1]
    assert (h["from"], h["to"], h["trigger"], h["outcome"]) == ("one", "two", "forced", "Succeeded")
    # The router followed the switch: it picked the head pods of both gears, as role both.
    metrics = _get(router + "/metrics")
    picks = _samples(metrics, "gearshift_router_picks_total")
    by_gear: dict[str, float] = {}
    for labels, value in picks.items():
        lab = dict(labels)
        assert lab["role"] == "both", lab
        by_gear[lab["pod"].split(f"{SERVICE}-both-")[1].split("-s0-")[0]] = value
    assert by_gear.get("one", 0) > 0 and by_gear.get("two", 0) > 0, by_gear
    assert sum(by_gear.values()) >= load.n
    mirrored = _samples(metrics, "gearshift_router_mirror_requests_total")
    ok_copies = sum(v for labels, v in mirrored.items() if dict(labels)["outcome"] == "ok")
    assert ok_copies > 0 and {dict(labels)["role"] for labels in mirrored} == {"both"}, mirrored
    # The old gear is gone after the shift; the PDService and `kubectl get gearsets` show the new one.
    sandbox.wait_for(lambda: not pods(sandbox, ns, "gearshift.io/gear=one"), 90, "gear one's pods deleted")
    pds = sandbox.kubectl_json("get", "pds", SERVICE, "-n", ns)["status"]
    assert pds["serving"]["activeGear"] == "two" and "prefill" not in pds and "decode" not in pds
    table = sandbox.kubectl("get", "gearsets", "-n", ns).stdout.splitlines()
    assert table[0].split()[:5] == ["NAME", "SERVICE", "ROLE", "ACTIVE", "TARGET"]
    assert table[1].split()[:4] == [GEARSET, SERVICE, "both", "two"]
    print(f"\naggregated shift: {load.ok} requests, 0 failed; picks {by_gear}; {ok_copies:g} mirrored")
