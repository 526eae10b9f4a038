"""What one reconcile wants: per role the gears to run and the gear its Service selects
(:func:`desired_state`), the GearSet status that follows (:func:`gearset_status_patch`), and the owned
objects no wanted gear has any more (:func:`stale_statefulsets`, :func:`stale_gear_services`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol

from gearshift.api.common import (
    COND_PLANNED,
    COND_SCALING_ACTIVE,
    REASON_PLAN_FAILED,
    REASON_PLANNED,
    ConditionStatus,
    set_condition,
)
from gearshift.api.gearset import Gear
from gearshift.api.pdservice import PDService
from gearshift.control.reconcile.placement import placement_problems
from gearshift.control.reconcile.planning import memory_utilization, no_memo, plan_roles
from gearshift.control.reconcile.state import DesiredState, PlanMemo, RoleState, shift_in_flight
from gearshift.control.shifting import capacity
from gearshift.control.shifting.adapt import gear_views, gearset_rules
from gearshift.control.shifting.policy import ShiftRules
from gearshift.k8s import names
from gearshift.k8s.desired import RoleDesire
from gearshift.planner.inputs import initial_gear


class PlanSettings(Protocol):
    """What planning reads of the operator's settings (``gearshift.control.reconcile.settings.Settings``)."""

    @property
    def sim_requests(self) -> int:
        """Requests per planner simulation run."""
        ...


def pick_active(rs: RoleState, rules: ShiftRules | None = None) -> list[Gear]:
    """Set ``rs.active`` (the GearSet's active gear while it has it, else the initial gear) and
    ``rs.in_flight``; returns the gears that run (the active one, and while a shift is in flight its
    ``from``/``to``/target unless the GearSet is being deleted), in ``rs.gears`` order.

    ``rules``: the role's shifting policy; with it and ``spec.initialGear`` unset, the initial gear is the
    one with the fewest GPUs predicted to meet the SLO at the expected load
    (:func:`gearshift.control.shifting.capacity.initial_gear`), else the planner's :func:`initial_gear`."""
    gnames = [g.name for g in rs.gears]
    rs.in_flight = shift_in_flight(rs.gs)
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

    ``roles`` come from :func:`~gearshift.control.reconcile.spec.role_state` and are updated in place
    (gears, active gear, links, status patch); ``bound`` are the nodes the service's pods are bound to or
    its StatefulSets are pinned to (:func:`~gearshift.control.reconcile.placement.bound_nodes`); ``memo``
    may serve plans already made for the same inputs hash.
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
        # otherwise leave it behind until the shifting loop's next write (27 s under load).
        patch["observedGeneration"] = generation
    return patch


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
