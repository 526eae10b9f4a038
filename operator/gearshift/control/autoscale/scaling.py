"""The pipeline-replica autoscaler's decisions: how many replicas a role wants, when, and where they go.

Pure: no clock (``now`` is passed in, s), no network, no kopf. The handler
(:mod:`gearshift.handlers.autoscale`) fetches samples, calls :func:`decide_scale` and acts;
:mod:`gearshift.control.autoscale.tick` maps the GearSet and PDService onto these numbers and the decisions
back onto the GearSet.

Algorithm, per sample of one role:

1. **Recommendation** (:func:`recommend`), the Kubernetes HPA rule ``desired = ceil(current × ratio)``
   (kubernetes.io/docs/tasks/run-application/horizontal-pod-autoscale, "Algorithm details") over the
   larger of two load ratios — KV-cache usage / ``targets.kvCacheUsage``, waiting requests per replica /
   ``targets.waitingPerReplica`` — with the HPA's 10% tolerance band (no change while the ratio is within
   0.9..1.1), clamped to ``[max(min, 1), max]``. The role's P99 / (``targets.sloRatio`` × SLO) is not a
   load ratio: a decode step's time is mostly the weights read once per step, so ITL hardly falls with
   fewer requests per replica, and as a proportional measure it would hold replicas up at any load. It
   acts one-sidedly instead: above the band it asks ``ceil(current × ratio)`` (an SLO miss is a scale-up
   signal), and within or above the band it vetoes a scale-down (fewer replicas would breach the SLO).
2. **Immediate scale-up** on the router's "no decode headroom" rejections (docs/sources.md#decode-headroom: a
   decode node needs free memory ≥ 1.2 × the request's KV cache, *else scale-up is requested*): one more
   replica than now (or the recommendation if higher), without waiting for the up window. Also immediate:
   activation from 0 replicas when requests wait, and raising to ``minReplicas``.
3. **Stabilisation windows**: a recommendation above the current count must hold for ``scaleUpS``
   (the target is the *lowest* recommendation seen in that run, as the HPA's scale-up stabilisation);
   below it for ``scaleDownS`` (the target is the *highest* in the run). A run restarts when the
   recommendation crosses back.
4. **Scale to min**: the normal path never goes below ``max(minReplicas, 1)``; an idle role (nothing
   running or waiting) for ``scaleToMinDelayS`` drops to ``minReplicas`` (0 included).
5. **Coordination with the gear executor**: while a shift of the role is in flight nothing is decided
   and the windows restart (the signals of a role in mid-shift describe neither gear); a shift plans
   with the current replica count (the executor reads ``GearSet.spec.replicas``). While a previous
   scale-up has replicas not Ready yet, further scale-ups wait (new replicas take minutes to load
   weights; counting their absence again would overshoot).
6. **Missing is never low load**: a sample whose KV usage or P99 is missing or not a number while
   requests run names it (``ScaleSample.missing``). Read as absent it would leave only the waiting
   ratio, i.e. no load, and drain replicas of a full role; so a scale-down holds (``SeriesMissing``,
   ``ScalingActive=False`` with one Warning event per episode), while a scale-up on what is known
   (waiting, rejections, a known P99) still goes ahead. The next complete sample clears it.

Placement (:func:`place_replicas`): each new pipeline replica needs, for every stage, a node with free
GPUs that the stage may use (its named nodes, else its node-selector labels), of an allowed compute
class, and — for planner-named stages — not already holding a pod of that stage (required
anti-affinity). Among candidates the one with the highest compute per GPU wins: at a flat price per
GPU-hour, goodput per GPU-hour is proportional to compute per GPU, so this is the cheapest place per unit
of goodput; ties go to the tightest fit (keeps large holes for large stages), then the name.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from gearshift.api.rolespec import ScalingSpec

#: HPA's default tolerance: no change while the load ratio is within 1 ± this.
TOLERANCE = 0.1

# --- reasons (CamelCase; events, status.scaling.lastReason) -------------------------------------------
REASON_KV_CACHE = "KvCacheHigh"
REASON_WAITING = "WaitingHigh"
REASON_SLO = "SloMissed"
REASON_NO_HEADROOM = "NoDecodeHeadroom"
REASON_ACTIVATE = "Activate"
REASON_BELOW_MIN = "BelowMinReplicas"
REASON_ABOVE_MAX = "AboveMaxReplicas"
REASON_LOW_LOAD = "LowLoad"
REASON_IDLE = "IdleScaleToMin"
REASON_STEADY = "Steady"
REASON_UP_WINDOW = "ScaleUpStabilising"
REASON_DOWN_WINDOW = "ScaleDownStabilising"
REASON_SHIFT = "ShiftInProgress"
REASON_PENDING = "ReplicasStarting"
REASON_NO_SIGNALS = "SignalsMissing"
REASON_AT_MAX = "AtMaxReplicas"
#: A series the load is judged by is missing (or not a number) while requests run: no scale-down.
REASON_SERIES_MISSING = "SeriesMissing"


class ScaleKind(StrEnum):
    """What :func:`decide_scale` concluded."""

    HOLD = "Hold"
    UP = "ScaleUp"
    DOWN = "ScaleDown"


@dataclass(frozen=True)
class ScalingPolicy:
    """The knobs of one role's autoscaler (``PDService.spec.<role>.scaling``); times in s."""

    min_replicas: int = 1
    max_replicas: int = 1
    kv_cache_usage: float = 0.8
    """Target KV-cache usage of the fullest head pod, 0..1 (``vllm:kv_cache_usage_perc``)."""
    waiting_per_replica: float = 4.0
    """Target waiting requests per pipeline replica (``vllm:num_requests_waiting``); 0 disables."""
    slo_ratio: float = 1.0
    """Scale up while the role's P99 exceeds this × the SLO (TTFT prefill, ITL decode)."""
    scale_up_s: float = 30.0
    scale_down_s: float = 300.0
    scale_to_min_delay_s: float = 600.0

    @classmethod
    def from_spec(cls, spec: ScalingSpec) -> ScalingPolicy:
        """The policy of an API ``ScalingSpec``."""
        return cls(
            min_replicas=spec.min_replicas,
            max_replicas=spec.max_replicas,
            kv_cache_usage=spec.targets.kv_cache_usage,
            waiting_per_replica=spec.targets.waiting_per_replica,
            slo_ratio=spec.targets.slo_ratio,
            scale_up_s=spec.windows.scale_up_s,
            scale_down_s=spec.windows.scale_down_s,
            scale_to_min_delay_s=spec.windows.scale_to_min_delay_s,
        )

    @property
    def floor(self) -> int:
        """The lowest count the load-driven path goes to (0 only through the idle scale-to-min)."""
        return max(self.min_replicas, 1)


