"""The gear-shifting tick's pure parts: what it sees of a role's gears, whether a shadow fits the free
GPUs, which request the executor gets (the decision's, or a vacating one for a time-limited node), the
``SignalsAvailable`` condition, the event a decision calls for, and which executor actions touch the API.

Pure: Kubernetes objects come in as plain dicts (as the API returns them), times as epoch seconds; no I/O,
no clock. The handler (:mod:`gearshift.handlers.shifting`) reads the objects, calls these, writes and
records; the status it writes is :mod:`gearshift.control.shifting.shift_status`'s.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Never, NoReturn

from gearshift.api.common import (
    COND_LATENCY_ATTAINABLE,
    COND_SIGNALS_AVAILABLE,
    REASON_SIGNALS_MISSING,
    ConditionUpdate,
)
from gearshift.api.gearset import Gear, GearSet
from gearshift.api.gearset_status import GearHealth
from gearshift.control.autoscale.scaling import NodeRank, NodeView, StageNeed, place_replicas
from gearshift.control.shifting.adapt import shift_request
from gearshift.control.shifting.decide import MANUAL, Decision, DecisionKind, DecisionState, held_triggers
from gearshift.control.shifting.executor import (
    FAIL_P99,
    GearObservation,
    Phase,
    ShiftRequest,
    ShiftState,
    judged_since,
)
from gearshift.control.shifting.executor_actions import (
    Action,
    DeleteGear,
    EnsureGear,
    Event,
    MarkUnhealthy,
    RecordShift,
    SelectGear,
)
from gearshift.control.shifting.policy import GearTable, ShiftRules
from gearshift.control.shifting.shift_status import gear_fingerprint
from gearshift.control.signals import (
    QUANTILE_SERIES,
    Engine,
    PipelineShape,
    Reading,
    UtilizationSource,
    describe_series,
    unavailable_series,
)
from gearshift.control.smoothing import LatencyMetric, Sample
from gearshift.control.windows import TRIGGER_WINDOW, closing_nodes, uses, vacate_target
from gearshift.facts.rfc3339 import from_time
from gearshift.k8s import names
from gearshift.k8s.placement import pod_gpus
from gearshift.planner.inputs import node_gpus

#: Container waiting/terminated reasons that mark a gear as failed (docs/sources.md#gear-health: OOM, crash
#: loops).
FAILURE_REASONS = ("OOMKilled", "CrashLoopBackOff")
#: Seconds a pod may stay unschedulable (``PodScheduled=False``, reason ``Unschedulable``) before its gear
#: counts as failed. While a shift warms, nothing it does frees GPUs (the old gear serves until the shadow
#: is Ready), so a shadow the scheduler cannot place would otherwise hold the shift for the whole
#: ``warmupTimeoutS``; the grace lets the scheduler see GPUs a deleted pod has just given back.
UNSCHEDULABLE_GRACE_S = 60.0
#: Condition reason when signals are there.
REASON_SIGNALS_OK = "SignalsOk"
#: Condition reason (SignalsAvailable=True) when a sample has no per-stage utilisation: vLLM exports none
#: and the gear's stage times, which the derivation needs, are unknown (or nothing completed yet); the
#: imbalance trigger is off, the others run.
REASON_STAGE_BALANCE_UNAVAILABLE = "StageBalanceUnavailable"
#: Condition reason (SignalsAvailable=False, a Warning event) when requests are served but latency
#: quantiles have no data: their histogram is not exported, not scraped or dropped.
REASON_LATENCY_UNAVAILABLE = "LatencyUnavailable"
#: Condition reason (SignalsAvailable=False, a Warning event) when requests are served but series other
#: than latency quantiles (the arrival rate) have no data.
REASON_SERIES_MISSING = "SeriesMissing"
#: Condition reason when neither the PDService nor the operator names a Prometheus.
REASON_NO_PROMETHEUS = "NoPrometheus"
#: Hold reasons that are the loop's normal state, not news: no event when a decision holds for them.
QUIET_HOLDS = ("Steady", "ShiftInProgress", "ForcedGear")


# --- the observed world --------------------------------------------------------------------------------
def _pod_ready_since(pod: Mapping[str, Any]) -> float | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready":
            if c.get("status") != "True":
                return None
            return from_time(c.get("lastTransitionTime")) or 0.0
    return None


def _pod_failure(pod: Mapping[str, Any]) -> str | None:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in FAILURE_REASONS:
            return str(waiting["reason"])
        for st in ((cs.get("state") or {}).get("terminated"), (cs.get("lastState") or {}).get("terminated")):
            if st and st.get("reason") in FAILURE_REASONS:
                return str(st["reason"])
    return None


def _pod_unschedulable(pod: Mapping[str, Any], now: float) -> str | None:
    """The scheduler's message when ``pod`` has been unschedulable for :data:`UNSCHEDULABLE_GRACE_S` at
    ``now`` (epoch s), else ``None``."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if (
            c.get("type") == "PodScheduled"
            and c.get("status") == "False"
            and c.get("reason") == "Unschedulable"
        ):
            since = from_time(c.get("lastTransitionTime"))
            if since is not None and now - since >= UNSCHEDULABLE_GRACE_S:
                name = (pod.get("metadata") or {}).get("name", "")
                return f"pod {name}: {c.get('message') or 'no node fits it'}"
    return None


