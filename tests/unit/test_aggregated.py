"""Aggregated serving: a PDService with ``spec.serving`` (a GearSet of role ``both``) through the reconciler,
the executor's gear operations, the planner and the router's flags, over an in-memory API.

Figures are worked out here from the model's config and the request shape, not read from the planner:
Llama-3-70B (examples/models/llama-3-70b.json) has 80 layers, 8 KV heads of 128 dims in bf16, so
2 x 8 x 128 x 2 = 4096 KV bytes per token and layer; at the example's workload (1024 prompt + 128 output
tokens) an aggregated pipeline holds ceil(1.2 x 1152) = 1383 tokens of KV per sequence (a PD prefill pod
ceil(1.2 x 1025) = 1230).
"""

from __future__ import annotations

import argparse
import copy
import math
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_handlers_reconcile import NS, new_api, put_fleet, stateful_sets
from test_shifting import FakeSignals, PerGearSignals, kubelet

from gearshift.api.gearset import GearSet
from gearshift.api.pdservice import PDService
from gearshift.control.adaptive_batch import tick as ab
from gearshift.control.autoscale.tick import TTFT_METRIC, ScaleScope, Skip, latency_signal, scope_of
from gearshift.control.reconcile.planning import plan_assumptions
from gearshift.control.reconcile.state import SpecInvalid
from gearshift.control.reconcile.verdict import service_verdict
from gearshift.control.shifting.executor import Phase
from gearshift.facts.model import GIB, load_hf_config
from gearshift.handlers import adaptive_batch as batch_handler
from gearshift.handlers import reconcile as rec
from gearshift.handlers import shifting
from gearshift.k8s import names
from gearshift.k8s.router import router_args
from gearshift.planner import load_cluster
from gearshift.planner.costs import RooflineAssumptions, RooflineCostModel
from gearshift.planner.inputs import engine_stage_limit
from gearshift.router import settings as router_settings
from gearshift.router.membership import EndpointSliceMembership
from gearshift.testing.kube import FakeKubeApi

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "vllm" / "tiny-llama-aggregated.yaml"
BIG = ROOT / "examples" / "vllm" / "llama3-70b-aggregated.yaml"
ARCH_70B = load_hf_config(ROOT / "examples" / "models" / "llama-3-70b.json")
KV_BYTES_PER_TOKEN_LAYER = 2 * 8 * 128 * 2


def _docs(path: Path) -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in yaml.safe_load_all(path.read_text())}


def _api(path: Path) -> tuple[FakeKubeApi, str]:
    api = new_api()
    put_fleet(api)
    docs = _docs(path)
    for d in docs.values():
        api.put(copy.deepcopy(d), NS)
    return api, docs["PDService"]["metadata"]["name"]


def _reconcile(api: FakeKubeApi, name: str) -> rec.ReconcileOutcome:
    api.runtime.fleet.forget()
    return rec.reconcile_service(api.runtime, NS, name)


def _env(sts: dict[str, Any]) -> dict[str, str]:
    c = sts["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", "") for e in c["env"]}


def _args(sts: dict[str, Any]) -> list[str]:
    return list(sts["spec"]["template"]["spec"]["containers"][0]["args"])


