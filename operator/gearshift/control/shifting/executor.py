"""The shift executor: a pure next-step function over a persisted state (FlexPipe's "Executor",
docs/sources.md#shift-executor).

Phases (``GearSet.status.phase``)::

    Stable ──request──▶ Warming ──Ready and warm──▶ Draining ──old in-flight 0 or timeout──▶ Switching
      ▲   (or Degraded when memory is short:                                                     │
      │    weights first, KV pool after the switch)                                              │
      ├──────────────── rollback window passed: old gear deleted ◀───────────────────────────────┘
      └── RollingBack ◀── new gear failed: OOM/crash loop, not Ready and warm in time, P99 regression

- ``Warming``: the target gear's StatefulSets run as *shadows*; the role Service still selects the old
  gear, so no client request reaches them. They warm on mirrored traffic (docs/sources.md#shift-executor):
  while the phase is ``Warming`` the shifting loop marks their head pods (:mod:`gearshift.k8s.warming`) and
  the router sends them copies of live requests, answers dropped, at most ``warmupShare`` of the gear's
  predicted throughput (:mod:`gearshift.router.mirror`). It moves on once every target pod has been Ready
  for ``warmSeconds``; after ``warmupTimeoutSeconds`` it rolls back.
- ``Draining``: the role Service selects the new gear, the old gear takes no new requests; wait for its
  in-flight requests to reach 0 (or ``drainTimeoutSeconds``).
- ``Switching``: the old gear is kept ``rollbackWindowSeconds``; the new gear failing, or its measured
  P99 above ``rollbackP99Ratio`` × max(the old gear's measured P99 when the shift started, ``targetP99Ms``),
  rolls back. (Not the planner's predicted P99: the planner predicts for its own request shape, e.g. a
  pipeline latency of 512-token requests, which is no TTFT of the traffic being served; judging by it
  rolled healthy shifts back. The old gear's measured P99 is the real alternative: the shift is a
  regression only if the new gear does much worse than the gear it replaced, and never while it meets
  the SLO with margin.) Except for a ``saturation`` (capacity) shift while the new gear serves at least
  the completions/s the old gear served when the shift was decided: under overload every gear's queue
  and P99 keep growing, so a P99 measured later on the new gear is no fair comparison with one measured
  earlier on the old, and serving more requests/s is what relieves the saturation. Such a shift still
  rolls back on failure, and on P99 when it also serves less (or either rate is unknown).
- ``RollingBack``: the failed gear is marked unhealthy with the reason; the role Service returns to the
  old gear (once it is Ready), *then* the failed gear drains like the old one in ``Draining`` (in-flight
  requests to 0 or ``drainTimeoutSeconds`` after the Service moved back), and only then is it deleted.
  Deleting it at once would fail every request on it.

The step is *level-triggered*: each call compares the persisted state with the observed world and
re-emits whatever is still missing (a gear to create, a selector to set), so an operator restart between
persisting the state and applying its actions, or in the middle of any phase, resumes. One invariant
holds at every step: the role Service is only ever pointed at a gear whose pods are Ready, and the gear it
selects is never deleted.
The step never reads the clock (``World.now``) and returns declarative actions
(:mod:`gearshift.control.shifting.executor_actions`) that the handler applies in order; its state goes to and
from ``GearSet.status`` through :mod:`gearshift.control.shifting.executor_status`, and
:func:`gearshift.control.shifting.executor_sim.simulate_steps` runs it over a scripted world until it is
Stable and idle.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum

from gearshift.control.shifting.executor_actions import (
    Action,
    DeleteGear,
    EnsureGear,
    Event,
    MarkUnhealthy,
    Outcome,
    RecordShift,
    SelectGear,
)
from gearshift.control.shifting.policy import ShiftRules
from gearshift.control.shifting.triggers import Trigger
from gearshift.control.signals import MIN_WINDOW_S


class Phase(StrEnum):
    """Executor phases; the values are ``GearSet.status.phase``'s."""

    STABLE = "Stable"
    WARMING = "Warming"
    DRAINING = "Draining"
    SWITCHING = "Switching"
    ROLLING_BACK = "RollingBack"
    DEGRADED = "Degraded"


