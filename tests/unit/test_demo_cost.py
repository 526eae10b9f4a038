"""The demo's cost figures (gearshift.dev.demo.cost, the report's Cost section, summary.json's cost) and the
twin's arrivals from a replay's requests. Expected values are worked out by hand in each test."""

from __future__ import annotations

from typing import Any

import pytest

from gearshift.dev import twin
from gearshift.dev.demo import cost, report, summary
from gearshift.dev.loadgen import TraceRequest
from gearshift.facts.model import load_hf_config
from gearshift.k8s.placement import pod_gpus


def _node(name: str, slices: int, replicas: int | None) -> dict[str, Any]:
    labels = {} if replicas is None else {"nvidia.com/gpu.replicas": str(replicas)}
    return {
        "metadata": {"name": name, "labels": labels},
        "status": {"capacity": {"nvidia.com/gpu": str(slices)}},
    }


def _pod(node: str | None, *gpus: int, phase: str = "Running", init: int = 0) -> dict[str, Any]:
    containers = [
        {"name": f"c{i}", "resources": {"limits": {"nvidia.com/gpu": str(g)}}} for i, g in enumerate(gpus)
    ]
    spec: dict[str, Any] = {"containers": containers}
    if node:
        spec["nodeName"] = node
    if init:
        spec["initContainers"] = [{"name": "i", "resources": {"requests": {"nvidia.com/gpu": str(init)}}}]
    return {"spec": spec, "status": {"phase": phase}}


class TestCardsHeld:
    def test_node_cards_divides_time_sliced_capacity(self) -> None:
        nodes = cost.node_cards([_node("h100", 2, 2), _node("a10", 1, None), _node("cpu", 0, None)])
        assert nodes == {"h100": cost.NodeCards(1, 2), "a10": cost.NodeCards(1, 1)}

    def test_pod_slices_sum_containers_and_take_the_larger_init(self) -> None:
        assert pod_gpus(_pod("n", 1, 2)) == 3
        assert pod_gpus(_pod("n", 1, init=4)) == 4
        assert pod_gpus({"spec": {"containers": [{"name": "router"}]}}) == 0

    def test_two_slices_of_one_card_are_one_card(self) -> None:
        nodes = {"h100": cost.NodeCards(1, 2), "a100": cost.NodeCards(2, 2)}
        pods = [
            _pod("h100", 1),  # the active pod
            _pod("h100", 1),  # a shadow on the same card
            _pod("a100", 1),
            _pod("a100", 1),
            _pod("a100", 1),  # three slices of a two-card node: two cards
            _pod(None, 1),  # not bound yet: holds nothing
            _pod("a100", 1, phase="Succeeded"),  # ended: released
            _pod("unknown", 2),  # a node not listed: one card per slice
        ]
        assert cost.cards_held(pods, nodes) == {"h100": 1, "a100": 2, "unknown": 2}

    def test_a_node_never_holds_more_cards_than_it_has(self) -> None:
        assert cost.cards_held([_pod("n", 1)] * 5, {"n": cost.NodeCards(1, 2)}) == {"n": 1}


class TestGpuSeconds:
    def test_step_integral_from_zero_to_the_end(self) -> None:
        s = [
            cost.CardSample(4.0, {"a": 2}),
            cost.CardSample(10.0, {"a": 2, "b": 1}),
            cost.CardSample(30.0, {"a": 2}),
        ]
        # 2 cards over [0, 10) (the first sample counts from 0), 3 over [10, 30), 2 over [30, 40].
        assert cost.gpu_seconds(s, 40.0) == pytest.approx(2 * 10 + 3 * 20 + 2 * 10)

    def test_samples_past_the_end_count_nothing(self) -> None:
        s = [cost.CardSample(0.0, {"a": 1}), cost.CardSample(50.0, {"a": 9})]
        assert cost.gpu_seconds(s, 40.0) == pytest.approx(40.0)

    def test_no_sample_is_an_error(self) -> None:
        with pytest.raises(ValueError, match="at least one sample"):
            cost.gpu_seconds([], 10.0)

    def test_run_cost(self) -> None:
        s = [cost.CardSample(0.0, {"a": 1}), cost.CardSample(50.0, {"a": 1, "b": 2})]
        got = cost.run_cost(s, 100.0, slo_met=600)
        gs = 1 * 50 + 3 * 50
        assert got["gpu_hours"] == pytest.approx(gs / 3600, abs=1e-4)
        assert got["mean_gpus"] == pytest.approx(2.0)
        assert got["peak_gpus"] == 3
        assert got["slo_met_per_gpu_hour"] == pytest.approx(600 / (gs / 3600), rel=1e-3)
        assert cost.run_cost(s, 100.0, slo_met=None)["slo_met_per_gpu_hour"] is None


