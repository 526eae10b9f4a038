"""The demo's comparison: peer layouts and the live run's gears in the twin (gearshift.dev.twin.gears,
gearshift.dev.twin.compare), the demo's goals (gearshift.dev.demo.goals), the 70B default example and
window, and the flags that choose them. Expected values are worked out by hand in each test."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from gearshift.api.gearset import Gear as ApiGear
from gearshift.api.gearset import GearSet
from gearshift.api.pdservice import PDService
from gearshift.api.shift_policy import ShiftPolicy
from gearshift.cli import build_parser
from gearshift.control.shifting.adapt import policy_from_api
from gearshift.dev import twin
from gearshift.dev.demo import DEFAULT_EXAMPLE, DEFAULT_KEEP_EVERY, DEFAULT_TIME_SCALE, goals, report
from gearshift.dev.demo import trace as tw
from gearshift.dev.demo.service import load_example, service_gearsets
from gearshift.dev.loadgen import TraceRequest
from gearshift.dev.twin.compare import best, dynamic_start, first_minute_rps, row
from gearshift.dev.twin.gears import gears_from_api, peer_gears
from gearshift.facts.model import load_hf_config
from gearshift.planner.errors import PlanError

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "examples" / "models"


def _rules() -> Any:
    return policy_from_api(ShiftPolicy(), role="both", ttft_slo_ms=2500, itl_slo_ms=150)


class TestPeerLayouts:
    def test_70b_fits_only_a_pair_of_h100s_evenly(self) -> None:
        # Llama-3-70B: per layer q, o 8192² and k, v 8192 x 1024 (8 KV heads x 128) = 150,994,944
        # parameters, the MLP 3 x 8192 x 28672 = 704,643,072: 855,638,016 x 2 bytes = 1.594 GiB; 80 layers
        # 127.5 GiB plus 2 x 128256 x 8192 x 2 bytes of embeddings (3.9 GiB): 131.4 GiB. Usable memory is 90%
        # of each card: H100 72 GiB (two: 144 >= 131.4, 40 layers = 63.8 GiB + the KV each), A100 36 GiB
        # (both: 72), A10 21.6 GiB (all four: 86.4), T4 14.4 GiB (both: 28.8): only the H100s, two stages.
        specs, info = peer_gears(
            load_hf_config(MODELS / "llama-3-70b.json"), _rules(), (1155, 211), micro_batch=16, max_batch=64
        )
        assert [s.name for s in specs] == ["peer-h100-80gb"]
        h100 = specs[0]
        assert [(st.start, st.end) for st in h100.api.stages] == [(0, 40), (40, 80)]
        assert h100.gpus == 2 and h100.heads == 1
        assert set(h100.nodes) == {"gpu-h100-0", "gpu-h100-1"}
        skipped = {p["gpu_model"]: p["cards"] for p in info if p.get("skipped")}
        assert skipped == {"A100-40GB": 2, "A10-24GB": 4, "T4-16GB": 2}
        # The KV for 64 sequences of 1366 tokens does not fit beside 40 layers; halved until it does.
        assert 1 <= h100.api.max_batch < 64 and h100.api.micro_batch == min(16, h100.api.max_batch)

    def test_8b_fits_one_card_of_each_big_model_and_copies_over_all_of_them(self) -> None:
        # Llama-3-8B: 32 layers of 218,103,808 parameters (q, o 4096², k, v 4096 x 1024, MLP 3 x 4096 x
        # 14336) = 13.0 GiB plus 2 x 128256 x 4096 x 2 bytes = 1.96 GiB: 15.0 GiB. One H100 (72) or A100 (36)
        # holds it; a T4 (14.4) does not, two do (16 + 16 layers): one copy over the two T4s.
        specs, info = peer_gears(
            load_hf_config(MODELS / "llama-3-8b.json"), _rules(), (512, 128), micro_batch=8, max_batch=64
        )
        by = {s.name: s for s in specs}
        assert by["peer-h100-80gb"].heads == 2 and len(by["peer-h100-80gb"].api.stages) == 1
        assert by["peer-a100-40gb"].heads == 2 and len(by["peer-a100-40gb"].api.stages) == 1
        t4 = by["peer-t4-16gb"]
        assert [(st.start, st.end) for st in t4.api.stages] == [(0, 16), (16, 32)] and t4.heads == 1
        assert all(not p.get("skipped") for p in info)


class TestGearsFromApi:
    def _gear(self, *stages: tuple[int, int, list[str]]) -> ApiGear:
        return ApiGear.model_validate(
            {
                "name": "uneven",
                "intent": "latency",
                "microBatch": 4,
                "maxBatch": 64,
                "stages": [
                    {"layers": [a, b], "replicas": len(nodes), "gpus": 1, "nodes": nodes}
                    for a, b, nodes in stages
                ],
            }
        )

    def test_the_live_gear_keeps_its_layers_nodes_and_cards(self) -> None:
        # 70 + 10 layers, the small stage on two cards (a hot-stage extra): 3 cards, one head.
        g = self._gear((0, 70, ["gpu-h100-0"]), (70, 80, ["gpu-a100-0", "gpu-a10-0"]))
        [spec] = gears_from_api([g], load_hf_config(MODELS / "llama-3-70b.json"), _rules())
        assert spec.name == "uneven" and spec.heads == 1 and spec.gpus == 3
        assert spec.cards == {"gpu-h100-0": 1, "gpu-a100-0": 1, "gpu-a10-0": 1}
        assert [s["gpu"] for s in spec.head_docs[0]["stages"]] == ["H100-80GB", "A100-40GB"]

    def test_a_node_outside_the_fleet_is_refused(self) -> None:
        g = self._gear((0, 80, ["gpu-x-0"]))
        with pytest.raises(
            PlanError, match=r"gear 'uneven' names nodes the fleet file does not have: \['gpu-x-0'\]"
        ):
            gears_from_api([g], load_hf_config(MODELS / "llama-3-70b.json"), _rules())


class TestCompareRows:
    def test_row_keeps_the_figures_and_the_p99s(self) -> None:
        r = row(
            {
                "variant": "static-a",
                "slo_met": 3,
                "goodput_rps": 0.5,
                "gpu_hours": 0.1,
                "ttft_ms": {"p50": 1.0, "p99": 9.0},
                "tpot_ms": {"p99": 4.0},
            },
            "static",
            4,
        )
        assert (r["kind"], r["gpus"], r["ttft_p99_ms"], r["tpot_p99_ms"], r["slo_met"]) == (
            "static",
            4,
            9.0,
            4.0,
            3,
        )
        assert "shift_history" not in r
        assert row({"variant": "dynamic", "shift_history": [{"to": "b"}]}, "dynamic")["shift_history"] == [
            {"to": "b"}
        ]

    def test_best_is_the_most_goodput_then_the_fewest_gpu_hours(self) -> None:
        rows = [
            {"variant": "a", "kind": "static", "goodput_rps": 2.0, "gpu_hours": 0.4},
            {"variant": "b", "kind": "static", "goodput_rps": 2.0, "gpu_hours": 0.2},
            {"variant": "c", "kind": "peer", "goodput_rps": 9.0, "gpu_hours": 0.1},
        ]
        assert best(rows, "static")["variant"] == "b"  # type: ignore[index]
        assert best(rows, "peer")["variant"] == "c"  # type: ignore[index]
        assert best(rows, "dynamic") is None

    def test_dynamic_start_reads_the_first_minute_or_keeps_the_initial_gear(self) -> None:
        # 30 arrivals in the first 60 s (every 2 s), 10 after: 0.5 req/s expected.
        trace = twin.Trace(
            np.arange(40) * 2.0, np.full(40, 100, dtype=np.int64), np.full(40, 10, dtype=np.int64), 1.0
        )
        assert first_minute_rps(trace) == pytest.approx(0.5)
        arch = load_hf_config(twin.MODEL)
        gears, _, _ = twin.plan_gears(arch, _rules(), even=False)
        policy, start = dynamic_start(gears, _rules(), trace)
        assert policy.expected_arrival_rps == pytest.approx(0.5) and start in {g.name for g in gears}
        kept, named = dynamic_start(gears, _rules(), trace, expected_given=True, initial="throughput")
        assert kept.expected_arrival_rps == _rules().expected_arrival_rps and named == "throughput"


def _rows(dyn_good: float, dyn_hours: float, dyn_per_hour: float, *, shifts: int = 0) -> list[dict[str, Any]]:
    return [
        {
            "variant": "dynamic",
            "kind": "dynamic",
            "slo_met": 800,
            "goodput_rps": dyn_good,
            "gpu_hours": dyn_hours,
            "slo_met_per_gpu_hour": dyn_per_hour,
            "shift_history": [{}] * shifts,
        },
        {
            "variant": "static-big",
            "kind": "static",
            "gpus": 8,
            "goodput_rps": 2.0,
            "gpu_hours": 1.0,
            "slo_met_per_gpu_hour": 800.0,
        },
        {
            "variant": "static-small",
            "kind": "static",
            "gpus": 4,
            "goodput_rps": 1.0,
            "gpu_hours": 0.5,
            "slo_met_per_gpu_hour": 800.0,
        },
        {
            "variant": "peer-h100",
            "kind": "peer",
            "gpus": 2,
            "goodput_rps": 0.5,
            "gpu_hours": 0.25,
            "slo_met_per_gpu_hour": 400.0,
        },
    ]


class TestGoals:
    def test_every_goal_met(self) -> None:
        # dynamic 2.0 req/s on 0.6 GPU-hours (1333.3 per GPU-hour) vs the best static (big: 2.0 on 1.0, 800):
        # 1.0x goodput, 1.667x per GPU-hour; vs the peer's 0.5 req/s: 4x. Live 760 of the twin's 800 = 0.95.
        g = goals.evaluate(
            rows=_rows(2.0, 0.6, 1333.3, shifts=2),
            live_slo_met=760,
            live_failed=0,
            shifts=[{"started_s": 100.0, "finished_s": 180.0, "outcome": "Succeeded"}],
            issue_s=465.0,
            wall_s=600.0,
        )
        assert g["planned_vs_best_peer"]["value"] == 4.0 and g["planned_vs_best_peer"]["met"]
        assert g["planned_vs_best_peer"]["gpu_hour_ratio"] == pytest.approx(0.4167, abs=1e-4)
        assert g["dynamic_vs_best_static_goodput"]["value"] == 1.0
        assert g["dynamic_vs_best_static_goodput"]["best_static"] == "static-big"
        assert g["dynamic_vs_best_static_slo_met_per_gpu_hour"]["value"] == pytest.approx(1.6666, abs=1e-3)
        assert g["live_vs_twin_dynamic"]["value"] == 0.95
        assert all(v["met"] for v in g.values()), g

    def test_goals_not_met_say_why(self) -> None:
        # The same goodput as the best static on the same cards (no shift): 1.0x per GPU-hour; 10 failed;
        # live 700 / 800 = 0.875; one shift still running when issuing stopped; 13 minutes.
        g = goals.evaluate(
            rows=_rows(2.0, 1.0, 800.0),
            live_slo_met=700,
            live_failed=10,
            shifts=[{"from": "a", "to": "b", "started_s": 400.0, "finished_s": None, "outcome": None}],
            issue_s=465.0,
            wall_s=780.0,
        )
        eff = g["dynamic_vs_best_static_slo_met_per_gpu_hour"]
        assert eff["value"] == 1.0 and not eff["met"] and "cannot spend fewer" in eff["why"]
        assert not g["live_failed"]["met"] and g["live_vs_twin_dynamic"]["value"] == 0.875
        assert not g["live_vs_twin_dynamic"]["met"]
        late = g["shifts_finish_before_replay_ends"]
        assert not late["met"] and late["late"] == [
            {"from": "a", "to": "b", "started_s": 400.0, "finished_s": None, "outcome": None}
        ]
        assert not g["wall_time"]["met"] and g["wall_time"]["value"] == 780.0

    def test_the_same_goodput_on_fewer_gpu_hours_meets_the_peer_goal(self) -> None:
        # dynamic 0.5 req/s (the peer's) on 0.1 GPU-hours against the peer's 0.25: 2.5x fewer.
        g = goals.evaluate(
            rows=_rows(0.5, 0.1, 4000.0), live_slo_met=None, live_failed=None, shifts=[], issue_s=1, wall_s=1
        )
        assert (
            g["planned_vs_best_peer"]["value"] == 1.0 and g["planned_vs_best_peer"]["gpu_hour_ratio"] == 2.5
        )
        assert g["planned_vs_best_peer"]["met"] and "live_failed" not in g

    def test_no_peer_layout(self) -> None:
        rows = [r for r in _rows(1.0, 0.5, 1600.0) if r["kind"] != "peer"]
        g = goals.evaluate(rows=rows, live_slo_met=1, live_failed=0, shifts=[], issue_s=1, wall_s=1)
        assert g["planned_vs_best_peer"]["value"] is None and g["planned_vs_best_peer"]["met"]
        assert "a peer serves nothing" in g["planned_vs_best_peer"]["why"]

    def test_the_oracle_bounds_the_efficiency_goal_and_is_a_goal_itself(self) -> None:
        # dynamic: 800 SLO-met on 1.0 GPU-hours (800 per GPU-hour), the best static the same; the oracle
        # 820 on 0.8 (1025 per GPU-hour): 1025 / 800 = 1.281x < 1.3x reachable; 800 / 820 = 0.9756 >= 0.97.
        rows = [{**r, "slo_met": 800} for r in _rows(2.0, 1.0, 800.0)]
        oracle = {"variant": "oracle", "kind": "oracle", "gpus": None, "goodput_rps": 2.05, "gpu_hours": 0.8,
                  "slo_met": 820, "slo_met_per_gpu_hour": 1025.0, "schedule": [{}, {}, {}]}  # fmt: skip
        g = goals.evaluate(rows=[*rows, oracle], live_slo_met=None, live_failed=None, shifts=[], issue_s=1,
                           wall_s=1)  # fmt: skip
        eff = g["dynamic_vs_best_static_slo_met_per_gpu_hour"]
        assert eff["oracle_ratio"] == pytest.approx(1.2812, abs=1e-4) and not eff["met"]
        assert "the per-window oracle reaches 1.2812x, so hindsight does not reach 1.3x" in eff["why"]
        o = g["dynamic_vs_oracle_slo_met"]
        assert o["value"] == pytest.approx(0.9756, abs=1e-4) and o["met"] and "(2 shifts)" in o["why"]
        # The oracle row is no static gear: the best static stays the static one.
        assert eff["best_static"] == "static-big"
        g = goals.evaluate(rows=[*rows, {**oracle, "slo_met": 900}], live_slo_met=None, live_failed=None,
                           shifts=[], issue_s=1, wall_s=1)  # fmt: skip
        assert not g["dynamic_vs_oracle_slo_met"]["met"]  # 800 / 900 = 0.889

    def test_goal_lines(self) -> None:
        g = goals.evaluate(rows=[], live_slo_met=None, live_failed=3, shifts=[], issue_s=10, wall_s=5)
        text = report.goal_lines(g)
        assert "## Goals" in text and "| live_failed | 3 | 0 | **no** |" in text
        assert report.goal_lines({}) == ""


class TestDefaultDemo:
    def test_the_default_example_is_70b_aggregated_on_the_sim_engine(self) -> None:
        docs = load_example(DEFAULT_EXAMPLE, None)
        pds = PDService.model_validate(next(d for d in docs if d["kind"] == "PDService"))
        [gs] = [GearSet.model_validate(d) for d in docs if d["kind"] == "GearSet"]
        assert pds.spec.engine == "sim" and pds.spec.model.num_layers == 80
        assert pds.spec.serving is not None and gs.spec.role == "both" and gs.spec.mode == "auto"
        assert service_gearsets(next(d for d in docs if d["kind"] == "PDService")) == {"both": "llama3-70b"}
        assert build_parser().parse_args(["demo"]).example == DEFAULT_EXAMPLE

    def test_service_gearsets_of_a_pd_service(self) -> None:
        docs = yaml.safe_load_all((REPO / "examples" / "demo" / "pdservice-demo.yaml").read_text())
        pds = next(d for d in docs if d and d["kind"] == "PDService")
        assert service_gearsets(pds) == {"prefill": "llama3-8b-prefill", "decode": "llama3-8b-decode"}

    def test_the_default_window_swings(self) -> None:
        from gearshift.dev.demo import DEFAULT_DURATION_S, DEFAULT_TRACE
        from gearshift.dev.loadgen import load_trace

        if not DEFAULT_TRACE.exists():
            pytest.skip("the shared trace is not on this machine")
        w = tw.window(
            load_trace(DEFAULT_TRACE), DEFAULT_TIME_SCALE, DEFAULT_DURATION_S, 0.0, DEFAULT_KEEP_EVERY
        )
        _, rates = tw.offered_rate(w.due_s, 30.0, w.run_s)
        # The whole trace hour (3502 s < 7.5 x 480 = 3600 s), 19,366 requests / 25 = 775 (rounded up).
        assert len(w.requests) == 775 and w.run_s <= DEFAULT_DURATION_S
        inner = rates[:-1]  # the last bin is partly past the trace's end
        assert max(inner) >= 1.5 * min(inner)  # the load swings enough for gears to matter
        assert 1.5 < w.mean_rate() < 1.9

    def test_keep_every_thins_the_window(self) -> None:
        trace = [TraceRequest(float(i), 10, 5) for i in range(10)]
        w = tw.window(trace, 1.0, 100.0, 0.0, 3)
        assert [r.offset_s for r in w.requests] == [0.0, 3.0, 6.0, 9.0]
        with pytest.raises(ValueError, match="keep_every must be >= 1"):
            tw.window(trace, 1.0, 100.0, 0.0, 0)

    @pytest.mark.parametrize("value", ["0", "-2", "1.5", "x"])
    def test_bad_keep_every_names_the_flag(self, value: str, capsys: pytest.CaptureFixture[str]) -> None:
        with pytest.raises(SystemExit):
            build_parser().parse_args(["demo", "--keep-every", value])
        assert f"argument --keep-every: {value!r}: give a whole number >= 1" in capsys.readouterr().err

    def test_pd_demo_args_parse(self) -> None:
        from gearshift.dev.demo import PD_DEMO_ARGS

        args: argparse.Namespace = build_parser().parse_args(["demo", *PD_DEMO_ARGS.split()])
        assert (args.time_scale, args.keep_every) == (3.0, 1)
        assert args.example == Path("examples/demo/pdservice-demo.yaml")
