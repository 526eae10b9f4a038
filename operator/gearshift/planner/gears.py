"""Gear generation: the ``latency``, ``balanced`` and ``throughput`` gears of a model on a fleet.

For each intent the planner enumerates candidates -- micro-batch sizes of the intent (latency 1-4,
balanced 4-8, throughput 8-16, DESIGN.md; only nodes whose ``max_batch_microbatch`` allows one), a
number ``R`` of pipeline replicas (1, 2, ... while classes of identical nodes can staff them), and a
stage-count cap (latency: the fewest stages that fit, or up to 4; balanced: up to 8; throughput: the
fewest that fit, or none)
-- solves each with the minimum-bottleneck partitioner, adds a variant of each (unless single-pipeline)
that gives the fleet's leftover nodes to its hottest stages as extra replicas, predicts each with the
simulator, and keeps per intent:

- ``throughput``: the highest capacity (req/s; at equal capacity the fewest stages, then the lowest
  simulated P99); it also tries the fleet's smallest ``max_batch_microbatch`` when that is below 8, so
  that small cards can join the deep pipeline;
- ``latency``: the lowest simulated P99 at the given QPS among candidates with capacity ≥ QPS / 0.8 (at
  equal P99 the fewest cards, so an extra card that does not lower P99 is left to the other gears);
- ``balanced``: the highest capacity / P99 at that QPS among the same.

Capacity is ``micro_batch × 1000 / effective bottleneck``, where a stage served by nodes with times
``t_j`` accepts a micro-batch every ``1 / Σ 1/t_j`` ms and a link shared by R pipelines every
``cap / R`` ms. A gear suits QPS up to 80% of its capacity (queues stay short below that utilisation);
sorted by capacity, each gear's range starts where the previous one's ends.

Time-limited nodes (:class:`~gearshift.planner.windows.Windows`): a windowed node whose window
closes before the dwell and margin end is left out; the others are *cheap-only*. Single pipelines are
planned on durable nodes alone, a replicated pipeline keeps at least one durable node per stage (durable
nodes first, so pipeline replica 0 is wholly durable; a stage that came out all windowed swaps in a spare
durable node at least as fast and as large, or the candidate is dropped), and hot-stage extras prefer
cheap-only nodes. So a windowed node never holds the only copy of a stage, and dropping it costs
capacity only.

Stage limit (``max_stages``): a caller whose engine cannot run deeper pipelines caps every
candidate's stage count (each intent's cap above is clamped to it). With ``max_stages=1`` every gear is
whole-model pipelines of one stage each -- a node's cards run tensor parallel inside the stage (the
profile's ``memory_gb`` of a node is all its cards) -- and capacity comes from more pipeline replicas and
hot-stage extras (here: more copies of the one stage). The operator passes ``max_stages=1`` for the decode
role of a vLLM PDService (vLLM's NixlConnector serves decode from one pipeline stage only:
:func:`gearshift.planner.inputs.engine_stage_limit`); the simulated engine has no limit, and without the
parameter planning is unchanged. A model that fits no node within the limit raises
:class:`~gearshift.planner.errors.StageLimitError` naming the memory needed and the largest node's.

Whole-pipeline replicas (``whole_pipelines``): an engine that replicates only whole pipelines (vLLM: each
instance owns all its ranks, so one stage cannot get a copy of its own) gets no hot-stage extras on a
candidate of several stages -- its capacity comes from pipeline replicas alone, as it will run. A
one-stage candidate keeps its extras: a copy of its one stage is a whole pipeline.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gearshift.planner.candidates import (
    Candidate,
    gear_candidates,
    kv_budgets,
    kv_resident_sequences,
    set_capacity,
    stage_time_ms,
)
from gearshift.planner.costs import CostModel
from gearshift.planner.errors import EmptyFleetError, PlanError
from gearshift.planner.intents import INTENTS, TARGET_UTILISATION
from gearshift.planner.prediction import (
    MixRates,
    cap_by_tpot,
    decode_times,
    mix_rates,
    output_tokens_of,
    running_batch,
    simulate_candidate,
)
from gearshift.planner.profile import Profile
from gearshift.planner.tpot import tpot_ms
from gearshift.planner.windows import Windows

#: Default offered load when none is given: this share of the best capacity found.
DEFAULT_QPS_SHARE = 0.25


@dataclass(frozen=True)
class Stage:
    """One stage of a gear: layers ``[start, end)`` on ``nodes`` (one pod per node)."""

    layers: tuple[int, int]
    node: str
    """The first replica's node (pipeline replica 0)."""
    nodes: tuple[str, ...]
    """Every node holding the stage: pipeline replica r on ``nodes[r]``, hot-stage extras after them."""
    time_ms: float
    """Time per micro-batch on the slowest of ``nodes``, ms."""
    memory_gb: float

    @property
    def replicas(self) -> int:
        return len(self.nodes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "layers": list(self.layers),
            "node": self.node,
            "nodes": list(self.nodes),
            "replicas": self.replicas,
            "time_ms": round(self.time_ms, 6),
            "memory_gb": round(self.memory_gb, 3),
        }


