"""The gear-shifting loop: per GearSet, every ``spec.policy.sampleIntervalS``, signals → decision → executor.

One tick (:func:`tick`, synchronous, over :class:`~gearshift.adapters.kube.KubeApi`):

1. read the GearSet and its PDService fresh; skip until the reconciler has set ``status.activeGear``;
2. observe the role's world: StatefulSets and pods per gear (Ready, Ready since, OOM/crash loops), the
   gear the role Service ``<pds>-<role>`` selects, whether free GPUs hold a full shadow of another gear;
3. fetch one sample of the serving gear from Prometheus (``PDService.spec.prometheusUrl``, else the
   operator's ``--prometheus-url``) with the queries of the PDService's ``spec.engine``
   (:func:`gearshift.control.signals.signal_queries`): the sim exports per-stage utilisation, for vLLM
   it is derived from the head's metrics and the gear's ``predictedTimeMs``
   (:func:`gearshift.control.signals.derived_stage_utilization`); during ``Draining`` also the old
   gear's in-flight requests, during ``RollingBack`` the failed gear's
   (:func:`~gearshift.control.shifting.executor.draining_gear`). No Prometheus, an error or a missing series →
   ``SignalsAvailable=False`` and the decision holds (no shift starts; a shift already running still
   finishes, its steps need no signals). A vLLM sample without derivable stage utilisation (a
   multi-stage gear without stage times, or no completions yet) is still a sample:
   ``SignalsAvailable=True`` with reason ``StageBalanceUnavailable`` and the imbalance trigger off. A
   sample whose latency quantiles or arrival rate have no value while requests flow is one too, but
   ``SignalsAvailable=False`` (``LatencyUnavailable`` / ``SeriesMissing``, naming each series, one
   Warning event) and the triggers that read them hold (missing is never fine);
4. :func:`gearshift.control.shifting.decide.decide` → :func:`gearshift.control.shifting.adapt.shift_request` →
   :func:`gearshift.control.shifting.executor.step`; when the active gear holds stages on a time-limited node
   the reconciler reports past its leaveBy (``status.windowedNodes`` ``Leaving``),
   :func:`gearshift.control.shifting.tick.window_request` replaces the decision's request with a shift
   (trigger ``window``) to the reconciler's window-free replacement, signals or not;
5. persist the new executor and decision state, smoothed signals, history, gear health and the
   condition in ``GearSet.status`` (under the reconciler's per-service lock, so a concurrent reconcile
   sees either the old or the new executor step, never a half), *then* apply the actions through the
   reconciler's :func:`~gearshift.handlers.reconcile.ensure_gear_sync`, ``select_gear_sync`` and
   ``delete_gear_sync`` and record events. An action type the tick does not know fails the tick before
   anything is written (:func:`gearshift.control.shifting.tick.api_operations`);
6. mark the head pods of a ``Warming`` shadow for the router's mirrored warm-up traffic and unmark every
   other pod of the role (:func:`_mark_warming`, :mod:`gearshift.k8s.warming`).

What is decided in a tick is pure code: the observation, the shadow check, the request, the condition,
the events and the mapping of actions to API operations in :mod:`gearshift.control.shifting.tick`, the status
patch in :mod:`gearshift.control.shifting.shift_status`; this module reads, calls them, writes and records.

Persisting before acting is what makes a restart safe: the executor step is level-triggered and re-emits
whatever the world still lacks (a gear to create, a selector to set, a leftover to delete), so an
operator killed between the two steps, or anywhere in a phase, resumes from ``status``.

Times: the loop passes wall-clock seconds (``time.time()``) as ``now`` because the state outlives the
process; status stores them as RFC 3339 times.

The kopf side is a *daemon* per GearSet rather than a ``kopf.timer``: a timer's interval is fixed when it
is registered, while ``spec.policy.sampleIntervalS`` is per object and may be edited; the daemon re-reads
it every turn. Both need kopf's finalizer on the GearSet.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, assert_never

import kopf

from gearshift.adapters import metrics
from gearshift.adapters.kube import GS, NODE, POD, STS, SVC, KubeApi, KubeApiError
from gearshift.adapters.memory import GearSetMemory
from gearshift.adapters.signals import SignalSource
from gearshift.api.common import GROUP, REASON_WINDOW_NO_TARGET, VERSION
from gearshift.api.gearset import Gear, GearSet
from gearshift.api.gearset_status import GearHealth
from gearshift.api.pdservice import PDService
from gearshift.control.reconcile.settings import Settings
from gearshift.control.reconcile.state import SHIFT_STEPS
from gearshift.control.shifting.adapt import gear_views, gearset_rules
from gearshift.control.shifting.decide import Decision, DecisionKind, DecisionState, Overrides, decide
from gearshift.control.shifting.executor import GearObservation, Phase, ShiftState, World, draining_gear, step
from gearshift.control.shifting.executor_actions import (
    Action,
    DeleteGear,
    EnsureGear,
    Event,
    Outcome,
    RecordShift,
    SelectGear,
)
from gearshift.control.shifting.executor_status import executor_from_status
from gearshift.control.shifting.policy import GearTable, ShiftRules
from gearshift.control.shifting.shift_status import (
    ORPHAN_MESSAGE,
    REASON_SHIFT_ABANDONED,
    Signals,
    close_orphans,
    control_from_status,
    heartbeat_only,
    json_safe,
    records_to_status,
    status_patch,
)
from gearshift.control.shifting.tick import (
    ApiOperation,
    api_operations,
    current_marks,
    decision_event,
    executor_request,
    forced_shift_reverted,
    gears_to_free,
    gpus_by_gear,
    lasting_marks,
    latency_condition,
    observe_gears,
    pipeline_shape,
    selected_gear,
    serving_since,
    shadow_fits,
    shadow_to_check,
    signals_condition,
    statefulsets_by_gear,
)
from gearshift.control.signals import (
    GearSelector,
    Reading,
    SignalsUnavailable,
    sample_window,
    unavailable_series,
)
from gearshift.control.smoothing import Sample
from gearshift.facts.errors import PolicyError
from gearshift.handlers.common import (
    ConditionBook,
    StatusHeld,
    StatusPruned,
    conditions_from,
    emit,
    patch_status,
)
from gearshift.handlers.loop import load_gearset_and_service, sampling_daemon, spec_generation
from gearshift.handlers.reconcile import delete_gear_sync, ensure_gear_sync, select_gear_sync
from gearshift.handlers.runtime import Runtime, runtime_of
from gearshift.k8s import names, warming

log = logging.getLogger(__name__)

PLURAL = "gearsets"
#: The shortest loop period, s, whatever ``sampleIntervalS`` says (keeps a typo from spinning the loop).
MIN_INTERVAL_S = 0.2
#: Seconds before kopf retries a GearSet deletion handler that raised (kopf's default is 60 s).
DELETE_RETRY_S = 5.0


# --- one tick ------------------------------------------------------------------------------------------
@dataclass
class ShiftTick:
    """What one shifting tick did (for logs, metrics and tests)."""

    skipped: str = ""
    """Why nothing was decided (no active gear yet, GearSet gone, ...); empty when it ran."""
    idle: bool = False
    """Nothing to decide until the spec changes or a shift is asked for (scaled to zero; no Prometheus to
    sample and nothing to execute): the loop waits longer (woken by a spec edit or a shift to make)."""
    phase: Phase | None = None
    decision: Decision | None = None
    actions: list[Action] = field(default_factory=list)
    signals_ok: bool = False
    message: str = ""


@dataclass(frozen=True)
class _Inputs:
    """What a tick read of its GearSet and PDService, parsed: the state it steps from."""

    namespace: str
    name: str
    body: dict[str, Any]
    gs: GearSet
    pds: PDService
    policy: ShiftRules
    state: ShiftState
    control: DecisionState
    gears: dict[str, Gear]
    """The spec's gears by name."""
    marks: list[GearHealth]
    """The gear-health marks that still hold (:func:`~gearshift.control.shifting.tick.current_marks`)."""


