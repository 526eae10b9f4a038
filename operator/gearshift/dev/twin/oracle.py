"""The per-window oracle: with hindsight, the gear each window should have been served on, under the
shift mechanics the operator's executor obeys (pure: no I/O, no clock).

``bench/gears.py`` and the demo's twin comparison (:func:`gearshift.dev.twin.compare.replay_window`)
replay its schedule beside the shifting loop: the schedule hindsight finds for the same gears, dwell,
rollback window and load lead. It is a reference, not a strict bound: it judges each window by the static
gears' SLO-met in that window, while a backlog carries over from one window to the next, so a controller
can beat it where a gear saturates (the x4-own-pace scenario of ``bench/gears.py``).
"""

from __future__ import annotations

import json
import math

from gearshift.control.shifting.policy import ShiftRules
from gearshift.dev.twin.constants import WINDOW_S
from gearshift.dev.twin.gears import GearSpec, is_upshift, shift_lead_s


def layout_key(spec: GearSpec) -> str:
    """What makes two gears the same serving layout: the API gear without its name, intent and
    predictions, and the pipeline document its heads run."""
    gear = spec.api.model_dump(mode="json", exclude={"name", "intent", "predicted", "qps_range"})
    return json.dumps([gear, spec.pipeline_doc, spec.head_nodes, spec.cards], sort_keys=True, default=str)


def distinct_layouts(names: list[str], specs: dict[str, GearSpec]) -> list[str]:
    """``names`` less each gear whose layout (:func:`layout_key`) an earlier one has, in order."""
    seen: set[str] = set()
    out = []
    for n in names:
        key = layout_key(specs[n])
        if key not in seen:
            seen.add(key)
            out.append(n)
    return out


def oracle_schedule(
    windows: dict[str, list[int]], specs: dict[str, GearSpec], policy: ShiftRules
) -> tuple[str, list[tuple[float, str]]]:
    """The oracle's gear per 60 s window from the static gears' SLO-met per window: the fewest GPU-seconds
    among the gears within 1% (at least one request) of the window's best, a shortfall beyond that costing
    100 GPU-windows per request, under the shift mechanics: a shift may start only when the previous
    one's rollback window and drain are over and its dwell has passed (``upshiftDwellS`` towards more
    predicted throughput, ``dwellS`` otherwise), and it costs the new gear's cards for its lead time
    (:func:`~gearshift.dev.twin.gears.shift_lead_s`: its shadow loads and warms beside the serving gear,
    as the twin charges it). Gears of one layout (the same stages, batch sizes and pipeline, e.g. a
    planner's ``balanced`` and ``throughput`` that came out equal) are one candidate, the first listed:
    a shift between them would change nothing but cost its shadow. Dynamic programming over (window,
    gear, windows since the last shift). Returns ``(first gear, [(t, gear) serving from t s])``."""
    names = distinct_layouts([g for g in windows if g in specs], specs)
    n_w = max(len(v) for v in windows.values())
    best = [max(windows[g][w] if w < len(windows[g]) else 0 for g in names) for w in range(n_w)]

    def cost(w: int, g: str) -> float:
        got = windows[g][w] if w < len(windows[g]) else 0
        short = max(0.0, best[w] - max(1.0, 0.01 * best[w]) - got)
        return specs[g].gpus + 100.0 * short

    def shadow(g: str) -> float:
        return specs[g].gpus * shift_lead_s(specs[g], policy) / WINDOW_S

    def gap(a: str, b: str) -> int:
        dwell = policy.upshift_dwell_s if is_upshift(specs[a], specs[b]) else policy.dwell_s
        need = dwell + policy.rollback_window_s + 10.0 + shift_lead_s(specs[b], policy)
        return math.ceil(need / WINDOW_S)

    k_max = max(gap(a, b) for a in names for b in names if a != b) if len(names) > 1 else 1
    inf = math.inf
    # value[g][k]: least cost of windows 0..w ending on g with k windows since its shift (capped at k_max).
    value = {g: [inf] * (k_max + 1) for g in names}
    back: list[dict[tuple[str, int], tuple[str, int]]] = []
    for g in names:
        value[g][k_max] = cost(0, g)  # the first gear is free to choose, not a shift
    for w in range(1, n_w):
        nxt = {g: [inf] * (k_max + 1) for g in names}
        ptr: dict[tuple[str, int], tuple[str, int]] = {}
        for g in names:
            for k in range(k_max + 1):
                v = value[g][k]
                if v == inf:
                    continue
                kk = min(k + 1, k_max)
                if v + cost(w, g) < nxt[g][kk]:
                    nxt[g][kk] = v + cost(w, g)
                    ptr[(g, kk)] = (g, k)
                for h in names:
                    if h != g and k + 1 >= gap(g, h) and v + cost(w, h) + shadow(h) < nxt[h][0]:
                        nxt[h][0] = v + cost(w, h) + shadow(h)
                        ptr[(h, 0)] = (g, k)
        back.append(ptr)
        value = nxt
    end = min(((value[g][k], g, k) for g in names for k in range(k_max + 1)), key=lambda x: x[0])
    path = [end[1]]
    state = (end[1], end[2])
    for ptr in reversed(back):
        state = ptr[state]
        path.append(state[0])
    path.reverse()
    changes = [(w * WINDOW_S, path[w]) for w in range(1, n_w) if path[w] != path[w - 1]]
    return path[0], changes
