"""The PromQL queries of a GearSet's signals, the parsing of Prometheus' answers, and a thin fetcher.

Series and labels: the engines export vLLM's metric names (DESIGN.md "Engine metrics") and the simulated
engine's head pod adds ``gearshift:stage_utilization{stage="k"}`` for every stage (docs/ARCHITECTURE.md).
Prometheus' pod discovery maps pod labels to series labels with ``labelmap`` (``gearshift.io/gear`` →
``gearshift_io_gear``; :mod:`gearshift.sandbox.prometheus`), so a gear's series are selected by
namespace, service, role and gear. Quantiles use ``histogram_quantile`` over the rate of the ``_bucket``
series summed by ``le`` (the Prometheus documentation's recipe for aggregated histograms).

Everything here is pure except :func:`fetch_sample`, the only function that talks to Prometheus.

Exceptions::

    SignalsUnavailable      Prometheus unreachable, an error answer, or a needed series missing
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gearshift.control.smoothing import Sample


class SignalsUnavailable(RuntimeError):
    """Prometheus gave no usable signals; the message says which query or series and why."""


#: Series label names that Prometheus' ``labelmap`` gives gearshift's pod labels.
LABEL_NAMESPACE = "namespace"
LABEL_SERVICE = "gearshift_io_service"
LABEL_ROLE = "gearshift_io_role"
LABEL_GEAR = "gearshift_io_gear"

STAGE_UTILIZATION = "gearshift:stage_utilization"
WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
SUCCESS_TOTAL = "vllm:request_success_total"
E2E = "vllm:e2e_request_latency_seconds"
TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"


@dataclass(frozen=True)
class GearSelector:
    """Which pods' series to read: one gear of one role of one PDService in a namespace."""

    namespace: str
    service: str
    role: str
    gear: str

    def matchers(self) -> str:
        """The label matchers, ``{namespace="..",gearshift_io_service="..",...}``."""
        pairs = (
            (LABEL_NAMESPACE, self.namespace),
            (LABEL_SERVICE, self.service),
            (LABEL_ROLE, self.role),
            (LABEL_GEAR, self.gear),
        )
        return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in pairs) + "}"


def _escape(value: str) -> str:
    # PromQL string literals follow Go's escaping: backslash and double quote must be escaped.
    return value.replace("\\", "\\\\").replace('"', '\\"')


def stage_utilization_query(sel: GearSelector) -> str:
    """Utilisation of each stage (0..1), averaged over the gear's pipeline replicas; one series per stage."""
    return f"avg by (stage) ({STAGE_UTILIZATION}{sel.matchers()})"


def queue_query(sel: GearSelector) -> str:
    """Requests waiting on the gear's head pods, summed."""
    return f"sum({WAITING}{sel.matchers()})"


def running_query(sel: GearSelector) -> str:
    """Requests running on the gear's head pods, summed."""
    return f"sum({RUNNING}{sel.matchers()})"


def qps_query(sel: GearSelector, window: str = "1m") -> str:
    """Completed requests/s over ``window``: from ``request_success_total``, else from the E2E histogram's
    ``_count`` (engines that lack the success counter)."""
    m = sel.matchers()
    return f"sum(rate({SUCCESS_TOTAL}{m}[{window}])) or sum(rate({E2E}_count{m}[{window}]))"


def quantile_query(histogram: str, q: float, sel: GearSelector, window: str = "1m") -> str:
    """The ``q`` quantile of ``histogram`` (seconds) over ``window`` across the gear's pods, in seconds.

    Raises:
        ValueError: ``q`` outside [0, 1].
    """
    if not 0 <= q <= 1:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    return f"histogram_quantile({q:g}, sum by (le) (rate({histogram}_bucket{sel.matchers()}[{window}])))"


@dataclass(frozen=True)
class SignalQueries:
    """Every query of one sample, by the :class:`~gearshift.control.smoothing.Sample` field it fills."""

    stage_utilization: str
    queue: str
    running: str
    qps: str
    quantiles: Mapping[str, str]
    """``ttft_p50_ms`` … ``e2e_p99_ms`` → query (results in s, converted to ms)."""


def signal_queries(sel: GearSelector, window: str = "1m") -> SignalQueries:
    """All queries of one sample of ``sel``'s gear."""
    quantiles = {
        f"{name}_p{int(q * 100)}_ms": quantile_query(hist, q, sel, window)
        for name, hist in (("ttft", TTFT), ("itl", ITL), ("e2e", E2E))
        for q in (0.5, 0.99)
    }
    return SignalQueries(
        stage_utilization=stage_utilization_query(sel),
        queue=queue_query(sel),
        running=running_query(sel),
        qps=qps_query(sel, window),
        quantiles=quantiles,
    )


