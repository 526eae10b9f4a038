"""The PromQL queries of a GearSet's signals, the parsing of Prometheus' answers, and a thin fetcher.

Series and labels: the engines export vLLM's metric names (DESIGN.md "Engine metrics") and the simulated
engine's head pod adds ``gearshift:stage_utilization{stage="k"}`` for every stage (docs/ARCHITECTURE.md).
Prometheus' pod discovery maps pod labels to series labels with ``labelmap`` (``gearshift.io/gear`` →
``gearshift_io_gear``; :mod:`gearshift.dev.sandbox.prometheus`), so a gear's series are selected by
namespace, service, role and gear. Quantiles use ``histogram_quantile`` over the rate of the ``_bucket``
series summed by ``le`` (the Prometheus documentation's recipe for aggregated histograms).

Per-stage utilisation has two sources, chosen by the PDService's ``spec.engine``
(:class:`UtilizationSource`, recorded in ``GearSet.status.signals.stageUtilizationSource``):

- ``sim`` → ``engine``: the simulated engine measures every stage's busy fraction and exports it;
- ``vllm`` → ``derived``: vLLM exports no per-stage utilisation (its metrics are the scheduler's and the
  requests', ``vllm/v1/metrics/loggers.py``, vLLM 0.32.0), and only the head pod (stage 0) serves
  ``/metrics``. The head's scheduler runs the whole pipeline, so its metrics describe the pipeline; the
  per-stage split comes from the planner's stage times (:func:`derived_stage_utilization`). When a
  multi-stage gear has no stage times, or the head has completed nothing yet in two scrapes, the sample
  has no stage utilisation (source ``none``): the imbalance trigger cannot fire for it, every other
  trigger works from the queue and the TTFT/ITL histograms.

Prometheus spells "no value" as ``NaN`` (``histogram_quantile`` over buckets that did not move) and a
division by zero as ``±Inf``; every non-finite value is *no data* here and never reaches a Sample.

The traffic mix (each request's prompt and generated tokens, :func:`token_mean_query`,
:func:`prompt_buckets_query`) comes from the router's client-facing histograms, selected by namespace,
service and the router pod's component label (:meth:`GearSelector.router_matchers`), else from the gear's
engines.

Missing is never fine: every optional series of a sample (each latency quantile, the arrival rate, the
traffic mix) is classified per sample as ok, missing (no series: not exported, not scraped, dropped
by a relabel rule) or not a number (:class:`SeriesHealth`, :attr:`Reading.health`), and
:func:`unavailable_series` says which of them should have had a value because requests flow; the
shifting tick reports those (``SignalsAvailable=False``) and the decision holds the triggers that read
them (:func:`gearshift.control.shifting.decide.held_triggers`).

Everything here is pure: :mod:`gearshift.adapters.prometheus` sends the queries and hands the answers to
:func:`reading_from_results`.

Exceptions::

    SignalsUnavailable      Prometheus unreachable, an error answer, or a needed series missing
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, Literal

from gearshift.control.smoothing import LatencyMetric, Sample, p99_field


class SignalsUnavailable(RuntimeError):
    """Prometheus gave no usable signals; the message says which query or series and why."""


#: Series label names that Prometheus' ``labelmap`` gives gearshift's pod labels.
LABEL_NAMESPACE = "namespace"
LABEL_SERVICE = "gearshift_io_service"
LABEL_ROLE = "gearshift_io_role"
LABEL_GEAR = "gearshift_io_gear"
#: ``app.kubernetes.io/component`` under the same mapping, and its value on the router's pods
#: (:func:`gearshift.k8s.router.build_router_deployment`); engine pods carry ``engine``.
LABEL_COMPONENT = "app_kubernetes_io_component"
COMPONENT_ROUTER = "router"

STAGE_UTILIZATION = "gearshift:stage_utilization"
WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
SUCCESS_TOTAL = "vllm:request_success_total"
E2E = "vllm:e2e_request_latency_seconds"
TTFT = "vllm:time_to_first_token_seconds"
#: The router's count of client requests per PDService and role (:mod:`gearshift.router.metrics`).
ROUTER_ARRIVALS = "gearshift_router_arrivals_total"
ITL = "vllm:inter_token_latency_seconds"
#: Per request, seconds from first scheduled to first token, and from first to last token; observed when
#: the request finishes (vLLM 0.32.0 ``vllm/v1/metrics/stats.py`` ``update_from_finished_request``;
#: histograms ``vllm:request_prefill_time_seconds`` and ``vllm:request_decode_time_seconds`` in
#: ``vllm/v1/metrics/loggers.py``). Their sum is the request's time in the scheduler's RUNNING set
#: (``inference_time = last_token_ts - scheduled_ts`` there).
PREFILL_TIME = "vllm:request_prefill_time_seconds"
DECODE_TIME = "vllm:request_decode_time_seconds"
#: Per finished request, its prompt tokens and its generated tokens; observed beside
#: ``vllm:request_success`` for every finished request, in 1-2-5 buckets up to ``max_model_len``
#: (vLLM 0.32.0 ``vllm/v1/metrics/loggers.py``, ``build_1_2_5_buckets``). The router exports the same
#: names once per client request (:class:`gearshift.router.metrics.ClientMetrics`), the sim per engine
#: (:mod:`gearshift.sim.metrics`).
PROMPT_TOKENS = "vllm:request_prompt_tokens"
GENERATION_TOKENS = "vllm:request_generation_tokens"

#: The serving engine of a PDService (``PDService.spec.engine``).
Engine = Literal["vllm", "sim"]
ENGINES: tuple[str, ...] = ("vllm", "sim")


class UtilizationSource(StrEnum):
    """Where a sample's per-stage utilisation came from (``status.signals.stageUtilizationSource``)."""

    ENGINE = "engine"
    """Measured and exported by the engine per stage (``gearshift:stage_utilization``, the sim)."""
    DERIVED = "derived"
    """vLLM: the head's seat occupancy × the planner's stage-time ratios
    (:func:`derived_stage_utilization`)."""
    NONE = "none"
    """Not known this sample (see :attr:`Reading.note`): the imbalance trigger cannot fire."""


