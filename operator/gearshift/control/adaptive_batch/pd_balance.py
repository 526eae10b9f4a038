"""PD load balancing decisions (docs/sources.md#rebalancing, docs/sources.md#adaptive-batch): dynamic
rebalancing and adaptive batch sizing. Pure.

Every ``INTERVAL_S`` (5 s) the caller (the router's control loop, later the operator) hands in one
:class:`PodLoad` per pod and gets a :class:`Decisions` back; nothing here applies anything.

Rebalancing (docs/sources.md#rebalancing): per role, load = ``0.6 · gpu_util + 0.4 · memory_util``; the role
is imbalanced when ``max − min > 0.3`` or some pod is above 0.9. The PD guide then migrates up to 5 requests
from the busiest to the idlest pod. vLLM cannot move a running request between engines, so the decision
instead names the pods new requests should spare (``avoid``: the busiest, and every pod above 0.9, while a pod
under 0.9 exists) and the migration the PD guide would have made (``migrate``) for the record.

Adaptive batch (docs/sources.md#adaptive-batch): ITL P99 > 1.2 × target → max batch × 0.9; ITL P99 < 0.8 ×
target and queue > 10 → × 1.1, capped at the hard max. Corrections: the PD guide's ``int(max × 1.1)`` never
grows a max batch below 10 (int(9 × 1.1) = 9), so growth is at least +1; shrinking is at least −1 and never
below 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

#: The PD guide (docs/sources.md#rebalancing): seconds between balance checks.
INTERVAL_S = 5.0
#: The PD guide (docs/sources.md#rebalancing): load spread (max − min) above which a role is imbalanced.
SPREAD_THRESHOLD = 0.3
#: The PD guide (docs/sources.md#rebalancing): a pod above this load is overloaded.
OVERLOAD_THRESHOLD = 0.9
#: The PD guide (docs/sources.md#rebalancing): requests moved per rebalance.
MIGRATE_COUNT = 5
#: The PD guide (docs/sources.md#adaptive-batch): adaptive batch factors and thresholds.
SHRINK_FACTOR, GROW_FACTOR = 0.9, 1.1
HIGH_ITL, LOW_ITL = 1.2, 0.8
QUEUE_BACKLOG = 10


@dataclass(frozen=True)
class PodLoad:
    """One pod's signals for a balance round."""

    name: str
    role: str
    gpu_util: float
    """0..1."""
    memory_util: float
    """KV-cache usage 0..1."""
    itl_p99_ms: float | None = None
    """ITL P99 over the last interval, ms; None when no tokens were produced."""
    queue_depth: float = 0.0
    max_batch: int = 256
    hard_max_batch: int = 1024

    @property
    def load(self) -> float:
        """The PD guide (docs/sources.md#rebalancing): ``0.6 · gpu_util + 0.4 · memory_util``."""
        return 0.6 * self.gpu_util + 0.4 * self.memory_util


@dataclass(frozen=True)
class RebalanceDecision:
    """Whether one role is imbalanced, and what the router should do about it."""

    role: str
    imbalanced: bool
    spread: float
    max_load: float
    reason: str
    busiest: str | None = None
    idlest: str | None = None
    avoid: tuple[str, ...] = ()
    migrate: int = 0


@dataclass(frozen=True)
class BatchDecision:
    """A pod's max batch size now and what the PD guide's rule would set."""

    pod: str
    current: int
    proposed: int
    reason: str

    @property
    def changed(self) -> bool:
        return self.proposed != self.current


