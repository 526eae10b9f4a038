"""Virtual-time benchmark of the pipeline-replica autoscaler: the shared trace with a burst past one
replica's capacity, the real decision code (gearshift.control.autoscale.scaling), a fluid model of decode
replicas.

What is modelled (stated, not measured on GPUs): a decode pipeline replica runs continuous batching of at
most ``MAX_BATCH`` sequences; one decode step takes ``STEP_BASE_MS + STEP_PER_SEQ_MS × batch`` (weights
read once per step plus each sequence's KV; the shape of the simulated engine's memory-bound decode) and a
request holds its KV (prompt + generated tokens × ``KV_BYTES_PER_TOKEN``) in a pool of ``KV_POOL_GB``.
A request is admitted to the ready replica with the most free KV if its final KV × 1.2 fits (the PD guide's
(docs/sources.md#decode-headroom) headroom rule); otherwise it waits, and each sample interval in which some
request found no such replica counts as router "no decode headroom" rejections (the autoscaler's immediate
trigger). A new replica takes ``WARMUP_S`` to become Ready (weights load); a replica scaled down is drained
(no admissions) and goes when its last request ends, so no request fails. TTFT = queue wait + ``PREFILL_MS``;
a request meets the SLO when TTFT ≤ 200 ms and its mean step time ≤ 50 ms (the example PDService's SLOs);
goodput = such requests per second.

Output: bench/results/autoscale.json — time to scale up (burst start → first decision, → replicas Ready),
goodput before / during / after the burst, GPU-hours of the autoscaled run vs a fixed ``maxReplicas``
deployment, failed requests. Run: ``python bench/autoscale.py`` (a few seconds, one core).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "operator"))

from gearshift.control.autoscale import scaling as sc  # noqa: E402
from gearshift.dev.loadgen import DEFAULT_TRACE as TRACE  # noqa: E402
from gearshift.dev.loadgen import load_trace  # noqa: E402

DT = 0.1  # s, model step
SAMPLE_S = 2.0  # s, autoscaler sample interval (docs/sources.md#shift-signals)
MAX_BATCH = 64
STEP_BASE_MS = 18.0
STEP_PER_SEQ_MS = 0.35
KV_BYTES_PER_TOKEN = 131072  # Llama-3-8B bf16: 32 layers x 2 x 8 KV heads x 128 x 2 B
KV_POOL_GB = 20.0
PREFILL_MS = 60.0
WARMUP_S = 60.0
GPUS_PER_REPLICA = 2
SLO_TTFT_MS, SLO_ITL_MS = 200.0, 50.0
WINDOW_S = 1800.0  # trace seconds replayed
BURST = (600.0, 900.0)  # s of the replay during which the trace runs BURST_SPEEDUP x faster
BURST_SPEEDUP = 4.0
POLICY = sc.ScalingPolicy(
    min_replicas=1,
    max_replicas=4,
    kv_cache_usage=0.8,
    waiting_per_replica=4.0,
    slo_ratio=1.0,
    scale_up_s=30.0,
    scale_down_s=120.0,
    scale_to_min_delay_s=600.0,
)


@dataclass
class Req:
    arrive: float
    prompt: int
    out: int
    done_tokens: float = 0.0
    admitted: float | None = None
    step_ms_sum: float = 0.0
    steps: int = 0

    @property
    def kv_final(self) -> float:
        return (self.prompt + self.out) * KV_BYTES_PER_TOKEN


@dataclass
class Replica:
    ready_at: float
    draining: bool = False
    running: list[Req] = field(default_factory=list)

    def kv_used(self) -> float:
        return sum((r.prompt + r.done_tokens) * KV_BYTES_PER_TOKEN for r in self.running)


def arrivals() -> list[Req]:
    """The trace's first WINDOW_S of replay time; inside BURST, trace time runs BURST_SPEEDUP x faster."""
    trace = load_trace(TRACE)
    out, b0, b1 = [], BURST[0], BURST[1]
    burst_trace_len = (b1 - b0) * BURST_SPEEDUP
    for t in trace:
        x = t.offset_s
        if x < b0:
            at = x
        elif x < b0 + burst_trace_len:
            at = b0 + (x - b0) / BURST_SPEEDUP
        else:
            at = b1 + (x - b0 - burst_trace_len)
        if at >= WINDOW_S:
            break
        out.append(Req(at, t.prompt_tokens, max(t.output_tokens, 1)))
    return out


