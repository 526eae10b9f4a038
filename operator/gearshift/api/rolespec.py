"""One role of a PDService (``spec.prefill``, ``spec.decode`` or ``spec.serving``): the GearSet that holds its
gears and, optionally, its pipeline-replica autoscaling (targets and stabilisation windows).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from gearshift.api.common import DnsLabel, SpecModel

#: CRD rules per model (see :mod:`gearshift.api.gearset` for the convention, ``messageExpression`` too).
CEL: dict[str, list[dict[str, str]]] = {
    "ScalingSpec": [
        {
            "rule": "self.minReplicas <= self.maxReplicas",
            "message": "scaling.minReplicas must be <= scaling.maxReplicas",
            "messageExpression": "'scaling.minReplicas (%d) must be <= scaling.maxReplicas (%d)'"
            ".format([self.minReplicas, self.maxReplicas])",
            "fieldPath": ".minReplicas",
        },
    ],
}


def _cel(name: str) -> dict[str, Any]:
    return {"x-kubernetes-validations": CEL[name]}


class GearSetRef(SpecModel):
    """Reference to a GearSet in the PDService's namespace."""

    name: DnsLabel = Field(description="GearSet name.")


class ScalingTargets(SpecModel):
    """What the autoscaler keeps each pipeline replica at."""

    kv_cache_usage: float = Field(
        default=0.8,
        gt=0,
        le=1,
        description="KV-cache usage per replica to scale at (vllm:kv_cache_usage_perc).",
    )
    waiting_per_replica: float = Field(
        default=4.0, ge=0, le=1e6, description="Waiting requests per replica to scale at."
    )
    slo_ratio: float = Field(
        default=1.0,
        gt=0,
        le=100,
        description="Scale up when the role's P99 (TTFT prefill, ITL decode) exceeds this x its SLO "
        "(beyond the 10% tolerance), and do not scale down while it is within 10% of it.",
    )
    decode_headroom_factor: float = Field(
        default=1.2,
        ge=1,
        le=100,
        description="A decode node needs free memory >= this x a request's KV cache, else scale up "
        "(docs/sources.md#decode-headroom: 1.2).",
    )


class ScalingWindows(SpecModel):
    """Stabilisation windows of the autoscaler, s."""

    scale_up_s: float = Field(default=30.0, ge=0, le=86400, description="Signals must hold this long to add.")
    scale_down_s: float = Field(
        default=300.0, ge=0, le=86400, description="Signals must hold this long to remove."
    )
    scale_to_min_delay_s: float = Field(
        default=600.0, ge=0, le=86400, description="Idle time before dropping to minReplicas."
    )


class ScalingSpec(SpecModel):
    """Pipeline-replica autoscaling of one role; absent: replicas stay as the GearSet says."""

    model_config = ConfigDict(json_schema_extra=_cel("ScalingSpec"))

    # At least 1: with no pod of a role the router has nothing to hold a request on and the autoscaler no
    # signal to wake it (scale to zero needs an activator, not built); a GearSet's spec.replicas may still
    # be set to 0 by hand.
    min_replicas: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="Fewest pipeline replicas (at least 1: scale to zero is not supported; set the "
        "GearSet's spec.replicas to 0 by hand to stop a role).",
    )
    max_replicas: int = Field(ge=1, le=1024, description="Most pipeline replicas.")
    targets: ScalingTargets = Field(default_factory=ScalingTargets, description="What to scale on.")
    windows: ScalingWindows = Field(default_factory=ScalingWindows, description="Stabilisation windows.")
    compute_classes: list[Literal["high", "mid", "low"]] = Field(
        default_factory=list,
        max_length=3,
        json_schema_extra={"x-kubernetes-list-type": "set"},
        description="Compute classes new replicas may use (GPUProfile computeClass); empty: any.",
    )

    @model_validator(mode="after")
    def _check_scaling(self) -> ScalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"scaling.minReplicas ({self.min_replicas}) must be <= scaling.maxReplicas "
                f"({self.max_replicas})"
            )
        if len(set(self.compute_classes)) != len(self.compute_classes):
            raise ValueError(f"scaling.computeClasses: duplicate values in {self.compute_classes}")
        return self


class RoleSpec(SpecModel):
    """One role of the service: prefill or decode (disaggregated), or serving (aggregated)."""

    gear_set_ref: GearSetRef = Field(description="The GearSet with this role's gears.")
    scaling: ScalingSpec | None = Field(default=None, description="Pipeline-replica autoscaling.")
