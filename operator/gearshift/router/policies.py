"""Pure scoring and choice functions of the PD router's policies: the prefill and decode pod of a request.

Policies (``POLICIES``):
  - ``pd-score`` (default): the PD guide's weighted node scores (docs/sources.md#prefill-score) (prefill:
    compute 0.30, load 0.25, queue 0.20, network 0.15, model cache 0.10; decode: ITL 0.35, memory 0.25, batch
    0.20, bandwidth 0.15, network 0.05) with the 1.2× KV-memory headroom filter on decode pods. Corrections to
    the PD guide, each because the PD guide's formula breaks the meaning of its own weights:

      1. *ITL score* — the PD guide returns ``1 + 0.2·(target − itl)/target`` below target, up to 1.2 for an
         idle pod, so the 0.35 weight silently became 0.42. We divide the PD guide's value by 1.2: same order,
         same continuity at the target, range [0, 1].
      2. *compute score* — the PD guide's ``prior × 0.85^(tp>1) × sqrt(gpus)`` is unbounded (2.83 on 8 cards),
         so on multi-card nodes the 0.30 weight outweighed all other terms together. We divide it by the
         largest value among the candidates (range (0, 1], the strongest candidate scores 1).
      3. *queue depth* — scraped engine counters are up to one scrape interval old, so a burst would all go
         to the pod that looked emptiest. Depth is ``max(running + waiting, router's in-flight to the pod)``.
      4. *bandwidth score* — the PD guide names the factor (HBM bandwidth and its use) but gives no formula.
         We use the HBM bandwidth each running sequence would share, ``hbm / (running + 1)``, divided by the
         best candidate's: decode is memory-bound (each step streams the weights and the KV cache once).
      5. *network score with no peer yet* — the decode pod is chosen first (the PD guide's prefill network
         term needs ``request.preferred_decode_node``), so decode's own network term is the PD guide's
         default 0.5 and prefill's uses the chosen decode pod.
      6. *request KV size* — the PD guide leaves it open; we use ``(prompt + max_tokens) ×
         kv_bytes_per_token``: the cache the request will hold at its end, which is what the headroom filter
         protects.
      7. *batch score* with ``max_batch`` 0 — guarded (score 0) rather than a division by zero.
      8. *queue term as expected prefill finish* — the PD guide's ``1 − min(depth / max_queue, 1)`` counts
         requests, not time, and saturates: 4 requests queued on an H100 wait ~130 ms while 4 on an A10
         wait ~1 s, yet both score the same; past ``max_queue`` (16) every deeper queue scores 0, so the
         compute term's fixed preference for the fast card (0.30 × (1 − 0.30) = 0.21 between an H100 and
         an A10) can never be overcome by a term whose whole swing is 0.20, and the fast pod's queue grows
         without bound under load. We score the time until this request's prefill would finish:
         ``1 − (depth + 1) × service_ms / target_ttft_ms``, with ``service_ms`` this request's prefill
         time on the pod (``RequestView.prefill_ms_ref`` on the reference card ÷ the pod's prefill speed;
         each queued request is priced as this one) and the PD guide's target TTFT (200 ms); not clamped
         below 0, so a finish ``k`` × the target away costs ``k`` × the weight. The ``+ 1`` (the request's
         own prefill) matters: without it an idle slow pod scores a full 1.0 however long the prompt,
         and long prompts — the TTFT tail — went to the A10s (P99 TTFT 1.04 s against 0.55 s with the
         PD guide's form in bench/router_des.py at 50 % load). With the PD guide's weights a busy H100 keeps a
         request while its expected finish is less than ~210 ms (0.21 / 0.20 × 200 ms) later than a busy
         A10's: close to join-the-shortest-expected-finish. With no prefill time (no model description)
         the PD guide's count form is kept.
  - ``shortest-queue``: FastChat's default (docs/sources.md#shortest-queue): ``argmin(queue_length / speed)``,
    first minimum wins, and the pick is counted at once (the caller adds 1 to the pod's queue length until the
    next scrape overwrites it). Speed is the pod's GPU-profile speed instead of FastChat's fixed 1
    (``speed_one=True`` restores FastChat's behaviour: it is the benchmark baseline).
  - ``lottery``: FastChat's weighted random choice, probability ``speed / Σ speed``; refuses when
    ``Σ speed < 1e-4`` as FastChat does.
  - ``round-robin``, ``power-of-two`` (two distinct random pods, the one with fewer router in-flight
    requests wins; Mitzenmacher 2001), ``least-request`` (fewest router in-flight requests).

Nothing here does I/O or reads the clock; randomness comes in as a ``random.Random``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from gearshift.facts.errors import PolicyError
from gearshift.facts.fleet import tp_efficiency
from gearshift.facts.gpus import GPU_SPECS, REFERENCE_MODEL, compute_score, pd_gpu_prior
from gearshift.facts.model import KV_HEADROOM

Role = Literal["prefill", "decode", "both"]
POLICIES: tuple[str, ...] = (
    "pd-score",
    "shortest-queue",
    "lottery",
    "round-robin",
    "power-of-two",
    "least-request",
)
DEFAULT_POLICY = "pd-score"

#: The PD guide (docs/sources.md#prefill-score): prefill weights.
PREFILL_WEIGHTS: dict[str, float] = {
    "compute": 0.30,
    "load": 0.25,
    "queue": 0.20,
    "network": 0.15,
    "cache": 0.10,
}
#: The PD guide (docs/sources.md#decode-score): decode weights.
DECODE_WEIGHTS: dict[str, float] = {
    "itl": 0.35,
    "memory": 0.25,
    "batch": 0.20,
    "bandwidth": 0.15,
    "network": 0.05,
}
#: The PD guide (docs/sources.md#slo-targets): target ITL, ms.
TARGET_ITL_MS = 50.0
#: The PD guide (docs/sources.md#prefill-score): KV transfer times at or above this score 0 on the network
#: term, ms.
MAX_TRANSFER_MS = 100.0
#: The PD guide (docs/sources.md#decode-score): the ideal decode batch is 70% of the maximum.
IDEAL_BATCH_FRACTION = 0.7
#: The PD guide (docs/sources.md#prefill-score): score of the network term when the peer pod is not known yet.
UNKNOWN_PEER_NETWORK_SCORE = 0.5
#: The PD guide (docs/sources.md#slo-targets): target TTFT, ms (the scale of the prefill queue term,
#: correction 8).
TARGET_TTFT_MS = 200.0


class NoPodError(RuntimeError):
    """No healthy pod of the role can take the request."""

    def __init__(self, role: str, reason: str) -> None:
        # "both" is the plain (not disaggregated) pool: say what the pods do rather than the role key.
        what = "serving (role both)" if role == "both" else role
        super().__init__(f"no {what} pod available: {reason}")
        self.role = role
        self.reason = reason


class BatchFullError(NoPodError):
    """Every routable pod of the role holds as many requests as its batch cap allows (the operator's
    adaptive max batch): the request waits in the router for one to finish."""

    def __init__(self, role: str) -> None:
        super().__init__(role, "every pod is at its max batch (gearshift.io/max-batch)")


class NoDecodeCapacityError(NoPodError):
    """Every healthy decode pod lacks 1.2 × the request's KV cache in free memory
    (docs/sources.md#decode-headroom: scale up)."""

    def __init__(self, kv_bytes: float) -> None:
        super().__init__(
            "decode", f"no decode pod has {KV_HEADROOM} × {kv_bytes / 2**20:.1f} MiB of free KV memory"
        )
        self.kv_bytes = kv_bytes


@dataclass(frozen=True)
class PodView:
    """What a policy knows of one pod at pick time: static facts from membership, live signals, router counts.

    Unlike the router's mutable per-pod record, a view is a snapshot and never changes.
    """

    name: str
    role: Role = "both"
    gpu_model: str | None = None
    """gearshift GPU model name (``gearshift.io/gpu-model``); None when unknown (seed prior 0.5)."""
    gpu_count: int = 1
    tp_size: int = 1
    compute_score: float | None = None
    """Measured per-card compute score (GPUProfile, H100 SXM = 1.0); None → the PD guide's prior table
    (docs/sources.md#gpu-prior)."""
    hbm_gbps: float | None = None
    """Per-card HBM bandwidth, GB/s (GPUProfile or datasheet); None → datasheet of ``gpu_model``."""
    speed: float | None = None
    """Relative speed for FastChat-style policies (pipeline-aware, from membership); None → derived."""
    node: str | None = None
    nic_gbps: float = 100.0
    """Node network bandwidth to other nodes, Gb/s."""
    latency_us: float = 10.0
    model_cached: bool = True
    # live signals
    running: float = 0.0
    waiting: float = 0.0
    queue_length: float = 0.0
    """FastChat-style queue length: last scraped running + waiting, plus picks since that scrape."""
    inflight: int = 0
    """Requests the router has sent to this pod and not yet finished."""
    gpu_util: float = 0.0
    """GPU (stage) utilisation 0..1."""
    kv_usage: float = 0.0
    """KV-cache usage 0..1 (``vllm:kv_cache_usage_perc``)."""
    kv_capacity_bytes: float | None = None
    """KV-cache pool size, bytes; None → unknown (the headroom filter passes)."""
    itl_ms: float | None = None
    """Recent mean inter-token latency, ms; None when no token was produced recently."""
    itl_prior_ms: float | None = None
    """Expected ITL of an idle pod (perf model), used when ``itl_ms`` is None; None → 0 (best)."""
    max_batch: int = 256
    max_queue: int = 16
    """Queue depth at which the queue score reaches 0 (the PD guide's ``max_queue_depth``)."""

    @property
    def free_kv_bytes(self) -> float | None:
        """Free KV-cache memory, bytes; None when the capacity is unknown."""
        if self.kv_capacity_bytes is None:
            return None
        return self.kv_capacity_bytes * max(0.0, 1.0 - self.kv_usage)

    @property
    def queue_depth(self) -> float:
        """Correction 3: the larger of the engine's count and the router's live in-flight count."""
        return max(self.running + self.waiting, float(self.inflight))


@dataclass(frozen=True)
class RequestView:
    """What a policy knows of one request."""

    prompt_tokens: int
    max_tokens: int = 16
    kv_bytes_per_token: float = 0.0
    """KV-cache bytes one token holds across all layers (``ModelArch.kv_bytes_per_token``); 0 → unknown."""
    model: str | None = None
    prefill_ms_ref: float | None = None
    """Prefill time of this prompt on the reference card (speed 1, H100 SXM), ms; None → unknown.

    The router prices it from the model description: ``prompt × FLOPs per token / (989 TFLOPS × 0.5 MFU)``
    (:func:`gearshift.router.settings.prefill_ms_per_token`, the planner's roofline assumptions)."""

    @property
    def kv_bytes(self) -> float:
        """KV cache the request holds at its end (correction 6), bytes."""
        return (self.prompt_tokens + self.max_tokens) * self.kv_bytes_per_token

    @property
    def prompt_kv_bytes(self) -> float:
        """KV cache the prefill pod hands to the decode pod, bytes."""
        return self.prompt_tokens * self.kv_bytes_per_token


@dataclass(frozen=True)
class Scored:
    """One candidate's score and the terms it is made of (for /debug and tests)."""

    pod: PodView
    score: float
    terms: Mapping[str, float] = field(default_factory=dict)


def check_weights(
    weights: Mapping[str, float], defaults: Mapping[str, float], field_name: str
) -> dict[str, float]:
    """Merge user weights over the defaults; returns the merged mapping.

    Raises:
        PolicyError: an unknown key or a negative / non-finite weight, naming ``field_name.key``.
    """
    merged = dict(defaults)
    for key, value in weights.items():
        if key not in defaults:
            raise PolicyError(f"{field_name}.{key} is not a weight; use one of {sorted(defaults)}")
        if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise PolicyError(f"{field_name}.{key} must be a finite number ≥ 0, got {value!r}")
        merged[key] = float(value)
    return merged


def check_policy(name: str) -> str:
    """Return ``name`` if it is a known policy.

    Raises:
        PolicyError: naming the known policies.
    """
    if name not in POLICIES:
        raise PolicyError(f"router.policy {name!r} is unknown; use one of {', '.join(POLICIES)}")
    return name


# --- shared terms -----------------------------------------------------------------------------------


def transfer_ms(kv_bytes: float, a: PodView, b: PodView) -> float:
    """The PD guide's KV transfer time between two pods (docs/sources.md#prefill-score), ms: ``bytes /
    bandwidth + latency``.

    The link is bounded by the slower NIC and the larger latency (as ``gearshift.facts.fleet.Fleet.link``);
    on the same node it is free of the network (0 ms).
    """
    if a.node is not None and a.node == b.node:
        return 0.0
    gbps = min(a.nic_gbps, b.nic_gbps)
    bytes_per_ms = gbps * 1e9 / 8 / 1000
    return kv_bytes / bytes_per_ms + max(a.latency_us, b.latency_us) / 1000


def network_score(kv_bytes: float, pod: PodView, peer: PodView | None) -> float:
    """The PD guide (docs/sources.md#prefill-score): ``max(0, 1 − transfer_ms / 100)``; 0.5 when the peer is
    not known yet."""
    if peer is None:
        return UNKNOWN_PEER_NETWORK_SCORE
    return max(0.0, 1.0 - transfer_ms(kv_bytes, pod, peer) / MAX_TRANSFER_MS)


def card_compute(pod: PodView) -> float:
    """Per-card compute: measured GPUProfile score, else the PD guide's prior table
    (docs/sources.md#gpu-prior) (H100 1.0 … unlisted 0.5)."""
    if pod.compute_score is not None:
        return pod.compute_score
    return pd_gpu_prior(pod.gpu_model or "")


def raw_compute(pod: PodView) -> float:
    """The PD guide's prefill compute term before normalisation (docs/sources.md#gpu-prior): ``card × (0.85 if
    tp > 1) × sqrt(gpus)``."""
    return card_compute(pod) * tp_efficiency(pod.tp_size) * math.sqrt(max(1, pod.gpu_count))


def card_hbm(pod: PodView) -> float:
    """Per-card HBM bandwidth, GB/s: measured, else datasheet, else the reference card's."""
    if pod.hbm_gbps is not None:
        return pod.hbm_gbps
    spec = GPU_SPECS.get(pod.gpu_model or "")
    return (spec or GPU_SPECS[REFERENCE_MODEL]).hbm_gbps


def pod_speed(pod: PodView, role: Role, speed_one: bool = False) -> float:
    """Relative speed for the FastChat-style policies.

    ``speed_one`` gives FastChat's fixed 1. Otherwise ``pod.speed`` when membership computed one (a
    pipeline's effective speed), else per role: prefill is compute-bound → datasheet compute score
    (bf16 TFLOPS / H100 SXM's) × gpus × TP efficiency; decode is memory-bound → HBM GB/s / H100 SXM's ×
    gpus × TP efficiency. Unknown GPUs count as the reference card.
    """
    if speed_one:
        return 1.0
    if pod.speed is not None:
        return pod.speed
    eff = tp_efficiency(pod.gpu_count)
    gpus = max(1, pod.gpu_count)
    if role == "decode":
        return card_hbm(pod) / GPU_SPECS[REFERENCE_MODEL].hbm_gbps * gpus * eff
    if pod.compute_score is not None:
        card = pod.compute_score
    elif pod.gpu_model in GPU_SPECS:
        card = compute_score(pod.gpu_model)
    else:
        card = 1.0
    return card * gpus * eff


# --- pd-score: prefill ---------------------------------------------------------------------------------


def prefill_load_score(pod: PodView) -> float:
    """The PD guide (docs/sources.md#prefill-score): ``1 − (0.6 · gpu_util + 0.4 · memory_util)``, clamped to
    [0, 1]."""
    return min(1.0, max(0.0, 1.0 - (0.6 * pod.gpu_util + 0.4 * pod.kv_usage)))


def prefill_service_ms(pod: PodView, request: RequestView) -> float | None:
    """This request's prefill time on ``pod``, ms: reference-card time ÷ the pod's prefill speed.

    None when the request's reference time is unknown.
    """
    if request.prefill_ms_ref is None:
        return None
    return request.prefill_ms_ref / max(pod_speed(pod, "prefill"), 1e-9)


def queue_score(
    pod: PodView, request: RequestView | None = None, target_ttft_ms: float = TARGET_TTFT_MS
) -> float:
    """Prefill queue term (correction 8): ``1 − (depth + 1) × service_ms / target_ttft_ms``, range (−∞, 1).

    ``depth`` from correction 3, ``service_ms`` from :func:`prefill_service_ms` (each queued request is
    priced as this one; ``+ 1`` is this request's own prefill). Without a service time (no request, or no
    model description): the PD guide's ``1 − min(depth / max_queue, 1)`` (docs/sources.md#prefill-score).
    """
    service = prefill_service_ms(pod, request) if request is not None else None
    if service is not None and target_ttft_ms > 0:
        return 1.0 - (pod.queue_depth + 1.0) * service / target_ttft_ms
    if pod.max_queue <= 0:
        return 0.0
    return 1.0 - min(pod.queue_depth / pod.max_queue, 1.0)


def score_prefill(
    pods: Sequence[PodView],
    request: RequestView,
    decode_pod: PodView | None = None,
    weights: Mapping[str, float] = PREFILL_WEIGHTS,
    target_ttft_ms: float = TARGET_TTFT_MS,
) -> list[Scored]:
    """The PD guide's prefill score of every pod (docs/sources.md#prefill-score) (higher is better), in input
    order.

    Terms: compute (correction 2: divided by the candidates' largest), load, queue (correction 8: expected
    prefill finish against ``target_ttft_ms``, ms), network (KV transfer of the prompt to ``decode_pod``),
    cache (1.0 model cached, 0.5 loadable; PDService key ``cache``).
    """
    if not pods:
        return []
    top = max(raw_compute(p) for p in pods) or 1.0
    out = []
    for p in pods:
        terms = {
            "compute": raw_compute(p) / top,
            "load": prefill_load_score(p),
            "queue": queue_score(p, request, target_ttft_ms),
            "network": network_score(request.prompt_kv_bytes, p, decode_pod),
            "cache": 1.0 if p.model_cached else 0.5,
        }
        out.append(Scored(p, sum(terms[k] * weights.get(k, 0.0) for k in terms), terms))
    return out


# --- pd-score: decode ----------------------------------------------------------------------------------


def itl_score(itl_ms: float, target_ms: float = TARGET_ITL_MS) -> float:
    """The PD guide's ITL score divided by 1.2 (docs/sources.md#decode-score) (correction 1), range [0, 1];
    ``itl_ms`` in ms."""
    if itl_ms > target_ms:
        seed = max(0.0, 1.0 - (itl_ms - target_ms) / target_ms)
    else:
        seed = 1.0 + (target_ms - itl_ms) / target_ms * 0.2
    return seed / 1.2


def memory_score(free_bytes: float | None, kv_bytes: float) -> float:
    """The PD guide (docs/sources.md#decode-score): piecewise in ``ratio = free / kv``: <1.2 → 0; <2 → 0..0.5;
    else 0.5..1 (full at 6).

    Unknown capacity or an unknown request size (0 bytes) counts as plenty (1.0).
    """
    if free_bytes is None or kv_bytes <= 0:
        return 1.0
    ratio = free_bytes / kv_bytes
    if ratio < KV_HEADROOM:
        return 0.0
    if ratio < 2.0:
        return (ratio - 1.2) / 0.8 * 0.5
    return 0.5 + min(0.5, (ratio - 2.0) / 4.0 * 0.5)


def batch_score(current: float, max_batch: int) -> float:
    """The PD guide (docs/sources.md#decode-score): ``max(0, 1 − |current − 0.7·max| / (0.7·max))``; 0 when
    ``max_batch`` ≤ 0 (correction 7)."""
    ideal = max_batch * IDEAL_BATCH_FRACTION
    if ideal <= 0:
        return 0.0
    return max(0.0, 1.0 - abs(current - ideal) / ideal)


def has_headroom(pod: PodView, kv_bytes: float) -> bool:
    """The PD guide's filter (docs/sources.md#decode-headroom): free KV memory ≥ 1.2 × the request's KV cache
    (unknown capacity passes), the
    margin capped at the pod's whole pool: a request of more than 1/1.2 of the pool (which the engine
    serves) takes an idle pod instead of never passing (held, then refused with 503, while its scale-up
    request could not help)."""
    free = pod.free_kv_bytes
    if free is None:
        return True
    need = KV_HEADROOM * kv_bytes
    if pod.kv_capacity_bytes is not None:
        need = min(need, pod.kv_capacity_bytes)
    return free >= need


def score_decode(
    pods: Sequence[PodView],
    request: RequestView,
    prefill_pod: PodView | None = None,
    weights: Mapping[str, float] = DECODE_WEIGHTS,
    target_itl_ms: float = TARGET_ITL_MS,
) -> list[Scored]:
    """The PD guide's decode score of every pod passing the headroom filter (docs/sources.md#decode-score)
    (higher is better), in input order.

    Terms: itl (correction 1; ``itl_ms``, else ``itl_prior_ms``, else 0), memory, batch (current = the
    larger of scraped running and router in-flight), bandwidth (correction 4), network (correction 5).
    """
    kv = request.kv_bytes
    fit = [p for p in pods if has_headroom(p, kv)]
    if not fit:
        return []

    def share(p: PodView) -> float:
        return card_hbm(p) * max(1, p.gpu_count) / (max(p.running, float(p.inflight)) + 1.0)

    top = max(share(p) for p in fit) or 1.0
    out = []
    for p in fit:
        itl = p.itl_ms if p.itl_ms is not None else (p.itl_prior_ms or 0.0)
        terms = {
            "itl": itl_score(itl, target_itl_ms),
            "memory": memory_score(p.free_kv_bytes, kv),
            "batch": batch_score(max(p.running, float(p.inflight)), p.max_batch),
            "bandwidth": share(p) / top,
            "network": network_score(request.prompt_kv_bytes, p, prefill_pod),
        }
        out.append(Scored(p, sum(terms[k] * weights.get(k, 0.0) for k in terms), terms))
    return out


def best(scored: Sequence[Scored]) -> Scored:
    """Highest score; ties go to fewer router in-flight requests, then to input order.

    Raises:
        ValueError: ``scored`` is empty.
    """
    if not scored:
        raise ValueError("best() needs at least one scored pod")
    return max(reversed(scored), key=lambda s: (s.score, -s.pod.inflight))


# --- FastChat-style and simple policies --------------------------------------------------------------


def shortest_queue(pods: Sequence[PodView], role: Role, speed_one: bool = False) -> int:
    """FastChat's SHORTEST_QUEUE (docs/sources.md#shortest-queue): index of ``argmin(queue_length / speed)``,
    first minimum.

    The caller counts the pick (queue_length += 1) as FastChat does.

    Raises:
        NoPodError: ``pods`` is empty.
    """
    if not pods:
        raise NoPodError(role, "no healthy pod")
    keys = [p.queue_length / max(pod_speed(p, role, speed_one), 1e-9) for p in pods]
    return keys.index(min(keys))


def lottery(pods: Sequence[PodView], role: Role, rng: random.Random, speed_one: bool = False) -> int:
    """FastChat's LOTTERY (docs/sources.md#lottery): index drawn with probability ``speed / Σ speed``.

    Raises:
        NoPodError: no pods, or ``Σ speed < 1e-4`` (FastChat returns no worker then).
    """
    speeds = [pod_speed(p, role, speed_one) for p in pods]
    total = sum(speeds)
    if not pods or total < 1e-4:
        raise NoPodError(role, "no pod with a positive speed")
    u = rng.random() * total
    acc = 0.0
    for i, s in enumerate(speeds):
        acc += s
        if u < acc:
            return i
    return len(pods) - 1


def round_robin(pods: Sequence[PodView], role: Role, counter: int) -> int:
    """Index ``counter mod n``; the caller advances ``counter``.

    Raises:
        NoPodError: ``pods`` is empty.
    """
    if not pods:
        raise NoPodError(role, "no healthy pod")
    return counter % len(pods)


def least_request(pods: Sequence[PodView], role: Role) -> int:
    """Index of the pod with the fewest router in-flight requests (first on ties).

    Raises:
        NoPodError: ``pods`` is empty.
    """
    if not pods:
        raise NoPodError(role, "no healthy pod")
    counts = [p.inflight for p in pods]
    return counts.index(min(counts))


def power_of_two(pods: Sequence[PodView], role: Role, rng: random.Random) -> int:
    """Two distinct random pods; the one with fewer router in-flight requests (the first drawn on ties).

    Raises:
        NoPodError: ``pods`` is empty.
    """
    if not pods:
        raise NoPodError(role, "no healthy pod")
    if len(pods) == 1:
        return 0
    a, b = rng.sample(range(len(pods)), 2)
    return b if pods[b].inflight < pods[a].inflight else a


def pipeline_speed(stages: Sequence[tuple[int, float]]) -> float:
    """Effective speed of a pipeline for one request: ``L / Σ (layers_k / speed_k)``.

    ``stages``: (layer count, stage speed) per stage. A one-stage pipeline has its card's speed; a layer
    on a slow card costs its slowness whatever the rest of the pipeline does.

    Raises:
        ValueError: no stage, or a non-positive layer count or speed.
    """
    if not stages:
        raise ValueError("pipeline_speed needs at least one stage")
    total = 0
    cost = 0.0
    for layers, speed in stages:
        if layers <= 0 or speed <= 0:
            raise ValueError(f"stage layers and speed must be positive, got {layers}, {speed}")
        total += layers
        cost += layers / speed
    return total / cost