@dataclass(frozen=True)
class GearSelector:
    """Which pods' series to read: one gear of one role of one PDService in a namespace."""

    namespace: str
    service: str
    role: str
    gear: str

    def matchers(self, *, with_gear: bool = True) -> str:
        """The label matchers, ``{namespace="..",gearshift_io_service="..",...}`` (without the gear's when
        not ``with_gear``: series of the whole role, such as the router's)."""
        pairs = (
            (LABEL_NAMESPACE, self.namespace),
            (LABEL_SERVICE, self.service),
            (LABEL_ROLE, self.role),
            *(((LABEL_GEAR, self.gear),) if with_gear else ()),
        )
        return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in pairs) + "}"

    def router_matchers(self) -> str:
        """The matchers of the PDService's router series, ``{namespace="..",gearshift_io_service="..",
        app_kubernetes_io_component="router"}``: the router pod's own labels (``gearshift.io/service`` and
        ``app.kubernetes.io/component``) mapped by Prometheus' pod discovery. No role: every client request
        passes through each role (the router counts each arrival once per role), so the role's requests
        are the service's. The component keeps the engines' series of the same metric names out."""
        pairs = (
            (LABEL_NAMESPACE, self.namespace),
            (LABEL_SERVICE, self.service),
            (LABEL_COMPONENT, COMPONENT_ROUTER),
        )
        return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in pairs) + "}"


@dataclass(frozen=True)
class PipelineShape:
    """What the derivation of per-stage utilisation needs to know of the sampled gear (from its spec).

    ``stage_times_ms[k]``: the planner's time of one micro-batch in stage k, ms (``Stage.predictedTimeMs``),
    ``None`` when not given; ``stage_replicas[k]``: pods of stage k per pipeline replica;
    ``max_num_seqs``: the gear's ``maxBatch``, which the operator passes to vLLM as ``--max-num-seqs``
    (:func:`gearshift.k8s.engine.vllm_args`).
    """

    gear: str
    stage_times_ms: tuple[float | None, ...]
    stage_replicas: tuple[int, ...] = ()
    max_num_seqs: int = 256

    @property
    def stages(self) -> int:
        return len(self.stage_times_ms)


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


def concurrency_query(sel: GearSelector, window: str = "1m") -> str:
    """Mean requests in execution (the scheduler's RUNNING set) per head engine over ``window``.

    By Little's law the time-average number of requests in a state equals the seconds spent in it per
    second of wall time: ``rate(<prefill time>_sum) + rate(<decode time>_sum)``, summed over the gear's
    head pods and divided by the number of head engines (``count`` of their ``num_requests_running``
    series: one per engine, each with its own scheduler and ``--max-num-seqs``). Unlike the
    ``num_requests_running`` gauge, which is one value at the last scrape, this integrates over the
    same window as the QPS and the quantiles. It counts requests when they finish, so a request longer
    than the window is counted at its end; the moving average smooths that.
    """
    m = sel.matchers()
    return (
        f"(sum(rate({PREFILL_TIME}_sum{m}[{window}])) + sum(rate({DECODE_TIME}_sum{m}[{window}])))"
        f" / count({RUNNING}{m})"
    )


