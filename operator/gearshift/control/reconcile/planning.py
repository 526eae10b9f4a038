"""Planning the ``auto`` roles: each role's pool of the fleet (split between prefill and decode), the plan's
inputs hash (a re-plan happens when it moves), the planner's gears merged with the running ones so that no
serving gear is rolled in place, and the events of planning and of time-limited nodes.

Pure: ``now`` is passed in; plans may be memoised by the caller (a
:data:`~gearshift.control.reconcile.state.PlanMemo`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from gearshift import planner
from gearshift.api.common import (
    MAX_GEAR_NAME,
    REASON_PLANNED,
    REASON_WINDOW_CLOSING,
    REASON_WINDOW_VACATED,
    REASON_WINDOWED_IN_USE,
    inputs_hash,
)
from gearshift.api.gearset import Gear, GearSet
from gearshift.api.gearset_plan import Workload
from gearshift.api.pdservice import PDService
from gearshift.control.reconcile.placement import explicit_pool
from gearshift.control.reconcile.state import PlanEvent, PlanMemo, RoleState, shift_in_flight
from gearshift.control.windows import (
    WindowTiming,
    next_leave_by,
    planner_windows,
    vacate_name,
    windowed_nodes,
)
from gearshift.facts.model import VLLM_GPU_MEMORY_UTILIZATION
from gearshift.k8s.fleetsplit import split_pools
from gearshift.planner.inputs import (
    api_gear,
    engine_stage_limit,
    gear_links,
    node_ready,
    resource_profile,
    role_candidates,
    stage_gpus,
    usable_profile,
)

#: Seconds of margin before a time-limited node's availableUntil when the GearSet sets none.
DEFAULT_WINDOW_MARGIN_S = 300.0


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
    limit = engine_stage_limit(pds.spec.engine, gs.spec.role)  # vLLM decode: one stage
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
        # A gear that holds more cards for no more capacity, or one layout under two names, would only
        # be shifted to by mistake.
        worthwhile_only=True,
    )
    return [api_gear(g, g.name, doc, {}) for g in result.gears]


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
    if shift_in_flight(gs) and st.executor is not None:
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
    # Time-limited nodes: the fingerprint moves only when one crosses its leaveBy.
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
