"""Arrivals for the twin: a trace CSV, or requests a replay already picked (pure but for reading a CSV)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gearshift.dev import tracefile


@dataclass(frozen=True)
class Trace:
    """Arrivals (s from the first), prompt and output token counts, in arrival order."""

    t: np.ndarray
    prompt: np.ndarray
    output: np.ndarray
    speed: float = 1.0
    """The time compression ``t`` was replayed at: ``t`` = original trace seconds / ``speed``."""

    @property
    def duration_s(self) -> float:
        return float(self.t[-1]) if len(self.t) else 0.0

    @property
    def trace_hours(self) -> float:
        """Hours of the original trace the replay covers (``duration_s`` × ``speed`` / 3600)."""
        return self.duration_s * self.speed / 3600.0


def load_trace(path: Path, limit_s: float | None = None, speed: float = 1.0) -> Trace:
    """Read a trace CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``) with the load generator's reader
    (:func:`gearshift.dev.tracefile.load_trace`: the same rows at the same offsets).

    ``speed`` > 1 compresses time (arrivals ``speed`` times denser); ``limit_s`` keeps the first seconds of
    the (compressed) trace.

    Raises:
        TraceError: a bad row or column, naming the file and line.
        OSError: the file cannot be read.
    """
    rows = tracefile.load_trace(path)
    t = np.array([r.offset_s for r in rows], dtype=float) / speed
    p = np.array([r.prompt_tokens for r in rows], dtype=np.int64)
    o = np.array([r.output_tokens for r in rows], dtype=np.int64)
    if limit_s is not None:
        keep = t <= limit_s
        t, p, o = t[keep], p[keep], o[keep]
    return Trace(t, p, o, speed)


def trace_from_requests(requests: Iterable[tracefile.TraceRequest], time_scale: float = 1.0) -> Trace:
    """The twin's :class:`Trace` of requests a replay picked (``offset_s`` in trace seconds from the
    window's start), arriving ``time_scale`` times faster than recorded, as the demo's load generator
    sends them (token counts of 0 count as 1).

    Raises:
        ValueError: no request, or ``time_scale`` <= 0.
    """
    rows = list(requests)
    if not rows or time_scale <= 0:
        raise ValueError("trace_from_requests needs at least one request and a positive time_scale")
    t = np.array([r.offset_s for r in rows], dtype=float) / time_scale
    order = np.argsort(t, kind="stable")
    p = np.array([max(1, int(r.prompt_tokens)) for r in rows])[order]
    o = np.array([max(1, int(r.output_tokens)) for r in rows])[order]
    return Trace(t[order], p, o, time_scale)
