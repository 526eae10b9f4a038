"""The demo's pure helpers: trace windowing, series from measurements, gear tables, live line, report,
plots (written and readable as PNG), and the command's flags."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy
import pytest

from gearshift.cli import build_parser
from gearshift.dev.demo import gears, live, plots, report, series
from gearshift.dev.demo import trace as tw
from gearshift.dev.demo.kube import DemoError, http_get, is_loopback_url
from gearshift.dev.demo.service import load_example
from gearshift.dev.loadgen import TraceRequest

REPO = Path(__file__).resolve().parents[2]


def reqs(*offsets: float) -> list[TraceRequest]:
    return [TraceRequest(o, 100, 10) for o in offsets]


class TestWindow:
    def test_auto_scale_fits_the_whole_trace_and_never_slows_it_down(self) -> None:
        assert tw.auto_time_scale(reqs(0, 3600), 600) == 6.0
        assert tw.auto_time_scale(reqs(0, 3500), 600) == 5.9  # rounded up: the run stays within 600 s
        assert tw.auto_time_scale(reqs(0, 10), 600) == 1.0

    def test_window_keeps_requests_within_the_cap_and_rebases_offsets(self) -> None:
        w = tw.window(reqs(0, 5, 10, 25, 40), time_scale=2.0, duration_s=10.0, start_s=5.0)
        # trace seconds [5, 25): 5, 10 (25 is the exclusive end)
        assert [r.offset_s for r in w.requests] == [0.0, 5.0]
        assert w.span_s == 6.0  # the trace's requests end before the cap: last + 1 s
        assert w.due_s == [0.0, 2.5]
        assert w.run_s == 3.0

    def test_window_span_is_the_cap_when_the_trace_goes_on(self) -> None:
        w = tw.window(reqs(*range(100)), time_scale=5.0, duration_s=4.0)
        assert len(w.requests) == 20 and w.span_s == 20.0 and w.run_s == 4.0
        assert w.mean_rate() == pytest.approx(5.0)

    def test_empty_window_and_bad_bounds_are_refused(self) -> None:
        with pytest.raises(ValueError, match="no trace request"):
            tw.window(reqs(0, 1), 1.0, 10.0, start_s=50.0)
        with pytest.raises(ValueError):
            tw.window(reqs(0, 1), 0.0, 10.0)

    def test_issued_by_and_offered_rate(self) -> None:
        due = [0.0, 0.5, 1.0, 3.5]
        assert [tw.issued_by(due, t) for t in (0.0, 0.9, 1.0, 10.0)] == [1, 2, 3, 4]
        centres, rates = tw.offered_rate(due, 2.0, 4.0)
        assert centres == [1.0, 3.0] and rates == [1.5, 0.5]

    def test_the_real_trace_fits_the_default_duration(self) -> None:
        from gearshift.dev.demo import DEFAULT_DURATION_S, DEFAULT_TRACE
        from gearshift.dev.loadgen import load_trace

        if not DEFAULT_TRACE.exists():
            pytest.skip("the shared trace is not on this machine")
        trace = load_trace(DEFAULT_TRACE)
        w = tw.window(trace, tw.auto_time_scale(trace, DEFAULT_DURATION_S), DEFAULT_DURATION_S)
        assert len(w.requests) == len(trace)
        assert w.run_s <= 600  # the bound: the replay takes at most 10 minutes


class TestWireSeries:
    def test_bins_count_sends_and_finishes_and_take_p99_of_ok_requests(self) -> None:
        recs = [
            series.WireRecord(0.5, True, ttft_s=0.1, e2e_s=1.0, itls_s=(0.01, 0.02)),
            series.WireRecord(1.5, True, ttft_s=0.3, e2e_s=2.0, itls_s=(0.03,)),
            series.WireRecord(2.5, False),
        ]
        b = series.bin_wire(recs, 2.0, 4.0)
        assert b["sent_qps"].v == [1.0, 0.5]
        assert b["done_qps"].v == [0.5, 0.5]  # finished at 1.5 s and 3.5 s
        assert b["ttft_p99_ms"].v[0] == pytest.approx(p99([100.0, 300.0]))
        assert math.isnan(b["ttft_p99_ms"].v[1])  # no OK request sent in [2, 4): a gap, not a zero
        assert b["itl_p99_ms"].v[0] == pytest.approx(p99([10.0, 20.0, 30.0]))

    def test_wire_records_rebase_perf_counter_times(self) -> None:
        rec = SimpleNamespace(sent_at=105.0, ok=True, ttft_s=0.2, e2e_s=1.0, itls_s=[0.01])
        [w] = series.wire_records([rec], perf0=100.0)
        assert w.sent_s == 5.0 and w.itls_s == (0.01,)

    def test_recent_wire_uses_requests_finished_in_the_window(self) -> None:
        recs = [series.WireRecord(0.0, True, 0.1, 1.0), series.WireRecord(5.0, True, 0.2, 1.0)]
        r = series.recent_wire(recs, now_s=6.5, window_s=2.0)
        assert r["qps"] == 0.5 and r["ttft_p99_ms"] == pytest.approx(200.0)


def p99(values: list[float]) -> float:
    """The expected value, computed independently of the code under test's helper."""
    return float(numpy.percentile(values, 99))


