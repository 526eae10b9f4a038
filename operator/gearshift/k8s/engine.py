"""The engine container of one stage pod: the real vLLM command line, or the simulated engine's.

vLLM (flags as documented in vLLM's CLI reference, ``vllm serve --help``, and its distributed-serving
guide, https://docs.vllm.ai/en/latest/serving/parallelism_scaling.html):

- ``vllm serve MODEL --port 8000 --served-model-name NAME``;
- ``--pipeline-parallel-size K`` with ``--tensor-parallel-size G`` (GPUs per stage pod; vLLM needs the
  same TP size in every stage);
- multi-node (K > 1): ``--distributed-executor-backend mp --nnodes K --node-rank k --master-addr HEAD
  --master-port 29500``; ranks k > 0 run ``--headless`` (no API server, they only hold their layers);
- ``--max-num-seqs`` = the gear's max batch, ``--max-num-batched-tokens`` = micro-batch × 2048
  (gearshift's choice: one 2048-token prompt chunk per sequence of a micro-batch),
  ``--gpu-memory-utilization`` from the GearSet's plan constraints (vLLM's default 0.9);
- PD: ``--kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'`` (vLLM's
  NixlConnector usage guide, https://docs.vllm.ai/en/latest/features/nixl_connector_usage.html);
- env ``VLLM_PP_LAYER_PARTITION`` = comma-separated layer counts per stage (vllm/envs.py, read by
  ``vllm.distributed.utils.get_pp_indices``): vLLM's own way to split layers unequally.

Simulated engine (``gearshift-sim``, docs/ARCHITECTURE.md's pod contract): env ``GEARSHIFT_ROLE``,
``GEARSHIFT_STAGE``, ``GEARSHIFT_MODEL`` (ModelArch JSON), ``GEARSHIFT_SERVED_MODEL_NAME``,
``GEARSHIFT_PIPELINE`` (the gear's stages, micro-batch, max batch, links); stages k > 0 run ``--worker``.

Both get ``GEARSHIFT_LAYERS`` (``start,end``), ``GEARSHIFT_MICRO_BATCH``, ``GEARSHIFT_PEERS`` (DNS names
of the previous and next stage's pod of the same pipeline replica) and ``GEARSHIFT_POD_INDEX`` (the
StatefulSet ordinal from the ``apps.kubernetes.io/pod-index`` label, Kubernetes >= 1.28).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gearshift.api.gearset import Gear
from gearshift.k8s import names
from gearshift.model import ModelArch

ENGINE_PORT = 8000
#: torch.distributed rendezvous port of vLLM's multi-node mp backend on the head pod.
MASTER_PORT = 29500
#: Tokens per sequence of a micro-batch in one scheduler step (``--max-num-batched-tokens`` / micro-batch).
TOKENS_PER_SEQUENCE_STEP = 2048
#: NixlConnector for PD disaggregation; ``kv_both`` lets one config serve prefill and decode pods.
KV_TRANSFER_CONFIG = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
#: The StatefulSet controller's pod label holding the ordinal (PodIndexLabel, GA in Kubernetes 1.32).
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"

DEFAULT_VLLM_IMAGE = "vllm/vllm-openai:v0.11.0"
DEFAULT_SIM_IMAGE = "ghcr.io/gearshift/worker:0.1.0"


class EngineSpecError(ValueError):
    """A gear the chosen engine cannot run; the message names the gear, the field and the fix."""


@dataclass(frozen=True)
class EngineContext:
    """What every stage pod of one role of one PDService shares."""

    service: str
    namespace: str
    role: str
    engine: str
    """``vllm`` or ``sim``."""
    model: ModelArch
    served_model_name: str
    image: str
    pipeline_replicas: int = 1
    """GearSet ``spec.replicas``: copies of the whole pipeline."""
    drain_s: float = 120.0
    """Longest drain of in-flight requests (GearSet ``policy.drainTimeoutS``), s."""
    memory_utilization: float = 0.9
    """vLLM ``--gpu-memory-utilization``."""
    links: Sequence[dict[str, float]] | None = field(default=None)
    """Per adjacent stage pair ``{"gbps", "latencyUs"}`` for the simulated pipeline, when known."""


def pod_dns(ctx: EngineContext, gear: str, stage: int, index: str) -> str:
    """DNS name of pod ``index`` of a stage StatefulSet through the gear's headless Service."""
    sts = names.stage_statefulset_name(ctx.service, ctx.role, gear, stage)
    headless = names.gear_headless_service_name(ctx.service, ctx.role, gear)
    return f"{sts}-{index}.{headless}.{ctx.namespace}.svc"


def layer_partition(gear: Gear) -> str:
    """``VLLM_PP_LAYER_PARTITION``: layer counts per stage, comma-separated (e.g. ``12,12,4,4``)."""
    return ",".join(str(s.num_layers) for s in gear.stages)


def sim_pipeline(gear: Gear, links: Sequence[dict[str, float]] | None = None) -> dict[str, Any]:
    """The ``GEARSHIFT_PIPELINE`` document of a gear (docs/ARCHITECTURE.md).

    A stage without ``gpuModel`` is timed as the reference card (H100-80GB).

    Raises:
        EngineSpecError: ``links`` has the wrong length (one per adjacent stage pair).
    """
    stages = []
    for s in gear.stages:
        entry: dict[str, Any] = {
            "layers": [s.start, s.end],
            "gpu": s.gpu_model or "H100-80GB",
            "gpus": s.gpus,
        }
        if s.nodes:
            entry["node"] = s.nodes[0]
        stages.append(entry)
    doc: dict[str, Any] = {"stages": stages, "microBatch": gear.micro_batch, "maxBatch": gear.max_batch}
    if links is not None:
        if len(links) != len(gear.stages) - 1:
            raise EngineSpecError(
                f"gear {gear.name!r}: {len(links)} links given for {len(gear.stages)} stages; give one per "
                "adjacent stage pair"
            )
        doc["links"] = [dict(x) for x in links]
    return doc


