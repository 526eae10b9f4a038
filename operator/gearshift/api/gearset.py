"""The GearSet kind: the gears of one role of a PDService, the gear-shifting policy, and the gear status.

A *gear* is one complete pipeline configuration: contiguous stages of layers ``[start, end)`` with
unequal layer counts but equal expected time, per-stage replicas, micro-batch and max batch, and the QPS
range and target latency it suits (seed 002). ``mode: explicit`` lists gears by hand; ``mode: auto``
lets the planner generate them from the GPUProfiles into ``status.plannedGears``.

Every cross-field rule is written twice, here as a pydantic validator and in :data:`CEL` below as an
``x-kubernetes-validations`` rule of the CRD; the e2e agreement test holds the two to the same answer.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AwareDatetime, ConfigDict, Field, model_validator

from gearshift.api.common import (
    API_VERSION,
    DNS_LABEL_PATTERN,
    MAX_CONDITIONS,
    MAX_GEAR_NAME,
    MAX_GEARS,
    MAX_HISTORY,
    MAX_NODES_PER_STAGE,
    MAX_SERVICE_NAME,
    MAX_STAGES,
    ApiVersion,
    Condition,
    DnsLabel,
    Message,
    NodeName,
    Selector,
    SpecModel,
    StatusModel,
)
from gearshift.facts.model import VLLM_GPU_MEMORY_UTILIZATION

Role = Literal["prefill", "decode", "both"]
GearIntent = Literal["latency", "balanced", "throughput"]
GearSetMode = Literal["auto", "explicit"]
#: ``Pending``: no gear serves yet. The six others are seed 002's executor states.
GearPhase = Literal["Pending", "Stable", "Warming", "Draining", "Switching", "RollingBack", "Degraded"]
ShiftTrigger = Literal[
    "imbalance",
    "saturation",
    "p99-high",
    "p99-low",
    "load-high",
    "load-low",
    "forced",
    "initial",
    "replan",
    "window",
    "rollback",
]
ShiftOutcome = Literal["InProgress", "Succeeded", "RolledBack", "Failed", "Aborted"]
#: Where ``status.signals.stageUtilization`` comes from (``gearshift.control.signals.UtilizationSource``).
StageUtilizationSource = Literal["engine", "derived", "none"]

GEAR_INTENTS: tuple[GearIntent, ...] = ("latency", "balanced", "throughput")
GEAR_PHASES: tuple[str, ...] = GearPhase.__args__  # type: ignore[attr-defined]

#: A gear name: a DNS label short enough for ``<pds>-<role>-<gear>-s<k>`` StatefulSet names.
GearName = Annotated[str, Field(min_length=1, max_length=MAX_GEAR_NAME, pattern=DNS_LABEL_PATTERN)]
#: A layer index of the model, 0-based.
LayerIndex = Annotated[int, Field(ge=0, le=100000)]
#: Requests per second.
Qps = Annotated[float, Field(ge=0, le=1e7)]
#: A gearshift.facts.gpus model name (e.g. H100-80GB).
GpuModelName = Annotated[str, Field(min_length=1, max_length=64)]

#: A rule on an object is reported as ``<field>: Invalid value: "object": <message>``, which shows no
#: value; so each rule that compares values also has a ``messageExpression`` that names them (the API
#: server falls back to ``message`` if the expression fails to evaluate).
#: The layer ranges of every stage, for the stage-contiguity rules' messages (``{}``: the problem).
_STAGES_GOT = (
    "\"{}: each stage's layers[0] must equal the previous stage's layers[1]; got %s\""
    ".format([self.stages.map(s, s.layers)])"
)

#: Rules of the CRD, per model, as ``x-kubernetes-validations`` entries; read by :mod:`gearshift.api.crdgen`.
#: Each guards its own index accesses so that a schema error elsewhere does not also raise a CEL error.
CEL: dict[str, list[dict[str, str]]] = {
    "Stage": [
        {
            "rule": "size(self.layers) != 2 || self.layers[0] < self.layers[1]",
            "message": "layers must be a half-open range [start, end) with start < end",
            "messageExpression": "'layers must be a half-open range [start, end) with start < end; got %s'"
            ".format([self.layers])",
            "fieldPath": ".layers",
        },
    ],
    "Gear": [
        {
            "rule": "size(self.stages) == 0 || size(self.stages[0].layers) != 2 "
            "|| self.stages[0].layers[0] == 0",
            "message": "stages[0].layers must start at layer 0",
            "messageExpression": "'stages[0].layers must start at layer 0; got %s'"
            ".format([self.stages[0].layers])",
            "fieldPath": ".stages",
        },
        {
            "rule": "self.stages.all(i, s, i == 0 || size(s.layers) != 2 "
            "|| size(self.stages[i - 1].layers) != 2 || s.layers[0] >= self.stages[i - 1].layers[1])",
            "message": "stages overlap: each stage's layers[0] must equal the previous stage's layers[1]",
            "messageExpression": _STAGES_GOT.format("stages overlap"),
            "fieldPath": ".stages",
        },
        {
            "rule": "self.stages.all(i, s, i == 0 || size(s.layers) != 2 "
            "|| size(self.stages[i - 1].layers) != 2 || s.layers[0] <= self.stages[i - 1].layers[1])",
            "message": "stages leave a gap: each stage's layers[0] must equal the previous stage's layers[1]",
            "messageExpression": _STAGES_GOT.format("stages leave a gap"),
            "fieldPath": ".stages",
        },
        {
            "rule": "self.microBatch <= self.maxBatch",
            "message": "microBatch must be <= maxBatch",
            "messageExpression": "'microBatch (%d) must be <= maxBatch (%d)'"
            ".format([self.microBatch, self.maxBatch])",
            "fieldPath": ".microBatch",
        },
        {
            "rule": "!has(self.qpsRange) || size(self.qpsRange) != 2 || self.qpsRange[0] <= self.qpsRange[1]",
            "message": "qpsRange must be [low, high] with low <= high",
            "messageExpression": "'qpsRange must be [low, high] with low <= high; got [%s, %s]'"
            ".format([self.qpsRange[0], self.qpsRange[1]])",
            "fieldPath": ".qpsRange",
        },
    ],
    "ShiftPolicy": [
        {
            "rule": "self.imbalanceLowUtilization < self.imbalanceHighUtilization",
            "message": "imbalanceLowUtilization must be below imbalanceHighUtilization",
            "messageExpression": "'imbalanceLowUtilization (%s) must be below imbalanceHighUtilization (%s)'"
            ".format([self.imbalanceLowUtilization, self.imbalanceHighUtilization])",
            "fieldPath": ".imbalanceLowUtilization",
        },
        {
            "rule": "self.p99LowRatio < self.p99HighRatio",
            "message": "p99LowRatio must be below p99HighRatio",
            "messageExpression": "'p99LowRatio (%s) must be below p99HighRatio (%s)'"
            ".format([self.p99LowRatio, self.p99HighRatio])",
            "fieldPath": ".p99LowRatio",
        },
    ],
    "PlanConstraints": [
        {
            "rule": "!has(self.minStages) || !has(self.maxStages) || self.minStages <= self.maxStages",
            "message": "minStages must be <= maxStages",
            "messageExpression": "'minStages (%d) must be <= maxStages (%d)'"
            ".format([self.minStages, self.maxStages])",
            "fieldPath": ".minStages",
        },
    ],
    "GearSetSpec": [
        {
            "rule": "self.mode != 'explicit' || (has(self.gears) && size(self.gears) > 0)",
            "message": "gears: mode explicit needs at least one gear (or set mode: auto to let the planner "
            "generate them)",
            "fieldPath": ".gears",
            "reason": "FieldValueRequired",
        },
        {
            "rule": "self.mode != 'auto' || !has(self.gears) || size(self.gears) == 0",
            "message": "gears must be empty when mode is auto: the planner writes status.plannedGears "
            "(use mode: explicit to list gears)",
            "fieldPath": ".gears",
            "reason": "FieldValueForbidden",
        },
        {
            "rule": "self.mode == 'auto' || !has(self.plan)",
            "message": "plan is only used with mode: auto",
            "fieldPath": ".plan",
            "reason": "FieldValueForbidden",
        },
        {
            "rule": "self.mode != 'explicit' || !has(self.initialGear) "
            "|| (has(self.gears) && self.gears.exists(g, g.name == self.initialGear))",
            "message": "initialGear must name one of spec.gears",
            "messageExpression": "'initialGear (%s) must name one of spec.gears (%s)'.format("
            "[self.initialGear, has(self.gears) ? self.gears.map(g, g.name) : []])",
            "fieldPath": ".initialGear",
        },
        {
            "rule": "self.mode != 'explicit' || !has(self.forceGear) "
            "|| (has(self.gears) && self.gears.exists(g, g.name == self.forceGear))",
            "message": "forceGear must name one of spec.gears",
            "messageExpression": "'forceGear (%s) must name one of spec.gears (%s)'.format("
            "[self.forceGear, has(self.gears) ? self.gears.map(g, g.name) : []])",
            "fieldPath": ".forceGear",
        },
    ],
}


def _cel(name: str) -> dict[str, Any]:
    return {"x-kubernetes-validations": CEL[name]}


class Stage(SpecModel):
    """One pipeline stage: a contiguous layer range on one node, replicated `replicas` times."""

    model_config = ConfigDict(json_schema_extra=_cel("Stage"))

    layers: list[LayerIndex] = Field(
        min_length=2,
        max_length=2,
        description="Half-open layer range [start, end) of the model held by this stage, 0-based.",
    )
    replicas: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="Pods of this stage per pipeline replica; more than 1 replicates a hot stage (seed 002).",
    )
    gpus: int = Field(
        default=1, ge=1, le=16, description="GPUs per pod (tensor parallelism inside the stage)."
    )
    nodes: list[NodeName] = Field(
        default_factory=list,
        max_length=MAX_NODES_PER_STAGE,
        description="Node names the planner chose for this stage; pods are placed on these (empty: any "
        "node matching nodeSelector).",
    )
    node_selector: Selector = Field(
        default_factory=dict,
        description="Node labels the stage's pods need, e.g. gearshift.io/gpu-model: H100-80GB.",
    )
    gpu_model: str | None = Field(
        default=None,
        max_length=64,
        description="GPU model the stage was planned for (a gearshift.facts.gpus name, e.g. A100-40GB); the "
        "simulated engine times the stage on it.",
    )
    predicted_time_ms: float | None = Field(
        default=None,
        ge=0,
        le=1e7,
        description="Planner's expected time of one micro-batch in this stage, ms.",
    )
    predicted_memory_gib: float | None = Field(
        default=None,
        alias="predictedMemoryGiB",
        ge=0,
        le=1e6,
        description="Planner's expected GPU memory per pod (weights + KV), GiB.",
    )

    @model_validator(mode="after")
    def _check_range(self) -> Stage:
        if self.layers[0] >= self.layers[1]:
            raise ValueError(
                f"layers must be a half-open range [start, end) with start < end, got {self.layers}"
            )
        return self

    @property
    def start(self) -> int:
        """First layer of the stage (inclusive)."""
        return self.layers[0]

    @property
    def end(self) -> int:
        """Layer after the stage's last one (exclusive)."""
        return self.layers[1]

    @property
    def num_layers(self) -> int:
        """Layers in the stage."""
        return self.layers[1] - self.layers[0]