def quantile_query(histogram: str, q: float, sel: GearSelector, window: str = "1m") -> str:
    """The ``q`` quantile of ``histogram`` (seconds) over ``window`` across the gear's pods, in seconds.

    Raises:
        ValueError: ``q`` outside [0, 1].
    """
    if not 0 <= q <= 1:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    return f"histogram_quantile({q:g}, sum by (le) (rate({histogram}_bucket{sel.matchers()}[{window}])))"


def arrival_query(sel: GearSelector, window: str = "1m") -> str:
    """Requests arriving per second for the gear over ``window``: the service's routers' count of the
    role's arrivals (``gearshift_router_arrivals_total``, counted before admission: every request the
    router serves, holds or refuses), else, with no router series, the engines' completions plus the
    growth of their requests in flight, ``rate(success) + deriv(running) + deriv(waiting)`` (neither vLLM
    nor the sim counts arrivals).

    The router's count comes first because the engines see only what the router lets through: with the
    gear's pods at their batch cap the router holds requests (and refuses them after its queue timeout),
    and the engines' estimate reads the gear's own throughput however many arrive. On the demo's
    Llama-3-70B window that read 0.6 req/s while 1.7 arrived, so load-high never fired and the router
    refused 493 of 775 requests (a live run before this change; bench/results/demo.json holds a later
    one). The sampled gear is the one the router sends the role's traffic to, so the role's arrivals are
    the gear's.
    """
    m = sel.matchers()
    router = sel.matchers(with_gear=False)
    return (
        f"sum(rate({ROUTER_ARRIVALS}{router}[{window}])) or (sum(rate({SUCCESS_TOTAL}{m}[{window}])) "
        f"+ sum(deriv({RUNNING}{m}[{window}])) + sum(deriv({WAITING}{m}[{window}])))"
    )


def token_mean_query(histogram: str, sel: GearSelector, window: str = "1m") -> str:
    """Mean tokens per request of ``histogram`` (:data:`PROMPT_TOKENS` or :data:`GENERATION_TOKENS`) over
    ``window``, ``rate(_sum) / rate(_count)``: from the service's routers (each client request once,
    :meth:`GearSelector.router_matchers`), else, with no router series, from the gear's engines.

    The router's series come first because they see the client's request: under PD each engine sees its
    leg only (a prefill pod generates one token per request). NaN (no request finished in the window)
    stays NaN rather than falling back: ``or`` falls back only when the router has no series at all.
    """
    r, m = sel.router_matchers(), sel.matchers()
    return (
        f"(sum(rate({histogram}_sum{r}[{window}])) / sum(rate({histogram}_count{r}[{window}]))) "
        f"or (sum(rate({histogram}_sum{m}[{window}])) / sum(rate({histogram}_count{m}[{window}])))"
    )


def prompt_buckets_query(sel: GearSelector, window: str = "1m") -> str:
    """The prompt-token histogram over ``window``: cumulative requests/s per ``le`` bound (tokens), one
    series per bucket; the routers' (:func:`token_mean_query`), else the gear's engines'.

    The engines' buckets are taken only when the routers have no ``_count`` series (``unless on()``): a
    bare ``or`` matches by label set, so it would add every engine bucket whose ``le`` the router lacks to
    the router's vector (the router's 1-2-5 ladder runs to 5e6 tokens, an engine's to its
    ``max_model_len``) and mix two sources in one cumulative histogram.
    """
    r, m = sel.router_matchers(), sel.matchers()
    return (
        f"sum by (le) (rate({PROMPT_TOKENS}_bucket{r}[{window}])) or "
        f"(sum by (le) (rate({PROMPT_TOKENS}_bucket{m}[{window}])) "
        f"unless on() sum(rate({PROMPT_TOKENS}_count{r}[{window}])))"
    )


#: The longest and the shortest range of a sample's rates and quantiles, s. 60 s is the queries' usual
#: ``[1m]``; 10 s keeps two scrapes in range at a 5 s scrape interval (rate() needs two).
WINDOW_S, MIN_WINDOW_S = 60.0, 10.0


