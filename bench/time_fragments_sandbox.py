"""Time-limited GPU nodes ("time fragments") on the sandbox twin, under the shared trace.

Two runs with the same fleet, the same service and the same replayed load, on a shared sandbox
(``gearshift sandbox up``), each in a namespace and node pools of its own:

- ``use``: the decode GearSet's pool holds one durable L40S and one L40S whose window
  (``gearshift.io/available-until``) closes ``--window-s`` seconds after it is created. The planner
  places the decode gear's extra replica on the windowed node; at ``leaveBy`` the operator vacates it
  (shadow → drain → switch to the window-free gear on the durable node).
- ``ignore``: the same two cards exist with the same window, but the windowed one carries another node
  pool label, so the decode GearSet never selects it. This is what an operator without time-limited nodes has
  to do with a time-limited card (a scheduler that may not lose a card mid-service leaves it out); giving it
  a window too short to use instead would exercise the window test rather than ignore the node.

Prefill is an explicit gear on one durable H100 (~30 ms per mean prompt, so TTFT is not the bottleneck:
the durable decode card is). The model is Qwen2.5-7B (examples/models/qwen2.5-7b.json): the whole model
(14.2 GiB of weights plus the planner's KV reservation) is one decode stage on an L40S, and in the
simulated engine's roofline an L40S decode step of 64 sequences (the gear's maxBatch) takes
~31 ms: one replica serves at most ~2,000 tokens/s. The trace window replayed (from 1860 s, 2x: ~13.9
req/s of 158 output tokens on average, ~2,200 tokens/s) is a little more than one replica can take at
full batch, so requests queue for a decode slot on the durable card alone, and not with the windowed
replica beside it (at 1.4x, ~1,540 tokens/s, one replica kept up and both runs measured the same).

The replay (``gearshift.dev.loadgen.run_load`` through the router pod's loopback IP) starts ``--lead-in-s``
seconds before the windowed nodes' deadline in both runs, so the same trace request is sent at the same
offset from the deadline in both; it keeps issuing ``--after-s`` seconds past the deadline. A sampler reads
the namespace's pods and the decode GearSet every ``SAMPLE_S`` s (kubernetes client, loopback API server).

Figures (``--out``, key ``sandbox_trace`` of bench/results/time_fragments.json, other keys kept): failed
requests, when the last pod left the windowed nodes vs their ``leaveBy`` and deadline, and goodput
(requests sent in an interval that met the PDService's SLO, per second of the interval) in the intervals
in use / vacating / after, computed on the ``use`` run's clock and applied at the same offsets from the
deadline to the ``ignore`` run.

Run: ``PYTHONPATH=operator .venv/bin/python bench/time_fragments_sandbox.py [--out FILE]``
(measured runs under the shared lock: ``flock /tmp/gs/sandbox-bench.lock nice -n 5 ...``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import benchlib
from gearshift.dev.demo import trace as tracewin
from gearshift.dev.loadgen import DEFAULT_TRACE as TRACE
from gearshift.dev.loadgen import LoadResult, RequestRecord, load_trace, run_load
from gearshift.dev.sandbox import cluster as sbcluster
from gearshift.dev.sandbox.harness import (
    GpuNodes,
    LayoutKubectl,
    OperatorProcess,
    apply,
    install_crds,
    kubectl_for_layout,
    pod_ready,
    wait_until,
)
from gearshift.dev.sandbox.layout import Layout
from gearshift.k8s import names
from gearshift.k8s.services import ROUTER_PORT
from gearshift.testing import manifests as build

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "time_fragments.json"
SERVICE = "tfs"
PREFILL_GS = f"{SERVICE}-prefill"
DECODE_GS = f"{SERVICE}-decode"
#: Qwen/Qwen2.5-7B-Instruct's config.json (examples/models/qwen2.5-7b.json): 28 layers, hidden 3584,
#: 28/4 heads, head dim 128 (14.2 GiB of bf16 weights: one decode stage on an L40S).
MODEL = {
    "name": "Qwen/Qwen2.5-7B-Instruct",
    "numLayers": 28,
    "hiddenSize": 3584,
    "numHeads": 28,
    "numKvHeads": 4,
    "headDim": 128,
    "intermediateSize": 18944,
    "vocabSize": 152064,
    "dtype": "bfloat16",
}
#: TTFT is loose enough for one H100 prefill at this load; ITL is the A10 decode's limit (see docstring).
SLO = {"ttftMs": 300, "itlMs": 50}
#: Shortened shifting policy: a vacate may take warmS + drainTimeoutS + rollbackWindowS = 75 s, the decode
#: gear dwells 30 s; with windowMarginS 30 the operator leaves at deadline − 30 − 75 = deadline − 105 s.
POLICY = {"dwellS": 30, "warmS": 5, "drainTimeoutS": 60, "rollbackWindowS": 10, "sampleIntervalS": 1,
          "warmupTimeoutS": 90}  # fmt: skip
MARGIN_S = 30.0
DURABLE, WINDOWED = 1, 1
CARD = "L40S-48GB"
PREFILL_CARD = "H100-80GB"
#: Seconds between samples of pods and GearSet status.
SAMPLE_S = 1.0
#: Seconds the load generator waits for requests in flight when issuing stops.
DRAIN_S = 90.0
READY_TIMEOUT_S = 150.0
#: Binning of the per-request outcomes in the results, s.
BIN_S = 10.0


#: Progress on stderr with the wall clock.
say = benchlib.sayer("tf-bench")


def manifests(
    ns: str, prefill_node: str, decode_pool: str, prom_url: str | None, workload: dict[str, int]
) -> list[dict[str, Any]]:
    """The PDService, an explicit prefill gear on ``prefill_node`` and the auto decode GearSet on
    ``decode_pool`` (latency intent only: one gear, so the only shift is the window's), planned for the
    replayed requests' mean shape ``workload`` (``promptTokens``, ``outputTokens``)."""
    prefill = build.gearset(PREFILL_GS, ns, {
        "serviceName": SERVICE, "role": "prefill", "mode": "explicit",
        "gears": [{"name": "p", "intent": "balanced", "microBatch": 4, "maxBatch": 64,
                   "stages": [{"layers": [0, 28], "nodes": [prefill_node], "gpuModel": PREFILL_CARD}]}],
    })  # fmt: skip
    decode = build.gearset(DECODE_GS, ns, {
        "serviceName": SERVICE, "role": "decode", "mode": "auto",
        "plan": {"intents": ["latency"], "workload": workload,
                 "constraints": {"nodeSelector": {"gearshift.io/node-pool": decode_pool},
                                 "maxStages": 1, "windowMarginS": MARGIN_S}},
        "policy": POLICY,
    })  # fmt: skip
    spec: dict[str, Any] = {
        "model": MODEL,
        "engine": "sim",
        "prefill": {"gearSetRef": {"name": PREFILL_GS}},
        "decode": {"gearSetRef": {"name": DECODE_GS}},
        "slo": SLO,
    }
    if prom_url:
        spec["prometheusUrl"] = prom_url  # in-flight counts end the drain as soon as the old gear is idle
    pds = build.pdservice(SERVICE, ns, spec)
    return [prefill, decode, pds]


@dataclass
class Sample:
    """One look at the namespace, ``t`` in Unix seconds."""

    t: float
    on_windowed: list[dict[str, Any]]
    """``{pod, node, gear, ready}`` of the pods on the windowed nodes."""
    active_gear: str | None
    phase: str | None
    target_gear: str | None
    windowed_nodes: list[dict[str, Any]]
    decode_ready: int
    """Ready decode engine pods (all gears)."""


@dataclass
class Sampler(benchlib.PeriodicSampler[Sample]):
    """Samples pods and the decode GearSet every ``SAMPLE_S`` s on a thread until :meth:`stop`."""

    core: Any
    custom: Any
    ns: str
    windowed: list[str]
    interval_s = SAMPLE_S

    def once(self) -> Sample:
        """One sample (two API calls)."""
        t = time.time()
        pods = self.core.list_namespaced_pod(self.ns, _request_timeout=10).items
        gs = self.custom.get_namespaced_custom_object(
            "gearshift.io", "v1alpha1", self.ns, "gearsets", DECODE_GS, _request_timeout=10
        )
        st = gs.get("status") or {}
        on_w, decode_ready = [], 0
        for p in pods:
            d = p.to_dict()
            # pod_ready reads the API's camelCase shape: map the client's snake_case fields.
            view = {
                "metadata": {"deletionTimestamp": d["metadata"].get("deletion_timestamp")},
                "status": {"conditions": [{"type": c["type"], "status": c["status"]}
                                          for c in (d["status"] or {}).get("conditions") or []]},
            }  # fmt: skip
            ready = pod_ready(view)
            labels = d["metadata"].get("labels") or {}
            if labels.get(names.LABEL_ROLE) == "decode" and ready:
                decode_ready += 1
            node = (d.get("spec") or {}).get("node_name")
            if node in self.windowed:
                on_w.append({"pod": d["metadata"]["name"], "node": node,
                             "gear": labels.get(names.LABEL_GEAR), "ready": ready})  # fmt: skip
        return Sample(t, on_w, st.get("activeGear"), st.get("phase"), st.get("targetGear"),
                      list(st.get("windowedNodes") or []), decode_ready)  # fmt: skip


@dataclass
class RunOut:
    """What one run measured."""

    mode: str
    deadline: datetime
    t_load0: float
    """Unix time the replay started."""
    result: LoadResult
    sent_wall: list[float]
    """Each record's send time, Unix seconds (same order as ``result.records``)."""
    samples: list[Sample]
    sampler_errors: int
    gearset_status: dict[str, Any]
    windowed_nodes: list[str]
    setup_s: float
    decode_gear: dict[str, Any] | None


def run_once(
    kc: LayoutKubectl, prom_url: str | None, mode: str, win: tracewin.Window, args: argparse.Namespace
) -> RunOut:
    """One run (``use`` or ``ignore``): own namespace and nodes, operator, service, replay, teardown."""
    tag = uuid.uuid4().hex[:6]
    ns = f"bench-tf-{mode}-{tag}"
    kc.kubectl("create", "namespace", ns)
    nodes = GpuNodes(kc, f"bench-tf{mode[0]}", cidr_base=args.cidr_base, gpu_replicas=2)
    op: OperatorProcess | None = None
    sampler: Sampler | None = None
    t_setup = time.time()
    try:
        deadline = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=args.window_s)
        prefill_node = nodes.add(PREFILL_CARD, "p")
        durable = [nodes.add(CARD, "d") for _ in range(DURABLE)]
        # ignore: same cards and windows, another pool, so the decode GearSet never selects them.
        windowed = [nodes.add(CARD, "d" if mode == "use" else "w", until=deadline) for _ in range(WINDOWED)]
        say(f"{mode}: namespace {ns}; prefill {prefill_node}; durable {durable}; windowed {windowed} "
            f"until {deadline.isoformat()}")  # fmt: skip
        op = OperatorProcess(kc, ns, Path(args.logs) / f"operator-{mode}-{tag}.log")
        shape = {
            "promptTokens": round(sum(r.prompt_tokens for r in win.requests) / len(win.requests)),
            "outputTokens": round(sum(r.output_tokens for r in win.requests) / len(win.requests)),
        }
        apply(kc, manifests(ns, prefill_node, nodes.pool("d"), prom_url, shape))

        core, custom = benchlib.kube_clients(kc)
        sampler = Sampler(core, custom, ns, windowed)

        def ready() -> str | None:
            pds = custom.get_namespaced_custom_object("gearshift.io", "v1alpha1", ns, "pdservices", SERVICE)
            if (pds.get("status") or {}).get("phase") != "Ready":
                return None
            s = sampler.once()
            if mode == "use" and sum(p["ready"] for p in s.on_windowed) < WINDOWED:
                return None
            return benchlib.ready_router_ip(core, ns, SERVICE)

        ip = wait_until(
            ready, READY_TIMEOUT_S, "the PDService Ready, the router, and (use) pods on the windowed nodes"
        )
        assert ip.startswith("127."), f"router pod IP {ip} is not loopback"
        url = f"http://{ip}:{ROUTER_PORT}"
        gs = custom.get_namespaced_custom_object("gearshift.io", "v1alpha1", ns, "gearsets", DECODE_GS)
        planned = (gs.get("status") or {}).get("plannedGears") or []
        decode_gear = next((g for g in planned if g.get("name") == gs["status"].get("activeGear")), None)
        setup_s = time.time() - t_setup
        start_at = deadline.timestamp() - args.lead_in_s
        if time.time() > start_at:
            raise RuntimeError(
                f"setup took {setup_s:.0f} s: past the replay's start ({args.lead_in_s:g} s before the "
                "deadline); raise --window-s"
            )
        say(f"{mode}: ready after {setup_s:.0f} s (router {url}); replay starts in "
            f"{start_at - time.time():.0f} s")  # fmt: skip
        sampler.start()
        time.sleep(max(0.0, start_at - time.time()))
        perf0, t_load0 = time.perf_counter(), time.time()
        res = benchlib.replay(
            lambda: run_load([url], list(win.requests), time_scale=win.time_scale,
                             max_requests=len(win.requests), max_duration_s=win.run_s + 1.0, drain_s=DRAIN_S,
                             stream=True, model=MODEL["name"], slo_ttft_ms=SLO["ttftMs"],
                             slo_itl_ms=SLO["itlMs"]),
            win.run_s + DRAIN_S + 60,
        )  # fmt: skip
        sampler.stop()
        sent_wall = [t_load0 + (r.sent_at - perf0) for r in res.records]
        gs = custom.get_namespaced_custom_object("gearshift.io", "v1alpha1", ns, "gearsets", DECODE_GS)
        say(f"{mode}: {res.issued} issued, {res.completed} completed, {res.failed} failed, "
            f"{res.incomplete} incomplete; goodput {res.goodput_rps:.2f} req/s")  # fmt: skip
        return RunOut(mode, deadline, t_load0, res, sent_wall, sampler.samples, sampler.errors,
                      gs.get("status") or {}, windowed, setup_s, decode_gear)  # fmt: skip
    finally:
        if sampler is not None:
            sampler.stop()
        benchlib.teardown(kc, ns, op, nodes, say)


