"""Fleet-scale planning: the most load a fleet serves, and the cheapest plan for a load, each beside a bound.

Two questions for a model (a :class:`~gearshift.planner.costs.CostModel`), a fleet and a workload
(:class:`Workload`: the request shape priced by the cost model, an optional latency SLO, and the
utilisation at which a pipeline still meets it, :data:`~gearshift.planner.gears.TARGET_UTILISATION`):

- **max load** (:func:`max_load`): a set of pipelines -- each with unequal stages over any card classes --
  with the highest total throughput at the SLO, on any part of the fleet;
- **cheapest** (:func:`cheapest`): for a target load (req/s), the plan of least cost (GPUs, or the pools'
  per-GPU-hour prices) that serves it at the SLO.

Both answers carry a **bound** (an upper bound on the max load; a lower bound on the cost) and
``ratio = plan / bound`` (max load ≤ 1, cost ≥ 1).

Plan space. A *unit* is ``tp`` cards of one class inside one node running one stage with tensor
parallelism (``tp`` a power of two dividing the node's GPU count; score ``tp × card score × 0.85`` for
``tp > 1``, :data:`gearshift.facts.fleet.TP_EFFICIENCY`; memory ``tp ×`` the card's). A pipeline has one
micro-batch size ``m`` from :data:`MICRO_BATCHES` (no larger than any of its units'
``max_micro_batch``) and one ``tp`` on every stage (vLLM: world size = TP × PP, the same TP on every
stage). Stage ``k`` holds a contiguous layer range with reference work ``w_k`` (ms per micro-batch on a
score-1 card, ``LayerCosts.compute_ms``) on a unit of score ``s_k``; its bottleneck
``T = max(max_k w_k/s_k, link bounds)`` (the partitioner's cost model, 70% link rule,
:mod:`gearshift.planner.partition`), its capacity ``1000·m/T`` req/s, of which ``u`` =
TARGET_UTILISATION is counted as served at the SLO; its latency (TTFT, or ITL for the decode role) is
``Σ_k pass_k/s_k + Σ link transfers`` with ``pass_k`` the stage's ``LayerCosts.pass_ms``, and must stay
within ``slo_ms``. Stages fit their unit's memory (weights + the KV budget).

The bound (derivation). Give stage ``k`` of a pipeline the busy share ``β_k = w_k/(s_k T) ∈ (0, 1]``.
Every layer is processed once per micro-batch, so ``Σ_k w_k = W_m`` (the model's total work at micro-batch
``m``), hence ``T = W_m / Σ_k β_k s_k`` and the pipeline serves
``X = 1000·u·m·Σ_k β_k s_k / W_m`` req/s. With ``ρ_m = min over layers of pass/compute``,
``pass_k ≥ ρ_m w_k``, so latency ``≥ ρ_m Σ_k w_k/s_k = ρ_m T Σ_k β_k``; the SLO then gives
``ρ_m T Σ_k β_k ≤ slo``, i.e. ``Σ_k β_k (s_k − s*_m) ≥ 0`` with ``s*_m = ρ_m W_m / slo`` (the busy-weighted
mean score of a pipeline is at least ``s*_m``). Summing over the pipelines of one (``m``, ``tp``) group and
letting ``x_{j,m} = Σ β_k`` over the units of class ``j`` in the group's pipelines (busy units, at most the
units used) gives the linear program

    max  Σ_{j,m} 1000·u·m·s_j / W_m · x_{j,m}
    s.t. Σ_m Σ_{j in pool q} tp_j · x_{j,m} ≤ cards_q            (each pool's cards)
         Σ_{j: tp_j = t} (s_j − s*_m) · x_{j,m} ≥ 0   for each (m, t)   (the SLO; absent without one)
         x_{j,m} = 0 where m > max_micro_batch_j,  x ≥ 0.

Every plan maps to a feasible point of equal value (by the steps above), so the LP's optimum bounds the max
load from above. It drops integrality (whole units and layers), memory and links, so it is a relaxation as
in Helix (Mei et al., ASPLOS 2025: a max-flow over the cluster graph bounds the throughput of any layer
placement) and Mélange (Griggs et al. 2024: an LP/ILP over GPU types and counts). For the cost the same
constraints with ``Σ load ≥ target`` and ``min Σ price_j used_j`` bound the cost from below, with
``used_j ≥ Σ_m x_{j,m}`` integral (a plan pays whole units, of which only the busy share is counted) and
``Σ_j used_j · memory_j ≥`` the model's memory (a plan holds at least one copy). HiGHS solves both,
through :func:`scipy.optimize.linprog` and (the integral ``used``) :func:`scipy.optimize.milp`.

The plan (rounding). Cards of one class are interchangeable, so the plan is built over classes and counts,
not nodes: the LP's units per (``m``, ``tp``) group are floored and dealt, strongest first and cyclically,
into ``P`` pipelines (each gets ⌊n/P⌋ or ⌈n/P⌉ of each class); each distinct composition is solved once by
the exact minimum-bottleneck partitioner (:func:`gearshift.planner.partition.min_bottleneck`, a DP over
class counts) and checked against the SLO (while it misses, its slowest unit leaves); several ``P``
(from the most pipelines the group's memory holds down) are tried and the best kept. Leftover cards are
offered to the LP again, twice, then a greedy adds pipelines or single units while that adds load.
``cheapest`` starts from the cost bound's units and grows greedily (least cost per useful req/s: a new
pipeline, or one more unit in a planned one) until the target is met, then drops the pipelines of highest
cost per req/s while the target still holds. Both keep the peer's uniform layout (re-cut by the
partitioner) when it does better, so a plan is never worse than the peer's.

Cost: the LPs have (classes × TP choices × micro-batch sizes) variables, independent of the GPU count;
the rounding solves at most (groups × ``P`` choices × distinct compositions) small partitions, each a DP
over the class counts of one pipeline (tens of units); so the time grows with the number of classes and
the model's layers, and with the GPU count only through ``P`` (the dealing, linear).

The peer (:func:`peer_max_load`, :func:`peer_cheapest`): what AIBrix, llm-d or KServe deploy on such a
fleet -- uniform pipelines of one card class with even layer splits (the fewest stages whose even split
fits memory, or up to two more), each pool a fleet of its own, the best (or cheapest, an integer program
over pipeline counts with :func:`scipy.optimize.milp`) mix of those for the same load.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, linprog, milp

from gearshift.facts.fleet import Fleet, max_micro_batch, tp_efficiency
from gearshift.facts.gpus import compute_score, gpu_spec
from gearshift.planner.costs import CostModel, LayerCosts
from gearshift.planner.errors import InfeasibleError, PlanError, PlanInputError
from gearshift.planner.gears import INTENTS, TARGET_UTILISATION
from gearshift.planner.partition import Pipeline, evaluate, even_split, min_bottleneck
from gearshift.planner.profile import Link, Node, Profile

#: Micro-batch sizes a fleet pipeline may run: those of the gears' intents (1-16).
MICRO_BATCHES: tuple[int, ...] = tuple(sorted({m for sizes in INTENTS.values() for m in sizes}))
#: Most units one pipeline template holds (keeps each partition a small DP).
MAX_TEMPLATE_UNITS = 48
#: Shares of the most pipelines a group's memory holds that the rounding tries as pipeline counts.
PIPELINE_SHARES = (1.0, 0.8, 0.65, 0.5, 0.35, 0.25, 0.15)
#: Units beyond the fewest that hold the model in the one-class pipelines a cheapest plan tops up with.
COVER_EXTRA_UNITS = 2
#: Shares of the units below the SLO's mean score kept in the variants the rounding tries.
SLOW_SHARES = (1.0, 0.75, 0.5)
#: A max-load rounding within this share of every unit busy stops trying other pipeline counts and variants.
GOOD_ENOUGH = 0.002
#: Rounds in which leftover cards go back to the LP.
LEFTOVER_ROUNDS = 2
#: ``cost_unit`` when no pool has a price: the plan's cost is its GPU count.
GPU_COUNT = "GPUs"
#: ``cost_unit`` when pools are priced (``pricePerGpuHour`` in the fleet file, or ``--price``).
PRICE_PER_HOUR = "price/h"
_EPS = 1e-9


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


# --------------------------------------------------------------------------------------------
# Classes


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


# --------------------------------------------------------------------------------------------
# Per micro-batch figures


@dataclass(frozen=True)
class _Batch:
    m: int
    costs: LayerCosts
    work_ms: float
    """``W_m``: the model's reference work per micro-batch, ms."""
    rho: float
    """``ρ_m``: the least pass/compute ratio of the layers other than the last."""
    slack_ms: float
    """``Δ_m = Σ_ℓ max(0, ρ_m w_ℓ − pass_ℓ)``: reference ms by which the layers under ``ρ_m`` (the LM head's
    last layer) shorten the pass."""
    need_gb: float

    def s_star(self, wl: Workload, s_low: float) -> float:
        """Least busy-weighted mean score of a pipeline within the SLO whose slowest unit has ``s_low``
        (0 without an SLO): ``ρ_m W_m / (slo + Δ_m / s_low)``."""
        if wl.slo_ms is None:
            return 0.0
        return self.rho * self.work_ms / (wl.slo_ms + self.slack_ms / s_low)

    def rate(self, wl: Workload, score: float) -> float:
        """Req/s at the SLO of one fully busy unit of ``score``."""
        return 1000.0 * wl.utilisation * self.m * score / self.work_ms


