"""The sandbox's probe: reports the simulated GPU of its node from datasheet figures, and says so.

Sandbox nodes are fake (kwok): no GPU exists, so nothing can be timed. The node carries its GPU's
datasheet figures as ``gearshift.io/*`` annotations (:mod:`gearshift.dev.sandbox.nodes`); the probe Job
passes them in the environment as ``GEARSHIFT_NODE_ANNOTATIONS`` (a JSON object of the node's
annotations; the downward API cannot expose node annotations, so the operator copies them), with
``GEARSHIFT_GPU_COUNT`` (the GPUs the Job requested) and ``GEARSHIFT_NODE_NAME``. Annotations win over
``gearshift.facts.gpus`` when both exist (a fleet file may describe a card differently).

The layer times are a roofline estimate (Williams, Waterman, Patterson, "Roofline", CACM 2009): a block
takes ``max(FLOPs / peak TFLOPS, bytes / HBM GB/s)`` with the FLOP counts of :mod:`gearshift.probe.ops`
and bytes = the block's weights plus its input and output activations. The largest micro-batch uses the
same activation estimate and budget rule as the measured probe. The document's ``kind`` is
``simulated`` and its ``backend`` ``datasheet``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from gearshift.api.probedoc import SCHEMA_VERSION
from gearshift.facts.gpus import gpu_spec
from gearshift.facts.model import ModelArch
from gearshift.k8s.names import ANNOTATION_PREFIX
from gearshift.probe import ops

ENV_ANNOTATIONS = "GEARSHIFT_NODE_ANNOTATIONS"
ENV_GPU_COUNT = "GEARSHIFT_GPU_COUNT"
#: bf16, as the real probe uses on a GPU.
SIM_DTYPE_BYTES = 2


class SimulatedDeviceError(ValueError):
    """The environment does not describe a simulated GPU; names the variable or annotation to set."""


def _number(annotations: Mapping[str, str], key: str, default: float) -> float:
    raw = annotations.get(ANNOTATION_PREFIX + key)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SimulatedDeviceError(
            f"node annotation {ANNOTATION_PREFIX + key}={raw!r} must be a number"
        ) from None
    if not value > 0:
        raise SimulatedDeviceError(f"node annotation {ANNOTATION_PREFIX + key}={raw!r} must be > 0")
    return value


def annotations_from_env(env: Mapping[str, str]) -> dict[str, str]:
    """Parse ``GEARSHIFT_NODE_ANNOTATIONS``.

    Raises:
        SimulatedDeviceError: unset, not JSON, not an object, or without ``gearshift.io/gpu-model``.
    """
    raw = env.get(ENV_ANNOTATIONS)
    if not raw:
        raise SimulatedDeviceError(
            f"{ENV_ANNOTATIONS} is not set: the simulated probe needs the node's annotations as JSON"
        )
    try:
        ann = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise SimulatedDeviceError(f"{ENV_ANNOTATIONS} is not JSON: {exc.msg}") from None
    if not isinstance(ann, dict):
        raise SimulatedDeviceError(f"{ENV_ANNOTATIONS} must be a JSON object of annotations")
    if ANNOTATION_PREFIX + "gpu-model" not in ann:
        raise SimulatedDeviceError(
            f"{ENV_ANNOTATIONS} lacks {ANNOTATION_PREFIX}gpu-model: is this a sandbox GPU node?"
        )
    return {str(k): str(v) for k, v in ann.items()}


def roofline_ms(flops: float, nbytes: float, tflops: float, gbps: float) -> float:
    """``max(flops / (tflops·10¹²), bytes / (GB/s·10⁹))`` in ms (Roofline, CACM 2009)."""
    return max(flops / (tflops * 1e12), nbytes / (gbps * 1e9)) * 1e3


def simulated_probe(
    annotations: Mapping[str, str],
    *,
    arch: ModelArch,
    seq_len: int,
    batches: tuple[int, ...],
    gpu_count: int = 1,
    node: str | None = None,
    memory_fraction: float = 0.1,
    micro_batch_cap: int = 64,
    now: datetime | None = None,
) -> dict[str, Any]:
    """A device probe document for the simulated GPU the annotations describe (see the module docstring).

    Raises:
        SimulatedDeviceError: unknown GPU model, a non-numeric annotation, or ``gpu_count`` < 1.
    """
    if gpu_count < 1:
        raise SimulatedDeviceError(f"{ENV_GPU_COUNT} must be >= 1, got {gpu_count}")
    model = annotations.get(ANNOTATION_PREFIX + "gpu-model", "")
    try:
        spec = gpu_spec(model)
    except KeyError as exc:
        raise SimulatedDeviceError(f"annotation {ANNOTATION_PREFIX}gpu-model: {exc.args[0]}") from None
    tflops = _number(annotations, "bf16-tflops", spec.bf16_tflops)
    hbm = _number(annotations, "hbm-gbps", spec.hbm_gbps)
    mem_gib = _number(annotations, "memory-gib", spec.memory_gib)
    intra = _number(annotations, "intra-node-gbps", spec.intra_node_gbps)
    generation = annotations.get(ANNOTATION_PREFIX + "generation") or spec.generation
    elt = SIM_DTYPE_BYTES
    h = arch.hidden_size
    attn_w = arch.attn_params * elt
    ffn_w = 3 * h * arch.intermediate_size * elt * (arch.experts_per_token if arch.num_experts > 1 else 1)
    timings = []
    for b in batches:
        io = 2 * b * seq_len * h * elt
        scores = 2 * b * arch.num_heads * seq_len * seq_len * elt
        attn_ms = roofline_ms(ops.attention_flops(arch, b, seq_len), attn_w + io + scores, tflops, hbm)
        ffn_ms = roofline_ms(ops.ffn_flops(arch, b, seq_len), ffn_w + io, tflops, hbm)
        timings.append({"microBatch": b, "attentionMs": attn_ms, "ffnMs": ffn_ms})
    budget = memory_fraction * mem_gib * ops.GIB
    best, b = 0, 1
    while b <= micro_batch_cap and ops.layer_activation_elements(arch, b, seq_len) * elt <= budget:
        best, b = b, b * 2
    first = next((t for t in timings if t["microBatch"] == 1), timings[0])
    return {
        "schemaVersion": SCHEMA_VERSION,
        "probe": "device",
        "kind": "simulated",
        "backend": "datasheet",
        "node": node,
        "gpuModel": spec.model,
        "gpuProduct": spec.product,
        "gpuCount": gpu_count,
        "generation": generation,
        "dtype": "bfloat16",
        "startedAt": (now or datetime.now(UTC)).isoformat().replace("+00:00", "Z"),
        "durationS": 0.0,
        "shape": {"model": arch.name, "seqLen": seq_len, "batches": list(batches)},
        "summary": {
            "memoryGiB": mem_gib,
            "memoryFreeGiB": mem_gib,
            "matmulTflops": tflops,
            "hbmGBps": hbm,
            "attentionMs": first["attentionMs"],
            "ffnMs": first["ffnMs"],
            "opTimings": timings,
            "maxMicroBatch": best,
            "intraNodeGBps": intra if gpu_count > 1 else None,
        },
        "simulated": {
            "source": "node annotations and gearshift.facts.gpus datasheets; layer times by roofline",
            "memoryBudgetGiB": budget / ops.GIB,
        },
    }