@dataclass(frozen=True)
class ScaleSample:
    """One observation of a role's active gear (head pods) and of the router."""

    at: float
    """When it was taken, s."""
    kv_cache_usage: float | None = None
    """KV-cache usage of the fullest head pod, 0..1; None: unknown."""
    waiting: float = 0.0
    """Requests waiting on all head pods together."""
    running: float = 0.0
    """Requests running on all head pods together."""
    p99_ratio: float | None = None
    """The role's P99 (TTFT for prefill, ITL for decode) / its SLO; None: no traffic in the window."""
    no_headroom: int = 0
    """Router rejections for lack of decode KV headroom since the previous sample (decode role)."""
    missing: tuple[str, ...] = ()
    """Series this sample lacks (no series, or not a number) while requests run or wait, each named with
    its query: missing is never low load, so a scale-down waits for them; a scale-up on what is
    known still goes ahead."""

    @property
    def idle(self) -> bool:
        """Nothing running or waiting, no rejection."""
        return self.running <= 0 and self.waiting <= 0 and self.no_headroom <= 0


@dataclass(frozen=True)
class Recommendation:
    """What the load asks for now, before stabilisation."""

    replicas: int
    reason: str
    ratio: float
    """The governing load ratio (1.0 = on target)."""


def recommend(sample: ScaleSample, current: int, policy: ScalingPolicy) -> Recommendation:
    """The replica count the sample asks for (steps 1–2 of the module docstring), within [floor, max].

    ``current`` = pipeline replicas now (``GearSet.spec.replicas``).
    """
    base = max(current, 1)
    ratios: list[tuple[float, str]] = []
    if sample.kv_cache_usage is not None:
        ratios.append((sample.kv_cache_usage / policy.kv_cache_usage, REASON_KV_CACHE))
    if policy.waiting_per_replica > 0:
        ratios.append((sample.waiting / base / policy.waiting_per_replica, REASON_WAITING))
    slo = sample.p99_ratio / policy.slo_ratio if sample.p99_ratio is not None else None
    if slo is not None and slo > 1.0 + TOLERANCE:
        ratios.append((slo, REASON_SLO))
    ratio, reason = max(ratios, default=(0.0, REASON_LOW_LOAD))
    if abs(ratio - 1.0) <= TOLERANCE:
        want, reason = base, REASON_STEADY
    else:
        # A tiny epsilon keeps 0.8 / 0.8 × 3 from rounding up through floating-point noise.
        want = math.ceil(base * ratio - 1e-9)
        if want < base:
            reason = REASON_LOW_LOAD
        elif want == base:
            reason = REASON_STEADY
    if want < base and slo is not None and slo >= 1.0 - TOLERANCE:
        want, reason, ratio = base, REASON_STEADY, slo
    if sample.no_headroom > 0:
        want, reason = max(want, current + 1), REASON_NO_HEADROOM
    want = min(max(want, policy.floor), policy.max_replicas)
    return Recommendation(want, reason, round(ratio, 4))


