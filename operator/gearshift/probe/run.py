"""A node's device probe: the operators of :mod:`gearshift.probe.ops` on every device, as one document.

Per device, in order: memory info, matmul, attention and FFN blocks, copies, the micro-batch ramp; then
peer copies between the node's GPUs. Everything runs inside ``try/finally`` blocks that drop the
tensors and return cached memory (``torch.cuda.empty_cache``) so a failed or timed-out probe leaves
the GPU as it found it, and under one :class:`~gearshift.probe.timing.Deadline`.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from gearshift.api.probedoc import SCHEMA_VERSION
from gearshift.facts.gpus import gpu_spec
from gearshift.facts.model import ModelArch
from gearshift.probe import ops
from gearshift.probe.backends import Backend
from gearshift.probe.timing import Deadline

#: Llama-3-8B's shape (meta-llama/Meta-Llama-3-8B config.json): the default model a GPU probe times.
LLAMA3_8B = ModelArch(
    name="llama-3-8b",
    num_layers=32,
    hidden_size=4096,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=14336,
    vocab_size=128256,
)
#: A small Llama-shaped layer for CPU runs (tests, laptops): same structure, ~0.8 M weights per layer.
TINY = ModelArch(
    name="tiny-llama",
    num_layers=4,
    hidden_size=256,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    intermediate_size=768,
    vocab_size=32000,
)

#: NVIDIA architecture per CUDA compute capability major.minor (CUDA C Programming Guide, "Compute
#: Capabilities").
ARCH_BY_CAPABILITY = {
    (7, 0): "volta",
    (7, 2): "volta",
    (7, 5): "turing",
    (8, 0): "ampere",
    (8, 6): "ampere",
    (8, 7): "ampere",
    (8, 9): "ada",
    (9, 0): "hopper",
    (10, 0): "blackwell",
    (10, 3): "blackwell",
    (12, 0): "blackwell",
}


@dataclass(frozen=True)
class ProbeConfig:
    """What a device probe measures and how long it may take.

    ``batches`` must include 1: ``attentionMs``/``ffnMs`` in the summary are at micro-batch 1.
    ``memory_budget_gib`` is the activation budget of one layer forward; None means ``memory_fraction``
    of the device's free memory at probe time (default 10%: a planning choice that leaves the rest to
    weights and the KV-cache pool, overridable).
    """

    arch: ModelArch = LLAMA3_8B
    seq_len: int = 512
    batches: tuple[int, ...] = (1, 4, 16)
    matmul_size: int = 8192
    copy_bytes: int = 1 << 30
    memory_budget_gib: float | None = None
    memory_fraction: float = 0.1
    micro_batch_cap: int = 64
    repeats: ops.Repeats = field(default_factory=ops.Repeats)
    time_budget_s: float = 180.0

    def __post_init__(self) -> None:
        if 1 not in self.batches or any(b < 1 for b in self.batches):
            raise ValueError(f"--batches must be positive and include 1, got {list(self.batches)}")
        for name in ("seq_len", "matmul_size", "copy_bytes", "micro_batch_cap"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"--memory-fraction must be in (0, 1], got {self.memory_fraction}")
        if self.memory_budget_gib is not None and self.memory_budget_gib <= 0:
            raise ValueError(f"--memory-budget-gib must be > 0, got {self.memory_budget_gib}")
        if self.time_budget_s <= 0:
            raise ValueError(f"--time-budget-s must be > 0, got {self.time_budget_s}")


#: Sizes for a probe on the CPU: seconds, not minutes, on two cores.
CPU_CONFIG = ProbeConfig(
    arch=TINY, seq_len=64, batches=(1, 2, 4), matmul_size=512, copy_bytes=16 << 20, micro_batch_cap=8
)


def gpu_model_name(device_name: str) -> str:
    """gearshift's model name for a CUDA device name, else a label-safe form of it (≤ 63 characters).

    ``NVIDIA H100 80GB HBM3`` → ``H100-80GB`` (through ``nvidia.com/gpu.product`` spelling, spaces as
    dashes, as GPU feature discovery writes it); an unknown card keeps its own name, e.g. ``NVIDIA-B200``.
    """
    product = device_name.strip().replace(" ", "-")
    try:
        return gpu_spec(product).model
    except KeyError:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "-", product).strip("-_.")[:63].rstrip("-_.")
        return safe or "unknown"


def _generation(bk: Backend) -> str:
    if bk.device != "cuda":
        return "cpu"
    import torch

    cap = tuple(torch.cuda.get_device_capability(bk.index))
    return ARCH_BY_CAPABILITY.get(cap, f"sm{cap[0]}{cap[1]}")


def probe_device(bk: Backend, cfg: ProbeConfig, deadline: Deadline) -> dict[str, Any]:
    """All measurements on one device (see the module docstring); the ``devices[i]`` entry."""
    with bk.active():
        try:
            total, free = bk.memory_info()
            budget = (
                int(cfg.memory_budget_gib * ops.GIB)
                if cfg.memory_budget_gib is not None
                else int(cfg.memory_fraction * free)
            )
            out: dict[str, Any] = {
                **bk.describe(),
                "name": bk.device_name,
                "memoryTotalGiB": total / ops.GIB,
                "memoryFreeGiB": free / ops.GIB,
            }
            out["matmul"] = ops.measure_matmul(bk, cfg.matmul_size, deadline, cfg.repeats)
            out.update(ops.measure_blocks(bk, cfg.arch, cfg.batches, cfg.seq_len, deadline, cfg.repeats))
            out["copies"] = ops.measure_copies(bk, cfg.copy_bytes, deadline, cfg.repeats)
            out["memory"] = ops.measure_max_micro_batch(
                bk, cfg.arch, cfg.seq_len, budget, deadline, cfg.micro_batch_cap
            )
            return out
        finally:
            bk.release()


def summarize_devices(devices: list[dict[str, Any]], peers: list[dict[str, Any]]) -> dict[str, Any]:
    """The node summary: the slowest card's figure of each kind (a stage waits for its slowest card).

    Raises:
        ValueError: ``devices`` empty.
    """
    if not devices:
        raise ValueError("no devices were probed")

    def timing(d: dict[str, Any], kind: str, batch: int) -> float:
        return next(e["timing"]["medianMs"] for e in d[kind] if e["batch"] == batch)

    batches = [e["batch"] for e in devices[0]["attention"]]
    op_timings = [
        {
            "microBatch": b,
            "attentionMs": max(timing(d, "attention", b) for d in devices),
            "ffnMs": max(timing(d, "ffn", b) for d in devices),
        }
        for b in batches
    ]
    one = next(t for t in op_timings if t["microBatch"] == 1)
    return {
        "memoryGiB": min(d["memoryTotalGiB"] for d in devices),
        "memoryFreeGiB": min(d["memoryFreeGiB"] for d in devices),
        "matmulTflops": min(d["matmul"]["tflops"] for d in devices),
        "hbmGBps": min(d["copies"]["deviceToDevice"]["memoryGBps"] for d in devices),
        "d2dGBps": min(d["copies"]["deviceToDevice"]["copyGBps"] for d in devices),
        "h2dGBps": min(d["copies"]["hostToDevice"]["GBps"] for d in devices),
        "attentionMs": one["attentionMs"],
        "ffnMs": one["ffnMs"],
        "opTimings": op_timings,
        "maxMicroBatch": min(d["memory"]["maxMicroBatch"] for d in devices),
        "intraNodeGBps": min(p["GBps"] for p in peers) if peers else None,
    }


def run_device_probe(
    backends: list[Backend], cfg: ProbeConfig, *, node: str | None = None, now: datetime | None = None
) -> dict[str, Any]:
    """Probe every backend's device and return the device probe document (:mod:`gearshift.api.probedoc`).

    Raises:
        ProbeTimeoutError: ``cfg.time_budget_s`` ran out before a measurement had its minimum repetitions.
        ValueError: no backends.
        Backend errors (e.g. a CUDA error) propagate after the devices are released.
    """
    if not backends:
        raise ValueError("no backends to probe")
    started = now or datetime.now(UTC)
    t0 = time.monotonic()
    deadline = Deadline(cfg.time_budget_s)
    devices = [probe_device(bk, cfg, deadline) for bk in backends]
    peers: list[dict[str, Any]] = []
    try:
        for dst in backends[1:]:
            peers.append(ops.measure_peer_copy(backends[0], dst, cfg.copy_bytes, deadline, cfg.repeats))
    finally:
        for bk in backends:
            bk.release()
    first = backends[0]
    names = sorted({d["name"] for d in devices})
    return {
        "schemaVersion": SCHEMA_VERSION,
        "probe": "device",
        "kind": first.device,
        "backend": first.name,
        "node": node,
        "gpuModel": gpu_model_name(names[0]) if first.device == "cuda" else "cpu",
        "gpuProduct": " / ".join(names)[:128],
        "gpuCount": len(backends),
        "generation": _generation(first),
        "dtype": first.dtype_name,
        "startedAt": started.isoformat().replace("+00:00", "Z"),
        "durationS": round(time.monotonic() - t0, 3),
        "shape": {
            "model": cfg.arch.name,
            "hiddenSize": cfg.arch.hidden_size,
            "numHeads": cfg.arch.num_heads,
            "numKvHeads": cfg.arch.num_kv_heads,
            "headDim": cfg.arch.head_dim,
            "intermediateSize": cfg.arch.intermediate_size,
            "seqLen": cfg.seq_len,
            "batches": list(cfg.batches),
            "matmulSize": cfg.matmul_size,
            "copyBytes": cfg.copy_bytes,
        },
        "summary": summarize_devices(devices, peers),
        "devices": devices,
        "peerCopies": peers,
    }
