"""Warm-up traffic on the sandbox twin: a warming shadow gets mirrored live requests within its cap, and
clients see none of them.

The operator runs as a subprocess watching only this module's namespace, on private GPU nodes
(``harness.GpuNodes``: two A10s for prefill, 2 time-sliced ``nvidia.com/gpu`` each so the shadow fits
beside the serving gear, one T4 for decode). The PDService (sim engine) has two explicit prefill gears:
``one`` serves, ``two`` predicts ``throughputQps: 10``; with ``warmupShare: 0.2``, one router replica and
one head pod per pipeline, the shadow's mirror cap is 0.2 × 10 = 2 requests/s. Its router runs as the
PDService's router pod (the sandbox pod runner, on a loopback pod IP).

The test forces ``two``. While it warms (``warmS`` long, so the window is all ``Warming``):

- the shadow's head pod carries ``gearshift.io/warming: "true"`` and ``gearshift.io/mirror-rps: "2"``,
  and the router lists it as a mirror target;
- clients send ``LOAD_RPS`` (above the cap) through the router for ``WINDOW_S`` s, half of them streamed;
- the shadow's own ``vllm:request_success_total`` grows by exactly the router's mirrored ``ok`` count, at
  most the cap × the window + the bucket's burst (2), and by at least half the cap × the window;
- every client request is answered (200) and counted on the serving gear: the router's
  ``gearshift_router_requests_total`` names the serving prefill pod for all of them and the shadow for
  none, and the serving pod's own success count grows by exactly the clients' requests;
- every client request was offered once: mirrored ``ok`` + ``dropped`` (the cap) = clients' requests.

Then ``warmS`` is lowered and the shift completes: the same shadow pod (same uid, no restart) serves and
has lost the mark, the router lists no target, and requests after the switch are mirrored to nobody.
The figures are printed (``pytest -s``).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

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
from gearshift.k8s import names
from gearshift.testing import manifests as build

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SERVICE = "wm"
PREFILL_GS = f"{SERVICE}-prefill"
MODEL = LLAMA_3_2_1B
PREDICTED_RPS = 10.0
WARMUP_SHARE = 0.2
CAP_RPS = WARMUP_SHARE * PREDICTED_RPS  # one head pod per pipeline, one router replica
BURST = max(1.0, CAP_RPS)  # gearshift.router.mirror.TokenBucket: one second's worth, at least one
LOAD_RPS = 6.0
WINDOW_S = 20.0
#: warmS long: the shadow stays Warming through the window; lowered afterwards to let the shift finish.
POLICY = {"sampleIntervalS": 1, "warmS": 300, "warmupTimeoutS": 900, "rollbackWindowS": 4,
          "drainTimeoutS": 30, "dwellS": 600, "warmupShare": WARMUP_SHARE}  # fmt: skip


def manifests(ns: str, a10: dict[str, str], t4: dict[str, str]) -> list[dict[str, Any]]:
    prefill = build.gearset(PREFILL_GS, ns, {
        "serviceName": SERVICE,
        "role": "prefill",
        "mode": "explicit",
        "initialGear": "one",
        "gears": [
            {"name": "one", "intent": "balanced", "microBatch": 4, "maxBatch": 64,
             "stages": [{"layers": [0, 16], "nodeSelector": a10, "gpuModel": "A10-24GB"}]},
            {"name": "two", "intent": "latency", "microBatch": 2, "maxBatch": 32,
             "predicted": {"throughputQps": PREDICTED_RPS},
             "stages": [{"layers": [0, 16], "nodeSelector": a10, "gpuModel": "A10-24GB"}]},
        ],
        "policy": POLICY,
    })  # fmt: skip
    decode = build.gearset(f"{SERVICE}-decode", ns, {
        "serviceName": SERVICE,
        "role": "decode",
        "mode": "explicit",
        "gears": [
            {"name": "d", "intent": "balanced", "microBatch": 8, "maxBatch": 64,
             "stages": [{"layers": [0, 16], "nodeSelector": t4, "gpuModel": "T4-16GB"}]},
        ],
        "policy": {"sampleIntervalS": 1, "dwellS": 600},
    })  # fmt: skip
    pds = build.pdservice(SERVICE, ns, {
        "model": MODEL,
        "engine": "sim",
        "prefill": {"gearSetRef": {"name": PREFILL_GS}},
        "decode": {"gearSetRef": {"name": f"{SERVICE}-decode"}},
        "slo": {"ttftMs": 200, "itlMs": 50},
    })  # fmt: skip
    return [prefill, decode, pds]


def _get(url: str, timeout: float = 5.0) -> str:
    assert url.startswith("http://127."), url  # loopback only
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return str(r.read().decode())


def _samples(url: str, name: str, **labels: str) -> float:
    """Sum of the ``name`` samples at ``url``'s ``/metrics`` whose labels include ``labels``."""
    total = 0.0
    for fam in text_string_to_metric_families(_get(url + "/metrics")):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


