"""The one roofline both the simulated engine and the planner time model work with (pure, no I/O).

A piece of work on some decoder layers (and, on the last stage, the LM head) takes the max of

  - compute: FLOPs / (peak FLOP/s × MFU), FLOPs = layers × (new tokens × dense FLOPs per token
    + ``4 · n_q · d · Σ attended positions``) + ``2 · vocab · h`` per sampled sequence on the LM head;
  - memory: bytes / (peak B/s × MBU), bytes = the weights (read once per micro-batch) + the KV cache
    read for attention + the KV written for the new tokens;

(Williams, Waterman, Patterson, "Roofline: an insightful visual performance model", CACM 2009). Per-token
FLOPs and bytes come from :class:`gearshift.facts.model.ModelArch` (``2 ×`` the parameters a token touches,
attention ``4 · n_q · d`` per attended position, KV ``2 · n_kv · d · dtype`` bytes per token per layer).

:mod:`gearshift.sim.perfmodel` times every engine step with :func:`stage_time_s`;
:class:`gearshift.planner.costs.RooflineCostModel` prices a request (its prefill plus its decode steps) with
the same function on the reference card. Prefill is compute-bound and decode memory-bound (Splitwise,
Patel et al. ISCA 2024 §3; DistServe, Zhong et al. OSDI 2024 §2); the max picks whichever holds.

Efficiency constants:
  - :data:`MBU` = 0.70, model bandwidth utilisation in decode: tuned CUDA serving stacks reach 70-85 %
    of peak HBM bandwidth (MosaicML/Databricks, "LLM Inference Performance Engineering: Best Practices",
    2023); the low end.
  - :data:`MFU` = 0.50, model FLOPs utilisation in prefill: large dense models reach 40-60 % (PaLM,
    Chowdhery et al. 2022, Table 3); bench/results/sim.json checks it against published vLLM TTFTs.

Units: seconds, bytes, FLOP.
"""

from __future__ import annotations

from gearshift.facts.model import ModelArch

#: Model FLOPs utilisation (prefill), see the module docstring.
MFU = 0.50
#: Model bandwidth utilisation (decode), see the module docstring.
MBU = 0.70


def layer_flops(arch: ModelArch, new_tokens: float, attn_positions: float) -> float:
    """FLOPs of one decoder layer computing ``new_tokens`` tokens that attend to ``attn_positions``
    earlier positions in total (Σ over the tokens), FLOP."""
    dense = 2.0 * (arch.attn_params + arch.active_mlp_params)
    return new_tokens * dense + 4.0 * arch.num_heads * arch.head_dim * attn_positions


def layer_bytes(arch: ModelArch, new_tokens: float, kv_read: float) -> float:
    """Bytes one decoder layer moves: its weights, the KV of ``kv_read`` cached tokens and the KV written
    for ``new_tokens``, B."""
    return arch.layer_weight_bytes + arch.kv_bytes_per_token_layer * (kv_read + new_tokens)


def head_flops(arch: ModelArch, seqs: float) -> float:
    """FLOPs of the LM head for ``seqs`` sampled positions (only the last position of each sequence is
    sampled, as vLLM does): ``2 · vocab · h`` each, FLOP."""
    return 2.0 * arch.vocab_size * arch.hidden_size * seqs


def head_bytes(arch: ModelArch) -> int:
    """Weights of the LM head, read once per micro-batch, B."""
    return arch.vocab_size * arch.hidden_size * arch.dtype_bytes


def stage_time_s(
    arch: ModelArch,
    layers: int,
    new_tokens: float,
    attn_positions: float,
    kv_read: float,
    seqs: float,
    *,
    last: bool,
    flops_per_s: float,
    bytes_per_s: float,
) -> float:
    """Roofline time of one micro-batch on a stage of ``layers`` decoder layers, s.

    Args:
        arch: the model.
        layers: decoder layers of the stage.
        new_tokens: tokens computed (all sequences of the micro-batch).
        attn_positions: Σ over those tokens of the positions each attends to.
        kv_read: cached tokens whose KV is read.
        seqs: sequences (LM-head rows) in the micro-batch; used when ``last``.
        last: the stage holds the LM head (the pipeline's last stage).
        flops_per_s: achieved FLOP/s (peak × cards × MFU × TP efficiency).
        bytes_per_s: achieved B/s (peak × cards × MBU).
    """
    flops = layers * layer_flops(arch, new_tokens, attn_positions)
    nbytes = layers * layer_bytes(arch, new_tokens, kv_read)
    if last:
        flops += head_flops(arch, seqs)
        nbytes += head_bytes(arch)
    return max(flops / flops_per_s, nbytes / bytes_per_s)


__all__ = ["MBU", "MFU", "head_bytes", "head_flops", "layer_bytes", "layer_flops", "stage_time_s"]
