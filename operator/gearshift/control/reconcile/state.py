"""What the reconciler works on: a role's state, what one reconcile wants, the errors it raises and the
PDService's condition reasons beyond :mod:`gearshift.api.common`'s.

Every module of :mod:`gearshift.control.reconcile` reads these; this one reads none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gearshift.api.gearset import Gear, GearSet
from gearshift.k8s.desired import RoleDesire

#: Executor steps during which the executor, not the reconciler, owns the role's gears and selector
#: (Degraded is the executor's weights-first warming).
SHIFT_STEPS = ("Warming", "Draining", "Switching", "RollingBack", "Degraded")

# Condition reasons of the PDService beyond those in gearshift.api.common.
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
    """What one reconcile wants, worked out from what it read
    (:func:`~gearshift.control.reconcile.desired.desired_state`)."""

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


def shift_in_flight(gs: GearSet) -> bool:
    ex = gs.status.executor
    return ex is not None and ex.step in SHIFT_STEPS
