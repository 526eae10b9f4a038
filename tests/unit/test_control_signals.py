"""PromQL builders and parsing of Prometheus' HTTP API answers (fixtures written from the documented
``/api/v1/query`` format), plus the fetcher against an unreachable loopback port."""

from __future__ import annotations

import json
import math
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
        # The traffic mix as a window of requests of 700 prompt and 90 output tokens gives it.
        mix = q.mix()
        answers[mix["prompt_tokens_mean"]] = vec("NaN" if "prompt_tokens_mean" in nan else "700")
        answers[mix["output_tokens_mean"]] = vec("NaN" if "output_tokens_mean" in nan else "90")
        answers[mix["prompt_tokens_buckets"]] = [
            {"metric": {"le": le}, "value": [0, "0" if "prompt_tokens_buckets" in nan else n]}
            for le, n in (("500.0", "0"), ("1000.0", qps), ("+Inf", qps))
        ]
        for name in drop:
            answers.pop(q.quantiles.get(name) or mix.get(name) or q.arrivals)
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
            "prompt_tokens_mean": SeriesHealth.OK,
            "output_tokens_mean": SeriesHealth.OK,
            "prompt_tokens_buckets": SeriesHealth.OK,
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


# --- the traffic mix ------------------------------------------------------------------------------------
R = '{namespace="llm",gearshift_io_service="chat",app_kubernetes_io_component="router"}'
#: vLLM's 1-2-5 token buckets up to 5000 tokens (vllm/v1/metrics/loggers.py ``build_1_2_5_buckets``).
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
WINDOW_S = 60.0


def _histogram_window(before: list[int], window: list[int]) -> tuple[list[dict[str, Any]], str, str]:
    """What Prometheus answers over a window in which ``window`` prompts were observed after ``before``:
    the ``sum by (le) (rate(..._bucket[1m]))`` vector and the ``rate(_sum)`` and ``rate(_count)`` values,
    from a prometheus_client histogram's own counts at the window's two ends (a rate over a window whose
    ends are scraped is the counter's growth / the window)."""
    from prometheus_client import CollectorRegistry, Histogram

    reg = CollectorRegistry()
    hist = Histogram("vllm:request_prompt_tokens", "prompt tokens", buckets=TOKEN_BUCKETS, registry=reg)

    def counts() -> dict[tuple[str, str], float]:
        return {(s.name, s.labels.get("le", "")): s.value for metric in reg.collect() for s in metric.samples}

    for n in before:
        hist.observe(n)
    start = counts()
    for n in window:
        hist.observe(n)
    end = counts()
    rate = {key: (end[key] - start[key]) / WINDOW_S for key in end}
    name = "vllm:request_prompt_tokens"
    vector = [
        {"metric": {"le": le}, "value": [1700000000.0, str(v)]}
        for (sample, le), v in rate.items()
        if sample == f"{name}_bucket"
    ]
    return vector, str(rate[(f"{name}_sum", "")]), str(rate[(f"{name}_count", "")])


def _pod_series_labels(namespace: str, pod_labels: dict[str, str]) -> dict[str, str]:
    """The labels a pod's series carry after the sandbox's ``kubernetes-pods`` relabelling: every pod
    label through ``labelmap`` (``label_name``) and the namespace."""
    from gearshift.dev.sandbox.prometheus import label_name

    return {label_name(k): v for k, v in pod_labels.items()} | {"namespace": namespace}


def _selects(matchers: str, labels: dict[str, str]) -> bool:
    import re

    pairs = re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', matchers)
    assert pairs and matchers == "{" + ",".join(f'{k}="{v}"' for k, v in pairs) + "}"
    return all(labels.get(k) == v for k, v in pairs)


