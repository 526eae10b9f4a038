"""bench/gears.py's parts that decide its figures: scenarios, the densified trace, the oracle's schedule and
the goals (card contention is the twin's: tests/unit/test_twin.py). Expected values are worked out by hand
in each test."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest

from gearshift.control.shifting.policy import ShiftRules
from gearshift.dev.twin.oracle import oracle_schedule
from gearshift.facts.model import load_hf_config

BENCH = Path(__file__).resolve().parents[2] / "bench"
ARCH = load_hf_config(BENCH.parent / "examples" / "models" / "llama-3-8b.json")


@pytest.fixture(scope="module")
def g(bench_module: Callable[[str], ModuleType]) -> ModuleType:
    return bench_module("gears")


class TestScenarios:
    def test_compressed_and_own_pace(self, g: ModuleType) -> None:
        s = g.parse_scenario("x4")
        assert (s.name, s.speed, s.density, s.limit_s) == ("x4-first-450s", 4.0, 1.0, 450.0)
        s = g.parse_scenario("x4-own-pace")
        assert (s.name, s.speed, s.density, s.limit_s) == ("x4-own-pace", 1.0, 4.0, None)
        s = g.parse_scenario("x2.5-own-pace:600")
        assert (s.name, s.density, s.limit_s) == ("x2.5-own-pace-first-600s", 2.5, 600.0)
        assert g.parse_scenario("x4-own-pace", limit_s=120.0).limit_s == 120.0

    @pytest.mark.parametrize("bad", ["y4", "x", "x0", "x-1-own-pace", "x4:abc", "x4:-5"])
    def test_bad_scenarios_name_the_forms(self, g: ModuleType, bad: str) -> None:
        with pytest.raises(ValueError, match="x<k>-own-pace"):
            g.parse_scenario(bad)

    def test_densify_keeps_the_pace_and_multiplies_the_load(self, g: ModuleType) -> None:
        n = 1200  # one request a second for 20 minutes
        base = g.Trace(np.arange(n, dtype=float), np.full(n, 100), np.full(n, 10))
        d = g.densify(base, 3.0)
        assert len(d.t) == 3 * n and np.all(np.diff(d.t) >= 0)
        assert d.t[0] == 0.0 and d.t[-1] <= base.duration_s
        per_min = np.bincount((d.t // 60).astype(int))[1:-1]  # inner minutes: 180 ± jitter noise
        assert np.all(np.abs(per_min - 180) <= 180 * 0.15), per_min
        half = g.densify(base, 1.5)
        assert abs(len(half.t) - 1.5 * n) < 0.1 * n  # the fraction drawn at random

    def test_trace_option_rejects_a_missing_file(self, g: ModuleType, tmp_path: Path) -> None:
        with pytest.raises(SystemExit) as exc:
            g.main(["--trace", str(tmp_path / "nope.csv"), "--out", str(tmp_path / "o.json")])
        assert exc.value.code == 2


def _spec(
    g: ModuleType, name: str, cards: int, rps: float, load_s: float = 10.0, layout: str | None = None
) -> Any:
    """A gear the oracle reads: its cards, predicted rps and load time; ``layout`` names its layout
    (default: its own), as the API gear's dump would."""
    dump = {"stages": layout or name}
    api = SimpleNamespace(predicted=SimpleNamespace(throughput_qps=rps), model_dump=lambda **_: dump)
    return g.GearSpec(name, api, {}, 1, frozenset(), load_s, cards={f"{layout or name}-n": cards})