class GearPrediction(SpecModel):
    """What the planner's simulator expects of a gear; online measurements correct it (seed 002)."""

    bottleneck_ms: float | None = Field(
        default=None, ge=0, le=1e7, description="Slowest stage's time per micro-batch, ms."
    )
    throughput_qps: float | None = Field(
        default=None, ge=0, le=1e7, description="Pipeline throughput, requests/s."
    )
    ttft_ms: float | None = Field(default=None, ge=0, le=1e7, description="Expected time to first token, ms.")
    itl_ms: float | None = Field(default=None, ge=0, le=1e7, description="Expected inter-token latency, ms.")
    p99_ms: float | None = Field(
        default=None, ge=0, le=1e7, description="Expected P99 of the role's key latency (TTFT or ITL), ms."
    )
    max_link_utilization: float | None = Field(
        default=None, ge=0, le=100, description="Highest share of a link's bandwidth the gear's traffic uses."
    )
    weights_gib: float | None = Field(
        default=None,
        alias="weightsGiB",
        ge=0,
        le=1e6,
        description="Weights a shift to this gear loads, GiB (the shift's cost).",
    )


class Gear(SpecModel):
    """One complete pipeline configuration (seed 002's 'gear')."""

    model_config = ConfigDict(json_schema_extra=_cel("Gear"))

    name: GearName = Field(
        description=f"Gear name, a DNS label of at most {MAX_GEAR_NAME} characters (it is part of the "
        "StatefulSet names <pds>-<role>-<gear>-s<k>).",
    )
    intent: GearIntent = Field(
        default="balanced",
        description="What the gear is for: latency (2-4 stages, micro-batch 1-4), balanced (4-8, 4-8) or "
        "throughput (8-12, 8-16) (seed 002); triggers pick gears by intent.",
    )
    stages: list[Stage] = Field(
        min_length=1,
        max_length=MAX_STAGES,
        description="Pipeline stages in order; layer ranges start at 0 and are contiguous.",
    )
    micro_batch: int = Field(
        default=4, ge=1, le=1024, description="Sequences per micro-batch flowing through the pipeline."
    )
    max_batch: int = Field(
        default=256,
        ge=1,
        le=65536,
        description="Most sequences in flight per pipeline replica (vLLM --max-num-seqs, default 256).",
    )
    qps_range: list[Qps] | None = Field(
        default=None,
        min_length=2,
        max_length=2,
        description="[low, high] requests/s this gear suits.",
    )
    target_latency_ms: float | None = Field(
        default=None, gt=0, le=1e7, description="Latency this gear is meant to meet (the role's P99), ms."
    )
    predicted: GearPrediction | None = Field(default=None, description="The planner's predictions.")

    @model_validator(mode="after")
    def _check_gear(self) -> Gear:
        if self.stages[0].start != 0:
            raise ValueError(f"stages[0].layers must start at layer 0, got {self.stages[0].layers}")
        for k in range(1, len(self.stages)):
            prev, cur = self.stages[k - 1], self.stages[k]
            if cur.start < prev.end:
                raise ValueError(
                    f"stages overlap: stages[{k}].layers {cur.layers} starts before stages[{k - 1}] ends "
                    f"({prev.end}); each stage's layers[0] must equal the previous stage's layers[1]"
                )
            if cur.start > prev.end:
                raise ValueError(
                    f"stages leave a gap: layers {prev.end}..{cur.start - 1} are in no stage; each stage's "
                    "layers[0] must equal the previous stage's layers[1]"
                )
        if self.micro_batch > self.max_batch:
            raise ValueError(f"microBatch ({self.micro_batch}) must be <= maxBatch ({self.max_batch})")
        if self.qps_range is not None and self.qps_range[0] > self.qps_range[1]:
            raise ValueError(f"qpsRange must be [low, high] with low <= high, got {self.qps_range}")
        return self

    @property
    def num_layers(self) -> int:
        """Layers the gear covers (the last stage's end)."""
        return self.stages[-1].end

    def check_model_layers(self, num_layers: int) -> None:
        """Check that the gear covers exactly the model's ``num_layers`` layers.

        Raises:
            ValueError: naming the gear, its last stage's end and the model's layer count.
        """
        if self.num_layers != num_layers:
            raise ValueError(
                f"gear {self.name!r}: stages cover layers [0, {self.num_layers}) but the model has "
                f"{num_layers} layers; make the last stage's layers end at {num_layers}"
            )

    def check_stage_limit(self, max_stages: int, why: str) -> None:
        """Check that the gear has at most ``max_stages`` pipeline stages (an engine's limit for a role,
        e.g. one stage for decode under vLLM's NixlConnector:
        ``gearshift.planner.inputs.engine_stage_limit``).

        Raises:
            ValueError: ``gear 'x' has N stages; <why>`` (``why``: the limit's reason and the fix).
        """
        if len(self.stages) > max_stages:
            raise ValueError(f"gear {self.name!r} has {len(self.stages)} stages; {why}")


