"""One replay in the twin: a static gear, the operator's shifting loop, or a forced schedule, and its
figures (goodput, GPU-hours, SLO-met per GPU-hour and per window, shifts, failures)."""

from __future__ import annotations

import datetime as dt
import heapq
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gearshift.api.gearset_status import GearHealth
from gearshift.control.shifting.adapt import gear_views, shift_request
from gearshift.control.shifting.decide import Decision, DecisionKind, DecisionState, decide
from gearshift.control.shifting.executor import GearObservation, ShiftState, World, step
from gearshift.control.shifting.executor_actions import (
    DeleteGear,
    EnsureGear,
    MarkUnhealthy,
    RecordShift,
    SelectGear,
)
from gearshift.control.shifting.policy import GearTable, ShiftRules
from gearshift.control.shifting.tick import lasting_marks, serving_since
from gearshift.control.shifting.triggers import Trigger
from gearshift.control.signals import sample_window_s
from gearshift.dev.twin.constants import DEFAULT_SLO, REJECTED, TAIL_S, WINDOW_S, Slo
from gearshift.dev.twin.engines import Sim
from gearshift.dev.twin.gears import GearSpec, is_upshift, shift_lead_s
from gearshift.dev.twin.trace import Trace
from gearshift.facts.model import ModelArch


@dataclass
class ControlLog:
    """What the control loop did: decisions by kind, shifts, the time on each gear."""

    decisions: dict[str, int] = field(default_factory=dict)
    shifts: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    gear_seconds: dict[str, float] = field(default_factory=dict)
    unhealthy: dict[str, str] = field(default_factory=dict)


