"""Router policies in virtual time: the router's real picker over simulated engines, free of CPU contention.

Why: ``bench/router.py policies`` runs the router, the simulated pods and the load generator as processes
on the wall clock. On the shared 2-core machine (load average 7-11 while other helpers run e2e tests)
the simulator, the router and the client starve, and tokens arrive in clumps (ITL P50 of 0 ms): the wall-
clock figures measure the machine, not the policy. This benchmark replays the same trace through the
same code in virtual time, so every policy sees exactly the same arrivals and the result is the same on
any machine (deterministic; seeds fixed).

What is real code: :class:`gearshift.router.pool.Pool` (``pick``: every policy in
:mod:`gearshift.router.policies`, the pick counting FastChat does, the router's in-flight counters) and
:func:`gearshift.router.signals.apply_sample` (how a scrape lands in the pool); the simulated engine
(:class:`gearshift.sim.engine.Engine`, its scheduler, paged KV pool and roofline timing through
``begin_step``/``end_step``); :func:`gearshift.router.settings.prefill_ms_per_token` and
``kv_bytes_per_token``.

What is modelled here, as in :mod:`gearshift.router.proxy`: the decode pod is picked first, then the
prefill pod (with the decode pod as its network peer); the prefill request (1 token) runs, its pod's
in-flight count is held until it finishes; then the decode request (``remote_kv_tokens`` = the prompt,
the KV crosses the 100 Gb/s link in the engine's transfer model) is sent and its pod's in-flight count is
held until the last token. The client's TTFT is the decode pod's first token − arrival; ITL are the gaps
between the decode pod's tokens; TPOT = (last − first) / (tokens − 1). Scrapes every ``--scrape`` s
(0.25, as the wall-clock bench) fold the engines' running/waiting/KV usage/stage utilisation/ITL into the
pool. Not modelled: the router's own CPU time and the HTTP hops (measured by ``bench/router_cost.py``).

Pool, trace and loads as ``bench/router.py policies``: prefill H100 + 2 × A10, decode H100 + 2 × A10
(Llama-3-8B, max batch 64, 100 Gb/s), the Azure 2023 conversation trace's first requests (its own bursts)
time-scaled to 50/80/95 % of the prefill pool's capacity (Σ 1 / prefill time of the mean prompt).

Run: ``PYTHONPATH=operator .venv/bin/python bench/router_des.py`` → ``bench/results/router.json`` key
``policies_virtual_time``.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "operator"))
sys.path.insert(0, str(REPO / "bench"))

from benchlib import write_result  # noqa: E402
from gearshift.dev.loadgen import DEFAULT_TRACE as TRACE  # noqa: E402
from gearshift.dev.loadgen import load_trace  # noqa: E402
from gearshift.facts.model import load_hf_config  # noqa: E402
from gearshift.router import policies as P  # noqa: E402
from gearshift.router.pool import BackendInfo, PolicyConfig, Pool  # noqa: E402
from gearshift.router.settings import kv_bytes_per_token, prefill_ms_per_token  # noqa: E402
from gearshift.router.signals import Histogram, PodSample, apply_sample  # noqa: E402
from gearshift.sim.engine import Engine, PlannedStep, SimRequest  # noqa: E402
from gearshift.sim.perfmodel import Link, PerfModel, single_stage_pipeline  # noqa: E402

MODEL = REPO / "examples" / "models" / "llama-3-8b.json"
RESULTS = REPO / "bench" / "results" / "router.json"
PREFILL_GPUS = ["H100-80GB", "A10-24GB", "A10-24GB"]
DECODE_GPUS = ["H100-80GB", "A10-24GB", "A10-24GB"]
MAX_BATCH = 64
LINK = Link(gbps=100.0, latency_us=10.0)
SLO_TTFT_MS = 200.0
SLO_TPOT_MS = 50.0
POLICY_RUNS: list[tuple[str, dict[str, Any]]] = [
    ("pd-score", {"policy": "pd-score"}),
    # pd-score with the PD guide's count-based queue term (docs/sources.md#prefill-score) (before correction
    # 8): no prefill time known.
    ("pd-score-seed-queue", {"policy": "pd-score", "seed_queue": True}),
    ("shortest-queue-speed1", {"policy": "shortest-queue", "speed_one": True}),
    ("shortest-queue", {"policy": "shortest-queue"}),
    ("lottery", {"policy": "lottery"}),
    ("lottery-speed1", {"policy": "lottery", "speed_one": True}),
    ("round-robin", {"policy": "round-robin"}),
    ("power-of-two", {"policy": "power-of-two"}),
    ("least-request", {"policy": "least-request"}),
]


@dataclass
class Pod:
    """One simulated head pod: engine, its in-flight step, and cumulative ITL (s) for the scrape."""

    name: str
    role: str
    engine: Engine
    step: PlannedStep | None = None
    itl_sum: float = 0.0
    itl_count: int = 0


@dataclass
class Req:
    """One client request's life."""

    arrival: float
    prompt: int
    output: int
    decode: str | None = None
    prefill: str | None = None
    token_times: list[float] = field(default_factory=list)
    failed: str | None = None


