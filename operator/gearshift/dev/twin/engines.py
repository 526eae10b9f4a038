"""The twin's simulated world: live gears' engines, the router, warm-up mirroring, card contention and GPU
time, driven by an event queue in virtual time (pure: no I/O, no sleeps)."""

from __future__ import annotations

import heapq
import itertools
import math
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from gearshift.control.shifting.policy import ShiftRules
from gearshift.control.signals import WINDOW_S as PROM_WINDOW_S
from gearshift.control.smoothing import Sample
from gearshift.dev.demo.series import histogram_quantile
from gearshift.dev.twin.constants import CLIENT_TIMEOUT_S, REJECTED, RETRY_S
from gearshift.dev.twin.gears import GearSpec
from gearshift.dev.twin.trace import Trace
from gearshift.facts.gpus import pd_gpu_prior
from gearshift.facts.model import ModelArch
from gearshift.k8s.warming import mirror_rps
from gearshift.sim.engine import Engine, PlannedStep, RequestRejected, SimRequest
from gearshift.sim.metrics import token_buckets
from gearshift.sim.perfmodel import PerfModel, PerfParams, parse_pipeline

#: The router's prompt-token buckets (vLLM's 1-2-5 series up to a million tokens).
TOKEN_BUCKETS = token_buckets(10**6)


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

    **Warm-up mirroring** (as the router does it): while a shadow is Ready and not
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
            warmup_share = self.policy.warmup_share
            # Shadows share warmupShare of a card beside serving work; serving engines share the rest.
            part = (
                (warmup_share if serving else 1.0) / shadows
                if mine
                else ((1.0 - warmup_share) if shadows else 1.0) / serving
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
        # The whole gear through this one router: the mirror_rps of one head pod and one router replica.
        rps = 0.0 if shadow is None else mirror_rps(self.policy.warmup_share, shadow.spec.predicted_rps)
        if shadow is None or rps <= 0:
            return
        tokens, at = self._bucket
        tokens = min(rps, tokens + (now - at) * rps)
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
        q: dict[str, Any] = {}
        for key in ("ttft", "itl", "e2e"):
            before = dict(old[key]) if old is not hist else {}
            delta = [(le, c - before.get(le, 0.0)) for le, c in hist[key]]
            for p in (0.5, 0.99):
                v = histogram_quantile(p, delta) if t0 < now else math.nan
                q[f"{key}_p{int(p * 100)}_ms"] = None if math.isnan(v) else v * 1000.0
        qps = (done - done0) / window if t0 < now else 0.0
        arrivals = max(0.0, qps + (inflight - inflight0) / window) if t0 < now else None
        mix = self._mix(now - window, now) if t0 < now else {}
        return Sample(
            at=now,
            stage_utilization=stage_u,
            queue=float(sum(e.num_waiting() for e in engines)),
            running=float(sum(e.num_running() for e in engines)),
            qps=qps,
            arrival_rps=arrivals,
            **q,
            **mix,
        )

    def _mix(self, start: float, end: float) -> dict[str, Any]:
        """The router's token histograms over ``(start, end]`` (s) as the operator's queries read them:
        the mean prompt and output tokens of the requests that arrived, and the prompt-token histogram
        (vLLM's 1-2-5 buckets, cumulative requests/s); empty when none arrived."""
        lo, hi = np.searchsorted(self.trace.t, [start, end], side="right")
        if hi <= lo:
            return {}
        prompts = np.sort(self.trace.prompt[lo:hi])
        span = end - start
        counts = np.searchsorted(prompts, TOKEN_BUCKETS, side="right")
        return {
            "prompt_tokens_mean": float(prompts.mean()),
            "output_tokens_mean": float(self.trace.output[lo:hi].mean()),
            "prompt_tokens_buckets": (
                *((le, float(c) / span) for le, c in zip(TOKEN_BUCKETS, counts, strict=True)),
                (math.inf, float(hi - lo) / span),
            ),
        }
