"""The PDService reconciler: read the PDService, its two GearSets and the fleet; plan ``auto`` GearSets;
apply the owned objects; delete gears no longer wanted; write status, conditions and events.

Level-triggered and idempotent: every call recomputes the whole desired state from what it reads, applies
it with server-side apply (a no-op when nothing changed: no resourceVersion moves), and patches status only
when it differs. It is plain synchronous code over :class:`~gearshift.handlers.kubeapi.KubeApi`, so unit
tests drive it with an in-memory API and kopf runs it in its thread pool (handlers/pdservice.py).

Exceptions (the kopf handlers turn them into kopf errors)::

    ReconcileError
     ├── SpecInvalid      the PDService or a GearSet cannot be used as written (permanent)
     └── NotYet           something referenced is not there yet (retry after ``delay`` s)

A shift in flight (GearSet ``status.executor.step`` in Warming/Draining/Switching/RollingBack) belongs to
the gear executor (issue 9): the reconciler then keeps both gears' pods, leaves the role Service's
selector alone and deletes no gear; the executor drives the objects through :func:`ensure_gear_sync`,
:func:`select_gear_sync` and :func:`delete_gear_sync`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

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
    REASON_INVALID_SPEC,
    REASON_NODE_LOST,
    REASON_PLACEMENT_FAILED,
    REASON_PLAN_FAILED,
    REASON_PLANNED,
    REASON_RECONCILED,
    REASON_WINDOW_CLOSING,
    REASON_WINDOW_VACATED,
    REASON_WINDOWED_IN_USE,
    format_validation_error,
    inputs_hash,
)
from gearshift.api.gearset import Gear, GearSet, Workload
from gearshift.api.pdservice import PDService
from gearshift.control.reconcile import SHIFT_STEPS
from gearshift.control.windows import (
    WindowTiming,
    next_leave_by,
    planner_windows,
    vacate_name,
    windowed_nodes,
)
from gearshift.facts.model import VLLM_GPU_MEMORY_UTILIZATION
from gearshift.handlers import common
from gearshift.handlers.common import ConditionBook, conditions_from, emit, now_utc, patch_status
from gearshift.handlers.kubeapi import DEPLOY, GPUP, GS, NODE, PDS, POD, STS, SVC, KubeApi
from gearshift.k8s import names
from gearshift.k8s.desired import (
    Images,
    RoleDesire,
    desired_objects,
    engine_context,
    gear_objects,
    owner_reference,
)
from gearshift.k8s.engine import EngineSpecError
from gearshift.k8s.fleetsplit import split_pools
from gearshift.k8s.placement import pinned_nodes
from gearshift.k8s.services import build_role_service
from gearshift.k8s.statefulset import stage_replicas
from gearshift.planner.inputs import (
    api_gear,
    engine_stage_limit,
    gear_links,
    initial_gear,
    node_ready,
    resource_profile,
    role_candidates,
    stage_limit_problems,
    usable_profile,
)

log = logging.getLogger(__name__)


#: Retry delay when a referenced object is missing, s.
NOT_YET_DELAY_S = 15.0
#: Plans kept in memory, keyed by their inputs hash (many PDServices of one model share a fleet).
PLAN_CACHE_SIZE = 128


class ReconcileError(Exception):
    """Base of the reconciler's errors."""


class SpecInvalid(ReconcileError):
    """The PDService or one of its GearSets cannot be used as written; retrying will not help."""


class NotYet(ReconcileError):
    """Something the PDService references is not there yet; retry after ``delay`` s."""

    def __init__(self, message: str, delay: float = NOT_YET_DELAY_S) -> None:
        super().__init__(message)
        self.delay = delay


@dataclass(frozen=True)
class Settings:
    """Operator-wide settings (from ``gearshift operator`` flags)."""

    images: Images = field(default_factory=Images)
    prometheus_url: str | None = None
    sim_requests: int = 500
    """Requests per planner simulation run (bounds planning time per gear candidate)."""


@dataclass
class Outcome:
    """What one reconcile did (for metrics, logs and tests)."""

    applied: int = 0
    deleted: int = 0
    planned: list[str] = field(default_factory=list)
    phase: str = ""
    ready: bool = False
    placed: bool = True
    auto: bool = False
    """Some role plans from GPUProfiles (a fleet change may re-plan it)."""
    nodes: set[str] = field(default_factory=set)
    """Nodes named by the running gears' stages (a change of one of them concerns this service)."""


_plan_cache: OrderedDict[str, list[Gear]] = OrderedDict()
_plan_lock = threading.Lock()
_service_locks: dict[tuple[str, str], threading.Lock] = {}
_locks_lock = threading.Lock()


def service_lock(namespace: str, name: str) -> threading.Lock:
    """The lock serialising reconciles of one PDService (kopf threads, fleet triggers, the executor)."""
    with _locks_lock:
        return _service_locks.setdefault((namespace, name), threading.Lock())