ROUTER_TEXT = """
# TYPE gearshift_router_requests_total counter
gearshift_router_requests_total{policy="pd-score",prefill_pod="p",decode_pod="d",outcome="ok"} {ok}
gearshift_router_requests_total{policy="pd-score",prefill_pod="p",decode_pod="d",outcome="timeout"} 2.0
# TYPE gearshift_router_upstream_ttft_seconds histogram
gearshift_router_upstream_ttft_seconds_bucket{policy="pd-score",le="0.1"} {b1}
gearshift_router_upstream_ttft_seconds_bucket{policy="pd-score",le="0.2"} {b2}
gearshift_router_upstream_ttft_seconds_bucket{policy="pd-score",le="+Inf"} {b2}
gearshift_router_upstream_ttft_seconds_count{policy="pd-score"} {b2}
gearshift_router_upstream_ttft_seconds_sum{policy="pd-score"} 1.0
"""


def scrape(t: float, ok: float, b1: float, b2: float) -> series.RouterScrape:
    text = ROUTER_TEXT.replace("{ok}", str(ok)).replace("{b1}", str(b1)).replace("{b2}", str(b2))
    return series.parse_router_metrics(text, t)


class TestRouterSeries:
    def test_parse_sums_outcomes_and_buckets(self) -> None:
        s = scrape(0.0, 10, 4, 10)
        assert (s.ok, s.total) == (10.0, 12.0)
        assert s.ttft[0] == (0.1, 4.0) and math.isinf(s.ttft[-1][0]) and s.itl == ()

    @pytest.mark.parametrize(
        ("q", "buckets", "want"),
        [
            (0.5, [(0.1, 5.0), (0.2, 10.0), (math.inf, 10.0)], 0.1),
            (0.75, [(0.1, 5.0), (0.2, 10.0), (math.inf, 10.0)], 0.15),
            (0.99, [(0.1, 0.0), (0.2, 0.0), (math.inf, 4.0)], 0.2),  # in +Inf: the highest finite bound
            (0.5, [(0.1, 4.0), (math.inf, 4.0)], 0.05),  # the first bucket starts at 0
        ],
    )
    def test_histogram_quantile_matches_prometheus(self, q: float, buckets: list, want: float) -> None:
        assert series.histogram_quantile(q, buckets) == pytest.approx(want)

    def test_empty_histogram_is_nan(self) -> None:
        assert math.isnan(series.histogram_quantile(0.99, [(0.1, 0.0), (math.inf, 0.0)]))
        assert math.isnan(series.histogram_quantile(0.99, []))

    def test_window_rates_and_quantile_of_the_delta(self) -> None:
        a, b = scrape(0.0, 10, 4, 10), scrape(2.0, 20, 4, 20)
        w = series.router_window(a, b)
        assert w["qps"] == 5.0 and w["rps"] == 5.0
        # 10 new observations, all in (0.1, 0.2]: P99 interpolates to 0.199 s
        assert w["ttft_p99_ms"] == pytest.approx(199.0)
        assert math.isnan(w["itl_p99_ms"])

    def test_counter_reset_counts_from_zero(self) -> None:
        w = series.router_window(scrape(0.0, 50, 10, 50), scrape(1.0, 3, 0, 3))
        assert w["qps"] == 3.0

    def test_router_series_slides_a_window(self) -> None:
        ss = [scrape(float(t), 10 * t, 0, 10 * t) for t in range(6)]
        out = series.router_series(ss, window_s=2.0)
        assert out["qps"].t == [1.0, 2.0, 3.0, 4.0, 5.0]
        assert out["qps"].v == [10.0] * 5


