"""The GearSet kind: the gears of one role of a PDService, how to plan them, and the GearSet root.

A *gear* is one complete pipeline configuration: contiguous stages of layers ``[start, end)`` with
unequal layer counts but equal expected time, per-stage replicas, micro-batch and max batch, and the QPS
range and target latency it suits (docs/sources.md#gears). ``mode: explicit`` lists gears by hand; ``mode:
auto`` lets the planner generate them from the GPUProfiles into ``status.plannedGears``.

The rest of the kind lives beside this module: the shifting policy ``spec.policy`` in
:mod:`gearshift.api.shift_policy`, the planner's constraints and workload in
:mod:`gearshift.api.gearset_plan`, the parts of the status in :mod:`gearshift.api.gearset_status`.

Every cross-field rule is written twice, here as a pydantic validator and in :data:`CEL` below as an
``x-kubernetes-validations`` rule of the CRD; the e2e agreement test holds the two to the same answer.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

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
    NodeName,
    Selector,
    SpecModel,
    StatusModel,
)
from gearshift.api.gearset_plan import PlanConstraints, Workload
from gearshift.api.gearset_status import (
    AdaptiveBatchStatus,
    ControlState,
    ExecutorState,
    GearHealth,
    GearPhase,
    GearSignals,
    ScalingStatus,
    ShiftRecord,
    WindowedNode,
)
from gearshift.api.shift_policy import ShiftPolicy

Role = Literal["prefill", "decode", "both"]
GearIntent = Literal["latency", "balanced", "throughput"]
GearSetMode = Literal["auto", "explicit"]

GEAR_INTENTS: tuple[GearIntent, ...] = ("latency", "balanced", "throughput")

#: A gear name: a DNS label short enough for ``<pds>-<role>-<gear>-s<k>`` StatefulSet names.
GearName = Annotated[str, Field(min_length=1, max_length=MAX_GEAR_NAME, pattern=DNS_LABEL_PATTERN)]
#: A layer index of the model, 0-based.
LayerIndex = Annotated[int, Field(ge=0, le=100000)]
#: Requests per second.
Qps = Annotated[float, Field(ge=0, le=1e7)]

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
        description="Pods of this stage per pipeline replica; more than 1 replicates a hot stage "
        "(docs/sources.md#gears).",
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
    """What the planner's simulator expects of a gear; online measurements correct it
    (docs/sources.md#planner)."""

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
    prompt_tokens_per_s: float | None = Field(
        default=None,
        gt=0,
        le=1e12,
        description="Prompt tokens/s the gear prefills when its requests cost nothing else: with "
        "outputTokensPerS, a request of p prompt and o output tokens keeps it busy p/promptTokensPerS + "
        "o/outputTokensPerS seconds, so it serves 1/(that) requests/s of the mix the router measures (a "
        "linear fit to the planner's cost model around spec.plan.workload).",
    )
    output_tokens_per_s: float | None = Field(
        default=None,
        gt=0,
        le=1e12,
        description="Output tokens/s the gear decodes when its requests cost nothing else (see "
        "promptTokensPerS).",
    )
    ttft_ms_per_prompt_token: float | None = Field(
        default=None,
        gt=0,
        le=1e6,
        description="Unloaded time to first token per prompt token on the gear's fastest cards, ms: a prompt "
        "of p tokens sees its first token no sooner than p x this on this gear.",
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
    """One complete pipeline configuration (FlexPipe's 'gear', docs/sources.md#gears)."""

    model_config = ConfigDict(json_schema_extra=_cel("Gear"))

    name: GearName = Field(
        description=f"Gear name, a DNS label of at most {MAX_GEAR_NAME} characters (it is part of the "
        "StatefulSet names <pds>-<role>-<gear>-s<k>).",
    )
    intent: GearIntent = Field(
        default="balanced",
        description="What the gear is for: latency (2-4 stages, micro-batch 1-4), balanced (4-8, 4-8) or "
        "throughput (8-12, 8-16) (docs/sources.md#gears); triggers pick gears by intent.",
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
        description=(
            "Manual override: shift to this gear and stay there, whatever the signals say. Without a "
            "Prometheus URL it shifts with no signal; while a configured Prometheus gives no sample it waits."
        ),
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
    scaling: ScalingStatus | None = Field(default=None, description="Pipeline-replica autoscaler.")
    adaptive_batch: AdaptiveBatchStatus | None = Field(
        default=None,
        description="Adaptive max batch of the active gear (docs/sources.md#adaptive-batch; decode role).",
    )
    autoscaled: bool | None = Field(
        default=None,
        description="Whether the PDService has a scaling section for this role (written by the reconciler; "
        "the autoscaler samples only then).",
    )
    windowed_nodes: list[WindowedNode] = Field(
        default_factory=list,
        max_length=1024,
        description="Time-limited nodes this role may plan on: deadline, stages, leave-by time.",
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