@dataclass(frozen=True)
class Prediction:
    """What the simulator and the cost model predict for a gear."""

    throughput_rps: float
    """Capacity, requests/s."""
    qps: float
    """Load the latencies were simulated at, requests/s."""
    p50_ms: float
    p99_ms: float
    saturated: bool
    mean_batch: float
    itl_ms: float | None = None
    """Mean time per output token of a request at ``qps`` (role ``both``/``decode`` under the roofline
    model: :func:`predicted_itl_ms`), ms; None when the cost model cannot say."""
    mix: MixRates | None = None
    """How capacity and first-token time move with the request mix
    (:func:`gearshift.planner.prediction.mix_rates`); None when the cost model cannot say."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "throughput_rps": round(self.throughput_rps, 4),
            "qps": round(self.qps, 4),
            "p50_ms": round(self.p50_ms, 3),
            "p99_ms": round(self.p99_ms, 3),
            "saturated": self.saturated,
            "mean_batch": round(self.mean_batch, 3),
        }
        if self.itl_ms is not None:
            out["itl_ms"] = round(self.itl_ms, 3) if math.isfinite(self.itl_ms) else None
        if self.mix is not None:
            for key, value, digits in (
                ("prompt_tokens_per_s", self.mix.prompt_tokens_per_s, 3),
                ("output_tokens_per_s", self.mix.output_tokens_per_s, 3),
                ("ttft_ms_per_prompt_token", self.mix.ttft_ms_per_prompt_token, 6),
            ):
                if value is not None:
                    out[key] = round(value, digits)
        return out


@dataclass(frozen=True)
class Gear:
    """One complete pipeline configuration (DESIGN.md's glossary)."""

    name: str
    stages: tuple[Stage, ...]
    micro_batch: int
    max_batch: int
    """Requests in flight per pipeline replica: ``micro_batch × stages`` keeps every stage busy."""
    pipelines: int
    bottleneck_ms: float
    """Slowest stage time or link bound of one pipeline replica, ms per micro-batch."""
    effective_ms: float
    """Time between micro-batches the whole gear accepts (replicas and extras counted), ms."""
    lower_bound_ms: float
    exact: bool
    predicted: Prediction
    qps_range: tuple[float, float] = (0.0, 0.0)
    link_ms: tuple[float, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "stages": [s.to_dict() for s in self.stages],
            "micro_batch": self.micro_batch,
            "max_batch": self.max_batch,
            "pipelines": self.pipelines,
            "bottleneck_ms": round(self.bottleneck_ms, 6),
            "effective_ms": round(self.effective_ms, 6),
            "lower_bound_ms": round(self.lower_bound_ms, 6),
            "exact": self.exact,
            "predicted": self.predicted.to_dict(),
            "qps_range": [round(self.qps_range[0], 4), round(self.qps_range[1], 4)],
            "link_ms": [round(x, 6) for x in self.link_ms],
        }


@dataclass(frozen=True)
class PlanResult:
    """The gears planned for one model on one fleet."""

    model: str
    gears: tuple[Gear, ...]
    qps: float
    left_out: dict[str, str] = field(default_factory=dict)
    """Intents whose pick was not worth a gear (``plan(worthwhile_only=True)``), and why."""

    def gear(self, name: str) -> Gear:
        """The gear named ``name``. Raises KeyError naming the ones there are."""
        for g in self.gears:
            if g.name == name:
                return g
        raise KeyError(f"no gear {name!r}; planned: {', '.join(g.name for g in self.gears)}")

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "qps": round(self.qps, 4), "gears": [g.to_dict() for g in self.gears]}