class ShiftPolicy(SpecModel):
    """When to shift gears and how to execute a shift. Defaults are seed 002's numbers unless noted."""

    model_config = ConfigDict(json_schema_extra=_cel("ShiftPolicy"))

    sample_interval_s: float = Field(
        default=2.0, gt=0, le=3600, description="Seconds between signal samples (seed 002: 2 s)."
    )
    ema_alpha: float = Field(
        default=0.3, gt=0, le=1, description="Weight of the newest sample in the EMA (seed 002: 0.3)."
    )
    enter_samples: int = Field(
        default=3, ge=1, le=1000, description="Consecutive samples a trigger must hold to fire (seed 002: 3)."
    )
    exit_samples: int = Field(
        default=3,
        ge=1,
        le=1000,
        description="Consecutive samples another trigger must hold to leave the new gear (seed 002: 3).",
    )
    dwell_s: float = Field(
        default=600.0, ge=0, le=86400, description="Minimum seconds a gear stays active (seed 002: 10 min)."
    )
    imbalance_high_utilization: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="Imbalance trigger: some stage's utilisation above this ... (seed 002: 0.9).",
    )
    imbalance_low_utilization: float = Field(
        default=0.6,
        ge=0,
        lt=1,
        description="... while every other stage is below this -> throughput gear (seed 002: 0.6).",
    )
    p99_high_ratio: float = Field(
        default=1.2, gt=0, le=100, description="P99 above this x target -> latency gear (seed 002: 1.2)."
    )
    p99_low_ratio: float = Field(
        default=0.7, gt=0, le=100, description="P99 below this x target -> balanced gear (seed 002: 0.7)."
    )
    saturation_queue: float = Field(
        default=1.0,
        ge=0,
        le=1e6,
        description="Saturation trigger (gearshift extension): P99 above p99HighRatio x target while more "
        "than this many requests wait per pipeline replica (smoothed) -> the gear with the most predicted "
        "throughput, if more than the active gear's.",
    )
    target_p99_ms: float | None = Field(
        default=None,
        gt=0,
        le=1e7,
        description="Target of the P99 triggers, ms; unset: the PDService SLO (ttftMs for prefill "
        "and both, itlMs for decode).",
    )
    retrigger_step: float = Field(
        default=0.05,
        ge=0,
        le=10,
        description="A trigger firing again inside the dwell moves its threshold this much away from "
        "firing (seed 002 says 'one step'; the size is gearshift's choice).",
    )
    min_benefit_cost_ratio: float = Field(
        default=1.0,
        ge=0,
        le=1e6,
        description="Veto a shift unless its predicted gain over one dwell is at least this x its cost "
        "(weights and KV moved, seed 002); 0 disables the check.",
    )
    warmup_share: float = Field(
        default=0.2,
        gt=0,
        le=1,
        description="Share of live requests' load a warming shadow gets (seed 002: 20%): the router mirrors "
        "requests to its head pods at up to warmupShare x the gear's predicted throughput (answers dropped; "
        "clients never see them) while it is Ready for warmS. The card-time share is not enforced on the "
        "GPU (the benchmark models it).",
    )
    warm_s: float = Field(
        default=30.0,
        ge=0,
        le=86400,
        description="How long a shadow gear must have been Ready before traffic moves to it, s (gearshift's "
        "choice: a few hundred warm-up requests at typical rates).",
    )
    warmup_timeout_s: float = Field(
        default=600.0, gt=0, le=86400, description="Shadows not ready and warm by then -> roll back, s."
    )
    max_retrigger_steps: int = Field(
        default=3,
        ge=0,
        le=100,
        description="Most steps a threshold can be raised by re-triggers inside the dwell "
        "(gearshift's choice).",
    )
    transfer_gbps: float = Field(
        default=2.0,
        gt=0,
        le=1e5,
        description="Rate one pod of a shift's new gear loads its weights and KV, GB/s (pods load at once, "
        "so the largest stage sets the shift's cost in the cost-benefit check; default: a local NVMe read; "
        "set the cluster's measured per-node load rate).",
    )
    avg_context_tokens: int = Field(
        default=1024,
        ge=0,
        le=10_000_000,
        description="KV-cache tokens a running request holds on average (prices the KV a shift moves).",
    )
    drain_timeout_s: float = Field(
        default=120.0,
        gt=0,
        le=86400,
        description="Longest wait for in-flight requests on the old gear to finish, s.",
    )
    rollback_window_s: float = Field(
        default=60.0,
        ge=0,
        le=86400,
        description="How long the old gear is kept after the switch to roll back to, s (seed 002 keeps a "
        "few hundred ms inside one engine; across pods gearshift needs enough samples to judge P99).",
    )
    rollback_p99_ratio: float = Field(
        default=2.0,
        gt=1,
        le=100,
        description="Within the rollback window, the new gear's measured P99 above this x max(the old "
        "gear's measured P99 when the shift started, the target P99) rolls back.",
    )
    expected_arrival_rps: float = Field(
        default=0.0,
        ge=0,
        le=1e6,
        description="Arrival rate the role expects when it starts, req/s: with initialGear unset it starts "
        "on the gear with the fewest GPUs predicted to meet the P99 target at this rate.",
    )
    capacity_headroom: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="A gear is predicted to meet the P99 target up to this x its predicted throughput "
        "(req/s) until it has measured its own capacity; the load-high/load-low triggers compare the "
        "smoothed arrival rate with that capacity (status.control.capacity).",
    )
    downshift_ratio: float = Field(
        default=0.75,
        gt=0,
        le=1,
        description="load-low shifts to a gear with fewer GPUs only while the arrival rate is below this x "
        "that gear's capacity (a margin against shifting back up at the next bump).",
    )
    upshift_dwell_s: float = Field(
        default=60.0,
        ge=0,
        le=86400,
        description="Least seconds after a shift ends before a shift to a gear with more capacity (as the "
        "HPA scales up at once and down after a stabilization window, dwellS governs the way down).",
    )
    allow_degraded: bool = Field(
        default=True,
        description="When memory is short for full shadows, load weights first and grow the KV pool after "
        "the switch (seed 002's degraded mode) instead of refusing the shift.",
    )

    @model_validator(mode="after")
    def _check_thresholds(self) -> ShiftPolicy:
        if self.imbalance_low_utilization >= self.imbalance_high_utilization:
            raise ValueError(
                f"imbalanceLowUtilization ({self.imbalance_low_utilization}) must be below "
                f"imbalanceHighUtilization ({self.imbalance_high_utilization})"
            )
        if self.p99_low_ratio >= self.p99_high_ratio:
            raise ValueError(
                f"p99LowRatio ({self.p99_low_ratio}) must be below p99HighRatio ({self.p99_high_ratio})"
            )
        return self