class TestOracle:
    def test_the_cheapest_gear_per_window_under_the_dwell(self, g: ModuleType) -> None:
        policy = ShiftRules(dwell_s=600, upshift_dwell_s=60, rollback_window_s=60, warm_s=30)
        specs = {"a": _spec(g, "a", 2, 20.0), "b": _spec(g, "b", 4, 40.0)}
        # a meets as much as b except in windows 10-14; b costs twice the cards.
        a = [100] * 30
        a[10:15] = [20] * 5
        first, plan = oracle_schedule({"a": a, "b": [100] * 30}, specs, policy)
        # Up to b for window 10. Back down needs dwell 600 + rollback 60 + 10 + lead (10 + 30 + 4) = 714 s
        # = 12 windows after that shift: window 22 (1320 s).
        assert (first, plan) == ("a", [(600.0, "b"), (1320.0, "a")])

    def test_no_shift_when_one_gear_is_best_everywhere(self, g: ModuleType) -> None:
        specs = {"a": _spec(g, "a", 2, 20.0), "b": _spec(g, "b", 4, 40.0)}
        assert oracle_schedule({"a": [50] * 10, "b": [50] * 10}, specs, ShiftRules()) == ("a", [])
        assert oracle_schedule({"a": [10] * 10, "b": [50] * 10}, specs, ShiftRules()) == ("b", [])

    def test_gears_of_one_layout_are_one_candidate(self, g: ModuleType) -> None:
        # b and c are one layout (a planner's balanced and throughput that came out equal): c is never
        # chosen, and alternating windows of b and c would be no reason to shift.
        specs = {
            "a": _spec(g, "a", 2, 20.0),
            "b": _spec(g, "b", 4, 40.0),
            "c": _spec(g, "c", 4, 40.0, layout="b"),
        }
        wins = {"a": [10] * 10, "b": [50] * 10, "c": [50] * 10}
        assert oracle_schedule(wins, specs, ShiftRules()) == ("b", [])

    def test_a_shift_pays_for_its_shadow(self, g: ModuleType) -> None:
        # Down from b (4 cards) to a (2) for the last window saves 2 GPU-windows; a's shadow holds its
        # 2 cards for its lead (load 100 + warm 30 + 2 samples of 2 s = 134 s = 2.23 windows) = 4.47.
        policy = ShiftRules(dwell_s=0, upshift_dwell_s=0, rollback_window_s=0, warm_s=30, sample_interval_s=2)
        specs = {"a": _spec(g, "a", 2, 20.0, load_s=100.0), "b": _spec(g, "b", 4, 40.0)}
        wins = {"a": [0] * 9 + [50], "b": [50] * 10}
        assert oracle_schedule(wins, specs, policy) == ("b", [])
        # Down for the last five windows saves 10 GPU-windows: worth the shadow.
        wins = {"a": [0] * 5 + [50] * 5, "b": [50] * 10}
        first, plan = oracle_schedule(wins, specs, policy)
        assert first == "b" and [gear for _, gear in plan] == ["a"]


def _result(
    variant: str, met: list[int], gpu_hours: float, shifts: float = 0.0, failed: int = 0
) -> dict[str, Any]:
    total = sum(met)
    return {
        "variant": variant,
        "slo_met": total,
        "goodput_rps": total / 600.0,
        "gpu_hours": gpu_hours,
        "slo_met_per_gpu_hour": total / gpu_hours,
        "windows": [{"start_s": 60 * i, "slo_met": m} for i, m in enumerate(met)],
        "shifts_per_trace_hour": shifts,
        "failed": failed,
    }