# --- the executor's event reasons (their one place; gearshift.api.common has the other reasons) ---
EVENT_SHIFT_STARTED = "ShiftStarted"
EVENT_SHADOW_READY = "ShadowReady"
EVENT_DRAIN_STARTED = "DrainStarted"
EVENT_DRAIN_TIMEOUT = "DrainTimeout"
EVENT_SWITCHED = "Switched"
EVENT_SHIFT_COMPLETED = "ShiftCompleted"
EVENT_ROLLED_BACK = "RolledBack"
EVENT_GEAR_UNHEALTHY = "GearUnhealthy"
EVENT_SHIFT_REFUSED = "ShiftRefused"
EVENT_SHIFT_CANCELLED = "ShiftCancelled"
EVENT_GEAR_MISSING = "GearMissing"

# --- why a gear is marked unhealthy --------------------------------------------------------------
FAIL_NOT_READY = "NotReadyInTime"
FAIL_P99 = "P99Regression"


# --- observed world ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class GearObservation:
    """What the handler saw of one gear's pods (all stages, all replicas)."""

    exists: bool = True
    """Its StatefulSets exist."""
    ready: bool = False
    """Every pod of every stage is Ready."""
    ready_since: float | None = None
    """Since when all have been Ready, s (the latest pod Ready condition's lastTransitionTime)."""
    in_flight: int = 0
    """Requests running or waiting on its head pods."""
    failure: str | None = None
    """A failure seen on its pods: ``OOMKilled``, ``CrashLoopBackOff``, ``Unschedulable``."""
    failure_message: str = ""
    """What more is known of ``failure`` (the scheduler's message for ``Unschedulable``), or ``""``."""
    p99_ms: float | None = None
    """Its measured P99 (the policy's latency metric), ms."""
    qps: float | None = None
    """Its measured served rate: completed requests/s (``Sample.qps``); ``None`` when not sampled."""
    kv_pool: bool = True
    """Its KV-cache pool is allocated in full."""


@dataclass(frozen=True)
class World:
    """The observed world at one step."""

    now: float
    """Current time, s."""
    gears: Mapping[str, GearObservation]
    """Gears whose objects exist (a missing name means no objects)."""
    selected: str | None
    """The gear the role Service selects now."""
    full_shadow_fits: bool = True
    """Free GPU memory holds the target gear's weights *and* KV pool beside the serving gear."""

    def gear(self, name: str | None) -> GearObservation:
        """The observation of ``name``; a gear without objects reads as not existing."""
        return self.gears.get(name or "", _ABSENT)

    def ready(self, name: str | None) -> bool:
        obs = self.gear(name)
        return obs.exists and obs.ready and obs.failure is None


_ABSENT = GearObservation(exists=False)


@dataclass(frozen=True)
class ShiftRequest:
    """A shift the decision asked for (``Decision.target``/``trigger``) with the target's predicted P99."""

    target: str
    trigger: str
    predicted_p99_ms: float | None = None
    baseline_p99_ms: float | None = None
    """The active gear's measured (smoothed) P99 when the shift was decided, ms (``Decision.p99_ms``)."""
    baseline_qps: float | None = None
    """The active gear's measured (smoothed) served rate when the shift was decided, completed requests/s
    (``Decision.qps``)."""
    why: str = ""
    """What the decision read (rate, token mix, P99, capacities): the ShiftStarted event says it."""


# --- persisted state ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShiftState:
    """The executor's state in ``GearSet.status.executor``; times in s. Plain data: its codec is
    :mod:`gearshift.control.shifting.executor_status`."""

    active: str
    """The gear that serves (or, mid-shift, the one traffic returns to on a rollback)."""
    phase: Phase = Phase.STABLE
    from_gear: str | None = None
    to_gear: str | None = None
    trigger: str | None = None
    started_at: float | None = None
    step_started_at: float | None = None
    deadline: float | None = None
    """When the current phase times out (Warming, Draining) or ends (Switching)."""
    degraded: bool = False
    predicted_p99_ms: float | None = None
    """The target gear's predicted P99 (informational; the rollback check does not use it)."""
    baseline_p99_ms: float | None = None
    """The old gear's measured P99 when the shift started, ms: the rollback check's yardstick."""
    baseline_qps: float | None = None
    """The old gear's served rate when the shift started, completed requests/s: a ``saturation`` shift's
    new gear serving at least this much is not rolled back on P99."""
    failure: str | None = None
    """Why a rollback happens."""
    failure_message: str = ""
    paused_at: float | None = None

    @property
    def busy(self) -> bool:
        """A shift is in progress."""
        return self.phase is not Phase.STABLE


