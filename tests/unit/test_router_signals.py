"""Metrics parsing, windowed ITL, histogram quantiles, static backends and EndpointSlice membership."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gearshift.router.membership import (
    BackendSpecError,
    infos_from_slices,
    node_facts,
    parse_backend,
    speed_from_pipeline,
)
from gearshift.router.pool import Backend, BackendInfo
from gearshift.router.signals import Histogram, apply_sample, parse_metrics

VLLM_TEXT = """\
# HELP vllm:num_requests_running Requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
# TYPE gearshift:stage_utilization gauge
gearshift:stage_utilization{stage="0"} 0.4
gearshift:stage_utilization{stage="1"} 0.8
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="1000"} 1.0
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{le="0.01",model_name="m"} 10.0
vllm:inter_token_latency_seconds_bucket{le="0.05",model_name="m"} 30.0
vllm:inter_token_latency_seconds_bucket{le="0.1",model_name="m"} 40.0
vllm:inter_token_latency_seconds_bucket{le="+Inf",model_name="m"} 40.0
vllm:inter_token_latency_seconds_count{model_name="m"} 40.0
vllm:inter_token_latency_seconds_sum{model_name="m"} 1.2
"""


def test_parse_vllm_metrics() -> None:
    s = parse_metrics(VLLM_TEXT)
    assert (s.running, s.waiting, s.kv_usage) == (3.0, 4.0, 0.5)
    assert s.stage_util == {"0": 0.4, "1": 0.8}
    assert s.kv_capacity_tokens == 16000
    assert s.itl is not None and (s.itl.count, s.itl.sum) == (40.0, 1.2)
    assert s.itl.buckets[0.05] == 30.0


def test_histogram_quantile_interpolates() -> None:
    h = parse_metrics(VLLM_TEXT).itl
    assert h is not None
    # rank 0.5 × 40 = 20 falls in (0.01, 0.05] holding 10..30: 0.01 + 0.04 × (20 − 10) / 20 = 0.03
    assert h.quantile(0.5) == pytest.approx(0.03)
    # rank 39.6 in (0.05, 0.1] holding 30..40: 0.05 + 0.05 × 9.6 / 10 = 0.098
    assert h.quantile(0.99) == pytest.approx(0.098)
    assert Histogram().quantile(0.5) is None


def test_apply_sample_windowed_itl_and_util() -> None:
    b = Backend(BackendInfo("p", "http://127.0.0.1:1", "decode", max_batch=10))
    apply_sample(b, parse_metrics(VLLM_TEXT), now=1.0, kv_bytes_per_token=1000.0)
    assert b.gpu_util == 0.8  # the busiest stage
    assert b.kv_capacity_bytes == 16000 * 1000.0
    assert b.fc_queue == 7.0
    assert b.itl_ms is None  # first scrape: no window yet
    later = VLLM_TEXT.replace('_count{model_name="m"} 40.0', '_count{model_name="m"} 50.0').replace(
        '_sum{model_name="m"} 1.2', '_sum{model_name="m"} 1.7'
    )
    apply_sample(b, parse_metrics(later), now=2.0)
    # (1.7 − 1.2) s over (50 − 40) tokens = 50 ms
    assert b.itl_ms == pytest.approx(50.0)
    no_stage = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 4\n"
    apply_sample(b, parse_metrics(no_stage), now=3.0)
    assert b.gpu_util == pytest.approx(0.4)  # running / max_batch


def test_parse_backend() -> None:
    info = parse_backend("prefill=http://127.0.0.1:9001/;gpu=A10-24GB;gpus=2;node=n1;nic=25;name=p1")
    assert (info.name, info.url, info.role, info.gpu_model, info.gpu_count, info.tp_size, info.nic_gbps) == (
        "p1",
        "http://127.0.0.1:9001",
        "prefill",
        "A10-24GB",
        2,
        2,
        25.0,
    )
    assert parse_backend("both=http://127.0.0.1:9").name == "both-127.0.0.1:9"


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("worker=http://127.0.0.1:1", "bad role"),
        ("prefill=127.0.0.1:1", "must start with http"),
        ("prefill=http://127.0.0.1:1;color=red", "unknown key 'color'"),
        ("prefill=http://127.0.0.1:1;gpus=two", "gpus='two' is not a int"),
        ("prefill=http://127.0.0.1:1;gpu=B200", "gpu 'B200' unknown"),
    ],
)
def test_parse_backend_errors(spec: str, match: str) -> None:
    with pytest.raises(BackendSpecError, match=match):
        parse_backend(spec)


def test_speed_from_pipeline() -> None:
    doc = {
        "stages": [
            {"layers": [0, 24], "gpu": "H100-80GB"},
            {"layers": [24, 32], "gpu": "A10-24GB", "gpus": 1},
        ]
    }
    # prefill: 32 / (24/1 + 8/(125/989)); decode: 32 / (24/1 + 8/(600/3350))
    assert speed_from_pipeline(doc, "prefill") == pytest.approx(32 / (24 + 8 * 989 / 125))
    assert speed_from_pipeline(doc, "decode") == pytest.approx(32 / (24 + 8 * 3350 / 600))
    assert speed_from_pipeline({"stages": [{"layers": [0, 1], "gpu": "B200"}]}, "prefill") is None
    assert speed_from_pipeline({"nope": 1}, "prefill") is None


def test_infos_from_slices() -> None:
    slices = [
        {
            "metadata": {"name": "s-pre-abc", "labels": {"kubernetes.io/service-name": "chat-prefill"}},
            "ports": [{"name": "http", "port": 8000}],
            "endpoints": [
                {
                    "addresses": ["127.0.1.5"],
                    "conditions": {"ready": True},
                    "nodeName": "gpu-h100-0",
                    "targetRef": {"kind": "Pod", "name": "chat-prefill-fast-s0-0"},
                },
                {
                    "addresses": ["127.0.1.6"],
                    "conditions": {"ready": False},
                    "nodeName": "gpu-h100-0",
                    "targetRef": {"kind": "Pod", "name": "chat-prefill-fast-s0-1"},
                },
            ],
        },
        {
            "metadata": {"name": "s-dec-abc", "labels": {"kubernetes.io/service-name": "chat-decode"}},
            "ports": [{"name": "http", "port": 8001}],
            "endpoints": [
                {
                    "addresses": ["127.0.2.7"],
                    "nodeName": "gpu-a10-1",
                    "targetRef": {"kind": "Pod", "name": "chat-decode-slow-s0-0"},
                },
            ],
        },
        {
            "metadata": {"name": "other", "labels": {"kubernetes.io/service-name": "unrelated"}},
            "endpoints": [],
        },
    ]
    nodes = {
        "gpu-h100-0": node_facts({"metadata": {"labels": {"gearshift.io/gpu-model": "H100-80GB"}}}, None),
        "gpu-a10-1": node_facts(
            {"metadata": {"labels": {"gearshift.io/gpu-model": "A10-24GB"}}},
            {"status": {"computeScore": 0.11, "hbmGBps": 590.0}},
        ),
    }
    pipeline = {"stages": [{"layers": [0, 32], "gpu": "A10-24GB"}]}
    envs = {"chat-decode-slow-s0-0": {"GEARSHIFT_PIPELINE": json.dumps(pipeline)}}
    infos = infos_from_slices(slices, {"chat-prefill": "prefill", "chat-decode": "decode"}, nodes, envs)
    by = {i.name: i for i in infos}
    assert set(by) == {"chat-prefill-fast-s0-0", "chat-decode-slow-s0-0"}
    pre, dec = by["chat-prefill-fast-s0-0"], by["chat-decode-slow-s0-0"]
    assert (pre.url, pre.role, pre.gpu_model, pre.node) == (
        "http://127.0.1.5:8000",
        "prefill",
        "H100-80GB",
        "gpu-h100-0",
    )
    assert (dec.url, dec.role, dec.compute_score, dec.hbm_gbps) == (
        "http://127.0.2.7:8001",
        "decode",
        0.11,
        590.0,
    )
    assert dec.speed == pytest.approx(600 / 3350)


class _FakeProm:
    """prometheus-api-client's ``custom_query`` over canned rows, recording the queries."""

    def __init__(self, rows: dict[str, list[dict[str, object]]]) -> None:
        self.rows, self.queries = rows, []  # type: ignore[var-annotated]

    def custom_query(self, q: str) -> list[dict[str, object]]:
        self.queries.append(q)
        for key, rows in self.rows.items():
            if key in q:
                return rows
        return []