def _batches(wl: Workload) -> list[_Batch]:
    out = []
    for m in wl.micro_batches:
        costs = wl.model.at(m)
        work = float(sum(costs.compute_ms))
        body = list(zip(costs.pass_ms, costs.compute_ms, strict=True))
        body = body[:-1] if len(body) > 1 else body
        rho = min((p / w for p, w in body if w > 0), default=0.0)
        slack = sum(max(0.0, rho * w - p) for p, w in zip(costs.pass_ms, costs.compute_ms, strict=True))
        need = float(sum(costs.memory_gb(i) for i in range(costs.num_layers)))
        out.append(_Batch(m, costs, work, rho, slack, need))
    return out


# --------------------------------------------------------------------------------------------
# The LP bound


@dataclass
class _Lp:
    """Variables ``x[j, b]`` (busy units of class j at batch b) and the shared constraint rows."""

    keys: list[tuple[int, int]]
    value: np.ndarray
    """Req/s per busy unit."""
    a_ub: np.ndarray
    b_ub: np.ndarray


def _lp(fc: FleetClasses, batches: list[_Batch], wl: Workload, caps: Mapping[str, float]) -> _Lp:
    keys = [
        (j, b)
        for j, c in enumerate(fc.classes)
        for b, bt in enumerate(batches)
        if bt.m <= c.max_micro_batch and c.count > 0
    ]
    value = np.array([batches[b].rate(wl, fc.classes[j].score) for j, b in keys])
    pools = sorted(fc.cards)
    rows, rhs = [], []
    for q in pools:
        rows.append([fc.classes[j].tp if fc.classes[j].pool == q else 0.0 for j, _ in keys])
        rhs.append(float(caps.get(q, 0.0)))
    if wl.slo_ms is not None:
        for b, bt in enumerate(batches):
            for t in sorted({c.tp for c in fc.classes}):
                members = [j for j, bb in keys if bb == b and fc.classes[j].tp == t]
                if not members:
                    continue
                s_star = bt.s_star(wl, min(fc.classes[j].score for j in members))
                row = [
                    -(fc.classes[j].score - s_star) if bb == b and fc.classes[j].tp == t else 0.0
                    for j, bb in keys
                ]
                if any(row):
                    rows.append(row)
                    rhs.append(0.0)
    a_ub = np.array(rows, dtype=float).reshape(len(rows), len(keys))
    return _Lp(keys, value, a_ub, np.array(rhs, dtype=float))


