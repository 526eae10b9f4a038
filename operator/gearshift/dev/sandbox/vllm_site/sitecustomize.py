"""Imported at start-up by every Python process of a sandbox vLLM pod (the pod runner puts this folder on
``PYTHONPATH``; nothing else does): gives NIXL's progress thread a delay between its turns.

Why: NIXL 1.5.1 creates its agents with ``pthrDelay = 0`` (hard-coded in ``nixl/_api.py``, ``nixl_agent``),
and on loopback its UCX progress thread (``nixlUcxSharedThread::run``: ``ucp_worker_arm`` never arms)
turns without sleeping. Measured on the sandbox machine with ``vllm serve`` 0.32.0 and
``NixlPushConnector``: an idle engine's progress thread took 99.5 % of a core, so three engines on two
cores starved each other, and vLLM's 5 s NIXL handshake timeout (``zmq.RCVTIMEO`` in
``nixl/base_worker.py``) failed the first PD request ("push_handshake_failed", the decode waited for ever).
With a 1000 µs delay the idle thread takes 2 % and a PD request's handshake and transfer take about 1 s.
Turning the thread off instead (``enable_prog_thread=False``) stalls the transfer: the worker hung.

This is the sandbox's CPU adaptation, like ``VLLM_CPU_OMP_THREADS_BIND``; the images the operator deploys
on GPUs run NIXL unchanged (a GPU node has cores to spare for one polling thread per engine).
"""

from __future__ import annotations

import os
import sys


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


try:
    _patch_nixl()
except Exception as exc:  # a broken patch must not stop vLLM; say so in the engine log
    print(f"gearshift sandbox sitecustomize: NIXL progress delay not set: {exc!r}", file=sys.stderr)
