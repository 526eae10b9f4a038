"""Time per output token of a pipeline under continuous batching, and the load at which it meets a target.

A request's TPOT (its mean inter-token latency, what the SLO judges: DistServe's goodput, Zhong et al. OSDI
2024) on a gear that runs both phases (role ``both``) is set by three things, modelled here per pipeline
replica of ``K`` stages, as :mod:`gearshift.sim.perfmodel` times the engine:

- **The step period.** ``N`` running sequences are split into ``m = min(K, ⌈N⌉)`` micro-batches of
  ``d = N / m`` sequences (vLLM V1 keeps one batch per stage in flight). Every sequence gets one token per
  period ``max(L(d), m · B(d))``, where ``L`` is one micro-batch's trip over every stage and link and
  ``B`` the slowest stage's time for it (GPipe fill/drain, Huang et al. NeurIPS 2019).
- **Prefill interference.** Prompts share the stages with the decode steps (chunked prefill puts them into
  the same steps), so decode gets the time prefills leave: the period is stretched by ``1 / (1 − ρ)``,
  where ``ρ = λ · P`` is the share of the bottleneck stage's time spent on prompts at ``λ`` requests/s per
  pipeline, ``P`` one prompt's time there (a processor-sharing view of the stage).
- **How many run.** Little's law: ``N = λ · (o − 1) · TPOT`` sequences are decoding at once, capped by
  the pipeline's max batch; ``N`` and TPOT depend on each other, so they are iterated to their fixed point.

Pure: no I/O. Units: ms, requests/s.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

#: Fixed-point iterations of TPOT and the running sequences (each moves TPOT by a shrinking factor; 40
#: settle it to well under 0.1 % on every gear of the example fleets).
ITERATIONS = 40
#: Bisection steps for the highest load that meets a TPOT target (2^-30 of the search range).
BISECTIONS = 30


@dataclass(frozen=True)
class DecodeTimes:
    """One pipeline replica's times, from the cost model and the nodes that hold its stages.

    ``step_ms(d)``: per stage, one decode step of a micro-batch of ``d`` sequences, ms (d ≥ 1, real);
    ``link_ms(d)``: every stage boundary together, moving ``d`` tokens' activations, ms;
    ``prefill_ms``: per stage, one request's prompt, ms.
    """

    step_ms: Callable[[float], Sequence[float]]
    link_ms: Callable[[float], float]
    prefill_ms: Sequence[float]

    @property
    def stages(self) -> int:
        return len(self.prefill_ms)


def period_ms(times: DecodeTimes, running: float) -> float:
    """The step period with ``running`` sequences decoding (at least one), ms."""
    k = times.stages
    n = max(1.0, running)
    m = min(float(k), math.ceil(n - 1e-9))
    d = n / m
    steps = times.step_ms(d)
    latency = sum(steps) + times.link_ms(d)
    return max(latency, m * max(steps))


def tpot_ms(times: DecodeTimes, rps: float, output_tokens: int, max_batch: int) -> float:
    """Mean time per output token at ``rps`` requests/s into this pipeline, ms; ``inf`` when prompts alone
    keep the bottleneck stage busy (ρ ≥ 1).

    Raises:
        ValueError: ``rps`` < 0, ``output_tokens`` < 1 or ``max_batch`` < 1.
    """
    if rps < 0 or output_tokens < 1 or max_batch < 1:
        raise ValueError(
            f"need rps >= 0, output_tokens >= 1, max_batch >= 1; got {rps}, {output_tokens}, {max_batch}"
        )
    rho = rps * max(times.prefill_ms) / 1000.0
    if rho >= 1.0:
        return math.inf
    stretch = 1.0 / (1.0 - rho)
    tpot = period_ms(times, 1.0) * stretch
    for _ in range(ITERATIONS):
        running = min(float(max_batch), rps * max(output_tokens - 1, 0) * tpot / 1000.0)
        tpot = period_ms(times, running) * stretch
    return tpot


def tpot_capacity(
    times: DecodeTimes, target_ms: float, output_tokens: int, max_batch: int, upper_rps: float
) -> float:
    """The highest load (requests/s into this pipeline, at most ``upper_rps``) whose TPOT is ≤
    ``target_ms`` and whose decoding sequences (Little's law: ``λ · (o − 1) · TPOT``) fit ``max_batch``
    (beyond, each new request waits for a running one to finish: the queue grows without bound); 0 when
    even a lone request's TPOT is above the target. Both rise with load, so a bisection finds it.

    Raises:
        ValueError: ``target_ms`` ≤ 0 or ``upper_rps`` < 0.
    """
    if target_ms <= 0 or upper_rps < 0:
        raise ValueError(f"need target_ms > 0 and upper_rps >= 0; got {target_ms}, {upper_rps}")

    def fits(rps: float) -> bool:
        tpot = tpot_ms(times, rps, output_tokens, max_batch)
        return tpot <= target_ms and rps * max(output_tokens - 1, 0) * tpot / 1000.0 <= max_batch

    if not fits(0.0):
        return 0.0
    if fits(upper_rps):
        return upper_rps
    lo, hi = 0.0, upper_rps
    for _ in range(BISECTIONS):
        mid = (lo + hi) / 2.0
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo
