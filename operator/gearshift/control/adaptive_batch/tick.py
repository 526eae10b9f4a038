"""The PD guide's adaptive batch (docs/sources.md#adaptive-batch), applied by the operator to the serving
(decode) gear. Pure.

The router computes the PD guide's rule (docs/sources.md#adaptive-batch) every 5 s per decode pod
(:func:`gearshift.control.adaptive_batch.pd_balance.adapt_batch`: ITL P99 > 1.2 × target → max batch × 0.9;
ITL P99 < 0.8 × target with a queue > 10 → × 1.1) and publishes it at ``GET /debug/decisions``. The operator
reads every router replica's round, and this module turns the proposals for each of the active gear's head
pods into one bounded step of that pod's *effective* max batch.

**What "apply" means.** A vLLM engine's batch limit is ``--max-num-seqs``, read once when the engine
starts (``SchedulerConfig.max_num_seqs``, vllm/config/scheduler.py; the v1 scheduler copies it into
``max_num_running_reqs`` at construction, vllm/v1/core/sched/scheduler.py, vLLM 0.32.0): it cannot be
changed in a running engine. Restarting the pod with another value drops its in-flight requests, which
the project forbids, and a gear shift (shadow → drain → switch) to move a ×0.9 step costs tens of GB of
weights moved for a correction meant to act within seconds. So the effective max batch is applied where it
loses nothing and works alike for vLLM and the simulated engine: **the router caps the requests it keeps on
each head pod at once** (pod annotation ``gearshift.io/max-batch``, read by the router's membership poll
within 2 s; requests beyond the cap wait in the router, FIFO, bounded by its queue timeout, and are never
sent to wait in the engine). That is what Envoy's per-host circuit breakers (``max_requests``) and
Kubernetes' API Priority and Fairness do in front of a server whose own limit is fixed: bound the
concurrency at the proxy. An engine batches what it is sent, so capping what it is sent lowers its
running batch, and with it its per-token time. The engine's own ``--max-num-seqs`` (the gear's
``maxBatch``, ``planned`` here) is the ceiling: a cap above it would change nothing. Growing beyond it
needs a new engine, i.e. a shift to a gear with a larger ``maxBatch``: out of this loop's reach.

**Per head pod.** The PD guide's rule is a decode-node rule (docs/sources.md#adaptive-batch): each pod's ITL
and backlog move that pod's own cap. One cap shared by a gear whose replicas run on different cards (an H100
pod beside an A10 pod) cannot serve both: the slow pod's ITL over target lowers it while the fast pod's
backlog raises it, and the cap oscillates with neither pod right (the demo's decode gear, H100/A100/A10 pods:
40 ↔ 58, 96% busy, SLO met 78% → 47%). So every head pod keeps its own effective max batch, stepped from that
pod's own proposals; ``status.adaptiveBatch.effective`` is the lowest of them and ``pods`` lists each.

**The step** (:func:`decide`), per head pod, at most once per ``cooldown_s`` per pod (30 s: six router
rounds, so the ITL a round measures reflects the cap in force, not the one before it):

- never during a shift (the executor's :class:`~gearshift.control.shifting.executor.ShiftState` busy: the
serving
  pods are about to change; a step would be measured on the wrong gear);
- a new active gear (a shift finished, the gear's ``maxBatch`` edited, first sight) starts every pod at its
  planned max batch, and so does a pod that joins the gear (a scale-up);
- *lower* a pod when any router proposes a smaller max batch for it (an ITL over target hurts the requests
  on that pod now): ``max(floor, min(effective − 1, ⌊effective × 0.9⌋))``;
- *raise* a pod when no router proposes lowering it and at least one proposes raising (the others within
  band or without ITL samples): ``min(planned, max(effective + 1, ⌊effective × 1.1⌋))``;
- the floor is ``max(1, microBatch, ⌈planned / 4⌉)``: a bounded correction, not a way to starve a pod when
  its ITL is high for another reason (a noisy neighbour, a long prompt mix); below it the answer is a
  shift or a scale-up, which their own loops decide;
- a proposal whose ``current`` is not the cap this module wrote for that pod (a router that has not read
  the new annotation yet, or a round measured before it) is stale and does not vote.

With ``R`` router replicas each keeps ``max(1, ⌊effective / R⌋)`` requests per pod (each router caps
only what it sends), as the warm-up mirror's per-router rate does.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from gearshift.api.gearset_status import AdaptiveBatchStatus
from gearshift.control.adaptive_batch.pd_balance import GROW_FACTOR, SHRINK_FACTOR
from gearshift.facts.rfc3339 import from_time, to_time

#: GearSet roles whose engines decode, where the PD guide's per-node batch rule applies
#: (docs/sources.md#adaptive-batch): decode, and an aggregated pipeline (both), whose head pods run every
#: request's decode steps.
ROLES = ("decode", "both")
#: Least seconds between two changes of one pod's effective max batch.
COOLDOWN_S = 30.0
#: The floor as a fraction of the planned max batch.
FLOOR_FRACTION = 0.25
#: Changes kept in ``status.adaptiveBatch.history``.
MAX_CHANGES = 10
#: Pods named in one message (a condition, an event, a decision).
MAX_NAMED = 4

StepKind = Literal["Lower", "Raise", "Hold", "Reset"]

# Reasons (CamelCase, for status, events and the condition).
REASON_INITIAL = "InitialGear"
REASON_GEAR_CHANGED = "GearChanged"
REASON_PLAN_CHANGED = "MaxBatchEdited"
REASON_POD_ADDED = "PodAdded"
REASON_DISABLED = "Disabled"
REASON_SHIFT = "ShiftInFlight"
REASON_NO_PODS = "NoHeadPods"
REASON_NO_DECISIONS = "NoRouterDecisions"
REASON_STALE = "RouterNotApplied"
REASON_COOLDOWN = "Cooldown"
REASON_AT_FLOOR = "AtFloor"
REASON_AT_PLANNED = "AtPlanned"
REASON_WITHIN_BAND = "WithinBand"
REASON_ITL_HIGH = "ItlOverTarget"
REASON_ITL_LOW = "ItlUnderTargetWithBacklog"

#: Which kind a tick reports when its pods did different things (the most consequential first).
_KIND_ORDER: tuple[StepKind, ...] = ("Lower", "Raise", "Reset", "Hold")


@dataclass(frozen=True)
class Vote:
    """One router's adaptive-batch proposal for one head pod (an entry of ``/debug/decisions`` ``batch``)."""

    router: str
    pod: str
    current: int
    proposed: int
    reason: str

    @property
    def direction(self) -> int:
        """−1 lower, +1 raise, 0 keep."""
        return (self.proposed > self.current) - (self.proposed < self.current)


