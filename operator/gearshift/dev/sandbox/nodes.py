"""Fleet file → the sandbox's Node manifests (pure: no I/O, no client).

Every sandbox node gets, by its index ``i`` in the node list (GPU nodes first, then the CPU nodes):
  - ``spec.podCIDR`` ``127.<octet>.<i+1>.0/24``: kwok hands each pod an address from its node's podCIDR,
    so every pod IP is a loopback address on this machine;
  - an InternalIP ``127.<octet>.0.<i+1>`` (the pods' ``status.hostIP``), outside every podCIDR.
``octet`` is the sandbox's own second octet (see ``layout``), never 0, so two sandboxes on one machine
get disjoint pod IPs and neither touches 127.0.0.0/24 (127.0.0.1, the resolver's 127.0.0.53).

A fleet of more than ``MAX_NODES`` nodes (the fleet-scale benchmark's 1,000) gets the *dense* plan
instead, still inside ``127.<octet>.0.0/16`` and outside kwok's own ``127.<octet>.255.0/24``:
  - ``spec.podCIDR`` a /27 (32 addresses, so ``pods`` capacity 30) from ``127.<octet>.8.0`` upwards;
  - InternalIP ``127.<octet>.<i // 254>.<i % 254 + 1>`` (third octet 0-7), outside every podCIDR.
It holds ``MAX_DENSE_NODES`` nodes; smaller fleets keep the /24 plan (110 pods per node) unchanged.

The GPU and CPU nodes themselves (GFD labels, capacity, taint, datasheet annotations) are
:mod:`gearshift.k8s.fleetnodes`'s; this module adds the sandbox's addresses and kwok's markers.
"""

from __future__ import annotations

from typing import Any

from gearshift.facts.fleet import Fleet, FleetNode
from gearshift.k8s import fleetnodes

#: Label a pod sets to have the sandbox's local pod runner run its container (see ``podrunner``).
SANDBOX_RUN_LABEL = "gearshift.io/sandbox-run"
DEFAULT_CPU_NODES = 2
#: Largest node count of the /24 plan: one /24 per node in 127.<octet>.1-254.0.
MAX_NODES = 254
#: The dense plan: a /27 per node from 127.<octet>.<DENSE_FIRST_BLOCK>.0 up to .254.224/27 (.255 is kwok's).
DENSE_PREFIX = 27
DENSE_FIRST_BLOCK = 8
DENSE_PER_BLOCK = 256 >> (32 - DENSE_PREFIX)
MAX_DENSE_NODES = (255 - DENSE_FIRST_BLOCK) * DENSE_PER_BLOCK
#: Pods per node of the dense plan: its /27 less the network and broadcast addresses.
DENSE_MAX_PODS = (1 << (32 - DENSE_PREFIX)) - 2


class NodeLayoutError(ValueError):
    """The fleet does not fit the sandbox's address plan; the message names the limit and the fix."""


def node_pod_cidr(octet: int, index: int, dense: bool = False) -> str:
    """The podCIDR of the sandbox's node number ``index`` (0-based): ``127.<octet>.<index+1>.0/24``, or
    with ``dense`` the index's /27 from ``127.<octet>.8.0`` (see the module docstring).

    Raises:
        NodeLayoutError: ``octet`` outside 1..255 or ``index`` outside 0..253 (dense: 0..1975).
    """
    _check(octet, index, dense)
    if dense:
        block, slot = divmod(index, DENSE_PER_BLOCK)
        size = 1 << (32 - DENSE_PREFIX)
        return f"127.{octet}.{DENSE_FIRST_BLOCK + block}.{slot * size}/{DENSE_PREFIX}"
    return f"127.{octet}.{index + 1}.0/24"


def node_ip(octet: int, index: int, dense: bool = False) -> str:
    """The InternalIP of node ``index``: ``127.<octet>.0.<index+1>`` (dense: ``127.<octet>.<index //
    254>.<index % 254 + 1>``), outside every podCIDR."""
    _check(octet, index, dense)
    if dense:
        return f"127.{octet}.{index // MAX_NODES}.{index % MAX_NODES + 1}"
    return f"127.{octet}.0.{index + 1}"


