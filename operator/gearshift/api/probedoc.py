"""The probe's output: the versioned JSON schema, its validation, and its mapping onto GPUProfile.status.

A data contract between two images: the worker image's probe (:mod:`gearshift.probe`) writes these
documents and the operator's profiling (:mod:`gearshift.profiling`) reads them, so it lives here, below
both, and neither imports the other.

A device probe prints one document (``probe: device``)::

    {"schemaVersion": 1, "probe": "device", "kind": "cuda" | "cpu" | "simulated",
     "backend": "torch" | "numpy" | "datasheet", "node": "gpu-h100-0", "gpuModel": "H100-80GB",
     "gpuProduct": "NVIDIA H100 80GB HBM3", "gpuCount": 1, "generation": "hopper", "dtype": "bfloat16",
     "startedAt": "2025-01-31T18:00:00Z", "durationS": 41.2,
     "shape": {"model": "llama-3-8b", "seqLen": 512, "batches": [1, 4, 16], ...},
     "summary": {"memoryGiB", "memoryFreeGiB", "matmulTflops", "hbmGBps", "d2dGBps", "h2dGBps",
                 "attentionMs", "ffnMs", "opTimings": [{"microBatch", "attentionMs", "ffnMs"}],
                 "maxMicroBatch", "intraNodeGBps"},
     "devices": [ per-GPU detail: every timing with median, min, max, IQR, repetitions ]}

``summary`` is what the operator uses; per-card figures there are the *slowest* card's (the weakest
card bounds a pipeline stage spread over the node's cards). ``devices`` is detail for people: the
termination log gets the document without it (Kubernetes keeps at most 4096 bytes of a termination
message), stdout gets all of it. A failed probe prints ``{"schemaVersion": 1, "probe": "device",
"error": "..."}``.

A link probe client prints ``{"schemaVersion": 1, "probe": "link", "kind": "tcp", "node", "peer",
"bandwidthGBps", "bandwidthGbps", "latencyUs", "rttUs", ...}`` (see :mod:`gearshift.probe.link`).

:func:`validate_probe_output` refuses anything else, so the operator never labels a node from bad data.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from gearshift.api.common import LABEL_VALUE_PATTERN, format_validation_error
from gearshift.facts.fleet import tp_efficiency
from gearshift.facts.gpus import GPU_SPECS, REFERENCE_MODEL
from gearshift.facts.rfc3339 import from_rfc3339

#: The schema version this module writes and reads.
SCHEMA_VERSION = 1
SUPPORTED_SCHEMA_VERSIONS = frozenset({1})
#: Kubernetes truncates a container's termination message beyond this many bytes.
TERMINATION_MESSAGE_MAX_BYTES = 4096

ProbeKind = Literal["cuda", "cpu", "simulated"]
#: ``GPUProfile.status.probe.device`` per probe kind (the API's enum spells the sandbox ``sim``).
STATUS_DEVICE: dict[str, str] = {"cuda": "cuda", "cpu": "cpu", "simulated": "sim"}


class ProbeOutputError(ValueError):
    """Probe output that must not be used: unparsable, a reported failure, or a field out of range."""


class _Doc(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="allow", allow_inf_nan=False, strict=False
    )


class OpTimingOut(_Doc):
    micro_batch: int = Field(ge=1, le=65536)
    attention_ms: float = Field(gt=0, le=1e6)
    ffn_ms: float = Field(gt=0, le=1e6)


class ProbeSummary(_Doc):
    """The node's figures the operator uses; bounds are generous physical limits, not expectations."""

    memory_gib: float = Field(alias="memoryGiB", gt=0, le=4096)
    memory_free_gib: float = Field(alias="memoryFreeGiB", ge=0, le=4096)
    matmul_tflops: float = Field(gt=0, le=100000)
    hbm_gbps: float = Field(alias="hbmGBps", gt=0, le=100000)
    d2d_gbps: float | None = Field(default=None, alias="d2dGBps", gt=0, le=100000)
    h2d_gbps: float | None = Field(default=None, alias="h2dGBps", gt=0, le=100000)
    attention_ms: float = Field(gt=0, le=1e6)
    ffn_ms: float = Field(gt=0, le=1e6)
    op_timings: list[OpTimingOut] = Field(default_factory=list, max_length=32)
    max_micro_batch: int = Field(ge=1, le=65536)
    intra_node_gbps: float | None = Field(default=None, alias="intraNodeGBps", gt=0, le=100000)