#: Seconds a read of the fleet (Nodes, GPUProfiles) serves other reconciles: a wave of reconciles after a
#: fleet event or at start-up reads the cluster-scoped lists once, not once per PDService.
FLEET_TTL_S = 2.0
_fleet_cache: dict[int, tuple[float, dict[str, Any], dict[str, Any]]] = {}


def fleet(api: KubeApi) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """``(nodes, profiles)`` by name, read at most every :data:`FLEET_TTL_S` s per API object."""
    now = time.monotonic()
    with _plan_lock:
        hit = _fleet_cache.get(id(api))
    if hit is not None and now - hit[0] < FLEET_TTL_S:
        return hit[1], hit[2]
    nodes = {n["metadata"]["name"]: n for n in api.list(*NODE)}
    profiles = {p["metadata"]["name"]: p for p in api.list(*GPUP)}
    with _plan_lock:
        _fleet_cache[id(api)] = (now, nodes, profiles)
    return nodes, profiles


def forget_fleet() -> None:
    """Drop the cached fleet (a Node or GPUProfile changed)."""
    with _plan_lock:
        _fleet_cache.clear()


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
    explicit gear): reporting it as lost would mark the service Degraded for a node it never had. Pure.
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


def plan_assumptions(gs: GearSet) -> planner.RooflineAssumptions:
    """The roofline assumptions a GearSet's plan prices with: its ``plan.workload`` request shape and its
    role (a prefill role's gears run only prompts, a decode role's only decode steps). Pure."""
    w = gs.spec.plan.workload if gs.spec.plan else Workload()
    return planner.RooflineAssumptions(
        prompt_tokens=w.prompt_tokens, output_tokens=w.output_tokens, role=gs.spec.role
    )


def _cached_plan(
    key: str,
    doc: dict[str, Any],
    pds: PDService,
    gs: GearSet,
    settings: Settings,
    windows: planner.Windows | None = None,
) -> list[Gear]:
    with _plan_lock:
        if key in _plan_cache:
            _plan_cache.move_to_end(key)
            return list(_plan_cache[key])
    profile = planner.parse_profile(doc)
    cost = planner.RooflineCostModel(pds.spec.model.to_model_arch(), plan_assumptions(gs))
    intents = list(gs.spec.plan.intents) if gs.spec.plan else list(planner.INTENTS)
    limit = engine_stage_limit(pds.spec.engine, gs.spec.role)  # vLLM decode: one stage (issue 18)
    result = planner.plan(
        profile,
        cost,
        intents=intents,
        sim_requests=settings.sim_requests,
        windows=windows,
        max_stages=limit.max_stages if limit else None,
        max_stages_why=limit.reason if limit else "",
    )
    gears = [api_gear(g, intent, doc, {}) for g, intent in zip(result.gears, intents, strict=True)]
    with _plan_lock:
        _plan_cache[key] = gears
        while len(_plan_cache) > PLAN_CACHE_SIZE:
            _plan_cache.popitem(last=False)
    return list(gears)


def _gpu_counts(gears: list[Gear], profiles: Mapping[str, Mapping[str, Any]]) -> list[Gear]:
    """Stage ``gpus`` = the least GPU count among the stage's nodes' profiles (the planner plans nodes)."""
    out = []
    for g in gears:
        stages = []
        for st in g.stages:
            counts = []
            for n in st.nodes:
                eff = usable_profile(profiles[n]) if n in profiles else None
                counts.append(eff.gpu_count if eff and eff.gpu_count else 1)
            stages.append(st.model_copy(update={"gpus": min(counts) if counts else st.gpus}))
        out.append(g.model_copy(update={"stages": stages}))
    return out


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
    decode: one, :func:`gearshift.planner.inputs.engine_stage_limit`), before anything is applied. Pure.

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


def role_state(pds: PDService, service: str, role: str, gs_body: dict[str, Any]) -> RoleState:
    """The :class:`RoleState` of ``role`` of PDService ``service`` from the body of the GearSet its
    ``gearSetRef`` names. Pure (``gearshift render`` calls it too).

    Raises:
        SpecInvalid: the GearSet does not validate, or serves another service or role.
    """
    ref = getattr(pds.spec, role).gear_set_ref.name
    try:
        gs = GearSet.model_validate(gs_body)
    except ValidationError as exc:
        raise SpecInvalid(f"GearSet {ref!r} is invalid:\n{format_validation_error(exc, 'spec')}") from None
    if gs.spec.role != role or gs.spec.service_name != service:
        raise SpecInvalid(
            f"{role}.gearSetRef names GearSet {ref!r}, which serves service "
            f"{gs.spec.service_name!r} role {gs.spec.role!r}; set its spec.serviceName: {service} and "
            f"spec.role: {role}, or refer to another GearSet"
        )
    return RoleState(role, gs_body, gs, autoscaled=getattr(pds.spec, role).scaling is not None)


