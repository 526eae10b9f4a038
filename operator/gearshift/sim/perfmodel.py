"""The simulated engine's performance model: how long one engine step of a pipeline takes (pure, no I/O).

A step runs a batch of work items through every pipeline stage. Each item is a sequence that computes
``new_tokens`` tokens on top of ``context`` tokens already in its KV cache (a decode item computes one
token; a prefill chunk computes many). Each stage's time per micro-batch is a roofline (Williams et al.,
"Roofline: an insightful visual performance model", CACM 2009), the max of

  - compute: FLOPs / (TFLOPS × cards × TP efficiency × MFU). FLOPs = the stage's layers ×
    (``new_tokens`` × dense FLOPs per token + attention ``4 · n_q · d · Σ context``), formulas from
    :meth:`gearshift.facts.model.ModelArch.layer_flops_per_token`; the last stage adds the LM head
    ``2 · vocab · h`` per sequence (only the last position is sampled, as vLLM does);
  - memory: bytes / (HBM GB/s × cards × MBU). Bytes = the stage's weights (read once per micro-batch)
    + the KV cache read for attention (``Σ context`` × KV bytes per token per layer × layers) + the KV
    written for the new tokens.

Prefill is compute-bound and decode memory-bound (Splitwise, Patel et al. ISCA 2024 §3; DistServe, Zhong
et al. OSDI 2024 §2); the max picks whichever holds for the batch at hand, so mixed (chunked-prefill)
steps are covered too.

Pipeline: ``m = min(K, ceil(sequences / micro_batch))`` micro-batches flow through stages ``s0..sK-1``
joined by links (activation ``h · dtype_bytes`` per token, :attr:`ModelArch.activation_bytes_per_token`).
One micro-batch takes ``L = Σ stage times + Σ link times``; the slowest stage ``B`` admits one
micro-batch per ``B``. Every sequence advances one step per period ``max(L, m · B)`` (GPipe, Huang et al.
NeurIPS 2019, fill/drain; a micro-batch's next token needs its previous one out of the last stage). At
most ``K`` (the stage count) micro-batches are in flight, as in vLLM V1: its engine core keeps a batch
queue of ``max_concurrent_batches`` = the pipeline-parallel size (``vllm/v1/engine/core.py``,
``EngineCore.__init__`` and ``step_with_batch_queue``; ``vllm/v1/executor/multiproc_executor.py``), and
each scheduled batch takes every running sequence not already in flight, within the token budget. So
more running sequences make each micro-batch larger -- one read of a stage's weights serves them all --
instead of adding micro-batches that each re-read the weights. A single-stage pipeline runs the batch
as one micro-batch.

Efficiency constants (configurable in :class:`PerfParams`):
  - ``mbu = 0.70``: model bandwidth utilisation in decode. Tuned CUDA serving stacks (vLLM,
    TensorRT-LLM) reach 70–85 % of peak HBM bandwidth ("model bandwidth utilization", The Open-Source AI
    Stack glossary, open-source-ai.tech, citing MosaicML/Databricks "LLM Inference Performance
    Engineering: Best Practices", 2023); we take the low end.
  - ``mfu = 0.50``: model FLOPs utilisation in prefill. An assumption (no single citable figure was found);
    bench/results/sim.json checks it against published vLLM TTFTs and reports the gap.
  - ``gpu_memory_utilization = 0.9`` and ``block_size = 16``: vLLM's defaults (``--gpu-memory-utilization``,
    ``--block-size``); the KV pool is what is left of 90 % of the cards after the stage's weights.
  - ``tp_efficiency``: the PD guide's ×0.85 when a stage spans several cards (docs/sources.md#gpu-prior)
    (:data:`gearshift.facts.fleet.TP_EFFICIENCY`).

Units: seconds, bytes, GB/s (1e9 B/s), TFLOPS (1e12 FLOP/s), link bandwidth in Gb/s (1e9 bit/s).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gearshift.facts import roofline
from gearshift.facts.fleet import TP_EFFICIENCY, tp_efficiency
from gearshift.facts.gpus import UnknownGPUError, gpu_spec
from gearshift.facts.model import GIB, VLLM_GPU_MEMORY_UTILIZATION, ModelArch


class PipelineConfigError(ValueError):
    """A pipeline description (``GEARSHIFT_PIPELINE``/``GEARSHIFT_GPU_PROFILE``) that cannot be used."""


@dataclass(frozen=True)
class PerfParams:
    """Efficiency constants and engine knobs of the model; sources in the module docstring."""

    mfu: float = roofline.MFU
    mbu: float = roofline.MBU
    gpu_memory_utilization: float = VLLM_GPU_MEMORY_UTILIZATION
    block_size: int = 16
    tp_efficiency: float = TP_EFFICIENCY
    step_overhead_s: float = 0.0
    """Fixed CPU/launch time added to every step, s (0: the roofline alone)."""


@dataclass(frozen=True)
class StageHW:
    """One pipeline stage: its layer range ``[start, end)`` and the hardware that holds it."""

    start: int
    end: int
    gpu: str
    gpus: int
    tflops: float
    """Dense bf16 TFLOPS per card."""
    hbm_gbps: float
    """HBM bandwidth per card, GB/s."""
    memory_gib: float
    """Memory per card, GiB."""
    node: str = ""

    @property
    def num_layers(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Link:
    """A link between adjacent stages: bandwidth in Gb/s (bits) and one-way latency in µs."""

    gbps: float
    latency_us: float = 10.0

    def transfer_s(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` bytes: latency + bytes × 8 / (Gb/s × 1e9)."""
        return self.latency_us * 1e-6 + nbytes * 8.0 / (self.gbps * 1e9)


