"""Predicted vs measured decoder-layer times on a real GPU: the roofline that the planner's cost model and the
simulated engine share (``gearshift.facts.roofline``), against ``e2e/device/layer_times.py``'s measurements
in ``bench/results/device.json`` (``layerTimes``, written by the device check on the lent machine).

For each model and point it prices one layer as the simulated engine prices a stage of one layer
(:func:`gearshift.facts.roofline.stage_time_s`, the card's datasheet peaks from ``gearshift.facts.gpus``,
``MFU``/``MBU`` from ``gearshift.facts.roofline``):

- prefill of ``b`` sequences of ``p`` tokens: ``b·p`` new tokens, ``b·p(p−1)/2`` attended positions
  (causal), no KV read — as :class:`gearshift.planner.costs.RooflineCostModel` prices a prefill;
- a decode step of ``b`` sequences at context ``c``: ``b`` new tokens, ``b·c`` attended and read.

It also fits the efficiencies the measurements imply (achieved FLOP/s over peak on the compute-bound
prefill points, achieved bytes/s over peak on the memory-bound decode points) so a reader sees which
constant a gap comes from. Writes the ``calibration`` section of ``bench/results/device.json`` and
``bench/results/sim_calibration.json``; the measured figures are never edited.

Run: ``.venv/bin/python bench/device_calibration.py`` (no GPU needed: it reads device.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from gearshift.api.probedoc import MEASURED_MATMUL_EFFICIENCY, compute_score_from_tflops
from gearshift.facts import roofline
from gearshift.facts.gpus import GPU_SPECS, compute_score
from gearshift.facts.model import ModelArch, load_hf_config
from gearshift.probe.run import gpu_model_name

REPO = Path(__file__).resolve().parent.parent
DEVICE = REPO / "bench" / "results" / "device.json"
OUT = REPO / "bench" / "results" / "sim_calibration.json"
MODELS = REPO / "examples" / "models"
#: A prediction off by more than this share is called out (the device check's calibration criterion).
TOLERANCE = 0.15


def predict_ms(
    arch: ModelArch, gpu: str, phase: str, batch: int, tokens: int, mfu: float, mbu: float
) -> dict[str, float]:
    """Roofline time of one layer, ms, and which bound holds: ``{ms, computeMs, memoryMs}``.

    ``tokens`` is the prompt length (prefill) or the context (decode)."""
    spec = GPU_SPECS[gpu]
    flops_s = spec.bf16_tflops * 1e12 * mfu
    bytes_s = spec.hbm_gbps * 1e9 * mbu
    if phase == "prefill":
        new, attn, kv = batch * tokens, batch * tokens * (tokens - 1) / 2.0, 0.0
    else:
        new, attn, kv = batch, batch * tokens, batch * tokens
    compute = roofline.layer_flops(arch, new, attn) / flops_s
    memory = roofline.layer_bytes(arch, new, kv) / bytes_s
    ms = 1e3 * roofline.stage_time_s(
        arch, 1, new, attn, kv, 0, last=False, flops_per_s=flops_s, bytes_per_s=bytes_s
    )
    return {"ms": ms, "computeMs": 1e3 * compute, "memoryMs": 1e3 * memory}


def implied(arch: ModelArch, gpu: str, phase: str, batch: int, tokens: int, ms: float) -> dict[str, float]:
    """The utilisation of peak FLOP/s and of peak bytes/s that a measured time ``ms`` implies."""
    spec = GPU_SPECS[gpu]
    if phase == "prefill":
        new, attn, kv = batch * tokens, batch * tokens * (tokens - 1) / 2.0, 0.0
    else:
        new, attn, kv = batch, batch * tokens, batch * tokens
    s = ms / 1e3
    return {
        "mfu": roofline.layer_flops(arch, new, attn) / s / (spec.bf16_tflops * 1e12),
        "mbu": roofline.layer_bytes(arch, new, kv) / s / (spec.hbm_gbps * 1e9),
    }


def compare(layer_times: dict[str, Any], gpu: str, mfu: float, mbu: float) -> dict[str, Any]:
    """Rows of predicted vs measured for every measured point; the worst ratios per phase."""
    rows = []
    for name, phases in layer_times["models"].items():
        arch = load_hf_config(MODELS / f"{name}.json")
        for phase in ("prefill", "decode"):
            for pt in phases.get(phase, []):
                tokens = pt["promptTokens"] if phase == "prefill" else pt["context"]
                pred = predict_ms(arch, gpu, phase, pt["batch"], tokens, mfu, mbu)
                rows.append(
                    {
                        "model": name,
                        "phase": phase,
                        "batch": pt["batch"],
                        "tokens": tokens,
                        "measuredMs": round(pt["ms"], 4),
                        "predictedMs": round(pred["ms"], 4),
                        "bound": "compute" if pred["computeMs"] >= pred["memoryMs"] else "memory",
                        "predictedOverMeasured": round(pred["ms"] / pt["ms"], 3),
                        **{
                            k: round(v, 3)
                            for k, v in implied(arch, gpu, phase, pt["batch"], tokens, pt["ms"]).items()
                        },
                    }
                )
    return {"mfu": mfu, "mbu": mbu, "rows": rows}


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per phase and bound: the median and extreme predicted/measured ratios, and the points off > 15 %."""
    out: dict[str, Any] = {}
    for phase in ("prefill", "decode"):
        sel = [r for r in rows if r["phase"] == phase]
        if not sel:
            continue
        ratios = [r["predictedOverMeasured"] for r in sel]
        out[phase] = {
            "medianRatio": round(statistics.median(ratios), 3),
            "minRatio": min(ratios),
            "maxRatio": max(ratios),
            "offByMoreThan15pct": sum(abs(x - 1) > TOLERANCE for x in ratios),
            "points": len(sel),
            "impliedMfuMedian": round(statistics.median(r["mfu"] for r in sel), 3),
            "impliedMbuMedian": round(statistics.median(r["mbu"] for r in sel), 3),
        }
    return out