class TestPrometheusAndShifts:
    def test_matrix_series_names_and_rebases(self) -> None:
        res = [
            {"metric": {"gearshift_io_gear": "b", "stage": "1"}, "values": [[110, "0.5"], [112, "NaN"]]},
            {"metric": {"gearshift_io_gear": "a", "stage": "0"}, "values": [[110, "1"]]},
        ]
        out = series.matrix_series(res, 100.0, ["gearshift_io_gear", "stage"])
        assert [s.name for s in out] == ["a/0", "b/1"]
        assert out[1].t == [10.0, 12.0] and out[1].v[0] == 0.5 and math.isnan(out[1].v[1])

    HISTORY: ClassVar[list[dict[str, Any]]] = [
        {"from": None, "to": "latency", "trigger": "initial", "startedAt": "2026-01-01T00:00:00Z"},
        {
            "from": "latency",
            "to": "balanced",
            "trigger": "p99-low",
            "startedAt": "2026-01-01T00:01:40Z",
            "finishedAt": "2026-01-01T00:02:00Z",
            "outcome": "Succeeded",
        },
        {
            "from": "balanced",
            "to": "throughput",
            "trigger": "imbalance",
            "startedAt": "2026-01-01T00:03:00Z",
            "finishedAt": "2026-01-01T00:03:30Z",
            "outcome": "RolledBack",
        },
    ]

    def test_shift_marks_skip_shifts_before_the_run(self) -> None:
        t0 = 1767225630.0  # 2026-01-01T00:00:30Z
        marks = series.shift_marks("decode", self.HISTORY, t0)
        assert [(m.to_gear, m.started_s, m.finished_s, m.outcome) for m in marks] == [
            ("balanced", 70.0, 90.0, "Succeeded"),
            ("throughput", 150.0, 180.0, "RolledBack"),
        ]

    def test_shift_marks_keep_a_shift_that_finished_during_the_run(self) -> None:
        t0 = 1767225710.0  # 2026-01-01T00:01:50Z: the p99-low shift began 10 s before the replay
        marks = series.shift_marks("decode", self.HISTORY, t0)
        assert [(m.to_gear, m.started_s, m.finished_s) for m in marks] == [
            ("balanced", -10.0, 10.0),
            ("throughput", 70.0, 100.0),
        ]

    def test_gear_spans_follow_succeeded_shifts_only(self) -> None:
        marks = series.shift_marks("decode", self.HISTORY, 1767225630.0)
        spans = series.gear_spans("decode", "latency", marks, 300.0)
        assert [(s.gear, s.start_s, s.end_s) for s in spans] == [
            ("latency", 0.0, 90.0),
            ("balanced", 90.0, 300.0),
        ]

    def test_no_shift_is_one_span(self) -> None:
        assert [(s.gear, s.end_s) for s in series.gear_spans("prefill", "latency", [], 60.0)] == [
            ("latency", 60.0)
        ]


GEARSET = {
    "metadata": {"name": "svc-decode"},
    "spec": {"mode": "auto", "role": "decode"},
    "status": {
        "activeGear": "balanced",
        "plannedGears": [
            {
                "name": "latency",
                "intent": "latency",
                "microBatch": 1,
                "maxBatch": 1,
                "qpsRange": [0, 5],
                "predicted": {"bottleneckMs": 15.0, "throughputQps": 66.7, "p99Ms": 40.0},
                "stages": [
                    {
                        "layers": [0, 32],
                        "nodes": ["gpu-h100-1"],
                        "gpuModel": "H100-80GB",
                        "predictedTimeMs": 15.0,
                    }
                ],
            },
            {
                "name": "balanced",
                "intent": "balanced",
                "microBatch": 4,
                "maxBatch": 8,
                "stages": [
                    {"layers": [0, 22], "nodes": ["gpu-h100-1"], "predictedTimeMs": 30.0, "replicas": 2},
                    {"layers": [22, 32], "nodes": ["gpu-a10-2"], "predictedTimeMs": 15.0},
                ],
            },
        ],
    },
}