class TestGoals:
    def test_every_goal_with_its_value(self, g: ModuleType) -> None:
        lat = _result("static-latency", [100] * 10, 1.0 / 3)
        thr = _result("static-throughput", [100] * 5 + [120] * 5, 2.0 / 3)
        dyn = _result("dynamic", [100] * 5 + [118, 110, 120, 120, 120], 0.5, shifts=6.0)
        ora = _result("oracle", [100] * 5 + [120] * 5, 0.45)
        goals = g._goals([lat, thr, dyn, ora])
        # best static by goodput: throughput (1100 met); dynamic 1088 -> 0.989
        assert goals["goodput_vs_best_static"]["best"] == "static-throughput"
        assert goals["goodput_vs_best_static"]["value"] == pytest.approx(1088 / 1100, abs=1e-4)
        assert goals["goodput_vs_best_static"]["met"]
        # per GPU-hour: 1088 / 0.5 = 2176 vs 1100 / (2/3) = 1650 -> 1.3188
        assert goals["slo_met_per_gpu_hour_vs_best_static"]["value"] == pytest.approx(2176 / 1650, abs=1e-4)
        w = goals["windows_vs_best_static_of_window"]
        # window 6 (110 vs 120 = 0.917) is the only one below 0.95 (window 5: 118/120 = 0.983)
        assert not w["met"] and w["windows_below"] == [{"start_s": 360, "ratio": 0.917, "best_static": 120}]
        assert w["value"] == pytest.approx(110 / 120, abs=1e-4)
        assert goals["slo_met_vs_oracle"]["value"] == pytest.approx(1088 / 1100, abs=1e-4)
        assert goals["shifts_per_trace_hour"]["met"] and goals["failed_requests"]["met"]

    def test_the_first_two_windows_are_not_judged(self, g: ModuleType) -> None:
        lat = _result("static-latency", [100] * 4, 1.0)
        dyn = _result("dynamic", [0, 10, 100, 100], 1.0)
        w = g._goals([lat, dyn])["windows_vs_best_static_of_window"]
        assert w["met"] and w["value"] == 1.0 and not math.isnan(w["value"])


class TestShapeScenarios:
    def test_names_and_loads(self, g: ModuleType) -> None:
        scens = g.shape_scenarios(["long-prompt", "day"], [1.0, 4.0])
        assert [s.name for s in scens] == ["long-prompt-x1", "long-prompt-x4", "day-x1", "day-x4"]
        assert (scens[1].shape, scens[1].density, scens[1].limit_s) == ("long-prompt", 4.0, None)
        assert g.shape_scenarios(["day"], [8.0], limit_s=300.0)[0].name == "day-x8-first-300s"

    @pytest.mark.parametrize(("shapes", "loads"), [(["nope"], [1.0]), (["day"], [0.0]), (["day"], [-2.0])])
    def test_bad_shapes_and_loads(self, g: ModuleType, shapes: list[str], loads: list[float]) -> None:
        with pytest.raises(ValueError, match=r"--shapes|--loads"):
            g.shape_scenarios(shapes, loads)

    def test_a_limited_shape_is_its_first_seconds_densified(self, g: ModuleType) -> None:
        tr = g.Scenario("day-x2-first-600s", density=2.0, limit_s=600.0, shape="day").trace(g.TRACE)
        one = g.Scenario("day-x1-first-600s", density=1.0, limit_s=600.0, shape="day").trace(g.TRACE)
        assert tr.duration_s <= 600.0 and one.duration_s <= 600.0 and len(tr.t) == 2 * len(one.t)


def _gpus(r: dict[str, Any], mean_gpus: float) -> dict[str, Any]:
    return {**r, "mean_gpus": mean_gpus}