def sample_window_s(serving_since: float | None, now: float) -> float:
    """The range of a sample taken at ``now`` (s) of a gear that took traffic at ``serving_since``
    (``None``: long ago), s: the last minute, shortened to the time since the gear took traffic, at least
    :data:`MIN_WINDOW_S`, in whole seconds. Right after a switch the new gear's histograms still hold its
    warm-up, whose mirrored requests ran on at most ``warmupShare`` of a card beside the serving gear and
    were slow on purpose: a minute-long window would judge (and roll back) the new gear on them."""
    if serving_since is None:
        return WINDOW_S
    return float(math.ceil(max(MIN_WINDOW_S, min(WINDOW_S, now - serving_since))))


def sample_window(serving_since: float | None, now: float) -> str:
    """:func:`sample_window_s` as a PromQL range: ``1m`` for the whole minute, else ``<s>s``."""
    span = sample_window_s(serving_since, now)
    return "1m" if span >= WINDOW_S else f"{span:.0f}s"


@dataclass(frozen=True)
class SignalQueries:
    """Every query of one sample, by the :class:`~gearshift.control.smoothing.Sample` field it fills."""

    stage_utilization: str | None
    """The engine's per-stage utilisation (sim); ``None`` for vLLM (it has none)."""
    queue: str
    running: str
    qps: str
    quantiles: Mapping[str, str]
    """``ttft_p50_ms`` … ``e2e_p99_ms`` → query (results in s, converted to ms)."""
    concurrency: str | None = None
    """vLLM: :func:`concurrency_query` (the head's seat occupancy is derived from it); ``None`` for sim."""
    engine: Engine = "sim"
    arrivals: str | None = None
    """:func:`arrival_query` (optional: without it the capacity triggers stay off)."""
    prompt_tokens_mean: str | None = None
    """:func:`token_mean_query` of :data:`PROMPT_TOKENS` (tokens; optional, as every mix query)."""
    output_tokens_mean: str | None = None
    """:func:`token_mean_query` of :data:`GENERATION_TOKENS` (tokens)."""
    prompt_tokens_buckets: str | None = None
    """:func:`prompt_buckets_query` (cumulative requests/s per ``le``)."""

    def mix(self) -> dict[str, str]:
        """The traffic-mix queries that are set, by :class:`Sample` field."""
        queries = {
            "prompt_tokens_mean": self.prompt_tokens_mean,
            "output_tokens_mean": self.output_tokens_mean,
            "prompt_tokens_buckets": self.prompt_tokens_buckets,
        }
        return {name: q for name, q in queries.items() if q is not None}

    def all(self) -> list[str]:
        """Every query to run, in a stable order."""
        extra = [q for q in (self.stage_utilization, self.concurrency, self.arrivals) if q is not None]
        return [*extra, self.queue, self.running, self.qps, *self.quantiles.values(), *self.mix().values()]


