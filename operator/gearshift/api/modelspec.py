"""A PDService's ``spec.model``: the served model by its architecture numbers or by an inline Hugging Face
``config.json`` (``hfConfig``), and its conversion into :class:`gearshift.facts.model.ModelArch`
(:meth:`ModelSpec.to_model_arch`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, model_validator

from gearshift.api.common import SpecModel
from gearshift.facts.model import DTYPE_BYTES, ModelArch, ModelConfigError, arch_from_hf_config

Dtype = Literal["bfloat16", "float16", "float32", "float8_e4m3fn", "fp8", "int8"]


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