class TestShapeGoals:
    def test_core_goals_against_the_statics_and_the_oracle(self, g: ModuleType) -> None:
        lat = _result("static-latency", [100] * 10, 1.0 / 3, failed=2)
        thr = _result("static-throughput", [100] * 5 + [120] * 5, 2.0 / 3, failed=1)
        dyn = _result("dynamic", [100] * 5 + [118] * 5, 0.5, failed=1)
        ora = _result("oracle", [100] * 5 + [120] * 5, 0.45)
        goals = g._goals([lat, thr, dyn, ora])
        # Neither static has more SLO-met (1000, 1100 vs 1090) *and* fewer GPU-hours (1/3, 2/3 vs 1/2).
        assert goals["not_dominated"]["met"] and goals["not_dominated"]["value"] == 0
        assert goals["slo_met_vs_best_static"]["best"] == "static-throughput"
        assert goals["slo_met_vs_best_static"]["value"] == pytest.approx(1090 / 1100, abs=1e-4)
        assert goals["failed_vs_best_static"]["met"]  # 1 <= throughput's 1
        # 1090 / 0.5 = 2180 against 1100 / 0.45 = 2444.4: 0.8918 < 0.95
        d = goals["slo_met_per_gpu_hour_vs_oracle"]
        assert d["value"] == pytest.approx(2180 / (1100 / 0.45), abs=1e-3) and not d["met"]
        assert "mean_gpus_vs_peak_static" not in goals  # only for the day shape

    def test_dominated_and_more_failures(self, g: ModuleType) -> None:
        lat = _result("static-latency", [100] * 10, 1.0 / 3)
        dyn = _result("dynamic", [90] * 10, 0.5, failed=3)
        goals = g._goals([lat, dyn])
        assert (
            goals["not_dominated"]["dominated_by"] == ["static-latency"] and not goals["not_dominated"]["met"]
        )
        assert not goals["failed_vs_best_static"]["met"]

    def test_mean_gpus_against_the_smallest_gear_that_holds_the_peak(self, g: ModuleType) -> None:
        # 20 windows; windows 8 and 9 are the peak (the busiest 10 %: 2 windows, 200 requests each).
        arrivals = [50] * 20
        arrivals[8:10] = [200, 200]
        lat_met = [50] * 20
        lat_met[8:10] = [150, 150]  # 300 / 400 = 0.75 at the peak: latency does not hold it
        lat = _gpus(_result("static-latency", lat_met, 20 / 60 * 2 / 2), 2.0)
        thr = _gpus(_result("static-throughput", [50] * 8 + [200, 200] + [50] * 10, 20 / 60 * 4), 4.0)
        bal = _gpus(_result("static-balanced", [50] * 8 + [200, 200] + [50] * 10, 20 / 60 * 8), 8.0)
        dyn = _gpus(_result("dynamic", [50] * 8 + [198, 200] + [50] * 10, 20 / 60 * 2.3), 2.3)
        e = g._goals([lat, thr, bal, dyn], arrivals, peak=True)["mean_gpus_vs_peak_static"]
        assert e["peak_static"] == "static-throughput"  # the fewest GPUs among those holding the peak
        assert e["peak_attainment"]["static-latency"] == 0.75
        assert e["peak_windows_start_s"] == [480, 540]
        assert e["value"] == pytest.approx(2.3 / 4.0) and e["met"]  # 0.575 <= 0.6 at 998/1000 of its SLO-met
        assert e["reachable"] and e["floor_mean_gpus"] == 2.0

    def test_no_static_gear_holds_the_peak(self, g: ModuleType) -> None:
        lat = _gpus(_result("static-latency", [10] * 10, 1.0), 2.0)
        dyn = _gpus(_result("dynamic", [10] * 10, 1.0), 2.0)
        e = g._goals([lat, dyn], [100] * 10, peak=True)["mean_gpus_vs_peak_static"]
        assert e["value"] is None and not e["met"] and e["peak_static"] is None

    def test_summary_rows_and_table(self, g: ModuleType) -> None:
        lat = _gpus(_result("static-latency", [100] * 4, 0.1), 2.0)
        dyn = _gpus(_result("dynamic", [100] * 4, 0.1), 2.0)
        trace = {"speed": 1.0, "density": 4.0, "limit_s": 300.0}
        scen = {"shape": "day", "tuning": "held out", "trace": trace, "results": [lat, dyn]}
        scen["goals"] = g._goals([lat, dyn], [10] * 4, peak=True)
        (row,) = g._summary({"day-x4-first-300s": scen})
        assert (row["shape"], row["load"], row["tuning"]) == ("day", "x4, first 300 s", "held out")
        assert row["best_static"]["variant"] == "static-latency" and row["oracle"] is None
        assert row["core_goals"]["not_dominated"] and not row["core_goals"]["mean_gpus_vs_peak_static"]
        table = g._summary_table([row]).splitlines()
        assert table[0].startswith("shape") and "a+ b+ c+ d. e-" in table[1]
