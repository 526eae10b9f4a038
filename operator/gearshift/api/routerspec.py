"""A PDService's ``spec.router``: the pick policy, the router's replicas and image, and the weights of seed
000's PD node scores (prefill score = 0.30 compute + 0.25 load + 0.20 queue + 0.15 network + 0.10 cache;
decode score = 0.35 ITL + 0.25 memory + 0.20 batch + 0.15 bandwidth + 0.05 network), which sum to 1.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from gearshift.api.common import SpecModel

RouterPolicy = Literal[
    "pd-score", "shortest-queue", "lottery", "round-robin", "power-of-two", "least-request"
]

#: Weights must sum to 1 within this tolerance (the same bound in pydantic and CEL).
WEIGHT_SUM_LOW = 0.999
WEIGHT_SUM_HIGH = 1.001

#: The weight sums the router.weights rules check (CEL expressions).
_PREFILL_SUM = "self.compute + self.load + self.queue + self.network + self.cache"
_DECODE_SUM = "self.itl + self.memory + self.batch + self.bandwidth + self.network"


#: CRD rules per model (see :mod:`gearshift.api.gearset` for the convention, ``messageExpression`` too).
CEL: dict[str, list[dict[str, str]]] = {
    "PrefillWeights": [
        {
            "rule": f"{_PREFILL_SUM} >= {WEIGHT_SUM_LOW} && {_PREFILL_SUM} <= {WEIGHT_SUM_HIGH}",
            "message": "router.weights.prefill: compute + load + queue + network + cache must sum to 1",
            "messageExpression": "'router.weights.prefill: compute + load + queue + network + cache must "
            "sum to 1; got %s'"
            f".format([{_PREFILL_SUM}])",
        },
    ],
    "DecodeWeights": [
        {
            "rule": f"{_DECODE_SUM} >= {WEIGHT_SUM_LOW} && {_DECODE_SUM} <= {WEIGHT_SUM_HIGH}",
            "message": "router.weights.decode: itl + memory + batch + bandwidth + network must sum to 1",
            "messageExpression": "'router.weights.decode: itl + memory + batch + bandwidth + network must "
            "sum to 1; got %s'"
            f".format([{_DECODE_SUM}])",
        },
    ],
}


def _cel(name: str) -> dict[str, Any]:
    return {"x-kubernetes-validations": CEL[name]}


def _weight(default: float, what: str) -> Any:
    return Field(
        default=default, ge=0, le=1, description=f"{what} (default {default}, docs/sources.md#pd-scheduling)."
    )


class PrefillWeights(SpecModel):
    """Weights of the PD guide's prefill node score (docs/sources.md#prefill-score); they sum to 1."""

    model_config = ConfigDict(json_schema_extra=_cel("PrefillWeights"))

    compute: float = _weight(0.30, "GPU compute prior x sqrt(gpu count)")
    load: float = _weight(0.25, "Headroom from 0.6 GPU util + 0.4 memory util")
    queue: float = _weight(0.20, "Short queue")
    network: float = _weight(0.15, "KV transfer time vs 100 ms")
    cache: float = _weight(0.10, "Model or prefix already cached")

    @model_validator(mode="after")
    def _sum(self) -> PrefillWeights:
        total = self.compute + self.load + self.queue + self.network + self.cache
        if not WEIGHT_SUM_LOW <= total <= WEIGHT_SUM_HIGH:
            raise ValueError(
                "router.weights.prefill: compute + load + queue + network + cache must sum to 1, "
                f"got {total:g}"
            )
        return self


class DecodeWeights(SpecModel):
    """Weights of the PD guide's decode node score (docs/sources.md#prefill-score); they sum to 1."""

    model_config = ConfigDict(json_schema_extra=_cel("DecodeWeights"))

    itl: float = _weight(0.35, "ITL vs the 50 ms target")
    memory: float = _weight(0.25, "Free memory for the request's KV cache")
    batch: float = _weight(0.20, "Batch near 70% of max")
    bandwidth: float = _weight(0.15, "HBM bandwidth")
    network: float = _weight(0.05, "KV transfer from the prefill node")

    @model_validator(mode="after")
    def _sum(self) -> DecodeWeights:
        total = self.itl + self.memory + self.batch + self.bandwidth + self.network
        if not WEIGHT_SUM_LOW <= total <= WEIGHT_SUM_HIGH:
            raise ValueError(
                "router.weights.decode: itl + memory + batch + bandwidth + network must sum to 1, "
                f"got {total:g}"
            )
        return self


class RouterWeights(SpecModel):
    """Weights of the pd-score policy per role."""

    prefill: PrefillWeights = Field(default_factory=PrefillWeights, description="Prefill score weights.")
    decode: DecodeWeights = Field(default_factory=DecodeWeights, description="Decode score weights.")


class RouterSpec(SpecModel):
    """The router that picks a prefill and a decode pod per request."""

    policy: RouterPolicy = Field(
        default="pd-score",
        description="pd-score (docs/sources.md#prefill-score), shortest-queue (FastChat's default, "
        "docs/sources.md#lottery), lottery (docs/sources.md#lottery), "
        "round-robin, power-of-two, least-request.",
    )
    weights: RouterWeights = Field(default_factory=RouterWeights, description="pd-score weights.")
    replicas: int = Field(default=1, ge=1, le=64, description="Router pods.")
    image: str | None = Field(
        default=None, max_length=512, description="Router image; unset: the operator's."
    )
