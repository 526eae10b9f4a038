"""What a demo run measured, gathered and written: the GearSets' shifts, Prometheus' utilisation and
engine latencies, the cards held, the twin's replays of the same window, and from them ``report.md``
(:mod:`~gearshift.dev.demo.report`), ``summary.json`` (:mod:`~gearshift.dev.demo.summary`), ``load.json`` and
the plots (:mod:`~gearshift.dev.demo.plots`)."""

from __future__ import annotations

import json
import math
import shlex
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gearshift.dev.demo import cost, goals, plots, report, series, summary
from gearshift.dev.demo import trace as tracewin
from gearshift.dev.demo.context import LIVE_WINDOW_S, TICK_S, Ctx
from gearshift.dev.demo.fleet import fleet_rows, node_models
from gearshift.dev.demo.gears import gearset_table, stage_nodes
from gearshift.dev.demo.kube import DemoError
from gearshift.dev.demo.replay import Replay
from gearshift.k8s import names

#: Time-series bin of the report's wire measurements, s.
BIN_S = 10.0


def _prom_util(ctx: Ctx, rep: Replay) -> dict[str, list[series.Series]]:
    if ctx.prom is None:
        return {}
    sel = f'namespace="{ctx.args.namespace}",gearshift_io_service="{ctx.service}"'
    expr = f"max by (gearshift_io_role, gearshift_io_gear, stage) (gearshift:stage_utilization{{{sel}}})"
    try:
        res = ctx.prom.query_range(expr, rep.t0, rep.t0 + rep.run_s, TICK_S)
    except (DemoError, OSError) as exc:
        ctx.notes.append(f"Prometheus range query for stage utilisation failed: {exc}")
        return {}
    out: dict[str, list[series.Series]] = {}
    for role in (*names.ROLES, "both"):
        part = [r for r in res if (r.get("metric") or {}).get("gearshift_io_role") == role]
        # An aggregated service has no prefill or decode pods: name only the roles that have series.
        if part:
            out[role] = series.matrix_series(part, rep.t0, ["gearshift_io_gear", "stage"])
    return out


def _prom_engine(ctx: Ctx, rep: Replay) -> dict[str, float]:
    """P99 TTFT on the prefill pods and P99 ITL on the decode pods over the run, from the engines' own
    histograms in Prometheus."""
    if ctx.prom is None:
        return {}
    rng = f"{max(1, math.ceil(rep.run_s))}s"
    sel = f'namespace="{ctx.args.namespace}",gearshift_io_service="{ctx.service}"'
    out = {}
    for key, metric, role in (
        ("prefill_ttft_p99_ms", "vllm:time_to_first_token_seconds_bucket", "prefill"),
        ("decode_itl_p99_ms", "vllm:inter_token_latency_seconds_bucket", "decode"),
        ("decode_ttft_p99_ms", "vllm:time_to_first_token_seconds_bucket", "decode"),
        ("both_ttft_p99_ms", "vllm:time_to_first_token_seconds_bucket", "both"),
        ("both_itl_p99_ms", "vllm:inter_token_latency_seconds_bucket", "both"),
    ):
        pick = f'{metric}{{{sel},gearshift_io_role="{role}"}}'
        expr = f"histogram_quantile(0.99, sum by (le) (increase({pick}[{rng}])))"
        try:
            res = ctx.prom.query(expr, at=rep.t0 + rep.run_s)
            if res:
                v = float(res[0]["value"][1]) * 1e3
                if not math.isnan(v):
                    out[key] = v
        except (DemoError, OSError, ValueError, KeyError, IndexError):
            continue
    return out