class DeviceProbeDoc(_Doc):
    """A successful device probe's document (``devices`` detail is allowed but not checked)."""

    schema_version: int
    probe: Literal["device"]
    kind: ProbeKind
    backend: Literal["torch", "numpy", "datasheet"]
    node: str | None = Field(default=None, max_length=253)
    gpu_model: str = Field(min_length=1, max_length=63, pattern=LABEL_VALUE_PATTERN)
    gpu_product: str | None = Field(default=None, max_length=128)
    gpu_count: int = Field(ge=1, le=64)
    generation: str = Field(min_length=1, max_length=32)
    started_at: str = Field(min_length=1, max_length=64)
    duration_s: float = Field(ge=0, le=86400)
    summary: ProbeSummary


class LinkProbeDoc(_Doc):
    """A link probe client's document."""

    schema_version: int
    probe: Literal["link"]
    kind: Literal["tcp"]
    node: str | None = Field(default=None, max_length=253)
    peer: str = Field(min_length=1, max_length=253)
    bandwidth_gbps_bytes: float = Field(alias="bandwidthGBps", gt=0, le=100000)
    bandwidth_gbps: float = Field(gt=0, le=800000)
    latency_us: float = Field(gt=0, le=1e7)


def _parse(doc: Any) -> dict[str, Any]:
    if isinstance(doc, bytes | str):
        text = doc.decode(errors="replace") if isinstance(doc, bytes) else doc
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            head = text[:80].replace("\n", " ")
            raise ProbeOutputError(
                f"probe output is not JSON ({exc.msg} at char {exc.pos}): {head!r}"
            ) from None
    if not isinstance(doc, dict):
        raise ProbeOutputError(f"probe output must be a JSON object, got {type(doc).__name__}")
    version = doc.get("schemaVersion")
    if version not in SUPPORTED_SCHEMA_VERSIONS:
        raise ProbeOutputError(
            f"schemaVersion {version!r} is not supported (supported: {sorted(SUPPORTED_SCHEMA_VERSIONS)}); "
            "run a probe image matching this operator"
        )
    if doc.get("error"):
        raise ProbeOutputError(f"the probe reported a failure: {doc['error']}")
    return doc


def validate_probe_output(doc: Any, *, expected_kinds: Collection[str] | None = None) -> dict[str, Any]:
    """Check a device probe's output (a mapping, or the JSON text/bytes of a termination message).

    ``expected_kinds`` (e.g. ``{"cuda"}`` on a real cluster) refuses documents of other kinds, so a CPU
    fallback run never becomes a GPU node's profile.

    Returns the parsed document (a dict) when valid.

    Raises:
        ProbeOutputError: not JSON, not an object, an unsupported ``schemaVersion``, a reported
            ``error``, a missing, mistyped, non-finite or out-of-range field (one line per field,
            camelCase path), an inconsistent document, or a kind not in ``expected_kinds``.
    """
    data = _parse(doc)
    if data.get("probe") != "device":
        raise ProbeOutputError(f"probe: expected 'device', got {data.get('probe')!r}")
    try:
        parsed = DeviceProbeDoc.model_validate(data)
    except ValidationError as exc:
        raise ProbeOutputError("invalid probe output:\n" + format_validation_error(exc)) from None
    if expected_kinds is not None and parsed.kind not in expected_kinds:
        raise ProbeOutputError(
            f"kind: the probe ran on {parsed.kind!r}, expected one of {sorted(expected_kinds)}; "
            "check the probe Job's GPU request and image"
        )
    s = parsed.summary
    if s.memory_free_gib > s.memory_gib * 1.001:
        raise ProbeOutputError(
            f"summary.memoryFreeGiB ({s.memory_free_gib}) exceeds summary.memoryGiB ({s.memory_gib})"
        )
    if s.op_timings and 1 not in {t.micro_batch for t in s.op_timings}:
        raise ProbeOutputError("summary.opTimings must include microBatch 1 (attentionMs/ffnMs are at 1)")
    return data