def _solve_max(
    fc: FleetClasses, batches: list[_Batch], wl: Workload, caps: Mapping[str, float]
) -> tuple[float, dict[tuple[int, int], float]]:
    lp = _lp(fc, batches, wl, caps)
    if not lp.keys:
        return 0.0, {}
    res = linprog(-lp.value, A_ub=lp.a_ub, b_ub=lp.b_ub, bounds=(0, None), method="highs")
    if res.status != 0:
        raise PlanError(f"the max-load LP failed: {res.message}")
    return float(-res.fun), {k: float(v) for k, v in zip(lp.keys, res.x, strict=True) if v > _EPS}


def bound_max_load(fc: FleetClasses, wl: Workload) -> float:
    """The LP upper bound on the load (req/s at the SLO) any plan serves on ``fc`` (module docstring)."""
    return _solve_max(fc, _batches(wl), wl, fc.cards)[0]


def _solve_cheapest(
    fc: FleetClasses, batches: list[_Batch], wl: Workload, target: float
) -> tuple[float, dict[tuple[int, int], float]] | None:
    lp = _lp(fc, batches, wl, fc.cards)
    if not lp.keys:
        return None
    n, k = len(lp.keys), len(fc.classes)
    # Variables: x (busy units per class and batch), then used_j (units per class).
    cost = np.concatenate([np.zeros(n), [c.price for c in fc.classes]])
    rows = [np.concatenate([r, np.zeros(k)]) for r in lp.a_ub]
    rhs = list(lp.b_ub)
    rows.append(np.concatenate([-lp.value, np.zeros(k)]))  # load ≥ target
    rhs.append(-target)
    for j in range(k):  # busy ≤ used
        row = np.zeros(n + k)
        for i, (jj, _) in enumerate(lp.keys):
            if jj == j:
                row[i] = 1.0
        row[n + j] = -1.0
        rows.append(row)
        rhs.append(0.0)
    need = min(bt.need_gb for bt in batches)
    rows.append(np.concatenate([np.zeros(n), [-c.memory_gb for c in fc.classes]]))  # one copy of the model
    rhs.append(-need)
    for q in sorted(fc.cards):  # used units within the pool's cards
        rows.append(np.concatenate([np.zeros(n), [c.tp if c.pool == q else 0.0 for c in fc.classes]]))
        rhs.append(float(fc.cards[q]))
    # Units used are whole in any plan, so ``used`` is integral (HiGHS' branch and bound, a few classes);
    # the busy units stay continuous.
    res = milp(
        cost,
        constraints=LinearConstraint(np.array(rows), -np.inf, np.array(rhs)),
        integrality=np.concatenate([np.zeros(n), np.ones(k)]),
        bounds=Bounds(0, np.inf),
    )
    if res.status == 2:
        return None
    if res.status != 0 or res.x is None:
        raise PlanError(f"the cheapest-plan bound failed: {res.message}")
    return float(res.fun), {key: float(v) for key, v in zip(lp.keys, res.x[:n], strict=True) if v > _EPS}


def bound_cheapest(fc: FleetClasses, wl: Workload, target_rps: float) -> float:
    """The LP lower bound on the cost of any plan serving ``target_rps`` at the SLO on ``fc``.

    Raises:
        InfeasibleError: the target is above the max-load bound (no plan can serve it).
    """
    batches = _batches(wl)
    got = _solve_cheapest(fc, batches, wl, target_rps)
    if got is None:
        raise _too_much(fc, wl, target_rps, batches)
    return got[0]


def _too_much(fc: FleetClasses, wl: Workload, target: float, batches: list[_Batch]) -> InfeasibleError:
    top = _solve_max(fc, batches, wl, fc.cards)[0]
    slo = f" at the {wl.slo_ms:g} ms SLO" if wl.slo_ms is not None else ""
    return InfeasibleError(
        f"a load of {target:g} req/s is impossible on this fleet{slo}: no plan serves more than "
        f"{top:.4g} req/s (the bound); lower --load, relax --slo-ms or add GPUs"
    )


# --------------------------------------------------------------------------------------------
# Rounding: pipelines from class counts


@dataclass(frozen=True)
class _Built:
    stages: tuple[tuple[int, int, int], ...]
    """(start, end, class index)."""
    bottleneck_ms: float
    latency_ms: float
    used: tuple[int, ...]
    """Units per class index (the whole fleet's class list)."""