class TestGearTables:
    def test_table_marks_the_active_gear_and_scales_bars_to_the_slowest_stage(self) -> None:
        text = gears.gearset_table("decode", GEARSET)
        lines = text.splitlines()
        assert lines[0] == "decode (auto, GearSet svc-decode):"
        assert any("gear balanced (balanced)" in ln and "← active" in ln for ln in lines)
        assert not any("gear latency" in ln and "active" in ln for ln in lines)
        s0 = next(ln for ln in lines if ln.strip().startswith("s0") and "layers   0–22" in ln)
        s1 = next(ln for ln in lines if ln.strip().startswith("s1"))
        assert s0.count("█") == gears.BAR_WIDTH and s1.count("█") == gears.BAR_WIDTH // 2
        assert "×2" in s0
        assert "suits 0.0–5.0 req/s" in text

    def test_a_stage_over_different_cards_shows_its_card_mix_and_nodes(self) -> None:
        gs = {
            "metadata": {"name": "p"},
            "spec": {"mode": "auto"},
            "status": {
                "activeGear": "balanced",
                "plannedGears": [
                    {
                        "name": "balanced",
                        "intent": "balanced",
                        "microBatch": 8,
                        "maxBatch": 64,
                        "predicted": {"bottleneckMs": 927.12, "throughputQps": 107.1, "p99Ms": 42.7},
                        "stages": [
                            {
                                "layers": [0, 32],
                                "nodes": ["a10-0", "a10-1", "h100-0", "a100-0"],
                                "gpuModel": "A10-24GB",  # the status holds one model per stage
                                "replicas": 4,
                                "predictedTimeMs": 927.12,
                            }
                        ],
                    }
                ],
            },
        }
        models = {"a10-0": "A10-24GB", "a10-1": "A10-24GB", "h100-0": "H100-80GB", "a100-0": "A100-40GB"}
        lines = gears.gearset_table("prefill", gs, models).splitlines()
        s0 = next(ln for ln in lines if ln.strip().startswith("s0"))
        assert s0.endswith("927.12 ms      ? GiB  ×4 A10-24GB×2, H100-80GB, A100-40GB")
        assert lines[lines.index(s0) + 1].strip() == "on a10-0, a10-1, h100-0, a100-0"
        summary = next(ln for ln in lines if "P99" in ln)
        assert "simulated request P99 42.7 ms with the replicas in parallel" in summary
        assert "slowest stage replica 927.12 ms/micro-batch" in summary
        # Without the node → card mapping the stage's one gpuModel stands in for every node.
        plain = gears.gearset_table("prefill", gs)
        assert "×4 A10-24GB×4" in plain

    def test_stage_nodes_lists_every_node_of_every_stage(self) -> None:
        assert gears.stage_nodes(GEARSET) == [
            ("latency", 0, (0, 32), "gpu-h100-1"),
            ("balanced", 0, (0, 22), "gpu-h100-1"),
            ("balanced", 1, (22, 32), "gpu-a10-2"),
        ]

    def test_explicit_gearsets_use_spec_gears(self) -> None:
        gs = {"metadata": {"name": "x"}, "spec": {"mode": "explicit", "gears": [{"name": "g", "stages": []}]}}
        assert "gear g" in gears.gearset_table("prefill", gs)

    def test_no_gears_yet(self) -> None:
        assert "(no gears yet)" in gears.gearset_table("prefill", {"spec": {"mode": "auto"}, "status": {}})


class TestLiveLine:
    def test_bar_clamps(self) -> None:
        assert (
            live.bar(0.5, 4) == "[##..]" and live.bar(2.0, 4) == "[####]" and live.bar(math.nan, 2) == "[..]"
        )

    def test_gear_state_text(self) -> None:
        assert live.GearState("latency", "Stable").text() == "latency"
        assert live.GearState("latency", "Warming", "balanced").text() == "latency→balanced (Warming)"
        assert live.GearState("latency", "Degraded").text() == "latency (Degraded)"

    def test_status_line_shows_progress_gears_and_measurements(self) -> None:
        line = live.status_line(
            30, 60, 100, 200, {"prefill": live.GearState("latency"), "decode": live.GearState("balanced")},
            12.34, 180.0, math.nan,
        )  # fmt: skip
        assert line.startswith("[" + "#" * 12 + "." * 12 + "]")
        assert "100/200 req" in line and "prefill latency  decode balanced" in line
        assert "router: QPS  12.3  P99 TTFT    180 ms  ITL    -   ms" in line  # the router's figures