# --- the step ----------------------------------------------------------------------------------------
def step(
    state: ShiftState,
    world: World,
    policy: ShiftRules,
    *,
    request: ShiftRequest | None = None,
    paused: bool = False,
    cancel: str | None = None,
) -> tuple[ShiftState, list[Action]]:
    """One executor step: the next state and the actions to apply, in order.

    Args:
        state: the persisted state.
        world: what the handler observed just now.
        policy: the shifting policy (timeouts, warm-up share, rollback ratio).
        request: a shift the decision asked for; used only when Stable, ignored otherwise.
        paused: ``spec.paused``: a shift in progress holds where it is (its deadlines are extended by the
            time spent paused), and no new shift starts.
        cancel: why the shift in progress is no longer wanted (a reverted ``spec.forceGear``). Honoured
            only while ``Warming``/``Degraded``: the old gear still serves and the shadow has taken no
            traffic, so the shadow is deleted and the state is Stable on the old gear again (outcome
            ``Aborted``). From ``Draining`` on the new gear serves: the shift finishes, and a new
            decision may shift back (undoing a switch is itself a shift).

    Returns:
        ``(new_state, actions)``; no actions means nothing to do until the world changes.
    """
    now = world.now
    if paused:
        return (state if state.paused_at is not None else replace(state, paused_at=now)), []
    if state.paused_at is not None:
        held = now - state.paused_at
        state = replace(
            state, paused_at=None, deadline=None if state.deadline is None else state.deadline + held
        )
    if cancel is not None and state.phase in (Phase.WARMING, Phase.DEGRADED):
        return _cancel(state, world, cancel)
    match state.phase:
        case Phase.STABLE:
            return _stable(state, world, policy, request)
        case Phase.WARMING | Phase.DEGRADED:
            return _warming(state, world, policy)
        case Phase.DRAINING:
            return _draining(state, world, policy)
        case Phase.SWITCHING:
            return _switching(state, world, policy)
        case Phase.ROLLING_BACK:
            return _rolling_back(state, world, policy)


def draining_gear(state: ShiftState) -> str | None:
    """The gear whose in-flight requests the step waits on: the old gear while ``Draining``, the failed
    gear while ``RollingBack``; ``None`` otherwise (the handler asks Prometheus only for this one)."""
    if state.phase is Phase.DRAINING:
        return state.from_gear
    if state.phase is Phase.ROLLING_BACK:
        return state.to_gear
    return None


def rollback_p99_limit(state: ShiftState, policy: ShiftRules) -> float:
    """The P99 above which the new gear rolls back, ms: ``rollbackP99Ratio`` × max(the old gear's measured
    P99 at the shift's start, ``targetP99Ms``)."""
    return policy.rollback_p99_ratio * max(state.baseline_p99_ms or 0.0, policy.target_p99_ms)


#: Shifts made for capacity: the served rate, not the P99, says whether they help.
CAPACITY_SHIFTS = (Trigger.SATURATION.value, Trigger.LOAD_HIGH.value)


def relieves_saturation(state: ShiftState, obs: GearObservation) -> bool:
    """A capacity shift (``saturation`` or ``load-high``) whose new gear serves at least the completions/s
    the old gear served at the decision: its P99 does not roll it back (under overload the P99 grows on
    any gear, and the new gear first works off the queue it inherits; the served rate says whether the
    shift helps). False for other triggers and when either rate is unknown."""
    return (
        state.trigger in CAPACITY_SHIFTS
        and state.baseline_qps is not None
        and obs.qps is not None
        and obs.qps >= state.baseline_qps
    )


