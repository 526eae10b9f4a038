"""Vacating a time-limited node through the gear executor, over the in-memory API.

At a node's leaveBy the reconciler publishes the window-free plan with the running gear's replacement
under a new name and keeps the running gear untouched; the shifting loop shifts to the replacement with
trigger ``window`` (shadow → drain → switch); the executor deletes the old gear; the reconciler then drops
it from ``plannedGears`` and reports the node ``Left``. Checked here: the serving gear's StatefulSets are
never rolled in place, the role Service only ever selects a Ready gear, and nothing is left on the node.

The fleet is the mixed fleet plus two H100 nodes (``gpu-h100-x0``/``x1``) so that the decode role's
latency gear is one stage replicated on both; ``x1`` carries the window, so the planner makes it the
cheap extra replica (the durable ``x0`` holds replica 0). Time: the reconciler reads the wall clock
(deadlines are set relative to it), the shifting loop gets simulated seconds (``T0 + 2 s`` per tick).
"""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from test_handlers_reconcile import NS, _example, fleet_nodes, new_api, put_fleet
from test_shifting import FakeSignals, kubelet

from gearshift.api.common import MAX_GEAR_NAME
from gearshift.api.gearset import Gear
from gearshift.control.reconcile.planning import drop_superseded, merge_plan
from gearshift.control.shifting.executor import Phase
from gearshift.control.windows import closing_nodes, uses, vacate_name, vacate_target, windowed_nodes
from gearshift.dev.sandbox.nodes import gpu_node_manifest
from gearshift.facts.fleet import FleetNode
from gearshift.facts.gpus import gpu_spec
from gearshift.handlers import reconcile as rec
from gearshift.handlers import shifting as sh
from gearshift.k8s import names
from gearshift.testing.kube import FakeKubeApi

GSV = "gearshift.io/v1alpha1"
DECODE = "llama3-8b-decode"
DURABLE, WINDOWED = "gpu-h100-x0", "gpu-h100-x1"
T0 = 1_800_000_000.0
#: Short policy: lead = max(dwell 20, warm 4 + drain 10 + rollback 6) = 20 s; margin 10 s.
POLICY = {"dwellS": 20, "warmS": 4, "drainTimeoutS": 10, "rollbackWindowS": 6}
MARGIN_S = 10