class VClock:
    """The virtual clock the engines read, s."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def pct(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of ``values``; None when empty."""
    if not values:
        return None
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))]


def summary(values: list[float]) -> dict[str, float] | None:
    """Mean, P50, P90, P99 of ``values`` (ms)."""
    if not values:
        return None
    return {"mean": sum(values) / len(values), "p50": pct(values, 50), "p90": pct(values, 90),
            "p99": pct(values, 99)}  # fmt: skip


def run_one(
    flags: dict[str, Any], arrivals: list[tuple[float, int, int]], scrape_s: float, seed: int
) -> dict[str, Any]:
    """Replay ``arrivals`` (virtual s, prompt, output tokens) through a fresh pool and engines; the result."""
    arch = load_hf_config(MODEL)
    kvb = kv_bytes_per_token(str(MODEL))
    ms_tok = prefill_ms_per_token(str(MODEL))
    clock = VClock()
    pods: dict[str, Pod] = {}
    infos = []
    for role, gpus in (("prefill", PREFILL_GPUS), ("decode", DECODE_GPUS)):
        for i, gpu in enumerate(gpus):
            pm = PerfModel(arch, single_stage_pipeline(arch, gpu, maxBatch=MAX_BATCH))
            name = f"{role}-{gpu.split('-')[0].lower()}-{i}"
            eng = Engine(pm, role=role, kv_link=LINK, clock=clock)
            pods[name] = Pod(name, role, eng)
            kv_cap = pm.kv_capacity_blocks() * pm.params.block_size * kvb
            infos.append(BackendInfo(name=name, url=f"sim://{name}", role=role, gpu_model=gpu,  # type: ignore[arg-type]
                                     max_batch=MAX_BATCH, nic_gbps=LINK.gbps,
                                     kv_capacity_bytes=kv_cap if role == "decode" else None))  # fmt: skip
    flags = dict(flags)
    seed_queue = bool(flags.pop("seed_queue", False))
    pool = Pool(PolicyConfig(**flags), random.Random(seed))
    pool.set_members(infos)
    seq = itertools.count()
    events: list[tuple[float, int, str, Any]] = []

    def push(t: float, kind: str, data: Any) -> None:
        heapq.heappush(events, (t, next(seq), kind, data))

    reqs = [Req(t, p, o) for t, p, o in arrivals]
    for i, r in enumerate(reqs):
        push(r.arrival, "arrive", i)
    # bounded: whatever is unfinished 120 virtual s after the last arrival counts as failed
    end_t = arrivals[-1][0] + 120.0
    push(0.0, "scrape", None)
    owner: dict[int, tuple[int, str]] = {}  # id(SimRequest) → (request index, stage)
    handles: dict[int, SimRequest] = {}

    def kick(pod: Pod) -> None:
        if pod.step is not None:
            return
        st = pod.engine.begin_step(clock.now)
        if st is not None:
            pod.step = st
            push(st.end, "step", pod.name)
        else:
            nxt = pod.engine.next_transfer_at()
            if nxt is not None:
                push(max(nxt, clock.now), "wake", pod.name)

    def send(i: int, role: str, pod_name: str) -> None:
        r = reqs[i]
        pod = pods[pod_name]
        backend = pool.backends[pod_name]
        backend.inflight += 1
        if role == "prefill":
            h = pod.engine.new_request(r.prompt, 1, prefill_only=True)
        else:
            h = pod.engine.new_request(r.prompt, r.output, remote_kv_tokens=r.prompt)
        owner[id(h)] = (i, role)
        handles[id(h)] = h
        kick(pod)

    while events:
        t, _, kind, data = heapq.heappop(events)
        if t > end_t:
            break
        clock.now = t
        if kind == "arrive":
            r = reqs[data]
            view = P.RequestView(prompt_tokens=r.prompt, max_tokens=r.output, kv_bytes_per_token=kvb,
                                 prefill_ms_ref=None if seed_queue else r.prompt * ms_tok)  # fmt: skip
            try:
                d = pool.pick("decode", view, t)
                p = pool.pick("prefill", view, t, peer=d)
            except P.NoPodError as exc:
                r.failed = str(exc)
                continue
            r.decode, r.prefill = d.info.name, p.info.name
            send(data, "prefill", p.info.name)
        elif kind in ("step", "wake"):
            pod = pods[data]
            if kind == "step":
                st = pod.step
                assert st is not None
                pod.step = None
                before = {id(h): h.generated for h, _ in st.batch}
                pod.engine.end_step(st)
                for h, _ in st.batch:
                    if h.generated > before[id(h)] and id(h) in owner:
                        i, role = owner[id(h)]
                        if role == "decode":
                            rr = reqs[i]
                            if rr.token_times:
                                pod.itl_sum += t - rr.token_times[-1]
                                pod.itl_count += 1
                            rr.token_times.append(t)
                    if h.finished and id(h) in owner:
                        i, role = owner.pop(id(h))
                        handles.pop(id(h), None)
                        pool.backends[pod.name].inflight -= 1
                        if role == "prefill":
                            send(i, "decode", reqs[i].decode or "")
            kick(pod)
        elif kind == "scrape":
            for pod in pods.values():
                e = pod.engine
                util = e.stage_utilization()
                sample = PodSample(running=e.num_running(), waiting=e.num_waiting(), kv_usage=e.kv_usage(),
                                   stage_util={str(k): u for k, u in enumerate(util)},
                                   itl=Histogram(pod.itl_sum, pod.itl_count, {}))  # fmt: skip
                apply_sample(pool.backends[pod.name], sample, t, kvb)
            push(t + scrape_s, "scrape", None)
    ttft, itl, tpot, e2e = [], [], [], []
    ok = met = 0
    for r in reqs:
        if r.failed or len(r.token_times) < r.output:
            continue
        ok += 1
        f = (r.token_times[0] - r.arrival) * 1000
        ttft.append(f)
        e2e.append((r.token_times[-1] - r.arrival) * 1000)
        gaps = [(b - a) * 1000 for a, b in itertools.pairwise(r.token_times)]
        itl.extend(gaps)
        tp = (r.token_times[-1] - r.token_times[0]) * 1000 / (len(r.token_times) - 1) if gaps else 0.0
        tpot.append(tp)
        met += f <= SLO_TTFT_MS and tp <= SLO_TPOT_MS
    duration = arrivals[-1][0] - arrivals[0][0]
    picks: dict[str, int] = {}
    for r in reqs:
        for name in (r.prefill, r.decode):
            if name:
                picks[name] = picks.get(name, 0) + 1
    return {"issued": len(reqs), "completed": ok, "failed": len(reqs) - ok, "ttft_ms": summary(ttft),
            "itl_ms": summary(itl), "tpot_ms": summary(tpot), "e2e_ms": summary(e2e), "slo_met": met,
            "goodput_rps": met / duration if duration > 0 else None,
            "picks": dict(sorted(picks.items()))}  # fmt: skip