def _twin(
    ctx: Ctx, rep: Replay, win: tracewin.Window, gearsets: dict[str, dict[str, Any]]
) -> dict[str, Any] | None:
    """The twin's replays of the window (virtual time; CPU only): the shifting loop, each static gear and
    each peer layout, or None with a note. The model is the PDService's, the policy and workload those of
    its aggregated GearSet (or its prefill GearSet, for a PD service), the initial gear the one the live run
    started on."""
    from gearshift.api.modelspec import ModelSpec
    from gearshift.dev import twin

    assert ctx.inputs is not None  # main sets it from _preflight
    pds = next(d for d in ctx.inputs.docs if d.get("kind") == "PDService")
    role = "both" if "both" in gearsets else "prefill"
    gs = gearsets.get(role) or {}
    spec = gs.get("spec") or {}
    planned = (
        spec.get("gears") if spec.get("mode") == "explicit" else (gs.get("status") or {}).get("plannedGears")
    )
    wl = (spec.get("plan") or {}).get("workload") or {}
    workload = (int(wl["promptTokens"]), int(wl["outputTokens"])) if wl else None
    ctx.say(
        f"twin: replaying the same {len(win.requests)} requests with the shifting loop, on each static gear "
        "and on each peer layout (virtual time)"
    )
    t = time.monotonic()
    try:
        out = cost.twin_compare(
            win.requests,
            win.time_scale,
            arch=ModelSpec.model_validate(pds["spec"]["model"]).to_model_arch(),
            fleet=ctx.args.fleet,
            slo_ttft_ms=float(ctx.slo.get("ttftMs") or twin.SLO_TTFT_S * 1000),
            slo_itl_ms=float(ctx.slo.get("itlMs") or twin.SLO_ITL_S * 1000),
            role=role,
            policy=spec.get("policy") or {},
            workload=workload,
            # The shifting loop starts where the live run started (its initialGear, else the capacity
            # controller's pick at the policy's expectedArrivalRps), so both runs face the window alike.
            initial_gear=(spec.get("initialGear") or rep.first_gears.get(role)) if role == "both" else None,
            max_model_len=rep.result.max_model_len,
            # An aggregated service's own gears are what the twin's combined engines run; a PD service's
            # prefill gears hold only prefill's share of the fleet, so the twin plans the whole fleet.
            planned=(planned or None) if role == "both" else None,
        )
    except (ValueError, OSError) as exc:  # a bad --model or --fleet (ModelConfigError is a ValueError)
        ctx.notes.append(f"The twin could not replay the window: {exc}")
        return None
    ctx.say(f"twin: {len(out['rows'])} replays in {time.monotonic() - t:.0f} s")
    return out


def write_report(
    ctx: Ctx,
    rep: Replay,
    win: tracewin.Window,
    fleet_table: str,
    gearsets_start: dict[str, dict[str, Any]],
) -> Path:
    """Write ``report.md``, ``summary.json``, ``load.json`` and the plots to ``--report-dir`` (and the
    summary to ``--results`` too); returns the path of ``report.md``."""
    out_dir = ctx.args.report_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    ns = ctx.args.namespace
    gs_end = {g["metadata"]["name"]: g for g in ctx.kube.json("get", "gearsets", "-n", ns)["items"]}
    gearsets_end = {role: gs_end.get(gs["metadata"]["name"], gs) for role, gs in gearsets_start.items()}
    marks, spans = series.timeline(gearsets_end, rep.first_gears, rep.t0, rep.run_s)
    files, util = _draw(ctx, rep, win, out_dir, gearsets_end, marks, spans)
    totals = series.router_totals(rep.scrapes)
    spend = _spend(ctx, rep)
    twin_rows = _twin(ctx, rep, win, gearsets_end)
    if twin_rows is not None:
        spend["twin"] = twin_rows
    ctx.notes.extend(summary.policy_notes(gearsets_end, win.time_scale))
    data = report.ReportData(
        title="gearshift demo report",
        started=datetime.fromtimestamp(rep.t0, UTC).isoformat(timespec="seconds"),
        command="gearshift demo " + " ".join(shlex.quote(a) for a in sys.argv[2:]),
        cluster=f"sandbox {ctx.layout.name} ({len(ctx.state.get('nodes') or [])} nodes, fleet "
        f"{Path(str(ctx.state.get('fleet', ''))).name}); operator via {ctx.install}",
        namespace=ns,
        service=ctx.service,
        model=str(next(iter(gearsets_start.values()))["spec"].get("serviceName", ctx.service)),
        trace=str(ctx.args.trace),
        window_start_s=win.start_s,
        window_span_s=win.span_s,
        time_scale=win.time_scale,
        requests=len(win.requests),
        run_s=rep.run_s,
        fleet_table=fleet_table,
        gear_tables={role: gearset_table(role, gs, node_models(ctx)) for role, gs in gearsets_start.items()},
        load=rep.result.to_dict(),
        router_totals=totals,
        marks=marks,
        spans=spans,
        utilization=series.mean_values(util),
        engine=_prom_engine(ctx, rep),
        cost=spend,
        plots=files,
        explore=report.explore_commands(ns, ctx.service),
        notes=ctx.notes,
    )
    (out_dir / "load.json").write_text(json.dumps(rep.result.to_dict(), indent=2))
    wall_s = time.monotonic() - ctx.say.start
    shift_list = summary.shifts(
        {role: (gs.get("status") or {}).get("history") or [] for role, gs in gearsets_end.items()}, rep.t0
    )
    met = goals.evaluate(
        rows=(twin_rows or {}).get("rows") or [],
        live_slo_met=rep.result.slo_met,
        live_failed=rep.result.failed,
        shifts=shift_list,
        issue_s=win.run_s,
        wall_s=wall_s,
    )
    (out_dir / "report.md").write_text(report.render(data) + report.goal_lines(met))
    doc = summary.build(
        command=data.command,
        started=data.started,
        wall_s=wall_s,
        time_scale=win.time_scale,
        window_start_s=win.start_s,
        window_span_s=win.span_s,
        load=data.load,
        router_totals=totals,
        engine=data.engine,
        shift_list=shift_list,
        policies={role: gs["spec"].get("policy") or {} for role, gs in gearsets_end.items()},
        first_gears=rep.first_gears,
        final_gears={role: (gs.get("status") or {}).get("activeGear") for role, gs in gearsets_end.items()},
        cost=spend,
        notes=ctx.notes,
        goals=met,
    )
    text = json.dumps(doc, indent=2) + "\n"
    (out_dir / "summary.json").write_text(text)
    if ctx.args.results is not None:
        ctx.args.results.parent.mkdir(parents=True, exist_ok=True)
        ctx.args.results.write_text(text)
        ctx.say(f"results: {ctx.args.results}")
    return out_dir / "report.md"