def _read_gearsets(api: KubeApi, body: Mapping[str, Any], pds: PDService) -> dict[str, RoleState]:
    ns = body["metadata"]["namespace"]
    name = body["metadata"]["name"]
    out: dict[str, RoleState] = {}
    missing = []
    for role in names.ROLES:
        ref = getattr(pds.spec, role).gear_set_ref.name
        gs_body = api.get(*GS, ns, ref)
        if gs_body is None:
            missing.append(f"{role}.gearSetRef {ref!r}")
            continue
        out[role] = role_state(pds, name, role, gs_body)
    if missing:
        raise NotYet(f"GearSet not found: {'; '.join(missing)}; create it in namespace {ns}")
    return out


def _plan_roles(
    pds: PDService,
    roles: dict[str, RoleState],
    nodes: dict[str, dict[str, Any]],
    profiles: dict[str, dict[str, Any]],
    settings: Settings,
    events: list[tuple[str, str, str, bool]],
    now: datetime,
) -> list[str]:
    """Plan the auto roles on their split pools; returns what is missing (for the Placed condition).

    Also reports each role's time-limited nodes (``windowedNodes``, events when work lands on one or
    must leave it; :mod:`gearshift.control.windows`)."""
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
    pre, dec = split_pools(pools["prefill"], pools["decode"])
    split = {"prefill": pre, "decode": dec}
    arch = pds.spec.model.to_model_arch().to_dict()
    for role, rs in roles.items():
        if rs.gs.spec.mode != "auto":
            rs.gears = list(rs.gs.spec.gears)
            continue
        plan_spec = rs.gs.spec.plan
        cons = plan_spec.constraints if plan_spec else None
        memutil = cons.memory_utilization if cons else VLLM_GPU_MEMORY_UTILIZATION
        pool = sorted(split[role])
        rs.gears = list(rs.gs.status.planned_gears)
        if not pool:
            rs.plan_error = (
                f"{role}: no usable GPU node to plan on (constraints, profiles, or the other role's share)"
            )
            continue
        doc = resource_profile(pool, profiles, nodes, memutil)
        intents = list(plan_spec.intents) if plan_spec else list(planner.INTENTS)
        # Time-limited nodes (issue 13): the fingerprint moves only when one crosses its leaveBy.
        deadlines = _deadlines(pool, profiles)
        pol = rs.gs.spec.policy
        timing = WindowTiming(
            cons.window_margin_s if cons else 300.0,
            pol.dwell_s,
            pol.warm_s + pol.drain_timeout_s + pol.rollback_window_s,
        )
        windows, wkey = planner_windows(deadlines, now, timing) if deadlines else (None, {})
        parts: list[Any] = [doc, cons.to_json() if cons else {}, arch, intents, settings.sim_requests]
        if plan_spec and plan_spec.workload != Workload():
            # Only a stated workload enters the fingerprint, so plans made before the field existed keep
            # their hash (no re-plan on upgrade); the role is fixed per GearSet.
            parts.append(plan_spec.workload.to_json())
        limit = engine_stage_limit(pds.spec.engine, role)
        if limit is not None:  # likewise only when set: sim plans keep their hash
            parts.append({"maxStages": limit.max_stages})
        key = inputs_hash(*parts, wkey) if wkey else inputs_hash(*parts)
        profile = planner.parse_profile(doc)
        running = _running(rs.gs)
        closing = {n for n, state in wkey.items() if state == "left"}
        if key != rs.gs.status.profiles_hash or not rs.gears:
            try:
                gears = _gpu_counts(_cached_plan(key, doc, pds, rs.gs, settings, windows), profiles)
            except planner.PlanError as exc:
                rs.plan_error = f"{role}: the planner found no gear on {len(pool)} node(s): {exc}"
                continue
            gears = merge_plan(rs.gs.status.planned_gears, gears, running, closing, nodes)
            rs.gears = gears
            rs.gs_status_patch["plannedGears"] = [g.to_json() for g in gears]
            rs.gs_status_patch["profilesHash"] = key
            events.append((role, REASON_PLANNED, plan_message(gears, len(pool)), False))
        kept = drop_superseded(rs.gears, running)
        if len(kept) != len(rs.gears):  # the executor has shifted off a gear a re-plan superseded
            rs.gears = kept
            rs.gs_status_patch["plannedGears"] = [g.to_json() for g in kept]
        rs.links = {g.name: gear_links(g, profile) for g in rs.gears}
        report = windowed_nodes(deadlines, rs.gears, now, timing)
        rs.window_leave_by = next_leave_by(report)
        before = {w.node: w.state for w in rs.gs.status.windowed_nodes}
        if report != [w.to_json() for w in rs.gs.status.windowed_nodes]:
            rs.gs_status_patch["windowedNodes"] = report
        for w in report:
            if w["state"] in ("Leaving", "Left") and before.get(w["node"]) == "InUse":
                moving = f"; {', '.join(w['stages'])} shift(s) off it" if w["stages"] else ""
                events.append(
                    (
                        role,
                        REASON_WINDOW_CLOSING,
                        f"node {w['node']} is reclaimed at {w['availableUntil']}: past its leaveBy "
                        f"{w['leaveBy']}, re-planned without it{moving}",
                        False,
                    )
                )
            elif w["state"] == "Left" and before.get(w["node"]) == "Leaving":
                events.append(
                    (
                        role,
                        REASON_WINDOW_VACATED,
                        f"nothing of this role runs on node {w['node']} any more (reclaimed at "
                        f"{w['availableUntil']})",
                        False,
                    )
                )
            elif w["state"] == "InUse" and before.get(w["node"]) != "InUse":
                events.append(
                    (
                        role,
                        REASON_WINDOWED_IN_USE,
                        f"time-limited node {w['node']} (reclaimed at {w['availableUntil']}) holds "
                        f"{', '.join(w['stages'])}; work leaves it by {w['leaveBy']}",
                        False,
                    )
                )
    return missing


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


