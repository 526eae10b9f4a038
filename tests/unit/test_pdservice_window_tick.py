"""The PDService handler's window tick: one reconcile as soon as ``status.windowLeaveBy`` comes,
instead of up to ``RETRY_S`` later at the retry timer."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import kopf
import pytest

from gearshift.adapters.kube import KubeApiError
from gearshift.handlers import pdservice
from gearshift.handlers.runtime import Runtime

BY = "2025-01-31T12:01:50+00:00"
AT = datetime(2025, 1, 31, 12, 1, 50, tzinfo=UTC)


class ReadsApi:
    """An API without PDServices: a reconcile reads the PDService once, finds it gone and succeeds.
    ``fail`` refuses that many reads first (a reconcile that fails)."""

    def __init__(self, fail: int = 0) -> None:
        self.reads: list[tuple[str | None, str]] = []
        self.fail = fail

    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        assert kind == "PDService"
        self.reads.append((namespace, name))
        if self.fail:
            self.fail -= 1
            raise KubeApiError("GET: 503 Service Unavailable", 503)
        return None


@pytest.fixture
def api() -> ReadsApi:
    return ReadsApi()


@pytest.fixture
def rt(api: ReadsApi) -> Runtime:
    return Runtime(api=api)  # type: ignore[arg-type]


def test_reconciles_once_at_leave_by(rt: Runtime, api: ReadsApi) -> None:
    assert not pdservice.window_tick(rt, "ns", "svc", BY, AT - timedelta(seconds=1))
    assert not pdservice.window_tick(rt, "ns", "svc", BY, AT + timedelta(milliseconds=500))  # still usable
    assert api.reads == []
    assert pdservice.window_tick(rt, "ns", "svc", BY, AT + timedelta(seconds=1))
    assert api.reads == [("ns", "svc")]
    for k in range(2, 10):  # later ticks while the node is Leaving: the same value, no more reconciles
        assert not pdservice.window_tick(rt, "ns", "svc", BY, AT + timedelta(seconds=2 * k))
    assert api.reads == [("ns", "svc")]
    # Another service with the same leaveBy is its own entry.
    assert pdservice.window_tick(rt, "ns", "other", BY, AT + timedelta(seconds=2))
    assert api.reads == [("ns", "svc"), ("ns", "other")]


def test_next_leave_by_and_unset(rt: Runtime, api: ReadsApi) -> None:
    assert pdservice.window_tick(rt, "ns", "svc", BY, AT + timedelta(seconds=1))
    later = "2025-01-31T12:10:00+00:00"
    assert not pdservice.window_tick(rt, "ns", "svc", later, AT + timedelta(seconds=30))
    assert pdservice.window_tick(rt, "ns", "svc", later, datetime(2025, 1, 31, 12, 10, 1, tzinfo=UTC))
    assert not pdservice.window_tick(rt, "ns", "svc", None, AT + timedelta(hours=1))
    assert len(api.reads) == 2


def test_a_failed_reconcile_is_tried_again_at_the_next_tick() -> None:
    api = ReadsApi(fail=1)
    rt = Runtime(api=api)  # type: ignore[arg-type]
    assert not pdservice.window_tick(rt, "ns", "svc", BY, AT + timedelta(seconds=1))  # failed: logged
    assert pdservice.window_tick(rt, "ns", "svc", BY, AT + timedelta(seconds=3))  # tried again, succeeded
    assert not pdservice.window_tick(rt, "ns", "svc", BY, AT + timedelta(seconds=5))
    assert api.reads == [("ns", "svc"), ("ns", "svc")]


def test_a_deleted_pdservice_forgets_its_window(rt: Runtime, api: ReadsApi) -> None:
    assert pdservice.window_tick(rt, "ns", "svc", BY, AT + timedelta(seconds=1))
    assert rt.services.window_handled(("ns", "svc")) == BY
    body = {"metadata": {"name": "svc", "namespace": "ns", "uid": "u-svc"}}
    pdservice.pdservice_forget(
        namespace="ns", name="svc", type="DELETED", body=body, memo=kopf.Memo(runtime=rt)
    )  # type: ignore[arg-type]
    assert not rt.services.known(("ns", "svc"))
    # A PDService made again under the name reconciles at its own leaveBy, even the same one.
    assert pdservice.window_tick(rt, "ns", "svc", BY, AT + timedelta(seconds=3))
    assert len(api.reads) == 2
