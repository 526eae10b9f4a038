"""The router's pod set: from the EndpointSlices of the role Services (watched), or from ``--backend`` flags.

A gear switch changes the selector of the role Service ``<pds>-<role>``; the EndpointSlice controller then
rewrites that Service's slices, and the watch here moves traffic to the new gear's head pods. Per pod the
router also wants its GPU: the node's ``gearshift.io/gpu-model`` label and, when the node has a
GPUProfile, its measured ``computeScore`` / ``hbmGBps``, plus the pod's ``GEARSHIFT_PIPELINE`` (the
stages behind a head pod) to derive a pipeline speed.

Loopback pod IPs (the sandbox, where every pod IP is in 127.0.0.0/8) never reach an EndpointSlice: the API
server refuses them ("may not be in the loopback range"). So for a role whose slices hold no endpoint the
watcher also polls the role Service's selector and its Ready pods, and builds the slice the EndpointSlice
controller would have written (:func:`slices_from_pods`). In a real cluster that fallback finds nothing
the slices lack: a role without endpoints has no Ready pod either.

Pods labelled ``gearshift.io/draining: "true"`` (the autoscaler drains a pipeline replica before a
scale-down) are left out of the pod set whatever the slices say, so no new request goes to them
while their in-flight requests finish; the same poll that feeds the fallback finds them.

The same poll finds the pods of a warming shadow gear (labelled ``gearshift.io/warming: "true"`` by the
shifting loop, outside the role Service) and hands them to ``on_warming``: the router mirrors a share of
live requests to them (:mod:`gearshift.router.mirror`). It does so in a real cluster too, where the
EndpointSlices hold the serving pods: only the poll sees pods no Service selects.

The same poll reads each pod's ``gearshift.io/max-batch`` annotation: the operator's adaptive max batch
(:mod:`gearshift.control.adaptive_batch.tick`), the most requests this router keeps on that pod at once
(:attr:`BackendInfo.batch_cap`); a head pod's ``GEARSHIFT_PIPELINE`` gives the engine's own max batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, cast

from gearshift import GROUP, VERSION
from gearshift.facts.gpus import GPU_SPECS, compute_score
from gearshift.k8s.names import ANNOTATION_MAX_BATCH, LABEL_DRAINING, NODE_GPU_MODEL, role_service_name
from gearshift.router.mirror import MirrorTarget, warming_targets
from gearshift.router.policies import pipeline_speed
from gearshift.router.pool import BackendInfo

log = logging.getLogger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
#: Period of the loopback fallback's Service/pod poll, s.
POD_POLL_S = 2.0
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
    A pod whose node gave no GPU model (the router may not read nodes) takes its pipeline's head-stage card.
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
            gpus = facts.get("gpuCount")
            env = pod_envs.get(pod, {})
            speed = None
            max_batch = 256
            if "GEARSHIFT_PIPELINE" in env:
                with contextlib.suppress(ValueError, TypeError, KeyError, IndexError, AttributeError):
                    pipeline = json.loads(env["GEARSHIFT_PIPELINE"])
                    speed = speed_from_pipeline(pipeline, role)
                    max_batch = max(1, int(pipeline.get("maxBatch", max_batch)))
                    if gpu is None:
                        # The node unreadable (the router's namespaced Role cannot grant nodes): the head
                        # stage's card as the engine itself was told (docs/ARCHITECTURE.md).
                        head = pipeline["stages"][0]
                        gpu, gpus = head["gpu"], gpus or head.get("gpus", 1)
            host = f"[{addr}]" if ":" in addr else addr
            out[pod] = BackendInfo(
                name=pod,
                url=f"http://{host}:{port}",
                role=role,  # type: ignore[arg-type]
                gpu_model=gpu if gpu in GPU_SPECS else None,
                gpu_count=int(gpus or 1),
                tp_size=int(gpus or 1),
                node=node,
                nic_gbps=float(facts.get("nicGbps", 100.0)),
                compute_score=facts.get("computeScore"),
                hbm_gbps=facts.get("hbmGBps"),
                speed=speed,
                max_batch=max_batch,
            )
    return list(out.values())


def batch_caps(pods: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Pod name → its ``gearshift.io/max-batch`` annotation (a whole number >= 1, others ignored). Pure."""
    out: dict[str, int] = {}
    for p in pods:
        meta = p.get("metadata") or {}
        raw = (meta.get("annotations") or {}).get(ANNOTATION_MAX_BATCH)
        with contextlib.suppress(TypeError, ValueError):
            if raw is not None and int(raw) >= 1:
                out[str(meta.get("name"))] = int(raw)
    return out


