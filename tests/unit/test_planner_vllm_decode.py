"""Under vLLM's NixlConnector the decode role is one pipeline stage.

vLLM 0.32.0 ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py``,
``NixlBaseConnectorWorker.__init__``: with ``pipeline_parallel_size > 1`` a ``kv_consumer`` raises
``NotImplementedError("NixlPushConnector consumer (decode) does not support pipeline_parallel_size > 1.")``;
a PP > 1 prefill writes its layer slice into a PP = 1 decode's full-model regions. So the planner plans a
vLLM decode role's gears with ``max_stages=1`` and the reconciler refuses explicit multi-stage decode
gears on a vLLM PDService; the simulated engine keeps its deep decode pipelines.

Memory figures here are computed from Llama-3-8B's config, not taken from the planner: weights
(32 × 218,112,000 + 2 × 128256 × 4096 params, bf16) = 14.96 GiB; KV budget at the default workload
(512 + 128 tokens × 1.2 headroom = 768 tokens, 64 sequences, 4096 B per token per layer, 32 layers) = 6 GiB.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from test_handlers_reconcile import NS, _example, fleet_nodes, service_api, stateful_sets

from gearshift import planner
from gearshift.api.gearset import Gear
from gearshift.control.reconcile.state import SpecInvalid
from gearshift.facts.model import GIB, load_hf_config
from gearshift.handlers import reconcile as rec
from gearshift.planner import PlanError, RooflineAssumptions, RooflineCostModel, StageLimitError, plan
from gearshift.planner.inputs import (
    VLLM_DECODE_STAGE_LIMIT,
    datasheet_gpuprofile,
    engine_stage_limit,
    stage_limit_problems,
)
from gearshift.testing.kube import FakeKubeApi

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ARCH = load_hf_config(EXAMPLES / "models" / "llama-3-8b.json")
WEIGHTS_GIB = (32 * ARCH.layer_weight_bytes + 2 * 128256 * 4096 * 2) / GIB
KV_GIB = 64 * 768 * 4096 * 32 / GIB
DECODE = RooflineCostModel(ARCH, RooflineAssumptions(role="decode"))
WHY = "vLLM's NixlConnector serves decode from one pipeline stage only (prefill PP>1 into decode PP=1)"
REFUSAL_TAIL = f"{WHY}: give decode one-stage gears and scale with replicas or tensor parallelism"


def _node(node_id: str, memory_gb: float, score: float) -> dict[str, Any]:
    return {
        "node_id": node_id,
        "generation": "test",
        "memory_gb": memory_gb,
        "compute_score": score,
        "max_batch_microbatch": 16,
    }


def _profile(nodes: list[dict[str, Any]]) -> planner.Profile:
    ids = [n["node_id"] for n in nodes]
    for n in nodes:
        n["interconnect"] = {m: {"bandwidth_gbps": 100, "latency_us": 10} for m in ids if m != n["node_id"]}
    return planner.parse_profile({"nodes": nodes})


def two_big_four_small() -> planner.Profile:
    """Two A100-40GB-like nodes (36 GiB usable, score 0.32) and four T4-like ones (14.4 GiB, 0.066):
    a T4 cannot hold Llama-3-8B's 14.96 GiB of weights, so a T4 takes part only in a multi-stage gear."""
    big = [_node(f"big-{i}", 36.0, 0.32) for i in range(2)]
    return _profile(big + [_node(f"small-{i}", 14.4, 0.066) for i in range(4)])


def test_figures() -> None:
    assert round(WEIGHTS_GIB, 2) == 14.96
    total = sum(DECODE.at(1).memory_gb(i) for i in range(32))
    assert total == pytest.approx(WEIGHTS_GIB + KV_GIB, rel=1e-9)  # 20.96 GiB


