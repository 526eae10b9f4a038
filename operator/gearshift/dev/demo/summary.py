"""The demo's figures as one JSON document (``summary.json``; ``bench/results/demo.json`` with ``--results``).

Pure: everything comes in as measured by the load generator (``load.json``), the router's own counters,
Prometheus and the GearSets' ``status.history``; nothing here recomputes a latency.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from gearshift.dev.demo.series import ShiftMark, _ts


def policy_times(policy: Mapping[str, Any], time_scale: float) -> dict[str, dict[str, float]]:
    """The shifting policy's times in run seconds and in trace seconds at ``time_scale`` (× faster)."""
    keys = ("sampleIntervalS", "dwellS", "warmS", "drainTimeoutS", "rollbackWindowS", "warmupTimeoutS")
    return {
        k: {"run_s": float(policy[k]), "trace_s": round(float(policy[k]) * time_scale, 1)}
        for k in keys
        if isinstance(policy.get(k), int | float)
    }


def policy_notes(gearsets: Mapping[str, Mapping[str, Any]], time_scale: float) -> list[str]:
    """The report's note of each role's shifting policy times (role → GearSet document), in run seconds and
    in trace seconds at ``time_scale`` (:func:`policy_times`); none for a policy without those times."""
    notes = []
    for role, gs in gearsets.items():
        times = policy_times(gs["spec"].get("policy") or {}, time_scale)
        if times:
            parts = ", ".join(
                f"{k.removesuffix('S')} {v['run_s']:g} s ({v['trace_s']:g} s)" for k, v in times.items()
            )
            notes.append(
                f"{role} shifting policy in run seconds (trace seconds at {time_scale:g}×): {parts}. "
                "The demo's example scales FlexPipe's 10-minute dwell down to fit a replay of minutes "
                "(docs/sources.md#shift-dwell)."
            )
    return notes


def shifts(histories: Mapping[str, Iterable[Mapping[str, Any]]], t0: float) -> list[dict[str, Any]]:
    """Every shift that finished during the run (or is still running), per role, from ``status.history``
    (times relative to the replay's start ``t0``, Unix s; a shift begun before it starts below 0), with
    the executor's message."""
    out = []
    for role, history in histories.items():
        for h in history:
            started = _ts(h.get("startedAt"))
            finished = _ts(h.get("finishedAt"))
            if started is None or (finished if finished is not None else started) < t0:
                continue
            out.append(
                {
                    "role": role,
                    "from": h.get("from"),
                    "to": h.get("to"),
                    "trigger": h.get("trigger"),
                    "outcome": h.get("outcome"),
                    "started_s": round(started - t0, 1),
                    "finished_s": None if finished is None else round(finished - t0, 1),
                    "message": h.get("message", ""),
                }
            )
    return sorted(out, key=lambda s: s["started_s"])


def outcome_counts(marks: Sequence[ShiftMark] | Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """How many shifts ended in each outcome (``Succeeded``, ``RolledBack``, ...; ``InProgress`` when
    none is recorded yet)."""
    out: dict[str, int] = {}
    for m in marks:
        o = m.outcome if isinstance(m, ShiftMark) else m.get("outcome")
        key = str(o or "InProgress")
        out[key] = out.get(key, 0) + 1
    return out


def _pct(d: Mapping[str, float] | None, key: str) -> float | None:
    if not d or d.get(key) is None:
        return None
    return round(float(d[key]), 2)


def build(
    *,
    command: str,
    started: str,
    wall_s: float,
    time_scale: float,
    window_start_s: float,
    window_span_s: float,
    load: Mapping[str, Any],
    router_totals: Mapping[str, float],
    engine: Mapping[str, float],
    shift_list: Sequence[Mapping[str, Any]],
    policies: Mapping[str, Mapping[str, Any]],
    first_gears: Mapping[str, str],
    final_gears: Mapping[str, str | None],
    cost: Mapping[str, Any] | None = None,
    notes: Sequence[str] = (),
    goals: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The summary document: what ran, the load generator's figures, the router's totals, the engines'
    P99s from Prometheus, the shifts and their outcomes, the policy times (run and trace seconds), and
    ``cost``: the run's GPU-hours and SLO-met per GPU-hour (``run``, measured from the pods' GPUs) beside
    the twin's replays of the same window (``twin``: shifting loop, static gears, peer layouts), as
    :mod:`gearshift.dev.demo.cost` computes them; ``goals``: :func:`gearshift.dev.demo.goals.evaluate`."""
    issued = int(load.get("issued") or 0)
    return {
        "command": command,
        "started": started,
        "wall_s": round(wall_s, 1),
        "trace_window_s": [round(window_start_s, 1), round(window_start_s + window_span_s, 1)],
        "time_scale": time_scale,
        "replay_s": round(float(load.get("duration_s") or 0.0), 1),
        "requests": {
            "issued": issued,
            "completed": load.get("completed"),
            "failed": load.get("failed"),
            "incomplete": load.get("incomplete"),
            "errors": dict(load.get("errors") or {}),
            "clipped_to_max_model_len": load.get("clipped", 0),
        },
        "offered_rps": _round(load.get("request_rate")),
        "throughput_rps": _round(load.get("throughput_rps")),
        "output_tokens_per_s": _round(load.get("output_tokens_per_s")),
        "slo": {"ttft_ms": load.get("slo_ttft_ms"), "itl_ms": load.get("slo_itl_ms")},
        "slo_met": load.get("slo_met"),
        "goodput_rps": _round(load.get("goodput_rps")),
        "ttft_ms": {"p50": _pct(load.get("ttft_ms"), "p50"), "p99": _pct(load.get("ttft_ms"), "p99")},
        "itl_ms": {"p50": _pct(load.get("itl_ms"), "p50"), "p99": _pct(load.get("itl_ms"), "p99")},
        "router": {k: _round(v) for k, v in router_totals.items()},
        "engine_p99_ms": {k: _round(v) for k, v in engine.items()},
        "gears": {"first": dict(first_gears), "last": dict(final_gears)},
        "shifts": list(shift_list),
        "shift_outcomes": outcome_counts(shift_list),
        "policy_times": {role: policy_times(p, time_scale) for role, p in policies.items()},
        "cost": dict(cost or {}),
        "goals": dict(goals or {}),
        "source": "load generator (load.json), router /metrics, Prometheus, GearSet status.history, the "
        "service's pods (GPU time), the twin (gearshift.dev.twin, virtual time: cost.twin)",
        "notes": list(notes),
    }


def _round(v: Any) -> Any:
    return round(float(v), 3) if isinstance(v, int | float) else v