def signal_queries(sel: GearSelector, window: str = "1m", engine: Engine = "sim") -> SignalQueries:
    """All queries of one sample of ``sel``'s gear served by ``engine``.

    Raises:
        ValueError: ``engine`` is neither ``vllm`` nor ``sim``.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    quantiles = {
        f"{name}_p{int(q * 100)}_ms": quantile_query(hist, q, sel, window)
        for name, hist in (("ttft", TTFT), ("itl", ITL), ("e2e", E2E))
        for q in (0.5, 0.99)
    }
    vllm = engine == "vllm"
    return SignalQueries(
        stage_utilization=None if vllm else stage_utilization_query(sel),
        queue=queue_query(sel),
        running=running_query(sel),
        qps=qps_query(sel, window),
        quantiles=quantiles,
        concurrency=concurrency_query(sel, window) if vllm else None,
        engine=engine,
        arrivals=arrival_query(sel, window),
        prompt_tokens_mean=token_mean_query(PROMPT_TOKENS, sel, window),
        output_tokens_mean=token_mean_query(GENERATION_TOKENS, sel, window),
        prompt_tokens_buckets=prompt_buckets_query(sel, window),
    )


# --- the derivation for vLLM (pure) ----------------------------------------------------------------------
def seat_occupancy(concurrency: float, max_num_seqs: int) -> float:
    """The head's busy fraction for vLLM: the share of its scheduler's seats in use, in [0, 1].

    ``concurrency`` is the time-averaged count of requests in execution per head engine
    (:func:`concurrency_query`); ``max_num_seqs`` the engine's ``--max-num-seqs`` (the gear's ``maxBatch``).

    Why seats rather than the phase-time sum on its own: vLLM's scheduler admits at most
    ``max_num_seqs`` requests into RUNNING (``vllm/v1/core/sched/scheduler.py``,
    ``max_num_running_reqs``), and a pipeline of K stages keeps K micro-batches in flight out of that set
    (``vllm/config/vllm.py`` ``max_concurrent_batches``). The planner sizes ``maxBatch`` as micro-batch ×
    stages so that a full set of seats keeps every stage busy (:class:`gearshift.planner.gears.Gear`), so
    occupancy is the share of the pipeline's micro-batch slots filled: 1 is the pipeline running at its
    bottleneck's pace with no room for more, which is what the imbalance trigger's 90 % means. The raw
    concurrency is not a fraction (32 decoding requests read 32), and "some request running" saturates
    at one request in a memory-bound decode step that would carry ``max_num_seqs`` at about the same cost.
    Known bias: where the per-step token budget (``--max-num-batched-tokens``, micro-batch × 2048 here)
    fills before the seats (prefill of very long prompts), a saturated prefill pipeline reads below 1;
    the queue-based ``saturation`` trigger and ``p99-high`` still see that overload.

    Raises:
        ValueError: ``max_num_seqs`` < 1.
    """
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    if not math.isfinite(concurrency):
        raise ValueError(f"concurrency must be finite, got {concurrency}")
    return min(1.0, max(0.0, concurrency / max_num_seqs))


def derived_stage_utilization(
    busy: float, stage_times_ms: Sequence[float | None], stage_replicas: Sequence[int] = ()
) -> tuple[float, ...] | None:
    """Per-stage utilisation of a pipeline from its busy fraction and the planner's stage times.

    ``u_k = busy × e_k / max_j e_j`` with ``e_k = t_k / r_k``: ``t_k`` the planner's time of one
    micro-batch in stage k (ms), ``r_k`` the stage's pods per pipeline replica (a stage served by r pods
    takes a micro-batch every ``t / r``: :mod:`gearshift.planner.gears`' capacity rule; ``()`` = all 1).
    A pipeline is paced by its bottleneck: while it is busy the bottleneck stage computes all the time
    and stage k ``e_k / e_max`` of it. So the bottleneck reads ``busy`` and the others less, in the
    planner's proportions. This can only show the imbalance the planner predicted, scaled by the load
    measured; a stage slower than predicted is not seen (vLLM reports no per-rank step times).

    A one-stage pipeline needs no stage time (``u_0 = busy``). Returns ``None`` when a multi-stage
    pipeline lacks a positive, finite time for some stage (an explicit gear without predictions).

    Raises:
        ValueError: ``busy`` outside [0, 1], no stages, or replicas not matching the stages or below 1.
    """
    if not (math.isfinite(busy) and 0.0 <= busy <= 1.0):
        raise ValueError(f"busy fraction must be in [0, 1], got {busy}")
    n = len(stage_times_ms)
    if n == 0:
        raise ValueError("a pipeline has at least one stage")
    replicas = tuple(stage_replicas) or (1,) * n
    if len(replicas) != n or any(r < 1 for r in replicas):
        raise ValueError(f"stage replicas {list(replicas)} must be >= 1, one per stage ({n})")
    if n == 1:
        return (busy,)
    if any(t is None or not math.isfinite(t) or t <= 0.0 for t in stage_times_ms):
        return None
    effective = [float(t) / r for t, r in zip(stage_times_ms, replicas, strict=True)]  # type: ignore[arg-type]
    slowest = max(effective)
    return tuple(busy * e / slowest for e in effective)


def missing_stage_times(shape: PipelineShape) -> list[int]:
    """Stages of a multi-stage ``shape`` without a positive, finite predicted time (``[]``: none missing)."""
    if shape.stages <= 1:
        return []
    return [k for k, t in enumerate(shape.stage_times_ms) if t is None or not math.isfinite(t) or t <= 0.0]


# --- parsing of the HTTP API's instant-vector results ---------------------------------------------------
def parse_vector(result: Sequence[Mapping[str, Any]], query: str = "") -> list[tuple[dict[str, str], float]]:
    """``[(labels, value)]`` from the ``data.result`` of an instant query (``resultType: vector``).

    Each element is ``{"metric": {labels}, "value": [<unix time>, "<number as string>"]}``; Prometheus
    spells special values ``"NaN"``, ``"+Inf"``, ``"-Inf"``, which ``float`` reads (callers treat them
    as no data).

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
    """The single value of an aggregated query; ``None`` when empty or not finite (NaN, ±Inf: no data).

    Raises:
        SignalsUnavailable: ``required`` and the result is empty (the series are missing) or not finite.
    """
    values = parse_vector(result, query)
    if not values:
        if required:
            raise SignalsUnavailable(f"no series for {query!r}: are the gear's pods scraped?")
        return None
    value = values[0][1]
    if math.isfinite(value):
        return value
    if required:
        raise SignalsUnavailable(f"{query!r} gave {value} (no data)")
    return None


