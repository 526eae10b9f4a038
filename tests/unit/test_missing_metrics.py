"""A metric a pod does not export is unknown, not zero.

- The router's scrape keeps a missing KV-usage series as unknown, and the picker prices such a pod as the
  fullest pod that reports one (it got every decode request when it was scored as empty).
- The KV-usage queries fall back to vLLM's older gauge name, checked with Prometheus' own evaluator
  (``promtool test rules``), not by reading the query string.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gearshift.control.autoscale import scaling
from gearshift.router import policies as P
from gearshift.router.pool import Backend, BackendInfo, PolicyConfig, Pool
from gearshift.router.signals import PrometheusSource, apply_sample, parse_metrics

NO_KV = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 1.0
"""
OLD_KV = NO_KV + '# TYPE vllm:gpu_cache_usage_perc gauge\nvllm:gpu_cache_usage_perc{model_name="m"} 0.4\n'
NAN_KV = NO_KV + '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name="m"} NaN\n'


def test_scrape_without_kv_series_is_unknown() -> None:
    assert parse_metrics(NO_KV).kv_usage is None
    assert parse_metrics(NAN_KV).kv_usage is None
    assert parse_metrics(OLD_KV).kv_usage == 0.4
    b = Backend(BackendInfo("d", "http://127.0.0.1:1", "decode"))
    apply_sample(b, parse_metrics(NO_KV), now=1.0)
    assert b.kv_usage is None


def _decode_pool() -> Pool:
    pool = Pool(PolicyConfig(policy="pd-score"))
    pool.set_members(
        [
            BackendInfo("d-busy", "http://127.0.0.1:1", "decode", gpu_model="A10-24GB"),
            BackendInfo("d-idle", "http://127.0.0.1:2", "decode", gpu_model="A10-24GB"),
            BackendInfo("d-silent", "http://127.0.0.1:3", "decode", gpu_model="A10-24GB"),
        ]
    )
    for b in pool.backends.values():
        b.kv_capacity_bytes = 1e8
    pool.backends["d-busy"].kv_usage = 0.9
    pool.backends["d-idle"].kv_usage = 0.2
    return pool


def test_a_pod_without_kv_usage_is_priced_as_the_fullest() -> None:
    pool = _decode_pool()
    # 150 tokens × 1e5 B = 15 MB of KV: d-busy's 10 MB free fails the PD guide's 1.2× headroom filter
    # (docs/sources.md#decode-headroom), d-idle's 80 MB passes; d-silent, priced at the fullest reported usage
    # (0.9), fails it too.
    req = P.RequestView(prompt_tokens=100, max_tokens=50, kv_bytes_per_token=1e5)
    picks = [pool.pick("decode", req, 0.0).info.name for _ in range(5)]
    assert picks == ["d-idle"] * 5
    # The same pool with the silent pod scored as empty (the old behaviour) sends it everything:
    # the test above fails if unknown turns back into 0.
    pool.backends["d-silent"].kv_usage = 0.0
    assert [pool.pick("decode", req, 0.0).info.name for _ in range(5)] == ["d-silent"] * 5


def test_prometheus_source_skips_non_finite_values() -> None:
    class Prom:
        def custom_query(self, q: str) -> list[dict[str, object]]:
            if "kv_cache_usage_perc" in q:
                return [{"metric": {"pod": "d-0"}, "value": [0, "+Inf"]}]
            if "num_requests_running" in q:
                return [{"metric": {"pod": "d-0"}, "value": [0, "NaN"]}]
            return []

    pool = Pool(PolicyConfig())
    pool.set_members([BackendInfo("d-0", "http://127.0.0.1:1", "decode")])
    PrometheusSource(pool, "http://127.0.0.1:9", query=_via(Prom())).poll()
    b = pool.backends["d-0"]
    assert b.kv_usage is None and b.running == 0.0


