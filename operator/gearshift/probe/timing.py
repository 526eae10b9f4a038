"""Repeated timing of one operation: warm-up, bounded repetitions, median and spread.

The clock is the backend's: CUDA events on a GPU (they time the kernels on the device's own clock, so
host-side launch jitter does not count), ``time.perf_counter`` on the CPU. Every loop is bounded twice:
by a repetition count and by a :class:`Deadline`, so a probe finishes in a bounded time even on a card
far slower than expected.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


class ProbeTimeoutError(RuntimeError):
    """The probe's time budget ran out before a measurement had its minimum repetitions."""


class Deadline:
    """A wall-clock deadline, ``budget_s`` seconds after creation (monotonic clock)."""

    def __init__(self, budget_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if budget_s <= 0:
            raise ValueError(f"time budget must be > 0 s, got {budget_s}")
        self._clock = clock
        self.budget_s = budget_s
        self.end = clock() + budget_s

    def remaining_s(self) -> float:
        """Seconds left (negative once passed)."""
        return self.end - self._clock()

    def expired(self) -> bool:
        return self.remaining_s() <= 0

    def check(self, what: str) -> None:
        """Raise :class:`ProbeTimeoutError` naming ``what`` if the deadline has passed."""
        if self.expired():
            raise ProbeTimeoutError(
                f"probe time budget of {self.budget_s:g} s ran out before {what}; "
                "raise --time-budget-s or use smaller --matmul-size/--seq-len"
            )


class Timer(Protocol):
    """Times one call of ``fn`` in milliseconds, including everything it queued on the device."""

    def __call__(self, fn: Callable[[], Any]) -> float: ...


def perf_counter_timer(fn: Callable[[], Any]) -> float:
    """Time ``fn()`` with ``time.perf_counter``, ms (CPU backends compute synchronously)."""
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


@dataclass(frozen=True)
class Timing:
    """Summary of repeated timings of one operation, ms."""

    median_ms: float
    min_ms: float
    max_ms: float
    iqr_ms: float
    """Interquartile range (p75 − p25), ms: the spread, robust to a single outlier."""
    reps: int
    warmup: int

    @property
    def spread(self) -> float:
        """Relative spread: IQR / median (0 = perfectly steady)."""
        return self.iqr_ms / self.median_ms if self.median_ms > 0 else 0.0

    def to_dict(self) -> dict[str, float | int]:
        return {
            "medianMs": self.median_ms,
            "minMs": self.min_ms,
            "maxMs": self.max_ms,
            "iqrMs": self.iqr_ms,
            "spread": round(self.spread, 6),
            "reps": self.reps,
            "warmup": self.warmup,
        }


def summarize(samples_ms: list[float], warmup: int = 0) -> Timing:
    """Median, min, max and IQR of ``samples_ms`` (ms).

    Raises:
        ValueError: no samples, or a negative or non-finite sample.
    """
    if not samples_ms:
        raise ValueError("no timing samples")
    for s in samples_ms:
        if not (s >= 0 and s != float("inf")):
            raise ValueError(f"timing sample {s!r} ms is not a finite non-negative number")
    if len(samples_ms) >= 2:
        q = statistics.quantiles(samples_ms, n=4, method="inclusive")
        iqr = q[2] - q[0]
    else:
        iqr = 0.0
    return Timing(
        median_ms=statistics.median(samples_ms),
        min_ms=min(samples_ms),
        max_ms=max(samples_ms),
        iqr_ms=iqr,
        reps=len(samples_ms),
        warmup=warmup,
    )


def time_op(
    fn: Callable[[], Any],
    timer: Timer,
    *,
    deadline: Deadline,
    what: str,
    warmup: int = 2,
    reps: int = 10,
    min_reps: int = 3,
) -> Timing:
    """Run ``fn`` ``warmup`` times untimed, then up to ``reps`` timed times; summarise.

    Repetitions stop early when ``deadline`` passes, once ``min_reps`` samples exist.

    Raises:
        ProbeTimeoutError: the deadline passed before ``min_reps`` samples (names ``what``).
        ValueError: ``reps`` < ``min_reps`` or ``min_reps`` < 1.
    """
    if min_reps < 1 or reps < min_reps:
        raise ValueError(f"need 1 <= min_reps <= reps, got min_reps={min_reps}, reps={reps}")
    for _ in range(warmup):
        deadline.check(f"warming up {what}")
        fn()
    samples: list[float] = []
    for _ in range(reps):
        if deadline.expired():
            if len(samples) >= min_reps:
                break
            deadline.check(f"{what} ({len(samples)} of {min_reps} repetitions done)")
        samples.append(timer(fn))
    return summarize(samples, warmup=warmup)