def observe_gear(
    gear: Gear | None,
    statefulsets: Sequence[Mapping[str, Any]],
    pods: Sequence[Mapping[str, Any]],
    now: float | None = None,
) -> GearObservation:
    """One gear's :class:`GearObservation` from its StatefulSets and pods (all stages).

    Ready: a StatefulSet for every stage of ``gear`` (when known), each with all its replicas Ready, and
    every pod Ready; ``ready_since`` is the latest pod Ready transition (s). A pod whose container is
    OOM-killed or in a crash loop sets ``failure``; so does, given ``now`` (epoch s), a pod the scheduler
    could not place for :data:`UNSCHEDULABLE_GRACE_S` (``Unschedulable``, with the scheduler's message in
    ``failure_message``).
    """
    if not statefulsets:
        return GearObservation(exists=False)
    failure = next((f for p in pods if (f := _pod_failure(p))), None)
    failure_message = ""
    if failure is None and now is not None:
        unplaced = next((m for p in pods if (m := _pod_unschedulable(p, now))), None)
        if unplaced is not None:
            failure, failure_message = "Unschedulable", unplaced
    stages = {int((s["metadata"].get("labels") or {}).get(names.LABEL_STAGE, "0")) for s in statefulsets}
    complete = gear is None or stages >= set(range(len(gear.stages)))
    want = 0
    sts_ready = True
    for s in statefulsets:
        n = int((s.get("spec") or {}).get("replicas") or 0)
        want += n
        if int((s.get("status") or {}).get("readyReplicas") or 0) < n:
            sts_ready = False
    live = [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]
    since = [_pod_ready_since(p) for p in live]
    ready = complete and sts_ready and len(live) >= want and all(t is not None for t in since)
    return GearObservation(
        exists=True,
        ready=ready,
        ready_since=max((t for t in since if t is not None), default=None) if ready else None,
        failure=failure,
        failure_message=failure_message,
    )


def _gear_label(obj: Mapping[str, Any]) -> str:
    return str((obj["metadata"].get("labels") or {}).get(names.LABEL_GEAR, ""))


