"""The PDService handler's window tick (issue 13): one reconcile as soon as ``status.windowLeaveBy`` comes,
instead of up to ``RETRY_S`` later at the retry timer."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from gearshift.handlers import pdservice
from gearshift.handlers.reconcile import NotYet

BY = "2025-01-31T12:01:50+00:00"
AT = datetime(2025, 1, 31, 12, 1, 50, tzinfo=UTC)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    seen: list[tuple[str, str]] = []
    monkeypatch.setattr(pdservice, "run_reconcile", lambda ns, name, body=None: seen.append((ns, name)))
    monkeypatch.setattr(pdservice, "_window_handled", {})
    return seen


def test_reconciles_once_at_leave_by(calls: list[tuple[str, str]]) -> None:
    assert not pdservice.window_tick("ns", "svc", BY, AT - timedelta(seconds=1))
    assert not pdservice.window_tick("ns", "svc", BY, AT + timedelta(milliseconds=500))  # still usable
    assert calls == []
    assert pdservice.window_tick("ns", "svc", BY, AT + timedelta(seconds=1))
    assert calls == [("ns", "svc")]
    for k in range(2, 10):  # later ticks while the node is Leaving: the same value, no more reconciles
        assert not pdservice.window_tick("ns", "svc", BY, AT + timedelta(seconds=2 * k))
    assert calls == [("ns", "svc")]
    # Another service with the same leaveBy is its own entry.
    assert pdservice.window_tick("ns", "other", BY, AT + timedelta(seconds=2))
    assert calls == [("ns", "svc"), ("ns", "other")]


def test_next_leave_by_and_unset(calls: list[tuple[str, str]]) -> None:
    assert pdservice.window_tick("ns", "svc", BY, AT + timedelta(seconds=1))
    later = "2025-01-31T12:10:00+00:00"
    assert not pdservice.window_tick("ns", "svc", later, AT + timedelta(seconds=30))
    assert pdservice.window_tick("ns", "svc", later, datetime(2025, 1, 31, 12, 10, 1, tzinfo=UTC))
    assert not pdservice.window_tick("ns", "svc", None, AT + timedelta(hours=1))
    assert len(calls) == 2


def test_a_failed_reconcile_is_tried_again_at_the_next_tick(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []

    def flaky(ns: str, name: str, body: object = None) -> None:
        seen.append(name)
        if len(seen) == 1:
            raise NotYet("profiles missing")

    monkeypatch.setattr(pdservice, "run_reconcile", flaky)
    monkeypatch.setattr(pdservice, "_window_handled", {})
    assert not pdservice.window_tick("ns", "svc", BY, AT + timedelta(seconds=1))  # failed: logged
    assert pdservice.window_tick("ns", "svc", BY, AT + timedelta(seconds=3))  # tried again, succeeded
    assert not pdservice.window_tick("ns", "svc", BY, AT + timedelta(seconds=5))
    assert seen == ["svc", "svc"]
