"""Builders of gearshift.k8s: stage StatefulSets (sim and vLLM), Services, router, placement, fleet split."""

from __future__ import annotations

import argparse
import json
import re
import shlex
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from gearshift.api.enginespec import _OWNED_RE
from gearshift.api.gearset import Gear, GearSet
from gearshift.api.pdservice import PDService
from gearshift.facts.gpus import GPU_SPECS, gpu_spec
from gearshift.k8s import names
from gearshift.k8s.desired import Images, RoleDesire, desired_objects, owner_reference
from gearshift.k8s.engine import (
    SHM_SIZE_LIMIT,
    EngineContext,
    EngineSpecError,
    pipeline_dtype,
    sim_pipeline,
    vllm_args,
)
from gearshift.k8s.fleetsplit import split_pools
from gearshift.k8s.router import build_router_deployment, build_router_rbac
from gearshift.k8s.services import build_gear_headless_service, build_role_service
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


def env_of(container: dict[str, Any], pod_index: str = "0", pod_ip: str = "127.0.0.2") -> dict[str, str]:
    """Container env with fieldRefs (pod-index label, pod IP) and secretKeyRefs resolved as the kubelet
    would, and $(VAR) of earlier variables expanded."""
    out: dict[str, str] = {}
    for e in container["env"]:
        value = e.get("value")
        if value is None:
            src = e["valueFrom"]
            if "secretKeyRef" in src:
                value = "secret"
            else:
                value = {"status.podIP": pod_ip}.get(src["fieldRef"]["fieldPath"], pod_index)
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


def vllm_ctx(pds: PDService, role: str = "prefill", **kw: Any) -> EngineContext:
    return replace(ctx_for(pds, engine="vllm"), role=role, **kw)


