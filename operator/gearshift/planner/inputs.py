"""From the cluster's GPUProfiles and Nodes to the planner's input, and from the planner's gears to the API's.

- :func:`role_candidates`: the GPU nodes one role may plan on (GearSet ``spec.plan.constraints``: node
  selector, GPU models, excluded nodes), and what is missing (nodes without a usable profile).
- :func:`resource_profile`: those nodes' effective GPUProfiles (override over measurement) as FlexPipe's
  (docs/sources.md#resource-profile) resource profile, the document :func:`gearshift.planner.parse_profile`
  reads.
- :func:`inputs_hash`: fingerprint of everything a plan depends on (``status.profilesHash``); a different
  hash means re-plan.
- :func:`api_gear`: a planner :class:`gearshift.planner.Gear` as an API
  :class:`gearshift.api.gearset.Gear` for ``status.plannedGears``.
- :func:`engine_stage_limit`: the most pipeline stages an engine runs for a role (the planner's
  ``max_stages``), and :func:`stage_limit_problems`: explicit gears that break it, with the fix.

Pure: takes plain dicts (the API server's JSON) and pydantic models; no I/O.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from gearshift import planner
from gearshift.api.gearset import Gear as ApiGear
from gearshift.api.gearset_plan import PlanConstraints
from gearshift.api.gpuprofile import GPUProfile, GPUProfileStatus
from gearshift.facts.fleet import max_micro_batch, tp_efficiency
from gearshift.facts.gpus import UnknownGPUError, compute_score, gpu_spec
from gearshift.facts.model import GIB, ModelArch
from gearshift.k8s.names import GPU_RESOURCE, NODE_GPU_MODEL

#: Sandbox/datasheet node annotations with the NIC figures (gearshift.dev.sandbox.nodes), used for links
#: between two nodes when neither profile lists the other.
ANNOTATION_NIC_GBPS = "gearshift.io/nic-gbps"
ANNOTATION_LATENCY_US = "gearshift.io/latency-us"
#: GPUProfile phases whose numbers the planner may use.
USABLE_PHASES = ("Ready",)


@dataclass(frozen=True)
class Candidates:
    """The nodes a role may plan on, and why others were left out."""

    nodes: dict[str, str] = field(default_factory=dict)
    """``{node name: GPU model}`` of usable nodes."""
    missing_profile: tuple[str, ...] = ()
    """GPU nodes that match the constraints but have no usable GPUProfile (absent, not Ready, bad)."""


def node_ready(node: Mapping[str, Any]) -> bool:
    """The node is schedulable and its ``Ready`` condition is True."""
    if (node.get("spec") or {}).get("unschedulable"):
        return False
    for c in (node.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready":
            return c.get("status") == "True"
    return False


def node_gpus(node: Mapping[str, Any]) -> int:
    """Allocatable ``nvidia.com/gpu`` of a node (0 when it has none or the value is not an integer)."""
    raw = ((node.get("status") or {}).get("allocatable") or {}).get(GPU_RESOURCE, "0")
    try:
        return int(str(raw))
    except ValueError:
        return 0


#: Effective statuses kept by ``(uid, resourceVersion)``: the GPU nodes of a large fleet, twice.
USABLE_MEMO_SIZE = 4096


class _Stored:
    """A GPUProfile body as the API server stored it, equal to another by ``(uid, resourceVersion)``
    (the API server gives every stored version of an object its own resourceVersion)."""

    __slots__ = ("body", "key")

    def __init__(self, key: tuple[str, str], body: Mapping[str, Any]) -> None:
        self.key, self.body = key, body

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Stored) and other.key == self.key


@functools.lru_cache(maxsize=USABLE_MEMO_SIZE)
def _usable_stored(stored: _Stored) -> GPUProfileStatus | None:
    try:
        return _usable(stored.body)
    finally:
        # The memo keeps this key: it must not keep the body (a whole fleet's bodies per re-read).
        stored.body = {}


def usable_profile(body: Mapping[str, Any]) -> GPUProfileStatus | None:
    """The effective status of a GPUProfile body, or None when it cannot be planned on. The returned model
    may be shared with other callers: read it, do not change it.

    Usable: parses, phase ``Ready`` or numbers pinned by ``spec.override`` (source ``override``), and has a
    known GPU model and memory.

    A body with a uid and a resourceVersion (as read from the API server) is worked out once per stored
    version: a reconcile reads the profile of every node a stage's selector matches, and validating and
    copying each (``GPUProfile.effective``) every time was a quarter of the operator's CPU with 110
    services on 1,008 nodes (py-spy over bench/fleet_operator.py).
    """
    meta = body.get("metadata") or {}
    uid, rv = meta.get("uid"), meta.get("resourceVersion")
    if isinstance(uid, str) and isinstance(rv, str) and uid and rv:
        return _usable_stored(_Stored((uid, rv), body))
    return _usable(body)


def _usable(body: Mapping[str, Any]) -> GPUProfileStatus | None:
    try:
        prof = GPUProfile.model_validate(dict(body))
    except ValidationError:
        return None
    eff = prof.effective()
    if eff.phase not in USABLE_PHASES and eff.source != "override":
        return None
    if not eff.gpu_model or not eff.memory_gib:
        return None
    try:
        gpu_spec(eff.gpu_model)
    except UnknownGPUError:
        return None
    return eff


def role_candidates(
    constraints: PlanConstraints | None,
    nodes: Iterable[Mapping[str, Any]],
    profiles: Mapping[str, Mapping[str, Any]],
) -> Candidates:
    """The GPU nodes a role may plan on.

    Args:
        constraints: the GearSet's ``spec.plan.constraints`` (None: no constraints).
        nodes: Node objects (API JSON).
        profiles: GPUProfile bodies by name (= node name).

    A node counts when it is Ready and schedulable, has allocatable GPUs, carries every
    ``constraints.nodeSelector`` label, is not in ``excludeNodes``, and, when ``gpuModels`` is set, its GPU
    model (from the profile, else the ``gearshift.io/gpu-model`` label) is listed. Such a node without a
    usable profile is reported in ``missing_profile``.
    """
    c = constraints or PlanConstraints()
    out: dict[str, str] = {}
    missing: list[str] = []
    for node in nodes:
        meta = node.get("metadata") or {}
        name = str(meta.get("name", ""))
        labels = meta.get("labels") or {}
        if not name or name in c.exclude_nodes or not node_ready(node) or node_gpus(node) < 1:
            continue
        if any(labels.get(k) != v for k, v in c.node_selector.items()):
            continue
        eff = usable_profile(profiles[name]) if name in profiles else None
        model = eff.gpu_model if eff else _label_model(meta)
        if c.gpu_models and model not in c.gpu_models:
            continue
        if eff is None or eff.gpu_model is None:
            missing.append(name)
            continue
        out[name] = eff.gpu_model
    return Candidates(dict(sorted(out.items())), tuple(sorted(missing)))


def _label_model(meta: Mapping[str, Any]) -> str | None:
    """GPU model of a node without a usable profile: gearshift's label or annotation, else GFD's product."""
    labels = meta.get("labels") or {}
    raw = labels.get(NODE_GPU_MODEL) or (meta.get("annotations") or {}).get(NODE_GPU_MODEL)
    raw = raw or labels.get("nvidia.com/gpu.product")
    if not raw:
        return None
    try:
        return gpu_spec(str(raw)).model
    except UnknownGPUError:
        return str(raw)


def _link_fallback(node: Mapping[str, Any] | None) -> tuple[float, float] | None:
    ann = ((node or {}).get("metadata") or {}).get("annotations") or {}
    try:
        return float(ann[ANNOTATION_NIC_GBPS]), float(ann.get(ANNOTATION_LATENCY_US, 10.0))
    except (KeyError, ValueError):
        return None


def resource_profile(
    node_names: Iterable[str],
    profiles: Mapping[str, Mapping[str, Any]],
    nodes: Mapping[str, Mapping[str, Any]] | None = None,
    memory_utilization: float = 0.9,
) -> dict[str, Any]:
    """FlexPipe's resource profile of ``node_names`` from their effective GPUProfiles
    (docs/sources.md#resource-profile).

    Per node: ``memory_gb`` = memory per GPU (GiB) × GPU count × ``memory_utilization`` (the share vLLM
    may use, ``--gpu-memory-utilization``); ``compute_score`` = the profile's (node vs one H100 SXM), else
    the datasheet's score × count × 0.85 for more than one card (gearshift.facts.fleet's TP efficiency, seed
    000); ``max_batch_microbatch`` = the profile's, else gearshift.facts.fleet's datasheet guess;
    interconnect = the profile's measured links to the other listed nodes. Where neither end of a pair
    measured the link, the slower of the two nodes' NIC annotations (``gearshift.io/nic-gbps``,
    ``latency-us``) stands in.

    Raises:
        KeyError: a node without a usable profile (call :func:`role_candidates` first).
    """
    names_ = sorted(set(node_names))
    effs: dict[str, GPUProfileStatus] = {}
    for n in names_:
        eff = usable_profile(profiles[n])
        if eff is None:
            raise KeyError(f"node {n!r} has no usable GPUProfile")
        effs[n] = eff
    measured: set[frozenset[str]] = set()
    out: list[dict[str, Any]] = []
    for n in names_:
        eff = effs[n]
        assert eff.gpu_model is not None and eff.memory_gib is not None
        count = eff.gpu_count or 1
        score = eff.compute_score
        if score is None:
            score = compute_score(eff.gpu_model) * count * tp_efficiency(count)
        inter = {}
        for link in eff.interconnect:
            if link.peer in effs and link.peer != n and link.bandwidth_gbps > 0:
                inter[link.peer] = {"bandwidth_gbps": link.bandwidth_gbps, "latency_us": link.latency_us}
                measured.add(frozenset((n, link.peer)))
        out.append(
            {
                "node_id": n,
                "generation": eff.generation or gpu_spec(eff.gpu_model).generation,
                "gpu_model": eff.gpu_model,
                "memory_gb": round(eff.memory_gib * count * memory_utilization, 6),
                "compute_score": round(score, 6),
                "max_batch_microbatch": eff.max_micro_batch or max_micro_batch(eff.memory_gib),
                "interconnect": inter,
            }
        )
    for entry in out:
        a = entry["node_id"]
        for b in names_:
            if b == a or frozenset((a, b)) in measured or b in entry["interconnect"]:
                continue
            fa = _link_fallback((nodes or {}).get(a))
            fb = _link_fallback((nodes or {}).get(b))
            if fa and fb:
                entry["interconnect"][b] = {
                    "bandwidth_gbps": min(fa[0], fb[0]),
                    "latency_us": max(fa[1], fb[1]),
                }
    return {"nodes": out}


@dataclass(frozen=True)
class StageLimit:
    """The most pipeline stages an engine runs for one role, why, and what to do instead."""

    max_stages: int
    reason: str
    """Why the engine cannot run more (quoted in plan errors and refusals)."""
    fix: str
    """What a user should write instead (quoted in refusals of explicit gears)."""

    @property
    def why(self) -> str:
        """``reason: fix``, the tail of a refusal."""
        return f"{self.reason}: {self.fix}"


#: Decode under vLLM's NixlConnector is one pipeline stage. vLLM 0.32.0,
#: ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py`` (0.32 split the former
#: ``nixl_connector.py`` into the ``nixl/`` package), ``NixlBaseConnectorWorker.__init__`` (lines 774-779):
#: with ``pipeline_parallel_size > 1`` and ``kv_role == "kv_consumer"`` it raises ``NotImplementedError(
#: "NixlPushConnector consumer (decode) does not support pipeline_parallel_size > 1.")`` ("Decode-side PP
#: is unsupported (completions counted per consumer rank)"); a PP > 1 producer instead writes its layer
#: slice "into the matching sub-range of a PP=1 remote's regions" (same file, the region slicing in the
#: handshake: "This worker holds a PP layer-slice; the PP=1 remote registered the full model"). So prefill
#: may be PP > 1 into a decode of PP = 1 only (DESIGN.md, "The real engine (vLLM)": 0.33 likewise).
VLLM_DECODE_STAGE_LIMIT = StageLimit(
    max_stages=1,
    reason="vLLM's NixlConnector serves decode from one pipeline stage only (prefill PP>1 into decode PP=1)",
    fix="give decode one-stage gears and scale with replicas or tensor parallelism",
)


def engine_stage_limit(engine: str, role: str) -> StageLimit | None:
    """The stage limit of ``role`` (``prefill``/``decode``/``both``) under ``engine`` (``vllm``/``sim``), or
    None.

    Only vLLM's decode role has one (:data:`VLLM_DECODE_STAGE_LIMIT`, a limit of the KV connector); vLLM's
    prefill and an aggregated pipeline (``both``: no KV transfer, vLLM's plain multi-node pipeline
    parallelism) run any pipeline depth, and the simulated engine models any pipeline for every role.
    """
    if engine == "vllm" and role == "decode":
        return VLLM_DECODE_STAGE_LIMIT
    return None


def _usable_gib(
    name: str, profiles: Mapping[str, Mapping[str, Any]], memory_utilization: float
) -> float | None:
    eff = usable_profile(profiles[name]) if name in profiles else None
    if eff is None or eff.memory_gib is None:
        return None
    return eff.memory_gib * (eff.gpu_count or 1) * memory_utilization


def stage_limit_problems(
    gears: Sequence[ApiGear],
    limit: StageLimit,
    arch: ModelArch | None = None,
    profiles: Mapping[str, Mapping[str, Any]] | None = None,
    memory_utilization: float = 0.9,
) -> list[str]:
    """One message per gear of ``gears`` with more stages than ``limit`` allows (empty: all fit).

    Each reads ``gear 'x' has N stages; <reason>: <fix>`` (:meth:`gearshift.api.gearset.Gear.
    check_stage_limit`). With ``arch`` and ``profiles``, a gear whose model weights alone (GiB, bytes /
    2^30) exceed the usable memory of every node it names (GPU memory × GPU count × ``memory_utilization``,
    vLLM's ``--gpu-memory-utilization``) also says that no one of those nodes can hold it, so the fix
    needs a node with more or larger GPUs. Pure.
    """
    out = []
    for gear in gears:
        try:
            gear.check_stage_limit(limit.max_stages, limit.why)
        except ValueError as exc:
            msg = str(exc)
            named = sorted({n for st in gear.stages for n in st.nodes})
            sizes = {n: _usable_gib(n, profiles or {}, memory_utilization) for n in named}
            known = {n: v for n, v in sizes.items() if v is not None}
            if arch is not None and known and limit.max_stages == 1:
                weights = arch.total_weight_bytes / GIB
                biggest = max(known, key=lambda n: (known[n], n))
                if weights > known[biggest]:
                    msg += (
                        f"; no node this gear names holds the whole model: its weights alone need "
                        f"{weights:.2f} GiB and the largest, {biggest}, has {known[biggest]:.2f} GiB usable "
                        f"(GPU memory x GPU count x {memory_utilization:g}); name a node with more or larger "
                        "GPUs"
                    )
            out.append(msg)
    return out


def stage_gpus(nodes: Sequence[str], profiles: Mapping[str, Mapping[str, Any]], default: int) -> int:
    """GPUs per pod of a stage on ``nodes``: the least GPU count among their usable GPUProfiles (one pod
    holds a whole node's cards, as the planner plans whole nodes; a node without one counts 1), or
    ``default`` for a stage that names no nodes."""
    counts = []
    for n in nodes:
        eff = usable_profile(profiles[n]) if n in profiles else None
        counts.append(eff.gpu_count if eff and eff.gpu_count else 1)
    return min(counts) if counts else default


def api_gear(
    gear: planner.Gear, intent: str, profile_doc: Mapping[str, Any], profiles: Mapping[str, Mapping[str, Any]]
) -> ApiGear:
    """The planner's ``gear`` as an API Gear named after its ``intent``.

    Each stage keeps its layers and nodes (``replicas`` = its node count), ``gpus`` = the least GPU count
    of its nodes (one pod holds a whole node's cards, as the planner plans whole nodes), ``gpuModel`` =
    its first node's model, predicted time and memory; the gear keeps micro-batch, max batch, QPS range
    and predictions.
    """
    models = {n["node_id"]: n.get("gpu_model") for n in profile_doc.get("nodes", [])}
    stages = []
    for st in gear.stages:
        stages.append(
            {
                "layers": list(st.layers),
                "replicas": len(st.nodes),
                "gpus": stage_gpus(st.nodes, profiles, 1),
                "nodes": list(st.nodes),
                "gpuModel": models.get(st.node),
                "predictedTimeMs": round(st.time_ms, 6),
                "predictedMemoryGiB": round(st.memory_gb, 6),
            }
        )
    lo, hi = gear.qps_range
    doc = {
        "name": intent,
        "intent": intent,
        "stages": stages,
        "microBatch": gear.micro_batch,
        "maxBatch": max(gear.max_batch, gear.micro_batch),
        "qpsRange": [round(lo, 4), round(max(hi, lo), 4)],
        "predicted": {
            "bottleneckMs": round(gear.bottleneck_ms, 6),
            "throughputQps": round(gear.predicted.throughput_rps, 6),
            "p99Ms": round(gear.predicted.p99_ms, 6),
            **(
                {"itlMs": round(gear.predicted.itl_ms, 6)}
                if gear.predicted.itl_ms is not None and math.isfinite(gear.predicted.itl_ms)
                else {}
            ),
            **_mix_fields(gear.predicted.mix),
        },
    }
    return ApiGear.model_validate(doc)


def _mix_fields(mix: planner.MixRates | None) -> dict[str, float]:
    """The API's ``predicted`` fields of a gear's work model (those the role has)."""
    if mix is None:
        return {}
    fields = {
        "promptTokensPerS": (mix.prompt_tokens_per_s, 3),
        "outputTokensPerS": (mix.output_tokens_per_s, 3),
        "ttftMsPerPromptToken": (mix.ttft_ms_per_prompt_token, 6),
    }
    return {k: round(v, d) for k, (v, d) in fields.items() if v is not None}


def initial_gear(gears: Sequence[ApiGear], wanted: str | None) -> str:
    """The gear a role starts in: ``wanted`` (``spec.initialGear``) when it is one of ``gears``, else the
    first whose QPS range includes 0 (it suits an idle service), else the first gear.

    Raises:
        ValueError: ``gears`` is empty.
    """
    if not gears:
        raise ValueError("no gears to choose an initial gear from")
    names = [g.name for g in gears]
    if wanted in names:
        return str(wanted)
    for g in gears:
        if g.qps_range is not None and g.qps_range[0] <= 0 <= g.qps_range[1]:
            return g.name
    return names[0]


def gear_links(gear: ApiGear, profile: planner.Profile) -> list[dict[str, float]] | None:
    """``GEARSHIFT_PIPELINE`` links of a gear whose stages name nodes: the link between the first node of
    stage k and of stage k+1 (``{"gbps", "latencyUs"}``); None when a stage names no node or a link is
    unknown."""
    out = []
    for a, b in zip(gear.stages, gear.stages[1:], strict=False):
        if not a.nodes or not b.nodes:
            return None
        link = profile.link(a.nodes[0], b.nodes[0])
        if link is None:
            return None
        out.append({"gbps": link.bandwidth_gbps, "latencyUs": link.latency_us})
    return out


def datasheet_gpuprofile(node: Mapping[str, Any]) -> dict[str, Any]:
    """A GPUProfile body (spec and status) for a GPU node from datasheet figures alone, ``source: datasheet``.

    For planning before any probe has run (tests, sandboxes without the probe): GPU model from the
    ``gearshift.io/gpu-model`` label or annotation, else ``nvidia.com/gpu.product``; GPU count from
    ``nvidia.com/gpu.count`` (else allocatable ``nvidia.com/gpu``); memory and compute from
    :mod:`gearshift.facts.gpus`.

    Raises:
        ValueError: the node names no GPU model gearshift knows.
    """
    meta = node.get("metadata") or {}
    labels = meta.get("labels") or {}
    ann = meta.get("annotations") or {}
    raw = labels.get(NODE_GPU_MODEL) or ann.get(NODE_GPU_MODEL) or labels.get("nvidia.com/gpu.product", "")
    try:
        spec = gpu_spec(str(raw))
    except UnknownGPUError as exc:
        raise ValueError(f"node {meta.get('name')!r}: {exc.args[0]}") from None
    # Physical cards: GPU feature discovery's count label; allocatable may count time-sliced replicas.
    try:
        count = int(labels["nvidia.com/gpu.count"])
    except (KeyError, ValueError):
        count = max(node_gpus(node), 1)
    score = compute_score(spec.model) * count * tp_efficiency(count)
    name = str(meta.get("name"))
    return {
        "apiVersion": "gearshift.io/v1alpha1",
        "kind": "GPUProfile",
        "metadata": {"name": name},
        "spec": {"nodeName": name},
        "status": {
            "phase": "Ready",
            "source": "datasheet",
            "gpuModel": spec.model,
            "gpuProduct": spec.product,
            "gpuCount": count,
            "memoryGiB": spec.memory_gib,
            "computeScore": round(score, 6),
            "matmulTflops": spec.bf16_tflops,
            "hbmGBps": spec.hbm_gbps,
            "maxMicroBatch": max_micro_batch(spec.memory_gib),
            "generation": spec.generation,
        },
    }