@dataclass(frozen=True)
class _Seen:
    """What a tick observed of its role: objects per gear, the selected gear, the sample."""

    by_gear: dict[str, list[Mapping[str, Any]]]
    selected: str | None
    url: str | None
    reading: Reading | None
    why: str
    """Why there is no reading (empty when there is one)."""
    in_flight_old: int | None
    """Requests still on the gear being drained; ``None``: unknown, or no drain."""
    observations: dict[str, GearObservation]
    gpus: dict[str, int]
    """GPUs the pods of each spec gear ask for now (:func:`gpus_by_gear`)."""
    pods: list[Mapping[str, Any]] = field(default_factory=list)
    """The role's pods as read this tick (their warm-up marks are set from them)."""

    @property
    def sample(self) -> Sample | None:
        return None if self.reading is None else self.reading.sample


@dataclass(frozen=True)
class _Stepped:
    """The decision's and the executor's outcome of one tick."""

    control: DecisionState
    decision: Decision
    state: ShiftState
    actions: list[Action]
    operations: list[ApiOperation]
    window_warning: str | None


def _load(api: KubeApi, namespace: str, name: str) -> _Inputs | ShiftTick:
    """The tick's inputs, or the :class:`ShiftTick` that skips this turn (a bad policy emits an event)."""
    loaded = load_gearset_and_service(api, namespace, name)
    if isinstance(loaded, str):
        return ShiftTick(skipped=loaded)
    gs_body, gs, pds = loaded
    gears = gs.gears()
    gear_names = [g.name for g in gears]
    st = gs.status
    if not gears or not st.active_gear:
        return ShiftTick(skipped="no active gear yet (the reconciler sets it)")
    if st.active_gear not in gear_names:
        return ShiftTick(skipped=f"active gear {st.active_gear!r} is not among {gear_names}")
    # A shift in flight must run to its end whatever the gear count says now.
    # A window on one of its nodes may call for a vacating shift to a gear the reconciler adds.
    if gs.spec.replicas == 0 and _settled(gs_body):
        return ShiftTick(skipped="scaled to zero: no signals", idle=True)
    try:
        policy = gearset_rules(gs, pds)
    except PolicyError as exc:
        emit(api, gs_body, "InvalidPolicy", str(exc), True)
        return ShiftTick(skipped=str(exc))
    state = executor_from_status(st.active_gear, st.executor)
    control = control_from_status(st.control)
    spec_gears = {g.name: g for g in gears}
    return _Inputs(namespace, name, gs_body, gs, pds, policy, state, control, spec_gears, current_marks(gs))