def votes_from(doc: Mapping[str, Any], router: str, pods: Collection[str]) -> list[Vote]:
    """The proposals of one router's ``/debug/decisions`` answer for ``pods`` (malformed entries left out)."""
    out = []
    for entry in doc.get("batch") or ():
        if not isinstance(entry, Mapping) or entry.get("pod") not in pods:
            continue
        try:
            cur, new = int(entry["current"]), int(entry["proposed"])
        except (KeyError, TypeError, ValueError):
            continue
        out.append(Vote(router, str(entry["pod"]), cur, new, str(entry.get("reason", ""))[:200]))
    return out


@dataclass(frozen=True)
class Change:
    """One change of a pod's effective max batch (``pod`` none: the whole gear, e.g. a reset)."""

    at: float
    before: int | None
    after: int
    reason: str
    message: str
    pod: str | None = None


@dataclass(frozen=True)
class PodBatch:
    """One head pod's effective max batch and when it last changed (its cooldown counts from then)."""

    effective: int
    last_change_at: float | None = None


@dataclass(frozen=True)
class BatchState:
    """What the loop remembers (``status.adaptiveBatch``): per head pod of the gear, its effective value."""

    gear: str | None = None
    planned: int | None = None
    pods: Mapping[str, PodBatch] = field(default_factory=dict)
    history: tuple[Change, ...] = ()

    @property
    def effective(self) -> int | None:
        """The lowest effective max batch over the head pods (the planned one with no pod yet)."""
        return min((p.effective for p in self.pods.values()), default=self.planned)

    @property
    def last_change_at(self) -> float | None:
        """When any pod's value last changed."""
        return max(
            (p.last_change_at for p in self.pods.values() if p.last_change_at is not None), default=None
        )


