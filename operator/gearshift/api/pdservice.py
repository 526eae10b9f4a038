"""The PDService kind: a served model split into prefill and decode roles, each backed by a GearSet,
plus the router in front of them (PD disaggregation, docs/sources.md#pd-scheduling) -- or, aggregated, one
``serving`` GearSet of role ``both`` whose pipelines run each request's prefill and decode (FlexPipe,
docs/sources.md#flexpipe).

The two shapes, checked at ``kubectl apply`` (CEL) and by :class:`PDServiceSpec` (pydantic):

- disaggregated: ``spec.prefill`` and ``spec.decode``, GearSets of role ``prefill`` and ``decode``, the
  KV cache moved from one to the other (vLLM's NIXL connector);
- aggregated: ``spec.serving`` alone, a GearSet of role ``both``; no KV transfer, so vLLM runs its
  gears as pipelines of any depth (a decode under NIXL is one stage). As KServe's LLMInferenceService
  makes ``prefill`` optional and llm-d labels such pods ``both``: the section says what the GearSet
  does for the service (it serves), the role what its engines run (both phases); :data:`ROLE_SECTIONS`
  is the one place that maps one to the other.

The model is given either by its architecture numbers or by an inline Hugging Face ``config.json``
(``hfConfig``); :meth:`ModelSpec.to_model_arch` turns both into :class:`gearshift.facts.model.ModelArch`.
Router weights default to the PD guide's (docs/sources.md#prefill-score): prefill score = 0.30 compute + 0.25
load + 0.20 queue + 0.15 network + 0.10 cache; decode score = 0.35 ITL + 0.25 memory + 0.20 batch + 0.15
bandwidth + 0.05 network.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AwareDatetime, ConfigDict, Field, model_validator

from gearshift.api.common import (
    API_VERSION,
    MAX_CONDITIONS,
    MAX_SERVICE_NAME,
    ApiVersion,
    Condition,
    Message,
    SpecModel,
    StatusModel,
)
from gearshift.api.enginespec import (
    MAX_ENGINE_ARGS,
    EngineArg,
    EngineResources,
    HFTokenSecret,
    ModelCache,
    check_engine_args,
)
from gearshift.api.modelspec import ModelSpec
from gearshift.api.rolespec import RoleSpec
from gearshift.api.routerspec import RouterSpec
from gearshift.facts.model import KV_LEASE_S

Engine = Literal["vllm", "sim"]
#: The GearSet role of aggregated serving (``spec.serving``): prefill and decode on the same engines.
AGGREGATED_ROLE = "both"
#: The spec (and status) section of each GearSet role.
ROLE_SECTIONS: dict[str, str] = {"prefill": "prefill", "decode": "decode", AGGREGATED_ROLE: "serving"}
#: The roles of each serving shape, in the order the operator handles them.
DISAGGREGATED_ROLES: tuple[str, ...] = ("prefill", "decode")
AGGREGATED_ROLES: tuple[str, ...] = (AGGREGATED_ROLE,)
ServicePhase = Literal["Pending", "Progressing", "Ready", "Degraded", "Failed"]
KvBufferDevice = Literal["cuda", "cpu"]

#: The refusals of a PDService that mixes or lacks the two serving shapes (CEL and pydantic say the same).
_MIXED_SHAPES = (
    "spec.serving (aggregated: one GearSet of role both runs prefill and decode) excludes spec.prefill and "
    "spec.decode (disaggregated PD); keep spec.serving alone, or remove it and keep spec.prefill and "
    "spec.decode"
)
_NO_SHAPE = (
    "give spec.prefill and spec.decode (disaggregated PD: GearSets of role prefill and decode) or "
    "spec.serving alone (aggregated: one GearSet of role both)"
)


#: CRD rules per model (see :mod:`gearshift.api.gearset` for the convention, ``messageExpression`` too).
CEL: dict[str, list[dict[str, str]]] = {
    "PDServiceSpec": [
        {
            "rule": "!has(self.serving) || (!has(self.prefill) && !has(self.decode))",
            "message": _MIXED_SHAPES,
            "fieldPath": ".serving",
            "reason": "FieldValueForbidden",
        },
        {
            "rule": "has(self.serving) || (has(self.prefill) && has(self.decode))",
            "message": _NO_SHAPE,
            "reason": "FieldValueRequired",
        },
        {
            "rule": "!has(self.prefill) || !has(self.decode) "
            "|| self.prefill.gearSetRef.name != self.decode.gearSetRef.name",
            "message": "decode.gearSetRef.name must differ from prefill.gearSetRef.name: a GearSet serves "
            "one role",
            "messageExpression": "'decode.gearSetRef.name must differ from prefill.gearSetRef.name (both "
            "are %s): a GearSet serves one role'.format([self.decode.gearSetRef.name])",
            "fieldPath": ".decode.gearSetRef.name",
        },
    ],
    "PDService": [
        {
            "rule": f"size(self.metadata.name) <= {MAX_SERVICE_NAME}",
            "message": f"metadata.name must be at most {MAX_SERVICE_NAME} characters (it prefixes the "
            "StatefulSet names <pds>-<role>-<gear>-s<k>)",
            "messageExpression": f"'metadata.name must be at most {MAX_SERVICE_NAME} characters (it prefixes "
            "the StatefulSet names <pds>-<role>-<gear>-s<k>); %s has %d'"
            ".format([self.metadata.name, size(self.metadata.name)])",
        },
    ],
}


def _cel(name: str) -> dict[str, Any]:
    return {"x-kubernetes-validations": CEL[name]}


class SLOSpec(SpecModel):
    """Service-level objectives; goodput counts requests that meet both."""

    ttft_ms: float = Field(
        default=200.0,
        gt=0,
        le=1e6,
        description="Time-to-first-token target, ms (docs/sources.md#slo-targets).",
    )
    itl_ms: float = Field(
        default=50.0,
        gt=0,
        le=1e6,
        description="Inter-token latency target, ms (docs/sources.md#slo-targets).",
    )


class PDServiceSpec(SpecModel):
    """Desired state of a PDService."""

    model_config = ConfigDict(json_schema_extra=_cel("PDServiceSpec"))

    model: ModelSpec = Field(description="The served model.")
    engine: Engine = Field(default="vllm", description="vllm on real GPUs, sim for the simulated fleet.")
    image: str | None = Field(
        default=None,
        max_length=512,
        description="Engine image; unset: the operator's default for the engine.",
    )
    prefill: RoleSpec | None = Field(
        default=None,
        description="The prefill role (disaggregated serving, with decode): a GearSet of role prefill.",
    )
    decode: RoleSpec | None = Field(
        default=None,
        description="The decode role (disaggregated serving, with prefill): a GearSet of role decode.",
    )
    serving: RoleSpec | None = Field(
        default=None,
        description="Aggregated serving, instead of prefill and decode: a GearSet of role both whose "
        "pipelines run each request's prefill and decode on the same engines (no KV transfer; on vLLM "
        "its gears may have several stages). Choose it when the model does not fit decode's cards, or "
        "when prefill and decode share the same cards anyway.",
    )
    router: RouterSpec = Field(default_factory=RouterSpec, description="Request router.")
    slo: SLOSpec = Field(default_factory=SLOSpec, description="Latency targets.")
    prometheus_url: str | None = Field(
        default=None,
        max_length=2048,
        pattern=r"^https?://[^\s]+$",
        description="Prometheus base URL for signals; unset: the operator's --prometheus-url.",
    )
    engine_args: list[EngineArg] = Field(
        default_factory=list,
        max_length=MAX_ENGINE_ARGS,
        description="Extra `vllm serve` arguments appended after the operator's (engine vllm only), e.g. "
        "[--enforce-eager]. Flags the operator sets itself are refused: --host, --port, "
        "--served-model-name, --model, --tensor-parallel-size, --pipeline-parallel-size, --nnodes, "
        "--node-rank, --master-addr, --master-port, --headless, --distributed-executor-backend, "
        "--kv-transfer-config, --dtype, --max-num-seqs, --max-num-batched-tokens, --gpu-memory-utilization.",
    )
    kv_buffer_device: KvBufferDevice = Field(
        default="cuda",
        description="NixlConnector kv_buffer_device of prefill and decode engines: cuda (KV transferred "
        "from GPU memory) or cpu (staged in host memory; what vLLM on CPUs, e.g. the sandbox, needs).",
    )
    kv_lease_s: int = Field(
        default=KV_LEASE_S,
        ge=10,
        le=3600,
        description="Seconds a prefill engine holds a finished request's KV for its decode engine "
        "(NixlConnector kv_lease_duration). The router hands the decode leg to a live decode pod within "
        "half of it, else the decode pod computes the prompt itself: a decode never reads KV the prefill "
        "has freed. Raise it when decode pods queue requests for longer.",
    )
    hf_token_secret: HFTokenSecret | None = Field(
        default=None, description="Secret with a Hugging Face token (env HF_TOKEN) for gated models."
    )
    model_cache: ModelCache | None = Field(
        default=None,
        description="Volume for the Hugging Face cache, shared by every gear; unset: each pod downloads "
        "into its own container filesystem.",
    )
    resources: EngineResources | None = Field(
        default=None, description="CPU and memory requests of the vLLM engine containers."
    )

    @property
    def aggregated(self) -> bool:
        """Served by one ``serving`` GearSet of role ``both`` (no prefill/decode split)."""
        return self.serving is not None

    @property
    def roles(self) -> tuple[str, ...]:
        """The GearSet roles of this service: ``("both",)`` aggregated, else ``("prefill", "decode")``."""
        return AGGREGATED_ROLES if self.aggregated else DISAGGREGATED_ROLES

    def role_spec(self, role: str) -> RoleSpec:
        """The section of GearSet role ``role`` (``both``: ``serving``).

        Raises:
            KeyError: the service has no such role (``both`` of a disaggregated one, and vice versa).
        """
        section: RoleSpec | None = getattr(self, ROLE_SECTIONS[role])
        if section is None:
            raise KeyError(f"spec.{ROLE_SECTIONS[role]} is not set: the service has roles {self.roles}")
        return section

    @model_validator(mode="after")
    def _distinct_roles(self) -> PDServiceSpec:
        check_engine_args(self.engine_args)
        if self.serving is not None:
            if self.prefill is not None or self.decode is not None:
                raise ValueError(_MIXED_SHAPES)
            return self
        if self.prefill is None or self.decode is None:
            raise ValueError(_NO_SHAPE)
        if self.prefill.gear_set_ref.name == self.decode.gear_set_ref.name:
            raise ValueError(
                f"decode.gearSetRef.name ({self.decode.gear_set_ref.name!r}) must differ from "
                "prefill.gearSetRef.name: a GearSet serves one role"
            )
        return self


class RoleStatus(StatusModel):
    """Observed state of one role."""

    gear_set: str | None = Field(default=None, max_length=253, description="GearSet name.")
    active_gear: str | None = Field(default=None, max_length=63, description="Gear serving the role.")
    ready_replicas: int = Field(
        default=0,
        ge=0,
        description="Ready serving copies of the model in the active gear: Ready pods of its narrowest stage "
        "(a copy needs every stage); the GearSet's status.readyCopies.",
    )
    desired_replicas: int = Field(
        default=0, ge=0, description="Serving copies wanted: pods of the active gear's narrowest stage."
    )
    last_scale_time: AwareDatetime | None = Field(default=None, description="When replicas last changed.")
    last_scale_reason: str | None = Field(
        default=None, max_length=1024, description="Why replicas last changed."
    )


class PDServiceStatus(StatusModel):
    """Observed state of a PDService."""

    observed_generation: int | None = Field(
        default=None, description="metadata.generation this status was computed from."
    )
    phase: ServicePhase | None = Field(
        default=None, description="Pending, Progressing, Ready, Degraded, Failed."
    )
    prefill: RoleStatus | None = Field(default=None, description="The prefill role.")
    decode: RoleStatus | None = Field(default=None, description="The decode role.")
    serving: RoleStatus | None = Field(default=None, description="The serving role (aggregated).")
    router_ready: bool | None = Field(default=None, description="The router Deployment is available.")
    endpoint: str | None = Field(default=None, max_length=1024, description="Client Service host:port.")
    message: Message | None = Field(default=None, description="Last error or note.")
    window_leave_by: AwareDatetime | None = Field(
        default=None,
        description="Earliest leaveBy of a time-limited node in use (GearSet status.windowedNodes "
        "lists them); the operator re-plans without the node then.",
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=MAX_CONDITIONS,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
        description="Ready, Placed, Progressing, Degraded, ScalingActive.",
    )


class PDService(StatusModel):
    """A whole PDService object: ``metadata`` stays a plain mapping (kopf's body), spec and status typed."""

    api_version: ApiVersion = Field(default=API_VERSION, description="API version.")
    kind: Literal["PDService"] = Field(default="PDService", description="Kind.")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Object metadata.")
    spec: PDServiceSpec = Field(description="Desired state.")
    status: PDServiceStatus = Field(default_factory=PDServiceStatus, description="Observed state.")

    @model_validator(mode="after")
    def _name_length(self) -> PDService:
        name = str(self.metadata.get("name", ""))
        if len(name) > MAX_SERVICE_NAME:
            raise ValueError(
                f"metadata.name {name!r} must be at most {MAX_SERVICE_NAME} characters (it prefixes the "
                "StatefulSet names <pds>-<role>-<gear>-s<k>)"
            )
        return self