def report_data(**over: object) -> report.ReportData:
    base = dict(
        title="gearshift demo report",
        started="2026-01-01T00:00:00+00:00",
        command="gearshift demo",
        cluster="sandbox gs-x",
        namespace="ns",
        service="svc",
        model="m",
        trace="t.csv",
        window_start_s=0.0,
        window_span_s=3600.0,
        time_scale=6.0,
        requests=100,
        run_s=600.0,
        fleet_table="NAME GPU\ngpu-h100-0 H100\n",
        gear_tables={"decode": "decode (auto):\ngear latency"},
        load={
            "issued": 100,
            "completed": 98,
            "failed": 2,
            "incomplete": 0,
            "request_rate": 0.17,
            "throughput_rps": 0.16,
            "output_tokens_per_s": 20.0,
            "ttft_ms": {"mean": 1.0, "p50": 1.0, "p90": 2.0, "p99": 3.0},
            "itl_ms": None,
            "slo_ttft_ms": 200.0,
            "slo_itl_ms": 50.0,
            "slo_met": 90,
            "goodput_rps": 0.15,
            "errors": {"HTTP 503": 2},
        },
        router_totals={"requests": 100, "ok": 98, "ttft_p99_ms": 150.0, "itl_p99_ms": math.nan},
        marks=[series.ShiftMark("decode", "latency", "balanced", "p99-low", "Succeeded", 70.0, 90.0)],
        spans=[series.GearSpan("decode", "latency", 0, 90), series.GearSpan("decode", "balanced", 90, 600)],
        utilization={"decode": {"latency/0": 0.5}},
        engine={"decode_itl_p99_ms": 21.5},
        plots={"Traffic": "traffic.png"},
        explore=["kubectl get gearshift -A"],
        notes=["a note"],
    )
    base.update(over)
    return report.ReportData(**base)  # type: ignore[arg-type]


class TestReport:
    def test_sections_and_sources_are_named(self) -> None:
        md = report.render(report_data())
        for heading in ("## Results", "## Gear shifts", "## Plots", "## The fleet", "## Explore", "## Notes"):
            assert heading in md
        assert "From the load generator" in md and "router's own `/metrics`" in md and "Prometheus" in md
        assert "| decode | latency | balanced | p99-low | 70 | 90 | Succeeded |" in md
        assert (
            "From the GearSets' `status.history`" in md
            and "predictions (GearSet `status.plannedGears`)" in md
        )
        assert "90/98 requests met it; goodput 0.15 req/s" in md
        assert "| TTFT | 1.0 | 1.0 | 2.0 | 3.0 |" in md and "| ITL | – | – | – | – |" in md
        assert "P99 upstream ITL – ms" in md  # NaN prints as a dash, not "nan"
        assert "![Traffic](traffic.png)" in md
        assert "decode: latency/0 50%" in md

    def test_a_rollback_says_why(self) -> None:
        back = series.ShiftMark(
            "prefill", "latency", "throughput", "saturation", "RolledBack", 10.0, 70.0, "P99 991 ms > 899 ms"
        )
        ok = series.ShiftMark(
            "prefill", "latency", "throughput", "load-high", "Succeeded", 80.0, 99.0, "in 19 s"
        )
        md = report.render(report_data(marks=[back, ok]))
        assert "| 10 | 70 | RolledBack: P99 991 ms > 899 ms |" in md and "| 80 | 99 | Succeeded |" in md

    def test_no_shift_says_so(self) -> None:
        assert "No gear shift happened" in report.render(report_data(marks=[]))


