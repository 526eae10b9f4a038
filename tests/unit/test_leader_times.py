"""Leader-election flags: client-go's rules on the times, and the errors that name the flags."""

from __future__ import annotations

import argparse

import pytest

from gearshift.adapters import leader
from gearshift.adapters.leader import JITTER_FACTOR, LeaseTimes, default_identity
from gearshift.handlers.main import add_arguments, lease_times


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


class TestLeaseTimes:
    def test_controller_runtime_defaults_are_usable(self):
        t = LeaseTimes()
        assert (t.lease_duration_s, t.renew_deadline_s, t.retry_period_s) == (15, 10.0, 2.0)
        assert t.problems() == []
        assert t.request_timeout_s == 5.0

    def test_lease_must_outlast_the_renew_deadline(self):
        (msg,) = LeaseTimes(10, 10, 2).problems()
        assert msg.startswith("--lease-duration (10) must exceed --renew-deadline (10)")

    def test_renew_deadline_needs_more_than_one_try(self):
        # client-go: renewDeadline must exceed JitterFactor (1.2) x retryPeriod; 2.4 is exactly 1.2 x 2.
        assert JITTER_FACTOR == 1.2
        (msg,) = LeaseTimes(15, 2.4, 2).problems()
        assert "--renew-deadline (2.4) must exceed 1.2 × --retry-period (2)" in msg
        assert LeaseTimes(15, 2.5, 2).problems() == []

    def test_sub_second_and_nan_refused(self):
        problems = LeaseTimes(15, 10, 0.5).problems()
        assert problems == ["--retry-period (0.5) must be at least 1 s"]
        assert any("--renew-deadline (nan)" in m for m in LeaseTimes(15, float("nan"), 2).problems())


class TestFlags:
    def test_off_by_default_and_times_not_checked(self):
        args = parse("--lease-duration", "1")
        assert args.leader_elect is False
        assert lease_times(args).lease_duration_s == 1  # unused without --leader-elect

    def test_namespace_from_the_chart_env(self, monkeypatch: pytest.MonkeyPatch):
        monkeypatch.setenv("GEARSHIFT_NAMESPACE", "gearshift-system")
        args = parse("--leader-elect")
        assert (args.leader_election_namespace, args.leader_election_id) == (
            "gearshift-system",
            "gearshift-operator",
        )
        assert lease_times(args) == LeaseTimes()

    def test_missing_namespace_names_the_flag(
        self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ):
        monkeypatch.delenv("GEARSHIFT_NAMESPACE", raising=False)
        with pytest.raises(SystemExit) as exc:
            lease_times(parse("--leader-elect"))
        assert exc.value.code == 2
        assert "--leader-election-namespace: required with --leader-elect" in capsys.readouterr().err

    def test_bad_times_exit_2_with_every_problem(self, capsys: pytest.CaptureFixture[str]):
        args = parse("--leader-elect", "--leader-election-namespace", "x", "--lease-duration", "5",
                     "--renew-deadline", "8")  # fmt: skip
        with pytest.raises(SystemExit) as exc:
            lease_times(args)
        assert exc.value.code == 2
        assert "--lease-duration (5) must exceed --renew-deadline (8)" in capsys.readouterr().err

    def test_lease_duration_is_whole_seconds(self):
        # The Lease's spec.leaseDurationSeconds is an integer.
        with pytest.raises(SystemExit):
            parse("--lease-duration", "1.5")


def test_identity_names_the_pod(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HOSTNAME", "gearshift-7d9f-abcde")
    a, b = default_identity(), default_identity()
    assert a.startswith("gearshift-7d9f-abcde_") and b.startswith("gearshift-7d9f-abcde_") and a != b


def test_recampaign_backoff_doubles_from_4_s_to_60_s_and_resets_after_a_long_term():
    b = leader.Backoff()
    # 4 s doubling, capped at 60 s: 4, 8, 16, 32, 60, 60 (written out, not computed from the class).
    assert [b.delay_s(n) for n in range(0, 8)] == [0.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0]
    assert b.delay_s(10_000) == 60.0  # no overflow on a long run of losses
    # A term shorter than 2 x 60 s continues the run; a longer one (or none) starts it again.
    assert b.next_attempt(3, 119.9) == 4
    assert b.next_attempt(3, 120.0) == 1
    assert b.next_attempt(0, 5.0) == 1
    assert b.next_attempt(5, None) == 6


@pytest.mark.parametrize("name", ["Bad_Name", "a" * 254, ""])
def test_a_lease_name_that_is_no_dns_subdomain_names_the_flag(name: str, capsys: pytest.CaptureFixture[str]):
    args = parse("--leader-elect", "--leader-election-namespace", "x", "--leader-election-id", name)
    with pytest.raises(SystemExit) as exc:
        lease_times(args)
    assert exc.value.code == 2 and "--leader-election-id" in capsys.readouterr().err
    assert lease_times(
        parse("--leader-elect", "--leader-election-namespace", "x", "--leader-election-id", "a.b-c")
    )
