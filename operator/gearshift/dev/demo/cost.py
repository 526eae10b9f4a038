"""What a demo run cost in GPU time, and what the twin's static gears cost on the same trace window (pure).

**The run's GPU time is measured on the cluster**: every few seconds the demo lists the service's engine
pods; a pod bound to a node holds the ``nvidia.com/gpu`` its containers ask for (extended resources are set
in limits, and requests default to them) until it is gone, shadows and draining pods included. With
NVIDIA time-slicing a card is advertised ``nvidia.com/gpu.replicas`` times, so a node's slices held are
rounded up to physical cards and capped at the cards it has (:func:`cards_held`). GPU-seconds are the
held cards integrated over the run (:func:`gpu_seconds`): what the cluster reserved for the service.

**The twin's static gears** (:func:`twin_static`) replay the same requests at the same time scale in
virtual time (:mod:`gearshift.dev.twin`): the planner's gears on the same fleet file, each served alone
from the first request to the last, with the same SLO. The twin runs each gear's engines in the combined
prefill+decode role (it does not model PD disaggregation), so the rows say what one static gear of the
fleet would have cost for the same traffic, beside what the run's disaggregated, shifting service cost.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gearshift.api.gearset import ShiftPolicy
from gearshift.control.adapt import policy_from_api
from gearshift.dev.loadgen import TraceRequest, clip_to_context
from gearshift.dev.twin import Slo, plan_gears, run_variant, trace_from_requests
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


def twin_static(
    requests: Sequence[TraceRequest],
    time_scale: float,
    *,
    arch: ModelArch,
    fleet: Path,
    slo_ttft_ms: float,
    slo_itl_ms: float,
    max_model_len: int | None = None,
) -> dict[str, Any]:
    """Every static gear the planner makes of ``fleet`` for ``arch``, replayed in the twin on ``requests``
    (trace seconds from the window's start) at ``time_scale``, clipped to ``max_model_len`` as the load
    generator clipped them. The gears are planned for the window's own mean prompt and output lengths.

    Returns ``{"workload": [prompt, output], "requests", "span_s", "gears": [row, ...]}``, one row per gear:
    ``gear``, ``gpus``, ``slo_met``, ``slo_attainment``, ``goodput_rps``, ``gpu_hours``,
    ``slo_met_per_gpu_hour``, ``failed``, ``rejected_too_long``, ``ttft_p99_ms``, ``tpot_p99_ms``,
    ``cpu_s`` (virtual time: ``gpu_hours`` is over the replay's seconds, as the run's).

    Raises:
        ValueError: no request, or a non-positive ``time_scale``; the planner's
            :class:`~gearshift.planner.errors.PlanError` (a ValueError) when it finds no gear.
    """
    rows = [clip_to_context(r, max_model_len) for r in requests]
    trace = trace_from_requests(rows, time_scale)
    workload = (round(float(trace.prompt.mean())), round(float(trace.output.mean())))
    policy = policy_from_api(ShiftPolicy(), role="prefill", ttft_slo_ms=slo_ttft_ms, itl_slo_ms=slo_itl_ms)
    gears, _, _ = plan_gears(arch, policy, workload, fleet=fleet, even=False)
    slo = Slo(slo_ttft_ms / 1000.0, slo_itl_ms / 1000.0)
    out = []
    for g in gears:
        r = run_variant(g.name, arch, trace, policy, gears, g.name, dynamic=False, slo=slo)
        out.append(
            {
                "gear": g.name,
                "gpus": g.gpus,
                "slo_met": r["slo_met"],
                "slo_attainment": r["slo_attainment"],
                "goodput_rps": r["goodput_rps"],
                "gpu_hours": r["gpu_hours"],
                "slo_met_per_gpu_hour": r["slo_met_per_gpu_hour"],
                "failed": r["failed"],
                "rejected_too_long": r["rejected_too_long"],
                "ttft_p99_ms": r["ttft_ms"]["p99"],
                "tpot_p99_ms": r["tpot_ms"]["p99"],
                "cpu_s": r["cpu_s"],
            }
        )
    return {
        "workload": list(workload),
        "requests": len(rows),
        "span_s": round(trace.duration_s, 1),
        "gears": out,
    }
