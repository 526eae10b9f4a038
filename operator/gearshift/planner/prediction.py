"""How a gear candidate (:class:`~gearshift.planner.candidates.Candidate`) serves: its running batch, its
decode step times and mean TPOT (its capacity capped so that the TPOT meets a target,
:func:`cap_by_tpot`), and its latency at a load from the discrete-event simulator
(:func:`simulate_candidate`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from gearshift.planner.candidates import Candidate, kv_resident_sequences, set_capacity
from gearshift.planner.costs import CostModel, LayerCosts, RooflineCostModel
from gearshift.planner.partition import PipelineStage
from gearshift.planner.profile import Profile
from gearshift.planner.simulate import simulate
from gearshift.planner.tpot import DecodeTimes, tpot_capacity, tpot_ms

#: Share of a TPOT target the *mean* predicted TPOT may reach: a request's TPOT scatters around the mean
#: with the prompts that land during its decode, and the SLO judges every request (as TARGET_UTILISATION
#: keeps queues short below capacity).
TPOT_HEADROOM = 0.8


def _tables(profile: Profile, model: CostModel, c: Candidate) -> tuple[list, list, list]:
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


def running_batch(c: Candidate, model: CostModel | None = None, kv_batch: int | None = None) -> int:
    """Running sequences per pipeline (the gear's ``max_batch``, as :func:`gearshift.planner.gears.plan`
    sets it)."""
    kv = kv_batch if kv_batch is not None else kv_resident_sequences(model) if model is not None else 0
    return max(c.micro_batch * len(c.pipeline.stages), kv)


def output_tokens_of(model: CostModel) -> int:
    assumptions = getattr(model, "assumptions", None)
    return int(getattr(assumptions, "output_tokens", 1) or 1)


def decode_times(profile: Profile, model: CostModel, c: Candidate) -> DecodeTimes | None:
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


def cap_by_tpot(profile: Profile, model: CostModel, c: Candidate, target_ms: float) -> None:
    """Lower ``c.capacity`` to the load at which its predicted mean TPOT stays within
    :data:`TPOT_HEADROOM` × ``target_ms`` (no change when the model cannot predict TPOT)."""
    times = decode_times(profile, model, c)
    if times is None:
        return
    r = c.pipeline.replicas
    per_pipeline = tpot_capacity(
        times, TPOT_HEADROOM * target_ms, output_tokens_of(model), running_batch(c, model), c.capacity / r
    )
    c.capacity = min(c.capacity, per_pipeline * r)


def simulate_candidate(
    profile: Profile, model: CostModel, c: Candidate, qps: float, requests: int, seed: int
) -> None:
    stage_ms, link_ms, busy_ms = _tables(profile, model, c)
    window = c.pipeline.replicas * len(c.pipeline.stages)
    slack = 0.0
    times = decode_times(profile, model, c)
    if times is not None and isinstance(model, RooflineCostModel) and model.assumptions.role == "both":
        # Continuous batching spreads a request's decode over its decode's span (simulate's busy_slack_ms).
        out = output_tokens_of(model)
        tpot = tpot_ms(times, qps / c.pipeline.replicas, out, running_batch(c, model))
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


@dataclass(frozen=True)
class MixRates:
    """How a gear's capacity and first-token time move with the request mix: a linear work model.

    A request of ``p`` prompt and ``o`` output tokens keeps the gear busy ``p / prompt_tokens_per_s +
    o / output_tokens_per_s`` seconds, so it serves ``1 / (p / prompt_tokens_per_s + o /
    output_tokens_per_s)`` requests/s of that mix. Both rates come from the planner's cost model
    (:func:`mix_rates`): the prefill is compute-bound and grows with ``p``, the decode steps with ``o``
    (:class:`~gearshift.planner.costs.RooflineCostModel`). ``ttft_ms_per_prompt_token``: the unloaded time
    to first token of a lone request per prompt token on the gear's fastest node of each stage, ms (a
    prompt of ``p`` tokens cannot see its first token sooner than ``p`` × this on this gear).
    """

    prompt_tokens_per_s: float | None
    """None for a decode gear (its requests' prompts were prefilled elsewhere)."""
    output_tokens_per_s: float | None
    """None for a prefill gear (it gives each request its first token only)."""
    ttft_ms_per_prompt_token: float | None
    """None for a decode gear."""


#: How far the fit of :func:`mix_rates` moves each side of the mix: twice the planned tokens.
MIX_FIT_FACTOR = 2.0


def mix_rates(
    profile: Profile, model: CostModel, c: Candidate, itl_target_ms: float | None
) -> MixRates | None:
    """The linear work model (:class:`MixRates`) of candidate ``c`` around the workload ``model`` prices.

    The candidate's capacity is re-priced with :data:`MIX_FIT_FACTOR` × the prompt tokens and, apart,
    × the output tokens (its layers, nodes, micro-batch and KV budget unchanged; the TPOT cap applied
    as when it was planned, ``itl_target_ms``); the difference in busy time per request gives each
    token's cost, scaled so that the model meets the planned capacity exactly at the planned workload.

    A disaggregated role serves one phase, so its work is one side's: a prefill gear's is its prompts'
    (``prompt_tokens_per_s`` = planned prompt tokens × capacity; the output is one token), a decode gear's
    its outputs' (``output_tokens_per_s`` likewise).

    Returns None unless ``model`` is the roofline model (a layer-cost file states no workload).
    """
    if not isinstance(model, RooflineCostModel) or c.capacity <= 0:
        return None
    a = model.assumptions
    p0, o0 = a.prompt_tokens, a.output_tokens
    fastest = [max(profile.node(n).compute_score for n in ids) for ids in c.nodes]
    if a.role == "decode":
        return MixRates(None, o0 * c.capacity, None)
    first = model.at(1).pass_ms
    ttft_ms = sum(
        sum(first[st.start : st.end]) / sc for st, sc in zip(c.pipeline.stages, fastest, strict=True)
    )
    if a.role == "prefill":
        return MixRates(p0 * c.capacity, None, ttft_ms / p0)

    def busy_s(p: int, o: int) -> float:
        m = RooflineCostModel(model.arch, replace(a, prompt_tokens=p, output_tokens=o))
        c2 = replace(c, costs=m.at(c.micro_batch, c.decode_batch), sim=None)
        set_capacity(profile, m, c2)
        if itl_target_ms is not None:
            cap_by_tpot(profile, m, c2, itl_target_ms)
        return 1.0 / c2.capacity if c2.capacity > 0 else math.inf

    base = 1.0 / c.capacity
    per_prompt = max(busy_s(round(MIX_FIT_FACTOR * p0), o0) - busy_s(p0, o0), 0.0) / (
        (MIX_FIT_FACTOR - 1) * p0
    )
    per_output = max(busy_s(p0, round(MIX_FIT_FACTOR * o0)) - busy_s(p0, o0), 0.0) / (
        (MIX_FIT_FACTOR - 1) * o0
    )
    if not (math.isfinite(per_prompt) and math.isfinite(per_output)) or per_prompt + per_output <= 0:
        return None
    # Each side keeps at least a hundredth of the busy time it would have alone, so neither rate is
    # infinite when the fit found one side free (a TPOT cap that does not move with the prompt).
    floor = 0.01 * base
    per_prompt, per_output = max(per_prompt, floor / p0), max(per_output, floor / o0)
    scale = base / (per_prompt * p0 + per_output * o0)
    return MixRates(1.0 / (per_prompt * scale), 1.0 / (per_output * scale), ttft_ms / p0)