def capacity(mean_prompt: int) -> tuple[float, dict[str, float]]:
    """Prefill capacity of the pool, req/s (Σ 1 / prefill time of the mean prompt); per-GPU prefill ms."""
    arch = load_hf_config(MODEL)
    ms = {g: PerfModel(arch, single_stage_pipeline(arch, g)).prefill_time_s(mean_prompt) * 1000
          for g in set(PREFILL_GPUS)}  # fmt: skip
    return sum(1000 / ms[g] for g in PREFILL_GPUS), ms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000, help="trace requests per point")
    ap.add_argument("--loads", default="0.5,0.8,0.95")
    ap.add_argument("--max-output", type=int, default=128, help="clip output tokens")
    ap.add_argument("--scrape", type=float, default=0.25, help="scrape interval, virtual s")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--policies", default="", help="comma-separated subset")
    a = ap.parse_args()
    trace = load_trace(TRACE, limit=20000)
    mean_prompt = round(sum(t.prompt_tokens for t in trace) / len(trace))
    cap, prefill_ms = capacity(mean_prompt)
    rows = trace[: a.requests]
    native = (len(rows) - 1) / max(rows[-1].offset_s - rows[0].offset_s, 1e-9)
    out: dict[str, Any] = {
        "what": "virtual-time replay: the router's Pool.pick over simulated engines (bench/router_des.py)",
        "pool": {"prefill": PREFILL_GPUS, "decode": DECODE_GPUS, "model": "llama-3-8b",
                 "max_batch": MAX_BATCH},
        "mean_prompt_tokens": mean_prompt, "prefill_ms_mean_prompt": prefill_ms, "capacity_rps": cap,
        "requests_per_point": len(rows), "max_output_tokens": a.max_output, "scrape_s": a.scrape,
        "slo": {"ttft_ms": SLO_TTFT_MS, "tpot_ms": SLO_TPOT_MS}, "points": {},
    }  # fmt: skip
    wall0 = time.monotonic()
    for load in [float(x) for x in a.loads.split(",")]:
        rate = load * cap
        scale = rate / native
        arrivals = [((t.offset_s - rows[0].offset_s) / scale, t.prompt_tokens,
                     max(1, min(t.output_tokens, a.max_output))) for t in rows]  # fmt: skip
        label = f"{round(load * 100)}%"
        for name, flags in POLICY_RUNS:
            if a.policies and name not in a.policies.split(","):
                continue
            res = run_one(flags, arrivals, a.scrape, a.seed) | {"target_rps": rate}
            out["points"].setdefault(label, {})[name] = res
            tt = res["ttft_ms"] or {}
            print(f"{label:4s} {name:22s} ttft p50 {tt.get('p50', float('nan')):8.1f} p99 "
                  f"{tt.get('p99', float('nan')):8.1f} ok {res['completed']}/{res['issued']} "
                  f"goodput {res['goodput_rps']:.2f}", flush=True)  # fmt: skip
    goal = {}
    for label in ("50%", "80%"):
        pts = out["points"].get(label, {})
        if "pd-score" in pts and "shortest-queue-speed1" in pts:
            x, y = pts["pd-score"]["ttft_ms"]["p99"], pts["shortest-queue-speed1"]["ttft_ms"]["p99"]
            goal[label] = {"pd_score_p99_ttft_ms": x, "sq_speed1_p99_ttft_ms": y, "reduction": 1 - x / y}
    out["goal"] = goal
    out["wall_s"] = time.monotonic() - wall0
    write_result(RESULTS, "policies_virtual_time", out)
    print(json.dumps(goal, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
