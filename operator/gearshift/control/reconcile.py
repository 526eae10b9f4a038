"""The PDService reconciler's decisions, without I/O: :mod:`gearshift.handlers.reconcile` reads and writes.

The handler reads the PDService, its two GearSets, the fleet and the owned objects, and hands them to
these functions in this order; ``gearshift render`` (:mod:`gearshift.commands.rendering`) calls the same
functions on files, so what it prints is what a first reconcile applies:

- :func:`role_state`, :func:`explicit_layer_problems`, :func:`explicit_engine_problems`: check each GearSet
  against its role, the model's layers and the engine (raise :class:`SpecInvalid`);
- :func:`desired_state`: plan the ``auto`` roles on their share of the fleet, pick each role's active gear
  and check the running gears' placement;
- :func:`gearset_status_patch`: the GearSet status (plan, active gear, phase, Planned condition);
- :func:`stale_statefulsets`, :func:`stale_gear_services`: the owned objects no wanted gear has any more;
- :func:`role_readiness`, :func:`readiness_patch`: each role's Ready pods and pipelines;
- :func:`service_verdict`: the PDService's conditions (Placed, Degraded, Progressing, Ready), its phase
  (:func:`service_phase`) and status; :func:`refusal` and :func:`gearsets_missing` when it cannot be served.

Pure: time (``now``) is passed in, nothing reads the clock or the API. Planning may be memoised by the
caller (``memo`` of :func:`desired_state`, the handler's plan cache); without one it plans every time.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple, Protocol

from pydantic import ValidationError

from gearshift import planner
from gearshift.api.common import (
    COND_DEGRADED,
    COND_PLACED,
    COND_PLANNED,
    COND_PROGRESSING,
    COND_READY,
    COND_SCALING_ACTIVE,
    MAX_GEAR_NAME,
    REASON_NODE_LOST,
    REASON_PLACEMENT_FAILED,
    REASON_PLAN_FAILED,
    REASON_PLANNED,
    REASON_RECONCILED,
    REASON_WINDOW_CLOSING,
    REASON_WINDOW_VACATED,
    REASON_WINDOWED_IN_USE,
    Condition,
    ConditionStatus,
    ConditionUpdate,
    format_validation_error,
    inputs_hash,
    set_condition,
)
from gearshift.api.gearset import Gear, GearSet
from gearshift.api.gearset_plan import Workload
from gearshift.api.pdservice import ROLE_SECTIONS, PDService
from gearshift.control import capacity
from gearshift.control.adapt import gear_views, gearset_rules
from gearshift.control.policy import ShiftRules
from gearshift.control.windows import (
    WindowTiming,
    next_leave_by,
    planner_windows,
    vacate_name,
    windowed_nodes,
)
from gearshift.facts.model import VLLM_GPU_MEMORY_UTILIZATION
from gearshift.k8s import names
from gearshift.k8s.desired import Images, RoleDesire, engine_context
from gearshift.k8s.fleetsplit import split_pools
from gearshift.k8s.placement import pinned_nodes
from gearshift.k8s.statefulset import ANNOTATION_TEMPLATE_HASH, stage_replicas
from gearshift.planner.inputs import (
    api_gear,
    engine_stage_limit,
    gear_links,
    initial_gear,
    node_ready,
    resource_profile,
    role_candidates,
    stage_gpus,
    stage_limit_problems,
    usable_profile,
)

#: Executor steps during which the executor, not the reconciler, owns the role's gears and selector
#: (Degraded is the executor's weights-first warming).
SHIFT_STEPS = ("Warming", "Draining", "Switching", "RollingBack", "Degraded")
#: Seconds of margin before a time-limited node's availableUntil when the GearSet sets none.
DEFAULT_WINDOW_MARGIN_S = 300.0

# --- condition reasons of the PDService beyond those in gearshift.api.common ------------------------
REASON_GEARSET_MISSING = "GearSetMissing"  # a gearSetRef names no GearSet (yet)
REASON_GEARSET_MISMATCH = "GearSetMismatch"  # the GearSet serves another service or role
REASON_PROFILES_MISSING = "ProfilesMissing"  # candidate GPU nodes have no usable GPUProfile
REASON_ALL_PLACED = "AllPlaced"  # every stage of the running gears has its nodes
REASON_ROLLING_OUT = "RollingOut"  # pods of a running gear are not all ready/updated
REASON_ALL_READY = "AllReady"  # both roles and the router serve
REASON_NOT_READY = "NotReady"  # some role or the router is not serving yet
REASON_AS_PLANNED = "AsPlanned"  # every node under a running stage is there
REASON_UNSCHEDULABLE = "Unschedulable"  # the scheduler cannot place a stage pod (e.g. GPUs short)

#: ``(role, reason, message, warning)``: an event of planning, for the GearSet and the PDService.
PlanEvent = tuple[str, str, str, bool]
#: ``memo(key, plan)``: the gears of the plan with inputs hash ``key``, calling ``plan()`` on a miss.
PlanMemo = Callable[[str, Callable[[], list[Gear]]], list[Gear]]


class ReconcileError(Exception):
    """Base of the reconciler's errors."""


class SpecInvalid(ReconcileError):
    """The PDService or one of its GearSets cannot be used as written; retrying will not help."""


class PlanSettings(Protocol):
    """What planning reads of the operator's settings (``gearshift.handlers.reconcile.Settings``)."""

    @property
    def sim_requests(self) -> int:
        """Requests per planner simulation run."""
        ...


@dataclass
class RoleState:
    """What the reconciler worked out for one role."""

    role: str
    gs_body: dict[str, Any]
    gs: GearSet
    gears: list[Gear] = field(default_factory=list)
    active: str | None = None
    in_flight: bool = False
    links: dict[str, list[dict[str, float]] | None] = field(default_factory=dict)
    gs_status_patch: dict[str, Any] = field(default_factory=dict)
    plan_error: str | None = None
    window_leave_by: str | None = None
    """Earliest leaveBy of a time-limited node in use by this role's gears (RFC 3339)."""
    autoscaled: bool = False
    """The PDService has a ``scaling`` section for this role."""


@dataclass
class DesiredState:
    """What one reconcile wants, worked out from what it read (:func:`desired_state`)."""

    desires: list[RoleDesire]
    """Per role, the gears whose objects should exist and the gear its Service selects."""
    missing: list[str]
    """Nodes an ``auto`` role may plan on that have no usable GPUProfile (for the Placed condition)."""
    problems: list[str]
    """What keeps a running gear from being placed, and plan failures."""
    lost: list[str]
    """Named nodes under running stages that are gone or not Ready."""
    skip_gears: set[tuple[str, str]]
    """``(role, gear)`` left as they are because they cannot be placed."""
    plan_events: list[PlanEvent]
    """``(role, reason, message, warning)`` of planning, for the GearSet and the PDService."""


class Readiness(NamedTuple):
    """A role's active gear as its StatefulSets report it (:func:`role_readiness`).

    Counts are of pods of the current revision only: a pod of an older revision that still serves does
    not count toward the ready pipelines (:func:`current_ready`)."""

    ready: int
    """Ready pods of the current revision of the narrowest stage."""
    desired: int
    """Pods the narrowest stage wants."""
    rolled: bool
    """Every stage's StatefulSet has observed its generation, finished its rollout (``currentRevision``
    = ``updateRevision``) and has all its pods updated and Ready: what ``kubectl rollout status`` waits
    for."""
    pipelines: int
    """Ready pipeline replicas (every stage has its share of Ready pods), as ``GearSet.status.replicas``."""
    waiting: str = ""
    """Why the gear is not rolled out (the first stage that is not), a sentence for conditions; ``""``
    when it is."""


