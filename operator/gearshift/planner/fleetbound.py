"""The bounds of the fleet-scale questions (:mod:`gearshift.planner.fleetplan`): the most load any plan
serves (:func:`bound_max_load`) and the least cost of a plan serving a load (:func:`bound_cheapest`), and
the LP solutions (busy units per class and micro-batch size) the plan's rounding starts from.

Derivation. Give stage ``k`` of a pipeline the busy share ``β_k = w_k/(s_k T) ∈ (0, 1]``.
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
constraints with ``Σ load ≥ target`` and ``min Σ price_j used_j`` bound the cost from below, with the units
in use ``u_{j,m} ≥ x_{j,m}``, ``used_j ≥ Σ_m u_{j,m}`` integral (a plan pays whole units, of which only the
busy share is counted) and, per (``m``, ``t``) group, a whole number of pipelines ``P_{m,t}`` each holding a
copy of the model: ``Σ_j memory_j · u_{j,m} ≥ need_m · P_{m,t}`` and ``Σ_j u_{j,m} ≤ layers · P_{m,t}`` (a
group with units has a pipeline; a pipeline has at most one unit per layer). Every plan meets these (its
stages fit their units' memory), so the bound stays one; without them a fraction of a unit too small to
hold the model alone could serve the last req/s (measured: bounds of 9 and 13 GPUs where 10 and 14 are
the least any plan can pay, ``bench/results/planner_fleet.json``). HiGHS solves both, through
:func:`scipy.optimize.linprog` and (the integral ``P`` and ``used``) :func:`scipy.optimize.milp`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, linprog, milp

from gearshift.planner.costs import LayerCosts
from gearshift.planner.errors import InfeasibleError, PlanError
from gearshift.planner.fleetclasses import FleetClasses, Workload

_EPS = 1e-9


@dataclass(frozen=True)
class BatchFigures:
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


def batch_figures(wl: Workload) -> list[BatchFigures]:
    out = []
    for m in wl.micro_batches:
        costs = wl.model.at(m)
        work = float(sum(costs.compute_ms))
        body = list(zip(costs.pass_ms, costs.compute_ms, strict=True))
        body = body[:-1] if len(body) > 1 else body
        rho = min((p / w for p, w in body if w > 0), default=0.0)
        slack = sum(max(0.0, rho * w - p) for p, w in zip(costs.pass_ms, costs.compute_ms, strict=True))
        need = float(sum(costs.memory_gb(i) for i in range(costs.num_layers)))
        out.append(BatchFigures(m, costs, work, rho, slack, need))
    return out


@dataclass
class _Lp:
    """Variables ``x[j, b]`` (busy units of class j at batch b) and the shared constraint rows."""

    keys: list[tuple[int, int]]
    value: np.ndarray
    """Req/s per busy unit."""
    a_ub: np.ndarray
    b_ub: np.ndarray


def _lp(fc: FleetClasses, batches: list[BatchFigures], wl: Workload, caps: Mapping[str, float]) -> _Lp:
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


def solve_max(
    fc: FleetClasses, batches: list[BatchFigures], wl: Workload, caps: Mapping[str, float]
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
    return solve_max(fc, batch_figures(wl), wl, fc.cards)[0]


def solve_cheapest(
    fc: FleetClasses, batches: list[BatchFigures], wl: Workload, target: float
) -> tuple[float, dict[tuple[int, int], float]] | None:
    """The cost lower bound (module docstring) and its busy units per (class, batch); None: infeasible."""
    lp = _lp(fc, batches, wl, fc.cards)
    if not lp.keys:
        return None
    n, k = len(lp.keys), len(fc.classes)
    groups = sorted({(b, fc.classes[j].tp) for j, b in lp.keys})
    g = len(groups)
    # Variables: x (busy units per class and batch), u (units in use per class and batch), P (pipelines
    # per (batch, TP) group), used (units per class).
    width = 2 * n + g + k
    cost = np.concatenate([np.zeros(2 * n + g), [c.price for c in fc.classes]])
    rows = [np.concatenate([r, np.zeros(width - n)]) for r in lp.a_ub]
    rhs = list(lp.b_ub)

    def row(entries: Mapping[int, float], bound: float) -> None:
        r = np.zeros(width)
        for i, v in entries.items():
            r[i] += v
        rows.append(r)
        rhs.append(bound)

    row({i: -v for i, v in enumerate(lp.value)}, -target)  # load ≥ target
    for i in range(n):  # busy ≤ in use
        row({i: 1.0, n + i: -1.0}, 0.0)
    layers = batches[0].costs.num_layers
    for gi, (b, t) in enumerate(groups):
        members = [i for i, (j, bb) in enumerate(lp.keys) if bb == b and fc.classes[j].tp == t]
        # Each pipeline holds a whole copy of the model at its micro-batch, in whole pipelines per group,
        # and has at most one unit per layer.
        row(
            {
                **{n + i: -fc.classes[lp.keys[i][0]].memory_gb for i in members},
                2 * n + gi: batches[b].need_gb,
            },
            0.0,
        )
        row({**{n + i: 1.0 for i in members}, 2 * n + gi: -float(layers)}, 0.0)
    for j in range(k):  # in use ≤ used
        row({**{n + i: 1.0 for i, (jj, _) in enumerate(lp.keys) if jj == j}, 2 * n + g + j: -1.0}, 0.0)
    for q in sorted(fc.cards):  # used units within the pool's cards
        row({2 * n + g + j: float(c.tp) for j, c in enumerate(fc.classes) if c.pool == q}, float(fc.cards[q]))
    # Pipelines and units used are whole in any plan (HiGHS' branch and bound over a few dozen integers);
    # busy units and units per batch stay continuous.
    res = milp(
        cost,
        constraints=LinearConstraint(np.array(rows), -np.inf, np.array(rhs)),
        integrality=np.concatenate([np.zeros(2 * n), np.ones(g + k)]),
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
    batches = batch_figures(wl)
    got = solve_cheapest(fc, batches, wl, target_rps)
    if got is None:
        raise beyond_bound(fc, wl, target_rps, batches)
    return got[0]


def beyond_bound(
    fc: FleetClasses, wl: Workload, target: float, batches: list[BatchFigures]
) -> InfeasibleError:
    top = solve_max(fc, batches, wl, fc.cards)[0]
    slo = f" at the {wl.slo_ms:g} ms SLO" if wl.slo_ms is not None else ""
    return InfeasibleError(
        f"a load of {target:g} req/s is impossible on this fleet{slo}: no plan serves more than "
        f"{top:.4g} req/s (the bound); lower --load, relax --slo-ms or add GPUs"
    )
