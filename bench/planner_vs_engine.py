"""Planner-predicted capacity vs the simulated engines' measured capacity, per planned gear.

For each gear the planner produces on the mixed fleet (as ``bench/gears.py`` plans them) and for the even
layer split, this drives every head pod's :class:`gearshift.sim.engine.Engine` in virtual time with a
saturating closed queue of requests shaped like the Azure conversation trace (its first ``--requests``
prompt/output lengths, all queued at t = 0), and measures the completion rate between the 10% and 90%
completions (ramp-up and tail left out). A gear's measured capacity is the sum over its heads; each head
is timed with its own nodes' GPU models (pipeline replica r runs on ``nodes[r]`` of every stage), as
``bench/gears.py`` runs them. The planner prices requests with the trace's mean prompt/output tokens
(``--default-workload``: its defaults).

Output: one row per gear, predicted req/s (``predicted.throughputQps``), measured req/s and their ratio;
``--out`` writes the rows as JSON.

Run: ``PYTHONPATH=operator nice -n 19 .venv/bin/python bench/planner_vs_engine.py --out /tmp/pve.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "operator"))
sys.path.insert(0, str(ROOT / "bench"))

import gears as gb  # noqa: E402
from gearshift.api.shift_policy import ShiftPolicy as ApiShiftPolicy  # noqa: E402
from gearshift.control.shifting.adapt import policy_from_api  # noqa: E402
from gearshift.facts.model import ModelArch, load_hf_config  # noqa: E402
from gearshift.sim.engine import Engine  # noqa: E402
from gearshift.sim.perfmodel import PerfModel, PerfParams, parse_pipeline  # noqa: E402


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def head_capacity(arch: ModelArch, pipeline_doc: dict[str, Any], shapes: Sequence[tuple[int, int]]) -> float:
    """Completions per second of one engine kept saturated by ``shapes`` (prompt, output) requests.

    The rate is taken between the 10% and the 90% completion, req/s.
    """
    clock = _Clock()
    engine = Engine(
        PerfModel(arch, parse_pipeline(pipeline_doc, arch), PerfParams()), role="both", clock=clock
    )
    reqs = [engine.new_request(p, o) for p, o in shapes]
    for _ in range(10_000_000):
        st = engine.begin_step(clock.now)
        if st is None:
            nxt = engine.next_transfer_at()
            if nxt is None:
                break
            clock.now = nxt
            continue
        clock.now = st.end
        engine.end_step(st)
    done = np.sort([r.finished_at for r in reqs if r.finished_at is not None])
    n = len(done)
    lo, hi = int(0.1 * n), int(0.9 * n) - 1
    return (hi - lo) / (done[hi] - done[lo]) if hi > lo and done[hi] > done[lo] else 0.0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=400, help="requests per head (trace shapes)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--default-workload",
        action="store_true",
        help="plan with the planner's default request shape (512/128) instead of the trace's means",
    )
    args = ap.parse_args(argv)
    arch = load_hf_config(gb.MODEL)
    policy = policy_from_api(ApiShiftPolicy(), role="prefill", ttft_slo_ms=200.0, itl_slo_ms=50.0)
    t0 = time.process_time()
    trace = gb.load_trace(gb.TRACE)
    workload = (round(float(trace.prompt.mean())), round(float(trace.output.mean())))
    if args.default_workload:
        workload = (512, 128)
    specs, even, _ = gb.plan_gears(arch, policy, workload)
    shapes = list(
        zip(trace.prompt[: args.requests].tolist(), trace.output[: args.requests].tolist(), strict=True)
    )
    rows = []
    for spec in [*specs, even]:
        docs = spec.head_docs
        per_head = [head_capacity(arch, d, shapes) for d in docs]
        measured = float(sum(per_head))
        pred = spec.api.predicted.throughput_qps if spec.api.predicted else None
        row = {
            "gear": spec.name,
            "stages": [f"{d['gpu']}[{d['layers'][0]},{d['layers'][1]})" for d in docs[0]["stages"]],
            "heads": spec.heads,
            "head_gpus": ["/".join(st["gpu"] for st in d["stages"]) for d in docs],
            "micro_batch": spec.api.micro_batch,
            "max_batch": spec.api.max_batch,
            "predicted_rps": None if pred is None else round(pred, 2),
            "measured_rps": round(measured, 2),
            "measured_per_head_rps": [round(x, 2) for x in per_head],
            "predicted_over_measured": None if pred is None or not measured else round(pred / measured, 2),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    doc = {
        "what": "planner-predicted vs engine-measured capacity per gear (saturated heads, trace shapes)",
        "requests_per_head": args.requests,
        "planner_workload_prompt_output": list(workload),
        "trace_mean_prompt_output": [
            round(float(trace.prompt.mean()), 1),
            round(float(trace.output.mean()), 1),
        ],
        "cpu_s": round(time.process_time() - t0, 1),
        "rows": rows,
    }
    if args.out:
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
