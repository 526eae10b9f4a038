"""Per-layer costs of a model: compute per micro-batch, weights, KV cache, and the activation between stages.

Two sources give the same :class:`LayerCosts`:

- a **layer-cost file** ``{name, activation_mb, layers: [{compute_ms, weight_gb, kv_gb}], micro_batch?}``
  whose ``compute_ms`` is a layer's time per micro-batch on a node of compute_score 1.0, measured (or
  estimated) at ``micro_batch`` requests (default 1); other micro-batch sizes scale compute and
  activation linearly -- a conservative choice that credits batching with no efficiency gain;
- a **model architecture** (:class:`gearshift.facts.model.ModelArch`, from an HF ``config.json``) through the
  roofline cost model of :class:`RooflineCostModel`.

Units: ms, GiB (``weight_gb``, ``kv_gb``, as the profile's ``memory_gb``), MB = 10^6 bytes
(``activation_mb``, so that ``MB·8/Gbps`` is ms).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from gearshift.facts import roofline
from gearshift.facts.gpus import GPU_SPECS, REFERENCE_MODEL
from gearshift.facts.model import GIB, KV_HEADROOM, ModelArch, ModelConfigError, arch_from_hf_config
from gearshift.planner.errors import PlanInputError


@dataclass(frozen=True)
class LayerCosts:
    """The costs of every decoder layer for one micro-batch size (the partitioner's input)."""

    name: str
    activation_mb: float
    """MB crossing each stage boundary per micro-batch."""
    compute_ms: tuple[float, ...]
    """Per layer: ms of work per micro-batch of requests on a compute_score-1.0 node (what a stage is busy
    for: with the roofline model, the requests' prefill and all their decode steps)."""
    weight_gb: tuple[float, ...]
    """Per layer: weights, GiB (embedding folded into layer 0, LM head into the last layer)."""
    kv_gb: tuple[float, ...]
    """Per layer: KV-cache budget, GiB."""
    micro_batch: int = 1
    latency_ms: tuple[float, ...] | None = None
    """Per layer: ms one micro-batch spends passing the layer toward the role's key latency (TTFT: its
    prefill; ITL: one decode step), on a compute_score-1.0 node; None: the same as ``compute_ms``."""

    def __post_init__(self) -> None:
        n = len(self.compute_ms)
        if n == 0:
            raise PlanInputError("layers must list at least one layer")
        if len(self.weight_gb) != n or len(self.kv_gb) != n:
            raise PlanInputError("compute_ms, weight_gb and kv_gb must have one entry per layer")
        if self.latency_ms is not None and len(self.latency_ms) != n:
            raise PlanInputError("latency_ms must have one entry per layer")

    @property
    def pass_ms(self) -> tuple[float, ...]:
        """Per layer: the latency share (``latency_ms``, else ``compute_ms``), ms."""
        return self.compute_ms if self.latency_ms is None else self.latency_ms

    @property
    def num_layers(self) -> int:
        return len(self.compute_ms)

    def memory_gb(self, i: int) -> float:
        """Weights plus KV cache of layer ``i``, GiB."""
        return self.weight_gb[i] + self.kv_gb[i]


class CostModel(Protocol):
    """Something that yields :class:`LayerCosts` for a micro-batch size."""

    @property
    def name(self) -> str: ...

    def at(self, micro_batch: int, decode_batch: int | None = None) -> LayerCosts:
        """The layer costs when each micro-batch carries ``micro_batch`` requests and decode steps read the
        weights once per ``decode_batch`` sequences (None: per micro-batch)."""
        ...


@dataclass(frozen=True)
class FileCostModel:
    """Costs read from a layer-cost file; other micro-batch sizes scale linearly from the file's."""

    base: LayerCosts

    @property
    def name(self) -> str:
        return self.base.name

    def at(self, micro_batch: int, decode_batch: int | None = None) -> LayerCosts:
        """Linear scaling from the file's micro-batch; a file states no decode, so ``decode_batch`` is
        ignored."""
        if micro_batch < 1:
            raise PlanInputError(f"micro_batch must be >= 1, got {micro_batch}")
        f = micro_batch / self.base.micro_batch
        b = self.base
        return LayerCosts(
            b.name, b.activation_mb * f, tuple(c * f for c in b.compute_ms), b.weight_gb, b.kv_gb, micro_batch
        )


#: Roles a gear can serve: both phases on one engine, or one side of prefill/decode disaggregation.
ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True)
class RooflineAssumptions:
    """The workload the roofline cost model prices; every field is a stated assumption, not a fact.

    ``prompt_tokens`` / ``output_tokens``: the served request shape (mean prompt and output tokens).
    Defaults: 512 prompt tokens (the planner's earlier assumption) and 128 output tokens, about the median
    output of the Azure LLM inference conversation trace (129; Patel et al., Splitwise, ISCA 2024); a
    GearSet states its own in ``spec.plan.workload``.
    ``role``: ``both`` prices a request as its prefill and its decode steps on one engine; ``prefill``
    (a PD prefill pod stops after the first token) only the prefill; ``decode`` only the decode steps.
    ``kv_sequences`` × ``kv_context_tokens``: the KV-cache budget reserved per layer on its stage; a
    one-stage gear batches ``kv_sequences`` sequences per decode step (its ``maxBatch``).
    ``kv_context_tokens`` None (the default) sizes it from the workload (:attr:`kv_tokens_per_sequence`:
    ``ceil(KV_HEADROOM × (p + o))``, a prefill pod ``p + 1``); a number fixes it (before the workload
    sized it, every plan reserved 4096 tokens: 64 × 4096 = 32 GiB per Llama-3-8B stage, more than an
    A100-40GB's 36 GiB usable leaves beside 15 GiB of weights).
    ``mfu``/``mbu``: achieved share of peak FLOPS / HBM bandwidth, the simulated engine's
    (:mod:`gearshift.facts.roofline`: 0.5, PaLM Table 3; 0.7, Databricks 2023).
    """

    prompt_tokens: int = 512
    output_tokens: int = 128
    role: str = "both"
    kv_sequences: int = 64
    kv_context_tokens: int | None = None
    mfu: float = roofline.MFU
    mbu: float = roofline.MBU

    def __post_init__(self) -> None:
        for key in ("prompt_tokens", "output_tokens", "kv_sequences"):
            if getattr(self, key) < 1:
                raise PlanInputError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.kv_context_tokens is not None and self.kv_context_tokens < 1:
            raise PlanInputError(f"kv_context_tokens must be >= 1 or None, got {self.kv_context_tokens}")
        for key in ("mfu", "mbu"):
            if not 0 < getattr(self, key) <= 1:
                raise PlanInputError(f"{key} must be in (0, 1], got {getattr(self, key)}")
        if self.role not in ROLES:
            raise PlanInputError(f"role must be one of {', '.join(ROLES)}, got {self.role!r}")

    @property
    def kv_tokens_per_sequence(self) -> int:
        """Tokens of KV cache reserved per running sequence: ``kv_context_tokens`` when set, else
        ``ceil(KV_HEADROOM × (prompt_tokens + output_tokens))`` -- the KV a request holds at its last
        token, with the router's 1.2× headroom. A ``prefill`` pod holds a request only through its prompt
        and first token, so there ``ceil(KV_HEADROOM × (prompt_tokens + 1))``."""
        if self.kv_context_tokens is not None:
            return self.kv_context_tokens
        held = self.prompt_tokens + (1 if self.role == "prefill" else self.output_tokens)
        return math.ceil(KV_HEADROOM * held)