@dataclass(frozen=True)
class Decisions:
    """One balance round's output."""

    at: float
    """Caller's clock, s."""
    rebalance: tuple[RebalanceDecision, ...] = ()
    batch: tuple[BatchDecision, ...] = field(default_factory=tuple)

    @property
    def avoid(self) -> frozenset[str]:
        return frozenset(n for r in self.rebalance for n in r.avoid)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (``/debug/decisions`` and GearSet/PDService status)."""
        return {
            "at": self.at,
            "rebalance": [asdict(r) for r in self.rebalance],
            "batch": [asdict(b) | {"changed": b.changed} for b in self.batch],
        }


def detect_imbalance(loads: Sequence[float]) -> tuple[bool, str]:
    """The PD guide's test (docs/sources.md#rebalancing): (imbalanced?, reason); loads 0..1.

    Fewer than two pods are never imbalanced, as in the PD guide (one pod has nowhere to shed load to).
    """
    if len(loads) < 2:
        return False, "fewer than two pods"
    spread = max(loads) - min(loads)
    if spread > SPREAD_THRESHOLD:
        return True, f"load spread {spread:.2f} > {SPREAD_THRESHOLD}"
    if max(loads) > OVERLOAD_THRESHOLD:
        return True, f"a pod's load {max(loads):.2f} > {OVERLOAD_THRESHOLD}"
    return False, "balanced"


def rebalance(role: str, pods: Sequence[PodLoad]) -> RebalanceDecision:
    """The PD guide's rebalancing decision for the pods of one role (docs/sources.md#rebalancing)."""
    mine = [p for p in pods if p.role == role]
    loads = [p.load for p in mine]
    if not mine:
        return RebalanceDecision(role, False, 0.0, 0.0, "no pods")
    spread = max(loads) - min(loads)
    imbalanced, reason = detect_imbalance(loads)
    if not imbalanced:
        return RebalanceDecision(role, False, spread, max(loads), reason)
    ordered = sorted(mine, key=lambda p: (-p.load, p.name))
    busiest, idlest = ordered[0], ordered[-1]
    avoid = {busiest.name} if spread > SPREAD_THRESHOLD else set()
    avoid |= {p.name for p in mine if p.load > OVERLOAD_THRESHOLD}
    if all(p.name in avoid for p in mine):
        # Sparing every pod spares none; keep only the strictly busiest out.
        avoid = {busiest.name} if idlest.load < busiest.load else set()
    return RebalanceDecision(
        role,
        True,
        spread,
        busiest.load,
        reason,
        busiest.name,
        idlest.name,
        tuple(sorted(avoid)),
        MIGRATE_COUNT if spread > SPREAD_THRESHOLD else 0,
    )


def adapt_batch(pod: PodLoad, target_itl_ms: float) -> BatchDecision:
    """The PD guide's adaptive batch rule for one pod (docs/sources.md#adaptive-batch) (corrections in the
    module docstring)."""
    cur = pod.max_batch
    itl = pod.itl_p99_ms
    if itl is None or not math.isfinite(itl):
        return BatchDecision(pod.name, cur, cur, "no ITL samples")
    if itl > HIGH_ITL * target_itl_ms:
        new = max(1, min(cur - 1, int(cur * SHRINK_FACTOR)))
        return BatchDecision(pod.name, cur, new, f"ITL P99 {itl:.1f} ms > {HIGH_ITL} × {target_itl_ms:g} ms")
    if itl < LOW_ITL * target_itl_ms and pod.queue_depth > QUEUE_BACKLOG:
        # A grow rule never shrinks, even when the current max already exceeds the hard max.
        new = max(cur, min(max(cur + 1, int(cur * GROW_FACTOR)), pod.hard_max_batch))
        return BatchDecision(
            pod.name,
            cur,
            new,
            f"ITL P99 {itl:.1f} ms < {LOW_ITL} × {target_itl_ms:g} ms"
            f" and queue {pod.queue_depth:g} > {QUEUE_BACKLOG}",
        )
    return BatchDecision(pod.name, cur, cur, "within band")


def evaluate(pods: Sequence[PodLoad], now: float, target_itl_ms: float = 50.0) -> Decisions:
    """One balance round: rebalancing per role (prefill, decode) and the batch rule for decode pods."""
    roles = sorted({p.role for p in pods})
    return Decisions(
        at=now,
        rebalance=tuple(rebalance(r, pods) for r in roles),
        batch=tuple(adapt_batch(p, target_itl_ms) for p in pods if p.role in ("decode", "both")),
    )
