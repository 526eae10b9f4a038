"""Gear-shifting benchmark (issues 9, 19): the Azure conversation trace on the mixed fleet, in virtual time.

Per scenario (a load: ``x<k>`` time-compressed, ``x<k>-own-pace`` k times as dense at the trace's own
pace, so the load crosses gear capacities on the trace's own timescale), it replays every static gear,
the shifting loop (``dynamic``) and the per-window **oracle** (:func:`oracle_schedule`), and reports per
variant goodput, GPU-hours (shadows and draining gears counted), SLO-met per GPU-hour, SLO-met per 60 s
window, shifts per trace hour and failures, and issue 19's goals.

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
- **Modelled since issue 19** (see :class:`Sim`): engines sharing a card split its time (a warming
  shadow gets at most ``warmupShare``), warm-up traffic mirrored to a Ready shadow as the router does,
  the cards every live gear holds over time, and the signal window the operator uses after a switch
  (:func:`gearshift.control.signals.sample_window_s`).
- **Not modelled**: prefill/decode disaggregation (the engines run the combined ``both`` role on the
  whole fleet), weight loading contending with serving, network between client and router.

A request the engine refuses at admission (longer than its KV pool can ever hold: vLLM answers 400, on
every gear alike) is counted as ``rejected_too_long``, not as failed. A request *fails* when its first
token comes more than ``--timeout`` (60 s) after arrival (the client gave up; the engine is not told),
when it is still unfinished at the end of the run, or when its gear is deleted under it. It meets the
SLO when its TTFT ≤ 200 ms and its mean inter-token latency (TPOT, ``(last − first token) / (tokens −
1)``) ≤ 50 ms (DESIGN.md's targets; TPOT as DistServe's goodput, Zhong et al. OSDI 2024). Goodput =
requests meeting the SLO / trace duration (requests/s).

Run: ``PYTHONPATH=operator .venv/bin/python bench/gears.py`` (writes ``bench/results/gears.json``; about
15 CPU-minutes); ``--scenarios x4-own-pace:600 --variants dynamic,latency,throughput`` for a quick look,
``--trace`` for another CSV of the same columns, ``--policy '{"capacityHeadroom": 0.8}'`` for a what-if.
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
from gearshift.api.gearset import GearHealth  # noqa: E402
from gearshift.api.gearset import ShiftPolicy as ApiShiftPolicy  # noqa: E402
from gearshift.control.adapt import gear_views, policy_from_api, shift_request  # noqa: E402
from gearshift.control.capacity import initial_gear as capacity_gear  # noqa: E402
from gearshift.control.decide import Decision, DecisionKind, DecisionState, decide  # noqa: E402
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
from gearshift.control.shifting import lasting_marks, serving_since  # noqa: E402
from gearshift.control.signals import WINDOW_S as PROM_WINDOW_S  # noqa: E402
from gearshift.control.signals import sample_window_s  # noqa: E402
from gearshift.control.smoothing import Sample  # noqa: E402
from gearshift.control.triggers import Trigger  # noqa: E402
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
#: How long an engine that has waiting requests but could schedule nothing retries (Engine.run's poll), s.
RETRY_S = 0.005
#: Most virtual seconds simulated after the last arrival, to let in-flight requests finish.
TAIL_S = 300.0
#: Failure reason of a request the engine refuses at admission (longer than its KV pool can ever hold).
REJECTED = "rejected by the engine"
#: Goodput windows (issue 19: "goodput per 60 s window"), s.
WINDOW_S = 60.0


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
    """Time for its pods to load their weights at the policy's transfer rate (pods load in parallel), s."""
    head_docs: list[dict[str, Any]] = field(default_factory=list)
    """The pipeline document of each head: replica r's stages on ``nodes[r]``'s GPU models."""
    head_nodes: list[tuple[str, ...]] = field(default_factory=list)
    """The nodes each head's pipeline replica runs on (its stages' pods)."""
    cards: dict[str, int] = field(default_factory=dict)
    """GPUs the gear's pods hold per node."""

    @property
    def gpus(self) -> int:
        """GPUs the gear holds (every pod of every stage)."""
        return sum(self.cards.values())

    @property
    def predicted_rps(self) -> float | None:
        """The planner's predicted throughput, requests/s."""
        p = self.api.predicted
        return None if p is None else p.throughput_qps


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
    head_docs, head_nodes = [], []
    cards: dict[str, int] = {}
    for st in api.stages:
        for n in st.nodes:
            cards[n] = cards.get(n, 0) + st.gpus
    for r in range(heads):
        # Each head pod is timed with its own replica's cards (gpuModel names only the first node's).
        hd = json.loads(json.dumps(doc))
        for k, st in enumerate(api.stages):
            if r < len(st.nodes) and gpu.get(st.nodes[r]):
                hd["stages"][k]["gpu"] = gpu[st.nodes[r]]
                hd["stages"][k]["node"] = st.nodes[r]
        head_docs.append(hd)
        head_nodes.append(tuple(st.nodes[r] for st in api.stages if r < len(st.nodes)))
    return GearSpec(api.name, api, doc, heads, nodes, load, head_docs, head_nodes, cards)


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
    nodes: tuple[str, ...] = ()
    """The cards (one per node in this fleet) its pipeline replica runs on."""
    gear: str = ""

    def has_work(self) -> bool:
        return self.stepping or self.engine.num_running() + self.engine.num_waiting() > 0


