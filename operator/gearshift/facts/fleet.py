"""Fleet description files: the GPU nodes of a sandbox (or of a planning exercise) in one YAML file.

A fleet file names node pools of one GPU model each (see ``examples/fleets/mixed.yaml``)::

    name: mixed
    network: {latencyUs: 10}
    gpuSharing: {strategy: time-slicing, replicas: 2}   # optional; default whole cards
    nodePools:
      - {name: h100, gpu: H100-80GB, nodes: 2, gpusPerNode: 1, nicGbps: 200}

A pool may state ``pricePerGpuHour`` (a number > 0, any currency per card-hour); the fleet-scale planner
(:mod:`gearshift.planner.fleetplan`) prices plans with it, else it counts GPUs.

From it this module derives, without any I/O beyond reading the file:
  - the fake nodes of the sandbox (names ``gpu-<pool>-<i>``, datasheet figures, a loopback podCIDR);
  - the planner's *resource profile* in FlexPipe's format (docs/sources.md#resource-profile), from datasheet
    figures, for planning before any probe has run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gearshift.facts.gpus import GPUSpec, compute_score, gpu_spec

#: Tensor-parallel efficiency when one stage spans several cards of a node (docs/sources.md#gpu-prior: ×0.85
#: for TP>1).
TP_EFFICIENCY = 0.85


def tp_efficiency(gpus: int, efficiency: float = TP_EFFICIENCY) -> float:
    """The factor a stage's summed compute is scaled by: ``efficiency`` when it spans more than one card
    (``gpus > 1``), else 1.0 (one card loses nothing to tensor-parallel communication)."""
    return efficiency if gpus > 1 else 1.0


class FleetError(ValueError):
    """A fleet file that cannot be used; the message names the field and the fix."""


@dataclass(frozen=True)
class FleetNode:
    """One GPU node of a fleet."""

    name: str
    pool: str
    gpu: GPUSpec
    gpus: int
    nic_gbps: float
    """Network interface bandwidth to other nodes, Gb/s."""
    latency_us: float
    """One-hop latency to other nodes, µs."""
    price_per_gpu_hour: float | None = None
    """The pool's ``pricePerGpuHour`` (per card-hour), None when the file states none."""

    @property
    def memory_gib(self) -> float:
        """GPU memory of the whole node, GiB."""
        return self.gpu.memory_gib * self.gpus

    @property
    def compute_score(self) -> float:
        """Datasheet compute score of the node (H100 SXM card = 1.0), with TP efficiency for >1 card."""
        return compute_score(self.gpu.model) * self.gpus * tp_efficiency(self.gpus)


@dataclass(frozen=True)
class Fleet:
    """A parsed fleet file."""

    name: str
    nodes: tuple[FleetNode, ...]
    gpu_replicas: int = 1
    """Schedulable ``nvidia.com/gpu`` per physical card (NVIDIA time-slicing ``replicas``; 1: whole cards)."""

    def link(self, a: FleetNode, b: FleetNode) -> tuple[float, float]:
        """Bandwidth (Gb/s) and latency (µs) between two distinct nodes: the slower NIC bounds the link."""
        return min(a.nic_gbps, b.nic_gbps), max(a.latency_us, b.latency_us)


_KIND_NAMES = {int: "an integer", float: "a number", str: "a string", list: "a list", dict: "a mapping"}
_FLEET_KEYS = {"name", "network", "gpuSharing", "nodePools"}
_POOL_KEYS = {"name", "gpu", "nodes", "gpusPerNode", "nicGbps", "pricePerGpuHour"}


