"""The demo's live line: a progress bar, the active gear of each role, and the router's QPS and upstream
P99 TTFT/ITL (pure)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

BAR_WIDTH = 24


@dataclass(frozen=True)
class GearState:
    """One role's gear status as its GearSet reports it."""

    active: str | None
    phase: str | None = None
    target: str | None = None

    def text(self) -> str:
        """``balanced``, or ``balanced→throughput (Warming)`` while a shift is under way."""
        active = self.active or "?"
        if self.target and self.target != self.active:
            return f"{active}→{self.target} ({self.phase or '?'})"
        if self.phase and self.phase not in ("Stable", "Pending"):
            return f"{active} ({self.phase})"
        return active


def bar(fraction: float, width: int = BAR_WIDTH) -> str:
    """A text progress bar ``[#####.....]`` for ``fraction`` in [0, 1] (clamped)."""
    f = 0.0 if math.isnan(fraction) else min(1.0, max(0.0, fraction))
    fill = round(f * width)
    return "[" + "#" * fill + "." * (width - fill) + "]"


def _ms(v: float | None) -> str:
    return "   -  " if v is None or math.isnan(v) else f"{v:6.0f}"


def status_line(
    elapsed_s: float,
    run_s: float,
    issued: int,
    total: int,
    gears: Mapping[str, GearState],
    qps: float | None,
    ttft_p99_ms: float | None,
    itl_p99_ms: float | None,
) -> str:
    """One line: ``[####....] 120/540 s  1820/9603 req  prefill balanced  decode latency  router: QPS  31.2
    P99 TTFT 180 ms  ITL 42 ms``. Values not measured yet print as ``-``.

    ``qps`` (OK answers/s) and the P99s (ms) are the router's (its ``/metrics``, upstream TTFT and ITL
    histograms), not the load generator's: the line says so, as the report's figures name their source.
    """
    frac = elapsed_s / run_s if run_s > 0 else 1.0
    gear_txt = "  ".join(f"{role} {g.text()}" for role, g in gears.items())
    q = "  - " if qps is None or math.isnan(qps) else f"{qps:5.1f}"
    return (
        f"{bar(frac)} {min(elapsed_s, run_s):4.0f}/{run_s:.0f} s  {issued}/{total} req  {gear_txt}  "
        f"router: QPS {q}  P99 TTFT {_ms(ttft_p99_ms)} ms  ITL {_ms(itl_p99_ms)} ms"
    )