@dataclass
class LiveGear:
    """A gear whose engines exist."""

    spec: GearSpec
    heads: list[Head]
    created_at: float
    ready_at: float
    kv_pool: bool = True
    shadow: bool = True
    """Not selected since it was created: a warming shadow (its card time is capped at warmupShare)."""
    snapshots: deque[tuple[float, dict[str, list[tuple[float, float]]], float, float]] = field(
        default_factory=deque
    )
    """(time, cumulative histogram buckets by metric, cumulative successes, requests in flight) per sample
    (the 1m window)."""

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
    """Engines of the live gears, the router, and the event queue, in virtual time.

    **Contention.** Engines whose pipelines share a card split its time: on each card the busy shadows
    (gears never selected yet, warming on mirrored requests) together get ``warmupShare`` of it and the
    busy serving engines (the selected gear and a gear draining beside it) share the rest equally; alone
    on a card an engine gets all of it. An engine's step lasts its modelled period divided by its share
    of its most contended card, taken when the step starts. Loading weights is not charged (a disk or
    network read, not the card's compute).

    **Warm-up mirroring** (issue 19 item 3, as the router does it): while a shadow is Ready and not
    selected, arrivals are copied to it through a token bucket at ``warmupShare`` × its predicted
    throughput (burst of one second's worth); copies are not counted as requests, their answers dropped.

    **GPU time.** The cards held by any live gear (the union: gears on one node share its card), summed
    over time from 0 to the last arrival: what the cluster reserves for the role.
    """

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
        self.gpu_s = 0.0
        self._cards_at = 0.0
        self.mirrored = 0
        self._bucket = (0.0, 0.0)
        """(tokens, when last filled) of the warm-up mirror."""

    # events
    def push(self, t: float, kind: str, data: Any = None) -> None:
        heapq.heappush(self.events, (t, next(self._seq), kind, data))

    # GPU time
    def cards(self) -> int:
        """Cards held now: per node the most any live gear holds there, summed."""
        per: dict[str, int] = {}
        for live in self.gears.values():
            for n, c in live.spec.cards.items():
                per[n] = max(per.get(n, 0), c)
        return sum(per.values())

    def _account(self, now: float) -> None:
        end = min(now, self.trace.duration_s)
        if end > self._cards_at:
            self.gpu_s += self.cards() * (end - self._cards_at)
            self._cards_at = end

    def finish_accounting(self) -> None:
        self._account(self.trace.duration_s)

    # gears
    def ensure(self, spec: GearSpec, now: float, ready_now: bool = False) -> LiveGear:
        if spec.name in self.gears:
            return self.gears[spec.name]
        self._account(now)
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
            nodes = spec.head_nodes[r] if r < len(spec.head_nodes) else ()
            heads.append(
                Head(e, weight=min(pd_gpu_prior(st.gpu) for st in pipe.stages), nodes=nodes, gear=spec.name)
            )
        ready = now if ready_now else now + spec.load_s
        live = LiveGear(spec, heads, now, ready, shadow=not ready_now)
        self.gears[spec.name] = live
        return live

    def select(self, name: str) -> None:
        self.selected = name
        if name in self.gears:
            self.gears[name].shadow = False

    def delete(self, name: str, now: float) -> None:
        if name not in self.gears:
            return
        self._account(now)
        self.gears.pop(name)
        for i, (g, req) in list(self.where.items()):
            if g == name and not req.finished:
                self.out.fail(i, "gear deleted with the request in flight")
                del self.where[i]

    # engines
    def share(self, head: Head) -> float:
        """The share of its most contended card ``head`` gets now (see the class docstring)."""
        if len(self.gears) < 2 or not head.nodes:
            return 1.0
        mine = self.gears[head.gear].shadow if head.gear in self.gears else False
        worst = 1.0
        for n in head.nodes:
            serving = shadows = 0
            for live in self.gears.values():
                for h in live.heads:
                    if h is not head and n in h.nodes and h.has_work():
                        if live.shadow:
                            shadows += 1
                        else:
                            serving += 1
            shadows += mine
            serving += not mine
            cap = self.policy.warmup_share
            # Shadows share warmupShare of a card beside serving work; serving engines share the rest.
            part = (
                (cap if serving else 1.0) / shadows if mine else ((1.0 - cap) if shadows else 1.0) / serving
            )
            worst = min(worst, part)
        return worst

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
        part = self.share(head)
        if part < 1.0:
            st = replace(st, end=st.start + (st.end - st.start) / part)
        head.stepping = True
        self.push(st.end, "end", (head, st))

    def on_end(self, head: Head, st: PlannedStep, now: float) -> None:
        head.engine.end_step(st)
        self.steps += 1
        head.stepping = False
        self.kick(head, now)

    def _pick(self, live: LiveGear) -> Head:
        return min(live.heads, key=lambda h: (h.engine.num_running() + h.engine.num_waiting() + 1) / h.weight)

    def on_arrival(self, i: int, now: float) -> None:
        live = self.gears.get(self.selected or "")
        if live is None:
            self.out.fail(i, "no gear selected")
            return
        head = self._pick(live)
        try:
            req = head.engine.new_request(int(self.trace.prompt[i]), int(self.trace.output[i]))
        except RequestRejected:
            self.out.fail(i, REJECTED)
            return
        self.where[i] = (live.spec.name, req)
        self.kick(head, now)
        self._mirror(i, now)

    def _mirror(self, i: int, now: float) -> None:
        shadow = next((g for g in self.gears.values() if g.shadow and now >= g.ready_at), None)
        rate = None if shadow is None else shadow.spec.predicted_rps
        if shadow is None or not rate or self.policy.warmup_share <= 0:
            return
        cap = self.policy.warmup_share * rate
        tokens, at = self._bucket
        tokens = min(cap, tokens + (now - at) * cap)
        if tokens < 1.0:
            self._bucket = (tokens, now)
            return
        self._bucket = (tokens - 1.0, now)
        head = self._pick(shadow)
        try:
            head.engine.new_request(int(self.trace.prompt[i]), int(self.trace.output[i]))
        except RequestRejected:
            return
        self.mirrored += 1
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
    def sample(self, name: str, now: float, span: float = PROM_WINDOW_S) -> Sample | None:
        """What the operator's Prometheus queries would return for gear ``name`` now over the last ``span``
        s (:func:`gearshift.control.signals.sample_window_s`); the arrival rate as
        :func:`gearshift.control.signals.arrival_query` computes it (completions plus the growth of the
        requests in flight over the window)."""
        live = self.gears.get(name)
        if live is None:
            return None
        engines = [h.engine for h in live.heads]
        hist, done = _cumulative(engines)
        inflight = float(sum(e.num_running() + e.num_waiting() for e in engines))
        live.snapshots.append((now, hist, done, inflight))
        while len(live.snapshots) > 1 and live.snapshots[1][0] <= now - PROM_WINDOW_S:
            live.snapshots.popleft()
        t0, old, done0, inflight0 = next(x for x in live.snapshots if x[0] >= now - span - 1e-9)
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
        qps = (done - done0) / window if t0 < now else 0.0
        arrivals = max(0.0, qps + (inflight - inflight0) / window) if t0 < now else None
        return Sample(
            at=now,
            stage_utilization=stage_u,
            queue=float(sum(e.num_waiting() for e in engines)),
            running=float(sum(e.num_running() for e in engines)),
            qps=qps,
            arrival_rps=arrivals,
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
    schedule: Sequence[tuple[float, str]] = (),
) -> dict[str, Any]:
    """Replay ``trace`` on ``start_gear`` (static), with the shifting loop over ``gears`` (dynamic), or
    through the shifts of ``schedule`` (the oracle: ``(t, gear)`` = ``gear`` should serve from ``t`` s on;
    each shift is forced early enough for the gear to load and warm, and runs the executor like any other).
    """
    wall0, cpu0 = time.perf_counter(), time.process_time()
    itl = array("d")
    sim = Sim(arch, trace, policy, itl)
    specs = {g.name: g for g in gears}
    sim.ensure(specs[start_gear], 0.0, ready_now=True)
    sim.select(start_gear)
    for i, t in enumerate(trace.t):
        sim.push(float(t), "arrival", i)
    horizon = trace.duration_s + TAIL_S
    log = ControlLog()
    api_gears = [g.api for g in gears]
    health: dict[str, GearHealth] = {}
    dstate = DecisionState()
    xstate = ShiftState(active=start_gear)
    plan = list(schedule)
    if dynamic or plan:
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
            views = gear_views(api_gears, lasting_marks(health.values(), t, policy))
            table = GearTable(views, active=xstate.active, arch=arch)
            sample_gear = sim.selected if sim.selected in sim.gears else xstate.active
            sample = sim.sample(sample_gear, t, sample_window_s(serving_since(xstate, policy), t))
            if plan:
                decision = _scheduled(plan, t, xstate, specs, policy)
            else:
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
                    sim.select(a.gear)
                elif isinstance(a, DeleteGear):
                    sim.delete(a.gear, t)
                elif isinstance(a, MarkUnhealthy):
                    health[a.gear] = GearHealth(
                        gear=a.gear,
                        healthy=False,
                        reason=a.reason,
                        since=dt.datetime.fromtimestamp(t, dt.UTC),
                    )
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
    sim.finish_accounting()
    sim.harvest()
    for i in list(sim.where):
        sim.out.fail(i, "unfinished at the end of the run")
    res = _summarise(
        name,
        sim,
        itl,
        trace,
        log,
        dynamic or bool(schedule),
        time.perf_counter() - wall0,
        time.process_time() - cpu0,
    )
    if dynamic:
        res["capacity"] = {
            g: {
                "predicted_rps": _r(e.predicted_rps),
                "measured_low_rps": _r(e.measured_low_rps),
                "measured_high_rps": _r(e.measured_high_rps),
                "capacity_rps": _r(e.capacity_rps),
            }
            for g, e in dstate.capacity.items()
        }
    return res


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