def _flag(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


class TestReconcileAggregated:
    def test_one_role_both_its_gear_and_services_and_no_pd(self) -> None:
        api, name = _api(TINY)
        out = _reconcile(api, name)
        sts = stateful_sets(api)
        assert sorted(sts) == ["tiny-llama-agg-both-pp1-s0"]  # the initial gear, one stage
        head = sts["tiny-llama-agg-both-pp1-s0"]
        env, args = _env(head), _args(head)
        assert env["GEARSHIFT_ROLE"] == "both" and env["VLLM_PP_LAYER_PARTITION"] == "4"
        assert "--kv-transfer-config" not in args  # no KV transfer: no connector, no NIXL
        assert not any(k.startswith("VLLM_NIXL") for k in env)
        ports = head["spec"]["template"]["spec"]["containers"][0]["ports"]
        assert [p["name"] for p in ports] == ["http"]
        assert _flag(args, "--pipeline-parallel-size") == "1"
        role_svc = api.get("v1", "Service", NS, "tiny-llama-agg-both")
        assert role_svc["spec"]["selector"] == {
            names.LABEL_SERVICE: name,
            names.LABEL_ROLE: "both",
            names.LABEL_GEAR: "pp1",
            names.LABEL_STAGE: "0",
        }
        assert api.get("v1", "Service", NS, "tiny-llama-agg-both-pp1") is not None  # headless, per gear
        assert api.get("v1", "Service", NS, name) is not None  # the client Service <pds>
        for pd in ("prefill", "decode"):
            assert api.get("v1", "Service", NS, f"{name}-{pd}") is None
        router = api.get("apps/v1", "Deployment", NS, names.router_name(name))
        rargs = router["spec"]["template"]["spec"]["containers"][0]["args"]
        assert _flag(rargs, "--roles") == "both" and _flag(rargs, "--policy") == "shortest-queue"
        pds = api.get("gearshift.io/v1alpha1", "PDService", NS, name)
        assert pds["status"]["serving"]["activeGear"] == "pp1"
        assert pds["status"]["serving"]["gearSet"] == "tiny-llama-agg"
        assert "prefill" not in pds["status"] and "decode" not in pds["status"]
        assert out.phase == "Progressing"  # no pod Ready in the in-memory API
        gs = api.get("gearshift.io/v1alpha1", "GearSet", NS, "tiny-llama-agg")["status"]
        assert gs["activeGear"] == "pp1" and gs["phase"] == "Stable"
        selector = set(gs["selector"].split(","))  # the scale subresource's: the active gear's heads
        assert {f"{names.LABEL_ROLE}=both", f"{names.LABEL_GEAR}=pp1", f"{names.LABEL_STAGE}=0"} <= selector

    def test_the_executor_ops_shift_to_the_uneven_two_stage_gear(self) -> None:
        api, name = _api(TINY)
        _reconcile(api, name)
        made = rec.ensure_gear_sync(api.runtime, NS, name, "both", "pp2")
        assert made == ["tiny-llama-agg-both-pp2-s0", "tiny-llama-agg-both-pp2-s1"]
        sts = stateful_sets(api)
        s0, s1 = sts["tiny-llama-agg-both-pp2-s0"], sts["tiny-llama-agg-both-pp2-s1"]
        # layers 3 + 1, vLLM's own variable, the same string on both ranks
        assert _env(s0)["VLLM_PP_LAYER_PARTITION"] == _env(s1)["VLLM_PP_LAYER_PARTITION"] == "3,1"
        assert (_env(s0)["GEARSHIFT_LAYERS"], _env(s1)["GEARSHIFT_LAYERS"]) == ("0,3", "3,4")
        a0, a1 = _args(s0), _args(s1)
        assert _flag(a0, "--nnodes") == _flag(a1, "--nnodes") == "2"
        assert (_flag(a0, "--node-rank"), _flag(a1, "--node-rank")) == ("0", "1")
        assert "--headless" in a1 and "--headless" not in a0
        assert "--kv-transfer-config" not in a0 + a1
        master = f"{name}-both-pp2-s0-$(GEARSHIFT_POD_INDEX).{name}-both-pp2.{NS}.svc"
        assert _env(s1)["GEARSHIFT_MASTER_ADDR"] == master
        rec.select_gear_sync(api.runtime, NS, name, "both", "pp2")
        selector = api.get("v1", "Service", NS, f"{name}-both")["spec"]["selector"]
        assert selector[names.LABEL_GEAR] == "pp2" and selector[names.LABEL_STAGE] == "0"
        assert rec.delete_gear_sync(api.runtime, NS, name, "both", "pp1") == 2  # its StatefulSet + Service
        assert "tiny-llama-agg-both-pp1-s0" not in stateful_sets(api)

    def test_a_gearset_of_another_role_is_refused_naming_the_fix(self) -> None:
        api, name = _api(TINY)
        gs = api.get("gearshift.io/v1alpha1", "GearSet", NS, "tiny-llama-agg")
        gs["spec"]["role"] = "decode"
        api.put(gs, NS)
        with pytest.raises(SpecInvalid) as err:
            _reconcile(api, name)
        msg = str(err.value)
        assert "serving.gearSetRef names GearSet 'tiny-llama-agg'" in msg and "spec.role: both" in msg
        assert stateful_sets(api) == {}

    def test_a_pd_executor_call_on_an_aggregated_service_is_not_yet(self) -> None:
        api, name = _api(TINY)
        _reconcile(api, name)
        with pytest.raises(rec.NotYet, match="has no role prefill"):
            rec.ensure_gear_sync(api.runtime, NS, name, "prefill", "pp1")

    def test_a_service_changing_shape_drops_the_other_shapes_status(self) -> None:
        api, name = _api(TINY)
        _reconcile(api, name)
        body = api.get("gearshift.io/v1alpha1", "PDService", NS, name)
        old = dict(body["status"], prefill={"activeGear": "x"}, decode={"activeGear": "y"})
        api.runtime.fleet.forget()
        pds = PDService.model_validate(body)
        nodes, profiles = api.runtime.fleet.read(api)
        gs_body = api.get("gearshift.io/v1alpha1", "GearSet", NS, "tiny-llama-agg")
        roles = {"both": rec.role_state(pds, name, "both", gs_body)}
        want = rec.desired_state(pds, roles, nodes, profiles, api.runtime.settings, datetime.now(UTC))
        readiness = {"both": rec.Readiness(1, 1, True, 1)}
        verdict = service_verdict(name, NS, want, roles, readiness, [], True, old)
        assert verdict.status["prefill"] is None and verdict.status["decode"] is None  # merge patch: removed
        assert verdict.status["serving"]["activeGear"] == "pp1"
        ready = next(c for c in verdict.conditions if c.type == "Ready")
        assert ready.message == "the serving pipelines and the router serve"


class TestPlanAggregated:
    def test_an_aggregated_role_has_no_stage_limit_on_vllm(self) -> None:
        assert engine_stage_limit("vllm", "both") is None
        assert engine_stage_limit("vllm", "decode") is not None  # the limit is NIXL's, kept for PD

    def test_prices_the_whole_request(self) -> None:
        gs = GearSet.model_validate(_docs(BIG)["GearSet"])
        shape = plan_assumptions(gs)
        assert (shape.role, shape.prompt_tokens, shape.output_tokens) == ("both", 1024, 128)
        assert shape.kv_tokens_per_sequence == math.ceil(1.2 * (1024 + 128)) == 1383

    @pytest.mark.parametrize("whole", [False, True])
    def test_vllm_pipelines_get_no_hot_stage_extras(self, whole: bool) -> None:
        # vLLM runs a stage's replicas as copies of the whole pipeline (the least replicas of its stages),
        # so no multi-stage candidate planned for it may rely on one stage's extra copy; the simulated
        # engine runs hot-stage extras as planned, so its candidates include them (whether a chosen gear
        # has one depends on the fleet: on the mixed fleet the 70B's best gears have none).
        from gearshift.planner import candidates as planner_candidates

        profile = load_cluster(ROOT / "examples" / "fleets" / "mixed.yaml")
        cost = RooflineCostModel(ARCH_70B, RooflineAssumptions(prompt_tokens=1024, output_tokens=128))
        cands = planner_candidates.gear_candidates(profile, cost, "latency", False, whole_pipelines=whole)
        uneven = [c for c in cands if len(c.nodes) > 1 and len({len(ids) for ids in c.nodes}) > 1]
        assert (uneven == []) == whole, [[len(ids) for ids in c.nodes] for c in uneven]

    def test_llama_70b_plans_uneven_pipelines_with_old_cards_on_vllm(self) -> None:
        api, name = _api(BIG)
        _reconcile(api, name)
        planned = api.get("gearshift.io/v1alpha1", "GearSet", NS, "llama3-70b")["status"]["plannedGears"]
        # balanced's pick is throughput's layout (35 + 35 + 10 on two H100s and an A100): one gear.
        assert [g["name"] for g in planned] == ["latency", "throughput"]
        per_layer_weights = ARCH_70B.layer_weight_bytes / GIB
        mixed = 0
        for g in planned:
            # KV for the gear's own max batch (the planner also tries smaller budgets than its 64)
            kv_per_layer = g["maxBatch"] * 1383 * KV_BYTES_PER_TOKEN_LAYER / GIB
            layers = [s["layers"][1] - s["layers"][0] for s in g["stages"]]
            assert len(layers) > 1 and sum(layers) == 80  # a pipeline over the whole model
            assert len(set(layers)) > 1  # unequal layer counts
            cards = {s["gpuModel"] for s in g["stages"]}
            mixed += "H100-80GB" in cards and bool(cards - {"H100-80GB"})  # old cards beside the new
            for s, n in zip(g["stages"][1:-1], layers[1:-1], strict=True):  # no embedding / LM head
                assert s["predictedMemoryGiB"] == pytest.approx(
                    n * (per_layer_weights + kv_per_layer), rel=1e-3
                )
        assert mixed > 0
        # Every gear's predicted time per output token meets the SLO's itlMs within the planner's headroom:
        # at 150 ms a token no layout with the A10s or T4s (600 and 320 GB/s, against the H100s' 3,350) serves
        # more than the H100s with an A100, so every gear is made of those.
        itl_ms = _docs(BIG)["PDService"]["spec"]["slo"]["itlMs"]
        for g in planned:
            assert 0 < g["predicted"]["itlMs"] <= itl_ms
            assert {s["gpuModel"] for s in g["stages"]} <= {"H100-80GB", "A100-40GB"}
        sts = stateful_sets(api)
        active = api.get("gearshift.io/v1alpha1", "GearSet", NS, "llama3-70b")["status"]["activeGear"]
        gear = next(g for g in planned if g["name"] == active)
        partition = ",".join(str(s["layers"][1] - s["layers"][0]) for s in gear["stages"])
        for k in range(len(gear["stages"])):
            s = sts[names.stage_statefulset_name(name, "both", active, k)]
            assert _env(s)["VLLM_PP_LAYER_PARTITION"] == partition
            assert _flag(_args(s), "--pipeline-parallel-size") == str(len(gear["stages"]))

    def test_a_node_closing_soon_is_planned_around_and_reported(self) -> None:
        # Time-limited nodes (the window machinery is the roles' own): gpu-a100-0 is reclaimed in 5 min,
        # within the default dwell (600 s) + window margin (300 s), so no gear of the aggregated plan uses
        # it and the GearSet reports it Left (nothing of this role on it).
        api, name = _api(BIG)
        _reconcile(api, name)
        st = api.get("gearshift.io/v1alpha1", "GearSet", NS, "llama3-70b")["status"]
        before = {n for g in st["plannedGears"] for s in g["stages"] for n in s["nodes"]}
        assert "gpu-a100-0" in before  # what the window takes away
        api, name = _api(BIG)
        prof = api.get("gearshift.io/v1alpha1", "GPUProfile", None, "gpu-a100-0")
        prof["status"]["availableUntil"] = (datetime.now(UTC) + timedelta(minutes=5)).isoformat()
        api.put(prof)
        _reconcile(api, name)
        st = api.get("gearshift.io/v1alpha1", "GearSet", NS, "llama3-70b")["status"]
        used = {n for g in st["plannedGears"] for s in g["stages"] for n in s["nodes"]}
        assert "gpu-a100-0" not in used and "gpu-a100-1" in used  # the other A100 takes its place
        [w] = st["windowedNodes"]
        assert (w["node"], w["state"], w["stages"]) == ("gpu-a100-0", "Left", [])


class TestRouterAggregated:
    def test_router_args_watch_the_one_role_service(self) -> None:
        pds = PDService.model_validate(_docs(TINY)["PDService"])
        args = router_args("tiny-llama-agg", NS, pds.spec)
        assert args[-2:] == ["--roles", "both"]
        pd = PDService.model_validate(
            yaml.safe_load((ROOT / "examples" / "pdservice-llama3-8b.yaml").read_text())
        )
        assert "--roles" not in router_args("llama3-8b", NS, pd.spec)

    def test_roles_flag_reaches_the_membership(self) -> None:
        p = argparse.ArgumentParser()
        router_settings.add_arguments(p)
        a = p.parse_args(["--service", "tiny-llama-agg", "--roles", "both"])
        settings = router_settings.settings_from_args(a)
        assert settings.roles == ("both",)
        assert router_settings.settings_from_args(p.parse_args(["--service", "s"])).roles == (
            "prefill",
            "decode",
        )
        m = EndpointSliceMembership("tiny-llama-agg", NS, lambda _: None, None, roles=settings.roles)  # type: ignore[arg-type]
        assert m.role_of_service == {"tiny-llama-agg-both": "both"}


class TestLoopsOnAggregated:
    def test_adaptive_batch_caps_the_serving_head_pods(self) -> None:
        api, name = _api(TINY)
        _reconcile(api, name)
        head = "tiny-llama-agg-both-pp1-s0-0"
        for pod, labels in (
            (head, names.engine_labels(name, "both", "pp1", 0)),
            (f"{name}-router-0", names.common_labels(name, names.COMPONENT_ROUTER)),
        ):
            api.put({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod, "labels": labels}}, NS)

        class Routers:
            def __init__(self) -> None:
                self.docs: dict[str, dict[str, Any]] = {}

            def fetch(self, pods: Any) -> list[tuple[str, dict[str, Any]]]:
                return list(self.docs.items())

        routers, t0 = Routers(), 1000.0
        first = batch_handler.tick(api.runtime, NS, "tiny-llama-agg", now=t0, source=routers)
        assert first.step is not None and first.step.kind == "Reset"
        routers.docs = {"r0": {"batch": [{"pod": head, "current": 8, "proposed": 7, "reason": "ITL"}]}}
        res = batch_handler.tick(api.runtime, NS, "tiny-llama-agg", now=t0 + ab.COOLDOWN_S, source=routers)
        assert res.step is not None and res.step.kind == "Lower"
        pod = api.get("v1", "Pod", NS, head)
        assert (
            pod["metadata"]["annotations"][names.ANNOTATION_MAX_BATCH] == "7"
        )  # 8 x 0.9 -> at least one step
        st = api.get("gearshift.io/v1alpha1", "GearSet", NS, "tiny-llama-agg")["status"]["adaptiveBatch"]
        assert (st["gear"], st["planned"], st["effective"]) == ("pp1", 8, 7)

    def test_the_autoscaler_scales_the_serving_role_from_spec_serving_scaling(self) -> None:
        docs = _docs(TINY)
        gs = GearSet.model_validate({**docs["GearSet"], "status": {"activeGear": "pp1"}})
        pds = PDService.model_validate(docs["PDService"])
        assert isinstance(scope_of(gs, pds, None), Skip)  # no scaling section: idle
        body = copy.deepcopy(docs["PDService"])
        body["spec"]["serving"]["scaling"] = {"minReplicas": 1, "maxReplicas": 3}
        scope = scope_of(gs, PDService.model_validate(body), "http://127.0.0.1:9090")
        assert isinstance(scope, ScaleScope)
        assert (scope.role, scope.gear.name, scope.policy.max_replicas) == ("both", "pp1", 3)
        assert scope.selector(NS).role == "both"
        # a GearSet of role both beside a disaggregated service has nothing to scale
        pd = PDService.model_validate(
            yaml.safe_load((ROOT / "examples" / "pdservice-llama3-8b.yaml").read_text())
        )
        assert isinstance(scope_of(gs, pd, None), Skip)

    def test_autoscaling_holds_an_aggregated_pipeline_to_ttft(self) -> None:
        slo = PDService.model_validate(_docs(TINY)["PDService"]).spec.slo
        sig = latency_signal("both", slo)
        assert (sig.metric, sig.slo_ms) == (TTFT_METRIC, 2000)


