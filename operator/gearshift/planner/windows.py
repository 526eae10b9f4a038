"""Time-limited nodes ("time fragments") as the planner sees them.

A node whose GPUs are free only until a known instant (node annotation ``gearshift.io/available-until``)
may serve a gear only while that gear is expected to stay: the gear's **dwell** (``policy.dwellS``: a gear
stays at least that long once shifted to) plus a safety **margin** (``plan.constraints.windowMarginS``)
must end before the window closes. Even then the node holds only work that is cheap to drop -- a
replicated pipeline's extra replica (r ≥ 1) or a hot stage's extra replica -- never the only copy of a
stage, so that losing it early costs capacity, not the service (FlexPipe (docs/sources.md#fragmentation) names
such cards a *time fragment*; static schedulers avoid them because losing a stage mid-pipeline breaks the
pipeline).

Pure: the caller passes the seconds left per node (``deadline − now``); no clock is read here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Windows:
    """Seconds left in each time-limited node's window, and the dwell and margin a gear needs."""

    left_s: Mapping[str, float] = field(default_factory=dict)
    """``{node: seconds until its window closes}``, counted from the planning instant; other nodes are
    durable (no window)."""
    dwell_s: float = 600.0
    """Expected stay of a planned gear, s (``policy.dwellS``; docs/sources.md#shift-dwell: 10 minutes)."""
    margin_s: float = 300.0
    """Slack between the end of the dwell and the window's close, s (``windowMarginS``)."""

    def usable(self, node_id: str) -> bool:
        """True for a durable node, or a windowed one with at least ``dwell_s + margin_s`` seconds left."""
        left = self.left_s.get(node_id)
        return left is None or left >= self.dwell_s + self.margin_s

    def cheap_only(self, node_ids: Iterable[str]) -> frozenset[str]:
        """The windowed nodes of ``node_ids`` that are usable, but only for cheap-to-drop replicas."""
        return frozenset(n for n in node_ids if n in self.left_s and self.usable(n))

    def excluded(self, node_ids: Iterable[str]) -> frozenset[str]:
        """The windowed nodes of ``node_ids`` whose window closes too soon for any gear."""
        return frozenset(n for n in node_ids if not self.usable(n))