def _field(obj: dict[str, Any], key: str, where: str, kind: type, default: Any = None) -> Any:
    if key not in obj or obj[key] is None:
        if default is not None:
            return default
        raise FleetError(f"{where}.{key} is required")
    value = obj[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise FleetError(f"{where}.{key} must be {_KIND_NAMES.get(kind, kind.__name__)}, got {value!r}")
    return value


def _no_unknown_keys(obj: dict[str, Any], allowed: set[str], where: str) -> None:
    # A typo (gpusPerNod) must not silently fall back to a default.
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise FleetError(
            f"{where}: unknown field(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}"
        )


def parse_fleet(doc: dict[str, Any]) -> Fleet:
    """Parse a fleet document (the YAML's mapping).

    Raises:
        FleetError: a missing or mistyped field, an unknown GPU model, a non-positive count,
            or a duplicate pool name; the message names the field (``nodePools[2].gpu``).
    """
    if not isinstance(doc, dict):
        raise FleetError("a fleet file must be a mapping with 'name' and 'nodePools'")
    _no_unknown_keys(doc, _FLEET_KEYS, "fleet")
    name = _field(doc, "name", "fleet", str)
    network = doc.get("network") or {}
    if not isinstance(network, dict):
        raise FleetError("fleet.network must be a mapping like {latencyUs: 10}")
    latency = _field(network, "latencyUs", "network", float, 10.0)
    if not (math.isfinite(latency) and latency >= 0):
        raise FleetError(f"network.latencyUs must be a finite number >= 0, got {latency}")
    sharing = doc.get("gpuSharing") or {}
    if not isinstance(sharing, dict):
        raise FleetError("fleet.gpuSharing must be a mapping like {strategy: time-slicing, replicas: 2}")
    gpu_replicas = _field(sharing, "replicas", "gpuSharing", int, 1)
    if gpu_replicas < 1:
        raise FleetError(f"gpuSharing.replicas must be >= 1, got {gpu_replicas}")
    pools = _field(doc, "nodePools", "fleet", list)
    if not pools:
        raise FleetError("fleet.nodePools must list at least one pool")
    nodes: list[FleetNode] = []
    seen: set[str] = set()
    for i, pool in enumerate(pools):
        where = f"nodePools[{i}]"
        if not isinstance(pool, dict):
            raise FleetError(f"{where} must be a mapping")
        _no_unknown_keys(pool, _POOL_KEYS, where)
        pname = _field(pool, "name", where, str)
        if pname in seen:
            raise FleetError(f"{where}.name {pname!r} is used twice; pool names must be unique")
        seen.add(pname)
        try:
            spec = gpu_spec(_field(pool, "gpu", where, str))
        except KeyError as exc:
            raise FleetError(f"{where}.gpu: {exc.args[0]}") from None
        count = _field(pool, "nodes", where, int)
        gpus = _field(pool, "gpusPerNode", where, int, 1)
        nic = _field(pool, "nicGbps", where, float, 100.0)
        price = pool.get("pricePerGpuHour")
        if price is not None:
            price = _field(pool, "pricePerGpuHour", where, float)
        for key, value in (
            ("nodes", count),
            ("gpusPerNode", gpus),
            ("nicGbps", nic),
            ("pricePerGpuHour", price),
        ):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise FleetError(f"{where}.{key} must be a finite number > 0, got {value}")
        for k in range(count):
            nodes.append(FleetNode(f"gpu-{pname}-{k}", pname, spec, gpus, nic, latency, price))
    return Fleet(name, tuple(nodes), gpu_replicas)


def load_fleet(path: str | Path) -> Fleet:
    """Read and parse a fleet YAML file.

    Raises:
        FleetError: the file is not YAML (with the line and column) or its content is wrong.
        OSError: unreadable.
    """
    with Path(path).open() as fh:
        try:
            doc = yaml.safe_load(fh)
        except yaml.YAMLError as exc:
            where = getattr(exc, "problem_mark", None)
            at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
            raise FleetError(f"not valid YAML{at}: {getattr(exc, 'problem', None) or exc}") from None
    return parse_fleet(doc)


def max_micro_batch(memory_gib: float) -> int:
    """Datasheet guess of the largest micro-batch a node runs well before a probe measures it.

    A heuristic, not a measurement: 16 from 40 GiB up, 8 from 24 GiB, else 4.
    """
    if memory_gib >= 40:
        return 16
    if memory_gib >= 24:
        return 8
    return 4


def datasheet_profile(fleet: Fleet) -> dict[str, Any]:
    """The fleet as the planner's resource profile (FlexPipe's format, docs/sources.md#resource-profile), from
    datasheet figures.

    Returns ``{"nodes": [{node_id, generation, memory_gb, compute_score, max_batch_microbatch,
    interconnect: {peer_id: {bandwidth_gbps, latency_us}}}]}``; ``memory_gb`` is the node's GPU memory
    (GiB), bandwidth in Gb/s, latency in µs; every pair of distinct nodes is linked.
    """
    out = []
    for n in fleet.nodes:
        links = {}
        for m in fleet.nodes:
            if m.name != n.name:
                bw, lat = fleet.link(n, m)
                links[m.name] = {"bandwidth_gbps": bw, "latency_us": lat}
        out.append(
            {
                "node_id": n.name,
                "generation": n.gpu.generation,
                "gpu_model": n.gpu.model,
                "memory_gb": n.memory_gib,
                "compute_score": round(n.compute_score, 6),
                "max_batch_microbatch": max_micro_batch(n.gpu.memory_gib),
                "interconnect": links,
            }
        )
    return {"nodes": out}