class TestPlots:
    def test_three_pngs_from_plain_data(self, tmp_path: Path) -> None:
        t = [float(x) for x in range(0, 100, 10)]
        wire = {
            "sent_qps": series.Series("s", t, [5.0] * 10),
            "done_qps": series.Series("d", t, [4.0] * 10),
            "ttft_p99_ms": series.Series("t", t, [100.0] * 9 + [math.nan]),
            "itl_p99_ms": series.Series("i", t, [20.0] * 10),
        }
        router = {"qps": series.Series("q", t, [4.0] * 10)}
        marks = [series.ShiftMark("decode", "latency", "balanced", "p99-low", "Succeeded", 40.0, 50.0)]
        spans = series.gear_spans("decode", "latency", marks, 100.0)
        files = [
            plots.plot_traffic(
                plots.TrafficData(100.0, wire["sent_qps"], wire, router, spans, marks, 200.0, 50.0),
                tmp_path / "traffic.png",
            ),
            plots.plot_utilization(
                {"decode": [series.Series("latency/0", t, [0.5] * 10)], "prefill": []},
                marks,
                100.0,
                tmp_path / "util.png",
            ),
            plots.plot_placement(
                [
                    plots.NodeRow("gpu-h100-0", "H100-80GB", 1, 80, 1.0),
                    plots.NodeRow("gpu-t4-0", "T4-16GB", 1, 16, None),
                ],
                [
                    plots.StageCell("decode", "latency", 0, (0, 32), "gpu-h100-0", True),
                    plots.StageCell("decode", "balanced", 0, (0, 1), "gpu-t4-0", False),
                    plots.StageCell("decode", "balanced", 1, (1, 32), "gpu-h100-0", False),
                ],
                tmp_path / "placement.png",
            ),
        ]
        for f in files:
            assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f.stat().st_size > 10_000

    def test_shift_spans_run_from_start_to_finish_or_to_the_run_end(self) -> None:
        done = series.ShiftMark("prefill", "a", "b", "t", "Succeeded", 40.0, 90.0)
        running = series.ShiftMark("decode", "a", "b", "t", "InProgress", 80.0, None)
        assert plots.shift_interval(done, 100.0) == (40.0, 90.0)
        assert plots.shift_interval(running, 100.0) == (80.0, 100.0)
        assert plots.shift_label(running) == "decode: a→b (in progress)"
        assert plots.shift_label(done) == "prefill: a→b"
        fig, ax = plots.plt.subplots()
        plots._shade_shifts(ax, [done, running], 100.0)
        spans = [(r.get_x(), r.get_x() + r.get_width()) for r in ax.patches]
        lines = [ln.get_xdata()[0] for ln in ax.get_lines()]
        plots.plt.close(fig)
        assert spans == [(40.0, 90.0), (80.0, 100.0)]
        assert lines == [40.0, 80.0]  # the line marks the start, finished or not

    def test_near_labels_are_staggered_far_ones_share_a_level(self) -> None:
        # (left, right) in s: 0–50 and 30–80 overlap; 60–110 clears the first; 120–150 clears all
        assert plots.stagger_levels([(0, 50), (30, 80), (60, 110), (120, 150)]) == [0, 1, 0, 0]
        assert plots.stagger_levels([(10, 20), (10, 20), (10, 20)]) == [0, 1, 2]
        assert plots.stagger_levels([]) == []

    def test_label_width_and_extent(self) -> None:
        # 10 characters + 2 of padding at 0.62 em of 7 pt: 12 * 0.62 * 7 / 72 in ≈ 0.7233 in; on axes
        # 10 in wide spanning 500 s that is 36.17 s.
        assert plots.label_width_s("x" * 10, 500.0, 10.0) == pytest.approx(12 * 0.62 * 7 / 72 * 50)
        m = series.ShiftMark("prefill", "throughput", "latency", "t", "Succeeded", 480.0, None)
        w = plots.label_width_s(plots.shift_label(m), 500.0, 10.0)
        assert plots.label_extent(m, 500.0, 10.0) == pytest.approx((480.0 - w, 480.0, True))
        early = series.ShiftMark("prefill", "a", "b", "t", "Succeeded", 10.0, 60.0)
        assert plots.label_extent(early, 500.0, 10.0)[2] is False

    def test_gear_colours_are_stable(self) -> None:
        assert plots.gear_colour("latency") == plots.GEAR_COLOURS["latency"]
        assert plots.gear_colour("custom") == plots.gear_colour("custom")


class TestCommandAndExample:
    def test_flags(self) -> None:
        args = build_parser().parse_args(
            [
                "demo",
                "--duration",
                "60",
                "--time-scale",
                "4",
                "--namespace",
                "x",
                "--down",
                "--install",
                "local",
            ]
        )
        assert (args.duration, args.time_scale, args.namespace, args.down, args.install) == (
            60.0,
            4.0,
            "x",
            True,
            "local",
        )
        assert build_parser().parse_args(["demo"]).down is False

    def test_example_serves_a_real_model_with_auto_gearsets_on_the_sim_engine(self) -> None:
        from gearshift.api.gearset import GearSet
        from gearshift.api.pdservice import PDService

        docs = load_example(REPO / "examples" / "demo" / "pdservice-demo.yaml", None)
        pds = PDService.model_validate(next(d for d in docs if d["kind"] == "PDService"))
        sets = [GearSet.model_validate(d) for d in docs if d["kind"] == "GearSet"]
        assert (
            pds.spec.engine == "sim" and pds.spec.model.num_layers == 32 and pds.spec.model.num_kv_heads == 8
        )
        assert {g.spec.role for g in sets} == {"prefill", "decode"}
        assert all(g.spec.mode == "auto" and g.spec.service_name == pds.metadata["name"] for g in sets)

    def test_model_flag_swaps_in_an_hf_config(self) -> None:
        docs = load_example(
            REPO / "examples" / "demo" / "pdservice-demo.yaml",
            REPO / "examples" / "models" / "qwen2.5-7b.json",
        )
        model = next(d for d in docs if d["kind"] == "PDService")["spec"]["model"]
        assert "qwen" in str(model).lower()


