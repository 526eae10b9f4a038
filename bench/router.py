"""Router benchmarks → ``bench/results/router.json``. Loopback only; every process is ours.

The router's own cost (added latency and CPU per request at 500 requests/s) is bench/router_cost.py's, in
``bench/results/router_peers.json``; this file holds the helpers it and bench/router_peers.py share.

``policies`` (the default part): a heterogeneous pool of gearshift-sim pods (Llama-3-8B; prefill: one H100
and two A10, decode: one H100 and two A10, one sim process), the shared Azure 2023 conversation trace
time-scaled to 50/80/95 % of the prefill pool's capacity (Σ 1 / prefill time of the mean prompt, from the
sim's perf model), streamed; P50/P99 TTFT, ITL, E2E and SLO goodput (TTFT ≤ 200 ms, TPOT ≤ 50 ms: seed
000's targets) per policy, plus FastChat's shortest-queue with speed 1 as the baseline.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchlib import free_port
from gearshift.dev.loadgen import DEFAULT_TRACE as TRACE

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
RESULTS = REPO / "bench" / "results" / "router.json"
MODEL = REPO / "examples" / "models" / "llama-3-8b.json"
BIN = Path(PY).parent


class Procs:
    """Processes this benchmark started; stopped by pid, never by name."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, args: list[str], log: Path) -> subprocess.Popen[bytes]:
        fh = log.open("wb")
        p = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO)
        self.procs.append(p)
        return p

    def stop(self, p: subprocess.Popen[bytes]) -> None:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def stop_all(self) -> None:
        for p in reversed(self.procs):
            self.stop(p)


def wait_http(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up within {timeout_s} s")


def loadgen(url: str, trace: Path, *, time_scale: float, max_requests: int, seconds: float, stream: bool,
            drain: float = 30.0, slo: bool = False, chat: bool = False) -> dict[str, Any]:  # fmt: skip
    args = [
        str(BIN / "gearshift"), "loadgen", "--url", url, "--trace", str(trace),
        "--time-scale", str(time_scale), "--max-requests", str(max_requests), "--max-duration", str(seconds),
        "--drain", str(drain), "-o", "json", "--model", "m",
        "--exit-zero",  # failed requests are figures of the run, in its JSON, not a failed command
    ]  # fmt: skip
    if stream:
        args.append("--stream")
    if slo:
        args += ["--slo-ttft-ms", "200", "--slo-itl-ms", "50"]
    if chat:
        args.append("--chat")
    out = subprocess.run(args, capture_output=True, check=True, cwd=REPO, timeout=seconds + drain + 60)
    return json.loads(out.stdout)


def write_trace(path: Path, rows: list[tuple[float, int, int]]) -> None:
    """A loadgen CSV from (offset s, prompt tokens, output tokens)."""
    base = 1_700_000_000.0
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["TIMESTAMP", "ContextTokens", "GeneratedTokens"])
        for off, p, g in rows:
            ts = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(base + off)) + f".{int((off % 1) * 1e6):06d}"
            w.writerow([ts, p, g])


def merge_results(key: str, value: Any) -> None:
    doc: dict[str, Any] = {}
    if RESULTS.exists():
        doc = json.loads(RESULTS.read_text())
    doc[key] = value
    machine = doc.get("machine") if isinstance(doc.get("machine"), dict) else {}
    machine.update(
        cpus=os.cpu_count(), note="2 shared CPU cores; other helpers' builds/tests ran concurrently"
    )
    doc["machine"] = machine
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(doc, indent=2) + "\n")


def brief(r: dict[str, Any]) -> dict[str, Any]:
    keys = ("issued", "completed", "failed", "incomplete", "request_rate", "throughput_rps", "goodput_rps",
            "slo_met", "ttft_ms", "itl_ms", "tpot_ms", "e2e_ms", "errors")  # fmt: skip
    return {k: r.get(k) for k in keys}


# --- (b) policies on a heterogeneous sim pool ----------------------------------------------------------

PREFILL_GPUS = ["H100-80GB", "A10-24GB", "A10-24GB"]
DECODE_GPUS = ["H100-80GB", "A10-24GB", "A10-24GB"]
POLICY_RUNS: list[tuple[str, list[str]]] = [
    ("pd-score", ["--policy", "pd-score"]),
    ("shortest-queue-speed1", ["--policy", "shortest-queue", "--speed-one"]),
    ("shortest-queue", ["--policy", "shortest-queue"]),
    ("lottery", ["--policy", "lottery", "--seed", "1"]),
    ("round-robin", ["--policy", "round-robin"]),
    ("power-of-two", ["--policy", "power-of-two", "--seed", "1"]),
    ("least-request", ["--policy", "least-request"]),
]