def _running(gs: GearSet) -> list[str]:
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
    """A re-plan's gears (``new``, one per intent, named after it) with the running gears kept safe. Pure.

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
    """``gears`` without those a re-plan superseded once nothing runs on them. Pure.

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


def _deadlines(pool: Iterable[str], profiles: Mapping[str, Mapping[str, Any]]) -> dict[str, datetime]:
    """``{node: status.availableUntil}`` of the time-limited nodes of ``pool`` (effective profiles)."""
    out = {}
    for n in pool:
        eff = usable_profile(profiles[n]) if n in profiles else None
        if eff is not None and eff.available_until is not None:
            out[n] = eff.available_until
    return out


def gearset_status_patch(rs: RoleState, now: Any) -> dict[str, Any]:
    """The GearSet status patch: planned gears, active gear, phase, Planned condition. Pure."""
    patch = dict(rs.gs_status_patch)
    st = rs.gs.status
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
    if rs.gs.spec.mode == "auto":
        book = ConditionBook(list(st.conditions), rs.gs_body["metadata"].get("generation"), now)
        if rs.plan_error:
            book.set(COND_PLANNED, "False", REASON_PLAN_FAILED, rs.plan_error, warning=True)
        elif rs.gears:
            book.set(COND_PLANNED, "True", REASON_PLANNED, f"{len(rs.gears)} gear(s) planned")
        if book.changes:
            patch["conditions"] = book.as_json()
    if not rs.autoscaled and (
        st.scaling is not None or any(c.type == COND_SCALING_ACTIVE for c in st.conditions)
    ):
        # The autoscale daemon stops when the scaling section goes; its last state must not linger as if
        # it still described the role.
        patch["scaling"] = None
        kept = patch.get("conditions", [c.to_json() for c in st.conditions])
        patch["conditions"] = [c for c in kept if c.get("type") != COND_SCALING_ACTIVE]
    if patch:
        patch["observedGeneration"] = rs.gs_body["metadata"].get("generation")
    return patch