@dataclass(frozen=True)
class ScaleState:
    """The autoscaler's memory between samples (persisted in ``GearSet.status.scaling``); times in s."""

    up_since: float | None = None
    """Start of the current run of recommendations above the current count."""
    up_floor: int | None = None
    """Lowest recommendation in that run."""
    down_since: float | None = None
    down_ceiling: int | None = None
    """Highest recommendation in the current run below the current count."""
    idle_since: float | None = None
    last_scale_at: float | None = None
    last_reason: str = ""


@dataclass(frozen=True)
class ScaleDecision:
    """One decision: hold, or change to ``target`` pipeline replicas."""

    kind: ScaleKind
    target: int
    reason: str
    message: str
    recommendation: int | None = None


def _reset_runs(s: ScaleState) -> ScaleState:
    return replace(s, up_since=None, up_floor=None, down_since=None, down_ceiling=None)


def decide_scale(
    state: ScaleState,
    sample: ScaleSample | None,
    policy: ScalingPolicy,
    *,
    current: int,
    ready: int,
    now: float,
    shift_in_flight: bool = False,
) -> tuple[ScaleState, ScaleDecision]:
    """One step of the autoscaler (module docstring). Pure.

    Args:
        state: memory from the previous step.
        sample: this step's observation; None when the signals are missing.
        policy: the role's scaling knobs.
        current: pipeline replicas asked for now (``GearSet.spec.replicas``).
        ready: pipeline replicas Ready now.
        now: the time, s.
        shift_in_flight: a gear shift of this role is in progress.
    """

    def hold(
        s: ScaleState, reason: str, message: str, rec: int | None = None
    ) -> tuple[ScaleState, ScaleDecision]:
        return s, ScaleDecision(ScaleKind.HOLD, current, reason, message, rec)

    def change(s: ScaleState, target: int, reason: str, message: str) -> tuple[ScaleState, ScaleDecision]:
        kind = ScaleKind.UP if target > current else ScaleKind.DOWN
        s = replace(_reset_runs(s), last_scale_at=now, last_reason=reason)
        return s, ScaleDecision(kind, target, reason, message, target)

    if shift_in_flight:
        return hold(_reset_runs(state), REASON_SHIFT, "a gear shift of this role is in flight; no scaling")
    if current < policy.min_replicas:
        return change(
            state,
            policy.min_replicas,
            REASON_BELOW_MIN,
            f"{current} replica(s) < minReplicas {policy.min_replicas}",
        )
    if current > policy.max_replicas:
        return change(
            state,
            policy.max_replicas,
            REASON_ABOVE_MAX,
            f"{current} replica(s) > maxReplicas {policy.max_replicas}",
        )
    if sample is None:
        return hold(_reset_runs(state), REASON_NO_SIGNALS, "no sample; the windows restart")
    state = replace(
        state, idle_since=(state.idle_since if state.idle_since is not None else now) if sample.idle else None
    )
    if current == 0:
        if not sample.idle:
            return change(state, policy.floor, REASON_ACTIVATE, "requests arrive at 0 replicas")
        return hold(state, REASON_STEADY, "0 replicas, idle")
    rec = recommend(sample, current, policy)
    idle_for = now - state.idle_since if state.idle_since is not None else 0.0
    if (
        state.idle_since is not None
        and idle_for >= policy.scale_to_min_delay_s
        and current > policy.min_replicas
    ):
        return change(
            state,
            policy.min_replicas,
            REASON_IDLE,
            f"idle for {idle_for:.0f} s >= scaleToMinDelayS {policy.scale_to_min_delay_s:g}",
        )
    if rec.replicas > current:
        if ready < current:
            return hold(
                _reset_runs(state),
                REASON_PENDING,
                f"{ready}/{current} replicas Ready; a scale-up is still starting",
                rec.replicas,
            )
        if rec.reason == REASON_NO_HEADROOM:
            return change(
                state,
                rec.replicas,
                rec.reason,
                f"router: {sample.no_headroom} request(s) found no decode pod with KV headroom",
            )
        since = state.up_since if state.up_since is not None else now
        floor = min(state.up_floor if state.up_floor is not None else rec.replicas, rec.replicas)
        state = replace(state, up_since=since, up_floor=floor, down_since=None, down_ceiling=None)
        if now - since >= policy.scale_up_s:
            return change(
                state,
                floor,
                rec.reason,
                f"load ratio {rec.ratio:g} ({rec.reason}) held {now - since:.0f} s: {current} -> {floor}",
            )
        return hold(
            state,
            REASON_UP_WINDOW,
            f"{rec.reason} asks {rec.replicas}; {now - since:.0f}/{policy.scale_up_s:g} s",
            rec.replicas,
        )
    if rec.replicas < current and sample.missing:
        return hold(
            _reset_runs(state),
            REASON_SERIES_MISSING,
            # No changing number in it: the condition's message, and so its one Warning event, stays put
            # for the whole episode.
            f"missing or not a number while requests run, so no scale-down on a load it cannot see: "
            f"{'; '.join(sample.missing)}",
            rec.replicas,
        )
    if rec.replicas < current:
        since = state.down_since if state.down_since is not None else now
        ceiling = max(state.down_ceiling if state.down_ceiling is not None else rec.replicas, rec.replicas)
        state = replace(state, down_since=since, down_ceiling=ceiling, up_since=None, up_floor=None)
        if now - since >= policy.scale_down_s:
            return change(
                state,
                ceiling,
                REASON_LOW_LOAD,
                f"load ratio {rec.ratio:g} held {now - since:.0f} s: {current} -> {ceiling}",
            )
        return hold(
            state,
            REASON_DOWN_WINDOW,
            f"load asks {rec.replicas}; {now - since:.0f}/{policy.scale_down_s:g} s",
            rec.replicas,
        )
    state = _reset_runs(state)
    if current >= policy.max_replicas and (rec.ratio > 1 + TOLERANCE or sample.no_headroom > 0):
        return hold(
            state,
            REASON_AT_MAX,
            f"load ratio {rec.ratio:g} but maxReplicas {policy.max_replicas}",
            rec.replicas,
        )
    return hold(state, REASON_STEADY, f"load ratio {rec.ratio:g}", rec.replicas)


