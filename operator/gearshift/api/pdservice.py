"""The PDService kind: a served model split into prefill and decode roles, each backed by a GearSet,
plus the router in front of them (seed 000's PD disaggregation) -- or, aggregated, one ``serving``
GearSet of role ``both`` whose pipelines run each request's prefill and decode (seed 002's FlexPipe).

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
Router weights default to seed 000's: prefill score = 0.30 compute + 0.25 load + 0.20 queue + 0.15
network + 0.10 cache; decode score = 0.35 ITL + 0.25 memory + 0.20 batch + 0.15 bandwidth + 0.05 network.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AwareDatetime, ConfigDict, Field, ValidationError, model_validator

from gearshift.api.common import (
    API_VERSION,
    MAX_CONDITIONS,
    MAX_SERVICE_NAME,
    ApiVersion,
    Condition,
    DnsLabel,
    Message,
    SpecModel,
    StatusModel,
)
from gearshift.facts.model import DTYPE_BYTES, KV_LEASE_S, ModelArch, ModelConfigError, arch_from_hf_config

Engine = Literal["vllm", "sim"]
#: The GearSet role of aggregated serving (``spec.serving``): prefill and decode on the same engines.
AGGREGATED_ROLE = "both"
#: The spec (and status) section of each GearSet role.
ROLE_SECTIONS: dict[str, str] = {"prefill": "prefill", "decode": "decode", AGGREGATED_ROLE: "serving"}
#: The roles of each serving shape, in the order the operator handles them.
DISAGGREGATED_ROLES: tuple[str, ...] = ("prefill", "decode")
AGGREGATED_ROLES: tuple[str, ...] = (AGGREGATED_ROLE,)
RouterPolicy = Literal[
    "pd-score", "shortest-queue", "lottery", "round-robin", "power-of-two", "least-request"
]
Dtype = Literal["bfloat16", "float16", "float32", "float8_e4m3fn", "fp8", "int8"]
ServicePhase = Literal["Pending", "Progressing", "Ready", "Degraded", "Failed"]
KvBufferDevice = Literal["cuda", "cpu"]

#: A Kubernetes resource quantity (``k8s.io/apimachinery`` resource.Quantity's regular expression).
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)"
    r"|(\.[0-9]+))))?$"
)
#: A DNS subdomain (Secret and PersistentVolumeClaim names).
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
#: A Secret data key (``k8s.io/apimachinery`` IsConfigMapKey).
SECRET_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"
#: Bounds of ``spec.engineArgs`` (they also keep the CRD's CEL cost finite).
MAX_ENGINE_ARGS = 64
MAX_ENGINE_ARG_LENGTH = 256

#: ``vllm serve`` flags the operator writes itself, with where the value comes from (the fix a refusal
#: names). Flag names as vLLM 0.32's parser spells them (``vllm/engine/arg_utils.py`` EngineArgs;
#: ``vllm/entrypoints/launchers/cli_args.py`` for ``--headless`` and FrontendArgs' ``--host``/``--port``);
#: vLLM also reads ``_`` for ``-`` in names, ``--flag=value``, dotted ``--flag.key value`` for JSON flags
#: (``vllm/utils/argparse_utils.py``) and unambiguous abbreviations (argparse ``allow_abbrev``).
#: tests/unit/test_vllm_args.py checks every name against vLLM's parser.
OPERATOR_OWNED_FLAGS: dict[str, str] = {
    "--host": "the pod IP (env GEARSHIFT_POD_IP from the downward API)",
    "--port": "the engine port 8000 the Services, probes and Prometheus annotations use",
    "--served-model-name": "spec.model.name",
    "--model": "spec.model.name (the positional model of `vllm serve`)",
    "--tensor-parallel-size": "the gear's stages[].gpus",
    "--pipeline-parallel-size": "the number of stages of the gear",
    "--nnodes": "the number of stages of the gear (one pod per stage)",
    "--node-rank": "the pod's stage index",
    "--master-addr": "the head pod's DNS name through the gear's headless Service",
    "--master-port": "the operator's rendezvous port 29500",
    "--headless": "stages k > 0 of a multi-stage gear",
    "--distributed-executor-backend": "mp, the multi-node backend the operator runs without Ray",
    "--kv-transfer-config": "the role (prefill: kv_producer, decode: kv_consumer) and spec.kvBufferDevice",
    "--dtype": "spec.model.dtype, pinned per pipeline (float16 on a pipeline with a card lacking bfloat16)",
    "--max-num-seqs": "the gear's maxBatch (GearSet spec.gears[].maxBatch)",
    "--max-num-batched-tokens": "the gear's microBatch x 2048 (GearSet spec.gears[].microBatch)",
    "--gpu-memory-utilization": "the GearSet's spec.plan.constraints.memoryUtilization",
}
#: Short aliases vLLM 0.32 gives some of them (``vllm/engine/arg_utils.py``).
OPERATOR_OWNED_SHORT_FLAGS: dict[str, str] = {
    "-tp": "--tensor-parallel-size",
    "-pp": "--pipeline-parallel-size",
    "-n": "--nnodes",
    "-r": "--node-rank",
}
#: The same refusal as a regular expression for the CRD (RE2): exact names with ``_`` read as ``-``,
#: ``=value`` and dotted sub-keys; the operator's validator also refuses abbreviations.
_OWNED_RE = (
    "^(--("
    + "|".join(f.removeprefix("--") for f in OPERATOR_OWNED_FLAGS)
    + ")([=.].*)?|-("
    + "|".join(f.removeprefix("-") for f in OPERATOR_OWNED_SHORT_FLAGS)
    + ")([=0-9].*)?)$"
)


def owned_flag(arg: str) -> str | None:
    """The operator-owned ``vllm serve`` flag ``arg`` sets, or None (a value or another flag).

    Reads ``arg`` as vLLM's FlexibleArgumentParser does (``vllm/utils/argparse_utils.py``): the name is
    what lies between ``--`` and the first ``=`` or ``.``, with ``_`` read as ``-``; a strict prefix of an
    owned flag counts (argparse resolves unambiguous abbreviations, and refuses ambiguous ones anyway).
    """
    if arg.startswith("--"):
        name = "--" + arg[2:].split("=", 1)[0].split(".", 1)[0].replace("_", "-")
        if name in OPERATOR_OWNED_FLAGS:
            return name
        if len(name) > 2:
            hits = [f for f in OPERATOR_OWNED_FLAGS if f.startswith(name)]
            if hits:
                return hits[0]
        return None
    for short, flag in OPERATOR_OWNED_SHORT_FLAGS.items():
        rest = arg[len(short) :]
        if arg.startswith(short) and (rest == "" or rest[0] == "=" or rest[0].isdigit()):
            return flag
    return None


#: Weights must sum to 1 within this tolerance (the same bound in pydantic and CEL).
WEIGHT_SUM_LOW = 0.999
WEIGHT_SUM_HIGH = 1.001

#: The weight sums the router.weights rules check (CEL expressions).
_PREFILL_SUM = "self.compute + self.load + self.queue + self.network + self.cache"
_DECODE_SUM = "self.itl + self.memory + self.batch + self.bandwidth + self.network"

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
    "HFConfig": [
        {
            "rule": "!has(self.num_key_value_heads) "
            "|| self.num_attention_heads % self.num_key_value_heads == 0",
            "message": "hfConfig.num_attention_heads must be a multiple of hfConfig.num_key_value_heads",
            "messageExpression": "'hfConfig.num_attention_heads (%d) must be a multiple of "
            "hfConfig.num_key_value_heads (%d)'"
            ".format([self.num_attention_heads, self.num_key_value_heads])",
            "fieldPath": ".num_key_value_heads",
        },
    ],
    "ModelSpec": [
        {
            "rule": "has(self.hfConfig) || (has(self.numLayers) && has(self.hiddenSize) "
            "&& has(self.numHeads) && has(self.intermediateSize) && has(self.vocabSize))",
            "message": "model needs either hfConfig or all of numLayers, hiddenSize, numHeads, "
            "intermediateSize and vocabSize",
            "reason": "FieldValueRequired",
        },
        {
            "rule": "!has(self.hfConfig) || !(has(self.numLayers) || has(self.hiddenSize) "
            "|| has(self.numHeads) || has(self.numKvHeads) || has(self.headDim) "
            "|| has(self.intermediateSize) || has(self.vocabSize) || has(self.maxPositionEmbeddings))",
            "message": "model: give hfConfig or the architecture numbers (numLayers, hiddenSize, ..., "
            "maxPositionEmbeddings), not both; with hfConfig the context limit is its "
            "max_position_embeddings",
            "fieldPath": ".hfConfig",
            "reason": "FieldValueForbidden",
        },
        {
            "rule": "!has(self.numHeads) || !has(self.numKvHeads) || self.numHeads % self.numKvHeads == 0",
            "message": "model.numHeads must be a multiple of model.numKvHeads (grouped-query attention)",
            "messageExpression": "'model.numHeads (%d) must be a multiple of model.numKvHeads (%d) "
            "(grouped-query attention)'"
            ".format([self.numHeads, self.numKvHeads])",
            "fieldPath": ".numKvHeads",
        },
        {
            "rule": "self.expertsPerToken <= self.numExperts",
            "message": "model.expertsPerToken must be <= model.numExperts",
            "messageExpression": "'model.expertsPerToken (%d) must be <= model.numExperts (%d)'"
            ".format([self.expertsPerToken, self.numExperts])",
            "fieldPath": ".expertsPerToken",
        },
    ],
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
    "ScalingSpec": [
        {
            "rule": "self.minReplicas <= self.maxReplicas",
            "message": "scaling.minReplicas must be <= scaling.maxReplicas",
            "messageExpression": "'scaling.minReplicas (%d) must be <= scaling.maxReplicas (%d)'"
            ".format([self.minReplicas, self.maxReplicas])",
            "fieldPath": ".minReplicas",
        },
    ],
    "ModelCache": [
        {
            "rule": "has(self.hostPath) != has(self.claimName)",
            "message": "modelCache: give exactly one of hostPath (a node directory) or claimName (a "
            "PersistentVolumeClaim)",
            "reason": "FieldValueInvalid",
        },
    ],
    "EngineArg": [
        {
            "rule": f"!self.replace('_', '-').matches('{_OWNED_RE}')",
            "message": "spec.engineArgs: this flag is set by the operator (its value comes from the gear, "
            "the role or another spec field); remove it from spec.engineArgs",
            "messageExpression": "'spec.engineArgs: %s is set by the operator (its value comes from the "
            "gear, the role or another spec field); remove it from spec.engineArgs'.format([self])",
        },
    ],
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


#: ModelSpec fields that describe the architecture; exclusive with hfConfig.
_ARCH_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
)


def _positive(le: int, description: str) -> Any:
    return Field(default=None, ge=1, le=le, description=description)


class HFConfig(SpecModel):
    """The fields of a Hugging Face ``config.json`` gearshift reads; all others are kept as given."""

    model_config = ConfigDict(
        alias_generator=None,
        extra="allow",
        json_schema_extra=_cel("HFConfig"),
    )

    num_hidden_layers: int = Field(ge=1, le=100000, description="Decoder layers.")
    hidden_size: int = Field(ge=1, le=1048576, description="Residual stream width.")
    num_attention_heads: int = Field(ge=1, le=65536, description="Query heads.")
    num_key_value_heads: int | None = _positive(65536, "KV heads (grouped-query attention); unset: heads.")
    head_dim: int | None = _positive(65536, "Head dimension; unset: hidden_size / num_attention_heads.")
    intermediate_size: int = Field(ge=1, le=4194304, description="MLP width (per expert for MoE).")
    vocab_size: int = Field(ge=1, le=16777216, description="Vocabulary size.")
    torch_dtype: Dtype | None = Field(default=None, description="Weights dtype (older transformers key).")
    dtype: Dtype | None = Field(default=None, description="Weights dtype (transformers >= 4.56 key).")
    num_local_experts: int | None = _positive(4096, "MoE experts per layer (Mixtral).")
    num_experts_per_tok: int | None = _positive(4096, "MoE experts each token uses (Mixtral).")
    tie_word_embeddings: bool | None = Field(default=None, description="Embedding and LM head shared.")
    max_position_embeddings: int | None = _positive(67108864, "The model's context limit, tokens.")

    @model_validator(mode="after")
    def _check_heads(self) -> HFConfig:
        kv = self.num_key_value_heads
        if kv is not None and self.num_attention_heads % kv:
            raise ValueError(
                f"hfConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"hfConfig.num_key_value_heads ({kv})"
            )
        return self


class ModelSpec(SpecModel):
    """The served model: a name plus its architecture numbers, or an inline HF ``config.json``."""

    model_config = ConfigDict(json_schema_extra=_cel("ModelSpec"))

    name: str = Field(
        min_length=1,
        max_length=256,
        description="Model name clients send (OpenAI 'model'), e.g. meta-llama/Meta-Llama-3-8B.",
    )
    num_layers: int | None = _positive(100000, "Decoder layers (HF num_hidden_layers).")
    hidden_size: int | None = _positive(1048576, "Residual stream width (HF hidden_size).")
    num_heads: int | None = _positive(65536, "Query heads (HF num_attention_heads).")
    num_kv_heads: int | None = _positive(65536, "KV heads (HF num_key_value_heads); unset: numHeads.")
    head_dim: int | None = _positive(65536, "Head dimension; unset: hiddenSize / numHeads.")
    intermediate_size: int | None = _positive(4194304, "MLP width, per expert for MoE.")
    vocab_size: int | None = _positive(16777216, "Vocabulary size.")
    max_position_embeddings: int | None = _positive(
        67108864,
        "The model's context limit in tokens (HF max_position_embeddings): what the simulated engine "
        "serves (capped by its KV pool; unset: the KV pool alone) and the router advertises; vLLM reads "
        "its model's own config.",
    )
    dtype: Dtype = Field(
        default="bfloat16", description="Weights and KV-cache dtype; hfConfig's torch_dtype wins when set."
    )
    num_experts: int = Field(default=1, ge=1, le=4096, description="MoE experts per layer (1: dense).")
    experts_per_token: int = Field(default=1, ge=1, le=4096, description="MoE experts each token uses.")
    tie_word_embeddings: bool = Field(default=False, description="Embedding and LM head are one matrix.")
    hf_config: HFConfig | None = Field(
        default=None,
        description="Inline Hugging Face config.json instead of the numbers above; unknown keys are kept.",
    )

    @model_validator(mode="after")
    def _check_model(self) -> ModelSpec:
        given = [f for f in _ARCH_FIELDS if getattr(self, f) is not None]
        if self.hf_config is None:
            needed = ("num_layers", "hidden_size", "num_heads", "intermediate_size", "vocab_size")
            missing = [type(self).model_fields[f].alias for f in needed if getattr(self, f) is None]
            if missing:
                raise ValueError(
                    f"model needs either hfConfig or all of numLayers, hiddenSize, numHeads, "
                    f"intermediateSize and vocabSize (missing: {', '.join(str(m) for m in missing)})"
                )
        elif given:
            names = ", ".join(str(type(self).model_fields[f].alias) for f in given)
            raise ValueError(
                f"model: give hfConfig or the architecture numbers ({names}), not both (with hfConfig, "
                "the context limit is its max_position_embeddings)"
            )
        if (
            self.num_heads is not None
            and self.num_kv_heads is not None
            and self.num_heads % self.num_kv_heads
        ):
            raise ValueError(
                f"model.numHeads ({self.num_heads}) must be a multiple of model.numKvHeads "
                f"({self.num_kv_heads}) (grouped-query attention)"
            )
        if self.experts_per_token > self.num_experts:
            raise ValueError(
                f"model.expertsPerToken ({self.experts_per_token}) must be <= model.numExperts "
                f"({self.num_experts})"
            )
        return self

    def to_model_arch(self) -> ModelArch:
        """The architecture as :class:`gearshift.facts.model.ModelArch` (named ``name``).

        ``hfConfig`` goes through :func:`gearshift.facts.model.arch_from_hf_config`; the numbers map one to
        one, with ``numKvHeads`` defaulting to ``numHeads`` and ``headDim`` to ``hiddenSize // numHeads``.

        Raises:
            ModelConfigError: the config lacks a field :func:`arch_from_hf_config` needs.
        """
        if self.hf_config is not None:
            cfg = self.hf_config.model_dump(exclude_none=True)
            if "torch_dtype" not in cfg and "dtype" not in cfg:
                cfg["torch_dtype"] = self.dtype
            return arch_from_hf_config(cfg, name=self.name)
        assert self.num_layers and self.hidden_size and self.num_heads  # checked by _check_model
        assert self.intermediate_size and self.vocab_size
        return ModelArch(
            name=self.name,
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads or self.num_heads,
            head_dim=self.head_dim or self.hidden_size // self.num_heads,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            dtype_bytes=DTYPE_BYTES[self.dtype],
            num_experts=self.num_experts,
            experts_per_token=self.experts_per_token,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings,
        )

    @property
    def weights_dtype(self) -> str:
        """The dtype the weights are in: hfConfig's ``torch_dtype`` (or ``dtype``) when set, else ``dtype``.

        The same precedence as :meth:`to_model_arch`; the engine pins ``--dtype`` from it.
        """
        if self.hf_config is not None:
            return self.hf_config.torch_dtype or self.hf_config.dtype or self.dtype
        return self.dtype

    @classmethod
    def from_hf_config(cls, name: str, cfg: dict[str, Any]) -> ModelSpec:
        """A ModelSpec holding ``cfg`` (a parsed ``config.json``) inline.

        Raises:
            ModelConfigError: ``cfg`` lacks a needed field or holds a wrong type, naming it.
        """
        try:
            return cls.model_validate({"name": name, "hfConfig": cfg})
        except ValidationError as exc:
            raise ModelConfigError(str(exc)) from exc


class GearSetRef(SpecModel):
    """Reference to a GearSet in the PDService's namespace."""

    name: DnsLabel = Field(description="GearSet name.")


