"""The fleet as the fleet-scale planner sees it (:mod:`gearshift.planner.fleetplan`): unit classes (``tp``
interchangeable cards of one pool inside one node) and each pool's card budget, from a fleet file
(:func:`fleet_classes`) or a resource profile (:func:`profile_classes`); the workload a question is asked
for (:class:`Workload`) and the shape of an answer (:class:`FleetAnswer` of :class:`FleetPipeline`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gearshift.facts.fleet import Fleet, max_micro_batch, tp_efficiency
from gearshift.facts.gpus import compute_score, gpu_spec
from gearshift.planner.costs import CostModel
from gearshift.planner.errors import PlanInputError
from gearshift.planner.intents import INTENTS, TARGET_UTILISATION
from gearshift.planner.profile import Link, Node, Profile

#: Micro-batch sizes a fleet pipeline may run: those of the gears' intents (1-16).
MICRO_BATCHES: tuple[int, ...] = tuple(sorted({m for sizes in INTENTS.values() for m in sizes}))


#: ``cost_unit`` when no pool has a price: the plan's cost is its GPU count.
GPU_COUNT = "GPUs"
#: ``cost_unit`` when pools are priced (``pricePerGpuHour`` in the fleet file, or ``--price``).
PRICE_PER_HOUR = "price/h"


@dataclass(frozen=True)
class UnitClass:
    """A kind of stage host: ``tp`` interchangeable cards of one pool inside one node (tensor parallel).

    Unlike a :class:`~gearshift.planner.profile.Node` (one named machine), a class stands for ``count``
    interchangeable units; the plan counts them and never names one.
    """

    name: str
    pool: str
    """The card budget it draws ``tp`` cards from (classes of one pool with other ``tp`` share it)."""
    tp: int
    count: int
    """Most units of this class (the pool's cards // ``tp``, whole nodes)."""
    score: float
    """Compute score of one unit (H100 SXM card = 1.0)."""
    memory_gb: float
    """GPU memory of one unit, GiB."""
    max_micro_batch: int
    nic_gbps: float
    latency_us: float
    price: float
    """Cost of one unit: ``tp`` × the per-GPU price (1 per GPU when unpriced)."""
    gpu_model: str | None = None


@dataclass(frozen=True)
class FleetClasses:
    """The unit classes of a fleet and the card budget of each pool."""

    classes: tuple[UnitClass, ...]
    cards: Mapping[str, int]
    """Cards (GPUs; nodes for a profile) per pool."""
    cost_unit: str = GPU_COUNT

    def by_name(self, name: str) -> UnitClass:
        """The class named ``name``. Raises KeyError naming it."""
        for c in self.classes:
            if c.name == name:
                return c
        raise KeyError(f"no unit class {name!r}")


@dataclass(frozen=True)
class Workload:
    """What is served: the cost model (request shape and role), the latency SLO and the utilisation."""

    model: CostModel
    slo_ms: float | None = None
    """Most key latency (TTFT; ITL for the decode role) of an unloaded pipeline, ms; None: no SLO."""
    utilisation: float = TARGET_UTILISATION
    micro_batches: tuple[int, ...] = MICRO_BATCHES

    def __post_init__(self) -> None:
        if self.slo_ms is not None and not (math.isfinite(self.slo_ms) and self.slo_ms > 0):
            raise PlanInputError(f"slo_ms must be a finite number > 0 or None, got {self.slo_ms}")
        if not 0 < self.utilisation <= 1:
            raise PlanInputError(f"utilisation must be in (0, 1], got {self.utilisation}")
        if not self.micro_batches or min(self.micro_batches) < 1:
            raise PlanInputError(f"micro_batches must be sizes >= 1, got {self.micro_batches}")


@dataclass(frozen=True)
class FleetPipeline:
    """``count`` identical pipelines: stages ``(start, end, unit class)``, at one micro-batch and TP."""

    micro_batch: int
    tp: int
    stages: tuple[tuple[int, int, str], ...]
    count: int
    bottleneck_ms: float
    latency_ms: float
    """Key latency of one unloaded pipeline (stage passes + link transfers), ms."""
    throughput_rps: float
    """Load one pipeline serves at the SLO (utilisation × capacity), req/s."""
    cost: float
    """Cost of one pipeline (its units' prices)."""
    gpus: int
    """GPUs of one pipeline."""

    @property
    def layer_counts(self) -> list[int]:
        return [b - a for a, b, _ in self.stages]

    def to_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "micro_batch": self.micro_batch,
            "tp": self.tp,
            "stages": [{"layers": [a, b], "unit": u} for a, b, u in self.stages],
            "bottleneck_ms": round(self.bottleneck_ms, 6),
            "latency_ms": round(self.latency_ms, 3),
            "throughput_rps": round(self.throughput_rps, 6),
            "cost": round(self.cost, 6),
            "gpus": self.gpus,
        }


@dataclass(frozen=True)
class FleetAnswer:
    """One question's plan, its bound and their ratio."""

    question: str
    """``max-load`` or ``cheapest``."""
    pipelines: tuple[FleetPipeline, ...]
    throughput_rps: float
    cost: float
    gpus: int
    bound: float
    """Max load: upper bound on req/s; cheapest: lower bound on the cost."""
    ratio: float
    """``throughput / bound`` (max load) or ``cost / bound`` (cheapest)."""
    cost_unit: str
    target_rps: float | None = None
    units_used: Mapping[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "question": self.question,
            "target_rps": None if self.target_rps is None else round(self.target_rps, 6),
            "throughput_rps": round(self.throughput_rps, 6),
            "cost": round(self.cost, 6),
            "cost_unit": self.cost_unit,
            "gpus": self.gpus,
            "bound": round(self.bound, 6),
            "ratio": round(self.ratio, 6),
            "units_used": dict(self.units_used),
            "pipelines": [p.to_dict() for p in self.pipelines],
        }