def vllm_pod(ctx: EngineContext, gear: Gear, k: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(pod template, engine container)`` of stage ``k``."""
    tmpl = build_stage_statefulset(ctx, gear, k)["spec"]["template"]
    return tmpl, tmpl["spec"]["containers"][0]


def flag(args: list[str], name: str) -> str | None:
    """The value after ``name`` in ``args`` (None when absent). vLLM's own parser reads every argument
    list in tests/unit/test_vllm_args.py; these tests check the manifest around it."""
    return args[args.index(name) + 1] if name in args else None


ONE = Gear.model_validate({"name": "one", "stages": [{"layers": [0, 32], "gpus": 2}], "maxBatch": 64})


class TestVllm:
    """The vLLM pod (vLLM 0.32.0): flags, env, volumes, resources, annotations (engine.py cites vLLM)."""

    @pytest.mark.parametrize("k", [0, 1, 3])
    def test_pod_ip_downward_api_host_and_master_addr(self, pds: PDService, prefill: GearSet, k: int) -> None:
        gear = prefill.spec.gear("balanced")
        _, c = vllm_pod(vllm_ctx(pds), gear, k)
        assert c["command"] == ["vllm"] and c["args"][:2] == ["serve", "meta-llama/Meta-Llama-3-8B"]
        assert c["env"][0] == {
            "name": "GEARSHIFT_POD_IP",
            "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
        }
        assert flag(c["args"], "--host") == "$(GEARSHIFT_POD_IP)"  # not 0.0.0.0: one loopback IP per pod
        assert flag(c["args"], "--port") == "8000"
        env = env_of(c, pod_index="2", pod_ip="127.0.0.9")
        assert env["VLLM_HOST_IP"] == "127.0.0.9"
        assert [int(x) for x in env["VLLM_PP_LAYER_PARTITION"].split(",")] == [12, 12, 4, 4]
        assert flag(c["args"], "--master-addr") == "$(GEARSHIFT_MASTER_ADDR)"
        # the head pod of the same pipeline replica, through the gear's headless Service
        assert (
            env["GEARSHIFT_MASTER_ADDR"]
            == "llama3-8b-prefill-balanced-s0-2.llama3-8b-prefill-balanced.ns1.svc"
        )
        assert flag(c["args"], "--node-rank") == str(k) and ("--headless" in c["args"]) == (k > 0)
        assert ("readinessProbe" in c) == (k == 0)  # headless ranks serve no HTTP
        if k == 0:  # a busy API server process must not flap the head's readiness (engine.py)
            assert {c[p]["timeoutSeconds"] for p in ("startupProbe", "readinessProbe", "livenessProbe")} == {
                5
            }

    @pytest.mark.parametrize(
        ("role", "kv_role"), [("prefill", "kv_producer"), ("decode", "kv_consumer"), ("both", None)]
    )
    @pytest.mark.parametrize("device", ["cuda", "cpu"])
    def test_kv_transfer_and_nixl_only_on_pd_roles(
        self, pds: PDService, prefill: GearSet, role: str, kv_role: str | None, device: str
    ) -> None:
        gear = prefill.spec.gear("balanced")
        for k in (0, 1):
            _, c = vllm_pod(vllm_ctx(pds, role, kv_buffer_device=device), gear, k)
            env = env_of(c, pod_ip="127.0.0.7")
            kv = flag(c["args"], "--kv-transfer-config")
            ports = {p["name"]: p["containerPort"] for p in c["ports"]}
            if kv_role is None:
                assert kv is None and "VLLM_NIXL_SIDE_CHANNEL_HOST" not in env and "nixl" not in ports
                continue
            # The push connector (engine.py docstring: vLLM 0.32's pull connector refuses a prefill
            # pipeline); one engine id per incarnation of a pipeline replica, on every rank: the head pod's
            # name and the replica's KV epoch, which the operator writes before the gate lifts.
            assert json.loads(kv) == {
                "kv_connector": "NixlPushConnector",
                "kv_role": kv_role,
                "kv_buffer_device": device,
                "engine_id": f"llama3-8b-{role}-balanced-s0-$(GEARSHIFT_POD_INDEX)-$(GEARSHIFT_KV_EPOCH)",
                # a slow first handshake must not outlast the prefill's hold on the KV (engine.py)
                "kv_connector_extra_config": {"kv_lease_duration": 120},
            }
            tmpl, _ = vllm_pod(vllm_ctx(pds, role, kv_buffer_device=device), gear, k)
            assert tmpl["spec"]["schedulingGates"] == [{"name": "gearshift.io/kv-epoch"}]
            epoch_env = next(e for e in c["env"] if e["name"] == "GEARSHIFT_KV_EPOCH")
            assert (
                epoch_env["valueFrom"]["fieldRef"]["fieldPath"]
                == "metadata.annotations['gearshift.io/kv-epoch']"
            )
            assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.7"
            assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600" == str(ports["nixl"])

    @pytest.mark.parametrize("role", ["prefill", "decode", "both"])
    def test_one_stage_pods_start_at_once_and_leave_the_engine_id_to_vllm(
        self, pds: PDService, role: str
    ) -> None:
        """vLLM draws a new engine id at each start (KVTransferConfig), which its NIXL peers need after a
        restart; no gate, no epoch."""
        tmpl, c = vllm_pod(vllm_ctx(pds, role), ONE, 0)
        kv = flag(c["args"], "--kv-transfer-config")
        assert (kv is None) == (role == "both")
        if kv is not None:
            assert "engine_id" not in json.loads(kv)
        assert "schedulingGates" not in tmpl["spec"]
        assert "GEARSHIFT_KV_EPOCH" not in {e["name"] for e in c["env"]}

    def test_single_stage_has_no_multinode_flags(self, pds: PDService) -> None:
        args = vllm_args(vllm_ctx(pds), ONE, 0)
        assert flag(args, "--tensor-parallel-size") == "2" and flag(args, "--pipeline-parallel-size") == "1"
        for f in ("--nnodes", "--node-rank", "--master-addr", "--headless", "--distributed-executor-backend"):
            assert f not in args
        assert shlex.join(args).startswith("serve meta-llama/Meta-Llama-3-8B --host")

    def test_engine_args_come_last(self, pds: PDService, prefill: GearSet) -> None:
        extra = ("--enforce-eager", "--max-model-len", "2048")
        for k in (0, 1):
            args = vllm_args(vllm_ctx(pds, engine_args=extra), prefill.spec.gear("balanced"), k)
            assert tuple(args[-3:]) == extra

    def test_unequal_tp_refused(self, pds: PDService) -> None:
        gear = Gear.model_validate(
            {"name": "x", "stages": [{"layers": [0, 16], "gpus": 1}, {"layers": [16, 32], "gpus": 2}]}
        )
        with pytest.raises(EngineSpecError, match="same gpus"):
            vllm_args(vllm_ctx(pds), gear, 0)

    def test_vllm_runs_pipeline_count_per_stage(self, pds: PDService, prefill: GearSet) -> None:
        gear = prefill.spec.gear("latency")  # stage 0 replicas 2, stage 1 replicas 1
        ctx = ctx_for(pds, engine="vllm")
        assert [stage_replicas(ctx, gear, k) for k in range(2)] == [1, 1]
        assert [stage_replicas(ctx_for(pds), gear, k) for k in range(2)] == [2, 1]

    @pytest.mark.parametrize(
        ("dtype", "cards", "want"),
        [
            ("bfloat16", ["H100-80GB", "A100-40GB"], "bfloat16"),
            ("bfloat16", ["L40S-48GB", "A10-24GB", "L4-24GB"], "bfloat16"),
            ("bfloat16", ["H100-80GB", "T4-16GB"], "float16"),  # one pre-Ampere card pins the pipeline
            ("bfloat16", ["V100-32GB"], "float16"),
            ("bfloat16", ["selector:T4-16GB"], "float16"),  # the gpu-model node selector counts too
            ("bfloat16", [None, "H100-80GB"], "bfloat16"),  # a stage naming no card: not downgraded
            ("float16", ["H100-80GB"], "float16"),
            ("float32", ["T4-16GB"], "float32"),  # the sandbox's CPU model
            ("fp8", ["H100-80GB"], "bfloat16"),  # quantized weights compute in bf16 ...
            ("int8", ["T4-16GB"], "float16"),  # ... or fp16 where a card lacks it
        ],
    )
    def test_dtype_pinned_per_pipeline(self, dtype: str, cards: list[str | None], want: str) -> None:
        stages = []
        for i, card in enumerate(cards):
            s: dict[str, Any] = {"layers": [i, i + 1]}
            if card and card.startswith("selector:"):
                s["nodeSelector"] = {names.NODE_GPU_MODEL: card.removeprefix("selector:")}
            elif card:
                s["gpuModel"] = card
            stages.append(s)
        assert pipeline_dtype(dtype, Gear.model_validate({"name": "g", "stages": stages})) == want

    def test_bf16_support_per_card(self) -> None:
        assert {m for m, s in GPU_SPECS.items() if not s.supports_bf16} == {"T4-16GB", "V100-32GB"}
        assert gpu_spec("T4-16GB").compute_capability == (7, 5)

    def test_dtype_flows_from_the_pdservice(self, pds: PDService, prefill: GearSet) -> None:
        body = pds.model_dump(by_alias=True, exclude_none=True)
        body["spec"]["engine"] = "vllm"
        body["spec"]["model"]["dtype"] = "float32"
        spec = PDService.model_validate(body).spec
        objs = desired_objects(
            "llama3-8b",
            "ns1",
            spec,
            [RoleDesire("prefill", [prefill.spec.gear("balanced")], "balanced")],
            Images(),
            None,
        )
        sts = next(o for o in objs if o["kind"] == "StatefulSet")
        assert flag(sts["spec"]["template"]["spec"]["containers"][0]["args"], "--dtype") == "float32"

    @pytest.mark.parametrize("k", [0, 1])
    def test_shm_and_no_cache_by_default(self, pds: PDService, prefill: GearSet, k: int) -> None:
        tmpl, c = vllm_pod(vllm_ctx(pds), prefill.spec.gear("balanced"), k)
        assert tmpl["spec"]["volumes"] == [
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE_LIMIT}}
        ]
        assert c["volumeMounts"] == [{"name": "dshm", "mountPath": "/dev/shm"}]
        env = env_of(c)
        assert "HF_HOME" not in env and "HF_TOKEN" not in env

    @pytest.mark.parametrize(
        ("cache", "volume"),
        [
            (
                {"hostPath": "/var/cache/hf"},
                {"hostPath": {"path": "/var/cache/hf", "type": "DirectoryOrCreate"}},
            ),
            ({"claimName": "models"}, {"persistentVolumeClaim": {"claimName": "models"}}),
        ],
    )
    def test_model_cache_is_one_volume_for_every_gear(
        self, pds: PDService, prefill: GearSet, cache: dict[str, str], volume: dict[str, Any]
    ) -> None:
        body = pds.model_dump(by_alias=True, exclude_none=True)
        body["spec"].update(engine="vllm", modelCache=cache, hfTokenSecret={"name": "hf", "key": "hf-token"})
        spec = PDService.model_validate(body).spec
        gears = [prefill.spec.gear("balanced"), prefill.spec.gear("throughput")]
        objs = desired_objects(
            "llama3-8b", "ns1", spec, [RoleDesire("prefill", gears, "balanced")], Images(), None
        )
        templates = [o["spec"]["template"] for o in objs if o["kind"] == "StatefulSet"]
        assert len(templates) == 12
        for tmpl in templates:
            vols = {v["name"]: v for v in tmpl["spec"]["volumes"]}
            assert vols["model-cache"] == {"name": "model-cache", **volume}
            c = tmpl["spec"]["containers"][0]
            assert {"name": "model-cache", "mountPath": "/root/.cache/huggingface"} in c["volumeMounts"]
            env = {e["name"]: e for e in c["env"]}
            assert env["HF_HOME"]["value"] == "/root/.cache/huggingface"
            assert env["HF_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "hf-token"}}

    def test_resources_requests_so_pods_are_not_best_effort(self, pds: PDService, prefill: GearSet) -> None:
        _, c = vllm_pod(vllm_ctx(pds), prefill.spec.gear("balanced"), 1)
        # 2 + N cores for N GPUs (vLLM's CPU minimum), 6G (vLLM's Kubernetes guide)
        assert c["resources"] == {"limits": {"nvidia.com/gpu": "1"}, "requests": {"cpu": "3", "memory": "6G"}}
        assert vllm_pod(vllm_ctx(pds), ONE, 0)[1]["resources"]["requests"]["cpu"] == "4"
        _, c = vllm_pod(vllm_ctx(pds, cpu_request=8, memory_request="32Gi"), ONE, 0)
        assert c["resources"]["requests"] == {"cpu": "8", "memory": "32Gi"}
        assert c["resources"]["limits"] == {"nvidia.com/gpu": "2"}

    def test_only_the_head_is_scraped(self, pds: PDService, prefill: GearSet) -> None:
        gear = prefill.spec.gear("balanced")
        ann = [vllm_pod(vllm_ctx(pds), gear, k)[0]["metadata"]["annotations"] for k in range(4)]
        assert ann[0] == {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": "8000",
            "prometheus.io/path": "/metrics",
        }
        assert ann[1:] == [{}, {}, {}]  # headless ranks serve no /metrics
        # simulated workers do export /metrics (per-stage utilisation)
        sim = build_stage_statefulset(ctx_for(pds), gear, 2)["spec"]["template"]["metadata"]["annotations"]
        assert sim["prometheus.io/scrape"] == "true"


class TestPDServiceEngineFields:
    """spec.engineArgs, kvBufferDevice, hfTokenSecret, modelCache, resources (pydantic and the CRD)."""

    @staticmethod
    def spec(**fields: Any) -> dict[str, Any]:
        body = _load("pdservice-llama3-8b.yaml")
        body["spec"].update(engine="vllm", **fields)
        return body

    @pytest.mark.parametrize(
        ("arg", "owned"),
        [
            ("--port", "--port"),
            ("--port=9000", "--port"),
            ("--host", "--host"),
            ("--tensor_parallel_size", "--tensor-parallel-size"),
            ("-tp", "--tensor-parallel-size"),
            ("-tp2", "--tensor-parallel-size"),
            ("-pp=2", "--pipeline-parallel-size"),
            ("--nnodes", "--nnodes"),
            ("-n", "--nnodes"),
            ("--node-rank=1", "--node-rank"),
            ("--master-addr", "--master-addr"),
            ("--master-port", "--master-port"),
            ("--headless", "--headless"),
            ("--headl", "--headless"),  # argparse resolves unambiguous abbreviations
            ("--kv-transfer-config", "--kv-transfer-config"),
            ("--kv-transfer-config.kv_role", "--kv-transfer-config"),
            ("--served-model-name", "--served-model-name"),
            ("--dtype=half", "--dtype"),
            ("--max-num-seqs", "--max-num-seqs"),
        ],
    )
    def test_owned_flags_refused_naming_field_and_fix(self, arg: str, owned: str) -> None:
        with pytest.raises(ValidationError) as err:
            PDService.model_validate(self.spec(engineArgs=["--enforce-eager", arg, "1"]))
        msg = str(err.value)
        assert f"spec.engineArgs[1] {arg!r}: {owned} is set by the operator" in msg
        assert "remove it from spec.engineArgs" in msg
        assert re.fullmatch(_OWNED_RE, arg.replace("_", "-")) or arg == "--headl"  # the CRD's rule too

    @pytest.mark.parametrize(
        "args", [["--enforce-eager"], ["--max-model-len", "2048"], ["--max_model_len=2048", "-O0"], []]
    )
    def test_other_args_accepted(self, args: list[str]) -> None:
        spec = PDService.model_validate(self.spec(engineArgs=args)).spec
        assert spec.engine_args == args
        assert not any(re.fullmatch(_OWNED_RE, a.replace("_", "-")) for a in args)

    def test_engine_args_bounded(self) -> None:
        with pytest.raises(ValidationError, match="at most 64"):
            PDService.model_validate(self.spec(engineArgs=["--enforce-eager"] * 65))
        with pytest.raises(ValidationError, match="at most 256"):
            PDService.model_validate(self.spec(engineArgs=["--x=" + "a" * 256]))

    def test_defaults(self) -> None:
        spec = PDService.model_validate(self.spec()).spec
        assert spec.kv_buffer_device == "cuda" and spec.engine_args == []
        assert spec.hf_token_secret is None and spec.model_cache is None and spec.resources is None
        assert (
            PDService.model_validate(self.spec(hfTokenSecret={"name": "hf"})).spec.hf_token_secret.key
            == "token"
        )

    @pytest.mark.parametrize(
        "cache",
        [{}, {"hostPath": "/a", "claimName": "b"}, {"hostPath": "relative/dir"}, {"claimName": "Bad_Name"}],
    )
    def test_model_cache_needs_exactly_one_valid_source(self, cache: dict[str, str]) -> None:
        with pytest.raises(ValidationError):
            PDService.model_validate(self.spec(modelCache=cache))

    @pytest.mark.parametrize(
        "bad", [{"cpu": "lots"}, {"memory": "-1Gi"}, {"cpu": -1}, {"kvBufferDevice": "xpu"}]
    )
    def test_bad_values_refused(self, bad: dict[str, Any]) -> None:
        fields = bad if "kvBufferDevice" in bad else {"resources": bad}
        with pytest.raises(ValidationError):
            PDService.model_validate(self.spec(**fields))

    def test_crd_schema(self) -> None:
        crd = yaml.safe_load((ROOT / "crds" / "gearshift.io_pdservices.yaml").read_text())
        props = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        ea = props["engineArgs"]
        assert ea["maxItems"] == 64 and ea["items"]["maxLength"] == 256
        assert _OWNED_RE in ea["items"]["x-kubernetes-validations"][0]["rule"]
        assert (
            props["kvBufferDevice"]["enum"] == ["cuda", "cpu"]
            and props["kvBufferDevice"]["default"] == "cuda"
        )
        assert (
            props["modelCache"]["x-kubernetes-validations"][0]["rule"]
            == "has(self.hostPath) != has(self.claimName)"
        )
        assert props["hfTokenSecret"]["properties"]["key"]["default"] == "token"
        assert props["resources"]["properties"]["cpu"]["x-kubernetes-int-or-string"] is True


class TestServicesAndRouter:
    def test_gear_headless_service_publishes_not_ready_pods(self) -> None:
        svc = build_gear_headless_service("s", "ns", "prefill", "balanced")
        assert svc["metadata"]["name"] == "s-prefill-balanced"
        assert svc["spec"]["clusterIP"] == "None"
        # the head is Ready only after its headless ranks reached --master-addr through this Service's DNS
        assert svc["spec"]["publishNotReadyAddresses"] is True
        assert svc["spec"]["selector"] == names.engine_labels("s", "prefill", "balanced")  # every stage

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
        from gearshift.router.settings import add_arguments

        dep = build_router_deployment("llama3-8b", "ns1", pds.spec)
        c = dep["spec"]["template"]["spec"]["containers"][0]
        p = argparse.ArgumentParser(exit_on_error=False)
        add_arguments(p)
        a = p.parse_args(c["args"])  # the real router's flags
        assert a.service == "llama3-8b" and a.policy == "pd-score" and a.namespace == "ns1"
        assert json.loads(a.weights)["decode"]["itl"] == pytest.approx(0.35)
        assert a.target_itl_ms == 50
        assert a.kv_lease_s == pds.spec.kv_lease_s == 120  # the default lease bounds the KV hand-off
        leased = pds.spec.model_copy(update={"kv_lease_s": 45})
        c = build_router_deployment("llama3-8b", "ns1", leased)["spec"]["template"]["spec"]["containers"][0]
        assert p.parse_args(c["args"]).kv_lease_s == 45
        assert dep["spec"]["template"]["metadata"]["labels"][names.LABEL_SANDBOX_RUN] == "true"
        assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "llama3-8b-router"

    def test_router_pods_are_scraped_on_the_router_port(self, pds: PDService) -> None:
        from gearshift.k8s.services import ROUTER_PORT

        tmpl = build_router_deployment("llama3-8b", "ns1", pds.spec)["spec"]["template"]
        assert tmpl["metadata"]["annotations"] == {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(ROUTER_PORT),
            "prometheus.io/path": "/metrics",
        }
        (port,) = tmpl["spec"]["containers"][0]["ports"]
        assert port["containerPort"] == ROUTER_PORT

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
