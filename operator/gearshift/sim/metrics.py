"""Prometheus metrics of one simulated engine, under vLLM's names (vllm/v1/metrics/loggers.py).

Every engine has its own :class:`prometheus_client.CollectorRegistry`, so that one process can serve many
simulated pods, each with its own ``/metrics``. Gauges are computed at scrape time by a collector that
reads the engine's state, so the step loop pays nothing for them; histograms and counters are updated as
events happen. Labels: ``model_name`` (the served model name) and ``engine`` (vLLM's engine index, "0").

Exported (vLLM names): ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc`` (0..1, as vLLM), histograms ``vllm:time_to_first_token_seconds``,
``vllm:inter_token_latency_seconds``, ``vllm:request_time_per_output_token_seconds``,
``vllm:e2e_request_latency_seconds``, ``vllm:request_prompt_tokens``, ``vllm:request_generation_tokens``
(tokens per finished request, in vLLM's 1-2-5 buckets up to ``max_model_len``), counters
``vllm:request_success_total{finished_reason}``, ``vllm:prompt_tokens_total``,
``vllm:generation_tokens_total``, ``vllm:num_preemptions_total``, and the info gauge
``vllm:cache_config_info{block_size, num_gpu_blocks, gpu_memory_utilization}`` = 1 (vLLM's
``CacheConfig.metrics_info()``: the router's decode headroom filter sizes the KV pool from it).
gearshift's own: ``gearshift:stage_utilization{stage}`` (busy fraction of each pipeline stage over the
last :data:`UTILIZATION_WINDOW_S`), ``gearshift:sim_step_lag_seconds`` (how late the simulator's step
timer fired: its own overhead), ``gearshift:sim_event_loop_lag_seconds`` (process-wide loop lag).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

#: Window of the stage-utilisation gauge, s (FlexPipe samples every 2 s, docs/sources.md#shift-signals; 10 s
#: smooths over bursts).
UTILIZATION_WINDOW_S = 10.0

# Bucket bounds follow vLLM's (v0.8 loggers.py), with finer low buckets for ITL since simulated H100
# steps are a few ms.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, … while ≤ ``max_model_len`` (tokens), as
    ``build_1_2_5_buckets`` in vllm/v1/metrics/loggers.py sizes ``vllm:request_prompt_tokens`` and
    ``vllm:request_generation_tokens``; prometheus_client adds ``+Inf``."""
    out: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_model_len:
                return tuple(out)
            out.append(float(value))
        exponent += 1


class EngineState(Protocol):
    """What the gauge collector reads from an engine."""

    def num_running(self) -> int: ...
    def num_waiting(self) -> int: ...
    def kv_usage(self) -> float: ...
    def stage_utilization(self) -> list[float]: ...


def cache_info(state: object) -> dict[str, str] | None:
    """The labels of ``vllm:cache_config_info`` for an engine with ``total_blocks`` and ``block_size``
    (and optionally ``model.params.gpu_memory_utilization``); None for a state without a KV pool."""
    blocks, size = getattr(state, "total_blocks", None), getattr(state, "block_size", None)
    if not isinstance(blocks, int) or not isinstance(size, int):
        return None
    params = getattr(getattr(state, "model", None), "params", None)
    util = getattr(params, "gpu_memory_utilization", None)
    out = {"block_size": str(size), "num_gpu_blocks": str(blocks)}
    if isinstance(util, int | float):
        out["gpu_memory_utilization"] = f"{util:g}"
    return out


class _GaugeCollector(Collector):
    def __init__(self, state: EngineState, labels: dict[str, str]) -> None:
        self._state = state
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        names = list(self._labels)
        values = list(self._labels.values())
        for name, doc, fn in (
            ("vllm:num_requests_running", "Requests in model execution batches.", self._state.num_running),
            ("vllm:num_requests_waiting", "Requests waiting to be processed.", self._state.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", self._state.kv_usage),
        ):
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, float(fn()))
            yield g
        g = GaugeMetricFamily(
            "gearshift:stage_utilization",
            f"Busy fraction of each pipeline stage over the last {UTILIZATION_WINDOW_S:g} s (simulated).",
            labels=[*names, "stage"],
        )
        for k, u in enumerate(self._state.stage_utilization()):
            g.add_metric([*values, str(k)], u)
        yield g
        info = cache_info(self._state)
        if info is not None:
            g = GaugeMetricFamily(
                "vllm:cache_config_info",
                "Information of the KV cache (vLLM CacheConfig); the value is 1.",
                labels=[*names, *info],
            )
            g.add_metric([*values, *info.values()], 1.0)
            yield g


class EngineMetrics:
    """The metrics of one engine in its own registry; ``render()`` gives the exposition text."""

    def __init__(self, state: EngineState, model_name: str, engine: str = "0", *, max_model_len: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"model_name": model_name, "engine": engine}
        names = list(labels)
        r = self.registry

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=r)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token, s.", TTFT_BUCKETS).labels(
            **labels
        )
        self.itl = hist("vllm:inter_token_latency_seconds", "Inter-token latency, s.", ITL_BUCKETS).labels(
            **labels
        )
        tpot_doc = "Per-request mean time per output token, s."
        self.tpot = hist("vllm:request_time_per_output_token_seconds", tpot_doc, ITL_BUCKETS).labels(**labels)
        e2e_doc = "End-to-end request latency, s."
        self.e2e = hist("vllm:e2e_request_latency_seconds", e2e_doc, E2E_BUCKETS).labels(**labels)
        tokens = token_buckets(max_model_len)
        self.request_prompt_tokens = hist(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens
        ).labels(**labels)
        self.request_generation_tokens = hist(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tokens
        ).labels(**labels)
        self.step_lag = hist(
            "gearshift:sim_step_lag_seconds", "How late the simulator's step timer fired, s.", LAG_BUCKETS
        ).labels(**labels)
        self._success = Counter(
            "vllm:request_success", "Finished requests.", [*names, "finished_reason"], registry=r
        )
        self._success_labels = labels

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, names, registry=r).labels(**labels)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Generation tokens processed.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative preemptions.")
        r.register(_GaugeCollector(state, labels))

    def success(self, reason: str) -> None:
        """Count a finished request (``reason``: ``length``, ``stop`` or ``abort``)."""
        self._success.labels(**self._success_labels, finished_reason=reason).inc()

    def finished_tokens(self, prompt: int, generated: int) -> None:
        """Observe a finished request's prompt and generated tokens; vLLM does so for every request it
        counts in ``vllm:request_success``, whatever its finish reason (``PrometheusStatLogger.record``)."""
        self.request_prompt_tokens.observe(prompt)
        self.request_generation_tokens.observe(generated)

    def add_collector(self, collector: Collector) -> None:
        """Expose a process-wide collector (e.g. the event-loop lag) in this engine's registry too."""
        self.registry.register(collector)


class LoopLagCollector(Collector):
    """Process-wide event-loop lag: the last and the largest lateness of a periodic timer, s."""

    def __init__(self, snapshot: Callable[[], tuple[float, float]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        last, worst = self._snapshot()
        g = GaugeMetricFamily(
            "gearshift:sim_event_loop_lag_seconds",
            "Event-loop lag of the simulator process, s.",
            labels=["kind"],
        )
        g.add_metric(["last"], last)
        g.add_metric(["max"], worst)
        yield g
