"""bench/shapes.py: the traffic shapes bench/gears.py replays beside the shipped trace. Each generator is
deterministic for its seed and lands on the published statistics it was fitted to (medians and means
after the clip), and each rate curve has the documented form."""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType

import numpy as np
import pytest

from gearshift.dev.loadgen import DEFAULT_TRACE
from gearshift.dev.twin import load_trace


@pytest.fixture(scope="module")
def s(bench_module: Callable[[str], ModuleType]) -> ModuleType:
    return bench_module("shapes")


class TestLognormalFit:
    def test_median_and_clipped_mean(self, s: ModuleType) -> None:
        mu, sigma = s.lognormal_for(2048.0, 8000, median=1500.0)
        assert math.exp(mu) == pytest.approx(1500.0)
        assert s.clipped_lognormal_mean(mu, sigma, 8000) == pytest.approx(2048.0, rel=1e-6)
        # Without the clip the same median and mean give sigma = sqrt(2 ln(mean/median)); the clip cuts the
        # tail, so the fitted sigma is wider.
        assert sigma > math.sqrt(2 * math.log(2048 / 1500))

    def test_mean_at_a_given_sigma(self, s: ModuleType) -> None:
        mu, sigma = s.lognormal_for(338.0, 2000, sigma=1.0)
        assert sigma == 1.0 and s.clipped_lognormal_mean(mu, 1.0, 2000) == pytest.approx(338.0, rel=1e-6)

    def test_refuses_what_it_cannot_fit(self, s: ModuleType) -> None:
        with pytest.raises(ValueError, match="exactly one"):
            s.lognormal_for(10.0, 100)
        with pytest.raises(ValueError, match="no lognormal"):
            s.lognormal_for(500.0, 100, median=50.0)  # a mean above the clip


class TestGenerators:
    def test_deterministic_for_a_seed(self, s: ModuleType) -> None:
        for name in ("long-prompt", "long-output", "day"):
            a, b = s.make_trace(name, DEFAULT_TRACE), s.make_trace(name, DEFAULT_TRACE)
            assert np.array_equal(a.t, b.t) and np.array_equal(a.prompt, b.prompt), name
            assert np.array_equal(a.output, b.output), name
            c = s.make_trace(name, DEFAULT_TRACE, seed=s.SEED + 1)
            assert not np.array_equal(a.prompt[:50], c.prompt[:50]), name
            assert a.t[0] == 0.0 and np.all(np.diff(a.t) >= 0), name

    def test_long_prompt_matches_the_code_trace(self, s: ModuleType) -> None:
        tr = s.make_trace("long-prompt", DEFAULT_TRACE)
        assert np.median(tr.prompt) == pytest.approx(1500, rel=0.05)
        assert tr.prompt.mean() == pytest.approx(2048, rel=0.05)
        assert np.median(tr.output) == pytest.approx(13, abs=1)
        assert tr.output.mean() == pytest.approx(28, rel=0.1)
        assert tr.prompt.min() >= 1 and tr.prompt.max() <= 8000 and tr.output.max() <= 2000
        assert len(tr.t) / 3600 == pytest.approx(2.5, rel=0.05)

    def test_long_output_matches_sharegpt(self, s: ModuleType) -> None:
        tr = s.make_trace("long-output", DEFAULT_TRACE)
        assert tr.prompt.mean() == pytest.approx(161, rel=0.06)
        assert tr.output.mean() == pytest.approx(338, rel=0.06)
        assert len(tr.t) / 3600 == pytest.approx(1.75, rel=0.06)

    def test_day_resamples_the_conversation_pairs(self, s: ModuleType) -> None:
        tr = s.make_trace("day", DEFAULT_TRACE)
        conv = load_trace(DEFAULT_TRACE)
        pairs = set(zip(conv.prompt.tolist(), conv.output.tolist(), strict=True))
        assert all(p in pairs for p in zip(tr.prompt.tolist(), tr.output.tolist(), strict=True))
        assert tr.duration_s <= s.DAY_REPLAY_S and len(tr.t) / s.DAY_REPLAY_S == pytest.approx(2.4, rel=0.05)
        # The night (hours 2-6) is far quieter than the afternoon (14-18): 0.2x at the extremes.
        h = s.day_hour(tr.t)
        night, day = np.sum((h >= 2) & (h < 6)), np.sum((h >= 14) & (h < 18))
        assert 0.15 < night / day < 0.4

    def test_conversation_is_the_shipped_trace(self, s: ModuleType) -> None:
        assert len(s.make_trace("conversation", DEFAULT_TRACE).t) == len(load_trace(DEFAULT_TRACE).t)
        with pytest.raises(KeyError, match="unknown shape"):
            s.make_trace("nope", DEFAULT_TRACE)


class TestRates:
    def test_each_rate_has_its_mean(self, s: ModuleType) -> None:
        for rate, dur, mean in (
            (s.long_prompt_rate, s.LONG_PROMPT_S, 2.5),
            (s.long_output_rate, s.LONG_OUTPUT_S, 1.75),
            (s.day_rate, s.DAY_REPLAY_S, 2.4),
        ):
            t = np.arange(0.0, dur) + 0.5
            assert float(np.mean(rate(t))) == pytest.approx(mean, rel=1e-3)

    def test_long_prompt_busiest_five_minutes_about_30x_the_quietest(self, s: ModuleType) -> None:
        r = s.long_prompt_rate(np.arange(0.0, 3600.0) + 0.5)
        five = np.convolve(r, np.ones(300) / 300, "valid")
        assert 25 < five.max() / five.min() < 35
        assert 800 < np.argmin(five) + 150 < 1000 and 2300 < np.argmax(five) + 150 < 2500

    def test_long_output_rises_and_falls(self, s: ModuleType) -> None:
        r = s.long_output_rate(np.array([0.0, 1800.0, 3600.0]))
        assert r[1] == pytest.approx(1.75 / 0.65) and r[0] == pytest.approx(0.3 * r[1])
        assert r[2] == pytest.approx(r[0])

    def test_day_trough_at_four_peak_at_sixteen(self, s: ModuleType) -> None:
        t = np.arange(0.0, s.DAY_REPLAY_S, 1.0)
        r = s.day_rate(t)
        assert s.day_hour(t[np.argmin(r)]) == pytest.approx(4.0, abs=0.01)
        assert s.day_hour(t[np.argmax(r)]) == pytest.approx(16.0, abs=0.01)
        assert r.min() / r.max() == pytest.approx(0.2, abs=1e-3)

    def test_poisson_arrivals_follow_the_rate(self, s: ModuleType) -> None:
        rng = np.random.default_rng(1)
        t = s.poisson_arrivals(lambda x: np.where(x < 500.0, 1.0, 9.0), 1000.0, rng)
        first, second = np.sum(t < 500), np.sum(t >= 500)
        assert first == pytest.approx(500, rel=0.15) and second == pytest.approx(4500, rel=0.05)