def validate_link_output(doc: Any) -> dict[str, Any]:
    """Check a link probe client's output; returns the parsed dict.

    Raises:
        ProbeOutputError: as :func:`validate_probe_output`, or ``bandwidthGbps`` ≠ 8 × ``bandwidthGBps``.
    """
    data = _parse(doc)
    if data.get("probe") != "link":
        raise ProbeOutputError(f"probe: expected 'link', got {data.get('probe')!r}")
    try:
        parsed = LinkProbeDoc.model_validate(data)
    except ValidationError as exc:
        raise ProbeOutputError("invalid link probe output:\n" + format_validation_error(exc)) from None
    if not math.isclose(parsed.bandwidth_gbps, 8 * parsed.bandwidth_gbps_bytes, rel_tol=1e-3):
        raise ProbeOutputError(
            f"bandwidthGbps ({parsed.bandwidth_gbps}) must be 8 × "
            f"bandwidthGBps ({parsed.bandwidth_gbps_bytes})"
        )
    return data


#: Share of its datasheet bf16 dense peak that a measured 8192³ matmul reaches on a GPU: 0.766, the median
#: of three probes of an H200 on the workplace's device machine (758, 778 and 736 TFLOP/s against 989;
#: bench/results/device.json holds the last run; the device README's KINDS.md saw 769-798 on the same card).
MEASURED_MATMUL_EFFICIENCY = 0.766


def compute_score_from_tflops(
    tflops_per_gpu: float, gpu_count: int, reference_tflops: float | None = None, *, measured: bool = False
) -> float:
    """A node's compute score: ``tflops × count × (0.85 if count > 1) / reference``.

    The reference is the datasheet bf16 dense figure of ``gearshift.facts.gpus.REFERENCE_MODEL`` (H100 SXM,
    989 TFLOPS) unless given. A ``measured`` figure (a probe's matmul on a real GPU) reaches only a share of
    its datasheet peak, so it is compared with the reference's *achievable* rate, the datasheet figure ×
    :data:`MEASURED_MATMUL_EFFICIENCY`: a probed H200 then scores 0.99 beside the datasheet prior of 1.0
    (``gearshift.facts.gpus.compute_score``). Compared with the bare datasheet figure it scored 0.74, so a
    fleet mixing probed and datasheet nodes planned an H200 stage 1.34 × slower than an H100's. The 0.85
    tensor-parallel factor is the PD guide's (docs/sources.md#gpu-prior), as in ``gearshift.facts.fleet``.
    """
    ref = reference_tflops if reference_tflops is not None else GPU_SPECS[REFERENCE_MODEL].bf16_tflops
    if measured:
        ref *= MEASURED_MATMUL_EFFICIENCY
    return tflops_per_gpu * gpu_count * tp_efficiency(gpu_count) / ref