class _Builder:
    """Solves pipeline compositions with the partitioner, once each."""

    def __init__(self, fc: FleetClasses, wl: Workload) -> None:
        self.fc = fc
        self.wl = wl
        self.cache: dict[tuple[int, tuple[int, ...]], _Built | None] = {}

    def _profile(self, comp: Sequence[int]) -> tuple[Profile, dict[str, int]]:
        nodes, owner = [], {}
        for j, k in enumerate(comp):
            c = self.fc.classes[j]
            for i in range(k):
                nid = f"{j}.{i}"
                nodes.append(Node(nid, c.memory_gb, c.score, c.max_micro_batch, gpu_model=c.gpu_model))
                owner[nid] = j
        links = {}
        for x in range(len(nodes)):
            cx = self.fc.classes[owner[nodes[x].node_id]]
            for y in range(x + 1, len(nodes)):
                cy = self.fc.classes[owner[nodes[y].node_id]]
                links[frozenset((nodes[x].node_id, nodes[y].node_id))] = Link(
                    min(cx.nic_gbps, cy.nic_gbps), max(cx.latency_us, cy.latency_us)
                )
        return Profile(tuple(nodes), links), owner

    def latency(self, bt: _Batch, profile: Profile, p: Pipeline) -> float:
        c = bt.costs
        lat = sum(
            sum(c.pass_ms[s.start : s.end]) / profile.node(s.node_ids[0]).compute_score for s in p.stages
        )
        return lat + sum(p.link_ms)

    def build(self, bt: _Batch, comp: tuple[int, ...]) -> _Built | None:
        """The min-bottleneck pipeline on the units ``comp`` (per class) meeting the SLO, or None."""
        key = (bt.m, comp)
        if key in self.cache:
            return self.cache[key]
        out: _Built | None = None
        cur = list(comp)
        passes = float(sum(bt.costs.pass_ms))
        while sum(cur) > 0:
            fastest = max(self.fc.classes[j].score for j, k in enumerate(cur) if k)
            if self.wl.slo_ms is not None and passes / fastest > self.wl.slo_ms:
                break  # even every layer on the fastest unit passes too slowly (a one-class pipeline, often)
            profile, owner = self._profile(cur)
            try:
                p = min_bottleneck(profile, bt.costs)
            except InfeasibleError:
                break
            lat = self.latency(bt, profile, p)
            if self.wl.slo_ms is None or lat <= self.wl.slo_ms * (1 + 1e-9):
                used = [0] * len(self.fc.classes)
                stages = []
                for s in p.stages:
                    j = owner[s.node_ids[0]]
                    used[j] += 1
                    stages.append((s.start, s.end, j))
                out = _Built(tuple(stages), p.bottleneck_ms, lat, tuple(used))
                break
            # Too slow for the SLO: the slowest unit in use leaves, and the rest is solved again.
            slow = min({owner[s.node_ids[0]] for s in p.stages}, key=lambda j: self.fc.classes[j].score)
            cur[slow] -= 1
        self.cache[key] = out
        return out


def _deal(counts: Mapping[int, int], scores: Sequence[float], P: int) -> Counter[tuple[int, ...]]:
    """Units dealt strongest first, cyclically, into ``P`` pipelines: compositions and how many of each."""
    order = sorted((j for j in counts if counts[j] > 0), key=lambda j: (-scores[j], j))
    k = len(scores)
    comps = [[0] * k for _ in range(P)]
    pos = 0
    for j in order:
        for _ in range(counts[j]):
            comps[pos % P][j] += 1
            pos += 1
    return Counter(tuple(c) for c in comps)


def _round_group(
    builder: _Builder, bt: _Batch, counts: Mapping[int, int], goal: str
) -> list[tuple[_Built, int]]:
    """Pipelines from the units ``counts`` of one (micro-batch, TP) group: best over pipeline counts.

    ``goal``: ``load`` keeps the most req/s, ``cost`` the least cost per req/s.
    """
    fc, wl = builder.fc, builder.wl
    units = sum(counts.values())
    if units == 0:
        return []
    if len([j for j, n in counts.items() if n > 0]) < 2:
        return _round_mixed(builder, bt, counts, goal)
    # The LP's mix sits on the SLO's edge and rounding (whole layers, the LM head's stage) can tip a
    # pipeline over it; fewer units below the SLO's mean score per pipeline are tried too.
    s_star = bt.s_star(wl, min(fc.classes[j].score for j, n in counts.items() if n > 0))
    variants = []
    ideal = _ideal(fc, wl, bt, counts, goal)
    for share in SLOW_SHARES if wl.slo_ms is not None else (1.0,):
        cut = {j: (n if fc.classes[j].score >= s_star else math.floor(n * share)) for j, n in counts.items()}
        if share == 1.0 or cut != counts:
            variants.append(_round_mixed(builder, bt, cut, goal))
            if goal == "load" and _score(fc, wl, bt, variants[-1], goal) >= ideal * (1 - GOOD_ENOUGH):
                break
    mixed = max(variants, key=lambda got: _score(fc, wl, bt, got, goal))
    if goal == "load" and _score(fc, wl, bt, mixed, goal) >= ideal * (1 - GOOD_ENOUGH):
        return mixed
    # Each class on its own (pipelines of one card class balance exactly when layers are even): kept when
    # it does better, e.g. without an SLO that needs fast cards beside slow ones.
    pure = [p for j, n in counts.items() if n > 0 for p in _round_mixed(builder, bt, {j: n}, goal)]
    return max((mixed, pure), key=lambda got: _score(fc, wl, bt, got, goal))


