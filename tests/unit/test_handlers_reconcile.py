"""The PDService reconciler over an in-memory API (idempotence, planning, placement failures, gear ops),
and the GPUProfile -> planner adapter."""

from __future__ import annotations

import copy
import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from gearshift import planner
from gearshift.adapters.caches import PlanCache
from gearshift.adapters.kube import KubeApiError
from gearshift.control.reconcile.planning import plan_message
from gearshift.control.reconcile.settings import Settings
from gearshift.control.reconcile.state import SpecInvalid
from gearshift.dev.sandbox.nodes import sandbox_nodes
from gearshift.facts.fleet import load_fleet
from gearshift.handlers import reconcile as rec
from gearshift.k8s import names
from gearshift.planner.inputs import (
    datasheet_gpuprofile,
    initial_gear,
    resource_profile,
    role_candidates,
)
from gearshift.testing.kube import FakeKubeApi

ROOT = Path(__file__).resolve().parents[2]
NS = "ns1"
#: The reconciler's settings in these tests (fewer simulated requests per gear candidate: faster plans).
SETTINGS = Settings(sim_requests=200)
#: Plans made by the tests' reconciles, shared by every test's Runtime as the operator shares its plans
#: across services (planning takes seconds); keyed by the plan's inputs, so no test sees another's fleet.
PLANS = PlanCache()


def new_api() -> FakeKubeApi:
    """An empty API whose Runtime reconciles with these tests' settings and shares their plans."""
    return FakeKubeApi(settings=SETTINGS, plans=PLANS)


def stateful_sets(api: FakeKubeApi) -> dict[str, dict[str, Any]]:
    """The StatefulSets of namespace ``NS`` by name."""
    return {o["metadata"]["name"]: o for o in api.list("apps/v1", "StatefulSet", NS)}


def resource_versions(api: FakeKubeApi) -> dict[tuple[str, str], str]:
    """``(kind, name) -> resourceVersion`` of every object but the PDServices and GearSets (whose status
    every reconcile may write)."""
    return {
        (kind, name): o["metadata"]["resourceVersion"]
        for (kind, _, name), o in api.store.items()
        if kind not in ("PDService", "GearSet")
    }


def _example(name: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "examples" / name).read_text())