def _role_readiness(
    ctx_role: RoleState,
    sts: Mapping[str, Mapping[str, Any]],
    pds: PDService,
    service: str,
    ns: str,
    images: Images,
) -> tuple[int, int, bool, int]:
    """``(ready pods, desired pods, rolled out, ready pipeline replicas)`` of a role's active gear; pods
    of its narrowest stage, pipeline replicas as ``GearSet.status.replicas`` counts them (a replica is
    ready when every stage has its share of Ready pods)."""
    if not ctx_role.active:
        return 0, 0, False, 0
    gear = next(g for g in ctx_role.gears if g.name == ctx_role.active)
    desire = RoleDesire(ctx_role.role, [gear], ctx_role.active, ctx_role.gs.spec.replicas)
    ctx = engine_context(service, ns, pds.spec, desire, images, gear)
    want = [stage_replicas(ctx, gear, k) for k in range(len(gear.stages))]
    desired = min(want) if want else 0
    ready = desired
    pipelines = ctx.pipeline_replicas
    rolled = True
    for k in range(len(gear.stages)):
        obj = sts.get(names.stage_statefulset_name(service, ctx_role.role, gear.name, k))
        s = (obj or {}).get("status") or {}
        r = int(s.get("readyReplicas") or 0)
        ready = min(ready, r)
        per = want[k] // ctx.pipeline_replicas if ctx.pipeline_replicas else 0
        pipelines = min(pipelines, r // per) if per else pipelines
        gen_ok = obj is not None and s.get("observedGeneration") == obj["metadata"].get("generation")
        if obj is None or not gen_ok or int(s.get("updatedReplicas") or 0) < want[k] or r < want[k]:
            rolled = False
    return ready, desired, rolled, pipelines


_COPIES_ATTR = {"readyCopies": "ready_copies", "desiredCopies": "desired_copies", "ready": "ready"}


def copies_status(ready: int, desired: int) -> dict[str, Any]:
    """GearSet status fields of the READY column: serving copies of the model Ready and wanted (pods of
    the active gear's narrowest stage, what the PDService's Ready message counts), and ``"ready/wanted"``
    (a printer column shows one JSONPath, so the pair is written as one string, as a Deployment shows)."""
    return {"readyCopies": ready, "desiredCopies": desired, "ready": f"{ready}/{desired}"}


def _unschedulable(pods: Sequence[Mapping[str, Any]]) -> list[str]:
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
    plan_events: list[tuple[str, str, str, bool]]
    """``(role, reason, message, warning)`` of planning, for the GearSet and the PDService."""


def desired_state(
    pds: PDService,
    roles: dict[str, RoleState],
    nodes: dict[str, dict[str, Any]],
    profiles: dict[str, dict[str, Any]],
    settings: Settings,
    now: datetime,
    bound: Collection[str] = (),
) -> DesiredState:
    """Plan the ``auto`` roles, pick each role's active gear and check the running gears' placement. Pure
    (no API call; plans are cached in memory): :func:`reconcile_service` applies the result, ``gearshift
    render`` prints it.

    ``roles`` come from :func:`role_state` and are updated in place (gears, active gear, links, status
    patch); ``bound`` are the nodes the service's pods are bound to or its StatefulSets are pinned to.
    """
    plan_events: list[tuple[str, str, str, bool]] = []
    missing = _plan_roles(pds, roles, nodes, profiles, settings, plan_events, now)
    problems: list[str] = []
    lost: list[str] = []
    desires: list[RoleDesire] = []
    skip_gears: set[tuple[str, str]] = set()
    for role, rs in roles.items():
        if rs.plan_error:
            problems.append(rs.plan_error)
        if not rs.gears:
            problems.append(f"{role}: GearSet {rs.gs.metadata['name']!r} has no gears yet")
            continue
        gnames = [g.name for g in rs.gears]
        rs.in_flight = _in_flight(rs.gs)
        st = rs.gs.status
        rs.active = (
            st.active_gear if st.active_gear in gnames else initial_gear(rs.gears, rs.gs.spec.initial_gear)
        )
        run = [rs.active]
        if rs.in_flight and st.executor:
            run += [g for g in (st.executor.from_gear, st.executor.to_gear, st.target_gear) if g in gnames]
        run_gears = [g for g in rs.gears if g.name in dict.fromkeys(run)]
        for g in run_gears:
            p, lo = placement_problems(role, g, nodes, bound)
            problems += p
            lost += lo
            if p:
                skip_gears.add((role, g.name))
        pol = rs.gs.spec.policy
        cons = rs.gs.spec.plan.constraints if rs.gs.spec.plan else None
        desires.append(
            RoleDesire(
                role,
                [g for g in run_gears if (role, g.name) not in skip_gears],
                None if rs.in_flight else rs.active,
                rs.gs.spec.replicas,
                pol.drain_timeout_s,
                cons.memory_utilization if cons else VLLM_GPU_MEMORY_UTILIZATION,
                rs.links,
            )
        )
    return DesiredState(desires, missing, problems, lost, skip_gears, plan_events)


def reconcile_service(
    api: KubeApi,
    namespace: str,
    name: str,
    settings: Settings | None = None,
    body: Mapping[str, Any] | None = None,
) -> Outcome:
    """Reconcile one PDService (see the module docstring). Serialised per PDService.

    Raises:
        SpecInvalid: the PDService or a GearSet is unusable (status and an event say why).
        NotYet: a GearSet is missing (status and an event say which).
    """
    with service_lock(namespace, name):
        return _reconcile(api, namespace, name, settings or Settings(), body)


def _reconcile(
    api: KubeApi, ns: str, name: str, settings: Settings, body: Mapping[str, Any] | None
) -> Outcome:
    # Always read the newest body: a kopf body may be older than a status we wrote a moment ago.
    fresh = api.get(*PDS, ns, name)
    if fresh is None:
        return Outcome(phase="Deleted")
    body = fresh
    if body["metadata"].get("deletionTimestamp"):
        return Outcome(phase="Deleting")
    out = Outcome()
    now = now_utc()
    gen = body["metadata"].get("generation")
    old_status = dict(body.get("status") or {})
    book = ConditionBook(conditions_from(old_status.get("conditions")), gen, now)

    def finish(status: dict[str, Any]) -> None:
        status["conditions"] = book.as_json()
        status["observedGeneration"] = gen
        merged = old_status | status
        if merged != old_status:
            patch_status(api, *PDS, ns, name, status)
        for reason, message, warning in book.changes:
            emit(api, body, reason, message, warning)

    def refuse(reason: str, msg: str) -> None:
        # Nothing is applied for a spec that cannot be served, so a service that was Ready still serves
        # its last applied spec: say the edit was refused (Progressing=False, Degraded) and keep Ready,
        # rather than Failed, which monitoring would read as down.
        serving = any(
            c.get("type") == COND_READY and c.get("status") == "True"
            for c in old_status.get("conditions") or []
        )
        if serving:
            book.set(
                COND_PROGRESSING, "False", reason, f"{msg}; still serving the last applied spec", warning=True
            )
            finish({"phase": "Degraded", "message": f"spec not applied, serving the last applied one: {msg}"})
        else:
            book.set(COND_READY, "False", reason, msg, warning=True)
            finish({"phase": "Failed", "message": msg})

    try:
        pds = PDService.model_validate(body)
    except ValidationError as exc:
        msg = format_validation_error(exc)
        refuse(REASON_INVALID_SPEC, msg)
        raise SpecInvalid(msg) from None
    try:
        roles = _read_gearsets(api, body, pds)
        explicit_layer_problems(pds, roles)
    except SpecInvalid as exc:
        refuse(common.REASON_GEARSET_MISMATCH, str(exc))
        raise
    except NotYet as exc:
        book.set(COND_PLACED, "False", common.REASON_GEARSET_MISSING, str(exc), warning=True)
        book.set(COND_READY, "False", common.REASON_GEARSET_MISSING, str(exc))
        finish({"phase": "Pending", "message": str(exc)})
        raise

    nodes, profiles = fleet(api)
    try:
        explicit_engine_problems(pds, roles, profiles)
    except SpecInvalid as exc:
        refuse(REASON_INVALID_SPEC, str(exc))
        raise
    service_pods = api.list(*POD, ns, {names.LABEL_SERVICE: name})
    # Pods of a deleted node are garbage-collected soon after it goes; the StatefulSet pinned to it stays.
    bound = {str(p["spec"]["nodeName"]) for p in service_pods if (p.get("spec") or {}).get("nodeName")}
    for sts_obj in api.list(*STS, ns, {names.LABEL_SERVICE: name}):
        bound |= pinned_nodes(sts_obj)
    want = desired_state(pds, roles, nodes, profiles, settings, now, bound)
    missing, plan_events, desires = want.missing, want.plan_events, want.desires
    problems, lost, skip_gears = want.problems, want.lost, want.skip_gears

    # GearSet status first: the executor and `kubectl get gs` see the plan and the active gear.
    for role, rs in roles.items():
        patch = gearset_status_patch(rs, now)
        if patch:
            patch_status(api, *GS, ns, rs.gs.metadata["name"], patch)
            out.planned += [role] if "plannedGears" in patch else []
    for role, reason, message, warning in plan_events:
        emit(api, roles[role].gs_body, reason, message, warning)
        gs_name = str(roles[role].gs.metadata["name"])
        emit(api, body, reason, service_event_message(role, gs_name, message), warning)

    out.auto = any(rs.gs.spec.mode == "auto" for rs in roles.values())
    out.nodes = {n for d in desires for g in d.gears for st in g.stages for n in st.nodes}
    owner = owner_reference(body)
    try:
        objs = desired_objects(name, ns, pds.spec, desires, settings.images, owner, settings.prometheus_url)
    except EngineSpecError as exc:
        refuse(REASON_INVALID_SPEC, str(exc))
        raise SpecInvalid(str(exc)) from None
    for obj in objs:
        api.apply(obj)
        out.applied += 1

    # Gears no longer wanted (a spec edit renamed or removed one, a re-plan): delete unless a shift runs.
    existing = api.list(*STS, ns, {names.LABEL_SERVICE: name, names.LABEL_COMPONENT: names.COMPONENT_ENGINE})
    keep = {(d.role, g.name) for d in desires for g in d.gears} | skip_gears
    flight = {r for r, rs in roles.items() if rs.in_flight}
    wanted = {(d.role, g.name): len(g.stages) for d in desires for g in d.gears}
    for obj in existing:
        labels = obj["metadata"].get("labels") or {}
        role, gear = labels.get(names.LABEL_ROLE, ""), labels.get(names.LABEL_GEAR, "")
        if role in flight or (role, gear) in skip_gears:
            continue
        stages = wanted.get((role, gear))
        # Gone from the wanted gears, or a stage past the end of a gear that lost stages.
        if stages is None or int(labels.get(names.LABEL_STAGE, "0")) >= stages:
            api.delete(*STS, ns, obj["metadata"]["name"])
            out.deleted += 1
    for svc in api.list(*SVC, ns, {names.LABEL_SERVICE: name, names.LABEL_COMPONENT: names.COMPONENT_ENGINE}):
        labels = svc["metadata"].get("labels") or {}
        svc_role, svc_gear = labels.get(names.LABEL_ROLE), labels.get(names.LABEL_GEAR)
        if svc_gear and svc_role not in flight and (svc_role, svc_gear) not in keep:
            api.delete(*SVC, ns, svc["metadata"]["name"])
            out.deleted += 1
    # --- status ---------------------------------------------------------------------------------
    sts = {s["metadata"]["name"]: s for s in api.list(*STS, ns, {names.LABEL_SERVICE: name})}
    unsched = _unschedulable(service_pods)
    role_status: dict[str, Any] = {}
    all_ready = True
    rolled_all = True
    for role, rs in roles.items():
        ready, desired, rolled, pipelines = _role_readiness(rs, sts, pds, name, ns, settings.images)
        counts = copies_status(ready, desired)
        st_now = rs.gs.status
        gs_patch = {k: v for k, v in counts.items() if getattr(st_now, _COPIES_ATTR[k]) != v}
        if not rs.autoscaled and st_now.replicas != pipelines:
            # The autoscaler writes it for the roles it scales; the scale subresource (HPA, KEDA) reads it
            # for every role.
            gs_patch["replicas"] = pipelines
        if gs_patch:
            patch_status(api, *GS, ns, rs.gs.metadata["name"], gs_patch)
        role_status[role] = {
            "gearSet": rs.gs.metadata["name"],
            "activeGear": rs.active,
            "readyReplicas": ready,
            "desiredReplicas": desired,
        }
        # Scaled to zero (GearSet replicas 0) is a served state too: every wanted pipeline is there.
        all_ready = all_ready and ready >= desired
        rolled_all = rolled_all and rolled
    router = api.get(*DEPLOY, ns, names.router_name(name))
    router_ready = bool(router and int((router.get("status") or {}).get("availableReplicas") or 0) >= 1)

    placed_msgs = missing + problems + unsched
    if placed_msgs:
        reason = (
            REASON_PLAN_FAILED
            if any(rs.plan_error for rs in roles.values()) and not unsched
            else (
                common.REASON_UNSCHEDULABLE
                if unsched and not (missing + problems)
                else REASON_PLACEMENT_FAILED
            )
        )
        if missing and not problems and not unsched:
            reason = common.REASON_PROFILES_MISSING
        book.set(COND_PLACED, "False", reason, "; ".join(placed_msgs), warning=True)
    else:
        book.set(
            COND_PLACED, "True", common.REASON_ALL_PLACED, "every stage of the active gears has its nodes"
        )
    out.placed = not placed_msgs
    if lost:
        book.set(
            COND_DEGRADED,
            "True",
            REASON_NODE_LOST,
            f"node(s) {', '.join(sorted(set(lost)))} under running stages are gone or not Ready",
            warning=True,
        )
    else:
        book.set(
            COND_DEGRADED, "False", common.REASON_AS_PLANNED, "every node under a running stage is Ready"
        )
    if rolled_all and router_ready:
        book.set(COND_PROGRESSING, "False", REASON_RECONCILED, "owned objects match the spec")
    else:
        book.set(
            COND_PROGRESSING, "True", common.REASON_ROLLING_OUT, "pods of the active gears are rolling out"
        )
    out.ready = all_ready and router_ready
    if out.ready:
        book.set(COND_READY, "True", common.REASON_ALL_READY, "prefill, decode and the router serve")
    else:
        waiting = [f"{r} {s['readyReplicas']}/{s['desiredReplicas']}" for r, s in role_status.items()]
        book.set(
            COND_READY,
            "False",
            common.REASON_NOT_READY,
            f"ready pipelines: {', '.join(waiting)}; router {'ready' if router_ready else 'not ready'}",
        )
    if lost:
        out.phase = "Degraded"
    elif out.ready:
        out.phase = "Ready"
    elif placed_msgs and not any(s["readyReplicas"] for s in role_status.values()):
        out.phase = "Pending"
    else:
        out.phase = "Progressing"
    status = {
        "phase": out.phase,
        "prefill": role_status.get("prefill"),
        "decode": role_status.get("decode"),
        "routerReady": router_ready,
        "endpoint": f"{name}.{ns}.svc:8000",
        "message": "; ".join(placed_msgs)[:4000] if placed_msgs else "",
    }
    leave_by = min((rs.window_leave_by for rs in roles.values() if rs.window_leave_by), default=None)
    if leave_by is not None or old_status.get("windowLeaveBy") is not None:
        status["windowLeaveBy"] = leave_by  # None deletes it (merge patch)
    finish(status)
    return out


# --- the gear executor's operations (issue 9 calls these) ------------------------------------------
def _context(
    api: KubeApi, namespace: str, service: str, role: str
) -> tuple[dict[str, Any], PDService, GearSet]:
    body = api.get(*PDS, namespace, service)
    if body is None:
        raise NotYet(f"PDService {namespace}/{service} not found")
    pds = PDService.model_validate(body)
    ref = getattr(pds.spec, role).gear_set_ref.name
    gs_body = api.get(*GS, namespace, ref)
    if gs_body is None:
        raise NotYet(f"GearSet {namespace}/{ref} not found")
    return body, pds, GearSet.model_validate(gs_body)


def ensure_gear_sync(
    api: KubeApi, namespace: str, service: str, role: str, gear: str, settings: Settings | None = None
) -> list[str]:
    """Apply the headless Service and StatefulSets of ``gear`` of ``role``; returns the StatefulSet names.

    Raises:
        NotYet: the PDService or GearSet is missing; KeyError: no such gear in the GearSet.
    """
    settings = settings or Settings()
    with service_lock(namespace, service):
        body, pds, gs = _context(api, namespace, service, role)
        g = next((x for x in gs.gears() if x.name == gear), None)
        if g is None:
            raise KeyError(
                f"GearSet {gs.metadata['name']!r} has no gear {gear!r}: {[x.name for x in gs.gears()]}"
            )
        cons = gs.spec.plan.constraints if gs.spec.plan else None
        memutil = cons.memory_utilization if cons else VLLM_GPU_MEMORY_UTILIZATION
        desire = RoleDesire(
            role,
            [g],
            None,
            gs.spec.replicas,
            gs.spec.policy.drain_timeout_s,
            memutil,
            # The same links the reconciler gives the gear: a pod template that differs from the
            # reconciler's would roll the gear's pods each time either one applies (a shadow restarted
            # by its own switch is "not Ready while draining" and the shift rolls back).
            {g.name: _auto_gear_links(api, gs, g, memutil)},
        )
        objs = gear_objects(service, namespace, pds.spec, desire, g, settings.images, owner_reference(body))
        for obj in objs:
            api.apply(obj)
        emit(
            api,
            body,
            common.REASON_GEAR_ENSURED,
            f"{role} gear {gear}: {len(objs) - 1} StatefulSet(s) applied",
        )
        return [o["metadata"]["name"] for o in objs if o["kind"] == "StatefulSet"]


def _auto_gear_links(api: KubeApi, gs: GearSet, gear: Gear, memutil: float) -> list[dict[str, float]] | None:
    """The simulated pipeline links of ``gear`` as :func:`reconcile` computes them: an ``auto`` role's
    gear gets the links between its stages' nodes from their GPUProfiles; explicit gears get none."""
    if gs.spec.mode != "auto":
        return None
    gear_nodes = {n for st in gear.stages for n in st.nodes}
    if not gear_nodes:
        return None
    nodes, profiles = fleet(api)
    try:
        doc = resource_profile(gear_nodes, profiles, nodes, memutil)
        return gear_links(gear, planner.parse_profile(doc))
    except (KeyError, ValueError, planner.PlanInputError):
        return None


def select_gear_sync(api: KubeApi, namespace: str, service: str, role: str, gear: str) -> None:
    """Point the role Service ``<pds>-<role>`` at the heads of ``gear`` (switching the role's traffic)."""
    with service_lock(namespace, service):
        body, _pds, _gs = _context(api, namespace, service, role)
        api.apply(build_role_service(service, namespace, role, gear, owner_reference(body)))
        emit(api, body, common.REASON_GEAR_SELECTED, f"{role} Service now selects gear {gear}")


def delete_gear_sync(api: KubeApi, namespace: str, service: str, role: str, gear: str) -> int:
    """Delete every StatefulSet and the headless Service of ``gear`` of ``role``; returns how many went."""
    with service_lock(namespace, service):
        labels = {names.LABEL_SERVICE: service, names.LABEL_ROLE: role, names.LABEL_GEAR: gear}
        n = 0
        for obj in api.list(*STS, namespace, labels):
            n += bool(api.delete(*STS, namespace, obj["metadata"]["name"]))
        n += bool(api.delete(*SVC, namespace, names.gear_headless_service_name(service, role, gear)))
        body = api.get(*PDS, namespace, service)
        if body is not None:
            emit(api, body, common.REASON_GEAR_DELETED, f"{role} gear {gear}: {n} object(s) deleted")
        return n


def services_using(bodies: Iterable[Mapping[str, Any]], gearset: str) -> list[str]:
    """Names of the PDServices among ``bodies`` whose prefill or decode refers to GearSet ``gearset``."""
    out = []
    for b in bodies:
        spec = b.get("spec") or {}
        refs = {(spec.get(r) or {}).get("gearSetRef", {}).get("name") for r in names.ROLES}
        if gearset in refs:
            out.append(b["metadata"]["name"])
    return sorted(out)
