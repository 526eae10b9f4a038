"""The GPUProfile kind: the measured capability of one GPU node (cluster-scoped, named after the node).

The probe writes ``status`` in FlexPipe's resource-profile terms (docs/sources.md#resource-profile)
(generation, memory, compute score, max micro-batch, interconnect bandwidth and latency per peer), measured by
running representative operators rather than read from the datasheet. ``spec.override`` lets an admin pin
values: every field set there wins over the measurement (:meth:`GPUProfile.effective`).
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AwareDatetime, ConfigDict, Field, model_validator

from gearshift.api.common import (
    API_VERSION,
    MAX_CONDITIONS,
    MAX_OBJECT_NAME,
    MAX_PEERS,
    ApiVersion,
    Condition,
    Message,
    NodeName,
    SpecModel,
    StatusModel,
)
from gearshift.facts.rfc3339 import from_rfc3339

#: RFC 3339 date-time with a time zone, as the API server's ``format: date-time`` wants it.
RFC3339_PATTERN = (
    r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]{1,6})?(Z|[+-][0-9]{2}:[0-9]{2})$"
)
ProfileSource = Literal["probe", "datasheet", "override"]
#: ``Pending``: no probe yet; ``Probing``: a probe Job runs; ``Ready``: usable numbers;
#: ``Failed``: the last probe failed and no earlier result exists; ``Stale``: the node is gone or changed.
ProfilePhase = Literal["Pending", "Probing", "Ready", "Failed", "Stale"]
ComputeClass = Literal["high", "mid", "low"]
ProbeDevice = Literal["cuda", "cpu", "sim"]

#: CRD rules per model (see :mod:`gearshift.api.gearset` for the convention).
CEL: dict[str, list[dict[str, str]]] = {
    "GPUProfile": [
        {
            "rule": "self.metadata.name == self.spec.nodeName",
            "message": "spec.nodeName must equal metadata.name: a GPUProfile is named after its node",
            "messageExpression": "'spec.nodeName (%s) must equal metadata.name (%s): a GPUProfile is named "
            "after its node'.format([self.spec.nodeName, self.metadata.name])",
        },
    ],
}


def _cel(name: str) -> dict[str, Any]:
    return {"x-kubernetes-validations": CEL[name]}


class InterconnectLink(StatusModel):
    """Measured link from this node to one peer node (FlexPipe's ``interconnect`` entry,
    docs/sources.md#resource-profile)."""

    model_config = ConfigDict(frozen=True)

    peer: str = Field(max_length=MAX_OBJECT_NAME, description="Peer node name.")
    bandwidth_gbps: float = Field(ge=0, description="Measured bandwidth to the peer, Gb/s (bits).")
    latency_us: float = Field(ge=0, description="Measured one-way latency to the peer, µs.")


class OpTiming(StatusModel):
    """Layer-block times at one micro-batch size."""

    model_config = ConfigDict(frozen=True)

    micro_batch: int = Field(ge=1, description="Sequences per batch the times were measured at.")
    attention_ms: float = Field(ge=0, description="Median time of one attention block, ms.")
    ffn_ms: float = Field(ge=0, description="Median time of one FFN block, ms.")


class ProfileOverride(SpecModel):
    """Values an admin pins; each field set here wins over the probe's measurement."""

    gpu_model: str | None = Field(
        default=None, min_length=1, max_length=64, description="GPU model (a gearshift.facts.gpus name)."
    )
    gpu_count: int | None = Field(default=None, ge=0, le=64, description="GPUs on the node.")
    memory_gib: float | None = Field(
        default=None, alias="memoryGiB", gt=0, le=4096, description="Memory per GPU, GiB."
    )
    compute_score: float | None = Field(
        default=None, ge=0, le=1000, description="Node compute relative to one H100 SXM card (= 1.0)."
    )
    matmul_tflops: float | None = Field(
        default=None, ge=0, le=100000, description="Large bf16 matmul throughput per GPU, TFLOPS."
    )
    hbm_gbps: float | None = Field(
        default=None, alias="hbmGBps", ge=0, le=100000, description="Memory bandwidth per GPU, GB/s (bytes)."
    )
    attention_ms: float | None = Field(
        default=None, ge=0, le=1e6, description="Attention block time at micro-batch 1, ms."
    )
    ffn_ms: float | None = Field(
        default=None, ge=0, le=1e6, description="FFN block time at micro-batch 1, ms."
    )
    max_micro_batch: int | None = Field(
        default=None, ge=1, le=65536, description="Largest micro-batch whose layer fits in memory."
    )
    generation: str | None = Field(
        default=None, max_length=32, description="Architecture generation (hopper, ampere, ...)."
    )
    compute_class: ComputeClass | None = Field(default=None, description="Compute class label value.")
    available_until: str | None = Field(
        default=None,
        max_length=64,
        pattern=RFC3339_PATTERN,
        json_schema_extra={"format": "date-time"},
        description="RFC 3339 time after which the node is reclaimed (a time fragment).",
    )

    @model_validator(mode="after")
    def _check_time(self) -> ProfileOverride:
        if self.available_until is not None:
            try:
                from_rfc3339(self.available_until)
            except ValueError:
                raise ValueError(
                    f"availableUntil {self.available_until!r} must be an RFC 3339 time, "
                    "e.g. 2025-01-31T18:00:00Z"
                ) from None
        return self


class GPUProfileSpec(SpecModel):
    """Desired state of a GPUProfile: which node, and what to pin."""

    node_name: NodeName = Field(description="The profiled node; equals metadata.name.")
    override: ProfileOverride | None = Field(
        default=None, description="Admin-pinned values that win over measurements."
    )


class ProbeInfo(StatusModel):
    """How the last probe ran."""

    job: str | None = Field(default=None, max_length=MAX_OBJECT_NAME, description="Probe Job name.")
    device: ProbeDevice | None = Field(
        default=None, description="cuda: a real GPU; cpu: the same code on the CPU; sim: the sandbox."
    )
    schema_version: int | None = Field(default=None, ge=0, description="Probe output schema version.")
    duration_s: float | None = Field(default=None, ge=0, description="Probe run time, s.")
    attempts: int | None = Field(default=None, ge=0, description="Attempts since the last success.")
    started_time: datetime | None = Field(default=None, description="When the current or last Job started.")
    next_time: datetime | None = Field(
        default=None, description="When the next probe is due (schedule, or retry after back-off)."
    )
    failure_reason: str | None = Field(
        default=None,
        max_length=64,
        description="Reason of the last failed attempt (Timeout, OOMKilled, ...).",
    )
    gpu_key: str | None = Field(
        default=None,
        max_length=256,
        description="The node's GPU when probed (product label x capacity); a change triggers a re-probe.",
    )
    reprobe_token: str | None = Field(
        default=None,
        max_length=256,
        description="Value of the node's gearshift.io/reprobe annotation last acted on.",
    )


class GPUProfileStatus(StatusModel):
    """Measured capability of the node (FlexPipe's resource profile, docs/sources.md#resource-profile)."""

    observed_generation: int | None = Field(
        default=None, description="metadata.generation this status was computed from."
    )
    phase: ProfilePhase | None = Field(default=None, description="Pending, Probing, Ready, Failed, Stale.")
    gpu_model: str | None = Field(
        default=None, max_length=64, description="GPU model (gearshift.facts.gpus name)."
    )
    gpu_product: str | None = Field(
        default=None, max_length=128, description="Product string the node reports (nvidia.com/gpu.product)."
    )
    gpu_count: int | None = Field(default=None, ge=0, description="GPUs on the node.")
    memory_gib: float | None = Field(
        default=None, alias="memoryGiB", ge=0, description="Memory per GPU, GiB."
    )
    free_memory_gib: float | None = Field(
        default=None, alias="freeMemoryGiB", ge=0, description="Free memory per GPU at probe time, GiB."
    )
    compute_score: float | None = Field(
        default=None, ge=0, description="Node compute relative to one H100 SXM card (= 1.0)."
    )
    matmul_tflops: float | None = Field(
        default=None, ge=0, description="Measured large bf16 matmul throughput per GPU, TFLOPS."
    )
    hbm_gbps: float | None = Field(
        default=None, alias="hbmGBps", ge=0, description="Measured memory bandwidth per GPU, GB/s (bytes)."
    )
    d2d_gbps: float | None = Field(
        default=None, alias="d2dGBps", ge=0, description="Device-to-device copy bandwidth in the node, GB/s."
    )
    h2d_gbps: float | None = Field(
        default=None, alias="h2dGBps", ge=0, description="Host-to-device copy bandwidth, GB/s."
    )
    attention_ms: float | None = Field(
        default=None, ge=0, description="Attention block time at micro-batch 1, ms."
    )
    ffn_ms: float | None = Field(default=None, ge=0, description="FFN block time at micro-batch 1, ms.")
    op_timings: list[OpTiming] = Field(
        default_factory=list, max_length=32, description="Block times at further micro-batch sizes."
    )
    max_micro_batch: int | None = Field(
        default=None, ge=1, description="Largest micro-batch whose layer fits in memory."
    )
    interconnect: list[InterconnectLink] = Field(
        default_factory=list,
        max_length=MAX_PEERS,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["peer"]},
        description="Measured links to peer nodes.",
    )
    generation: str | None = Field(
        default=None, max_length=32, description="Architecture generation (hopper, ampere, ada, ...)."
    )
    compute_class: ComputeClass | None = Field(
        default=None, description="Class from clustering the fleet's compute scores (high, mid, low)."
    )
    source: ProfileSource | None = Field(
        default=None, description="Where the numbers come from: probe, datasheet or override."
    )
    probe_time: AwareDatetime | None = Field(default=None, description="When the last good probe ended.")
    available_until: AwareDatetime | None = Field(
        default=None, description="When the node will be reclaimed (time fragment), if known."
    )
    probe: ProbeInfo | None = Field(default=None, description="How the last probe ran.")
    overridden: list[Annotated[str, Field(max_length=64)]] = Field(
        default_factory=list,
        max_length=32,
        description="Status fields whose value comes from spec.override instead of the measurement.",
    )
    message: Message | None = Field(default=None, description="Last error or note.")
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=MAX_CONDITIONS,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
        description="Ready, Probed, Stale, Windowed, Degraded.",
    )