def _check(octet: int, index: int, dense: bool = False) -> None:
    if not 1 <= octet <= 255:
        raise NodeLayoutError(f"sandbox octet must be in 1..255 (127.0.x.x is the host's), got {octet}")
    if dense:
        if not 0 <= index < MAX_DENSE_NODES:
            raise NodeLayoutError(
                f"node index {index} outside 0..{MAX_DENSE_NODES - 1}: a sandbox holds at most "
                f"{MAX_DENSE_NODES} nodes; use a smaller fleet file"
            )
        return
    if not 0 <= index < MAX_NODES:
        raise NodeLayoutError(
            f"node index {index} outside 0..{MAX_NODES - 1}: a sandbox holds at most {MAX_NODES} nodes; "
            "use a smaller fleet file"
        )


def _place(manifest: dict[str, Any], index: int, octet: int, dense: bool = False) -> dict[str, Any]:
    """``manifest`` (a :mod:`gearshift.k8s.fleetnodes` Node) as the sandbox's node number ``index``: its
    podCIDR and addresses, and kwok's markers."""
    cidr = node_pod_cidr(octet, index, dense)
    meta = manifest["metadata"]
    meta["labels"]["type"] = "kwok"
    # kwokctl's binary runtime manages every node; the annotation is kwok's own marker of a fake
    # node, so tools that filter on it see these as fake too.
    meta["annotations"].update({"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"})
    manifest["spec"].update({"podCIDR": cidr, "podCIDRs": [cidr]})
    manifest["status"]["addresses"] = [
        {"type": "InternalIP", "address": node_ip(octet, index, dense)},
        {"type": "Hostname", "address": meta["name"]},
    ]
    return manifest


def _max_pods(dense: bool) -> int:
    return DENSE_MAX_PODS if dense else fleetnodes.MAX_PODS


def gpu_node_manifest(
    node: FleetNode, index: int, octet: int, gpu_replicas: int = 1, dense: bool = False
) -> dict[str, Any]:
    """The Node manifest (with ``status`` capacity/allocatable/addresses) of one fleet node.

    Args:
        node: the fleet node (``gearshift.facts.fleet``); its datasheet comes from ``gearshift.facts.gpus``.
        index: the node's position in the sandbox's node list (sets its podCIDR and IP).
        octet: the sandbox's second octet.
        gpu_replicas: ``nvidia.com/gpu`` advertised per card (see :func:`gearshift.k8s.fleetnodes.gpu_node`).
        dense: the dense address plan (fleets of more than ``MAX_NODES`` nodes).

    Raises:
        NodeLayoutError: ``octet`` or ``index`` outside the address plan.
    """
    return _place(fleetnodes.gpu_node(node, gpu_replicas, _max_pods(dense)), index, octet, dense)


def cpu_node_manifest(i: int, index: int, octet: int, dense: bool = False) -> dict[str, Any]:
    """The Node manifest of plain CPU node ``cpu-<i>`` (no GPU, no taint) as sandbox node ``index``."""
    return _place(fleetnodes.cpu_node(i, _max_pods(dense)), index, octet, dense)


def sandbox_nodes(fleet: Fleet, octet: int, cpu_nodes: int = DEFAULT_CPU_NODES) -> list[dict[str, Any]]:
    """All Node manifests of a sandbox: the fleet's GPU nodes (``gpu-<pool>-<i>``), then ``cpu-0..``;
    the dense address plan when there are more than ``MAX_NODES``.

    Raises:
        NodeLayoutError: more than ``MAX_DENSE_NODES`` nodes, or a bad octet.
    """
    total = len(fleet.nodes) + cpu_nodes
    if total > MAX_DENSE_NODES:
        raise NodeLayoutError(
            f"the fleet has {len(fleet.nodes)} GPU nodes + {cpu_nodes} CPU nodes = {total}; "
            f"a sandbox holds at most {MAX_DENSE_NODES}: use a smaller fleet file"
        )
    dense = total > MAX_NODES
    out = [gpu_node_manifest(n, i, octet, fleet.gpu_replicas, dense) for i, n in enumerate(fleet.nodes)]
    out += [cpu_node_manifest(k, len(fleet.nodes) + k, octet, dense) for k in range(cpu_nodes)]
    return out