@dataclass(frozen=True)
class PodStep:
    """One head pod's decision: what its effective max batch becomes and why."""

    pod: str
    kind: StepKind
    effective: int
    reason: str
    message: str


@dataclass(frozen=True)
class BatchStep:
    """One tick's decision: a step per head pod, summed up in ``kind``/``reason``/``message``."""

    kind: StepKind
    planned: int
    floor: int
    reason: str
    message: str
    pods: tuple[PodStep, ...] = ()

    @property
    def effective(self) -> int:
        """The lowest effective max batch after this step (the planned one with no pod)."""
        return min((p.effective for p in self.pods), default=self.planned)

    @property
    def changes(self) -> bool:
        return self.kind in ("Lower", "Raise", "Reset")

    def cap(self, pod: str) -> int:
        """Effective max batch of ``pod`` after this step (the planned one for a pod it does not name)."""
        return next((p.effective for p in self.pods if p.pod == pod), self.planned)


#: Values of the GearSet annotation ``gearshift.io/adaptive-batch`` (case-insensitive) and what they mean.
SWITCH_VALUES = {"on": True, "true": True, "off": False, "false": False}
REASON_BAD_SWITCH = "InvalidAnnotation"


def switch(value: str | None) -> tuple[bool, str | None]:
    """Whether the annotation ``gearshift.io/adaptive-batch`` (``value``; absent: on) turns the loop on,
    and an error message for a value that is none of :data:`SWITCH_VALUES` (then the loop stays on: an
    unreadable annotation must not silently change what runs, as Kubernetes ignores an unknown one)."""
    if value is None:
        return True, None
    known = SWITCH_VALUES.get(value.strip().lower())
    if known is None:
        return True, (
            f"annotation gearshift.io/adaptive-batch is {value!r}, not one of on, off, true, false: "
            "ignored, adaptive batch stays on; set it to off to turn it off"
        )
    return known, None


def floor_of(planned: int, micro_batch: int = 1) -> int:
    """The least effective max batch (module docstring), never above ``planned``."""
    return min(planned, max(1, micro_batch, math.ceil(planned * FLOOR_FRACTION)))


def lowered(effective: int, floor: int) -> int:
    """The PD guide's × 0.9 (docs/sources.md#adaptive-batch), at least one lower, not below ``floor``."""
    return max(floor, min(effective - 1, int(effective * SHRINK_FACTOR)))


def raised(effective: int, planned: int) -> int:
    """The PD guide's × 1.1 (docs/sources.md#adaptive-batch), at least one higher, not above ``planned``."""
    return min(planned, max(effective + 1, int(effective * GROW_FACTOR)))