class PlanConstraints(SpecModel):
    """Limits for the planner when it generates gears (``mode: auto``)."""

    model_config = ConfigDict(json_schema_extra=_cel("PlanConstraints"))

    min_stages: int | None = Field(default=None, ge=1, le=MAX_STAGES, description="Fewest stages per gear.")
    max_stages: int | None = Field(default=None, ge=1, le=MAX_STAGES, description="Most stages per gear.")
    max_replicas_per_stage: int | None = Field(
        default=None, ge=1, le=1024, description="Most replicas of one stage."
    )
    node_selector: Selector = Field(
        default_factory=dict, description="Only nodes with these labels are used."
    )
    exclude_nodes: list[NodeName] = Field(
        default_factory=list, max_length=1024, description="Nodes never used."
    )
    gpu_models: list[GpuModelName] = Field(
        default_factory=list,
        max_length=64,
        description="Allowed GPU models (gearshift.facts.gpus names); empty: any.",
    )
    link_utilization_cap: float = Field(
        default=0.7,
        gt=0,
        le=1,
        description="Traffic between adjacent stages must stay below this share of the link's bandwidth "
        "(seed 002: 70%).",
    )
    memory_utilization: float = Field(
        default=VLLM_GPU_MEMORY_UTILIZATION,
        gt=0,
        le=1,
        description="Share of each GPU's memory for weights and KV cache (vLLM --gpu-memory-utilization, "
        "default 0.9).",
    )
    window_margin_s: float = Field(
        default=300.0,
        ge=0,
        le=86400,
        description="A time-limited node is used only if the gear's dwell ends this long before its window "
        "closes, s.",
    )

    @model_validator(mode="after")
    def _check_stages(self) -> PlanConstraints:
        if self.min_stages is not None and self.max_stages is not None and self.min_stages > self.max_stages:
            raise ValueError(f"minStages ({self.min_stages}) must be <= maxStages ({self.max_stages})")
        return self