def stage_values(result: Sequence[Mapping[str, Any]], query: str) -> tuple[float, ...]:
    """Per-stage values ordered by the ``stage`` label (0, 1, …).

    Raises:
        SignalsUnavailable: empty, a series without an integer ``stage`` label, stages missing in between,
            or a value that is not finite (no data).
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
        if not math.isfinite(value):
            raise SignalsUnavailable(f"stage {labels['stage']} of {query!r} is {value} (no data)")
    if sorted(by_stage) != list(range(len(by_stage))):
        raise SignalsUnavailable(f"stages {sorted(by_stage)} of {query!r} are not 0..{len(by_stage) - 1}")
    return tuple(by_stage[k] for k in range(len(by_stage)))


def bucket_values(result: Sequence[Mapping[str, Any]], query: str) -> tuple[tuple[float, float], ...]:
    """``(le, cumulative value)`` pairs of a ``sum by (le)`` result in rising ``le`` order, ``+Inf``
    (``math.inf``) last; ``()`` when the vector is no histogram of any request: empty, a series without a
    numeric ``le`` label (not a histogram's bucket), a value not finite, no ``+Inf`` bucket, or ``+Inf`` at
    0 (nothing observed in the window). An optional series that is no histogram is no data, as a NaN is,
    rather than a failed sample: the other signals still drive their triggers. Counts are made
    non-decreasing in ``le``, as ``histogram_quantile`` does: each bucket is a rate of its own, and float
    rounding or a bucket series caught by a scrape the others missed can leave a higher bucket a hair
    below a lower one.

    Raises:
        SignalsUnavailable: a malformed result (naming the query).
    """
    pairs = []
    for labels, value in parse_vector(result, query):
        try:
            le = float(labels["le"])
        except (KeyError, ValueError):
            return ()
        if math.isnan(le) or not math.isfinite(value):
            return ()
        pairs.append((le, value))
    pairs.sort()
    if not pairs or pairs[-1][0] != math.inf or pairs[-1][1] <= 0.0:
        return ()
    out, top = [], 0.0
    for le, value in pairs:
        top = max(top, value)
        out.append((le, top))
    return tuple(out)


class SeriesHealth(StrEnum):
    """What one query of a sample gave (:func:`series_health`)."""

    OK = "ok"
    MISSING = "missing"
    """No series at all: the metric is not exported or not scraped (or a rule drops it)."""
    NOT_A_NUMBER = "not-a-number"
    """Series there, value NaN or ±Inf (``histogram_quantile`` over buckets that did not move)."""


#: The latency quantiles of a sample, by :class:`Sample` field, and the histogram and quantile of each.
QUANTILE_SERIES: Mapping[str, tuple[str, int]] = {
    f"{name}_p{q}_ms": (hist, q)
    for name, hist in (("ttft", TTFT), ("itl", ITL), ("e2e", E2E))
    for q in (50, 99)
}
#: What each optional series of a sample is, by its :class:`Sample` field, for condition messages.
SERIES_NAMES: Mapping[str, str] = {
    **{field_: f"{hist} P{q}" for field_, (hist, q) in QUANTILE_SERIES.items()},
    "arrival_rps": f"arrival rate ({SUCCESS_TOTAL}, {RUNNING}, {WAITING})",
    "prompt_tokens_mean": f"mean prompt tokens ({PROMPT_TOKENS})",
    "output_tokens_mean": f"mean output tokens ({GENERATION_TOKENS})",
    "prompt_tokens_buckets": f"prompt-token histogram ({PROMPT_TOKENS}_bucket)",
}
#: The traffic mix's :class:`Sample` fields, each observed once per finished request. Reported when
#: *missing* while requests flow, not when not a number: the router's series are scraped apart from the
#: engines', so a window in which the engines have completed requests and the router's scrape has none
#: yet (every start of traffic, seen in the sandbox) is no fault; that sample reads the planned mix.
MIX_SERIES = ("prompt_tokens_mean", "output_tokens_mean", "prompt_tokens_buckets")
#: Series every completed request observes: with requests completing in the window they have a value.
ALWAYS_OBSERVED = ("e2e_p50_ms", "e2e_p99_ms", "arrival_rps")


def series_health(result: Sequence[Mapping[str, Any]], query: str = "") -> SeriesHealth:
    """The :class:`SeriesHealth` of an aggregated query's ``data.result`` (its first value).

    Raises:
        SignalsUnavailable: a malformed result (naming the query).
    """
    values = parse_vector(result, query)
    if not values:
        return SeriesHealth.MISSING
    return SeriesHealth.OK if math.isfinite(values[0][1]) else SeriesHealth.NOT_A_NUMBER


def bucket_health(result: Sequence[Mapping[str, Any]], query: str = "") -> SeriesHealth:
    """The :class:`SeriesHealth` of a ``sum by (le)`` histogram result: missing without series, not a
    number when :func:`bucket_values` finds no histogram in it.

    Raises:
        SignalsUnavailable: a malformed result (naming the query).
    """
    if not parse_vector(result, query):
        return SeriesHealth.MISSING
    return SeriesHealth.OK if bucket_values(result, query) else SeriesHealth.NOT_A_NUMBER


@dataclass(frozen=True)
class Reading:
    """One sample and how its stage utilisation was obtained."""

    sample: Sample
    source: UtilizationSource = UtilizationSource.ENGINE
    pipeline_utilization: float | None = None
    """vLLM: the head's seat occupancy this sample (:func:`seat_occupancy`), 0..1; ``None`` otherwise."""
    note: str = ""
    """Why ``sample.stage_utilization`` is empty (source ``none``); a stable sentence, no numbers that
    change from sample to sample (it goes into a condition message)."""
    health: Mapping[str, SeriesHealth] = field(default_factory=dict)
    """Each optional series of this sample (a key of :data:`SERIES_NAMES`) as Prometheus gave it; the
    required ones (queue, running, served rate, the sim's stage utilisation) fail the sample instead, and
    vLLM's phase-time rates, when absent, leave the stage utilisation unknown (:attr:`note`)."""


def unavailable_series(reading: Reading, metric: LatencyMetric) -> dict[str, SeriesHealth]:
    """The series of ``reading`` that have no value although they should: ``{Sample field: health}``.

    Only while requests flow (``qps`` > 0: requests completed in the window; an idle gear's quantiles
    are absent because there was nothing to measure). Then a series that is missing is always reported;
    one that is not a number only when every completed request observes it (E2E latency, the arrival
    rate, the traffic mix: :data:`ALWAYS_OBSERVED`) or it is the policy's latency ``metric`` (the P99
    triggers read it): an ITL quantile of one-token requests (a PD prefill leg) has nothing to measure.
    A reading without health (a source that does not classify) reports the policy's P99 when it is
    absent.
    """
    if reading.sample.qps <= 0:
        return {}
    out: dict[str, SeriesHealth] = {}
    for name, health in reading.health.items():
        if health is SeriesHealth.MISSING or (
            health is SeriesHealth.NOT_A_NUMBER
            and (name in ALWAYS_OBSERVED or name.startswith(f"{metric.value}_"))
        ):
            out[name] = health
    p99 = p99_field(metric)
    if p99 not in reading.health and reading.sample.p99_ms(metric) is None:
        out[p99] = SeriesHealth.NOT_A_NUMBER
    return out


def describe_series(unavailable: Mapping[str, SeriesHealth]) -> str:
    """``"<series> (<health>), ..."`` in :data:`SERIES_NAMES`' order; stable for a stable input."""
    order = list(SERIES_NAMES)
    names = sorted(unavailable, key=lambda n: order.index(n) if n in order else len(order))
    return ", ".join(f"{SERIES_NAMES.get(n, n)} ({unavailable[n].value})" for n in names)


def sample_from_results(at: float, queries: SignalQueries, results: Mapping[str, Sequence[Any]]) -> Sample:
    """Build a :class:`Sample` from the ``data.result`` of each query (keyed by the query string), for the
    engine's own stage utilisation (sim); see :func:`reading_from_results` for both engines.

    Stage utilisation, queue, running and QPS are required; a quantile may be absent or NaN (no traffic).

    Raises:
        SignalsUnavailable: a required series missing or a malformed result.
    """
    return reading_from_results(at, queries, results).sample


def _rate(result: Sequence[Any], query: str) -> float | None:
    """A non-negative rate or ``None`` (no data); ``deriv`` can dip a sum below 0 on a draining gear."""
    v = scalar(result, query, required=False)
    return None if v is None else max(0.0, v)


def reading_from_results(
    at: float,
    queries: SignalQueries,
    results: Mapping[str, Sequence[Any]],
    shape: PipelineShape | None = None,
) -> Reading:
    """Build a :class:`Reading` from the ``data.result`` of each query (keyed by the query string).

    Queue, running and QPS are required; a quantile or a traffic-mix value may be absent or not finite
    (no traffic), and is ``None`` (the bucket vector ``()``) in the sample then. The sim's
    per-stage utilisation is required too. For vLLM (``queries.concurrency`` set) the stage utilisation
    is derived from the head's seat occupancy and ``shape`` (the sampled gear); when that cannot be done
    the sample has none and :attr:`Reading.note` says why, instead of failing the whole sample.

    Raises:
        SignalsUnavailable: a required series missing or a malformed result.
    """
    stages: tuple[float, ...] = ()
    if queries.stage_utilization is not None:
        stages = stage_values(results.get(queries.stage_utilization, []), queries.stage_utilization)
    quantiles = {
        field_: None if (v := scalar(results.get(q, []), q, required=False)) is None else v * 1000.0
        for field_, q in queries.quantiles.items()
    }
    health = {field_: series_health(results.get(q, []), q) for field_, q in queries.quantiles.items()}
    if queries.arrivals is not None:
        health["arrival_rps"] = series_health(results.get(queries.arrivals, []), queries.arrivals)
    means: dict[str, float | None] = {}
    buckets: tuple[tuple[float, float], ...] = ()
    for field_, q in queries.mix().items():
        answer = results.get(q, [])
        if field_ == "prompt_tokens_buckets":
            buckets, health[field_] = bucket_values(answer, q), bucket_health(answer, q)
        else:
            means[field_], health[field_] = scalar(answer, q, required=False), series_health(answer, q)
    base = Sample(
        at=at,
        stage_utilization=stages,
        queue=scalar(results.get(queries.queue, []), queries.queue, required=True) or 0.0,
        running=scalar(results.get(queries.running, []), queries.running, required=True) or 0.0,
        qps=scalar(results.get(queries.qps, []), queries.qps, required=True) or 0.0,
        arrival_rps=None
        if queries.arrivals is None
        else _rate(results.get(queries.arrivals, []), queries.arrivals),
        prompt_tokens_buckets=buckets,
        **quantiles,
        **means,
    )
    if queries.stage_utilization is not None:
        return Reading(base, UtilizationSource.ENGINE, health=health)
    if queries.concurrency is None:
        raise ValueError("queries have neither a stage utilisation nor a concurrency query")
    if shape is None:
        note = "the sampled gear is not in the GearSet's gears, so its stage times are unknown"
        return Reading(base, UtilizationSource.NONE, note=note, health=health)
    concurrency = scalar(results.get(queries.concurrency, []), queries.concurrency, required=False)
    if concurrency is None:
        note = (
            f"gear {shape.gear!r}: the head's {PREFILL_TIME} and {DECODE_TIME} rates have no value "
            "(fewer than two scrapes of them in the window: just started, or a vLLM without them)"
        )
        return Reading(base, UtilizationSource.NONE, note=note, health=health)
    busy = seat_occupancy(concurrency, shape.max_num_seqs)
    stages_u = derived_stage_utilization(busy, shape.stage_times_ms, shape.stage_replicas or ())
    if stages_u is None:
        missing = ", ".join(str(k) for k in missing_stage_times(shape))
        note = (
            f"gear {shape.gear!r} has {shape.stages} stages and stage(s) {missing} carry no "
            "predictedTimeMs (an explicit gear without the planner's predictions), so per-stage "
            "utilisation cannot be derived from vLLM's metrics"
        )
        return Reading(base, UtilizationSource.NONE, pipeline_utilization=busy, note=note, health=health)
    return Reading(
        replace(base, stage_utilization=stages_u),
        UtilizationSource.DERIVED,
        pipeline_utilization=busy,
        health=health,
    )
