"""Virtual-time benchmark of time-limited GPU nodes: goodput while a windowed node serves an
extra pipeline replica, against a run that ignores the node; the move off it before the deadline.

What is real: the window arithmetic (``gearshift.control.windows.WindowTiming``: leaveBy = deadline −
windowMarginS − max(dwellS, warmS + drainTimeoutS + rollbackWindowS)) with the GearSet's default policy,
and the bundled trace (``gearshift.dev.loadgen.DEFAULT_TRACE``, replayed ``SPEED`` x faster so one
pipeline replica is overloaded and two are not). What is modelled (stated, not measured on GPUs): the
decode replicas are bench/autoscale.py's fluid model (continuous batching of at most 64 sequences, step
``18 + 0.35 × batch`` ms, a 20 GB KV pool with the PD guide's 1.2× headroom rule
(docs/sources.md#decode-headroom); SLO: TTFT ≤ 200 ms and mean step ≤ 50 ms); the vacate follows the
executor's path with fixed durations: at leaveBy the shadow of the window-free gear starts, is Ready after
``WARMUP_S`` and warm after ``warmS``, then traffic switches to it and the old gear (both replicas, one on the
windowed node) takes no new requests and finishes what it runs (drain), and is deleted after the rollback
window. The shadow's share of the durable card while it warms, and the time-slicing of that card between the
draining old replica and the new one after the switch, are not modelled (both would lower run B's goodput
around the switch a little).

Runs: A ignores the windowed node (one durable replica throughout); B uses it from the start (two
replicas) and vacates it. Output: bench/results/time_fragments.json (goodput per phase, SLO attainment,
requests still on the windowed node at its deadline, when it was freed). ``python bench/time_fragments.py``.
"""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "operator"))
sys.path.insert(0, str(ROOT / "bench"))

import autoscale as fm  # noqa: E402  (the fluid decode model: Req, Replica, goodput, constants)
from gearshift.api.gearset_plan import PlanConstraints  # noqa: E402
from gearshift.api.shift_policy import ShiftPolicy  # noqa: E402
from gearshift.control.windows import WindowTiming  # noqa: E402
from gearshift.dev.loadgen import load_trace  # noqa: E402

#: Trace replay speed-ups swept: from about one replica's capacity (1.0) to past it (1.3).
SPEEDS = (1.0, 1.1, 1.2, 1.3)
#: The windowed node is reclaimed this long after the start, s.
DEADLINE_S = 1800.0
#: Replay length, s (past the deadline, to see the durable-only tail in both runs).
HORIZON_S = 2400.0
#: Shadow pods Ready after this long (weights load), s (as bench/autoscale.py's WARMUP_S).
WARMUP_S = fm.WARMUP_S


def arrivals(speed: float) -> list[fm.Req]:
    """The trace's first ``HORIZON_S`` of replay time at ``speed``x."""
    out = []
    for t in load_trace(fm.TRACE):
        at = t.offset_s / speed
        if at >= HORIZON_S:
            break
        out.append(fm.Req(at, t.prompt_tokens, max(t.output_tokens, 1)))
    return out


