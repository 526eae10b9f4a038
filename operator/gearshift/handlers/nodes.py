"""kopf handlers on Nodes: index the GPU nodes and give each one a GPUProfile named after it.

GPU nodes are those with ``nvidia.com/gpu`` capacity that match ``GEARSHIFT_GPU_NODE_SELECTOR``
(:class:`gearshift.profiling.settings.ProbeSettings`, the :class:`~gearshift.handlers.runtime.Runtime`'s
:meth:`~gearshift.handlers.runtime.Runtime.probe_settings`). Probing itself, staleness and labels are the
GPUProfile timer's (:mod:`gearshift.handlers.gpuprofile`), which reads the ``gpu_nodes`` index kept here;
these handlers only watch, so nothing is written onto a node except the profile labels.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import kopf

from gearshift.adapters.kube import KubeApiError
from gearshift.api.common import API_VERSION, GROUP, VERSION
from gearshift.facts.errors import SettingsError
from gearshift.handlers.runtime import runtime_of
from gearshift.profiling.profiles import GpuNodeView, node_view, parse_selector

PLURAL = "gpuprofiles"


@functools.cache
def _selector(text: str) -> tuple[Any, ...]:
    return parse_selector(text)


@kopf.on.startup()
def nodes_startup(logger: Any, memo: kopf.Memo, **_: Any) -> None:
    """Read and check the settings before any handler runs; a bad value stops the operator, named."""
    try:
        s = runtime_of(memo).probe_settings()
    except SettingsError as exc:
        raise kopf.PermanentError(str(exc)) from None
    logger.info(
        "GPU profiling: probe Jobs in %s (image %s, sandbox %s), selector %r, re-probe every %g s",
        s.job.namespace,
        s.job.image,
        s.job.sandbox,
        s.node_selector,
        s.reprobe_interval_s,
    )


# The handlers on every Node and GPUProfile event are coroutines: kopf runs a plain function in its thread
# pool, and a fleet's node heartbeats (about 11 a second from 1,008 kwok nodes) then queued behind the
# reconciles there for no work of their own.
@kopf.index("", "v1", "nodes")
async def gpu_nodes(name: str, body: kopf.Body, memo: kopf.Memo, **_: Any) -> dict[str, GpuNodeView] | None:
    """Index ``node name → GpuNodeView`` of every GPU node (others are not indexed)."""
    view = node_view(body, _selector(runtime_of(memo).probe_settings().node_selector))
    return {name: view} if view is not None else None


@kopf.on.event("", "v1", "nodes")
async def node_event(
    type: str | None, name: str, body: kopf.Body, logger: Any, memo: kopf.Memo, **_: Any
) -> None:
    """Ensure a GPUProfile exists for every GPU node (created once; the timer does the rest)."""
    if type == "DELETED":
        # The profile stays: its timer marks it Stale; a node that comes back is re-probed.
        return
    rt = runtime_of(memo)
    selector = _selector(rt.probe_settings().node_selector)
    if node_view(body, selector) is None or rt.profiles.ensured(name):
        return
    manifest = {
        "apiVersion": API_VERSION,
        "kind": "GPUProfile",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/managed-by": "gearshift"}},
        "spec": {"nodeName": name},
    }
    try:
        await asyncio.to_thread(rt.api.create, manifest)
        logger.info("created GPUProfile %s for GPU node %s", name, name)
    except KubeApiError as exc:
        if exc.status != 409:  # 409: it exists (made by an earlier run, or by hand): left as it is
            raise kopf.TemporaryError(f"cannot create GPUProfile {name}: {exc}", delay=5) from None
    rt.profiles.ensure(name)


@kopf.on.event(GROUP, VERSION, PLURAL)
async def gpuprofile_event_forget(
    type: str | None, name: str, memo: kopf.Memo, body: kopf.Body | None = None, **_: Any
) -> None:
    """Forget a deleted GPUProfile (the status last written, that it exists, its pruned-write reports):
    the profile of an existing GPU node is created again on the node's next event."""
    if type == "DELETED":
        uid = (body.get("metadata") or {}).get("uid") if body is not None else None
        runtime_of(memo).forget_profile(name, uid)
