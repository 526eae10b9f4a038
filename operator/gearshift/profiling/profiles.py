"""Fleet-level pure helpers of GPU profiling: which nodes are GPU nodes, compute classes by clustering the
fleet's scores, node labels from a profile, spec overrides, and datasheet interconnect.

No I/O and no clock: the kopf handlers (:mod:`gearshift.handlers.gpuprofile`) pass everything in.

Compute classes (``high``/``mid``/``low``): the fleet's *per-card* compute scores (the node score divided
by its cards and the PD guide's tensor-parallel factor (docs/sources.md#gpu-prior), so eight T4s are still a
``low`` card while the node's own ``computeScore`` keeps their sum) are clustered in log space — ratios, not
differences, make cards alike — by exact 1-D k-means with k = min(3, distinct scores) (dynamic programming,
Wang & Song, "Ckmeans.1d.dp", The R Journal 3(2), 2011). Adjacent clusters whose geometric means differ by
less than :data:`MIN_CLASS_RATIO` (1.5×) are then merged, so measurement noise or near-equal cards (H100 SXM
vs PCIe, 1.31×; A100 vs L40S, 1.16×) never split into two classes. The top cluster is ``high``, the
bottom ``low`` (when there are two or more) and a middle one ``mid``. On the datasheets of
``examples/fleets/mixed.yaml`` (H100 1.0, A100 0.315, A10 0.126, T4 0.066) this gives H100 high, A100 mid,
A10 and T4 low.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gearshift.api.gpuprofile import ComputeClass, GPUProfileSpec, GPUProfileStatus, ProfileOverride
from gearshift.facts.fleet import tp_efficiency
from gearshift.k8s.names import (
    ANNOTATION_AVAILABLE_UNTIL,
    ANNOTATION_REPROBE,
    DOMAIN,
    GPU_RESOURCE,
    NODE_COMPUTE_CLASS,
    NODE_GPU_MODEL,
    NODE_MEMORY_GIB,
    NODE_PROFILED,
)
from gearshift.k8s.placement import quantity_int

#: GPU feature discovery's product label (``NVIDIA-H100-80GB-HBM3``).
GFD_PRODUCT_LABEL = "nvidia.com/gpu.product"
GFD_REPLICAS_LABEL = "nvidia.com/gpu.replicas"
#: Clusters closer than this score ratio are one class (see the module docstring).
MIN_CLASS_RATIO = 1.5
MAX_CLASSES = 3
#: Node labels written from a profile (DESIGN.md).
PROFILE_LABELS = (NODE_GPU_MODEL, NODE_COMPUTE_CLASS, NODE_MEMORY_GIB, NODE_PROFILED)


class SelectorError(ValueError):
    """A GPU node label selector that cannot be parsed; the message shows the accepted forms."""


# --- GPU nodes ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Requirement:
    """One term of an equality-based label selector."""

    key: str
    op: str  # "=", "!=", "exists", "!exists"
    value: str = ""

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether ``labels`` satisfy this term (Kubernetes semantics: ``k!=v`` holds when k is absent)."""
        if self.op == "exists":
            return self.key in labels
        if self.op == "!exists":
            return self.key not in labels
        if self.op == "=":
            return labels.get(self.key) == self.value
        return labels.get(self.key) != self.value


_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def parse_selector(text: str) -> tuple[Requirement, ...]:
    """Parse an equality-based label selector: ``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k``, comma-joined.

    Raises:
        SelectorError: a term in another form (set-based ``in (...)`` is not supported) or a bad key.
    """
    out: list[Requirement] = []
    for raw in (t.strip() for t in text.split(",")):
        if not raw:
            continue
        if "!=" in raw:
            key, value = (s.strip() for s in raw.split("!=", 1))
            req = Requirement(key, "!=", value)
        elif "=" in raw:
            key, value = (s.strip() for s in raw.replace("==", "=").split("=", 1))
            req = Requirement(key, "=", value)
        elif raw.startswith("!"):
            req = Requirement(raw[1:].strip(), "!exists")
        else:
            req = Requirement(raw, "exists")
        if not _KEY.match(req.key) or " " in req.value:
            raise SelectorError(
                f"GPU node selector term {raw!r} is not understood; use key=value, key!=value, key or !key, "
                "comma-separated (e.g. 'nvidia.com/gpu.present=true,!example.com/excluded')"
            )
        out.append(req)
    return tuple(out)


@dataclass(frozen=True)
class GpuNodeView:
    """What profiling needs of a Node: its GPUs, labels, and gearshift annotations."""

    name: str
    gpu_count: int
    product: str
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    slices_per_card: int = 1
    """``nvidia.com/gpu`` advertised per physical card (NVIDIA time-slicing ``replicas``; 1: whole cards)."""

    @property
    def gpu_key(self) -> str:
        """The node's GPU as probed: product label × capacity; a change means a re-probe."""
        return f"{self.product or 'unknown'}x{self.gpu_count}"

    @property
    def reprobe_token(self) -> str | None:
        """The value of ``gearshift.io/reprobe`` (any new value asks for one more probe)."""
        return self.annotations.get(ANNOTATION_REPROBE)

    @property
    def available_until(self) -> str | None:
        """The node's reclaim time annotation, if any (RFC 3339)."""
        return self.annotations.get(ANNOTATION_AVAILABLE_UNTIL)


