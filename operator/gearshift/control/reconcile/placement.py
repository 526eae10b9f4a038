"""Where gears may run and what keeps them from it: the nodes an explicit GearSet names or selects, the
placement problems and lost nodes of a gear, and the nodes a service runs on.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from gearshift.api.gearset import Gear
from gearshift.k8s import names
from gearshift.k8s.placement import pinned_nodes
from gearshift.planner.inputs import node_ready, usable_profile


def _labels_match(node: Mapping[str, Any], selector: Mapping[str, str]) -> bool:
    labels = (node.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


def _node_gpu_model(node: Mapping[str, Any], profiles: Mapping[str, Mapping[str, Any]]) -> str:
    meta = node.get("metadata") or {}
    name = meta.get("name", "")
    eff = usable_profile(profiles[name]) if name in profiles else None
    if eff and eff.gpu_model:
        return eff.gpu_model
    labels = meta.get("labels") or {}
    ann = meta.get("annotations") or {}
    return str(labels.get(names.NODE_GPU_MODEL) or ann.get(names.NODE_GPU_MODEL) or "unknown")


def explicit_pool(
    gears: Sequence[Gear], nodes: Mapping[str, Mapping[str, Any]], profiles: Mapping[str, Mapping[str, Any]]
) -> dict[str, str]:
    """``{node: GPU model}`` an explicit GearSet may use: nodes its stages name or select."""
    out: dict[str, str] = {}
    for g in gears:
        for st in g.stages:
            if st.nodes:
                picked = [nodes[n] for n in st.nodes if n in nodes]
            elif st.node_selector:
                picked = [n for n in nodes.values() if _labels_match(n, st.node_selector)]
            else:
                picked = []
            for n in picked:
                out[n["metadata"]["name"]] = _node_gpu_model(n, profiles)
    return out


def placement_problems(
    role: str,
    gear: Gear,
    nodes: Mapping[str, Mapping[str, Any]],
    bound: Collection[str] = (),
) -> tuple[list[str], list[str]]:
    """``(problems, lost)`` of one gear: what keeps stages from being placed, and named nodes that are lost.

    A named node is *lost* when it is there but not Ready, or gone while the service was using it
    (``bound``: nodes the service's pods are bound to, or its StatefulSets are pinned to). A name no
    Node has and the service never used is a placement problem only (most likely a misspelling in an
    explicit gear): reporting it as lost would mark the service Degraded for a node it never had.
    """
    problems: list[str] = []
    lost: list[str] = []
    for k, st in enumerate(gear.stages):
        where = f"{role} gear {gear.name!r} stage {k}"
        if st.nodes:
            gone = [n for n in st.nodes if n not in nodes or not node_ready(nodes[n])]
            lost += [n for n in gone if n in nodes or n in bound]
            unknown = [n for n in gone if n not in nodes and n not in bound]
            if unknown:
                problems.append(
                    f"{where}: no Node named {', '.join(unknown)} (check the names in the gear's "
                    f"stages[{k}].nodes, e.g. with `kubectl get nodes`)"
                )
            if len(unknown) < len(gone):
                problems.append(
                    f"{where}: node(s) {', '.join(n for n in gone if n not in unknown)} missing or not Ready"
                )
        elif st.node_selector:
            ok = [n for n in nodes.values() if node_ready(n) and _labels_match(n, st.node_selector)]
            if not ok:
                sel = ",".join(f"{k2}={v}" for k2, v in sorted(st.node_selector.items()))
                problems.append(f"{where}: no Ready node has labels {sel}")
    return problems, lost


def bound_nodes(pods: Iterable[Mapping[str, Any]], statefulsets: Iterable[Mapping[str, Any]]) -> set[str]:
    """Nodes the service runs on: those its ``pods`` are bound to and its ``statefulsets`` are pinned to.

    Pods of a deleted node are garbage-collected soon after it goes; the StatefulSet pinned to it stays.
    """
    out = {str(p["spec"]["nodeName"]) for p in pods if (p.get("spec") or {}).get("nodeName")}
    for sts in statefulsets:
        out |= pinned_nodes(sts)
    return out
