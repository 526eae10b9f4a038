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

Time-limited nodes (:class:`~gearshift.planner.windows.Windows`, issue 13): a windowed node whose window
closes before the dwell and margin end is left out; the others are *cheap-only*. Single pipelines are
planned on durable nodes alone, a replicated pipeline keeps at least one durable node per stage (durable
nodes first, so pipeline replica 0 is wholly durable; a stage that came out all windowed swaps in a spare
durable node at least as fast and as large, or the candidate is dropped), and hot-stage extras prefer
cheap-only nodes. So a windowed node never holds the only copy of a stage, and dropping it costs
capacity only.

Stage limit (``max_stages``, issue 18): a caller whose engine cannot run deeper pipelines caps every
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
from dataclasses import dataclass, field, replace
from typing import Any

from gearshift.planner.costs import CostModel, LayerCosts, RooflineCostModel
from gearshift.planner.errors import EmptyFleetError, InfeasibleError, PlanError, StageLimitError
from gearshift.planner.partition import (
    DEFAULT_WORK_CAP,
    Pipeline,
    PipelineStage,
    evaluate,
    fewest_stages,
    lower_bound_ms,
    min_bottleneck,
)
from gearshift.planner.profile import Profile
from gearshift.planner.simulate import SimResult, simulate
from gearshift.planner.tpot import DecodeTimes, tpot_capacity, tpot_ms
from gearshift.planner.windows import Windows

INTENTS: dict[str, tuple[int, ...]] = {"latency": (1, 2, 4), "balanced": (4, 8), "throughput": (8, 16)}
#: Utilisation up to which a gear is said to suit a load.
TARGET_UTILISATION = 0.8
#: Most pipeline replicas tried per gear.
MAX_PIPELINES = 8
#: Default offered load when none is given: this share of the best capacity found.
DEFAULT_QPS_SHARE = 0.25
#: Share of a TPOT target the *mean* predicted TPOT may reach: a request's TPOT scatters around the mean
#: with the prompts that land during its decode, and the SLO judges every request (as TARGET_UTILISATION
#: keeps queues short below capacity).
TPOT_HEADROOM = 0.8


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

    def gear(self, name: str) -> Gear:
        """The gear named ``name``. Raises KeyError naming the ones there are."""
        for g in self.gears:
            if g.name == name:
                return g
        raise KeyError(f"no gear {name!r}; planned: {', '.join(g.name for g in self.gears)}")

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "qps": round(self.qps, 4), "gears": [g.to_dict() for g in self.gears]}


# --------------------------------------------------------------------------------------------


@dataclass
class _Candidate:
    intent: str
    micro_batch: int
    pipeline: Pipeline
    costs: LayerCosts
    nodes: list[list[str]]
    decode_batch: int | None = None
    """Sequences per micro-batch of a decode step when not the micro-batch (continuous batching: the
    running sequences over the stages, :func:`_batched_decode`)."""
    effective_ms: float = 0.0
    capacity: float = 0.0
    sim: SimResult | None = None
    itl_ms: float | None = None
    model: CostModel | None = None
    """The cost model the candidate was planned with when not the plan's (a smaller KV budget:
    :func:`_kv_budgets`)."""


def _stage_ms(costs: LayerCosts, start: int, end: int, score: float) -> float:
    return sum(costs.compute_ms[start:end]) / score


def _link_bound(profile: Profile, c: _Candidate) -> float:
    bound = 0.0
    for a, b in zip(c.nodes, c.nodes[1:], strict=False):
        for x in a:
            for y in b:
                link = profile.link(x, y)
                if link is not None:
                    bound = max(bound, link.cap_ms(c.costs.activation_mb))
    return bound / c.pipeline.replicas


