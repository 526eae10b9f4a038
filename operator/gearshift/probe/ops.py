"""The probe's measured operators, written once against :class:`~gearshift.probe.backends.Backend`.

One decoder layer of a model shape (:class:`gearshift.facts.model.ModelArch`), as serving engines run it in
prefill, on ``b`` sequences of ``s`` tokens:

  - attention block: q/k/v projections, grouped-query K/V head sharing, ``softmax(q·kᵀ/√d)·v`` over the
    full ``s × s`` score matrix, output projection. FLOPs
    ``2·b·s·P_attn + 4·b·n_q·d·s²`` (``P_attn`` the four projections' weights, ``gearshift.facts.model``; the
    two score matmuls cost ``2·b·n_q·s²·d`` each; kipply 2022, "Transformer Inference Arithmetic");
  - FFN block: SwiGLU ``down(silu(x·W_gate) ⊙ (x·W_up))``, FLOPs ``6·b·s·h·i`` per expert; an MoE layer
    runs ``experts_per_token`` expert FFNs over all tokens (the compute a routed token costs; routing
    itself is not timed);
  - a square matmul ``m = n = k``: ``2·m·n·k`` FLOPs (one multiply and one add per term);
  - copies, STREAM's convention (McCalpin, "STREAM: Sustainable Memory Bandwidth", 1995): a
    device-to-device copy of N bytes reads N and writes N, so memory bandwidth = 2N / t; host↔device
    and peer copies report N / t (the link carries N).
  - peak memory of one layer forward at micro-batch 1, 2, 4, … (doubling, capped), the largest that
    fits an activation budget.

The softmax and the SwiGLU gate run in place, so a layer's activation peak is close to
:func:`layer_activation_elements` (scores ``b·n_q·s²`` plus a handful of ``b·s·h``-sized tensors).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gearshift.facts.model import ModelArch
from gearshift.probe.backends import Backend, wall_clock_ms
from gearshift.probe.timing import Deadline, Timing, summarize, time_op

GIB = 1024**3


@dataclass(frozen=True)
class Repeats:
    """How often each measurement runs: untimed warm-up, then timed repetitions (at least ``min_reps``)."""

    warmup: int = 2
    reps: int = 10
    min_reps: int = 3


# --- the operators -------------------------------------------------------------------------------


def make_layer(bk: Backend, arch: ModelArch) -> dict[str, Any]:
    """Random weights of one decoder layer, ``[in, out]`` layout (x @ W).

    Shapes: wq ``[h, n_q·d]``, wk/wv ``[h, n_kv·d]``, wo ``[n_q·d, h]``, w_gate/w_up ``[h, i]``,
    w_down ``[i, h]``.
    """
    h, d, i = arch.hidden_size, arch.head_dim, arch.intermediate_size
    return {
        "wq": bk.randn((h, arch.num_heads * d)),
        "wk": bk.randn((h, arch.num_kv_heads * d)),
        "wv": bk.randn((h, arch.num_kv_heads * d)),
        "wo": bk.randn((arch.num_heads * d, h)),
        "w_gate": bk.randn((h, i)),
        "w_up": bk.randn((h, i)),
        "w_down": bk.randn((i, h)),
    }


def layer_weight_elements(arch: ModelArch) -> int:
    """Elements :func:`make_layer` allocates: the layer's projections (one expert for MoE)."""
    return arch.attn_params + 3 * arch.hidden_size * arch.intermediate_size