class ScalingTargets(SpecModel):
    """What the autoscaler keeps each pipeline replica at (issue 12)."""

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
        "(seed 000: 1.2).",
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
    """Pipeline-replica autoscaling of one role (issue 12); absent: replicas stay as the GearSet says."""

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


def _weight(default: float, what: str) -> Any:
    return Field(default=default, ge=0, le=1, description=f"{what} (seed 000 default {default}).")


class PrefillWeights(SpecModel):
    """Weights of seed 000's prefill node score; they sum to 1."""

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
    """Weights of seed 000's decode node score; they sum to 1."""

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
        description="pd-score (seed 000), shortest-queue (FastChat's default, seed 003), lottery (seed 003), "
        "round-robin, power-of-two, least-request.",
    )
    weights: RouterWeights = Field(default_factory=RouterWeights, description="pd-score weights.")
    replicas: int = Field(default=1, ge=1, le=64, description="Router pods.")
    image: str | None = Field(
        default=None, max_length=512, description="Router image; unset: the operator's."
    )


class SLOSpec(SpecModel):
    """Service-level objectives; goodput counts requests that meet both."""

    ttft_ms: float = Field(
        default=200.0, gt=0, le=1e6, description="Time-to-first-token target, ms (seed 000)."
    )
    itl_ms: float = Field(
        default=50.0, gt=0, le=1e6, description="Inter-token latency target, ms (seed 000)."
    )


