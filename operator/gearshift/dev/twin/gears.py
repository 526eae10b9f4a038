"""The planner's gears as the twin runs them: API gears, their head pods' pipelines and their cards (pure
but for reading the fleet file)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gearshift import planner
from gearshift.api.gearset import Gear as ApiGear
from gearshift.control.shifting.policy import ShiftRules
from gearshift.dev.twin.constants import MEMORY_UTILIZATION, PLAN_SIM_REQUESTS
from gearshift.facts import fleet as fleet_mod
from gearshift.facts.model import ModelArch
from gearshift.k8s.engine import sim_pipeline
from gearshift.planner.inputs import api_gear, gear_links

#: The repository root (operator/gearshift/dev/twin/gears.py → five levels up).
_ROOT = Path(__file__).resolve().parents[4]
FLEET = _ROOT / "examples" / "fleets" / "mixed.yaml"
MODEL = _ROOT / "examples" / "models" / "llama-3-8b.json"


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
    arch: ModelArch,
    policy: ShiftRules,
    workload: tuple[int, int] = (512, 128),
    fleet: Path = FLEET,
    *,
    even: bool = True,
    itl_target_ms: float | None = None,
) -> tuple[list[GearSpec], GearSpec | None, dict[str, Any]]:
    """The planner's three gears on the whole ``fleet`` file, and (``even``) the even layer split over the
    throughput gear's nodes (the deepest gear: every node of the fleet), with the same pipeline replicas and
    micro-batch; None without ``even``.

    ``workload``: (mean prompt, mean output) tokens the planner prices requests with (a GearSet's
    ``spec.plan.workload``); engines run the combined role, so the planner prices both phases.
    ``itl_target_ms``: the SLO's TPOT target, which caps each gear's capacity as the operator plans an
    aggregated GearSet (:func:`gearshift.planner.plan`); None: capacity is the busy rate.

    Raises:
        gearshift.planner.errors.PlanError: the planner finds no gear (or the even split does not fit).
        gearshift.facts.fleet.FleetError: a bad fleet file.
    """
    fl, doc, profile = fleet_profile(fleet)
    cost = _cost(arch, workload)
    result = planner.plan(
        profile, cost, sim_requests=PLAN_SIM_REQUESTS, itl_target_ms=itl_target_ms, worthwhile_only=True
    )
    specs = []
    for g in result.gears:
        api = api_gear(g, g.name, doc, {})
        specs.append(_spec(api, profile, arch, policy))
    info: dict[str, Any] = {"planner_qps": round(result.qps, 3), "gears": [g.to_dict() for g in result.gears]}
    if not even:
        return specs, None, info
    # Even split: the throughput gear's node sequence per pipeline replica, layers as even as possible.
    # The planner drops a throughput pick that another gear matches with fewer cards: then the deepest
    # gear left stands in.
    thr = next((s for s in specs if s.name == "throughput"), None) or max(
        specs, key=lambda s: s.predicted_rps or 0.0
    )
    order = [st.nodes[0] for st in thr.api.stages]
    cuts = planner.even_split(cost.at(thr.api.micro_batch), order)
    gpu = {n.name: n.gpu.model for n in fl.nodes}
    reps = thr.api.stages[0].replicas
    even_api = _uniform_gear(
        "even", cuts, [[thr.api.stages[k].nodes[r] for k in range(len(cuts))] for r in range(reps)], gpu,
        thr.api.micro_batch, thr.api.max_batch,
    )  # fmt: skip
    even_spec = _spec(even_api, profile, arch, policy)
    bottleneck, times, _ = planner.evaluate(
        profile, cost.at(thr.api.micro_batch), [(a, b, [ids[0]]) for a, b, ids in cuts]
    )
    info["even"] = {
        "layers": [[a, b] for a, b, _ in cuts],
        "nodes": [ids[0] for _, _, ids in cuts],
        "bottleneck_ms": round(bottleneck, 3),
        "stage_ms": [round(x, 3) for x in times],
    }
    return specs, even_spec, info


def gears_from_api(
    api_gears: Sequence[ApiGear], arch: ModelArch, policy: ShiftRules, fleet: Path = FLEET
) -> list[GearSpec]:
    """The twin's specs of gears the operator planned (a GearSet's ``status.plannedGears`` or explicit
    ``spec.gears``), on ``fleet``'s nodes (their GPU models and links), so that the twin replays the very
    gears a live run served.

    Raises:
        gearshift.facts.fleet.FleetError: a bad fleet file.
        gearshift.planner.errors.PlanError: a gear names a node the fleet does not have.
    """
    _, _, profile = fleet_profile(fleet)
    ids = {n.node_id for n in profile.nodes}
    for g in api_gears:
        missing = sorted({n for st in g.stages for n in st.nodes} - ids)
        if missing:
            raise planner.PlanError(f"gear {g.name!r} names nodes the fleet file does not have: {missing}")
    return [_spec(g, profile, arch, policy) for g in api_gears]


def peer_gears(
    arch: ModelArch,
    policy: ShiftRules,
    workload: tuple[int, int] = (512, 128),
    fleet: Path = FLEET,
    *,
    micro_batch: int,
    max_batch: int,
) -> tuple[list[GearSpec], list[dict[str, Any]]]:
    """The layouts a user of a peer system (LWS, KServe, llm-d) deploys on ``fleet``: per GPU model, uniform
    pipelines of that model alone with an even layer split, of the fewest stages whose even split fits the
    cards' memory, copied over as many of that model's cards as hold whole copies (a model whose even split
    fits no number of its cards gives no layout). Each runs at ``micro_batch`` and ``max_batch`` (the
    planner's gears' values, so the rows differ in layout only), or, where the model does not fit that way,
    at the largest halving of ``max_batch`` (KV reserved for fewer sequences) that lets it fit on as few
    cards (the micro-batch capped at it): what a peer user does with ``--max-num-seqs``.

    The same rule as :func:`gearshift.planner.fleetpeer.peer_configs` (even splits of one class, the
    fewest stages that fit), on the fleet's own nodes rather than its classes, so the twin can run them.

    Returns ``(gears named "peer-<gpu model>", [{"gear", "gpu_model", "stages", "copies", "layers",
    "skipped"}])``: the second lists every GPU model, with why it gives no layout.

    Raises:
        gearshift.facts.fleet.FleetError: a bad fleet file.
    """
    fl, _, profile = fleet_profile(fleet)
    # Largest first: a peer user lowers the batch (vLLM --max-num-seqs, the KV the planner reserves per
    # stage) until the model fits, before adding cards: max_batch, halved down to 1.
    batches = [max_batch >> i for i in range(max_batch.bit_length())]
    gpu = {n.name: n.gpu.model for n in fl.nodes}
    by_model: dict[str, list[str]] = {}
    for n in fl.nodes:
        by_model.setdefault(n.gpu.model, []).append(n.name)
    specs: list[GearSpec] = []
    info: list[dict[str, Any]] = []
    for model, ids in by_model.items():
        fitted: tuple[int, int, list[tuple[int, int, list[str]]]] | None = None
        for k in range(1, min(len(ids), arch.num_layers) + 1):
            for seqs in batches:
                m = min(micro_batch, seqs)
                costs = _cost(arch, workload, seqs).at(m)
                cuts = planner.even_split(costs, ids[:k])
                try:
                    planner.evaluate(profile, costs, cuts)
                except planner.PlanError:
                    continue  # the even split does not fit k cards at this micro-batch
                fitted = (k, seqs, cuts)
                break
            if fitted is not None:
                break
        if fitted is None:
            info.append(
                {"gpu_model": model, "cards": len(ids), "skipped": "no even split fits its cards' memory"}
            )
            continue
        k, seqs, cuts = fitted
        m = min(micro_batch, seqs)
        copies = len(ids) // k
        name = f"peer-{model.lower()}"
        replicas = [ids[r * k : (r + 1) * k] for r in range(copies)]
        api = _uniform_gear(name, cuts, replicas, gpu, m, seqs)
        specs.append(_spec(api, profile, arch, policy))
        info.append(
            {
                "gear": name,
                "gpu_model": model,
                "cards": len(ids),
                "stages": k,
                "copies": copies,
                "micro_batch": m,
                "max_batch": seqs,
                "layers": [b - a for a, b, _ in cuts],
            }
        )
    return specs, info


def fleet_profile(fleet: Path) -> tuple[fleet_mod.Fleet, dict[str, Any], planner.Profile]:
    """The fleet file, its datasheet profile document and the planner's profile (usable memory only)."""
    fl = fleet_mod.load_fleet(fleet)
    doc = fleet_mod.datasheet_profile(fl)
    for n in doc["nodes"]:  # as gearshift.planner.inputs.resource_profile: usable memory only
        n["memory_gb"] = round(n["memory_gb"] * MEMORY_UTILIZATION, 6)
    return fl, doc, planner.parse_profile(doc)