class TestPlannerStageLimit:
    def test_without_a_limit_some_gear_is_multi_stage(self) -> None:
        res = plan(two_big_four_small(), DECODE, sim_requests=200)
        assert max(len(g.stages) for g in res.gears) > 1  # the sim engine's plan keeps its pipelines
        # no limit and max_stages=None are the same call
        same = plan(two_big_four_small(), DECODE, sim_requests=200, max_stages=None)
        assert same.to_dict() == res.to_dict()

    def test_one_stage_gears_whole_model_on_one_node(self) -> None:
        res = plan(two_big_four_small(), DECODE, sim_requests=200, max_stages=1)
        assert [g.name for g in res.gears] == ["latency", "balanced", "throughput"]
        for g in res.gears:
            assert len(g.stages) == 1
            st = g.stages[0]
            assert st.layers == (0, 32)
            # capacity from copies of the whole model: every node holding it is a big one
            assert set(st.nodes) <= {"big-0", "big-1"}
            assert st.memory_gb == pytest.approx(WEIGHTS_GIB + KV_GIB, rel=1e-9)
        assert max(len(g.stages[0].nodes) for g in res.gears) == 2  # both big nodes serve copies

    def test_does_not_fit_one_node_says_so(self) -> None:
        small = _profile([_node(f"small-{i}", 14.4, 0.066) for i in range(4)])
        assert max(len(g.stages) for g in plan(small, DECODE, sim_requests=200).gears) >= 2
        with pytest.raises(StageLimitError) as err:
            plan(small, DECODE, sim_requests=200, max_stages=1, max_stages_why=WHY)
        msg = str(err.value)
        need = WEIGHTS_GIB + KV_GIB
        assert msg.startswith("the model does not fit one node's memory: ")
        assert f"need {need:.2f} GiB" in msg and "the largest node, small-0, holds 14.40 GiB" in msg
        assert f"short by {need - 14.4:.2f} GiB" in msg
        assert "it needs 2 stages, but gears here have one stage only: " + WHY in msg
        assert "tensor parallel inside the node" in msg

    def test_more_cards_per_node_hold_it(self) -> None:
        # a node of two 16 GB cards (28.8 GiB usable): one stage, tensor parallel inside the node
        prof = _profile([_node("t4x2", 28.8, 0.112)] + [_node(f"small-{i}", 14.4, 0.066) for i in range(2)])
        res = plan(prof, DECODE, sim_requests=200, max_stages=1)
        assert all(g.stages[0].nodes == ("t4x2",) and len(g.stages) == 1 for g in res.gears)

    def test_max_stages_two_clamps_the_deep_gears(self) -> None:
        res = plan(two_big_four_small(), DECODE, sim_requests=200, max_stages=2)
        assert all(len(g.stages) <= 2 for g in res.gears)

    def test_bad_limit(self) -> None:
        with pytest.raises(PlanError, match="max_stages must be >= 1"):
            plan(two_big_four_small(), DECODE, max_stages=0)


class TestEngineStageLimit:
    def test_only_vllm_decode_is_limited(self) -> None:
        assert engine_stage_limit("vllm", "decode") is VLLM_DECODE_STAGE_LIMIT
        assert VLLM_DECODE_STAGE_LIMIT.max_stages == 1
        assert engine_stage_limit("vllm", "prefill") is None
        assert engine_stage_limit("sim", "decode") is None
        assert engine_stage_limit("sim", "prefill") is None
        assert VLLM_DECODE_STAGE_LIMIT.why == REFUSAL_TAIL

    def test_explicit_gear_refusal_text(self) -> None:
        g = Gear.model_validate(
            {"name": "x", "stages": [{"layers": [0, 10]}, {"layers": [10, 20]}, {"layers": [20, 32]}]}
        )
        with pytest.raises(ValueError) as err:
            g.check_stage_limit(1, VLLM_DECODE_STAGE_LIMIT.why)
        assert str(err.value) == f"gear 'x' has 3 stages; {REFUSAL_TAIL}"
        one = Gear.model_validate({"name": "y", "stages": [{"layers": [0, 32], "gpus": 2}]})
        one.check_stage_limit(1, "unused")
        assert stage_limit_problems([one], VLLM_DECODE_STAGE_LIMIT) == []

    def test_named_nodes_too_small_for_the_whole_model(self) -> None:
        nodes = {n["metadata"]["name"]: n for n in fleet_nodes()}
        profiles = {n: datasheet_gpuprofile(nodes[n]) for n in ("gpu-t4-0", "gpu-t4-1", "gpu-h100-0")}
        two_t4 = Gear.model_validate(
            {
                "name": "t4s",
                "stages": [
                    {"layers": [0, 16], "nodes": ["gpu-t4-0"]},
                    {"layers": [16, 32], "nodes": ["gpu-t4-1"]},
                ],
            }
        )
        [msg] = stage_limit_problems([two_t4], VLLM_DECODE_STAGE_LIMIT, ARCH, profiles)
        assert msg.startswith(f"gear 't4s' has 2 stages; {REFUSAL_TAIL}; ")
        # 16 GiB × 1 card × 0.9 = 14.40 GiB < 14.96 GiB of weights
        assert f"its weights alone need {WEIGHTS_GIB:.2f} GiB and the largest, gpu-t4-1, has 14.40 GiB" in msg
        assert "name a node with more or larger GPUs" in msg
        h100 = two_t4.model_copy(
            update={"stages": [s.model_copy(update={"nodes": ["gpu-h100-0"]}) for s in two_t4.stages]}
        )
        [msg2] = stage_limit_problems([h100], VLLM_DECODE_STAGE_LIMIT, ARCH, profiles)
        assert msg2 == f"gear 't4s' has 2 stages; {REFUSAL_TAIL}"  # an H100 holds it: no note


# --- the reconciler ---------------------------------------------------------------------------------


def _vllm(api: FakeKubeApi) -> None:
    pds = api.get("gearshift.io/v1alpha1", "PDService", NS, "llama3-8b")
    pds["spec"]["engine"] = "vllm"
    api.put(pds, NS)


def _reconcile(api: FakeKubeApi) -> rec.ReconcileOutcome:
    api.runtime.fleet.forget()
    return rec.reconcile_service(api.runtime, NS, "llama3-8b")


