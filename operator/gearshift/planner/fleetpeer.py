"""The fleet-scale planner's peer (:func:`peer_max_load`, :func:`peer_cheapest`): what AIBrix, llm-d or KServe
deploy on such a fleet -- uniform pipelines of one card class with even layer splits (the fewest stages
whose even split fits memory, or up to two more), each pool a fleet of its own, the best (or cheapest, an
integer program over pipeline counts with :func:`scipy.optimize.milp`) mix of those for the same load.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from gearshift.planner.errors import PlanError
from gearshift.planner.fleetbound import batch_figures
from gearshift.planner.fleetclasses import FleetClasses, UnitClass, Workload
from gearshift.planner.partition import evaluate, even_split
from gearshift.planner.profile import Link, Node, Profile


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
        for bt in batch_figures(wl):
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


def peer_milp(
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
    return peer_milp(fc, peer_configs(fc, wl), None)


def peer_cheapest(
    fc: FleetClasses, wl: Workload, target_rps: float
) -> tuple[float, float, dict[tuple[str, int, int], int]] | None:
    """The cheapest mix of uniform even-split pipelines serving ``target_rps``: (req/s, cost, pipelines per
    (class, micro-batch, stages)), or None when no such mix serves it."""
    return peer_milp(fc, peer_configs(fc, wl), target_rps)
