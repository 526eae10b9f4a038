"""Live pod signals: scraped from each pod's ``/metrics`` (vLLM metric names) or read from Prometheus.

Read (summed over ``model_name``/``engine`` label sets):
  ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (older
  vLLM: ``vllm:gpu_cache_usage_perc``), ``vllm:inter_token_latency_seconds`` (older:
  ``vllm:time_per_output_token_seconds``) as a histogram, ``vllm:cache_config_info`` (``num_gpu_blocks`` ×
  ``block_size`` tokens of KV capacity) and gearshift-sim's ``gearshift:stage_utilization{stage}``.
SGLang's ``sglang:`` names are read as well (``num_running_reqs``, ``num_queue_reqs``, ``token_usage``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from gearshift.router import outlier
from gearshift.router.pool import Backend, Pool

log = logging.getLogger(__name__)

RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
ITL = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")
STAGE_UTIL = "gearshift:stage_utilization"
CACHE_INFO = "vllm:cache_config_info"


@dataclass
class Histogram:
    """A cumulative histogram at one instant: ``buckets`` maps upper bound (s) → cumulative count."""

    sum: float = 0.0
    count: float = 0.0
    buckets: dict[float, float] = field(default_factory=dict)

    def minus(self, older: Histogram) -> Histogram:
        """Observations made between ``older`` and this snapshot (a counter reset yields this snapshot)."""
        if self.count < older.count:
            return self
        return Histogram(
            self.sum - older.sum,
            self.count - older.count,
            {le: c - older.buckets.get(le, 0.0) for le, c in self.buckets.items()},
        )

    def quantile(self, q: float) -> float | None:
        """Prometheus ``histogram_quantile``: linear interpolation inside the bucket, s; None when empty."""
        if self.count <= 0:
            return None
        rank = q * self.count
        prev_le, prev_c = 0.0, 0.0
        for le in sorted(self.buckets):
            c = self.buckets[le]
            if c >= rank:
                if math.isinf(le):
                    return prev_le
                width = c - prev_c
                return prev_le + (le - prev_le) * ((rank - prev_c) / width if width > 0 else 1.0)
            prev_le, prev_c = le, c
        return prev_le


@dataclass
class PodSample:
    """One scrape of one pod."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float | None = None
    """Fullest KV-usage series, 0..1; None when the pod exports none."""
    stage_util: dict[str, float] = field(default_factory=dict)
    itl: Histogram | None = None
    kv_capacity_tokens: float | None = None


def parse_metrics(text: str) -> PodSample:
    """Parse Prometheus text exposition into a :class:`PodSample`.

    Raises:
        ValueError: the text is not Prometheus exposition format.
    """
    s = PodSample()
    seen_itl = False
    for fam in text_string_to_metric_families(text):
        name = fam.name
        if name in RUNNING:
            s.running += sum(x.value for x in fam.samples)
        elif name in WAITING:
            s.waiting += sum(x.value for x in fam.samples)
        elif name in KV_USAGE:
            values = [x.value for x in fam.samples if math.isfinite(x.value)]
            if values:
                s.kv_usage = max([*values, *([s.kv_usage] if s.kv_usage is not None else [])])
        elif name == STAGE_UTIL:
            for x in fam.samples:
                s.stage_util[x.labels.get("stage", "0")] = x.value
        elif name == CACHE_INFO:
            for x in fam.samples:
                with contextlib.suppress(KeyError, ValueError):
                    s.kv_capacity_tokens = float(x.labels["num_gpu_blocks"]) * float(x.labels["block_size"])
        elif name in ITL and not seen_itl:
            seen_itl = True
            h = Histogram()
            for x in fam.samples:
                if x.name.endswith("_sum"):
                    h.sum += x.value
                elif x.name.endswith("_count"):
                    h.count += x.value
                elif x.name.endswith("_bucket"):
                    le = float(x.labels["le"])
                    h.buckets[le] = h.buckets.get(le, 0.0) + x.value
            s.itl = h
    return s