def _explicit_decode(stages: list[dict[str, Any]]) -> dict[str, Any]:
    gs = copy.deepcopy(_example("gearset-explicit.yaml"))
    gs["metadata"]["name"] = "llama3-8b-decode"
    gs["spec"]["role"] = "decode"
    gs["spec"]["initialGear"] = "deep"
    gs["spec"]["gears"] = [{"name": "deep", "intent": "latency", "stages": stages}]
    return gs


@pytest.fixture
def api() -> FakeKubeApi:
    return service_api()


class TestReconcileVllmDecode:
    def test_explicit_multi_stage_decode_is_refused(self, api: FakeKubeApi) -> None:
        _vllm(api)
        api.put(
            _explicit_decode(
                [
                    {"layers": [0, 10], "nodes": ["gpu-t4-0"]},
                    {"layers": [10, 20], "nodes": ["gpu-t4-1"]},
                    {"layers": [20, 32], "nodes": ["gpu-a10-3"]},
                ]
            ),
            NS,
        )
        with pytest.raises(SpecInvalid) as err:
            _reconcile(api)
        want = f"decode: GearSet 'llama3-8b-decode': gear 'deep' has 3 stages; {REFUSAL_TAIL}"
        # an A10 (21.6 GiB usable) holds the 14.96 GiB of weights: no note about one node's memory
        assert str(err.value) == want
        assert stateful_sets(api) == {}  # nothing applied
        st = api.get("gearshift.io/v1alpha1", "PDService", NS, "llama3-8b")["status"]
        ready = next(c for c in st["conditions"] if c["type"] == "Ready")
        assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
        assert ready["message"].startswith(want) and st["phase"] == "Failed"
        [ev] = [e for e in api.events if e["reason"] == "InvalidSpec"]
        assert ev["type"] == "Warning" and want in ev["message"]
        assert ev["involvedObject"]["kind"] == "PDService"

    def test_same_gears_on_the_sim_engine_are_served(self, api: FakeKubeApi) -> None:
        api.put(
            _explicit_decode(
                [{"layers": [0, 16], "nodes": ["gpu-a10-2"]}, {"layers": [16, 32], "nodes": ["gpu-a10-3"]}]
            ),
            NS,
        )
        _reconcile(api)
        assert "llama3-8b-decode-deep-s1" in stateful_sets(api)

    def test_one_stage_explicit_decode_is_served_on_vllm(self, api: FakeKubeApi) -> None:
        _vllm(api)
        api.put(_explicit_decode([{"layers": [0, 32], "nodes": ["gpu-h100-1"]}]), NS)
        _reconcile(api)
        sts = stateful_sets(api)
        assert "llama3-8b-decode-deep-s0" in sts and "llama3-8b-decode-deep-s1" not in sts

    def test_auto_decode_plans_one_stage_gears(self, api: FakeKubeApi) -> None:
        _reconcile(api)  # sim first: its plan and fingerprint
        sim = api.get("gearshift.io/v1alpha1", "GearSet", NS, "llama3-8b-decode")["status"]
        _vllm(api)
        _reconcile(api)
        gs = api.get("gearshift.io/v1alpha1", "GearSet", NS, "llama3-8b-decode")["status"]
        assert gs["profilesHash"] != sim["profilesHash"]  # the limit enters the fingerprint
        assert [g["name"] for g in gs["plannedGears"]] == ["latency", "balanced", "throughput"]
        assert all(len(g["stages"]) == 1 and g["stages"][0]["layers"] == [0, 32] for g in gs["plannedGears"])
        # prefill (explicit, 4 stages) is not limited
        assert "llama3-8b-prefill-balanced-s3" in stateful_sets(api)

    def test_auto_decode_model_too_big_for_one_node(self, api: FakeKubeApi) -> None:
        _vllm(api)
        pds = api.get("gearshift.io/v1alpha1", "PDService", NS, "llama3-8b")
        big = load_hf_config(EXAMPLES / "models" / "llama-3-70b.json")
        pds["spec"]["model"].update(
            numLayers=big.num_layers,
            hiddenSize=big.hidden_size,
            numHeads=big.num_heads,
            numKvHeads=big.num_kv_heads,
            intermediateSize=big.intermediate_size,
        )
        api.put(pds, NS)
        prefill = api.get("gearshift.io/v1alpha1", "GearSet", NS, "llama3-8b-prefill")
        for g in prefill["spec"]["gears"]:  # cover the 80 layers (prefill is not under test)
            g["stages"][-1]["layers"][1] = 80
        api.put(prefill, NS)
        out = _reconcile(api)
        assert not out.placed
        gs = api.get("gearshift.io/v1alpha1", "GearSet", NS, "llama3-8b-decode")["status"]
        planned = next(c for c in gs["conditions"] if c["type"] == "Planned")
        assert planned["status"] == "False"
        assert "the model does not fit one node's memory" in planned["message"]
        assert "the largest node, gpu-h100-1, holds 72.00 GiB" in planned["message"]
        assert WHY in planned["message"]
