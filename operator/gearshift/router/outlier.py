"""Which pods the router may send to: active health checks, passive outlier ejection, panic mode.

Pure bookkeeping on :class:`~gearshift.router.pool.Backend` records (no I/O; time ``now`` is monotonic
seconds passed in). The semantics are Envoy's, which settled them for exactly this failure: a busy
machine answers slowly, one slow answer must not take a pod out, and nothing may take every pod out.

- **Active health checks** (``config.core.v3.HealthCheck``): a pod is marked unhealthy after
  ``unhealthy_threshold`` consecutive failed checks (a check fails on a non-200 answer or on no answer
  within ``timeout_s``), and healthy again after ``healthy_threshold`` consecutive passes. Pods start
  healthy: they come from EndpointSlices, whose kubelet readiness probe has passed already (Envoy would
  wait for one passing check; the probe is that check). A passing check also unejects the pod
  (``successful_active_health_check_uneject_host``, default true).
- **Passive outlier detection** (``config.cluster.v3.OutlierDetection``): ``consecutive_5xx`` (default 5)
  consecutive errors — 5xx answers and local-origin errors (connect failures, resets) alike, as with
  ``split_external_local_origin_errors: false`` — eject the pod for ``base_ejection_time`` (30 s) times
  the number of times it has been ejected, at most ``max_ejection_time`` (300 s). The count falls by one
  for each ``interval`` (10 s) the pod spends back in service. At most ``max_ejection_percent`` (10 %)
  of a role's pods are ejected at once, but at least one may be.
- **Panic threshold** (load balancing, ``healthy_panic_threshold``, default 50 %): when fewer than that
  share of a role's pods are both healthy and not ejected, the router sends to *all* of the role's pods,
  ignoring health: a pod that might answer beats a certain 503.

Sources: envoyproxy.io docs, "Outlier detection" (intro/arch_overview/upstream/outlier) and
``api-v3/config/cluster/v3/outlier_detection.proto``; "Health checking" and
``api-v3/config/core/v3/health_check.proto``; "Panic threshold"
(intro/arch_overview/upstream/load_balancing/panic_threshold).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class OutlierConfigError(ValueError):
    """A threshold out of range; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field} {message}")
        self.field = field


@dataclass(frozen=True)
class OutlierConfig:
    """Thresholds; the defaults are Envoy's (the module docstring)."""

    consecutive_errors: int = 5
    """Envoy ``consecutive_5xx``: consecutive errors that eject a pod; 0 disables passive ejection."""
    base_ejection_s: float = 30.0
    max_ejection_s: float = 300.0
    interval_s: float = 10.0
    """Envoy ``interval``: each one a pod spends in service lowers its ejection multiplier by one."""
    max_ejection_percent: float = 10.0
    panic_threshold_percent: float = 50.0
    """Envoy ``healthy_panic_threshold``; 0 disables panic mode."""
    unhealthy_threshold: int = 3
    healthy_threshold: int = 2
    check_timeout_s: float = 5.0
    """An active check not answered within this fails, s. vLLM's ``/health`` awaits the engine core, which
    a loaded machine delays by seconds; Kubernetes' probe default is 1 s, the operator's vLLM probes 5 s."""

    def __post_init__(self) -> None:
        """Raises: OutlierConfigError naming the field out of range."""
        lowest = {"consecutive_errors": 0, "unhealthy_threshold": 1, "healthy_threshold": 1}
        for name, low in lowest.items():
            if getattr(self, name) < low:
                raise OutlierConfigError(name, f"must be at least {low}, got {getattr(self, name)}")
        for name in ("base_ejection_s", "max_ejection_s", "interval_s", "check_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise OutlierConfigError(name, f"must be a finite number of seconds above 0, got {value}")
        for name in ("max_ejection_percent", "panic_threshold_percent"):
            if not 0 <= getattr(self, name) <= 100:
                raise OutlierConfigError(name, f"must be within 0..100 %, got {getattr(self, name)}")


class Host(Protocol):
    """What this module reads and writes on a pod record (:class:`gearshift.router.pool.Backend`)."""

    healthy: bool
    check_failures: int
    check_passes: int
    failures: int
    ejected_until: float
    ejections: int
    returned_at: float


def ejected(h: Host, now: float) -> bool:
    return now < h.ejected_until


def available(h: Host, now: float) -> bool:
    """Healthy by active checks and not ejected."""
    return h.healthy and not ejected(h, now)


def routable(hosts: Sequence[Host], now: float, cfg: OutlierConfig) -> tuple[list[int], bool]:
    """Indices of ``hosts`` (one role's pods) the router may send to, and whether that is panic mode.

    Below the panic threshold every host is routable; with no host at all, none.
    """
    ok = [i for i, h in enumerate(hosts) if available(h, now)]
    if hosts and 100.0 * len(ok) / len(hosts) < cfg.panic_threshold_percent:
        return list(range(len(hosts))), True
    return ok, False


def record_check(h: Host, passed: bool, now: float, cfg: OutlierConfig) -> None:
    """Count one active health check of ``h``."""
    if passed:
        h.check_failures = 0
        h.check_passes += 1
        if not h.healthy and h.check_passes >= cfg.healthy_threshold:
            h.healthy = True
        if h.healthy and ejected(h, now):
            _return(h, now)
        if h.healthy:
            h.failures = 0
    else:
        h.check_passes = 0
        h.check_failures += 1
        if h.check_failures >= cfg.unhealthy_threshold:
            h.healthy = False


def record_success(h: Host) -> None:
    """A request leg got an answer that is not a server error: the consecutive-error run ends."""
    h.failures = 0


def record_error(h: Host, now: float, peers: Sequence[Host], cfg: OutlierConfig) -> bool:
    """Count one error (5xx answer or local-origin failure) of ``h``; True when it ejected ``h`` now.

    ``peers`` are the pods of ``h``'s role, ``h`` among them: they bound how many may be ejected at once.
    """
    h.failures += 1
    if cfg.consecutive_errors == 0 or h.failures < cfg.consecutive_errors or ejected(h, now):
        return False
    already = sum(1 for p in peers if p is not h and ejected(p, now))
    cap = max(1, math.floor(len(peers) * cfg.max_ejection_percent / 100.0))
    if already >= cap:
        return False
    # Envoy lowers the multiplier by one per interval spent back in service.
    if h.ejections and h.returned_at:
        h.ejections = max(0, h.ejections - int((now - h.returned_at) // cfg.interval_s))
    h.ejections += 1
    longest = max(cfg.max_ejection_s, cfg.base_ejection_s)
    h.ejected_until = now + min(cfg.base_ejection_s * h.ejections, longest)
    h.failures = 0
    return True


def release_expired(hosts: Sequence[Host], now: float) -> None:
    """Return to service the hosts whose ejection time has passed (stamps when, for the multiplier)."""
    for h in hosts:
        if h.ejected_until and not ejected(h, now):
            _return(h, now)


def _return(h: Host, now: float) -> None:
    h.ejected_until = 0.0
    h.returned_at = now
    h.failures = 0