def apply_sample(b: Backend, s: PodSample, now: float, kv_bytes_per_token: float = 0.0) -> None:
    """Fold one scrape into a backend: counters, utilisation, windowed mean ITL since the last scrape.

    GPU utilisation is the busiest stage's (a pipeline is as busy as its bottleneck); without stage
    metrics it is ``running / max_batch``.
    """
    b.running, b.waiting, b.kv_usage = s.running, s.waiting, s.kv_usage
    b.fc_queue = s.running + s.waiting
    if s.stage_util:
        b.gpu_util = max(0.0, min(1.0, max(s.stage_util.values())))
    else:
        b.gpu_util = min(1.0, s.running / max(1, b.info.max_batch))
    if s.kv_capacity_tokens is not None and kv_bytes_per_token > 0:
        b.kv_capacity_bytes = s.kv_capacity_tokens * kv_bytes_per_token
    if s.itl is not None:
        prev: Histogram | None = b.extra.get("itl_hist")
        if prev is not None:
            d = s.itl.minus(prev)
            b.itl_ms = d.sum / d.count * 1000 if d.count > 0 else None
        b.extra["itl_hist"] = s.itl
    b.last_scrape = now


class Scraper:
    """Scrapes every pod's ``/metrics`` every ``interval_s`` seconds into the pool."""

    def __init__(
        self,
        pool: Pool,
        session: aiohttp.ClientSession,
        interval_s: float = 0.5,
        timeout_s: float = 1.0,
        kv_bytes_per_token: float = 0.0,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.pool, self.session = pool, session
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self.kv_bytes_per_token = kv_bytes_per_token
        self.clock = clock or asyncio.get_running_loop().time
        self.errors = 0

    async def scrape_one(self, b: Backend) -> bool:
        """Scrape one pod; False (and the pod keeps its last signals) on any failure."""
        try:
            async with self.session.get(
                b.info.url + "/metrics", timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            ) as resp:
                if resp.status != 200:
                    self.errors += 1
                    return False
                text = await resp.text()
            apply_sample(b, parse_metrics(text), self.clock(), self.kv_bytes_per_token)
            return True
        except (aiohttp.ClientError, TimeoutError, ValueError):
            self.errors += 1
            return False

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self.scrape_one(b) for b in list(self.pool.backends.values())))

    async def run(self) -> None:
        while True:
            await self.scrape_all()
            await asyncio.sleep(self.interval_s)