# --- pure parts ------------------------------------------------------------------------------------------
def _g(name: str, intent: str, *stage_nodes: list[str]) -> Gear:
    n = len(stage_nodes)
    return Gear.model_validate(
        {
            "name": name,
            "intent": intent,
            "stages": [
                {"layers": [k * 32 // n, (k + 1) * 32 // n], "replicas": len(ns), "nodes": ns}
                for k, ns in enumerate(stage_nodes)
            ],
        }
    )


READY = {n: {"status": {"conditions": [{"type": "Ready", "status": "True"}]}} for n in ("d0", "d1", "w")}


class TestPure:
    def test_vacate_name_is_a_short_stable_content_hash(self) -> None:
        a = _g("throughput", "throughput", ["d0"], ["d1"])
        b = _g("throughput", "throughput", ["d0"], ["d1", "d0"])
        na, nb = vacate_name(a, MAX_GEAR_NAME), vacate_name(b, MAX_GEAR_NAME)
        assert na == vacate_name(a.model_copy(update={"name": "other"}), MAX_GEAR_NAME)  # name-blind
        assert na != nb and na.startswith("throughput-w") and len(na) <= MAX_GEAR_NAME
        assert vacate_name(a, MAX_GEAR_NAME, taken={na}) not in (na,)

    def test_closing_nodes_and_target(self) -> None:
        report = [
            {"node": "w", "state": "Leaving"},
            {"node": "v", "state": "InUse"},
            {"node": "u", "state": "Left"},
        ]
        assert closing_nodes(report) == {"w", "u"}
        gears = [
            _g("latency-wabc", "latency", ["d0"]),
            _g("balanced", "balanced", ["d0"], ["d1"]),
            _g("latency", "latency", ["d0", "w"]),
        ]
        assert uses(gears[2], {"w"}) and not uses(gears[0], {"w"})
        assert vacate_target(gears, "latency", {"w"}) == "latency-wabc"  # same intent first
        assert vacate_target(gears, "latency", {"w"}, unhealthy={"latency-wabc"}) == "balanced"
        assert vacate_target(gears, "balanced", {"w"}) is None  # not on the node: nothing to do
        assert vacate_target(gears[2:], "latency", {"w"}) is None  # no gear off the node

    def test_report_states(self) -> None:
        from gearshift.control.windows import WindowTiming

        t = WindowTiming(margin_s=10, dwell_s=20, shift_s=20)
        now = datetime(2025, 1, 1, tzinfo=UTC)
        deadlines = {"w": now + timedelta(seconds=29)}  # past leaveBy (30 s before the deadline)
        on = [SimpleNamespace(name="latency", stages=[SimpleNamespace(nodes=["d0", "w"])])]
        assert windowed_nodes(deadlines, on, now, t)[0]["state"] == "Leaving"
        assert windowed_nodes(deadlines, [], now, t)[0]["state"] == "Left"
        assert windowed_nodes({"w": now + timedelta(seconds=31)}, on, now, t)[0]["state"] == "InUse"

    def test_merge_plan_keeps_the_running_gear_and_renames_its_replacement(self) -> None:
        old = [_g("latency", "latency", ["d0", "w"]), _g("balanced", "balanced", ["d0"], ["d1"])]
        new = [_g("latency", "latency", ["d0"]), _g("balanced", "balanced", ["d0"], ["d1"])]
        out = merge_plan(old, new, ["latency"], {"w"}, READY)
        assert [g.name for g in out][1:] == ["balanced", "latency"]
        assert out[0].name.startswith("latency-w") and out[0].stages == new[0].stages
        assert out[2] == old[0]  # the serving gear as it was: no StatefulSet rolls in place
        # Once the executor has shifted off it, the superseded gear goes.
        assert [g.name for g in drop_superseded(out, [out[0].name])] == [out[0].name, "balanced"]
        assert drop_superseded(out, ["latency"]) == out

    def test_merge_plan_node_already_gone_is_a_node_loss(self) -> None:
        old = [_g("latency", "latency", ["d0", "w"])]
        new = [_g("latency", "latency", ["d0"])]
        gone = {k: v for k, v in READY.items() if k != "w"}
        assert merge_plan(old, new, ["latency"], {"w"}, gone) == new  # in place, as before

    def test_merge_plan_active_keeps_a_vacate_name(self) -> None:
        old = [_g("latency-wabc", "latency", ["d0"]), _g("balanced", "balanced", ["d0"], ["d1"])]
        new = [_g("latency", "latency", ["d0", "d1"]), _g("balanced", "balanced", ["d0"], ["d1"])]
        out = merge_plan(old, new, ["latency-wabc"], set(), READY)
        assert [g.name for g in out] == ["latency-wabc", "balanced"]
        assert out[0].stages == new[0].stages


# --- over the in-memory API -------------------------------------------------------------------------------
def _h100(name: str, index: int) -> dict[str, Any]:
    node = gpu_node_manifest(FleetNode(name, "h100x", gpu_spec("H100-80GB"), 1, 200, 10), index, 77, 2)
    node["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    node["metadata"]["labels"][names.NODE_GPU_MODEL] = "H100-80GB"
    return node


def _set_window(api: FakeKubeApi, node: str, until: datetime) -> None:
    prof = api.get(GSV, "GPUProfile", None, node)
    assert prof is not None
    prof["status"]["availableUntil"] = until.isoformat()
    api.put(prof)


def _reconcile(api: FakeKubeApi) -> rec.ReconcileOutcome:
    api.runtime.fleet.forget()
    return rec.reconcile_service(api.runtime, NS, "llama3-8b")


def _gs(api: FakeKubeApi) -> dict[str, Any]:
    body = api.get(GSV, "GearSet", NS, DECODE)
    assert body is not None
    return body


def _decode_sts(api: FakeKubeApi) -> dict[str, dict[str, Any]]:
    return {
        s["metadata"]["name"]: s
        for s in api.list("apps/v1", "StatefulSet", NS, {names.LABEL_ROLE: "decode"})
        if s["metadata"]["labels"].get(names.LABEL_COMPONENT) == names.COMPONENT_ENGINE
    }


def _selected(api: FakeKubeApi) -> str:
    svc = api.get("v1", "Service", NS, "llama3-8b-decode")
    assert svc is not None
    return str(svc["spec"]["selector"][names.LABEL_GEAR])


def _ready(api: FakeKubeApi, gear: str) -> bool:
    sts = [s for s in _decode_sts(api).values() if s["metadata"]["labels"][names.LABEL_GEAR] == gear]
    return bool(sts) and all(s.get("status", {}).get("readyReplicas") == s["spec"]["replicas"] for s in sts)


@pytest.fixture
def windowed() -> FakeKubeApi:
    """The fleet with ``x1`` windowed 3 h ahead, the short policy, reconciled and Ready."""
    a = new_api()
    put_fleet(a, [*fleet_nodes(gpu_replicas=2), _h100(DURABLE, 90), _h100(WINDOWED, 91)])
    _set_window(a, WINDOWED, datetime.now(UTC) + timedelta(hours=3))
    pds = _example("pdservice-llama3-8b.yaml")
    pds["spec"]["prometheusUrl"] = "http://127.0.0.1:9"
    a.put(pds, NS)
    a.put(_example("gearset-explicit.yaml"), NS)
    gs = _example("gearset-auto.yaml")
    gs["spec"]["policy"].update(POLICY)
    gs["spec"]["plan"]["constraints"]["windowMarginS"] = MARGIN_S
    # The vacate is followed from the latency gear (one stage on both H100s); pricing decode by its steps
    # (plan.workload) made the planner's default start gear another one.
    gs["spec"]["initialGear"] = "latency"
    a.put(gs, NS)
    _reconcile(a)
    kubelet(a, T0 - 100)
    _reconcile(a)
    return a


class TestVacate:
    def test_plan_uses_the_windowed_node_for_an_extra_replica(self, windowed: FakeKubeApi) -> None:
        st = _gs(windowed)["status"]
        assert st["activeGear"] == "latency"
        (lat,) = [g for g in st["plannedGears"] if g["name"] == "latency"]
        # Replica 0 durable, the first extra the windowed node (extras take cheap-only nodes first); the
        # KV reservation sized from the default workload (64 × 768 tokens) lets the A100/A10 cards the
        # decode pool keeps hold the whole model too, as further (durable) extras.
        nodes = lat["stages"][0]["nodes"]
        assert nodes[:2] == [DURABLE, WINDOWED]
        assert WINDOWED not in nodes[2:] and all(not n.startswith("gpu-h100-x") for n in nodes[2:])
        (w,) = st["windowedNodes"]
        assert w["state"] == "InUse" and "latency/s0" in w["stages"]

    def test_leave_by_shifts_off_through_the_executor(self, windowed: FakeKubeApi) -> None:
        api = windowed
        # The window now closes 25 s ahead: inside margin (10) + lead (20), so past its leaveBy.
        _set_window(api, WINDOWED, datetime.now(UTC) + timedelta(seconds=25))
        old_specs = {k: copy.deepcopy(v["spec"]) for k, v in _decode_sts(api).items()}
        assert old_specs and all("-latency-" in k for k in old_specs)
        out = _reconcile(api)
        assert out.planned == ["decode"]
        st = _gs(api)["status"]
        names_ = [g["name"] for g in st["plannedGears"]]
        target = names_[0]
        assert target.startswith("latency-w") and names_[-1] == "latency"  # old gear kept, last
        assert st["activeGear"] == "latency" and _selected(api) == "latency"
        (w,) = st["windowedNodes"]
        assert w["state"] == "Leaving" and w["stages"] == ["latency/s0"]
        assert {k: v["spec"] for k, v in _decode_sts(api).items()} == old_specs  # nothing rolled

        sig = FakeSignals()
        sig.up = False  # the deadline does not wait for Prometheus
        phases: list[Phase] = []
        now = T0
        for _ in range(60):
            r = sh.tick(api.runtime, NS, DECODE, now=now, signals=sig)
            assert r.phase is not None
            phases.append(r.phase)
            kubelet(api, now)
            _reconcile(api)
            sel = _selected(api)
            assert _ready(api, sel), f"role Service on {sel!r}, not Ready, at +{now - T0:.0f} s"
            for k, spec in old_specs.items():  # the old gear is never rolled in place
                cur = _decode_sts(api).get(k)
                assert cur is None or cur["spec"] == spec
            now += 2.0
            if r.phase is Phase.STABLE and _gs(api)["status"]["activeGear"] == target:
                break
        order = [p for i, p in enumerate(phases) if i == 0 or phases[i - 1] != p]
        assert order == [Phase.WARMING, Phase.DRAINING, Phase.SWITCHING, Phase.STABLE]
        st = _gs(api)["status"]
        assert st["activeGear"] == target and _selected(api) == target
        assert [g["name"] for g in st["plannedGears"]].count("latency") == 0
        assert all(not uses(Gear.model_validate(g), {WINDOWED}) for g in st["plannedGears"])
        assert all(WINDOWED not in str(s["spec"]) for s in _decode_sts(api).values())
        assert not [p for p in api.list("v1", "Pod", NS) if "-decode-latency-s" in p["metadata"]["name"]]
        (w,) = st["windowedNodes"]
        assert w["state"] == "Left" and w["stages"] == []
        (h,) = st["history"]
        assert (h["from"], h["to"], h["trigger"], h["outcome"]) == ("latency", target, "window", "Succeeded")
        reasons = [e["reason"] for e in api.events]
        for reason in ("WindowClosing", "ShiftStarted", "Switched", "ShiftCompleted", "WindowVacated"):
            assert reason in reasons
        pds = api.get(GSV, "PDService", NS, "llama3-8b")
        assert pds is not None and pds["status"].get("windowLeaveBy") is None

    def test_no_target_keeps_serving_and_says_why(self, windowed: FakeKubeApi) -> None:
        api = windowed
        _set_window(api, WINDOWED, datetime.now(UTC) + timedelta(seconds=25))
        _reconcile(api)
        # Every replacement unhealthy: the loop cannot vacate, keeps the gear and warns once.
        key = api.key("GearSet", NS, DECODE)
        api.store[key]["status"]["gearHealth"] = [
            {"gear": g["name"], "healthy": False, "reason": "OOMKilled", "message": "x"}
            for g in api.store[key]["status"]["plannedGears"]
            if g["name"] != "latency"
        ]
        sig = FakeSignals()
        sig.up = False
        for i in range(3):
            r = sh.tick(api.runtime, NS, DECODE, now=T0 + 2 * i, signals=sig)
            assert r.phase is Phase.STABLE
        assert _selected(api) == "latency"
        assert [e["reason"] for e in api.events].count("WindowNoTarget") == 1
