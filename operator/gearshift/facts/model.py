"""Model architecture numbers and the per-layer cost formulas every part of gearshift shares.

A decoder-only transformer (Llama, Qwen2, Mistral, Mixtral families) is described by its Hugging Face
``config.json``. From it we derive, per decoder layer and per token:

  - parameters: attention ``h·(n_q·d) + 2·h·(n_kv·d) + (n_q·d)·h`` (q, k, v, o projections with
    grouped-query attention) plus the SwiGLU MLP ``3·h·i`` (gate, up, down); Mixtral-style MoE layers hold
    ``E`` experts of ``3·h·i`` each plus a router ``h·E`` and use ``top_k`` of them per token;
  - FLOPs per token: ``2 ×`` the parameters a token touches (one multiply-add per weight; Kaplan et al.
    2020, "Scaling Laws for Neural Language Models", §2.1) plus attention over the context
    ``4 · n_q · d · context`` (QKᵀ and AV; "Transformer Inference Arithmetic", kipply 2022);
  - KV-cache bytes per token: ``2 · n_kv · d · dtype_bytes`` (keys and values; vLLM PagedAttention,
    Kwon et al. SOSP 2023);
  - activation bytes crossing a stage boundary per token: ``h · dtype_bytes`` (the residual stream).
The embedding and the LM head (``vocab · h`` each, shared when ``tie_word_embeddings``) sit on the first
and last stage.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GIB = 1024**3

#: vLLM's default ``--gpu-memory-utilization`` (``vllm/config/cache.py``, ``CacheConfig``): the share of a
#: GPU's memory an engine takes for weights, activations and KV cache.
VLLM_GPU_MEMORY_UTILIZATION = 0.9
#: How long a prefill engine keeps a finished request's KV blocks for its decode engine by default, s
#: (``spec.kvLeaseS``; ``kv_connector_extra_config.kv_lease_duration``; vLLM 0.32's default is 30,
#: ``nixl/base_scheduler.py``). Once the decode engine holds the request it renews the lease by heartbeats
#: every lease/6 (``base_scheduler.py`` ``_heartbeat_interval``), each extending it by 2/3 of the lease
#: (``base_worker.py`` ``_lease_extension``); until then only the router's hand-off bound
#: (``router/proxy.py`` ``KV_HANDOFF_SHARE``) keeps a decode from reading blocks the prefill has freed.
#: The first request between two engines waits for their NIXL handshake; measured on the 2-core sandbox it
#: took over 30 s, the prefill released the blocks ("Releasing expired KV blocks ... before lease
#: expired") and the decode waited for its 480 s watchdog. 120 s covers a slow handshake; what it costs is
#: blocks held that long for a request whose decode leg never comes.
KV_LEASE_S = 120
#: The PD guide (docs/sources.md#decode-headroom): a decode pod needs free KV memory ≥ 1.2 × a request's KV
#: cache (the PD router's decode filter); the planner sizes a stage's KV reservation with the same factor, so
#: that filter has room at the planned batch.
KV_HEADROOM = 1.2

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "fp8": 1, "int8": 1}


class ModelConfigError(ValueError):
    """A model config lacking a needed field or holding an impossible value; names the field."""


@dataclass(frozen=True)
class ModelArch:
    """Architecture numbers of a decoder-only transformer."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int = 2
    num_experts: int = 1
    experts_per_token: int = 1
    tie_word_embeddings: bool = False
    max_position_embeddings: int | None = None
    """The model's own context limit, tokens (HF ``max_position_embeddings``): vLLM's default
    ``max_model_len`` (vllm/config/model.py ``_get_and_verify_max_len``); None: not given."""

    # --- per layer ---------------------------------------------------------------------------
    @property
    def attn_params(self) -> int:
        h, d = self.hidden_size, self.head_dim
        return h * self.num_heads * d + 2 * h * self.num_kv_heads * d + self.num_heads * d * h

    @property
    def mlp_params(self) -> int:
        """All MLP weights of a layer (every expert for MoE, plus the router)."""
        one = 3 * self.hidden_size * self.intermediate_size
        if self.num_experts > 1:
            return self.num_experts * one + self.hidden_size * self.num_experts
        return one

    @property
    def active_mlp_params(self) -> int:
        """MLP weights one token touches (``top_k`` experts for MoE)."""
        one = 3 * self.hidden_size * self.intermediate_size
        if self.num_experts > 1:
            return self.experts_per_token * one + self.hidden_size * self.num_experts
        return one

    @property
    def layer_params(self) -> int:
        return self.attn_params + self.mlp_params + 2 * self.hidden_size  # + two RMSNorm weights

    @property
    def layer_weight_bytes(self) -> int:
        """Weights of one decoder layer, bytes."""
        return self.layer_params * self.dtype_bytes

    def layer_flops_per_token(self, context: int = 0) -> float:
        """FLOPs one token costs in one layer, attending over ``context`` earlier tokens."""
        dense = 2.0 * (self.attn_params + self.active_mlp_params)
        return dense + 4.0 * self.num_heads * self.head_dim * context

    @property
    def kv_bytes_per_token_layer(self) -> int:
        """KV cache one token holds in one layer, bytes."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache one token holds across all layers, bytes."""
        return self.kv_bytes_per_token_layer * self.num_layers

    @property
    def activation_bytes_per_token(self) -> int:
        """Bytes that cross a pipeline-stage boundary per token (the residual stream)."""
        return self.hidden_size * self.dtype_bytes

    # --- whole model -------------------------------------------------------------------------
    @property
    def embedding_bytes(self) -> int:
        """Embedding plus LM head, bytes (one matrix when tied)."""
        mats = 1 if self.tie_word_embeddings else 2
        return mats * self.vocab_size * self.hidden_size * self.dtype_bytes

    @property
    def total_weight_bytes(self) -> int:
        return self.num_layers * self.layer_weight_bytes + self.embedding_bytes

    def stage_weight_bytes(self, start: int, end: int) -> int:
        """Weights one pipeline stage holding layers ``[start, end)`` loads, bytes.

        The first stage also holds the embedding and the last the LM head; with tied embeddings a
        pipeline still needs the matrix on both ends (vLLM loads it on the first and the last PP rank).

        Raises:
            ValueError: the range is empty or outside ``[0, num_layers]``.
        """
        if not 0 <= start < end <= self.num_layers:
            raise ValueError(
                f"stage layers [{start}, {end}) must satisfy 0 <= start < end <= {self.num_layers}"
            )
        matrix = self.vocab_size * self.hidden_size * self.dtype_bytes
        ends = (matrix if start == 0 else 0) + (matrix if end == self.num_layers else 0)
        return (end - start) * self.layer_weight_bytes + ends

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dict (``ModelArch(**d)`` reads it back); an unset context limit is left out, so
        the JSON of a model without one is what it was before the field existed."""
        d = dict(self.__dict__)
        if d.get("max_position_embeddings") is None:
            d.pop("max_position_embeddings", None)
        return d


def arch_from_hf_config(cfg: dict[str, Any], name: str | None = None) -> ModelArch:
    """Build a :class:`ModelArch` from a Hugging Face ``config.json`` mapping.

    Reads ``num_hidden_layers``, ``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``
    (defaults to the head count: multi-head attention), ``head_dim`` (defaults to hidden / heads),
    ``intermediate_size``, ``vocab_size``, ``torch_dtype``, ``max_position_embeddings`` when given, and for
    MoE ``num_local_experts`` and ``num_experts_per_tok``.

    Raises:
        ModelConfigError: a required field missing or not a positive integer, or an unknown dtype.
    """

    def need(key: str) -> int:
        value = cfg.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelConfigError(f"config.json field {key!r} must be a positive integer, got {value!r}")
        return value

    layers = need("num_hidden_layers")
    hidden = need("hidden_size")
    heads = need("num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    if dtype not in DTYPE_BYTES:
        raise ModelConfigError(
            f"config.json field 'torch_dtype' {dtype!r} is not one of {sorted(DTYPE_BYTES)}"
        )
    if heads % kv_heads:
        raise ModelConfigError(
            f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
        )
    return ModelArch(
        name=name or str(cfg.get("_name_or_path") or cfg.get("model_type") or "model"),
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        intermediate_size=need("intermediate_size"),
        vocab_size=need("vocab_size"),
        dtype_bytes=DTYPE_BYTES[dtype],
        num_experts=int(cfg.get("num_local_experts") or 1),
        experts_per_token=int(cfg.get("num_experts_per_tok") or 1),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=need("max_position_embeddings") if "max_position_embeddings" in cfg else None,
    )


def load_hf_config(path: str | Path) -> ModelArch:
    """Read a Hugging Face ``config.json`` file; the model is named after the file's stem or folder."""
    p = Path(path)
    with p.open() as fh:
        cfg = json.load(fh)
    stem = p.parent.name if p.stem == "config" else p.stem
    return arch_from_hf_config(cfg, name=cfg.get("_name_or_path") or stem)
