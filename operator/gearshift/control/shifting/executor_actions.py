"""What the shift executor asks for: declarative actions (:data:`Action`) that the shifting loop applies
in order through the Kubernetes API (and the twin and the tests' scripted world in memory), and how a
shift ended (:class:`Outcome`). Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Outcome(StrEnum):
    """How a shift ended (``ShiftRecord.outcome``)."""

    IN_PROGRESS = "InProgress"
    SUCCEEDED = "Succeeded"
    ROLLED_BACK = "RolledBack"
    FAILED = "Failed"
    ABORTED = "Aborted"
    """Cancelled before the switch: its ``spec.forceGear`` was reverted while the target warmed."""


@dataclass(frozen=True)
class EnsureGear:
    """Create (or update) the gear's StatefulSets and headless Service.

    ``shadow``: the pods run beside the serving gear, outside the role Service (no client traffic); while
    the phase is ``Warming`` the shifting loop marks its head pods for mirrored warm-up traffic at
    ``warmupShare`` of its predicted throughput (:mod:`gearshift.k8s.warming`); its share of a card's
    compute is not enforced (the sandbox's time-sliced cards give none). ``kv_pool`` false: weights only,
    no KV-cache pool yet (degraded mode).
    """

    gear: str
    shadow: bool = False
    kv_pool: bool = True


@dataclass(frozen=True)
class SelectGear:
    """Point the role Service's selector (and the router) at the gear's head pods."""

    gear: str


@dataclass(frozen=True)
class DeleteGear:
    """Delete the gear's StatefulSets and headless Service."""

    gear: str


@dataclass(frozen=True)
class MarkUnhealthy:
    """Record the gear as unhealthy in ``status.gearHealth``; decisions skip it."""

    gear: str
    reason: str
    message: str = ""


@dataclass(frozen=True)
class Event:
    """A Kubernetes event on the GearSet."""

    reason: str
    message: str
    warning: bool = False


@dataclass(frozen=True)
class RecordShift:
    """Add or update (by ``started_at``) the shift's entry in ``status.history``; times in s."""

    from_gear: str
    to_gear: str
    trigger: str
    started_at: float
    outcome: Outcome
    finished_at: float | None = None
    message: str = ""


Action = EnsureGear | SelectGear | DeleteGear | MarkUnhealthy | Event | RecordShift