class TestBadInputTouchesNothing:
    """A bad flag is refused before the demo touches the cluster (it used to delete the previous run's
    service first), and a second demo on the same sandbox is refused while one runs."""

    @pytest.mark.parametrize(
        ("argv", "match"),
        [
            (["--time-scale", "-1"], r"argument --time-scale: '-1': give a finite number 0 or more"),
            (["--duration", "0"], r"argument --duration: '0': give a finite number above 0"),
            (["--start", "nan"], r"argument --start: 'nan': give a finite number"),
        ],
    )
    def test_flags_out_of_range_are_argparse_errors(
        self, argv: list[str], match: str, capsys: pytest.CaptureFixture[str]
    ) -> None:
        with pytest.raises(SystemExit):
            build_parser().parse_args(["demo", *argv])
        assert re.search(match, capsys.readouterr().err)

    def test_preflight_names_the_flag(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        from gearshift.dev.demo.run import _preflight
        from gearshift.dev.tracefile import TraceError

        def args(*argv: str) -> Any:
            return build_parser().parse_args(["demo", *argv])

        _preflight(args())  # the defaults are good
        with pytest.raises(DemoError, match=r"--time-scale/--keep-every: no trace request"):
            _preflight(args("--start", "999999"))
        bad = tmp_path / "cfg.json"
        bad.write_text("not json")
        with pytest.raises(DemoError, match=r"--model .*cfg.json: not a readable HF config.json"):
            _preflight(args("--model", str(bad)))
        trace = tmp_path / "t.csv"
        trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n1,10,0\n")
        with pytest.raises(TraceError, match=r"line 2: GeneratedTokens is 0"):
            _preflight(args("--trace", str(trace)))
        with pytest.raises(DemoError, match=r"--example .*: no PDService"):
            (tmp_path / "e.yaml").write_text("kind: GearSet\n")
            _preflight(args("--example", str(tmp_path / "e.yaml")))

    def test_one_demo_at_a_time(self, tmp_path: Path) -> None:
        from gearshift.dev.demo.run import _one_demo_at_a_time

        busy = r"another gearshift demo is running on this sandbox \(pid \d+\)"
        with (
            _one_demo_at_a_time(tmp_path),
            pytest.raises(DemoError, match=busy),
            _one_demo_at_a_time(tmp_path),
        ):
            pass
        with _one_demo_at_a_time(tmp_path):  # released when the first run ended
            pass


class TestLocalOperatorMetrics:
    """The local operator's ``/metrics`` reach the sandbox Prometheus through a target file of its own."""

    def test_target_file_written_then_removed_when_the_operator_stops(self, tmp_path, monkeypatch) -> None:
        from gearshift.dev.demo import install
        from gearshift.dev.demo.context import Ctx
        from gearshift.dev.sandbox.cluster import local_targets_dir
        from gearshift.dev.sandbox.layout import Layout

        monkeypatch.setenv("GEARSHIFT_SANDBOX_DIR", str(tmp_path / "sb"))
        layout = Layout.from_env()
        ctx = Ctx(
            SimpleNamespace(namespace="team-a"),
            lambda _m: None,
            layout,
            None,
            None,
            {},  # type: ignore[arg-type]
        )
        path = install._announce_local_operator(ctx, 41234)
        assert path.parent == local_targets_dir(layout) and path.name == "operator-team-a.json"
        (group,) = json.loads(path.read_text())
        assert group["targets"] == ["127.0.0.1:41234"]
        # labelled as the chart's pod would be after the pod job's relabelling
        assert group["labels"]["namespace"] == install.SYSTEM_NAMESPACE
        assert group["labels"]["app_kubernetes_io_component"] == "operator"
        ctx.metrics_target = path
        install.stop_operator(ctx)  # no process to stop: the file goes all the same
        assert not path.exists() and ctx.metrics_target is None


class TestLoopbackOnly:
    @pytest.mark.parametrize(
        ("url", "ok"),
        [
            ("http://127.12.11.1:8000", True),
            ("http://localhost:9090", True),
            ("http://[::1]:9090", True),
            ("http://10.0.0.41:8000", False),
            ("http://192.168.1.2", False),
            ("http://example.com", False),
        ],
    )
    def test_is_loopback_url(self, url: str, ok: bool) -> None:
        assert is_loopback_url(url) is ok

    def test_http_get_refuses_other_hosts(self) -> None:
        with pytest.raises(DemoError, match="loopback"):
            http_get("http://10.0.0.41:8000/metrics")


class TestSummary:
    """summary.json / bench/results/demo.json: the demo's own measurements, rearranged, never recomputed."""

    def test_pd_demo_time_scale_leaves_headroom_and_still_bursts(self) -> None:
        from gearshift.dev.demo import DEFAULT_DURATION_S, DEFAULT_TRACE
        from gearshift.dev.loadgen import load_trace

        if not DEFAULT_TRACE.exists():
            pytest.skip("the shared trace is not on this machine")
        # The 8B PD demo's flags (PD_DEMO_ARGS): every request at 3x.
        w = tw.window(load_trace(DEFAULT_TRACE), 3.0, DEFAULT_DURATION_S)
        _, rates = tw.offered_rate(w.due_s, 20.0, w.run_s)
        # The sandbox fleet serves about 24 req/s of this trace: two thirds on average, bursts above 80%.
        assert w.mean_rate() < 0.7 * 24 and max(rates) > 0.8 * 24
        assert w.run_s <= DEFAULT_DURATION_S

    def test_build_copies_the_measurements_and_counts_outcomes(self) -> None:
        from gearshift.dev.demo import summary

        hist = {
            "prefill": [
                {"from": "latency", "to": "balanced", "trigger": "p99-low", "outcome": "Succeeded",
                 "startedAt": "2026-01-01T00:01:40Z", "finishedAt": "2026-01-01T00:02:50Z", "message": "ok"},
                {"from": "x", "to": "y", "outcome": "Succeeded", "startedAt": "2025-12-31T23:00:00Z"},
            ],
            "decode": [
                {"from": "latency", "to": "balanced", "trigger": "p99-low", "outcome": "RolledBack",
                 "startedAt": "2026-01-01T00:00:30Z", "finishedAt": "2026-01-01T00:01:00Z", "message": "no"},
            ],
        }  # fmt: skip
        t0 = 1767225600.0  # 2026-01-01T00:00:00Z
        shifts = summary.shifts(hist, t0)
        assert [(s["role"], s["outcome"], s["started_s"]) for s in shifts] == [
            ("decode", "RolledBack", 30.0),
            ("prefill", "Succeeded", 100.0),
        ]
        load = {"issued": 10, "completed": 9, "failed": 1, "incomplete": 0, "errors": {"HTTP 503": 1},
                "ttft_ms": {"p50": 50.0, "p99": 300.0}, "itl_ms": {"p50": 10.0, "p99": 40.0},
                "goodput_rps": 0.5, "duration_s": 20.0, "request_rate": 0.5}  # fmt: skip
        doc = summary.build(
            command="gearshift demo",
            started="2026-01-01T00:00:00+00:00",
            wall_s=99.94,
            time_scale=3.0,
            window_start_s=0.0,
            window_span_s=60.0,
            load=load,
            router_totals={"requests": 10.0},
            engine={},
            shift_list=shifts,
            policies={"prefill": {"dwellS": 60, "sampleIntervalS": 2}},
            first_gears={"prefill": "latency"},
            final_gears={"prefill": "balanced"},
        )
        assert doc["requests"]["failed"] == 1 and doc["goodput_rps"] == 0.5 and doc["wall_s"] == 99.9
        assert doc["ttft_ms"] == {"p50": 50.0, "p99": 300.0}
        assert doc["shift_outcomes"] == {"RolledBack": 1, "Succeeded": 1}
        assert doc["policy_times"]["prefill"]["dwellS"] == {"run_s": 60.0, "trace_s": 180.0}
        json.dumps(doc)