class HealthChecker:
    """Active health checks (``GET /health`` every ``interval_s``), counted by
    :func:`gearshift.router.outlier.record_check` with the pool's thresholds and timeout."""

    def __init__(
        self,
        pool: Pool,
        session: aiohttp.ClientSession,
        interval_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.pool, self.session = pool, session
        self.interval_s, self.clock = interval_s, clock

    async def check_one(self, b: Backend) -> None:
        cfg = self.pool.outlier
        ok = False
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with self.session.get(
                b.info.url + "/health", timeout=aiohttp.ClientTimeout(total=cfg.check_timeout_s)
            ) as resp:
                ok = resp.status == 200
        outlier.record_check(b, ok, self.clock(), cfg)

    async def run(self) -> None:
        # Sleep first: EndpointSlice endpoints are already ready, and static pods are trusted until checked.
        while True:
            await asyncio.sleep(self.interval_s)
            await asyncio.gather(*(self.check_one(b) for b in list(self.pool.backends.values())))


class PrometheusSource:
    """Signals from a Prometheus server instead of scraping pods (``--prometheus URL``).

    Instant queries by the ``pod`` label (Prometheus' Kubernetes service discovery relabels it so); the
    pool's pod names must be the pod names. Uses the operator's one Prometheus client
    (:func:`gearshift.adapters.prometheus.instant_queries`, synchronous) in a thread.
    """

    QUERIES: ClassVar[dict[str, str]] = {
        "running": 'sum by (pod) (vllm:num_requests_running{pod=~"%s"})',
        "waiting": 'sum by (pod) (vllm:num_requests_waiting{pod=~"%s"})',
        # vLLM renamed the gauge (0.10: gpu_cache_usage_perc → kv_cache_usage_perc); `or` takes the old
        # name only for pods without the new one.
        "kv_usage": 'max by (pod) (vllm:kv_cache_usage_perc{pod=~"%s"}) '
        'or max by (pod) (vllm:gpu_cache_usage_perc{pod=~"%s"})',
        "itl_s": 'sum by (pod) (rate(vllm:inter_token_latency_seconds_sum{pod=~"%s"}[30s])) / '
        'sum by (pod) (rate(vllm:inter_token_latency_seconds_count{pod=~"%s"}[30s]))',
        "util": 'max by (pod) (gearshift:stage_utilization{pod=~"%s"})',
        # The balance round's ITL P99 per pod (the PD guide's adaptive batch rule,
        # docs/sources.md#adaptive-batch), over the last 30 s: the scraper's histogram deltas have no
        # Prometheus counterpart finer than a rate window.
        "itl_p99_s": "histogram_quantile(0.99, sum by (pod, le) "
        '(rate(vllm:inter_token_latency_seconds_bucket{pod=~"%s"}[30s])))',
    }

    #: The KV pool of each pod from vLLM's info gauge (its labels carry the numbers), as the scraper reads it.
    CACHE_QUERY: ClassVar[str] = (
        'max by (pod, num_gpu_blocks, block_size) (vllm:cache_config_info{pod=~"%s"})'
    )

    def __init__(
        self,
        pool: Pool,
        url: str,
        interval_s: float = 2.0,
        kv_bytes_per_token: float = 0.0,
        query: Callable[[list[str]], Mapping[str, Sequence[Any]]] | None = None,
    ) -> None:
        from gearshift.adapters.prometheus import instant_queries

        self.pool = pool
        self.url = url
        # The operator's one Prometheus client (no retries: the next poll is seconds away); tests pass
        # their own ``query``.
        self.query = query if query is not None else (lambda qs: instant_queries(url, qs))
        self.interval_s = interval_s
        self.kv_bytes_per_token = kv_bytes_per_token
        self._problem: str | None = None

    def poll(self) -> None:
        """One round of queries, applied to the pool (blocking; run it in a thread).

        Raises:
            gearshift.control.signals.SignalsUnavailable: Prometheus unreachable or an error answer.
        """
        names = "|".join(sorted(self.pool.backends))
        if not names:
            return
        queries = {key: q.replace("%s", names) for key, q in self.QUERIES.items()}
        cache = self.CACHE_QUERY.replace("%s", names) if self.kv_bytes_per_token > 0 else None
        results = self.query([*queries.values(), *([cache] if cache else [])])
        for key, q in queries.items():
            for row in results.get(q, []):
                b = self.pool.backends.get(row["metric"].get("pod", ""))
                value = float(row["value"][1])
                if b is None or not math.isfinite(value):
                    continue
                if key == "itl_s":
                    b.itl_ms = value * 1000
                elif key == "itl_p99_s":
                    b.extra["itl_p99_ms"] = value * 1000
                elif key == "util":
                    b.gpu_util = value
                else:
                    setattr(b, key, value)
        if cache is not None:
            # Without the pool size the decode headroom filter passes every pod and the router never asks
            # for a scale-up (the autoscaler's immediate signal).
            for row in results.get(cache, []):
                b = self.pool.backends.get(row["metric"].get("pod", ""))
                with contextlib.suppress(KeyError, ValueError):
                    tokens = float(row["metric"]["num_gpu_blocks"]) * float(row["metric"]["block_size"])
                    if b is not None and tokens > 0:
                        b.kv_capacity_bytes = tokens * self.kv_bytes_per_token
        for b in self.pool.backends.values():
            b.fc_queue = b.running + b.waiting

    async def run(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.poll)
                self._problem = None
            except Exception as exc:  # the next poll tries again; say so once, not every interval
                if str(exc) != self._problem:
                    log.warning("router signals from Prometheus at %s: %s", self.url, exc)
                    self._problem = str(exc)
            await asyncio.sleep(self.interval_s)