def interconnect_from_links(node: str, link_docs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """``status.interconnect`` entries of ``node`` from link probe documents (either end may be ``node``).

    Each validated link ``a ↔ b`` gives ``a`` the peer ``b`` and vice versa (links are measured once per
    pair and taken as symmetric). When a peer was measured twice the later document wins.

    Raises:
        ProbeOutputError: a document fails :func:`validate_link_output`.
    """
    by_peer: dict[str, dict[str, Any]] = {}
    for raw in link_docs:
        doc = validate_link_output(raw)
        a, b = doc.get("node"), doc["peer"]
        peer = b if a == node else a if b == node else None
        if peer is None or peer == node:
            continue
        by_peer[peer] = {
            "peer": peer,
            "bandwidthGbps": round(float(doc["bandwidthGbps"]), 3),
            "latencyUs": round(float(doc["latencyUs"]), 3),
        }
    return [by_peer[p] for p in sorted(by_peer)]


def profile_status_from_probe(
    doc: Any,
    links: Iterable[dict[str, Any]] = (),
    *,
    reference_tflops: float | None = None,
) -> dict[str, Any]:
    """Map a device probe document (and link documents) onto ``GPUProfile.status`` fields (camelCase).

    Returns ``{gpuModel, gpuProduct, gpuCount, memoryGiB, freeMemoryGiB, computeScore, matmulTflops,
    hbmGBps, d2dGBps, h2dGBps, attentionMs, ffnMs, opTimings, maxMicroBatch, interconnect, generation,
    source, probeTime, probe: {device, schemaVersion, durationS}}``; units as in the document (GiB,
    TFLOPS, GB/s, ms, Gb/s, µs). ``source`` is ``datasheet`` for the sandbox's simulated probe and
    ``probe`` otherwise; ``probeTime`` is the document's ``startedAt`` plus its duration. ``phase``,
    ``computeClass`` and conditions are the operator's to set (the class needs the whole fleet).

    Raises:
        ProbeOutputError: the document (or a link document) fails validation.
    """
    from datetime import timedelta

    data = validate_probe_output(doc)
    s = data["summary"]
    node = data.get("node")
    ended = from_rfc3339(str(data["startedAt"])) + timedelta(seconds=float(data["durationS"]))
    score = compute_score_from_tflops(
        s["matmulTflops"], data["gpuCount"], reference_tflops, measured=data.get("kind") == "cuda"
    )
    status: dict[str, Any] = {
        "gpuModel": data["gpuModel"],
        "gpuProduct": data.get("gpuProduct"),
        "gpuCount": data["gpuCount"],
        "memoryGiB": s["memoryGiB"],
        "freeMemoryGiB": s["memoryFreeGiB"],
        # Six significant digits, not decimals: a CPU run scores ~1e-4.
        "computeScore": float(f"{score:.6g}"),
        "matmulTflops": s["matmulTflops"],
        "hbmGBps": s["hbmGBps"],
        "d2dGBps": s.get("intraNodeGBps") or s.get("d2dGBps"),
        "h2dGBps": s.get("h2dGBps"),
        "attentionMs": s["attentionMs"],
        "ffnMs": s["ffnMs"],
        "opTimings": [
            {"microBatch": t["microBatch"], "attentionMs": t["attentionMs"], "ffnMs": t["ffnMs"]}
            for t in s.get("opTimings", [])
        ],
        "maxMicroBatch": s["maxMicroBatch"],
        "interconnect": interconnect_from_links(node, links) if node else [],
        "generation": data["generation"],
        "source": "datasheet" if data["kind"] == "simulated" else "probe",
        "probeTime": ended.isoformat().replace("+00:00", "Z"),
        "probe": {
            "device": STATUS_DEVICE[data["kind"]],
            "schemaVersion": data["schemaVersion"],
            "durationS": data["durationS"],
        },
    }
    return {k: v for k, v in status.items() if v is not None}


def compact(doc: dict[str, Any]) -> dict[str, Any]:
    """The document without per-device detail, for the termination log (≤ 4096 bytes).

    Raises:
        ProbeOutputError: even the compact form exceeds :data:`TERMINATION_MESSAGE_MAX_BYTES`.
    """
    out = {k: v for k, v in doc.items() if k not in ("devices", "peerCopies", "simulated")}
    size = len(json.dumps(out, separators=(",", ":")).encode())
    if size > TERMINATION_MESSAGE_MAX_BYTES:
        raise ProbeOutputError(
            f"compact probe output is {size} bytes, over Kubernetes' {TERMINATION_MESSAGE_MAX_BYTES}-byte "
            "termination message limit; use fewer --batches"
        )
    return out
