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

GPU nodes carry what NVIDIA's GPU feature discovery (GFD) and device plugin put on a real GPU node:
labels ``nvidia.com/gpu.product|memory|count|family|replicas|sharing-strategy|present`` (memory in MiB per
card), capacity ``nvidia.com/gpu``, and the taint ``nvidia.com/gpu=present:NoSchedule`` that GPU pools
commonly carry (GKE and AKS taint GPU pools this way); the datasheet figures from ``gearshift.facts.gpus`` go
into ``gearshift.io/*`` annotations. The profile-derived labels (``gearshift.io/gpu-model`` …) are not
set here: the operator writes them after probing.
"""

from __future__ import annotations

from typing import Any

from gearshift.facts.fleet import Fleet, FleetNode
from gearshift.k8s import names

#: Label a pod sets to have the sandbox's local pod runner run its container (see ``podrunner``).
SANDBOX_RUN_LABEL = "gearshift.io/sandbox-run"
#: Label naming the node's pool (the fleet pool, or ``cpu`` for the plain nodes).
POOL_LABEL = "gearshift.io/node-pool"
#: Taint of a GPU node; pods that need a GPU tolerate it.
GPU_TAINT: dict[str, str] = {"key": names.GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}
#: Plain nodes for the operator, router and Prometheus pods.
CPU_POOL = "cpu"
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

# Host resources are not in the fleet format; these are typical of cloud GPU VMs (16 vCPU and 128 GiB
# per card, e.g. AWS p4d/p5: 96 vCPU and 1152-2048 GiB for 8 cards) and of a small CPU worker.
GPU_NODE_CPU_PER_GPU = 16
GPU_NODE_MEMORY_GIB_PER_GPU = 128
CPU_NODE_CPU = 16
CPU_NODE_MEMORY_GIB = 64
MAX_PODS = 110

#: GFD's ``nvidia.com/gpu.family`` value per architecture (GFD writes the architecture's lower-case name).
GFD_FAMILY = {"ada": "ada-lovelace"}

#: Prefix of the datasheet annotations on each GPU node (values from ``gearshift.facts.gpus`` and the
#: fleet file).
ANNOTATION_PREFIX = names.ANNOTATION_PREFIX


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


def _base_node(name: str, pool: str, index: int, octet: int, dense: bool = False) -> dict[str, Any]:
    cidr = node_pod_cidr(octet, index, dense)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                POOL_LABEL: pool,
            },
            # kwokctl's binary runtime manages every node; the annotation is kwok's own marker of a fake
            # node, so tools that filter on it see these as fake too.
            "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {"podCIDR": cidr, "podCIDRs": [cidr]},
        "status": {
            "addresses": [
                {"type": "InternalIP", "address": node_ip(octet, index, dense)},
                {"type": "Hostname", "address": name},
            ],
        },
    }


def _resources(cpu: int, memory_gib: int, gpus: int = 0, dense: bool = False) -> dict[str, str]:
    pods = DENSE_MAX_PODS if dense else MAX_PODS
    res = {"cpu": str(cpu), "memory": f"{memory_gib}Gi", "pods": str(pods), "ephemeral-storage": "500Gi"}
    if gpus:
        res[names.GPU_RESOURCE] = str(gpus)
    return res


def gpu_node_manifest(
    node: FleetNode, index: int, octet: int, gpu_replicas: int = 1, dense: bool = False
) -> dict[str, Any]:
    """The Node manifest (with ``status`` capacity/allocatable/addresses) of one fleet node.

    Args:
        node: the fleet node (``gearshift.facts.fleet``); its datasheet comes from ``gearshift.facts.gpus``.
        index: the node's position in the sandbox's node list (sets its podCIDR and IP).
        octet: the sandbox's second octet.
        gpu_replicas: ``nvidia.com/gpu`` advertised per card (time-slicing, as NVIDIA's device plugin
            does with ``replicas``; labels ``nvidia.com/gpu.replicas`` and ``.sharing-strategy`` say so).
        dense: the dense address plan (fleets of more than ``MAX_NODES`` nodes).
    """
    spec = node.gpu
    manifest = _base_node(node.name, node.pool, index, octet, dense)
    meta = manifest["metadata"]
    meta["labels"].update(
        {
            "nvidia.com/gpu.present": "true",
            "nvidia.com/gpu.product": spec.product,
            "nvidia.com/gpu.memory": str(round(spec.memory_gib * 1024)),
            "nvidia.com/gpu.count": str(node.gpus),
            "nvidia.com/gpu.family": GFD_FAMILY.get(spec.generation, spec.generation),
            "nvidia.com/gpu.replicas": str(gpu_replicas),
            "nvidia.com/gpu.sharing-strategy": "time-slicing" if gpu_replicas > 1 else "none",
        }
    )
    meta["annotations"].update(
        {
            ANNOTATION_PREFIX + "gpu-model": spec.model,
            ANNOTATION_PREFIX + "generation": spec.generation,
            ANNOTATION_PREFIX + "bf16-tflops": _num(spec.bf16_tflops),
            ANNOTATION_PREFIX + "hbm-gbps": _num(spec.hbm_gbps),
            ANNOTATION_PREFIX + "memory-gib": _num(spec.memory_gib),
            ANNOTATION_PREFIX + "intra-node-gbps": _num(spec.intra_node_gbps),
            ANNOTATION_PREFIX + "nic-gbps": _num(node.nic_gbps),
            ANNOTATION_PREFIX + "latency-us": _num(node.latency_us),
        }
    )
    manifest["spec"]["taints"] = [dict(GPU_TAINT)]
    res = _resources(
        GPU_NODE_CPU_PER_GPU * node.gpus,
        GPU_NODE_MEMORY_GIB_PER_GPU * node.gpus,
        node.gpus * gpu_replicas,
        dense,
    )
    manifest["status"].update({"capacity": res, "allocatable": dict(res)})
    return manifest


def cpu_node_manifest(i: int, index: int, octet: int, dense: bool = False) -> dict[str, Any]:
    """The Node manifest of plain CPU node ``cpu-<i>`` (no GPU, no taint)."""
    manifest = _base_node(f"cpu-{i}", CPU_POOL, index, octet, dense)
    res = _resources(CPU_NODE_CPU, CPU_NODE_MEMORY_GIB, dense=dense)
    manifest["status"].update({"capacity": res, "allocatable": dict(res)})
    return manifest


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


def _num(x: float) -> str:
    """A number as an annotation value: integral floats without the ``.0``."""
    return str(int(x)) if float(x).is_integer() else str(x)