@pytest.fixture(scope="module")
def env(sandbox: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if not sandbox.prometheus_url:
        pytest.skip("needs the sandbox's Prometheus (a shift starts only with signals)")
    if not getattr(sandbox, "is_sandbox", False):
        pytest.skip("needs the gearshift sandbox (private GPU nodes on loopback pod IPs)")
    install_crds(sandbox)
    ns = f"e2e-warm-{uuid.uuid4().hex[:6]}"
    sandbox.kubectl("create", "namespace", ns)
    nodes = GpuNodes(sandbox, "e2e-wm", cidr_base=140, gpu_replicas=2)
    op: OperatorProcess | None = None
    try:
        for _ in range(2):
            nodes.add("A10-24GB", "a10")
        nodes.add("T4-16GB", "t4")
        pool = "gearshift.io/node-pool"
        sandbox.apply(manifests(ns, {pool: nodes.pool("a10")}, {pool: nodes.pool("t4")}))
        op = OperatorProcess(
            sandbox,
            ns,
            tmp_path_factory.mktemp("operator") / "operator.log",
            extra_args=["--prometheus-url", sandbox.prometheus_url],
        )
        router = serving_router_url(sandbox, ns, SERVICE, 2, op.log_tail)

        def signals_ok() -> bool:
            conds = (_gs(sandbox, ns).get("status") or {}).get("conditions") or []
            return any(c["type"] == "SignalsAvailable" and c["status"] == "True" for c in conds)

        sandbox.wait_for(signals_ok, 90, "SignalsAvailable=True on the prefill GearSet")
        yield {"ns": ns, "router": router, "op": op}
    finally:
        left = teardown_run(sandbox, ns, op, nodes)
        assert not left, f"not deleted: {left}"


def _gs(sandbox: Any, ns: str) -> dict[str, Any]:
    return sandbox.kubectl_json("get", "gearset", PREFILL_GS, "-n", ns)


def _heads(sandbox: Any, ns: str, gear: str) -> list[dict[str, Any]]:
    sel = f"gearshift.io/service={SERVICE},gearshift.io/role=prefill,gearshift.io/gear={gear}"
    sel += ",gearshift.io/stage=0"
    return pods(sandbox, ns, sel)


class RouterLoad:
    """``LOAD_RPS`` requests/s through the router for ``seconds`` s, every other one streamed; each answer is
    read to its end and checked (200, a completion, ``[DONE]`` for a stream)."""

    def __init__(self, router: str, seconds: float) -> None:
        assert router.startswith("http://127.")
        self.router = router
        self.n = int(seconds * LOAD_RPS)
        self.ok = 0
        self.errors: list[str] = []
        self.elapsed = 0.0

    async def _one(self, session: Any, i: int) -> None:
        import aiohttp

        stream = i % 2 == 1
        body = {"model": MODEL["name"], "prompt": " ".join(["hello"] * 32), "max_tokens": 8, "stream": stream}
        try:
            async with session.post(
                self.router + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=60)
            ) as r:
                text = await r.text()
                assert r.status == 200, f"HTTP {r.status}: {text[:200]}"
                if stream:
                    assert text.rstrip().endswith("data: [DONE]"), text[-200:]
                else:
                    assert json.loads(text)["choices"][0]["text"]
            self.ok += 1
        except Exception as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")

    async def _run(self) -> None:
        import aiohttp

        start = time.monotonic()
        async with aiohttp.ClientSession() as session:
            tasks = []
            for i in range(self.n):
                await asyncio.sleep(max(0.0, start + i / LOAD_RPS - time.monotonic()))
                tasks.append(asyncio.create_task(self._one(session, i)))
            await asyncio.gather(*tasks)
        self.elapsed = time.monotonic() - start

    def run(self) -> None:
        t = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        t.start()
        t.join(WINDOW_S + 120)
        assert not t.is_alive(), "the load did not finish"


def _snapshot(router: str, shadow_url: str, serving_url: str, shadow: str, serving: str) -> dict[str, float]:
    mirror = "gearshift_router_mirror_requests_total"
    return {
        "shadow_success": _samples(shadow_url, "vllm:request_success_total"),
        "serving_success": _samples(serving_url, "vllm:request_success_total"),
        "mirror_ok": _samples(router, mirror, role="prefill", pod=shadow, outcome="ok"),
        "mirror_failed": _samples(router, mirror, role="prefill", pod=shadow, outcome="failed"),
        "mirror_dropped": _samples(router, mirror, role="prefill", pod=shadow, outcome="dropped"),
        "mirror_busy": _samples(router, mirror, role="prefill", pod=shadow, outcome="busy"),
        "client_on_serving": _samples(router, "gearshift_router_requests_total", prefill_pod=serving),
        "client_on_shadow": _samples(router, "gearshift_router_requests_total", prefill_pod=shadow),
    }