def _tp_choices(gpus: int) -> list[int]:
    """Powers of two dividing ``gpus``: such units pack a node exactly in any mix."""
    out, t = [], 1
    while t <= gpus and gpus % t == 0:
        out.append(t)
        t *= 2
    return out


def fleet_classes(fleet: Fleet, prices: Mapping[str, float] | None = None) -> FleetClasses:
    """The unit classes of a fleet: pools of one GPU model, GPUs per node, NIC and price merged, one class
    per TP choice.

    Args:
        fleet: a parsed fleet file.
        prices: per-GPU-hour price by GPU model or pool name, over the file's ``pricePerGpuHour``.

    Raises:
        PlanInputError: a price for no pool or model of the fleet (naming the known ones), a price ≤ 0, or
            prices for some pools but not all (naming those without).
    """
    prices = dict(prices or {})
    known = {n.pool for n in fleet.nodes} | {n.gpu.model for n in fleet.nodes}
    unknown = sorted(set(prices) - known)
    if unknown:
        raise PlanInputError(
            f"--price names {', '.join(unknown)}, which is no pool or GPU model of fleet {fleet.name!r}; "
            f"known: {', '.join(sorted(known))}"
        )
    for k, v in prices.items():
        if not (math.isfinite(v) and v > 0):
            raise PlanInputError(f"--price {k}={v}: give a price > 0 per GPU-hour")
    groups: dict[tuple[str, int, float, float, float | None], list[str]] = {}
    nodes: Counter[tuple[str, int, float, float, float | None]] = Counter()
    for n in fleet.nodes:
        price = prices.get(n.pool, prices.get(n.gpu.model, n.price_per_gpu_hour))
        key = (n.gpu.model, n.gpus, n.nic_gbps, n.latency_us, price)
        names = groups.setdefault(key, [])
        if n.pool not in names:
            names.append(n.pool)
        nodes[key] += 1
    unpriced = sorted({p for k, ps in groups.items() if k[4] is None for p in ps})
    priced = len(unpriced) < len({p for ps in groups.values() for p in ps})
    if priced and unpriced:
        raise PlanInputError(
            f"pools {', '.join(unpriced)} have no price while others do; give pricePerGpuHour in the fleet "
            "file or --price MODEL=PRICE for every pool, or none to count GPUs"
        )
    classes: list[UnitClass] = []
    cards: dict[str, int] = {}
    for key, names in groups.items():
        model, gpus, nic, lat, price = key
        pool = "+".join(names)
        cards[pool] = nodes[key] * gpus
        card = compute_score(model)
        spec = gpu_spec(model)
        for t in _tp_choices(gpus):
            classes.append(
                UnitClass(
                    name=pool if t == 1 else f"{pool}/tp{t}",
                    pool=pool,
                    tp=t,
                    count=nodes[key] * (gpus // t),
                    score=card * t * tp_efficiency(t),
                    memory_gb=spec.memory_gib * t,
                    max_micro_batch=max_micro_batch(spec.memory_gib),
                    nic_gbps=nic,
                    latency_us=lat,
                    price=t * (price if price is not None else 1.0),
                    gpu_model=model,
                )
            )
    return FleetClasses(tuple(classes), cards, PRICE_PER_HOUR if priced else GPU_COUNT)


def profile_classes(profile: Profile) -> FleetClasses:
    """Classes of identical nodes of a resource profile (one unit = one whole node, price 1 per node).

    Nodes are identical when score, memory, micro-batch limit and GPU model agree; a class's links are
    the worst link among its members and to other classes (so a plan on classes is feasible on the nodes).

    Raises:
        PlanInputError: two nodes without a link (the fleet questions assume every pair is linked).
    """
    groups: dict[tuple[float, float, int, str | None], list[Node]] = {}
    for n in profile.nodes:
        groups.setdefault((n.compute_score, n.memory_gb, n.max_micro_batch, n.gpu_model), []).append(n)
    ids = [n.node_id for n in profile.nodes]
    worst: Link | None = None
    for i, a in enumerate(ids):
        for b in ids[i + 1 :]:
            link = profile.link(a, b)
            if link is None:
                raise PlanInputError(
                    f"nodes {a} and {b} have no link; the fleet-scale planner needs every pair linked"
                )
            if worst is None or link.bandwidth_gbps < worst.bandwidth_gbps:
                worst = Link(link.bandwidth_gbps, max(link.latency_us, worst.latency_us if worst else 0.0))
    nic = worst.bandwidth_gbps if worst else math.inf
    lat = worst.latency_us if worst else 0.0
    classes = []
    for k, ((score, mem, mmb, model), members) in enumerate(groups.items()):
        name = f"{model or 'node'}#{k}"
        classes.append(UnitClass(name, name, 1, len(members), score, mem, mmb, nic, lat, 1.0, model))
    return FleetClasses(tuple(classes), {c.pool: c.count for c in classes})


def class_nodes(profile: Profile, fc: FleetClasses) -> dict[str, list[str]]:
    """The node ids of each class of :func:`profile_classes` (same order as the profile)."""
    out: dict[str, list[str]] = {c.name: [] for c in fc.classes}
    for n in profile.nodes:
        for c in fc.classes:
            if (c.score, c.memory_gb, c.max_micro_batch, c.gpu_model) == (
                n.compute_score,
                n.memory_gb,
                n.max_micro_batch,
                n.gpu_model,
            ):
                out[c.name].append(n.node_id)
                break
    return out
