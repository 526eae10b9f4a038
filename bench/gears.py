"""Gear-shifting benchmark (issue 9): the Azure conversation trace on the mixed fleet, in virtual time.

What is real and what is modelled:

- **Real code**: the planner (:func:`gearshift.planner.plan` on the fleet's resource profile, as the
  operator's reconciler calls it, ``sim_requests=500`` as its ``Settings``), the API gears
  (:func:`gearshift.planner.inputs.api_gear`), the simulated engine's pipeline document
  (:func:`gearshift.k8s.engine.sim_pipeline` with :func:`gearshift.planner.inputs.gear_links`), the simulated
  engine itself (:class:`gearshift.sim.engine.Engine`: its scheduler, paged KV pool, preemption and
  :class:`~gearshift.sim.perfmodel.PerfModel` roofline timing, driven by its ``begin_step``/``end_step``
  hook), and the operator's pure control code: :func:`gearshift.control.decide.decide`,
  :func:`gearshift.control.executor.step`, :func:`gearshift.control.adapt.policy_from_api` with the
  GearSet API's default :class:`~gearshift.api.gearset.ShiftPolicy`.
- **Simulated here**: time (virtual: one trace hour = 3600 virtual seconds, no wall-clock sleeps); the
  router (shortest queue, ``running + waiting``, over the selected gear's head pods, each queue divided by
  the head's GPU prior -- the PD router's seed-000 prior, :func:`gearshift.facts.gpus.pd_gpu_prior`, of its
  slowest card -- so that a whole-model replica on an A100 beside the H100s takes a smaller share, as the
  real router's GPU term does; identical heads reduce to plain shortest queue); Prometheus (the same numbers
  its queries would give: stage utilisation from the engines' gauge, summed queue/running, completions over
  the last minute, P50/P99 by ``histogram_quantile`` interpolation over the engines' own histogram buckets
  of the last minute); the Kubernetes side of the executor's actions (``EnsureGear`` creates the gear's
  engines, Ready after its weights load at the policy's ``transferGbps``; ``SelectGear`` moves new requests;
  the old gear keeps and finishes its in-flight requests; ``DeleteGear`` removes it, failing whatever it
  still holds).
- **Not modelled**: prefill/decode disaggregation (the engines run the combined ``both`` role on the
  whole fleet), contention between two gears that share a GPU during a shift (each gear's engines are
  timed as if alone), shadow warm-up traffic (shadows take none; with one GPU per node and gears sharing
  nodes the executor runs them ``Degraded`` anyway), network between client and router.

A request *fails* when the engine rejects it (too long for the KV pool), when its first token comes more
than ``--timeout`` (60 s) after arrival (the client gave up; the engine is not told), when it is still
unfinished at the end of the run, or when its gear is deleted under it. It meets the SLO when its TTFT
≤ 200 ms and its mean inter-token latency (TPOT, ``(last − first token) / (tokens − 1)``) ≤ 50 ms
(DESIGN.md's targets; TPOT as DistServe's goodput, Zhong et al. OSDI 2024). Goodput = requests meeting
the SLO / trace duration (requests/s).

Run: ``PYTHONPATH=operator .venv/bin/python bench/gears.py`` (writes ``bench/results/gears.json``).
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import heapq
import itertools
import json
import math
import os
import platform
import resource
import sys
import time
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "operator"))

from gearshift import planner  # noqa: E402
from gearshift.api.gearset import Gear as ApiGear  # noqa: E402
from gearshift.api.gearset import ShiftPolicy as ApiShiftPolicy  # noqa: E402
from gearshift.control.adapt import gear_views, policy_from_api, shift_request  # noqa: E402
from gearshift.control.decide import DecisionKind, DecisionState, decide  # noqa: E402
from gearshift.control.executor import (  # noqa: E402
    DeleteGear,
    EnsureGear,
    GearObservation,
    MarkUnhealthy,
    RecordShift,
    SelectGear,
    ShiftState,
    World,
    step,
)
from gearshift.control.policy import GearTable, ShiftRules  # noqa: E402
from gearshift.control.smoothing import Sample  # noqa: E402
from gearshift.dev.demo.series import histogram_quantile  # noqa: E402
from gearshift.dev.loadgen import DEFAULT_TRACE as TRACE  # noqa: E402
from gearshift.facts import fleet as fleet_mod  # noqa: E402
from gearshift.facts.gpus import pd_gpu_prior  # noqa: E402
from gearshift.facts.model import ModelArch, load_hf_config  # noqa: E402
from gearshift.k8s.engine import sim_pipeline  # noqa: E402
from gearshift.planner.inputs import api_gear, gear_links, initial_gear  # noqa: E402
from gearshift.sim.engine import Engine, PlannedStep, RequestRejected, SimRequest  # noqa: E402
from gearshift.sim.perfmodel import PerfModel, PerfParams, parse_pipeline  # noqa: E402

FLEET = ROOT / "examples" / "fleets/mixed.yaml"
MODEL = ROOT / "examples" / "models" / "llama-3-8b.json"
OUT = ROOT / "bench" / "results" / "gears.json"

#: SLOs (DESIGN.md: target TTFT 200 ms, target ITL 50 ms), s.
SLO_TTFT_S = 0.200
SLO_ITL_S = 0.050
#: A client gives up when the first token is later than this, s (the brief's "timeouts > 60 s").
CLIENT_TIMEOUT_S = 60.0
#: vLLM's ``--gpu-memory-utilization`` default; the reconciler's resource profile scales memory by it.
MEMORY_UTILIZATION = 0.9
#: The reconciler's planner setting (gearshift.handlers.reconcile.Settings.sim_requests).
PLAN_SIM_REQUESTS = 500
#: Window of the QPS and quantile queries (gearshift.control.signals: ``[1m]``), s.
PROM_WINDOW_S = 60.0
#: How long an engine that has waiting requests but could schedule nothing retries (Engine.run's poll), s.
RETRY_S = 0.005
#: Most virtual seconds simulated after the last arrival, to let in-flight requests finish.
TAIL_S = 300.0


# --- trace -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Trace:
    """Arrivals (s from the first), prompt and output token counts, in arrival order."""

    t: np.ndarray
    prompt: np.ndarray
    output: np.ndarray
    speed: float = 1.0
    """The time compression ``t`` was replayed at: ``t`` = original trace seconds / ``speed``."""

    @property
    def duration_s(self) -> float:
        return float(self.t[-1]) if len(self.t) else 0.0

    @property
    def trace_hours(self) -> float:
        """Hours of the original trace the replay covers (``duration_s`` × ``speed`` / 3600)."""
        return self.duration_s * self.speed / 3600.0


def load_trace(path: Path, limit_s: float | None = None, speed: float = 1.0) -> Trace:
    """Read the Azure LLM inference trace (``TIMESTAMP,ContextTokens,GeneratedTokens``).

    ``speed`` > 1 compresses time (arrivals ``speed`` times denser); ``limit_s`` keeps the first seconds of
    the (compressed) trace. Token counts are used as given (an output of 0 counts as 1).
    """
    ts, pr, out = [], [], []
    with path.open() as fh:
        for row in csv.DictReader(fh):
            ts.append(dt.datetime.fromisoformat(row["TIMESTAMP"][:26]).timestamp())
            pr.append(max(1, int(row["ContextTokens"])))
            out.append(max(1, int(row["GeneratedTokens"])))
    t = (np.array(ts) - ts[0]) / speed
    order = np.argsort(t, kind="stable")
    t, p, o = t[order], np.array(pr)[order], np.array(out)[order]
    if limit_s is not None:
        keep = t <= limit_s
        t, p, o = t[keep], p[keep], o[keep]
    return Trace(t, p, o, speed)


# --- gears -------------------------------------------------------------------------------------------
@dataclass
class GearSpec:
    """A gear as the benchmark runs it: the API gear and the pipeline document of its head pods."""

    name: str
    api: ApiGear
    pipeline_doc: dict[str, Any]
    heads: int
    """Head pods = pipeline replicas (stage 0's replicas), each simulating the whole pipeline."""
    nodes: frozenset[str]
    load_s: float
    head_docs: list[dict[str, Any]] = field(default_factory=list)
    """The pipeline document of each head: replica r's stages on ``nodes[r]``'s GPU models."""
    """Time for its pods to load their weights at the policy's transfer rate (pods load in parallel), s."""


def plan_gears(
    arch: ModelArch, policy: ShiftRules, workload: tuple[int, int] = (512, 128)
) -> tuple[list[GearSpec], GearSpec, dict[str, Any]]:
    """The planner's three gears on the whole fleet, and the even layer split over the throughput gear's
    nodes (the deepest gear: every node of the fleet), with the same pipeline replicas and micro-batch.

    ``workload``: (mean prompt, mean output) tokens the planner prices requests with (a GearSet's
    ``spec.plan.workload``); engines run the combined role, so the planner prices both phases."""
    fl = fleet_mod.load_fleet(FLEET)
    doc = fleet_mod.datasheet_profile(fl)
    for n in doc["nodes"]:  # as gearshift.planner.inputs.resource_profile: usable memory only
        n["memory_gb"] = round(n["memory_gb"] * MEMORY_UTILIZATION, 6)
    profile = planner.parse_profile(doc)
    shape = planner.RooflineAssumptions(prompt_tokens=workload[0], output_tokens=workload[1], role="both")
    cost = planner.RooflineCostModel(arch, shape)
    result = planner.plan(profile, cost, sim_requests=PLAN_SIM_REQUESTS)
    specs = []
    for g in result.gears:
        api = api_gear(g, g.name, doc, {})
        specs.append(_spec(api, profile, arch, policy))
    # Even split: the throughput gear's node sequence per pipeline replica, layers as even as possible.
    thr = next(s for s in specs if s.name == "throughput")
    order = [st.nodes[0] for st in thr.api.stages]
    cuts = planner.even_split(cost.at(thr.api.micro_batch), order)
    gpu = {n.name: n.gpu.model for n in fl.nodes}
    reps = thr.api.stages[0].replicas
    stages = [
        {
            "layers": [a, b],
            "replicas": reps,
            "gpus": 1,
            "nodes": [thr.api.stages[k].nodes[r] for r in range(reps)],
            "gpuModel": gpu[ids[0]],
        }
        for k, (a, b, ids) in enumerate(cuts)
    ]
    even_api = ApiGear.model_validate(
        {
            "name": "even",
            "intent": "throughput",
            "stages": stages,
            "microBatch": thr.api.micro_batch,
            "maxBatch": thr.api.max_batch,
        }
    )
    even = _spec(even_api, profile, arch, policy)
    bottleneck, times, _ = planner.evaluate(
        profile, cost.at(thr.api.micro_batch), [(a, b, [ids[0]]) for a, b, ids in cuts]
    )
    info = {
        "planner_qps": round(result.qps, 3),
        "gears": [g.to_dict() for g in result.gears],
        "even": {
            "layers": [[a, b] for a, b, _ in cuts],
            "nodes": [ids[0] for _, _, ids in cuts],
            "bottleneck_ms": round(bottleneck, 3),
            "stage_ms": [round(x, 3) for x in times],
        },
    }
    return specs, even, info


def with_max_batch(spec: GearSpec, max_batch: int) -> GearSpec:
    """The same gear with ``maxBatch`` (vLLM ``--max-num-seqs``) set to ``max_batch``: a what-if."""
    api = spec.api.model_copy(update={"max_batch": max_batch})
    return replace(spec, api=api, pipeline_doc={**spec.pipeline_doc, "maxBatch": max_batch})


def _spec(api: ApiGear, profile: planner.Profile, arch: ModelArch, policy: ShiftRules) -> GearSpec:
    doc = sim_pipeline(api, gear_links(api, profile))
    load = max(arch.stage_weight_bytes(s.start, s.end) for s in api.stages) / (policy.transfer_gbps * 1e9)
    nodes = frozenset(n for s in api.stages for n in s.nodes)
    heads = api.stages[0].replicas
    gpu = {n.node_id: n.gpu_model for n in profile.nodes}
    head_docs = []
    for r in range(heads):
        # Each head pod is timed with its own replica's cards (gpuModel names only the first node's).
        hd = json.loads(json.dumps(doc))
        for k, st in enumerate(api.stages):
            if r < len(st.nodes) and gpu.get(st.nodes[r]):
                hd["stages"][k]["gpu"] = gpu[st.nodes[r]]
                hd["stages"][k]["node"] = st.nodes[r]
        head_docs.append(hd)
    return GearSpec(api.name, api, doc, heads, nodes, load, head_docs)


# --- the simulated world -----------------------------------------------------------------------------
class VClock:
    """The virtual clock every engine reads, s."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ItlRecorder:
    """Stands in for an engine's ITL histogram child: records every gap (s) and forwards it."""

    def __init__(self, inner: Any, sink: array) -> None:
        self._inner = inner
        self._sink = sink

    def observe(self, value: float) -> None:
        self._sink.append(value)
        self._inner.observe(value)


@dataclass
class Head:
    """One head pod: its engine and its step in flight."""

    engine: Engine
    stepping: bool = False
    weight: float = 1.0
    """Routing weight: the PD router's GPU prior of the head's slowest card (gearshift.facts.gpus)."""


@dataclass
class LiveGear:
    """A gear whose engines exist."""

    spec: GearSpec
    heads: list[Head]
    created_at: float
    ready_at: float
    kv_pool: bool = True
    snapshots: deque[tuple[float, dict[str, list[tuple[float, float]]], float]] = field(default_factory=deque)
    """(time, cumulative histogram buckets by metric, cumulative successes) per sample (the 1m window)."""

    def in_flight(self) -> int:
        return sum(h.engine.num_running() + h.engine.num_waiting() for h in self.heads)


@dataclass
class Outcomes:
    """Per-request results, indexed like the trace."""

    n: int
    ttft: np.ndarray = field(init=False)
    tpot: np.ndarray = field(init=False)
    failed: np.ndarray = field(init=False)
    reasons: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.ttft = np.full(self.n, np.nan)
        self.tpot = np.full(self.n, np.nan)
        self.failed = np.zeros(self.n, dtype=bool)

    def fail(self, i: int, reason: str) -> None:
        if not self.failed[i]:
            self.failed[i] = True
            self.reasons[reason] = self.reasons.get(reason, 0) + 1


HIST_NAMES = {
    "vllm:time_to_first_token_seconds": "ttft",
    "vllm:inter_token_latency_seconds": "itl",
    "vllm:e2e_request_latency_seconds": "e2e",
}


def _cumulative(engines: Sequence[Engine]) -> tuple[dict[str, list[tuple[float, float]]], float]:
    """Cumulative histogram buckets (le, count) summed over ``engines``, and finished requests."""
    acc: dict[str, dict[float, float]] = {v: {} for v in HIST_NAMES.values()}
    done = 0.0
    for e in engines:
        for metric in e.metrics.registry.collect():
            key = HIST_NAMES.get(metric.name)
            for s in metric.samples:
                if key is not None and s.name.endswith("_bucket"):
                    le = float(s.labels["le"])
                    acc[key][le] = acc[key].get(le, 0.0) + s.value
                elif s.name == "vllm:request_success_total":
                    done += s.value
    return {k: sorted(v.items()) for k, v in acc.items()}, done


class Sim:
    """Engines of the live gears, the router, and the event queue, in virtual time."""

    def __init__(self, arch: ModelArch, trace: Trace, policy: ShiftRules, itl_sink: array) -> None:
        self.arch = arch
        self.trace = trace
        self.policy = policy
        self.clock = VClock()
        self.gears: dict[str, LiveGear] = {}
        self.selected: str | None = None
        self.events: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()
        self.out = Outcomes(len(trace.t))
        self.where: dict[int, tuple[str, SimRequest]] = {}
        self.itl_sink = itl_sink
        self.steps = 0

    # events
    def push(self, t: float, kind: str, data: Any = None) -> None:
        heapq.heappush(self.events, (t, next(self._seq), kind, data))

    # gears
    def ensure(self, spec: GearSpec, now: float, ready_now: bool = False) -> LiveGear:
        if spec.name in self.gears:
            return self.gears[spec.name]
        heads = []
        for r in range(spec.heads):
            pipe = parse_pipeline(spec.head_docs[r] if spec.head_docs else spec.pipeline_doc, self.arch)
            e = Engine(
                PerfModel(self.arch, pipe, PerfParams()),
                role="both",
                model_name=self.arch.name,
                clock=self.clock,
            )
            e.metrics.itl = ItlRecorder(e.metrics.itl, self.itl_sink)  # type: ignore[assignment]
            heads.append(Head(e, weight=min(pd_gpu_prior(st.gpu) for st in pipe.stages)))
        ready = now if ready_now else now + spec.load_s
        live = LiveGear(spec, heads, now, ready)
        self.gears[spec.name] = live
        return live

    def delete(self, name: str) -> None:
        live = self.gears.pop(name, None)
        if live is None:
            return
        for i, (g, req) in list(self.where.items()):
            if g == name and not req.finished:
                self.out.fail(i, "gear deleted with the request in flight")
                del self.where[i]

    # engines
    def kick(self, head: Head, now: float) -> None:
        if head.stepping:
            return
        st = head.engine.begin_step(now)
        if st is None:
            nxt = head.engine.next_transfer_at()
            if nxt is not None or head.engine.waiting:
                head.stepping = True
                self.push(nxt if nxt is not None else now + RETRY_S, "retry", head)
            return
        head.stepping = True
        self.push(st.end, "end", (head, st))

    def on_end(self, head: Head, st: PlannedStep, now: float) -> None:
        head.engine.end_step(st)
        self.steps += 1
        head.stepping = False
        self.kick(head, now)

    def on_arrival(self, i: int, now: float) -> None:
        live = self.gears.get(self.selected or "")
        if live is None:
            self.out.fail(i, "no gear selected")
            return
        head = min(live.heads, key=lambda h: (h.engine.num_running() + h.engine.num_waiting() + 1) / h.weight)
        try:
            req = head.engine.new_request(int(self.trace.prompt[i]), int(self.trace.output[i]))
        except RequestRejected:
            self.out.fail(i, "rejected by the engine")
            return
        self.where[i] = (live.spec.name, req)
        self.kick(head, now)

    def harvest(self) -> None:
        """Record finished requests (called at every sample and at the end)."""
        for i, (_, req) in list(self.where.items()):
            if req.finished:
                self._record(i, req)
                del self.where[i]

    def _record(self, i: int, req: SimRequest) -> None:
        arrival = req.arrival
        if req.first_token_at is not None:
            self.out.ttft[i] = req.first_token_at - arrival
            if req.generated > 1 and req.finished_at is not None:
                self.out.tpot[i] = (req.finished_at - req.first_token_at) / (req.generated - 1)
            else:
                self.out.tpot[i] = 0.0
        if req.first_token_at is None or req.first_token_at - arrival > CLIENT_TIMEOUT_S:
            self.out.fail(i, f"first token later than {CLIENT_TIMEOUT_S:g} s")

    # signals
    def sample(self, name: str, now: float) -> Sample | None:
        """What the operator's Prometheus queries would return for gear ``name`` now."""
        live = self.gears.get(name)
        if live is None:
            return None
        engines = [h.engine for h in live.heads]
        hist, done = _cumulative(engines)
        live.snapshots.append((now, hist, done))
        while len(live.snapshots) > 1 and live.snapshots[1][0] <= now - PROM_WINDOW_S:
            live.snapshots.popleft()
        t0, old, done0 = live.snapshots[0]
        window = max(now - t0, self.policy.sample_interval_s)
        utils = [e.stage_utilization() for e in engines]
        stage_u = tuple(float(np.mean([u[k] for u in utils])) for k in range(len(utils[0])))
        q: dict[str, float | None] = {}
        for key in ("ttft", "itl", "e2e"):
            before = dict(old[key]) if old is not hist else {}
            delta = [(le, c - before.get(le, 0.0)) for le, c in hist[key]]
            for p in (0.5, 0.99):
                v = histogram_quantile(p, delta) if t0 < now else math.nan
                q[f"{key}_p{int(p * 100)}_ms"] = None if math.isnan(v) else v * 1000.0
        return Sample(
            at=now,
            stage_utilization=stage_u,
            queue=float(sum(e.num_waiting() for e in engines)),
            running=float(sum(e.num_running() for e in engines)),
            qps=(done - done0) / window if t0 < now else 0.0,
            **q,
        )


# --- one variant -------------------------------------------------------------------------------------
@dataclass
class ControlLog:
    """What the control loop did: decisions by kind, shifts, the time on each gear."""

    decisions: dict[str, int] = field(default_factory=dict)
    shifts: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    gear_seconds: dict[str, float] = field(default_factory=dict)
    unhealthy: dict[str, str] = field(default_factory=dict)


def run_variant(
    name: str,
    arch: ModelArch,
    trace: Trace,
    policy: ShiftRules,
    gears: Sequence[GearSpec],
    start_gear: str,
    *,
    dynamic: bool,
) -> dict[str, Any]:
    """Replay ``trace`` on ``start_gear`` (static) or with the shifting loop over ``gears`` (dynamic)."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    itl = array("d")
    sim = Sim(arch, trace, policy, itl)
    specs = {g.name: g for g in gears}
    sim.ensure(specs[start_gear], 0.0, ready_now=True)
    sim.selected = start_gear
    for i, t in enumerate(trace.t):
        sim.push(float(t), "arrival", i)
    horizon = trace.duration_s + TAIL_S
    log = ControlLog()
    api_gears = [g.api for g in gears]
    health: dict[str, str] = {}
    dstate = DecisionState()
    xstate = ShiftState(active=start_gear)
    if dynamic:
        sim.push(policy.sample_interval_s, "sample")
    last_sel_t, last_sel = 0.0, start_gear
    for _ in range(200_000_000):  # bounded: far above the events of one trace hour
        if not sim.events:
            break
        t, _, kind, data = heapq.heappop(sim.events)
        if t > horizon:
            break
        sim.clock.now = t
        if kind == "end":
            head, st = data
            sim.on_end(head, st, t)
        elif kind == "arrival":
            sim.on_arrival(data, t)
        elif kind == "retry":
            data.stepping = False
            sim.kick(data, t)
        elif kind == "sample":
            sim.harvest()
            if sim.selected != last_sel:
                log.gear_seconds[last_sel] = log.gear_seconds.get(last_sel, 0.0) + t - last_sel_t
                last_sel_t, last_sel = t, sim.selected or ""
            views = gear_views(api_gears)
            views = tuple(
                replace(v, healthy=False, unhealthy_reason=health[v.name]) if v.name in health else v
                for v in views
            )
            table = GearTable(views, active=xstate.active, arch=arch)
            sample_gear = sim.selected if sim.selected in sim.gears else xstate.active
            sample = sim.sample(sample_gear, t)
            dstate, decision = decide(dstate, sample, policy, table, t, busy=xstate.busy)
            log.decisions[decision.kind.value] = log.decisions.get(decision.kind.value, 0) + 1
            if decision.kind is not DecisionKind.HOLD and decision.kind is not DecisionKind.NO_SIGNALS:
                log.events.append(
                    {"t": round(t, 1), "decision": decision.kind.value, "message": decision.message}
                )
            request = shift_request(decision, table)
            obs = {}
            for gname, live in sim.gears.items():
                ready = t >= live.ready_at
                obs[gname] = GearObservation(
                    exists=True,
                    ready=ready,
                    ready_since=live.ready_at if ready else None,
                    in_flight=live.in_flight(),
                    p99_ms=sample.p99_ms(policy.latency_metric) if sample and gname == sample_gear else None,
                    qps=sample.qps if sample and gname == sample_gear else None,
                    kv_pool=live.kv_pool,
                )
            fits = True
            if request is not None and request.target in specs:
                used = frozenset(n for g in sim.gears.values() for n in g.spec.nodes)
                fits = not (specs[request.target].nodes & used)  # one GPU per node in this fleet
            world = World(now=t, gears=obs, selected=sim.selected, full_shadow_fits=fits)
            xstate, actions = step(xstate, world, policy, request=request)
            for a in actions:
                if isinstance(a, EnsureGear):
                    live = sim.ensure(specs[a.gear], t)
                    live.kv_pool = a.kv_pool
                elif isinstance(a, SelectGear):
                    sim.selected = a.gear
                elif isinstance(a, DeleteGear):
                    sim.delete(a.gear)
                elif isinstance(a, MarkUnhealthy):
                    health[a.gear] = a.reason
                    log.unhealthy[a.gear] = f"{a.reason}: {a.message}"
                elif isinstance(a, RecordShift):
                    rec = {
                        "from": a.from_gear,
                        "to": a.to_gear,
                        "trigger": a.trigger,
                        "started_s": round(a.started_at, 1),
                        "outcome": a.outcome.value,
                        "finished_s": None if a.finished_at is None else round(a.finished_at, 1),
                        "message": a.message,
                    }
                    log.shifts = [s for s in log.shifts if s["started_s"] != rec["started_s"]] + [rec]
            if t + policy.sample_interval_s <= trace.duration_s + 1.0:
                sim.push(t + policy.sample_interval_s, "sample")
    end_t = sim.clock.now
    log.gear_seconds[last_sel] = log.gear_seconds.get(last_sel, 0.0) + end_t - last_sel_t
    sim.harvest()
    for i in list(sim.where):
        sim.out.fail(i, "unfinished at the end of the run")
    return _summarise(
        name, sim, itl, trace, log, dynamic, time.perf_counter() - wall0, time.process_time() - cpu0
    )


def _pct(values: np.ndarray, q: float) -> float | None:
    v = values[~np.isnan(values)]
    return None if len(v) == 0 else round(float(np.percentile(v, q)) * 1000.0, 3)


def _summarise(
    name: str, sim: Sim, itl: array, trace: Trace, log: ControlLog, dynamic: bool, wall: float, cpu: float
) -> dict[str, Any]:
    out = sim.out
    ok = (~out.failed) & (out.ttft <= SLO_TTFT_S) & (out.tpot <= SLO_ITL_S)
    ttft_ok = (~out.failed) & (out.ttft <= SLO_TTFT_S)
    itl_ok = (~out.failed) & (out.tpot <= SLO_ITL_S)
    dur = trace.duration_s
    itl_a = np.frombuffer(itl, dtype=np.float64) if len(itl) else np.array([np.nan])
    started = [s for s in log.shifts]
    res: dict[str, Any] = {
        "variant": name,
        "requests": len(trace.t),
        "slo_met": int(ok.sum()),
        "goodput_rps": round(float(ok.sum()) / dur, 4),
        "slo_attainment": round(float(ok.mean()), 4),
        "ttft_met_share": round(float(ttft_ok.mean()), 4),
        "tpot_met_share": round(float(itl_ok.mean()), 4),
        "ttft_ms": {"p50": _pct(out.ttft, 50), "p99": _pct(out.ttft, 99)},
        "itl_ms": {"p50": _pct(itl_a, 50), "p99": _pct(itl_a, 99), "tokens": len(itl)},
        "tpot_ms": {"p50": _pct(out.tpot, 50), "p99": _pct(out.tpot, 99)},
        "failed": int(out.failed.sum()),
        "failed_by_reason": out.reasons,
        "shifts": len(started),
        # Per hour of the original trace the replay covers, not per hour of (compressed) replay.
        "shifts_per_trace_hour": round(len(started) / trace.trace_hours, 3),
        "engine_steps": sim.steps,
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
    }
    if dynamic:
        res["shift_history"] = log.shifts
        res["decisions"] = log.decisions
        res["decision_events"] = log.events[:60]
        res["seconds_selected_per_gear"] = {k: round(v, 1) for k, v in log.gear_seconds.items()}
        res["unhealthy"] = log.unhealthy
    return res


# --- main --------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--limit-s", type=float, default=None, help="replay only the first seconds of the trace")
    ap.add_argument("--speed", type=float, default=1.0, help="time compression (1 = the trace's own rate)")
    ap.add_argument("--variants", default="dynamic,latency,balanced,throughput,even")
    ap.add_argument(
        "--scenarios",
        default="as-planned,max-batch-256",
        help="as-planned (the planner's gears) and/or max-batch-<n> (what-if: every gear's maxBatch = n)",
    )
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument(
        "--role",
        choices=("prefill", "decode"),
        default="prefill",
        help="whose SLO the latency triggers read: prefill = TTFT 200 ms, decode = ITL 50 ms",
    )
    args = ap.parse_args(argv)

    arch = load_hf_config(args.model)
    policy = policy_from_api(
        ApiShiftPolicy(), role=args.role, ttft_slo_ms=SLO_TTFT_S * 1000, itl_slo_ms=SLO_ITL_S * 1000
    )
    whole = load_trace(args.trace)
    workload = (round(float(whole.prompt.mean())), round(float(whole.output.mean())))
    t0 = time.perf_counter()
    gears, even, plan_info = plan_gears(arch, policy, workload)
    plan_s = time.perf_counter() - t0
    trace = load_trace(args.trace, args.limit_s, args.speed)
    start = initial_gear([g.api for g in gears], None)
    scenarios: dict[str, Any] = {}
    for scen in args.scenarios.split(","):
        if scen == "as-planned":
            sg, se = gears, even
            what = "the planner's gears exactly as generated (maxBatch = micro-batch x stages)"
        elif scen.startswith("max-batch-"):
            mb = int(scen.removeprefix("max-batch-"))
            sg, se = [with_max_batch(g, mb) for g in gears], with_max_batch(even, mb)
            what = f"what-if: the same layouts with maxBatch (vLLM --max-num-seqs) = {mb} in every gear"
        else:
            raise SystemExit(f"unknown scenario {scen!r}: as-planned or max-batch-<n>")
        results = []
        for v in args.variants.split(","):
            if v == "dynamic":
                r = run_variant("dynamic", arch, trace, policy, sg, start, dynamic=True)
            elif v == "even":
                r = run_variant("even", arch, trace, policy, [se], "even", dynamic=False)
            else:
                r = run_variant(f"static-{v}", arch, trace, policy, sg, v, dynamic=False)
            print(
                scen,
                json.dumps(
                    {
                        k: r[k]
                        for k in (
                            "variant",
                            "goodput_rps",
                            "slo_attainment",
                            "ttft_ms",
                            "itl_ms",
                            "failed",
                            "shifts",
                            "cpu_s",
                        )
                    }
                ),
                flush=True,
            )
            results.append(r)
        scenarios[scen] = {
            "what": what,
            "gears": {g.name: {"pipeline": g.pipeline_doc, "heads": g.heads} for g in [*sg, se]},
            "results": results,
            "goals": _goals(results),
        }
    doc = _report(args, arch, policy, gears, even, plan_info, plan_s, trace, start, scenarios, workload)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def _goals(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 9's goals for one scenario: goodput ratios, shifts per trace hour, failed requests."""
    by = {r["variant"]: r for r in results}
    statics = [r for r in results if r["variant"].startswith("static-")]
    goals: dict[str, Any] = {}
    if "dynamic" in by and statics:
        best = max(statics, key=lambda r: r["goodput_rps"])
        d = by["dynamic"]
        ratio = d["goodput_rps"] / best["goodput_rps"] if best["goodput_rps"] else math.inf
        goals["goodput_vs_best_static"] = {
            "best_static": best["variant"],
            "ratio": round(ratio, 4),
            "goal": 1.3,
            "met": ratio >= 1.3,
        }
        if "even" in by:
            e = by["even"]["goodput_rps"]
            r2 = d["goodput_rps"] / e if e else math.inf
            goals["goodput_vs_even_split"] = {
                "ratio": round(r2, 4) if math.isfinite(r2) else "inf",
                "goal": 2.0,
                "met": r2 >= 2.0,
            }
        goals["shifts_per_trace_hour"] = {
            "value": d["shifts_per_trace_hour"],
            "goal": "<= 6",
            "met": d["shifts_per_trace_hour"] <= 6,
        }
        goals["failed_requests"] = {"value": d["failed"], "goal": 0, "met": d["failed"] == 0}
    return goals


def _report(
    args: argparse.Namespace,
    arch: ModelArch,
    policy: ShiftRules,
    gears: Sequence[GearSpec],
    even: GearSpec,
    plan_info: dict[str, Any],
    plan_s: float,
    trace: Trace,
    start: str,
    scenarios: dict[str, Any],
    workload: tuple[int, int],
) -> dict[str, Any]:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    trace_path = Path(args.trace).resolve()
    return {
        "benchmark": "gears (issue 9): dynamic gear shifting vs static gears vs even layer split",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "note": "shared 2-core VM; other sessions ran e2e tests meanwhile",
            "max_rss_mib": round(rss / 1024, 1),
        },
        "method": {
            "time": "virtual (discrete events); 1 trace second = 1 virtual second unless speed != 1",
            "real": [
                "planner.plan on the fleet's resource profile (sim_requests=500, as the reconciler)",
                "planner.inputs.api_gear / gear_links, k8s.engine.sim_pipeline (heads' GEARSHIFT_PIPELINE)",
                "gearshift.sim.engine.Engine (scheduler, paged KV, preemption) timed by sim.perfmodel, "
                "driven through Engine.begin_step/end_step",
                "control.decide.decide, control.executor.step, control.adapt (policy_from_api with the "
                "GearSet API's default ShiftPolicy, gear_views, shift_request)",
            ],
            "simulated": [
                "router: shortest queue ((running + waiting + 1) / the head's GPU prior) over the selected "
                "gear's head pods",
                "Prometheus: stage utilisation gauge (10 s window), summed queue/running, completions over "
                "1 min, P50/P99 by histogram_quantile over the engines' own buckets of the last minute",
                "Kubernetes: EnsureGear creates the gear's engines, Ready after weights load at "
                "policy.transferGbps; SelectGear moves new requests; the old gear finishes its in-flight "
                "requests; DeleteGear removes it (requests still on it count as failed)",
            ],
            "not_modelled": [
                "PD disaggregation: engines run the combined 'both' role on the whole fleet",
                "GPU contention between two gears sharing a node during a shift",
                "shadow warm-up traffic (shadows take none)",
                "client timeouts do not abort engine work (a request past 60 s still runs; it counts failed)",
            ],
            "slo": {
                "ttft_ms": SLO_TTFT_S * 1000,
                "itl_ms": SLO_ITL_S * 1000,
                "itl_is": "per-request mean inter-token latency (TPOT); itl_ms percentiles are per token",
            },
            "failure": "rejected by the engine, first token > 60 s after arrival, unfinished at the end, or "
            "on a gear deleted under it",
            "goodput": "requests meeting both SLOs / trace duration (requests/s)",
        },
        "parameters": {
            # Repository-relative for the bundled trace: no path of the machine that ran it.
            "trace": str(trace_path.relative_to(ROOT) if trace_path.is_relative_to(ROOT) else trace_path),
            "requests": len(trace.t),
            "trace_duration_s": round(trace.duration_s, 1),
            "offered_rps": round(len(trace.t) / trace.duration_s, 4),
            "speed": args.speed,
            "limit_s": args.limit_s,
            "fleet": str(FLEET.relative_to(ROOT)),
            "model": str(Path(args.model).resolve().relative_to(ROOT)),
            "model_choice": (
                "llama-3-8b. llama-3-70b (140 GB bf16) cannot meet the 50 ms ITL SLO in any pipeline on this "
                "fleet: a decode step must read every stage's weights in sequence, >= 140 GB / (3.35 TB/s x "
                "0.7) = 60 ms even on H100s only (the planner's 70b gears run ~80 ms), so every variant's "
                "goodput would be 0. With 8b the planner's gears differ in kind: latency = the whole model "
                "on each H100 (1 stage x 2), balanced = 4 unequal stages A10/A10/H100/A100 x 2, throughput "
                "= 5 unequal stages T4/A10/A10/H100/A100 x 2 (every node)."
            ),
            "role": "both (combined prefill+decode) on the whole fleet; latency triggers read "
            + ("TTFT P99 vs 200 ms" if args.role == "prefill" else "ITL P99 vs 50 ms"),
            "workload": {
                "prompt_tokens": workload[0],
                "output_tokens": workload[1],
                "source": "the whole trace's mean prompt and output tokens (GearSet spec.plan.workload)",
            },
            "policy": {k: (v.value if hasattr(v, "value") else v) for k, v in vars(policy).items()},
            "client_timeout_s": CLIENT_TIMEOUT_S,
            "tail_s": TAIL_S,
            "initial_gear": start,
            "planning_s": round(plan_s, 2),
        },
        "gears": {
            **{
                g.name: {
                    "pipeline": g.pipeline_doc,
                    "heads": g.heads,
                    "load_s": round(g.load_s, 2),
                    "predicted": g.api.predicted.to_json() if g.api.predicted else None,
                }
                for g in gears
            },
            "even": {"pipeline": even.pipeline_doc, "heads": even.heads, "load_s": round(even.load_s, 2)},
            "planner": plan_info,
        },
        "scenarios": scenarios,
    }


if __name__ == "__main__":
    raise SystemExit(main())
