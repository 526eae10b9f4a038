"""What a demo run cost in GPU time, and what the twin's static gears cost on the same trace window (pure).

**The run's GPU time is measured on the cluster**: every few seconds the demo lists the service's engine
pods; a pod bound to a node holds the ``nvidia.com/gpu`` its containers ask for (extended resources are set
in limits, and requests default to them) until it is gone, shadows and draining pods included. With
NVIDIA time-slicing a card is advertised ``nvidia.com/gpu.replicas`` times, so a node's slices held are
rounded up to physical cards and capped at the cards it has (:func:`cards_held`). GPU-seconds are the
held cards integrated over the run (:func:`gpu_seconds`): what the cluster reserved for the service.

**The twin** (:func:`twin_compare`) replays the same requests at the same time scale in virtual time
(:mod:`gearshift.dev.twin`): with the operator's shifting loop over the planner's gears (``dynamic``),
on each of those gears alone, and on each layout a peer system would deploy (uniform one-model pipelines
with even splits), with the same SLO and policy. The twin runs engines in the combined prefill+decode
role (it does not model PD disaggregation): for an aggregated service (role ``both``) that is the
service's own shape; for a PD service the rows say what one combined gear of the fleet would have cost.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gearshift.api.gearset import Gear as ApiGear
from gearshift.api.shift_policy import ShiftPolicy
from gearshift.control.shifting.adapt import policy_from_api
from gearshift.dev.loadgen import TraceRequest, clip_to_context
from gearshift.dev.twin import Slo, plan_gears, trace_from_requests
from gearshift.dev.twin.compare import replay_window
from gearshift.dev.twin.gears import gears_from_api, peer_gears
from gearshift.facts.model import ModelArch
from gearshift.k8s.placement import pod_gpus
from gearshift.profiling.profiles import node_view

#: Pod phases whose containers have ended: the kubelet has released their resources.
_ENDED = ("Succeeded", "Failed")


@dataclass(frozen=True)
class NodeCards:
    """A GPU node's physical cards and how many ``nvidia.com/gpu`` slices each card is advertised as."""

    cards: int
    slices_per_card: int = 1


def node_cards(nodes: Iterable[Mapping[str, Any]]) -> dict[str, NodeCards]:
    """Node name → :class:`NodeCards` for every GPU node of a ``kubectl get nodes -o json`` list's ``items``
    (physical cards as :func:`gearshift.profiling.profiles.node_view` counts them: capacity divided by GPU
    feature discovery's ``nvidia.com/gpu.replicas``)."""
    views = (node_view(body) for body in nodes)
    return {v.name: NodeCards(v.gpu_count, v.slices_per_card) for v in views if v is not None}


def cards_held(pods: Iterable[Mapping[str, Any]], nodes: Mapping[str, NodeCards]) -> dict[str, int]:
    """Node → physical cards held by ``pods`` (a ``kubectl get pods -o json`` list's ``items``) on it.

    A pod holds its slices from the moment it is bound (``spec.nodeName``) until it is gone or has ended
    (phase ``Succeeded``/``Failed``); a terminating pod still holds them. Per node the slices are rounded
    up to whole cards (``slices_per_card``) and capped at the node's cards; a node missing from ``nodes``
    counts one card per slice."""
    slices: dict[str, int] = {}
    for pod in pods:
        node = (pod.get("spec") or {}).get("nodeName")
        if not node or (pod.get("status") or {}).get("phase") in _ENDED:
            continue
        n = pod_gpus(pod)
        if n > 0:
            slices[node] = slices.get(node, 0) + n
    out = {}
    for node, n in slices.items():
        nc = nodes.get(node)
        out[node] = n if nc is None else min(nc.cards, math.ceil(n / nc.slices_per_card))
    return out


@dataclass(frozen=True)
class CardSample:
    """Cards held per node at ``t`` s since the run's start."""

    t: float
    cards: Mapping[str, int]

    @property
    def total(self) -> int:
        return sum(self.cards.values())


def gpu_seconds(samples: Sequence[CardSample], run_s: float) -> float:
    """GPU-seconds held over ``[0, run_s]``: each sample's cards count until the next sample (the last
    until ``run_s``; before the first, the first's), so the error is at most one poll interval per change.

    Raises:
        ValueError: no sample, or ``run_s`` < 0.
    """
    if not samples or run_s < 0:
        raise ValueError("gpu_seconds needs at least one sample and run_s >= 0")
    ordered = sorted(samples, key=lambda s: s.t)
    total = 0.0
    for k, s in enumerate(ordered):
        start = 0.0 if k == 0 else min(max(s.t, 0.0), run_s)
        end = run_s if k + 1 == len(ordered) else min(max(ordered[k + 1].t, 0.0), run_s)
        total += s.total * max(0.0, end - start)
    return total