def node_view(body: Mapping[str, Any], selector: Iterable[Requirement] = ()) -> GpuNodeView | None:
    """The :class:`GpuNodeView` of a Node body, or None when it is not a GPU node.

    A GPU node has ``nvidia.com/gpu`` capacity > 0 and matches every ``selector`` term.
    """
    meta = body.get("metadata") or {}
    status = body.get("status") or {}
    labels = dict(meta.get("labels") or {})
    slots = quantity_int((status.get("capacity") or {}).get(GPU_RESOURCE))
    # With NVIDIA time-slicing each card is advertised ``nvidia.com/gpu.replicas`` times; the profile
    # describes physical cards (GPU feature discovery's own convention for nvidia.com/gpu.count).
    replicas = max(1, quantity_int(labels.get(GFD_REPLICAS_LABEL, "1")))
    count = slots // replicas
    if count < 1 or not all(r.matches(labels) for r in selector):
        return None
    annotations = {
        k: str(v) for k, v in (meta.get("annotations") or {}).items() if k.startswith(f"{DOMAIN}/")
    }
    return GpuNodeView(
        name=str(meta.get("name", "")),
        gpu_count=count,
        product=labels.get(GFD_PRODUCT_LABEL, ""),
        labels=labels,
        annotations=annotations,
        slices_per_card=replicas,
    )


# --- compute classes ----------------------------------------------------------------------------------


def card_score(status: GPUProfileStatus) -> float | None:
    """Per-card compute score: ``computeScore / (gpuCount × 0.85 if gpuCount > 1)``, None when unknown.

    The 0.85 is the PD guide's tensor-parallel factor (docs/sources.md#gpu-prior), which
    :func:`gearshift.api.probedoc.compute_score_from_tflops` applied to multi-card nodes.
    """
    if status.compute_score is None or not status.compute_score > 0:
        return None
    count = status.gpu_count or 1
    return status.compute_score / (count * tp_efficiency(count))


def _kmeans_1d(values: np.ndarray, weights: np.ndarray, k: int) -> list[int]:
    """Exact weighted 1-D k-means of sorted ``values``; returns the cluster index (0-based) of each value.

    Dynamic programming over prefix sums: ``D[c][i]`` is the least within-cluster sum of squares of the
    first ``i`` values in ``c`` clusters (Wang & Song 2011). O(k·m²) with the inner loop vectorised.
    """
    m = len(values)
    w = np.concatenate([[0.0], np.cumsum(weights)])
    s1 = np.concatenate([[0.0], np.cumsum(weights * values)])
    s2 = np.concatenate([[0.0], np.cumsum(weights * values**2)])

    def sse(j: np.ndarray, i: int) -> np.ndarray:
        # Cost of one cluster holding values j..i-1 (j < i).
        ww = w[i] - w[j]
        mu = (s1[i] - s1[j]) / ww
        return (s2[i] - s2[j]) - ww * mu**2

    inf = math.inf
    cost = np.full((k + 1, m + 1), inf)
    back = np.zeros((k + 1, m + 1), dtype=int)
    cost[0, 0] = 0.0
    for c in range(1, k + 1):
        for i in range(c, m + 1):
            js = np.arange(c - 1, i)
            cand = cost[c - 1, js] + sse(js, i)
            best = int(np.argmin(cand))
            cost[c, i], back[c, i] = cand[best], js[best]
    labels = [0] * m
    i = m
    for c in range(k, 0, -1):
        j = back[c, i]
        for t in range(j, i):
            labels[t] = c - 1
        i = j
    return labels


def classify(scores: Mapping[str, float], min_ratio: float = MIN_CLASS_RATIO) -> dict[str, ComputeClass]:
    """Compute class of each node from its per-card score (method in the module docstring).

    Args:
        scores: node name → per-card compute score (> 0; others are left out of the result).
        min_ratio: adjacent clusters closer than this ratio of geometric means are merged.

    Returns:
        node name → ``high``, ``mid`` or ``low``; empty for an empty fleet.
    """
    good = {n: s for n, s in scores.items() if s > 0 and math.isfinite(s)}
    if not good:
        return {}
    # Scores that agree to 4 significant digits are one value: keeps the DP small and ties together.
    logs = {n: round(math.log(float(f"{s:.4g}")), 9) for n, s in good.items()}
    distinct = sorted(set(logs.values()))
    counts = np.array([sum(1 for v in logs.values() if v == d) for d in distinct], dtype=float)
    vals = np.array(distinct)
    k = min(MAX_CLASSES, len(distinct))
    assignment = _kmeans_1d(vals, counts, k)
    # Clusters as [first, last] index ranges over the sorted distinct values, low to high.
    clusters: list[list[int]] = []
    for idx, c in enumerate(assignment):
        if clusters and assignment[idx - 1] == c:
            clusters[-1][1] = idx
        else:
            clusters.append([idx, idx])

    def mean(cl: list[int]) -> float:
        sl = slice(cl[0], cl[1] + 1)
        return float(np.average(vals[sl], weights=counts[sl]))

    limit = math.log(min_ratio)
    while len(clusters) > 1:
        gaps = [mean(clusters[i + 1]) - mean(clusters[i]) for i in range(len(clusters) - 1)]
        i = int(np.argmin(gaps))
        if gaps[i] >= limit:
            break
        clusters[i : i + 2] = [[clusters[i][0], clusters[i + 1][1]]]
    names: list[ComputeClass]
    names = {1: ["high"], 2: ["low", "high"], 3: ["low", "mid", "high"]}[len(clusters)]  # type: ignore[assignment]
    by_value: dict[float, ComputeClass] = {}
    for cl, name in zip(clusters, names, strict=True):
        for t in range(cl[0], cl[1] + 1):
            by_value[float(vals[t])] = name
    return {n: by_value[v] for n, v in logs.items()}