def fleet_nodes(gpu_replicas: int = 1) -> list[dict[str, Any]]:
    """The mixed fleet's Node objects; ``gpu_replicas`` GPUs advertised per card (1: whole cards)."""
    nodes = []
    fleet = dataclasses.replace(
        load_fleet(ROOT / "examples" / "fleets/mixed.yaml"), gpu_replicas=gpu_replicas
    )
    for n in sandbox_nodes(fleet, 77):
        n["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
        model = n["metadata"]["annotations"].get(names.NODE_GPU_MODEL)
        if model:  # the label profiling writes (the probe operator's job)
            n["metadata"]["labels"][names.NODE_GPU_MODEL] = model
        nodes.append(n)
    return nodes


def put_fleet(api: FakeKubeApi, nodes: list[dict[str, Any]] | None = None) -> None:
    """Store ``nodes`` (default: :func:`fleet_nodes`) and the datasheet GPUProfile of each GPU node."""
    for n in fleet_nodes() if nodes is None else nodes:
        api.put(n)
        if n["status"]["allocatable"].get("nvidia.com/gpu"):
            api.put(datasheet_gpuprofile(n))


def service_api() -> FakeKubeApi:
    """The mixed fleet, the llama3-8b PDService and its two example GearSets (explicit prefill, auto
    decode), nothing reconciled yet."""
    a = new_api()
    put_fleet(a)
    a.put(_example("pdservice-llama3-8b.yaml"), NS)
    a.put(_example("gearset-explicit.yaml"), NS)
    a.put(_example("gearset-auto.yaml"), NS)
    return a


@pytest.fixture
def api() -> FakeKubeApi:
    return service_api()


def reconcile(api: FakeKubeApi) -> rec.ReconcileOutcome:
    # The operator drops its fleet cache on every Node/GPUProfile event; tests change nodes directly.
    api.runtime.fleet.forget()
    return rec.reconcile_service(api.runtime, NS, "llama3-8b")


class _Gate:
    """Holds the first ``n`` API calls whose kind ``holds`` until all ``n`` are in flight (a barrier, 5 s at
    most): calls made one after another break it, and the call that waits raises BrokenBarrierError."""

    def __init__(self, n: int, holds: Callable[[str], bool]) -> None:
        self.n, self.holds = n, holds
        self.barrier = threading.Barrier(n, timeout=5)
        self.seen: list[str] = []
        self._lock = threading.Lock()

    def wrap(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def gated(api_version: str, kind: str, *args: Any, **kwargs: Any) -> Any:
            with self._lock:
                wait = self.holds(kind) and len(self.seen) < self.n
                if wait:
                    self.seen.append(kind)
            if wait:
                self.barrier.wait()
            return call(api_version, kind, *args, **kwargs)

        return gated


class TestAdapter:
    def test_profile_from_gpuprofiles(self) -> None:
        nodes = {n["metadata"]["name"]: n for n in fleet_nodes()}
        profiles = {n: datasheet_gpuprofile(b) for n, b in nodes.items() if not n.startswith("cpu")}
        doc = resource_profile(["gpu-h100-0", "gpu-a10-1"], profiles, nodes, memory_utilization=0.9)
        by = {x["node_id"]: x for x in doc["nodes"]}
        assert by["gpu-h100-0"]["memory_gb"] == pytest.approx(80 * 0.9)
        assert by["gpu-a10-1"]["compute_score"] == pytest.approx(125 / 989, rel=1e-5)
        # no measured link: the slower NIC annotation (A10 node: 25 Gb/s) stands in
        assert by["gpu-h100-0"]["interconnect"]["gpu-a10-1"] == {"bandwidth_gbps": 25.0, "latency_us": 10.0}
        prof = planner.parse_profile(doc)  # the planner accepts it
        assert prof.link("gpu-a10-1", "gpu-h100-0").bandwidth_gbps == 25.0

    def test_measured_link_and_override_win(self) -> None:
        nodes = {n["metadata"]["name"]: n for n in fleet_nodes()}
        profiles = {n: datasheet_gpuprofile(nodes[n]) for n in ("gpu-h100-0", "gpu-h100-1")}
        profiles["gpu-h100-0"]["status"]["interconnect"] = [
            {"peer": "gpu-h100-1", "bandwidthGbps": 180.0, "latencyUs": 4.0}
        ]
        profiles["gpu-h100-1"]["spec"]["override"] = {"memoryGiB": 40}
        doc = resource_profile(profiles, profiles, nodes, memory_utilization=1.0)
        by = {x["node_id"]: x for x in doc["nodes"]}
        assert by["gpu-h100-0"]["interconnect"] == {
            "gpu-h100-1": {"bandwidth_gbps": 180.0, "latency_us": 4.0}
        }
        assert "gpu-h100-0" not in by["gpu-h100-1"]["interconnect"]  # measured by the other end: no fallback
        assert by["gpu-h100-1"]["memory_gb"] == 40

    def test_candidates_constraints_and_missing_profiles(self) -> None:
        from gearshift.api.gearset_plan import PlanConstraints

        nodes = fleet_nodes()
        profiles = {
            n["metadata"]["name"]: datasheet_gpuprofile(n)
            for n in nodes
            if n["status"]["allocatable"].get("nvidia.com/gpu")
        }
        del profiles["gpu-a10-3"]
        profiles["gpu-a100-1"]["status"]["phase"] = "Stale"
        cons = PlanConstraints.model_validate(
            {"gpuModels": ["H100-80GB", "A10-24GB", "A100-40GB"], "excludeNodes": ["gpu-h100-1"]}
        )
        c = role_candidates(cons, nodes, profiles)
        assert set(c.nodes) == {"gpu-h100-0", "gpu-a100-0", "gpu-a10-0", "gpu-a10-1", "gpu-a10-2"}
        assert c.missing_profile == ("gpu-a10-3", "gpu-a100-1")
        assert "gpu-a10-3" not in c.nodes and "gpu-t4-0" not in c.nodes

    def test_initial_gear(self) -> None:
        from gearshift.api.gearset import Gear

        g = [
            Gear.model_validate({"name": n, "stages": [{"layers": [0, 4]}], "qpsRange": r})
            for n, r in (("a", [5, 9]), ("b", [0, 5]))
        ]
        assert initial_gear(g, None) == "b"
        assert initial_gear(g, "a") == "a"
        assert initial_gear(g, "zzz") == "b"


class TestReconcile:
    def test_creates_placed_objects_and_plans_auto(self, api: FakeKubeApi) -> None:
        out = reconcile(api)
        assert out.applied > 0 and out.planned == ["decode"]
        sts = stateful_sets(api)
        # prefill: explicit, initialGear balanced -> 4 stages on the named nodes
        pre = [n for n in sts if n.startswith("llama3-8b-prefill-")]
        assert sorted(pre) == [f"llama3-8b-prefill-balanced-s{k}" for k in range(4)]
        # decode: the planner's gears, on the decode share of the fleet split
        gs = api.get("gearshift.io/v1alpha1", "GearSet", NS, "llama3-8b-decode")
        planned = gs["status"]["plannedGears"]
        assert [g["name"] for g in planned] == ["latency", "balanced", "throughput"]
        active = gs["status"]["activeGear"]
        gear = next(g for g in planned if g["name"] == active)
        dec = sorted(n for n in sts if n.startswith("llama3-8b-decode-"))
        assert dec == [f"llama3-8b-decode-{active}-s{k}" for k in range(len(gear["stages"]))]
        decode_nodes = {n for g in planned for s in g["stages"] for n in s["nodes"]}
        # fleet split: H100s, A100s and A10s shared with the explicit prefill pool; decode gets the
        # second half of each model by name
        assert decode_nodes <= {"gpu-h100-1", "gpu-a100-1", "gpu-a10-2", "gpu-a10-3"}
        # the plan equals the planner run on the same split (independent call)
        profs = {o["metadata"]["name"]: o for o in api.list("gearshift.io/v1alpha1", "GPUProfile")}
        nodes = {o["metadata"]["name"]: o for o in api.list("v1", "Node")}
        doc = resource_profile(["gpu-h100-1", "gpu-a100-1", "gpu-a10-2", "gpu-a10-3"], profs, nodes, 0.9)
        from gearshift.api.pdservice import PDService

        arch = PDService.model_validate(api.get("gearshift.io/v1alpha1", "PDService", NS, "llama3-8b")).spec
        want = planner.plan(
            planner.parse_profile(doc),
            # a decode GearSet's gears are priced by their decode steps (default workload 512/128)
            planner.RooflineCostModel(arch.model.to_model_arch(), planner.RooflineAssumptions(role="decode")),
            sim_requests=200,
        )
        assert [[list(s.nodes) for s in g.stages] for g in want.gears] == [
            [s["nodes"] for s in g["stages"]] for g in planned
        ]
        role_svc = api.get("v1", "Service", NS, "llama3-8b-decode")
        assert role_svc["spec"]["selector"][names.LABEL_GEAR] == active
        assert role_svc["spec"]["selector"][names.LABEL_STAGE] == "0"
        st = api.get("gearshift.io/v1alpha1", "PDService", NS, "llama3-8b")["status"]
        assert st["prefill"]["activeGear"] == "balanced" and st["observedGeneration"] == 1
        conds = {c["type"]: c for c in st["conditions"]}
        assert conds["Placed"]["status"] == "True" and conds["Ready"]["status"] == "False"
        assert any(e["reason"] == "Planned" for e in api.events)

    def test_twice_changes_nothing(self, api: FakeKubeApi) -> None:
        reconcile(api)
        before = resource_versions(api)
        status_before = api.get("gearshift.io/v1alpha1", "PDService", NS, "llama3-8b")["metadata"][
            "resourceVersion"
        ]
        n_events = len(api.events)
        out = reconcile(api)
        assert resource_versions(api) == before and out.planned == [] and out.deleted == 0
        assert (
            api.get("gearshift.io/v1alpha1", "PDService", NS, "llama3-8b")["metadata"]["resourceVersion"]
            == status_before
        )
        assert len(api.events) == n_events

    def test_a_second_reconcile_sends_no_apply_and_an_edit_sends_only_the_changed_objects(
        self, api: FakeKubeApi
    ) -> None:
        first = reconcile(api)
        owned = len(api.applied)
        assert first.applied == owned > 0
        assert reconcile(api).applied == 0 and len(api.applied) == owned  # nothing sent: nothing changed
        gs = api.get("gearshift.io/v1alpha1", "GearSet", NS, "llama3-8b-prefill")
        gs["spec"]["gears"][1]["stages"][3]["nodes"] = ["gpu-a10-0"]  # balanced, stage 3 moves
        gs["spec"]["gears"][1]["stages"][3]["gpuModel"] = "A10-24GB"
        api.put(gs, NS)
        assert reconcile(api).applied == 4  # the gear's four StatefulSets (their pipeline env), no more
        assert {o["metadata"]["name"] for o in api.applied[owned:]} == {
            f"llama3-8b-prefill-balanced-s{k}" for k in range(4)
        }

    def test_the_reads_of_what_a_service_owns_go_out_together(self, api: FakeKubeApi) -> None:
        """Its pods, StatefulSets, Services, router Deployment and the router's three RBAC objects: seven
        reads that do not depend on one another. Each waits (at most 5 s) until all seven are in flight, so
        reads made one after another break the barrier and the reconcile fails."""
        owned_kinds = {"Pod", "StatefulSet", "Service", "Deployment", "ServiceAccount", "Role", "RoleBinding"}
        gate = _Gate(len(owned_kinds), lambda kind: kind in owned_kinds)
        api.get, api.list = gate.wrap(api.get), gate.wrap(api.list)  # type: ignore[method-assign]
        assert reconcile(api).applied > 0
        assert sorted(gate.seen) == sorted(owned_kinds) and not gate.barrier.broken

    def test_the_gearset_plans_are_written_together_before_any_apply(self, api: FakeKubeApi) -> None:
        """The two GearSets' status writes wait (at most 5 s) for each other: written one after the other,
        they break the barrier. Both are stored before the first server-side apply."""
        gate = _Gate(2, lambda kind: kind == "GearSet")
        api.patch_status = gate.wrap(api.patch_status)  # type: ignore[method-assign]
        assert reconcile(api).applied > 0 and len(gate.seen) == 2 and not gate.barrier.broken
        verbs = api.verbs()
        first_apply = verbs.index(("apply", "StatefulSet"))
        assert verbs[:first_apply].count(("patch_status", "GearSet")) >= 2

    def test_what_someone_else_changed_or_deleted_is_applied_again(self, api: FakeKubeApi) -> None:
        reconcile(api)
        sts = stateful_sets(api)["llama3-8b-prefill-balanced-s0"]
        want_image = sts["spec"]["template"]["spec"]["containers"][0]["image"]
        sts["spec"]["template"]["spec"]["containers"][0]["image"] = "someone/else:1"
        api.apply(sts)  # a spec edit by hand: the generation moves
        api.delete("v1", "Service", NS, "llama3-8b-decode")  # the role Service deleted by hand
        role = api.get("rbac.authorization.k8s.io/v1", "Role", NS, names.router_name("llama3-8b"))
        role["rules"] = []
        api.apply(role)  # the router's Role emptied: its resourceVersion moves
        n = len(api.applied)
        assert reconcile(api).applied == 3
        assert {(o["kind"], o["metadata"]["name"]) for o in api.applied[n:]} == {
            ("StatefulSet", "llama3-8b-prefill-balanced-s0"),
            ("Service", "llama3-8b-decode"),
            ("Role", names.router_name("llama3-8b")),
        }
        restored = stateful_sets(api)["llama3-8b-prefill-balanced-s0"]
        assert restored["spec"]["template"]["spec"]["containers"][0]["image"] == want_image
        assert api.get("v1", "Service", NS, "llama3-8b-decode") is not None
        assert api.get("rbac.authorization.k8s.io/v1", "Role", NS, names.router_name("llama3-8b"))["rules"]

    def test_a_restarted_operator_applies_everything_once(self, api: FakeKubeApi) -> None:
        owned = reconcile(api).applied
        api.runtime.applied.forget((NS, "llama3-8b"))  # a new process remembers nothing
        assert reconcile(api).applied == owned
        assert reconcile(api).applied == 0

    def test_spec_edit_patches_only_what_changed(self, api: FakeKubeApi) -> None:
        reconcile(api)
        before = resource_versions(api)
        gs = api.get("gearshift.io/v1alpha1", "GearSet", NS, "llama3-8b-prefill")
        gs["spec"]["gears"][1]["stages"][3]["nodes"] = ["gpu-a10-0"]  # balanced, stage 3 moves
        gs["spec"]["gears"][1]["stages"][3]["gpuModel"] = "A10-24GB"
        api.put(gs, NS)
        reconcile(api)
        after = resource_versions(api)
        changed = {k for k in after if before.get(k) != after[k]}
        # the pipeline description (env) changes on every stage of the gear; nothing else moves
        assert changed == {("StatefulSet", f"llama3-8b-prefill-balanced-s{k}") for k in range(4)}
        aff = stateful_sets(api)["llama3-8b-prefill-balanced-s3"]["spec"]["template"]["spec"]["affinity"]
        assert aff["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
            "matchExpressions"
        ][0]["values"] == ["gpu-a10-0"]

    def test_switching_initial_gear_deletes_the_old_gear(self, api: FakeKubeApi) -> None:
        reconcile(api)
        gs = api.get("gearshift.io/v1alpha1", "GearSet", NS, "llama3-8b-prefill")
        gs["spec"]["gears"] = [g for g in gs["spec"]["gears"] if g["name"] != "balanced"]
        gs["spec"]["initialGear"] = "throughput"
        api.put(gs, NS)
        out = reconcile(api)
        pre = sorted(n for n in stateful_sets(api) if n.startswith("llama3-8b-prefill-"))
        assert pre == sorted(f"llama3-8b-prefill-throughput-s{k}" for k in range(8))
        assert out.deleted == 5  # 4 StatefulSets + the headless Service of the balanced gear
        assert (
            api.get("v1", "Service", NS, "llama3-8b-prefill")["spec"]["selector"][names.LABEL_GEAR]
            == "throughput"
        )

    def test_missing_gearset_waits(self, api: FakeKubeApi) -> None:
        api.delete("gearshift.io/v1alpha1", "GearSet", NS, "llama3-8b-decode")
        with pytest.raises(rec.NotYet, match="llama3-8b-decode"):
            reconcile(api)
        st = api.get("gearshift.io/v1alpha1", "PDService", NS, "llama3-8b")["status"]
        placed = next(c for c in st["conditions"] if c["type"] == "Placed")
        assert placed["status"] == "False" and placed["reason"] == "GearSetMissing"
        assert stateful_sets(api) == {}

    def test_gearset_of_other_service_is_permanent(self, api: FakeKubeApi) -> None:
        gs = api.get("gearshift.io/v1alpha1", "GearSet", NS, "llama3-8b-decode")
        gs["spec"]["serviceName"] = "other"
        api.put(gs, NS)
        with pytest.raises(SpecInvalid, match=r"spec\.serviceName: llama3-8b"):
            reconcile(api)

    def test_lost_node_keeps_serving_objects_and_reports(self, api: FakeKubeApi) -> None:
        reconcile(api)
        before = resource_versions(api)
        node = api.get("v1", "Node", None, "gpu-a100-0")
        node["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
        api.put(node)
        reconcile(api)
        after = resource_versions(api)
        pre = {k: v for k, v in after.items() if k[1].startswith("llama3-8b-prefill-balanced")}
        assert pre == {k: v for k, v in before.items() if k[1].startswith("llama3-8b-prefill-balanced")}
        st = api.get("gearshift.io/v1alpha1", "PDService", NS, "llama3-8b")["status"]
        conds = {c["type"]: c for c in st["conditions"]}
        assert conds["Placed"]["status"] == "False" and "gpu-a100-0" in conds["Placed"]["message"]
        assert conds["Degraded"]["status"] == "True" and conds["Degraded"]["reason"] == "NodeLost"
        assert st["phase"] == "Degraded"

    def test_auto_role_replans_without_lost_node(self, api: FakeKubeApi) -> None:
        reconcile(api)
        gs = api.get("gearshift.io/v1alpha1", "GearSet", NS, "llama3-8b-decode")
        used = {n for g in gs["status"]["plannedGears"] for s in g["stages"] for n in s["nodes"]}
        victim = sorted(used)[0]
        api.delete("v1", "Node", None, victim)
        out = reconcile(api)
        assert out.planned == ["decode"]
        gs = api.get("gearshift.io/v1alpha1", "GearSet", NS, "llama3-8b-decode")
        now_used = {n for g in gs["status"]["plannedGears"] for s in g["stages"] for n in s["nodes"]}
        assert victim not in now_used and now_used

    def test_shift_in_flight_is_left_to_the_executor(self, api: FakeKubeApi) -> None:
        reconcile(api)
        gs = api.get("gearshift.io/v1alpha1", "GearSet", NS, "llama3-8b-prefill")
        api.patch_status(
            "gearshift.io/v1alpha1",
            "GearSet",
            NS,
            "llama3-8b-prefill",
            {
                "executor": {"step": "Warming", "fromGear": "balanced", "toGear": "latency"},
                "targetGear": "latency",
            },
        )
        del gs
        reconcile(api)
        pre = sorted(n for n in stateful_sets(api) if n.startswith("llama3-8b-prefill-"))
        assert pre == sorted(
            [f"llama3-8b-prefill-balanced-s{k}" for k in range(4)]
            + ["llama3-8b-prefill-latency-s0", "llama3-8b-prefill-latency-s1"]
        )
        assert (
            api.get("v1", "Service", NS, "llama3-8b-prefill")["spec"]["selector"][names.LABEL_GEAR]
            == "balanced"
        )

    def test_a_gearset_being_deleted_mid_shift_gets_no_shadow(self, api: FakeKubeApi) -> None:
        """CI on a fresh clone (test_shifting_e2e): a GearSet deleted while Warming kept its shadow, since a
        reconcile after the deletion handler freed it (or a tick that loaded the GearSet before) applied it
        again, and nothing was left to free it."""
        reconcile(api)
        gsv = ("gearshift.io/v1alpha1", "GearSet", NS, "llama3-8b-prefill")
        in_flight = {"executor": {"step": "Warming", "fromGear": "balanced", "toGear": "latency"}}
        api.patch_status(*gsv, {**in_flight, "targetGear": "latency"})
        api.patch(*gsv, {"metadata": {"deletionTimestamp": "2026-12-01T21:00:00Z"}})
        reconcile(api)
        pre = sorted(n for n in stateful_sets(api) if n.startswith("llama3-8b-prefill-"))
        assert pre == [f"llama3-8b-prefill-balanced-s{k}" for k in range(4)]
        with pytest.raises(rec.NotYet, match="being deleted"):
            rec.ensure_gear_sync(api.runtime, NS, "llama3-8b", "prefill", "latency")
        assert not [n for n in stateful_sets(api) if "-latency-" in n and "prefill" in n]

    def test_gear_operations(self, api: FakeKubeApi) -> None:
        reconcile(api)
        made = rec.ensure_gear_sync(api.runtime, NS, "llama3-8b", "prefill", "latency")
        assert made == ["llama3-8b-prefill-latency-s0", "llama3-8b-prefill-latency-s1"]
        rec.select_gear_sync(api.runtime, NS, "llama3-8b", "prefill", "latency")
        assert (
            api.get("v1", "Service", NS, "llama3-8b-prefill")["spec"]["selector"][names.LABEL_GEAR]
            == "latency"
        )
        assert rec.delete_gear_sync(api.runtime, NS, "llama3-8b", "prefill", "balanced") == 5
        assert not [n for n in stateful_sets(api) if "-balanced-" in n and "prefill" in n]
        with pytest.raises(KeyError, match="no gear"):
            rec.ensure_gear_sync(api.runtime, NS, "llama3-8b", "prefill", "nope")

    def test_shadow_from_the_executor_matches_the_reconciler(self, api: FakeKubeApi) -> None:
        """ensure_gear_sync (the executor's shadow and its un-shadowing) applies the same pod template as
        the reconciler, pipeline links included: otherwise each apply rolls the gear's pods and the shift
        rolls back with "stopped being Ready while draining" (the demo's failed shifts)."""
        # Long requests (7000 tokens: 64 × 8400 KV tokens reserved, 65.6 GiB beside 15 GiB of weights) fit
        # the whole model on no card, so every gear is a pipeline; at the default 640 tokens every gear is
        # one stage, and at 4000 the throughput gear is the whole model on an H100 (its decode steps batch
        # all 64 sequences per weight read), leaving the active balanced gear the only pipeline.
        body = api.get("gearshift.io/v1alpha1", "GearSet", NS, "llama3-8b-decode")
        body["spec"]["plan"]["workload"] = {"promptTokens": 6000, "outputTokens": 1000}
        api.put(body, NS)
        reconcile(api)
        gs = api.get("gearshift.io/v1alpha1", "GearSet", NS, "llama3-8b-decode")
        active = gs["status"]["activeGear"]
        deep = next(g for g in gs["status"]["plannedGears"] if len(g["stages"]) > 1 and g["name"] != active)
        made = rec.ensure_gear_sync(api.runtime, NS, "llama3-8b", "decode", deep["name"])
        env = {
            e["name"]: e.get("value")
            for e in api.get("apps/v1", "StatefulSet", NS, made[0])["spec"]["template"]["spec"]["containers"][
                0
            ]["env"]
        }
        assert '"links"' in env["GEARSHIFT_PIPELINE"]
        rvs = {n: api.get("apps/v1", "StatefulSet", NS, n)["metadata"]["resourceVersion"] for n in made}
        api.patch_status(
            "gearshift.io/v1alpha1",
            "GearSet",
            NS,
            "llama3-8b-decode",
            {"executor": {"step": "Warming", "fromGear": active, "toGear": deep["name"]}},
        )
        reconcile(api)  # keeps both gears of the shift in flight
        # the switch's un-shadowing
        rec.ensure_gear_sync(api.runtime, NS, "llama3-8b", "decode", deep["name"])
        after = {n: api.get("apps/v1", "StatefulSet", NS, n)["metadata"]["resourceVersion"] for n in made}
        assert after == rvs

    def test_status_counts_ready_pipelines(self, api: FakeKubeApi) -> None:
        reconcile(api)
        for name, o in stateful_sets(api).items():
            o["status"] = {
                "readyReplicas": o["spec"]["replicas"],
                "updatedReplicas": o["spec"]["replicas"],
                "observedGeneration": o["metadata"]["generation"],
            }
            api.store[("StatefulSet", NS, name)] = o
        dep = api.get("apps/v1", "Deployment", NS, "llama3-8b-router")
        dep["status"] = {"availableReplicas": 1}
        api.store[("Deployment", NS, "llama3-8b-router")] = dep
        out = reconcile(api)
        assert out.ready and out.phase == "Ready"
        st = api.get("gearshift.io/v1alpha1", "PDService", NS, "llama3-8b")["status"]
        assert st["prefill"]["readyReplicas"] == st["prefill"]["desiredReplicas"] == 1
        assert st["routerReady"] is True
        conds = {c["type"]: c["status"] for c in st["conditions"]}
        assert conds == {"Placed": "True", "Ready": "True", "Progressing": "False", "Degraded": "False"}
        # GearSet status.replicas (READY column, scale subresource) of a role the autoscaler does not
        # write it for (the example scales decode only): one pipeline replica, Ready.
        prefill = api.get("gearshift.io/v1alpha1", "GearSet", NS, "llama3-8b-prefill")["status"]
        assert not prefill.get("autoscaled") and prefill["replicas"] == 1
        # One pod of a stage not Ready: that pipeline replica is not Ready.
        name, o = next((n, o) for n, o in stateful_sets(api).items() if n.startswith("llama3-8b-prefill-"))
        o["status"]["readyReplicas"] = o["spec"]["replicas"] - 1
        api.store[("StatefulSet", NS, name)] = o
        reconcile(api)
        assert api.get("gearshift.io/v1alpha1", "GearSet", NS, "llama3-8b-prefill")["status"]["replicas"] == 0


class TestExplicitGearLayers:
    def test_gear_beyond_the_models_layers_is_refused_before_anything_is_applied(
        self, api: FakeKubeApi
    ) -> None:
        reconcile(api)
        before = {n: s["metadata"]["resourceVersion"] for n, s in stateful_sets(api).items()}
        gs = api.get("gearshift.io/v1alpha1", "GearSet", NS, "llama3-8b-prefill")
        gear = gs["spec"]["gears"][0]
        last = gear["stages"][-1]
        last["layers"] = [last["layers"][0], 40]  # Llama-3-8B has 32 layers
        api.put(gs, NS)
        with pytest.raises(SpecInvalid, match=r"stages cover layers \[0, 40\) but the model has 32"):
            reconcile(api)
        # Nothing that was serving changed.
        assert {n: s["metadata"]["resourceVersion"] for n, s in stateful_sets(api).items()} == before
        pds = api.get("gearshift.io/v1alpha1", "PDService", NS, "llama3-8b")
        ready = {c["type"]: c for c in pds["status"]["conditions"]}["Ready"]
        assert ready["status"] == "False" and "make the last stage's layers end at 32" in ready["message"]

    def test_a_refused_edit_of_a_serving_service_reads_degraded_not_failed(self, api: FakeKubeApi) -> None:
        reconcile(api)
        pds = api.get("gearshift.io/v1alpha1", "PDService", NS, "llama3-8b")
        # The service was serving: its last status said Ready=True.
        pds["status"]["conditions"] = [
            {"type": "Ready", "status": "True", "reason": "AllReady", "message": "serving",
             "lastTransitionTime": "2026-01-01T00:00:00Z"}
        ]  # fmt: skip
        pds["status"]["phase"] = "Ready"
        api.put(pds, NS)
        before = {n: s["metadata"]["resourceVersion"] for n, s in stateful_sets(api).items()}
        gs = api.get("gearshift.io/v1alpha1", "GearSet", NS, "llama3-8b-prefill")
        last = gs["spec"]["gears"][0]["stages"][-1]
        last["layers"] = [last["layers"][0], 40]
        api.put(gs, NS)
        with pytest.raises(SpecInvalid):
            reconcile(api)
        assert {n: s["metadata"]["resourceVersion"] for n, s in stateful_sets(api).items()} == before
        st = api.get("gearshift.io/v1alpha1", "PDService", NS, "llama3-8b")["status"]
        cond = {c["type"]: c for c in st["conditions"]}
        assert st["phase"] == "Degraded"
        assert cond["Ready"]["status"] == "True"
        assert cond["Progressing"]["status"] == "False"
        assert "make the last stage's layers end at 32" in cond["Progressing"]["message"]
        assert "still serving the last applied spec" in cond["Progressing"]["message"]


class TestUnknownNodeIsNotALostNode:
    def test_misspelled_node_in_a_new_gear_is_a_placement_problem_not_node_lost(
        self, api: FakeKubeApi
    ) -> None:
        reconcile(api)
        gs = api.get("gearshift.io/v1alpha1", "GearSet", NS, "llama3-8b-prefill")
        active = gs["status"]["activeGear"]
        gear = next(g for g in gs["spec"]["gears"] if g["name"] == active)
        typo = gear["stages"][0]["nodes"][0] + "x"
        gear["stages"][0]["nodes"][0] = typo
        api.put(gs, NS)
        reconcile(api)
        conds = {
            c["type"]: c
            for c in api.get("gearshift.io/v1alpha1", "PDService", NS, "llama3-8b")["status"]["conditions"]
        }
        assert conds["Placed"]["status"] == "False"
        assert f"no Node named {typo}" in conds["Placed"]["message"]
        assert conds["Degraded"]["status"] == "False", conds["Degraded"]

    def test_deleted_node_is_lost_after_its_pods_are_gone(self, api: FakeKubeApi) -> None:
        reconcile(api)
        gs = api.get("gearshift.io/v1alpha1", "GearSet", NS, "llama3-8b-prefill")
        active = gs["status"]["activeGear"]
        gear = next(g for g in gs["spec"]["gears"] if g["name"] == active)
        victim = gear["stages"][0]["nodes"][0]
        api.delete("v1", "Node", None, victim)  # the fake API has no pods: only the StatefulSet remembers it
        reconcile(api)
        conds = {
            c["type"]: c
            for c in api.get("gearshift.io/v1alpha1", "PDService", NS, "llama3-8b")["status"]["conditions"]
        }
        assert conds["Degraded"]["status"] == "True" and conds["Degraded"]["reason"] == "NodeLost"
        assert victim in conds["Degraded"]["message"]


def test_pinned_nodes_reads_back_node_affinity() -> None:
    from gearshift.k8s.placement import node_affinity, pinned_nodes

    sts = {"spec": {"template": {"spec": {"affinity": {"nodeAffinity": node_affinity(["b", "a"], {})}}}}}
    assert pinned_nodes(sts) == {"a", "b"}
    by_label = {
        "spec": {"template": {"spec": {"affinity": {"nodeAffinity": node_affinity([], {"pool": "x"})}}}}
    }
    assert pinned_nodes(by_label) == set()


def test_reconciler_marks_the_gearsets_the_pdservice_scales(api: FakeKubeApi) -> None:
    from gearshift.handlers.autoscale import _autoscaled

    pds = api.get("gearshift.io/v1alpha1", "PDService", NS, "llama3-8b")
    pds["spec"]["decode"]["scaling"] = {"minReplicas": 1, "maxReplicas": 2}
    pds["spec"]["prefill"].pop("scaling", None)
    api.put(pds, NS)
    reconcile(api)
    decode = api.get("gearshift.io/v1alpha1", "GearSet", NS, "llama3-8b-decode")
    prefill = api.get("gearshift.io/v1alpha1", "GearSet", NS, "llama3-8b-prefill")
    assert decode["status"]["autoscaled"] is True and _autoscaled(decode)
    assert not prefill["status"].get("autoscaled") and not _autoscaled(prefill)
    # What the autoscaler wrote while it ran (a decision and its condition).
    decode["status"]["scaling"] = {"desiredReplicas": 2, "lastReason": "NoFreeGPU"}
    decode["status"].setdefault("conditions", []).append(
        {"type": "ScalingActive", "status": "False", "reason": "NoFreeGPU", "message": "no node",
         "lastTransitionTime": "2025-01-01T00:00:00Z"}
    )  # fmt: skip
    api.put(decode, NS)
    # Taking the section out clears the mark, so kopf stops that GearSet's autoscale daemon, and the
    # autoscaler's last state goes with it (it no longer describes the role).
    pds = api.get("gearshift.io/v1alpha1", "PDService", NS, "llama3-8b")
    del pds["spec"]["decode"]["scaling"]
    api.put(pds, NS)
    reconcile(api)
    decode = api.get("gearshift.io/v1alpha1", "GearSet", NS, "llama3-8b-decode")
    assert decode["status"]["autoscaled"] is False and not _autoscaled(decode)
    assert decode["status"].get("scaling") is None
    assert "ScalingActive" not in {c["type"] for c in decode["status"].get("conditions") or []}


def test_plan_message_counts_distinct_nodes() -> None:
    from gearshift.api.gearset import Gear

    # Three gears over 5 offered nodes that use only a, b, c and d (a and b shared by two gears).
    gears = [
        Gear.model_validate({"name": n, "stages": st})
        for n, st in (
            ("latency", [{"layers": [0, 32], "nodes": ["a"]}]),
            ("balanced", [{"layers": [0, 16], "nodes": ["a"]}, {"layers": [16, 32], "nodes": ["b"]}]),
            ("throughput", [{"layers": [0, 16], "nodes": ["b", "c"]}, {"layers": [16, 32], "nodes": ["d"]}]),
        )
    ]
    assert plan_message(gears, 5) == (
        "planned 3 gear(s) on 4 node(s) of 5 usable: latency: [0, 32]@a; balanced: [0, 16]@a | [16, 32]@b; "
        "throughput: [0, 16]@b,c | [16, 32]@d"
    )


def test_planned_events_on_the_pdservice_name_the_role_and_gearset(api: FakeKubeApi) -> None:
    reconcile(api)
    planned = [e for e in api.events if e["reason"] == "Planned"]
    on_gs = [e for e in planned if e["involvedObject"]["kind"] == "GearSet"]
    on_pds = [e for e in planned if e["involvedObject"]["kind"] == "PDService"]
    assert len(on_gs) == 1 and on_gs[0]["involvedObject"]["name"] == "llama3-8b-decode"
    assert len(on_pds) == 1
    assert on_pds[0]["message"] == f"decode (GearSet llama3-8b-decode): {on_gs[0]['message']}"
    # The node count is of the distinct nodes the planned gears use (counted from status here).
    gs = api.get("gearshift.io/v1alpha1", "GearSet", NS, "llama3-8b-decode")
    used = {n for g in gs["status"]["plannedGears"] for s in g["stages"] for n in s["nodes"]}
    n_gears = len(gs["status"]["plannedGears"])
    assert on_gs[0]["message"].startswith(f"planned {n_gears} gear(s) on {len(used)} node(s) of 4 usable: ")


def test_gearset_ready_column_counts_serving_copies_as_the_pdservice_does(api: FakeKubeApi) -> None:
    # The demo's case: the active gear is one whole-model stage replicated 4x, at spec.replicas 1.
    gs = api.get("gearshift.io/v1alpha1", "GearSet", NS, "llama3-8b-prefill")
    gs["spec"]["gears"][1]["stages"] = [
        {"layers": [0, 32], "replicas": 4, "nodeSelector": {names.NODE_GPU_MODEL: "A10-24GB"}}
    ]
    api.put(gs, NS)
    reconcile(api)
    sts = stateful_sets(api)["llama3-8b-prefill-balanced-s0"]
    assert sts["spec"]["replicas"] == 4

    def ready_pods(n: int) -> None:
        sts["status"] = {"readyReplicas": n, "updatedReplicas": 4, "observedGeneration": 1}
        api.store[("StatefulSet", NS, "llama3-8b-prefill-balanced-s0")] = copy.deepcopy(sts)
        reconcile(api)

    def shown() -> tuple[dict[str, Any], dict[str, Any]]:
        gs_st = api.get("gearshift.io/v1alpha1", "GearSet", NS, "llama3-8b-prefill")["status"]
        return gs_st, api.get("gearshift.io/v1alpha1", "PDService", NS, "llama3-8b")["status"]

    ready_pods(4)
    gs_st, pds_st = shown()
    assert (gs_st["readyCopies"], gs_st["desiredCopies"], gs_st["ready"]) == (4, 4, "4/4")
    assert gs_st["replicas"] == 1  # one pipeline replica, Ready: the scale subresource's count is kept
    assert (pds_st["prefill"]["readyReplicas"], pds_st["prefill"]["desiredReplicas"]) == (4, 4)
    ready_msg = next(c["message"] for c in pds_st["conditions"] if c["type"] == "Ready")
    assert "prefill 4/4" in ready_msg
    ready_pods(3)  # one copy down: 3 of 4 serve, and the one pipeline replica is not whole
    gs_st, pds_st = shown()
    assert gs_st["ready"] == "3/4" and gs_st["readyCopies"] == 3 and gs_st["replicas"] == 0
    assert pds_st["prefill"]["readyReplicas"] == 3


def _serve_all(api: FakeKubeApi) -> None:
    """Every StatefulSet rolled out and Ready, the router available: the service reads Ready."""
    for name, o in stateful_sets(api).items():
        n = o["spec"]["replicas"]
        o["status"] = {"readyReplicas": n, "updatedReplicas": n, "replicas": n,
                       "observedGeneration": o["metadata"]["generation"]}  # fmt: skip
        api.store[("StatefulSet", NS, name)] = o
    dep = api.get("apps/v1", "Deployment", NS, "llama3-8b-router")
    dep["status"] = {"availableReplicas": 1}
    api.store[("Deployment", NS, "llama3-8b-router")] = dep


def test_an_edit_of_the_active_gear_says_rolling_out_before_the_statefulsets_change(api: FakeKubeApi) -> None:
    """The write that says Progressing comes before the apply that starts the rollout, so no
    read after the StatefulSets changed finds the service Ready on the old revision."""
    reconcile(api)
    _serve_all(api)
    assert reconcile(api).ready
    gs = api.get("gearshift.io/v1alpha1", "GearSet", NS, "llama3-8b-prefill")
    active = gs["status"]["activeGear"]
    ready = next(c for c in gs["status"]["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["observedGeneration"]) == ("True", gs["metadata"]["generation"])
    i = next(k for k, g in enumerate(gs["spec"]["gears"]) if g["name"] == active)
    gs["spec"]["gears"][i]["microBatch"] = gs["spec"]["gears"][i]["microBatch"] + 1
    api.put(gs, NS)
    generation = api.get("gearshift.io/v1alpha1", "GearSet", NS, "llama3-8b-prefill")["metadata"][
        "generation"
    ]
    # The StatefulSet applies fail: what is stored then is what was written ahead of them.
    api.refuse[("apply", "StatefulSet")] = KubeApiError("apply refused (test)", 500)
    with pytest.raises(KubeApiError):
        reconcile(api)
    ahead = api.get("gearshift.io/v1alpha1", "PDService", NS, "llama3-8b")["status"]
    conds = {c["type"]: c for c in ahead["conditions"]}
    assert (conds["Ready"]["status"], conds["Progressing"]["status"], ahead["phase"]) == (
        "False", "True", "Progressing"
    )  # fmt: skip
    gs_ahead = api.get("gearshift.io/v1alpha1", "GearSet", NS, "llama3-8b-prefill")["status"]
    ready = next(c for c in gs_ahead["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["observedGeneration"]) == ("False", generation)
    kept = {c["type"] for c in gs["status"]["conditions"]}
    assert kept <= {c["type"] for c in gs_ahead["conditions"]}  # the list was kept, not replaced
    del api.refuse[("apply", "StatefulSet")]
    out = reconcile(api)
    assert not out.ready and out.phase == "Progressing"
    st = api.get("gearshift.io/v1alpha1", "PDService", NS, "llama3-8b")["status"]
    conds = {c["type"]: c for c in st["conditions"]}
    assert (conds["Ready"]["status"], conds["Progressing"]["status"]) == ("False", "True")
    assert f"prefill gear {active}" in conds["Progressing"]["message"]
    # The GearSet's own Ready is stamped with the edited generation: kubectl wait on it waits.
    gs_st = api.get("gearshift.io/v1alpha1", "GearSet", NS, "llama3-8b-prefill")["status"]
    ready = next(c for c in gs_st["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"], ready["observedGeneration"]) == (
        "False",
        "RollingOut",
        generation,
    )
    # Nothing changes the templates: no write ahead, and once rolled out both read Ready again.
    _serve_all(api)
    api.calls.clear()
    assert reconcile(api).ready
    statuses = [c for c in api.calls if c[:2] == ("patch_status", "PDService")]
    assert len(statuses) <= 1
    gs_st = api.get("gearshift.io/v1alpha1", "GearSet", NS, "llama3-8b-prefill")["status"]
    assert next(c for c in gs_st["conditions"] if c["type"] == "Ready")["status"] == "True"