def run(autoscale: bool) -> dict[str, Any]:
    reqs = arrivals()
    pool = KV_POOL_GB * 1e9
    start_n = 1 if autoscale else POLICY.max_replicas
    replicas = [Replica(ready_at=0.0) for _ in range(start_n)]
    queue: list[Req] = []
    finished: list[Req] = []
    state, spec, blocked = sc.ScaleState(), start_n, 0
    i, t, next_sample = 0, 0.0, SAMPLE_S
    gpu_s, decisions = 0.0, []
    horizon = WINDOW_S + 300.0
    while t < horizon and (i < len(reqs) or queue or any(r.running for r in replicas) or t < WINDOW_S):
        while i < len(reqs) and reqs[i].arrive <= t:
            queue.append(reqs[i])
            i += 1
        ready = [r for r in replicas if r.ready_at <= t and not r.draining]
        while queue:
            q = queue[0]
            fits = [r for r in ready if len(r.running) < MAX_BATCH and pool - r.kv_used() >= 1.2 * q.kv_final]
            if not fits:
                if any(len(r.running) < MAX_BATCH for r in ready):
                    blocked += 1  # slots free, KV headroom not: the router's no-headroom case
                break
            best = max(fits, key=lambda r: pool - r.kv_used())
            q.admitted = t
            best.running.append(queue.pop(0))
        for r in replicas:
            if not r.running:
                continue
            step_ms = STEP_BASE_MS + STEP_PER_SEQ_MS * len(r.running)
            for q in r.running:
                q.done_tokens += DT * 1000.0 / step_ms
                q.step_ms_sum += step_ms
                q.steps += 1
            done = [q for q in r.running if q.done_tokens >= q.out]
            for q in done:
                r.running.remove(q)
                finished.append(q)
        replicas = [r for r in replicas if not (r.draining and not r.running)]
        gpu_s += len(replicas) * GPUS_PER_REPLICA * DT
        t = round(t + DT, 6)
        if autoscale and t >= next_sample:
            next_sample += SAMPLE_S
            ready = [r for r in replicas if r.ready_at <= t and not r.draining]
            sample = sc.ScaleSample(
                at=t,
                kv_cache_usage=max((r.kv_used() / pool for r in ready), default=0.0),
                waiting=float(len(queue)),
                running=float(sum(len(r.running) for r in ready)),
                no_headroom=blocked,
            )
            blocked = 0
            state, d = sc.decide_scale(state, sample, POLICY, current=spec, ready=len(ready), now=t)
            if d.kind is sc.ScaleKind.UP:
                replicas += [Replica(ready_at=t + WARMUP_S) for _ in range(d.target - spec)]
                decisions.append({"t": t, "kind": "up", "to": d.target, "reason": d.reason})
                spec = d.target
            elif d.kind is sc.ScaleKind.DOWN:
                live = [r for r in replicas if not r.draining]
                for r in live[d.target :]:
                    r.draining = True
                decisions.append({"t": t, "kind": "down", "to": d.target, "reason": d.reason})
                spec = d.target
    return summarize(reqs, finished, gpu_s, decisions, len(queue) + sum(len(r.running) for r in replicas))


def goodput(done: list[Req], t0: float, t1: float) -> tuple[float, float]:
    """(goodput req/s, share meeting the SLO) of requests arriving in [t0, t1)."""
    sel = [q for q in done if t0 <= q.arrive < t1]
    ok = [
        q
        for q in sel
        if q.admitted is not None
        and (q.admitted - q.arrive) * 1000 + PREFILL_MS <= SLO_TTFT_MS
        and q.step_ms_sum / max(q.steps, 1) <= SLO_ITL_MS
    ]
    return round(len(ok) / (t1 - t0), 3), round(len(ok) / max(len(sel), 1), 4)


def summarize(reqs: list[Req], done: list[Req], gpu_s: float, decisions: list[dict], left: int) -> dict:
    phases = {"before": (0.0, BURST[0]), "burst": BURST, "after": (BURST[1], WINDOW_S)}
    out: dict[str, Any] = {
        "requests": len(reqs),
        "finished": len(done),
        "failed_or_unfinished": len(reqs) - len(done),
        "left_at_horizon": left,
        "gpu_hours": round(gpu_s / 3600.0, 3),
        "goodput_rps": {k: goodput(done, *v)[0] for k, v in phases.items()},
        "slo_attainment": {k: goodput(done, *v)[1] for k, v in phases.items()},
        "decisions": decisions,
        # goodput (req/s) of the requests arriving in each 30 s bin from 60 s before the burst to 150 s after
        "goodput_bins_30s": {
            int(b): goodput(done, b, b + 30.0)[0] for b in range(int(BURST[0]) - 60, int(BURST[1]) + 150, 30)
        },
    }
    ups = [d for d in decisions if d["kind"] == "up" and d["t"] >= BURST[0]]
    if ups:
        out["time_to_scale_up_decision_s"] = round(ups[0]["t"] - BURST[0], 1)
        out["time_to_scale_up_ready_s"] = round(ups[0]["t"] + WARMUP_S - BURST[0], 1)
    return out


def main() -> int:
    auto, fixed = run(True), run(False)
    one_replica_rps = 1000.0 / (STEP_BASE_MS + STEP_PER_SEQ_MS * MAX_BATCH) * MAX_BATCH
    result = {
        "kind": "virtual-time (fluid decode model + the real gearshift.control.autoscale.scaling decisions)",
        "note": __doc__.split("\n\n")[1].replace("\n", " "),
        "trace": str(TRACE.name),
        "window_s": WINDOW_S,
        "burst": {"from_s": BURST[0], "to_s": BURST[1], "speedup": BURST_SPEEDUP},
        "model": {
            "max_batch": MAX_BATCH,
            "step_ms": f"{STEP_BASE_MS} + {STEP_PER_SEQ_MS} x batch",
            "one_replica_output_tokens_per_s_at_full_batch": round(one_replica_rps, 1),
            "kv_pool_gb": KV_POOL_GB,
            "warmup_s": WARMUP_S,
            "gpus_per_replica": GPUS_PER_REPLICA,
        },
        "policy": POLICY.__dict__,
        "autoscaled": auto,
        "fixed_max_replicas": fixed,
        "gpu_hours_saved_share": round(1 - auto["gpu_hours"] / fixed["gpu_hours"], 3),
    }
    out = ROOT / "bench" / "results" / "autoscale.json"
    # The sandbox runs (tests/e2e/test_autoscale_e2e.py, bench/autoscale_sandbox.py) keep their sections.
    kept = json.loads(out.read_text()) if out.exists() else {}
    result = {**result, **{k: v for k, v in kept.items() if k.startswith("sandbox_")}}
    out.write_text(json.dumps(result, indent=2) + "\n")
    keys = ("autoscaled", "fixed_max_replicas", "gpu_hours_saved_share")
    print(json.dumps({k: v for k, v in result.items() if k in keys}, indent=1)[:4000])
    return 0 if math.isfinite(auto["gpu_hours"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