@dataclass(frozen=True)
class Pipeline:
    """A gear's pipeline as the head pod sees it."""

    stages: tuple[StageHW, ...]
    links: tuple[Link, ...]
    micro_batch: int = 1
    max_batch: int = 256
    """Most sequences running at once (vLLM ``--max-num-seqs``, default 256)."""
    max_batched_tokens: int = 8192
    """Most tokens computed in one step (vLLM ``--max-num-batched-tokens``)."""


#: Link assumed when the pipeline names none (fleets/mixed.yaml's H100 NIC: 200 Gb/s, 10 µs).
DEFAULT_LINK = Link(gbps=200.0, latency_us=10.0)


def _num(obj: Mapping[str, Any], key: str, where: str, default: float | None = None) -> float:
    if key not in obj:
        if default is None:
            raise PipelineConfigError(f"{where}.{key} is required")
        return default
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise PipelineConfigError(f"{where}.{key} must be a positive number, got {value!r}")
    return float(value)


def parse_pipeline(
    doc: Mapping[str, Any], arch: ModelArch, profile: Sequence[Mapping[str, Any]] | None = None
) -> Pipeline:
    """Build a :class:`Pipeline` from the ``GEARSHIFT_PIPELINE`` JSON (docs/ARCHITECTURE.md).

    ``doc``: ``{"stages": [{"layers": [a, b], "gpu": "H100-80GB", "gpus": 1, "node": ".."}],
    "microBatch": 4, "maxBatch": 32, "maxBatchedTokens": 8192, "links": [{"gbps": 200, "latencyUs": 10}]}``.
    ``profile``: optional per-stage overrides ``[{"tflops": .., "hbmGBps": .., "memoryGiB": ..}]``
    (``GEARSHIFT_GPU_PROFILE``, from a measured GPUProfile); otherwise datasheet figures of
    :mod:`gearshift.facts.gpus`.

    Raises:
        PipelineConfigError: naming the field, e.g. layers not contiguous from 0 to the model's
            layer count, an unknown GPU, a links list of the wrong length.
    """
    stages_doc = doc.get("stages")
    if not isinstance(stages_doc, list) or not stages_doc:
        raise PipelineConfigError("pipeline.stages must be a non-empty list of {layers, gpu, gpus}")
    if profile is not None and len(profile) not in (0, len(stages_doc)):
        raise PipelineConfigError(
            f"GEARSHIFT_GPU_PROFILE has {len(profile)} entries; give one per stage ({len(stages_doc)})"
        )
    stages: list[StageHW] = []
    expect = 0
    for k, st in enumerate(stages_doc):
        where = f"pipeline.stages[{k}]"
        if not isinstance(st, Mapping):
            raise PipelineConfigError(f"{where} must be an object")
        layers = st.get("layers")
        if (
            not isinstance(layers, list | tuple)
            or len(layers) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in layers)
        ):
            raise PipelineConfigError(f"{where}.layers must be [start, end) integers, got {layers!r}")
        a, b = int(layers[0]), int(layers[1])
        if a != expect or b <= a:
            raise PipelineConfigError(
                f"{where}.layers {[a, b]} must start at {expect} (where the previous stage ended) "
                "and be non-empty"
            )
        expect = b
        try:
            spec = gpu_spec(str(st.get("gpu", "")))
        except UnknownGPUError as exc:
            raise PipelineConfigError(f"{where}.gpu: {exc.args[0]}") from None
        gpus = st.get("gpus", 1)
        if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
            raise PipelineConfigError(f"{where}.gpus must be a positive integer, got {gpus!r}")
        over = profile[k] if profile else {}
        stages.append(
            StageHW(
                start=a,
                end=b,
                gpu=spec.model,
                gpus=gpus,
                tflops=_num(over, "tflops", f"GEARSHIFT_GPU_PROFILE[{k}]", spec.bf16_tflops),
                hbm_gbps=_num(over, "hbmGBps", f"GEARSHIFT_GPU_PROFILE[{k}]", spec.hbm_gbps),
                memory_gib=_num(over, "memoryGiB", f"GEARSHIFT_GPU_PROFILE[{k}]", spec.memory_gib),
                node=str(st.get("node", "")),
            )
        )
    if expect != arch.num_layers:
        raise PipelineConfigError(
            f"pipeline.stages cover layers [0, {expect}) but model {arch.name!r} has {arch.num_layers}"
        )
    links_doc = doc.get("links") or []
    if not isinstance(links_doc, list) or (links_doc and len(links_doc) != len(stages) - 1):
        raise PipelineConfigError(
            f"pipeline.links must list {len(stages) - 1} links (links[k] joins stage k and k+1)"
        )
    links = tuple(
        Link(_num(ln, "gbps", f"pipeline.links[{i}]"), _num(ln, "latencyUs", f"pipeline.links[{i}]", 10.0))
        for i, ln in enumerate(links_doc)
    ) or tuple(DEFAULT_LINK for _ in range(len(stages) - 1))

    def pos_int(key: str, default: int) -> int:
        v = doc.get(key, default)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise PipelineConfigError(f"pipeline.{key} must be a positive integer, got {v!r}")
        return v

    return Pipeline(
        stages=tuple(stages),
        links=links,
        micro_batch=pos_int("microBatch", 1),
        max_batch=pos_int("maxBatch", 256),
        max_batched_tokens=pos_int("maxBatchedTokens", 8192),
    )