def _observe(api: KubeApi, t: _Inputs, settings: Settings, signals: SignalSource, now: float) -> _Seen:
    """Read the role's StatefulSets, pods and Service and sample the serving gear (and the drained one's
    in-flight requests) from Prometheus; a failed sample is a reason (``why``), not an error."""
    service, role, ns = t.gs.spec.service_name, t.gs.spec.role, t.namespace
    labels = {names.LABEL_SERVICE: service, names.LABEL_ROLE: role}
    by_gear = statefulsets_by_gear(
        api.list(*STS, ns, {**labels, names.LABEL_COMPONENT: names.COMPONENT_ENGINE})
    )
    pods = api.list(*POD, ns, labels)
    selected = selected_gear(api.get(*SVC, ns, names.role_service_name(service, role)))
    url = t.pds.spec.prometheus_url or settings.prometheus_url
    sample_gear = selected if selected in by_gear else t.state.active
    reading: Reading | None = None
    why = ""
    if not url:
        why = "no Prometheus URL: set PDService spec.prometheusUrl or the operator's --prometheus-url"
    else:
        shape = pipeline_shape(t.gears[sample_gear]) if sample_gear in t.gears else None
        try:
            reading = signals.sample(
                url,
                GearSelector(ns, service, role, sample_gear),
                now,
                engine=t.pds.spec.engine,
                shape=shape,
                window=sample_window(serving_since(t.state, t.policy), now),
            )
        except SignalsUnavailable as exc:
            why = str(exc)
    drained = draining_gear(t.state)
    in_flight_old: int | None = None
    if drained is not None and drained in by_gear and url:
        try:
            in_flight_old = signals.in_flight(url, GearSelector(ns, service, role, drained))
        except SignalsUnavailable as exc:
            log.info("GearSet %s/%s: in-flight requests of %s unknown: %s", ns, t.name, drained, exc)
    observations = observe_gears(
        t.gears,
        by_gear,
        pods,
        drained=drained,
        drained_in_flight=in_flight_old,
        sample=None if reading is None else reading.sample,
        sample_gear=sample_gear,
        metric=t.policy.latency_metric,
        now=now,
    )
    return _Seen(
        by_gear,
        selected,
        url,
        reading,
        why,
        in_flight_old,
        observations,
        gpus_by_gear(t.gears, pods),
        list(pods),
    )