def pool_capacity(mean_prompt: int) -> tuple[float, dict[str, float], dict[str, int]]:
    """Prefill capacity (req/s) of the pool from the sim's perf model; per-GPU prefill ms; decode KV bytes."""
    from gearshift.facts.model import load_hf_config
    from gearshift.sim.perfmodel import PerfModel, single_stage_pipeline

    arch = load_hf_config(MODEL)
    ms, kv = {}, {}
    for gpu in set(PREFILL_GPUS + DECODE_GPUS):
        pm = PerfModel(arch, single_stage_pipeline(arch, gpu))
        ms[gpu] = pm.prefill_time_s(mean_prompt) * 1000
        kv[gpu] = pm.kv_capacity_blocks() * pm.params.block_size * arch.kv_bytes_per_token
    cap = sum(1000 / ms[g] for g in PREFILL_GPUS)
    return cap, ms, kv


def trace_rows(limit: int = 20000) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) of the trace's first ``limit`` + 2 requests."""
    rows_all = []
    with TRACE.open() as fh:
        rd = csv.DictReader(fh)
        for i, row in enumerate(rd):
            rows_all.append((int(row["ContextTokens"]), int(row["GeneratedTokens"])))
            if i > limit:
                break
    return rows_all


def scaled_trace(rows_all: list[tuple[int, int]], rate: float, seconds: float, max_out: int,
                 path: Path) -> tuple[int, float]:  # fmt: skip
    """Write the trace's first ``rate × seconds`` requests to ``path`` with its own arrival pattern (bursts
    kept) and output tokens clipped to ``max_out``; returns (requests, loadgen --time-scale for ``rate``)."""
    from gearshift.dev.loadgen import _parse_ts

    n = int(rate * seconds)
    rows = rows_all[:n]
    with TRACE.open() as fh2:
        stamps = [r["TIMESTAMP"] for _, r in zip(range(n), csv.DictReader(fh2), strict=False)]
    t = [_parse_ts(s, i).timestamp() for i, s in enumerate(stamps)]
    native = (len(t) - 1) / max(t[-1] - t[0], 1e-9)
    write_trace(path, [(t[i] - t[0], p, min(g, max_out)) for i, (p, g) in enumerate(rows)])
    return n, rate / native


def sim_pool(roles: list[tuple[str, list[str]]], kv_bytes: dict[str, int], procs: Procs, tmp: Path,
             log: str = "sim.log") -> list[dict[str, Any]]:  # fmt: skip
    """One gearshift-sim process serving a pod per (role, GPU) (Llama-3-8B, maxBatch 64, 100 Gb/s KV link),
    started under ``procs`` and waited for; each pod's role, gpu, name, url and router ``--backend`` spec."""
    pods, out = [], []
    for role, gpus in roles:
        for i, gpu in enumerate(gpus):
            port = free_port()
            pipe = {"stages": [{"layers": [0, 32], "gpu": gpu, "gpus": 1}], "maxBatch": 64}
            link = {"gbps": 100, "latencyUs": 10}
            env_pod = {"GEARSHIFT_ROLE": role, "GEARSHIFT_PIPELINE": pipe, "GEARSHIFT_KV_LINK": link}
            pods.append({"listen": f"127.0.0.1:{port}", "env": env_pod})
            name = f"{role}-{gpu.split('-')[0].lower()}-{i}"
            url = f"http://127.0.0.1:{port}"
            spec = f"{role}={url};gpu={gpu};name={name};maxbatch=64;nic=100"
            if role in ("decode", "both"):
                spec += f";kvbytes={kv_bytes[gpu]}"
            out.append({"role": role, "gpu": gpu, "name": name, "url": url, "port": port, "backend": spec})
    pods_file = tmp / f"{Path(log).stem}-pods.json"
    pods_file.write_text(json.dumps(pods))
    env = os.environ | {"GEARSHIFT_MODEL": str(MODEL), "GEARSHIFT_SERVED_MODEL_NAME": "m"}
    fh = (tmp / log).open("wb")
    sim = subprocess.Popen([str(BIN / "gearshift-sim"), "--pods", str(pods_file)], stdout=fh,
                           stderr=subprocess.STDOUT, cwd=REPO, env=env)  # fmt: skip
    procs.procs.append(sim)
    for p in pods:
        wait_http(f"http://{p['listen']}/health", 60)
    return out