def test_prometheus_source_sizes_the_kv_pool() -> None:
    # The router in a PDService reads signals through Prometheus; without the pool size from
    # vllm:cache_config_info the decode headroom filter passed every pod (tests/e2e/test_autoscale.py).
    from gearshift.router.pool import PolicyConfig, Pool
    from gearshift.router.signals import PrometheusSource

    pool = Pool(PolicyConfig())
    pool.set_members([BackendInfo("d-0", "http://127.0.0.1:1", "decode")])
    prom = _FakeProm(
        {
            "vllm:kv_cache_usage_perc": [{"metric": {"pod": "d-0"}, "value": [0, "0.9"]}],
            "vllm:cache_config_info": [
                {"metric": {"pod": "d-0", "num_gpu_blocks": "236", "block_size": "16"}, "value": [0, "1"]},
                {"metric": {"pod": "gone", "num_gpu_blocks": "1", "block_size": "16"}, "value": [0, "1"]},
            ],
        }
    )
    src = PrometheusSource(pool, "http://127.0.0.1:9", kv_bytes_per_token=524288.0, query=_via(prom))
    src.poll()
    b = pool.backends["d-0"]
    assert b.kv_usage == 0.9
    assert b.kv_capacity_bytes == 236 * 16 * 524288.0
    assert any("cache_config_info" in q and "d-0" in q for q in prom.queries)
    # Without KV bytes per token (no --model) the pool stays unknown, as with the scraper.
    pool2 = Pool(PolicyConfig())
    pool2.set_members([BackendInfo("d-0", "http://127.0.0.1:1", "decode")])
    PrometheusSource(pool2, "http://127.0.0.1:9", query=_via(prom)).poll()
    assert pool2.backends["d-0"].kv_capacity_bytes is None


def _via(prom: Any) -> Any:
    """A fake with prometheus-api-client's ``custom_query`` as PrometheusSource's ``query``."""
    return lambda queries: {q: prom.custom_query(q) for q in queries}


async def test_prometheus_down_is_said_once_and_polling_goes_on(caplog: Any) -> None:
    import asyncio
    import contextlib
    import logging

    from gearshift.control.signals import SignalsUnavailable
    from gearshift.router.pool import PolicyConfig, Pool
    from gearshift.router.signals import PrometheusSource

    calls = []

    def down(queries: list[str]) -> Any:
        calls.append(len(queries))
        raise SignalsUnavailable("Prometheus at http://127.0.0.1:9 did not answer: refused")

    pool = Pool(PolicyConfig())
    pool.set_members([BackendInfo("d-0", "http://127.0.0.1:1", "decode")])
    src = PrometheusSource(pool, "http://127.0.0.1:9", interval_s=0.01, query=down)
    with caplog.at_level(logging.WARNING, logger="gearshift.router.signals"):
        task = asyncio.create_task(src.run())
        for _ in range(200):
            if len(calls) >= 3:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert len(calls) >= 3
    warned = [r for r in caplog.records if "did not answer" in r.getMessage()]
    assert len(warned) == 1
