"""Builders of gearshift.k8s: stage StatefulSets (sim and vLLM), Services, router, placement, fleet split."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from gearshift.api.gearset import Gear, GearSet
from gearshift.api.pdservice import PDService
from gearshift.k8s import names
from gearshift.k8s.desired import Images, RoleDesire, desired_objects, owner_reference
from gearshift.k8s.engine import EngineContext, EngineSpecError, sim_pipeline, vllm_args
from gearshift.k8s.fleetsplit import split_pools
from gearshift.k8s.router import build_router_deployment, build_router_rbac
from gearshift.k8s.services import build_role_service
from gearshift.k8s.statefulset import build_stage_statefulset, stage_replicas
from gearshift.sim.config import config_from_env

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "examples" / name).read_text())


@pytest.fixture
def pds() -> PDService:
    body = _load("pdservice-llama3-8b.yaml")
    body["metadata"].update(namespace="ns1", uid="u-1")
    return PDService.model_validate(body)


@pytest.fixture
def prefill() -> GearSet:
    return GearSet.model_validate(_load("gearset-explicit.yaml"))


def ctx_for(pds: PDService, engine: str = "sim", replicas: int = 1) -> EngineContext:
    return EngineContext(
        service="llama3-8b",
        namespace="ns1",
        role="prefill",
        engine=engine,
        model=pds.spec.model.to_model_arch(),
        served_model_name=pds.spec.model.name,
        image="img:1",
        pipeline_replicas=replicas,
        drain_s=120,
    )


def env_of(container: dict[str, Any], pod_index: str = "0") -> dict[str, str]:
    """Container env with fieldRefs resolved as the kubelet would, and $(VAR) expanded."""
    out: dict[str, str] = {}
    for e in container["env"]:
        value = e.get("value")
        if value is None:
            value = pod_index  # the only fieldRef is the pod-index label
        for k, v in out.items():
            value = value.replace(f"$({k})", v)
        out[e["name"]] = value
    return out


class TestFleetSplit:
    @pytest.mark.parametrize(
        ("prefill", "decode", "want_p", "want_d"),
        [
            # disjoint pools stay as they are
            ({"a": "H100"}, {"b": "A10"}, {"a"}, {"b"}),
            # 3 shared H100s: prefill ceil(3/2)=2 by sorted name, decode 1
            (
                {"h2": "H100", "h0": "H100", "h1": "H100"},
                {"h0": "H100", "h1": "H100", "h2": "H100"},
                {"h0", "h1"},
                {"h2"},
            ),
            # per model: 2 shared H100 (1/1), 1 shared A10 (prefill), decode-only T4 stays
            (
                {"h0": "H100", "h1": "H100", "a0": "A10"},
                {"h0": "H100", "h1": "H100", "a0": "A10", "t": "T4"},
                {"h0", "a0"},
                {"h1", "t"},
            ),
        ],
    )
    def test_split(self, prefill: dict, decode: dict, want_p: set, want_d: set) -> None:
        p, d = split_pools(prefill, decode)
        assert set(p) == want_p and set(d) == want_d
        assert not set(p) & set(d)
        assert set(p) | set(d) == set(prefill) | set(decode)

    def test_deterministic_whatever_the_order(self) -> None:
        names_ = [f"n{i}" for i in range(7)]
        a = split_pools({n: "X" for n in names_}, {n: "X" for n in reversed(names_)})
        b = split_pools({n: "X" for n in reversed(names_)}, {n: "X" for n in names_})
        assert set(a[0]) == set(b[0]) == {"n0", "n1", "n2", "n3"}


class TestStageStatefulSetSim:
    def test_names_labels_placement(self, pds: PDService, prefill: GearSet) -> None:
        gear = prefill.spec.gear("balanced")
        sts = build_stage_statefulset(ctx_for(pds), gear, 2, owner_reference(pds.model_dump(by_alias=True)))
        assert sts["metadata"]["name"] == "llama3-8b-prefill-balanced-s2"
        assert sts["spec"]["serviceName"] == "llama3-8b-prefill-balanced"
        tmpl = sts["spec"]["template"]
        labels = tmpl["metadata"]["labels"]
        assert labels[names.LABEL_GEAR] == "balanced" and labels[names.LABEL_STAGE] == "2"
        assert labels[names.LABEL_SANDBOX_RUN] == "true"
        assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
        aff = tmpl["spec"]["affinity"]
        terms = aff["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert terms == [
            {
                "matchExpressions": [
                    {"key": "kubernetes.io/hostname", "operator": "In", "values": ["gpu-a100-0"]}
                ]
            }
        ]
        assert "requiredDuringSchedulingIgnoredDuringExecution" in aff["podAntiAffinity"]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tmpl["spec"][
            "tolerations"
        ]
        c = tmpl["spec"]["containers"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        assert tmpl["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
        assert tmpl["spec"]["terminationGracePeriodSeconds"] >= 120
        assert sts["metadata"]["ownerReferences"][0]["kind"] == "PDService"

    def test_selector_stage_uses_labels(self, pds: PDService, prefill: GearSet) -> None:
        gear = prefill.spec.gear("latency")
        sts = build_stage_statefulset(ctx_for(pds, replicas=3), gear, 0)
        exprs = sts["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]["nodeSelectorTerms"][0]["matchExpressions"]
        assert exprs == [{"key": names.NODE_GPU_MODEL, "operator": "In", "values": ["H100-80GB"]}]
        # stage 0 of the latency gear has replicas 2, times 3 pipeline replicas
        assert sts["spec"]["replicas"] == 6
        assert (
            "preferredDuringSchedulingIgnoredDuringExecution"
            in sts["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
        )

    @pytest.mark.parametrize("k", [0, 1, 3])
    def test_env_is_what_the_simulated_engine_reads(self, pds: PDService, prefill: GearSet, k: int) -> None:
        gear = prefill.spec.gear("balanced")
        c = build_stage_statefulset(ctx_for(pds), gear, k)["spec"]["template"]["spec"]["containers"][0]
        env = env_of(c, pod_index="1")
        cfg = config_from_env(env | {"GEARSHIFT_HOST": "127.0.0.1"})  # the real parser of the sim
        assert cfg.stage == k and cfg.role == "prefill" and cfg.worker == (k > 0)
        assert [(s.start, s.end) for s in cfg.pipeline.stages] == [(0, 12), (12, 24), (24, 28), (28, 32)]
        assert [s.gpu for s in cfg.pipeline.stages] == ["H100-80GB", "H100-80GB", "A100-40GB", "A100-40GB"]
        assert cfg.arch.num_layers == 32
        assert (c["args"] == ["--worker"]) == (k > 0)
        assert env["GEARSHIFT_LAYERS"] == f"{gear.stages[k].start},{gear.stages[k].end}"
        peers = env["GEARSHIFT_PEERS"].split(",")
        if k > 0:
            assert peers[0] == f"llama3-8b-prefill-balanced-s{k - 1}-1.llama3-8b-prefill-balanced.ns1.svc"

    def test_links_must_match_stages(self, prefill: GearSet) -> None:
        gear = prefill.spec.gear("balanced")
        assert len(sim_pipeline(gear, [{"gbps": 100, "latencyUs": 10}] * 3)["links"]) == 3
        with pytest.raises(EngineSpecError, match="one per adjacent stage pair"):
            sim_pipeline(gear, [{"gbps": 100, "latencyUs": 10}])


# Flags of `vllm serve` as documented by vLLM (CLI reference `vllm serve --help`, "Parallelism and
# Scaling" for --nnodes/--node-rank/--master-addr/--master-port/--headless with the mp backend, the
# NixlConnector usage guide for --kv-transfer-config). Value-taking flags map to True.
VLLM_DOCUMENTED_FLAGS = {
    "--host": True,
    "--port": True,
    "--served-model-name": True,
    "--tensor-parallel-size": True,
    "--pipeline-parallel-size": True,
    "--max-num-seqs": True,
    "--max-num-batched-tokens": True,
    "--gpu-memory-utilization": True,
    "--kv-transfer-config": True,
    "--distributed-executor-backend": True,
    "--nnodes": True,
    "--node-rank": True,
    "--master-addr": True,
    "--master-port": True,
    "--headless": False,
}


def vllm_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm", exit_on_error=False)
    p.add_argument("cmd", choices=["serve"])
    p.add_argument("model")
    for flag, takes in VLLM_DOCUMENTED_FLAGS.items():
        if takes:
            p.add_argument(flag)
        else:
            p.add_argument(flag, action="store_true")
    return p


class TestVllm:
    @pytest.mark.parametrize("k", [0, 1, 3])
    def test_flags_are_documented_and_consistent(self, pds: PDService, prefill: GearSet, k: int) -> None:
        gear = prefill.spec.gear("balanced")
        ctx = ctx_for(pds, engine="vllm")
        c = build_stage_statefulset(ctx, gear, k)["spec"]["template"]["spec"]["containers"][0]
        assert c["command"] == ["vllm"]
        ns = vllm_parser().parse_args(c["args"])  # unknown flags would raise
        assert ns.model == "meta-llama/Meta-Llama-3-8B"
        assert int(ns.pipeline_parallel_size) == 4 == int(ns.nnodes)
        assert int(ns.node_rank) == k
        assert ns.headless == (k > 0)
        assert ns.distributed_executor_backend == "mp"
        assert int(ns.max_num_seqs) == gear.max_batch
        assert int(ns.max_num_batched_tokens) == gear.micro_batch * 2048
        assert json.loads(ns.kv_transfer_config) == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
        env = env_of(c, pod_index="2")
        # vLLM's own variable for unequal splits: layer counts per stage, summing to the model's layers
        counts = [int(x) for x in env["VLLM_PP_LAYER_PARTITION"].split(",")]
        assert counts == [12, 12, 4, 4] and sum(counts) == 32
        assert ns.master_addr == "$(GEARSHIFT_MASTER_ADDR)"
        assert (
            env["GEARSHIFT_MASTER_ADDR"]
            == "llama3-8b-prefill-balanced-s0-2.llama3-8b-prefill-balanced.ns1.svc"
        )
        assert ("readinessProbe" in c) == (k == 0)  # headless ranks serve no HTTP

    def test_single_stage_has_no_multinode_flags(self, pds: PDService) -> None:
        gear = Gear.model_validate(
            {"name": "one", "stages": [{"layers": [0, 32], "gpus": 2}], "maxBatch": 64}
        )
        args = vllm_args(ctx_for(pds, engine="vllm"), gear, 0)
        ns = vllm_parser().parse_args(args)
        assert ns.nnodes is None and ns.headless is False and ns.tensor_parallel_size == "2"
        assert shlex.join(args).startswith("serve meta-llama/Meta-Llama-3-8B")

    def test_unequal_tp_refused(self, pds: PDService) -> None:
        gear = Gear.model_validate(
            {"name": "x", "stages": [{"layers": [0, 16], "gpus": 1}, {"layers": [16, 32], "gpus": 2}]}
        )
        with pytest.raises(EngineSpecError, match="same gpus"):
            vllm_args(ctx_for(pds, engine="vllm"), gear, 0)

    def test_vllm_runs_pipeline_count_per_stage(self, pds: PDService, prefill: GearSet) -> None:
        gear = prefill.spec.gear("latency")  # stage 0 replicas 2, stage 1 replicas 1
        ctx = ctx_for(pds, engine="vllm")
        assert [stage_replicas(ctx, gear, k) for k in range(2)] == [1, 1]
        assert [stage_replicas(ctx_for(pds), gear, k) for k in range(2)] == [2, 1]


class TestServicesAndRouter:
    def test_role_service_selects_active_gear_heads(self) -> None:
        svc = build_role_service("s", "ns", "decode", "throughput")
        assert svc["metadata"]["name"] == "s-decode"
        assert svc["spec"]["clusterIP"] == "None"  # the router reads its EndpointSlices, no VIP needed
        assert svc["spec"]["selector"] == {
            names.LABEL_SERVICE: "s",
            names.LABEL_ROLE: "decode",
            names.LABEL_GEAR: "throughput",
            names.LABEL_STAGE: "0",
        }

    def test_router_args_parse_with_the_router(self, pds: PDService) -> None:
        from gearshift.router.server import add_arguments

        dep = build_router_deployment("llama3-8b", "ns1", pds.spec)
        c = dep["spec"]["template"]["spec"]["containers"][0]
        p = argparse.ArgumentParser(exit_on_error=False)
        add_arguments(p)
        a = p.parse_args(c["args"])  # the real router's flags
        assert a.service == "llama3-8b" and a.policy == "pd-score" and a.namespace == "ns1"
        assert json.loads(a.weights)["decode"]["itl"] == pytest.approx(0.35)
        assert a.target_itl_ms == 50
        assert dep["spec"]["template"]["metadata"]["labels"][names.LABEL_SANDBOX_RUN] == "true"
        assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "llama3-8b-router"

    def test_router_role_reads_slices_pods_and_gets_services_only(self) -> None:
        sa, role, binding = build_router_rbac("s", "ns")
        assert sa["kind"] == "ServiceAccount"
        verbs = {(r["apiGroups"][0], r["resources"][0]): r["verbs"] for r in role["rules"]}
        assert verbs == {
            ("discovery.k8s.io", "endpointslices"): ["get", "list", "watch"],
            ("", "pods"): ["get", "list", "watch"],
            # the role Services' selectors, for the loopback fallback (router/membership.py)
            ("", "services"): ["get"],
        }
        assert binding["roleRef"]["name"] == role["metadata"]["name"]

    def test_desired_objects_all_owned_and_unique(self, pds: PDService, prefill: GearSet) -> None:
        gears = [prefill.spec.gear("balanced"), prefill.spec.gear("throughput")]
        objs = desired_objects(
            "llama3-8b",
            "ns1",
            pds.spec,
            [RoleDesire("prefill", gears, "balanced")],
            Images(),
            owner_reference({"metadata": {"name": "llama3-8b", "uid": "u"}}),
        )
        keys = [(o["kind"], o["metadata"]["name"]) for o in objs]
        assert len(keys) == len(set(keys))
        assert all(o["metadata"]["ownerReferences"][0]["uid"] == "u" for o in objs)
        sts = sorted(n for k, n in keys if k == "StatefulSet")
        assert sts == sorted(
            [f"llama3-8b-prefill-balanced-s{k}" for k in range(4)]
            + [f"llama3-8b-prefill-throughput-s{k}" for k in range(8)]
        )
        assert ("Service", "llama3-8b-prefill") in keys and ("Service", "llama3-8b") in keys
        # no selected gear -> the role Service is left to the executor
        objs2 = desired_objects(
            "llama3-8b", "ns1", pds.spec, [RoleDesire("prefill", gears, None)], Images(), None
        )
        assert ("Service", "llama3-8b-prefill") not in [(o["kind"], o["metadata"]["name"]) for o in objs2]
