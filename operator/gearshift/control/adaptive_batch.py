"""Seed 000's adaptive batch, applied by the operator to the serving (decode) gear. Pure.

The router computes seed 000's rule every 5 s per decode pod
(:func:`gearshift.control.pd_balance.adapt_batch`: ITL P99 > 1.2 × target → max batch × 0.9; ITL P99
< 0.8 × target with a queue > 10 → × 1.1) and publishes it at ``GET /debug/decisions``. The operator
reads every router replica's round, and this module turns the proposals for the active gear's head pods
into one bounded step of the gear's *effective* max batch.

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

**The step** (:func:`decide`), at most once per ``cooldown_s`` (30 s: six router rounds, so the ITL a round
measures reflects the cap in force, not the one before it):

- never during a shift (the executor's :class:`~gearshift.control.executor.ShiftState` busy: the serving
  pods are about to change; a step would be measured on the wrong gear);
- a new active gear (a shift finished, the gear's ``maxBatch`` edited, first sight) starts at its planned
  max batch;
- *lower* when any router proposes a smaller max batch for any head pod (an ITL over target hurts the
  requests on that pod now): ``max(floor, min(effective − 1, ⌊effective × 0.9⌋))``;
- *raise* when no router proposes lowering and at least one proposes raising (the others within band or
  without ITL samples): ``min(planned, max(effective + 1, ⌊effective × 1.1⌋))``;
- the floor is ``max(1, microBatch, ⌈planned / 4⌉)``: a bounded correction, not a way to starve a pod when
  its ITL is high for another reason (a noisy neighbour, a long prompt mix); below it the answer is a
  shift or a scale-up, which their own loops decide;
- a proposal whose ``current`` is not the cap this module wrote (a router that has not read the new
  annotation yet, or a round measured before it) is stale and does not vote.

With ``R`` router replicas each keeps ``max(1, ⌊effective / R⌋)`` requests per pod (each router caps
only what it sends), as the warm-up mirror's per-router rate does.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from gearshift.api.gearset import AdaptiveBatchStatus
from gearshift.control.executor_status import from_time, to_time
from gearshift.control.pd_balance import GROW_FACTOR, SHRINK_FACTOR

#: Least seconds between two changes of the effective max batch.
COOLDOWN_S = 30.0
#: The floor as a fraction of the planned max batch.
FLOOR_FRACTION = 0.25
#: Changes kept in ``status.adaptiveBatch.history``.
MAX_CHANGES = 10

StepKind = Literal["Lower", "Raise", "Hold", "Reset"]

# Reasons (CamelCase, for status, events and the condition).
REASON_INITIAL = "InitialGear"
REASON_GEAR_CHANGED = "GearChanged"
REASON_PLAN_CHANGED = "MaxBatchEdited"
REASON_DISABLED = "Disabled"
REASON_SHIFT = "ShiftInFlight"
REASON_NO_DECISIONS = "NoRouterDecisions"
REASON_STALE = "RouterNotApplied"
REASON_COOLDOWN = "Cooldown"
REASON_AT_FLOOR = "AtFloor"
REASON_AT_PLANNED = "AtPlanned"
REASON_WITHIN_BAND = "WithinBand"
REASON_ITL_HIGH = "ItlOverTarget"
REASON_ITL_LOW = "ItlUnderTargetWithBacklog"


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
    """One change of the effective max batch."""

    at: float
    before: int | None
    after: int
    reason: str
    message: str


@dataclass(frozen=True)
class BatchState:
    """What the loop remembers (``status.adaptiveBatch``)."""

    gear: str | None = None
    planned: int | None = None
    effective: int | None = None
    last_change_at: float | None = None
    history: tuple[Change, ...] = ()


@dataclass(frozen=True)
class BatchStep:
    """One decision: what the effective max batch becomes and why."""

    kind: StepKind
    effective: int
    planned: int
    floor: int
    reason: str
    message: str

    @property
    def changes(self) -> bool:
        return self.kind in ("Lower", "Raise", "Reset")


def floor_of(planned: int, micro_batch: int = 1) -> int:
    """The least effective max batch (module docstring), never above ``planned``."""
    return min(planned, max(1, micro_batch, math.ceil(planned * FLOOR_FRACTION)))


def lowered(effective: int, floor: int) -> int:
    """Seed 000's × 0.9, at least one lower, not below ``floor``."""
    return max(floor, min(effective - 1, int(effective * SHRINK_FACTOR)))


def raised(effective: int, planned: int) -> int:
    """Seed 000's × 1.1, at least one higher, not above ``planned``."""
    return min(planned, max(effective + 1, int(effective * GROW_FACTOR)))