def _common_env(ctx: EngineContext, gear: Gear, k: int) -> list[dict[str, Any]]:
    stage = gear.stages[k]
    peers = []
    if k > 0:
        peers.append(pod_dns(ctx, gear.name, k - 1, "$(GEARSHIFT_POD_INDEX)"))
    if k + 1 < len(gear.stages):
        peers.append(pod_dns(ctx, gear.name, k + 1, "$(GEARSHIFT_POD_INDEX)"))
    return [
        {
            "name": "GEARSHIFT_POD_INDEX",
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{POD_INDEX_LABEL}']"}},
        },
        {"name": "GEARSHIFT_GEAR", "value": gear.name},
        {"name": "GEARSHIFT_ROLE", "value": ctx.role},
        {"name": "GEARSHIFT_STAGE", "value": str(k)},
        {"name": "GEARSHIFT_LAYERS", "value": f"{stage.start},{stage.end}"},
        {"name": "GEARSHIFT_MICRO_BATCH", "value": str(gear.micro_batch)},
        {"name": "GEARSHIFT_PEERS", "value": ",".join(peers)},
    ]


def _http_probe(path: str, period: int, failures: int, initial: int = 0) -> dict[str, Any]:
    probe: dict[str, Any] = {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 2,
    }
    if initial:
        probe["initialDelaySeconds"] = initial
    return probe


def vllm_args(ctx: EngineContext, gear: Gear, k: int) -> list[str]:
    """The ``vllm serve`` arguments of stage ``k`` (module docstring lists each flag's source).

    Raises:
        EngineSpecError: stages ask for different GPU counts (vLLM runs one TP size in all stages).
    """
    tp = {s.gpus for s in gear.stages}
    if len(tp) != 1:
        raise EngineSpecError(
            f"gear {gear.name!r}: stages ask for {sorted(tp)} GPUs; vLLM needs the same "
            "--tensor-parallel-size in every stage, so give every stage the same gpus"
        )
    n = len(gear.stages)
    args = [
        "serve",
        ctx.model.name,
        "--host",
        "0.0.0.0",
        "--port",
        str(ENGINE_PORT),
        "--served-model-name",
        ctx.served_model_name,
        "--tensor-parallel-size",
        str(tp.pop()),
        "--pipeline-parallel-size",
        str(n),
        "--max-num-seqs",
        str(gear.max_batch),
        "--max-num-batched-tokens",
        str(gear.micro_batch * TOKENS_PER_SEQUENCE_STEP),
        "--gpu-memory-utilization",
        f"{ctx.memory_utilization:g}",
        "--kv-transfer-config",
        json.dumps(KV_TRANSFER_CONFIG, separators=(",", ":")),
    ]
    if n > 1:
        args += [
            "--distributed-executor-backend",
            "mp",
            "--nnodes",
            str(n),
            "--node-rank",
            str(k),
            "--master-addr",
            "$(GEARSHIFT_MASTER_ADDR)",
            "--master-port",
            str(MASTER_PORT),
        ]
        if k > 0:
            args.append("--headless")
    return args


def vllm_container(ctx: EngineContext, gear: Gear, k: int, resources: dict[str, Any]) -> dict[str, Any]:
    """The vLLM container of stage ``k``.

    Headless ranks (k > 0) serve no HTTP, so they get no probes; the head gets a startup probe that
    allows 20 minutes of weight loading, then readiness and liveness on ``/health``.

    Raises:
        EngineSpecError: see :func:`vllm_args`.
    """
    env = [
        *_common_env(ctx, gear, k),
        {"name": "VLLM_PP_LAYER_PARTITION", "value": layer_partition(gear)},
        {"name": "GEARSHIFT_MASTER_ADDR", "value": pod_dns(ctx, gear.name, 0, "$(GEARSHIFT_POD_INDEX)")},
    ]
    c: dict[str, Any] = {
        "name": "engine",
        "image": ctx.image,
        "command": ["vllm"],
        "args": vllm_args(ctx, gear, k),
        "env": env,
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        "resources": resources,
    }
    if k == 0:
        c["startupProbe"] = _http_probe("/health", 10, 120)
        c["readinessProbe"] = _http_probe("/health", 5, 3)
        c["livenessProbe"] = _http_probe("/health", 10, 6)
    return c


def sim_container(ctx: EngineContext, gear: Gear, k: int, resources: dict[str, Any]) -> dict[str, Any]:
    """The ``gearshift-sim`` container of stage ``k`` (head for k = 0, ``--worker`` after).

    Raises:
        EngineSpecError: see :func:`sim_pipeline`.
    """
    env = [
        *_common_env(ctx, gear, k),
        {"name": "GEARSHIFT_PORT", "value": str(ENGINE_PORT)},
        {"name": "GEARSHIFT_MODEL", "value": json.dumps(ctx.model.to_dict(), sort_keys=True)},
        {"name": "GEARSHIFT_SERVED_MODEL_NAME", "value": ctx.served_model_name},
        {
            "name": "GEARSHIFT_PIPELINE",
            "value": json.dumps(sim_pipeline(gear, ctx.links), sort_keys=True, separators=(",", ":")),
        },
    ]
    return {
        "name": "engine",
        "image": ctx.image,
        "command": ["gearshift-sim"],
        "args": ["--worker"] if k > 0 else [],
        "env": env,
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        "resources": resources,
        "readinessProbe": _http_probe("/health", 2, 3),
        "livenessProbe": _http_probe("/health", 10, 6, initial=5),
    }
