"""Datasheet figures of the GPU models gearshift knows, and the relative scores derived from them.

These are the *prior*: the sandbox's fake nodes carry them as annotations, the simulated engine
derives its timing from them, and the planner uses them when no measured GPUProfile exists. Once a
probe has run, its measurements win.

Sources (dense, no sparsity; bf16 unless noted):
  - H100 SXM5 80GB: 989 TFLOPS, 3350 GB/s HBM3 (NVIDIA H100 Tensor Core GPU datasheet, 2023).
  - H100 PCIe 80GB: 756 TFLOPS, 2000 GB/s (same datasheet).
  - H200 SXM 141GB: 989 TFLOPS, 4800 GB/s (NVIDIA H200 datasheet, 2024).
  - H800 SXM 80GB: 989 TFLOPS, 3350 GB/s (export variant of H100 SXM; NVLink cut to 400 GB/s).
  - A100 SXM 80GB: 312 TFLOPS, 2039 GB/s; A100 40GB: 312 TFLOPS, 1555 GB/s (NVIDIA A100 datasheet).
  - L40S 48GB: 362 TFLOPS, 864 GB/s (NVIDIA L40S datasheet).
  - A10 24GB: 125 TFLOPS, 600 GB/s (NVIDIA A10 datasheet).
  - L4 24GB: 121 TFLOPS, 300 GB/s (NVIDIA L4 datasheet).
  - V100 SXM2 32GB: 125 TFLOPS fp16 tensor, 900 GB/s (NVIDIA V100 datasheet; no bf16).
  - T4 16GB: 65 TFLOPS fp16 tensor, 320 GB/s (NVIDIA T4 datasheet; no bf16).
  - CUDA compute capability (NVIDIA's CUDA GPUs table, https://developer.nvidia.com/cuda-gpus): Hopper
    9.0, Ampere A100 8.0 and A10 8.6, Ada L40S/L4 8.9, Volta V100 7.0, Turing T4 7.5. bf16 needs 8.0 or
    more: vLLM refuses ``--dtype bfloat16`` below it (``vllm/platforms/cuda.py``
    ``check_if_supports_dtype``), so T4 and V100 run float16.
  - Intra-node links: NVLink 4 900 GB/s (H100/H200), NVLink 3 600 GB/s (A100), PCIe Gen4 x16
    32 GB/s per direction, PCIe Gen3 x16 16 GB/s per direction.
The PD router's GPU prior (docs/sources.md#gpu-prior): H100 1.0, H800 0.95, A100-80GB 0.75, A100-40GB 0.65,
A10 0.30, anything else 0.5.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Reference card for ``compute_score`` = 1.0: H100 SXM5 80GB, 989 bf16 dense TFLOPS.
REFERENCE_MODEL = "H100-80GB"
#: Lowest CUDA compute capability with bfloat16 (Ampere; ``vllm/platforms/cuda.py`` checks the same 8.0).
BF16_MIN_COMPUTE_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class GPUSpec:
    """Datasheet figures of one GPU model (per card)."""

    model: str
    """gearshift's name, also the value of the node label ``gearshift.io/gpu-model``."""
    product: str
    """What NVIDIA's GPU feature discovery writes to ``nvidia.com/gpu.product``."""
    memory_gib: float
    """HBM/GDDR capacity per card, GiB (marketing "80GB" taken as 80 GiB, as nvidia-smi rounds)."""
    bf16_tflops: float
    """Dense bf16 (fp16 where the card lacks bf16) tensor throughput, TFLOPS."""
    hbm_gbps: float
    """Memory bandwidth, GB/s."""
    intra_node_gbps: float
    """Card-to-card bandwidth inside a node (NVLink or PCIe), GB/s per direction."""
    generation: str
    """Architecture: hopper, ampere, ada, volta, turing."""
    compute_capability: tuple[int, int]
    """CUDA compute capability ``(major, minor)`` (NVIDIA's CUDA GPUs table)."""

    @property
    def supports_bf16(self) -> bool:
        """The card computes in bfloat16: compute capability >= 8.0 (Ampere, Ada, Hopper).

        vLLM's CUDA platform refuses bf16 below 8.0 (``vllm/platforms/cuda.py`` ``check_if_supports_dtype``).
        """
        return self.compute_capability >= BF16_MIN_COMPUTE_CAPABILITY


GPU_SPECS: dict[str, GPUSpec] = {
    s.model: s
    for s in (
        GPUSpec("H200-141GB", "NVIDIA-H200", 141, 989, 4800, 900, "hopper", (9, 0)),
        GPUSpec("H100-80GB", "NVIDIA-H100-80GB-HBM3", 80, 989, 3350, 900, "hopper", (9, 0)),
        GPUSpec("H100-PCIE-80GB", "NVIDIA-H100-PCIe", 80, 756, 2000, 32, "hopper", (9, 0)),
        GPUSpec("H800-80GB", "NVIDIA-H800", 80, 989, 3350, 400, "hopper", (9, 0)),
        GPUSpec("A100-80GB", "NVIDIA-A100-SXM4-80GB", 80, 312, 2039, 600, "ampere", (8, 0)),
        GPUSpec("A100-40GB", "NVIDIA-A100-SXM4-40GB", 40, 312, 1555, 600, "ampere", (8, 0)),
        GPUSpec("L40S-48GB", "NVIDIA-L40S", 48, 362, 864, 32, "ada", (8, 9)),
        GPUSpec("A10-24GB", "NVIDIA-A10", 24, 125, 600, 32, "ampere", (8, 6)),
        GPUSpec("L4-24GB", "NVIDIA-L4", 24, 121, 300, 32, "ada", (8, 9)),
        GPUSpec("V100-32GB", "Tesla-V100-SXM2-32GB", 32, 125, 900, 300, "volta", (7, 0)),
        GPUSpec("T4-16GB", "Tesla-T4", 16, 65, 320, 16, "turing", (7, 5)),
    )
}

#: The PD guide's GPU prior for PD node selection (docs/sources.md#gpu-prior); models not listed score 0.5.
PD_GPU_PRIOR: dict[str, float] = {
    "H100-80GB": 1.0,
    "H100-PCIE-80GB": 1.0,
    "H800-80GB": 0.95,
    "A100-80GB": 0.75,
    "A100-40GB": 0.65,
    "A10-24GB": 0.30,
}
PD_GPU_PRIOR_DEFAULT = 0.5


class UnknownGPUError(KeyError):
    """A GPU model name that is not in :data:`GPU_SPECS`."""


def gpu_spec(model: str) -> GPUSpec:
    """Return the datasheet of ``model`` (gearshift name or ``nvidia.com/gpu.product`` value).

    Raises:
        UnknownGPUError: naming the model and the known ones.
    """
    if model in GPU_SPECS:
        return GPU_SPECS[model]
    for spec in GPU_SPECS.values():
        if spec.product.lower() == model.lower():
            return spec
    known = ", ".join(sorted(GPU_SPECS))
    raise UnknownGPUError(f"unknown GPU model {model!r}; known models: {known}")


def compute_score(model: str) -> float:
    """Datasheet compute score of one card: bf16 dense TFLOPS / the reference card's (H100 SXM = 1.0)."""
    return gpu_spec(model).bf16_tflops / GPU_SPECS[REFERENCE_MODEL].bf16_tflops


def pd_gpu_prior(model: str) -> float:
    """The PD guide's per-model GPU score used by the PD router's compute term (docs/sources.md#gpu-prior)
    (0.5 when unlisted)."""
    return PD_GPU_PRIOR.get(model, PD_GPU_PRIOR_DEFAULT)
