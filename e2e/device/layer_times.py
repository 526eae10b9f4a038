"""Measured time of one decoder layer on the GPU, in prefill and in decode, per micro-batch: the figures the
planner's cost model and the simulated engine predict with the roofline (``gearshift.facts.roofline``).

Run by ``check.py`` (step ``layers``) on the device machine, after the probe has let go of the card. It
builds one decoder layer of each model in ``examples/models/`` it is given (bf16, random weights) with the
kernels a serving engine uses on the card, not the probe's portable ones:

- prefill: ``b`` sequences of ``p`` tokens; q/k/v projections, causal attention through PyTorch's
  ``scaled_dot_product_attention`` (FlashAttention-2 on Hopper, as vLLM's FLASH_ATTN backend), output
  projection, SwiGLU FFN;
- decode: ``b`` sequences, one new token each, attending to ``c`` cached tokens (a dense KV cache
  ``[b, n_kv, c, d]``; paged attention reads the same bytes), the same projections and FFN.

Norms, rotary embeddings and the residual adds are left out: the roofline counts neither (they are
``O(b·s·h)`` element-wise work next to the ``O(b·s·h²)`` projections).

Prints one JSON document: ``{device, torch, dtype, models: {name: {prefill: [...], decode: [...]}}}``, each
entry ``{batch, promptTokens | context, ms, msEager, graph}`` (medians of the timed repetitions, CUDA
events; ``ms`` replayed from a CUDA graph as vLLM runs its steps, ``msEager`` launched op by op).
Exit 2 when no CUDA device is visible.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "operator"))

from gearshift.facts.model import ModelArch, load_hf_config  # noqa: E402

#: The shapes measured: (micro-batch, prompt tokens) for prefill, (micro-batch, context) for decode.
PREFILL_POINTS = ((1, 512), (4, 512), (8, 512), (1, 2048), (4, 2048))
DECODE_POINTS = ((1, 1024), (8, 1024), (32, 1024), (64, 1024), (128, 1024), (256, 1024), (64, 4096))
WARMUP, REPS = 3, 20


def _time_ms(torch: Any, fn: Any, deadline: float) -> float:
    """Median of the timed calls of ``fn``, ms (CUDA events; :data:`WARMUP` untimed first)."""
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(REPS):
        if time.monotonic() > deadline and len(samples) >= 3:
            break
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def _timed(torch: Any, fn: Any, deadline: float) -> dict[str, Any]:
    """``{ms, msEager, graph}``: ``fn`` replayed as a CUDA graph (vLLM captures its forward passes in CUDA
    graphs, ``compilation_config.cudagraph_capture_sizes``, so a step costs no per-kernel launch from
    Python), and eagerly. ``ms`` is the graph's time, or the eager one where capture failed (``graph``
    then holds the error)."""
    eager = _time_ms(torch, fn, deadline)
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(WARMUP):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        ms = _time_ms(torch, graph.replay, deadline)
        del graph
        return {"ms": ms, "msEager": eager, "graph": True}
    except Exception as exc:  # recorded: the eager time stands
        return {"ms": eager, "msEager": eager, "graph": f"capture failed: {type(exc).__name__}: {exc}"[:300]}


def measure(torch: Any, arch: ModelArch, deadline: float) -> dict[str, list[dict[str, Any]]]:
    """Prefill and decode times of one layer of ``arch`` at :data:`PREFILL_POINTS` / :data:`DECODE_POINTS`."""
    F = torch.nn.functional
    dev, dt = "cuda", torch.bfloat16
    h, d, i = arch.hidden_size, arch.head_dim, arch.intermediate_size
    nq, nkv = arch.num_heads, arch.num_kv_heads

    def w(*shape: int) -> Any:
        return torch.randn(*shape, device=dev, dtype=dt) * 0.02

    wqkv, wo = w(h, (nq + 2 * nkv) * d), w(nq * d, h)
    wgu, wdown = w(h, 2 * i), w(i, h)

    def ffn(x: Any) -> Any:
        g, u = (x @ wgu).chunk(2, dim=-1)
        return (F.silu(g) * u) @ wdown

    def prefill(x: Any) -> Any:
        b, s, _ = x.shape
        q, k, v = (x @ wqkv).split([nq * d, nkv * d, nkv * d], dim=-1)
        q = q.view(b, s, nq, d).transpose(1, 2)
        k = k.view(b, s, nkv, d).transpose(1, 2)
        v = v.view(b, s, nkv, d).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nq != nkv)
        hid = x + o.transpose(1, 2).reshape(b, s, nq * d) @ wo
        return hid + ffn(hid)

    def decode(x: Any, kc: Any, vc: Any) -> Any:
        b = x.shape[0]
        q, k, v = (x @ wqkv).split([nq * d, nkv * d, nkv * d], dim=-1)
        # GQA decode as a query of nq/nkv rows per KV head: each KV byte is read once, as paged attention
        # kernels do (repeating K/V per query head would read it nq/nkv times).
        q = q.reshape(b, nkv, nq // nkv, d)
        kc[:, :, -1, :] = k.reshape(b, nkv, d)
        vc[:, :, -1, :] = v.reshape(b, nkv, d)
        o = F.scaled_dot_product_attention(q, kc, vc)
        hid = x + o.reshape(b, 1, nq * d) @ wo
        return hid + ffn(hid)

    out: dict[str, list[dict[str, Any]]] = {"prefill": [], "decode": []}
    with torch.inference_mode():
        for b, p in PREFILL_POINTS:
            x = w(b, p, h)
            t = _timed(torch, lambda x=x: prefill(x), deadline)
            out["prefill"].append({"batch": b, "promptTokens": p, **t})
        for b, c in DECODE_POINTS:
            x = w(b, 1, h)
            kc, vc = w(b, nkv, c, d), w(b, nkv, c, d)
            t = _timed(torch, lambda x=x, kc=kc, vc=vc: decode(x, kc, vc), deadline)
            out["decode"].append({"batch": b, "context": c, **t})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", help="Hugging Face config.json files (examples/models/*.json)")
    ap.add_argument("--budget-s", type=float, default=120.0, help="stop repeating past this, s")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device visible to torch"}))
        return 2
    deadline = time.monotonic() + args.budget_s
    doc: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "dtype": "bfloat16",
        "kernels": "torch matmul (cuBLAS) + scaled_dot_product_attention",
        "models": {},
    }
    t0 = time.monotonic()
    for path in args.models:
        arch = load_hf_config(path)
        doc["models"][Path(path).stem] = measure(torch, arch, deadline)
        torch.cuda.empty_cache()
    doc["seconds"] = round(time.monotonic() - t0, 1)
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
