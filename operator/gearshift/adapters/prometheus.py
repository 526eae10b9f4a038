"""The one Prometheus client of the operator: instant queries over prometheus-api-client, no retries.

No retries because every caller samples again within seconds (``sampleIntervalS``), and a retrying client
(the library's default backs off for seconds) would stall a control loop while Prometheus is down.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from gearshift.control.signals import (
    Engine,
    GearSelector,
    PipelineShape,
    Reading,
    SignalsUnavailable,
    queue_query,
    reading_from_results,
    running_query,
    signal_queries,
)


def instant_queries(url: str, queries: Iterable[str], timeout_s: float = 5.0) -> dict[str, Sequence[Any]]:
    """Each query's instant-vector result (Prometheus' ``/api/v1/query`` ``data.result``), by query.

    Raises:
        SignalsUnavailable: Prometheus at ``url`` unreachable or an error answer (names the query).
    """
    import requests
    from prometheus_api_client import PrometheusConnect
    from prometheus_api_client.exceptions import PrometheusApiClientException
    from urllib3.util.retry import Retry

    prom = PrometheusConnect(url=url, disable_ssl=True, timeout=timeout_s, retry=Retry(total=0))
    results: dict[str, Sequence[Any]] = {}
    for query in queries:
        try:
            results[query] = prom.custom_query(query)
        except (PrometheusApiClientException, requests.RequestException) as err:
            raise SignalsUnavailable(f"Prometheus at {url} did not answer {query!r}: {err}") from err
    return results


def fetch_reading(
    url: str,
    sel: GearSelector,
    at: float,
    *,
    engine: Engine = "sim",
    shape: PipelineShape | None = None,
    window: str = "1m",
    timeout_s: float = 5.0,
) -> Reading:
    """One reading of ``sel``'s gear (:func:`gearshift.control.signals.reading_from_results`).

    Args:
        url: Prometheus base URL, e.g. ``http://127.0.0.1:9090``.
        sel: the gear's pods.
        at: the sample's time, s (the caller's clock).
        engine: ``PDService.spec.engine``; picks the queries (``signal_queries``).
        shape: the sampled gear's stages (vLLM's derivation needs them).
        window: range of the rates, a PromQL duration.
        timeout_s: per-request timeout, s.

    Raises:
        SignalsUnavailable: Prometheus unreachable, an error answer, or a required series missing.
    """
    queries = signal_queries(sel, window, engine)
    return reading_from_results(at, queries, instant_queries(url, queries.all(), timeout_s), shape)


def in_flight(url: str, sel: GearSelector, timeout_s: float = 5.0) -> int:
    """Requests running or waiting on ``sel``'s head pods.

    Raises:
        SignalsUnavailable: Prometheus unreachable, an error answer, or no series.
    """
    queries = (running_query(sel), queue_query(sel))
    results = instant_queries(url, queries, timeout_s)
    total = 0.0
    for q in queries:
        if not results[q]:
            raise SignalsUnavailable(f"no series for {q!r}")
        total += float(results[q][0]["value"][1])
    return round(total)