class Workload(SpecModel):
    """The request shape the planner prices a gear's capacity with (mean tokens per request)."""

    prompt_tokens: int = Field(
        default=512,
        ge=1,
        le=1048576,
        description="Mean prompt tokens per request (prefill work).",
    )
    output_tokens: int = Field(
        default=128,
        ge=1,
        le=1048576,
        description="Mean generated tokens per request (decode steps); the default is about the median of "
        "the Azure LLM inference conversation trace (129).",
    )


class AutoPlan(SpecModel):
    """What the planner should generate when ``mode: auto``."""

    intents: list[GearIntent] = Field(
        default_factory=lambda: list(GEAR_INTENTS),
        min_length=1,
        max_length=3,
        json_schema_extra={"x-kubernetes-list-type": "set"},
        description="Intents to generate one gear each for; the gear is named after its intent.",
    )
    constraints: PlanConstraints = Field(
        default_factory=PlanConstraints, description="Limits for the planner."
    )
    workload: Workload = Field(
        default_factory=Workload,
        description="Request shape the planner prices capacity with: a prefill role's gears run the "
        "prompts, a decode role's gears the output tokens, a both role's gears the whole request.",
    )

    @model_validator(mode="after")
    def _unique_intents(self) -> AutoPlan:
        if len(set(self.intents)) != len(self.intents):
            raise ValueError(f"intents: duplicate values in {self.intents}; list each intent once")
        return self


class GearSetSpec(SpecModel):
    """Desired state of a GearSet: its gears (or how to plan them) and the shifting policy."""

    model_config = ConfigDict(json_schema_extra=_cel("GearSetSpec"))

    service_name: DnsLabel = Field(
        max_length=MAX_SERVICE_NAME, description="Name of the PDService this GearSet serves."
    )
    role: Role = Field(
        description="What the gears' engines run: prefill or decode (a side of a disaggregated PDService, "
        "its spec.prefill or spec.decode), or both (aggregated: each request's prefill and decode on the "
        "same pipeline, the PDService's spec.serving)."
    )
    mode: GearSetMode = Field(
        default="explicit",
        description="explicit: the gears below; auto: the planner generates gears from the GPUProfiles.",
    )
    gears: list[Gear] = Field(
        default_factory=list,
        max_length=MAX_GEARS,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
        description="The gears (mode explicit); names are unique.",
    )
    plan: AutoPlan | None = Field(default=None, description="Planner settings (mode auto).")
    initial_gear: GearName | None = Field(
        default=None,
        description="Gear to start in; unset: the gear with the fewest GPUs predicted to meet the P99 "
        "target at policy.expectedArrivalRps, else the first whose qpsRange contains 0, else the first.",
    )
    force_gear: GearName | None = Field(
        default=None,
        description="Manual override: shift to this gear and stay there, whatever the signals say.",
    )
    paused: bool = Field(default=False, description="Stop gear shifting (signals are still sampled).")
    replicas: int = Field(
        default=1,
        ge=0,
        le=1024,
        description="Pipeline replicas of the active gear (the REPLICAS column): copies of the gear's whole "
        "layout, stage k running replicas x stages[k].replicas pods. A pipeline replica whose narrowest "
        "stage has r pods serves r copies of the model, so READY (serving copies, status.ready) can read "
        "4/4 at replicas 1. The scale subresource's target (HPA/KEDA, or gearshift's autoscaler).",
    )
    policy: ShiftPolicy = Field(default_factory=ShiftPolicy, description="When and how to shift gears.")

    @model_validator(mode="after")
    def _check_spec(self) -> GearSetSpec:
        names = [g.name for g in self.gears]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"gears: duplicate gear names {dup}; each gear needs its own name")
        if self.mode == "explicit" and not self.gears:
            raise ValueError(
                "gears: mode explicit needs at least one gear (or set mode: auto to let the planner "
                "generate them)"
            )
        if self.mode == "auto" and self.gears:
            raise ValueError(
                "gears must be empty when mode is auto: the planner writes status.plannedGears "
                "(use mode: explicit to list gears)"
            )
        if self.mode != "auto" and self.plan is not None:
            raise ValueError("plan is only used with mode: auto")
        if self.mode == "explicit":
            for field, value in (("initialGear", self.initial_gear), ("forceGear", self.force_gear)):
                if value is not None and value not in names:
                    raise ValueError(f"{field} {value!r} must name one of spec.gears {names}")
        return self

    def gear(self, name: str) -> Gear:
        """The explicit gear called ``name``.

        Raises:
            KeyError: no such gear, naming the known ones.
        """
        for g in self.gears:
            if g.name == name:
                return g
        raise KeyError(f"no gear {name!r} in spec.gears {[g.name for g in self.gears]}")


# --- status -----------------------------------------------------------------------------------------
#: Longest ``status.signals.skipped`` the schema takes (the writer cuts to it).
SKIPPED_MAX_CHARS = 1024