def policies(seconds: float, loads: list[float], names: list[str], max_out: int, tmp: Path) -> dict[str, Any]:
    rows_all = trace_rows()
    mean_prompt = round(sum(p for p, _ in rows_all) / len(rows_all))
    cap, prefill_ms, kv_bytes = pool_capacity(mean_prompt)
    out: dict[str, Any] = {
        "pool": {"prefill": PREFILL_GPUS, "decode": DECODE_GPUS, "model": "llama-3-8b"},
        "mean_prompt_tokens": mean_prompt,
        "prefill_ms_mean_prompt": prefill_ms,
        "capacity_rps": cap,
        "seconds_per_point": seconds,
        "max_output_tokens": max_out,
        "slo": {"ttft_ms": 200, "tpot_ms": 50},
        "points": {},
    }
    procs = Procs()
    try:
        pool = sim_pool([("prefill", PREFILL_GPUS), ("decode", DECODE_GPUS)], kv_bytes, procs, tmp)
        backends = [p["backend"] for p in pool]
        for load in loads:
            rate = load * cap
            trace = tmp / f"trace-{load}.csv"
            n, scale = scaled_trace(rows_all, rate, seconds, max_out, trace)
            for name, flags in POLICY_RUNS:
                if names and name not in names:
                    continue
                port = free_port()
                args = [str(BIN / "gearshift-router"), "--port", str(port), "--model", str(MODEL),
                        "--log-level", "WARNING", "--scrape-interval", "0.25", *flags]  # fmt: skip
                for b in backends:
                    args += ["--backend", b]
                r = procs.start(args, tmp / f"router-{name}-{load}.log")
                wait_http(f"http://127.0.0.1:{port}/health")
                res = loadgen(f"http://127.0.0.1:{port}", trace, time_scale=scale, max_requests=n,
                              seconds=seconds, stream=True, drain=30, slo=True)  # fmt: skip
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as m:
                        picks = [ln for ln in m.read().decode().splitlines()
                                 if ln.startswith("gearshift_router_picks_total")]  # fmt: skip
                except OSError:
                    picks = []
                procs.stop(r)
                point = brief(res) | {"target_rps": rate, "picks": picks, "loadavg_1m": os.getloadavg()[0]}
                out["points"].setdefault(f"{int(load * 100)}%", {})[name] = point
                ttft = point["ttft_ms"] or {}
                print(f"load {load:.2f} {name:24s} ttft p50 {ttft.get('p50', float('nan')):8.1f} "
                      f"p99 {ttft.get('p99', float('nan')):8.1f} ok {point['completed']}/{point['issued']} "
                      f"goodput {point['goodput_rps']}", flush=True)  # fmt: skip
                time.sleep(2)  # let the sim drain between runs
        # the goal: pd-score P99 TTFT ≥ 30 % below shortest-queue (speed 1) at 80 %, no worse at 50 %
        goal = {}
        for label in ("50%", "80%"):
            pts = out["points"].get(label, {})
            if "pd-score" in pts and "shortest-queue-speed1" in pts:
                a = (pts["pd-score"]["ttft_ms"] or {}).get("p99")
                b = (pts["shortest-queue-speed1"]["ttft_ms"] or {}).get("p99")
                if a is not None and b is not None:
                    goal[label] = {
                        "pd_score_p99_ttft_ms": a,
                        "sq_speed1_p99_ttft_ms": b,
                        "reduction": 1 - a / b,
                    }
        out["goal"] = goal
    finally:
        procs.stop_all()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("part", nargs="?", default="policies", choices=["policies"])
    p.add_argument("--seconds", type=float, default=10.0, help="seconds per point")
    p.add_argument("--loads", default="0.5,0.8,0.95", help="policies: fractions of capacity")
    p.add_argument("--policies", default="", help="policies: comma-separated subset")
    p.add_argument("--max-output", type=int, default=32, help="policies: clip output tokens (CPU budget)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="gs-router-bench-") as d:
        tmp = Path(d)
        loads = [float(x) for x in a.loads.split(",")]
        names = [x for x in a.policies.split(",") if x]
        before = os.getloadavg()
        res = policies(a.seconds, loads, names, a.max_output, tmp)
        res["loadavg_1_5_15"] = {"before": before, "after": os.getloadavg()}
        merge_results("policies", res)
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