class GPUProfile(StatusModel):
    """A whole GPUProfile object: ``metadata`` stays a plain mapping (kopf's body), spec and status typed."""

    model_config = ConfigDict(json_schema_extra=_cel("GPUProfile"))

    api_version: ApiVersion = Field(default=API_VERSION, description="API version.")
    kind: Literal["GPUProfile"] = Field(default="GPUProfile", description="Kind.")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Object metadata.")
    spec: GPUProfileSpec = Field(description="Which node and what to pin.")
    status: GPUProfileStatus = Field(default_factory=GPUProfileStatus, description="Measured capability.")

    @model_validator(mode="after")
    def _name_is_node(self) -> GPUProfile:
        name = self.metadata.get("name")
        if name is not None and name != self.spec.node_name:
            raise ValueError(
                f"spec.nodeName ({self.spec.node_name!r}) must equal metadata.name ({name!r}): "
                "a GPUProfile is named after its node"
            )
        return self

    def effective(self) -> GPUProfileStatus:
        """The status with every field set in ``spec.override`` replacing the measured one.

        ``source`` becomes ``override`` when at least one field was pinned.
        """
        ov = self.spec.override
        if ov is None:
            return self.status.model_copy(deep=True)
        pinned: dict[str, Any] = {
            k: v for k, v in ov.model_dump(exclude_none=True).items() if k != "available_until"
        }
        if ov.available_until is not None:
            pinned["available_until"] = from_rfc3339(ov.available_until)
        if pinned:
            pinned["source"] = "override"
        return self.status.model_copy(update=pinned, deep=True)