def with_caps(infos: Iterable[BackendInfo], caps: Mapping[str, int]) -> list[BackendInfo]:
    """``infos`` with each pod's batch cap from ``caps`` (None where it has none). Pure."""
    return [replace(b, batch_cap=caps.get(b.name)) for b in infos]


def draining_pods(pods: Iterable[Mapping[str, Any]]) -> frozenset[str]:
    """Names of the pods labelled ``gearshift.io/draining: "true"`` (the autoscaler drains them). Pure."""
    return frozenset(
        str((p.get("metadata") or {}).get("name"))
        for p in pods
        if ((p.get("metadata") or {}).get("labels") or {}).get(LABEL_DRAINING) == "true"
    )


def without_draining(infos: Iterable[BackendInfo], draining: frozenset[str]) -> list[BackendInfo]:
    """``infos`` less the draining pods. Pure."""
    return [b for b in infos if b.name not in draining]


def _selected(labels: Mapping[str, str], selector: Mapping[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _target_port(port: Mapping[str, Any], pod: Mapping[str, Any]) -> int | None:
    target = port.get("targetPort", port.get("port"))
    if isinstance(target, int):
        return target
    if isinstance(target, str) and target.isdigit():
        return int(target)
    for c in (pod.get("spec") or {}).get("containers") or []:
        for cp in c.get("ports") or []:
            if cp.get("name") == target:
                return int(cp["containerPort"])
    return None


def slices_from_pods(
    services: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """EndpointSlice-shaped dicts for ``services`` (API JSON) from the Ready, Running ``pods`` their selectors
    pick, as the EndpointSlice controller builds them (one slice per Service; ports by name, target ports
    resolved against the pod). Pure; used where the API server refuses the pods' (loopback) addresses."""
    pods = list(pods)
    out: list[dict[str, Any]] = []
    for svc in services:
        meta, spec = svc.get("metadata") or {}, svc.get("spec") or {}
        selector = spec.get("selector") or {}
        ports = spec.get("ports") or []
        endpoints: list[dict[str, Any]] = []
        slice_ports: dict[str, int] = {}
        for pod in pods:
            pmeta, status = pod.get("metadata") or {}, pod.get("status") or {}
            if not _selected(pmeta.get("labels") or {}, selector) or pmeta.get("deletionTimestamp"):
                continue
            ready = any(
                c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
            )
            if status.get("phase") != "Running" or not status.get("podIP"):
                continue
            for port in ports:
                number = _target_port(port, pod)
                if number is not None:
                    slice_ports.setdefault(str(port.get("name") or ""), number)
            endpoints.append(
                {
                    "addresses": [status["podIP"]],
                    "conditions": {"ready": ready},
                    "nodeName": (pod.get("spec") or {}).get("nodeName"),
                    "targetRef": {
                        "kind": "Pod",
                        "name": pmeta.get("name"),
                        "namespace": pmeta.get("namespace"),
                    },
                }
            )
        out.append(
            {
                "metadata": {
                    "name": f"{meta.get('name')}-pods",
                    "labels": {SERVICE_NAME_LABEL: meta.get("name", "")},
                },
                "ports": [{"name": n, "port": v} for n, v in slice_ports.items()],
                "endpoints": sorted(endpoints, key=lambda e: str(e["targetRef"]["name"])),
            }
        )
    return out


def merge_slices(
    watched: Iterable[Mapping[str, Any]], from_pods: Iterable[Mapping[str, Any]]
) -> list[Mapping[str, Any]]:
    """The watched EndpointSlices, plus the pod-built slice of every Service whose watched slices hold no
    endpoint at all (the loopback case). Pure."""
    watched = list(watched)
    with_endpoints = {
        (s.get("metadata") or {}).get("labels", {}).get(SERVICE_NAME_LABEL)
        for s in watched
        if s.get("endpoints")
    }
    extra = [
        s
        for s in from_pods
        if (s.get("metadata") or {}).get("labels", {}).get(SERVICE_NAME_LABEL) not in with_endpoints
    ]
    return [*watched, *extra]


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
        on_warming: Callable[[list[MirrorTarget]], None] | None = None,
        roles: Sequence[str] = ("prefill", "decode"),
    ) -> None:
        self.service, self.namespace = service, namespace
        self.on_warming = on_warming
        self.on_change, self.loop = on_change, loop
        self.kubeconfig = kubeconfig
        # An aggregated PDService has one role Service, <pds>-both; a PD one <pds>-prefill and <pds>-decode.
        self.role_of_service = {role_service_name(service, r): r for r in roles}
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
                    # The client types a custom object as `object`; it is the GPUProfile's JSON.
                    prof = cast(
                        "dict[str, Any]",
                        custom.get_cluster_custom_object(GROUP, VERSION, "gpuprofiles", node),
                    )
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

        lock = threading.Lock()
        from_pods: list[dict[str, Any]] = []
        draining: frozenset[str] = frozenset()
        caps: dict[str, int] = {}

        def push() -> None:
            with lock:
                merged = merge_slices(slices.values(), from_pods)
                nodes, envs = {}, {}
                for sl in merged:
                    for ep in sl.get("endpoints") or []:
                        if ep.get("nodeName"):
                            nodes[ep["nodeName"]] = facts_for(ep["nodeName"])
                        pod = (ep.get("targetRef") or {}).get("name")
                        if pod:
                            envs[pod] = env_for(pod)
                infos = with_caps(
                    without_draining(infos_from_slices(merged, self.role_of_service, nodes, envs), draining),
                    caps,
                )
            self.loop.call_soon_threadsafe(self.on_change, infos)

        def poll_pods() -> None:
            # The loopback fallback (module docstring): Services' selectors and their pods, every
            # POD_POLL_S; pushes only when the pod-built slices change.
            nonlocal from_pods, draining, caps
            warned = False
            warm_last: list[MirrorTarget] = []
            while not self._stop.wait(POD_POLL_S):
                try:
                    svcs = [
                        ser(core.read_namespaced_service(n, self.namespace)) for n in self.role_of_service
                    ]
                    pods = ser(core.list_namespaced_pod(self.namespace).items)
                    built = slices_from_pods(svcs, pods)
                    warm = warming_targets(pods, self.service) if self.on_warming is not None else []
                    now_draining = draining_pods(pods)
                    now_caps = batch_caps(pods)
                except Exception as exc:  # RBAC without services/pods, or a Service not created yet
                    if not warned:
                        log.info(
                            "pod-selector fallback for %s/%s unavailable: %s",
                            self.namespace,
                            self.service,
                            exc,
                        )
                        warned = True
                    continue
                with lock:
                    changed = built != from_pods or now_draining != draining or now_caps != caps
                    from_pods = built
                    draining = now_draining
                    caps = now_caps
                if self.on_warming is not None and warm != warm_last:
                    warm_last = warm
                    self.loop.call_soon_threadsafe(self.on_warming, warm)
                if changed:
                    push()

        threading.Thread(target=poll_pods, name="pod-selector-poll", daemon=True).start()

        while not self._stop.is_set():
            try:
                listed = disco.list_namespaced_endpoint_slice(self.namespace, label_selector=selector)
                with lock:
                    slices = {s.metadata.name: ser(s) for s in listed.items}  # type: ignore[union-attr,misc]  # a stored object always has metadata.name
                push()
                w = watch.Watch()
                for ev in w.stream(
                    disco.list_namespaced_endpoint_slice,
                    self.namespace,
                    label_selector=selector,
                    resource_version=listed.metadata.resource_version,  # type: ignore[union-attr]  # the API server always sets a list's metadata
                    timeout_seconds=60,
                ):
                    obj = ser(ev["object"])
                    name = obj["metadata"]["name"]
                    with lock:
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
