"""Where a stage's pods may run: node affinity, anti-affinity, GPU tolerations and GPU requests.

A stage that names nodes (the planner's gears always do) is pinned to them by required node affinity on
``kubernetes.io/hostname``, with required pod anti-affinity so that the stage's pods take one node each,
as the planner assigned them. A stage that only gives ``nodeSelector`` labels (hand-written gears such as
``gearshift.io/gpu-model: H100-80GB``) is placed on any node with those labels, its pods spread over
nodes when possible. Pure: plain dicts, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from gearshift.k8s.names import GPU_RESOURCE

#: The node label every kubelet sets to the node's name.
HOSTNAME_LABEL = "kubernetes.io/hostname"


def node_affinity(nodes: Sequence[str], node_selector: Mapping[str, str]) -> dict[str, Any]:
    """Required node affinity of a stage: on ``nodes`` by hostname, else on the ``node_selector`` labels.

    Returns the ``nodeAffinity`` object (empty mapping when the stage may run anywhere).
    Node names are sorted so that the same set always renders the same manifest (idempotent applies).
    """
    exprs: list[dict[str, Any]]
    if nodes:
        exprs = [{"key": HOSTNAME_LABEL, "operator": "In", "values": sorted(set(nodes))}]
    elif node_selector:
        exprs = [{"key": k, "operator": "In", "values": [v]} for k, v in sorted(node_selector.items())]
    else:
        return {}
    return {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": exprs}]}
    }


def pinned_nodes(statefulset: Mapping[str, Any]) -> set[str]:
    """The node names a StatefulSet's pod template is pinned to by :func:`node_affinity` (hostname ``In``).

    Empty when the template has no such term (a stage placed by labels). Pure.
    """
    tmpl = ((statefulset.get("spec") or {}).get("template") or {}).get("spec") or {}
    na = (tmpl.get("affinity") or {}).get("nodeAffinity") or {}
    terms = (na.get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms") or []
    out: set[str] = set()
    for term in terms:
        for e in term.get("matchExpressions") or []:
            if e.get("key") == HOSTNAME_LABEL and e.get("operator") == "In":
                out.update(str(v) for v in e.get("values") or [])
    return out


def pod_anti_affinity(selector: Mapping[str, str], required: bool) -> dict[str, Any]:
    """Keep pods matching ``selector`` (one stage of one gear) on distinct nodes.

    ``required`` for planner-named nodes (one pod per named node, as planned); preferred otherwise, so
    that a hand-written stage with more replicas than labelled nodes still schedules.
    """
    term = {"labelSelector": {"matchLabels": dict(sorted(selector.items()))}, "topologyKey": HOSTNAME_LABEL}
    if required:
        return {"requiredDuringSchedulingIgnoredDuringExecution": [term]}
    return {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": term}]}


def gpu_tolerations() -> list[dict[str, Any]]:
    """Tolerate the ``nvidia.com/gpu`` taint GPU pools commonly carry (any value, NoSchedule)."""
    return [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]


def gpu_resources(gpus: int, cpu: str | None = None, memory: str | None = None) -> dict[str, Any]:
    """Container resources: ``gpus`` whole GPUs (extended resources go in limits; requests default to them).

    Raises:
        ValueError: ``gpus`` < 1.
    """
    if gpus < 1:
        raise ValueError(f"a stage needs at least 1 GPU, got gpus={gpus}")
    limits: dict[str, Any] = {GPU_RESOURCE: str(gpus)}
    requests: dict[str, Any] = {}
    if cpu:
        requests["cpu"] = cpu
    if memory:
        requests["memory"] = memory
    out: dict[str, Any] = {"limits": limits}
    if requests:
        out["requests"] = requests
    return out


def quantity_int(value: Any) -> int:
    """An integer Kubernetes quantity or label value (``"2"``), 0 when it is not one."""
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return 0


def pod_gpus(pod: Mapping[str, Any]) -> int:
    """``nvidia.com/gpu`` a pod holds: its containers' limits (or requests where a limit is absent),
    summed; init containers run one at a time before the others and release theirs, so the pod holds the
    larger of the two (the scheduler's effective request, Kubernetes "Resource sharing within containers").
    A value that is not a whole number counts 0 (extended resources are whole numbers)."""
    spec = pod.get("spec") or {}

    def each(containers: Iterable[Mapping[str, Any]]) -> list[int]:
        out = []
        for c in containers:
            res = c.get("resources") or {}
            raw = (res.get("limits") or {}).get(GPU_RESOURCE, (res.get("requests") or {}).get(GPU_RESOURCE))
            out.append(max(0, quantity_int(raw)))
        return out

    main, init = each(spec.get("containers") or []), each(spec.get("initContainers") or [])
    return max(sum(main), max(init, default=0))