def run(use_window: bool, policy: ShiftPolicy, leave_by_s: float, speed: float) -> dict[str, Any]:
    """One run; with ``use_window`` the windowed extra replica serves until the vacate moves off it."""
    reqs = arrivals(speed)
    pool = fm.KV_POOL_GB * 1e9
    durable = fm.Replica(ready_at=0.0)
    windowed = fm.Replica(ready_at=0.0) if use_window else None
    replicas = [durable] + ([windowed] if windowed else [])
    switch_at = leave_by_s + WARMUP_S + policy.warm_s  # shadow Ready and warm → traffic switches
    delete_at: float | None = None
    freed_at: float | None = None
    on_windowed_at_deadline = 0
    queue: list[fm.Req] = []
    finished: list[fm.Req] = []
    i, t = 0, 0.0
    while t < HORIZON_S + 300 and (i < len(reqs) or queue or any(r.running for r in replicas)):
        if use_window and t >= switch_at and delete_at is None:
            # Switch: the new gear (one replica, durable card) takes traffic; the old gear drains.
            for r in replicas:
                r.draining = True
            replicas.append(fm.Replica(ready_at=t))
            delete_at = switch_at + policy.rollback_window_s  # the executor deletes the old gear then
        if delete_at is not None and t >= delete_at and windowed in replicas:
            # Drain done (or drainTimeoutS passed): the old gear's pods go, the windowed node is free.
            left = [r for r in replicas if r.draining]
            if all(not r.running for r in left) or t >= switch_at + policy.drain_timeout_s:
                replicas = [r for r in replicas if not r.draining]
                freed_at = t
        if use_window and windowed is not None and t >= DEADLINE_S and on_windowed_at_deadline == 0:
            on_windowed_at_deadline = len(windowed.running) if windowed in replicas else 0
        while i < len(reqs) and reqs[i].arrive <= t:
            queue.append(reqs[i])
            i += 1
        ready = [r for r in replicas if r.ready_at <= t and not r.draining]
        while queue:
            q = queue[0]
            fits = [
                r for r in ready if len(r.running) < fm.MAX_BATCH and pool - r.kv_used() >= 1.2 * q.kv_final
            ]
            if not fits:
                break
            best = max(fits, key=lambda r: pool - r.kv_used())
            q.admitted = t
            best.running.append(queue.pop(0))
        for r in replicas:
            if not r.running:
                continue
            step_ms = fm.STEP_BASE_MS + fm.STEP_PER_SEQ_MS * len(r.running)
            for q in r.running:
                q.done_tokens += fm.DT * 1000.0 / step_ms
                q.step_ms_sum += step_ms
                q.steps += 1
            for q in [q for q in r.running if q.done_tokens >= q.out]:
                r.running.remove(q)
                finished.append(q)
        t = round(t + fm.DT, 6)
    phases = {
        "windowed_in_use": (0.0, leave_by_s),
        "vacating": (leave_by_s, switch_at + policy.rollback_window_s),
        "after": (switch_at + policy.rollback_window_s, HORIZON_S),
        "whole": (0.0, HORIZON_S),
    }
    return {
        "requests": len(reqs),
        "finished": len(finished),
        "failed_or_unfinished": len(reqs) - len(finished),
        "offered_rps": {
            k: round(sum(a <= q.arrive < b for q in reqs) / (b - a), 3) for k, (a, b) in phases.items()
        },
        "goodput_rps": {k: fm.goodput(finished, *v)[0] for k, v in phases.items()},
        "slo_attainment": {k: fm.goodput(finished, *v)[1] for k, v in phases.items()},
        "phases_s": {k: [round(a, 1), round(b, 1)] for k, (a, b) in phases.items()},
        "windowed_node_freed_at_s": None if freed_at is None else round(freed_at, 1),
        "requests_on_windowed_node_at_deadline": on_windowed_at_deadline,
    }


def main() -> int:
    policy = ShiftPolicy()
    margin = PlanConstraints().window_margin_s
    timing = WindowTiming(
        margin, policy.dwell_s, policy.warm_s + policy.drain_timeout_s + policy.rollback_window_s
    )
    t0 = datetime(2025, 1, 1, tzinfo=UTC)
    leave_by_s = (timing.leave_by(t0 + timedelta(seconds=DEADLINE_S)) - t0).total_seconds()
    sweep = []
    for speed in SPEEDS:
        a, b = run(False, policy, leave_by_s, speed), run(True, policy, leave_by_s, speed)
        gain = {
            k: round(b["goodput_rps"][k] / a["goodput_rps"][k], 3) if a["goodput_rps"][k] else None
            for k in a["goodput_rps"]
        }
        sweep.append(
            {
                "speed": speed,
                "ignore_windowed_node": a,
                "use_windowed_node": b,
                "goodput_ratio_use_vs_ignore": gain,
            }
        )
    result = {
        "kind": "virtual-time (bench/autoscale.py's fluid decode model; window timing from "
        "gearshift.control.windows with the default GearSet policy)",
        "note": __doc__.split("\n\n")[1].replace("\n", " "),
        "trace": fm.TRACE.name,
        "deadline_s": DEADLINE_S,
        "leave_by_s": leave_by_s,
        "timing": {
            "windowMarginS": margin,
            "dwellS": policy.dwell_s,
            "warmS": policy.warm_s,
            "drainTimeoutS": policy.drain_timeout_s,
            "rollbackWindowS": policy.rollback_window_s,
            "shadow_ready_after_s": WARMUP_S,
        },
        "runs": sweep,
    }
    out = ROOT / "bench" / "results" / "time_fragments.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    ok = True
    for r in sweep:
        a, b = r["ignore_windowed_node"], r["use_windowed_node"]
        print(
            f"speed {r['speed']}: goodput while windowed in use {a['goodput_rps']['windowed_in_use']} -> "
            f"{b['goodput_rps']['windowed_in_use']} rps (offered {a['offered_rps']['windowed_in_use']}), "
            f"whole {a['goodput_rps']['whole']} -> {b['goodput_rps']['whole']}; node freed at "
            f"{b['windowed_node_freed_at_s']} s (deadline {DEADLINE_S:g}), "
            f"unfinished {b['failed_or_unfinished']}"
        )
        ok = ok and b["requests_on_windowed_node_at_deadline"] == 0 and b["failed_or_unfinished"] == 0
        ok = ok and (b["windowed_node_freed_at_s"] or 1e9) < DEADLINE_S
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