@dataclass(frozen=True)
class ServiceVerdict:
    """The PDService's status after one reconcile (:func:`service_verdict`)."""

    conditions: list[ConditionUpdate]
    """In the order they are set: Placed, Degraded, Progressing, Ready."""
    phase: str
    ready: bool
    """Both roles and the router serve."""
    placed: bool
    """Every stage of the running gears has its nodes, and every node has a usable profile."""
    status: dict[str, Any]
    """The status fields to write, without ``conditions`` and ``observedGeneration``."""


# --- checks of the spec -----------------------------------------------------------------------------
def role_state(pds: PDService, service: str, role: str, gs_body: dict[str, Any]) -> RoleState:
    """The :class:`RoleState` of ``role`` of PDService ``service`` from the body of the GearSet its
    ``gearSetRef`` names.

    Raises:
        SpecInvalid: the GearSet does not validate, or serves another service or role.
    """
    section = pds.spec.role_spec(role)
    ref = section.gear_set_ref.name
    try:
        gs = GearSet.model_validate(gs_body)
    except ValidationError as exc:
        raise SpecInvalid(f"GearSet {ref!r} is invalid:\n{format_validation_error(exc)}") from None
    if gs.spec.role != role or gs.spec.service_name != service:
        raise SpecInvalid(
            f"{ROLE_SECTIONS[role]}.gearSetRef names GearSet {ref!r}, which serves service "
            f"{gs.spec.service_name!r} role {gs.spec.role!r}; set its spec.serviceName: {service} and "
            f"spec.role: {role}, or refer to another GearSet"
        )
    return RoleState(role, gs_body, gs, autoscaled=section.scaling is not None)


def explicit_layer_problems(pds: PDService, roles: Mapping[str, RoleState]) -> None:
    """Check that every explicit gear covers exactly the model's layers, before anything is applied.

    The CRD can check that stages are contiguous but not the model's layer count (the GearSet does not
    know the model), so a gear ending at layer 40 of a 32-layer model would otherwise reach the pods and
    crash-loop there.

    Raises:
        SpecInvalid: naming the GearSet, the gear, where its stages end and the model's layer count.
    """
    layers = pds.spec.model.to_model_arch().num_layers
    problems = []
    for role, rs in roles.items():
        if rs.gs.spec.mode != "explicit":
            continue
        for gear in rs.gs.spec.gears:
            try:
                gear.check_model_layers(layers)
            except ValueError as exc:
                problems.append(f"{role}: GearSet {rs.gs.metadata['name']!r}: {exc}")
    if problems:
        raise SpecInvalid("; ".join(problems))


def explicit_engine_problems(
    pds: PDService, roles: Mapping[str, RoleState], profiles: Mapping[str, Mapping[str, Any]] | None = None
) -> None:
    """Check that every explicit gear has no more stages than the engine runs for its role (vLLM's
    decode: one, :func:`gearshift.planner.inputs.engine_stage_limit`), before anything is applied.

    Raises:
        SpecInvalid: naming the role, the GearSet, the gear, its stage count, why and what to write
            instead (and, from ``profiles``, when no node the gear names holds the whole model).
    """
    arch = pds.spec.model.to_model_arch()
    problems = []
    for role, rs in roles.items():
        limit = engine_stage_limit(pds.spec.engine, role)
        if rs.gs.spec.mode != "explicit" or limit is None:
            continue
        for msg in stage_limit_problems(rs.gs.spec.gears, limit, arch, profiles):
            problems.append(f"{role}: GearSet {rs.gs.metadata['name']!r}: {msg}")
    if problems:
        raise SpecInvalid("; ".join(problems))


# --- placement --------------------------------------------------------------------------------------
def _in_flight(gs: GearSet) -> bool:
    ex = gs.status.executor
    return ex is not None and ex.step in SHIFT_STEPS