class GearSignals(StatusModel):
    """The smoothed (EMA) signals of the last sample."""

    sample_time: AwareDatetime | None = Field(default=None, description="When the sample was taken.")
    qps: float | None = Field(default=None, description="Requests/s over the last minute.")
    p99_ms: float | None = Field(
        default=None,
        description="P99 the triggers compare with the target: TTFT for prefill and both, ITL for decode, "
        "ms.",
    )
    p50_ttft_ms: float | None = Field(default=None, description="P50 time to first token, ms.")
    p99_ttft_ms: float | None = Field(default=None, description="P99 time to first token, ms.")
    p50_itl_ms: float | None = Field(default=None, description="P50 inter-token latency, ms.")
    p99_itl_ms: float | None = Field(default=None, description="P99 inter-token latency, ms.")
    p50_e2e_ms: float | None = Field(
        default=None, alias="p50E2eMs", description="P50 end-to-end request latency, ms."
    )
    p99_e2e_ms: float | None = Field(
        default=None, alias="p99E2eMs", description="P99 end-to-end request latency, ms."
    )
    queue_length: float | None = Field(default=None, description="Waiting requests per pipeline replica.")
    kv_cache_usage: float | None = Field(default=None, description="KV-cache usage, 0..1.")
    stage_utilization: list[float] = Field(
        default_factory=list,
        max_length=MAX_STAGES,
        description="Utilisation of each stage, 0..1, in order; empty when not known.",
    )
    stage_utilization_source: StageUtilizationSource | None = Field(
        default=None,
        description="Where stageUtilization comes from: engine (the simulated engine measures and "
        "exports each stage's busy fraction), derived (vLLM exports none: the head's seat occupancy, "
        "pipelineUtilization, times each stage's predictedTimeMs / the bottleneck's), none (not known "
        "this sample, e.g. a multi-stage vLLM gear without predictedTimeMs: the imbalance trigger is off; "
        "the SignalsAvailable condition says why).",
    )
    pipeline_utilization: float | None = Field(
        default=None,
        description="vLLM only: the head engine's seat occupancy in the last sample (not smoothed), 0..1: "
        "mean requests in execution over the window (rate of vllm:request_prefill_time_seconds_sum + "
        "vllm:request_decode_time_seconds_sum per head engine) / maxBatch (--max-num-seqs).",
    )
    skipped: str | None = Field(
        default=None,
        max_length=SKIPPED_MAX_CHARS,
        description="Why this tick has no sample (Prometheus unreachable, a series the controller reads "
        "is missing): sampleTime is the tick's and every value is null, as the SignalsAvailable "
        "condition also says; null when the sample was taken. The status advances every sample "
        "interval either way (#31).",
    )
    missed_samples: int | None = Field(
        default=None,
        ge=0,
        description="Sample instants the shifting loop let pass since the operator started, because a "
        "turn took longer than spec.policy.sampleIntervalS (a slow API server or a busy machine); 0 while "
        "it keeps pace. Also counted by gearshift_operator_samples_missed_total.",
    )


class GearHealth(StatusModel):
    """Whether a gear may be shifted to; unhealthy until the model or the profiles change (seed 002)."""

    gear: str = Field(max_length=63, description="Gear name.")
    healthy: bool = Field(description="False after OOM, crash loops or severe timeouts.")
    reason: str = Field(
        default="", max_length=1024, description="CamelCase reason (OOMKilled, Timeout, ...)."
    )
    message: Message = Field(default="", description="Details.")
    since: AwareDatetime | None = Field(default=None, description="When the gear was last marked.")
    profiles_hash: str | None = Field(
        default=None,
        max_length=128,
        description="GPUProfiles fingerprint when marked; a different one clears the mark.",
    )
    gear_hash: str | None = Field(
        default=None,
        max_length=128,
        description="Fingerprint of the gear's spec when marked; editing the gear clears the mark.",
    )


class ShiftRecord(StatusModel):
    """One gear shift, for history and events."""

    from_gear: str | None = Field(default=None, alias="from", max_length=63, description="Gear shifted from.")
    to_gear: str = Field(alias="to", max_length=63, description="Gear shifted to.")
    trigger: ShiftTrigger = Field(description="What started the shift.")
    started_at: AwareDatetime = Field(description="When the shift started.")
    finished_at: AwareDatetime | None = Field(default=None, description="When it ended.")
    outcome: ShiftOutcome = Field(default="InProgress", description="How it ended.")
    message: Message = Field(default="", description="Details.")


class ExecutorState(StatusModel):
    """The gear executor's persisted state, so an operator restart resumes a shift where it stopped."""

    step: GearPhase = Field(default="Stable", description="Current executor step.")
    from_gear: str | None = Field(default=None, max_length=63, description="Gear being left.")
    to_gear: str | None = Field(default=None, max_length=63, description="Gear being entered.")
    trigger: ShiftTrigger | None = Field(default=None, description="Trigger of the shift in progress.")
    started_at: AwareDatetime | None = Field(default=None, description="When the shift started.")
    step_started_at: AwareDatetime | None = Field(default=None, description="When the current step started.")
    deadline: AwareDatetime | None = Field(default=None, description="When the current step times out.")
    rollback_until: AwareDatetime | None = Field(default=None, description="End of the rollback window.")
    degraded: bool = Field(default=False, description="Shadows run weights-only; KV pool grows after.")
    attempt: int = Field(default=0, ge=0, description="Retries of the current step.")
    in_flight: int | None = Field(
        default=None,
        ge=0,
        description="Requests still on the gear being drained (the old gear while Draining, the failed "
        "gear while RollingBack).",
    )
    predicted_p99_ms: float | None = Field(
        default=None, ge=0, le=1e7, description="The target gear's predicted P99 (informational), ms."
    )
    baseline_p99_ms: float | None = Field(
        default=None,
        ge=0,
        le=1e9,
        description="The old gear's measured P99 when the shift started (the rollback check's "
        "yardstick), ms.",
    )
    baseline_qps: float | None = Field(
        default=None,
        ge=0,
        le=1e9,
        description="The old gear's served rate when the shift started, completed requests/s: a "
        "saturation shift's new gear serving at least this much is not rolled back on P99.",
    )
    failure: str | None = Field(
        default=None, max_length=1024, description="CamelCase reason of the rollback in progress."
    )
    failure_message: Message = Field(default="", description="Why it rolls back.")
    paused_at: AwareDatetime | None = Field(
        default=None, description="When spec.paused held the shift (deadlines are extended by the pause)."
    )