def shift_started_message(trigger: str, active: str, target: str, degraded: bool, why: str = "") -> str:
    """The ``ShiftStarted`` event's text, in plain words: why (``why``: what the decision read), which gear
    is started beside which, and whether its pods get their KV-cache pool now (full) or only weights
    (degraded: free GPU memory is short, so the pool is grown after the switch, when the old gear's
    memory is freed)."""
    because = f" ({why})" if why else ""
    head = (
        f"{trigger}{because}: shifting from gear {active!r} to {target!r}: starting shadow pods of every "
        f"stage of gear {target!r} beside the active gear {active!r}"
    )
    if degraded:
        return (
            f"{head}, with model weights only (not enough free GPU memory for their KV-cache pool as well; "
            f"it is allocated after the switch); {active!r} keeps serving until they are Ready and warm"
        )
    return f"{head}, with weights and KV-cache pool; {active!r} keeps serving until they are Ready and warm"


def _stable(
    state: ShiftState, world: World, policy: ShiftRules, request: ShiftRequest | None
) -> tuple[ShiftState, list[Action]]:
    now, active = world.now, state.active
    actions: list[Action] = []
    if not world.gear(active).exists:
        actions.append(EnsureGear(active))
    if world.selected != active and world.ready(active):
        actions.append(SelectGear(active))
    serving = active if world.ready(active) else world.selected
    # Leftovers of an interrupted shift; the gear the Service still selects stays until another is Ready.
    actions += [DeleteGear(g) for g in sorted(world.gears) if g != active and g != serving]
    if request is None or request.target == active:
        return state, actions
    if not world.ready(active):
        return state, [
            *actions,
            Event(
                EVENT_SHIFT_REFUSED, f"shift to {request.target!r} waits: gear {active!r} is not Ready", True
            ),
        ]
    degraded = not world.full_shadow_fits
    if degraded and not policy.allow_degraded:
        message = f"not enough free GPU memory for shadows of {request.target!r} and allowDegraded is false"
        return state, [
            *actions,
            Event(EVENT_SHIFT_REFUSED, message, True),
            RecordShift(active, request.target, request.trigger, now, Outcome.FAILED, now, message),
        ]
    new = replace(
        state,
        phase=Phase.DEGRADED if degraded else Phase.WARMING,
        from_gear=active,
        to_gear=request.target,
        trigger=request.trigger,
        started_at=now,
        step_started_at=now,
        deadline=now + policy.warmup_timeout_s,
        degraded=degraded,
        predicted_p99_ms=request.predicted_p99_ms,
        baseline_p99_ms=(
            request.baseline_p99_ms if request.baseline_p99_ms is not None else world.gear(active).p99_ms
        ),
        baseline_qps=request.baseline_qps if request.baseline_qps is not None else world.gear(active).qps,
        failure=None,
        failure_message="",
    )
    return new, [
        *actions,
        EnsureGear(request.target, shadow=True, kv_pool=not degraded),
        Event(
            EVENT_SHIFT_STARTED,
            shift_started_message(request.trigger, active, request.target, degraded, request.why),
        ),
        RecordShift(active, request.target, request.trigger, now, Outcome.IN_PROGRESS),
    ]


def _cancel(state: ShiftState, world: World, why: str) -> tuple[ShiftState, list[Action]]:
    target, old = state.to_gear, state.from_gear
    assert target is not None and old is not None and state.trigger is not None
    assert state.started_at is not None
    message = f"{old!r} → {target!r} cancelled while {target!r} warmed: {why}"
    actions: list[Action] = [] if world.selected == old else [SelectGear(old)]
    return ShiftState(active=old), [
        *actions,
        DeleteGear(target),
        Event(EVENT_SHIFT_CANCELLED, message),
        RecordShift(old, target, state.trigger, state.started_at, Outcome.ABORTED, world.now, message),
    ]


