"""The demo report, ``report.md``, assembled from plain data (pure; the plots are separate PNGs).

Every number in it names its source: the load generator's wire measurements, the router's own
``/metrics``, or Prometheus (which scraped the engines). None comes from the simulator's internal state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gearshift.dev.demo.series import GearSpan, ShiftMark


@dataclass
class ReportData:
    """Everything ``report.md`` shows."""

    title: str
    started: str
    """When the replay started (ISO 8601, UTC)."""
    command: str
    cluster: str
    """How the cluster and operator were run (sandbox name, helm or local operator)."""
    namespace: str
    service: str
    model: str
    trace: str
    window_start_s: float
    window_span_s: float
    time_scale: float
    requests: int
    run_s: float
    fleet_table: str
    """``kubectl get gpup`` output."""
    gear_tables: Mapping[str, str]
    """Role → :func:`gearshift.dev.demo.gears.gearset_table` text (as planned at the start)."""
    load: Mapping[str, Any]
    """``gearshift.dev.loadgen.LoadResult.to_dict()``."""
    router_totals: Mapping[str, float]
    """Router counters over the run: ``requests``, ``ok``, ``ttft_p99_ms``, ``itl_p99_ms``."""
    marks: Sequence[ShiftMark]
    spans: Sequence[GearSpan]
    utilization: Mapping[str, Mapping[str, float]]
    """Role → ``gear/stage`` → mean busy fraction over the run (Prometheus)."""
    engine: Mapping[str, float]
    """Engine-side figures from Prometheus (e.g. ``ttft_p99_ms``, ``itl_p99_ms``) over the run."""
    plots: Mapping[str, str]
    """Caption → file name."""
    explore: Sequence[str]
    cost: Mapping[str, Any] = field(default_factory=dict)
    """``{"run": gearshift.dev.demo.cost.run_cost(...), "span_s": s, "twin": cost.twin_static(...)}``
    (each part absent when it could not be measured)."""
    notes: Sequence[str] = field(default_factory=list)


def _ms(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return f"{float(v):.1f}"


def _pct_row(name: str, p: Mapping[str, float] | None) -> str:
    if not p:
        return f"| {name} | – | – | – | – |"
    return (
        f"| {name} | {_ms(p.get('mean'))} | {_ms(p.get('p50'))} | {_ms(p.get('p90'))} | {_ms(p.get('p99'))} |"
    )


def _num(v: Any, fmt: str) -> str:
    return "–" if v is None else format(float(v), fmt)


def cost_section(cost: Mapping[str, Any], time_scale: float, requests: int) -> list[str]:
    """The report's "Cost" lines: the run's GPU-hours and SLO-met per GPU-hour, and the twin's static gears
    on the same window beside them (``cost`` as :class:`ReportData` holds it; empty: nothing)."""
    run, twin = cost.get("run"), cost.get("twin")
    if not run and not twin:
        return []
    span = float(cost.get("span_s") or (twin or {}).get("span_s") or 0.0)
    out = ["", "## Cost", ""]
    if run:
        out += [
            "GPU time the service held, measured: its engine pods' `nvidia.com/gpu` (every gear's: active, "
            "shadows and draining; time-sliced slices rounded up to physical cards), polled "
            f"{run['samples']} times over the {span:.0f} s of the run (issuing, then finishing what was "
            f"issued): **{run['gpu_hours']:.4f} "
            f"GPU-hours** (mean {_num(run['mean_gpus'], '.2f')} cards, peak {run['peak_gpus']}); "
            f"{run['slo_met']} requests met the SLO: "
            f"**{_num(run['slo_met_per_gpu_hour'], ',.0f')} SLO-met per GPU-hour**.",
        ]
    if twin:
        w = twin.get("workload") or ["?", "?"]
        out += [
            "",
            f"The twin (`gearshift.dev.twin`, virtual time) replayed the same {twin['requests']} requests "
            f"at the same {time_scale:g}× on the same fleet and SLO: with the operator's shifting loop over "
            f"the planner's gears (`dynamic`, from `{twin.get('initial_gear')}`), on each of those gears "
            "alone (`static`), and on each layout a user of a peer system (LWS, KServe, llm-d) would deploy "
            "(`peer`: uniform pipelines of one card type with even layer splits, on only the card types "
            "that hold the model that way), and through the per-window oracle's schedule over the planner's "
            "gears (`oracle`: with hindsight, the fewest cards that serve each minute as well as the best "
            "gear does, under the same dwell and warm-up; a reference, not a strict bound). "
            f"Gears planned for {w[0]} prompt / {w[1]} output tokens. The "
            "twin's engines run prefill and decode together: for an aggregated service that is its own "
            "shape, for a PD service one combined gear of the fleet. The run's simulated engines keep "
            "wall-clock time on the sandbox's shared cores beside the control plane, the router and the "
            "load generator; the twin's keep virtual time. The run is charged its whole duration, the "
            "twin's rows their arrival span, as `bench/gears.py` charges them.",
            "",
            "| serving | cards | SLO met | failed | goodput (req/s) | GPU-hours | SLO-met per GPU-hour |",
            "| --- " * 7 + "|",
        ]
        if run:
            met = run["slo_met"]
            good = None if met is None or span <= 0 else met / span
            share = "–" if met is None or not requests else f"{met} ({met / requests:.0%})"
            out.append(
                f"| this run (measured) | mean {_num(run['mean_gpus'], '.2f')} | {share} | "
                f"{run.get('failed', '–')} | {_num(good, '.2f')} | {run['gpu_hours']:.4f} | "
                f"{_num(run.get('slo_met_per_gpu_hour'), ',.0f')} |"
            )
        layouts = twin.get("gears") or {}
        for r in twin.get("rows") or []:
            name = r["variant"]
            if r["kind"] in ("dynamic", "oracle"):
                label = f"twin: `{r['kind']}` ({r['shifts']} shifts)"
                cards = f"mean {_num(r.get('mean_gpus'), '.2f')}"
            else:
                gear = name.removeprefix("static-")
                info = layouts.get(gear) or {}
                split = "+".join(str(x) for x in info.get("layers") or [])
                label = f"twin: {r['kind']} `{gear}`" + (f" ({split})" if split else "")
                cards = str(r.get("gpus"))
            out.append(
                f"| {label} | {cards} | {r['slo_met']} ({r['slo_attainment']:.0%}) | {r['failed']} | "
                f"{r['goodput_rps']:.2f} | {r['gpu_hours']:.4f} | "
                f"{_num(r.get('slo_met_per_gpu_hour'), ',.0f')} |"
            )
        skipped = [p for p in twin.get("peer_layouts") or [] if p.get("skipped")]
        if skipped:
            out += [
                "",
                "Card types that hold the model in no uniform even split: "
                + ", ".join(f"{p['gpu_model']} ({p['cards']} cards)" for p in skipped)
                + ".",
            ]
    return out


def goal_lines(goals: Mapping[str, Mapping[str, Any]]) -> str:
    """The report's "Goals" section (the demo's goals as :func:`gearshift.dev.demo.goals.evaluate` judged
    them), or "" without goals."""
    if not goals:
        return ""
    out = ["", "## Goals", "", "| goal | value | target | met | why |", "| --- " * 5 + "|"]
    for name, g in goals.items():
        out.append(
            f"| {name} | {g.get('value')} | {g.get('goal')} | {'yes' if g.get('met') else '**no**'} | "
            f"{g.get('why', '')} |"
        )
    return "\n".join(out) + "\n"


def explore_commands(namespace: str, service: str) -> list[str]:
    """The report's "explore the cluster" commands, for the service ``service`` in ``namespace``."""
    env_cmd = "gearshift sandbox env"
    return [
        f'eval "$(.venv/bin/{env_cmd})"        # KUBECONFIG and PATH for kubectl',
        "kubectl get gearshift -A                # PDServices, GearSets and GPUProfiles",
        f"kubectl get gearsets -n {namespace}            # active gear, phase, P99, QPS",
        f"kubectl describe pdservice {service} -n {namespace}",
        f"kubectl get pods -n {namespace} -o wide        # stages and the nodes they run on",
        "kubectl get gpup                        # the measured fleet",
        ".venv/bin/gearshift demo --down          # or: make sandbox-down (tear everything down)",
    ]