def _add_extras(
    profile: Profile,
    c: _Candidate,
    free: list[str],
    cheap: frozenset[str] = frozenset(),
    all_linked: bool = False,
) -> None:
    """Give leftover nodes to the hottest stage while they fit its memory and link to both neighbours;
    cheap-only (time-limited) nodes first, then the fastest. ``all_linked``: the caller knows every pair of
    nodes is linked, so the link checks are skipped."""
    while free:
        rates = [
            sum(1.0 / _stage_ms(c.costs, st.start, st.end, profile.node(n).compute_score) for n in ids)
            for st, ids in zip(c.pipeline.stages, c.nodes, strict=True)
        ]
        k = min(range(len(rates)), key=rates.__getitem__)
        st = c.pipeline.stages[k]
        fits = []
        for nid in free:
            node = profile.node(nid)
            if node.memory_gb < st.memory_gb:
                continue
            neighbours = (c.nodes[k - 1] if k else []) + (c.nodes[k + 1] if k + 1 < len(c.nodes) else [])
            if all_linked or all(profile.link(nid, m) is not None for m in neighbours):
                fits.append(nid)
        if not fits:
            return
        best = max(fits, key=lambda n: (n in cheap, profile.node(n).compute_score))
        c.nodes[k].append(best)
        free.remove(best)


def _tables(profile: Profile, model: CostModel, c: _Candidate) -> tuple[list, list, list]:
    """The simulator's tables for micro-batches of 1..micro_batch requests: passage (the key latency's
    share) and busy time per stage and server, and link transfer per boundary, ms."""
    per_n = [model.at(n, c.decode_batch) for n in range(1, c.micro_batch + 1)]

    def table(cn: LayerCosts, st: PipelineStage, nid: str, passage: bool) -> float:
        work = cn.pass_ms if passage else cn.compute_ms
        return sum(work[st.start : st.end]) / profile.node(nid).compute_score

    stage_ms = [
        [[table(cn, st, nid, True) for cn in per_n] for nid in ids]
        for st, ids in zip(c.pipeline.stages, c.nodes, strict=True)
    ]
    busy_ms = [
        [[table(cn, st, nid, False) for cn in per_n] for nid in ids]
        for st, ids in zip(c.pipeline.stages, c.nodes, strict=True)
    ]
    link_ms = []
    for a, b in zip(c.nodes, c.nodes[1:], strict=False):
        pairs = [profile.link(x, y) for x, y in zip(a, b, strict=False)]
        link_ms.append([max(p.transfer_ms(cn.activation_mb) for p in pairs if p is not None) for cn in per_n])
    return stage_ms, link_ms, busy_ms


def _secure(
    profile: Profile, stages: list[list[str]], cheap: frozenset[str], eligible: list[str]
) -> list[list[str]] | None:
    """``stages`` (node ids per stage) with durable nodes first in each stage, or None when some stage
    holds only cheap-only nodes and no spare durable node (at least as fast, as large, linked to the
    neighbouring stages) can take one of their places."""
    used = {n for ids in stages for n in ids}
    spare = [n for n in eligible if n not in cheap and n not in used]
    out: list[list[str]] = []
    for k, ids_in in enumerate(stages):
        ids = list(ids_in)
        if all(n in cheap for n in ids):
            neighbours = (out[k - 1] if k else []) + (stages[k + 1] if k + 1 < len(stages) else [])
            swap = next(
                (
                    (w, d)
                    for w in ids
                    for d in spare
                    if profile.node(d).compute_score >= profile.node(w).compute_score
                    and profile.node(d).memory_gb >= profile.node(w).memory_gb
                    and all(profile.link(d, m) is not None for m in neighbours)
                ),
                None,
            )
            if swap is None:
                return None
            ids[ids.index(swap[0])] = swap[1]
            spare.remove(swap[1])
        out.append(sorted(ids, key=lambda n: n in cheap))  # stable: durable first
    return out


def _stage_limit_error(
    profile: Profile, costs: LayerCosts, node_ids: Sequence[str], kmin: int, max_stages: int, why: str
) -> StageLimitError:
    """Why no pipeline of at most ``max_stages`` stages fits ``node_ids`` (the fewest that fit: ``kmin``)."""
    need = sum(costs.memory_gb(i) for i in range(costs.num_layers))
    nodes = sorted((profile.node(n) for n in node_ids), key=lambda n: (-n.memory_gb, n.node_id))
    have = sum(n.memory_gb for n in nodes[:max_stages])
    because = f": {why}" if why else ""
    if max_stages == 1:
        what = "one node's memory"
        where = f"the largest node, {nodes[0].node_id}, holds {have:.2f} GiB"
        limit = f"gears here have one stage only{because}"
    else:
        what = f"the memory of {max_stages} nodes"
        where = f"the {max_stages} largest nodes hold {have:.2f} GiB"
        limit = f"gears here have at most {max_stages}{because}"
    return StageLimitError(
        f"the model does not fit {what}: its weights + KV cache need {need:.2f} GiB and {where}, short by "
        f"{max(need - have, 0.0):.2f} GiB (it needs {kmin} stages, but {limit}); add a node with more GPU "
        "memory (more or larger cards, tensor parallel inside the node) or lower the KV budget "
        "(spec.plan.workload, memoryUtilization)"
    )


