"""Output of ``gearshift plan``: a terminal table with a bar per stage, or JSON / YAML of the plan; and the
fleet-scale answers of ``gearshift plan --fleet`` (:func:`fleet_report`, :func:`fleet_table`)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import yaml

from gearshift.planner.gears import Gear, PlanResult

if TYPE_CHECKING:
    from gearshift.planner.fleetclasses import FleetAnswer, FleetClasses, Workload

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
        f"{' (saturated)' if p.saturated else ''}"
        f"{f', TPOT {p.itl_ms:.1f} ms' if p.itl_ms is not None else ''}; suits "
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


def fleet_report(name: str, classes: FleetClasses, wl: Workload, load: float | None) -> dict[str, Any]:
    """Both fleet-scale answers as one document: ``{fleet, model, gpus, slo_ms, utilisation, cost_unit,
    max_load, cheapest}``, each answer :meth:`FleetAnswer.to_dict` (with ``bound`` and ``ratio``) plus
    ``peer`` (the best uniform one-class, even-split layout, or None) and ``gain_over_peer`` (max load: ours /
    peer's req/s; cheapest: peer's cost / ours).

    Raises:
        PlanError: no plan, or a ``load`` the fleet cannot serve (the message gives the bound).
    """
    # Imported here: scipy's solvers load only for --fleet, not for every `gearshift plan`.
    from gearshift.planner.fleetpeer import peer_cheapest, peer_max_load
    from gearshift.planner.fleetplan import cheapest, max_load

    top = max_load(classes, wl)
    target = load if load is not None else top.throughput_rps / 2
    cheap = cheapest(classes, wl, target)
    peer_top = peer_max_load(classes, wl)
    peer_cheap = peer_cheapest(classes, wl, target)

    def with_peer(
        ans: FleetAnswer, peer: tuple[float, float, dict[tuple[str, int, int], int]] | None
    ) -> dict[str, Any]:
        doc = ans.to_dict()
        doc["peer"] = (
            None
            if peer is None
            else {
                "throughput_rps": round(peer[0], 6),
                "cost": round(peer[1], 6),
                "pipelines": [
                    {"unit": u, "micro_batch": m, "stages": k, "count": n} for (u, m, k), n in peer[2].items()
                ],
            }
        )
        if peer is None:
            doc["gain_over_peer"] = None
        elif ans.question == "max-load":
            doc["gain_over_peer"] = round(ans.throughput_rps / peer[0], 6) if peer[0] > 0 else None
        else:
            doc["gain_over_peer"] = round(peer[1] / ans.cost, 6) if ans.cost > 0 else None
        return doc

    return {
        "fleet": name,
        "model": wl.model.name,
        "gpus": sum(classes.cards.values()),
        "slo_ms": wl.slo_ms,
        "utilisation": wl.utilisation,
        "cost_unit": classes.cost_unit,
        "max_load": with_peer(top, peer_top),
        "cheapest": with_peer(cheap, peer_cheap),
    }


def _fleet_pipelines(doc: Mapping[str, Any]) -> list[str]:
    lines = []
    for p in doc["pipelines"]:
        stages = " | ".join(f"{s['unit']} {s['layers'][1] - s['layers'][0]}" for s in p["stages"])
        lines.append(
            f"  {p['count']:>4} × [{stages}]  micro-batch {p['micro_batch']}, TP {p['tp']}: "
            f"{p['throughput_rps']:.3f} req/s each, bottleneck {p['bottleneck_ms']:.1f} ms, "
            f"latency {p['latency_ms']:.0f} ms, {p['gpus']} GPU(s)"
        )
    return lines


def fleet_table(report: Mapping[str, Any]) -> str:
    """:func:`fleet_report` for a terminal: each answer's totals, bound and ratio, its pipelines (count ×
    [unit class and layers per stage]) and the peer's figures."""
    unit = report["cost_unit"]
    slo = f"SLO {report['slo_ms']:g} ms" if report["slo_ms"] is not None else "no latency SLO"
    top, cheap = report["max_load"], report["cheapest"]
    out = [
        f"fleet {report['fleet']}: {report['gpus']} GPUs; model {report['model']}; {slo}; load counted at "
        f"{report['utilisation']:.0%} of capacity",
        "",
        f"max load: {top['throughput_rps']:.2f} req/s on {top['gpus']} GPUs; bound {top['bound']:.2f} req/s; "
        f"plan / bound {top['ratio']:.3f}",
        *_fleet_pipelines(top),
    ]
    if top["peer"] is not None:
        out.append(
            f"  peer (uniform one-class pipelines, even splits): {top['peer']['throughput_rps']:.2f} req/s; "
            f"ours ×{top['gain_over_peer']:.3f}"
        )
    out += [
        "",
        f"cheapest for {cheap['target_rps']:.2f} req/s: cost {cheap['cost']:.2f} {unit} "
        f"({cheap['gpus']} GPUs, serves {cheap['throughput_rps']:.2f} req/s); "
        f"bound {cheap['bound']:.2f} {unit}; plan / bound {cheap['ratio']:.3f}",
        *_fleet_pipelines(cheap),
    ]
    if cheap["peer"] is not None:
        out.append(
            f"  peer (uniform one-class pipelines, even splits): cost {cheap['peer']['cost']:.2f} {unit}; "
            f"ours ×{1 / cheap['gain_over_peer']:.3f} of it"
        )
    else:
        out.append("  peer (uniform one-class pipelines, even splits): cannot serve this load")
    return "\n".join(out) + "\n"