def probe_score(doc: dict[str, Any], gpu: str) -> dict[str, Any]:
    """The probed card's GPUProfile compute score against the bare datasheet reference (before) and the
    reference's achievable matmul rate (``api.probedoc.MEASURED_MATMUL_EFFICIENCY``), beside the datasheet
    prior the planner gives an unprobed card of the same model."""
    tflops = float(doc["probe"]["summary"]["matmulTflops"])
    return {
        "measuredMatmulTflops": round(tflops, 1),
        "datasheetTflops": GPU_SPECS[gpu].bf16_tflops,
        "scoreAgainstDatasheet": round(compute_score_from_tflops(tflops, 1), 3),
        "scoreAgainstAchievable": round(compute_score_from_tflops(tflops, 1, measured=True), 3),
        "datasheetPrior": round(compute_score(gpu), 3),
        "measuredMatmulEfficiency": MEASURED_MATMUL_EFFICIENCY,
    }


def end_to_end() -> list[dict[str, Any]]:
    """The simulated engine's end-to-end check against published vLLM runs (bench/results/sim.json,
    ``bench/sim_calibration.py``) at the same MFU/MBU: what the constants are fitted to. A layer's kernels
    alone leave out what an engine step adds (norms, rotary, sampling, scheduling), so the two can differ."""
    path = REPO / "bench" / "results" / "sim.json"
    if not path.exists():
        return []
    rows = json.loads(path.read_text()).get("calibration", {}).get("rows", [])
    keep = ("gpu", "metric", "published", "simulated", "gap_pct")
    return [{k: r.get(k) for k in keep} for r in rows]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=str(DEVICE), help="device.json from the device check")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    path = Path(args.device)
    doc = json.loads(path.read_text())
    lt = doc.get("layerTimes")
    if not lt:
        raise SystemExit(f"{path}: no layerTimes (the device check's 'layers' step did not run)")
    gpu = gpu_model_name(lt["device"])
    result = {
        "benchmark": "device_calibration",
        "device": lt["device"],
        "gpuModel": gpu,
        "kernels": lt.get("kernels"),
        "source": f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path} layerTimes",
        "tolerance": TOLERANCE,
        "current": compare(lt, gpu, roofline.MFU, roofline.MBU),
    }
    result["current"]["summary"] = summary(result["current"]["rows"])
    result["endToEnd"] = end_to_end()
    result["computeScore"] = probe_score(doc, gpu)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    doc["calibration"] = {
        "computeScore": result["computeScore"],
        "by": "bench/device_calibration.py",
        "gpuModel": gpu,
        "mfu": roofline.MFU,
        "mbu": roofline.MBU,
        "summary": result["current"]["summary"],
        "rows": result["current"]["rows"],
    }
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(result["current"]["summary"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