def run_decisions(
    policy: ScalingPolicy,
    samples: Sequence[ScaleSample],
    start: int,
    *,
    shifting: Iterable[bool] | None = None,
) -> list[ScaleDecision]:
    """Feed ``samples`` in order, applying each change at once (every replica Ready at once); the
    decisions. For tests and the virtual-time benchmark (a simulator next to the planner, STYLE.md)."""
    state, current, out = ScaleState(), start, []
    flags = list(shifting) if shifting is not None else [False] * len(samples)
    for s, busy in zip(samples, flags, strict=True):
        state, d = decide_scale(
            state, s, policy, current=current, ready=current, now=s.at, shift_in_flight=busy
        )
        out.append(d)
        current = d.target
    return out


# --- placement ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NodeView:
    """A GPU node as the placement sees it."""

    name: str
    free_gpus: int
    """Allocatable ``nvidia.com/gpu`` minus the GPUs of its unfinished pods."""
    compute_per_gpu: float
    """GPUProfile ``computeScore`` / GPU count (H100 SXM = 1.0), else the datasheet's."""
    compute_class: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class StageNeed:
    """What one stage needs per pipeline replica."""

    gpus: int = 1
    """GPUs per pod."""
    pods: int = 1
    """Pods per pipeline replica (hot-stage replicas)."""
    nodes: tuple[str, ...] = ()
    """Named nodes (planner gears): only these, one pod per node."""
    selector: Mapping[str, str] = field(default_factory=dict)
    """Node labels (hand-written gears), when no nodes are named."""
    occupied: frozenset[str] = frozenset()
    """Nodes already holding a pod of this stage."""