def plan(
    profile: Profile,
    model: CostModel,
    *,
    intents: Sequence[str] = ("latency", "balanced", "throughput"),
    qps: float | None = None,
    single_pipeline: bool = False,
    sim_requests: int = 2000,
    seed: int = 0,
    windows: Windows | None = None,
    max_stages: int | None = None,
    max_stages_why: str = "",
    whole_pipelines: bool = False,
    itl_target_ms: float | None = None,
    worthwhile_only: bool = False,
) -> PlanResult:
    """Plan the gears of ``model`` on ``profile``.

    Args:
        profile: the fleet's nodes and links.
        model: layer costs per micro-batch size (:class:`~gearshift.planner.costs.CostModel`).
        intents: which of ``latency``, ``balanced``, ``throughput`` to plan.
        qps: offered load for the latency predictions, requests/s (default: 25% of the best capacity).
        single_pipeline: one pipeline, no replicas or extras; ``throughput`` is then the exact
            minimum-bottleneck pipeline at micro-batch 8 (16 if no node runs 8).
        sim_requests: requests per simulated run (bounds the planning time).
        seed: seed of the simulated arrivals.
        windows: time-limited nodes (seconds left, dwell, margin): those closing within dwell + margin
            are left out, the others hold only cheap-to-drop replicas (module docstring).
        max_stages: most stages of any gear (None: no limit beyond each intent's); ``1`` plans whole-model
            one-stage gears only, scaled by pipeline replicas (module docstring, "Stage limit").
        max_stages_why: why the limit holds, quoted in the error when the model does not fit within it.
        whole_pipelines: the engine replicates whole pipelines only (vLLM): no hot-stage extras on gears
            of several stages (module docstring).
        itl_target_ms: the TPOT target (the SLO's ``itlMs``), ms. With the roofline model of role ``both``
            or ``decode``, a gear's capacity is then the load its predicted mean TPOT meets within
            :data:`~gearshift.planner.prediction.TPOT_HEADROOM` of it
            (:func:`gearshift.planner.tpot.tpot_capacity`), when that is lower than the rate that keeps its
            stages busy: a deep pipeline of slow stages can be busy only part of the time and still give every
            token too late. None: capacity is the busy rate alone.
        worthwhile_only: leave out the picks not worth a gear (:func:`worth_having`), as the operator and
            ``gearshift plan`` do; False keeps one gear per intent.

    Returns:
        A :class:`PlanResult` with one :class:`Gear` per intent, in the order asked (with
        ``worthwhile_only``, less the picks not worth a gear: one layout under two names, or more cards
        for no more capacity).

    Raises:
        PlanError: an unknown intent, qps ≤ 0 or max_stages < 1; InfeasibleError subclasses when no gear
            fits, naming what does not fit and by how much (StageLimitError: not within ``max_stages``).
    """
    unknown = [i for i in intents if i not in INTENTS]
    if unknown or not intents:
        raise PlanError(f"unknown gear {unknown}; choose from {', '.join(INTENTS)}")
    if qps is not None and qps <= 0:
        raise PlanError(f"qps must be > 0, got {qps}")
    if max_stages is not None and max_stages < 1:
        raise PlanError(f"max_stages must be >= 1 or None, got {max_stages}")
    if not profile.nodes:
        raise EmptyFleetError("the resource profile lists no nodes")
    cheap: frozenset[str] = frozenset()
    if windows is not None:
        ids = [n.node_id for n in profile.nodes]
        gone = windows.excluded(ids)
        if gone:
            profile = profile.subset(frozenset(ids) - gone)
            if not profile.nodes:
                raise EmptyFleetError(
                    f"every node's window closes within dwell + margin "
                    f"({windows.dwell_s:g} + {windows.margin_s:g} s): {', '.join(sorted(gone))}"
                )
        cheap = windows.cheap_only(ids)
    if itl_target_ms is not None and itl_target_ms <= 0:
        raise PlanError(f"itl_target_ms must be > 0, got {itl_target_ms}")
    budgets = kv_budgets(model) if itl_target_ms is not None else [model]
    pools: dict[str, list[Candidate]] = {}
    for i in intents:
        pools[i] = []
        first_error: PlanError | None = None
        for m in budgets:
            try:
                found = gear_candidates(
                    profile,
                    m,
                    i,
                    single_pipeline,
                    cheap,
                    max_stages,
                    max_stages_why,
                    whole_pipelines,
                    short_balanced=itl_target_ms is not None,
                )
            except PlanError as exc:
                first_error = first_error or exc
                continue
            for c in found:
                c.model = m
            pools[i] += found
        if not pools[i]:
            assert first_error is not None
            raise first_error
    for cands in pools.values():
        for c in cands:
            set_capacity(profile, model, c)
    busy_capacity = max(c.capacity for cands in pools.values() for c in cands)
    if itl_target_ms is not None:
        for cands in pools.values():
            for c in cands:
                cap_by_tpot(profile, _model_of(c, model), c, itl_target_ms)
    best_capacity = max(c.capacity for cands in pools.values() for c in cands)
    load = qps if qps is not None else DEFAULT_QPS_SHARE * (best_capacity or busy_capacity)
    chosen: dict[str, Candidate] = {}
    for intent, cands in pools.items():
        if intent == "throughput":
            best = max(c.capacity for c in cands)
            # Equal capacity (the same cards as R pipelines or as one plus extras): the fewest stages,
            # then the lowest simulated P99 -- more pipelines keep more micro-batches in flight.
            top = [c for c in cands if c.capacity >= best * (1 - 1e-9)]
            fewest = min(len(c.pipeline.stages) for c in top)
            top = [c for c in top if len(c.pipeline.stages) == fewest]
            for c in top:
                simulate_candidate(profile, _model_of(c, model), c, load, sim_requests, seed)
            pick = min(top, key=lambda c: (c.sim.p99_ms, _cards(c)))  # type: ignore[union-attr]
        else:
            ok = [c for c in cands if c.capacity * TARGET_UTILISATION >= load] or [
                max(cands, key=lambda c: c.capacity)
            ]
            for c in ok:
                simulate_candidate(profile, _model_of(c, model), c, load, sim_requests, seed)
            if intent == "latency":
                # Equal P99, fewer cards: the simulator hands a micro-batch to whichever server ends it
                # first, so an extra slower card that never helped leaves P99 unchanged there, while a
                # router spreading requests over replicas would send it its share at its slower pace.
                pick = min(ok, key=lambda c: (c.sim.p99_ms, _cards(c), -c.capacity))  # type: ignore[union-attr]
            else:
                pick = max(ok, key=lambda c: c.capacity / c.sim.p99_ms)  # type: ignore[union-attr]
        chosen[intent] = pick
    left_out: dict[str, str] = {}
    if worthwhile_only:
        chosen, left_out = worth_having(chosen)
    for c in chosen.values():
        m = _model_of(c, model)
        times = decode_times(profile, m, c)
        if times is not None:
            c.itl_ms = tpot_ms(times, load / c.pipeline.replicas, output_tokens_of(m), running_batch(c, m))
    ranges = _qps_ranges({i: c.capacity for i, c in chosen.items()})
    gears = tuple(
        _gear(
            profile,
            chosen[i],
            ranges[i],
            kv_resident_sequences(_model_of(chosen[i], model)),
            mix_rates(profile, _model_of(chosen[i], model), chosen[i], itl_target_ms),
        )
        for i in intents
        if i in chosen
    )
    return PlanResult(model.name, gears, load, left_out)