def per_router_cap(effective: int, routers: int) -> int:
    """Requests one of ``routers`` router replicas keeps on a pod at once."""
    return max(1, effective // max(1, routers))


def _top(votes: Sequence[Vote]) -> str:
    v = votes[0]
    more = f" (+{len(votes) - 1} more)" if len(votes) > 1 else ""
    return f"router {v.router}: {v.reason}{more}"


def _pod_step(
    pod: str,
    state: PodBatch,
    votes: Sequence[Vote],
    *,
    planned: int,
    floor: int,
    routers: int,
    now: float,
    cooldown_s: float,
) -> PodStep:
    """One pod's step from its own proposals (module docstring)."""
    eff = state.effective

    def step(kind: StepKind, value: int, reason: str, message: str) -> PodStep:
        return PodStep(pod, kind, value, reason, message)

    if not votes:
        return step("Hold", eff, REASON_NO_DECISIONS, f"pod {pod}: no router published a decision")
    expected = per_router_cap(eff, routers)
    fresh = [v for v in votes if v.current == expected]
    if not fresh:
        v = votes[0]
        return step(
            "Hold",
            eff,
            REASON_STALE,
            f"router {v.router} reports max batch {v.current} for pod {pod}, not the cap {expected} "
            "written (it has not read the annotation yet)",
        )
    down = [v for v in fresh if v.direction < 0]
    up = [v for v in fresh if v.direction > 0]
    cooling = state.last_change_at is not None and now - state.last_change_at < cooldown_s
    if down:
        if eff <= floor:
            return step("Hold", eff, REASON_AT_FLOOR, f"pod {pod} at the floor {floor}; {_top(down)}")
        if cooling:
            return step(
                "Hold",
                eff,
                REASON_COOLDOWN,
                f"pod {pod} changed less than {cooldown_s:g} s ago; {_top(down)}",
            )
        new = lowered(eff, floor)
        return step("Lower", new, REASON_ITL_HIGH, f"pod {pod} max batch {eff} → {new}: {_top(down)}")
    if up:
        if eff >= planned:
            return step(
                "Hold", eff, REASON_AT_PLANNED, f"pod {pod} at the planned {planned} (the engine's limit)"
            )
        if cooling:
            return step(
                "Hold", eff, REASON_COOLDOWN, f"pod {pod} changed less than {cooldown_s:g} s ago; {_top(up)}"
            )
        new = raised(eff, planned)
        return step("Raise", new, REASON_ITL_LOW, f"pod {pod} max batch {eff} → {new}: {_top(up)}")
    return step("Hold", eff, REASON_WITHIN_BAND, f"pod {pod} max batch {eff}: its ITL is within band")


def _messages(steps: Sequence[PodStep]) -> str:
    """The messages of ``steps``, at most :data:`MAX_NAMED` of them, and how many more there were."""
    more = f" (+{len(steps) - MAX_NAMED} more pods)" if len(steps) > MAX_NAMED else ""
    return "; ".join(p.message for p in steps[:MAX_NAMED]) + more


def _summary(pods: Sequence[PodStep]) -> tuple[StepKind, str, str]:
    """The tick's kind, reason and message: the most consequential kind among the pods, the reason its pods
    share (the first one's when they differ), the messages of its pods (:func:`_messages`)."""
    kind = next(k for k in _KIND_ORDER if any(p.kind == k for p in pods))
    mine = [p for p in pods if p.kind == kind]
    return kind, mine[0].reason, _messages(mine)


def decide(
    state: BatchState,
    *,
    gear: str,
    planned: int,
    micro_batch: int,
    heads: Collection[str],
    votes: Iterable[Vote],
    now: float,
    shift_in_flight: bool,
    routers: int = 1,
    enabled: bool = True,
    cooldown_s: float = COOLDOWN_S,
) -> BatchStep:
    """The step for the active ``gear`` whose engines run ``planned`` (its ``maxBatch``) at most, whose head
    pods are ``heads`` (names; each pod's effective max batch in the result, ``BatchStep.pods``)."""
    floor = floor_of(planned, micro_batch)
    pods = sorted(heads)

    def every(kind: StepKind, value: Mapping[str, int] | int, reason: str, message: str) -> BatchStep:
        vals = {p: value if isinstance(value, int) else value[p] for p in pods}
        steps = tuple(PodStep(p, kind, vals[p], reason, message) for p in pods)
        return BatchStep(kind, planned, floor, reason, message, steps)

    same_gear = state.gear == gear and state.planned == planned
    if shift_in_flight:
        # Nothing changes while the serving pods are about to: not even a reset to the new gear.
        keep = {p: state.pods[p].effective if same_gear and p in state.pods else planned for p in pods}
        return every("Hold", keep, REASON_SHIFT, "a gear shift is in flight: the max batch waits for it")
    if not enabled:
        if same_gear and all(state.pods.get(p, PodBatch(planned)).effective == planned for p in pods):
            return every("Hold", planned, REASON_DISABLED, "adaptive batch is off for this GearSet")
        return every(
            "Reset", planned, REASON_DISABLED, f"adaptive batch is off: back to the planned {planned}"
        )
    if state.gear is None:
        return every(
            "Reset", planned, REASON_INITIAL, f"gear {gear} starts at its planned max batch {planned}"
        )
    if state.gear != gear:
        return every(
            "Reset", planned, REASON_GEAR_CHANGED, f"gear {gear} is active: its planned max batch {planned}"
        )
    if state.planned != planned:
        return every(
            "Reset", planned, REASON_PLAN_CHANGED, f"gear {gear}'s maxBatch is now {planned}: starting there"
        )
    if not pods:
        return BatchStep("Hold", planned, floor, REASON_NO_PODS, f"gear {gear} has no head pod yet")
    by_pod: dict[str, list[Vote]] = {p: [] for p in pods}
    for v in votes:
        if v.pod in by_pod:
            by_pod[v.pod].append(v)
    steps = tuple(
        PodStep(p, "Reset", planned, REASON_POD_ADDED, f"pod {p} joins gear {gear} at the planned {planned}")
        if p not in state.pods
        else _pod_step(
            p,
            state.pods[p],
            by_pod[p],
            planned=planned,
            floor=floor,
            routers=routers,
            now=now,
            cooldown_s=cooldown_s,
        )
        for p in pods
    )
    kind, reason, message = _summary(steps)
    return BatchStep(kind, planned, floor, reason, message, steps)


def advance(state: BatchState, step: BatchStep, gear: str, now: float) -> BatchState:
    """The state after ``step``: each pod's value (a change recorded: time, pod, from, to, why), pods that
    left the gear forgotten; a hold during a shift or with no pod keeps the memory as it was."""
    if step.reason in (REASON_SHIFT, REASON_NO_PODS):
        return state
    if step.reason == REASON_DISABLED and step.kind == "Hold" and state.gear == gear:
        return state
    gear_reset = step.kind == "Reset" and step.reason != REASON_POD_ADDED
    before_gear = state.effective if state.gear == gear and state.planned is not None else None
    pods: dict[str, PodBatch] = {}
    changes: list[Change] = []
    for p in step.pods:
        old = state.pods.get(p.pod) if not gear_reset else None
        if old is not None and old.effective == p.effective:
            pods[p.pod] = old
            continue
        pods[p.pod] = PodBatch(p.effective, now)
        if old is not None:
            changes.append(Change(now, old.effective, p.effective, p.reason, p.message, p.pod))
    if gear_reset and (before_gear != step.planned or state.gear != gear or state.planned != step.planned):
        changes.append(Change(now, before_gear, step.planned, step.reason, step.message))
    new = BatchState(gear=gear, planned=step.planned, pods=pods, history=state.history)
    if new.pods == state.pods and new.gear == state.gear and new.planned == state.planned and not changes:
        return state
    return replace(new, history=(*state.history, *changes)[-MAX_CHANGES:])


def _capped(state: BatchState) -> list[tuple[str, int]]:
    planned = state.planned or 0
    return sorted((n, p.effective) for n, p in state.pods.items() if p.effective < planned)


def pod_annotations(
    step: BatchStep, pods: Iterable[str], routers: int, enabled: bool
) -> dict[str, str | None]:
    """Each head pod's ``gearshift.io/max-batch`` after ``step``: its per-router cap, or None (removed) when
    the loop is off."""
    return {p: str(per_router_cap(step.cap(p), routers)) if enabled else None for p in pods}


def condition(step: BatchStep, state: BatchState, bad_switch: str | None = None) -> tuple[str, str, str]:
    """The ``BatchAdapted`` condition: True while the router caps any head pod below the planned max batch;
    with ``bad_switch`` (:func:`switch`'s error) its reason is ``InvalidAnnotation`` and the message
    starts with the error."""
    status, reason, message = _condition(step, state)
    if bad_switch is not None:
        return status, REASON_BAD_SWITCH, f"{bad_switch}; {message}"
    return status, reason, message


def _condition(step: BatchStep, state: BatchState) -> tuple[str, str, str]:
    if step.reason == REASON_DISABLED:
        return ("False", REASON_DISABLED, "adaptive batch is off (annotation gearshift.io/adaptive-batch)")
    last = state.history[-1] if state.history else None
    why = f"; last change {last.reason}: {last.message}" if last is not None else ""
    capped = _capped(state)
    if capped:
        named = ", ".join(f"{n} {v}" for n, v in capped[:MAX_NAMED])
        more = f" (+{len(capped) - MAX_NAMED} more)" if len(capped) > MAX_NAMED else ""
        reason = (
            last.reason
            if last is not None and last.reason in (REASON_ITL_HIGH, REASON_ITL_LOW)
            else REASON_ITL_HIGH
        )
        return (
            "True",
            reason,
            f"max batch {min(v for _, v in capped)} of {step.planned} (lowest); below the planned on "
            f"{len(capped)} of {len(state.pods)} head pods: {named}{more}{why}",
        )
    eff = state.effective if state.effective is not None else step.effective
    return ("False", REASON_AT_PLANNED, f"max batch {eff}: the planned {step.planned} on every head pod{why}")


def events(step: BatchStep, before: BatchState, gear: str) -> list[tuple[str, str, bool]]:
    """The events a changing step records: (reason, message, warning), one per kind of change (lowered
    pods, raised pods, a reset of the gear); none for a hold, a pod joining at its planned value, or the
    first sight of a gear (nothing changed: its engines run the planned max batch already)."""
    out = []
    for kind, reason in (("Lower", "MaxBatchLowered"), ("Raise", "MaxBatchRaised")):
        mine = [p for p in step.pods if p.kind == kind]
        if mine:
            out.append((reason, _messages(mine), False))
    if step.kind == "Reset" and step.reason not in (REASON_INITIAL, REASON_POD_ADDED):
        moved = before.gear != gear or any(p.effective != step.planned for p in before.pods.values())
        if moved or before.planned != step.planned:
            out.append(("MaxBatchReset", step.message, False))
    return out


# --- status ------------------------------------------------------------------------------------------
def state_from_status(st: AdaptiveBatchStatus | None) -> BatchState:
    """The loop's memory from ``status.adaptiveBatch`` (none: a fresh start)."""
    if st is None:
        return BatchState()
    return BatchState(
        gear=st.gear,
        planned=st.planned,
        pods={p.pod: PodBatch(p.effective, from_time(p.last_change_time)) for p in st.pods},
        history=tuple(
            Change(from_time(c.time) or 0.0, c.from_value, c.to_value, c.reason, c.message, c.pod)
            for c in st.history
        ),
    )


def status_json(state: BatchState, step: BatchStep, routers: int, now: float) -> dict[str, Any]:
    """``status.adaptiveBatch`` after ``step`` (``state``: :func:`advance`'s result)."""
    eff = state.effective if state.effective is not None else step.effective
    return {
        "gear": state.gear,
        "planned": step.planned,
        "effective": eff,
        "floor": step.floor,
        "perRouter": per_router_cap(eff, routers),
        "pods": [
            {
                "pod": name,
                "effective": p.effective,
                "perRouter": per_router_cap(p.effective, routers),
                "lastChangeTime": to_time(p.last_change_at),
            }
            for name, p in sorted(state.pods.items())
        ],
        "lastDecision": step.kind,
        "lastReason": step.reason,
        "lastMessage": step.message[:1024],
        "lastDecisionTime": to_time(now),
        "lastChangeTime": to_time(state.last_change_at),
        "history": [
            {
                "time": to_time(c.at),
                "pod": c.pod,
                "from": c.before,
                "to": c.after,
                "reason": c.reason,
                "message": c.message[:1024],
            }
            for c in state.history
        ],
    }


def status_changed(old: AdaptiveBatchStatus | None, doc: Mapping[str, Any]) -> bool:
    """Whether ``doc`` says more than the stored status beyond a later ``lastDecisionTime`` (a hold that
    repeats itself is not rewritten every round)."""
    if old is None:
        return True
    before, after = old.to_json(), AdaptiveBatchStatus.model_validate(doc).to_json()
    before.pop("lastDecisionTime", None)
    after.pop("lastDecisionTime", None)
    return before != after
