"""Fleet file → Node manifests shaped as a real GPU node is (pure: no I/O, no client).

GPU nodes carry what NVIDIA's GPU feature discovery (GFD) and device plugin put on a real GPU node:
labels ``nvidia.com/gpu.product|memory|count|family|replicas|sharing-strategy|present`` (memory in MiB per
card), capacity ``nvidia.com/gpu``, and the taint ``nvidia.com/gpu=present:NoSchedule`` that GPU pools
commonly carry (GKE and AKS taint GPU pools this way); the datasheet figures from ``gearshift.facts.gpus`` go
into ``gearshift.io/*`` annotations. The profile-derived labels (``gearshift.io/gpu-model`` …) are not
set here: the operator writes them after probing.

Two users: ``gearshift render`` stands these in for a cluster's nodes, and the sandbox
(:mod:`gearshift.dev.sandbox.nodes`) adds its addresses and kwok's markers to create them.
"""

from __future__ import annotations

from typing import Any

from gearshift.facts.fleet import Fleet, FleetNode
from gearshift.k8s import names

#: Label naming the node's pool (the fleet pool, or ``cpu`` for the plain nodes).
POOL_LABEL = "gearshift.io/node-pool"
#: Taint of a GPU node; pods that need a GPU tolerate it.
GPU_TAINT: dict[str, str] = {"key": names.GPU_RESOURCE, "value": "present", "effect": "NoSchedule"}
#: Plain nodes for the operator, router and Prometheus pods.
CPU_POOL = "cpu"

# Host resources are not in the fleet format; these are typical of cloud GPU VMs (16 vCPU and 128 GiB
# per card, e.g. AWS p4d/p5: 96 vCPU and 1152-2048 GiB for 8 cards) and of a small CPU worker.
GPU_NODE_CPU_PER_GPU = 16
GPU_NODE_MEMORY_GIB_PER_GPU = 128
CPU_NODE_CPU = 16
CPU_NODE_MEMORY_GIB = 64
#: The kubelet's default ``maxPods``.
MAX_PODS = 110

#: GFD's ``nvidia.com/gpu.family`` value per architecture (GFD writes the architecture's lower-case name).
GFD_FAMILY = {"ada": "ada-lovelace"}

#: Prefix of the datasheet annotations on each GPU node (values from ``gearshift.facts.gpus`` and the
#: fleet file).
ANNOTATION_PREFIX = names.ANNOTATION_PREFIX


def _base_node(name: str, pool: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                POOL_LABEL: pool,
            },
            "annotations": {},
        },
        "spec": {},
        "status": {},
    }


def _resources(cpu: int, memory_gib: int, gpus: int = 0, max_pods: int = MAX_PODS) -> dict[str, str]:
    res = {"cpu": str(cpu), "memory": f"{memory_gib}Gi", "pods": str(max_pods), "ephemeral-storage": "500Gi"}
    if gpus:
        res[names.GPU_RESOURCE] = str(gpus)
    return res


def gpu_node(node: FleetNode, gpu_replicas: int = 1, max_pods: int = MAX_PODS) -> dict[str, Any]:
    """The Node manifest (with ``status`` capacity and allocatable) of one fleet node.

    Args:
        node: the fleet node (``gearshift.facts.fleet``); its datasheet comes from ``gearshift.facts.gpus``.
        gpu_replicas: ``nvidia.com/gpu`` advertised per card (time-slicing, as NVIDIA's device plugin
            does with ``replicas``; labels ``nvidia.com/gpu.replicas`` and ``.sharing-strategy`` say so).
        max_pods: the node's ``pods`` capacity.
    """
    spec = node.gpu
    manifest = _base_node(node.name, node.pool)
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
    cpu, memory = GPU_NODE_CPU_PER_GPU * node.gpus, GPU_NODE_MEMORY_GIB_PER_GPU * node.gpus
    res = _resources(cpu, memory, node.gpus * gpu_replicas, max_pods)
    manifest["status"].update({"capacity": res, "allocatable": dict(res)})
    return manifest


def cpu_node(i: int, max_pods: int = MAX_PODS) -> dict[str, Any]:
    """The Node manifest of plain CPU node ``cpu-<i>`` (no GPU, no taint)."""
    manifest = _base_node(f"cpu-{i}", CPU_POOL)
    res = _resources(CPU_NODE_CPU, CPU_NODE_MEMORY_GIB, max_pods=max_pods)
    manifest["status"].update({"capacity": res, "allocatable": dict(res)})
    return manifest


def fleet_nodes(fleet: Fleet, cpu_nodes: int = 0, max_pods: int = MAX_PODS) -> list[dict[str, Any]]:
    """All Node manifests of a fleet: its GPU nodes (``gpu-<pool>-<i>``), then ``cpu-0`` … ``cpu-<n-1>``."""
    out = [gpu_node(n, fleet.gpu_replicas, max_pods) for n in fleet.nodes]
    return out + [cpu_node(k, max_pods) for k in range(cpu_nodes)]


def _num(x: float) -> str:
    """A number as an annotation value: integral floats without the ``.0``."""
    return str(int(x)) if float(x).is_integer() else str(x)