def render(d: ReportData) -> str:
    """``report.md`` text."""
    load = d.load
    out = [
        f"# {d.title}",
        "",
        f"- started: {d.started} · command: `{d.command}`",
        f"- cluster: {d.cluster}; namespace `{d.namespace}`, PDService `{d.service}` ({d.model}, engine sim)",
        f"- trace: `{d.trace}`, window {d.window_start_s:.0f}–{d.window_start_s + d.window_span_s:.0f} s "
        f"of the trace, replayed {d.time_scale:g}× faster: {d.requests} requests in {d.run_s:.0f} s",
        "",
        "## Results",
        "",
        "From the load generator (client side, on the wire):",
        "",
        f"- issued {load.get('issued')}, completed {load.get('completed')}, failed {load.get('failed')}, "
        f"incomplete {load.get('incomplete')}; offered {float(load.get('request_rate') or 0):.2f} req/s, "
        f"throughput {float(load.get('throughput_rps') or 0):.2f} req/s, "
        f"{float(load.get('output_tokens_per_s') or 0):.0f} output tokens/s",
    ]
    if load.get("goodput_rps") is not None:
        out.append(
            f"- SLO (TTFT ≤ {load.get('slo_ttft_ms'):g} ms, TPOT ≤ {load.get('slo_itl_ms'):g} ms): "
            f"{load.get('slo_met')}/{load.get('completed')} requests met it; goodput "
            f"{float(load['goodput_rps']):.2f} req/s"
        )
    if load.get("clipped"):
        out.append(
            f"- {load['clipped']} trace row(s) longer than the service's max_model_len "
            f"{load.get('max_model_len')} were shortened to fit (vLLM refuses them with a 400)"
        )
    for err, n in (load.get("errors") or {}).items():
        out.append(f"- error ×{n}: `{err}`")
    out += [
        "",
        "| metric (ms) | mean | P50 | P90 | P99 |",
        "| --- | --- | --- | --- | --- |",
        _pct_row("TTFT", load.get("ttft_ms")),
        _pct_row("ITL", load.get("itl_ms")),
        _pct_row("TPOT", load.get("tpot_ms")),
        _pct_row("E2E", load.get("e2e_ms")),
        "",
        "From the router's own `/metrics` (counter and histogram deltas over the run): "
        f"{d.router_totals.get('requests', 0):.0f} requests, {d.router_totals.get('ok', 0):.0f} OK; "
        f"P99 upstream TTFT {_ms(d.router_totals.get('ttft_p99_ms'))} ms, "
        f"P99 upstream ITL {_ms(d.router_totals.get('itl_p99_ms'))} ms (bucket-interpolated).",
    ]
    if d.engine:
        parts = ", ".join(f"{k.replace('_', ' ')} {_ms(v)}" for k, v in d.engine.items())
        out += ["", f"From Prometheus (the engines' vLLM histograms, over the run): {parts}."]
    out += cost_section(d.cost, d.time_scale, d.requests)
    out += ["", "## Gear shifts", ""]
    if d.marks:
        out += [
            "From the GearSets' `status.history` (seconds since the replay started; a shift runs from its "
            "start, through the shadow pods' warm-up and the drain, to the switch):",
            "",
            "| role | from | to | trigger | started (s) | finished (s) | outcome |",
            "| --- " * 7 + "|",
        ]
        for m in d.marks:
            fin = "–" if m.finished_s is None else f"{m.finished_s:.0f}"
            # A shift that did not succeed says why (a rollback's P99 comparison, a warm-up timeout).
            why = (
                f": {m.message}".replace("|", "\\|")
                if m.message and m.outcome not in ("Succeeded", "InProgress")
                else ""
            )
            out.append(
                f"| {m.role} | {m.from_gear or '–'} | {m.to_gear} | {m.trigger} | {m.started_s:.0f} | {fin} "
                f"| {m.outcome}{why} |"
            )
    else:
        out.append("No gear shift happened during the replay (GearSet `status.history`).")
    out += ["", "Gears that served traffic (from the shifts above):", ""]
    for s in d.spans:
        out.append(f"- {s.role}: `{s.gear}` from {s.start_s:.0f} s to {s.end_s:.0f} s")
    if d.utilization:
        out += ["", "Mean stage utilisation over the run (`gearshift:stage_utilization`, Prometheus):", ""]
        for role, per in d.utilization.items():
            cells = ", ".join(f"{k} {v:.0%}" for k, v in per.items())
            out.append(f"- {role}: {cells or '–'}")
    out += ["", "## Plots", ""]
    for caption, fname in d.plots.items():
        out += [f"### {caption}", "", f"![{caption}]({fname})", ""]
    out += [
        "## The fleet",
        "",
        "`kubectl get gpup` when the replay started:",
        "",
        "```",
        d.fleet_table.rstrip(),
    ]
    out += [
        "```",
        "",
        "## The gears the operator planned",
        "",
        "The planner's predictions (GearSet `status.plannedGears`), not measurements; cards from the "
        "GPUProfiles.",
        "",
    ]
    for _role, text in d.gear_tables.items():
        out += ["```", text.rstrip(), "```", ""]
    out += ["## Explore", "", "```bash", *d.explore, "```", ""]
    if d.notes:
        out += ["## Notes", "", *[f"- {n}" for n in d.notes], ""]
    return "\n".join(out)