def test_a_warming_shadow_gets_mirrored_requests_within_its_cap_and_clients_see_none(
    sandbox: Any, env: dict[str, Any]
) -> None:
    ns, router = env["ns"], env["router"]
    (serving_pod,) = _heads(sandbox, ns, "one")
    serving = serving_pod["metadata"]["name"]
    serving_url = f"http://{serving_pod['status']['podIP']}:8000"
    sandbox.kubectl(
        "patch", "gearset", PREFILL_GS, "-n", ns, "--type=merge", "-p", '{"spec":{"forceGear":"two"}}'
    )

    def marked_shadow() -> dict[str, Any] | None:
        if (_gs(sandbox, ns).get("status") or {}).get("phase") != "Warming":
            return None
        heads = [p for p in _heads(sandbox, ns, "two") if pod_ready(p)]
        if len(heads) != 1 or heads[0]["metadata"].get("labels", {}).get(names.LABEL_WARMING) != "true":
            return None
        return heads[0]

    shadow_pod = sandbox.wait_for(marked_shadow, 180, "the shadow's head Ready and marked warming")
    shadow = shadow_pod["metadata"]["name"]
    assert shadow_pod["metadata"]["annotations"][names.ANNOTATION_MIRROR_RPS] == "2"
    shadow_url = f"http://{shadow_pod['status']['podIP']}:8000"
    assert shadow_url.startswith("http://127.")
    sandbox.wait_for(
        lambda: _samples(router, "gearshift_router_mirror_targets", role="prefill") == 1,
        30,
        "the router to mirror to the shadow",
        interval=0.5,
    )

    before = _snapshot(router, shadow_url, serving_url, shadow, serving)
    load = RouterLoad(router, WINDOW_S)
    load.run()
    sandbox.wait_for(
        lambda: _samples(router, "gearshift_router_mirror_inflight") == 0, 30, "the copies to finish"
    )
    after = _snapshot(router, shadow_url, serving_url, shadow, serving)
    assert (_gs(sandbox, ns).get("status") or {}).get("phase") == "Warming", "the window was not all Warming"
    d = {k: after[k] - before[k] for k in after}
    figures = {
        "window_s": round(load.elapsed, 2),
        "client_requests": load.n,
        "client_ok": load.ok,
        "cap_rps": CAP_RPS,
        "cap_bound": round(CAP_RPS * load.elapsed + BURST, 1),
        **{k: int(v) for k, v in d.items()},
    }
    print("warm-up mirror figures:", json.dumps(figures))
    assert load.errors == [] and load.ok == load.n > 100, load.errors[:5]
    # the shadow got mirrored requests, within the cap, and nothing else
    assert d["shadow_success"] == d["mirror_ok"], figures
    assert d["mirror_failed"] == 0 and d["mirror_busy"] == 0, figures
    assert 0.5 * CAP_RPS * load.elapsed <= d["mirror_ok"] <= CAP_RPS * load.elapsed + BURST, figures
    # one offer per client request: mirrored or dropped by the cap
    assert d["mirror_ok"] + d["mirror_dropped"] == load.n, figures
    # clients saw none of them: every client request was served by the serving gear, none by the shadow
    assert d["client_on_serving"] == load.n and d["client_on_shadow"] == 0, figures
    assert d["serving_success"] == load.n, figures

    # The switch: the same pod serves, unmarked and not restarted; the router mirrors to nobody.
    uid = shadow_pod["metadata"]["uid"]
    sandbox.kubectl(
        "patch", "gearset", PREFILL_GS, "-n", ns, "--type=merge", "-p", '{"spec":{"policy":{"warmS":1}}}'
    )

    def stable_on_two() -> bool:
        st = _gs(sandbox, ns).get("status") or {}
        return st.get("phase") == "Stable" and st.get("activeGear") == "two"

    sandbox.wait_for(stable_on_two, 120, "the shift to two to finish")
    (now_pod,) = _heads(sandbox, ns, "two")
    meta = now_pod["metadata"]
    assert meta["uid"] == uid and meta["name"] == shadow
    assert all(c.get("restartCount", 0) == 0 for c in now_pod["status"].get("containerStatuses") or [])
    assert names.LABEL_WARMING not in (meta.get("labels") or {})
    assert names.ANNOTATION_MIRROR_RPS not in (meta.get("annotations") or {})
    sandbox.wait_for(
        lambda: _samples(router, "gearshift_router_mirror_targets", role="prefill") == 0,
        30,
        "the router to stop mirroring",
        interval=0.5,
    )
    sent = _samples(router, "gearshift_router_mirror_requests_total")
    on_two = _samples(router, "gearshift_router_requests_total", prefill_pod=shadow)
    tail = RouterLoad(router, 2.0)
    tail.run()
    assert tail.errors == [] and tail.ok == tail.n
    assert _samples(router, "gearshift_router_mirror_requests_total") == sent  # no more copies
    assert _samples(router, "gearshift_router_requests_total", prefill_pod=shadow) - on_two == tail.n
