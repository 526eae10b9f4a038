"""Fleet-scale planning: the most load a fleet serves, and the cheapest plan for a load, each beside a bound.

Two questions for a model (a :class:`~gearshift.planner.costs.CostModel`), a fleet and a workload
(:class:`~gearshift.planner.fleetclasses.Workload`: the request shape priced by the cost model, an
optional latency SLO, and the utilisation at which a pipeline still meets it,
:data:`~gearshift.planner.intents.TARGET_UTILISATION`):

- **max load** (:func:`max_load`): a set of pipelines -- each with unequal stages over any card classes --
  with the highest total throughput at the SLO, on any part of the fleet;
- **cheapest** (:func:`cheapest`): for a target load (req/s), the plan of least cost (GPUs, or the pools'
  per-GPU-hour prices) that serves it at the SLO.

Both answers carry a **bound** (an upper bound on the max load; a lower bound on the cost) and
``ratio = plan / bound`` (max load ≤ 1, cost ≥ 1).

Plan space. A *unit* is ``tp`` cards of one class inside one node running one stage with tensor
parallelism (``tp`` a power of two dividing the node's GPU count; score ``tp × card score × 0.85`` for
``tp > 1``, :data:`gearshift.facts.fleet.TP_EFFICIENCY`; memory ``tp ×`` the card's). A pipeline has one
micro-batch size ``m`` from :data:`~gearshift.planner.fleetclasses.MICRO_BATCHES` (no larger than any of
its units' ``max_micro_batch``) and one ``tp`` on every stage (vLLM: world size = TP × PP, the same TP on
every stage). Stage ``k`` holds a contiguous layer range with reference work ``w_k`` (ms per micro-batch on a
score-1 card, ``LayerCosts.compute_ms``) on a unit of score ``s_k``; its bottleneck ``T = max(max_k w_k/s_k,
link bounds)`` (the partitioner's cost model, 70% link rule, :mod:`gearshift.planner.partition`), its capacity
``1000·m/T`` req/s, of which ``u`` = TARGET_UTILISATION is counted as served at the SLO; its latency (TTFT, or
ITL for the decode role) is ``Σ_k pass_k/s_k + Σ link transfers`` with ``pass_k`` the stage's
``LayerCosts.pass_ms``, and must stay within ``slo_ms``. Stages fit their unit's memory (weights + the KV
budget).

The bound: :mod:`gearshift.planner.fleetbound` derives it, a linear program over busy units per class and
micro-batch size that drops integrality, memory and links (a relaxation), and solves it with HiGHS.

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

The peer's layout (uniform pipelines of one card class, even layer splits) is
:mod:`gearshift.planner.fleetpeer`'s; both questions try it and keep it when it does better.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gearshift.planner.errors import InfeasibleError, PlanInputError
from gearshift.planner.fleetbound import BatchFigures, batch_figures, beyond_bound, solve_cheapest, solve_max
from gearshift.planner.fleetclasses import FleetAnswer, FleetClasses, FleetPipeline, Workload
from gearshift.planner.fleetpeer import peer_configs, peer_milp
from gearshift.planner.partition import Pipeline, min_bottleneck
from gearshift.planner.profile import Link, Node, Profile

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

    def latency(self, bt: BatchFigures, profile: Profile, p: Pipeline) -> float:
        c = bt.costs
        lat = sum(
            sum(c.pass_ms[s.start : s.end]) / profile.node(s.node_ids[0]).compute_score for s in p.stages
        )
        return lat + sum(p.link_ms)

    def build(self, bt: BatchFigures, comp: tuple[int, ...]) -> _Built | None:
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
    builder: _Builder, bt: BatchFigures, counts: Mapping[int, int], goal: str
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


def _score(
    fc: FleetClasses, wl: Workload, bt: BatchFigures, got: Sequence[tuple[_Built, int]], goal: str
) -> float:
    """``goal`` ``load``: req/s of ``got``; ``cost``: req/s per unit of cost (-inf when empty)."""
    load = sum(bt.m * 1000.0 * wl.utilisation / b.bottleneck_ms * n for b, n in got)
    if goal == "load":
        return load if got else -math.inf
    cost = sum(sum(fc.classes[j].price * u for j, u in enumerate(b.used)) * n for b, n in got)
    return load / cost if cost > 0 else -math.inf


def _round_mixed(
    builder: _Builder, bt: BatchFigures, counts: Mapping[int, int], goal: str
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


def _ideal(fc: FleetClasses, wl: Workload, bt: BatchFigures, counts: Mapping[int, int], goal: str) -> float:
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
    fc: FleetClasses, wl: Workload, batches: list[BatchFigures], built: list[tuple[int, _Built, int]]
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
    batches: list[BatchFigures],
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
    batches = batch_figures(wl)
    bound, x = solve_max(fc, batches, wl, fc.cards)
    builder = _Builder(fc, wl)
    built = _build_all(fc, wl, batches, builder, x, "load")
    for _ in range(LEFTOVER_ROUNDS):
        left = _cards_left(fc, built)
        extra_bound, x2 = solve_max(fc, batches, wl, left)
        if extra_bound <= 0:
            break
        more = _build_all(fc, wl, batches, builder, x2, "load")
        if not more:
            break
        built.extend(more)
    # Whatever the LP's rounding left: add pipelines or units while that adds load.
    built = _cover(fc, wl, batches, builder, built, math.inf, "load") or built
    # The uniform one-class layout is a plan too (the peer's, re-cut by the partitioner): never do worse.
    uniform = _uniform(fc, wl, batches, builder, peer_milp(fc, peer_configs(fc, wl), None))
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
    batches = batch_figures(wl)
    got = solve_cheapest(fc, batches, wl, target_rps)
    if got is None:
        raise beyond_bound(fc, wl, target_rps, batches)
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
    uniform = _uniform(fc, wl, batches, builder, peer_milp(fc, peer_configs(fc, wl), target_rps))
    if uniform and _load(wl, batches, uniform) >= target_rps * (1 - 1e-9):
        uniform = _trim(fc, wl, batches, uniform, target_rps)
        if _cost(fc, uniform) < _cost(fc, built):
            built = uniform
    pipes, load, cost, gpus, used = _assemble(fc, wl, batches, built)
    return FleetAnswer(
        "cheapest", tuple(pipes), load, cost, gpus, bound, cost / bound, fc.cost_unit, target_rps, dict(used)
    )


def _load(wl: Workload, batches: list[BatchFigures], built: Sequence[tuple[int, _Built, int]]) -> float:
    return sum(1000.0 * wl.utilisation * batches[b].m / bb.bottleneck_ms * n for b, bb, n in built)


def _cover(
    fc: FleetClasses,
    wl: Workload,
    batches: list[BatchFigures],
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
    batches: list[BatchFigures],
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


def _as_built(
    fc: FleetClasses, batches: list[BatchFigures], ans: FleetAnswer
) -> list[tuple[int, _Built, int]]:
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
    fc: FleetClasses,
    wl: Workload,
    batches: list[BatchFigures],
    built: list[tuple[int, _Built, int]],
    target: float,
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
