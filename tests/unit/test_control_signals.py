"""PromQL builders and parsing of Prometheus' HTTP API answers (fixtures written from the documented
``/api/v1/query`` format), plus the fetcher against an unreachable loopback port."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from gearshift.adapters.prometheus import fetch_reading
from gearshift.control.signals import (
    GearSelector,
    SignalsUnavailable,
    parse_vector,
    qps_query,
    quantile_query,
    sample_from_results,
    scalar,
    signal_queries,
    stage_utilization_query,
    stage_values,
)

FIXTURES = Path(__file__).parent / "fixtures"
SEL = GearSelector("llm", "chat", "prefill", "bal")
M = '{namespace="llm",gearshift_io_service="chat",gearshift_io_role="prefill",gearshift_io_gear="bal"}'


def result(name: str) -> list:
    return json.loads((FIXTURES / f"control_prometheus_vector_{name}.json").read_text())["data"]["result"]


class TestQueries:
    def test_exact_strings(self):
        assert stage_utilization_query(SEL) == f"avg by (stage) (gearshift:stage_utilization{M})"
        assert qps_query(SEL) == (
            f"sum(rate(vllm:request_success_total{M}[1m])) or "
            f"sum(rate(vllm:e2e_request_latency_seconds_count{M}[1m]))"
        )
        assert quantile_query("vllm:time_to_first_token_seconds", 0.99, SEL, "30s") == (
            f"histogram_quantile(0.99, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket{M}[30s])))"
        )

    def test_label_values_are_escaped(self):
        q = stage_utilization_query(GearSelector('a"b', "s\\x", "decode", "g"))
        assert 'namespace="a\\"b"' in q and 'gearshift_io_service="s\\\\x"' in q

    def test_all_six_quantiles(self):
        q = signal_queries(SEL)
        assert sorted(q.quantiles) == sorted(f"{m}_p{p}_ms" for m in ("ttft", "itl", "e2e") for p in (50, 99))
        assert (
            "0.5," in q.quantiles["itl_p50_ms"]
            and "inter_token_latency_seconds_bucket" in q.quantiles["itl_p50_ms"]
        )

    def test_bad_quantile(self):
        with pytest.raises(ValueError, match="quantile"):
            quantile_query("x", 1.5, SEL)


class TestParsing:
    def test_stages_are_ordered_by_label(self):
        assert stage_values(result("stages"), "q") == (0.95, 0.31, 0.42)

    def test_scalar_nan_and_empty(self):
        assert scalar(result("scalar"), "q", required=True) == 7.0
        assert scalar(result("nan"), "q", required=False) is None
        assert scalar(result("empty"), "q", required=False) is None
        with pytest.raises(SignalsUnavailable, match="no series for 'q'"):
            scalar(result("empty"), "q", required=True)

    def test_malformed(self):
        with pytest.raises(SignalsUnavailable, match="unexpected"):
            parse_vector([{"metric": {}}], "q")
        with pytest.raises(SignalsUnavailable, match=r"not 0\.\.1"):
            stage_values(
                [
                    {"metric": {"stage": "0"}, "value": [0, "1"]},
                    {"metric": {"stage": "2"}, "value": [0, "1"]},
                ],
                "q",
            )

    def test_sample_from_results(self):
        q = signal_queries(SEL)
        results = {
            q.stage_utilization: result("stages"),
            q.queue: result("scalar"),
            q.running: result("scalar"),
        }
        results[q.qps] = [{"metric": {}, "value": [0, "12.5"]}]
        results[q.quantiles["ttft_p99_ms"]] = [{"metric": {}, "value": [0, "0.2485"]}]
        results[q.quantiles["ttft_p50_ms"]] = result("nan")
        s = sample_from_results(4.0, q, results)
        assert s.stage_utilization == (0.95, 0.31, 0.42)
        assert (s.queue, s.running, s.qps) == (7.0, 7.0, 12.5)
        assert s.ttft_p99_ms == pytest.approx(248.5)
        assert s.ttft_p50_ms is None and s.e2e_p99_ms is None

    def test_missing_required_series(self):
        q = signal_queries(SEL)
        with pytest.raises(SignalsUnavailable, match="gearshift:stage_utilization"):
            sample_from_results(0.0, q, {})


def test_unreachable_prometheus_raises_signals_unavailable():
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(SignalsUnavailable, match="did not answer"):
        fetch_reading(f"http://127.0.0.1:{port}", SEL, 0.0, timeout_s=1.0)
