"""The simulator's own overhead: one ``gearshift-sim --pods`` process serving a 24-pod mixed fleet while
``gearshift loadgen`` replays the Azure conversation trace at ≥ 200 requests/s; writes the ``overhead``
part of bench/results/sim.json.

Measured: the sim process's CPU seconds per request (/proc/<pid>/stat utime+stime), the load
generator's own CPU, the event-loop lag of the sim process, how late the engines' step timers fired
relative to the modelled step durations (``/sim/stats``: lag / planned step time), and wire-measured
latency percentiles. The simulator is not the bottleneck when the step lag stays a small fraction of
the modelled step time and the loop lag stays in the low milliseconds.

Traffic goes only to 127.0.20.x (loopback). Run: ``.venv/bin/python bench/sim_overhead.py [--duration 30]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from gearshift.dev.loadgen import DEFAULT_TRACE as TRACE
from gearshift.dev.loadgen import load_trace, run_load

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "sim.json"
PODS = 24
TICKS = os.sysconf("SC_CLK_TCK")

# Fleets serving Llama-3-8B, 6 pods of each kind. "mixed" is examples/fleets/mixed.yaml's cards; at
# 200 req/s of this trace its A10/T4 pods are overloaded by the model itself (prefill alone needs more
# than their time), so "capable" (cards that can carry ~8 req/s each) is the one that isolates the
# simulator's own overhead.
CAPABLE: list[dict[str, Any]] = [
    {"stages": [{"layers": [0, 32], "gpu": "H100-80GB"}], "maxBatch": 256},
    {"stages": [{"layers": [0, 32], "gpu": "H200-141GB"}], "maxBatch": 256},
    {"stages": [{"layers": [0, 32], "gpu": "H800-80GB"}], "maxBatch": 256},
    {
        "stages": [{"layers": [0, 14], "gpu": "H100-80GB"}, {"layers": [14, 32], "gpu": "H200-141GB"}],
        "links": [{"gbps": 200, "latencyUs": 10}],
        "microBatch": 8,
        "maxBatch": 256,
    },
]
MIXED: list[dict[str, Any]] = [
    {"stages": [{"layers": [0, 32], "gpu": "H100-80GB"}], "maxBatch": 256},
    {"stages": [{"layers": [0, 32], "gpu": "A100-40GB"}], "maxBatch": 256},
    {"stages": [{"layers": [0, 32], "gpu": "A10-24GB"}], "maxBatch": 128},
    {
        "stages": [{"layers": [0, 20], "gpu": "A10-24GB"}, {"layers": [20, 32], "gpu": "T4-16GB"}],
        "links": [{"gbps": 25, "latencyUs": 10}],
        "microBatch": 8,
        "maxBatch": 128,
    },
]


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


async def wait_ready(urls: list[str], within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    async with aiohttp.ClientSession() as s:
        for u in urls:
            while True:
                try:
                    async with s.get(u + "/health") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{u} not ready")
                await asyncio.sleep(0.1)


async def get_json(urls: list[str], path: str) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as s:
        out = []
        for u in urls:
            async with s.get(u + path) as r:
                out.append(await r.json() if path.endswith("stats") else {"text": await r.text()})
        return out


def loop_lag(metrics_text: str) -> dict[str, float]:
    out = {}
    for line in metrics_text.splitlines():
        if line.startswith("gearshift:sim_event_loop_lag_seconds{"):
            kind = line.split('kind="')[1].split('"')[0]
            out[kind] = float(line.rsplit(" ", 1)[1])
    return out


async def one_run(
    urls: list[str], pid: int, stream: bool, duration: float, scale: float, drain: float = 30.0
) -> dict[str, Any]:
    trace = load_trace(TRACE)
    before = await get_json(urls, "/sim/stats")
    c0, r0 = cpu_s(pid), resource.getrusage(resource.RUSAGE_SELF)
    res = await run_load(urls, trace, time_scale=scale, max_requests=len(trace), max_duration_s=duration,
                         drain_s=drain, stream=stream, slo_ttft_ms=200, slo_itl_ms=50)  # fmt: skip
    c1, r1 = cpu_s(pid), resource.getrusage(resource.RUSAGE_SELF)
    after = await get_json(urls, "/sim/stats")
    lag_text = (await get_json(urls[:1], "/metrics"))[0]["text"]
    planned = sum(a["planned_step_s"] - b["planned_step_s"] for a, b in zip(after, before, strict=True))
    lag = sum(a["lag_s"] - b["lag_s"] for a, b in zip(after, before, strict=True))
    steps = sum(a["steps"] - b["steps"] for a, b in zip(after, before, strict=True))
    sim_cpu = c1 - c0
    gen_cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return {
        "stream": stream,
        "offered_rps": round(res.request_rate, 1),
        "completed": res.completed,
        "failed": res.failed,
        "incomplete": res.incomplete,
        "duration_s": round(res.duration_s, 1),
        "throughput_rps": round(res.throughput_rps, 1),
        "output_tokens_per_s": round(res.output_tokens_per_s),
        "sim_cpu_s": round(sim_cpu, 2),
        "sim_cpu_s_per_request": round(sim_cpu / max(1, res.completed), 5),
        "sim_cpu_utilisation": round(sim_cpu / res.duration_s, 3),
        "loadgen_cpu_s_per_request": round(gen_cpu / max(1, res.completed), 5),
        "engine_steps": steps,
        "modelled_step_s_total": round(planned, 2),
        "step_timer_lag_s_total": round(lag, 3),
        "step_lag_fraction_of_modelled_time": round(lag / planned, 4) if planned else None,
        "mean_modelled_step_ms": round(1e3 * planned / steps, 3) if steps else None,
        "mean_step_lag_ms": round(1e3 * lag / steps, 3) if steps else None,
        "event_loop_lag_s": loop_lag(lag_text),
        "wire_ms": {"ttft": res.ttft_ms, "itl": res.itl_ms, "tpot": res.tpot_ms, "e2e": res.e2e_ms},
        "goodput_rps_ttft200_tpot50": None if res.goodput_rps is None else round(res.goodput_rps, 1),
        "errors": res.errors,
    }


def main(duration: float, scale: float, fleet: str) -> None:
    kinds = CAPABLE if fleet == "capable" else MIXED
    pods = []
    for i in range(PODS):
        pods.append(
            {
                "listen": f"127.0.20.{i + 1}:8000",
                "env": {
                    "GEARSHIFT_SERVED_MODEL_NAME": "llama-3-8b",
                    "GEARSHIFT_PIPELINE": kinds[i % len(kinds)],
                },
            }
        )
    urls = [f"http://{p['listen']}" for p in pods]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as fh:
        yaml.safe_dump({"pods": pods}, fh)
        pods_file = fh.name
    env = {**os.environ, "GEARSHIFT_MODEL": str(REPO / "examples" / "models" / "llama-3-8b.json")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gearshift.sim.server", "--pods", pods_file],
        env=env,
        stdout=subprocess.DEVNULL,
    )

    async def runs_() -> list[dict[str, Any]]:
        await wait_ready(urls)
        return [await one_run(urls, proc.pid, stream, duration, scale) for stream in (False, True)]

    try:
        runs = asyncio.run(runs_())
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        Path(pods_file).unlink()
    doc = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    doc.setdefault("overhead", {})[fleet] = {
        "setup": (
            f"one gearshift-sim process, {PODS} pods (Llama-3-8B, {fleet} fleet: "
            + ", ".join("+".join(st["gpu"] for st in k["stages"]) for k in kinds)
            + f", 6 each), trace {TRACE.name} at time-scale {scale:g}, issuing for {duration:g} s, "
            f"load generator in a second process; host CPUs: {os.cpu_count()}, shared with other work "
            f"(load average at the end {os.getloadavg()[0]:.1f})"
        ),
        "runs": runs,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(runs, indent=2))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of load per run")
    ap.add_argument("--time-scale", type=float, default=40.0, help="trace speed-up (40 → ~215 req/s)")
    ap.add_argument("--fleet", choices=["capable", "mixed"], default="capable")
    a = ap.parse_args()
    main(a.duration, a.time_scale, a.fleet)
