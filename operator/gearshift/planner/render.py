"""Output of ``gearshift plan``: a terminal table with a bar per stage, or JSON / YAML of the plan."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

import yaml

from gearshift.planner.gears import Gear, PlanResult

BAR_WIDTH = 30


def to_json(result: PlanResult) -> str:
    """The plan as JSON (``{"model", "qps", "gears": [...]}``, see :meth:`Gear.to_dict`)."""
    return json.dumps(result.to_dict(), indent=2)


def to_yaml(result: PlanResult) -> str:
    """The plan as YAML, same structure as :func:`to_json`."""
    return yaml.safe_dump(result.to_dict(), sort_keys=False)


def card_mix(nodes: Sequence[str], models: Mapping[str, str | None] | None) -> str:
    """The cards under ``nodes`` as ``A10-24GB×2, H100-80GB, A100-40GB`` (models in order of first
    appearance, a count when a model holds more than one node); ``?`` for a node without a known model."""
    counts: dict[str, int] = {}
    for n in nodes:
        m = (models or {}).get(n) or "?"
        counts[m] = counts.get(m, 0) + 1
    return ", ".join(m if c == 1 else f"{m}×{c}" for m, c in counts.items())


def stage_cards(nodes: Sequence[str], models: Mapping[str, str | None] | None) -> str:
    """A stage's placement, compact: ``H100-80GB on gpu-h100-0`` for one node; ``×4 A10-24GB×2,
    H100-80GB, A100-40GB`` for a replicated stage (its nodes go on a line of their own). Without
    ``models`` the node names stand in for the cards."""
    if not models:
        return (f"×{len(nodes)} " if len(nodes) > 1 else "") + ", ".join(nodes)
    mix = card_mix(nodes, models)
    return f"{mix} on {nodes[0]}" if len(nodes) == 1 else f"×{len(nodes)} {mix}"


def _gear_table(gear: Gear, models: Mapping[str, str | None] | None = None) -> list[str]:
    p = gear.predicted
    gap = gear.bottleneck_ms / gear.lower_bound_ms if gear.lower_bound_ms > 0 else float("nan")
    lines = [
        f"gear {gear.name}: {len(gear.stages)} stages × {gear.pipelines} pipeline(s), micro-batch "
        f"{gear.micro_batch}, max batch {gear.max_batch}",
        f"  bottleneck {gear.bottleneck_ms:.2f} ms/micro-batch in one pipeline's slowest stage (lower bound "
        f"{gear.lower_bound_ms:.2f}, ×{gap:.3f}{', exact' if gear.exact else ', heuristic'}); all replicas "
        f"together take a micro-batch every {gear.effective_ms:.2f} ms",
        f"  predicted {p.throughput_rps:.1f} req/s; simulated requests at {p.qps:.1f} req/s, replicas "
        f"serving in parallel: P50 {p.p50_ms:.1f} ms, P99 {p.p99_ms:.1f} ms"
        f"{' (saturated)' if p.saturated else ''}; suits "
        f"{gear.qps_range[0]:.1f}–{gear.qps_range[1]:.1f} req/s",
    ]
    longest = max(s.time_ms for s in gear.stages) or 1.0
    for k, s in enumerate(gear.stages):
        fill = round(BAR_WIDTH * s.time_ms / longest)
        bar = "█" * fill + "·" * (BAR_WIDTH - fill)
        a, b = s.layers
        lines.append(
            f"  s{k:<2} layers {a:>3}–{b:<3} ({b - a:>3}) {bar} {s.time_ms:8.2f} ms {s.memory_gb:6.1f} GiB  "
            + stage_cards(s.nodes, models)
        )
        if s.replicas > 1 and models:
            lines.append(f"{'':6}on {', '.join(s.nodes)}")
    return lines


def to_table(result: PlanResult, models: Mapping[str, str | None] | None = None) -> str:
    """A human-readable plan: per gear a summary and one bar per stage (layers, the time per micro-batch
    of its slowest replica in ms, GiB per card, the cards and nodes holding it).

    Args:
        result: the plan.
        models: node → GPU model, to show each stage's card mix; without it only node names show.
    """
    out = [
        f"model {result.model}: {len(result.gears)} gear(s), latencies at {result.qps:.1f} req/s",
        "stage rows: layers, time per micro-batch of the stage's slowest replica (ms, bar), memory per card, "
        + ("replicas and cards" if models else "replicas and nodes"),
        "",
    ]
    for g in result.gears:
        out.extend(_gear_table(g, models))
        out.append("")
    return "\n".join(out).rstrip() + "\n"