def _layout(c: Candidate) -> tuple[Any, ...]:
    """What a gear deploys: each stage's layers and nodes, the micro-batch and the decode batch."""
    stages = tuple((st.start, st.end, tuple(ids)) for st, ids in zip(c.pipeline.stages, c.nodes, strict=True))
    return stages, c.micro_batch, c.decode_batch


def worth_having(chosen: dict[str, Candidate]) -> tuple[dict[str, Candidate], dict[str, str]]:
    """The intents' picks less those not worth a gear, and why each was left out: a layout another intent
    also picked (one layout under two names is one gear; the later intent keeps it, ``throughput`` before
    ``balanced`` before ``latency``), and a pick that holds more cards than another and serves no more
    (``capacity``, requests/s of the planned workload): no load would ever want it. Order is kept.
    """
    names = list(chosen)
    keep = dict(chosen)
    why: dict[str, str] = {}
    for i, a in enumerate(names):
        twin = next((b for b in names[i + 1 :] if _layout(chosen[b]) == _layout(chosen[a])), None)
        if twin is not None:
            del keep[a]
            why[a] = f"is the same layout as {twin}"
    for a in list(keep):
        ca = keep[a]
        better = next(
            (
                b
                for b, cb in keep.items()
                if b != a and _cards(cb) < _cards(ca) and cb.capacity >= ca.capacity
            ),
            None,
        )
        if better is not None:
            del keep[a]
            cb = keep[better]
            why[a] = (
                f"holds {_cards(ca)} cards for {ca.capacity:.1f} req/s where {better} serves "
                f"{cb.capacity:.1f} on {_cards(cb)}"
            )
    return keep, why


