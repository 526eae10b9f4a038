"""vLLM's signals: the PromQL the controller runs for an ``engine: vllm`` service, the derived per-stage
utilisation (expected values worked out by hand in each test), and NaN/Inf as no data.

Prometheus answers are written in the documented ``/api/v1/query`` vector format; Prometheus spells
special values ``"NaN"``, ``"+Inf"``, ``"-Inf"``.
"""

from __future__ import annotations

import math

import pytest

from gearshift.control.signals import (
    GearSelector,
    PipelineShape,
    SignalsUnavailable,
    UtilizationSource,
    concurrency_query,
    derived_stage_utilization,
    missing_stage_times,
    reading_from_results,
    scalar,
    seat_occupancy,
    signal_queries,
    stage_values,
)

SEL = GearSelector("llm", "chat", "prefill", "bal")
M = '{namespace="llm",gearshift_io_service="chat",gearshift_io_role="prefill",gearshift_io_gear="bal"}'


def vec(value: str) -> list[dict]:
    return [{"metric": {}, "value": [1.7e9, value]}]


class TestQueries:
    def test_vllm_concurrency_query_exact(self) -> None:
        assert concurrency_query(SEL) == (
            f"(sum(rate(vllm:request_prefill_time_seconds_sum{M}[1m])) + "
            f"sum(rate(vllm:request_decode_time_seconds_sum{M}[1m]))) / count(vllm:num_requests_running{M})"
        )

    def test_vllm_queries_read_no_stage_utilization(self) -> None:
        q = signal_queries(SEL, engine="vllm")
        assert q.stage_utilization is None and q.concurrency == concurrency_query(SEL)
        assert not any("gearshift:" in x for x in q.all())
        # + the arrival rate and the traffic mix (two means, the prompt-token buckets)
        assert q.all()[0] == q.concurrency and len(q.all()) == 1 + 1 + 3 + 6 + 3

    def test_sim_queries_unchanged(self) -> None:
        sim = signal_queries(SEL)
        assert sim == signal_queries(SEL, engine="sim")
        assert sim.concurrency is None
        assert sim.stage_utilization == f"avg by (stage) (gearshift:stage_utilization{M})"
        assert sim.all() == [
            sim.stage_utilization,
            sim.arrivals,
            sim.queue,
            sim.running,
            sim.qps,
            *sim.quantiles.values(),
            sim.prompt_tokens_mean,
            sim.output_tokens_mean,
            sim.prompt_tokens_buckets,
        ]

    def test_unknown_engine(self) -> None:
        with pytest.raises(ValueError, match="engine must be one of"):
            signal_queries(SEL, engine="sglang")  # type: ignore[arg-type]


class TestSeatOccupancy:
    def test_fraction_of_max_num_seqs(self) -> None:
        assert seat_occupancy(24.0, 32) == 0.75  # 24 of 32 seats
        assert seat_occupancy(40.0, 32) == 1.0  # a burst of long completions: capped
        assert seat_occupancy(0.0, 32) == 0.0
        assert seat_occupancy(-0.01, 32) == 0.0  # rate() rounding below 0

    def test_bad_inputs(self) -> None:
        with pytest.raises(ValueError, match="max_num_seqs"):
            seat_occupancy(1.0, 0)
        with pytest.raises(ValueError, match="finite"):
            seat_occupancy(math.nan, 32)


class TestDerivedStageUtilization:
    def test_bottleneck_reads_busy_others_in_proportion(self) -> None:
        # t = 10, 20, 5 ms: the bottleneck is stage 1 (20 ms). Busy 0.75:
        # u0 = 0.75 * 10/20 = 0.375, u1 = 0.75, u2 = 0.75 * 5/20 = 0.1875.
        u = derived_stage_utilization(0.75, (10.0, 20.0, 5.0))
        assert u == pytest.approx((0.375, 0.75, 0.1875))

    def test_replicated_stage_shares_its_load(self) -> None:
        # Stage 1 has 2 pods: it takes a micro-batch every 20/2 = 10 ms, like stage 0.
        # e = 10, 10, 5 → u = 0.75, 0.75, 0.75 * 5/10 = 0.375.
        u = derived_stage_utilization(0.75, (10.0, 20.0, 5.0), (1, 2, 1))
        assert u == pytest.approx((0.75, 0.75, 0.375))

    def test_balanced_gear_never_looks_imbalanced(self) -> None:
        assert derived_stage_utilization(0.95, (7.0, 7.0, 7.0, 7.0)) == pytest.approx((0.95,) * 4)

    def test_one_stage_needs_no_times(self) -> None:
        assert derived_stage_utilization(0.4, (None,)) == (0.4,)

    @pytest.mark.parametrize("times", [(10.0, None), (10.0, 0.0), (math.nan, 5.0), (math.inf, 5.0)])
    def test_unknown_times_give_none(self, times: tuple) -> None:
        assert derived_stage_utilization(0.5, times) is None

    def test_bad_inputs(self) -> None:
        with pytest.raises(ValueError, match="busy"):
            derived_stage_utilization(1.5, (1.0, 2.0))
        with pytest.raises(ValueError, match="busy"):
            derived_stage_utilization(math.nan, (1.0, 2.0))
        with pytest.raises(ValueError, match="at least one stage"):
            derived_stage_utilization(0.5, ())
        with pytest.raises(ValueError, match="replicas"):
            derived_stage_utilization(0.5, (1.0, 2.0), (1,))

    def test_missing_stage_times(self) -> None:
        assert missing_stage_times(PipelineShape("g", (None, 3.0, 0.0))) == [0, 2]
        assert missing_stage_times(PipelineShape("g", (None,))) == []