# --- parsing of the HTTP API's instant-vector results ---------------------------------------------------
def parse_vector(result: Sequence[Mapping[str, Any]], query: str = "") -> list[tuple[dict[str, str], float]]:
    """``[(labels, value)]`` from the ``data.result`` of an instant query (``resultType: vector``).

    Each element is ``{"metric": {labels}, "value": [<unix time>, "<number as string>"]}``; Prometheus
    spells special values ``"NaN"``, ``"+Inf"``, ``"-Inf"``, which ``float`` reads.

    Raises:
        SignalsUnavailable: an element not of that shape (naming the query).
    """
    out = []
    for item in result:
        try:
            out.append((dict(item.get("metric", {})), float(item["value"][1])))
        except (KeyError, IndexError, TypeError, ValueError) as err:
            raise SignalsUnavailable(f"unexpected Prometheus result for {query!r}: {item!r}") from err
    return out


def scalar(result: Sequence[Mapping[str, Any]], query: str, *, required: bool) -> float | None:
    """The single value of an aggregated query; ``None`` when empty or NaN and not ``required``.

    Raises:
        SignalsUnavailable: ``required`` and the result is empty (the series are missing).
    """
    values = parse_vector(result, query)
    if not values:
        if required:
            raise SignalsUnavailable(f"no series for {query!r}: are the gear's pods scraped?")
        return None
    value = values[0][1]
    return None if math.isnan(value) else value


def stage_values(result: Sequence[Mapping[str, Any]], query: str) -> tuple[float, ...]:
    """Per-stage values ordered by the ``stage`` label (0, 1, …).

    Raises:
        SignalsUnavailable: empty, a series without an integer ``stage`` label, or stages missing in between.
    """
    values = parse_vector(result, query)
    if not values:
        raise SignalsUnavailable(f"no series for {query!r}: does the head pod export {STAGE_UTILIZATION}?")
    by_stage: dict[int, float] = {}
    for labels, value in values:
        try:
            by_stage[int(labels["stage"])] = value
        except (KeyError, ValueError) as err:
            raise SignalsUnavailable(f"series {labels} of {query!r} has no integer 'stage' label") from err
    if sorted(by_stage) != list(range(len(by_stage))):
        raise SignalsUnavailable(f"stages {sorted(by_stage)} of {query!r} are not 0..{len(by_stage) - 1}")
    return tuple(by_stage[k] for k in range(len(by_stage)))


def sample_from_results(at: float, queries: SignalQueries, results: Mapping[str, Sequence[Any]]) -> Sample:
    """Build a :class:`Sample` from the ``data.result`` of each query (keyed by the query string).

    Stage utilisation, queue, running and QPS are required; a quantile may be absent or NaN (no traffic).

    Raises:
        SignalsUnavailable: a required series missing or a malformed result.
    """
    quantiles = {
        field: None if (v := scalar(results.get(q, []), q, required=False)) is None else v * 1000.0
        for field, q in queries.quantiles.items()
    }
    return Sample(
        at=at,
        stage_utilization=stage_values(results.get(queries.stage_utilization, []), queries.stage_utilization),
        queue=scalar(results.get(queries.queue, []), queries.queue, required=True) or 0.0,
        running=scalar(results.get(queries.running, []), queries.running, required=True) or 0.0,
        qps=scalar(results.get(queries.qps, []), queries.qps, required=True) or 0.0,
        **quantiles,
    )


def fetch_sample(
    url: str, sel: GearSelector, at: float, *, window: str = "1m", timeout_s: float = 5.0
) -> Sample:
    """Query Prometheus at ``url`` for one sample of ``sel``'s gear (the only non-pure function here).

    Args:
        url: Prometheus base URL, e.g. ``http://127.0.0.1:9090``.
        sel: the gear's pods.
        at: the sample's time, s (the caller's clock).
        window: range of the rates, a PromQL duration.
        timeout_s: per-request timeout, s.

    Raises:
        SignalsUnavailable: Prometheus unreachable, an error answer, or a required series missing.
    """
    # Imported here so that the pure parts of gearshift.control never load an HTTP client.
    import requests
    from prometheus_api_client import PrometheusConnect
    from prometheus_api_client.exceptions import PrometheusApiClientException
    from urllib3.util.retry import Retry

    queries = signal_queries(sel, window)
    # No retries: the next sample comes in sampleIntervalSeconds anyway, and a retrying client (the
    # library's default backs off for seconds) would stall the control loop while Prometheus is down.
    prom = PrometheusConnect(url=url, disable_ssl=True, timeout=timeout_s, retry=Retry(total=0))
    wanted = [
        queries.stage_utilization,
        queries.queue,
        queries.running,
        queries.qps,
        *queries.quantiles.values(),
    ]
    results: dict[str, Sequence[Any]] = {}
    for query in wanted:
        try:
            results[query] = prom.custom_query(query)
        except (PrometheusApiClientException, requests.RequestException) as err:
            raise SignalsUnavailable(f"Prometheus at {url} did not answer {query!r}: {err}") from err
    return sample_from_results(at, queries, results)