def _model_of(c: Candidate, model: CostModel) -> CostModel:
    return c.model if c.model is not None else model


def _cards(c: Candidate) -> int:
    """GPU nodes a candidate occupies (pipeline replicas and hot-stage extras alike)."""
    return sum(len(ids) for ids in c.nodes)


def _qps_ranges(capacity: dict[str, float]) -> dict[str, tuple[float, float]]:
    out, lo = {}, 0.0
    for name in sorted(capacity, key=capacity.__getitem__):
        hi = max(lo, TARGET_UTILISATION * capacity[name])
        out[name] = (lo, hi)
        lo = hi
    return out


def _gear(
    profile: Profile,
    c: Candidate,
    qps_range: tuple[float, float],
    kv_batch: int = 0,
    mix: MixRates | None = None,
) -> Gear:
    assert c.sim is not None
    stages = []
    for st, ids in zip(c.pipeline.stages, c.nodes, strict=True):
        t = max(stage_time_ms(c.costs, st.start, st.end, profile.node(n).compute_score) for n in ids)
        stages.append(Stage((st.start, st.end), ids[0], tuple(ids), t, st.memory_gb))
    pred = Prediction(
        c.capacity, c.sim.qps, c.sim.p50_ms, c.sim.p99_ms, c.sim.saturated, c.sim.mean_batch, c.itl_ms, mix
    )
    if math.isnan(pred.p99_ms):
        raise PlanError("the simulator produced no latency; raise sim_requests")
    return Gear(
        name=c.intent,
        stages=tuple(stages),
        micro_batch=c.micro_batch,
        # Running sequences per pipeline (vLLM's --max-num-seqs): at least enough micro-batches to keep
        # every stage busy, and as many as the KV cache reserved on every stage holds -- decode steps
        # batch all running sequences, so capping at micro-batch × stages would serialise decode.
        max_batch=running_batch(c, kv_batch=kv_batch),
        pipelines=c.pipeline.replicas,
        bottleneck_ms=c.pipeline.bottleneck_ms,
        effective_ms=c.effective_ms,
        lower_bound_ms=c.pipeline.lower_bound_ms,
        exact=c.pipeline.exact,
        predicted=pred,
        qps_range=qps_range,
        link_ms=c.pipeline.link_ms,
    )
