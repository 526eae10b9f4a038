"""Aggregated (role ``both``) gears: the planner's predictions against the simulated engine, and the planned
gears against the layouts a peer system deploys, at steady loads (virtual time, CPU only).

For each workload shape (the demo's: the Azure conversation trace's mean 1155-token prompt and 211-token
output; and two the planner was not written against: long prompts 4096/128 and long outputs 256/512) the
planner plans Llama-3-70B on the mixed fleet for the demo's SLO (TTFT 2.5 s, TPOT 150 ms), as the operator
plans an aggregated GearSet. Each planned gear and each peer layout (``gearshift.dev.twin.peer_gears``:
uniform pipelines of one card type, even splits) then serves Poisson arrivals of that shape in the twin at
fractions of the gear's planned capacity. Per row: the planner's predicted TPOT and TTFT P99 at that load,
the engine's TPOT P50/P99, TTFT P99, SLO attainment, failures and SLO-met per GPU-hour.

Nothing here is tuned: the one constant the TPOT cap uses (``TPOT_HEADROOM`` = 0.8) was set before any of
these runs.

Run: ``PYTHONPATH=operator .venv/bin/python bench/aggregated_tpot.py`` (writes
``bench/results/aggregated_tpot.json``; about a minute).
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

from gearshift import planner  # noqa: E402
from gearshift.api.shift_policy import ShiftPolicy  # noqa: E402
from gearshift.control.shifting.adapt import policy_from_api  # noqa: E402
from gearshift.dev.twin.constants import Slo  # noqa: E402
from gearshift.dev.twin.gears import GearSpec, fleet_profile, peer_gears, plan_gears  # noqa: E402
from gearshift.dev.twin.trace import Trace  # noqa: E402
from gearshift.dev.twin.variant import run_variant  # noqa: E402
from gearshift.facts.model import load_hf_config  # noqa: E402

FLEET = ROOT / "examples" / "fleets" / "mixed.yaml"
MODEL = ROOT / "examples" / "models" / "llama-3-70b.json"
TTFT_MS, ITL_MS = 2500.0, 150.0
SHAPES = {"demo": (1155, 211), "long-prompt": (4096, 128), "long-output": (256, 512)}
LOAD_SHARES = (0.25, 0.5, 0.75, 0.9, 1.1)
SPAN_S = 600.0


def _replay(arch: Any, rules: Any, spec: GearSpec, shape: tuple[int, int], rps: float) -> dict[str, Any]:
    n = max(50, int(rps * SPAN_S))
    t = np.cumsum(np.random.default_rng(7).exponential(1.0 / rps, n))
    trace = Trace(t, np.full(n, shape[0]), np.full(n, shape[1]))
    slo = Slo(TTFT_MS / 1000.0, ITL_MS / 1000.0)
    return run_variant(spec.name, arch, trace, rules, [spec], spec.name, dynamic=False, slo=slo)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "aggregated_tpot.json")
    args = ap.parse_args(argv)
    t0 = time.process_time()
    arch = load_hf_config(MODEL)
    rules = policy_from_api(ShiftPolicy(), role="both", ttft_slo_ms=TTFT_MS, itl_slo_ms=ITL_MS)
    _, _, profile = fleet_profile(FLEET)  # the profile the twin planned its gears on
    out: dict[str, Any] = {
        "what": __doc__.splitlines()[0],
        "model": arch.name,
        "fleet": str(FLEET.relative_to(ROOT)),
        "slo_ms": {"ttft": TTFT_MS, "tpot": ITL_MS},
        "span_s_per_row": SPAN_S,
        "shapes": {},
    }
    for shape_name, shape in SHAPES.items():
        cost = planner.RooflineCostModel(
            arch, planner.RooflineAssumptions(prompt_tokens=shape[0], output_tokens=shape[1])
        )
        specs, _, _ = plan_gears(arch, rules, shape, fleet=FLEET, even=False, itl_target_ms=ITL_MS)
        widest = max(specs, key=lambda g: (g.api.micro_batch, g.api.max_batch or 0))
        mb, maxb = widest.api.micro_batch, widest.api.max_batch or 64
        peers, peer_info = peer_gears(arch, rules, shape, FLEET, micro_batch=mb, max_batch=maxb)
        # Every layout serves the same absolute loads: shares of the largest planned capacity.
        top = max((s.api.predicted.throughput_qps or 0.0) for s in specs if s.api.predicted) or 1.0
        seen: set[str] = set()
        rows = []
        for spec in [*specs, *peers]:
            layout = json.dumps(
                [spec.api.max_batch, [[s.end - s.start, list(s.nodes)] for s in spec.api.stages]]
            )
            if layout in seen:  # intents that planned the same layout and batch: replay it once
                continue
            seen.add(layout)
            planned = spec.api.predicted.throughput_qps if spec.api.predicted else None
            for share in LOAD_SHARES:
                rps = share * top
                result = _replay(arch, rules, spec, shape, rps)
                row: dict[str, Any] = {
                    "gear": spec.name,
                    "kind": "peer" if spec.name.startswith("peer") else "planned",
                    "gpus": spec.gpus,
                    "layers": [s.end - s.start for s in spec.api.stages],
                    "cards": [spec.api.stages[k].gpu_model for k in range(len(spec.api.stages))],
                    "max_batch": spec.api.max_batch,
                    "planned_capacity_rps": None if planned is None else round(planned, 3),
                    "load_share_of_best_planned": share,
                    "rps": round(rps, 3),
                    "engine": {
                        "tpot_ms": result["tpot_ms"],
                        "ttft_p99_ms": result["ttft_ms"]["p99"],
                        "slo_attainment": result["slo_attainment"],
                        "failed": result["failed"],
                        "slo_met_per_gpu_hour": result["slo_met_per_gpu_hour"],
                    },
                }
                if not spec.name.startswith("peer"):
                    # The planner's prediction at this load for this very layout: a gear of the plan for
                    # this load that has it (another load may pick other layouts; then none is recorded).
                    want = [(tuple(s.layers), tuple(s.nodes)) for s in spec.api.stages]
                    again = planner.plan(profile, cost, itl_target_ms=ITL_MS, qps=rps).gears
                    same = [
                        g
                        for g in again
                        if [(s.layers, s.nodes) for s in g.stages] == want
                        and g.max_batch == spec.api.max_batch
                    ]
                    row["planner"] = (
                        None
                        if not same
                        else {
                            "tpot_ms": None
                            if same[0].predicted.itl_ms is None
                            else round(same[0].predicted.itl_ms, 1),
                            "ttft_p99_ms": round(same[0].predicted.p99_ms, 1),
                        }
                    )
                rows.append(row)
                print(shape_name, json.dumps(row), flush=True)
        out["shapes"][shape_name] = {"prompt_output": list(shape), "peer_layouts": peer_info, "rows": rows}
    out["cpu_s"] = round(time.process_time() - t0, 1)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
