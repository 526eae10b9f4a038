"""When work must leave a time-limited node, and what to report about it.

A node whose GPUProfile carries ``status.availableUntil`` (its deadline) is planned on only while a gear
placed now can stay its expected time and still leave with a margin:

    leaveBy = availableUntil − windowMarginS − lead,
    lead = max(dwellS, warmS + drainTimeoutS + rollbackWindowS)

``dwellS`` is how long a gear stays once shifted to (FlexPipe's minimum dwell, docs/sources.md#shift-dwell);
``warmS + drainTimeoutS + rollbackWindowS`` bounds one shadow → drain → switch (the old gear's pods stay for
the rollback window after the switch). Before ``leaveBy`` the planner may use the node for cheap-to-drop
replicas (:mod:`gearshift.planner.windows`); from ``leaveBy`` on it leaves the node out, so the plan's
fingerprint changes and the reconciler re-plans without it -- with the margin still ahead for the move.
The planner's own test (``seconds left ≥ dwell + margin`` with dwell := ``lead``) is the same inequality,
so the plan changes exactly at ``leaveBy`` and not at every reconcile.

**Vacating** (the move off the node at ``leaveBy``) goes through the gear executor, never an in-place
update of the serving StatefulSets (a rolling restart would cut in-flight requests): the reconciler
publishes the window-free plan with the replacement of a running gear under a new name
(:func:`vacate_name`) and keeps the running gear as it is; the shifting loop sees the active gear on a
node the report marks ``Leaving`` (:func:`closing_nodes`) and shifts to :func:`vacate_target` with trigger
``window`` (shadow → drain → switch); the executor deletes the old gear after the rollback window.

Pure: ``now`` is passed in; no clock, no I/O.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
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
    """Time one shadow → drain → switch may take
    (``policy.warmS + policy.drainTimeoutS + policy.rollbackWindowS``)."""

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
    ``gears`` on it, and ``state``: before ``leaveBy`` ``InUse`` or ``Unused``; past it ``Leaving`` while a
    gear (the serving one, until the executor has shifted off it) still holds stages there, else
    ``Left``."""
    gears = list(gears)
    out = []
    for n in sorted(deadlines):
        by = timing.leave_by(deadlines[n])
        stages = stages_on(n, gears)
        # The planner's own test (Windows.usable), so the state flips with the plan's fingerprint.
        if (deadlines[n] - now).total_seconds() < timing.lead_s + timing.margin_s:
            state = "Leaving" if stages else "Left"
        else:
            state = "InUse" if stages else "Unused"
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
    """The earliest ``leaveBy`` among nodes ``InUse`` or ``Leaving`` (while set, the operator re-plans within
    a couple of seconds of ``leaveBy`` (:func:`leave_by_due`) and looks again every retry period to drop the
    old gear once the shift is done)."""
    times = [r["leaveBy"] for r in report if r.get("state") in ("InUse", "Leaving")]
    return min(times) if times else None


def leave_by_due(leave_by: str | None, now: datetime, handled: str | None) -> bool:
    """Whether a PDService's ``status.windowLeaveBy`` has come and no reconcile has run for it yet.

    The operator re-plans at ``leaveBy`` (the window-free plan and the ``Leaving`` report that start the
    vacate); its ordinary retry timer looks only every ``RETRY_S`` (30 s), which would spend that much of
    ``windowMarginS`` before the move even starts. A short timer asks this every tick instead.

    Args:
        leave_by: ``status.windowLeaveBy`` (RFC 3339), or ``None`` when no time-limited node is in use.
        now: the current time (timezone-aware).
        handled: the ``leave_by`` value a reconcile already ran for (so it runs once per value).

    Returns:
        True when ``leave_by`` is set, parses, differs from ``handled``, and ``now`` in whole seconds is
        past it; False for an unparsable value (the ordinary timer still looks). Whole seconds because the
        reconciler reads the clock at second precision (``now_utc``) and a node stays usable while
        ``deadline − now ≥ lead + margin``, i.e. through ``leaveBy`` itself: a reconcile in that second
        would find nothing to move and the vacate would wait for the next ordinary trigger.
    """
    if leave_by is None or leave_by == handled:
        return False
    try:
        when = datetime.fromisoformat(leave_by)
    except ValueError:
        return False
    if when.tzinfo is None:  # the reconciler writes aware times; a naive one is read as UTC
        when = when.replace(tzinfo=UTC)
    return when < now.replace(microsecond=0)


# --- vacating: the move off a node past its leaveBy --------------------------------------------------
#: The executor trigger of a shift that vacates time-limited nodes (``GearSet`` ``ShiftTrigger``).
TRIGGER_WINDOW = "window"


def closing_nodes(report: Iterable[Mapping[str, Any]]) -> frozenset[str]:
    """The nodes of a ``windowedNodes`` report past their ``leaveBy`` (``Leaving`` or ``Left``).

    The shifting loop reads this from status rather than comparing ``leaveBy`` with its own clock: the
    reconciler writes the state in the same patch as the window-free plan, so the replacement gear is
    there whenever a node reads as closing.
    """
    return frozenset(str(r["node"]) for r in report if r.get("state") in ("Leaving", "Left"))


def uses(gear: Any, nodes: Collection[str]) -> bool:
    """Whether some stage of ``gear`` (``.stages[k].nodes``) names one of ``nodes``."""
    return any(n in nodes for st in gear.stages for n in (st.nodes or []))


def vacate_name(gear: Any, max_len: int, taken: Collection[str] = ()) -> str:
    """A fresh name for the window-free replacement of a running gear: ``<intent>-w<hash>``.

    The hash is of the gear's content (stages, batches), so the same plan gives the same name on every
    reconcile; it never equals a name in ``taken`` (the running gears). ``gear`` has ``.intent`` and
    ``.to_json()``; ``max_len`` is the longest gear name (``MAX_GEAR_NAME``).
    """
    doc = {k: v for k, v in gear.to_json().items() if k != "name"}
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str)
    for salt in range(64):
        digest = hashlib.sha256(f"{raw}#{salt}".encode()).hexdigest()
        name = f"{str(gear.intent)[: max_len - 5]}-w{digest[:3]}"
        if name not in taken:
            return name
    raise ValueError(f"no free name for a replacement of gear {gear.name!r}")  # pragma: no cover


def vacate_target(
    gears: Sequence[Any], active: str, closing: Collection[str], unhealthy: Collection[str] = ()
) -> str | None:
    """The gear to shift to when ``active`` holds stages on a ``closing`` node, else ``None``.

    Candidates use no closing node and are healthy; one of the active gear's intent comes first (the
    reconciler's replacement), then the others in plan order. ``None`` also when ``active`` is not on a
    closing node, or no candidate exists (the caller reports it).
    """
    cur = next((g for g in gears if g.name == active), None)
    if cur is None or not uses(cur, closing):
        return None
    cands = [g for g in gears if g.name != active and g.name not in unhealthy and not uses(g, closing)]
    same = [g for g in cands if g.intent == cur.intent]
    pick = (same or cands or [None])[0]
    return None if pick is None else pick.name