def run_variant(
    name: str,
    arch: ModelArch,
    trace: Trace,
    policy: ShiftRules,
    gears: Sequence[GearSpec],
    start_gear: str,
    *,
    dynamic: bool,
    schedule: Sequence[tuple[float, str]] = (),
    slo: Slo = DEFAULT_SLO,
) -> dict[str, Any]:
    """Replay ``trace`` on ``start_gear`` (static), with the shifting loop over ``gears`` (dynamic), or
    through the shifts of ``schedule`` (the oracle: ``(t, gear)`` = ``gear`` should serve from ``t`` s on;
    each shift is forced early enough for the gear to load and warm, and runs the executor like any other).

    Returns the variant's figures: ``goodput_rps`` (requests meeting ``slo`` per second of the trace's
    span), ``gpu_hours`` (cards held by any live gear, 0 to the last arrival), ``slo_met_per_gpu_hour``,
    ``mean_gpus``, latency percentiles (ms), ``failed`` and ``rejected_too_long``, ``shifts`` and
    ``shifts_per_trace_hour``, ``windows`` (SLO-met per :data:`~gearshift.dev.twin.constants.WINDOW_S`),
    and for a dynamic run the shift history, decisions and capacity estimates. Virtual time: CPU only.
    """
    wall0, cpu0 = time.perf_counter(), time.process_time()
    itl = array("d")
    sim = Sim(arch, trace, policy, itl)
    specs = {g.name: g for g in gears}
    sim.ensure(specs[start_gear], 0.0, ready_now=True)
    sim.select(start_gear)
    for i, t in enumerate(trace.t):
        sim.push(float(t), "arrival", i)
    horizon = trace.duration_s + TAIL_S
    log = ControlLog()
    api_gears = [g.api for g in gears]
    health: dict[str, GearHealth] = {}
    dstate = DecisionState()
    xstate = ShiftState(active=start_gear)
    plan = list(schedule)
    if dynamic or plan:
        sim.push(policy.sample_interval_s, "sample")
    last_sel_t, last_sel = 0.0, start_gear
    for _ in range(200_000_000):  # bounded: far above the events of one trace hour
        if not sim.events:
            break
        t, _, kind, data = heapq.heappop(sim.events)
        if t > horizon:
            break
        sim.clock.now = t
        if kind == "end":
            head, st = data
            sim.on_end(head, st, t)
        elif kind == "arrival":
            sim.on_arrival(data, t)
        elif kind == "retry":
            data.stepping = False
            sim.kick(data, t)
        elif kind == "sample":
            sim.harvest()
            if sim.selected != last_sel:
                log.gear_seconds[last_sel] = log.gear_seconds.get(last_sel, 0.0) + t - last_sel_t
                last_sel_t, last_sel = t, sim.selected or ""
            views = gear_views(api_gears, lasting_marks(health.values(), t, policy))
            table = GearTable(views, active=xstate.active, arch=arch)
            sample_gear = sim.selected if sim.selected in sim.gears else xstate.active
            sample = sim.sample(sample_gear, t, sample_window_s(serving_since(xstate, policy), t))
            if plan:
                decision = _scheduled(plan, t, xstate, specs, policy)
            else:
                dstate, decision = decide(dstate, sample, policy, table, t, busy=xstate.busy)
            log.decisions[decision.kind.value] = log.decisions.get(decision.kind.value, 0) + 1
            if decision.kind is not DecisionKind.HOLD and decision.kind is not DecisionKind.NO_SIGNALS:
                log.events.append(
                    {"t": round(t, 1), "decision": decision.kind.value, "message": decision.message}
                )
            request = shift_request(decision, table)
            obs = {}
            for gname, live in sim.gears.items():
                ready = t >= live.ready_at
                obs[gname] = GearObservation(
                    exists=True,
                    ready=ready,
                    ready_since=live.ready_at if ready else None,
                    in_flight=live.in_flight(),
                    p99_ms=sample.p99_ms(policy.latency_metric) if sample and gname == sample_gear else None,
                    qps=sample.qps if sample and gname == sample_gear else None,
                    kv_pool=live.kv_pool,
                )
            fits = True
            if request is not None and request.target in specs:
                used = frozenset(n for g in sim.gears.values() for n in g.spec.nodes)
                fits = not (specs[request.target].nodes & used)  # one GPU per node in this fleet
            world = World(now=t, gears=obs, selected=sim.selected, full_shadow_fits=fits)
            xstate, actions = step(xstate, world, policy, request=request)
            for a in actions:
                if isinstance(a, EnsureGear):
                    live = sim.ensure(specs[a.gear], t)
                    live.kv_pool = a.kv_pool
                elif isinstance(a, SelectGear):
                    sim.select(a.gear)
                elif isinstance(a, DeleteGear):
                    sim.delete(a.gear, t)
                elif isinstance(a, MarkUnhealthy):
                    health[a.gear] = GearHealth(
                        gear=a.gear,
                        healthy=False,
                        reason=a.reason,
                        since=dt.datetime.fromtimestamp(t, dt.UTC),
                    )
                    log.unhealthy[a.gear] = f"{a.reason}: {a.message}"
                elif isinstance(a, RecordShift):
                    rec = {
                        "from": a.from_gear,
                        "to": a.to_gear,
                        "trigger": a.trigger,
                        "started_s": round(a.started_at, 1),
                        "outcome": a.outcome.value,
                        "finished_s": None if a.finished_at is None else round(a.finished_at, 1),
                        "message": a.message,
                    }
                    log.shifts = [s for s in log.shifts if s["started_s"] != rec["started_s"]] + [rec]
            if t + policy.sample_interval_s <= trace.duration_s + 1.0:
                sim.push(t + policy.sample_interval_s, "sample")
    end_t = sim.clock.now
    log.gear_seconds[last_sel] = log.gear_seconds.get(last_sel, 0.0) + end_t - last_sel_t
    sim.finish_accounting()
    sim.harvest()
    for i in list(sim.where):
        sim.out.fail(i, "unfinished at the end of the run")
    res = _summarise(
        name,
        sim,
        itl,
        trace,
        log,
        dynamic or bool(schedule),
        time.perf_counter() - wall0,
        time.process_time() - cpu0,
        slo,
    )
    if dynamic:
        res["capacity"] = {
            g: {
                "predicted_rps": _r(e.predicted_rps),
                "measured_low_rps": _r(e.measured_low_rps),
                "measured_high_rps": _r(e.measured_high_rps),
                "capacity_rps": _r(e.capacity_rps),
            }
            for g, e in dstate.capacity.items()
        }
    return res


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