def _cost(arch: ModelArch, workload: tuple[int, int], kv_sequences: int = 64) -> planner.RooflineCostModel:
    """The planner's cost model for requests of ``workload`` (prompt, output) tokens in the combined role,
    KV reserved per stage for ``kv_sequences`` sequences (the gear's maxBatch; the planner's default 64)."""
    shape = planner.RooflineAssumptions(
        prompt_tokens=workload[0], output_tokens=workload[1], role="both", kv_sequences=kv_sequences
    )
    return planner.RooflineCostModel(arch, shape)


def _uniform_gear(
    name: str,
    cuts: list[tuple[int, int, list[str]]],
    replicas: list[list[str]],
    gpu: dict[str, str],
    micro_batch: int,
    max_batch: int,
) -> ApiGear:
    """An API gear of the layer ranges of ``cuts``, pipeline replica r on the nodes ``replicas[r]`` (one
    node per stage), one GPU per stage pod."""
    stages = [
        {
            "layers": [a, b],
            "replicas": len(replicas),
            "gpus": 1,
            "nodes": [rep[k] for rep in replicas],
            "gpuModel": gpu[replicas[0][k]],
        }
        for k, (a, b, _) in enumerate(cuts)
    ]
    return ApiGear.model_validate(
        {
            "name": name,
            "intent": "throughput",
            "stages": stages,
            "microBatch": micro_batch,
            "maxBatch": max_batch,
        }
    )


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


def shift_lead_s(spec: GearSpec, policy: ShiftRules) -> float:
    """How long before it must serve a shift to ``spec`` has to start: its weights load, then it warms
    ``warmS``, and the executor moves traffic at its next sample, s."""
    return spec.load_s + policy.warm_s + 2 * policy.sample_interval_s


def is_upshift(old: GearSpec, new: GearSpec) -> bool:
    """Whether the oracle's shift ``old`` → ``new`` goes up (more predicted throughput)."""
    return (new.predicted_rps or 0.0) > (old.predicted_rps or 0.0)