def _warming(state: ShiftState, world: World, policy: ShiftRules) -> tuple[ShiftState, list[Action]]:
    now, target = world.now, state.to_gear
    assert target is not None and state.from_gear is not None
    obs = world.gear(target)
    if obs.failure:
        detail = f" ({obs.failure_message})" if obs.failure_message else ""
        return _begin_rollback(
            state, world, policy, obs.failure, f"gear {target!r} failed while warming: {obs.failure}{detail}"
        )
    warm = world.ready(target) and obs.ready_since is not None and now - obs.ready_since >= policy.warm_s
    if warm:
        new = replace(state, phase=Phase.DRAINING, step_started_at=now, deadline=now + policy.drain_timeout_s)
        return new, [
            EnsureGear(target, shadow=False, kv_pool=not state.degraded),
            Event(EVENT_SHADOW_READY, f"gear {target!r} is Ready and warm"),
            SelectGear(target),
            Event(EVENT_DRAIN_STARTED, f"the role Service selects {target!r}; draining {state.from_gear!r}"),
        ]
    if state.deadline is not None and now >= state.deadline:
        return _begin_rollback(
            state,
            world,
            policy,
            FAIL_NOT_READY,
            f"gear {target!r} was not Ready and warm {policy.warmup_timeout_s:g} s after the shift started",
        )
    actions: list[Action] = []
    if not obs.exists:
        actions.append(EnsureGear(target, shadow=True, kv_pool=not state.degraded))
    if world.selected != state.from_gear and world.ready(state.from_gear):
        actions.append(SelectGear(state.from_gear))
    return state, actions


def _draining(state: ShiftState, world: World, policy: ShiftRules) -> tuple[ShiftState, list[Action]]:
    now, target, old = world.now, state.to_gear, state.from_gear
    assert target is not None and old is not None
    if not world.ready(target):
        reason = world.gear(target).failure or FAIL_NOT_READY
        return _begin_rollback(
            state, world, policy, reason, f"gear {target!r} stopped being Ready while draining"
        )
    actions: list[Action] = [] if world.selected == target else [SelectGear(target)]
    in_flight = world.gear(old).in_flight if world.gear(old).exists else 0
    timed_out = state.deadline is not None and now >= state.deadline
    if in_flight > 0 and not timed_out:
        return state, actions
    if in_flight > 0:
        actions.append(
            Event(
                EVENT_DRAIN_TIMEOUT,
                f"{in_flight} requests still in flight on {old!r} after {policy.drain_timeout_s:g} s",
                True,
            )
        )
    if state.degraded:
        actions.append(EnsureGear(target, shadow=False, kv_pool=True))
    actions.append(Event(EVENT_SWITCHED, f"traffic is on {target!r}; {old!r} kept for rollback"))
    return replace(
        state, phase=Phase.SWITCHING, step_started_at=now, deadline=now + policy.rollback_window_s
    ), actions


def judged_since(state: ShiftState, policy: ShiftRules) -> float | None:
    """Switching: from when the new gear's P99 is measured for the rollback check, s: halfway through the
    rollback window. The first half is an initial delay, as Argo Rollouts' analysis ``initialDelay``: it
    holds the switch's transient (the drain shared the cards with the old gear, and requests queued
    then are still being served), which any gear shows and which says nothing about the gear. The check
    itself starts once a sample's window (:func:`gearshift.control.signals.sample_window`, at least
    ``MIN_WINDOW_S``) fits after that point. ``None`` outside Switching."""
    if state.phase is not Phase.SWITCHING or state.step_started_at is None:
        return None
    return state.step_started_at + policy.rollback_window_s / 2


def _switching(state: ShiftState, world: World, policy: ShiftRules) -> tuple[ShiftState, list[Action]]:
    now, target, old = world.now, state.to_gear, state.from_gear
    assert target is not None and old is not None
    obs = world.gear(target)
    if not world.ready(target):
        reason = obs.failure or FAIL_NOT_READY
        return _begin_rollback(
            state, world, policy, reason, f"gear {target!r} failed after the switch: {reason}"
        )
    limit = rollback_p99_limit(state, policy)
    since = judged_since(state, policy)
    settled = since is None or now - since >= MIN_WINDOW_S
    if settled and obs.p99_ms is not None and obs.p99_ms > limit and not relieves_saturation(state, obs):
        before = "unknown" if state.baseline_p99_ms is None else f"{state.baseline_p99_ms:.0f} ms"
        served = ""
        if state.trigger in CAPACITY_SHIFTS:
            now_qps = "unknown" if obs.qps is None else f"{obs.qps:.2f}"
            then_qps = "unknown" if state.baseline_qps is None else f"{state.baseline_qps:.2f}"
            served = f", serving {now_qps} req/s vs {old!r}'s {then_qps} before the shift"
        return _begin_rollback(
            state,
            world,
            policy,
            FAIL_P99,
            f"gear {target!r} P99 {obs.p99_ms:.0f} ms > {policy.rollback_p99_ratio:g} × max({old!r} before "
            f"the shift {before}, target {policy.target_p99_ms:g} ms) = {limit:.0f} ms{served}",
        )
    actions: list[Action] = [] if world.selected == target else [SelectGear(target)]
    if state.degraded and not obs.kv_pool:
        actions.append(EnsureGear(target, shadow=False, kv_pool=True))
    if state.deadline is not None and now < state.deadline:
        return state, actions
    assert state.trigger is not None and state.started_at is not None
    message = f"{old!r} → {target!r} in {now - state.started_at:.0f} s"
    done = ShiftState(active=target)
    return done, [
        *actions,
        DeleteGear(old),
        Event(EVENT_SHIFT_COMPLETED, message),
        RecordShift(old, target, state.trigger, state.started_at, Outcome.SUCCEEDED, now, message),
    ]