class TestTrafficMix:
    """The prompt and output tokens of the role's requests: the router's client-facing histograms, else
    the gear's engines'; parsed into the sample, NaN and missing as no data, reported while requests
    flow."""

    def test_exact_strings(self):
        from gearshift.control.signals import prompt_buckets_query, token_mean_query

        assert token_mean_query("vllm:request_prompt_tokens", SEL, "30s") == (
            f"(sum(rate(vllm:request_prompt_tokens_sum{R}[30s])) / "
            f"sum(rate(vllm:request_prompt_tokens_count{R}[30s]))) "
            f"or (sum(rate(vllm:request_prompt_tokens_sum{M}[30s])) / "
            f"sum(rate(vllm:request_prompt_tokens_count{M}[30s])))"
        )
        assert prompt_buckets_query(SEL) == (
            f"sum by (le) (rate(vllm:request_prompt_tokens_bucket{R}[1m])) or "
            f"(sum by (le) (rate(vllm:request_prompt_tokens_bucket{M}[1m])) "
            f"unless on() sum(rate(vllm:request_prompt_tokens_count{R}[1m])))"
        )
        q = signal_queries(SEL, "45s", engine="vllm")
        assert q.mix() == {
            "prompt_tokens_mean": token_mean_query("vllm:request_prompt_tokens", SEL, "45s"),
            "output_tokens_mean": token_mean_query("vllm:request_generation_tokens", SEL, "45s"),
            "prompt_tokens_buckets": prompt_buckets_query(SEL, "45s"),
        }
        assert all(query in q.all() for query in q.mix().values())

    def test_the_router_matchers_select_the_router_pods_series_only(self):
        """Built from the router Deployment's pod template and an engine pod's labels, mapped as the
        sandbox's Prometheus maps them: the router's series have the service but no role, so the role's
        matchers (the arrivals') miss them; the component label keeps the engines' same-named series out."""
        import yaml

        from gearshift.api.pdservice import PDService
        from gearshift.k8s import names
        from gearshift.k8s.router import build_router_deployment

        body = yaml.safe_load(
            (Path(__file__).parents[2] / "examples" / "pdservice-llama3-8b.yaml").read_text()
        )
        pds = PDService.model_validate(body)
        template = build_router_deployment("chat", "llm", pds.spec)["spec"]["template"]
        router = _pod_series_labels("llm", template["metadata"]["labels"])
        engine = _pod_series_labels("llm", names.engine_labels("chat", "prefill", "bal", stage=0))
        other = _pod_series_labels("llm", names.common_labels("other", names.COMPONENT_ROUTER))

        assert _selects(SEL.router_matchers(), router)
        assert not _selects(SEL.router_matchers(), engine)
        assert not _selects(SEL.router_matchers(), other)
        assert not _selects(SEL.matchers(with_gear=False), router)
        assert _selects(SEL.matchers(), engine)

    def test_means_and_buckets_from_a_histogram_window(self):
        from gearshift.control.signals import SeriesHealth, reading_from_results

        q = signal_queries(SEL)
        before, window = [3000, 40, 40], [7, 150, 150, 480, 900, 1200, 1200, 6000]
        vector, prompt_sum, prompt_count = _histogram_window(before, window)
        mix = q.mix()
        answers: dict[str, Any] = {
            q.stage_utilization: result("stages"),
            q.queue: result("scalar"),
            q.running: result("scalar"),
            q.qps: [{"metric": {}, "value": [0, "0.5"]}],
            # the answer's order is Prometheus' own; the parser sorts by le
            mix["prompt_tokens_buckets"]: list(reversed(vector)),
            mix["prompt_tokens_mean"]: [
                {"metric": {}, "value": [0, str(float(prompt_sum) / float(prompt_count))]}
            ],
            mix["output_tokens_mean"]: [{"metric": {}, "value": [0, "87.25"]}],
        }
        r = reading_from_results(5.0, q, answers)
        expected = tuple(
            (float(le), sum(n <= le for n in window) / WINDOW_S) for le in (*TOKEN_BUCKETS, math.inf)
        )
        got = r.sample.prompt_tokens_buckets
        assert [le for le, _ in got] == [le for le, _ in expected]  # rising, +Inf last
        assert [n for _, n in got] == pytest.approx([n for _, n in expected])
        assert r.sample.prompt_tokens_mean == pytest.approx(sum(window) / len(window))
        assert r.sample.output_tokens_mean == 87.25
        assert {k: r.health[k] for k in mix} == dict.fromkeys(mix, SeriesHealth.OK)

    def test_buckets_are_made_non_decreasing(self):
        from gearshift.control.signals import bucket_values

        vec = [
            {"metric": {"le": "+Inf"}, "value": [0, "2"]},
            {"metric": {"le": "100.0"}, "value": [0, "1.5"]},
            {"metric": {"le": "200.0"}, "value": [0, "1.4999"]},
        ]
        assert bucket_values(vec, "q") == ((100.0, 1.5), (200.0, 1.5), (math.inf, 2.0))

    @pytest.mark.parametrize(
        "vector",
        [
            [],
            [{"metric": {"le": "100.0"}, "value": [0, "1"]}],  # no +Inf bucket
            [{"metric": {"le": "100.0"}, "value": [0, "0"]}, {"metric": {"le": "+Inf"}, "value": [0, "0"]}],
            [{"metric": {"le": "100.0"}, "value": [0, "NaN"]}, {"metric": {"le": "+Inf"}, "value": [0, "1"]}],
        ],
        ids=["empty", "no-inf", "no-requests", "nan"],
    )
    def test_buckets_without_a_histogram_are_no_data(self, vector: list[dict[str, Any]]):
        from gearshift.control.signals import SeriesHealth, bucket_health, bucket_values

        assert bucket_values(vector, "q") == ()
        assert bucket_health(vector, "q") is (
            SeriesHealth.MISSING if not vector else SeriesHealth.NOT_A_NUMBER
        )

    def test_a_series_without_a_numeric_le_is_no_histogram(self):
        """No data (the sample and its other signals stand), not a failed sample."""
        from gearshift.control.signals import SeriesHealth, bucket_health, bucket_values

        for labels in ({}, {"le": "many"}, {"le": "NaN"}):
            vector = [{"metric": labels, "value": [0, "1"]}, {"metric": {"le": "+Inf"}, "value": [0, "1"]}]
            assert bucket_values(vector, "q") == ()
            assert bucket_health(vector, "q") is SeriesHealth.NOT_A_NUMBER
        with pytest.raises(SignalsUnavailable, match="unexpected"):
            bucket_values([{"metric": {"le": "+Inf"}}], "q")

    def test_nan_mix_is_none_and_a_missing_one_is_reported_while_requests_flow(self):
        """A mix that is not a number while the engines completed requests is the router's scrape lagging
        the engines' (every start of traffic): no value, not reported. A missing series is a fault."""
        from gearshift.control.signals import SeriesHealth, unavailable_series
        from gearshift.control.smoothing import LatencyMetric

        helper = TestSeriesHealth()
        mix = ("prompt_tokens_mean", "output_tokens_mean", "prompt_tokens_buckets")
        busy = helper._reading("2", nan=mix)
        s = busy.sample
        assert (s.prompt_tokens_mean, s.output_tokens_mean, s.prompt_tokens_buckets) == (None, None, ())
        assert unavailable_series(busy, LatencyMetric.TTFT) == {}
        gone = helper._reading("2", drop=mix)
        assert unavailable_series(gone, LatencyMetric.ITL) == dict.fromkeys(mix, SeriesHealth.MISSING)
        assert unavailable_series(helper._reading("0", nan=mix), LatencyMetric.TTFT) == {}
        ok = helper._reading("2")
        assert (ok.sample.prompt_tokens_mean, ok.sample.output_tokens_mean) == (700.0, 90.0)
        assert ok.sample.prompt_tokens_buckets == ((500.0, 0.0), (1000.0, 2.0), (math.inf, 2.0))
        assert unavailable_series(ok, LatencyMetric.TTFT) == {}

    def test_description_names_the_mix_series(self):
        from gearshift.control.signals import SeriesHealth, describe_series

        text = describe_series(
            {"prompt_tokens_buckets": SeriesHealth.MISSING, "prompt_tokens_mean": SeriesHealth.NOT_A_NUMBER}
        )
        assert text == (
            "mean prompt tokens (vllm:request_prompt_tokens) (not-a-number), "
            "prompt-token histogram (vllm:request_prompt_tokens_bucket) (missing)"
        )