def _step(api: KubeApi, t: _Inputs, seen: _Seen, now: float) -> _Stepped:
    """Decide, then step the executor; lists nodes and pods only when a shift is about to start.

    Raises:
        UnknownActionError: the executor returned an action the tick cannot carry out (before any write).
    """
    gs, state = t.gs, t.state
    views = gear_views(list(t.gears.values()), lasting_marks(t.marks, now, t.policy))
    table = GearTable(views, active=state.active, arch=t.pds.spec.model.to_model_arch())
    t0 = time.perf_counter()
    overrides = Overrides(force_gear=gs.spec.force_gear, paused=gs.spec.paused)
    unavailable = () if seen.reading is None else unavailable_series(seen.reading, t.policy.latency_metric)
    control, decision = decide(
        t.control,
        seen.sample,
        t.policy,
        table,
        now,
        overrides=overrides,
        busy=state.busy,
        unavailable=tuple(unavailable),
        signals_configured=seen.url is not None,
    )
    metrics.DECISION_SECONDS.observe(time.perf_counter() - t0)
    request, window_warning = executor_request(decision, table, gs, state)
    shadow = shadow_to_check(request, state, t.gears, seen.by_gear)
    fits = shadow is None or shadow_fits(shadow, gs.spec.replicas, api.list(*NODE), api.list(*POD))
    world = World(now=now, gears=seen.observations, selected=seen.selected, full_shadow_fits=fits)
    new_state, actions = step(
        state,
        world,
        t.policy,
        request=request,
        paused=gs.spec.paused,
        cancel=forced_shift_reverted(gs, state),
    )
    return _Stepped(control, decision, new_state, actions, api_operations(actions), window_warning)


def _set_conditions(book: ConditionBook, t: _Inputs, seen: _Seen, done: _Stepped) -> tuple[str, ...]:
    """Set the conditions the tick owns (SignalsAvailable, LatencyAttainable) in ``book``; their types."""
    owned = (
        signals_condition(
            url=seen.url,
            engine=t.pds.spec.engine,
            reading=seen.reading,
            metric=t.policy.latency_metric,
            why=seen.why,
        ),
        latency_condition(done.control),
    )
    for c in owned:
        book.set(c.type, c.status, c.reason, c.message, warning=c.warning)
    return tuple(c.type for c in owned)