def _large_pool(profile: Profile) -> bool:
    """The pool is large: the exact partitioner's DP over classes of identical nodes would exceed its
    state cap (:data:`~gearshift.planner.partition.DEFAULT_WORK_CAP`), where it falls back to a heuristic
    on a trimmed slice of the fleet. Such pools are planned by the fleet-scale planner instead."""
    counts: dict[tuple[float, float], int] = {}
    for n in profile.nodes:
        key = (n.compute_score, n.memory_gb)
        counts[key] = counts.get(key, 0) + 1
    return math.prod(c + 1 for c in counts.values()) * len(counts) > DEFAULT_WORK_CAP


def _fleet_candidates(profile: Profile, model: CostModel, intent: str) -> list[_Candidate] | None:
    """Candidates of a large pool from the fleet-scale planner (:mod:`gearshift.planner.fleetplan`): per
    micro-batch size of the intent, the max-load plan over classes of identical nodes; each group of
    identical pipelines in it becomes one candidate of that many pipeline replicas on concrete nodes (and
    its variant with the leftover nodes as hot-stage extras). None when the fleet planner cannot take the
    profile (a node pair without a link) or finds nothing, so the caller plans as for small pools."""
    # Imported here: fleetplan reads this module's intents and utilisation (no import cycle at load time).
    from gearshift.planner.fleetplan import Workload, class_nodes, max_load, profile_classes

    try:
        fc = profile_classes(profile)
    except PlanError:
        return None
    members = class_nodes(profile, fc)
    sizes = list(INTENTS[intent])
    smallest = min(n.max_micro_batch for n in profile.nodes)
    if intent == "throughput" and smallest < sizes[0]:
        sizes.insert(0, smallest)
    out: list[_Candidate] = []
    for mb in sizes:
        try:
            answer = max_load(fc, Workload(model, None, micro_batches=(mb,)))
        except PlanError:
            continue
        costs = model.at(mb)
        for group in answer.pipelines:
            pools = {name: list(ids) for name, ids in members.items()}
            cuts = [(a, b, tuple(pools[u].pop(0) for _ in range(group.count))) for a, b, u in group.stages]
            bottleneck, times, transfers = evaluate(profile, costs, cuts)
            stages = tuple(
                PipelineStage(a, b, ids, t, sum(costs.memory_gb(i) for i in range(a, b)))
                for (a, b, ids), t in zip(cuts, times, strict=True)
            )
            used = [profile.node(n) for _, _, ids in cuts for n in ids]
            pipe = Pipeline(
                stages,
                bottleneck,
                lower_bound_ms(costs, used, group.count),
                False,
                "fleet: LP bound + class templates",
                group.count,
                tuple(transfers),
            )
            c = _Candidate(intent, mb, pipe, costs, [list(ids) for _, _, ids in cuts])
            out.append(c)
            wide = replace(c, nodes=[list(ids) for ids in c.nodes])
            taken = {n for ids in wide.nodes for n in ids}
            # profile_classes refused profiles with an unlinked pair, so every pair is linked here.
            free = [n.node_id for n in profile.nodes if n.node_id not in taken]
            _add_extras(profile, wide, free, all_linked=True)
            if wide.nodes != c.nodes:
                out.append(wide)
    return out or None