def _labels_match(node: Mapping[str, Any], selector: Mapping[str, str]) -> bool:
    labels = (node.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


def _node_gpu_model(node: Mapping[str, Any], profiles: Mapping[str, Mapping[str, Any]]) -> str:
    meta = node.get("metadata") or {}
    name = meta.get("name", "")
    eff = usable_profile(profiles[name]) if name in profiles else None
    if eff and eff.gpu_model:
        return eff.gpu_model
    labels = meta.get("labels") or {}
    ann = meta.get("annotations") or {}
    return str(labels.get(names.NODE_GPU_MODEL) or ann.get(names.NODE_GPU_MODEL) or "unknown")


def explicit_pool(
    gears: Sequence[Gear], nodes: Mapping[str, Mapping[str, Any]], profiles: Mapping[str, Mapping[str, Any]]
) -> dict[str, str]:
    """``{node: GPU model}`` an explicit GearSet may use: nodes its stages name or select."""
    out: dict[str, str] = {}
    for g in gears:
        for st in g.stages:
            if st.nodes:
                picked = [nodes[n] for n in st.nodes if n in nodes]
            elif st.node_selector:
                picked = [n for n in nodes.values() if _labels_match(n, st.node_selector)]
            else:
                picked = []
            for n in picked:
                out[n["metadata"]["name"]] = _node_gpu_model(n, profiles)
    return out


def placement_problems(
    role: str,
    gear: Gear,
    nodes: Mapping[str, Mapping[str, Any]],
    bound: Collection[str] = (),
) -> tuple[list[str], list[str]]:
    """``(problems, lost)`` of one gear: what keeps stages from being placed, and named nodes that are lost.

    A named node is *lost* when it is there but not Ready, or gone while the service was using it
    (``bound``: nodes the service's pods are bound to, or its StatefulSets are pinned to). A name no
    Node has and the service never used is a placement problem only (most likely a misspelling in an
    explicit gear): reporting it as lost would mark the service Degraded for a node it never had.
    """
    problems: list[str] = []
    lost: list[str] = []
    for k, st in enumerate(gear.stages):
        where = f"{role} gear {gear.name!r} stage {k}"
        if st.nodes:
            gone = [n for n in st.nodes if n not in nodes or not node_ready(nodes[n])]
            lost += [n for n in gone if n in nodes or n in bound]
            unknown = [n for n in gone if n not in nodes and n not in bound]
            if unknown:
                problems.append(
                    f"{where}: no Node named {', '.join(unknown)} (check the names in the gear's "
                    f"stages[{k}].nodes, e.g. with `kubectl get nodes`)"
                )
            if len(unknown) < len(gone):
                problems.append(
                    f"{where}: node(s) {', '.join(n for n in gone if n not in unknown)} missing or not Ready"
                )
        elif st.node_selector:
            ok = [n for n in nodes.values() if node_ready(n) and _labels_match(n, st.node_selector)]
            if not ok:
                sel = ",".join(f"{k2}={v}" for k2, v in sorted(st.node_selector.items()))
                problems.append(f"{where}: no Ready node has labels {sel}")
    return problems, lost


def bound_nodes(pods: Iterable[Mapping[str, Any]], statefulsets: Iterable[Mapping[str, Any]]) -> set[str]:
    """Nodes the service runs on: those its ``pods`` are bound to and its ``statefulsets`` are pinned to.

    Pods of a deleted node are garbage-collected soon after it goes; the StatefulSet pinned to it stays.
    """
    out = {str(p["spec"]["nodeName"]) for p in pods if (p.get("spec") or {}).get("nodeName")}
    for sts in statefulsets:
        out |= pinned_nodes(sts)
    return out


# --- planning ---------------------------------------------------------------------------------------
def plan_assumptions(gs: GearSet) -> planner.RooflineAssumptions:
    """The roofline assumptions a GearSet's plan prices with: its ``plan.workload`` request shape and its
    role (a prefill role's gears run only prompts, a decode role's only decode steps)."""
    w = gs.spec.plan.workload if gs.spec.plan else Workload()
    return planner.RooflineAssumptions(
        prompt_tokens=w.prompt_tokens, output_tokens=w.output_tokens, role=gs.spec.role
    )


def memory_utilization(gs: GearSet) -> float:
    """The share of GPU memory the engine may take for a GearSet's gears (its plan constraints', else
    vLLM's default), 0..1."""
    cons = gs.spec.plan.constraints if gs.spec.plan else None
    return cons.memory_utilization if cons else VLLM_GPU_MEMORY_UTILIZATION


def no_memo(key: str, plan: Callable[[], list[Gear]]) -> list[Gear]:
    """A :data:`PlanMemo` that keeps nothing: ``plan()``."""
    return plan()


def plan_gears(
    doc: dict[str, Any],
    pds: PDService,
    gs: GearSet,
    sim_requests: int,
    windows: planner.Windows | None = None,
) -> list[Gear]:
    """The gears the planner finds for ``gs`` on resource profile ``doc``, one per intent, as API gears.

    Raises:
        gearshift.planner.PlanError: no gear fits (``PlanInputError`` when ``doc`` is unusable).
    """
    profile = planner.parse_profile(doc)
    cost = planner.RooflineCostModel(pds.spec.model.to_model_arch(), plan_assumptions(gs))
    intents = list(gs.spec.plan.intents) if gs.spec.plan else list(planner.INTENTS)
    limit = engine_stage_limit(pds.spec.engine, gs.spec.role)  # vLLM decode: one stage (issue 18)
    result = planner.plan(
        profile,
        cost,
        intents=intents,
        sim_requests=sim_requests,
        windows=windows,
        max_stages=limit.max_stages if limit else None,
        max_stages_why=limit.reason if limit else "",
        # vLLM runs a stage's replicas as whole pipeline copies (k8s.statefulset.stage_replicas): a hot
        # stage cannot get extras of its own there.
        whole_pipelines=pds.spec.engine == "vllm",
        itl_target_ms=plan_itl_target(pds, gs),
    )
    return [api_gear(g, intent, doc, {}) for g, intent in zip(result.gears, intents, strict=True)]


def plan_itl_target(pds: PDService, gs: GearSet) -> float | None:
    """The TPOT target an aggregated GearSet's gears are planned for (its service's ``slo.itlMs``, ms):
    a gear of role ``both`` serves every token, so its capacity is the load whose TPOT meets it. None for
    the PD roles, whose plans keep the busy-rate capacity."""
    return pds.spec.slo.itl_ms if gs.spec.role == "both" else None


def plan_key(
    pds: PDService, gs: GearSet, doc: Mapping[str, Any], sim_requests: int, window_states: Mapping[str, str]
) -> str:
    """The inputs hash of an ``auto`` GearSet's plan (``status.profilesHash``): a re-plan happens when it
    moves. ``window_states`` are :func:`gearshift.control.windows.planner_windows`'s node states (the hash
    moves only when a time-limited node crosses its leaveBy)."""
    plan_spec = gs.spec.plan
    cons = plan_spec.constraints if plan_spec else None
    intents = list(plan_spec.intents) if plan_spec else list(planner.INTENTS)
    arch = pds.spec.model.to_model_arch().to_dict()
    parts: list[Any] = [doc, cons.to_json() if cons else {}, arch, intents, sim_requests]
    if plan_spec and plan_spec.workload != Workload():
        # Only a stated workload enters the fingerprint, so plans made before the field existed keep
        # their hash (no re-plan on upgrade); the role is fixed per GearSet.
        parts.append(plan_spec.workload.to_json())
    limit = engine_stage_limit(pds.spec.engine, gs.spec.role)
    if limit is not None:  # likewise only when set: sim plans keep their hash
        parts.append({"maxStages": limit.max_stages})
    if pds.spec.engine == "vllm":  # whole-pipeline replicas only (plan_gears)
        parts.append({"wholePipelines": True})
    itl = plan_itl_target(pds, gs)
    if itl is not None:  # aggregated only: PD plans keep their hash
        parts.append({"itlTargetMs": itl})
    return inputs_hash(*parts, window_states) if window_states else inputs_hash(*parts)


def window_timing(gs: GearSet) -> WindowTiming:
    """How long before a time-limited node's deadline work on it must leave, from the GearSet's plan
    constraints and shift policy (:mod:`gearshift.control.windows`)."""
    cons = gs.spec.plan.constraints if gs.spec.plan else None
    pol = gs.spec.policy
    return WindowTiming(
        cons.window_margin_s if cons else DEFAULT_WINDOW_MARGIN_S,
        pol.dwell_s,
        pol.warm_s + pol.drain_timeout_s + pol.rollback_window_s,
    )


def _gpu_counts(gears: list[Gear], profiles: Mapping[str, Mapping[str, Any]]) -> list[Gear]:
    """Stage ``gpus`` = the least GPU count among the stage's nodes' profiles (the planner plans nodes)."""
    out = []
    for g in gears:
        stages = [st.model_copy(update={"gpus": stage_gpus(st.nodes, profiles, st.gpus)}) for st in g.stages]
        out.append(g.model_copy(update={"stages": stages}))
    return out


def deadlines(pool: Iterable[str], profiles: Mapping[str, Mapping[str, Any]]) -> dict[str, datetime]:
    """``{node: status.availableUntil}`` of the time-limited nodes of ``pool`` (effective profiles)."""
    out = {}
    for n in pool:
        eff = usable_profile(profiles[n]) if n in profiles else None
        if eff is not None and eff.available_until is not None:
            out[n] = eff.available_until
    return out


def running_gears(gs: GearSet) -> list[str]:
    """Gears with objects: the active gear, and a shift's ``from``/``to``/target while one is in flight."""
    st = gs.status
    out = [st.active_gear]
    if _in_flight(gs) and st.executor is not None:
        out += [st.executor.from_gear, st.executor.to_gear, st.target_gear]
    return [g for g in dict.fromkeys(out) if g]


def merge_plan(
    old: Sequence[Gear],
    new: Sequence[Gear],
    running: Sequence[str],
    closing: Collection[str],
    nodes: Mapping[str, Mapping[str, Any]],
) -> list[Gear]:
    """A re-plan's gears (``new``, one per intent, named after it) with the running gears kept safe.

    - A running gear with stages on a ``closing`` node (past its leaveBy) that is still Ready is *vacated*
      through the executor: it stays as it is (appended after the plan's gears), and the plan's gear of
      the same name comes under a fresh name (``<intent>-w<hash>``), so no StatefulSet of a serving gear
      is rolled in place; the shifting loop then shifts to it (trigger ``window``). A node that is
      already gone or not Ready is a node loss instead: the gear follows the plan in place, as before.
    - Otherwise the active gear keeps its name: when an earlier vacate renamed it, the plan's gear of its
      intent takes that name (its layout follows the plan, as a re-plan always did).
    - A running gear whose name the plan no longer has is kept (a shift in flight finishes on it).
    """
    by_name = {g.name: g for g in old}
    live = [by_name[n] for n in running if n in by_name]
    vacating = [
        g
        for g in live
        if any(n in closing and n in nodes and node_ready(nodes[n]) for st in g.stages for n in st.nodes)
    ]
    out = list(new)
    if vacating:
        away = {g.name for g in vacating}
        taken = {g.name for g in live} | {g.name for g in out}
        renamed = []
        for g in out:
            if g.name in away:
                g = g.model_copy(update={"name": vacate_name(g, MAX_GEAR_NAME, taken)})
                taken.add(g.name)
            renamed.append(g)
        out = renamed + vacating
    elif running and running[0] in by_name and running[0] not in {g.name for g in out}:
        active = by_name[running[0]]
        same = next((g for g in out if g.intent == active.intent), None)
        if same is not None:
            out = [g.model_copy(update={"name": active.name}) if g is same else g for g in out]
    have = {g.name for g in out}
    return out + [g for g in live if g.name not in have]


def drop_superseded(gears: Sequence[Gear], running: Collection[str]) -> list[Gear]:
    """``gears`` without those a re-plan superseded once nothing runs on them.

    The plan's gears come first, one per intent (:func:`merge_plan` appends kept ones), so a gear that is
    not running and follows another gear of its intent is a superseded one.
    """
    seen: set[str] = set()
    out = []
    for g in gears:
        if g.intent in seen and g.name not in running:
            continue
        seen.add(g.intent)
        out.append(g)
    return out


def plan_message(gears: Sequence[Gear], pool_size: int) -> str:
    """The ``Planned`` event's text: how many gears, on how many distinct nodes, and each gear's stages.

    ``pool_size`` is the number of nodes the planner was offered; gears often share nodes and need not
    use all of them, so the node count is of the distinct nodes the gears' stages name."""
    used = {n for g in gears for s in g.stages for n in s.nodes}
    summary = "; ".join(
        f"{g.name}: " + " | ".join(f"{s.layers}@{','.join(s.nodes)}" for s in g.stages) for g in gears
    )
    return f"planned {len(gears)} gear(s) on {len(used)} node(s) of {pool_size} usable: {summary}"


def service_event_message(role: str, gearset: str, message: str) -> str:
    """A role's event as recorded on the PDService: the GearSet's own message, prefixed with the role and
    the GearSet it is about (the PDService has two, and its events list would not say which)."""
    return f"{role} (GearSet {gearset}): {message}"


def window_events(
    role: str, report: Sequence[Mapping[str, Any]], before: Mapping[str, str]
) -> list[PlanEvent]:
    """The events of a role's time-limited nodes changing state: work lands on one (``WindowedInUse``),
    must leave it (``WindowClosing``), or has left it (``WindowVacated``).

    ``report`` is :func:`gearshift.control.windows.windowed_nodes`'s; ``before`` is ``{node: state}`` of
    the GearSet's ``status.windowedNodes`` as last written."""
    events: list[PlanEvent] = []
    for w in report:
        was = before.get(w["node"])
        if w["state"] in ("Leaving", "Left") and was == "InUse":
            moving = f"; {', '.join(w['stages'])} shift(s) off it" if w["stages"] else ""
            msg = (
                f"node {w['node']} is reclaimed at {w['availableUntil']}: past its leaveBy "
                f"{w['leaveBy']}, re-planned without it{moving}"
            )
            events.append((role, REASON_WINDOW_CLOSING, msg, False))
        elif w["state"] == "Left" and was == "Leaving":
            msg = (
                f"nothing of this role runs on node {w['node']} any more (reclaimed at {w['availableUntil']})"
            )
            events.append((role, REASON_WINDOW_VACATED, msg, False))
        elif w["state"] == "InUse" and was != "InUse":
            msg = (
                f"time-limited node {w['node']} (reclaimed at {w['availableUntil']}) holds "
                f"{', '.join(w['stages'])}; work leaves it by {w['leaveBy']}"
            )
            events.append((role, REASON_WINDOWED_IN_USE, msg, False))
    return events


def role_pools(
    roles: Mapping[str, RoleState],
    nodes: Mapping[str, Mapping[str, Any]],
    profiles: Mapping[str, Mapping[str, Any]],
) -> tuple[dict[str, dict[str, str]], list[str]]:
    """``(pools, missing)``: per role the ``{node: GPU model}`` it may use before the two roles' pools are
    split (an ``auto`` role's plan candidates, an explicit role's named or selected nodes), and what is
    missing for the Placed condition (candidate nodes without a usable GPUProfile)."""
    pools: dict[str, dict[str, str]] = {}
    missing: list[str] = []
    for role, rs in roles.items():
        if rs.gs.spec.mode == "auto":
            cons = rs.gs.spec.plan.constraints if rs.gs.spec.plan else None
            cand = role_candidates(cons, nodes.values(), profiles)
            pools[role] = cand.nodes
            if cand.missing_profile:
                missing.append(f"{role}: no usable GPUProfile for node(s) {', '.join(cand.missing_profile)}")
        else:
            pools[role] = explicit_pool(rs.gs.spec.gears, nodes, profiles)
    return pools, missing


def plan_auto_role(
    pds: PDService,
    rs: RoleState,
    pool: Sequence[str],
    nodes: Mapping[str, Mapping[str, Any]],
    profiles: Mapping[str, Mapping[str, Any]],
    sim_requests: int,
    now: datetime,
    memo: PlanMemo = no_memo,
) -> list[PlanEvent]:
    """Plan an ``auto`` role on ``pool`` (its share of the fleet, node names) when the plan's inputs
    hash moved or it has no gears; returns the events to record.

    Updates ``rs`` in place: ``gears``, ``links``, ``window_leave_by``, ``gs_status_patch``
    (``plannedGears``, ``profilesHash``, ``windowedNodes``) and ``plan_error`` (no pool, or no gear fits).
    """
    rs.gears = list(rs.gs.status.planned_gears)
    if not pool:
        rs.plan_error = (
            f"{rs.role}: no usable GPU node to plan on (constraints, profiles, or the other role's share)"
        )
        return []
    doc = resource_profile(pool, profiles, nodes, memory_utilization(rs.gs))
    # Time-limited nodes (issue 13): the fingerprint moves only when one crosses its leaveBy.
    limits = deadlines(pool, profiles)
    timing = window_timing(rs.gs)
    windows, states = planner_windows(limits, now, timing) if limits else (None, {})
    key = plan_key(pds, rs.gs, doc, sim_requests, states)
    profile = planner.parse_profile(doc)
    running = running_gears(rs.gs)
    events: list[PlanEvent] = []
    if key != rs.gs.status.profiles_hash or not rs.gears:
        try:
            planned = _gpu_counts(
                memo(key, lambda: plan_gears(doc, pds, rs.gs, sim_requests, windows)), profiles
            )
        except planner.PlanError as exc:
            rs.plan_error = f"{rs.role}: the planner found no gear on {len(pool)} node(s): {exc}"
            return []
        closing = {n for n, state in states.items() if state == "left"}
        gears = merge_plan(rs.gs.status.planned_gears, planned, running, closing, nodes)
        rs.gears = gears
        rs.gs_status_patch["plannedGears"] = [g.to_json() for g in gears]
        rs.gs_status_patch["profilesHash"] = key
        events.append((rs.role, REASON_PLANNED, plan_message(gears, len(pool)), False))
    kept = drop_superseded(rs.gears, running)
    if len(kept) != len(rs.gears):  # the executor has shifted off a gear a re-plan superseded
        rs.gears = kept
        rs.gs_status_patch["plannedGears"] = [g.to_json() for g in kept]
    rs.links = {g.name: gear_links(g, profile) for g in rs.gears}
    report = windowed_nodes(limits, rs.gears, now, timing)
    rs.window_leave_by = next_leave_by(report)
    if report != [w.to_json() for w in rs.gs.status.windowed_nodes]:
        rs.gs_status_patch["windowedNodes"] = report
    before = {w.node: w.state for w in rs.gs.status.windowed_nodes}
    return events + window_events(rs.role, report, before)


def plan_roles(
    pds: PDService,
    roles: Mapping[str, RoleState],
    nodes: Mapping[str, Mapping[str, Any]],
    profiles: Mapping[str, Mapping[str, Any]],
    sim_requests: int,
    now: datetime,
    memo: PlanMemo = no_memo,
) -> tuple[list[str], list[PlanEvent]]:
    """Give every role its gears: an explicit role its spec's, an ``auto`` role a plan on its split pool
    (:func:`plan_auto_role`). Returns ``(missing, events)``: what is missing for the Placed condition,
    and the events of planning and of time-limited nodes (:mod:`gearshift.control.windows`)."""
    pools, missing = role_pools(roles, nodes, profiles)
    split = dict(pools)  # one role (aggregated) has its whole pool
    if "prefill" in pools and "decode" in pools:
        split["prefill"], split["decode"] = split_pools(pools["prefill"], pools["decode"])
    events: list[PlanEvent] = []
    for role, rs in roles.items():
        if rs.gs.spec.mode != "auto":
            rs.gears = list(rs.gs.spec.gears)
        else:
            events += plan_auto_role(pds, rs, sorted(split[role]), nodes, profiles, sim_requests, now, memo)
    return missing, events


# --- what to run ------------------------------------------------------------------------------------
def pick_active(rs: RoleState, rules: ShiftRules | None = None) -> list[Gear]:
    """Set ``rs.active`` (the GearSet's active gear while it has it, else the initial gear) and
    ``rs.in_flight``; returns the gears that run (the active one, and while a shift is in flight its
    ``from``/``to``/target unless the GearSet is being deleted), in ``rs.gears`` order.

    ``rules``: the role's shifting policy; with it and ``spec.initialGear`` unset, the initial gear is the
    one with the fewest GPUs predicted to meet the SLO at the expected load
    (:func:`gearshift.control.capacity.initial_gear`), else the planner's :func:`initial_gear`."""
    gnames = [g.name for g in rs.gears]
    rs.in_flight = _in_flight(rs.gs)
    st = rs.gs.status
    if st.active_gear in gnames:
        rs.active = st.active_gear
    else:
        cheapest = None
        if rules is not None and rs.gs.spec.initial_gear not in gnames:
            cheapest = capacity.initial_gear(gear_views(rs.gears), rules)
        rs.active = cheapest or initial_gear(rs.gears, rs.gs.spec.initial_gear)
    run = [rs.active]
    # A GearSet being deleted gets no shadow applied: its deletion handler frees the gears not serving,
    # and a reconcile after that would start them again, with no GearSet left to free them.
    deleting = bool(rs.gs.metadata.get("deletionTimestamp"))
    if rs.in_flight and st.executor and not deleting:
        run += [g for g in (st.executor.from_gear, st.executor.to_gear, st.target_gear) if g in gnames]
    return [g for g in rs.gears if g.name in dict.fromkeys(run)]


def _rules(pds: PDService, rs: RoleState) -> ShiftRules | None:
    """The role's shifting policy, or ``None`` when it cannot be built (the shifting loop reports why)."""
    try:
        return gearset_rules(rs.gs, pds)
    except ValueError:
        return None


def role_desire(rs: RoleState, gears: Sequence[Gear]) -> RoleDesire:
    """What to run for a role: ``gears``, its Service on the active gear unless a shift is in flight
    (the executor owns the selector then), and the GearSet's replicas, drain time and memory share."""
    return RoleDesire(
        rs.role,
        list(gears),
        None if rs.in_flight else rs.active,
        rs.gs.spec.replicas,
        rs.gs.spec.policy.drain_timeout_s,
        memory_utilization(rs.gs),
        rs.links,
    )


def desired_state(
    pds: PDService,
    roles: dict[str, RoleState],
    nodes: dict[str, dict[str, Any]],
    profiles: dict[str, dict[str, Any]],
    settings: PlanSettings,
    now: datetime,
    bound: Collection[str] = (),
    memo: PlanMemo = no_memo,
) -> DesiredState:
    """Plan the ``auto`` roles, pick each role's active gear and check the running gears' placement:
    ``gearshift.handlers.reconcile.reconcile_service`` applies the result, ``gearshift render`` prints it.

    ``roles`` come from :func:`role_state` and are updated in place (gears, active gear, links, status
    patch); ``bound`` are the nodes the service's pods are bound to or its StatefulSets are pinned to
    (:func:`bound_nodes`); ``memo`` may serve plans already made for the same inputs hash.
    """
    missing, events = plan_roles(pds, roles, nodes, profiles, settings.sim_requests, now, memo)
    want = DesiredState([], missing, [], [], set(), events)
    for role, rs in roles.items():
        if rs.plan_error:
            want.problems.append(rs.plan_error)
        if not rs.gears:
            want.problems.append(f"{role}: GearSet {rs.gs.metadata['name']!r} has no gears yet")
            continue
        run_gears = pick_active(rs, _rules(pds, rs))
        for g in run_gears:
            p, lo = placement_problems(role, g, nodes, bound)
            want.problems += p
            want.lost += lo
            if p:
                want.skip_gears.add((role, g.name))
        want.desires.append(role_desire(rs, [g for g in run_gears if (role, g.name) not in want.skip_gears]))
    return want


def gearset_status_patch(rs: RoleState, now: datetime) -> dict[str, Any]:
    """The GearSet status patch: planned gears, active gear, phase, selector, Planned condition; the
    autoscale state dropped when the scaling section went. Empty when nothing changes."""
    patch = dict(rs.gs_status_patch)
    st = rs.gs.status
    generation = rs.gs_body["metadata"].get("generation")
    if bool(st.autoscaled) != rs.autoscaled:
        patch["autoscaled"] = rs.autoscaled  # starts or stops the GearSet's autoscale daemon
    if rs.active and st.active_gear != rs.active and not rs.in_flight:
        patch["activeGear"] = rs.active
    if st.phase in (None, "Pending") and rs.active:
        patch["phase"] = "Stable"
    if rs.active:
        sel = ",".join(
            f"{k}={v}" for k, v in names.engine_labels(rs.gs.spec.service_name, rs.role, rs.active, 0).items()
        )
        if st.selector != sel:
            patch["selector"] = sel
    if rs.gs.spec.mode == "auto" and (rs.plan_error or rs.gears):
        status: ConditionStatus = "False" if rs.plan_error else "True"
        reason = REASON_PLAN_FAILED if rs.plan_error else REASON_PLANNED
        msg = rs.plan_error or f"{len(rs.gears)} gear(s) planned"
        conds, changed = set_condition(
            list(st.conditions), COND_PLANNED, status, reason, msg, now, generation
        )
        if changed:
            patch["conditions"] = [c.to_json() for c in conds]
    if not rs.autoscaled and (
        st.scaling is not None or any(c.type == COND_SCALING_ACTIVE for c in st.conditions)
    ):
        # The autoscale daemon stops when the scaling section goes; its last state must not linger as if
        # it still described the role.
        patch["scaling"] = None
        kept = patch.get("conditions", [c.to_json() for c in st.conditions])
        patch["conditions"] = [c for c in kept if c.get("type") != COND_SCALING_ACTIVE]
    if patch or st.observed_generation != generation:
        # Written as soon as this reconcile has read (and goes on to apply) the GearSet's spec, not only
        # with other news: a spec edit that changes nothing else here (a gear's microBatch) would
        # otherwise leave it behind until the shifting loop's next write (#31: 27 s under load).
        patch["observedGeneration"] = generation
    return patch


# --- garbage collection -----------------------------------------------------------------------------
def stale_statefulsets(
    statefulsets: Iterable[Mapping[str, Any]], want: DesiredState, in_flight: Collection[str]
) -> list[str]:
    """Names of the engine ``statefulsets`` to delete: of gears no longer wanted (a spec edit renamed or
    removed one, a re-plan), or stages past the end of a gear that lost stages.

    Kept: everything of a role with a shift ``in_flight`` (role names: the executor deletes its gears),
    and gears left as they are because they cannot be placed (``want.skip_gears``)."""
    wanted = {(d.role, g.name): len(g.stages) for d in want.desires for g in d.gears}
    out = []
    for obj in statefulsets:
        labels = obj["metadata"].get("labels") or {}
        role, gear = labels.get(names.LABEL_ROLE, ""), labels.get(names.LABEL_GEAR, "")
        if role in in_flight or (role, gear) in want.skip_gears:
            continue
        stages = wanted.get((role, gear))
        if stages is None or int(labels.get(names.LABEL_STAGE, "0")) >= stages:
            out.append(str(obj["metadata"]["name"]))
    return out


def stale_gear_services(
    services: Iterable[Mapping[str, Any]], want: DesiredState, in_flight: Collection[str]
) -> list[str]:
    """Names of the engine ``services`` to delete: gears' headless Services whose gear is neither wanted
    nor left as it is, of roles without a shift ``in_flight``. Services without a gear label (the role
    Services) stay."""
    keep = {(d.role, g.name) for d in want.desires for g in d.gears} | want.skip_gears
    out = []
    for svc in services:
        labels = svc["metadata"].get("labels") or {}
        role, gear = labels.get(names.LABEL_ROLE), labels.get(names.LABEL_GEAR)
        if gear and role not in in_flight and (role, gear) not in keep:
            out.append(str(svc["metadata"]["name"]))
    return out


# --- readiness and the PDService's status -----------------------------------------------------------
def current_ready(sts: Mapping[str, Any]) -> int:
    """Ready pods of a StatefulSet that run its current spec, at least (a lower bound).

    Its status counts Ready pods of every revision (``readyReplicas``) and pods of the update revision
    (``updatedReplicas``) among the pods it has (``replicas``); every pod not updated may be one of the
    Ready ones, so ``readyReplicas - (replicas - updatedReplicas)`` are Ready *and* updated. Exact once
    the rollout ends. Until the controller has observed the StatefulSet's generation its counts are of
    the previous spec (as read: the caller does not call the gear rolled out meanwhile)."""
    meta, s = sts.get("metadata") or {}, sts.get("status") or {}
    ready = int(s.get("readyReplicas") or 0)
    if s.get("observedGeneration") != meta.get("generation"):
        return ready
    updated = int(s.get("updatedReplicas") or 0)
    pods = int(s["replicas"]) if s.get("replicas") is not None else max(ready, updated)
    return max(0, ready - max(0, pods - updated))


def rollout_wait(sts: Mapping[str, Any] | None, name: str, want: int) -> str:
    """Why StatefulSet ``name`` (``sts``, None: not there) has not rolled out ``want`` pods of its
    current spec, as ``kubectl rollout status`` judges it; ``""`` when it has.

    In order: not created, generation not observed yet (status is of an older spec), rollout to the
    update revision not complete (``currentRevision`` ≠ ``updateRevision``, or pods not updated), pods
    not Ready."""
    if sts is None:
        return f"StatefulSet {name} not created yet"
    s, gen = sts.get("status") or {}, (sts.get("metadata") or {}).get("generation")
    seen = s.get("observedGeneration")
    if seen != gen:
        return f"StatefulSet {name} has not observed generation {gen} yet (status of {seen})"
    updated, ready = int(s.get("updatedReplicas") or 0), int(s.get("readyReplicas") or 0)
    update_rev, current_rev = s.get("updateRevision"), s.get("currentRevision")
    if updated < want or (update_rev and current_rev and update_rev != current_rev):
        rev = f" {update_rev}" if update_rev else ""
        return (
            f"StatefulSet {name}: {min(updated, want)}/{want} pods at the new revision{rev}, "
            f"{min(current_ready(sts), want)} Ready"
        )
    if ready < want:
        return f"StatefulSet {name}: {ready}/{want} pods Ready"
    return ""


def role_readiness(
    rs: RoleState,
    sts: Mapping[str, Mapping[str, Any]],
    pds: PDService,
    service: str,
    ns: str,
    images: Images,
) -> Readiness:
    """The :class:`Readiness` of a role's active gear from the service's StatefulSets (``sts``, by name);
    all zero and not rolled out while the role has no active gear."""
    if not rs.active:
        return Readiness(0, 0, False, 0, "no active gear yet")
    gear = next(g for g in rs.gears if g.name == rs.active)
    desire = RoleDesire(rs.role, [gear], rs.active, rs.gs.spec.replicas)
    ctx = engine_context(service, ns, pds.spec, desire, images, gear)
    want = [stage_replicas(ctx, gear, k) for k in range(len(gear.stages))]
    desired = min(want) if want else 0
    ready = desired
    pipelines = ctx.pipeline_replicas
    waiting = ""
    for k in range(len(gear.stages)):
        name = names.stage_statefulset_name(service, rs.role, gear.name, k)
        obj = sts.get(name)
        r = 0 if obj is None else current_ready(obj)
        ready = min(ready, r)
        per = want[k] // ctx.pipeline_replicas if ctx.pipeline_replicas else 0
        pipelines = min(pipelines, r // per) if per else pipelines
        waiting = waiting or rollout_wait(obj, name, want[k])
    return Readiness(ready, desired, not waiting, pipelines, waiting)


_COPIES_ATTR = {"readyCopies": "ready_copies", "desiredCopies": "desired_copies", "ready": "ready"}


def copies_status(ready: int, desired: int) -> dict[str, Any]:
    """GearSet status fields of the READY column: serving copies of the model Ready and wanted (pods of
    the active gear's narrowest stage, what the PDService's Ready message counts), and ``"ready/wanted"``
    (a printer column shows one JSONPath, so the pair is written as one string, as a Deployment shows)."""
    return {"readyCopies": ready, "desiredCopies": desired, "ready": f"{ready}/{desired}"}


def rollouts_starting(
    desired: Iterable[Mapping[str, Any]],
    live: Mapping[str, Mapping[str, Any]],
    active: Mapping[str, str | None],
) -> list[str]:
    """What applying ``desired`` will start rolling among the serving gears: ``"<role> gear <gear>:
    StatefulSet <name> gets a new pod template"`` for each desired StatefulSet of a role's active gear
    (``active``: role → gear) whose template fingerprint (``ANNOTATION_TEMPLATE_HASH``) differs from the
    live one's (``live``: by name; a StatefulSet not there yet starts no rollout: nothing serves from
    it). A live StatefulSet without the annotation (written by an older operator) counts as changing:
    saying Progressing once too often is the safe side."""
    out = []
    for obj in desired:
        if obj.get("kind") != "StatefulSet":
            continue
        meta = obj.get("metadata") or {}
        labels = meta.get("labels") or {}
        role, gear, name = labels.get(names.LABEL_ROLE), labels.get(names.LABEL_GEAR), meta.get("name")
        old = live.get(str(name))
        if old is None or not isinstance(role, str) or active.get(role) != gear:
            continue
        want = (meta.get("annotations") or {}).get(ANNOTATION_TEMPLATE_HASH)
        have = ((old.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_TEMPLATE_HASH)
        if want != have:
            out.append(f"{role} gear {gear}: StatefulSet {name} gets a new pod template")
    return out


def rollout_ahead(starting: Sequence[str]) -> list[ConditionUpdate]:
    """The conditions written *before* applying objects that start ``starting`` (:func:`rollouts_starting`):
    ``Progressing=True`` and ``Ready=False`` (``RollingOut``), so that no read of the PDService after the
    StatefulSets changed can find it Ready on the old revision."""
    msg = "; ".join(starting)
    return [
        ConditionUpdate(COND_PROGRESSING, "True", REASON_ROLLING_OUT, msg),
        ConditionUpdate(COND_READY, "False", REASON_ROLLING_OUT, msg),
    ]


def gearset_rollout_ahead(
    rs: RoleState, starting: Sequence[str], now: datetime, conditions: Sequence[Condition] | None = None
) -> dict[str, Any]:
    """The GearSet status patch written before a rollout of its role's gear starts (``starting`` as
    :func:`rollouts_starting` gives it): ``Ready=False`` (``RollingOut``) at the GearSet's generation, set
    into ``conditions`` (default: the GearSet's as read). Empty when none of ``starting`` is this role's."""
    mine = [m for m in starting if m.startswith(f"{rs.role} gear ")]
    if not mine:
        return {}
    ready = ConditionUpdate(COND_READY, "False", REASON_ROLLING_OUT, "; ".join(mine))
    return gearset_condition_patch(rs, ready, now, conditions)


def gearset_condition_patch(
    rs: RoleState, update: ConditionUpdate, now: datetime, conditions: Sequence[Condition] | None = None
) -> dict[str, Any]:
    """``{"conditions": [...]}`` with ``update`` set into ``conditions`` (default: the GearSet's as read)
    at the GearSet's generation; empty when that changes nothing stored (a bare generation bump counts:
    kubectl's wait reads it)."""
    base = list(rs.gs.status.conditions if conditions is None else conditions)
    generation = rs.gs_body["metadata"].get("generation")
    conds, _ = set_condition(base, update.type, update.status, update.reason, update.message, now, generation)
    new = [c.to_json() for c in conds]
    return {"conditions": new} if new != [c.to_json() for c in base] else {}


def gearset_ready(rs: RoleState, readiness: Readiness) -> ConditionUpdate:
    """The GearSet's ``Ready`` condition: True only when the role's active gear is served by pods of the
    GearSet's current spec (every stage rolled out, as ``kubectl rollout status`` judges it, and every
    wanted pipeline Ready); a pod of an older revision does not count (:class:`Readiness`)."""
    gear = rs.active or "-"
    if not rs.active:
        return ConditionUpdate(COND_READY, "False", REASON_NOT_READY, "no active gear yet")
    if not readiness.rolled:
        why = readiness.waiting or "rolling out"
        return ConditionUpdate(COND_READY, "False", REASON_ROLLING_OUT, f"gear {gear}: {why}")
    if readiness.ready < readiness.desired:
        return ConditionUpdate(
            COND_READY,
            "False",
            REASON_NOT_READY,
            f"gear {gear}: {readiness.ready}/{readiness.desired} pods Ready",
        )
    return ConditionUpdate(
        COND_READY,
        "True",
        REASON_ALL_READY,
        f"gear {gear}: {readiness.pipelines} pipeline(s) of the current spec serve",
    )


def readiness_patch(
    rs: RoleState,
    readiness: Readiness,
    now: datetime | None = None,
    conditions: Sequence[Condition] | None = None,
) -> dict[str, Any]:
    """The GearSet status fields that differ from ``readiness``: the READY column's and, for a role the
    autoscaler does not scale, ``replicas`` (the ready pipelines). With ``now``, also the ``Ready``
    condition (:func:`gearset_ready`) set into ``conditions`` (default: the GearSet's as read), stamped
    with the GearSet's generation so that ``kubectl wait --for=condition=Ready`` waits out an edit the
    reconcile has not rolled out yet (kubectl's wait compares a condition's ``observedGeneration`` with
    ``metadata.generation``). Empty when nothing changes."""
    st = rs.gs.status
    counts = copies_status(readiness.ready, readiness.desired)
    patch = {k: v for k, v in counts.items() if getattr(st, _COPIES_ATTR[k]) != v}
    if not rs.autoscaled and st.replicas != readiness.pipelines:
        # The autoscaler writes it for the roles it scales; the scale subresource (HPA, KEDA) reads it
        # for every role.
        patch["replicas"] = readiness.pipelines
    if now is not None:
        patch |= gearset_condition_patch(rs, gearset_ready(rs, readiness), now, conditions)
    return patch


def unschedulable(pods: Sequence[Mapping[str, Any]]) -> list[str]:
    """``"pod NAME: MESSAGE"`` of each pod the scheduler reports it cannot place, sorted."""
    out = []
    for pod in pods:
        for c in (pod.get("status") or {}).get("conditions") or []:
            if (
                c.get("type") == "PodScheduled"
                and c.get("status") == "False"
                and c.get("reason") == "Unschedulable"
            ):
                out.append(f"pod {pod['metadata']['name']}: {c.get('message', 'unschedulable')}")
    return sorted(out)


def router_ready(router: Mapping[str, Any] | None) -> bool:
    """Whether the router Deployment (None: not there) has an available replica."""
    return bool(router and int((router.get("status") or {}).get("availableReplicas") or 0) >= 1)


def placed_condition(
    missing: Sequence[str], problems: Sequence[str], unsched: Sequence[str], plan_failed: bool
) -> ConditionUpdate:
    """The Placed condition: True when nothing is ``missing`` (GPUProfiles), no gear has placement
    ``problems`` and no pod is unschedulable (``unsched``); the reason says which when one is alone."""
    msgs = [*missing, *problems, *unsched]
    if not msgs:
        return ConditionUpdate(
            COND_PLACED, "True", REASON_ALL_PLACED, "every stage of the active gears has its nodes"
        )
    if missing and not problems and not unsched:
        reason = REASON_PROFILES_MISSING
    elif plan_failed and not unsched:
        reason = REASON_PLAN_FAILED
    elif unsched and not (missing or problems):
        reason = REASON_UNSCHEDULABLE
    else:
        reason = REASON_PLACEMENT_FAILED
    return ConditionUpdate(COND_PLACED, "False", reason, "; ".join(msgs), warning=True)


def degraded_condition(lost: Collection[str]) -> ConditionUpdate:
    """The Degraded condition: True (a Warning) when nodes under running stages are ``lost``."""
    if lost:
        msg = f"node(s) {', '.join(sorted(set(lost)))} under running stages are gone or not Ready"
        return ConditionUpdate(COND_DEGRADED, "True", REASON_NODE_LOST, msg, warning=True)
    return ConditionUpdate(
        COND_DEGRADED, "False", REASON_AS_PLANNED, "every node under a running stage is Ready"
    )


def service_phase(lost: bool, ready: bool, unplaced: bool, serving_any: bool) -> str:
    """The PDService's phase: Degraded when a node under a running stage is lost, else Ready when both
    roles and the router serve, else Pending when something cannot be placed and no role has a Ready
    pipeline (``serving_any``), else Progressing."""
    if lost:
        return "Degraded"
    if ready:
        return "Ready"
    if unplaced and not serving_any:
        return "Pending"
    return "Progressing"


def progressing_condition(rolling: Sequence[str], router_is_ready: bool) -> ConditionUpdate:
    """The Progressing condition: True (``RollingOut``) while some role's active gear rolls out
    (``rolling``: one ``"<role> gear <gear>: <why>"`` per such role) or the router has no available
    replica, else False (``Reconciled``)."""
    if rolling:
        return ConditionUpdate(COND_PROGRESSING, "True", REASON_ROLLING_OUT, "; ".join(rolling))
    if not router_is_ready:
        return ConditionUpdate(
            COND_PROGRESSING, "True", REASON_ROLLING_OUT, "the router Deployment has no available replica"
        )
    return ConditionUpdate(COND_PROGRESSING, "False", REASON_RECONCILED, "owned objects match the spec")


def role_status(rs: RoleState, readiness: Readiness) -> dict[str, Any]:
    """A role's entry in the PDService status (``status.prefill``, ``status.decode``, ``status.serving``)."""
    return {
        "gearSet": rs.gs.metadata["name"],
        "activeGear": rs.active,
        "readyReplicas": readiness.ready,
        "desiredReplicas": readiness.desired,
    }


def service_verdict(
    name: str,
    ns: str,
    want: DesiredState,
    roles: Mapping[str, RoleState],
    readiness: Mapping[str, Readiness],
    unsched: Sequence[str],
    router_is_ready: bool,
    old_status: Mapping[str, Any],
) -> ServiceVerdict:
    """The PDService's conditions, phase and status after a reconcile of ``name`` in ``ns`` applied
    ``want``; ``readiness`` by role (:func:`role_readiness`), ``unsched`` the unschedulable pods
    (:func:`unschedulable`), ``old_status`` the status read (``windowLeaveBy`` is cleared once set)."""
    roles_st = {role: role_status(rs, readiness[role]) for role, rs in roles.items()}
    # Scaled to zero (GearSet replicas 0) is a served state too: every wanted pipeline is there.
    all_ready = all(r.ready >= r.desired for r in readiness.values())
    # Ready means served by the current spec (#31): a role whose StatefulSets still roll to a new
    # revision is served, if at all, by pods of the old one, so it is not Ready however many pods are.
    rolling = [
        f"{role} gear {roles[role].active or '-'}: {r.waiting or 'rolling out'}"
        for role, r in readiness.items()
        if not r.rolled
    ]
    ready = all_ready and not rolling and router_is_ready
    placed_msgs = [*want.missing, *want.problems, *unsched]
    serving = "prefill, decode" if len(roles_st) > 1 else "the serving pipelines"
    waiting = ", ".join(f"{r} {s['readyReplicas']}/{s['desiredReplicas']}" for r, s in roles_st.items())
    plan_failed = any(rs.plan_error for rs in roles.values())
    conditions = [
        placed_condition(want.missing, want.problems, unsched, plan_failed),
        degraded_condition(want.lost),
        progressing_condition(rolling, router_is_ready),
        ConditionUpdate(COND_READY, "True", REASON_ALL_READY, f"{serving} and the router serve")
        if ready
        else ConditionUpdate(
            COND_READY,
            "False",
            REASON_NOT_READY,
            "".join(f"{r}; " for r in rolling)
            + f"ready pipelines: {waiting}; router {'ready' if router_is_ready else 'not ready'}",
        ),
    ]
    serving_any = any(s["readyReplicas"] for s in roles_st.values())
    phase = service_phase(bool(want.lost), ready, bool(placed_msgs), serving_any)
    status: dict[str, Any] = {
        "phase": phase,
        "routerReady": router_is_ready,
        "endpoint": f"{name}.{ns}.svc:8000",
        "message": "; ".join(placed_msgs)[:4000] if placed_msgs else "",
    }
    for role, section in ROLE_SECTIONS.items():
        if role in roles_st:
            status[section] = roles_st[role]
        elif old_status.get(section) is not None:
            status[section] = None  # the service changed shape: drop the other shape's entry
    leave_by = min((rs.window_leave_by for rs in roles.values() if rs.window_leave_by), default=None)
    if leave_by is not None or old_status.get("windowLeaveBy") is not None:
        status["windowLeaveBy"] = leave_by  # None deletes it (merge patch)
    return ServiceVerdict(conditions, phase, ready, not placed_msgs, status)


def refusal(old_status: Mapping[str, Any], reason: str, msg: str) -> tuple[ConditionUpdate, dict[str, Any]]:
    """``(condition, status)`` of a PDService whose spec cannot be served (``reason``, ``msg``).

    Nothing is applied then, so a service that was Ready (``old_status``'s conditions) still serves its
    last applied spec: the edit is refused (Progressing=False, phase Degraded) and Ready is kept, rather
    than Failed, which monitoring would read as down. Otherwise Ready=False and phase Failed."""
    serving = any(
        c.get("type") == COND_READY and c.get("status") == "True" for c in old_status.get("conditions") or []
    )
    if serving:
        cond = ConditionUpdate(
            COND_PROGRESSING, "False", reason, f"{msg}; still serving the last applied spec", warning=True
        )
        return cond, {
            "phase": "Degraded",
            "message": f"spec not applied, serving the last applied one: {msg}",
        }
    return ConditionUpdate(COND_READY, "False", reason, msg, warning=True), {
        "phase": "Failed",
        "message": msg,
    }


def gearsets_missing(msg: str) -> tuple[list[ConditionUpdate], dict[str, Any]]:
    """``(conditions, status)`` of a PDService whose GearSets are not there yet (``msg`` names them)."""
    conditions = [
        ConditionUpdate(COND_PLACED, "False", REASON_GEARSET_MISSING, msg, warning=True),
        ConditionUpdate(COND_READY, "False", REASON_GEARSET_MISSING, msg),
    ]
    return conditions, {"phase": "Pending", "message": msg}


def services_using(bodies: Iterable[Mapping[str, Any]], gearset: str) -> list[str]:
    """Names of the PDServices among ``bodies`` whose prefill, decode or serving refers to GearSet
    ``gearset``."""
    out = []
    for b in bodies:
        spec = b.get("spec") or {}
        refs = {(spec.get(r) or {}).get("gearSetRef", {}).get("name") for r in ROLE_SECTIONS.values()}
        if gearset in refs:
            out.append(b["metadata"]["name"])
    return sorted(out)