class HFTokenSecret(SpecModel):
    """A Secret holding a Hugging Face access token (gated models): the engine gets it as ``HF_TOKEN``."""

    name: str = Field(
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="Secret name (same namespace).",
    )
    key: str = Field(
        default="token",
        min_length=1,
        max_length=253,
        pattern=SECRET_KEY_PATTERN,
        description="Key in the Secret's data holding the token (vLLM's Kubernetes guide uses token).",
    )


class ModelCache(SpecModel):
    """Where the engines keep the Hugging Face cache, shared by every gear so a shift reuses the download.

    Mounted at ``/root/.cache/huggingface`` (the vLLM image's cache, as vLLM's Kubernetes guide
    docs/deployment/k8s.md mounts it) with ``HF_HOME`` pointing there. A claim shared by pods on several
    nodes needs an access mode that allows it (ReadWriteMany, or ReadOnlyMany when filled beforehand).
    """

    model_config = ConfigDict(json_schema_extra=_cel("ModelCache"))

    host_path: str | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        pattern=r"^/",
        description="Absolute directory on each node (hostPath, created when missing).",
    )
    claim_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="PersistentVolumeClaim in the PDService's namespace.",
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> ModelCache:
        if (self.host_path is None) == (self.claim_name is None):
            raise ValueError(
                "modelCache: give exactly one of hostPath (a node directory) or claimName (a "
                "PersistentVolumeClaim)"
            )
        return self


