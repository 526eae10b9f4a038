"""Pipeline-replica autoscaling on the sandbox twin under the shared trace: a burst past one
decode replica's capacity, the scale-up, the recovery of goodput, and the scale-down after it.

Two runs with the same fleet, service and replayed load, on a shared sandbox (``gearshift sandbox up``),
each in a namespace and node pools of its own (podCIDR block 100-149):

- ``autoscaled``: decode ``scaling: {minReplicas: 1, maxReplicas: MAX}``;
- ``fixed``: ``minReplicas = maxReplicas = MAX`` (a fixed max-replica deployment, the baseline).

Fleet and model: prefill is an explicit gear on one A100-40GB (a 1155-token prompt, the trace's mean,
prefills in ~0.1 s in the simulated engine's roofline, so TTFT is not what saturates); decode is an
explicit one-stage gear on a pool of ``MAX`` L4-24GB nodes. The model is Llama-2-7B-shaped (32 layers,
hidden 4096, 32 KV heads: 512 KiB of KV cache per token, no GQA), so one L4 holds 18 531 tokens of KV
after the weights (perfmodel ``stage_kv_tokens``), decoding at ~65 ms a step alone and ~95-110 ms at a full
pool. The trace's mean request (1155 prompt + 211 output tokens) holds ~1.4 k tokens at its end and the
router's seed-000 filter wants 1.2 x that free, so one replica runs ~12-13 such requests at once, each for
~211 steps x ~0.1 s = ~21 s: by Little's law ~0.6 req/s per replica. The burst (~0.8 req/s) is past one
replica's capacity and within two's (~1.2 req/s); the low phases (~0.25 req/s) fit one. The trace's
largest request (14 089 tokens, x1.2 = 16.9 k) still fits an empty pod, so nothing is unservable.

Load shape (``build_load``): the shared trace's requests in order with their recorded sizes and their
arrival times at time scale 1, starting ``--trace-start-s`` seconds into the trace, *thinned* per phase by
keeping every k-th request (systematic thinning: the trace's own arrival pattern at 1/k of its rate):

    low   [0, low1_s)                      every ``--low-every``-th   (trace 5.5 req/s / 22 ≈ 0.25 req/s)
    burst [low1_s, low1_s + burst_s)       every ``--burst-every``-th (/ 7 ≈ 0.8 req/s)
    low   [.., + low2_s)                   every ``--low-every``-th

replayed with ``gearshift.dev.loadgen.run_load`` through the router pod's loopback IP, streaming, bounded by
the request count and ``low1_s + burst_s + low2_s`` seconds of issuing plus ``DRAIN_S`` to finish.

Sampled every ``SAMPLE_S`` s (kubernetes client, loopback API server): the decode GearSet's
``spec.replicas``, ``status.scaling`` (desired/ready, last decision and reason), the ``ScalingActive``
condition, Ready decode head pods; and the router's ``/metrics`` (no-headroom counter, held requests).

Figures (key ``sandbox_trace`` of bench/results/autoscale.json, the other keys kept), times from the burst
start: the first router no-headroom miss, ``spec.replicas`` raised, the new replica's head pod Ready;
goodput (requests *sent* in an interval that met the PDService SLO, per second of the interval) before the
scale-up ``[burst start, new replica Ready)`` and after it ``[Ready, burst end)``, with the same offsets in
the fixed run; ``spec.replicas`` back to 1 after the burst; failed requests (any non-200, refusals
included, and requests cut off unfinished); decode GPU-hours = ∫ Ready decode head pods × GPUs per
replica dt over the replay, against the fixed run's measured integral and the nominal MAX x duration.

Each run's samples and per-request outcomes go to bench/results/autoscale_sandbox_runs.json (``--raw``), so
the two runs can be separate invocations (``--modes autoscaled`` then ``--modes fixed``, each under the
shared lock and under ~10 minutes); the figures are recomputed from it after each run (runs of another
load shape are dropped).

Run: ``PYTHONPATH=operator .venv/bin/python bench/autoscale_sandbox.py [--out FILE] [--modes ...]``
(measured runs under the shared lock: ``flock /tmp/gs/sandbox-bench.lock nice -n 5 ...``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import benchlib
from gearshift.dev.loadgen import DEFAULT_TRACE as TRACE
from gearshift.dev.loadgen import LoadResult, TraceRequest, load_trace, run_load
from gearshift.dev.sandbox import cluster as sbcluster
from gearshift.dev.sandbox.harness import (
    GpuNodes,
    LayoutKubectl,
    OperatorProcess,
    apply,
    install_crds,
    kubectl_for_layout,
    wait_until,
)
from gearshift.dev.sandbox.layout import Layout
from gearshift.facts.model import ModelArch
from gearshift.k8s import names
from gearshift.k8s.services import ROUTER_PORT
from gearshift.sim.perfmodel import PerfModel, single_stage_pipeline
from gearshift.testing import manifests as build

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "autoscale.json"
#: Each run's samples and per-request outcomes (compact JSON), from which the figures are computed.
RAW = REPO / "bench" / "results" / "autoscale_sandbox_runs.json"
KEY = "sandbox_trace"
SERVICE = "ass"
PREFILL_GS = f"{SERVICE}-prefill"
DECODE_GS = f"{SERVICE}-decode"
#: Llama-2-7B's shape (its config.json): 32 layers, hidden 4096, 32 heads and 32 KV heads of 128.
MODEL = {
    "name": "meta-llama/Llama-2-7b-hf",
    "numLayers": 32,
    "hiddenSize": 4096,
    "numHeads": 32,
    "numKvHeads": 32,
    "headDim": 128,
    "intermediateSize": 11008,
    "vocabSize": 32000,
    "dtype": "bfloat16",
}
ARCH = ModelArch("llama-2-7b", 32, 4096, 32, 32, 128, 11008, 32000)
PREFILL_CARD = "A100-40GB"
DECODE_CARD = "L4-24GB"
#: GPUs one decode pipeline replica takes (one stage on one card).
GPUS_PER_REPLICA = 1
#: TTFT: a held or queued request misses it; TPOT: an L4 at a full KV pool decodes at ~110 ms a step.
SLO = {"ttftMs": 2000, "itlMs": 150}
#: drainTimeoutS covers the longest decode (~600 tokens x ~0.1 s) so a scale-down never cuts a request.
POLICY = {"sampleIntervalS": 1, "drainTimeoutS": 120, "warmupTimeoutS": 120, "dwellS": 600}
WINDOWS = {"scaleUpS": 30, "scaleDownS": 30, "scaleToMinDelayS": 600}
#: The API's default targets (sloRatio 1). A first run found that the P99/SLO ratio, then a proportional
#: load measure, held two replicas at any load: decode ITL is mostly the weights read once per step (~65 ms
#: alone on an L4; P99 ~97 ms from the histogram buckets, ratio 0.65 → ceil(2 × 0.65) = 2). The autoscaler
# : now uses the P99 one-sidedly (control/autoscale/scaling.py: scale up above the SLO, veto a scale-down near
# it).
TARGETS: dict[str, float] = {}
SAMPLE_S = 1.0
#: Seconds the load generator waits for requests in flight once issuing stops.
DRAIN_S = 120.0
READY_TIMEOUT_S = 180.0
BIN_S = 10.0


#: Progress on stderr with the wall clock.
say = benchlib.sayer("as-bench")


def decode_kv_tokens() -> int:
    """KV-cache tokens one decode replica holds (the simulated engine's own formula)."""
    return PerfModel(ARCH, single_stage_pipeline(ARCH, DECODE_CARD)).stage_kv_tokens(0)


# ------------------------------------------------------------------------------------------- load
@dataclass(frozen=True)
class Phase:
    """One phase of the shaped load: ``[start_s, end_s)`` of the run, every ``every``-th trace request."""

    name: str
    start_s: float
    end_s: float
    every: int


def phases(args: argparse.Namespace) -> list[Phase]:
    """low, burst, low (see the module docstring)."""
    a, b = args.low1_s, args.low1_s + args.burst_s
    return [
        Phase("low_before", 0.0, a, args.low_every),
        Phase("burst", a, b, args.burst_every),
        Phase("low_after", b, b + args.low2_s, args.low_every),
    ]


def build_load(trace: list[TraceRequest], start_s: float, plan: list[Phase]) -> list[TraceRequest]:
    """The trace from ``start_s`` at time scale 1, offsets rebased to 0, thinned per phase: in each phase
    the requests whose index within the phase is a multiple of its ``every`` are kept.

    Raises:
        ValueError: the trace ends before the last phase does.
    """
    window = [
        TraceRequest(r.offset_s - start_s, r.prompt_tokens, r.output_tokens)
        for r in trace
        if start_s <= r.offset_s < start_s + plan[-1].end_s
    ]
    if not window or window[-1].offset_s < plan[-1].end_s - 60:
        raise ValueError(f"the trace holds too little after {start_s:g} s for {plan[-1].end_s:g} s of load")
    out = []
    for ph in plan:
        inside = [r for r in window if ph.start_s <= r.offset_s < ph.end_s]
        out += inside[:: ph.every]
    return out


# ---------------------------------------------------------------------------------------- service
def manifests(
    ns: str, prefill_node: str, decode_pool: str, prom_url: str | None, lo: int, hi: int
) -> list[dict[str, Any]]:
    """The explicit prefill gear on ``prefill_node``, the explicit decode gear on ``decode_pool`` and the
    PDService with decode ``scaling: {minReplicas: lo, maxReplicas: hi}``."""
    prefill = build.gearset(PREFILL_GS, ns, {
        "serviceName": SERVICE, "role": "prefill", "mode": "explicit",
        "gears": [{"name": "p", "intent": "balanced", "microBatch": 4, "maxBatch": 64,
                   "stages": [{"layers": [0, 32], "nodes": [prefill_node], "gpuModel": PREFILL_CARD}]}],
        "policy": POLICY,
    })  # fmt: skip
    decode = build.gearset(DECODE_GS, ns, {
        "serviceName": SERVICE, "role": "decode", "mode": "explicit",
        "gears": [{"name": "d", "intent": "balanced", "microBatch": 8, "maxBatch": 64,
                   "stages": [{"layers": [0, 32], "gpuModel": DECODE_CARD,
                               "nodeSelector": {"gearshift.io/node-pool": decode_pool}}]}],
        "policy": POLICY,
    })  # fmt: skip
    spec: dict[str, Any] = {
        "model": MODEL,
        "engine": "sim",
        "prefill": {"gearSetRef": {"name": PREFILL_GS}},
        "decode": {
            "gearSetRef": {"name": DECODE_GS},
            "scaling": {"minReplicas": lo, "maxReplicas": hi, "windows": WINDOWS, "targets": TARGETS},
        },
        "slo": SLO,
        "router": {"policy": "pd-score"},
    }
    if prom_url:
        spec["prometheusUrl"] = prom_url
    pds = build.pdservice(SERVICE, ns, spec)
    return [prefill, decode, pds]


# ---------------------------------------------------------------------------------------- sampling
def http_get(url: str, timeout: float = 3.0) -> str:
    """GET a loopback URL (the sandbox's network rule)."""
    if not url.startswith("http://127."):
        raise ValueError(f"{url} is not a loopback URL")
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return str(r.read().decode())


def router_counters(text: str) -> dict[str, float]:
    """The router's no-headroom counter and held-requests gauge from its ``/metrics`` text."""
    out = {"no_headroom_total": 0.0, "held": 0.0}
    for line in text.splitlines():
        if line.startswith("gearshift_router_no_decode_headroom_total "):
            out["no_headroom_total"] = float(line.split()[1])
        elif line.startswith("gearshift_router_headroom_held "):
            out["held"] = float(line.split()[1])
    return out


@dataclass
class Sampler(benchlib.PeriodicSampler[dict[str, Any]]):
    """Samples the decode GearSet, decode head pods and the router every ``SAMPLE_S`` s on a thread."""

    core: Any
    custom: Any
    ns: str
    router: str
    t0: float = 0.0
    """Unix time the samples' ``t`` is relative to (set when the replay starts)."""
    interval_s = SAMPLE_S

    def once(self) -> dict[str, Any]:
        t = time.time()
        gs = self.custom.get_namespaced_custom_object(
            "gearshift.io", "v1alpha1", self.ns, "gearsets", DECODE_GS, _request_timeout=10
        )
        sel = f"{names.LABEL_SERVICE}={SERVICE},{names.LABEL_ROLE}=decode,gearshift.io/stage=0"
        heads = self.core.list_namespaced_pod(self.ns, label_selector=sel, _request_timeout=10).items
        ready = 0
        for p in heads:
            conds = {c.type: c.status for c in p.status.conditions or []}
            ready += conds.get("Ready") == "True" and not p.metadata.deletion_timestamp
        st = gs.get("status") or {}
        sc = st.get("scaling") or {}
        cond = next((c for c in st.get("conditions") or [] if c.get("type") == "ScalingActive"), {})
        try:
            rc = router_counters(http_get(self.router + "/metrics"))
        except (OSError, ValueError):
            rc = {"no_headroom_total": None, "held": None}
        return {
            "t": round(t - self.t0, 2),
            "spec_replicas": gs["spec"].get("replicas", 1),
            "ready_heads": ready,
            "heads": len(heads),
            "decision": sc.get("lastDecision"),
            "reason": sc.get("lastReason"),
            "draining": list(sc.get("draining") or []),
            "scaling_active": cond.get("status"),
            "scaling_active_reason": cond.get("reason"),
            **rc,
        }

    def start(self, t0: float = 0.0) -> None:
        self.t0 = t0
        super().start()


# ------------------------------------------------------------------------------------------- runs
def compact(res: LoadResult, perf0: float) -> list[list[Any]]:
    """Per request: ``[sent s from the replay start, ok, TTFT ms, TPOT ms, output tokens, error]``."""
    out = []
    for r in res.records:
        tpot = r.tpot_s
        out.append([
            round(r.sent_at - perf0, 3), r.ok,
            None if r.ttft_s is None else round(r.ttft_s * 1e3, 1),
            None if tpot is None else round(tpot * 1e3, 1),
            r.output_tokens, r.error,
        ])  # fmt: skip
    return out


def run_once(kc: LayoutKubectl, prom_url: str | None, mode: str, load: list[TraceRequest],
             args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """One run: own namespace and nodes, operator, service, replay, teardown; returns its raw record."""
    tag = uuid.uuid4().hex[:6]
    ns = f"bench-as-{mode}-{tag}"
    lo = 1 if mode == "autoscaled" else args.max_replicas
    kc.kubectl("create", "namespace", ns)
    nodes = GpuNodes(kc, f"bench-as{mode[0]}", cidr_base=args.cidr_base)
    op: OperatorProcess | None = None
    sampler: Sampler | None = None
    t_setup = time.time()
    try:
        prefill_node = nodes.add(PREFILL_CARD, "p")
        decode_nodes = [nodes.add(DECODE_CARD, "d") for _ in range(args.max_replicas)]
        say(f"{mode}: namespace {ns}; prefill {prefill_node}; decode pool {decode_nodes}")
        op = OperatorProcess(kc, ns, Path(args.logs) / f"operator-{mode}-{tag}.log")
        apply(kc, manifests(ns, prefill_node, nodes.pool("d"), prom_url, lo, args.max_replicas))
        core, custom = benchlib.kube_clients(kc)
        head_sel = f"{names.LABEL_SERVICE}={SERVICE},{names.LABEL_ROLE}=decode,gearshift.io/stage=0"

        def ready() -> str | None:
            heads = core.list_namespaced_pod(ns, label_selector=head_sel).items
            n_ready = sum(
                1 for p in heads
                if any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])
            )  # fmt: skip
            if n_ready < lo:
                return None
            ip = benchlib.ready_router_ip(core, ns, SERVICE)
            if ip is None:
                return None
            url = f"http://{ip}:{ROUTER_PORT}"
            try:  # the router knows the prefill head and every decode head
                known = json.loads(http_get(url + "/debug/pods"))["pods"]
            except (OSError, ValueError, KeyError):
                return None
            return url if len(known) >= 1 + lo else None

        url = wait_until(ready, READY_TIMEOUT_S, f"{lo} decode replica(s), prefill and the router Ready")
        setup_s = time.time() - t_setup
        say(f"{mode}: ready after {setup_s:.0f} s (router {url}); replay of {len(load)} requests")
        sampler = Sampler(core, custom, ns, url)
        issue_s = phases(args)[-1].end_s
        perf0, t_load0 = time.perf_counter(), time.time()
        sampler.start(t_load0)
        res = benchlib.replay(
            lambda: run_load([url], load, time_scale=1.0, max_requests=len(load), max_duration_s=issue_s + 1,
                             drain_s=DRAIN_S, stream=True, model=MODEL["name"], slo_ttft_ms=SLO["ttftMs"],
                             slo_itl_ms=SLO["itlMs"]),
            issue_s + DRAIN_S + 60,
        )  # fmt: skip
        # Keep sampling after the last answer until the scale-down lands (bounded): it is part of the figure.
        if mode == "autoscaled":
            end = time.monotonic() + args.tail_s
            while time.monotonic() < end:
                last = sampler.samples[-1] if sampler.samples else {}
                if last.get("spec_replicas") == 1 and last.get("ready_heads") == 1:
                    break
                time.sleep(SAMPLE_S)
        sampler.stop()
        say(f"{mode}: {res.issued} issued, {res.completed} completed, {res.failed} failed, "
            f"{res.incomplete} incomplete in {res.duration_s:.0f} s")  # fmt: skip
        return {
            "namespace": ns,
            "scaling": {"minReplicas": lo, "maxReplicas": args.max_replicas, "targets": TARGETS},
            "setup_s": round(setup_s, 1),
            "started_at": datetime.fromtimestamp(t_load0, UTC).replace(microsecond=0).isoformat(),
            "issued": res.issued,
            "completed": res.completed,
            "failed": res.failed,
            "incomplete": res.incomplete,
            "errors": dict(list(res.errors.items())[:10]),
            "duration_s": round(res.duration_s, 1),
            "ttft_ms": res.ttft_ms,
            "tpot_ms": res.tpot_ms,
            "goodput_rps_whole_run": None if res.goodput_rps is None else round(res.goodput_rps, 3),
            "sampler_errors": sampler.errors,
            "samples": sampler.samples,
            "requests_columns": ["sent_s", "ok", "ttft_ms", "tpot_ms", "output_tokens", "error"],
            "requests": compact(res, perf0),
        }
    finally:
        if sampler is not None:
            sampler.stop()
        benchlib.teardown(kc, ns, op, nodes, say)