def _write_status(rt: Runtime, t: _Inputs, seen: _Seen, done: _Stepped, now: float) -> ConditionBook:
    """Persist the tick's states, history, gear health, signals and the SignalsAvailable condition (under
    the reconciler's per-service lock); returns the condition book, whose changes call for events."""
    st, raw = t.gs.status, t.body.get("status") or {}
    gen = t.body["metadata"].get("generation")
    book = ConditionBook(conditions_from([c.to_json() for c in st.conditions]), gen, _now_dt(now))
    mine = _set_conditions(book, t, seen, done)
    history, health = records_to_status(
        raw.get("history") or [],
        raw.get("gearHealth") or [],
        done.actions,
        marks=lasting_marks(t.marks, now, t.policy),  # an expired P99Regression mark leaves the status
        gears=t.gears,
        now=now,
        profiles_hash=st.profiles_hash,
    )
    history, orphans = close_orphans(history, done.state, now)
    _count_shifts(t, done.actions)
    signals = Signals(
        done.control.smoothed,
        seen.sample,
        seen.reading,
        t.gs.spec.replicas,
        at=now,
        skipped=seen.why or None,
        missed_samples=rt.gearsets.missed((t.namespace, t.name)),
    )
    patch = status_patch(
        done.state,
        done.control,
        t.policy,
        in_flight_old=seen.in_flight_old,
        history=history,
        health=health,
        conditions=book.as_json(),
        generation=gen,
        signals=signals,
    )
    if not seen.url and heartbeat_only(raw, json_safe(patch), now):
        return book  # nothing to sample, nothing new (KEP-589); a configured source writes every tick
    with rt.service_locks.hold((t.namespace, t.gs.spec.service_name)):
        patch["conditions"] = _keep_other_conditions(rt.api, t.namespace, t.name, patch["conditions"], mine)
        try:
            patch_status(rt.api, *GS, t.namespace, t.name, json_safe(patch), rt.pruned)
        except StatusHeld:
            raise  # not written: the entries stay open and are closed by a later tick
        except StatusPruned:
            _say_abandoned(rt, t, orphans)  # written, less the pruned fields: the history was kept
            raise
    _say_abandoned(rt, t, orphans)
    return book


def _count_shifts(t: _Inputs, actions: Sequence[Action]) -> None:
    for a in actions:
        if isinstance(a, RecordShift) and a.outcome is not Outcome.IN_PROGRESS:
            metrics.SHIFTS.labels(t.namespace, t.gs.spec.service_name, t.gs.spec.role, a.outcome.value).inc()


def _say_abandoned(rt: Runtime, t: _Inputs, closed: Sequence[Mapping[str, Any]]) -> None:
    """One ``ShiftAbandoned`` Warning event per history entry :func:`close_orphans` closed and the tick
    wrote."""
    for h in closed:
        emit(
            rt.api,
            t.body,
            REASON_SHIFT_ABANDONED,
            f"shift {h.get('from')} -> {h.get('to')} started {h.get('startedAt')}: {ORPHAN_MESSAGE}",
            True,
        )


def _act(rt: Runtime, t: _Inputs, operations: Sequence[ApiOperation]) -> None:
    """Carry out the executor's API operations in order, through the reconciler's builders."""
    service, role = t.gs.spec.service_name, t.gs.spec.role
    for op in operations:
        match op:
            case EnsureGear(gear=g):
                ensure_gear_sync(rt, t.namespace, service, role, g)
            case SelectGear(gear=g):
                select_gear_sync(rt, t.namespace, service, role, g)
            case DeleteGear(gear=g):
                delete_gear_sync(rt, t.namespace, service, role, g)
            case Event(reason=r, message=m, warning=w):
                emit(rt.api, t.body, r, m, w)
            case _:
                assert_never(op)


def _mark_warming(api: KubeApi, t: _Inputs, pods: Sequence[Mapping[str, Any]], state: ShiftState) -> None:
    """Label the head pods of the gear ``Warming`` now for mirrored warm-up traffic, with their mirrored
    requests/s (:func:`gearshift.k8s.warming.gear_mirror_rps` of ``warmupShare``), and unmark every other
    pod of the role (:mod:`gearshift.k8s.warming` says why on the pods, not in their template). After the
    actions: the tick that switches to the shadow has just pointed the role Service at it, and the router
    mirrors to no pod it routes to, so the unmarking that follows loses nothing."""
    gear = state.to_gear if state.phase is Phase.WARMING else None
    mirror_rps = warming.gear_mirror_rps(
        t.policy.warmup_share,
        t.gears.get(gear) if gear else None,
        t.pds.spec.engine,
        t.pds.spec.router.replicas,
    )
    for pod, patch in warming.warming_mark_patches(pods, gear, mirror_rps):
        try:
            api.patch("v1", "Pod", t.namespace, pod, patch)
        except KubeApiError as exc:
            if exc.status != 404:  # a pod gone since the list needs no mark
                raise


