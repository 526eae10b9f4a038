"""The capacity controller: SLO capacity predicted, corrected online, and the load triggers.

Gears like the benchmark's: ``lat`` the whole model on 2 cards, ``thr`` on 4, ``big`` on 8. Capacities
are worked out by hand from the rules (headroom 0.8 × predicted throughput, set here; the default is 0.9),
not by the code under test.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from gearshift.control.shifting import capacity as cap
from gearshift.control.shifting.capacity import CapacityEstimate
from gearshift.control.shifting.decide import REASON_DWELL, DecisionKind, DecisionState, decide
from gearshift.control.shifting.policy import GearTable, GearView, Intent, ShiftRules, StageView
from gearshift.control.shifting.triggers import Trigger
from gearshift.control.smoothing import Sample
from gearshift.facts.errors import PolicyError
from gearshift.facts.model import load_hf_config

ARCH = load_hf_config(Path(__file__).resolve().parents[2] / "examples" / "models" / "llama-3-8b.json")
RULES = ShiftRules(target_p99_ms=200.0, capacity_headroom=0.8)
#: A role that has served long past any dwell (a fresh DecisionState starts one at its first sample).
SETTLED = DecisionState(last_shift_at=-10_000.0)


def gear(name: str, cards: int, thr: float | None, p99: float | None = 90.0, **kw: object) -> GearView:
    return GearView(
        name,
        Intent.LATENCY,
        (StageView(0, 32, replicas=cards),),
        thr,
        p99,
        **kw,  # type: ignore[arg-type]
    )


LAT = gear("lat", 2, 28.75)  # capacity 0.8 × 28.75 = 23.0 req/s
THR = gear("thr", 4, 38.0)  # 30.4 req/s
BIG = gear("big", 8, 50.0)  # 40.0 req/s
SLOW = gear("slow", 1, 100.0, p99=5150.0)  # predicted P99 above target: capacity 0


def table(active: str, *gs: GearView) -> GearTable:
    return GearTable(gs or (LAT, THR, BIG), active, ARCH)


def smp(
    t: float, arrivals: float | None, p99: float | None = 120.0, queue: float = 0.0, qps: float | None = None
) -> Sample:
    return Sample(
        at=t,
        ttft_p99_ms=p99,
        arrival_rps=arrivals,
        queue=queue,
        qps=arrivals or 0.0 if qps is None else qps,
    )


def run(
    active: str,
    samples: list[Sample],
    state: DecisionState | None = None,
    gs: tuple[GearView, ...] = (),
    rules: ShiftRules = RULES,
) -> tuple[DecisionState, list[tuple[DecisionKind, str | None, str]]]:
    st = state or DecisionState()
    out = []
    for s in samples:
        st, d = decide(st, s, rules, table(active, *gs), s.at)
        out.append((d.kind, d.target, d.reason))
    return st, out


class TestEstimate:
    def test_predicted_is_headroom_times_throughput(self) -> None:
        assert cap.predicted_capacity(LAT, RULES) == pytest.approx(23.0)
        assert cap.predicted_capacity(
            gear("x", 2, 28.75), ShiftRules(capacity_headroom=0.5)
        ) == pytest.approx(14.375)

    def test_a_predicted_p99_above_target_means_no_capacity(self) -> None:
        assert cap.predicted_capacity(SLOW, RULES) == 0.0
        assert not cap.fits(CapacityEstimate(0.0), 0.0)

    def test_no_prediction_no_estimate(self) -> None:
        g = gear("x", 2, None)
        assert cap.predicted_capacity(g, RULES) is None
        assert CapacityEstimate().capacity_rps is None
        assert not cap.fits(CapacityEstimate(), 1.0)

    def test_bounds_clamp_the_prediction(self) -> None:
        assert CapacityEstimate(23.0, measured_low_rps=25.0).capacity_rps == 25.0
        assert CapacityEstimate(23.0, measured_high_rps=18.0).capacity_rps == 18.0
        assert CapacityEstimate(23.0, 10.0, 30.0).capacity_rps == 23.0
        assert CapacityEstimate(None, 12.0).capacity_rps == 12.0

    def test_observe_within_slo_raises_the_low_bound_after_a_whole_window(self) -> None:
        e = CapacityEstimate(23.0)
        for t, rate in ((0, 21.0), (30, 20.0), (58, 22.0)):
            e = cap.observe(e, arrival_rps=rate, completed_rps=rate, keeping_up=True, overloaded=False, now=t)
        assert e.measured_low_rps is None and (e.pending_low_rps, e.pending_since) == (20.0, 0)
        e = cap.observe(e, arrival_rps=21.0, completed_rps=21.0, keeping_up=True, overloaded=False, now=60)
        # The least rate of the 60 s run is what it served throughout.
        assert (e.measured_low_rps, e.measured_high_rps, e.updated_at) == (20.0, None, 60)
        assert e.pending_low_rps is None
        same = cap.observe(e, arrival_rps=15.0, completed_rps=15.0, keeping_up=True, overloaded=False, now=62)
        assert same is e

    def test_a_breach_ends_the_run(self) -> None:
        e = CapacityEstimate(23.0)
        e = cap.observe(e, arrival_rps=21.0, completed_rps=21.0, keeping_up=True, overloaded=False, now=0)
        e = cap.observe(e, arrival_rps=21.0, completed_rps=21.0, keeping_up=False, overloaded=False, now=30)
        e = cap.observe(e, arrival_rps=21.0, completed_rps=21.0, keeping_up=True, overloaded=False, now=61)
        assert e.measured_low_rps is None and e.pending_since == 61

    def test_observe_overload_sets_the_high_bound_once_it_lasts_a_window(self) -> None:
        def over(
            e: CapacityEstimate, t: float, arrival: float, done: float, saturated: bool
        ) -> CapacityEstimate:
            return cap.observe(
                e,
                arrival_rps=arrival,
                completed_rps=done,
                keeping_up=False,
                overloaded=True,
                saturated=saturated,
                now=t,
            )

        e = over(CapacityEstimate(23.0), 1, 19.0, 17.0, False)
        # One overloaded sample is no bound yet: a burst shorter than the rates' window reads low.
        assert e.measured_high_rps is None and (e.pending_high_rps, e.pending_high_since) == (19.0, 1)
        e = over(e, 1 + cap.CONFIRM_S, 18.0, 17.0, False)
        assert e.measured_high_rps == 19.0  # a P99 breach without backlog: the most it took in the run
        s = over(CapacityEstimate(23.0), 1, 30.0, 26.5, True)
        s = over(s, 31, 30.0, 24.0, True)
        s = over(s, 61, 31.0, 25.0, True)
        assert s.measured_high_rps == 26.5  # backing up: the most it completed while overloaded
        # A run broken by a calm sample starts again.
        b = over(CapacityEstimate(23.0), 1, 30.0, 26.5, True)
        b = cap.observe(b, arrival_rps=10.0, completed_rps=10.0, keeping_up=False, overloaded=False, now=30)
        b = over(b, 61, 30.0, 26.5, True)
        assert b.measured_high_rps is None and b.pending_high_since == 61

    def test_a_contradicting_bound_replaces_the_other(self) -> None:
        e = CapacityEstimate(23.0, 20.0, None)
        for t in (2, 2 + cap.CONFIRM_S):
            e = cap.observe(e, arrival_rps=18.0, completed_rps=18.0, keeping_up=False, overloaded=True, now=t)
        assert (e.measured_low_rps, e.measured_high_rps) == (None, 18.0)
        for t in (63, 123):
            e = cap.observe(e, arrival_rps=21.0, completed_rps=21.0, keeping_up=True, overloaded=False, now=t)
        assert (e.measured_low_rps, e.measured_high_rps) == (21.0, None)

    def test_unknown_arrivals_change_nothing(self) -> None:
        e = CapacityEstimate(23.0)
        for a in (None, math.nan, 0.0):
            assert (
                cap.observe(e, arrival_rps=a, completed_rps=1, keeping_up=True, overloaded=False, now=1) is e
            )

    def test_round_trip(self) -> None:
        e = CapacityEstimate(23.0, 18.5, 26.25, 40.0, 24.0, 50.0, 30.0, 55.0)
        assert CapacityEstimate.from_dict(e.to_dict()) == e

    def test_policy_ranges(self) -> None:
        for kw in ({"capacity_headroom": 0.0}, {"downshift_ratio": 1.5}, {"upshift_dwell_s": -1.0}):
            with pytest.raises(PolicyError, match=r"spec\.policy"):
                ShiftRules(**kw)  # type: ignore[arg-type]


class TestChoice:
    def test_cheapest_fitting_gear(self) -> None:
        est = cap.estimates_for((LAT, THR, BIG), {}, RULES)
        assert cap.cheapest((LAT, THR, BIG), est, 20.0).name == "lat"  # type: ignore[union-attr]
        assert cap.cheapest((LAT, THR, BIG), est, 25.0).name == "thr"  # type: ignore[union-attr]
        assert cap.cheapest((LAT, THR, BIG), est, 35.0).name == "big"  # type: ignore[union-attr]
        assert cap.cheapest((LAT, THR, BIG), est, 45.0) is None
        assert cap.largest((LAT, THR, BIG), est).name == "big"  # type: ignore[union-attr]

    def test_unhealthy_gears_are_passed_over(self) -> None:
        sick = GearView("thr", Intent.LATENCY, THR.stages, 38.0, 90.0, healthy=False, unhealthy_reason="OOM")
        est = cap.estimates_for((LAT, sick, BIG), {}, RULES)
        assert cap.cheapest((LAT, sick, BIG), est, 25.0).name == "big"  # type: ignore[union-attr]

    def test_initial_gear_is_the_cheapest_that_meets_the_slo_at_the_expected_load(self) -> None:
        assert cap.initial_gear((SLOW, BIG, THR, LAT), RULES) == "lat"  # SLOW has 1 card but misses the SLO
        assert cap.initial_gear((LAT, THR, BIG), ShiftRules(expected_arrival_rps=28.0)) == "thr"
        assert ShiftRules().capacity_headroom == 0.9  # lat: 0.9 × 28.75 = 25.9 < 28
        # A load above every gear: the one with the most capacity.
        assert cap.initial_gear((LAT, THR), ShiftRules(expected_arrival_rps=80.0)) == "thr"
        assert cap.initial_gear((gear("a", 2, None),), RULES) is None
        assert cap.initial_gear((SLOW,), RULES) is None

    def test_estimates_keep_measurements_and_take_new_predictions(self) -> None:
        known = {"lat": CapacityEstimate(99.0, 20.0, 24.0, 3.0), "gone": CapacityEstimate(1.0)}
        est = cap.estimates_for((LAT, THR), known, RULES)
        assert est["lat"] == CapacityEstimate(pytest.approx(23.0), 20.0, 24.0, 3.0)  # type: ignore[arg-type]
        assert set(est) == {"lat", "thr"}


class TestDecide:
    def test_load_high_picks_the_cheapest_gear_that_fits_not_the_biggest(self) -> None:
        # 26 req/s > lat's 23.0: thr (30.4 on 4 cards) fits; big (40 on 8) fits too but costs more.
        _, out = run("lat", [smp(t, 26.0) for t in (2, 4, 6)], SETTLED)
        assert [k for k, _, _ in out] == [DecisionKind.HOLD, DecisionKind.HOLD, DecisionKind.SHIFT]
        assert out[-1][1:] == ("thr", "LoadHigh")

    def test_load_high_waits_only_the_upshift_dwell(self) -> None:
        state = DecisionState(last_shift_at=0.0)
        _, out = run("lat", [smp(t, 26.0) for t in (30, 32, 34)], state)
        assert out[-1] == (DecisionKind.HOLD, "thr", REASON_DWELL)  # 34 s < upshiftDwellS 60 s
        _, out = run("lat", [smp(t, 26.0) for t in (100, 102, 104)], state)
        assert out[-1][:2] == (DecisionKind.SHIFT, "thr")  # 104 s: past 60 s, well inside dwellS 600 s

    def test_load_low_goes_down_after_the_full_dwell(self) -> None:
        # 15 req/s <= 0.75 × lat's 23.0 = 17.25, P99 fine: lat will do, on half the cards.
        state = DecisionState(last_shift_at=0.0)
        _, out = run("thr", [smp(t, 15.0) for t in (300, 302, 304)], state)
        assert out[-1] == (DecisionKind.HOLD, "lat", REASON_DWELL)
        _, out = run("thr", [smp(t, 15.0) for t in (700, 702, 704)], state)
        assert out[-1][1:] == ("lat", "LoadLow") and out[-1][0] is DecisionKind.SHIFT

    def test_load_low_needs_the_margin_and_a_calm_gear(self) -> None:
        # 18 req/s fits lat (23.0) but not within 0.75 of it: stay.
        _, out = run("thr", [smp(t, 18.0) for t in range(2, 20, 2)])
        assert {k for k, _, _ in out} == {DecisionKind.HOLD}
        # 15 req/s but a P99 over the p99-high alarm (1.2 × 200 ms): no way down while the gear struggles.
        _, out = run("thr", [smp(t, 15.0, p99=250.0) for t in range(2, 20, 2)])
        assert {k for k, _, _ in out} == {DecisionKind.HOLD}

    def test_saturation_measures_the_capacity_and_the_shift_uses_it(self) -> None:
        # lat is predicted to keep up with 23.0 but backs up (3 waiting per replica, P99 400 ms) at 20 req/s
        # arriving, completing 18.5: saturation wants thr, the cheapest gear that fits 20, at once; the
        # capacity is measured as 18.5 once the overload has lasted a whole window.
        st, out = run("lat", [smp(t, 20.0, p99=400.0, queue=6.0, qps=18.5) for t in (2, 4, 6)], SETTLED)
        assert out[-1][:3] == (DecisionKind.SHIFT, "thr", "Saturation")
        # Alone (nowhere to shift), it stays overloaded for a window: the bound is set.
        st, out = run(
            "lat", [smp(t, 20.0, p99=400.0, queue=6.0, qps=18.5) for t in range(2, 70, 2)], SETTLED, gs=(LAT,)
        )
        assert st.capacity["lat"].measured_high_rps == pytest.approx(18.5)
        assert st.capacity["lat"].capacity_rps == pytest.approx(18.5)

    def test_p99_high_without_backlog_wants_a_lower_predicted_p99_that_fits_not_more_cards(self) -> None:
        # thr (predicted P99 300 ms) over the alarm at 15 req/s with no queue: lat (90 ms, fits 15 < 23) is
        # the answer; its capacity is not lowered (no backlog: a latency, not a capacity, problem).
        thr = gear("thr", 4, 38.0, p99=150.0)
        lat = gear("lat", 2, 28.75, p99=90.0)
        st, out = run("thr", [smp(t, 15.0, p99=300.0) for t in (2, 4, 6)], SETTLED, gs=(lat, thr))
        assert out[-1][:3] == (DecisionKind.SHIFT, "lat", "P99High")
        assert not st.capacity["thr"].measured
        # On lat itself (the lowest predicted P99) the alarm has nowhere to go: it holds.
        st, out = run("lat", [smp(t, 15.0, p99=300.0) for t in (2, 4, 6, 8)], gs=(lat, thr))
        assert {k for k, _, _ in out} == {DecisionKind.HOLD}

    def test_p99_high_moves_down_only_within_the_downshift_margin(self) -> None:
        # lat saturated at 15.3 req/s (measured); thr over the alarm at 14 req/s: lat fits 14 only at 91%
        # of that bound, above downshiftRatio 0.75, so load-high would move back up after the dwell (the
        # demo's flap). Stay; at 11 req/s (72%) lat is the answer.
        thr = gear("thr", 4, 38.0, p99=150.0)
        lat = gear("lat", 2, 28.75, p99=90.0)
        settled = DecisionState(last_shift_at=-10_000.0, capacity={"lat": CapacityEstimate(23.0, None, 15.3)})
        _, out = run("thr", [smp(t, 14.0, p99=300.0) for t in (2, 4, 6, 8)], settled, gs=(lat, thr))
        assert {k for k, _, _ in out} == {DecisionKind.HOLD}
        _, out = run("thr", [smp(t, 11.0, p99=300.0) for t in (2, 4, 6)], settled, gs=(lat, thr))
        assert out[-1][:3] == (DecisionKind.SHIFT, "lat", "P99High")
        # A predicted capacity keeps its headroom already: 14 req/s on lat predicted at 15.3 may go.
        predicted = replace(settled, capacity={"lat": CapacityEstimate(15.3)})
        _, out = run("thr", [smp(t, 14.0, p99=300.0) for t in (2, 4, 6)], predicted, gs=(lat, thr))
        assert out[-1][:3] == (DecisionKind.SHIFT, "lat", "P99High")
        assert CapacityEstimate(23.0, None, 15.3).saturated and not CapacityEstimate(15.3).saturated
        assert not CapacityEstimate(10.0, None, 15.3).saturated  # the prediction is lower: not the bound

    def test_the_first_gear_gets_a_dwell_from_its_first_sample(self) -> None:
        # Fresh state: the first sample with an arrival rate starts the dwell, so early, short-window rates
        # move nothing for upshiftDwellS (up) or dwellS (down).
        st, out = run("lat", [smp(t, 26.0) for t in (2, 4, 6)])
        assert st.last_shift_at == 2 and out[-1] == (DecisionKind.HOLD, "thr", REASON_DWELL)
        # lat served 26 req/s within target for 60 s meanwhile (its capacity is measured >= 26, above the
        # predicted 23); at 30 req/s arriving (smoothed 27.2 > 26) load-high, still latched, goes at 62 s.
        st, out = run("lat", [smp(62, 30.0)], st)
        assert st.capacity["lat"].measured_low_rps == 26.0
        assert out[0][:2] == (DecisionKind.SHIFT, "thr")
        # Without an arrival rate (FlexPipe's triggers alone, docs/sources.md#shift-triggers) nothing changes:
        # no dwell is started.
        st, _ = run("lat", [smp(2, None)])
        assert st.last_shift_at is None

    def test_measured_low_bound_lets_a_gear_take_more_than_predicted(self) -> None:
        known = {"lat": CapacityEstimate(23.0, measured_low_rps=26.0)}
        _, out = run("lat", [smp(t, 25.0) for t in (2, 4, 6, 8)], DecisionState(capacity=known))
        assert {k for k, _, _ in out} == {DecisionKind.HOLD}

    def test_no_arrival_rate_no_capacity_triggers(self) -> None:
        st, out = run("lat", [smp(t, None) for t in (2, 4, 6, 8)])
        assert {k for k, _, _ in out} == {DecisionKind.HOLD}
        assert not st.tracks[Trigger.LOAD_HIGH].latched and st.capacity["lat"].measured_low_rps is None

    def test_p99_low_is_left_to_load_low(self) -> None:
        # A P99 far below target at 24 req/s on thr: FlexPipe would go to the balanced gear
        # (docs/sources.md#shift-triggers); the capacity controller stays, as no cheaper gear fits 24 within
        # the margin.
        _, out = run("thr", [smp(t, 24.0, p99=60.0) for t in range(2, 20, 2)])
        assert {k for k, _, _ in out} == {DecisionKind.HOLD}

    def test_busy_samples_measure_nothing(self) -> None:
        st = DecisionState()
        for t in (2, 4, 6):
            st, _ = decide(st, smp(t, 30.0, p99=400.0), RULES, table("lat"), t, busy=True)
        assert not st.capacity["lat"].measured


class TestSampleWindow:
    def test_the_window_is_shortened_to_the_time_since_the_gear_took_traffic(self) -> None:
        from gearshift.control.signals import sample_window

        assert sample_window(None, 1000.0) == "1m"
        assert sample_window(1000.0, 1003.0) == "10s"  # two scrapes at least
        assert sample_window(1000.0, 1037.2) == "38s"
        assert sample_window(1000.0, 1060.0) == "1m"
        assert sample_window(1000.0, 1500.0) == "1m"
        from gearshift.control.signals import sample_window_s

        assert (sample_window_s(None, 5.0), sample_window_s(1000.0, 1037.2)) == (60.0, 38.0)

    def test_serving_since_is_the_switch_while_draining_and_the_check_start_while_switching(self) -> None:
        from gearshift.control.shifting.executor import Phase, ShiftState
        from gearshift.control.shifting.tick import serving_since

        rules = ShiftRules(rollback_window_s=60.0)
        for phase, since in (
            (Phase.STABLE, None),
            (Phase.WARMING, None),
            (Phase.DEGRADED, None),
            (Phase.DRAINING, 50.0),
            (Phase.SWITCHING, 80.0),  # halfway through the rollback window: the check's initial delay
            (Phase.ROLLING_BACK, None),
        ):
            st = ShiftState(active="a", phase=phase, step_started_at=50.0)
            assert serving_since(st, rules) == since, phase

    def test_arrival_query_adds_the_growth_in_flight_to_completions(self) -> None:
        from gearshift.control.signals import (
            GearSelector,
            arrival_query,
            reading_from_results,
            signal_queries,
        )

        sel = GearSelector("ns", "svc", "prefill", "lat")
        q = signal_queries(sel, "38s")
        assert q.arrivals == arrival_query(sel, "38s") and "[38s]" in q.arrivals and "deriv(" in q.arrivals
        vec = lambda v: [{"metric": {}, "value": [0, v]}]  # noqa: E731
        answers = {x: vec("0") for x in q.all()}
        answers[q.stage_utilization] = [{"metric": {"stage": "0"}, "value": [0, "0.5"]}]  # type: ignore[index]
        answers[q.qps] = vec("3.5")
        answers[q.arrivals] = vec("4.25")  # type: ignore[index]
        assert reading_from_results(1.0, q, answers).sample.arrival_rps == 4.25
        answers[q.arrivals] = vec("-0.5")  # type: ignore[index]  # a draining gear's deriv dips below 0
        assert reading_from_results(1.0, q, answers).sample.arrival_rps == 0.0
        answers[q.arrivals] = []  # type: ignore[index]
        assert reading_from_results(1.0, q, answers).sample.arrival_rps is None

    def test_a_p99_regression_mark_lasts_one_dwell_others_stay(self) -> None:
        from datetime import UTC, datetime

        from gearshift.api.gearset_status import GearHealth
        from gearshift.control.shifting.tick import lasting_marks

        at = datetime.fromtimestamp(1000.0, UTC)
        p99 = GearHealth(gear="thr", healthy=False, reason="P99Regression", since=at)
        oom = GearHealth(gear="big", healthy=False, reason="OOMKilled", since=at)
        rules = ShiftRules(dwell_s=600.0)
        assert lasting_marks([p99, oom], 1599.0, rules) == [p99, oom]
        assert lasting_marks([p99, oom], 1600.0, rules) == [oom]
        assert lasting_marks([p99, oom], 1e9, rules) == [oom]

    def test_an_expired_p99_mark_leaves_status_gear_health(self) -> None:
        # What the shifting handler writes: status.gearHealth keeps only the marks that still bar a gear.
        from datetime import UTC, datetime

        from gearshift.api.gearset_status import GearHealth
        from gearshift.control.shifting.shift_status import records_to_status
        from gearshift.control.shifting.tick import lasting_marks

        at = datetime.fromtimestamp(1000.0, UTC)
        stored = [
            {"gear": "thr", "healthy": False, "reason": "P99Regression", "since": "1970-01-01T00:16:40Z"},
            {"gear": "big", "healthy": False, "reason": "OOMKilled", "since": "1970-01-01T00:16:40Z"},
        ]
        marks = [GearHealth.model_validate(h) for h in stored]
        assert marks[0].since == at
        rules = ShiftRules(dwell_s=600.0)
        for now, kept in ((1599.0, ["thr", "big"]), (1600.0, ["big"])):
            _, health = records_to_status(
                [], stored, [], marks=lasting_marks(marks, now, rules), gears={}, now=now, profiles_hash=None
            )
            assert [h["gear"] for h in health] == kept
