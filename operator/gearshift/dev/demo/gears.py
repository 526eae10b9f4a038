"""Text tables of the gears a GearSet holds (``status.plannedGears`` or ``spec.gears``), pure.

The layout follows ``gearshift.planner.render.to_table`` (a summary line per gear, then one bar per stage
scaled to the slowest stage) but reads the API form, so the demo shows the gears the *operator* planned
from the GPUProfiles, not a second plan computed by the demo.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gearshift.planner.render import card_mix

BAR_WIDTH = 30


def _f(value: Any, fmt: str = ".1f", none: str = "?") -> str:
    return none if value is None else format(float(value), fmt)


def gear_table(
    gear: Mapping[str, Any], active: bool = False, models: Mapping[str, str | None] | None = None
) -> list[str]:
    """Lines describing one API gear (camelCase dict): summary, predictions, a bar per stage.

    Args:
        gear: the gear as ``status.plannedGears`` or ``spec.gears`` hold it.
        active: mark it as the active gear.
        models: node → GPU model (the nodes' ``gearshift.io/gpu-model`` or their GPUProfiles), to show a
            replicated stage's card mix; without it (or for a node it lacks) the stage's one ``gpuModel``
            stands in, which for a stage over different cards names only one of them.
    """
    stages: Sequence[Mapping[str, Any]] = gear.get("stages") or []
    p = gear.get("predicted") or {}
    qr = gear.get("qpsRange") or []
    mark = "  ← active" if active else ""
    lines = [
        f"gear {gear.get('name')} ({gear.get('intent', '?')}): {len(stages)} stage(s), micro-batch "
        f"{gear.get('microBatch', '?')}, max batch {gear.get('maxBatch', '?')}{mark}",
        # The bottleneck is one replica's time per micro-batch; the P99 is per request with every replica
        # serving in parallel, so it may well be far below the bottleneck.
        f"  predicted {_f(p.get('throughputQps'))} req/s, simulated request P99 {_f(p.get('p99Ms'))} ms with "
        f"the replicas in parallel; slowest stage replica {_f(p.get('bottleneckMs'), '.2f')} ms/micro-batch"
        + (f"; suits {_f(qr[0])}–{_f(qr[1])} req/s" if len(qr) == 2 else ""),
    ]
    times = [float(s.get("predictedTimeMs") or 0.0) for s in stages]
    longest = max(times, default=0.0) or 1.0
    for k, (s, t) in enumerate(zip(stages, times, strict=True)):
        a, b = ([*list(s.get("layers") or [0, 0]), 0, 0])[:2]
        fill = round(BAR_WIDTH * t / longest)
        bar = "█" * fill + "·" * (BAR_WIDTH - fill)
        nodes = [str(n) for n in s.get("nodes") or []]
        own = s.get("gpuModel")
        # The card mix from the nodes, not the stage's one gpuModel: a replicated stage may span cards of
        # different speeds (the ms column is its slowest replica's).
        mix = card_mix(nodes, {n: (models or {}).get(n) or own for n in nodes}) if nodes else own or "?"
        reps = int(s.get("replicas") or 1)
        mem = s.get("predictedMemoryGiB")
        lines.append(
            f"  s{k:<2} layers {a:>3}–{b:<3} ({b - a:>3}) {bar} {t:8.2f} ms {_f(mem, '6.1f', '     ?')} GiB  "
            + (f"×{reps} " if reps > 1 else "")
            + mix
            + (f" on {nodes[0]}" if len(nodes) == 1 else "")
        )
        if len(nodes) > 1:
            lines.append(f"{'':6}on {', '.join(nodes)}")
    return lines


def gearset_table(
    role: str, gearset: Mapping[str, Any], models: Mapping[str, str | None] | None = None
) -> str:
    """All gears of one GearSet (API dict) with the active one marked; a header names role and mode, and
    what a stage row holds. ``models`` (node → GPU model) as for :func:`gear_table`."""
    spec = gearset.get("spec") or {}
    status = gearset.get("status") or {}
    gears = spec.get("gears") if spec.get("mode") == "explicit" else status.get("plannedGears")
    active = status.get("activeGear")
    out = [f"{role} ({spec.get('mode', '?')}, GearSet {(gearset.get('metadata') or {}).get('name', '?')}):"]
    if not gears:
        out.append("  (no gears yet)")
    else:
        out.append(
            "  stage rows: layers, ms per micro-batch of the stage's slowest replica (bar), GiB per card, "
            "cards"
        )
    for g in gears or []:
        out.extend(gear_table(g, active=g.get("name") == active, models=models))
    return "\n".join(out)


def stage_nodes(gearset: Mapping[str, Any]) -> list[tuple[str, int, tuple[int, int], str]]:
    """``(gear, stage, (first, end) layers, node)`` for every node of every stage of a GearSet's gears."""
    spec = gearset.get("spec") or {}
    status = gearset.get("status") or {}
    gears = spec.get("gears") if spec.get("mode") == "explicit" else status.get("plannedGears")
    out = []
    for g in gears or []:
        for k, s in enumerate(g.get("stages") or []):
            a, b = ([*list(s.get("layers") or [0, 0]), 0, 0])[:2]
            for node in s.get("nodes") or []:
                out.append((str(g.get("name")), k, (int(a), int(b)), str(node)))
    return out
