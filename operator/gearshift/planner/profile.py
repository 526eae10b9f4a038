"""The resource profile the planner plans on: GPU nodes and the links between them (FlexPipe's format,
docs/sources.md#link-cap).

A profile document is ``{"nodes": [{node_id, generation, memory_gb, compute_score,
max_batch_microbatch, interconnect: {peer_id: {bandwidth_gbps, latency_us}}}]}`` -- what the probe
measures and what :func:`gearshift.facts.fleet.datasheet_profile` derives from datasheets. ``memory_gb`` is
the node's GPU memory in GiB, ``compute_score`` its speed relative to an H100 SXM card (1.0), bandwidth in
Gb/s, latency in µs. FlexPipe writes peer keys as ``to_gpu_002`` for node ``gpu-002``
(docs/sources.md#resource-profile); both spellings are accepted.

Links are symmetric: a link listed by either end serves both directions; when both ends list it, the
lower bandwidth and the higher latency count (the slower direction bounds a pipeline).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from gearshift.planner.errors import EmptyFleetError, PlanInputError

#: Adjacent stages may use at most this share of their link (docs/sources.md#link-cap: "at most 70% of the
#: link bandwidth").
LINK_CAP = 0.7


@dataclass(frozen=True)
class Link:
    """A network link between two nodes."""

    bandwidth_gbps: float
    """Gb/s."""
    latency_us: float
    """One-way latency, µs."""

    def transfer_ms(self, activation_mb: float) -> float:
        """Time to send ``activation_mb`` MB (10^6 bytes) over the link: ``mb·8/Gbps + µs/1000``, ms."""
        return activation_mb * 8.0 / self.bandwidth_gbps + self.latency_us / 1000.0

    def cap_ms(self, activation_mb: float) -> float:
        """Least bottleneck (ms) at which ``activation_mb`` per micro-batch stays under the 70% cap.

        One micro-batch crosses the link per bottleneck period, so its traffic share is
        ``(mb·8/Gbps) / bottleneck``; requiring it ≤ :data:`LINK_CAP` gives ``mb·8/Gbps/0.7``
        (docs/sources.md#link-cap).
        """
        return activation_mb * 8.0 / self.bandwidth_gbps / LINK_CAP


@dataclass(frozen=True)
class Node:
    """One GPU node as the planner sees it (a whole node: all its cards form one stage)."""

    node_id: str
    memory_gb: float
    """GPU memory of the node, GiB."""
    compute_score: float
    """Speed relative to one H100 SXM card (1.0); a stage's time is its reference time / score."""
    max_micro_batch: int
    """Largest micro-batch the node runs (``max_batch_microbatch``)."""
    generation: str = ""
    gpu_model: str | None = None


@dataclass(frozen=True)
class Profile:
    """A parsed resource profile: nodes in their given order and the symmetric link table."""

    nodes: tuple[Node, ...]
    links: Mapping[frozenset[str], Link] = field(default_factory=dict)

    def link(self, a: str, b: str) -> Link | None:
        """The link between nodes ``a`` and ``b`` (either order), or None when the profile has none."""
        return self.links.get(frozenset((a, b)))

    @cached_property
    def _by_id(self) -> dict[str, Node]:
        # Computed once per profile: a fleet of hundreds of nodes looks nodes up millions of times.
        return {n.node_id: n for n in self.nodes}

    def node(self, node_id: str) -> Node:
        """The node named ``node_id``. Raises KeyError naming it."""
        try:
            return self._by_id[node_id]
        except KeyError:
            raise KeyError(f"no node {node_id!r} in the profile") from None

    def subset(self, node_ids: set[str] | frozenset[str]) -> Profile:
        """The profile restricted to ``node_ids`` (their links kept)."""
        nodes = tuple(n for n in self.nodes if n.node_id in node_ids)
        links = {k: v for k, v in self.links.items() if k <= node_ids}
        return Profile(nodes, links)


def _number(obj: Mapping[str, Any], key: str, where: str, *, positive: bool = True) -> float:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PlanInputError(f"{where}.{key} must be a number, got {value!r}")
    if value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise PlanInputError(f"{where}.{key} must be {bound}, got {value!r}")
    return float(value)


def _resolve_peer(key: str, ids: set[str]) -> str | None:
    if key in ids:
        return key
    bare = key.removeprefix("to_")
    for candidate in (bare, bare.replace("_", "-")):
        if candidate in ids:
            return candidate
    return None


def parse_profile(doc: Any) -> Profile:
    """Parse a resource-profile mapping (FlexPipe's format, docs/sources.md#resource-profile, see the module
    docstring).

    Raises:
        EmptyFleetError: ``nodes`` is empty.
        PlanInputError: a missing or mistyped field (named like ``nodes[2].memory_gb``), a duplicate
            node id, or an interconnect peer that names no node.
    """
    if not isinstance(doc, Mapping) or "nodes" not in doc:
        raise PlanInputError("a resource profile must be a mapping with a 'nodes' list")
    raw = doc["nodes"]
    if not isinstance(raw, list):
        raise PlanInputError(f"nodes must be a list, got {type(raw).__name__}")
    if not raw:
        raise EmptyFleetError("the resource profile lists no nodes; add at least one under 'nodes'")
    nodes: list[Node] = []
    for i, item in enumerate(raw):
        where = f"nodes[{i}]"
        if not isinstance(item, Mapping):
            raise PlanInputError(f"{where} must be a mapping")
        node_id = item.get("node_id")
        if not isinstance(node_id, str) or not node_id:
            raise PlanInputError(f"{where}.node_id must be a non-empty string, got {node_id!r}")
        if any(n.node_id == node_id for n in nodes):
            raise PlanInputError(f"{where}.node_id {node_id!r} is used twice; node ids must be unique")
        mmb = item.get("max_batch_microbatch", 16)
        if isinstance(mmb, bool) or not isinstance(mmb, int) or mmb < 1:
            raise PlanInputError(f"{where}.max_batch_microbatch must be an integer >= 1, got {mmb!r}")
        nodes.append(
            Node(
                node_id=node_id,
                memory_gb=_number(item, "memory_gb", where),
                compute_score=_number(item, "compute_score", where),
                max_micro_batch=mmb,
                generation=str(item.get("generation", "")),
                gpu_model=item.get("gpu_model"),
            )
        )
    ids = {n.node_id for n in nodes}
    links: dict[frozenset[str], Link] = {}
    for i, item in enumerate(raw):
        src = nodes[i].node_id
        inter = item.get("interconnect") or {}
        if not isinstance(inter, Mapping):
            raise PlanInputError(f"nodes[{i}].interconnect must be a mapping of peer id to link")
        for key, spec in inter.items():
            where = f"nodes[{i}].interconnect.{key}"
            peer = _resolve_peer(str(key), ids)
            if peer is None:
                raise PlanInputError(f"{where}: no node {key!r} in the profile; use a listed node_id")
            if peer == src:
                continue
            if not isinstance(spec, Mapping):
                raise PlanInputError(f"{where} must be a mapping with bandwidth_gbps and latency_us")
            bw = _number(spec, "bandwidth_gbps", where)
            link = Link(bw, _number(spec, "latency_us", where, positive=False))
            pair = frozenset((src, peer))
            old = links.get(pair)
            if old is not None:
                link = Link(min(old.bandwidth_gbps, bw), max(old.latency_us, link.latency_us))
            links[pair] = link
    return Profile(tuple(nodes), links)


def load_cluster(path: str | Path) -> Profile:
    """Read a cluster file: a resource profile (``nodes:``) or a fleet file (``nodePools:``), YAML or JSON.

    A fleet file is turned into a profile from datasheets by :func:`gearshift.facts.fleet.datasheet_profile`.

    Raises:
        PlanInputError: unreadable file, neither format, or bad fields (FleetError's message kept).
        EmptyFleetError: no nodes.
    """
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise PlanInputError(f"cannot read cluster file {str(p)!r}: {exc.strerror}") from None
    try:
        doc = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise PlanInputError(f"cluster file {str(p)!r} is not valid YAML/JSON: {exc}") from None
    if isinstance(doc, Mapping) and "nodePools" in doc:
        from gearshift.facts.fleet import FleetError, datasheet_profile, parse_fleet

        try:
            return parse_profile(datasheet_profile(parse_fleet(dict(doc))))
        except FleetError as exc:
            raise PlanInputError(f"fleet file {str(p)!r}: {exc}") from None
    if isinstance(doc, Mapping) and "nodes" in doc:
        return parse_profile(doc)
    if not isinstance(doc, Mapping):
        what = "empty" if doc is None else f"a {type(doc).__name__}, not a mapping"
        raise PlanInputError(
            f"cluster file {str(p)!r} is {what}: give a mapping with 'nodes' (a resource profile) or "
            "'nodePools' (a fleet file)"
        )
    raise PlanInputError(
        f"cluster file {str(p)!r} has neither 'nodes' (a resource profile) nor 'nodePools' (a fleet file)"
    )