def _quantity(what: str) -> Any:
    return Field(
        default=None,
        json_schema_extra={"pattern": QUANTITY_PATTERN},
        description=f"{what}: request of each vLLM engine container, a Kubernetes quantity; unset: the "
        "operator's default (gearshift.k8s.engine).",
    )


class EngineResources(SpecModel):
    """CPU and memory requests of the vLLM engine containers (GPUs come from the gear's stages)."""

    cpu: int | str | None = _quantity("CPU, cores (e.g. 6 or 5500m); unset: 2 + the pod's GPUs")
    memory: int | str | None = _quantity("Memory, bytes (e.g. 16Gi); unset: 6G")

    @model_validator(mode="after")
    def _quantities(self) -> EngineResources:
        for name in ("cpu", "memory"):
            value = getattr(self, name)
            if isinstance(value, int) and value < 0:
                raise ValueError(f"resources.{name} must not be negative, got {value}")
            if isinstance(value, str) and (value[:1] == "-" or not re.fullmatch(QUANTITY_PATTERN, value)):
                raise ValueError(
                    f"resources.{name} {value!r} is not a Kubernetes quantity (e.g. '4', '500m', '16Gi')"
                )
        return self


def _check_engine_args(args: list[str]) -> None:
    for i, arg in enumerate(args):
        flag = owned_flag(arg)
        if flag is not None:
            raise ValueError(
                f"spec.engineArgs[{i}] {arg!r}: {flag} is set by the operator from "
                f"{OPERATOR_OWNED_FLAGS[flag]}; remove it from spec.engineArgs"
            )


EngineArg = Annotated[
    str,
    Field(min_length=1, max_length=MAX_ENGINE_ARG_LENGTH, json_schema_extra=_cel("EngineArg")),
]


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
        _check_engine_args(self.engine_args)
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
        description="Earliest leaveBy of a time-limited node in use (issue 13; GearSet status.windowedNodes "
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