def shift_lead_s(spec: GearSpec, policy: ShiftRules) -> float:
    """How long before it must serve a shift to ``spec`` has to start: its weights load, then it warms
    ``warmS``, and the executor moves traffic at its next sample, s."""
    return spec.load_s + policy.warm_s + 2 * policy.sample_interval_s


def _upshift(old: GearSpec, new: GearSpec) -> bool:
    """Whether the oracle's shift ``old`` → ``new`` goes up (more predicted throughput)."""
    return (new.predicted_rps or 0.0) > (old.predicted_rps or 0.0)


def _scheduled(
    plan: list[tuple[float, str]],
    now: float,
    xstate: ShiftState,
    specs: dict[str, GearSpec],
    policy: ShiftRules,
) -> Decision:
    """The oracle's decision now: shift to the next scheduled gear once its lead time has come, as a
    capacity shift (``load-high`` towards more predicted throughput, else ``load-low``), so the executor
    treats it as it treats the controller's own (a load-high shift that serves more is not rolled back
    on its P99)."""
    while plan and plan[0][1] == xstate.active and not xstate.busy:
        plan.pop(0)
    if plan and not xstate.busy:
        at, gear = plan[0]
        if now >= at - shift_lead_s(specs[gear], policy):
            up = _upshift(specs[xstate.active], specs[gear])
            trigger = (Trigger.LOAD_HIGH if up else Trigger.LOAD_LOW).value
            return Decision(
                DecisionKind.SHIFT,
                "Oracle",
                f"oracle: {gear!r} serves from {at:.0f} s",
                target=gear,
                trigger=trigger,
            )
    return Decision(DecisionKind.HOLD, "Oracle", "")


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
    # Refused at admission as longer than the engine's KV pool can ever hold: vLLM answers 400 (the
    # client's error, the same on every gear), so they are reported apart from failures.
    rejected = out.reasons.get(REJECTED, 0)
    gpu_hours = sim.gpu_s / 3600.0
    win = (trace.t // WINDOW_S).astype(int)
    n_win = int(win.max()) + 1 if len(win) else 0
    met_w = np.bincount(win[ok], minlength=n_win)
    res: dict[str, Any] = {
        "variant": name,
        "requests": len(trace.t),
        "slo_met": int(ok.sum()),
        "goodput_rps": round(float(ok.sum()) / dur, 4),
        "gpu_hours": round(gpu_hours, 4),
        "slo_met_per_gpu_hour": round(float(ok.sum()) / gpu_hours, 1) if gpu_hours else None,
        "mean_gpus": round(sim.gpu_s / dur, 3) if dur else None,
        "slo_attainment": round(float(ok.mean()), 4),
        "ttft_met_share": round(float(ttft_ok.mean()), 4),
        "tpot_met_share": round(float(itl_ok.mean()), 4),
        "ttft_ms": {"p50": _pct(out.ttft, 50), "p99": _pct(out.ttft, 99)},
        "itl_ms": {"p50": _pct(itl_a, 50), "p99": _pct(itl_a, 99), "tokens": len(itl)},
        "tpot_ms": {"p50": _pct(out.tpot, 50), "p99": _pct(out.tpot, 99)},
        "failed": int(out.failed.sum()) - rejected,
        "failed_by_reason": {k: v for k, v in out.reasons.items() if k != REJECTED},
        "rejected_too_long": rejected,
        "shifts": len(started),
        # Per hour of the original trace the replay covers, not per hour of (compressed) replay.
        "shifts_per_trace_hour": round(len(started) / trace.trace_hours, 3),
        "mirrored_warmup_requests": sim.mirrored,
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
    res["windows"] = [{"start_s": int(k * WINDOW_S), "slo_met": int(met_w[k])} for k in range(n_win)]
    return res


# --- scenarios and the oracle ------------------------------------------------------------------------
#: Default replay length of each time-compressed scenario (the runs issue 9 and 19 quote), s.
COMPRESSED_LIMIT_S = {1.0: 1200.0, 4.0: 450.0, 8.0: 300.0}
#: Seed of the own-pace scenarios' copies (their arrival jitter).
DENSIFY_SEED = 19
#: Each copy of a request in an own-pace scenario arrives within ± this of the original, s: the minute-
#: scale shape of the load stays the trace's, its second-scale burstiness is not copied in lockstep.
DENSIFY_JITTER_S = 30.0


def densify(trace: Trace, k: float, seed: int = DENSIFY_SEED, jitter_s: float = DENSIFY_JITTER_S) -> Trace:
    """The trace ``k`` times as dense at its own pace: every request plus ``k − 1`` copies (a fractional
    part as that share of requests, drawn at random), each copy arriving uniformly within ± ``jitter_s``
    of its original (clipped to the trace), with the original's token counts."""
    rng = np.random.default_rng(seed)
    ts, ps, os_ = [trace.t], [trace.prompt], [trace.output]
    whole, frac = int(k), k - int(k)
    end = trace.duration_s
    for c in range(1, whole + (1 if frac > 0 else 0)):
        keep = np.ones(len(trace.t), dtype=bool) if c < whole else rng.random(len(trace.t)) < frac
        jit = rng.uniform(-jitter_s, jitter_s, int(keep.sum()))
        ts.append(np.clip(trace.t[keep] + jit, 0.0, end))
        ps.append(trace.prompt[keep])
        os_.append(trace.output[keep])
    t = np.concatenate(ts)
    order = np.argsort(t, kind="stable")
    return Trace(t[order] - t[order][0], np.concatenate(ps)[order], np.concatenate(os_)[order], trace.speed)


@dataclass(frozen=True)
class Scenario:
    """A load: the trace time-compressed ``speed`` times, or ``density`` times as dense at its own pace."""

    name: str
    speed: float = 1.0
    density: float = 1.0
    limit_s: float | None = None

    def describe(self) -> str:
        span = "the whole trace" if self.limit_s is None else f"the first {self.limit_s:g} s"
        if self.density != 1.0:
            return (
                f"the trace {self.density:g}x as dense at its own pace (each request plus copies within "
                f"+-{DENSIFY_JITTER_S:g} s): {span}; load changes at the trace's own timescale"
            )
        return f"the trace time-compressed x{self.speed:g}: {span}"

    def trace(self, path: Path) -> Trace:
        if self.density != 1.0:
            return densify(load_trace(path, self.limit_s), self.density)
        return load_trace(path, self.limit_s, self.speed)


def parse_scenario(text: str, limit_s: float | None = None) -> Scenario:
    """``x<k>`` (time-compressed k times), ``x<k>-own-pace`` (k times as dense at the trace's pace), each
    optionally ``:<seconds>`` (replay only the first seconds); ``limit_s`` overrides every limit.

    Raises:
        ValueError: any other text, naming the accepted forms.
    """
    name, _, lim = text.partition(":")
    own = name.endswith("-own-pace")
    body = name.removesuffix("-own-pace")
    try:
        if not body.startswith("x"):
            raise ValueError
        k = float(body[1:])
        limit = float(lim) if lim else None
        if k <= 0 or (limit is not None and limit <= 0):
            raise ValueError
    except ValueError:
        raise ValueError(
            f"scenario {text!r}: use x<k> (time-compressed) or x<k>-own-pace (k times as dense at the "
            "trace's pace), optionally :<seconds>, e.g. x4:450 or x4-own-pace"
        ) from None
    if limit_s is not None:
        limit = limit_s
    elif limit is None and not own:
        limit = COMPRESSED_LIMIT_S.get(k)
    whole = limit is None or (own and not lim and limit_s is None)
    label = name if whole else f"{name}-first-{limit:g}s"
    return Scenario(label, speed=1.0 if own else k, density=k if own else 1.0, limit_s=limit)


def oracle_schedule(
    windows: dict[str, list[int]], specs: dict[str, GearSpec], policy: ShiftRules
) -> tuple[str, list[tuple[float, str]]]:
    """The oracle's gear per 60 s window from the static gears' SLO-met per window: the fewest GPU-seconds
    among the gears within 1% (at least one request) of the window's best, a shortfall beyond that costing
    100 GPU-windows per request, under the shift mechanics: a shift may start only when the previous
    one's rollback window and drain are over and its dwell has passed (``upshiftDwellS`` towards more
    predicted throughput, ``dwellS`` otherwise). Dynamic programming over (window, gear, windows since the
    last shift). Returns ``(first gear, [(t, gear) serving from t s])``."""
    names = [g for g in windows if g in specs]
    n_w = max(len(v) for v in windows.values())
    best = [max(windows[g][w] if w < len(windows[g]) else 0 for g in names) for w in range(n_w)]

    def cost(w: int, g: str) -> float:
        got = windows[g][w] if w < len(windows[g]) else 0
        short = max(0.0, best[w] - max(1.0, 0.01 * best[w]) - got)
        return specs[g].gpus + 100.0 * short

    def gap(a: str, b: str) -> int:
        dwell = policy.upshift_dwell_s if _upshift(specs[a], specs[b]) else policy.dwell_s
        need = dwell + policy.rollback_window_s + 10.0 + shift_lead_s(specs[b], policy)
        return math.ceil(need / WINDOW_S)

    k_max = max(gap(a, b) for a in names for b in names if a != b) if len(names) > 1 else 1
    inf = math.inf
    # value[g][k]: least cost of windows 0..w ending on g with k windows since its shift (capped at k_max).
    value = {g: [inf] * (k_max + 1) for g in names}
    back: list[dict[tuple[str, int], tuple[str, int]]] = []
    for g in names:
        value[g][k_max] = cost(0, g)  # the first gear is free to choose, not a shift
    for w in range(1, n_w):
        nxt = {g: [inf] * (k_max + 1) for g in names}
        ptr: dict[tuple[str, int], tuple[str, int]] = {}
        for g in names:
            for k in range(k_max + 1):
                v = value[g][k]
                if v == inf:
                    continue
                kk = min(k + 1, k_max)
                if v + cost(w, g) < nxt[g][kk]:
                    nxt[g][kk] = v + cost(w, g)
                    ptr[(g, kk)] = (g, k)
                for h in names:
                    if h != g and k + 1 >= gap(g, h) and v + cost(w, h) < nxt[h][0]:
                        nxt[h][0] = v + cost(w, h)
                        ptr[(h, 0)] = (g, k)
        back.append(ptr)
        value = nxt
    end = min(((value[g][k], g, k) for g in names for k in range(k_max + 1)), key=lambda x: x[0])
    path = [end[1]]
    state = (end[1], end[2])
    for ptr in reversed(back):
        state = ptr[state]
        path.append(state[0])
    path.reverse()
    changes = [(w * WINDOW_S, path[w]) for w in range(1, n_w) if path[w] != path[w - 1]]
    return path[0], changes


# --- main --------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--trace", type=Path, default=TRACE, help="any CSV with TIMESTAMP,ContextTokens,GeneratedTokens"
    )
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument(
        "--scenarios",
        default="x1,x4,x8,x4-own-pace",
        help="comma-separated loads: x<k> (time-compressed; x1/x4/x8 replay their first 1200/450/300 s), "
        "x<k>-own-pace (k times as dense at the trace's own pace, the whole trace); :<s> limits either",
    )
    ap.add_argument(
        "--limit-s", type=float, default=None, help="replay only the first seconds (every scenario)"
    )
    ap.add_argument(
        "--variants",
        default="dynamic,latency,balanced,throughput,oracle",
        help="dynamic, oracle (needs every static gear), a gear name (static), even",
    )
    ap.add_argument(
        "--max-batch", type=int, default=None, help="what-if: every gear's maxBatch (vLLM --max-num-seqs)"
    )
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument(
        "--role",
        choices=("prefill", "decode"),
        default="prefill",
        help="whose SLO the latency triggers read: prefill = TTFT 200 ms, decode = ITL 50 ms",
    )
    ap.add_argument(
        "--policy",
        default="{}",
        help="GearSet spec.policy overrides as JSON, e.g. '{\"capacityHeadroom\": 0.8}' (default: the API's)",
    )
    args = ap.parse_args(argv)
    try:
        api_policy = ApiShiftPolicy.model_validate(json.loads(args.policy))
    except (ValueError, TypeError) as err:
        ap.error(f"--policy: {err}")
    try:
        scens = [parse_scenario(x, args.limit_s) for x in args.scenarios.split(",") if x]
    except ValueError as err:
        ap.error(str(err))
    if not args.trace.is_file():
        ap.error(f"--trace {args.trace}: no such file")

    arch = load_hf_config(args.model)
    policy = policy_from_api(
        api_policy, role=args.role, ttft_slo_ms=SLO_TTFT_S * 1000, itl_slo_ms=SLO_ITL_S * 1000
    )
    whole = load_trace(args.trace)
    workload = (round(float(whole.prompt.mean())), round(float(whole.output.mean())))
    t0 = time.perf_counter()
    gears, even, plan_info = plan_gears(arch, policy, workload)
    plan_s = time.perf_counter() - t0
    if args.max_batch is not None:
        gears, even = [with_max_batch(g, args.max_batch) for g in gears], with_max_batch(even, args.max_batch)
    specs = {g.name: g for g in gears}
    wanted = [v for v in args.variants.split(",") if v]
    unknown = [v for v in wanted if v not in ("dynamic", "oracle", "even", *specs)]
    if unknown:
        ap.error(f"--variants {unknown}: use dynamic, oracle, even or a gear ({', '.join(specs)})")
    scenarios: dict[str, Any] = {}
    expected_given = "expectedArrivalRps" in json.loads(args.policy)
    for scen in scens:
        trace = scen.trace(args.trace)
        # The load a user expects when the role starts (policy.expectedArrivalRps): unless --policy
        # gives it, the scenario's first minute.
        first_minute = float(np.sum(trace.t < WINDOW_S)) / WINDOW_S
        scen_policy = policy if expected_given else replace(policy, expected_arrival_rps=first_minute)
        start = capacity_gear(gear_views([g.api for g in gears]), scen_policy) or initial_gear(
            [g.api for g in gears], None
        )
        results = []
        statics = [v for v in wanted if v in specs]
        for v in [*statics, *(x for x in wanted if x not in specs)]:
            if v == "dynamic":
                r = run_variant("dynamic", arch, trace, scen_policy, gears, start, dynamic=True)
            elif v == "even":
                r = run_variant("even", arch, trace, policy, [even], "even", dynamic=False)
            elif v == "oracle":
                wins = {
                    x["variant"].removeprefix("static-"): [w["slo_met"] for w in x["windows"]]
                    for x in results
                    if x["variant"].startswith("static-")
                }
                if set(wins) != set(specs):
                    ap.error("--variants oracle needs every gear as a static variant: " + ", ".join(specs))
                first, plan = oracle_schedule(wins, specs, policy)
                r = run_variant("oracle", arch, trace, policy, gears, first, dynamic=False, schedule=plan)
                r["schedule"] = [{"serves_from_s": 0.0, "gear": first}] + [
                    {"serves_from_s": t, "gear": g} for t, g in plan
                ]
            else:
                r = run_variant(f"static-{v}", arch, trace, policy, gears, v, dynamic=False)
            keys = (
                "variant",
                "goodput_rps",
                "gpu_hours",
                "slo_met_per_gpu_hour",
                "failed",
                "shifts",
                "cpu_s",
            )
            print(scen.name, json.dumps({k: r.get(k) for k in keys}), flush=True)
            results.append(r)
        scenarios[scen.name] = {
            "what": scen.describe(),
            "trace": {
                "speed": scen.speed,
                "density": scen.density,
                "limit_s": scen.limit_s,
                "requests": len(trace.t),
                "trace_duration_s": round(trace.duration_s, 1),
                "offered_rps": round(len(trace.t) / trace.duration_s, 4) if trace.duration_s else None,
                "offered_rps_per_minute": [
                    round(float(x) / WINDOW_S, 2) for x in np.bincount((trace.t // WINDOW_S).astype(int))
                ],
            },
            "initial_gear": start,
            "expected_arrival_rps": round(scen_policy.expected_arrival_rps, 3),
            "results": results,
            "goals": _goals(results),
        }
    doc = _report(args, arch, policy, gears, even, plan_info, plan_s, scenarios, workload)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def _goals(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 19's goals for one scenario (each with its value, the goal and whether it is met)."""
    by = {r["variant"]: r for r in results}
    statics = [r for r in results if r["variant"].startswith("static-")]
    goals: dict[str, Any] = {}
    if "dynamic" not in by or not statics:
        return goals
    d = by["dynamic"]
    best = max(statics, key=lambda r: (r["goodput_rps"], -r["gpu_hours"]))

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else round(a / b, 4)

    def goal(value: Any, target: str, met: bool, **extra: Any) -> dict[str, Any]:
        return {"value": value, "goal": target, "met": met, **extra}

    g = ratio(d["goodput_rps"], best["goodput_rps"])
    goals["goodput_vs_best_static"] = goal(g, ">= 0.98", g is not None and g >= 0.98, best=best["variant"])
    e = ratio(d["slo_met_per_gpu_hour"], best["slo_met_per_gpu_hour"])
    goals["slo_met_per_gpu_hour_vs_best_static"] = goal(
        e,
        ">= 1.3",
        e is not None and e >= 1.3,
        best=best["variant"],
        gpu_hours=[d["gpu_hours"], best["gpu_hours"]],
    )
    n_w = len(d["windows"])
    low, worst = [], None
    for w in range(int(120 // WINDOW_S), n_w):
        top = max(s["windows"][w]["slo_met"] for s in statics if w < len(s["windows"]))
        if top <= 0:
            continue
        r = d["windows"][w]["slo_met"] / top
        worst = r if worst is None else min(worst, r)
        if r < 0.95:
            low.append({"start_s": d["windows"][w]["start_s"], "ratio": round(r, 3), "best_static": top})
    goals["windows_vs_best_static_of_window"] = goal(
        None if worst is None else round(worst, 4),
        ">= 0.95 in every 60 s window after the first 120 s",
        not low,
        windows_below=low,
        windows=n_w,
    )
    if "oracle" in by:
        o = by["oracle"]
        r_o = ratio(d["slo_met"], o["slo_met"])
        goals["slo_met_vs_oracle"] = goal(
            r_o,
            ">= 0.97",
            r_o is not None and r_o >= 0.97,
            oracle_gpu_hours=o["gpu_hours"],
            oracle_slo_met_per_gpu_hour=o["slo_met_per_gpu_hour"],
        )
    goals["shifts_per_trace_hour"] = goal(d["shifts_per_trace_hour"], "<= 6", d["shifts_per_trace_hour"] <= 6)
    goals["failed_requests"] = goal(d["failed"], "0", d["failed"] == 0)
    return goals


def _report(
    args: argparse.Namespace,
    arch: ModelArch,
    policy: ShiftRules,
    gears: Sequence[GearSpec],
    even: GearSpec,
    plan_info: dict[str, Any],
    plan_s: float,
    scenarios: dict[str, Any],
    workload: tuple[int, int],
) -> dict[str, Any]:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    trace_path = Path(args.trace).resolve()
    return {
        "benchmark": "gears (issues 9, 19): dynamic gear shifting vs each static gear vs the per-window "
        "oracle, goodput and GPU-hours",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "note": "shared 2-core VM; other work ran meanwhile (virtual time: only wall_s and cpu_s vary)",
            "max_rss_mib": round(rss / 1024, 1),
        },
        "method": {
            "time": "virtual (discrete events); 1 trace second = 1 virtual second unless speed != 1",
            "real": [
                "planner.plan on the fleet's resource profile (sim_requests=500, as the reconciler)",
                "planner.inputs.api_gear / gear_links, k8s.engine.sim_pipeline (heads' GEARSHIFT_PIPELINE)",
                "gearshift.sim.engine.Engine (scheduler, paged KV, preemption) timed by sim.perfmodel, "
                "driven through Engine.begin_step/end_step",
                "control.decide.decide (with the capacity controller, control.capacity), "
                "control.executor.step, "
                "control.adapt (policy_from_api with the GearSet API's default ShiftPolicy, gear_views, "
                "shift_request); the initial gear from control.capacity.initial_gear",
            ],
            "simulated": [
                "router: shortest queue ((running + waiting + 1) / the head's GPU prior) over the selected "
                "gear's head pods",
                "Prometheus: stage utilisation gauge (10 s window), summed queue/running, completions over "
                "1 min, P50/P99 by histogram_quantile over the engines' own buckets of the last minute",
                "Kubernetes: EnsureGear creates the gear's engines, Ready after weights load at "
                "policy.transferGbps; SelectGear moves new requests; the old gear finishes its in-flight "
                "requests; DeleteGear removes it (requests still on it count as failed)",
                "contention: engines sharing a card split its time; busy shadows together get at most "
                "warmupShare of it, busy serving engines (active, draining) share the rest equally; a step "
                "lasts its modelled period / the engine's share of its most contended card",
                "warm-up mirroring: arrivals copied to a Ready, unselected shadow through a token bucket at "
                "warmupShare x its predicted throughput (answers dropped, not counted as requests)",
                "GPU time: the cards held by any live gear (union: gears on one node share its card) from 0 "
                "to the last arrival, shadows and draining gears included",
                "arrival rate: completions + growth of requests in flight over the 1 min window, as "
                "control.signals.arrival_query",
            ],
            "oracle": "per scenario: the static gears' SLO-met per 60 s window give, by dynamic programming, "
            "the cheapest gear per window among those within 1% of the window's best, under the shift "
            "mechanics (a shift starts after the previous one's rollback window, drain and dwell: "
            "upshiftDwellS towards more predicted throughput, dwellS otherwise); that schedule is then "
            "replayed through the executor as capacity shifts (load-high up, load-low down), started early "
            "enough to load and warm, and "
            "its figures are the replay's",
            "not_modelled": [
                "PD disaggregation: engines run the combined 'both' role on the whole fleet",
                "weight loading contending with serving (it reads disk or network, not the card)",
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
            "gpu_hours": "cards held x time over the trace duration / 3600 (shadows, draining gears in)",
            "windows": "SLO-met requests by arrival in each 60 s window",
        },
        "parameters": {
            # Repository-relative for the bundled trace: no path of the machine that ran it.
            "trace": str(trace_path.relative_to(ROOT) if trace_path.is_relative_to(ROOT) else trace_path),
            "limit_s": args.limit_s,
            "max_batch": args.max_batch,
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
            "initial_gear": "per scenario: control.capacity.initial_gear at the scenario's first minute's "
            "arrival rate (policy.expectedArrivalRps, unless --policy sets it)",
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
