"""Array backends the probe's operators run on: PyTorch (CUDA or CPU) and NumPy (CPU).

The operators in :mod:`gearshift.probe.ops` are written once against the small :class:`Backend`
surface below, so a GPU probe and the CPU probe of the unit tests run the very same code. PyTorch is
an optional extra (``pip install gearshift[probe]``: the CUDA wheel and its ``nvidia-*`` libraries are
2.8 GB to download and 5.3 GB installed), so without it the NumPy backend runs the operators on the CPU
and the output says so (``backend: numpy``).

Per backend:
  - timing: CUDA events on a GPU, ``time.perf_counter`` on the CPU (see :mod:`gearshift.probe.timing`);
  - peak memory: the CUDA caching allocator's peak on a GPU; ``tracemalloc`` for NumPy (NumPy reports
    its array buffers to it); none for PyTorch on the CPU (the memory probe then says ``formula``);
  - dtype: bf16 on a GPU (what serving uses); float32 on the CPU (NumPy has no bf16, and PyTorch's CPU
    bf16 matmul is an emulation far slower than float32, which would say nothing about the host);
  - CPU threads: one by default (``threads``). On cores shared with other processes, multi-threaded
    BLAS threads wait on each other's descheduled peers: on the 2-core build host the CPU probe ran
    3-5x longer at OpenBLAS's default thread count and its block times spread up to 200x between runs,
    against about 2x at one thread (``bench/results/probe-cpu.json``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import time
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from gearshift.probe.timing import Timer, perf_counter_timer

#: Scale of the random operands: keeps bf16 products far from overflow without changing the work.
_INIT_SCALE = 0.02


class BackendError(RuntimeError):
    """A backend or device that was asked for but is not available here; says what to install or pass."""


class Backend:
    """The array operations the probe's operators use, on one device. See the module docstring."""

    name: str
    device: str
    """``cuda`` or ``cpu``."""
    index: int
    dtype_name: str
    dtype_bytes: int
    threads: int | None = None
    """CPU threads the backend's kernels may use (None: the library's default)."""

    # --- arrays -----------------------------------------------------------------------------------
    def randn(self, shape: tuple[int, ...]) -> Any:
        raise NotImplementedError

    def empty(self, shape: tuple[int, ...]) -> Any:
        raise NotImplementedError

    def host_buffer(self, n: int) -> Any:
        """A 1-D host buffer of ``n`` elements (page-locked for CUDA, as engines use for transfers)."""
        raise NotImplementedError

    def matmul(self, a: Any, b: Any) -> Any:
        return a @ b

    def swapaxes(self, x: Any, a: int, b: int) -> Any:
        raise NotImplementedError

    def repeat_heads(self, x: Any, repeats: int, axis: int) -> Any:
        """Repeat each head ``repeats`` times along ``axis`` (grouped-query attention's K/V sharing)."""
        raise NotImplementedError

    def softmax_(self, x: Any) -> Any:
        """Softmax over the last axis, in place (returns ``x``)."""
        raise NotImplementedError

    def silu_mul_(self, g: Any, u: Any) -> Any:
        """``g ← silu(g) · u`` in place (SwiGLU's gate), returns ``g``."""
        raise NotImplementedError

    def copy_(self, dst: Any, src: Any) -> None:
        raise NotImplementedError

    # --- device -----------------------------------------------------------------------------------
    @property
    def device_name(self) -> str:
        raise NotImplementedError

    def synchronize(self) -> None:
        """Wait until all queued work on the device is done (no-op on synchronous CPU backends)."""

    def timer(self) -> Timer:
        return perf_counter_timer

    def memory_info(self) -> tuple[int, int]:
        """``(total, free)`` memory of the device, bytes."""
        return _host_memory()

    def peak_memory(self, fn: Callable[[], Any]) -> int | None:
        """Bytes allocated at the peak of ``fn()`` above what was allocated before; None if unknowable."""
        return None

    def is_oom(self, exc: BaseException) -> bool:
        return isinstance(exc, MemoryError)

    def release(self) -> None:
        """Give cached device memory back (after a probe, so the node's next pod finds it free)."""

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Make this backend's device current for the duration."""
        yield

    def describe(self) -> dict[str, Any]:
        out = {"backend": self.name, "device": self.device, "index": self.index, "dtype": self.dtype_name}
        if self.device == "cpu":
            out["threads"] = self.threads
        return out