def _promtool(tmp_path: Path, series: dict[str, str], expr: str, expected: list[dict[str, object]]) -> None:
    test = {
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in series.items()],
                "promql_expr_test": [{"expr": expr, "eval_time": "2m", "exp_samples": expected}],
            }
        ],
    }
    path = tmp_path / "test.yml"
    path.write_text(yaml.safe_dump(test))
    proc = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool (Debian package prometheus) not installed"
)


@needs_promtool
def test_router_kv_query_falls_back_per_pod_to_the_old_name(tmp_path: Path) -> None:
    q = PrometheusSource.QUERIES["kv_usage"].replace("%s", "d-new|d-old|d-both")
    _promtool(
        tmp_path,
        {
            'vllm:kv_cache_usage_perc{pod="d-new"}': "0.3x3",
            'vllm:gpu_cache_usage_perc{pod="d-old"}': "0.7x3",
            # a pod exporting both names (vLLM 0.10's deprecation window): the current name wins
            'vllm:kv_cache_usage_perc{pod="d-both"}': "0.1x3",
            'vllm:gpu_cache_usage_perc{pod="d-both"}': "0.9x3",
        },
        q,
        [
            {"labels": '{pod="d-new"}', "value": 0.3},
            {"labels": '{pod="d-old"}', "value": 0.7},
            {"labels": '{pod="d-both"}', "value": 0.1},
        ],
    )


@needs_promtool
def test_autoscaler_kv_query_falls_back_to_the_old_name(tmp_path: Path) -> None:
    m = '{namespace="ns"}'
    _promtool(
        tmp_path,
        {'vllm:gpu_cache_usage_perc{namespace="ns",pod="a"}': "0.6x3"},
        scaling.kv_usage_query(m),
        [{"labels": "{}", "value": 0.6}],
    )
    _promtool(
        tmp_path,
        {
            'vllm:kv_cache_usage_perc{namespace="ns",pod="a"}': "0.2x3",
            'vllm:kv_cache_usage_perc{namespace="ns",pod="b"}': "0.5x3",
            'vllm:gpu_cache_usage_perc{namespace="ns",pod="c"}': "0.95x3",
        },
        scaling.kv_usage_query(m),
        [{"labels": "{}", "value": 0.5}],
    )


def _via(prom: Any) -> Any:
    """A fake with prometheus-api-client's ``custom_query`` as PrometheusSource's ``query``."""
    return lambda queries: {q: prom.custom_query(q) for q in queries}


@needs_promtool
def test_arrivals_come_from_the_router_else_from_the_engines(tmp_path: Path) -> None:
    # The router counts 2 + 1 req/s for this service's role (two router pods); the gear's engines completed
    # 0.5 req/s with nothing queued: the router's count is the load. Another service's router is ignored.
    from gearshift.control.signals import GearSelector, arrival_query

    sel = GearSelector("ns", "svc", "both", "g")
    expr = arrival_query(sel, "2m")
    svc = 'namespace="ns",gearshift_io_service="svc",gearshift_io_role="both"'
    engine = {
        f'vllm:request_success_total{{{svc},gearshift_io_gear="g",pod="h"}}': "0+30x3",
        f'vllm:num_requests_running{{{svc},gearshift_io_gear="g",pod="h"}}': "4x3",
        f'vllm:num_requests_waiting{{{svc},gearshift_io_gear="g",pod="h"}}': "0x3",
    }
    routers = {
        f'gearshift_router_arrivals_total{{{svc},pod="r1"}}': "0+120x3",
        f'gearshift_router_arrivals_total{{{svc},pod="r2"}}': "0+60x3",
        'gearshift_router_arrivals_total{namespace="ns",gearshift_io_service="other",'
        'gearshift_io_role="both",pod="r3"}': "0+600x3",
    }
    _promtool(tmp_path, {**engine, **routers}, expr, [{"labels": "{}", "value": 3.0}])
    # no router series (a router of another version, or none scraped): the engines' estimate
    _promtool(tmp_path, engine, expr, [{"labels": "{}", "value": 0.5}])
