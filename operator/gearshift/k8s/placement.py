"""Where a stage's pods may run: node affinity, anti-affinity, GPU tolerations and GPU requests.

A stage that names nodes (the planner's gears always do) is pinned to them by required node affinity on
``kubernetes.io/hostname``, with required pod anti-affinity so that the stage's pods take one node each,
as the planner assigned them. A stage that only gives ``nodeSelector`` labels (hand-written gears such as
``gearshift.io/gpu-model: H100-80GB``) is placed on any node with those labels, its pods spread over
nodes when possible. Pure: plain dicts, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

#: The extended resource of the NVIDIA device plugin (also advertised by the sandbox's fake nodes).
GPU_RESOURCE = "nvidia.com/gpu"
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