def run_cost(samples: Sequence[CardSample], run_s: float, slo_met: int | None) -> dict[str, Any]:
    """The run's ``gpu_hours``, ``mean_gpus``, ``peak_gpus`` and ``slo_met_per_gpu_hour`` (None without an
    SLO count or GPU time), from the card samples over ``[0, run_s]`` s."""
    gs = gpu_seconds(samples, run_s)
    hours = gs / 3600.0
    return {
        "gpu_hours": round(hours, 4),
        "mean_gpus": round(gs / run_s, 3) if run_s > 0 else None,
        "peak_gpus": max(s.total for s in samples),
        "slo_met": slo_met,
        "slo_met_per_gpu_hour": round(slo_met / hours, 1) if slo_met is not None and hours > 0 else None,
        "samples": len(samples),
    }


def twin_compare(
    requests: Sequence[TraceRequest],
    time_scale: float,
    *,
    arch: ModelArch,
    fleet: Path,
    slo_ttft_ms: float,
    slo_itl_ms: float,
    role: str = "prefill",
    policy: Mapping[str, Any] | None = None,
    workload: tuple[int, int] | None = None,
    initial_gear: str | None = None,
    max_model_len: int | None = None,
    planned: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The demo's window replayed in the twin every way the report compares: the shifting loop
    (``dynamic``), each gear the planner makes of ``fleet`` for ``arch`` alone (``static``), and each peer
    layout alone (``peer``: uniform one-model pipelines with even splits,
    :func:`gearshift.dev.twin.gears.peer_gears`), on ``requests`` (trace seconds from the window's start) at
    ``time_scale``, clipped to ``max_model_len`` as the load generator clipped them.

    ``policy`` is the GearSet's ``spec.policy`` (camelCase; the API's defaults when None) read for ``role``
    (``prefill`` or ``both``: the latency triggers read TTFT); ``workload`` its ``spec.plan.workload``
    (prompt, output tokens; the window's own means when None); ``initial_gear`` its ``spec.initialGear``
    (the dynamic run starts there, else where the operator's capacity controller starts,
    :func:`gearshift.dev.twin.compare.dynamic_start`); ``planned`` the GearSet's planned gears (API
    documents, camelCase): the twin replays those, the very gears the run served; without them it plans
    the fleet file's datasheet profiles itself.

    Returns ``{"workload": [prompt, output], "requests", "span_s", "initial_gear", "peer_layouts",
    "rows": [row, ...]}`` (rows as :func:`gearshift.dev.twin.compare.row`: dynamic, the gears, the peers;
    virtual time, so ``gpu_hours`` is over the replay's seconds, as the run's).

    Raises:
        ValueError: no request, a non-positive ``time_scale``, a bad ``policy`` or ``initial_gear`` naming
            no planned gear; the planner's :class:`~gearshift.planner.errors.PlanError` (a ValueError)
            when it finds no gear.
    """
    rows = [clip_to_context(r, max_model_len) for r in requests]
    trace = trace_from_requests(rows, time_scale)
    if workload is None:
        workload = (round(float(trace.prompt.mean())), round(float(trace.output.mean())))
    api_policy = ShiftPolicy.model_validate(dict(policy or {}))
    rules = policy_from_api(api_policy, role=role, ttft_slo_ms=slo_ttft_ms, itl_slo_ms=slo_itl_ms)
    if planned:
        gears = gears_from_api([ApiGear.model_validate(dict(g)) for g in planned], arch, rules, fleet)
    else:
        itl_target = slo_itl_ms if role == "both" else None
        gears, _, _ = plan_gears(arch, rules, workload, fleet=fleet, even=False, itl_target_ms=itl_target)
    if initial_gear is not None and initial_gear not in {g.name for g in gears}:
        raise ValueError(
            f"initialGear {initial_gear!r} names no planned gear ({', '.join(g.name for g in gears)})"
        )
    # The peers batch as the planner's deepest-batching gear does, so the rows differ in layout only.
    widest = max(gears, key=lambda g: (g.api.micro_batch, g.api.max_batch or 0))
    peers, peer_info = peer_gears(
        arch, rules, workload, fleet, micro_batch=widest.api.micro_batch, max_batch=widest.api.max_batch or 64
    )
    out = replay_window(
        arch,
        trace,
        rules,
        gears,
        peers,
        slo=Slo(slo_ttft_ms / 1000.0, slo_itl_ms / 1000.0),
        expected_given="expectedArrivalRps" in (policy or {}),
        initial=initial_gear,
    )
    return {
        "workload": list(workload),
        "requests": len(rows),
        "span_s": round(trace.duration_s, 1),
        "initial_gear": out["initial_gear"],
        "expected_arrival_rps": out["expected_arrival_rps"],
        "gears_from": "the GearSet's planned gears" if planned else "planned here from the fleet file",
        "gears": {
            g.name: {
                "gpus": g.gpus,
                "layers": [s.end - s.start for s in g.api.stages],
                "nodes": [list(s.nodes) for s in g.api.stages],
                "copies": g.heads,
                "predicted_rps": g.predicted_rps,
            }
            for g in gears
        },
        "peer_layouts": peer_info,
        "rows": out["rows"],
    }
