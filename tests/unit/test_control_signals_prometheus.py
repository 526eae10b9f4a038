"""The signal queries against a real Prometheus (Debian's binary) scraping a loopback exporter.

The exporter (prometheus_client) serves the engine's metric names with known values; Prometheus scrapes
it every second with the target labels pod discovery would give a gear's head pod. Expected quantiles
follow Prometheus' documented ``histogram_quantile`` rule: linear interpolation inside the bucket that
holds the rank (every observation here falls in one bucket, so the q quantile is lower + q × width).
All traffic stays on 127.0.0.1; the test needs the ``prometheus`` binary and is skipped without it.
"""

from __future__ import annotations

import math
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from gearshift.adapters.prometheus import fetch_reading
from gearshift.control.signals import (
    GearSelector,
    PipelineShape,
    SignalsUnavailable,
    UtilizationSource,
)

PROMETHEUS = shutil.which("prometheus")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(PROMETHEUS is None, reason="needs the prometheus binary (Debian package prometheus)"),
]
SEL = GearSelector("llm", "chat", "prefill", "bal")
BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
RATE = 20.0  # requests/s the exporter reports
PREFILL_S, DECODE_S = 0.1, 0.5  # each request's vllm:request_prefill/decode_time_seconds


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def exporter() -> Iterator[tuple[int, Callable[[], float]]]:
    registry = CollectorRegistry()
    util = Gauge("gearshift:stage_utilization", "stage utilisation", ["stage"], registry=registry)
    for stage, value in enumerate((0.95, 0.31, 0.42)):
        util.labels(stage=str(stage)).set(value)
    Gauge("vllm:num_requests_waiting", "waiting", registry=registry).set(7)
    Gauge("vllm:num_requests_running", "running", registry=registry).set(3)
    done = Counter("vllm:request_success", "finished", registry=registry)
    ttft = Histogram("vllm:time_to_first_token_seconds", "ttft", buckets=BUCKETS, registry=registry)
    itl = Histogram("vllm:inter_token_latency_seconds", "itl", buckets=BUCKETS, registry=registry)
    e2e = Histogram("vllm:e2e_request_latency_seconds", "e2e", buckets=BUCKETS, registry=registry)
    prefill = Histogram("vllm:request_prefill_time_seconds", "prefill", buckets=BUCKETS, registry=registry)
    decode = Histogram("vllm:request_decode_time_seconds", "decode", buckets=BUCKETS, registry=registry)

    server = _serve(registry)
    port = server.server_address[1]
    stop = threading.Event()

    def traffic() -> None:
        while not stop.wait(1.0 / RATE):
            done.inc()
            ttft.observe(0.15)  # bucket (0.1, 0.25]
            itl.observe(0.02)  # bucket (0.01, 0.025]
            e2e.observe(0.7)  # bucket (0.5, 1.0]
            prefill.observe(PREFILL_S)
            decode.observe(DECODE_S)

    worker = threading.Thread(target=traffic, daemon=True)
    started = time.monotonic()
    worker.start()
    yield port, lambda: done._value.get() / (time.monotonic() - started)  # the rate actually produced
    stop.set()
    worker.join(timeout=5)
    server.shutdown()
    server.server_close()


@pytest.fixture
def prometheus(exporter: tuple[int, Callable[[], float]], tmp_path: Path) -> Iterator[str]:
    labels = {
        "namespace": SEL.namespace,
        "gearshift_io_service": SEL.service,
        "gearshift_io_role": SEL.role,
        "gearshift_io_gear": SEL.gear,
    }
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [
            {
                "job_name": "engine",
                "static_configs": [{"targets": [f"127.0.0.1:{exporter[0]}"], "labels": labels}],
            }
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    with (tmp_path / "prometheus.log").open("w") as log:
        proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)


def test_fetch_reading_from_real_prometheus(prometheus: str, exporter: tuple[int, Callable[[], float]]):
    start = time.monotonic()
    deadline = start + 45.0
    last: Exception | None = None
    sample = None
    while time.monotonic() < deadline:
        try:
            sample = fetch_reading(prometheus, SEL, 0.0, window="10s", timeout_s=2.0).sample
            # Once the 10 s window is full of scrapes, rate() no longer sees the series' start.
            if time.monotonic() - start > 15.0 and sample.ttft_p99_ms is not None:
                break
        except SignalsUnavailable as err:  # not up yet, or fewer than two scrapes for rate()
            last = err
        time.sleep(1.0)
    assert sample is not None, f"no sample within 45 s: {last}"
    assert sample.stage_utilization == pytest.approx((0.95, 0.31, 0.42))
    assert (sample.queue, sample.running) == (7.0, 3.0)
    produced = exporter[1]()
    assert sample.qps == pytest.approx(produced, rel=0.3)  # rate() extrapolates at the window's edges
    assert sample.ttft_p99_ms == pytest.approx((0.1 + 0.99 * 0.15) * 1000, rel=1e-6)
    assert sample.ttft_p50_ms == pytest.approx((0.1 + 0.50 * 0.15) * 1000, rel=1e-6)
    assert sample.itl_p99_ms == pytest.approx((0.01 + 0.99 * 0.015) * 1000, rel=1e-6)
    assert sample.e2e_p50_ms == pytest.approx((0.5 + 0.50 * 0.5) * 1000, rel=1e-6)

    with pytest.raises(SignalsUnavailable, match="no series"):
        fetch_reading(prometheus, GearSelector("llm", "chat", "prefill", "other"), 0.0, window="10s")


