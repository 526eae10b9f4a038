"""The autoscaler handler (handlers/autoscale.py) over an in-memory API: no scaling section, the router's
no-headroom trigger writing spec.replicas with placement, the no-free-GPU condition (nothing evicted),
retry when a node appears, the scale-down drain, and a shift aborting a drain."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import kopf
import pytest
from test_handlers_reconcile import NS, _example, new_api, put_fleet

from gearshift.api.common import COND_SCALING_ACTIVE
from gearshift.control.autoscale import scaling as sc
from gearshift.control.autoscale import tick as rules
from gearshift.control.signals import GearSelector
from gearshift.handlers import autoscale as au
from gearshift.k8s import names
from gearshift.testing.daemons import OneTurn
from gearshift.testing.kube import FakeKubeApi

GS_NAME = "llama3-8b-decode"
T0 = 1_800_000_000.0
SVC = "llama3-8b"


class FakeSignals:
    """A steady sample and settable pod/router counters."""

    def __init__(self) -> None:
        self.kv = 0.5
        self.running = 2.0
        self.missing: tuple[str, ...] = ()
        self.counters: dict[str, float | None] = {sc.NO_HEADROOM_TOTAL: 0.0}

    def sample(self, url: str, sel: GearSelector, metric: str, slo_ms: float, at: float) -> sc.ScaleSample:
        return sc.ScaleSample(at=at, kv_cache_usage=self.kv, running=self.running, missing=self.missing)

    def counter(self, pods: Sequence[Mapping[str, Any]], port: int, name: str) -> float | None:
        return self.counters.get(name)


def _pod(name: str, stage: int, node: str, ready: bool = True) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": names.engine_labels(SVC, "decode", "g", stage)},
        "spec": {
            "nodeName": node,
            "containers": [{"name": "engine", "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
        },
        "status": {"phase": "Running", "podIP": "127.0.0.1"},
    }


def _sts(replicas: int) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {
            "name": names.stage_statefulset_name(SVC, "decode", "g", 0),
            "labels": names.engine_labels(SVC, "decode", "g", 0),
        },
        "spec": {"replicas": replicas},
        "status": {"readyReplicas": replicas},
    }


@pytest.fixture
def world() -> FakeKubeApi:
    """Decode GearSet with one 1-stage gear ``g`` on A10 nodes by label; 1 replica on gpu-a10-0."""
    a = new_api()
    put_fleet(a)
    pds = _example("pdservice-llama3-8b.yaml")
    pds["spec"]["prometheusUrl"] = "http://127.0.0.1:9"
    pds["spec"]["decode"]["scaling"] = {
        "minReplicas": 1,
        "maxReplicas": 3,
        "windows": {"scaleUpS": 30, "scaleDownS": 0, "scaleToMinDelayS": 600},
    }
    a.put(pds, NS)
    gs = {
        "apiVersion": "gearshift.io/v1alpha1",
        "kind": "GearSet",
        "metadata": {"name": GS_NAME},
        "spec": {
            "serviceName": SVC,
            "role": "decode",
            "mode": "explicit",
            "replicas": 1,
            "gears": [
                {
                    "name": "g",
                    "stages": [
                        {"layers": [0, 32], "nodeSelector": {names.NODE_GPU_MODEL: "A10-24GB"}},
                    ],
                }
            ],
        },
        "status": {"activeGear": "g", "phase": "Stable"},
    }
    a.put(gs, NS)
    a.put(_sts(1), NS)
    a.put(_pod("llama3-8b-decode-g-s0-0", 0, "gpu-a10-0"), NS)
    return a


def gs(api: FakeKubeApi) -> dict[str, Any]:
    return api.get("gearshift.io/v1alpha1", "GearSet", NS, GS_NAME)


def run(api: FakeKubeApi, sig: FakeSignals, now: float) -> au.ScaleTick:
    return au.tick(api.runtime, NS, GS_NAME, now=now, signals=sig)


def cond(api: FakeKubeApi) -> dict[str, Any] | None:
    return next(
        (c for c in gs(api)["status"].get("conditions", []) if c["type"] == COND_SCALING_ACTIVE), None
    )


def a10_nodes(api: FakeKubeApi) -> list[str]:
    return sorted(
        n["metadata"]["name"]
        for n in api.list("v1", "Node")
        if n["metadata"]["labels"].get(names.NODE_GPU_MODEL) == "A10-24GB"
    )


class TestTick:
    def test_without_scaling_section_nothing_happens(self, world: FakeKubeApi) -> None:
        key = world.key("PDService", NS, SVC)
        del world.store[key]["spec"]["decode"]["scaling"]
        res = run(world, FakeSignals(), T0)
        assert res.skipped.startswith("no scaling section") and res.idle
        assert "scaling" not in gs(world)["status"]

    def test_headroom_rejections_scale_up_at_once_onto_a_free_a10(self, world: FakeKubeApi) -> None:
        sig = FakeSignals()
        first = run(world, sig, T0)  # baseline read of the router counter
        assert first.decision is not None and first.decision.kind is sc.ScaleKind.HOLD
        sig.counters[sc.NO_HEADROOM_TOTAL] = 4.0
        res = run(world, sig, T0 + 2)
        assert res.replicas == 2
        body = gs(world)
        assert body["spec"]["replicas"] == 2
        st = body["status"]["scaling"]
        assert (st["lastDecision"], st["lastReason"], st["desiredReplicas"]) == (
            "ScaleUp",
            "NoDecodeHeadroom",
            2,
        )
        assert st["routerRejections"] == 4.0
        # every A10 has the same compute per GPU: the first free one by name (gpu-a10-0 is taken)
        assert st["placement"] == f"new replicas on: {a10_nodes(world)[1]}"
        assert any(e["reason"] == "ScaledUp" for e in world.events)
        assert cond(world)["status"] == "True"

    def test_no_free_gpu_is_a_condition_and_evicts_nothing_then_retries(self, world: FakeKubeApi) -> None:
        for i, node in enumerate(a10_nodes(world)[1:]):
            world.put(_pod(f"other-{i}", 0, node) | {"metadata": {"name": f"other-{i}", "labels": {}}}, NS)
        pods_before = sorted(p["metadata"]["name"] for p in world.list("v1", "Pod", NS))
        sig = FakeSignals()
        run(world, sig, T0)
        sig.counters[sc.NO_HEADROOM_TOTAL] = 2.0
        res = run(world, sig, T0 + 2)
        assert res.replicas is None
        assert gs(world)["spec"]["replicas"] == 1
        c = cond(world)
        assert (c["status"], c["reason"]) == ("False", "NoFreeGPU")
        assert "A10-24GB" in c["message"]
        assert sorted(p["metadata"]["name"] for p in world.list("v1", "Pod", NS)) == pods_before
        # a node appears: the next rejection places the replica there
        world.delete("v1", "Pod", NS, "other-0")
        sig.counters[sc.NO_HEADROOM_TOTAL] = 3.0
        res = run(world, sig, T0 + 4)
        assert res.replicas == 2
        assert cond(world)["status"] == "True"

    def test_a_missing_kv_series_holds_the_scale_down_with_one_warning_then_clears(
        self, world: FakeKubeApi
    ) -> None:
        # KV usage missing while 2 requests run; what is left (waiting 0) reads as no load. Without
        # the hold the tick would drain a replica (as the test below does with kv 0.1).
        world.patch("gearshift.io/v1alpha1", "GearSet", NS, GS_NAME, {"spec": {"replicas": 2}})
        world.put(_sts(2), NS)
        world.put(_pod("llama3-8b-decode-g-s0-1", 0, "gpu-a10-1"), NS)
        sig = FakeSignals()
        sig.kv, sig.missing = None, ("KV-cache usage (max(vllm:kv_cache_usage_perc{...}))",)
        for t in (T0, T0 + 2, T0 + 4):
            res = run(world, sig, t)
            assert res.replicas is None and not res.draining
            assert res.decision is not None and res.decision.reason == sc.REASON_SERIES_MISSING
        c = cond(world)
        assert (c["status"], c["reason"]) == ("False", sc.REASON_SERIES_MISSING)
        assert "KV-cache usage" in c["message"]
        warned = [e for e in world.events if e["reason"] == sc.REASON_SERIES_MISSING]
        assert len(warned) == 1 and warned[0]["type"] == "Warning"
        sig.kv, sig.missing = 0.5, ()
        run(world, sig, T0 + 6)
        assert cond(world)["status"] == "True"

    def test_scale_down_drains_the_highest_head_first(self, world: FakeKubeApi) -> None:
        world.patch("gearshift.io/v1alpha1", "GearSet", NS, GS_NAME, {"spec": {"replicas": 2}})
        world.put(_sts(2), NS)
        world.put(_pod("llama3-8b-decode-g-s0-1", 0, "gpu-a10-1"), NS)
        sig = FakeSignals()
        sig.kv = 0.1  # 0.1 / 0.8 -> ceil(2 x 0.125) = 1; scaleDownS 0
        sig.counters |= {"vllm:num_requests_running": 2.0, "vllm:num_requests_waiting": 0.0}
        res = run(world, sig, T0)
        assert res.draining == ["llama3-8b-decode-g-s0-1"]
        pod = world.get("v1", "Pod", NS, "llama3-8b-decode-g-s0-1")
        assert pod["metadata"]["labels"][names.LABEL_DRAINING] == "true"
        assert gs(world)["spec"]["replicas"] == 2  # not yet: the drain runs first
        # inside the grace period, and then while requests are in flight: hold
        assert run(world, sig, T0 + 1).replicas is None
        assert run(world, sig, T0 + rules.DRAIN_GRACE_S + 1).replicas is None
        sig.counters["vllm:num_requests_running"] = 0.0
        res = run(world, sig, T0 + rules.DRAIN_GRACE_S + 3)
        assert res.replicas == 1
        assert gs(world)["spec"]["replicas"] == 1
        assert gs(world)["status"]["scaling"]["draining"] == []
        assert any(e["reason"] == "ScaledDown" for e in world.events)

    def test_a_shift_aborts_the_drain(self, world: FakeKubeApi) -> None:
        world.patch("gearshift.io/v1alpha1", "GearSet", NS, GS_NAME, {"spec": {"replicas": 2}})
        world.put(_sts(2), NS)
        world.put(_pod("llama3-8b-decode-g-s0-1", 0, "gpu-a10-1"), NS)
        sig = FakeSignals()
        sig.kv = 0.1
        run(world, sig, T0)
        world.patch_status("gearshift.io/v1alpha1", "GearSet", NS, GS_NAME, {"executor": {"step": "Warming"}})
        run(world, sig, T0 + 1)
        pod = world.get("v1", "Pod", NS, "llama3-8b-decode-g-s0-1")
        assert names.LABEL_DRAINING not in pod["metadata"]["labels"]
        assert gs(world)["spec"]["replicas"] == 2
        assert any(e["reason"] == rules.REASON_DRAIN_ABORTED for e in world.events)


class TestRouterSkipsDraining:
    def test_draining_pods_leave_the_pod_set(self) -> None:
        from gearshift.router.membership import draining_pods, without_draining
        from gearshift.router.pool import BackendInfo

        pods = [
            {"metadata": {"name": "a", "labels": {names.LABEL_DRAINING: "true"}}},
            {"metadata": {"name": "b", "labels": {names.LABEL_DRAINING: "false"}}},
            {"metadata": {"name": "c"}},
        ]
        assert draining_pods(pods) == frozenset({"a"})
        infos = [
            BackendInfo(name=n, url=f"http://127.0.0.1:{i}", role="decode") for i, n in enumerate("abc", 9000)
        ]
        assert [b.name for b in without_draining(infos, draining_pods(pods))] == ["b", "c"]


async def test_the_daemon_ticks_with_the_runtime_and_signals_in_kopfs_memo(world: FakeKubeApi) -> None:
    world.runtime.scale_signals = FakeSignals()
    assert "scaling" not in gs(world)["status"]
    await au.gearset_autoscale(
        namespace=NS, name=GS_NAME, body=gs(world), stopped=OneTurn(), memo=kopf.Memo(runtime=world.runtime)
    )  # type: ignore[arg-type]
    assert gs(world)["status"]["scaling"]["lastDecision"] == "Hold"
