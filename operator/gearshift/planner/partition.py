"""The minimum-bottleneck pipeline partitioner: which nodes, in which order, hold which layers.

One module of 600-odd lines on purpose: the exact DP, its class-count states, the heuristic that coarsens
onto it and the replicated variant share one state layout and one reach function, and read best together.

Problem (the planner's cost model): choose an ordered sequence of distinct nodes and cut the layers
``[0, L)`` into one non-empty contiguous stage per node so that every stage fits its node's memory,
adjacent nodes are linked, and the **bottleneck** -- the largest of the stage times
``sum(compute_ms[a:b]) / compute_score`` and the link bounds ``activation_mb·8/Gbps/0.7`` -- is least.
With a free order this is NP-hard in general (it contains partitioning onto unrelated machines), so the
exact method is exponential in the number of *distinct* nodes only.

Exact method (up to 2^16 DP states, i.e. 16 distinct nodes, more when nodes come in identical pools):

1. The optimum is one of finitely many candidate values: a stage time ``(P[b]-P[a])/s`` for a prefix
   sum ``P`` and a node score ``s``, or a link bound. Feasibility is monotone in the bottleneck ``T``,
   so a bisection over the sorted candidates (from the lower bound up) finds the least feasible one.
2. Feasibility at ``T`` is a dynamic program over *which nodes are used* with the state value "the
   furthest layer the pipeline can reach", ``G[S][v]`` for node set ``S`` ending at node ``v``. Reaching
   further dominates, because a node's reach ``reach_v(a)`` (the largest ``b`` with the stage ``[a, b)``
   within ``T`` and within memory, found by binary search on prefix sums) is non-decreasing in ``a``.
   Hence ``G[S][u] = reach_u(max over linked v of G[S \\ u][v])``, one vectorised numpy step per
   (level, u): O(2^N · N) work per check instead of O(2^N · N²).
3. Identical nodes (same score, memory and links) are interchangeable, so the DP runs over *how many*
   nodes of each class are used (mixed-radix states): a 64-node fleet of 4 pools is still exact.

Heuristic (state space above the cap): nodes are binned into classes of similar score (5% bins) and
equal memory, each class taking its weakest member's score and memory and the worst link between the
classes -- so any solution of the coarse problem is feasible on the real nodes -- class sizes are
trimmed until the states fit, the same DP solves it, and the layer cuts are then re-optimised for the
chosen node order on the real scores. Its gap to the lower bound is reported.

Replicated pipelines: with ``replicas = R`` each stage takes R nodes of one class (the DP runs on class
sizes ``// R``), giving R pipelines with the same cuts.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from gearshift.planner.costs import LayerCosts
from gearshift.planner.errors import (
    EmptyFleetError,
    LayerTooLargeError,
    ModelTooLargeError,
    NoLinkError,
    PlanError,
)
from gearshift.planner.profile import Link, Node, Profile

#: Most DP moves per check (states × classes) the exact method accepts: 16 distinct nodes (2^16 × 16).
DEFAULT_WORK_CAP = 1 << 20
#: Score-quantile groupings the heuristic tries; it keeps the best plan.
HEURISTIC_GROUPS = (1, 2, 3, 4, 6, 8)
#: Relative slack of the feasibility test, so that a candidate equal to a stage time passes.
_EPS = 1e-9


@dataclass(frozen=True)
class PipelineStage:
    """Layers ``[start, end)`` held by ``node_ids`` (one node per pipeline replica)."""

    start: int
    end: int
    node_ids: tuple[str, ...]
    time_ms: float
    """Time per micro-batch of the slowest of the stage's nodes, ms."""
    memory_gb: float
    """Weights + KV cache of the stage's layers, GiB."""

    @property
    def layers(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Pipeline:
    """A partition: stages in pipeline order, its bottleneck and the lower bound beside it."""

    stages: tuple[PipelineStage, ...]
    bottleneck_ms: float
    """Largest stage time or link bound of the slowest replica, ms per micro-batch."""
    lower_bound_ms: float
    """``max(total_compute·R / Σ scores, max_layer / max_score)`` over the nodes considered, ms."""
    exact: bool
    """True when the bottleneck is proven minimal (exact DP), False for the heuristic."""
    method: str
    replicas: int = 1
    link_ms: tuple[float, ...] = field(default=())
    """Pure transfer time of each stage boundary (worst replica), ms: ``mb·8/Gbps + µs/1000``."""

    @property
    def layer_counts(self) -> list[int]:
        return [s.layers for s in self.stages]

    @property
    def node_ids(self) -> list[str]:
        return [n for s in self.stages for n in s.node_ids]


# --------------------------------------------------------------------------------------------
# Evaluation of a given partition (the contract the tests check against)


def lower_bound_ms(costs: LayerCosts, nodes: Sequence[Node], replicas: int = 1) -> float:
    """The planner's lower bound on the bottleneck: ``max(total·R / Σ scores, max_layer / max_score)``, ms.

    Raises:
        EmptyFleetError: no nodes.
    """
    if not nodes:
        raise EmptyFleetError("no nodes to plan on")
    scores = [n.compute_score for n in nodes]
    return max(sum(costs.compute_ms) * replicas / sum(scores), max(costs.compute_ms) / max(scores))


def evaluate(
    profile: Profile, costs: LayerCosts, cuts: Sequence[tuple[int, int, Sequence[str]]]
) -> tuple[float, list[float], list[float]]:
    """Bottleneck of a given partition ``[(start, end, node_ids)]`` under the planner's cost model.

    Returns ``(bottleneck_ms, stage_time_ms per stage, link transfer_ms per boundary)`` where stage times
    and transfers are the worst over replicas (``node_ids[r]`` forms replica r).

    Raises:
        PlanError: the stages do not tile ``[0, L)``, a stage's memory exceeds a node's (by how much),
            or adjacent nodes are not linked.
    """
    L = costs.num_layers
    pos = 0
    times, transfers = [], []
    bottleneck = 0.0
    for k, (a, b, ids) in enumerate(cuts):
        if a != pos or b <= a:
            raise PlanError(f"stage {k} covers [{a}, {b}) but must start at {pos} and be non-empty")
        pos = b
        need = sum(costs.memory_gb(i) for i in range(a, b))
        work = sum(costs.compute_ms[a:b])
        worst = 0.0
        for nid in ids:
            node = profile.node(nid)
            if need > node.memory_gb * (1 + 1e-12):
                raise PlanError(
                    f"stage {k} (layers [{a}, {b})) needs {need:.2f} GiB but {nid} has {node.memory_gb:.2f} "
                    f"GiB: over by {need - node.memory_gb:.2f} GiB"
                )
            worst = max(worst, work / node.compute_score)
        times.append(worst)
        bottleneck = max(bottleneck, worst)
        if k:
            prev_ids = cuts[k - 1][2]
            worst_t = 0.0
            for m, n in zip(prev_ids, ids, strict=True):
                link = profile.link(m, n)
                if link is None:
                    raise PlanError(f"stages {k - 1} and {k} sit on {m} and {n}, which have no link")
                bottleneck = max(bottleneck, link.cap_ms(costs.activation_mb))
                worst_t = max(worst_t, link.transfer_ms(costs.activation_mb))
            transfers.append(worst_t)
    if pos != L:
        raise PlanError(f"the stages end at layer {pos} but the model has {L} layers")
    return bottleneck, times, transfers


def even_split(costs: LayerCosts, node_ids: Sequence[str]) -> list[tuple[int, int, list[str]]]:
    """The naive baseline: layers split as evenly as possible over ``node_ids`` in order (larger first)."""
    L, K = costs.num_layers, len(node_ids)
    base, extra = divmod(L, K)
    cuts, a = [], 0
    for k, nid in enumerate(node_ids):
        b = a + base + (1 if k < extra else 0)
        cuts.append((a, b, [nid]))
        a = b
    return cuts


# --------------------------------------------------------------------------------------------
# Node classes


@dataclass
class _Class:
    members: list[Node]
    score: float
    memory: float


def _worst(links: list[Link | None]) -> Link | None:
    if not links or any(x is None for x in links):
        return None
    return Link(min(x.bandwidth_gbps for x in links if x), max(x.latency_us for x in links if x))


def _class_links(profile: Profile, classes: list[_Class]) -> tuple[list[list[Link | None]], bool]:
    """Conservative class-to-class links and whether every member pair agrees (exact grouping)."""
    k = len(classes)
    out: list[list[Link | None]] = [[None] * k for _ in range(k)]
    uniform = True
    for i, ci in enumerate(classes):
        for j, cj in enumerate(classes):
            pairs = [profile.link(x.node_id, y.node_id) for x in ci.members for y in cj.members if x is not y]
            out[i][j] = _worst(pairs)
            if len(set(pairs)) > 1:
                uniform = False
    return out, uniform


def _exact_classes(nodes: Sequence[Node]) -> list[_Class]:
    groups: dict[tuple[float, float], list[Node]] = {}
    for n in nodes:
        groups.setdefault((n.compute_score, n.memory_gb), []).append(n)
    return [_Class(m, m[0].compute_score, m[0].memory_gb) for m in groups.values()]


def _coarse_classes(nodes: Sequence[Node], groups: int) -> list[_Class]:
    """Nodes split into ``groups`` score quantiles, each split again by memory (GiB, floored).

    A class takes its weakest member's score and smallest memory, so plans on it stay feasible.
    """
    ranked = sorted(nodes, key=lambda n: -n.compute_score)
    size = math.ceil(len(ranked) / groups)
    buckets: dict[tuple[int, int], list[Node]] = {}
    for i, n in enumerate(ranked):
        buckets.setdefault((i // size, math.floor(n.memory_gb)), []).append(n)
    return [_Class(m, min(n.compute_score for n in m), min(n.memory_gb for n in m)) for m in buckets.values()]


def _work(counts: Sequence[int]) -> int:
    """DP moves per feasibility check: states × classes."""
    return math.prod(c + 1 for c in counts) * len(counts)


# --------------------------------------------------------------------------------------------
# The DP


class _Solver:
    """Bisection + DP over class-count states for one cost table and one set of classes."""

    def __init__(
        self,
        costs: LayerCosts,
        classes: list[_Class],
        counts: list[int],
        links: list[list[Link | None]],
        max_stages: int | None,
    ) -> None:
        self.costs = costs
        self.L = costs.num_layers
        self.k = len(classes)
        self.classes = classes
        self.counts = np.array(counts, dtype=np.int64)
        self.scores = np.array([c.score for c in classes])
        self.P = np.concatenate(([0.0], np.cumsum(costs.compute_ms)))
        Q = np.concatenate(([0.0], np.cumsum([costs.memory_gb(i) for i in range(self.L)])))
        mems = np.array([c.memory for c in classes])
        self.reach_mem = np.searchsorted(Q, Q[None, :] + mems[:, None] + 1e-9, side="right") - 1
        self.link_ok = np.array([[x is not None for x in row] for row in links], dtype=bool)
        self.link_cap = np.array(
            [[x.cap_ms(costs.activation_mb) if x else np.inf for x in row] for row in links]
        )
        radix = self.counts + 1
        self.stride = np.concatenate(([1], np.cumprod(radix)[:-1])).astype(np.int64)
        self.nstates = int(np.prod(radix))
        idx = np.arange(self.nstates, dtype=np.int64)
        cnt = (idx[:, None] // self.stride[None, :]) % radix[None, :]
        self.level_of = cnt.sum(axis=1)
        total = int(self.counts.sum())
        self.max_level = min(total, max_stages) if max_stages else total
        # States are stored level by level; pos[s] is state s's index inside its level's array.
        self.levels: list[np.ndarray] = [idx[self.level_of == lv] for lv in range(self.max_level + 1)]
        self.pos = np.zeros(self.nstates, dtype=np.int64)
        for states in self.levels:
            self.pos[states] = np.arange(states.size)
        # Every move "add one node of class u to state prev" into level lv, concatenated over u so that
        # one numpy step per level handles all of them; slices[lv][u] is class u's part.
        self.moves: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.slices: list[dict[int, slice]] = []
        for lv in range(self.max_level + 1):
            us, sels, prevs, sl, at = [], [], [], {}, 0
            if lv >= 2:
                states = self.levels[lv]
                for u in range(self.k):
                    sel = states[cnt[states, u] >= 1]
                    if sel.size:
                        us.append(np.full(sel.size, u, dtype=np.int64))
                        sels.append(self.pos[sel])
                        prevs.append(self.pos[sel - self.stride[u]])
                        sl[u] = slice(at, at + sel.size)
                        at += sel.size
            empty = np.zeros(0, dtype=np.int64)
            self.moves.append(
                (
                    np.concatenate(us) if us else empty,
                    np.concatenate(sels) if sels else empty,
                    np.concatenate(prevs) if prevs else empty,
                )
            )
            self.slices.append(sl)
        self.G: list[np.ndarray] = [np.full((self.k, st.size), -1, dtype=np.int32) for st in self.levels]

    def reach(self, T: float) -> np.ndarray:
        slack = T * self.scores * (1 + _EPS) + 1e-12 * self.P[-1]
        rt = np.searchsorted(self.P, self.P[None, :] + slack[:, None], side="right") - 1
        return np.minimum(rt, self.reach_mem)

    def allowed(self, T: float) -> np.ndarray:
        allow = self.link_ok & (self.link_cap <= T * (1 + _EPS))
        # A class of one node never follows itself (its DP entry is always -1), so the missing
        # self-link must not force the slower masked path.
        single = self.counts <= 1
        allow[single, single] = True
        return allow

    def feasible(self, T: float, allowed: np.ndarray | None = None) -> int | None:
        """The fewest stages of a pipeline with bottleneck ≤ T, or None; leaves the DP table in G."""
        L, G = self.L, self.G
        reach = self.reach(T)
        allow = self.allowed(T) if allowed is None else allowed
        for g in G:
            g.fill(-1)
        g1 = G[1]
        for u in range(self.k):
            if self.counts[u] >= 1 and reach[u, 0] > 0:
                g1[u, self.pos[self.stride[u]]] = reach[u, 0]
        if (g1 == L).any():
            return 1
        masked = [u for u in range(self.k) if not allow[:, u].all()]
        for lv in range(2, self.max_level + 1):
            prev_g, cur = G[lv - 1], G[lv]
            rowmax = prev_g.max(axis=0)
            if (rowmax < 0).all():
                return None
            us, sel, prev = self.moves[lv]
            best = rowmax[prev]
            for u in masked:
                part = self.slices[lv].get(u)
                if part is None:
                    continue
                cols = np.flatnonzero(allow[:, u])
                best[part] = prev_g[cols][:, prev[part]].max(axis=0) if cols.size else -1
            val = reach[us, np.maximum(best, 0)]
            cur[us, sel] = np.where((best >= 0) & (val > best), val, -1)
            if (cur == L).any():
                return lv
        return None

    def value(self, state: int, u: int) -> int:
        """The DP entry G[state][u] of the last ``feasible`` call."""
        return int(self.G[self.level_of[state]][u, self.pos[state]])

    def backtrack(
        self, T: float, level: int, allowed: np.ndarray | None = None
    ) -> list[tuple[int, int, int]]:
        """Stages ``(start, end, class)`` of the pipeline found by ``feasible(T)`` at ``level``."""
        allow = self.allowed(T) if allowed is None else allowed
        L = self.L
        us, ps = np.nonzero(self.G[level] == L)
        s, u = int(self.levels[level][ps[0]]), int(us[0])
        end = L
        out: list[tuple[int, int, int]] = []
        while self.level_of[s] > 1:
            prev = s - int(self.stride[u])
            vs = [v for v in np.flatnonzero(allow[:, u]) if self.value(prev, int(v)) >= 0]
            vals = [self.value(prev, int(v)) for v in vs]
            i = int(np.argmax(vals))
            start, v = vals[i], int(vs[i])
            out.append((start, end, u))
            s, u, end = prev, v, start
        out.append((0, end, u))
        out.reverse()
        return out

    def candidates(self) -> np.ndarray:
        P = self.P
        diffs = (P[None, :] - P[:, None])[np.triu_indices(self.L + 1, k=1)]
        vals = [diffs / s for s in np.unique(self.scores)]
        vals.append(self.link_cap[np.isfinite(self.link_cap)].ravel())
        return np.unique(np.concatenate(vals))

    def solve(self, lower: float) -> tuple[float, list[tuple[int, int, int]]] | None:
        """Least feasible candidate bottleneck ≥ ``lower`` and its stages, or None when none is feasible."""
        cand = self.candidates()
        if self.feasible(float(cand[-1])) is None:
            return None
        lo = int(np.searchsorted(cand, lower * (1 - 1e-12)))
        hi = len(cand) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if self.feasible(float(cand[mid])) is not None:
                hi = mid
            else:
                lo = mid + 1
        T = float(cand[hi])
        level = self.feasible(T)
        assert level is not None
        return T, self.backtrack(T, level)


# --------------------------------------------------------------------------------------------
# Public entry point


def _diagnose(
    costs: LayerCosts, nodes: Sequence[Node], solver: _Solver, profile: Profile, replicas: int
) -> PlanError:
    """The most specific reason no pipeline exists (called after the DP failed at T = ∞)."""
    L = costs.num_layers
    per_layer = [costs.memory_gb(i) for i in range(L)]
    biggest = max(nodes, key=lambda n: n.memory_gb)
    i = int(np.argmax(per_layer))
    if per_layer[i] > biggest.memory_gb:
        return LayerTooLargeError(
            f"layer {i} needs {per_layer[i]:.2f} GiB (weights {costs.weight_gb[i]:.2f}"
            f" + KV {costs.kv_gb[i]:.2f}) but the largest node, {biggest.node_id}, has "
            f"{biggest.memory_gb:.2f} GiB: short by "
            f"{per_layer[i] - biggest.memory_gb:.2f} GiB; add a larger card or lower the KV budget"
        )
    all_links = np.ones((solver.k, solver.k), dtype=bool)
    level = solver.feasible(math.inf, allowed=all_links)
    if level is not None:
        stages = solver.backtrack(math.inf, level, allowed=all_links)
        pools = [list(c.members) for c in solver.classes]
        order = [pools[u].pop(0).node_id for _, _, u in stages]
        missing = [f"{a}–{b}" for a, b in itertools.pairwise(order) if profile.link(a, b) is None]
        what = ", ".join(missing) or "between the needed nodes"
        return NoLinkError(
            f"the model fits in memory only across {level} stages, but the profile has no link {what}; "
            "add those links to the interconnect of the profile"
        )
    need = sum(per_layer) * replicas
    usable = sorted((n.memory_gb for n in nodes), reverse=True)[: solver.max_level * replicas]
    have = sum(usable)
    if need > have:
        return ModelTooLargeError(
            f"the model needs {need:.2f} GiB (weights + KV"
            f"{f' for {replicas} replicas' if replicas > 1 else ''})"
            f" but the usable nodes hold {have:.2f} GiB: short by {need - have:.2f} GiB; add nodes or lower "
            "the KV budget"
        )
    return ModelTooLargeError(
        f"the model needs {need:.2f} GiB and the nodes hold {have:.2f} GiB in total, but layers cannot be "
        "cut to fit the cards' individual memory; add a larger card or lower the KV budget"
    )


def _refine(
    profile: Profile, costs: LayerCosts, seq: list[tuple[str, ...]]
) -> list[tuple[int, int, tuple[str, ...]]] | None:
    """Best cuts for a fixed sequence of stage node tuples: bisection + greedy (greedy is optimal here)."""
    L = costs.num_layers
    P = np.concatenate(([0.0], np.cumsum(costs.compute_ms)))
    Q = np.concatenate(([0.0], np.cumsum([costs.memory_gb(i) for i in range(L)])))
    nodes = [[profile.node(n) for n in ids] for ids in seq]
    score = np.array([min(n.compute_score for n in ns) for ns in nodes])
    mem = np.array([min(n.memory_gb for n in ns) for ns in nodes])
    caps = []
    for a, b in itertools.pairwise(seq):
        links = [profile.link(x, y) for x, y in zip(a, b, strict=True)]
        caps.append(max(x.cap_ms(costs.activation_mb) if x else math.inf for x in links))
    diffs = (P[None, :] - P[:, None])[np.triu_indices(L + 1, k=1)]
    cand = np.unique(np.concatenate([diffs / s for s in np.unique(score)] + [np.array(caps)]))
    cand = cand[np.isfinite(cand)]

    def greedy(T: float) -> list[tuple[int, int, tuple[str, ...]]] | None:
        a, out = 0, []
        for i, ids in enumerate(seq):
            if i and caps[i - 1] > T * (1 + _EPS):
                return None
            bt = int(np.searchsorted(P, P[a] + T * score[i] * (1 + _EPS) + 1e-12 * P[-1], side="right") - 1)
            bm = int(np.searchsorted(Q, Q[a] + mem[i] + 1e-9, side="right") - 1)
            b = min(bt, bm)
            if b <= a:
                return None
            out.append((a, b, ids))
            a = b
            if a == L:
                return out
        return None

    lo, hi = 0, len(cand) - 1
    if not len(cand) or greedy(float(cand[hi])) is None:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if greedy(float(cand[mid])) is not None:
            hi = mid
        else:
            lo = mid + 1
    return greedy(float(cand[hi]))


def min_bottleneck(
    profile: Profile,
    costs: LayerCosts,
    *,
    replicas: int = 1,
    max_stages: int | None = None,
    node_ids: Sequence[str] | None = None,
    work_cap: int = DEFAULT_WORK_CAP,
) -> Pipeline:
    """The minimum-bottleneck pipeline (``replicas`` copies with the same cuts) over the profile's nodes.

    Args:
        profile: nodes and links.
        costs: layer costs for one micro-batch size.
        replicas: pipelines to build, each stage taking that many nodes of one class.
        max_stages: most stages per pipeline (None: as many as there are nodes).
        node_ids: restrict to these nodes (default: all).
        work_cap: most DP moves per check (states × classes) before the heuristic takes over.

    Returns:
        A :class:`Pipeline`; ``exact`` tells whether its bottleneck is proven minimal.

    Raises:
        EmptyFleetError: no node (or fewer nodes than ``replicas`` of any class).
        LayerTooLargeError, NoLinkError, ModelTooLargeError: no pipeline exists; the message says what
            does not fit and by how much.
    """
    if replicas < 1:
        raise PlanError(f"replicas must be >= 1, got {replicas}")
    nodes = list(profile.nodes)
    if node_ids is not None:
        wanted = set(node_ids)
        nodes = [n for n in nodes if n.node_id in wanted]
    if not nodes:
        raise EmptyFleetError("no nodes to plan on: the profile (after filters) is empty")
    sub = profile.subset({n.node_id for n in nodes}) if node_ids is not None else profile

    lb = lower_bound_ms(costs, nodes, replicas)
    attempts, exact, method = _attempts(sub, nodes, replicas, work_cap)
    best: Pipeline | None = None
    error: PlanError | None = None
    for a_classes, a_counts, a_links in attempts:
        if sum(a_counts) == 0:
            error = EmptyFleetError(f"no class of similar nodes has {replicas} members for as many replicas")
            continue
        solver = _Solver(costs, a_classes, a_counts, a_links, max_stages)
        found = solver.solve(lb)
        if found is None:
            error = _diagnose(costs, nodes, solver, sub, replicas)
            continue
        pipeline = _assemble(sub, costs, a_classes, found[1], replicas, lb, exact, method)
        if best is None or pipeline.bottleneck_ms < best.bottleneck_ms:
            best = pipeline
    if best is None:
        assert error is not None
        raise error
    return best


_Attempt = tuple[list[_Class], list[int], list[list[Link | None]]]


def _attempts(
    profile: Profile, nodes: list[Node], replicas: int, work_cap: int
) -> tuple[list[_Attempt], bool, str]:
    """The class structures to run the DP on, whether they make the result exact, and the method name."""
    classes = _exact_classes(nodes)
    links, uniform = _class_links(profile, classes)
    counts = [len(c.members) // replicas for c in classes]
    if uniform and _work(counts) <= work_cap:
        return [(classes, counts, links)], True, "exact: bisection + DP over classes of identical nodes"
    if replicas == 1 and len(nodes) <= 64 and _work([1] * len(nodes)) <= work_cap:
        singles = [_Class([n], n.compute_score, n.memory_gb) for n in nodes]
        return (
            [(singles, [1] * len(nodes), _class_links(profile, singles)[0])],
            True,
            ("exact: bisection + DP over node subsets"),
        )
    attempts = []
    for groups in HEURISTIC_GROUPS:
        coarse = _coarse_classes(nodes, groups)
        n_counts = [len(c.members) // replicas for c in coarse]
        while _work(n_counts) > work_cap:
            n_counts[int(np.argmax(n_counts))] -= 1
        attempts.append((coarse, n_counts, _class_links(profile, coarse)[0]))
    return attempts, False, "heuristic: DP over coarse node classes, cuts re-optimised"


def fewest_stages(
    profile: Profile,
    costs: LayerCosts,
    *,
    replicas: int = 1,
    node_ids: Sequence[str] | None = None,
    work_cap: int = DEFAULT_WORK_CAP,
) -> int | None:
    """The fewest stages any pipeline needs to fit memory and links (bottleneck unbounded), or None."""
    nodes = [n for n in profile.nodes if node_ids is None or n.node_id in set(node_ids)]
    if not nodes:
        return None
    sub = profile.subset({n.node_id for n in nodes})
    attempts, _, _ = _attempts(sub, nodes, replicas, work_cap)
    found = [_Solver(costs, c, k, lk, None).feasible(math.inf) for c, k, lk in attempts if sum(k) > 0]
    levels = [lv for lv in found if lv is not None]
    return min(levels) if levels else None


def _assemble(
    profile: Profile,
    costs: LayerCosts,
    classes: list[_Class],
    class_stages: list[tuple[int, int, int]],
    replicas: int,
    lb: float,
    exact: bool,
    method: str,
) -> Pipeline:
    """Concrete nodes for the class-level stages (strongest members first), then evaluate."""
    pools = [list(c.members) for c in classes]
    seq: list[tuple[str, ...]] = []
    for _, _, u in class_stages:
        seq.append(tuple(pools[u].pop(0).node_id for _ in range(replicas)))
    cuts = [(a, b, ids) for (a, b, _), ids in zip(class_stages, seq, strict=True)]
    if not exact:
        cuts = _refine(profile, costs, seq) or cuts
    bottleneck, times, transfers = evaluate(profile, costs, cuts)
    stages = tuple(
        PipelineStage(a, b, tuple(ids), t, sum(costs.memory_gb(i) for i in range(a, b)))
        for (a, b, ids), t in zip(cuts, times, strict=True)
    )
    return Pipeline(stages, bottleneck, lb, exact, method, replicas, tuple(transfers))
