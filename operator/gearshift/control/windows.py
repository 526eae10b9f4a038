"""When work must leave a time-limited node, and what to report about it (issue 13).

A node whose GPUProfile carries ``status.availableUntil`` (its deadline) is planned on only while a gear
placed now can stay its expected time and still leave with a margin:

    leaveBy = availableUntil − windowMarginS − lead,   lead = max(dwellS, warmS + drainTimeoutS)

``dwellS`` is how long a gear stays once shifted to (seed 002's minimum dwell); ``warmS + drainTimeoutS``
bounds one shadow → drain → switch. Before ``leaveBy`` the planner may use the node for cheap-to-drop
replicas (:mod:`gearshift.planner.windows`); from ``leaveBy`` on it leaves the node out, so the plan's
fingerprint changes and the reconciler re-plans without it -- with the margin still ahead for the move.
The planner's own test (``seconds left ≥ dwell + margin`` with dwell := ``lead``) is the same inequality,
so the plan changes exactly at ``leaveBy`` and not at every reconcile.

Pure: ``now`` is passed in; no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from gearshift.planner.windows import Windows


@dataclass(frozen=True)
class WindowTiming:
    """The three durations that set ``leaveBy``, s."""

    margin_s: float
    """``plan.constraints.windowMarginS``."""
    dwell_s: float
    """``policy.dwellS``."""
    shift_s: float
    """Time one shadow → drain → switch may take (``policy.warmS + policy.drainTimeoutS``)."""

    @property
    def lead_s(self) -> float:
        """How long before ``deadline − margin`` work must start leaving, s."""
        return max(self.dwell_s, self.shift_s)

    def leave_by(self, deadline: datetime) -> datetime:
        """When work must have left a node reclaimed at ``deadline``."""
        return deadline - timedelta(seconds=self.margin_s + self.lead_s)


def planner_windows(
    deadlines: Mapping[str, datetime], now: datetime, timing: WindowTiming
) -> tuple[Windows, dict[str, str]]:
    """The planner's :class:`Windows` at ``now`` and its fingerprint part ``{node: usable|left}``.

    The fingerprint changes only when a node crosses its ``leaveBy`` (or a deadline is added or removed),
    so plans are cached between those instants.
    """
    left = {n: (d - now).total_seconds() for n, d in deadlines.items()}
    w = Windows(left_s=left, dwell_s=timing.lead_s, margin_s=timing.margin_s)
    return w, {n: ("usable" if w.usable(n) else "left") for n in sorted(deadlines)}


def stages_on(node: str, gears: Iterable[Any]) -> list[str]:
    """``'<gear>/s<k>'`` of every stage of ``gears`` (API gears: ``.name``, ``.stages[k].nodes``) on
    ``node``."""
    return [f"{g.name}/s{k}" for g in gears for k, st in enumerate(g.stages) if node in (st.nodes or [])]


def windowed_nodes(
    deadlines: Mapping[str, datetime], gears: Iterable[Any], now: datetime, timing: WindowTiming
) -> list[dict[str, Any]]:
    """``GearSet.status.windowedNodes``: per windowed node its deadline, ``leaveBy``, the stages of
    ``gears`` on it, and ``state`` (``Left`` past ``leaveBy``, else ``InUse`` or ``Unused``)."""
    gears = list(gears)
    out = []
    for n in sorted(deadlines):
        by = timing.leave_by(deadlines[n])
        stages = stages_on(n, gears)
        state = "Left" if now >= by else ("InUse" if stages else "Unused")
        out.append(
            {
                "node": n,
                "availableUntil": deadlines[n].isoformat(),
                "leaveBy": by.isoformat(),
                "stages": stages,
                "state": state,
            }
        )
    return out


def next_leave_by(report: Iterable[Mapping[str, Any]]) -> str | None:
    """The earliest ``leaveBy`` among nodes still ``InUse`` (when the reconciler must look again)."""
    times = [r["leaveBy"] for r in report if r.get("state") == "InUse"]
    return min(times) if times else None
