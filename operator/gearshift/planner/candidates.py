"""The gear planner's candidates (:mod:`gearshift.planner.gears`): for one intent, the pipelines the
minimum-bottleneck partitioner finds for each micro-batch size, replica count and stage cap, with the
variants that give leftover nodes to the hottest stages, durable nodes placed before time-limited ones, and
the fleet-scale planner's plans for a large pool (:func:`gear_candidates`); each one's capacity
(:func:`set_capacity`) and the KV budgets it is planned with (:func:`kv_budgets`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from gearshift.planner.costs import CostModel, LayerCosts, RooflineCostModel
from gearshift.planner.errors import EmptyFleetError, InfeasibleError, PlanError, StageLimitError
from gearshift.planner.fleetclasses import Workload, class_nodes, profile_classes
from gearshift.planner.fleetplan import max_load
from gearshift.planner.intents import INTENTS
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
from gearshift.planner.simulate import SimResult

#: Most pipeline replicas tried per gear.
MAX_PIPELINES = 8


@dataclass
class Candidate:
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
    :func:`kv_budgets`)."""


def stage_time_ms(costs: LayerCosts, start: int, end: int, score: float) -> float:
    return sum(costs.compute_ms[start:end]) / score


def link_bound(profile: Profile, c: Candidate) -> float:
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
    c: Candidate,
    free: list[str],
    cheap: frozenset[str] = frozenset(),
    all_linked: bool = False,
) -> None:
    """Give leftover nodes to the hottest stage while they fit its memory and link to both neighbours;
    cheap-only (time-limited) nodes first, then the fastest. ``all_linked``: the caller knows every pair of
    nodes is linked, so the link checks are skipped."""
    while free:
        rates = [
            sum(1.0 / stage_time_ms(c.costs, st.start, st.end, profile.node(n).compute_score) for n in ids)
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


def large_pool(profile: Profile) -> bool:
    """The pool is large: the exact partitioner's DP over classes of identical nodes would exceed its
    state cap (:data:`~gearshift.planner.partition.DEFAULT_WORK_CAP`), where it falls back to a heuristic
    on a trimmed slice of the fleet. Such pools are planned by the fleet-scale planner instead."""
    counts: dict[tuple[float, float], int] = {}
    for n in profile.nodes:
        key = (n.compute_score, n.memory_gb)
        counts[key] = counts.get(key, 0) + 1
    return math.prod(c + 1 for c in counts.values()) * len(counts) > DEFAULT_WORK_CAP


def _fleet_candidates(profile: Profile, model: CostModel, intent: str) -> list[Candidate] | None:
    """Candidates of a large pool from the fleet-scale planner (:mod:`gearshift.planner.fleetplan`): per
    micro-batch size of the intent, the max-load plan over classes of identical nodes; each group of
    identical pipelines in it becomes one candidate of that many pipeline replicas on concrete nodes (and
    its variant with the leftover nodes as hot-stage extras). None when the fleet planner cannot take the
    profile (a node pair without a link) or finds nothing, so the caller plans as for small pools."""
    try:
        fc = profile_classes(profile)
    except PlanError:
        return None
    members = class_nodes(profile, fc)
    sizes = list(INTENTS[intent])
    smallest = min(n.max_micro_batch for n in profile.nodes)
    if intent == "throughput" and smallest < sizes[0]:
        sizes.insert(0, smallest)
    out: list[Candidate] = []
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
            c = Candidate(intent, mb, pipe, costs, [list(ids) for _, _, ids in cuts])
            out.append(c)
            wide = replace(c, nodes=[list(ids) for ids in c.nodes])
            taken = {n for ids in wide.nodes for n in ids}
            # profile_classes refused profiles with an unlinked pair, so every pair is linked here.
            free = [n.node_id for n in profile.nodes if n.node_id not in taken]
            _add_extras(profile, wide, free, all_linked=True)
            if wide.nodes != c.nodes:
                out.append(wide)
    return out or None


def gear_candidates(
    profile: Profile,
    model: CostModel,
    intent: str,
    single_pipeline: bool,
    cheap: frozenset[str] = frozenset(),
    max_stages: int | None = None,
    max_stages_why: str = "",
    whole_pipelines: bool = False,
    short_balanced: bool = False,
) -> list[Candidate]:
    if not single_pipeline and not cheap and max_stages is None and large_pool(profile):
        fleet = _fleet_candidates(profile, model, intent)
        if fleet:
            return fleet
    out: list[Candidate] = []
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
                c = Candidate(intent, mb, p, costs, secured)
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
    profile: Profile, model: CostModel, c: Candidate, kv_batch: int, node_ids: Sequence[str]
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


def set_capacity(profile: Profile, model: CostModel, c: Candidate) -> None:
    worst = 0.0
    for st, ids in zip(c.pipeline.stages, c.nodes, strict=True):
        rate = sum(1.0 / stage_time_ms(c.costs, st.start, st.end, profile.node(n).compute_score) for n in ids)
        worst = max(worst, 1.0 / rate)
    c.effective_ms = max(worst, link_bound(profile, c))
    c.capacity = c.micro_batch * 1000.0 / c.effective_ms


#: The smallest KV budget (sequences per pipeline) :func:`kv_budgets` tries.
MIN_KV_SEQUENCES = 8


def kv_budgets(model: CostModel) -> list[CostModel]:
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