def tick(rt: Runtime, namespace: str, name: str, *, now: float, signals: SignalSource) -> ShiftTick:
    """One turn of the shifting loop for GearSet ``namespace/name`` (see the module docstring), with the
    runtime's API and settings, sampling ``signals``.

    Raises:
        KubeApiError: the API server refused a read or write (the loop retries next turn).
        UnknownActionError: the executor returned an action type the tick has no handling for; nothing
            of the step is written (the loop logs it with its traceback).
    """
    api = rt.api
    t = _load(api, namespace, name)
    if isinstance(t, ShiftTick):
        return t
    seen = _observe(api, t, rt.settings, signals, now)
    done = _step(api, t, seen, now)
    book = _write_status(rt, t, seen, done, now)
    # Sample → status lag: ``now`` is when the sample was taken, on the same wall clock.
    metrics.SAMPLE_TO_STATUS_SECONDS.observe(max(0.0, time.time() - now))
    _act(rt, t, done.operations)
    _mark_warming(api, t, seen.pods, done.state)
    metrics.record_gears(namespace, t.gs.spec.service_name, t.gs.spec.role, done.state.active, seen.gpus)
    for reason, message, warning in book.changes:
        emit(api, t.body, reason, message, warning)
    if done.window_warning is not None:
        _once(api, rt.gearsets, t.body, (namespace, name), REASON_WINDOW_NO_TARGET, done.window_warning)
    _decision_event(api, rt.gearsets, t.body, (namespace, name), done.decision)
    return ShiftTick(
        phase=done.state.phase,
        decision=done.decision,
        actions=done.actions,
        signals_ok=seen.reading is not None,
        message=seen.why,
        # Without a Prometheus URL no sample can move the decision: only a spec edit or a shift to make can
        # (the daemon is woken by both, wake_key). 220 GearSets sampling nothing every 2 s starved every
        # forced shift on the 1,008-node fleet (bench/fleet_operator.py).
        idle=seen.url is None and not done.actions and _at_rest(t.body),
    )


def _once(
    api: KubeApi,
    memory: GearSetMemory,
    body: Mapping[str, Any],
    key: tuple[str, str],
    reason: str,
    message: str,
) -> None:
    """Emit a Warning event unless the last window warning of this GearSet had the same message (the loop
    ticks every few s)."""
    if memory.new_window_warning(key, message):
        emit(api, body, reason, message, True)


def _keep_other_conditions(
    api: KubeApi, namespace: str, name: str, conditions: list[dict[str, Any]], mine: tuple[str, ...]
) -> list[dict[str, Any]]:
    """The conditions of the types ``mine`` from ``conditions`` (those the tick sets: SignalsAvailable,
    LatencyAttainable) plus every other condition as stored now.
    The reconciler writes the GearSet's Ready=False ahead of a rollout, and the autoscaler ScalingActive,
    between this tick's read and its write: the tick's copy of those, read before, must not overwrite
    them (it did: Ready=True came back while the StatefulSet rolled, tests/e2e/test_status_truth_e2e.py)."""
    fresh = api.get(*GS, namespace, name) or {}
    others = [c for c in (fresh.get("status") or {}).get("conditions") or [] if c.get("type") not in mine]
    return [c for c in conditions if c.get("type") in mine] + others


def _now_dt(now: float) -> datetime:
    return datetime.fromtimestamp(now, UTC).replace(microsecond=0)


def _decision_event(
    api: KubeApi, memory: GearSetMemory, body: Mapping[str, Any], key: tuple[str, str], decision: Decision
) -> None:
    """The event :func:`~gearshift.control.shifting.tick.decision_event` calls for, given this GearSet's last
    hold reason (remembered in ``memory``: the loop ticks every few s)."""
    previous: str | None = None
    if decision.kind is DecisionKind.HOLD:
        previous = memory.swap_hold(key, decision.reason)
    event = decision_event(decision, previous)
    if event is not None:
        emit(api, body, event.reason, event.message, event.warning)