@dataclass(frozen=True)
class RooflineCostModel:
    """Layer costs of serving requests, from a model architecture by the simulated engine's roofline
    (:func:`gearshift.facts.roofline.stage_time_s`) on the reference card (H100 SXM: 989 TFLOPS, 3350 GB/s,
    gearshift.facts.gpus) at ``mfu``/``mbu``.

    A request of ``p`` prompt and ``o`` output tokens is its prefill plus ``o − 1`` decode steps (the
    first token comes out of the prefill), as :class:`gearshift.sim.engine.Engine` runs it. Per layer and
    micro-batch of ``m`` requests, with decode steps batching ``d`` sequences (``decode_batch``, default
    ``m``) at the mean context ``c = p + o/2``:

    - prefill ``P = roofline(m·p new tokens, Σ attended = m·p(p−1)/2 (causal), no KV read)``;
    - one decode step ``D = roofline(d new tokens, d·c attended, d·c KV read)`` -- the layer's weights are
      read once per step of ``d`` sequences, which is why small micro-batches decode slowly on a pipeline
      (each micro-batch re-reads every stage's weights);
    - ``compute_ms = P + m·(o − 1)·D / d`` (role ``both``; ``prefill``: ``P``; ``decode``: the decode
      part) -- the time the layer is busy per micro-batch of requests, so a stage's capacity is
      ``m / Σ compute_ms`` requests per ms, the engine's at saturation;
    - ``latency_ms``: ``P`` (the TTFT share; ``decode`` role: ``D`` at ``d = m``, the ITL share).

    The LM head (``2·h·vocab`` FLOPs per sampled sequence, its weights read once per micro-batch) is priced
    the same way and folded into the last layer; its weights, and the embedding's, into the last and
    first layer's ``weight_gb`` (a tied embedding is held twice when first and last stage differ, as
    pipeline engines do). ``kv_gb = kv_sequences · kv_tokens_per_sequence · KV bytes per token per
    layer`` (:attr:`RooflineAssumptions.kv_tokens_per_sequence`);
    ``activation_mb`` = the tokens a micro-batch sends across a stage boundary (prefill and decode) ×
    ``hidden · dtype`` bytes.

    The per-layer sum of rooflines equals the engine's per-stage roofline when every layer is bound the
    same way (prefill of long prompts: compute; decode: memory); the planner scales a stage by the node's
    ``compute_score`` (a FLOPS ratio), which overstates memory-bound time on cards whose bandwidth ratio
    is higher than their FLOPS ratio (A100-40GB 0.46 vs 0.32, T4 0.10 vs 0.07).
    """

    arch: ModelArch
    assumptions: RooflineAssumptions = RooflineAssumptions()

    @property
    def name(self) -> str:
        return self.arch.name

    def at(self, micro_batch: int, decode_batch: int | None = None) -> LayerCosts:
        if micro_batch < 1:
            raise PlanInputError(f"micro_batch must be >= 1, got {micro_batch}")
        if decode_batch is not None and decode_batch < 1:
            raise PlanInputError(f"decode_batch must be >= 1, got {decode_batch}")
        a, s = self.arch, self.assumptions
        ref = GPU_SPECS[REFERENCE_MODEL]
        flops_s = ref.bf16_tflops * 1e12 * s.mfu
        bytes_s = ref.hbm_gbps * 1e9 * s.mbu
        m, p, o = micro_batch, s.prompt_tokens, s.output_tokens
        d = decode_batch or m
        c = p + o / 2.0

        def layer_ms(new: float, attn: float, kv: float) -> float:
            return 1e3 * roofline.stage_time_s(
                a, 1, new, attn, kv, 0, last=False, flops_per_s=flops_s, bytes_per_s=bytes_s
            )

        def head_ms(seqs: float) -> float:
            return 1e3 * max(roofline.head_flops(a, seqs) / flops_s, roofline.head_bytes(a) / bytes_s)

        prefill = layer_ms(m * p, m * p * (p - 1) / 2.0, 0.0)
        prefill_head = head_ms(m)
        step = layer_ms(d, d * c, d * c)
        step_head = head_ms(d)
        steps = m * (o - 1) / d  # decode steps' share of this micro-batch of requests
        if s.role == "decode":
            # a decode pod runs at least one step per request, even for one-token outputs
            steps = m * max(o - 1, 1) / d
            layer, head = steps * step, steps * step_head
            lat, lat_head = layer_ms(m, m * c, m * c), head_ms(m)
            tokens = m * (o - 1)
        elif s.role == "prefill":
            layer, head, lat, lat_head, tokens = prefill, prefill_head, prefill, prefill_head, m * p
        else:
            layer, head = prefill + steps * step, prefill_head + steps * step_head
            lat, lat_head = prefill, prefill_head
            tokens = m * (p + o - 1)
        n = a.num_layers
        compute = [layer] * n
        compute[-1] += head
        latency = [lat] * n
        latency[-1] += lat_head
        hb = roofline.head_bytes(a) / GIB
        weights = [a.layer_weight_bytes / GIB] * n
        weights[0] += hb
        weights[-1] += hb
        kv = s.kv_sequences * s.kv_tokens_per_sequence * a.kv_bytes_per_token_layer / GIB
        return LayerCosts(
            name=a.name,
            activation_mb=max(tokens, m) * a.activation_bytes_per_token / 1e6,
            compute_ms=tuple(compute),
            weight_gb=tuple(weights),
            kv_gb=(kv,) * n,
            micro_batch=micro_batch,
            latency_ms=tuple(latency),
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