@dataclass(frozen=True)
class Placement:
    """Where ``replicas`` new pipeline replicas go; ``short`` says why no more fit."""

    replicas: int
    nodes: tuple[tuple[str, ...], ...]
    """Per new replica, per stage pod: the chosen node names (stage order, pods of a stage together)."""
    short: str = ""


#: How the packer ranks a stage's candidate nodes: ``(node, its free GPUs now) -> key``, lowest first.
NodeRank = Callable[[NodeView, int], Any]


def fastest_tightest(node: NodeView, free: int) -> tuple[float, int, str]:
    """The autoscaler's rank: highest compute per GPU, then the tightest fit, then the name."""
    return (-node.compute_per_gpu, free, node.name)


def place_replicas(
    stages: Sequence[StageNeed],
    add: int,
    nodes: Iterable[NodeView],
    allowed_classes: Sequence[str] = (),
    rank: NodeRank = fastest_tightest,
) -> Placement:
    """Place up to ``add`` new pipeline replicas, all stages of each or none (module docstring), each pod on
    the candidate node ``rank`` puts first (default :func:`fastest_tightest`). Pure."""
    free = {n.name: n for n in nodes}
    left = {n: v.free_gpus for n, v in free.items()}
    used = [set(st.occupied) for st in stages]
    placed: list[tuple[str, ...]] = []
    short = ""
    for _ in range(max(add, 0)):
        trial = dict(left)
        trial_used = [set(u) for u in used]
        chosen: list[str] = []
        for k, st in enumerate(stages):
            for _pod in range(st.pods):
                cands = [
                    v
                    for name, v in free.items()
                    if (
                        name in st.nodes
                        if st.nodes
                        else all(v.labels.get(a) == b for a, b in st.selector.items())
                    )
                    and (not allowed_classes or v.compute_class in allowed_classes)
                    and trial[name] >= st.gpus
                    and not (st.nodes and name in trial_used[k])
                ]
                if not cands:
                    where = f"nodes {list(st.nodes)}" if st.nodes else f"labels {dict(st.selector)}"
                    classes = f" of class {list(allowed_classes)}" if allowed_classes else ""
                    short = f"stage {k}: no node{classes} among {where} has {st.gpus} free GPU(s)"
                    break
                best = min(cands, key=lambda v: rank(v, trial[v.name]))
                trial[best.name] -= st.gpus
                trial_used[k].add(best.name)
                chosen.append(best.name)
            if short:
                break
        if short:
            break
        left, used = trial, trial_used
        placed.append(tuple(chosen))
    return Placement(len(placed), tuple(placed), short)


