"""What a GearSet's planner is told (``spec.plan`` with ``mode: auto``): the limits it must respect
(:class:`PlanConstraints`) and the request shape it prices a gear's capacity with (:class:`Workload`).

:class:`gearshift.api.gearset.AutoPlan` holds both, beside the intents to generate.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import ConfigDict, Field, model_validator

from gearshift.api.common import MAX_STAGES, NodeName, Selector, SpecModel
from gearshift.facts.model import VLLM_GPU_MEMORY_UTILIZATION

#: A gearshift.facts.gpus model name (e.g. H100-80GB).
GpuModelName = Annotated[str, Field(min_length=1, max_length=64)]

#: Rules of the CRD, per model, as ``x-kubernetes-validations`` entries; read by :mod:`gearshift.api.crdgen`.
CEL: dict[str, list[dict[str, str]]] = {
    "PlanConstraints": [
        {
            "rule": "!has(self.minStages) || !has(self.maxStages) || self.minStages <= self.maxStages",
            "message": "minStages must be <= maxStages",
            "messageExpression": "'minStages (%d) must be <= maxStages (%d)'"
            ".format([self.minStages, self.maxStages])",
            "fieldPath": ".minStages",
        },
    ],
}


def _cel(name: str) -> dict[str, Any]:
    return {"x-kubernetes-validations": CEL[name]}


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
        "(docs/sources.md#link-cap: 70%).",
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