def _draw(
    ctx: Ctx,
    rep: Replay,
    win: tracewin.Window,
    out_dir: Path,
    gearsets_end: dict[str, dict[str, Any]],
    marks: list[series.ShiftMark],
    spans: list[series.GearSpan],
) -> tuple[dict[str, str], dict[str, list[series.Series]]]:
    """Draw the traffic, utilisation and placement plots into ``out_dir``; returns the report's plot list
    (caption → file name) and the per-stage utilisation series read from Prometheus."""
    perf_records = series.wire_records(rep.result.records, rep.perf0)
    wire = series.bin_wire(perf_records, BIN_S, rep.run_s)
    router = series.router_series(rep.scrapes, LIVE_WINDOW_S)
    centres, offered = tracewin.offered_rate(win.due_s, BIN_S, rep.run_s)
    offered_s = series.Series("offered", centres, offered)
    title = f"{ctx.service} on the sandbox fleet: {len(win.requests)} requests at {win.time_scale:g}×"
    files: dict[str, str] = {}
    plots.plot_traffic(
        plots.TrafficData(
            run_s=rep.run_s,
            offered_qps=offered_s,
            wire=wire,
            router=router,
            spans=spans,
            marks=marks,
            slo_ttft_ms=ctx.slo.get("ttftMs"),
            slo_itl_ms=ctx.slo.get("itlMs"),
            title=title,
        ),
        out_dir / "traffic.png",
    )
    files["QPS and P99 latency over time, gear shifts marked"] = "traffic.png"
    util = _prom_util(ctx, rep)
    plots.plot_utilization(util, marks, rep.run_s, out_dir / "utilization.png", spans=spans)
    files["Per-stage utilisation over time (Prometheus)"] = "utilization.png"
    ran = {(s.role, s.gear) for s in spans}
    cells = [
        plots.StageCell(role, gear, k, layers, node, (role, gear) in ran)
        for role, gs in gearsets_end.items()
        for gear, k, layers, node in stage_nodes(gs)
    ]
    plots.plot_placement(fleet_rows(ctx), cells, out_dir / "placement.png")
    files["The fleet and the placement of every gear's stages"] = "placement.png"
    return files, util


def _spend(ctx: Ctx, rep: Replay) -> dict[str, Any]:
    """The run's GPU time from the cards polled through it (``cost.run_cost``), said on the way; empty,
    with a note, when no poll succeeded."""
    spend: dict[str, Any] = {}
    if rep.cards:
        # Over the whole run, as the load generator's goodput: the cards serve the requests issued last
        # until they finish, and those count as SLO-met.
        run_s = rep.result.duration_s
        spend = {
            "run": {**cost.run_cost(rep.cards, run_s, rep.result.slo_met), "failed": rep.result.failed},
            "span_s": round(run_s, 1),
        }
        ctx.say(
            f"cost: {spend['run']['gpu_hours']:.4f} GPU-hours over {run_s:.0f} s "
            f"(mean {spend['run']['mean_gpus']} cards, peak {spend['run']['peak_gpus']})"
        )
    else:
        ctx.notes.append("No poll of the service's pods succeeded: the run's GPU-hours are not known.")
    return spend