def _candidates(
    profile: Profile,
    model: CostModel,
    intent: str,
    single_pipeline: bool,
    cheap: frozenset[str] = frozenset(),
    max_stages: int | None = None,
    max_stages_why: str = "",
    whole_pipelines: bool = False,
    short_balanced: bool = False,
) -> list[_Candidate]:
    if not single_pipeline and not cheap and max_stages is None and _large_pool(profile):
        fleet = _fleet_candidates(profile, model, intent)
        if fleet:
            return fleet
    out: list[_Candidate] = []
    last_error: PlanError | None = None
    sizes = list(INTENTS[intent])
    kv_batch = kv_resident_sequences(model)
    smallest = min(n.max_micro_batch for n in profile.nodes)
    if intent == "throughput" and smallest < sizes[0]:
        # Small cards run only small micro-batches; without this they could never join the deep pipeline.
        sizes.insert(0, smallest)
    for mb in sizes:
        eligible = [n.node_id for n in profile.nodes if n.max_micro_batch >= mb]
        if not eligible:
            last_error = EmptyFleetError(
                f"no node runs a micro-batch of {mb} (max_batch_microbatch); the {intent} gear needs one"
            )
            continue
        durable = [n for n in eligible if n not in cheap]
        if not durable:
            last_error = EmptyFleetError(
                f"every node that runs a micro-batch of {mb} is time-limited; the only copy of a stage "
                "needs a node without a window"
            )
            continue
        costs = model.at(mb)
        try:
            kmin = fewest_stages(profile, costs, node_ids=durable)
        except PlanError as exc:
            last_error = exc
            continue
        if kmin is None:
            try:  # let the partitioner explain why nothing fits
                min_bottleneck(profile, costs, node_ids=durable)
            except InfeasibleError as exc:
                last_error = exc
            continue
        if max_stages is not None and kmin > max_stages:
            last_error = _stage_limit_error(profile, costs, durable, kmin, max_stages, max_stages_why)
            continue
        caps: Sequence[int | None]
        if single_pipeline:
            caps = [None]
        elif intent == "throughput":
            # Uncapped gives the deepest min-bottleneck pipeline; the fewest stages give whole-model (or
            # few-stage) replicas that the leftover cards can join as extras -- often more capacity.
            caps = [None] if kmin == len(profile.nodes) else [kmin, None]
        elif intent == "latency":
            caps = sorted({kmin, max(kmin, 4)})
        elif short_balanced:
            # Up to 8 stages, and the fewer-stage caps latency tries: when a TPOT target caps capacity
            # (aggregated serving), a deep pipeline of slow stages can serve less than a short one.
            caps = sorted({kmin, max(kmin, 4), max(kmin, 8)})
        else:
            caps = [max(kmin, 8)]
        if max_stages is not None:
            caps = sorted({max_stages if c is None else min(c, max_stages) for c in caps})
        for cap in caps:
            for r in range(1, 2 if single_pipeline else MAX_PIPELINES + 1):
                try:
                    # One pipeline: durable nodes only; more: any, then one durable node per stage.
                    ids = durable if r == 1 else eligible
                    p = min_bottleneck(profile, costs, replicas=r, max_stages=cap, node_ids=ids)
                except InfeasibleError as exc:
                    if r == 1:
                        last_error = exc
                    break
                secured = _secure(profile, [list(s.node_ids) for s in p.stages], cheap, eligible)
                if secured is None:
                    continue
                c = _Candidate(intent, mb, p, costs, secured)
                if math.ceil(kv_batch / len(p.stages)) > mb:
                    _batched_decode(profile, model, c, kv_batch, ids)
                out.append(c)
                if not single_pipeline and not (whole_pipelines and len(p.stages) > 1):
                    # Extras are a variant, not forced: a slower extra card raises capacity but can raise
                    # P99 (it serves its share of requests at its own, slower pace), so both versions
                    # compete and each intent's rule in plan() picks.
                    used = {n for ids_ in secured for n in ids_}
                    wide = replace(c, nodes=[list(ids_) for ids_ in c.nodes])
                    _add_extras(profile, wide, [n for n in eligible if n not in used], cheap)
                    if wide.nodes != c.nodes:
                        out.append(wide)
    if not out:
        raise last_error or EmptyFleetError(f"no {intent} gear fits the fleet")
    return out


