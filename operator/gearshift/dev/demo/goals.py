"""The demo's goals for one demo run, each with its value, the goal, whether it is met and why (pure).

Inputs are what the run measured (the load generator's SLO-met and failed counts, the shifts from the
GearSets' history, the command's wall time) and the twin's rows of the same window
(:func:`gearshift.dev.demo.cost.twin_compare`). Nothing is tuned here: a goal not met says so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

#: planned gears (the twin's shifting loop) ÷ the best peer layout: goodput, or GPU-hours the other way.
PEER_RATIO = 1.5
#: twin dynamic ÷ the best static gear: goodput at least this ...
STATIC_GOODPUT = 0.98
#: ... and SLO-met per GPU-hour at least this.
STATIC_EFFICIENCY = 1.3
#: twin dynamic ÷ the per-window oracle (:mod:`gearshift.dev.twin.oracle`): SLO-met requests.
ORACLE_SLO_MET = 0.97
#: the live run's SLO-met ÷ the twin dynamic's, on the same requests.
LIVE_VS_TWIN = 0.9
#: ``make demo`` on a warm machine, s (12 minutes).
WALL_S = 720.0


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else round(a / b, 4)


def _goal(value: Any, goal: str, met: bool, why: str, **extra: Any) -> dict[str, Any]:
    return {"value": value, "goal": goal, "met": met, "why": why, **extra}


def _best(rows: Sequence[Mapping[str, Any]], kind: str) -> Mapping[str, Any] | None:
    of_kind = [r for r in rows if r.get("kind") == kind]
    return max(of_kind, key=lambda r: (r["goodput_rps"], -r["gpu_hours"])) if of_kind else None


def evaluate(
    *,
    rows: Sequence[Mapping[str, Any]],
    live_slo_met: int | None,
    live_failed: int | None,
    shifts: Sequence[Mapping[str, Any]],
    issue_s: float,
    wall_s: float,
) -> dict[str, dict[str, Any]]:
    """The goals: ``planned_vs_best_peer``, ``dynamic_vs_best_static_goodput``,
    ``dynamic_vs_best_static_slo_met_per_gpu_hour``, ``dynamic_vs_oracle_slo_met``, ``live_failed``,
    ``live_vs_twin_dynamic``, ``shifts_finish_before_replay_ends``, ``wall_time``.

    The per-window oracle's SLO-met per GPU-hour over the best static gear's (``oracle_ratio`` of the
    efficiency goal) is what any controller with the same gears and shift mechanics could reach on the
    window as far as hindsight finds (a reference, not a strict bound: :mod:`gearshift.dev.twin.oracle`);
    the goal says when it is below the target.

    Args:
        rows: the twin's rows (kinds ``dynamic``, ``static``, ``peer``, ``oracle``).
        live_slo_met: requests of the live run that met the SLO (the load generator's count).
        live_failed: requests of the live run that failed.
        shifts: the live run's shifts (``started_s``, ``finished_s`` None while running, ``outcome``),
            seconds from the replay's start.
        issue_s: seconds the replay issued requests for (the end of the window on the run's clock).
        wall_s: the whole command's wall time, s.
    """
    out: dict[str, dict[str, Any]] = {}
    dyn = next((r for r in rows if r.get("kind") == "dynamic"), None)
    static = _best(rows, "static")
    peer = _best(rows, "peer")
    oracle = next((r for r in rows if r.get("kind") == "oracle"), None)
    if dyn is not None:
        if peer is None:
            out["planned_vs_best_peer"] = _goal(
                None,
                f">= {PEER_RATIO}x goodput, or the same goodput on >= {PEER_RATIO}x fewer GPU-hours",
                dyn["goodput_rps"] > 0,
                "no uniform even-split layout of one card type holds the model on this fleet: a peer "
                "serves nothing",
            )
        else:
            g = _ratio(dyn["goodput_rps"], peer["goodput_rps"])
            h = _ratio(peer["gpu_hours"], dyn["gpu_hours"])
            by_goodput = (g is None and dyn["goodput_rps"] > 0) or (g is not None and g >= PEER_RATIO)
            by_hours = dyn["goodput_rps"] >= peer["goodput_rps"] and h is not None and h >= PEER_RATIO
            out["planned_vs_best_peer"] = _goal(
                g,
                f">= {PEER_RATIO}x goodput, or the same goodput on >= {PEER_RATIO}x fewer GPU-hours",
                bool(by_goodput or by_hours),
                f"twin dynamic {dyn['goodput_rps']} req/s on {dyn['gpu_hours']} GPU-hours vs the best peer "
                f"layout {peer['variant']} ({peer['gpus']} cards) {peer['goodput_rps']} req/s on "
                f"{peer['gpu_hours']} GPU-hours",
                peer=peer["variant"],
                gpu_hour_ratio=h,
            )
    if dyn is not None and static is not None:
        g = _ratio(dyn["goodput_rps"], static["goodput_rps"])
        e = _ratio(dyn["slo_met_per_gpu_hour"], static["slo_met_per_gpu_hour"])
        shifted = len(dyn.get("shift_history") or [])
        why = (
            f"best static gear {static['variant']} ({static['gpus']} cards); the shifting loop shifted "
            f"{shifted} times"
        )
        out["dynamic_vs_best_static_goodput"] = _goal(
            g,
            f">= {STATIC_GOODPUT}",
            g is not None and g >= STATIC_GOODPUT,
            why,
            best_static=static["variant"],
        )
        o = None if oracle is None else _ratio(oracle["slo_met_per_gpu_hour"], static["slo_met_per_gpu_hour"])
        bound = (
            ""
            if o is None
            else f"; the per-window oracle reaches {o}x"
            + (
                f", so hindsight does not reach {STATIC_EFFICIENCY}x on this window either"
                if o < STATIC_EFFICIENCY
                else ""
            )
        )
        out["dynamic_vs_best_static_slo_met_per_gpu_hour"] = _goal(
            e,
            f">= {STATIC_EFFICIENCY}",
            e is not None and e >= STATIC_EFFICIENCY,
            why
            + (
                ": it holds the same cards as the best static gear the whole window, so it cannot spend fewer"
                if shifted == 0
                else ""
            )
            + bound,
            best_static=static["variant"],
            oracle_ratio=o,
        )
    if dyn is not None and oracle is not None:
        r = _ratio(float(dyn["slo_met"]), float(oracle["slo_met"]))
        out["dynamic_vs_oracle_slo_met"] = _goal(
            r,
            f">= {ORACLE_SLO_MET}x the per-window oracle's SLO-met requests",
            r is not None and r >= ORACLE_SLO_MET,
            f"twin dynamic {dyn['slo_met']} SLO-met on {dyn['gpu_hours']} GPU-hours vs the oracle's "
            f"{oracle['slo_met']} on {oracle['gpu_hours']} ({len(oracle.get('schedule') or [1]) - 1} shifts)",
        )
    if live_failed is not None:
        out["live_failed"] = _goal(live_failed, "0", live_failed == 0, "the load generator's failed requests")
    if dyn is not None and live_slo_met is not None:
        r = _ratio(float(live_slo_met), float(dyn["slo_met"]))
        out["live_vs_twin_dynamic"] = _goal(
            r,
            f">= {LIVE_VS_TWIN}x the twin dynamic's SLO-met requests (goodput on the same requests)",
            r is not None and r >= LIVE_VS_TWIN,
            f"live {live_slo_met} SLO-met vs the twin's {dyn['slo_met']}; the live engines share 2 cores "
            "with the control plane, router and load generator, the twin's run in virtual time",
        )
    late = [s for s in shifts if s.get("finished_s") is None or float(s["finished_s"]) > issue_s]
    out["shifts_finish_before_replay_ends"] = _goal(
        len(shifts) - len(late),
        f"every shift started finishes before the replay stops issuing ({issue_s:.0f} s)",
        not late,
        f"{len(shifts)} shifts, {len(late)} unfinished or finished after {issue_s:.0f} s"
        if shifts
        else "no shift started",
        late=[{k: s.get(k) for k in ("from", "to", "started_s", "finished_s", "outcome")} for s in late],
    )
    out["wall_time"] = _goal(
        round(wall_s, 1),
        f"<= {WALL_S:.0f} s on a warm machine",
        wall_s <= WALL_S,
        "the whole command, from start to the report written",
    )
    return out