def attention_block(bk: Backend, w: dict[str, Any], x: Any, arch: ModelArch) -> Any:
    """Self-attention of ``x`` ``[b, s, h]`` → ``[b, s, h]`` (no mask: every token sees all ``s``)."""
    b, s, _ = x.shape
    nq, nkv, d = arch.num_heads, arch.num_kv_heads, arch.head_dim
    q = bk.swapaxes(bk.matmul(x, w["wq"]).reshape(b, s, nq, d), 1, 2)
    k = bk.swapaxes(bk.matmul(x, w["wk"]).reshape(b, s, nkv, d), 1, 2)
    v = bk.swapaxes(bk.matmul(x, w["wv"]).reshape(b, s, nkv, d), 1, 2)
    k = bk.repeat_heads(k, nq // nkv, axis=1)
    v = bk.repeat_heads(v, nq // nkv, axis=1)
    scores = bk.matmul(q, bk.swapaxes(k, -1, -2))
    del q, k
    scores *= 1.0 / math.sqrt(d)
    bk.softmax_(scores)
    o = bk.matmul(scores, v)
    del scores, v
    o = bk.swapaxes(o, 1, 2).reshape(b, s, nq * d)
    return bk.matmul(o, w["wo"])


def ffn_block(bk: Backend, w: dict[str, Any], x: Any, arch: ModelArch) -> Any:
    """SwiGLU MLP of ``x`` ``[b, s, h]`` → ``[b, s, h]``, ``experts_per_token`` times for MoE."""
    out = None
    for _ in range(arch.experts_per_token if arch.num_experts > 1 else 1):
        g = bk.matmul(x, w["w_gate"])
        u = bk.matmul(x, w["w_up"])
        bk.silu_mul_(g, u)
        del u
        y = bk.matmul(g, w["w_down"])
        del g
        if out is None:
            out = y
        else:
            out += y
    return out


def layer_forward(bk: Backend, w: dict[str, Any], x: Any, arch: ModelArch) -> Any:
    """One pre-norm-less decoder layer: ``x + attn(x)``, then ``+ ffn(·)`` (residual stream)."""
    hid = x + attention_block(bk, w, x, arch)
    hid += ffn_block(bk, w, hid, arch)
    return hid


# --- what they cost ---------------------------------------------------------------------------------


def matmul_flops(m: int, n: int, k: int) -> float:
    """FLOPs of ``[m, k] @ [k, n]``: ``2·m·n·k``."""
    return 2.0 * m * n * k


def attention_flops(arch: ModelArch, batch: int, seq_len: int) -> float:
    """FLOPs of :func:`attention_block` on ``[batch, seq_len, h]``: ``2·b·s·P_attn + 4·b·n_q·d·s²``."""
    proj = 2.0 * batch * seq_len * arch.attn_params
    return proj + 4.0 * batch * arch.num_heads * arch.head_dim * seq_len**2


def ffn_flops(arch: ModelArch, batch: int, seq_len: int) -> float:
    """FLOPs of :func:`ffn_block` on ``[batch, seq_len, h]``: ``6·b·s·h·i`` per active expert."""
    experts = arch.experts_per_token if arch.num_experts > 1 else 1
    return 6.0 * batch * seq_len * arch.hidden_size * arch.intermediate_size * experts


def layer_activation_elements(arch: ModelArch, batch: int, seq_len: int) -> int:
    """Estimated elements alive at the peak of :func:`layer_forward` (input included, weights not).

    Attention peak (while ``scores·v`` is written): x, q, repeated k and v, o: ``b·s·(h + 4·n_q·d)``,
    plus the scores ``b·n_q·s²``. FFN peak (while the SwiGLU gate runs): x, the residual, gate, up and
    the gate's temporary: ``b·s·(2·h + 3·i)``. An estimate of this module's own code (array libraries add
    small temporaries): the memory probe uses it only to avoid allocating far past its budget.
    """
    b, s, h = batch, seq_len, arch.hidden_size
    attn = b * s * (h + 4 * arch.num_heads * arch.head_dim) + b * arch.num_heads * s * s
    ffn = b * s * (2 * h + 3 * arch.intermediate_size)
    return max(attn, ffn)


# --- the measurements -------------------------------------------------------------------------------


def _timed(bk: Backend, fn: Any, deadline: Deadline, what: str, rep: Repeats) -> Timing:
    return time_op(
        fn, bk.timer(), deadline=deadline, what=what, warmup=rep.warmup, reps=rep.reps, min_reps=rep.min_reps
    )


def measure_matmul(bk: Backend, size: int, deadline: Deadline, rep: Repeats = Repeats()) -> dict[str, Any]:
    """Time ``[size, size] @ [size, size]`` and report TFLOPS = ``2·size³ / median``.

    Returns ``{m, n, k, flops, dtype, timing, tflops}`` (timing in ms, see :class:`Timing`).
    """
    a, b = bk.randn((size, size)), bk.randn((size, size))
    t = _timed(bk, lambda: bk.matmul(a, b), deadline, f"matmul {size}³", rep)
    flops = matmul_flops(size, size, size)
    return {
        "m": size,
        "n": size,
        "k": size,
        "flops": flops,
        "dtype": bk.dtype_name,
        "timing": t.to_dict(),
        "tflops": flops / (t.median_ms * 1e-3) / 1e12,
    }


def measure_blocks(
    bk: Backend,
    arch: ModelArch,
    batches: tuple[int, ...],
    seq_len: int,
    deadline: Deadline,
    rep: Repeats = Repeats(),
) -> dict[str, list[dict[str, Any]]]:
    """Time the attention and FFN blocks of ``arch`` at each micro-batch in ``batches``, ``seq_len`` tokens.

    Returns ``{"attention": [...], "ffn": [...]}``, one ``{batch, seqLen, flops, timing, tflops}`` per
    batch (``tflops``: achieved, from the FLOP formulas above).
    """
    w = make_layer(bk, arch)
    out: dict[str, list[dict[str, Any]]] = {"attention": [], "ffn": []}
    for batch in batches:
        x = bk.randn((batch, seq_len, arch.hidden_size))
        for kind, fn, flops in (
            ("attention", attention_block, attention_flops(arch, batch, seq_len)),
            ("ffn", ffn_block, ffn_flops(arch, batch, seq_len)),
        ):
            t = _timed(
                bk,
                lambda fn=fn, x=x: fn(bk, w, x, arch),
                deadline,
                f"{kind} block at micro-batch {batch}",
                rep,
            )
            out[kind].append(
                {
                    "batch": batch,
                    "seqLen": seq_len,
                    "flops": flops,
                    "timing": t.to_dict(),
                    "tflops": flops / (t.median_ms * 1e-3) / 1e12,
                }
            )
    return out


def measure_copies(bk: Backend, nbytes: int, deadline: Deadline, rep: Repeats = Repeats()) -> dict[str, Any]:
    """Time device-to-device, host-to-device and device-to-host copies of ``nbytes`` bytes.

    Returns ``{bytes, deviceToDevice: {timing, copyGBps, memoryGBps}, hostToDevice: {timing, GBps},
    deviceToHost: {timing, GBps}}``, GB = 10⁹ bytes; ``memoryGBps`` = 2·bytes / t (STREAM copy).
    On a CPU backend "device" and "host" are both host memory, so all three are memory copies.
    """
    n = max(1, nbytes // bk.dtype_bytes)
    real = n * bk.dtype_bytes
    src, dst, host = bk.randn((n,)), bk.empty((n,)), bk.host_buffer(n)
    d2d = _timed(bk, lambda: bk.copy_(dst, src), deadline, "device-to-device copy", rep)
    h2d = _timed(bk, lambda: bk.copy_(dst, host), deadline, "host-to-device copy", rep)
    d2h = _timed(bk, lambda: bk.copy_(host, src), deadline, "device-to-host copy", rep)
    gbps = real / 1e9

    def rate(t: Timing) -> float:
        return gbps / (t.median_ms * 1e-3)

    return {
        "bytes": real,
        "deviceToDevice": {"timing": d2d.to_dict(), "copyGBps": rate(d2d), "memoryGBps": 2 * rate(d2d)},
        "hostToDevice": {"timing": h2d.to_dict(), "GBps": rate(h2d)},
        "deviceToHost": {"timing": d2h.to_dict(), "GBps": rate(d2h)},
    }


def measure_peer_copy(
    src_bk: Backend, dst_bk: Backend, nbytes: int, deadline: Deadline, rep: Repeats = Repeats()
) -> dict[str, Any]:
    """Time a copy of ``nbytes`` from ``src_bk``'s device to ``dst_bk``'s (NVLink or PCIe inside a node).

    Host-clocked with both devices synchronised (one device's events cannot time a two-device copy).
    Returns ``{from, to, bytes, timing, GBps}``.
    """
    n = max(1, nbytes // src_bk.dtype_bytes)
    src, dst = src_bk.randn((n,)), dst_bk.empty((n,))

    def copy() -> None:
        dst_bk.copy_(dst, src)
        dst_bk.synchronize()

    for _ in range(rep.warmup):
        copy()
    samples: list[float] = []
    for _ in range(rep.reps):
        if deadline.expired() and len(samples) >= rep.min_reps:
            break
        deadline.check(f"peer copy {src_bk.index}→{dst_bk.index}")
        samples.append(wall_clock_ms(src_bk, copy))
    t = summarize(samples, rep.warmup)
    real = n * src_bk.dtype_bytes
    return {
        "from": src_bk.index,
        "to": dst_bk.index,
        "bytes": real,
        "timing": t.to_dict(),
        "GBps": real / 1e9 / (t.median_ms * 1e-3),
    }


def measure_max_micro_batch(
    bk: Backend,
    arch: ModelArch,
    seq_len: int,
    budget_bytes: int,
    deadline: Deadline,
    cap: int = 64,
) -> dict[str, Any]:
    """Peak activation memory of one layer forward at micro-batch 1, 2, 4, … ≤ ``cap``; the largest fitting.

    A micro-batch fits when its measured activation peak (input included, the layer's resident
    weights not) is ≤ ``budget_bytes`` and it ran without running out of memory. The ramp stops at the
    first micro-batch that does not fit, at ``cap``, or at the deadline; it never starts a step whose
    estimated peak (:func:`layer_activation_elements`) exceeds twice the budget, so a budget far below the
    device's memory is never overrun. Where the backend cannot measure peaks (PyTorch on the CPU) the
    estimate stands in and ``method`` says ``formula``.

    Returns ``{seqLen, budgetBytes, weightBytes, method, steps: [{microBatch, peakBytes, fits, why}],
    maxMicroBatch, bytesPerMicroBatch}`` (``maxMicroBatch`` 0 when not even 1 fits).

    Raises:
        ValueError: ``cap`` < 1 or ``budget_bytes`` ≤ 0.
    """
    if cap < 1:
        raise ValueError(f"micro-batch cap must be >= 1, got {cap}")
    if budget_bytes <= 0:
        raise ValueError(f"memory budget must be > 0 bytes, got {budget_bytes}")
    elt = bk.dtype_bytes
    steps: list[dict[str, Any]] = []
    best = 0
    method = "measured"
    w = make_layer(bk, arch)
    try:
        b = 1
        while b <= cap and not deadline.expired():
            estimate = layer_activation_elements(arch, b, seq_len) * elt
            if estimate > 2 * budget_bytes:
                steps.append({"microBatch": b, "peakBytes": estimate, "fits": False, "why": "estimate"})
                break

            def step(b: int = b) -> None:
                x = bk.randn((b, seq_len, arch.hidden_size))
                layer_forward(bk, w, x, arch)

            try:
                peak = bk.peak_memory(step)
            except Exception as exc:
                if not bk.is_oom(exc):
                    raise
                bk.release()
                steps.append({"microBatch": b, "peakBytes": None, "fits": False, "why": "out of memory"})
                break
            if peak is None:
                method, peak = "formula", estimate
            fits = peak <= budget_bytes
            steps.append({"microBatch": b, "peakBytes": peak, "fits": fits, "why": "budget"})
            if not fits:
                break
            best = b
            b *= 2
    finally:
        # Tensors die with this frame; the allocator's cache is handed back here, OOM or not.
        bk.release()
    measured = [s for s in steps if s["fits"]]
    per_mb = max(s["peakBytes"] / s["microBatch"] for s in measured) if measured else None
    return {
        "seqLen": seq_len,
        "budgetBytes": budget_bytes,
        "weightBytes": layer_weight_elements(arch) * elt,
        "method": method,
        "steps": steps,
        "maxMicroBatch": best,
        "bytesPerMicroBatch": per_mb,
    }
