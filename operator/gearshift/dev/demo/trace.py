"""Trace windowing for the demo: which part of a trace to replay, how fast, and how far along a run is.

Pure: trace requests in, plain numbers out. A trace of ``span`` seconds replayed at time scale ``k``
takes ``span / k`` seconds; the demo caps that at ``duration`` seconds, so it replays the window
``[start, start + duration × k)`` of the trace.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

from gearshift.dev.loadgen import TraceRequest


@dataclass(frozen=True)
class Window:
    """The part of a trace one demo run replays, with its arrival times on the run's clock."""

    start_s: float
    """Start of the window, s after the trace's first request."""
    span_s: float
    """Length of the window in trace seconds."""
    time_scale: float
    """Trace seconds per run second (10: ten times faster than recorded)."""
    requests: tuple[TraceRequest, ...]
    """The window's requests, offsets from the window start (trace seconds, before scaling)."""

    @property
    def run_s(self) -> float:
        """How long issuing the window's requests takes at ``time_scale``, s."""
        return self.span_s / self.time_scale

    @property
    def due_s(self) -> list[float]:
        """Each request's send time on the run's clock, s (sorted)."""
        return [r.offset_s / self.time_scale for r in self.requests]

    def mean_rate(self) -> float:
        """Offered requests per run second over the window."""
        return len(self.requests) / self.run_s if self.run_s > 0 else 0.0


def trace_span(trace: Sequence[TraceRequest]) -> float:
    """Seconds from the first to the last request of ``trace`` (0 for fewer than two)."""
    return trace[-1].offset_s - trace[0].offset_s if len(trace) > 1 else 0.0


def auto_time_scale(trace: Sequence[TraceRequest], duration_s: float) -> float:
    """The smallest time scale that replays the whole trace within ``duration_s`` (never below 1).

    Rounded up to one decimal so the printed scale is the one used.
    """
    if duration_s <= 0:
        raise ValueError("duration_s must be positive")
    return max(1.0, math.ceil(10 * trace_span(trace) / duration_s) / 10)


def window(
    trace: Sequence[TraceRequest],
    time_scale: float,
    duration_s: float,
    start_s: float = 0.0,
    keep_every: int = 1,
) -> Window:
    """The requests of ``trace`` that arrive within ``duration_s`` run seconds from ``start_s``; with
    ``keep_every`` N > 1 only the 1st, (N+1)th, ... of them (the trace's shape at 1/N of its load).

    Args:
        trace: requests sorted by offset (``gearshift.dev.loadgen.load_trace``).
        time_scale: trace seconds per run second (> 0).
        duration_s: cap on the run's issuing time, s (> 0).
        start_s: where in the trace to start, trace seconds.
        keep_every: keep every Nth request of the window (>= 1).

    Raises:
        ValueError: non-positive scale or duration, ``keep_every`` < 1, or a window holding no request.
    """
    if time_scale <= 0 or duration_s <= 0:
        raise ValueError("time_scale and duration_s must be positive")
    if keep_every < 1:
        raise ValueError(f"keep_every must be >= 1, got {keep_every}")
    end = start_s + duration_s * time_scale
    picked = [r for r in trace if start_s <= r.offset_s < end][::keep_every]
    if not picked:
        raise ValueError(f"no trace request in [{start_s:g}, {end:g}) s of the trace")
    last = picked[-1].offset_s - start_s
    # The window ends at the cap, or one trace second after its last request when the trace ends sooner
    # (so the last request's rate bin is not empty).
    span = min(end - start_s, last + 1.0)
    reqs = tuple(TraceRequest(r.offset_s - start_s, r.prompt_tokens, r.output_tokens) for r in picked)
    return Window(start_s=start_s, span_s=span, time_scale=time_scale, requests=reqs)


def issued_by(due_s: Sequence[float], elapsed_s: float) -> int:
    """How many requests with send times ``due_s`` (sorted) are due ``elapsed_s`` s into the run."""
    return bisect.bisect_right(due_s, elapsed_s)


def offered_rate(due_s: Sequence[float], bin_s: float, run_s: float) -> tuple[list[float], list[float]]:
    """Offered requests/s per ``bin_s`` bin of a run of ``run_s`` s: (bin centres, rates)."""
    if bin_s <= 0:
        raise ValueError("bin_s must be positive")
    n = max(1, math.ceil(run_s / bin_s))
    counts = [0] * n
    for t in due_s:
        k = min(n - 1, max(0, int(t // bin_s)))
        counts[k] += 1
    return [(k + 0.5) * bin_s for k in range(n)], [c / bin_s for c in counts]