class TestTraceFromRequests:
    def test_scaled_sorted_and_at_least_one_token(self) -> None:
        reqs = [TraceRequest(6.0, 100, 0), TraceRequest(0.0, 0, 5), TraceRequest(3.0, 7, 8)]
        tr = twin.trace_from_requests(reqs, time_scale=3.0)
        assert tr.t.tolist() == [0.0, 1.0, 2.0]
        assert tr.prompt.tolist() == [1, 7, 100]
        assert tr.output.tolist() == [5, 8, 1]
        assert tr.speed == 3.0 and tr.trace_hours == pytest.approx(2.0 * 3.0 / 3600)

    def test_empty_or_bad_scale(self) -> None:
        with pytest.raises(ValueError):
            twin.trace_from_requests([], 1.0)
        with pytest.raises(ValueError):
            twin.trace_from_requests([TraceRequest(0.0, 1, 1)], 0.0)


class TestTwinCompare:
    def test_every_static_gear_and_peer_holds_its_cards_for_the_whole_span(self) -> None:
        # 40 short requests over 39 s at 2x: light enough for every gear; the planner's gears of the mixed
        # fleet and the peers' uniform layouts, each replayed alone, and the shifting loop.
        reqs = [TraceRequest(2.0 * i, 64, 8) for i in range(40)]
        out = cost.twin_compare(
            reqs, 2.0, arch=load_hf_config(twin.MODEL), fleet=twin.FLEET, slo_ttft_ms=200, slo_itl_ms=50
        )
        assert out["requests"] == 40 and out["span_s"] == pytest.approx(39.0)
        assert out["workload"] == [64, 8]
        kinds = [r["kind"] for r in out["rows"]]
        assert kinds[0] == "dynamic" and "static" in kinds and "peer" in kinds and kinds[-1] == "oracle"
        assert kinds == sorted(kinds, key=["dynamic", "static", "peer", "oracle"].index)
        names = [r["variant"] for r in out["rows"]]
        assert len(names) == len(set(names))
        held = [r for r in out["rows"] if r["kind"] in ("static", "peer")]
        for r in held:
            # A static gear holds its cards from 0 to the last arrival and nothing else.
            assert r["gpu_hours"] == pytest.approx(r["gpus"] * 39.0 / 3600, abs=1e-4)
            assert r["failed"] == 0 and 0 <= r["slo_met"] <= 40
            if r["slo_met"]:
                assert r["slo_met_per_gpu_hour"] == pytest.approx(
                    r["slo_met"] / (r["gpus"] * 39.0 / 3600), rel=2e-3
                )
        assert out["initial_gear"] in out["gears"]
        # Every gear meets every request of so light a load: the oracle serves the whole span on the gear
        # with the fewest cards and never shifts.
        oracle = out["rows"][-1]
        fewest = min((r for r in held if r["kind"] == "static"), key=lambda r: r["gpus"])
        gear = fewest["variant"].removeprefix("static-")
        assert oracle["schedule"] == [{"serves_from_s": 0.0, "gear": gear}]
        assert (oracle["slo_met"], oracle["shifts"]) == (fewest["slo_met"], 0)
        assert oracle["gpu_hours"] == pytest.approx(fewest["gpu_hours"], abs=1e-4)

    def test_rows_longer_than_the_context_are_clipped_as_the_load_generator_clips_them(self) -> None:
        reqs = [TraceRequest(0.0, 20_000, 10), TraceRequest(1.0, 64, 8)]
        arch = load_hf_config(twin.MODEL)
        args = {"arch": arch, "fleet": twin.FLEET, "slo_ttft_ms": 200, "slo_itl_ms": 50}
        unclipped = cost.twin_compare(reqs, 1.0, **args)
        clipped = cost.twin_compare(reqs, 1.0, max_model_len=8192, **args)
        assert all(r["rejected_too_long"] == 1 for r in unclipped["rows"])
        assert all(r["rejected_too_long"] == 0 for r in clipped["rows"])

    def test_an_initial_gear_that_is_not_planned_is_refused(self) -> None:
        with pytest.raises(ValueError, match=r"initialGear 'nope' names no planned gear"):
            cost.twin_compare(
                [TraceRequest(0.0, 64, 8)],
                1.0,
                arch=load_hf_config(twin.MODEL),
                fleet=twin.FLEET,
                slo_ttft_ms=200,
                slo_itl_ms=50,
                initial_gear="nope",
            )