# --- drain -------------------------------------------------------------------------------------------
_ORDINAL = re.compile(r"-(\d+)$")


def pod_ordinal(pod_name: str) -> int | None:
    """A StatefulSet pod's ordinal (the ``-N`` suffix), or None."""
    m = _ORDINAL.search(pod_name)
    return int(m.group(1)) if m else None


def pods_to_drain(head_pods: Iterable[str], target: int, pods_per_replica: int = 1) -> list[str]:
    """The head (stage-0) pods that leave when the role goes to ``target`` pipeline replicas: those whose
    ordinal is ≥ ``target × pods_per_replica`` (a StatefulSet removes its highest ordinals first)."""
    cut = target * pods_per_replica
    return sorted(p for p in head_pods if (o := pod_ordinal(p)) is not None and o >= cut)


@dataclass(frozen=True)
class DrainStatus:
    """Whether a scale-down may cut replicas now."""

    done: bool
    reason: str
    message: str


def drain_done(
    started_at: float, now: float, in_flight: int | None, *, grace_s: float, timeout_s: float
) -> DrainStatus:
    """A drain ends when the router has had ``grace_s`` to stop picking the pods and their in-flight count
    (running + waiting) is 0, or at ``timeout_s`` (then in-flight requests are cut: the status says so).

    ``in_flight`` None (unknown) holds until the timeout rather than cut requests off.
    """
    waited = now - started_at
    if waited >= timeout_s:
        return DrainStatus(
            True, "DrainTimeout", f"{in_flight} request(s) still in flight after {waited:.0f} s"
        )
    if waited < grace_s:
        return DrainStatus(False, "Draining", f"router excluding the pods ({waited:.0f}/{grace_s:g} s)")
    if in_flight is None:
        return DrainStatus(False, "Draining", "in-flight requests unknown; waiting")
    if in_flight > 0:
        return DrainStatus(False, "Draining", f"{in_flight} request(s) in flight")
    return DrainStatus(True, "Drained", f"no request in flight after {waited:.0f} s")


# --- PromQL of the autoscaler's signals (head pods of one gear) ----------------------------------------
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
#: The gauge's name before vLLM 0.10 renamed it.
KV_CACHE_USAGE_OLD = "vllm:gpu_cache_usage_perc"
NO_HEADROOM_TOTAL = "gearshift_router_no_decode_headroom_total"


def kv_usage_query(matchers: str) -> str:
    """KV-cache usage of the fullest head pod matching ``matchers`` (``{...}``), 0..1; the older gauge name
    when no pod exports the current one (PromQL ``or``)."""
    return f"max({KV_CACHE_USAGE}{matchers}) or max({KV_CACHE_USAGE_OLD}{matchers})"


def pod_in_flight_query(namespace: str, pods: Sequence[str]) -> str:
    """Requests running or waiting on the named pods, summed."""
    names_re = "|".join(re.escape(p) for p in pods)
    m = f'{{namespace="{namespace}",pod=~"{names_re}"}}'
    return f"sum(vllm:num_requests_running{m}) + sum(vllm:num_requests_waiting{m})"


def parse_counter(text: str, name: str) -> float | None:
    """Sum of the samples of counter ``name`` in a Prometheus text exposition; None when absent."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith(name) and (len(line) == len(name) or line[len(name)] in " {"):
            try:
                total += float(line.rsplit(" ", 1)[1])
                seen = True
            except (IndexError, ValueError):
                continue
    return total if seen else None


def counter_delta(previous: float | None, value: float | None) -> int:
    """Increase of a counter since ``previous``; a reset (router restart) counts from 0."""
    if value is None:
        return 0
    if previous is None:
        return 0
    return int(value - previous) if value >= previous else int(value)