def _batched_decode(
    profile: Profile, model: CostModel, c: _Candidate, kv_batch: int, node_ids: Sequence[str]
) -> None:
    """Re-price a candidate whose decode steps batch the running sequences, ``kv_batch`` (its max batch)
    over its ``K`` stages: ``ceil(kv_batch / K)`` sequences per micro-batch of a step.

    Continuous batching keeps at most one micro-batch per stage in flight and puts every running sequence
    into one of them (vLLM V1's batch queue of pipeline-parallel-size batches, ``vllm/v1/engine/core.py``;
    :mod:`gearshift.sim.perfmodel` runs the same), so a decode step reads a stage's weights once per
    ``kv_batch / K`` sequences, not once per planner micro-batch: at micro-batch 1 a deep pipeline of a
    large model would otherwise be priced a whole weight read per request per token. The stages keep
    their layers (the per-layer cost changes by one factor, bar the LM head folded into the last layer).
    """
    n = len(c.pipeline.stages)
    d = math.ceil(kv_batch / n)
    costs = model.at(c.micro_batch, d)
    cuts = [(st.start, st.end, st.node_ids) for st in c.pipeline.stages]
    bottleneck, times, transfers = evaluate(profile, costs, cuts)
    stages = tuple(
        PipelineStage(st.start, st.end, st.node_ids, t, st.memory_gb)
        for st, t in zip(c.pipeline.stages, times, strict=True)
    )
    lb = lower_bound_ms(costs, [profile.node(n_) for n_ in node_ids], c.pipeline.replicas)
    c.pipeline = replace(
        c.pipeline, stages=stages, bottleneck_ms=bottleneck, lower_bound_ms=lb, link_ms=tuple(transfers)
    )
    c.costs = costs
    c.decode_batch = d


def _finish(profile: Profile, model: CostModel, c: _Candidate) -> None:
    worst = 0.0
    for st, ids in zip(c.pipeline.stages, c.nodes, strict=True):
        rate = sum(1.0 / _stage_ms(c.costs, st.start, st.end, profile.node(n).compute_score) for n in ids)
        worst = max(worst, 1.0 / rate)
    c.effective_ms = max(worst, _link_bound(profile, c))
    c.capacity = c.micro_batch * 1000.0 / c.effective_ms


def _max_batch(c: _Candidate, model: CostModel | None = None, kv_batch: int | None = None) -> int:
    """Running sequences per pipeline (the gear's ``max_batch``; see :func:`_gear`)."""
    kv = kv_batch if kv_batch is not None else kv_resident_sequences(model) if model is not None else 0
    return max(c.micro_batch * len(c.pipeline.stages), kv)


def _output_tokens(model: CostModel) -> int:
    assumptions = getattr(model, "assumptions", None)
    return int(getattr(assumptions, "output_tokens", 1) or 1)


def _decode_times(profile: Profile, model: CostModel, c: _Candidate) -> DecodeTimes | None:
    """One pipeline replica's decode-step, link and prompt times
    (:class:`~gearshift.planner.tpot.DecodeTimes`) on the slowest node of each stage; None unless
    ``model`` is the roofline model of a role that decodes (a layer-cost file states no decode step)."""
    if not isinstance(model, RooflineCostModel) or model.assumptions.role not in ("both", "decode"):
        return None
    decode = RooflineCostModel(model.arch, replace(model.assumptions, role="decode"))
    per_token_mb = model.arch.activation_bytes_per_token / 1e6
    scores = [min(profile.node(n).compute_score for n in ids) for ids in c.nodes]
    cuts = [(st.start, st.end) for st in c.pipeline.stages]
    memo: dict[int, list[float]] = {}

    def step_ms(d: float) -> list[float]:
        key = max(1, math.ceil(d - 1e-9))
        if key not in memo:
            lat = decode.at(key).pass_ms
            memo[key] = [sum(lat[a:b]) / sc for (a, b), sc in zip(cuts, scores, strict=True)]
        return memo[key]

    links = []
    for a, b in zip(c.nodes, c.nodes[1:], strict=False):
        pairs = [p for p in (profile.link(x, y) for x, y in zip(a, b, strict=False)) if p is not None]
        if pairs:
            links.append(max(pairs, key=lambda p: p.transfer_ms(1.0)))

    def link_ms(d: float) -> float:
        return sum(p.transfer_ms(d * per_token_mb) for p in links)

    if model.assumptions.role == "decode":
        prefill = [0.0] * len(cuts)
    else:
        first = model.at(1).pass_ms
        prefill = [sum(first[a:b]) / sc for (a, b), sc in zip(cuts, scores, strict=True)]
    return DecodeTimes(step_ms, link_ms, prefill)