class TestShiftingAggregated:
    """The gear-shifting loop (handlers/shifting.py) on the aggregated GearSet, tick by tick, with the same
    fakes as test_shifting.py: a StatefulSet controller/kubelet and a signal source."""

    T0 = 1_800_000_000.0

    @pytest.fixture
    def world(self) -> tuple[FakeKubeApi, str]:
        api, name = _api(TINY)
        pds = api.get("gearshift.io/v1alpha1", "PDService", NS, name)
        pds["spec"]["prometheusUrl"] = "http://127.0.0.1:9"
        api.put(pds, NS)
        _reconcile(api, name)
        kubelet(api, self.T0 - 100)
        key = api.key("GearSet", NS, "tiny-llama-agg")
        api.store[key]["spec"]["forceGear"] = "pp2"
        return api, name

    @staticmethod
    def _selected(api: FakeKubeApi, name: str) -> str:
        return str(api.get("v1", "Service", NS, f"{name}-both")["spec"]["selector"][names.LABEL_GEAR])

    @staticmethod
    def _gears(api: FakeKubeApi) -> set[str]:
        sts = api.list("apps/v1", "StatefulSet", NS, {names.LABEL_ROLE: "both"})
        return {s["metadata"]["labels"][names.LABEL_GEAR] for s in sts}

    @staticmethod
    def _status(api: FakeKubeApi) -> dict[str, Any]:
        return dict(api.get("gearshift.io/v1alpha1", "GearSet", NS, "tiny-llama-agg")["status"])

    def test_forced_shift_to_the_two_stage_gear_runs_every_phase(
        self, world: tuple[FakeKubeApi, str]
    ) -> None:
        api, name = world
        key = api.key("GearSet", NS, "tiny-llama-agg")
        api.store[key]["spec"]["policy"].update(warmS=4, rollbackWindowS=10, drainTimeoutS=30)
        sig, phases, now = FakeSignals(), [], self.T0
        for _ in range(40):
            r = shifting.tick(api.runtime, NS, "tiny-llama-agg", now=now, signals=sig)
            phases.append(r.phase)
            sel = self._selected(api, name)
            sts = api.list("apps/v1", "StatefulSet", NS, {names.LABEL_ROLE: "both", names.LABEL_GEAR: sel})
            assert sts and all(s.get("status", {}).get("readyReplicas") == s["spec"]["replicas"] for s in sts)
            kubelet(api, now)
            now += 2.0
            if r.phase is Phase.STABLE and self._status(api)["activeGear"] == "pp2" and len(phases) > 3:
                break
        order = [p for i, p in enumerate(phases) if i == 0 or phases[i - 1] != p]
        assert order == [Phase.WARMING, Phase.DRAINING, Phase.SWITCHING, Phase.STABLE]
        assert self._selected(api, name) == "pp2" and self._gears(api) == {"pp2"}
        (h,) = self._status(api)["history"]
        assert (h["from"], h["to"], h["trigger"], h["outcome"]) == ("pp1", "pp2", "forced", "Succeeded")
        assert set(sig.asked) == {"pp1", "pp2"}  # the serving gear's, then the new gear's series
        # the aggregated gear is judged by TTFT against slo.ttftMs (2000 ms in the example)
        assert self._status(api)["signals"]["p99Ms"] == 150.0  # FakeSignals' TTFT P99, not its ITL (20)

    def test_a_p99_regression_rolls_back_to_the_one_stage_gear(self, world: tuple[FakeKubeApi, str]) -> None:
        api, name = world
        key = api.key("GearSet", NS, "tiny-llama-agg")
        api.store[key]["spec"]["policy"].update(warmS=0, rollbackWindowS=30, drainTimeoutS=100)
        # pp2's TTFT P99 9000 ms > 2 x max(pp1's 150 ms, the 2000 ms target) = 4000 ms
        sig = PerGearSignals({"pp1": 150.0, "pp2": 9000.0})
        phases = []
        for t in (self.T0, self.T0 + 2, self.T0 + 4, self.T0 + 6, self.T0 + 30, self.T0 + 32):
            phases.append(shifting.tick(api.runtime, NS, "tiny-llama-agg", now=t, signals=sig).phase)
            kubelet(api, t)
        assert phases[:5] == [
            Phase.WARMING,
            Phase.DRAINING,
            Phase.SWITCHING,
            Phase.SWITCHING,
            Phase.ROLLING_BACK,
        ]
        st = self._status(api)
        assert st["phase"] == "Stable" and st["activeGear"] == "pp1" and self._selected(api, name) == "pp1"
        assert st["history"][-1]["outcome"] == "RolledBack" and self._gears(api) == {"pp1"}
        (mark,) = st["gearHealth"]
        assert (mark["gear"], mark["reason"]) == ("pp2", "P99Regression") and "4000 ms" in mark["message"]