def single_stage_pipeline(arch: ModelArch, gpu: str = "H100-80GB", gpus: int = 1, **kw: int) -> Pipeline:
    """A one-stage pipeline holding the whole model on one node (the default when none is given)."""
    doc: dict[str, Any] = {"stages": [{"layers": [0, arch.num_layers], "gpu": gpu, "gpus": gpus}], **kw}
    return parse_pipeline(doc, arch)


@dataclass(frozen=True)
class Work:
    """One sequence's share of a step: ``new_tokens`` computed on top of ``context`` cached tokens."""

    new_tokens: int
    context: int


@dataclass
class StepTiming:
    """The modelled timing of one engine step."""

    period_s: float
    """Wall time of the step: every sequence in it advances by its work, s."""
    latency_s: float
    """One micro-batch's trip through all stages and links, s."""
    stage_busy_s: list[float] = field(default_factory=list)
    """Busy time of each stage within the period, s (utilisation = busy / period)."""
    micro_batches: int = 1


class PerfModel:
    """Roofline timing of a model on a pipeline; see the module docstring for the formulas."""

    def __init__(self, arch: ModelArch, pipeline: Pipeline, params: PerfParams | None = None) -> None:
        self.arch = arch
        self.pipeline = pipeline
        self.params = params or PerfParams()
        n = len(pipeline.stages)
        self._held = [self._stage_held_bytes(k) for k in range(n)]
        eff = [tp_efficiency(s.gpus, self.params.tp_efficiency) for s in pipeline.stages]
        self._flops_per_s = [
            s.tflops * 1e12 * s.gpus * e * self.params.mfu for s, e in zip(pipeline.stages, eff, strict=True)
        ]
        self._bytes_per_s = [s.hbm_gbps * 1e9 * s.gpus * self.params.mbu for s in pipeline.stages]

    # --- memory ----------------------------------------------------------------------------------
    def stage_layers(self, k: int) -> int:
        return self.pipeline.stages[k].num_layers

    def _stage_held_bytes(self, k: int) -> int:
        n = len(self.pipeline.stages)
        held = self.stage_layers(k) * self.arch.layer_weight_bytes
        embed = self.arch.vocab_size * self.arch.hidden_size * self.arch.dtype_bytes
        if k == 0:
            held += embed
        if k == n - 1 and not (self.arch.tie_word_embeddings and n == 1):
            held += embed
        return held

    def stage_weight_bytes(self, k: int) -> int:
        """Weights stage ``k`` holds, bytes: its layers, plus the embedding (first) and LM head (last)."""
        return self._held[k]

    def stage_kv_tokens(self, k: int) -> int:
        """Tokens of KV cache stage ``k`` can hold: (cards × GiB × gpu_memory_utilization − weights) /
        (KV bytes per token per layer × the stage's layers); 0 when the weights do not fit."""
        s = self.pipeline.stages[k]
        budget = s.memory_gib * GIB * s.gpus * self.params.gpu_memory_utilization - self._held[k]
        per_token = self.arch.kv_bytes_per_token_layer * self.stage_layers(k)
        return max(0, int(budget // per_token))

    def kv_capacity_blocks(self) -> int:
        """KV blocks of the pipeline: the tightest stage bounds it, since every stage keeps the KV of
        its own layers for the same tokens. Blocks hold ``params.block_size`` tokens."""
        tokens = min(self.stage_kv_tokens(k) for k in range(len(self.pipeline.stages)))
        return tokens // self.params.block_size

    # --- time ------------------------------------------------------------------------------------
    def stage_time_s(
        self, k: int, new_tokens: float, attn_context: float, kv_read: float, seqs: float
    ) -> float:
        """Roofline time of one micro-batch in stage ``k`` (:func:`gearshift.facts.roofline.stage_time_s`), s.

        ``new_tokens``: tokens computed; ``attn_context``: Σ over those tokens of the positions each
        attends to; ``kv_read``: cached tokens whose KV is read; ``seqs``: sequences (LM head rows).
        """
        return roofline.stage_time_s(
            self.arch,
            self.stage_layers(k),
            new_tokens,
            attn_context,
            kv_read,
            seqs,
            last=k == len(self.pipeline.stages) - 1,
            flops_per_s=self._flops_per_s[k],
            bytes_per_s=self._bytes_per_s[k],
        )

    def step(self, work: Iterable[Work]) -> StepTiming:
        """Time one engine step that runs ``work`` (one item per scheduled sequence).

        Returns the period (all sequences advance once), one micro-batch's latency and each stage's
        busy time; an empty batch takes 0 s.
        """
        new = ctx = attn = 0.0
        seqs = 0
        for w in work:
            seqs += 1
            new += w.new_tokens
            ctx += w.context
            # Token i of the chunk attends to context + i earlier positions (causal).
            attn += w.new_tokens * w.context + w.new_tokens * (w.new_tokens - 1) / 2.0
        if seqs == 0:
            return StepTiming(0.0, 0.0, [0.0] * len(self.pipeline.stages), 0)
        return self._pipeline_step(new, ctx, attn, seqs)

    def _pipeline_step(self, new: float, ctx: float, attn: float, seqs: int) -> StepTiming:
        n = len(self.pipeline.stages)
        m = 1 if n == 1 else min(n, max(1, math.ceil(seqs / self.pipeline.micro_batch)))
        times = [self.stage_time_s(k, new / m, attn / m, ctx / m, seqs / m) for k in range(n)]
        act = self.arch.activation_bytes_per_token * new / m
        links = sum(ln.transfer_s(act) for ln in self.pipeline.links)
        latency = sum(times) + links + self.params.step_overhead_s
        period = max(latency, m * max(times))
        return StepTiming(period, latency, [m * t for t in times], m)

    # --- single requests (what tests and the calibration compare against) ------------------------
    def prefill_time_s(self, prompt_tokens: int) -> float:
        """TTFT of a lone request on an idle engine with no chunking: one step over the whole prompt, s."""
        return self.step([Work(prompt_tokens, 0)]).period_s

    def decode_step_s(self, context: int, batch: int = 1) -> float:
        """One decode step of ``batch`` sequences each holding ``context`` tokens, s."""
        return self.step([Work(1, context)] * batch).period_s

    def single_request(self, prompt_tokens: int, output_tokens: int) -> tuple[float, list[float]]:
        """TTFT and the inter-token gaps of a lone request on an idle engine, s.

        The first token comes out of the prefill step (context 0 → ``prompt_tokens``); token ``i``
        (1-based, ``i ≥ 2``) comes out of a decode step that computes token ``i − 1`` over
        ``prompt_tokens + i − 2`` cached tokens.
        Assumes ``prompt_tokens ≤ max_batched_tokens`` (no chunked prefill).
        """
        ttft = self.prefill_time_s(prompt_tokens)
        itls = [self.decode_step_s(prompt_tokens + j) for j in range(output_tokens - 1)]
        return ttft, itls

    def kv_transfer_s(self, tokens: int, link: Link) -> float:
        """Time to pull ``tokens`` tokens of KV cache over ``link``: tokens × KV bytes per token, s."""
        return link.transfer_s(tokens * self.arch.kv_bytes_per_token)


__all__ = [
    "DEFAULT_LINK",
    "Link",
    "PerfModel",
    "PerfParams",
    "Pipeline",
    "PipelineConfigError",
    "StageHW",
    "StepTiming",
    "Work",
    "parse_pipeline",
    "single_stage_pipeline",
]