# --------------------------------------------------------------------------------------- analysis
def meets_slo(req: list[Any]) -> bool:
    """The load generator's SLO test (TTFT ≤ ttftMs and TPOT ≤ itlMs) on one compact request record."""
    _, ok, ttft, tpot, _, _ = req
    return benchlib.within_slo(ok, ttft, tpot, SLO)


def interval(requests: list[list[Any]], lo: float, hi: float) -> dict[str, Any]:
    """Requests sent in ``[lo, hi)`` s of the replay: offered and SLO-meeting rates per second of it."""
    span = max(hi - lo, 1e-9)
    picked = [r for r in requests if lo <= r[0] < hi]
    met = sum(meets_slo(r) for r in picked)
    return {
        "from_s": round(lo, 1),
        "to_s": round(hi, 1),
        "sent": len(picked),
        "failed": sum(1 for r in picked if not r[1]),
        "slo_met": met,
        "offered_rps": round(len(picked) / span, 3),
        "goodput_rps": round(met / span, 3),
        "slo_attainment": round(met / len(picked), 3) if picked else None,
    }


def first_t(samples: list[dict[str, Any]], after: float, pred: Any) -> float | None:
    """``t`` of the first sample at or after ``after`` satisfying ``pred``."""
    return next((s["t"] for s in samples if s["t"] >= after and pred(s)), None)