# --------------------------------------------------------------------------------------- analysis


def vacate_times(samples: list[Sample]) -> dict[str, float | None]:
    """From the ``use`` run's samples (Unix s): the last sample with a pod on a windowed node, the first
    after it with none (the vacate's end), and when the GearSet left Stable for the window shift."""
    last_on = max((s.t for s in samples if s.on_windowed), default=None)
    first_off = next((s.t for s in samples if last_on is not None and s.t > last_on), None)
    shift = next((s.t for s in samples if s.phase not in (None, "Stable")), None)
    draining = next((s.t for s in samples if s.phase == "Draining"), None)
    return {"last_pod_seen_s": last_on, "vacated_s": first_off, "shift_started_s": shift,
            "draining_started_s": draining}  # fmt: skip


def interval_stats(recs: list[RequestRecord], sent: list[float], lo: float, hi: float) -> dict[str, Any]:
    """Requests sent in ``[lo, hi)`` (Unix s): offered and SLO-meeting rates per second of the interval."""
    span = max(hi - lo, 1e-9)
    picked = [r for r, t in zip(recs, sent, strict=True) if lo <= t < hi]
    met = sum(1 for r in picked if meets_slo(r))
    return {
        "span_s": round(span, 1),
        "sent": len(picked),
        "completed": sum(r.ok for r in picked),
        "failed": sum(1 for r in picked if not r.ok and r.error != "incomplete"),
        "incomplete": sum(1 for r in picked if r.error == "incomplete"),
        "slo_met": met,
        "offered_rps": round(len(picked) / span, 3),
        "goodput_rps": round(met / span, 3),
        "slo_attainment": round(met / len(picked), 4) if picked else None,
    }