def statefulsets_by_gear(statefulsets: Iterable[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """A role's engine StatefulSets grouped by their gear label (``""`` for one without), in list order."""
    by_gear: dict[str, list[Mapping[str, Any]]] = {}
    for s in statefulsets:
        by_gear.setdefault(_gear_label(s), []).append(s)
    return by_gear


def observe_gears(
    gears: Mapping[str, Gear],
    by_gear: Mapping[str, Sequence[Mapping[str, Any]]],
    pods: Sequence[Mapping[str, Any]],
    *,
    drained: str | None,
    drained_in_flight: int | None,
    sample: Sample | None,
    sample_gear: str | None,
    metric: LatencyMetric,
    now: float | None = None,
) -> dict[str, GearObservation]:
    """The executor's view of every gear with StatefulSets (``by_gear``, from :func:`statefulsets_by_gear`).

    ``gears`` are the spec's gears by name (a gear no longer in the spec is still observed, without its
    stage count); ``pods`` all pods of the role. The ``drained`` gear (the old one while Draining, the
    failed one while RollingBack) gets ``drained_in_flight`` requests, 1 when unknown (``None``): an
    unknown count holds the drain until its timeout rather than cut requests off. The ``sample_gear``
    (the one sampled) gets the sample's P99 (``metric``, ms) and served rate (completed requests/s).
    ``now`` (epoch s) lets a long-unschedulable pod fail its gear (:func:`observe_gear`).
    """
    out: dict[str, GearObservation] = {}
    for gname, objs in by_gear.items():
        obs = observe_gear(gears.get(gname), objs, [p for p in pods if _gear_label(p) == gname], now)
        if gname == drained:
            obs = replace(obs, in_flight=1 if drained_in_flight is None else drained_in_flight)
        if sample is not None and gname == sample_gear:
            obs = replace(obs, p99_ms=sample.p99_ms(metric), qps=sample.qps)
        out[gname] = obs
    return out


def selected_gear(role_service: Mapping[str, Any] | None) -> str | None:
    """The gear the role Service's selector names, or ``None`` (no Service yet)."""
    if not role_service:
        return None
    return ((role_service.get("spec") or {}).get("selector") or {}).get(names.LABEL_GEAR)


def serving_since(state: ShiftState, policy: ShiftRules) -> float | None:
    """Since when the selected gear's samples count, s, or ``None`` (Stable, or a gear that served before:
    Warming, Degraded and RollingBack select the old gear): Draining from the switch; Switching from the
    rollback check's start (:func:`gearshift.control.shifting.executor.judged_since`), so the window of
    :func:`gearshift.control.signals.sample_window` holds neither the warm-up nor the switch's transient."""
    if state.phase is Phase.DRAINING:
        return state.step_started_at
    return judged_since(state, policy)


def pipeline_shape(gear: Gear) -> PipelineShape:
    """What vLLM's derived stage utilisation needs of ``gear``: the planner's per-stage times
    (``predictedTimeMs``, ms; ``None`` where not given), per-stage replicas and ``maxBatch``
    (``--max-num-seqs``)."""
    return PipelineShape(
        gear=gear.name,
        stage_times_ms=tuple(s.predicted_time_ms for s in gear.stages),
        stage_replicas=tuple(s.replicas for s in gear.stages),
        max_num_seqs=gear.max_batch,
    )


# --- free GPUs -----------------------------------------------------------------------------------------
def gpus_by_gear(gears: Iterable[str], pods: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """GPUs the pods of each of ``gears`` ask for (:func:`pod_gpus`; pods labelled with the gear, finished
    ones left out); 0 for a gear with no pods. Other gears' pods are not counted."""
    out = dict.fromkeys(gears, 0)
    for pod in pods:
        gear = ((pod.get("metadata") or {}).get("labels") or {}).get(names.LABEL_GEAR)
        if gear in out and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
            out[gear] += pod_gpus(pod)
    return out


def free_gpus(nodes: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Free GPUs per node name: allocatable ``nvidia.com/gpu`` − GPUs of its unfinished pods (not
    ``Succeeded``/``Failed``); negative when pods hold more than the node now advertises. Node order kept."""
    free = {n["metadata"]["name"]: node_gpus(n) for n in nodes}
    for p in pods:
        phase = (p.get("status") or {}).get("phase")
        host = (p.get("spec") or {}).get("nodeName")
        if host in free and phase not in ("Succeeded", "Failed"):
            free[host] -= pod_gpus(p)
    return free


def _most_free_first(candidates: Sequence[str]) -> NodeRank:
    """Most free GPUs first, ties in ``candidates`` order: the shadow check has no compute preference, the
    kube-scheduler places a shadow's pods and its default scoring (NodeResourcesFit, LeastAllocated)
    favours the emptiest node."""
    order = {name: i for i, name in enumerate(candidates)}
    return lambda node, free: (-free, order[node.name])


def shadow_fits(
    gear: Gear, pipeline_replicas: int, nodes: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]]
) -> bool:
    """Whether free GPUs (:func:`free_gpus`) hold every pod of ``gear`` beside everything running now.

    ``pipeline_replicas`` (``GearSet.spec.replicas``, at least 1 counted) times each stage's ``replicas``
    pods per stage. Stages take nodes in order (a named node list, else the nodes matching the stage's
    selector, else any node), at most one pod of a stage per node (the builders' anti-affinity, counted as
    required here even for a selector stage, whose StatefulSet only prefers it), the node with the most
    free GPUs first. The packing is :func:`gearshift.control.autoscale.scaling.place_replicas`'s, one stage at
    a time with the stage's candidates given as named nodes (that is what makes its anti-affinity apply). GPUs
    are whole devices here, so "memory short for a full shadow" means "not enough free cards" (a greedy fit,
    not an optimal packing).
    """
    node_list = list(nodes)
    free = free_gpus(node_list, pods)
    labels = {n["metadata"]["name"]: (n["metadata"].get("labels") or {}) for n in node_list}
    for st in gear.stages:
        if st.nodes:
            cands = list(dict.fromkeys(n for n in st.nodes if n in free))
        else:
            cands = [n for n in free if all(labels[n].get(k) == v for k, v in st.node_selector.items())]
        need = StageNeed(gpus=st.gpus, pods=st.replicas * max(pipeline_replicas, 1), nodes=tuple(cands))
        # No candidate: nodes=() reads as "any node" to place_replicas, but it is offered none at all.
        views = [NodeView(name, free_gpus=free[name], compute_per_gpu=0.0) for name in cands]
        placed = place_replicas([need], 1, views, rank=_most_free_first(cands))
        if placed.replicas < 1:
            return False
        for name in placed.nodes[0]:
            free[name] -= st.gpus
    return True


def shadow_to_check(
    request: ShiftRequest | None, state: ShiftState, gears: Mapping[str, Gear], existing: Collection[str]
) -> Gear | None:
    """The gear whose full shadow must fit the free GPUs before the executor starts this tick's shift, or
    ``None`` (no request, a shift already runs, the target is not a spec gear, or its objects exist):
    only a shift about to start needs the cluster-wide view of free GPUs."""
    if request is None or state.busy or request.target not in gears or request.target in existing:
        return None
    return gears[request.target]


# --- requests, holds, windows --------------------------------------------------------------------------
def forced_shift_reverted(gs: GearSet, state: ShiftState) -> str | None:
    """Why a shift ``spec.forceGear`` started is no longer wanted, or None: the field now names another
    gear or none. The executor cancels it only before the switch."""
    if not state.busy or state.trigger != MANUAL or gs.spec.force_gear == state.to_gear:
        return None
    now_forced = f"names {gs.spec.force_gear!r}" if gs.spec.force_gear else "was cleared"
    return f"spec.forceGear {now_forced}"


def current_marks(gs: GearSet) -> list[GearHealth]:
    """The health marks that still hold (docs/sources.md#gear-health: a gear is unhealthy until the model or
    the profiles
    change): marked under the current GPUProfiles, and on the gear as it is now — an edited gear is a new
    gear and is tried again, as the ``ForceGearUnhealthy`` hold tells users."""
    st = gs.status
    gears = {g.name: gear_fingerprint(g) for g in gs.gears()}
    return [
        h
        for h in st.gear_health
        if h.profiles_hash in (None, st.profiles_hash) and h.gear_hash in (None, gears.get(h.gear))
    ]


def lasting_marks(marks: Iterable[GearHealth], now: float, policy: ShiftRules) -> list[GearHealth]:
    """The marks that bar a gear now: a ``P99Regression`` mark lasts one ``dwellS``, every other
    one until the model or the profiles change (:func:`current_marks`). A P99 regression is a judgement
    under one load and one transition (the drain shares the cards): a gear that regressed at one peak may
    be the one the next peak needs, whereas OOM, crash loops and timeouts (FlexPipe's list,
    docs/sources.md#gear-health) say the gear cannot run here at all."""
    out = []
    for h in marks:
        since = from_time(h.since)
        if h.reason == FAIL_P99 and since is not None and now - since >= policy.dwell_s:
            continue
        out.append(h)
    return out


def window_request(gs: GearSet, table: GearTable, state: ShiftState) -> ShiftRequest | str | None:
    """The shift that vacates time-limited nodes, when the active gear holds stages on one the reconciler
    reports past its leaveBy (``status.windowedNodes`` state ``Leaving``).

    Returns a :class:`ShiftRequest` with trigger ``window`` to the reconciler's window-free replacement
    (:func:`gearshift.control.windows.vacate_target`), a message when no healthy gear is off those nodes,
    or ``None`` (nothing to vacate, or a shift already runs: it finishes first).
    """
    if state.busy:
        return None
    closing = closing_nodes(w.to_json() for w in gs.status.windowed_nodes)
    if not closing:
        return None
    gears = gs.gears()
    unhealthy = {g.name for g in table.gears if not g.healthy}
    target = vacate_target(gears, state.active, closing, unhealthy)
    if target is None:
        cur = next((g for g in gears if g.name == state.active), None)
        if cur is None or not uses(cur, closing):
            return None
        return (
            f"gear {state.active!r} runs on node(s) {', '.join(sorted(closing))} past their leaveBy and no "
            "healthy gear is off them to shift to; it stays until the node goes (then: node loss)"
        )
    view = table.get(target)
    return ShiftRequest(target, TRIGGER_WINDOW, None if view is None else view.predicted_p99_ms)


def executor_request(
    decision: Decision, table: GearTable, gs: GearSet, state: ShiftState
) -> tuple[ShiftRequest | None, str | None]:
    """``(request, window_warning)``: the shift the executor is asked for this tick, and the message of a
    time-limited node that cannot be vacated (:func:`window_request`), if any.

    A vacating shift replaces the decision's request: the node's deadline comes before any trigger, dwell
    or forced gear.
    """
    vacate = window_request(gs, table, state)
    if isinstance(vacate, ShiftRequest):
        return vacate, None
    return shift_request(decision, table), vacate


def decision_event(decision: Decision, previous_hold: str | None) -> Event | None:
    """The event a decision calls for: one that did something (raised a threshold; vetoed, as a warning)
    always; a hold only when its reason differs from ``previous_hold`` (the last hold's reason for this
    GearSet, ``None`` at first) and is not one of :data:`QUIET_HOLDS` (a forced-gear hold warns)."""
    if decision.kind in (DecisionKind.THRESHOLD_RAISED, DecisionKind.VETOED):
        return Event(decision.kind.value, decision.message, decision.kind is DecisionKind.VETOED)
    if decision.kind is not DecisionKind.HOLD:
        return None
    if previous_hold == decision.reason or decision.reason in QUIET_HOLDS:
        return None
    return Event(decision.reason, decision.message, decision.reason.startswith("Force"))


# --- the LatencyAttainable condition -------------------------------------------------------------------
#: Its reasons: the target is within some gear's reach, or prompts too long for any gear make it not.
REASON_ATTAINABLE = "Attainable"
REASON_PROMPTS_TOO_LONG = "PromptsTooLong"


def latency_condition(control: DecisionState) -> ConditionUpdate:
    """``LatencyAttainable`` after this tick's decision: False (a warning) with ``PromptsTooLong`` and the
    decision's account (the share of requests no gear can serve in time) while ``p99-high`` is latched on
    a miss no gear would fix (:attr:`DecisionState.latency_unfixable`: no shift is made for it), else
    True."""
    if control.latency_unfixable is not None:
        return ConditionUpdate(
            COND_LATENCY_ATTAINABLE, "False", REASON_PROMPTS_TOO_LONG, control.latency_unfixable, warning=True
        )
    return ConditionUpdate(
        COND_LATENCY_ATTAINABLE, "True", REASON_ATTAINABLE, "no latency miss that every gear would share"
    )


# --- the SignalsAvailable condition --------------------------------------------------------------------
def signals_condition(
    *,
    url: str | None,
    engine: Engine,
    reading: Reading | None,
    metric: LatencyMetric,
    why: str,
) -> ConditionUpdate:
    """``SignalsAvailable`` after this tick's sample (``reading``, ``None`` when there was none: ``why``
    says what failed; ``url`` is the Prometheus asked, ``None``/empty when none is configured).

    Missing is never fine: False (a warning) with ``LatencyUnavailable`` (only latency quantiles)
    or ``SeriesMissing`` when requests were served but series that should have a value have none
    (:func:`~gearshift.control.signals.unavailable_series`; the message names each series, its health
    and the triggers that hold, and stays the same while they do, so the event comes once); True with
    ``StageBalanceUnavailable`` when the reading has no stage utilisation, else ``SignalsOk``; False (a
    warning) with ``NoPrometheus`` or ``SignalsMissing`` when there was no sample.
    """
    cond = COND_SIGNALS_AVAILABLE
    sample = reading.sample if reading is not None else None
    missing = unavailable_series(reading, metric) if reading is not None else {}
    if missing:
        latency_only = all(name in QUANTILE_SERIES for name in missing)
        held = [t.value for t in held_triggers(missing, metric)]
        return ConditionUpdate(
            cond,
            "False",
            REASON_LATENCY_UNAVAILABLE if latency_only else REASON_SERIES_MISSING,
            f"Prometheus at {url} answers and the gear serves requests, but these series have no value: "
            f"{describe_series(missing)} (are they exported by the head pods and scraped?); "
            + (f"the {', '.join(sorted(held))} trigger(s) hold" if held else "no trigger reads them"),
            warning=True,
        )
    if reading is not None and reading.source is UtilizationSource.NONE:
        return ConditionUpdate(
            cond,
            "True",
            REASON_STAGE_BALANCE_UNAVAILABLE,
            f"Prometheus at {url} answers (engine {engine}); {reading.note}: the imbalance trigger is off "
            "for this gear, the saturation and P99 triggers run",
        )
    if sample is not None:
        return ConditionUpdate(cond, "True", REASON_SIGNALS_OK, f"Prometheus at {url} answers")
    reason = REASON_NO_PROMETHEUS if not url else REASON_SIGNALS_MISSING
    return ConditionUpdate(cond, "False", reason, f"{why}; no gear shift starts", warning=True)


# --- actions → API operations --------------------------------------------------------------------------
#: The executor actions that the handler carries out against the API (StatefulSets, Service, events);
#: :class:`RecordShift` and :class:`MarkUnhealthy` go into the status patch instead.
ApiOperation = EnsureGear | SelectGear | DeleteGear | Event


class UnknownActionError(TypeError):
    """An executor action this tick has no handling for (a new :data:`Action` type not wired here)."""


def unknown_action(action: Never) -> NoReturn:
    """Raise :class:`UnknownActionError` for ``action``; typed ``Never`` so that mypy proves every
    ``match`` that ends in it exhaustive."""
    raise UnknownActionError(f"executor action {action!r} has no handling in the shifting tick")


def api_operations(actions: Iterable[Action]) -> list[ApiOperation]:
    """The actions that touch the API, in the executor's order (ensure, select, delete, event).

    Raises:
        UnknownActionError: an action of a type this function does not know; it is raised before the
            handler writes anything, so nothing of that step is persisted or half applied.
    """
    out: list[ApiOperation] = []
    for a in actions:
        match a:
            case EnsureGear() | SelectGear() | DeleteGear() | Event():
                out.append(a)
            case RecordShift() | MarkUnhealthy():
                pass  # status only: shift_status.records_to_status writes them
            case _:
                unknown_action(a)
    return out


def gears_to_free(sts: Sequence[Mapping[str, Any]], selected: str | None, active: str | None) -> list[str]:
    """Gears of a deleted GearSet's role whose StatefulSets go with it: every gear but the one serving
    (the role Service's, else ``status.activeGear``), sorted.

    The serving gear stays: deleting its pods would drop requests, and the PDService's own deletion (owner
    references) or a new GearSet decides its fate. A shadow or a drained old gear holds GPUs for nothing.
    """
    keep = selected or active
    gears = {(s.get("metadata", {}).get("labels") or {}).get(names.LABEL_GEAR) for s in sts}
    return sorted(g for g in gears if g and g != keep)
