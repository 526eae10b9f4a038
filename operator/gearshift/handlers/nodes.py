"""kopf handlers on Nodes: index the GPU nodes and give each one a GPUProfile named after it.

GPU nodes are those with ``nvidia.com/gpu`` capacity that match ``GEARSHIFT_GPU_NODE_SELECTOR``
(:class:`gearshift.profiling.lifecycle.ProbeSettings`). Probing itself, staleness and labels are the
GPUProfile timer's (:mod:`gearshift.handlers.gpuprofile`), which reads the ``gpu_nodes`` index kept here;
these handlers only watch, so nothing is written onto a node except the profile labels.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any

import kopf

from gearshift.api.common import API_VERSION, GROUP, VERSION
from gearshift.handlers.kubeapi import KubeApi, KubeApiError
from gearshift.profiling.lifecycle import ProbeSettings, SettingsError
from gearshift.profiling.profiles import GpuNodeView, node_view, parse_selector

PLURAL = "gpuprofiles"

_lock = threading.Lock()
_settings: ProbeSettings | None = None
#: Nodes whose GPUProfile is known to exist; saves a create call on every node heartbeat.
_ensured: set[str] = set()


def configure(settings: ProbeSettings) -> None:
    """Set the profiling settings (``gearshift operator`` calls this; else the startup handler reads env)."""
    global _settings
    with _lock:
        _settings = settings


def settings() -> ProbeSettings:
    """The profiling settings in force (from the environment unless :func:`configure` set them)."""
    global _settings
    with _lock:
        if _settings is None:
            _settings = ProbeSettings.from_env(os.environ)
        return _settings


@functools.cache
def _selector(text: str) -> tuple[Any, ...]:
    return parse_selector(text)


def kube_api() -> KubeApi:
    """The operator's API (:func:`gearshift.handlers.pdservice.api`: in-cluster credentials, else
    ``$KUBECONFIG``), shared with the other handlers."""
    # Imported here, as the other handler modules do: importing pdservice registers its handlers, which
    # `--disable gearshift.handlers.pdservice` must keep off.
    from gearshift.handlers import pdservice

    return pdservice.api()


@kopf.on.startup()
def nodes_startup(logger: Any, **_: Any) -> None:
    """Read and check the settings before any handler runs; a bad value stops the operator, named."""
    try:
        s = settings()
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


@kopf.index("", "v1", "nodes")
def gpu_nodes(name: str, body: kopf.Body, **_: Any) -> dict[str, GpuNodeView] | None:
    """Index ``node name → GpuNodeView`` of every GPU node (others are not indexed)."""
    view = node_view(body, _selector(settings().node_selector))
    return {name: view} if view is not None else None


@kopf.on.event("", "v1", "nodes")
def node_event(type: str | None, name: str, body: kopf.Body, logger: Any, **_: Any) -> None:
    """Ensure a GPUProfile exists for every GPU node (created once; the timer does the rest)."""
    if type == "DELETED":
        # The profile stays: its timer marks it Stale; a node that comes back is re-probed.
        return
    if node_view(body, _selector(settings().node_selector)) is None or name in _ensured:
        return
    manifest = {
        "apiVersion": API_VERSION,
        "kind": "GPUProfile",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/managed-by": "gearshift"}},
        "spec": {"nodeName": name},
    }
    try:
        kube_api().create(manifest)
        logger.info("created GPUProfile %s for GPU node %s", name, name)
    except KubeApiError as exc:
        if exc.status != 409:  # 409: it exists (made by an earlier run, or by hand): left as it is
            raise kopf.TemporaryError(f"cannot create GPUProfile {name}: {exc}", delay=5) from None
    _ensured.add(name)


@kopf.on.event(GROUP, VERSION, PLURAL)
def gpuprofile_event_forget(type: str | None, name: str, **_: Any) -> None:
    """A deleted GPUProfile of an existing GPU node is created again on the node's next event."""
    if type == "DELETED":
        _ensured.discard(name)