def vllm_results(concurrency: str | None = "24", **quantiles: str) -> tuple:
    """Prometheus answers of every vLLM query: 2 waiting, 24 running, 5 req/s, the given quantiles (s)."""
    q = signal_queries(SEL, engine="vllm")
    results = {q.queue: vec("2"), q.running: vec("24"), q.qps: vec("5")}
    if concurrency is not None:
        results[q.concurrency] = vec(concurrency)
    for name, value in quantiles.items():
        results[q.quantiles[name]] = vec(value)
    return q, results


class TestVllmReading:
    def test_derived(self) -> None:
        q, results = vllm_results(ttft_p99_ms="0.25", itl_p99_ms="NaN")
        shape = PipelineShape("bal", (10.0, 20.0, 5.0), (1, 1, 1), max_num_seqs=32)
        r = reading_from_results(4.0, q, results, shape)
        assert r.source is UtilizationSource.DERIVED
        assert r.pipeline_utilization == 0.75  # 24 in execution / 32 seats
        assert r.sample.stage_utilization == pytest.approx((0.375, 0.75, 0.1875))
        assert (r.sample.queue, r.sample.running, r.sample.qps) == (2.0, 24.0, 5.0)
        assert r.sample.ttft_p99_ms == pytest.approx(250.0) and r.sample.itl_p99_ms is None
        assert r.note == ""

    def test_one_stage_gear_without_predictions_is_derived(self) -> None:
        q, results = vllm_results("8")
        r = reading_from_results(0.0, q, results, PipelineShape("lat", (None,), (1,), max_num_seqs=16))
        assert r.source is UtilizationSource.DERIVED and r.sample.stage_utilization == (0.5,)

    def test_explicit_gear_without_stage_times_is_still_a_sample(self) -> None:
        q, results = vllm_results(ttft_p99_ms="0.3")
        shape = PipelineShape("bal", (None, None), (1, 1), max_num_seqs=32)
        r = reading_from_results(0.0, q, results, shape)
        assert r.source is UtilizationSource.NONE and r.sample.stage_utilization == ()
        assert r.pipeline_utilization == 0.75 and r.sample.ttft_p99_ms == pytest.approx(300.0)
        assert "predictedTimeMs" in r.note and "stage(s) 0, 1" in r.note and "'bal'" in r.note

    @pytest.mark.parametrize("concurrency", [None, "NaN", "+Inf"])
    def test_no_concurrency_value_is_no_stage_data(self, concurrency: str | None) -> None:
        q, results = vllm_results(concurrency)
        r = reading_from_results(0.0, q, results, PipelineShape("bal", (1.0, 2.0)))
        assert r.source is UtilizationSource.NONE and r.sample.stage_utilization == ()
        assert r.pipeline_utilization is None and "no value" in r.note

    def test_unknown_gear(self) -> None:
        q, results = vllm_results()
        r = reading_from_results(0.0, q, results, None)
        assert r.source is UtilizationSource.NONE and "not in the GearSet" in r.note

    def test_queue_running_qps_stay_required(self) -> None:
        q, results = vllm_results()
        del results[q.queue]
        with pytest.raises(SignalsUnavailable, match="num_requests_waiting"):
            reading_from_results(0.0, q, results, PipelineShape("bal", (1.0,)))

    def test_sim_reading_is_the_engines(self) -> None:
        q = signal_queries(SEL)
        results = {
            q.stage_utilization: [
                {"metric": {"stage": "1"}, "value": [0, "0.2"]},
                {"metric": {"stage": "0"}, "value": [0, "0.9"]},
            ],
            q.queue: vec("0"),
            q.running: vec("1"),
            q.qps: vec("2"),
        }
        r = reading_from_results(0.0, q, results)
        assert r.source is UtilizationSource.ENGINE and r.sample.stage_utilization == (0.9, 0.2)
        assert r.pipeline_utilization is None


class TestNonFiniteIsNoData:
    @pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf"])
    def test_scalar(self, value: str) -> None:
        assert scalar(vec(value), "q", required=False) is None
        with pytest.raises(SignalsUnavailable, match="no data"):
            scalar(vec(value), "q", required=True)

    def test_stage_value(self) -> None:
        with pytest.raises(SignalsUnavailable, match="no data"):
            stage_values([{"metric": {"stage": "0"}, "value": [0, "NaN"]}], "q")

    def test_infinite_quantile_never_reaches_the_sample(self) -> None:
        q, results = vllm_results(ttft_p99_ms="+Inf", ttft_p50_ms="NaN", e2e_p99_ms="1.5")
        s = reading_from_results(0.0, q, results, PipelineShape("bal", (1.0,))).sample
        assert s.ttft_p99_ms is None and s.ttft_p50_ms is None and s.e2e_p99_ms == pytest.approx(1500.0)
