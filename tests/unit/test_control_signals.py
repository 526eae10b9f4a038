"""PromQL builders and parsing of Prometheus' HTTP API answers (fixtures written from the documented
``/api/v1/query`` format), plus the fetcher against an unreachable loopback port."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

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


class TestSeriesHealth:
    """Every optional series of a sample is ok, missing or not a number; while requests flow the
    ones that should have a value and have none are reported."""

    def test_classes(self):
        from gearshift.control.signals import SeriesHealth, series_health

        assert series_health([]) is SeriesHealth.MISSING
        assert series_health([{"metric": {}, "value": [0, "NaN"]}]) is SeriesHealth.NOT_A_NUMBER
        assert series_health([{"metric": {}, "value": [0, "+Inf"]}]) is SeriesHealth.NOT_A_NUMBER
        assert series_health([{"metric": {}, "value": [0, "0"]}]) is SeriesHealth.OK

    def _reading(self, qps: str, drop: tuple[str, ...] = (), nan: tuple[str, ...] = ()) -> Any:
        from gearshift.control.signals import GearSelector, reading_from_results, signal_queries

        q = signal_queries(GearSelector("ns", "svc", "prefill", "g"))
        vec = lambda v: [{"metric": {}, "value": [0, v]}]  # noqa: E731
        answers: dict[str, Any] = {
            q.stage_utilization: [{"metric": {"stage": "0"}, "value": [0, "0.5"]}],
            q.queue: vec("0"),
            q.running: vec("1"),
            q.qps: vec(qps),
            q.arrivals: vec(qps),
        }
        for name, query in q.quantiles.items():
            answers[query] = vec("NaN" if name in nan else "0.1")
        for name in drop:
            answers.pop(q.quantiles.get(name, q.arrivals))
        return reading_from_results(0.0, q, answers)

    def test_reading_records_each_series(self):
        from gearshift.control.signals import SeriesHealth

        r = self._reading("2", drop=("ttft_p50_ms", "arrival_rps"), nan=("itl_p99_ms",))
        assert r.health == {
            "ttft_p50_ms": SeriesHealth.MISSING,
            "ttft_p99_ms": SeriesHealth.OK,
            "itl_p50_ms": SeriesHealth.OK,
            "itl_p99_ms": SeriesHealth.NOT_A_NUMBER,
            "e2e_p50_ms": SeriesHealth.OK,
            "e2e_p99_ms": SeriesHealth.OK,
            "arrival_rps": SeriesHealth.MISSING,
        }
        assert r.sample.ttft_p50_ms is None and r.sample.arrival_rps is None and r.sample.ttft_p99_ms == 100.0

    def test_unavailable_only_while_requests_flow(self):
        from gearshift.control.signals import SeriesHealth, unavailable_series
        from gearshift.control.smoothing import LatencyMetric

        idle = self._reading("0", drop=("ttft_p50_ms",), nan=("e2e_p99_ms", "ttft_p99_ms"))
        assert unavailable_series(idle, LatencyMetric.TTFT) == {}
        busy = self._reading("2", drop=("ttft_p50_ms",), nan=("e2e_p99_ms", "itl_p50_ms", "itl_p99_ms"))
        # Missing is always reported; NaN where every completed request observes it (E2E) or the policy
        # reads it: ITL's NaN is a one-token prefill leg's, unless ITL is the policy's metric.
        assert unavailable_series(busy, LatencyMetric.TTFT) == {
            "ttft_p50_ms": SeriesHealth.MISSING,
            "e2e_p99_ms": SeriesHealth.NOT_A_NUMBER,
        }
        assert unavailable_series(busy, LatencyMetric.ITL) == {
            "ttft_p50_ms": SeriesHealth.MISSING,
            "itl_p50_ms": SeriesHealth.NOT_A_NUMBER,
            "itl_p99_ms": SeriesHealth.NOT_A_NUMBER,
            "e2e_p99_ms": SeriesHealth.NOT_A_NUMBER,
        }

    def test_a_reading_without_health_reports_an_absent_policy_p99(self):
        from gearshift.control.signals import Reading, SeriesHealth, unavailable_series
        from gearshift.control.smoothing import LatencyMetric, Sample

        r = Reading(Sample(at=0.0, qps=3.0, itl_p99_ms=20.0))
        assert unavailable_series(r, LatencyMetric.TTFT) == {"ttft_p99_ms": SeriesHealth.NOT_A_NUMBER}
        assert unavailable_series(r, LatencyMetric.ITL) == {}

    def test_description_names_each_series_in_a_stable_order(self):
        from gearshift.control.signals import SeriesHealth, describe_series

        text = describe_series(
            {"arrival_rps": SeriesHealth.MISSING, "ttft_p99_ms": SeriesHealth.NOT_A_NUMBER}
        )
        assert text == (
            "vllm:time_to_first_token_seconds P99 (not-a-number), arrival rate (vllm:request_success_total, "
            "vllm:num_requests_running, vllm:num_requests_waiting) (missing)"
        )