def _cap_by_tpot(profile: Profile, model: CostModel, c: _Candidate, target_ms: float) -> None:
    """Lower ``c.capacity`` to the load at which its predicted mean TPOT stays within
    :data:`TPOT_HEADROOM` × ``target_ms`` (no change when the model cannot predict TPOT)."""
    times = _decode_times(profile, model, c)
    if times is None:
        return
    r = c.pipeline.replicas
    per_pipeline = tpot_capacity(
        times, TPOT_HEADROOM * target_ms, _output_tokens(model), _max_batch(c, model), c.capacity / r
    )
    c.capacity = min(c.capacity, per_pipeline * r)


def _simulate(
    profile: Profile, model: CostModel, c: _Candidate, qps: float, requests: int, seed: int
) -> None:
    stage_ms, link_ms, busy_ms = _tables(profile, model, c)
    window = c.pipeline.replicas * len(c.pipeline.stages)
    slack = 0.0
    times = _decode_times(profile, model, c)
    if times is not None and isinstance(model, RooflineCostModel) and model.assumptions.role == "both":
        # Continuous batching spreads a request's decode over its decode's span (simulate's busy_slack_ms).
        out = _output_tokens(model)
        tpot = tpot_ms(times, qps / c.pipeline.replicas, out, _max_batch(c, model))
        slack = (out - 1) * tpot if math.isfinite(tpot) else 0.0
    c.sim = simulate(
        stage_ms,
        link_ms,
        c.micro_batch,
        window,
        qps,
        requests=requests,
        seed=seed,
        busy_ms=busy_ms,
        busy_slack_ms=slack,
    )


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
            :data:`TPOT_HEADROOM` of it (:func:`gearshift.planner.tpot.tpot_capacity`), when that is lower
            than the rate that keeps its stages busy: a deep pipeline of slow stages can be busy only part
            of the time and still give every token too late. None: capacity is the busy rate alone.

    Returns:
        A :class:`PlanResult` with one :class:`Gear` per intent, in the order asked.

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
    budgets = _kv_budgets(model) if itl_target_ms is not None else [model]
    pools: dict[str, list[_Candidate]] = {}
    for i in intents:
        pools[i] = []
        first_error: PlanError | None = None
        for m in budgets:
            try:
                found = _candidates(
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
            _finish(profile, model, c)
    busy_capacity = max(c.capacity for cands in pools.values() for c in cands)
    if itl_target_ms is not None:
        for cands in pools.values():
            for c in cands:
                _cap_by_tpot(profile, _model_of(c, model), c, itl_target_ms)
    best_capacity = max(c.capacity for cands in pools.values() for c in cands)
    load = qps if qps is not None else DEFAULT_QPS_SHARE * (best_capacity or busy_capacity)
    chosen: dict[str, _Candidate] = {}
    for intent, cands in pools.items():
        if intent == "throughput":
            best = max(c.capacity for c in cands)
            # Equal capacity (the same cards as R pipelines or as one plus extras): the fewest stages,
            # then the lowest simulated P99 -- more pipelines keep more micro-batches in flight.
            top = [c for c in cands if c.capacity >= best * (1 - 1e-9)]
            fewest = min(len(c.pipeline.stages) for c in top)
            top = [c for c in top if len(c.pipeline.stages) == fewest]
            for c in top:
                _simulate(profile, _model_of(c, model), c, load, sim_requests, seed)
            pick = min(top, key=lambda c: (c.sim.p99_ms, _cards(c)))  # type: ignore[union-attr]
        else:
            ok = [c for c in cands if c.capacity * TARGET_UTILISATION >= load] or [
                max(cands, key=lambda c: c.capacity)
            ]
            for c in ok:
                _simulate(profile, _model_of(c, model), c, load, sim_requests, seed)
            if intent == "latency":
                # Equal P99, fewer cards: the simulator hands a micro-batch to whichever server ends it
                # first, so an extra slower card that never helped leaves P99 unchanged there, while a
                # router spreading requests over replicas would send it its share at its slower pace.
                pick = min(ok, key=lambda c: (c.sim.p99_ms, _cards(c), -c.capacity))  # type: ignore[union-attr]
            else:
                pick = max(ok, key=lambda c: c.capacity / c.sim.p99_ms)  # type: ignore[union-attr]
        chosen[intent] = pick
    for c in chosen.values():
        m = _model_of(c, model)
        times = _decode_times(profile, m, c)
        if times is not None:
            c.itl_ms = tpot_ms(times, load / c.pipeline.replicas, _output_tokens(m), _max_batch(c, m))
    ranges = _qps_ranges({i: c.capacity for i, c in chosen.items()})
    gears = tuple(
        _gear(profile, chosen[i], ranges[i], kv_resident_sequences(_model_of(chosen[i], model)))
        for i in intents
    )
    return PlanResult(model.name, gears, load)


#: The smallest KV budget (sequences per pipeline) :func:`_kv_budgets` tries.
MIN_KV_SEQUENCES = 8


def _kv_budgets(model: CostModel) -> list[CostModel]:
    """``model`` and, for the roofline model of role ``both``, the same with the KV cache reserved for half
    as many sequences, halved again down to :data:`MIN_KV_SEQUENCES`.

    A smaller budget lets a pipeline fit fewer, faster cards (Llama-3-70B at 1155 + 211 tokens: 64
    sequences need a third card beside two H100s, 16 do not) at the cost of a smaller max batch, which
    :func:`gearshift.planner.tpot.tpot_capacity` charges (Little's law). The peers' layouts make the same
    trade with ``--max-num-seqs`` (:func:`gearshift.dev.twin.gears.peer_gears`); here every budget
    competes and each intent's rule picks.
    """
    if not isinstance(model, RooflineCostModel) or model.assumptions.role != "both":
        return [model]
    out: list[CostModel] = [model]
    k = model.assumptions.kv_sequences // 2
    while k >= MIN_KV_SEQUENCES:
        out.append(replace(model, assumptions=replace(model.assumptions, kv_sequences=k)))
        k //= 2
    return out


def _model_of(c: _Candidate, model: CostModel) -> CostModel:
    return c.model if c.model is not None else model


def _cards(c: _Candidate) -> int:
    """GPU nodes a candidate occupies (pipeline replicas and hot-stage extras alike)."""
    return sum(len(ids) for ids in c.nodes)


def _qps_ranges(capacity: dict[str, float]) -> dict[str, tuple[float, float]]:
    out, lo = {}, 0.0
    for name in sorted(capacity, key=capacity.__getitem__):
        hi = max(lo, TARGET_UTILISATION * capacity[name])
        out[name] = (lo, hi)
        lo = hi
    return out


def kv_resident_sequences(model: CostModel) -> int:
    """Sequences whose KV cache the cost model reserved on every stage (0 when it reserved none).

    The roofline model sizes each stage's memory for ``kv_sequences`` sequences of
    ``kv_tokens_per_sequence`` tokens each (the workload's prompt + output with 1.2× headroom,
    :class:`~gearshift.planner.costs.RooflineAssumptions`), so continuous batching of that many running
    sequences of the workload's shape fits on every stage by construction. A layer-cost file states no
    such count.
    """
    assumptions = getattr(model, "assumptions", None)
    return int(getattr(assumptions, "kv_sequences", 0) or 0)


def _gear(profile: Profile, c: _Candidate, qps_range: tuple[float, float], kv_batch: int = 0) -> Gear:
    assert c.sim is not None
    stages = []
    for st, ids in zip(c.pipeline.stages, c.nodes, strict=True):
        t = max(_stage_ms(c.costs, st.start, st.end, profile.node(n).compute_score) for n in ids)
        stages.append(Stage((st.start, st.end), ids[0], tuple(ids), t, st.memory_gb))
    pred = Prediction(
        c.capacity, c.sim.qps, c.sim.p50_ms, c.sim.p99_ms, c.sim.saturated, c.sim.mean_batch, c.itl_ms
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
        max_batch=_max_batch(c, kv_batch=kv_batch),
        pipelines=c.pipeline.replicas,
        bottleneck_ms=c.pipeline.bottleneck_ms,
        effective_ms=c.effective_ms,
        lower_bound_ms=c.pipeline.lower_bound_ms,
        exact=c.pipeline.exact,
        predicted=pred,
        qps_range=qps_range,
        link_ms=c.pipeline.link_ms,
    )