# --- kopf ----------------------------------------------------------------------------------------------
def run_tick(rt: Runtime, namespace: str, name: str) -> ShiftTick:
    """One tick now, sampling the runtime's signal source (see :func:`tick`)."""
    return tick(rt, namespace, name, now=time.time(), signals=rt.shift_signals)


def _settled(body: Mapping[str, Any]) -> bool:
    """No shift in flight, none forced, no time-limited node to leave: nothing for the executor to do."""
    spec, st = body.get("spec") or {}, body.get("status") or {}
    return (
        (st.get("executor") or {}).get("step") not in SHIFT_STEPS
        and not spec.get("forceGear")
        and not st.get("windowedNodes")
    )


def _at_rest(body: Mapping[str, Any]) -> bool:
    """As :func:`_settled`, except that a forced gear that is already the active one asks for nothing: no
    shift to make."""
    spec, st = body.get("spec") or {}, body.get("status") or {}
    forced = spec.get("forceGear")
    return (
        (st.get("executor") or {}).get("step") not in SHIFT_STEPS
        and (not forced or forced == st.get("activeGear"))
        and not st.get("windowedNodes")
    )


def wake_key(body: Mapping[str, Any]) -> Hashable:
    """What ends a shifting daemon's wait early when it moves: the spec (its generation) and whether a
    shift is asked for or in flight (:func:`_at_rest`: a window the reconciler writes, a forced gear)."""
    return (spec_generation(body), _at_rest(body))


def _serving_or_busy(body: kopf.Body, **_: Any) -> bool:
    """kopf runs the daemon only for GearSets with replicas to sample or a shift to finish: a namespace of
    services scaled to zero costs no sampling (no hot loop when idle)."""
    return (body.get("spec") or {}).get("replicas", 1) != 0 or not _settled(body)


gearset_shifting = sampling_daemon(
    "gearset_shifting",
    run_tick,
    what="shifting tick",
    floor_s=MIN_INTERVAL_S,
    when=_serving_or_busy,
    count_missed=True,
    wake_on=wake_key,
)


def free_gears_of_deleted_gearset(rt: Runtime, namespace: str, body: Mapping[str, Any]) -> list[str]:
    """On a GearSet's deletion: delete its role's StatefulSets of gears not serving; returns those gears."""
    api, spec, st = rt.api, body.get("spec") or {}, body.get("status") or {}
    service, role = spec.get("serviceName"), spec.get("role")
    if not service or not role:
        return []
    labels = {
        names.LABEL_SERVICE: service,
        names.LABEL_ROLE: role,
        names.LABEL_COMPONENT: names.COMPONENT_ENGINE,
    }
    sts = api.list(*STS, namespace, labels)
    selected = selected_gear(api.get(*SVC, namespace, names.role_service_name(service, role)))
    freed = gears_to_free(sts, selected, st.get("activeGear"))
    for gear in freed:
        delete_gear_sync(rt, namespace, service, role, gear)
    if freed:
        log.info("GearSet %s/%s deleted: freed gear(s) %s", namespace, body["metadata"]["name"], freed)
    return freed


# A failed deletion handler retries soon: the shadows it frees hold GPUs meanwhile.
@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True, backoff=DELETE_RETRY_S)  # type: ignore[arg-type]  # namespaced kind: kopf's namespace (str | None) is a str
def gearset_deleted(namespace: str, name: str, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A GearSet deleted mid-shift left its shadow StatefulSets (and their GPUs) behind. Its
    daemon has stopped: the loop's memory of it goes too."""
    rt = runtime_of(memo)
    free_gears_of_deleted_gearset(rt, namespace, body)
    rt.gearsets.forget((namespace, name))
    spec = body.get("spec") or {}
    if spec.get("serviceName") and spec.get("role"):
        metrics.forget_gears(namespace, spec["serviceName"], spec["role"])