class GearCapacity(StatusModel):
    """One gear's SLO capacity (issue 19): what the planner predicted and what the gear measured while it
    served (gearshift.control.capacity)."""

    gear: str = Field(max_length=63, description="Gear name.")
    predicted_rps: float | None = Field(
        default=None,
        ge=0,
        le=1e9,
        description="policy.capacityHeadroom x the planner's predicted throughput, requests/s (0: its "
        "predicted P99 misses the target).",
    )
    measured_low_rps: float | None = Field(
        default=None,
        ge=0,
        le=1e9,
        description="Highest smoothed arrival rate it served within the P99 target with no backlog, req/s.",
    )
    measured_high_rps: float | None = Field(
        default=None,
        ge=0,
        le=1e9,
        description="Lowest smoothed arrival (or, saturated, completion) rate at which a saturation or "
        "p99-high trigger latched on it, req/s.",
    )
    capacity_rps: float | None = Field(
        default=None,
        ge=0,
        le=1e9,
        description="The estimate the controller uses: predictedRps clamped into the measured bounds, "
        "req/s (informational; recomputed from the three above).",
    )
    updated_time: AwareDatetime | None = Field(default=None, description="When a bound last changed.")
    pending_low_rps: float | None = Field(
        default=None,
        ge=0,
        le=1e9,
        description="Least arrival rate of the current run of within-target samples above measuredLowRps; "
        "it becomes measuredLowRps after 60 s (the P99's window).",
    )
    pending_since: AwareDatetime | None = Field(default=None, description="When that run started.")


class ControlState(StatusModel):
    """The decision loop's persisted memory: EMA values, hysteresis streaks, raised thresholds."""

    capacity: list[GearCapacity] = Field(
        default_factory=list,
        max_length=MAX_GEARS,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["gear"]},
        description="Per gear: predicted and measured SLO capacity (the load-high / load-low triggers).",
    )

    ema: dict[str, float] = Field(
        default_factory=dict, max_length=64, description="Smoothed value per signal name."
    )
    streaks: dict[str, int] = Field(
        default_factory=dict, max_length=16, description="Consecutive samples each trigger has held."
    )
    threshold_steps: dict[str, int] = Field(
        default_factory=dict,
        max_length=16,
        description="Steps each trigger's threshold was raised by re-triggers inside the dwell.",
    )
    off_streaks: dict[str, int] = Field(
        default_factory=dict,
        max_length=16,
        description="Consecutive samples each trigger has not held (hysteresis on the way out).",
    )
    latched: list[str] = Field(
        default_factory=list, max_length=16, description="Triggers latched by hysteresis now."
    )
    dwell_until: AwareDatetime | None = Field(default=None, description="No shift before this time.")
    last_shift_time: AwareDatetime | None = Field(
        default=None, description="When the last shift was decided (the dwell counts from it)."
    )
    last_retrigger_time: AwareDatetime | None = Field(
        default=None,
        description="When a trigger last fired inside the dwell (raised thresholds reset "
        "one dwell after it).",
    )


class ScalingStatus(StatusModel):
    """The pipeline-replica autoscaler's report and memory (issue 12; ``PDService.spec.<role>.scaling``)."""

    desired_replicas: int | None = Field(default=None, ge=0, description="Pipeline replicas asked for.")
    ready_replicas: int | None = Field(default=None, ge=0, description="Pipeline replicas Ready.")
    last_decision: str | None = Field(
        default=None, max_length=64, description="Hold, ScaleUp or ScaleDown (the latest decision)."
    )
    last_reason: str | None = Field(default=None, max_length=128, description="CamelCase reason of it.")
    last_message: Message = Field(default="", description="Details of it.")
    last_scale_time: AwareDatetime | None = Field(default=None, description="When replicas last changed.")
    up_since: AwareDatetime | None = Field(default=None, description="Start of the scale-up window run.")
    up_floor: int | None = Field(default=None, ge=0, description="Lowest recommendation in that run.")
    down_since: AwareDatetime | None = Field(default=None, description="Start of the scale-down window run.")
    down_ceiling: int | None = Field(default=None, ge=0, description="Highest recommendation in that run.")
    idle_since: AwareDatetime | None = Field(default=None, description="Since when nothing runs or waits.")
    router_rejections: float | None = Field(
        default=None, ge=0, description="Router no-decode-headroom counter at the last read (its baseline)."
    )
    draining: list[str] = Field(
        default_factory=list, max_length=1024, description="Head pods being drained for a scale-down."
    )
    drain_target: int | None = Field(default=None, ge=0, description="Replicas the drain scales down to.")
    drain_started_at: AwareDatetime | None = Field(default=None, description="When the drain began.")
    placement: Message = Field(default="", description="Nodes the last scale-up expects its new pods on.")


class MaxBatchChange(StatusModel):
    """One change of the serving gear's effective max batch."""

    time: AwareDatetime = Field(description="When it changed.")
    from_value: int | None = Field(
        default=None, alias="from", ge=1, description="Effective max batch before (none: a new gear)."
    )
    to_value: int = Field(alias="to", ge=1, description="Effective max batch after.")
    reason: str = Field(max_length=128, description="CamelCase reason (ItlOverTarget, GearChanged, ...).")
    message: Message = Field(default="", description="Details: the router's proposal and its ITL.")
    pod: str | None = Field(
        default=None, max_length=253, description="Head pod whose cap changed (none: the whole gear)."
    )


class PodMaxBatch(StatusModel):
    """One head pod's adaptive max batch (its own ITL and backlog step it: seed 000's per-node rule)."""

    pod: str = Field(max_length=253, description="Head pod name.")
    effective: int = Field(ge=1, description="Max batch in force on this pod.")
    per_router: int = Field(ge=1, description="What each router replica lets this pod run at once.")
    last_change_time: AwareDatetime | None = Field(
        default=None, description="When this pod's value last changed (its cooldown counts from it)."
    )


