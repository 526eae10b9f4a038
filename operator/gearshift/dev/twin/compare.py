"""One trace window replayed every way the demo and ``bench/gears.py`` compare: the shifting loop
(``dynamic``), each of the planner's gears alone (``static``), each peer layout alone (``peer``) and the
per-window oracle over the planner's gears (``oracle``, :mod:`gearshift.dev.twin.oracle`), with the same
figures per row (pure: virtual time, CPU only).

The dynamic variant starts where the operator starts a GearSet with no ``initialGear``: on the gear with
the fewest GPUs predicted to meet the SLO at the expected arrival rate (:func:`dynamic_start`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from gearshift.control.shifting.adapt import gear_views
from gearshift.control.shifting.capacity import initial_gear as capacity_gear
from gearshift.control.shifting.policy import ShiftRules
from gearshift.dev.twin.constants import DEFAULT_SLO, WINDOW_S, Slo
from gearshift.dev.twin.gears import GearSpec
from gearshift.dev.twin.oracle import oracle_schedule
from gearshift.dev.twin.trace import Trace
from gearshift.dev.twin.variant import run_variant
from gearshift.facts.model import ModelArch
from gearshift.planner.inputs import initial_gear

#: Row kinds, in the order :func:`replay_window` returns them.
KINDS = ("dynamic", "static", "peer", "oracle")


def first_minute_rps(trace: Trace) -> float:
    """Arrivals in the trace's first :data:`~gearshift.dev.twin.constants.WINDOW_S` seconds, per second
    (the load a user would expect when the service starts)."""
    return float(np.sum(trace.t < WINDOW_S)) / WINDOW_S


def dynamic_start(
    gears: Sequence[GearSpec],
    policy: ShiftRules,
    trace: Trace,
    *,
    expected_given: bool = False,
    initial: str | None = None,
) -> tuple[ShiftRules, str]:
    """The policy the dynamic variant runs and the gear it starts on: ``initial`` when given (a GearSet's
    ``spec.initialGear``), as the operator does.

    Unless ``expected_given`` (the GearSet set ``expectedArrivalRps``), the policy's expected arrival rate
    becomes the trace's first minute (:func:`first_minute_rps`, requests/s). The start gear is the
    capacity controller's (:func:`gearshift.control.shifting.capacity.initial_gear`: the fewest GPUs predicted
    to meet the SLO at that rate), or the planner's default (:func:`gearshift.planner.inputs.initial_gear`)
    when none is predicted to.
    """
    run_policy = policy if expected_given else replace(policy, expected_arrival_rps=first_minute_rps(trace))
    if initial is not None:
        return run_policy, initial
    apis = [g.api for g in gears]
    start = capacity_gear(gear_views(apis), run_policy) or initial_gear(apis, None)
    return run_policy, start


def row(result: dict[str, Any], kind: str, gpus: int | None = None) -> dict[str, Any]:
    """The figures every comparison shows of one replay (``run_variant``'s result): ``variant``, ``kind``
    (``dynamic``, ``static``, ``peer``), ``gpus`` (cards the gear holds; None for dynamic, whose cards
    change), ``slo_met``, ``slo_attainment``, ``goodput_rps`` (req/s), ``failed``, ``rejected_too_long``,
    ``gpu_hours``, ``mean_gpus``, ``slo_met_per_gpu_hour``, ``shifts``, ``ttft_p99_ms``, ``tpot_p99_ms``,
    ``cpu_s``; a dynamic or oracle row also ``shift_history`` and ``seconds_selected_per_gear``, an oracle
    row its ``schedule`` (``[{"serves_from_s", "gear"}]``)."""
    keys = (
        "variant",
        "slo_met",
        "slo_attainment",
        "goodput_rps",
        "failed",
        "rejected_too_long",
        "gpu_hours",
        "mean_gpus",
        "slo_met_per_gpu_hour",
        "shifts",
        "cpu_s",
    )
    out = {k: result.get(k) for k in keys}
    out["kind"] = kind
    out["gpus"] = gpus
    out["ttft_p99_ms"] = (result.get("ttft_ms") or {}).get("p99")
    out["tpot_p99_ms"] = (result.get("tpot_ms") or {}).get("p99")
    if kind == "oracle":
        out["schedule"] = result.get("schedule") or []
    if kind in ("dynamic", "oracle"):
        out["shift_history"] = result.get("shift_history") or []
        out["seconds_selected_per_gear"] = result.get("seconds_selected_per_gear") or {}
    return out


def oracle_variant(
    arch: ModelArch,
    trace: Trace,
    policy: ShiftRules,
    gears: Sequence[GearSpec],
    statics: dict[str, dict[str, Any]],
    *,
    slo: Slo = DEFAULT_SLO,
) -> dict[str, Any]:
    """Replay the per-window oracle's schedule (:func:`gearshift.dev.twin.oracle.oracle_schedule`) over
    ``gears``, from ``statics`` (gear name → that gear's static ``run_variant`` result, for its SLO-met per
    window). Returns ``run_variant``'s result plus ``schedule`` (``[{"serves_from_s", "gear"}]``).

    Raises:
        ValueError: ``statics`` lacks one of ``gears``.
    """
    missing = [g.name for g in gears if g.name not in statics]
    if missing:
        raise ValueError(f"the oracle needs every gear's static replay: missing {', '.join(missing)}")
    wins = {g.name: [w["slo_met"] for w in statics[g.name]["windows"]] for g in gears}
    first, plan = oracle_schedule(wins, {g.name: g for g in gears}, policy)
    r = run_variant("oracle", arch, trace, policy, gears, first, dynamic=False, schedule=plan, slo=slo)
    r["schedule"] = [{"serves_from_s": 0.0, "gear": first}] + [
        {"serves_from_s": t, "gear": g} for t, g in plan
    ]
    return r


def replay_window(
    arch: ModelArch,
    trace: Trace,
    policy: ShiftRules,
    gears: Sequence[GearSpec],
    peers: Sequence[GearSpec] = (),
    *,
    slo: Slo = DEFAULT_SLO,
    expected_given: bool = False,
    initial: str | None = None,
) -> dict[str, Any]:
    """Replay ``trace`` with the shifting loop over ``gears``, on each of ``gears`` alone, on each of
    ``peers`` alone and, with two gears or more, through the per-window oracle's schedule over ``gears``
    (:func:`oracle_variant`), all under ``policy`` and ``slo``; the shifting loop starts on ``initial``
    when given (:func:`dynamic_start`).

    Returns ``{"initial_gear", "expected_arrival_rps", "rows": [row, ...]}``: rows (:func:`row`) in the
    order dynamic, the gears, the peers, the oracle.
    """
    run_policy, start = dynamic_start(gears, policy, trace, expected_given=expected_given, initial=initial)
    rows = [
        row(run_variant("dynamic", arch, trace, run_policy, gears, start, dynamic=True, slo=slo), "dynamic")
    ]
    statics: dict[str, dict[str, Any]] = {}
    for g in gears:
        r = run_variant(f"static-{g.name}", arch, trace, policy, gears, g.name, dynamic=False, slo=slo)
        statics[g.name] = r
        rows.append(row(r, "static", g.gpus))
    for p in peers:
        r = run_variant(p.name, arch, trace, policy, [p], p.name, dynamic=False, slo=slo)
        rows.append(row(r, "peer", p.gpus))
    if len(gears) > 1:
        rows.append(row(oracle_variant(arch, trace, policy, gears, statics, slo=slo), "oracle"))
    return {
        "initial_gear": start,
        "expected_arrival_rps": round(run_policy.expected_arrival_rps, 3),
        "rows": rows,
    }


def best(rows: Sequence[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    """The row of ``kind`` with the most goodput (fewer GPU-hours on a tie), or None when there is none."""
    of_kind = [r for r in rows if r["kind"] == kind]
    return max(of_kind, key=lambda r: (r["goodput_rps"], -r["gpu_hours"])) if of_kind else None