def _scheduled(
    plan: list[tuple[float, str]],
    now: float,
    xstate: ShiftState,
    specs: dict[str, GearSpec],
    policy: ShiftRules,
) -> Decision:
    """The oracle's decision now: shift to the next scheduled gear once its lead time has come, as a
    capacity shift (``load-high`` towards more predicted throughput, else ``load-low``), so the executor
    treats it as it treats the controller's own (a load-high shift that serves more is not rolled back
    on its P99)."""
    while plan and plan[0][1] == xstate.active and not xstate.busy:
        plan.pop(0)
    if plan and not xstate.busy:
        at, gear = plan[0]
        if now >= at - shift_lead_s(specs[gear], policy):
            up = is_upshift(specs[xstate.active], specs[gear])
            trigger = (Trigger.LOAD_HIGH if up else Trigger.LOAD_LOW).value
            return Decision(
                DecisionKind.SHIFT,
                "Oracle",
                f"oracle: {gear!r} serves from {at:.0f} s",
                target=gear,
                trigger=trigger,
            )
    return Decision(DecisionKind.HOLD, "Oracle", "")


def _pct(values: np.ndarray, q: float) -> float | None:
    v = values[~np.isnan(values)]
    return None if len(v) == 0 else round(float(np.percentile(v, q)) * 1000.0, 3)


def _summarise(
    name: str,
    sim: Sim,
    itl: array,
    trace: Trace,
    log: ControlLog,
    dynamic: bool,
    wall: float,
    cpu: float,
    slo: Slo,
) -> dict[str, Any]:
    out = sim.out
    ok = (~out.failed) & (out.ttft <= slo.ttft_s) & (out.tpot <= slo.itl_s)
    ttft_ok = (~out.failed) & (out.ttft <= slo.ttft_s)
    itl_ok = (~out.failed) & (out.tpot <= slo.itl_s)
    dur = trace.duration_s
    itl_a = np.frombuffer(itl, dtype=np.float64) if len(itl) else np.array([np.nan])
    started = [s for s in log.shifts]
    # Refused at admission as longer than the engine's KV pool can ever hold: vLLM answers 400 (the
    # client's error, the same on every gear), so they are reported apart from failures.
    rejected = out.reasons.get(REJECTED, 0)
    gpu_hours = sim.gpu_s / 3600.0
    win = (trace.t // WINDOW_S).astype(int)
    n_win = int(win.max()) + 1 if len(win) else 0
    met_w = np.bincount(win[ok], minlength=n_win)
    res: dict[str, Any] = {
        "variant": name,
        "requests": len(trace.t),
        "slo_met": int(ok.sum()),
        "goodput_rps": round(float(ok.sum()) / dur, 4),
        "gpu_hours": round(gpu_hours, 4),
        "slo_met_per_gpu_hour": round(float(ok.sum()) / gpu_hours, 1) if gpu_hours else None,
        "mean_gpus": round(sim.gpu_s / dur, 3) if dur else None,
        "slo_attainment": round(float(ok.mean()), 4),
        "ttft_met_share": round(float(ttft_ok.mean()), 4),
        "tpot_met_share": round(float(itl_ok.mean()), 4),
        "ttft_ms": {"p50": _pct(out.ttft, 50), "p99": _pct(out.ttft, 99)},
        "itl_ms": {"p50": _pct(itl_a, 50), "p99": _pct(itl_a, 99), "tokens": len(itl)},
        "tpot_ms": {"p50": _pct(out.tpot, 50), "p99": _pct(out.tpot, 99)},
        "failed": int(out.failed.sum()) - rejected,
        "failed_by_reason": {k: v for k, v in out.reasons.items() if k != REJECTED},
        "rejected_too_long": rejected,
        "shifts": len(started),
        # Per hour of the original trace the replay covers, not per hour of (compressed) replay.
        "shifts_per_trace_hour": round(len(started) / trace.trace_hours, 3),
        "mirrored_warmup_requests": sim.mirrored,
        "engine_steps": sim.steps,
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
    }
    if dynamic:
        res["shift_history"] = log.shifts
        res["decisions"] = log.decisions
        res["decision_events"] = log.events[:60]
        res["seconds_selected_per_gear"] = {k: round(v, 1) for k, v in log.gear_seconds.items()}
        res["unhealthy"] = log.unhealthy
    res["windows"] = [{"start_s": int(k * WINDOW_S), "slo_met": int(met_w[k])} for k in range(n_win)]
    return res
