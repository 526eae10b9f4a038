"""How much load a gear keeps within the TTFT target as prompts grow: the measurement behind
``gearshift.control.shifting.capacity.PREFILL_WAIT_SHARE`` (virtual time, CPU only).

The planner's gears of Llama-3-8B on the mixed fleet (planned for the conversation trace's mean workload,
as ``bench/gears.py`` plans them); the ``latency`` gear (the whole model on each H100) serves uniform
arrivals of one request shape for 300 s in the twin, at fractions of its busy rate for that shape (the
planner's linear work model, ``GearView.busy_rps``). Per shape: ``S / T``, the unloaded prefill of the prompt
(``ttftMsPerPromptToken`` × prompt tokens) over the 200 ms target; per load, the share of requests that met
TTFT ≤ 200 ms and TPOT ≤ 50 ms. ``rho_99`` is the highest load fraction tried at which at least 99 % met
it, and ``rho_99 × S / T`` the figure the controller's headroom rule holds constant.

Run: ``PYTHONPATH=operator .venv/bin/python bench/prefill_headroom.py`` (writes
``bench/results/prefill_headroom.json``; about 3 CPU-minutes).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "operator"))

from gearshift.control.shifting.adapt import gear_view  # noqa: E402
from gearshift.control.shifting.capacity import PREFILL_WAIT_SHARE, headroom  # noqa: E402
from gearshift.control.shifting.policy import ShiftRules  # noqa: E402
from gearshift.dev.twin import MODEL, Trace, plan_gears, run_variant  # noqa: E402
from gearshift.facts.model import load_hf_config  # noqa: E402

OUT = ROOT / "bench" / "results" / "prefill_headroom.json"
#: (prompt, output) tokens: the conversation trace's means, then prompts ever longer with short outputs.
SHAPES = ((1155, 211), (1500, 28), (2048, 28), (3000, 28), (4000, 28))
LOADS = (0.3, 0.45, 0.6, 0.75, 0.9)
SPAN_S = 300.0
SEED = 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    arch = load_hf_config(MODEL)
    rules = ShiftRules()
    gears, _, _ = plan_gears(arch, rules, (1155, 211))
    spec = next(g for g in gears if g.name == "latency")
    view = gear_view(spec.api)
    assert view.ttft_ms_per_prompt_token is not None
    rng = np.random.default_rng(SEED)
    rows: list[dict[str, Any]] = []
    for prompt, output in SHAPES:
        busy = view.busy_rps(prompt, output)
        assert busy is not None
        share = prompt * view.ttft_ms_per_prompt_token / rules.target_p99_ms
        met = []
        for frac in LOADS:
            n = int(frac * busy * SPAN_S)
            t = np.sort(rng.uniform(0.0, SPAN_S, n))
            trace = Trace(t, np.full(n, prompt), np.full(n, output), 1.0)
            r = run_variant("static-latency", arch, trace, rules, gears, "latency", dynamic=False)
            met.append(
                {
                    "load_fraction": frac,
                    "rps": round(frac * busy, 2),
                    "slo_met_share": round(r["slo_met"] / n, 4),
                }
            )
        ok = [m["load_fraction"] for m in met if m["slo_met_share"] >= 0.99]
        rho = max(ok) if ok else None
        rows.append(
            {
                "prompt_tokens": prompt,
                "output_tokens": output,
                "busy_rps": round(busy, 2),
                "prefill_share_of_target": round(share, 4),
                "loads": met,
                "rho_99": rho,
                "rho_99_times_share": None if rho is None else round(rho * share, 4),
                "controller_headroom": round(headroom(view, rules, prompt), 4),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    doc = {
        "benchmark": "prefill_headroom: the load a gear keeps within TTFT 200 ms as prompts grow (twin)",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "gear": {
            "name": spec.name,
            "gpus": spec.gpus,
            "predicted": spec.api.predicted.to_json() if spec.api.predicted else None,
        },
        "method": "uniform arrivals for 300 s at each fraction of the gear's busy rate for the shape; SLO: "
        "TTFT <= 200 ms and TPOT <= 50 ms; rho_99: highest fraction tried with >= 99 % met",
        "prefill_wait_share": PREFILL_WAIT_SHARE,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