def _begin_rollback(
    state: ShiftState, world: World, policy: ShiftRules, reason: str, message: str
) -> tuple[ShiftState, list[Action]]:
    assert state.to_gear is not None
    new = replace(
        state,
        phase=Phase.ROLLING_BACK,
        step_started_at=world.now,
        deadline=None,
        failure=reason,
        failure_message=message,
    )
    marks: list[Action] = [
        MarkUnhealthy(state.to_gear, reason, message),
        Event(EVENT_GEAR_UNHEALTHY, message, True),
    ]
    following, actions = _rolling_back(new, world, policy)
    return following, marks + actions


def _rolling_back(state: ShiftState, world: World, policy: ShiftRules) -> tuple[ShiftState, list[Action]]:
    """Old gear Ready → select it (the drain deadline starts), then wait until the failed gear holds no
    requests (or the deadline) with the Service on the old gear, then delete the failed gear.

    ``deadline`` is ``None`` until the step that selects the old gear: the drain is counted from there.
    """
    now, target, old = world.now, state.to_gear, state.from_gear
    assert target is not None and old is not None
    if not world.ready(old):
        # Traffic stays where it is until the old gear can take it back.
        missing: list[Action] = [] if world.gear(old).exists else [EnsureGear(old)]
        return state, missing
    failed = world.gear(target)
    if state.deadline is None:
        # The step that moves traffic back: the drain counts from here.
        moved = replace(state, step_started_at=now, deadline=now + policy.drain_timeout_s)
        actions: list[Action] = [] if world.selected == old else [SelectGear(old)]
        if failed.exists:
            actions.append(
                Event(EVENT_DRAIN_STARTED, f"the role Service selects {old!r} again; draining {target!r}")
            )
            return moved, actions
        return _rolled_back(moved, world, actions)
    if world.selected != old:
        # Level-triggered: re-point the Service; the failed gear's count means nothing until it is.
        return state, [SelectGear(old)]
    in_flight = failed.in_flight if failed.exists else 0
    if in_flight > 0 and now < state.deadline:
        return state, []
    actions = []
    if in_flight > 0:
        actions.append(
            Event(
                EVENT_DRAIN_TIMEOUT,
                f"{in_flight} requests still in flight on {target!r} after {policy.drain_timeout_s:g} s",
                True,
            )
        )
    return _rolled_back(state, world, actions)


def _rolled_back(state: ShiftState, world: World, actions: list[Action]) -> tuple[ShiftState, list[Action]]:
    """Delete the drained failed gear and record the rollback: back to Stable on the old gear."""
    now, target, old = world.now, state.to_gear, state.from_gear
    assert target is not None and old is not None
    assert state.trigger is not None and state.started_at is not None
    if world.gear(target).exists:
        actions = [*actions, DeleteGear(target)]
    message = f"back on {old!r}: {state.failure_message or state.failure}"
    return ShiftState(active=old), [
        *actions,
        Event(EVENT_ROLLED_BACK, message, True),
        RecordShift(old, target, state.trigger, state.started_at, Outcome.ROLLED_BACK, now, message),
    ]