def _score(fc: FleetClasses, wl: Workload, bt: _Batch, got: Sequence[tuple[_Built, int]], goal: str) -> float:
    """``goal`` ``load``: req/s of ``got``; ``cost``: req/s per unit of cost (-inf when empty)."""
    load = sum(bt.m * 1000.0 * wl.utilisation / b.bottleneck_ms * n for b, n in got)
    if goal == "load":
        return load if got else -math.inf
    cost = sum(sum(fc.classes[j].price * u for j, u in enumerate(b.used)) * n for b, n in got)
    return load / cost if cost > 0 else -math.inf


def _round_mixed(
    builder: _Builder, bt: _Batch, counts: Mapping[int, int], goal: str
) -> list[tuple[_Built, int]]:
    """Pipelines dealt from ``counts``, best over the pipeline counts tried (see :func:`_round_group`)."""
    fc = builder.fc
    units = sum(counts.values())
    memory = sum(fc.classes[j].memory_gb * n for j, n in counts.items())
    p_max = max(1, min(units, int(memory // (bt.need_gb * (1 + 1e-6)))))
    p_min = max(1, math.ceil(units / MAX_TEMPLATE_UNITS))
    tries = sorted({max(p_min, min(p_max, max(1, round(p_max * f)))) for f in PIPELINE_SHARES}, reverse=True)
    scores = [c.score for c in fc.classes]
    best: list[tuple[_Built, int]] = []
    best_key = -math.inf
    for P in tries:
        got = []
        for comp, mult in _deal(counts, scores, P).items():
            built = builder.build(bt, comp)
            if built is not None:
                got.append((built, mult))
        key = _score(fc, builder.wl, bt, got, goal)
        if key > best_key * (1 + 1e-12) or (best_key == -math.inf and got):
            best, best_key = got, key
        if goal == "load" and best_key >= _ideal(fc, builder.wl, bt, counts, goal) * (1 - GOOD_ENOUGH):
            break  # within GOOD_ENOUGH of every unit busy: no other pipeline count can do much better
    return best


def _ideal(fc: FleetClasses, wl: Workload, bt: _Batch, counts: Mapping[int, int], goal: str) -> float:
    """:func:`_score` if every unit of ``counts`` were in a pipeline and busy (an upper bound)."""
    load = sum(bt.rate(wl, fc.classes[j].score) * n for j, n in counts.items())
    if goal == "load":
        return load
    cost = sum(fc.classes[j].price * n for j, n in counts.items())
    return load / cost if cost > 0 else -math.inf


def _groups(
    fc: FleetClasses, x: Mapping[tuple[int, int], float], scale: float = 1.0
) -> dict[tuple[int, int], dict[int, int]]:
    """LP units per (batch index, TP), floored (after ``scale``), within each class's count."""
    out: dict[tuple[int, int], dict[int, int]] = {}
    for (j, b), v in x.items():
        c = fc.classes[j]
        n = min(c.count, math.floor(v * scale + 1e-6))
        if n > 0:
            out.setdefault((b, c.tp), {})[j] = n
    return out


def _assemble(
    fc: FleetClasses, wl: Workload, batches: list[_Batch], built: list[tuple[int, _Built, int]]
) -> tuple[list[FleetPipeline], float, float, int, Counter[str]]:
    pipes: dict[tuple[int, tuple[tuple[int, int, int], ...]], tuple[_Built, int]] = {}
    for b, bb, n in built:
        key = (b, bb.stages)
        old = pipes.get(key)
        pipes[key] = (bb, n + (old[1] if old else 0))
    out, load, cost, gpus, used = [], 0.0, 0.0, 0, Counter[str]()
    for (b, stages), (bb, n) in pipes.items():
        bt = batches[b]
        thr = 1000.0 * wl.utilisation * bt.m / bb.bottleneck_ms
        c_each = sum(fc.classes[j].price * u for j, u in enumerate(bb.used))
        g_each = sum(fc.classes[j].tp * u for j, u in enumerate(bb.used))
        tp = fc.classes[stages[0][2]].tp
        out.append(
            FleetPipeline(
                bt.m,
                tp,
                tuple((a, e, fc.classes[j].name) for a, e, j in stages),
                n,
                bb.bottleneck_ms,
                bb.latency_ms,
                thr,
                c_each,
                g_each,
            )
        )
        load += thr * n
        cost += c_each * n
        gpus += g_each * n
        for j, u in enumerate(bb.used):
            if u:
                used[fc.classes[j].name] += u * n
    out.sort(key=lambda p: -p.throughput_rps * p.count)
    return out, load, cost, gpus, used


def _cards_left(fc: FleetClasses, built: list[tuple[int, _Built, int]]) -> dict[str, float]:
    left = {q: float(v) for q, v in fc.cards.items()}
    for _, bb, n in built:
        for j, u in enumerate(bb.used):
            left[fc.classes[j].pool] -= fc.classes[j].tp * u * n
    return left


def _build_all(
    fc: FleetClasses,
    wl: Workload,
    batches: list[_Batch],
    builder: _Builder,
    x: Mapping[tuple[int, int], float],
    goal: str,
    scale: float = 1.0,
) -> list[tuple[int, _Built, int]]:
    out: list[tuple[int, _Built, int]] = []
    for (b, _t), counts in sorted(_groups(fc, x, scale).items()):
        out.extend((b, bb, n) for bb, n in _round_group(builder, batches[b], counts, goal))
    return out


def max_load(fc: FleetClasses, wl: Workload) -> FleetAnswer:
    """The plan with the most load at the SLO on the fleet, beside the LP bound (module docstring).

    Raises:
        InfeasibleError: no pipeline fits the fleet at the SLO.
    """
    batches = _batches(wl)
    bound, x = _solve_max(fc, batches, wl, fc.cards)
    builder = _Builder(fc, wl)
    built = _build_all(fc, wl, batches, builder, x, "load")
    for _ in range(LEFTOVER_ROUNDS):
        left = _cards_left(fc, built)
        extra_bound, x2 = _solve_max(fc, batches, wl, left)
        if extra_bound <= 0:
            break
        more = _build_all(fc, wl, batches, builder, x2, "load")
        if not more:
            break
        built.extend(more)
    # Whatever the LP's rounding left: add pipelines or units while that adds load.
    built = _cover(fc, wl, batches, builder, built, math.inf, "load") or built
    # The uniform one-class layout is a plan too (the peer's, re-cut by the partitioner): never do worse.
    uniform = _uniform(fc, wl, batches, builder, _peer_milp(fc, peer_configs(fc, wl), None))
    if _load(wl, batches, uniform) > _load(wl, batches, built):
        built = uniform
    pipes, load, cost, gpus, used = _assemble(fc, wl, batches, built)
    if not pipes:
        slo = f" within the {wl.slo_ms:g} ms SLO" if wl.slo_ms is not None else ""
        raise InfeasibleError(
            f"no pipeline of the model fits this fleet{slo} (memory per card, links, micro-batch limits); "
            "add larger cards or relax --slo-ms"
        )
    return FleetAnswer(
        "max-load", tuple(pipes), load, cost, gpus, bound, load / bound, fc.cost_unit, None, dict(used)
    )


def cheapest(fc: FleetClasses, wl: Workload, target_rps: float) -> FleetAnswer:
    """The least-cost plan serving ``target_rps`` at the SLO, beside the LP bound (module docstring).

    Raises:
        PlanInputError: ``target_rps`` ≤ 0 or not finite.
        InfeasibleError: the target is above what the fleet can serve (the message gives the bound), or no
            plan found reaches it.
    """
    if not (math.isfinite(target_rps) and target_rps > 0):
        raise PlanInputError(f"the target load must be a finite number of req/s > 0, got {target_rps}")
    batches = _batches(wl)
    got = _solve_cheapest(fc, batches, wl, target_rps)
    if got is None:
        raise _too_much(fc, wl, target_rps, batches)
    bound, x = got
    builder = _Builder(fc, wl)
    covered = _cover(fc, wl, batches, builder, _build_all(fc, wl, batches, builder, x, "cost"), target_rps)
    if covered is not None:
        built = covered
    else:
        top = max_load(fc, wl)
        if top.throughput_rps < target_rps * (1 - 1e-9):
            raise InfeasibleError(
                f"no plan found serves {target_rps:g} req/s: the best found serves {top.throughput_rps:.4g} "
                f"(bound {top.bound:.4g}); lower --load"
            )
        built = _as_built(fc, batches, top)
    built = _trim(fc, wl, batches, built, target_rps)
    uniform = _uniform(fc, wl, batches, builder, _peer_milp(fc, peer_configs(fc, wl), target_rps))
    if uniform and _load(wl, batches, uniform) >= target_rps * (1 - 1e-9):
        uniform = _trim(fc, wl, batches, uniform, target_rps)
        if _cost(fc, uniform) < _cost(fc, built):
            built = uniform
    pipes, load, cost, gpus, used = _assemble(fc, wl, batches, built)
    return FleetAnswer(
        "cheapest", tuple(pipes), load, cost, gpus, bound, cost / bound, fc.cost_unit, target_rps, dict(used)
    )


def _load(wl: Workload, batches: list[_Batch], built: Sequence[tuple[int, _Built, int]]) -> float:
    return sum(1000.0 * wl.utilisation * batches[b].m / bb.bottleneck_ms * n for b, bb, n in built)


def _cover(
    fc: FleetClasses,
    wl: Workload,
    batches: list[_Batch],
    builder: _Builder,
    built: list[tuple[int, _Built, int]],
    target: float,
    goal: str = "cost",
) -> list[tuple[int, _Built, int]] | None:
    """``built`` grown greedily until ``target`` is served; None when the leftover cards allow no move first.

    ``goal`` ``cost``: each move is the least cost per useful req/s; ``load`` (``target`` infinite): the
    most req/s per GPU added, until no move adds load (then the result, never None).

    Moves: add a pipeline -- a composition already planned, or one class alone (from the fewest units
    whose memory holds the model to :data:`COVER_EXTRA_UNITS` more) at any micro-batch it runs -- or give
    planned pipelines one more unit of a class of their TP.
    """
    out = list(built)
    k = len(fc.classes)
    fresh: list[tuple[int, tuple[int, ...]]] = []
    for j, c in enumerate(fc.classes):
        # One class alone: at the largest micro-batch where it can meet the SLO (the bound's test).
        fit = [
            b
            for b, bt in enumerate(batches)
            if bt.m <= c.max_micro_batch and c.score >= bt.s_star(wl, c.score)
        ]
        if c.count == 0 or not fit:
            continue
        b = max(fit, key=lambda b: batches[b].m)
        kmin = math.ceil(batches[b].need_gb / c.memory_gb)
        for n in range(kmin, min(c.count, kmin + COVER_EXTRA_UNITS) + 1):
            fresh.append((b, tuple(n if i == j else 0 for i in range(k))))

    def thr(b: int, bb: _Built) -> float:
        return 1000.0 * wl.utilisation * batches[b].m / bb.bottleneck_ms

    def price(bb: _Built) -> float:
        return sum(fc.classes[j].price * u for j, u in enumerate(bb.used))

    def gpus(bb: _Built) -> int:
        return sum(fc.classes[j].tp * u for j, u in enumerate(bb.used))

    def merit(d_price: float, d_gpus: int, gain: float, short: float) -> float:
        """Lower is better."""
        if goal == "load":
            return -gain / max(d_gpus, 1)
        return max(d_price, 0.0) / min(gain, short)

    def fits(comp: Sequence[int], left: Mapping[str, float]) -> int:
        need: dict[str, int] = {}
        for j, u in enumerate(comp):
            if u:
                need[fc.classes[j].pool] = need.get(fc.classes[j].pool, 0) + fc.classes[j].tp * u
        return min((math.floor(left[q] / v + 1e-9) for q, v in need.items()), default=0)

    while (load := _load(wl, batches, out)) < target * (1 - 1e-9):
        left = _cards_left(fc, out)
        short = target - load
        best: tuple[float, int, int, _Built, int] | None = None  # (per, entry or -1, batch, pipeline, copies)
        adds = [(b, comp) for b, bb, _ in out for comp in [bb.used]] + fresh
        for b, comp in dict.fromkeys(adds):
            room = fits(comp, left)
            if room < 1:
                continue
            bb = builder.build(batches[b], comp)
            if bb is None:
                continue
            t = thr(b, bb)
            per = merit(price(bb), gpus(bb), t, short)
            if best is None or per < best[0]:
                best = (per, -1, b, bb, max(1, min(room, math.floor(min(short / t, room)))))
        for i, (b, old, n) in enumerate(out):
            tp = fc.classes[old.stages[0][2]].tp
            for j, c in enumerate(fc.classes):
                if (
                    c.tp != tp
                    or batches[b].m > c.max_micro_batch
                    or fits([1 if x == j else 0 for x in range(k)], left) < 1
                ):
                    continue
                comp = tuple(u + (1 if x == j else 0) for x, u in enumerate(old.used))
                bb = builder.build(batches[b], comp)
                if bb is None or (gain := thr(b, bb) - thr(b, old)) <= 0:
                    continue
                per = merit(price(bb) - price(old), gpus(bb) - gpus(old), gain, short)
                if best is None or per < best[0]:
                    room = fits([1 if x == j else 0 for x in range(k)], left)
                    best = (per, i, b, bb, max(1, min(n, room, math.floor(min(short / gain, room)))))
        if best is None:
            return out if goal == "load" else None
        _, i, b, bb, copies = best
        if i >= 0:
            out[i] = (out[i][0], out[i][1], out[i][2] - copies)
        out.append((b, bb, copies))
        out = [e for e in out if e[2] > 0]
    return out


def _cost(fc: FleetClasses, built: Sequence[tuple[int, _Built, int]]) -> float:
    return sum(fc.classes[j].price * u * n for _, bb, n in built for j, u in enumerate(bb.used))


def _uniform(
    fc: FleetClasses,
    wl: Workload,
    batches: list[_Batch],
    builder: _Builder,
    peer: tuple[float, float, dict[tuple[str, int, int], int]] | None,
) -> list[tuple[int, _Built, int]]:
    """The peer's pipelines (class, micro-batch, stages → copies) as a plan, each re-cut by the partitioner
    on the same units (never a larger bottleneck than the even split; one class, so the same latency)."""
    if peer is None:
        return []
    index = {c.name: j for j, c in enumerate(fc.classes)}
    bidx = {bt.m: b for b, bt in enumerate(batches)}
    out = []
    for (unit, m, stages), copies in peer[2].items():
        comp = tuple(stages if j == index[unit] else 0 for j in range(len(fc.classes)))
        bb = builder.build(batches[bidx[m]], comp)
        if bb is not None:
            out.append((bidx[m], bb, copies))
    return out


def _as_built(fc: FleetClasses, batches: list[_Batch], ans: FleetAnswer) -> list[tuple[int, _Built, int]]:
    index = {c.name: j for j, c in enumerate(fc.classes)}
    bidx = {bt.m: b for b, bt in enumerate(batches)}
    out = []
    for p in ans.pipelines:
        used = [0] * len(fc.classes)
        for _, _, u in p.stages:
            used[index[u]] += 1
        stages = tuple((a, e, index[u]) for a, e, u in p.stages)
        out.append((bidx[p.micro_batch], _Built(stages, p.bottleneck_ms, p.latency_ms, tuple(used)), p.count))
    return out


def _trim(
    fc: FleetClasses, wl: Workload, batches: list[_Batch], built: list[tuple[int, _Built, int]], target: float
) -> list[tuple[int, _Built, int]]:
    """Drop pipelines, the highest cost per req/s first, while the rest still serves ``target``."""

    def thr(b: int, bb: _Built) -> float:
        return 1000.0 * wl.utilisation * batches[b].m / bb.bottleneck_ms

    def price(bb: _Built) -> float:
        return sum(fc.classes[j].price * u for j, u in enumerate(bb.used))

    counts = [n for _, _, n in built]
    load = sum(thr(b, bb) * n for b, bb, n in built)
    for i in sorted(range(len(built)), key=lambda i: -price(built[i][1]) / thr(built[i][0], built[i][1])):
        t = thr(built[i][0], built[i][1])
        drop = min(counts[i], math.floor((load - target) / t + 1e-9)) if load > target else 0
        counts[i] -= drop
        load -= drop * t
    return [(b, bb, n) for (b, bb, _), n in zip(built, counts, strict=True) if n > 0]


# --------------------------------------------------------------------------------------------
# The peer: uniform pipelines of one card class, even layer splits


@dataclass(frozen=True)
class PeerConfig:
    """One uniform pipeline: ``stages`` units of one class, an even layer split, at ``micro_batch``."""

    unit: str
    micro_batch: int
    stages: int
    throughput_rps: float
    latency_ms: float


def peer_configs(fc: FleetClasses, wl: Workload, extra_stages: int = 2) -> list[PeerConfig]:
    """Per unit class, the uniform even-split pipeline with the most req/s per unit that fits memory, links
    and the SLO (stage counts from the fewest that fit to ``extra_stages`` more), if any.

    Both answers and both peer figures ask for the same classes and workload, so the last few are cached.
    """
    try:
        return list(_peer_configs(fc.classes, wl, extra_stages))
    except TypeError:  # a cost model that cannot be hashed: computed each time
        return list(_peer_configs.__wrapped__(fc.classes, wl, extra_stages))


@lru_cache(maxsize=4)
def _peer_configs(classes: tuple[UnitClass, ...], wl: Workload, extra_stages: int) -> tuple[PeerConfig, ...]:
    out = []
    for c in classes:
        best: PeerConfig | None = None
        for bt in _batches(wl):
            if bt.m > c.max_micro_batch:
                continue
            L = bt.costs.num_layers
            link = Link(c.nic_gbps, c.latency_us)
            fitted = 0
            for K in range(1, min(L, c.count) + 1):
                ids = [f"p{i}" for i in range(K)]
                nodes = tuple(Node(i, c.memory_gb, c.score, c.max_micro_batch) for i in ids)
                links = {frozenset((a, b)): link for x, a in enumerate(ids) for b in ids[x + 1 :]}
                profile = Profile(nodes, links)
                try:
                    bottleneck, _, transfers = evaluate(profile, bt.costs, even_split(bt.costs, ids))
                except PlanError:
                    if fitted:
                        break
                    continue
                fitted += 1
                cuts = even_split(bt.costs, ids)
                lat = sum(sum(bt.costs.pass_ms[a:b]) / c.score for a, b, _ in cuts) + sum(transfers)
                if wl.slo_ms is None or lat <= wl.slo_ms * (1 + 1e-9):
                    thr = 1000.0 * wl.utilisation * bt.m / bottleneck
                    if best is None or thr / K > best.throughput_rps / best.stages:
                        best = PeerConfig(c.name, bt.m, K, thr, lat)
                if fitted > extra_stages:
                    break
        if best is not None:
            out.append(best)
    return tuple(out)


def _peer_milp(
    fc: FleetClasses, configs: list[PeerConfig], target: float | None
) -> tuple[float, float, dict[tuple[str, int, int], int]] | None:
    """Pipelines per config: max load (``target`` None) or least cost for ``target``; (load, cost, copies per
    (unit class, micro-batch, stages))."""
    if not configs:
        return None
    cls = [fc.by_name(p.unit) for p in configs]
    thr = np.array([p.throughput_rps for p in configs])
    cost = np.array([c.price * p.stages for c, p in zip(cls, configs, strict=True)])
    pools = sorted(fc.cards)
    a = np.array(
        [[c.tp * p.stages if c.pool == q else 0 for c, p in zip(cls, configs, strict=True)] for q in pools]
    )
    cons = [LinearConstraint(a, -np.inf, np.array([fc.cards[q] for q in pools], dtype=float))]
    if target is None:
        objective = -thr
    else:
        cons.append(LinearConstraint(thr[None, :], target, np.inf))
        objective = cost
    res = milp(objective, constraints=cons, integrality=np.ones(len(configs)), bounds=Bounds(0, np.inf))
    if res.status != 0 or res.x is None:
        return None
    z = np.round(res.x).astype(int)
    chosen = {(p.unit, p.micro_batch, p.stages): int(n) for p, n in zip(configs, z, strict=True) if n}
    return float(thr @ z), float(cost @ z), chosen


def peer_max_load(
    fc: FleetClasses, wl: Workload
) -> tuple[float, float, dict[tuple[str, int, int], int]] | None:
    """The most load uniform even-split pipelines serve on the fleet: (req/s, cost, pipelines per
    (class, micro-batch, stages)),
    or None when no class can hold the model alone within the SLO."""
    return _peer_milp(fc, peer_configs(fc, wl), None)


def peer_cheapest(
    fc: FleetClasses, wl: Workload, target_rps: float
) -> tuple[float, float, dict[tuple[str, int, int], int]] | None:
    """The cheapest mix of uniform even-split pipelines serving ``target_rps``: (req/s, cost, pipelines per
    (class, micro-batch, stages)), or None when no such mix serves it."""
    return _peer_milp(fc, peer_configs(fc, wl), target_rps)


__all__ = [
    "GPU_COUNT",
    "MICRO_BATCHES",
    "PRICE_PER_HOUR",
    "FleetAnswer",
    "FleetClasses",
    "FleetPipeline",
    "PeerConfig",
    "UnitClass",
    "Workload",
    "bound_cheapest",
    "bound_max_load",
    "cheapest",
    "class_nodes",
    "fleet_classes",
    "max_load",
    "peer_cheapest",
    "peer_configs",
    "peer_max_load",
    "profile_classes",
]
