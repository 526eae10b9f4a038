"""Where the sampling loops get their numbers: the protocols the ticks read through, and the live sources
over Prometheus, the pods' own ``/metrics`` and the router pods' ``/debug/decisions``.

The :class:`~gearshift.handlers.runtime.Runtime` holds one source of each of the first two kinds (unit
tests give fakes); the adaptive batch tick is handed its router source. A source raises
:class:`~gearshift.control.signals.SignalsUnavailable` where it cannot answer, or leaves out whom it could
not reach, as each method says.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import requests

from gearshift.adapters import prometheus
from gearshift.control.autoscale import scaling as sc
from gearshift.control.autoscale import tick as rules
from gearshift.control.signals import Engine, GearSelector, PipelineShape, Reading
from gearshift.k8s.services import ROUTER_PORT


class SignalSource(Protocol):
    """Where a shifting tick gets its numbers (Prometheus in the operator, a fake in unit tests)."""

    def sample(
        self,
        url: str,
        sel: GearSelector,
        at: float,
        *,
        engine: Engine,
        shape: PipelineShape | None,
        window: str = "1m",
    ) -> Reading:
        """One raw reading of ``sel``'s gear served by ``engine`` (``shape``: its stages, for vLLM's
        derived stage utilisation; ``window``: the PromQL range of its rates); raises SignalsUnavailable."""
        ...

    def in_flight(self, url: str, sel: GearSelector) -> int:
        """Requests running or waiting on ``sel``'s head pods; raises SignalsUnavailable."""
        ...


class PrometheusSignals:
    """:class:`SignalSource` over Prometheus' HTTP API (prometheus-api-client, no retries)."""

    def __init__(self, timeout_s: float = 2.0) -> None:
        self.timeout_s = timeout_s

    def sample(
        self,
        url: str,
        sel: GearSelector,
        at: float,
        *,
        engine: Engine,
        shape: PipelineShape | None,
        window: str = "1m",
    ) -> Reading:
        return prometheus.fetch_reading(
            url, sel, at, engine=engine, shape=shape, window=window, timeout_s=self.timeout_s
        )

    def in_flight(self, url: str, sel: GearSelector) -> int:
        return prometheus.in_flight(url, sel, self.timeout_s)


class ScaleSignalSource(Protocol):
    """Where an autoscaler tick gets its numbers (Prometheus and pod endpoints in the operator, a fake in
    tests)."""

    def sample(self, url: str, sel: GearSelector, metric: str, slo_ms: float, at: float) -> sc.ScaleSample:
        """KV usage, waiting/running and P99 / SLO of ``sel``'s head pods; raises SignalsUnavailable."""
        ...

    def counter(self, pods: Sequence[Mapping[str, Any]], port: int, name: str) -> float | None:
        """Sum of metric ``name`` over the pods' ``/metrics`` (None: none answered)."""
        ...


def _pod_url(pod: Mapping[str, Any], port: int) -> str | None:
    ip = (pod.get("status") or {}).get("podIP")
    return f"http://{ip}:{port}/metrics" if ip else None


class LiveSignals:
    """:class:`ScaleSignalSource` over Prometheus' HTTP API and the pods' own ``/metrics``."""

    def __init__(self, timeout_s: float = 2.0) -> None:
        self.timeout_s = timeout_s

    def sample(self, url: str, sel: GearSelector, metric: str, slo_ms: float, at: float) -> sc.ScaleSample:
        queries = rules.sample_queries(sel, metric)
        results = prometheus.instant_queries(url, queries.values(), self.timeout_s)
        return rules.sample_from(queries, results, slo_ms, at)

    def counter(self, pods: Sequence[Mapping[str, Any]], port: int, name: str) -> float | None:
        total, seen = 0.0, False
        for p in pods:
            url = _pod_url(p, port)
            if url is None:
                continue
            try:
                text = requests.get(url, timeout=self.timeout_s).text
            except requests.RequestException:
                continue
            v = sc.parse_counter(text, name)
            if v is not None:
                total, seen = total + v, True
        return total if seen else None


class RouterDecisionSource(Protocol):
    """Where a tick reads the routers' balance rounds (HTTP in the operator, a fake in unit tests)."""

    def fetch(self, pods: Sequence[Mapping[str, Any]]) -> list[tuple[str, Mapping[str, Any]]]:
        """``(router pod name, its /debug/decisions JSON)`` for each router pod that answered."""
        ...


class HttpRouterDecisions:
    """:class:`RouterDecisionSource` over the router pods' ``/debug/decisions`` (pod IPs)."""

    def __init__(self, timeout_s: float = 2.0) -> None:
        self.timeout_s = timeout_s

    def fetch(self, pods: Sequence[Mapping[str, Any]]) -> list[tuple[str, Mapping[str, Any]]]:
        out: list[tuple[str, Mapping[str, Any]]] = []
        for p in pods:
            ip = (p.get("status") or {}).get("podIP")
            if not ip or (p.get("metadata") or {}).get("deletionTimestamp"):
                continue
            try:
                r = requests.get(f"http://{ip}:{ROUTER_PORT}/debug/decisions", timeout=self.timeout_s)
                doc = r.json() if r.status_code == 200 else None
            except (requests.RequestException, ValueError):
                continue
            if isinstance(doc, dict):
                out.append((str(p["metadata"]["name"]), doc))
        return out