def test_fetch_vllm_reading_from_real_prometheus(prometheus: str, exporter: tuple[int, Callable[[], float]]):
    """The vLLM queries: 20 req/s each spending 0.1 s in prefill and 0.5 s in decode keep, by Little's
    law, 20 x 0.6 = 12 requests in execution on the one head engine; of 32 seats that is 0.375, and with
    stage times 10 and 20 ms stage 0 reads 0.375 x 10/20 = 0.1875. The ``gearshift:stage_utilization``
    series the exporter also serves are not read."""
    shape = PipelineShape("bal", (10.0, 20.0), (1, 1), max_num_seqs=32)
    start = time.monotonic()
    reading = None
    last: Exception | None = None
    while time.monotonic() < start + 45.0:
        try:
            reading = fetch_reading(prometheus, SEL, 0.0, engine="vllm", shape=shape, window="10s")
            if time.monotonic() - start > 15.0 and reading.source is UtilizationSource.DERIVED:
                break
        except SignalsUnavailable as err:
            last = err
        time.sleep(1.0)
    assert reading is not None, f"no reading within 45 s: {last}"
    assert reading.source is UtilizationSource.DERIVED
    produced = exporter[1]()
    busy = produced * (PREFILL_S + DECODE_S) / 32
    assert reading.pipeline_utilization == pytest.approx(busy, rel=0.3)
    assert reading.pipeline_utilization == pytest.approx(0.375, rel=0.3)
    u0, u1 = reading.sample.stage_utilization
    assert u1 == reading.pipeline_utilization and u0 == pytest.approx(u1 * 10.0 / 20.0)
    assert (reading.sample.queue, reading.sample.running) == (7.0, 3.0)
    assert reading.sample.ttft_p99_ms == pytest.approx((0.1 + 0.99 * 0.15) * 1000, rel=1e-6)


# --- the traffic mix through the sandbox's own pod discovery and relabelling --------------------------
ROUTER_PROMPT, ROUTER_OUTPUT = 700, 90  # each client request, as the router records it
ENGINE_PROMPT, ENGINE_OUTPUT = 300, 1  # each prefill leg, as an engine records it
ENGINE_MAX_MODEL_LEN = 4096


class _Stage:
    """The engine state the sim's gauge collector reads: one idle stage."""

    def num_running(self) -> int:
        return 0

    def num_waiting(self) -> int:
        return 0

    def kv_usage(self) -> float:
        return 0.0

    def stage_utilization(self) -> list[float]:
        return [0.5]


