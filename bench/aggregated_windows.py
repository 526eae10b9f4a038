"""The demo's aggregated Llama-3-70B service on trace windows it was not written against (the demo's goals,
in the twin: virtual time, CPU only).

``make demo`` replays one window of the Azure conversation trace (the whole hour at 7.5x, every 25th
request). A controller or planner checked on one window proves little, so this replays the same service
(examples/demo/pdservice-demo-70b.yaml: its model, SLO, workload and shifting policy, unchanged) on
others: each half of the hour on its own (at half the demo's speed, so each lasts as long), denser and
sparser thinnings, and the demo window with prompts four times as long (long-prompt traffic; the GearSet's
planned workload stays the example's, as a user's would). Per window, as the demo's report: the shifting
loop (``dynamic``, started where the operator starts it: the fewest cards predicted to meet the SLO at
the example's ``expectedArrivalRps``), each planned gear alone, and the layout a peer system deploys
(uniform pipelines of one card type, even splits: the two H100s), with SLO met, failed, goodput,
GPU-hours and SLO-met per GPU-hour; and the goals' ratios: planned (best static) vs peer goodput,
dynamic vs best static goodput and SLO-met per GPU-hour.

Nothing was tuned on these windows.

Run: ``PYTHONPATH=operator .venv/bin/python bench/aggregated_windows.py`` (writes
``bench/results/aggregated_windows.json``; about a CPU-minute).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "operator"))

from gearshift.api.modelspec import ModelSpec  # noqa: E402
from gearshift.dev.demo import cost  # noqa: E402
from gearshift.dev.demo import trace as tracewin  # noqa: E402
from gearshift.dev.loadgen import DEFAULT_TRACE, TraceRequest, load_trace  # noqa: E402
from gearshift.dev.twin.compare import best  # noqa: E402

EXAMPLE = ROOT / "examples" / "demo" / "pdservice-demo-70b.yaml"
FLEET = ROOT / "examples" / "fleets" / "mixed.yaml"
#: The demo's issuing time, s (``gearshift demo --duration``).
DURATION_S = 480.0
#: Prompt growth of the long-prompt window, and the context every request is clipped to (the model's).
LONG_PROMPT_FACTOR = 4
MAX_MODEL_LEN = 8192


@dataclass(frozen=True)
class Window:
    name: str
    start_s: float
    time_scale: float
    keep_every: int
    prompt_factor: int = 1
    why: str = ""


WINDOWS = (
    Window("demo", 0.0, 7.5, 25, why="the demo's own window: the whole hour at 7.5x, every 25th request"),
    Window("first-half", 0.0, 3.75, 25, why="the hour's first half at 3.75x (the same issuing time)"),
    Window("second-half", 1745.0, 3.75, 25, why="the hour's second half at 3.75x: the peak and the fall"),
    Window("denser", 0.0, 7.5, 15, why="every 15th request: above the largest gear's capacity at the peak"),
    Window("sparser", 0.0, 7.5, 40, why="every 40th request: around the two-H100 gear's capacity"),
    Window("sparsest", 0.0, 7.5, 60, why="every 60th request: within the two-H100 gear's capacity"),
    Window("long-prompt", 0.0, 7.5, 25, LONG_PROMPT_FACTOR, why="the demo window, prompts 4x as long"),
)


def _requests(trace: Sequence[TraceRequest], w: Window) -> tracewin.Window:
    win = tracewin.window(trace, w.time_scale, DURATION_S, w.start_s, w.keep_every)
    if w.prompt_factor == 1:
        return win
    longer = tuple(
        TraceRequest(
            r.offset_s,
            min(r.prompt_tokens * w.prompt_factor, MAX_MODEL_LEN - max(r.output_tokens, 1)),
            r.output_tokens,
        )
        for r in win.requests
    )
    return replace(win, requests=longer)


def _summary(out: dict[str, Any]) -> dict[str, Any]:
    rows = out["rows"]
    dyn = next(r for r in rows if r["kind"] == "dynamic")
    static, peer = best(rows, "static"), best(rows, "peer")
    assert static is not None
    statics = [r for r in rows if r["kind"] == "static"]
    static_eff = max(statics, key=lambda r: r["slo_met_per_gpu_hour"] or 0)

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else round(a / b, 3)

    return {
        "best_static": static["variant"],
        "planned_vs_peer_goodput": ratio(
            static["goodput_rps"], None if peer is None else peer["goodput_rps"]
        ),
        "dynamic_vs_best_static_goodput": ratio(dyn["goodput_rps"], static["goodput_rps"]),
        "most_efficient_static": static_eff["variant"],
        "dynamic_vs_most_efficient_static_slo_met_per_gpu_hour": ratio(
            dyn["slo_met_per_gpu_hour"], static_eff["slo_met_per_gpu_hour"]
        ),
        "dynamic_failed_minus_best_static": dyn["failed"] - static["failed"],
        **_oracle_summary(dyn, static_eff, next((r for r in rows if r["kind"] == "oracle"), None)),
    }


def _oracle_summary(
    dyn: dict[str, Any], static_eff: dict[str, Any], oracle: dict[str, Any] | None
) -> dict[str, Any]:
    """The oracle's figures: dynamic's SLO-met over the oracle's (goal >= 0.97), and the oracle's SLO-met per
    GPU-hour over the most efficient static gear's (what any controller could gain on the window)."""
    if oracle is None:
        return {}

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else round(a / b, 3)

    return {
        "oracle_shifts": oracle["shifts"],
        "dynamic_vs_oracle_slo_met": ratio(dyn["slo_met"], oracle["slo_met"]),
        "oracle_vs_most_efficient_static_slo_met_per_gpu_hour": ratio(
            oracle["slo_met_per_gpu_hour"], static_eff["slo_met_per_gpu_hour"]
        ),
        "dynamic_vs_oracle_slo_met_per_gpu_hour": ratio(
            dyn["slo_met_per_gpu_hour"], oracle["slo_met_per_gpu_hour"]
        ),
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "aggregated_windows.json")
    args = ap.parse_args(argv)
    t0 = time.process_time()
    docs = list(yaml.safe_load_all(EXAMPLE.read_text()))
    pds = next(d for d in docs if d["kind"] == "PDService")
    gs = next(d for d in docs if d["kind"] == "GearSet")
    slo = pds["spec"]["slo"]
    wl = gs["spec"]["plan"]["workload"]
    # As the operator: it starts on the fewest cards predicted to meet the SLO at expectedArrivalRps (0
    # when unset; given explicitly, the twin takes it rather than the window's first minute).
    policy = {"expectedArrivalRps": 0.0, **gs["spec"].get("policy", {})}
    trace = load_trace(DEFAULT_TRACE)
    out: dict[str, Any] = {
        "what": __doc__.splitlines()[0],
        "example": str(EXAMPLE.relative_to(ROOT)),
        "fleet": str(FLEET.relative_to(ROOT)),
        "slo_ms": {"ttft": slo["ttftMs"], "tpot": slo["itlMs"]},
        "windows": {},
    }
    for w in WINDOWS:
        win = _requests(trace, w)
        res = cost.twin_compare(
            win.requests,
            win.time_scale,
            arch=ModelSpec.model_validate(pds["spec"]["model"]).to_model_arch(),
            fleet=FLEET,
            slo_ttft_ms=float(slo["ttftMs"]),
            slo_itl_ms=float(slo["itlMs"]),
            role="both",
            policy=policy,
            workload=(int(wl["promptTokens"]), int(wl["outputTokens"])),
            max_model_len=MAX_MODEL_LEN,
        )
        entry = {
            "why": w.why,
            "start_s": w.start_s,
            "time_scale": w.time_scale,
            "keep_every": w.keep_every,
            "prompt_factor": w.prompt_factor,
            "requests": res["requests"],
            "mean_rps": round(res["requests"] / res["span_s"], 3),
            "initial_gear": res["initial_gear"],
            "gears": res["gears"],
            "rows": res["rows"],
            "summary": _summary(res),
        }
        out["windows"][w.name] = entry
        print(w.name, json.dumps(entry["summary"]), flush=True)
        for r in res["rows"]:
            print(
                f"  {r['variant']:<18} met {r['slo_met']:>4}/{res['requests']} failed {r['failed']:>4} "
                f"goodput {r['goodput_rps']:.3f} GPU-h {r['gpu_hours']:.3f} "
                f"met/GPU-h {r['slo_met_per_gpu_hour']} shifts {r['shifts']}",
                flush=True,
            )
    out["cpu_s"] = round(time.process_time() - t0, 1)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