def per_router_cap(effective: int, routers: int) -> int:
    """Requests one of ``routers`` router replicas keeps on a pod at once."""
    return max(1, effective // max(1, routers))


def _top(votes: Sequence[Vote]) -> str:
    v = votes[0]
    more = f" (+{len(votes) - 1} more)" if len(votes) > 1 else ""
    return f"router {v.router} for pod {v.pod}: {v.reason}{more}"


def decide(
    state: BatchState,
    *,
    gear: str,
    planned: int,
    micro_batch: int,
    votes: Iterable[Vote],
    now: float,
    shift_in_flight: bool,
    routers: int = 1,
    enabled: bool = True,
    cooldown_s: float = COOLDOWN_S,
) -> BatchStep:
    """The step for the active ``gear`` whose engines run ``planned`` (its ``maxBatch``) at most."""
    floor = floor_of(planned, micro_batch)
    eff = state.effective

    def step(kind: StepKind, value: int, reason: str, message: str) -> BatchStep:
        return BatchStep(kind, value, planned, floor, reason, message)

    if shift_in_flight:
        # Nothing changes while the serving pods are about to: not even a reset to the new gear.
        keep = eff if eff is not None and state.gear == gear else planned
        return step("Hold", keep, REASON_SHIFT, "a gear shift is in flight: the max batch waits for it")
    if not enabled:
        if eff == planned and state.gear == gear and state.planned == planned:
            return step("Hold", planned, REASON_DISABLED, "adaptive batch is off for this GearSet")
        return step(
            "Reset", planned, REASON_DISABLED, f"adaptive batch is off: back to the planned {planned}"
        )
    if eff is None or state.gear is None:
        return step(
            "Reset", planned, REASON_INITIAL, f"gear {gear} starts at its planned max batch {planned}"
        )
    if state.gear != gear:
        return step(
            "Reset", planned, REASON_GEAR_CHANGED, f"gear {gear} is active: its planned max batch {planned}"
        )
    if state.planned != planned:
        return step(
            "Reset", planned, REASON_PLAN_CHANGED, f"gear {gear}'s maxBatch is now {planned}: starting there"
        )
    expected = per_router_cap(eff, routers)
    votes = list(votes)
    if not votes:
        return step("Hold", eff, REASON_NO_DECISIONS, "no router published a decision for the gear's pods")
    fresh = [v for v in votes if v.current == expected]
    if not fresh:
        v = votes[0]
        return step(
            "Hold",
            eff,
            REASON_STALE,
            f"router {v.router} reports max batch {v.current} for pod {v.pod}, not the cap {expected} "
            "written (it has not read the annotation yet)",
        )
    down = [v for v in fresh if v.direction < 0]
    up = [v for v in fresh if v.direction > 0]
    cooling = state.last_change_at is not None and now - state.last_change_at < cooldown_s
    if down:
        if eff <= floor:
            return step("Hold", eff, REASON_AT_FLOOR, f"at the floor {floor}; {_top(down)}")
        if cooling:
            return step("Hold", eff, REASON_COOLDOWN, f"changed less than {cooldown_s:g} s ago; {_top(down)}")
        new = lowered(eff, floor)
        return step("Lower", new, REASON_ITL_HIGH, f"max batch {eff} → {new}: {_top(down)}")
    if up:
        if eff >= planned:
            return step("Hold", eff, REASON_AT_PLANNED, f"at the planned {planned} (the engine's own limit)")
        if cooling:
            return step("Hold", eff, REASON_COOLDOWN, f"changed less than {cooldown_s:g} s ago; {_top(up)}")
        new = raised(eff, planned)
        return step("Raise", new, REASON_ITL_LOW, f"max batch {eff} → {new}: {_top(up)}")
    return step("Hold", eff, REASON_WITHIN_BAND, f"max batch {eff}: every router's ITL is within band")


def advance(state: BatchState, step: BatchStep, gear: str, now: float) -> BatchState:
    """The state after ``step``: a change is recorded (time, from, to, why); a hold keeps the memory."""
    if not step.changes:
        return replace(state, gear=gear if state.gear is None else state.gear)
    before = state.effective if state.gear == gear else None
    if before == step.effective and state.gear == gear and state.planned == step.planned:
        return state
    change = Change(now, before, step.effective, step.reason, step.message)
    return BatchState(
        gear=gear,
        planned=step.planned,
        effective=step.effective,
        last_change_at=now,
        history=(*state.history, change)[-MAX_CHANGES:],
    )


def condition(step: BatchStep, state: BatchState) -> tuple[str, str, str]:
    """The ``BatchAdapted`` condition: True while the router caps the gear below its planned max batch."""
    eff = state.effective if state.effective is not None else step.effective
    if step.reason == REASON_DISABLED:
        return ("False", REASON_DISABLED, "adaptive batch is off (annotation gearshift.io/adaptive-batch)")
    last = state.history[-1] if state.history else None
    why = f" since {last.reason}: {last.message}" if last is not None else ""
    if eff < step.planned:
        return ("True", last.reason if last else REASON_ITL_HIGH, f"max batch {eff} of {step.planned}{why}")
    return ("False", REASON_AT_PLANNED, f"max batch {eff}: the planned {step.planned}{why}")


def event(step: BatchStep, before: int | None) -> tuple[str, str, bool] | None:
    """The event a changing step records: (reason, message, warning); none for a hold, or for the first
    sight of a gear (nothing changed: its engines run the planned max batch already)."""
    if step.kind == "Lower":
        return ("MaxBatchLowered", step.message, False)
    if step.kind == "Raise":
        return ("MaxBatchRaised", step.message, False)
    if step.kind == "Reset" and before != step.effective and step.reason != REASON_INITIAL:
        return ("MaxBatchReset", step.message, False)
    return None


# --- status ------------------------------------------------------------------------------------------
def state_from_status(st: AdaptiveBatchStatus | None) -> BatchState:
    """The loop's memory from ``status.adaptiveBatch`` (none: a fresh start)."""
    if st is None:
        return BatchState()
    return BatchState(
        gear=st.gear,
        planned=st.planned,
        effective=st.effective,
        last_change_at=from_time(st.last_change_time),
        history=tuple(
            Change(from_time(c.time) or 0.0, c.from_value, c.to_value, c.reason, c.message)
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
        "lastDecision": step.kind,
        "lastReason": step.reason,
        "lastMessage": step.message[:1024],
        "lastDecisionTime": to_time(now),
        "lastChangeTime": to_time(state.last_change_at),
        "history": [
            {
                "time": to_time(c.at),
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