class AdaptiveBatchStatus(StatusModel):
    """Seed 000's adaptive batch on the active gear (decode role; gearshift.control.adaptive_batch): the
    router caps each head pod's concurrent requests at that pod's own effective value (``pods``; annotation
    ``gearshift.io/max-batch``, divided among router replicas); the engines keep their ``--max-num-seqs``
    (``planned``), so no pod restarts and no request is dropped."""

    gear: str = Field(max_length=63, description="Gear the values are for (the active gear).")
    planned: int = Field(ge=1, description="The gear's maxBatch, the engine's own limit: the ceiling.")
    effective: int = Field(
        ge=1, description="Lowest max batch in force over the head pods (each pod's own value: pods)."
    )
    floor: int = Field(ge=1, description="Least effective value: max(1, microBatch, ceil(planned / 4)).")
    per_router: int = Field(
        ge=1, description="Requests each router replica keeps at once on the most capped head pod."
    )
    pods: list[PodMaxBatch] = Field(
        default_factory=list,
        max_length=256,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["pod"]},
        description="Each head pod's max batch (the annotation the router reads is its perRouter).",
    )
    last_decision: Literal["Lower", "Raise", "Hold", "Reset"] = Field(description="The latest decision.")
    last_reason: str = Field(max_length=128, description="CamelCase reason of it (Cooldown, AtFloor, ...).")
    last_message: Message = Field(default="", description="Details of it.")
    last_decision_time: AwareDatetime | None = Field(
        default=None,
        description="When the latest decision that changed this status was taken (a decision that repeats "
        "the previous one, every 5 s, is not written again).",
    )
    last_change_time: AwareDatetime | None = Field(
        default=None, description="When any head pod's value last changed."
    )
    history: list[MaxBatchChange] = Field(
        default_factory=list, max_length=10, description="Recent changes, oldest first; at most 10."
    )


class WindowedNode(StatusModel):
    """A time-limited node of this role (issue 13): its deadline, what runs on it, when work leaves it."""

    node: str = Field(max_length=253, description="Node name.")
    available_until: AwareDatetime = Field(description="When the node is reclaimed (its GPUProfile).")
    leave_by: AwareDatetime = Field(
        description="When work must leave it: availableUntil - windowMarginS - max(dwellS, warmS + "
        "drainTimeoutS + rollbackWindowS); from then on the planner leaves it out and the executor shifts "
        "the serving gear off it (trigger window)."
    )
    stages: list[Annotated[str, Field(max_length=128)]] = Field(
        default_factory=list,
        max_length=64,
        description="What runs on it: '<gear>/s<k>' of the planned gears (empty: nothing).",
    )
    state: Literal["InUse", "Unused", "Leaving", "Left"] = Field(
        default="Unused",
        description="InUse (a gear places work on it), Unused, Leaving (past leaveBy; the serving gear is "
        "being shifted off it), Left (past leaveBy, nothing on it).",
    )


class GearSetStatus(StatusModel):
    """Observed state of a GearSet: the gear status that `kubectl get gearsets` prints."""

    observed_generation: int | None = Field(
        default=None, description="metadata.generation this status was computed from."
    )
    phase: GearPhase | None = Field(default=None, description="Pending, Stable, Warming, Draining, ...")
    active_gear: str | None = Field(default=None, max_length=63, description="Gear serving traffic.")
    target_gear: str | None = Field(default=None, max_length=63, description="Gear being shifted to.")
    replicas: int | None = Field(
        default=None,
        ge=0,
        description="Ready pipeline replicas of the active gear (a replica is Ready when every stage has all "
        "its pods Ready; the scale subresource's status, compared with spec.replicas).",
    )
    ready_copies: int | None = Field(
        default=None,
        ge=0,
        description="Ready serving copies of the model in the active gear: the Ready pods of its narrowest "
        "stage (a copy needs every stage). A one-stage gear replicated 4x is 4 copies per pipeline "
        "replica. The same count as the PDService's status.<role>.readyReplicas and Ready message.",
    )
    desired_copies: int | None = Field(
        default=None,
        ge=0,
        description="Serving copies wanted: pods of the active gear's narrowest stage (spec.replicas x its "
        "stage replicas).",
    )
    ready: str | None = Field(
        default=None,
        max_length=32,
        description="readyCopies/desiredCopies, e.g. 4/4 (the READY column, as a Deployment shows it).",
    )
    selector: str | None = Field(
        default=None,
        max_length=1024,
        description="Label selector of the active gear's head pods, as a string (scale subresource).",
    )
    signals: GearSignals | None = Field(default=None, description="Last smoothed signals.")
    planned_gears: list[Gear] = Field(
        default_factory=list, max_length=MAX_GEARS, description="Gears the planner generated (mode auto)."
    )
    profiles_hash: str | None = Field(
        default=None, max_length=128, description="Fingerprint of the GPUProfiles the plan used."
    )
    gear_health: list[GearHealth] = Field(
        default_factory=list,
        max_length=MAX_GEARS,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["gear"]},
        description="Health mark per gear.",
    )
    history: list[ShiftRecord] = Field(
        default_factory=list,
        max_length=MAX_HISTORY,
        description=f"Recent shifts, oldest first; at most {MAX_HISTORY} (the oldest are dropped).",
    )
    executor: ExecutorState | None = Field(default=None, description="Persisted executor state.")
    control: ControlState | None = Field(default=None, description="Persisted decision-loop state.")
    scaling: ScalingStatus | None = Field(default=None, description="Pipeline-replica autoscaler (issue 12).")
    adaptive_batch: AdaptiveBatchStatus | None = Field(
        default=None, description="Adaptive max batch of the active gear (seed 000; decode role)."
    )
    autoscaled: bool | None = Field(
        default=None,
        description="Whether the PDService has a scaling section for this role (written by the reconciler; "
        "the autoscaler samples only then).",
    )
    windowed_nodes: list[WindowedNode] = Field(
        default_factory=list,
        max_length=1024,
        description="Time-limited nodes this role may plan on (issue 13): deadline, stages, leave-by time.",
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=MAX_CONDITIONS,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
        description="Ready, Placed, Progressing, Degraded, Planned, SignalsAvailable.",
    )


class GearSet(StatusModel):
    """A whole GearSet object: ``metadata`` stays a plain mapping (kopf's body), spec and status typed."""

    api_version: ApiVersion = Field(default=API_VERSION, description="API version.")
    kind: Literal["GearSet"] = Field(default="GearSet", description="Kind.")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Object metadata.")
    spec: GearSetSpec = Field(description="Desired state.")
    status: GearSetStatus = Field(default_factory=GearSetStatus, description="Observed state.")

    def gears(self) -> list[Gear]:
        """The gears in force: ``spec.gears`` (explicit) or ``status.plannedGears`` (auto)."""
        return list(self.spec.gears) if self.spec.mode == "explicit" else list(self.status.planned_gears)
