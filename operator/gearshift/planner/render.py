"""Output of ``gearshift plan``: a terminal table with a bar per stage, or JSON / YAML of the plan."""

from __future__ import annotations

import json

import yaml

from gearshift.planner.gears import Gear, PlanResult

BAR_WIDTH = 30


def to_json(result: PlanResult) -> str:
    """The plan as JSON (``{"model", "qps", "gears": [...]}``, see :meth:`Gear.to_dict`)."""
    return json.dumps(result.to_dict(), indent=2)


def to_yaml(result: PlanResult) -> str:
    """The plan as YAML, same structure as :func:`to_json`."""
    return yaml.safe_dump(result.to_dict(), sort_keys=False)


def _gear_table(gear: Gear) -> list[str]:
    p = gear.predicted
    gap = gear.bottleneck_ms / gear.lower_bound_ms if gear.lower_bound_ms > 0 else float("nan")
    lines = [
        f"gear {gear.name}: {len(gear.stages)} stages × {gear.pipelines} pipeline(s), micro-batch "
        f"{gear.micro_batch}, max batch {gear.max_batch}",
        f"  bottleneck {gear.bottleneck_ms:.2f} ms/micro-batch (lower bound {gear.lower_bound_ms:.2f}, "
        f"×{gap:.3f}{', exact' if gear.exact else ', heuristic'}); effective {gear.effective_ms:.2f} ms",
        f"  predicted {p.throughput_rps:.1f} req/s; at {p.qps:.1f} req/s P50 {p.p50_ms:.1f} ms, P99 "
        f"{p.p99_ms:.1f} ms{' (saturated)' if p.saturated else ''}; suits "
        f"{gear.qps_range[0]:.1f}–{gear.qps_range[1]:.1f} req/s",
    ]
    longest = max(s.time_ms for s in gear.stages) or 1.0
    width = max(len(s.node) for s in gear.stages)
    for k, s in enumerate(gear.stages):
        fill = round(BAR_WIDTH * s.time_ms / longest)
        bar = "█" * fill + "·" * (BAR_WIDTH - fill)
        extra = f" ×{s.replicas} ({', '.join(s.nodes[1:])})" if s.replicas > 1 else ""
        a, b = s.layers
        lines.append(
            f"  s{k:<2} {s.node:<{width}} layers {a:>3}–{b:<3} ({b - a:>3}) "
            f"{bar} {s.time_ms:8.2f} ms {s.memory_gb:7.1f} GiB{extra}"
        )
    return lines


def to_table(result: PlanResult) -> str:
    """A human-readable plan: per gear a summary and one bar per stage (node, layers, ms)."""
    out = [f"model {result.model}: {len(result.gears)} gear(s), latencies at {result.qps:.1f} req/s", ""]
    for g in result.gears:
        out.extend(_gear_table(g))
        out.append("")
    return "\n".join(out).rstrip() + "\n"
