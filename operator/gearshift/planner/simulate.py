"""A discrete-event simulator of one gear: requests arrive, are batched, and flow through the stages.

Kind: an *in-order* discrete-event simulation over micro-batches with Poisson arrivals. Each stage is a
station with one server per node holding it (pipeline replicas and hot-stage replicas alike); a
micro-batch takes, at every stage in turn, the server that finishes it first, then crosses the link to
the next stage. Micro-batches enter in arrival order and keep it -- as pipeline-parallel engines (vLLM)
schedule them -- so one pass in dispatch order is an exact event simulation of that policy, with no
event heap. Batching is continuous: when the first stage has a free server and the in-flight window
(``max_batch / micro_batch`` micro-batches per pipeline) allows, whatever requests wait (up to
``micro_batch``) leave at once, so light load gives small, fast batches and heavy load full ones.

Why not a closed-form queue: stage times depend on the batch size the load produces, stations are
heterogeneous multi-server queues in tandem, and P99 is wanted -- an M/G/1 formula would give none of
these. The run is seeded and bounded (``requests``), so it is deterministic and fast.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: Share of simulated requests dropped as warm-up before latencies are counted.
WARMUP_SHARE = 0.1


@dataclass(frozen=True)
class SimResult:
    """Latency and throughput of one simulated run."""

    qps: float
    """Offered load, requests/s."""
    requests: int
    p50_ms: float
    p99_ms: float
    mean_ms: float
    achieved_rps: float
    """Completed requests per second over the run."""
    mean_batch: float
    """Mean requests per micro-batch."""
    saturated: bool
    """True when the offered load exceeds what the gear served (queues grew through the run)."""


def simulate(
    stage_ms: Sequence[Sequence[Sequence[float]]],
    link_ms: Sequence[Sequence[float]],
    micro_batch: int,
    window: int,
    qps: float,
    *,
    requests: int = 2000,
    seed: int = 0,
    busy_ms: Sequence[Sequence[Sequence[float]]] | None = None,
    busy_slack_ms: float = 0.0,
) -> SimResult:
    """Simulate ``requests`` Poisson arrivals at ``qps`` through a gear.

    Args:
        stage_ms: ``[stage][server][n-1]`` ms for a micro-batch of ``n`` requests (n = 1..micro_batch).
        link_ms: ``[boundary][n-1]`` ms to move ``n`` requests' activations from stage k to k+1.
        micro_batch: most requests per micro-batch.
        window: most micro-batches in flight at once (over all pipelines).
        qps: offered load, requests/s (> 0).
        requests: how many requests to simulate (bounds the run).
        seed: seed of the arrival process.
        busy_ms: like ``stage_ms``, how long a micro-batch keeps its server busy when that is longer than
            its passage (a request's decode steps occupy the stage after its first token has left);
            None: ``stage_ms``.
        busy_slack_ms: how far behind a server's work beyond passages may fall before it holds the next
            micro-batch, ms. 0: a micro-batch waits until the earlier ones' whole busy time is done (one
            batch at a time). Under continuous batching a request's decode steps are spread over its
            decode (about ``(o − 1)`` × TPOT) and interleave with later prompts, which wait for at most a
            step; the slack lets that work trail by as long, so prompts queue only when the stage's work
            outruns it (the stage is over capacity).

    Raises:
        ValueError: ``qps`` ≤ 0, no stages, or tables of the wrong length.
    """
    if qps <= 0:
        raise ValueError(f"qps must be > 0, got {qps}")
    if not stage_ms or any(not servers for servers in stage_ms):
        raise ValueError("a gear needs at least one stage with at least one server")
    if len(link_ms) != len(stage_ms) - 1:
        raise ValueError("link_ms needs one entry per stage boundary")
    busy = stage_ms if busy_ms is None else busy_ms
    if len(busy) != len(stage_ms) or any(len(b) != len(t) for b, t in zip(busy, stage_ms, strict=True)):
        raise ValueError("busy_ms needs the shape of stage_ms")
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1000.0 / qps, size=requests)).tolist()
    free = [[0.0] * len(servers) for servers in stage_ms]
    work = [[0.0] * len(servers) for servers in stage_ms]
    done: list[float] = []
    latency = [0.0] * requests
    batches = 0
    i = 0
    while i < requests:
        t = max(arrivals[i], min(free[0]))
        if len(done) >= window:
            t = max(t, done[-window])
        n = 1
        while n < micro_batch and i + n < requests and arrivals[i + n] <= t:
            n += 1
        ready = t
        for k, servers in enumerate(stage_ms):
            best_j, best_start, best_end = 0, 0.0, float("inf")
            for j, table in enumerate(servers):
                start = max(ready, free[k][j], work[k][j] - busy_slack_ms)
                end = start + table[n - 1]
                if end < best_end:
                    best_j, best_start, best_end = j, start, end
            free[k][best_j] = best_end
            work[k][best_j] = max(work[k][best_j], best_start) + busy[k][best_j][n - 1]
            ready = best_end + (link_ms[k][n - 1] if k < len(link_ms) else 0.0)
        done.append(ready)
        for r in range(i, i + n):
            latency[r] = ready - arrivals[r]
        batches += 1
        i += n
    skip = int(requests * WARMUP_SHARE)
    counted = np.array(latency[skip:])
    span_ms = max(done) - arrivals[0]
    achieved = requests / span_ms * 1000.0 if span_ms > 0 else 0.0
    # Queues that keep growing show as a late half much slower than the early half.
    half = len(counted) // 2
    saturated = bool(half and np.median(counted[half:]) > 2.0 * np.median(counted[:half]) + 1.0)
    return SimResult(
        qps=qps,
        requests=requests,
        p50_ms=float(np.percentile(counted, 50)),
        p99_ms=float(np.percentile(counted, 99)),
        mean_ms=float(counted.mean()),
        achieved_rps=achieved,
        mean_batch=requests / batches,
        saturated=saturated,
    )
