"""The planner's gears as the twin runs them: API gears, their head pods' pipelines and their cards (pure
but for reading the fleet file)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gearshift import planner
from gearshift.api.gearset import Gear as ApiGear
from gearshift.control.policy import ShiftRules
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
) -> tuple[list[GearSpec], GearSpec | None, dict[str, Any]]:
    """The planner's three gears on the whole ``fleet`` file, and (``even``) the even layer split over the
    throughput gear's nodes (the deepest gear: every node of the fleet), with the same pipeline replicas and
    micro-batch; None without ``even``.

    ``workload``: (mean prompt, mean output) tokens the planner prices requests with (a GearSet's
    ``spec.plan.workload``); engines run the combined role, so the planner prices both phases.

    Raises:
        gearshift.planner.errors.PlanError: the planner finds no gear (or the even split does not fit).
        gearshift.facts.fleet.FleetError: a bad fleet file.
    """
    fl = fleet_mod.load_fleet(fleet)
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
    info: dict[str, Any] = {"planner_qps": round(result.qps, 3), "gears": [g.to_dict() for g in result.gears]}
    if not even:
        return specs, None, info
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
