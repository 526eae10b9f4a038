"""One sample of a GearSet's signals and its exponential moving average (docs/sources.md#shift-signals: alpha
0.3)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from enum import StrEnum
from typing import Any


class LatencyMetric(StrEnum):
    """Which P99 the latency triggers compare with ``targetP99Ms``."""

    TTFT = "ttft"
    ITL = "itl"
    E2E = "e2e"


def p99_field(metric: LatencyMetric) -> str:
    """The :class:`Sample` field of ``metric``'s P99 (``ttft_p99_ms``, ``itl_p99_ms``, ``e2e_p99_ms``)."""
    return f"{metric.value}_p99_ms"


@dataclass(frozen=True)
class Sample:
    """The signals of one GearSet at one instant (raw from Prometheus, or smoothed).

    ``stage_utilization`` holds one fraction in [0, 1] per stage of the active gear, stage 0 first.
    Latencies are in ms; ``None`` means Prometheus had no value (e.g. no requests in the window).
    """

    at: float
    """When the sample was taken, s (any monotonic origin; the controller passes it in)."""
    stage_utilization: tuple[float, ...] = ()
    queue: float = 0.0
    """Requests waiting, summed over the gear's head pods (``vllm:num_requests_waiting``)."""
    running: float = 0.0
    """Requests running, summed over the head pods (``vllm:num_requests_running``)."""
    qps: float = 0.0
    """Completed requests per second over the last minute."""
    arrival_rps: float | None = None
    """Requests arriving per second over the last minute: completions plus the growth of the requests
    in flight (``running + waiting``); ``None`` when not measured (the capacity controller then stays
    off, :mod:`gearshift.control.shifting.capacity`)."""
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p99_ms: float | None = None
    e2e_p50_ms: float | None = None
    e2e_p99_ms: float | None = None
    prompt_tokens_mean: float | None = None
    """Mean prompt tokens of the role's requests over the window (the router's
    ``vllm:request_prompt_tokens`` histogram, ``rate(_sum) / rate(_count)``); ``None``: not measured."""
    output_tokens_mean: float | None = None
    """Mean generated tokens of the role's finished requests over the window
    (``vllm:request_generation_tokens``); ``None``: not measured."""
    prompt_tokens_buckets: tuple[tuple[float, float], ...] = ()
    """The prompt-token histogram over the window: ``(le, cumulative requests/s)`` pairs in rising ``le``
    order, ``+Inf`` last (``sum by (le) (rate(..._bucket))``); empty when not measured. Not smoothed: the
    latest window's distribution."""

    def p99_ms(self, metric: LatencyMetric) -> float | None:
        """The P99 the latency triggers read, ms."""
        value: float | None = getattr(self, p99_field(metric))
        return value

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (for ``GearSet.status``)."""
        d = asdict(self)
        d["stage_utilization"] = list(self.stage_utilization)
        # JSON has no infinity: the +Inf bucket's bound is written as null.
        d["prompt_tokens_buckets"] = [
            [le if math.isfinite(le) else None, n] for le, n in self.prompt_tokens_buckets
        ]
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        """Inverse of :meth:`to_dict`."""
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        kwargs["stage_utilization"] = tuple(float(u) for u in data.get("stage_utilization", ()))
        kwargs["prompt_tokens_buckets"] = tuple(
            (math.inf if le is None else float(le), float(n))
            for le, n in data.get("prompt_tokens_buckets", ())
        )
        return cls(**kwargs)


_SCALARS = ("queue", "running", "qps")
_LATENCIES = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "e2e_p50_ms", "e2e_p99_ms")
#: The traffic mix: smoothed like the rate it is read beside.
_MIX = ("prompt_tokens_mean", "output_tokens_mean")
_OPTIONALS = ("arrival_rps", *_LATENCIES, *_MIX)


def ema(previous: float | None, value: float | None, alpha: float) -> float | None:
    """``alpha · value + (1 − alpha) · previous``; the first value passes through, a missing one keeps
    the previous average (:func:`smooth` drops a latency average instead when the window saw no traffic).
    NaN counts as missing (``histogram_quantile`` gives NaN with no traffic)."""
    if value is None or math.isnan(value):
        return previous
    if previous is None:
        return value
    return alpha * value + (1.0 - alpha) * previous


def smooth(previous: Sample | None, sample: Sample, alpha: float) -> Sample:
    """The EMA of ``sample`` onto the running average ``previous`` (``None`` before the first sample).

    When the stage count changes (a new gear serves), the per-stage average restarts from the new
    sample: stage k of one gear has nothing to do with stage k of another.
    """
    if previous is None:
        cleaned: dict[str, Any] = {k: _clean(getattr(sample, k)) for k in _OPTIONALS}
        return replace(sample, **cleaned)
    if len(previous.stage_utilization) == len(sample.stage_utilization):
        stages = tuple(
            float(ema(p, s, alpha))  # type: ignore[arg-type]
            for p, s in zip(previous.stage_utilization, sample.stage_utilization, strict=True)
        )
    else:
        stages = sample.stage_utilization
    values: dict[str, Any] = {k: ema(getattr(previous, k), getattr(sample, k), alpha) for k in _SCALARS}
    values |= {k: ema(getattr(previous, k), getattr(sample, k), alpha) for k in _OPTIONALS}
    if _idle(sample):
        # No request completed or waited in the whole window: its quantiles are absent because there
        # was nothing to measure, not because a scrape missed them. Keeping the last average would hold
        # a latency trigger latched on an idle service, and shift it when the dwell ends (the demo did,
        # after its replay).
        values |= {k: None for k in _LATENCIES if _clean(getattr(sample, k)) is None}
    buckets = sample.prompt_tokens_buckets or previous.prompt_tokens_buckets
    return Sample(at=sample.at, stage_utilization=stages, prompt_tokens_buckets=buckets, **values)


def _idle(sample: Sample) -> bool:
    """Whether ``sample`` saw no traffic over its window (no completion, nothing running or waiting)."""
    return sample.qps == 0 and sample.running == 0 and sample.queue == 0 and not sample.arrival_rps


def _clean(value: float | None) -> float | None:
    return None if value is None or math.isnan(value) else value