def gpu_hours(samples: list[dict[str, Any]], lo: float, hi: float) -> float:
    """∫ Ready decode head pods × GPUs per replica dt over ``[lo, hi]`` s (step-wise between samples), h."""
    pts = [s for s in samples if s["t"] <= hi]
    total = 0.0
    for a, b in itertools.pairwise(pts):
        t0, t1 = max(a["t"], lo), min(b["t"], hi)
        if t1 > t0:
            total += a["ready_heads"] * GPUS_PER_REPLICA * (t1 - t0)
    if pts and pts[-1]["t"] < hi:
        total += pts[-1]["ready_heads"] * GPUS_PER_REPLICA * (hi - max(pts[-1]["t"], lo))
    return total / 3600.0


def timeline(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The samples where ``spec.replicas``, Ready heads, the decision or draining changed."""
    out, prev = [], None
    for s in samples:
        key = (s["spec_replicas"], s["ready_heads"], s["decision"], s["reason"], tuple(s["draining"]))
        if key != prev:
            out.append(
                {k: s[k] for k in ("t", "spec_replicas", "ready_heads", "decision", "reason", "draining")}
            )
            prev = key
    return out


def summarize(runs: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """The comparison of the autoscaled run with the fixed one (either may be missing: ``None`` figures)."""
    burst0, burst1, end = meta["burst_from_s"], meta["burst_to_s"], meta["issue_s"]
    a, f = runs.get("autoscaled"), runs.get("fixed")
    out: dict[str, Any] = {}
    if a is not None:
        s = a["samples"]
        miss = first_t(s, burst0, lambda x: (x["no_headroom_total"] or 0) > 0)
        up = first_t(s, burst0, lambda x: x["spec_replicas"] > 1)
        rdy = first_t(s, burst0, lambda x: x["ready_heads"] > 1)
        down = first_t(s, burst1, lambda x: x["spec_replicas"] == 1) if up is not None else None
        gone = first_t(s, burst1, lambda x: x["heads"] == 1 and x["ready_heads"] == 1) if up else None
        peak = max((x["spec_replicas"] for x in s), default=None)
        cut = rdy if rdy is not None else burst1
        out["time_to_scale_up_s"] = {
            "burst_start_to_first_no_headroom": None if miss is None else round(miss - burst0, 1),
            "burst_start_to_spec_replicas_raised": None if up is None else round(up - burst0, 1),
            "burst_start_to_new_replica_ready": None if rdy is None else round(rdy - burst0, 1),
            "spec_raised_to_ready": None if up is None or rdy is None else round(rdy - up, 1),
            "scale_up_stabilisation_window_s": WINDOWS["scaleUpS"],
            "within_window": None if up is None else (up - burst0) <= WINDOWS["scaleUpS"],
        }
        out["scale_down"] = {
            "burst_end_to_spec_replicas_1_s": None if down is None else round(down - burst1, 1),
            "burst_end_to_one_pod_left_s": None if gone is None else round(gone - burst1, 1),
            "scale_down_window_s": WINDOWS["scaleDownS"],
        }
        out["peak_spec_replicas"] = peak
        windows = {
            "low_before": (0.0, burst0),
            "burst_before_new_replica_ready": (burst0, cut),
            "burst_after_new_replica_ready": (cut, burst1),
            "low_after": (burst1, end),
            "whole": (0.0, end),
        }
        out["goodput"] = {
            mode: {k: interval(run["requests"], lo, hi) for k, (lo, hi) in windows.items()}
            for mode, run in (("autoscaled", a), ("fixed", f))
            if run is not None
        }
        span_end = max(end, a["samples"][-1]["t"] if a["samples"] else end)
        gh = {"autoscaled": round(gpu_hours(s, 0.0, end), 5)}
        if f is not None:
            gh["fixed_measured"] = round(gpu_hours(f["samples"], 0.0, end), 5)
        gh["fixed_nominal"] = round(meta["max_replicas"] * GPUS_PER_REPLICA * end / 3600.0, 5)
        gh["autoscaled_share_of_fixed_nominal"] = round(gh["autoscaled"] / gh["fixed_nominal"], 3)
        gh["interval_s"] = [0.0, end]
        gh["autoscaled_including_tail"] = round(gpu_hours(s, 0.0, span_end), 5)
        out["decode_gpu_hours"] = gh
        out["replicas_timeline"] = timeline(s)
    out["failed_requests"] = {m: r["failed"] + r["incomplete"] for m, r in runs.items()}
    out["missing_runs"] = [m for m in ("autoscaled", "fixed") if m not in runs]
    return out


def write_entry(args: argparse.Namespace, meta: dict[str, Any], runs: dict[str, Any]) -> None:
    """Replace ``sandbox_trace`` in ``args.out`` with the figures of ``runs`` (other keys kept)."""
    entry = {
        "kind": "measured on the sandbox twin (real API server, scheduler, controllers, operator, "
        "router; simulated engines and GPUs), wall clock",
        "command": "PYTHONPATH=operator .venv/bin/python bench/autoscale_sandbox.py --modes autoscaled; "
        "then --modes fixed (each under flock /tmp/gs/sandbox-bench.lock nice -n 5); --modes '' "
        "recomputes the figures from --raw",
        "written_at": datetime.now(UTC).replace(microsecond=0).isoformat(),
        "machine": "2 CPU cores shared with other helpers; every process (API server, etcd, scheduler, "
        "kwok, Prometheus, pod runner, engines, router, operator, load generator) runs on them",
        "method": (__doc__ or "").split("\n\n", 1)[1].split("\n\nRun:")[0],
        "fleet": {
            "prefill": f"1 x {PREFILL_CARD}",
            "decode_pool": f"{args.max_replicas} x {DECODE_CARD}",
            "model": MODEL["name"],
            "gpus_per_decode_replica": GPUS_PER_REPLICA,
        },
        "slo": SLO,
        "policy": POLICY,
        "scaling_windows": WINDOWS,
        "router": "pd-score; a request without decode KV headroom is held up to 30 s (FIFO), counted "
        "once as no-headroom (the immediate scale-up trigger)",
        "load": meta,
        "raw": str(args.raw.relative_to(REPO)) if args.raw.is_relative_to(REPO) else str(args.raw),
        **summarize(runs, meta),
        "runs": {
            m: {k: v for k, v in r.items() if k not in ("samples", "requests", "requests_columns")}
            for m, r in runs.items()
        },
    }
    benchlib.write_result(args.out, KEY, entry)
    say(f"wrote {args.out} ({KEY}, runs {sorted(runs)})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=RESULTS, help=f"results JSON; key {KEY} is replaced")
    p.add_argument("--raw", type=Path, default=RAW, help="per-run samples and requests (compact JSON)")
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--trace-start-s", type=float, default=600.0, help="where in the trace to start, s")
    p.add_argument("--low1-s", type=float, default=60.0)
    p.add_argument("--burst-s", type=float, default=150.0)
    p.add_argument("--low2-s", type=float, default=180.0)
    p.add_argument("--low-every", type=int, default=22, help="keep every k-th trace request in low phases")
    p.add_argument("--burst-every", type=int, default=7, help="keep every k-th trace request in the burst")
    p.add_argument("--max-replicas", type=int, default=2)
    p.add_argument("--tail-s", type=float, default=90.0, help="autoscaled: most s to wait for replicas 1")
    p.add_argument("--cidr-base", type=int, default=100, help="first podCIDR index of this run's nodes")
    p.add_argument("--logs", default="/tmp/gs/as-bench", help="operator logs folder")
    p.add_argument("--modes", default="autoscaled,fixed")
    args = p.parse_args(argv)

    plan = phases(args)
    load = build_load(load_trace(args.trace), args.trace_start_s, plan)
    kv = decode_kv_tokens()
    biggest = max(r.prompt_tokens + r.output_tokens for r in load)
    if 1.2 * biggest > kv:
        raise SystemExit(f"a request of {biggest} tokens never fits one decode pod ({kv} KV tokens)")
    per_phase = {ph.name: sum(ph.start_s <= r.offset_s < ph.end_s for r in load) for ph in plan}
    say(f"load: {len(load)} requests {per_phase}; decode KV pool {kv} tokens; largest request {biggest}")
    meta = {
        "trace": {"file": args.trace.name, "start_s": args.trace_start_s, "time_scale": 1.0},
        "phases": [
            {
                "name": ph.name,
                "from_s": ph.start_s,
                "to_s": ph.end_s,
                "keep_every": ph.every,
                "requests": per_phase[ph.name],
                "offered_rps": round(per_phase[ph.name] / (ph.end_s - ph.start_s), 3),
            }
            for ph in plan
        ],
        "burst_from_s": plan[1].start_s,
        "burst_to_s": plan[1].end_s,
        "issue_s": plan[-1].end_s,
        "max_replicas": args.max_replicas,
        "decode_kv_pool_tokens": kv,
        "largest_request_tokens": biggest,
        "mean_prompt_tokens": round(sum(r.prompt_tokens for r in load) / len(load), 1),
        "mean_output_tokens": round(sum(r.output_tokens for r in load) / len(load), 1),
    }
    layout = Layout.from_env()
    prom = sbcluster.read_state(layout).get("prometheus_url")
    kc = kubectl_for_layout(layout)
    if args.modes:
        install_crds(kc)
    raw = json.loads(args.raw.read_text()) if args.raw.exists() else {}
    runs: dict[str, Any] = dict(raw.get("runs") or {}) if raw.get("load") == meta else {}
    for mode in [m for m in args.modes.split(",") if m]:
        runs[mode] = run_once(kc, prom, mode, load, args)
        args.raw.write_text(json.dumps({"load": meta, "runs": runs}, separators=(",", ":")) + "\n")
        write_entry(args, meta, runs)
    if not args.modes:  # figures again from the runs already in --raw
        write_entry(args, meta, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