class NumpyBackend(Backend):
    """NumPy on the host CPU, float32."""

    name = "numpy"
    device = "cpu"

    def __init__(self, seed: int = 0, threads: int | None = 1) -> None:
        self.index = 0
        self.dtype_name = "float32"
        self.dtype_bytes = 4
        self.threads = threads
        self._rng = np.random.default_rng(seed)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        if self.threads is None:
            yield
            return
        from threadpoolctl import threadpool_limits

        with threadpool_limits(limits=self.threads, user_api="blas"):
            yield

    def randn(self, shape: tuple[int, ...]) -> np.ndarray:
        x = self._rng.standard_normal(shape, dtype=np.float32)
        x *= _INIT_SCALE
        return x

    def empty(self, shape: tuple[int, ...]) -> np.ndarray:
        # zeros, not empty: touching every page now keeps first-touch page faults out of the timings.
        return np.zeros(shape, dtype=np.float32)

    def host_buffer(self, n: int) -> np.ndarray:
        return self.randn((n,))

    def swapaxes(self, x: np.ndarray, a: int, b: int) -> np.ndarray:
        return np.swapaxes(x, a, b)

    def repeat_heads(self, x: np.ndarray, repeats: int, axis: int) -> np.ndarray:
        return x if repeats == 1 else np.repeat(x, repeats, axis=axis)

    def softmax_(self, x: np.ndarray) -> np.ndarray:
        x -= x.max(axis=-1, keepdims=True)
        np.exp(x, out=x)
        x /= x.sum(axis=-1, keepdims=True)
        return x

    def silu_mul_(self, g: np.ndarray, u: np.ndarray) -> np.ndarray:
        # silu(g) = g · sigmoid(g) = g / (1 + e^-g), computed without a second full-size temporary.
        s = np.negative(g)
        np.exp(s, out=s)
        s += 1.0
        g /= s
        del s
        g *= u
        return g

    def copy_(self, dst: np.ndarray, src: np.ndarray) -> None:
        np.copyto(dst, src)

    @property
    def device_name(self) -> str:
        return _cpu_name()

    def peak_memory(self, fn: Callable[[], Any]) -> int:
        started = not tracemalloc.is_tracing()
        if started:
            tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            fn()
            return max(0, tracemalloc.get_traced_memory()[1] - base)
        finally:
            if started:
                tracemalloc.stop()


class TorchBackend(Backend):
    """PyTorch on one CUDA device (bf16, CUDA events, caching-allocator peaks) or on the CPU (float32)."""

    name = "torch"

    def __init__(
        self, device: str, index: int = 0, dtype: str | None = None, seed: int = 0, threads: int | None = 1
    ) -> None:
        import torch

        self._torch = torch
        if device == "cuda":
            if not torch.cuda.is_available():
                raise BackendError("device 'cuda' asked for but torch.cuda.is_available() is False")
            if not 0 <= index < torch.cuda.device_count():
                raise BackendError(f"CUDA device index {index} outside 0..{torch.cuda.device_count() - 1}")
            self._dev = torch.device("cuda", index)
        elif device == "cpu":
            self._dev = torch.device("cpu")
        else:
            raise BackendError(f"device must be 'cuda' or 'cpu', got {device!r}")
        self.device = device
        self.index = index
        self.threads = threads if device == "cpu" else None
        self.dtype_name = dtype or ("bfloat16" if device == "cuda" else "float32")
        try:
            self._dtype = getattr(torch, self.dtype_name)
        except AttributeError:
            raise BackendError(f"--dtype {self.dtype_name!r} is not a torch dtype") from None
        self.dtype_bytes = torch.empty((), dtype=self._dtype).element_size()
        self._gen = torch.Generator(device=self._dev).manual_seed(seed)

    def randn(self, shape: tuple[int, ...]) -> Any:
        x = self._torch.randn(shape, generator=self._gen, device=self._dev, dtype=self._dtype)
        return x.mul_(_INIT_SCALE)

    def empty(self, shape: tuple[int, ...]) -> Any:
        return self._torch.zeros(shape, device=self._dev, dtype=self._dtype)

    def host_buffer(self, n: int) -> Any:
        pin = self.device == "cuda"
        return self._torch.zeros((n,), dtype=self._dtype, pin_memory=pin)

    def swapaxes(self, x: Any, a: int, b: int) -> Any:
        return x.transpose(a, b)

    def repeat_heads(self, x: Any, repeats: int, axis: int) -> Any:
        return x if repeats == 1 else x.repeat_interleave(repeats, dim=axis)

    def softmax_(self, x: Any) -> Any:
        x.sub_(x.amax(dim=-1, keepdim=True)).exp_()
        return x.div_(x.sum(dim=-1, keepdim=True))

    def silu_mul_(self, g: Any, u: Any) -> Any:
        return self._torch.nn.functional.silu(g, inplace=True).mul_(u)

    def copy_(self, dst: Any, src: Any) -> None:
        # non_blocking: a pinned host buffer then copies asynchronously, so the CUDA events time the DMA.
        dst.copy_(src, non_blocking=True)

    @property
    def device_name(self) -> str:
        if self.device == "cuda":
            return str(self._torch.cuda.get_device_name(self._dev))
        return _cpu_name()

    def synchronize(self) -> None:
        if self.device == "cuda":
            self._torch.cuda.synchronize(self._dev)

    def timer(self) -> Timer:
        if self.device != "cuda":
            return perf_counter_timer
        torch = self._torch

        def cuda_event_timer(fn: Callable[[], Any]) -> float:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end))

        return cuda_event_timer

    def memory_info(self) -> tuple[int, int]:
        if self.device == "cuda":
            free, total = self._torch.cuda.mem_get_info(self._dev)
            return int(total), int(free)
        return _host_memory()

    def peak_memory(self, fn: Callable[[], Any]) -> int | None:
        if self.device != "cuda":
            return None
        cuda = self._torch.cuda
        cuda.synchronize(self._dev)
        cuda.reset_peak_memory_stats(self._dev)
        base = cuda.memory_allocated(self._dev)
        fn()
        cuda.synchronize(self._dev)
        return max(0, int(cuda.max_memory_allocated(self._dev)) - base)

    def is_oom(self, exc: BaseException) -> bool:
        return isinstance(exc, MemoryError | self._torch.cuda.OutOfMemoryError)

    def release(self) -> None:
        if self.device == "cuda":
            self._torch.cuda.synchronize(self._dev)
            self._torch.cuda.empty_cache()
            self._torch.cuda.reset_peak_memory_stats(self._dev)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        # inference_mode: no autograd graph, so no tensor outlives an operator through it.
        with contextlib.ExitStack() as stack:
            stack.enter_context(self._torch.inference_mode())
            if self.device == "cuda":
                stack.enter_context(self._torch.cuda.device(self._dev))
            elif self.threads is not None:
                before = self._torch.get_num_threads()
                self._torch.set_num_threads(self.threads)
                stack.callback(self._torch.set_num_threads, before)
            yield