# --- node labels and overrides -------------------------------------------------------------------------


def node_labels(status: GPUProfileStatus | None) -> dict[str, str | None]:
    """The ``gearshift.io/*`` node labels a profile stands for, as a merge patch.

    Only a Ready profile with a model, memory and class gives values; anything else (Failed, Stale,
    Probing without earlier data, no class yet) gives ``None`` for every label, i.e. removes them, so a
    node never carries labels from bad or outdated data. ``memory-gib`` is the memory per GPU rounded to
    whole GiB (an integer, usable with node affinity's ``Gt``/``Lt``).
    """
    remove: dict[str, str | None] = dict.fromkeys(PROFILE_LABELS)
    if status is None or status.phase not in ("Ready", "Probing"):
        return remove
    if not (status.gpu_model and status.memory_gib and status.compute_class and status.probe_time):
        return remove
    return {
        NODE_GPU_MODEL: status.gpu_model,
        NODE_COMPUTE_CLASS: status.compute_class,
        NODE_MEMORY_GIB: str(round(status.memory_gib)),
        NODE_PROFILED: "true",
    }


def labels_patch(current: Mapping[str, str], wanted: Mapping[str, str | None]) -> dict[str, str | None]:
    """The part of ``wanted`` that differs from the node's ``current`` labels (empty: nothing to patch)."""
    return {k: v for k, v in wanted.items() if current.get(k) != v}


def apply_override(
    status: GPUProfileStatus, override: ProfileOverride | None
) -> tuple[GPUProfileStatus, list[str]]:
    """``status`` with every field pinned in ``spec.override`` replacing the measurement.

    Returns ``(status, overridden)``: ``overridden`` lists the pinned fields in camelCase as the status
    spells them (also written to ``status.overridden``); ``source`` becomes ``override`` when any is pinned
    (:meth:`gearshift.api.gpuprofile.GPUProfile.effective`).
    """
    from gearshift.api.gpuprofile import GPUProfile

    if override is None:
        out = status.model_copy(deep=True)
        out.overridden = []
        return out, []
    eff = GPUProfile(spec=GPUProfileSpec(node_name="x", override=override), status=status).effective()
    pinned = [
        ProfileOverride.model_fields[k].alias or k
        for k, v in override.model_dump(exclude_none=True).items()
        if v is not None
    ]
    eff.overridden = sorted(pinned)
    return eff, eff.overridden


def datasheet_interconnect(
    node: GpuNodeView, peers: Iterable[GpuNodeView], limit: int
) -> list[dict[str, Any]]:
    """``status.interconnect`` from the nodes' ``gearshift.io/nic-gbps`` and ``latency-us`` annotations.

    The slower NIC bounds a link and the larger latency counts, as :meth:`gearshift.facts.fleet.Fleet.link`
    does; peers without the annotations are left out. This is the datasheet fallback used until pairwise
    link probes run (the profile's ``source`` says ``datasheet``).

    A fleet with more than ``limit`` such peers gets none: the first ``limit`` by name would be an
    arbitrary part of it (at 1,000 nodes an A100 node listed 256 T4 and A10 peers and none of the cards it
    pipelines with), and the planner computes every pair from the same annotations where a profile lists
    no link (:func:`gearshift.planner.inputs.resource_profile`), so the list only cost bytes: 16 KB in
    each of 1,000 profiles, in every status write and in every copy the operator holds
    (bench/fleet_operator.py).
    """

    def nic(v: GpuNodeView) -> tuple[float, float] | None:
        try:
            return float(v.annotations[f"{DOMAIN}/nic-gbps"]), float(
                v.annotations.get(f"{DOMAIN}/latency-us", 0)
            )
        except (KeyError, ValueError):
            return None

    mine = nic(node)
    if mine is None:
        return []
    out: list[dict[str, Any]] = []
    for peer in sorted(peers, key=lambda p: p.name):
        theirs = nic(peer)
        if peer.name == node.name or theirs is None:
            continue
        if len(out) >= limit:
            return []
        out.append(
            {
                "peer": peer.name,
                "bandwidthGbps": min(mine[0], theirs[0]),
                "latencyUs": max(mine[1], theirs[1]),
            }
        )
    return out
