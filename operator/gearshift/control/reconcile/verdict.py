"""The PDService's status after a reconcile: its conditions (Placed, Degraded, Progressing, Ready), its phase
(:func:`service_phase`) and its status fields (:func:`service_verdict`); :func:`refusal` and
:func:`gearsets_missing` when it cannot be served.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gearshift.api.common import (
    COND_DEGRADED,
    COND_PLACED,
    COND_PROGRESSING,
    COND_READY,
    REASON_NODE_LOST,
    REASON_PLACEMENT_FAILED,
    REASON_PLAN_FAILED,
    REASON_RECONCILED,
    ConditionUpdate,
)
from gearshift.api.pdservice import ROLE_SECTIONS
from gearshift.control.reconcile.readiness import Readiness
from gearshift.control.reconcile.state import (
    REASON_ALL_PLACED,
    REASON_ALL_READY,
    REASON_AS_PLANNED,
    REASON_GEARSET_MISSING,
    REASON_NOT_READY,
    REASON_PROFILES_MISSING,
    REASON_ROLLING_OUT,
    REASON_UNSCHEDULABLE,
    DesiredState,
    RoleState,
)


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
    ``want``; ``readiness`` by role (:func:`~gearshift.control.reconcile.readiness.role_readiness`),
    ``unsched`` the unschedulable pods (:func:`unschedulable`), ``old_status`` the status read
    (``windowLeaveBy`` is cleared once set)."""
    roles_st = {role: role_status(rs, readiness[role]) for role, rs in roles.items()}
    # Scaled to zero (GearSet replicas 0) is a served state too: every wanted pipeline is there.
    all_ready = all(r.ready >= r.desired for r in readiness.values())
    # Ready means served by the current spec: a role whose StatefulSets still roll to a new
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