def torch_available() -> bool:
    """Whether PyTorch can be imported (without importing it)."""
    return importlib.util.find_spec("torch") is not None


def select_backends(
    backend: str = "auto", device: str = "auto", dtype: str | None = None, threads: int | None = 1
) -> list[Backend]:
    """The backends to probe: one per CUDA device, or one CPU backend (``threads``: its CPU threads).

    ``backend``: ``auto`` (torch when importable, else numpy), ``torch`` or ``numpy``.
    ``device``: ``auto`` (every CUDA device when torch sees one, else the CPU), ``cuda`` or ``cpu``.

    Raises:
        BackendError: torch asked for but not installed; cuda asked for without torch or a GPU;
            numpy asked for with device cuda; an unknown name.
    """
    if backend not in ("auto", "torch", "numpy"):
        raise BackendError(f"--backend must be auto, torch or numpy, got {backend!r}")
    if device not in ("auto", "cuda", "cpu"):
        raise BackendError(f"--device must be auto, cuda or cpu, got {device!r}")
    use_torch = backend == "torch" or (backend == "auto" and torch_available())
    if backend == "torch" and not torch_available():
        raise BackendError("--backend torch: PyTorch is not installed; pip install 'gearshift[probe]'")
    if not use_torch:
        if device == "cuda":
            raise BackendError("--device cuda needs PyTorch: pip install 'gearshift[probe]'")
        if dtype not in (None, "float32"):
            raise BackendError(f"the numpy backend runs float32 only, got --dtype {dtype!r}")
        return [NumpyBackend(threads=threads)]
    import torch

    has_cuda = torch.cuda.is_available()
    if device == "cuda" and not has_cuda:
        raise BackendError("--device cuda: torch sees no CUDA device (driver, NVIDIA_VISIBLE_DEVICES?)")
    if device == "cuda" or (device == "auto" and has_cuda):
        return [TorchBackend("cuda", i, dtype) for i in range(torch.cuda.device_count())]
    return [TorchBackend("cpu", 0, dtype, threads=threads)]


def _host_memory() -> tuple[int, int]:
    """Total and available host memory, bytes (``MemAvailable`` from /proc/meminfo where present)."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = page * os.sysconf("SC_PHYS_PAGES")
    free = page * os.sysconf("SC_AVPHYS_PAGES")
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
                break
    return total, free


def _cpu_name() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "cpu"


def wall_clock_ms(backend: Backend, fn: Callable[[], Any]) -> float:
    """Time ``fn`` on the host clock with the device synchronised before and after, ms.

    For work spanning two devices (peer copies), where one device's CUDA events cannot time it.
    """
    backend.synchronize()
    t0 = time.perf_counter()
    fn()
    backend.synchronize()
    return (time.perf_counter() - t0) * 1e3