def meets_slo(r: RequestRecord) -> bool:
    """The load generator's SLO test (TTFT ≤ ttftMs and TPOT ≤ itlMs) on one finished request."""
    tpot = r.tpot_s
    return benchlib.within_slo(
        r.ok, None if r.ttft_s is None else r.ttft_s * 1e3, None if tpot is None else tpot * 1e3, SLO
    )


def bins(run: RunOut, t0: float, end: float) -> list[dict[str, Any]]:
    """Per ``BIN_S`` bin of send time (s from ``t0``, the deadline-aligned replay start): sent, completed,
    failed, SLO met, and the pods on the windowed nodes at the bin's last sample."""
    n = max(1, math.ceil((end - t0) / BIN_S))
    out = []
    for k in range(n):
        lo, hi = t0 + k * BIN_S, t0 + (k + 1) * BIN_S
        st = interval_stats(run.result.records, run.sent_wall, lo, hi)
        last = [s for s in run.samples if s.t < hi]
        on_w = sum(p["ready"] for p in last[-1].on_windowed) if last else None
        keep = ("sent", "completed", "failed", "slo_met")
        out.append({"t_s": k * BIN_S, **{key: st[key] for key in keep}, "ready_pods_on_windowed": on_w})
    return out


def timeline(run: RunOut) -> list[dict[str, Any]]:
    """The samples where something changed: s from the deadline, the decode GearSet's active gear, phase,
    target and windowed-node states, and the pods on the windowed nodes (``pod@node`` and Ready)."""
    out: list[dict[str, Any]] = []
    d = run.deadline.timestamp()
    for s in run.samples:
        row = {
            "active": s.active_gear,
            "phase": s.phase,
            "target": s.target_gear,
            "windowed_states": [w.get("state") for w in s.windowed_nodes],
            "pods_on_windowed": sorted(f"{p['pod']}@{p['node']}{'' if p['ready'] else ' (not Ready)'}"
                                       for p in s.on_windowed),
        }  # fmt: skip
        if not out or {k: v for k, v in out[-1].items() if k != "t_s"} != row:
            out.append({"t_s": round(s.t - d, 1), **row})
    return out


