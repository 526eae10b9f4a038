"""Per-layer costs of a model: compute per micro-batch, weights, KV cache, and the activation between stages.

Two sources give the same :class:`LayerCosts`:

- a **layer-cost file** ``{name, activation_mb, layers: [{compute_ms, weight_gb, kv_gb}], micro_batch?}``
  whose ``compute_ms`` is a layer's time per micro-batch on a node of compute_score 1.0, measured (or
  estimated) at ``micro_batch`` requests (default 1); other micro-batch sizes scale compute and
  activation linearly -- a conservative choice that credits batching with no efficiency gain;
- a **model architecture** (:class:`gearshift.model.ModelArch`, from an HF ``config.json``) through the
  roofline cost model of :class:`RooflineCostModel`.

Units: ms, GiB (``weight_gb``, ``kv_gb``, as the profile's ``memory_gb``), MB = 10^6 bytes
(``activation_mb``, so that ``MB·8/Gbps`` is ms).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from gearshift.gpus import GPU_SPECS, REFERENCE_MODEL
from gearshift.model import GIB, ModelArch, ModelConfigError, arch_from_hf_config
from gearshift.planner.errors import PlanInputError


@dataclass(frozen=True)
class LayerCosts:
    """The costs of every decoder layer for one micro-batch size (the partitioner's input)."""

    name: str
    activation_mb: float
    """MB crossing each stage boundary per micro-batch."""
    compute_ms: tuple[float, ...]
    """Per layer: ms per micro-batch on a compute_score-1.0 node."""
    weight_gb: tuple[float, ...]
    """Per layer: weights, GiB (embedding folded into layer 0, LM head into the last layer)."""
    kv_gb: tuple[float, ...]
    """Per layer: KV-cache budget, GiB."""
    micro_batch: int = 1

    def __post_init__(self) -> None:
        n = len(self.compute_ms)
        if n == 0:
            raise PlanInputError("layers must list at least one layer")
        if len(self.weight_gb) != n or len(self.kv_gb) != n:
            raise PlanInputError("compute_ms, weight_gb and kv_gb must have one entry per layer")

    @property
    def num_layers(self) -> int:
        return len(self.compute_ms)

    def memory_gb(self, i: int) -> float:
        """Weights plus KV cache of layer ``i``, GiB."""
        return self.weight_gb[i] + self.kv_gb[i]


class CostModel(Protocol):
    """Something that yields :class:`LayerCosts` for a micro-batch size."""

    name: str

    def at(self, micro_batch: int) -> LayerCosts:
        """The layer costs when each micro-batch carries ``micro_batch`` requests."""
        ...


@dataclass(frozen=True)
class FileCostModel:
    """Costs read from a layer-cost file; other micro-batch sizes scale linearly from the file's."""

    base: LayerCosts

    @property
    def name(self) -> str:
        return self.base.name

    def at(self, micro_batch: int) -> LayerCosts:
        if micro_batch < 1:
            raise PlanInputError(f"micro_batch must be >= 1, got {micro_batch}")
        f = micro_batch / self.base.micro_batch
        b = self.base
        return LayerCosts(
            b.name, b.activation_mb * f, tuple(c * f for c in b.compute_ms), b.weight_gb, b.kv_gb, micro_batch
        )


@dataclass(frozen=True)
class RooflineAssumptions:
    """The workload the roofline cost model prices; every field is a stated assumption, not a fact.

    ``prompt_tokens``: tokens one request brings through the pipeline (the prefill of a typical prompt).
    ``kv_sequences`` × ``kv_context_tokens``: the KV-cache budget reserved per layer on its stage.
    ``mfu``/``mbu``: achieved share of peak FLOPS / HBM bandwidth. 0.5 and 0.8 are typical of
    prefill in vLLM-class engines (MFU of 40-60% is what large dense models reach: PaLM, Chowdhery et al.
    2022, Table 3; decode reaches ~80% of HBM bandwidth: "LLM Inference Performance Engineering",
    Databricks 2023).
    """

    prompt_tokens: int = 512
    kv_sequences: int = 64
    kv_context_tokens: int = 4096
    mfu: float = 0.5
    mbu: float = 0.8

    def __post_init__(self) -> None:
        for key in ("prompt_tokens", "kv_sequences", "kv_context_tokens"):
            if getattr(self, key) < 1:
                raise PlanInputError(f"{key} must be >= 1, got {getattr(self, key)}")
        for key in ("mfu", "mbu"):
            if not 0 < getattr(self, key) <= 1:
                raise PlanInputError(f"{key} must be in (0, 1], got {getattr(self, key)}")


@dataclass(frozen=True)
class RooflineCostModel:
    """Layer costs from a model architecture by a roofline on the reference card (H100 SXM).

    Per layer and micro-batch of ``m`` requests of ``p`` prompt tokens (``t = m·p`` tokens):

    - FLOPs ``F = t · layer_flops_per_token(context=p/2)`` (gearshift.model: 2 × parameters touched plus
      attention over the context; causal attention over a prompt sees p/2 tokens on average);
    - bytes ``B = layer weights + t · KV bytes per token per layer`` (weights read once per micro-batch,
      the new KV written);
    - ``compute_ms = max(F / (989 TFLOPS · mfu), B / (3350 GB/s · mbu))`` -- the roofline (Williams,
      Waterman, Patterson, CACM 2009) at the H100 SXM datasheet peaks (gearshift.gpus).

    ``weight_gb`` is the layer's weights; ``kv_gb = kv_sequences · kv_context_tokens · KV bytes per
    token per layer``; ``activation_mb = t · hidden · dtype bytes``. The embedding sits on the first stage
    (folded into layer 0's weights) and the LM head on the last (its weights and ``2·h·vocab`` FLOPs per
    request, for the one token whose logits prefill needs, folded into the last layer). A tied embedding
    is still held twice when first and last stage differ, as pipeline engines do.
    """

    arch: ModelArch
    assumptions: RooflineAssumptions = RooflineAssumptions()

    @property
    def name(self) -> str:
        return self.arch.name

    def at(self, micro_batch: int) -> LayerCosts:
        if micro_batch < 1:
            raise PlanInputError(f"micro_batch must be >= 1, got {micro_batch}")
        a, s = self.arch, self.assumptions
        ref = GPU_SPECS[REFERENCE_MODEL]
        peak_flops = ref.bf16_tflops * 1e12 * s.mfu
        peak_bytes = ref.hbm_gbps * 1e9 * s.mbu
        tokens = micro_batch * s.prompt_tokens

        def roofline_ms(flops: float, nbytes: float) -> float:
            return max(flops / peak_flops, nbytes / peak_bytes) * 1e3

        layer_ms = roofline_ms(
            tokens * a.layer_flops_per_token(context=s.prompt_tokens // 2),
            a.layer_weight_bytes + tokens * a.kv_bytes_per_token_layer,
        )
        head_bytes = a.vocab_size * a.hidden_size * a.dtype_bytes
        head_ms = roofline_ms(2.0 * a.hidden_size * a.vocab_size * micro_batch, head_bytes)
        n = a.num_layers
        compute = [layer_ms] * n
        compute[-1] += head_ms
        weights = [a.layer_weight_bytes / GIB] * n
        weights[0] += head_bytes / GIB
        weights[-1] += head_bytes / GIB
        kv = s.kv_sequences * s.kv_context_tokens * a.kv_bytes_per_token_layer / GIB
        return LayerCosts(
            name=a.name,
            activation_mb=tokens * a.activation_bytes_per_token / 1e6,
            compute_ms=tuple(compute),
            weight_gb=tuple(weights),
            kv_gb=(kv,) * n,
            micro_batch=micro_batch,
        )


def parse_layer_costs(doc: Any) -> FileCostModel:
    """Parse a layer-cost mapping (see the module docstring).

    Raises:
        PlanInputError: a missing or negative field, named like ``layers[3].compute_ms``.
    """
    if not isinstance(doc, Mapping):
        raise PlanInputError("a layer-cost file must be a mapping with 'name', 'activation_mb' and 'layers'")

    def num(obj: Mapping[str, Any], key: str, where: str, default: float | None = None) -> float:
        value = obj.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise PlanInputError(f"{where}{key} must be a number >= 0, got {value!r}")
        return float(value)

    layers = doc.get("layers")
    if not isinstance(layers, Sequence) or isinstance(layers, str) or not layers:
        raise PlanInputError("layers must be a non-empty list of {compute_ms, weight_gb, kv_gb}")
    compute, weight, kv = [], [], []
    for i, layer in enumerate(layers):
        where = f"layers[{i}]."
        if not isinstance(layer, Mapping):
            raise PlanInputError(f"layers[{i}] must be a mapping with compute_ms, weight_gb, kv_gb")
        compute.append(num(layer, "compute_ms", where))
        weight.append(num(layer, "weight_gb", where))
        kv.append(num(layer, "kv_gb", where, 0.0))
    mb = doc.get("micro_batch", 1)
    if isinstance(mb, bool) or not isinstance(mb, int) or mb < 1:
        raise PlanInputError(f"micro_batch must be an integer >= 1, got {mb!r}")
    base = LayerCosts(
        name=str(doc.get("name") or "model"),
        activation_mb=num(doc, "activation_mb", ""),
        compute_ms=tuple(compute),
        weight_gb=tuple(weight),
        kv_gb=tuple(kv),
        micro_batch=mb,
    )
    return FileCostModel(base)


def load_model(path: str | Path, assumptions: RooflineAssumptions | None = None) -> CostModel:
    """Read ``--model``: a layer-cost file (has ``layers``) or an HF ``config.json``.

    Raises:
        PlanInputError: unreadable or invalid file; ModelConfigError's message is kept.
    """
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except OSError as exc:
        raise PlanInputError(f"cannot read model file {str(p)!r}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise PlanInputError(f"model file {str(p)!r} is not valid JSON: {exc}") from None
    if isinstance(doc, Mapping) and "layers" in doc:
        return parse_layer_costs(doc)
    try:
        stem = p.parent.name if p.stem == "config" else p.stem
        arch = arch_from_hf_config(dict(doc), name=doc.get("_name_or_path") or stem)
    except (ModelConfigError, TypeError, ValueError) as exc:
        raise PlanInputError(f"model file {str(p)!r}: {exc}") from None
    return RooflineCostModel(arch, assumptions or RooflineAssumptions())
