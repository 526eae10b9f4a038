"""Brute-force reference for the partitioner benchmark: every ordered node subset, every layer split.

Independent of :mod:`gearshift.planner.partition` on purpose (no bisection, no subset DP, no classes):
it enumerates all ordered sequences of distinct nodes depth-first, and for each sequence prefix keeps
``best[b]`` = the least bottleneck that covers layers ``[0, b)`` with exactly that prefix, one non-empty
stage per node -- the min over all splits, computed by the textbook min-max recurrence
``best'[b] = min_a max(best[a], link bound, stage(a, b))``. A prefix whose best is already no better than
the best full pipeline found is pruned (more stages never lower a bottleneck).
"""

from __future__ import annotations

import math

import numpy as np

from gearshift.planner.costs import LayerCosts
from gearshift.planner.profile import Profile


def brute_force_min_bottleneck(
    profile: Profile, costs: LayerCosts
) -> tuple[float, list[tuple[int, int, str]]]:
    """Least bottleneck (ms) over all ordered subsets and splits, and one pipeline reaching it.

    Raises:
        ValueError: no pipeline exists.
    """
    L = costs.num_layers
    P = np.concatenate(([0.0], np.cumsum(costs.compute_ms)))
    Q = np.concatenate(([0.0], np.cumsum([costs.memory_gb(i) for i in range(L)])))
    work = P[None, :] - P[:, None]  # work[a, b] = compute of [a, b)
    mem = Q[None, :] - Q[:, None]
    upper = np.triu(np.ones((L + 1, L + 1), dtype=bool), k=1)
    nodes = list(profile.nodes)
    stage = []
    for n in nodes:
        t = work / n.compute_score
        t[~upper | (mem > n.memory_gb + 1e-9)] = math.inf
        stage.append(t)
    best_val = math.inf
    best_path: list[tuple[int, int, str]] = []

    def walk(used: list[int], dp: np.ndarray, parents: list[np.ndarray]) -> None:
        nonlocal best_val, best_path
        if dp[L] < best_val:
            best_val = float(dp[L])
            # recover the split from the argmin chain
            path, b = [], L
            for k in range(len(used) - 1, -1, -1):
                a = int(parents[k][b])
                path.append((a, b, nodes[used[k]].node_id))
                b = a
            best_path = path[::-1]
        if dp.min() >= best_val:
            return
        last = nodes[used[-1]]
        for j, n in enumerate(nodes):
            if j in used:
                continue
            link = profile.link(last.node_id, n.node_id)
            if link is None:
                continue
            cap = link.cap_ms(costs.activation_mb)
            m = np.maximum(np.maximum(dp[:, None], cap), stage[j])
            par = m.argmin(axis=0)
            walk([*used, j], m.min(axis=0), [*parents, par])

    for j in range(len(nodes)):
        dp0 = np.full(L + 1, math.inf)
        dp0[0] = 0.0
        m = np.maximum(dp0[:, None], stage[j])
        walk([j], m.min(axis=0), [m.argmin(axis=0)])
    if not math.isfinite(best_val):
        raise ValueError("no pipeline exists")
    return best_val, best_path
