"""The router's pod set: from the EndpointSlices of the role Services (watched), or from ``--backend`` flags.

A gear switch changes the selector of the role Service ``<pds>-<role>``; the EndpointSlice controller then
rewrites that Service's slices, and the watch here moves traffic to the new gear's head pods. Per pod the
router also wants its GPU: the node's ``gearshift.io/gpu-model`` label and, when the node has a
GPUProfile, its measured ``computeScore`` / ``hbmGBps``, plus the pod's ``GEARSHIFT_PIPELINE`` (the
stages behind a head pod) to derive a pipeline speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from gearshift.gpus import GPU_SPECS, compute_score
from gearshift.k8s.names import NODE_GPU_MODEL, role_service_name
from gearshift.router.policies import pipeline_speed
from gearshift.router.pool import BackendInfo

log = logging.getLogger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
_BACKEND_KEYS = {
    "name": str,
    "gpu": str,
    "gpus": int,
    "tp": int,
    "node": str,
    "nic": float,
    "latency": float,
    "compute": float,
    "hbm": float,
    "speed": float,
    "maxbatch": int,
    "maxqueue": int,
    "kvbytes": float,
    "itlprior": float,
}


class BackendSpecError(ValueError):
    """A ``--backend`` value that cannot be parsed; the message shows the expected format."""


def parse_backend(spec: str) -> BackendInfo:
    """Parse ``ROLE=URL[;key=value...]``, e.g. ``prefill=http://127.0.0.1:9001;gpu=H100-80GB;gpus=2``.

    Keys: name, gpu, gpus, tp, node, nic (Gb/s), latency (µs), compute (per-card score), hbm (GB/s), speed,
    maxbatch, maxqueue, kvbytes (KV pool bytes), itlprior (ms).

    Raises:
        BackendSpecError: naming the bad part and the format.
    """
    fmt = "expected ROLE=URL[;key=value...] with ROLE prefill|decode|both, e.g. prefill=http://127.0.0.1:9001;gpu=A10-24GB"
    head, *rest = spec.split(";")
    role, sep, url = head.partition("=")
    if not sep or role not in ("prefill", "decode", "both"):
        raise BackendSpecError(f"--backend {spec!r}: bad role {role!r}; {fmt}")
    if not url.startswith(("http://", "https://")):
        raise BackendSpecError(f"--backend {spec!r}: URL {url!r} must start with http://; {fmt}")
    url = url.rstrip("/")
    kw: dict[str, Any] = {}
    for part in rest:
        key, sep, value = part.partition("=")
        if not sep or key not in _BACKEND_KEYS:
            raise BackendSpecError(
                f"--backend {spec!r}: unknown key {key!r}; keys: {', '.join(_BACKEND_KEYS)}"
            )
        try:
            kw[key] = _BACKEND_KEYS[key](value)
        except ValueError as exc:
            raise BackendSpecError(
                f"--backend {spec!r}: {key}={value!r} is not a {_BACKEND_KEYS[key].__name__}"
            ) from exc
    if "gpu" in kw and kw["gpu"] not in GPU_SPECS:
        raise BackendSpecError(
            f"--backend {spec!r}: gpu {kw['gpu']!r} unknown; known: {', '.join(sorted(GPU_SPECS))}"
        )
    name = kw.pop("name", None) or f"{role}-{url.split('://', 1)[1]}"
    return BackendInfo(
        name=name,
        url=url,
        role=role,  # type: ignore[arg-type]
        gpu_model=kw.get("gpu"),
        gpu_count=kw.get("gpus", 1),
        tp_size=kw.get("tp", kw.get("gpus", 1)),
        node=kw.get("node"),
        nic_gbps=kw.get("nic", 100.0),
        latency_us=kw.get("latency", 10.0),
        compute_score=kw.get("compute"),
        hbm_gbps=kw.get("hbm"),
        speed=kw.get("speed"),
        max_batch=kw.get("maxbatch", 256),
        max_queue=kw.get("maxqueue", 16),
        kv_capacity_bytes=kw.get("kvbytes"),
        itl_prior_ms=kw.get("itlprior"),
    )


def speed_from_pipeline(pipeline: Mapping[str, Any], role: str) -> float | None:
    """Effective pipeline speed from a ``GEARSHIFT_PIPELINE`` document (docs/ARCHITECTURE.md).

    Per stage: prefill → datasheet compute score × gpus; decode → HBM GB/s relative to H100 SXM × gpus.
    None when a stage names an unknown GPU or the document is malformed.
    """
    ref_hbm = GPU_SPECS["H100-80GB"].hbm_gbps
    stages = []
    try:
        for st in pipeline["stages"]:
            a, b = st["layers"]
            gpu, n = st["gpu"], int(st.get("gpus", 1))
            if gpu not in GPU_SPECS:
                return None
            per = GPU_SPECS[gpu].hbm_gbps / ref_hbm if role == "decode" else compute_score(gpu)
            stages.append((int(b) - int(a), per * n))
        return pipeline_speed(stages)
    except (KeyError, TypeError, ValueError):
        return None


def infos_from_slices(
    slices: Iterable[Mapping[str, Any]],
    role_of_service: Mapping[str, str],
    nodes: Mapping[str, Mapping[str, Any]],
    pod_envs: Mapping[str, Mapping[str, str]],
    port_name: str = "http",
) -> list[BackendInfo]:
    """Backends from EndpointSlice dicts (API JSON shape). Pure.

    ``nodes``: node name → {"gpuModel", "gpuCount", "computeScore", "hbmGBps", "nicGbps"} (any subset).
    ``pod_envs``: pod name → its container env (for ``GEARSHIFT_PIPELINE``). Only ready endpoints count.
    """
    out: dict[str, BackendInfo] = {}
    for sl in slices:
        svc = (sl.get("metadata") or {}).get("labels", {}).get(SERVICE_NAME_LABEL, "")
        role = role_of_service.get(svc)
        if role is None:
            continue
        ports = sl.get("ports") or []
        port = next((p.get("port") for p in ports if p.get("name") == port_name), None)
        if port is None and ports:
            port = ports[0].get("port")
        if port is None:
            continue
        for ep in sl.get("endpoints") or []:
            if (ep.get("conditions") or {}).get("ready") is False or not ep.get("addresses"):
                continue
            addr = ep["addresses"][0]
            pod = (ep.get("targetRef") or {}).get("name") or f"{role}-{addr}"
            node = ep.get("nodeName")
            facts = nodes.get(node or "", {})
            gpu = facts.get("gpuModel")
            env = pod_envs.get(pod, {})
            speed = None
            if "GEARSHIFT_PIPELINE" in env:
                with contextlib.suppress(ValueError):
                    speed = speed_from_pipeline(json.loads(env["GEARSHIFT_PIPELINE"]), role)
            host = f"[{addr}]" if ":" in addr else addr
            out[pod] = BackendInfo(
                name=pod,
                url=f"http://{host}:{port}",
                role=role,  # type: ignore[arg-type]
                gpu_model=gpu if gpu in GPU_SPECS else None,
                gpu_count=int(facts.get("gpuCount", 1) or 1),
                tp_size=int(facts.get("gpuCount", 1) or 1),
                node=node,
                nic_gbps=float(facts.get("nicGbps", 100.0)),
                compute_score=facts.get("computeScore"),
                hbm_gbps=facts.get("hbmGBps"),
                speed=speed,
            )
    return list(out.values())


def node_facts(node: Mapping[str, Any], profile: Mapping[str, Any] | None) -> dict[str, Any]:
    """A node's GPU facts: the ``gearshift.io/gpu-model`` label, overridden by a GPUProfile's status."""
    labels = (node.get("metadata") or {}).get("labels") or {}
    facts: dict[str, Any] = {}
    if labels.get(NODE_GPU_MODEL):
        facts["gpuModel"] = labels[NODE_GPU_MODEL]
    status = (profile or {}).get("status") or {}
    for key in ("gpuModel", "gpuCount", "computeScore", "hbmGBps", "nicGbps"):
        if status.get(key) is not None:
            facts[key] = status[key]
    return facts


class EndpointSliceMembership:
    """Watches the role Services' EndpointSlices of one PDService and pushes the pod set on every change.

    The kubernetes client is synchronous, so the watch runs in a daemon thread and hands results to the
    event loop with ``call_soon_threadsafe``.
    """

    def __init__(
        self,
        service: str,
        namespace: str,
        on_change: Callable[[list[BackendInfo]], None],
        loop: asyncio.AbstractEventLoop,
        kubeconfig: str | None = None,
    ) -> None:
        self.service, self.namespace = service, namespace
        self.on_change, self.loop = on_change, loop
        self.kubeconfig = kubeconfig
        self.role_of_service = {role_service_name(service, r): r for r in ("prefill", "decode")}
        self._stop = threading.Event()

    def start(self) -> threading.Thread:
        t = threading.Thread(target=self._run, name="endpointslice-watch", daemon=True)
        t.start()
        return t

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        from kubernetes import client, config, watch

        if self.kubeconfig:
            config.load_kube_config(self.kubeconfig)
        else:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
        disco = client.DiscoveryV1Api()
        core = client.CoreV1Api()
        custom = client.CustomObjectsApi()
        ser = client.ApiClient().sanitize_for_serialization
        selector = f"{SERVICE_NAME_LABEL} in ({','.join(self.role_of_service)})"
        slices: dict[str, dict[str, Any]] = {}
        cache_nodes: dict[str, dict[str, Any]] = {}
        cache_envs: dict[str, dict[str, str]] = {}

        def facts_for(node: str) -> dict[str, Any]:
            if node not in cache_nodes:
                try:
                    n = ser(core.read_node(node))
                except Exception:  # a node we may not read (RBAC) still routes, with the prior
                    n = {}
                try:
                    prof = custom.get_cluster_custom_object("gearshift.io", "v1alpha1", "gpuprofiles", node)
                except Exception:
                    prof = None
                cache_nodes[node] = node_facts(n, prof)
            return cache_nodes[node]

        def env_for(pod: str) -> dict[str, str]:
            if pod not in cache_envs:
                try:
                    p = ser(core.read_namespaced_pod(pod, self.namespace))
                    c = (p.get("spec", {}).get("containers") or [{}])[0]
                    cache_envs[pod] = {
                        e["name"]: e.get("value", "") for e in c.get("env") or [] if "name" in e
                    }
                except Exception:
                    cache_envs[pod] = {}
            return cache_envs[pod]

        def push() -> None:
            nodes, envs = {}, {}
            for sl in slices.values():
                for ep in sl.get("endpoints") or []:
                    if ep.get("nodeName"):
                        nodes[ep["nodeName"]] = facts_for(ep["nodeName"])
                    pod = (ep.get("targetRef") or {}).get("name")
                    if pod:
                        envs[pod] = env_for(pod)
            infos = infos_from_slices(slices.values(), self.role_of_service, nodes, envs)
            self.loop.call_soon_threadsafe(self.on_change, infos)

        while not self._stop.is_set():
            try:
                listed = disco.list_namespaced_endpoint_slice(self.namespace, label_selector=selector)
                slices = {s.metadata.name: ser(s) for s in listed.items}
                push()
                w = watch.Watch()
                for ev in w.stream(
                    disco.list_namespaced_endpoint_slice,
                    self.namespace,
                    label_selector=selector,
                    resource_version=listed.metadata.resource_version,
                    timeout_seconds=60,
                ):
                    obj = ser(ev["object"])
                    name = obj["metadata"]["name"]
                    if ev["type"] == "DELETED":
                        slices.pop(name, None)
                    else:
                        slices[name] = obj
                    push()
                    if self._stop.is_set():
                        w.stop()
            except Exception as exc:  # API server restarts and expired resource versions: re-list
                log.warning(
                    "EndpointSlice watch for %s/%s failed (%s); re-listing", self.namespace, self.service, exc
                )
                self._stop.wait(1.0)