def _cost_doc() -> dict[str, Any]:
    return {
        "span_s": 100.0,
        "run": {
            "gpu_hours": 0.1,
            "mean_gpus": 3.6,
            "peak_gpus": 5,
            "slo_met": 900,
            "slo_met_per_gpu_hour": 9000.0,
            "samples": 25,
        },
        "twin": {
            "workload": [1179, 242],
            "requests": 1000,
            "span_s": 99.5,
            "initial_gear": "latency",
            "gears": {"latency": {"layers": [32]}, "throughput": {"layers": [20, 12]}},
            "peer_layouts": [
                {"gear": "peer-h100-80gb", "gpu_model": "H100-80GB", "cards": 2},
                {"gpu_model": "T4-16GB", "cards": 2, "skipped": "no even split fits its cards' memory"},
            ],
            "rows": [
                _row("dynamic", "dynamic", None, 960, 0.96, 9.6, 0.07, 13714.3, mean_gpus=2.5, shifts=2),
                _row("static-latency", "static", 2, 950, 0.95, 9.5, 0.05, 19000.0),
                _row("static-throughput", "static", 4, 600, 0.6, 6.0, 0.1, 6000.0),
                _row("peer-h100-80gb", "peer", 2, 300, 0.3, 3.0, 0.05, 6000.0, failed=40),
            ],
        },
    }


def _row(
    variant: str,
    kind: str,
    gpus: int | None,
    met: int,
    share: float,
    goodput: float,
    hours: float,
    per_hour: float,
    *,
    failed: int = 0,
    mean_gpus: float | None = None,
    shifts: int = 0,
) -> dict[str, Any]:
    return {
        "variant": variant,
        "kind": kind,
        "gpus": gpus,
        "slo_met": met,
        "slo_attainment": share,
        "goodput_rps": goodput,
        "gpu_hours": hours,
        "slo_met_per_gpu_hour": per_hour,
        "failed": failed,
        "rejected_too_long": 0,
        "mean_gpus": mean_gpus if mean_gpus is not None else gpus,
        "shifts": shifts,
    }


class TestReport:
    def test_cost_section_puts_the_run_beside_the_twin_rows(self) -> None:
        doc = _cost_doc()
        doc["run"]["failed"] = 0
        text = "\n".join(report.cost_section(doc, 3.0, 1000))
        assert "**0.1000 GPU-hours** (mean 3.60 cards, peak 5)" in text
        assert "**9,000 SLO-met per GPU-hour**" in text
        # The run: 900 SLO-met over its 100 s = 9.00 req/s.
        assert "| this run (measured) | mean 3.60 | 900 (90%) | 0 | 9.00 | 0.1000 | 9,000 |" in text
        assert "| twin: `dynamic` (2 shifts) | mean 2.50 | 960 (96%) | 0 | 9.60 | 0.0700 | 13,714 |" in text
        assert "| twin: static `latency` (32) | 2 | 950 (95%) | 0 | 9.50 | 0.0500 | 19,000 |" in text
        assert "| twin: static `throughput` (20+12) | 4 | 600 (60%) | 0 | 6.00 | 0.1000 | 6,000 |" in text
        assert "| twin: peer `peer-h100-80gb` | 2 | 300 (30%) | 40 | 3.00 | 0.0500 | 6,000 |" in text
        assert "Card types that hold the model in no uniform even split: T4-16GB (2 cards)." in text
        assert "(`dynamic`, from `latency`)" in text

    def test_the_run_is_charged_its_whole_span(self) -> None:
        text = "\n".join(report.cost_section(_cost_doc(), 3.0, 1000))
        assert "over the 100 s of the run (issuing, then finishing what was issued)" in text

    def test_nothing_measured_no_section(self) -> None:
        assert report.cost_section({}, 3.0, 10) == []

    def test_twin_only(self) -> None:
        doc = _cost_doc()
        del doc["run"]
        text = "\n".join(report.cost_section(doc, 3.0, 1000))
        assert "this run" not in text and "| twin: static `latency` (32) | 2 |" in text

    def test_summary_carries_the_cost(self) -> None:
        doc = summary.build(
            command="gearshift demo",
            started="2026-12-02T00:00:00+00:00",
            wall_s=1.0,
            time_scale=3.0,
            window_start_s=0.0,
            window_span_s=300.0,
            load={"issued": 1000},
            router_totals={},
            engine={},
            shift_list=[],
            policies={},
            first_gears={},
            final_gears={},
            cost=_cost_doc(),
        )
        assert doc["cost"]["run"]["slo_met_per_gpu_hour"] == 9000.0
        assert [r["variant"] for r in doc["cost"]["twin"]["rows"]] == [
            "dynamic",
            "static-latency",
            "static-throughput",
            "peer-h100-80gb",
        ]