def summarize(use: RunOut, ign: RunOut, win: tracewin.Window, args: argparse.Namespace) -> dict[str, Any]:
    """The ``sandbox_trace`` entry: phases on the use run's clock, applied to both runs relative to their
    deadlines (the replay starts ``lead_in_s`` before each run's deadline)."""
    vt = vacate_times(use.samples)
    d_use = use.deadline.timestamp()
    ws = next((s.windowed_nodes for s in use.samples if s.windowed_nodes), [])
    leave_by = min((datetime.fromisoformat(w["leaveBy"]).timestamp() for w in ws), default=None)
    issue_end_rel = win.run_s - args.lead_in_s  # issuing ends this long after the deadline
    rel = {  # seconds relative to the deadline
        "replay_start": -args.lead_in_s,
        "leave_by": None if leave_by is None else leave_by - d_use,
        "vacated": None if vt["vacated_s"] is None else vt["vacated_s"] - d_use,
        "issue_end": issue_end_rel,
    }
    phases: dict[str, tuple[float, float]] = {}
    if rel["leave_by"] is not None and rel["vacated"] is not None:
        phases = {
            "windowed_in_use": (rel["replay_start"], rel["leave_by"]),
            "vacating": (rel["leave_by"], rel["vacated"]),
            "while_used": (rel["replay_start"], rel["vacated"]),
            "after": (rel["vacated"], rel["issue_end"]),
            "whole": (rel["replay_start"], rel["issue_end"]),
        }
    runs = {}
    for run in (use, ign):
        d = run.deadline.timestamp()
        res = run.result
        stats = {p: interval_stats(res.records, run.sent_wall, d + a, d + b) for p, (a, b) in phases.items()}
        ran = sorted({(p["pod"], p["node"], p["gear"]) for s in run.samples for p in s.on_windowed})
        hist = [{k: h.get(k) for k in ("from", "to", "trigger", "outcome", "startedAt", "finishedAt")}
                for h in run.gearset_status.get("history") or []]  # fmt: skip
        runs[run.mode] = {
            "issued": res.issued,
            "completed": res.completed,
            "failed": res.failed,
            "incomplete": res.incomplete,
            "errors": dict(list(res.errors.items())[:10]),
            "goodput_rps_whole_run": None if res.goodput_rps is None else round(res.goodput_rps, 3),
            "ttft_ms": res.ttft_ms,
            "tpot_ms": res.tpot_ms,
            "phases": stats,
            "decode_gear": run.decode_gear,
            "pods_seen_on_windowed_nodes": [{"pod": a, "node": b, "gear": c} for a, b, c in ran],
            "decode_history": hist,
            "final_windowed_nodes": run.gearset_status.get("windowedNodes"),
            "setup_s": round(run.setup_s, 1),
            "samples": len(run.samples),
            "sampler_errors": run.sampler_errors,
            "timeline_from_deadline": timeline(run),
            "bins": bins(run, d - args.lead_in_s, d + issue_end_rel),
        }
    u, g = runs["use"]["phases"], runs["ignore"]["phases"]
    vac = rel["vacated"]
    return {
        "kind": "measured on the sandbox twin (real API server, scheduler, controllers, operator, router; "
        "simulated engines and GPUs)",
        "command": "PYTHONPATH=operator .venv/bin/python bench/time_fragments_sandbox.py",
        "measured_at": datetime.now(UTC).replace(microsecond=0).isoformat(),
        "machine": "2 CPU cores shared with other users of the sandbox and other helpers; every process "
        "(API server, etcd, scheduler, kwok, pod runner, engines, router, operator, load generator) on them",
        "method": (
            f"Two runs, same fleet and load. Fleet: prefill on 1 {PREFILL_CARD} (explicit gear); decode "
            f"(auto, latency intent only, maxStages 1) on {DURABLE} durable {CARD} plus {WINDOWED} {CARD} "
            f"whose window closes {args.window_s:g} s after they are created. 'use': the windowed cards are "
            "in the decode pool; 'ignore': the same cards with the same windows exist but carry another pool "
            "label, so the decode GearSet never selects them (what an operator without time-window handling "
            "does with them). Load: the shared trace replayed through the router pod's loopback IP, "
            f"starting {args.lead_in_s:g} s before each run's deadline and issuing until "
            f"{issue_end_rel:g} s after it, streaming. Goodput: requests sent in the interval that met the "
            f"PDService SLO (TTFT <= {SLO['ttftMs']} ms, TPOT <= {SLO['itlMs']} ms), per second of the "
            "interval. Intervals are relative to the deadline, from the 'use' run: in use until leaveBy, "
            "vacating until the first sample (every 1 s) with no pod on the windowed nodes, after that until "
            "issuing ends; the same offsets are applied to the 'ignore' run."
        ),
        "trace": {
            "file": TRACE.name,
            "start_s": win.start_s,
            "span_s": round(win.span_s, 1),
            "time_scale": win.time_scale,
            "requests": len(win.requests),
            "offered_rps": round(win.mean_rate(), 3),
        },
        "slo": SLO,
        "policy": {**POLICY, "windowMarginS": MARGIN_S},
        "window_s": args.window_s,
        "relative_to_deadline_s": {k: None if v is None else round(v, 1) for k, v in rel.items()},
        "vacate": {
            "leave_by_before_deadline_s": None if rel["leave_by"] is None else round(-rel["leave_by"], 1),
            "shift_started_before_deadline_s": None
            if vt["shift_started_s"] is None
            else round(d_use - vt["shift_started_s"], 1),
            "traffic_off_windowed_before_deadline_s": None
            if vt["draining_started_s"] is None
            else round(d_use - vt["draining_started_s"], 1),
            "last_pod_off_before_deadline_s": None if vac is None else round(-vac, 1),
            "vacated_before_deadline": vac is not None and vac <= 0,
            "vacated_before_deadline_minus_margin": vac is not None and vac <= -MARGIN_S,
        },
        "failed_requests": {"use": runs["use"]["failed"], "ignore": runs["ignore"]["failed"]},
        "goodput_rps": {p: {"use": u[p]["goodput_rps"], "ignore": g[p]["goodput_rps"]} for p in u},
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=RESULTS, help="results JSON; key sandbox_trace is replaced")
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--trace-start-s", type=float, default=1860.0, help="where in the trace to start, s")
    p.add_argument("--time-scale", type=float, default=2.0)
    p.add_argument("--window-s", type=float, default=300.0, help="window length from node creation, s")
    p.add_argument("--lead-in-s", type=float, default=240.0, help="replay start before the deadline, s")
    p.add_argument("--after-s", type=float, default=90.0, help="issuing continues this long past it, s")
    p.add_argument("--cidr-base", type=int, default=50, help="first podCIDR index of this run's nodes")
    p.add_argument("--logs", default="/tmp/gs/tf-bench", help="operator logs folder")
    p.add_argument("--modes", default="use,ignore")
    args = p.parse_args(argv)

    layout = Layout.from_env()
    state = sbcluster.read_state(layout)
    prom = state.get("prometheus_url")
    kc = kubectl_for_layout(layout)
    install_crds(kc)
    trace = load_trace(args.trace)
    win = tracewin.window(trace, args.time_scale, args.lead_in_s + args.after_s, args.trace_start_s)
    say(f"trace window: {len(win.requests)} requests, {win.run_s:.0f} s, {win.mean_rate():.2f} req/s")
    outs = {m: run_once(kc, prom, m, win, args) for m in args.modes.split(",")}
    if set(outs) != {"use", "ignore"}:
        say("both modes are needed for the figures; nothing written")
        return 0
    entry = summarize(outs["use"], outs["ignore"], win, args)
    benchlib.write_result(args.out, "sandbox_trace", entry)
    say(f"wrote {args.out} (sandbox_trace): goodput {json.dumps(entry['goodput_rps'])}; "
        f"vacate {json.dumps(entry['vacate'])}; failed {entry['failed_requests']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