def _serve(registry: CollectorRegistry) -> ThreadingHTTPServer:
    """``registry`` served on a loopback port (``server.server_address[1]``), in a daemon thread."""

    class Metrics(BaseHTTPRequestHandler):
        # Always the classic text format (0.0.4), as vLLM's engines are scraped: prometheus_client's
        # OpenMetrics output, which Prometheus 2.42 negotiates, writes colons in names as underscores.
        def do_GET(self) -> None:
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def mix_prometheus(tmp_path: Path) -> Iterator[tuple[str, Callable[[], float]]]:
    """The router's real client metrics (:func:`make_client_metrics`) and a sim engine's real metrics
    (:class:`EngineMetrics`), served on loopback and found by Prometheus through the sandbox's
    ``kubernetes-pods`` job: a router pod built from the router Deployment's template of service ``chat``,
    and engine pods of ``chat`` and of ``solo`` (a service without a router), all on the same engine
    exporter. Yields Prometheus' URL and the request rate the exporters actually produced."""
    from gearshift.api.pdservice import PDService
    from gearshift.dev.sandbox.prometheus import prometheus_argv, prometheus_config
    from gearshift.dev.sandbox.promsd import write_targets
    from gearshift.k8s import names
    from gearshift.k8s.router import build_router_deployment
    from gearshift.router.metrics import make_client_metrics
    from gearshift.sim.metrics import EngineMetrics

    router_reg = CollectorRegistry()
    client = make_client_metrics(router_reg)
    engine = EngineMetrics(_Stage(), "llama", max_model_len=ENGINE_MAX_MODEL_LEN)
    servers = [_serve(router_reg), _serve(engine.registry)]
    router_port, engine_port = (s.server_address[1] for s in servers)

    root = Path(__file__).resolve().parents[2]
    pds = PDService.model_validate(
        yaml.safe_load((root / "examples" / "pdservice-llama3-8b.yaml").read_text())
    )
    template = build_router_deployment("chat", SEL.namespace, pds.spec)["spec"]["template"]
    scrape = {"prometheus.io/scrape": "true", "prometheus.io/path": "/metrics"}

    def pod(name: str, labels: dict[str, str], port: int) -> dict[str, Any]:
        return {
            "metadata": {
                "name": name,
                "namespace": SEL.namespace,
                "labels": labels,
                "annotations": scrape | {"prometheus.io/port": str(port)},
            },
            "spec": {"nodeName": "n1", "containers": [{"name": "main"}]},
            "status": {"podIP": "127.0.0.1", "phase": "Running"},
        }

    pods = [
        pod("chat-router-1", template["metadata"]["labels"], router_port),
        pod("chat-bal-0", names.engine_labels("chat", SEL.role, SEL.gear, stage=0), engine_port),
        pod("solo-bal-0", names.engine_labels("solo", SEL.role, SEL.gear, stage=0), engine_port),
    ]
    targets = tmp_path / "targets.json"
    write_targets(targets, pods)
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(prometheus_config(targets, scrape_interval_s=1)))

    stop = threading.Event()

    def traffic() -> None:
        while not stop.wait(1.0 / RATE):
            client.request_prompt_tokens.labels("llama").observe(ROUTER_PROMPT)
            client.request_generation_tokens.labels("llama").observe(ROUTER_OUTPUT)
            engine.success("length")
            engine.e2e.observe(0.7)
            engine.finished_tokens(ENGINE_PROMPT, ENGINE_OUTPUT)

    worker = threading.Thread(target=traffic, daemon=True)
    started = time.monotonic()
    worker.start()
    port = free_port()
    argv = prometheus_argv(str(PROMETHEUS), tmp_path / "prometheus.yml", tmp_path / "data", port)
    with (tmp_path / "prometheus.log").open("w") as log:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log)
        try:
            labels = {"model_name": "llama", "engine": "0"}

            def produced() -> float:
                done = engine.registry.get_sample_value("vllm:request_prompt_tokens_count", labels) or 0.0
                return done / (time.monotonic() - started)

            yield f"http://127.0.0.1:{port}", produced
        finally:
            stop.set()
            worker.join(timeout=5)
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
            for s in servers:
                s.shutdown()
                s.server_close()


def test_traffic_mix_from_the_router_else_the_engines(mix_prometheus: tuple[str, Callable[[], float]]):
    """``chat`` has a router: its mix is the router's (700 prompt, 90 output tokens, the router's 1-2-5
    ladder to 5e6), not the engines' prefill legs of the same metric names. ``solo`` has none: its mix is
    its engines' (300 and 1, the engine's ladder to its max_model_len). Every observation falls in one
    bucket, so each bucket below it reads 0 and each from it up the whole request rate."""
    from gearshift.control.signals import MIX_SERIES, SeriesHealth, unavailable_series
    from gearshift.control.smoothing import LatencyMetric
    from gearshift.router.metrics import VLLM_TOKEN_BUCKETS
    from gearshift.sim.metrics import token_buckets

    url, produced = mix_prometheus
    solo = GearSelector(SEL.namespace, "solo", SEL.role, SEL.gear)
    start = time.monotonic()
    readings: dict[str, Any] = {}
    last: Exception | None = None
    while time.monotonic() < start + 45.0:
        try:
            readings = {
                s.service: fetch_reading(url, s, 0.0, window="10s", timeout_s=2.0) for s in (SEL, solo)
            }
            full = time.monotonic() - start > 15.0
            if full and all(r.sample.prompt_tokens_buckets for r in readings.values()):
                break
        except SignalsUnavailable as err:  # not scraped yet
            last = err
        time.sleep(1.0)
    assert readings, f"no reading within 45 s: {last}"
    rate = produced()
    for service, (prompt, output, ladder) in {
        "chat": (ROUTER_PROMPT, ROUTER_OUTPUT, VLLM_TOKEN_BUCKETS),
        "solo": (ENGINE_PROMPT, ENGINE_OUTPUT, token_buckets(ENGINE_MAX_MODEL_LEN)),
    }.items():
        reading = readings[service]
        s = reading.sample
        assert s.prompt_tokens_mean == pytest.approx(prompt, rel=1e-9), service
        assert s.output_tokens_mean == pytest.approx(output, rel=1e-9), service
        assert [le for le, _ in s.prompt_tokens_buckets] == [*ladder, math.inf], service
        below = [n for le, n in s.prompt_tokens_buckets if le < prompt]
        above = [n for le, n in s.prompt_tokens_buckets if le >= prompt]
        assert below == [0.0] * len(below) and len(set(above)) == 1, service
        assert above[0] == pytest.approx(rate, rel=0.3), service  # rate() extrapolates at the edges
        assert {k: reading.health[k] for k in MIX_SERIES} == dict.fromkeys(MIX_SERIES, SeriesHealth.OK)
        assert unavailable_series(reading, LatencyMetric.E2E) == {}
