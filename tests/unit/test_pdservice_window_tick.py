"""The PDService handler's window tick: one reconcile as soon as ``status.windowLeaveBy`` comes,
instead of up to ``RETRY_S`` later at the retry timer."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

import kopf
import pytest

from gearshift.adapters.kube import KubeApiError
from gearshift.api.common import GROUP, VERSION
from gearshift.handlers import pdservice
from gearshift.handlers.runtime import Runtime
from gearshift.k8s import names

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


async def test_a_deleted_pdservice_forgets_its_window(rt: Runtime, api: ReadsApi) -> None:
    assert pdservice.window_tick(rt, "ns", "svc", BY, AT + timedelta(seconds=1))
    assert rt.services.window_handled(("ns", "svc")) == BY
    body = {"metadata": {"name": "svc", "namespace": "ns", "uid": "u-svc"}}
    await pdservice.pdservice_seen(
        namespace="ns", name="svc", type="DELETED", body=body, memo=kopf.Memo(runtime=rt)
    )  # type: ignore[arg-type]
    assert not rt.services.known(("ns", "svc"))
    # A PDService made again under the name reconciles at its own leaveBy, even the same one.
    assert pdservice.window_tick(rt, "ns", "svc", BY, AT + timedelta(seconds=3))
    assert len(api.reads) == 2


def _body(status: dict[str, Any], generation: int = 1) -> dict[str, Any]:
    return {
        "metadata": {"name": "svc", "namespace": "ns", "uid": "u-svc", "generation": generation},
        "status": status,
    }


async def _until(done: Any) -> None:
    """Poll ``done`` (the tasks under test signal nothing) for at most 5 s."""
    deadline = asyncio.get_running_loop().time() + 5
    while not done():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def _seen(rt: Runtime, body: dict[str, Any], type: str | None = "MODIFIED") -> None:
    await pdservice.pdservice_seen(
        namespace="ns", name="svc", type=type, body=body, memo=kopf.Memo(runtime=rt)
    )  # type: ignore[arg-type]


async def test_a_service_that_needs_attention_is_retried_until_it_does_not(
    rt: Runtime, api: ReadsApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The retry watch reconciles every RETRY_S while the last body lags, is Pending or Degraded, and
    ends by itself once the body is Ready and current; events while it runs start no second one."""
    fast = {"retry": (0.01, pdservice.needs_retry, pdservice._retry), "window": pdservice._TENDERS["window"]}
    monkeypatch.setattr(pdservice, "_TENDERS", fast)
    await _seen(rt, _body({}))  # new: no status, so behind its generation
    await _seen(rt, _body({"phase": "Pending", "observedGeneration": 1}))
    (task,) = rt.services.tending.values()
    await _until(lambda: len(api.reads) >= 3)
    await _seen(rt, _body({"phase": "Ready", "observedGeneration": 1}))
    await asyncio.wait_for(task, 1)
    assert rt.services.tending == {}
    reads = len(api.reads)
    await asyncio.sleep(0.05)
    assert len(api.reads) == reads  # no reconcile once it is over
    await _seen(rt, _body({"phase": "Ready", "observedGeneration": 1}, generation=2))  # edited: again
    assert list(rt.services.tending) == [("retry", ("ns", "svc"))]
    await _seen(rt, _body({}), type="DELETED")
    assert rt.services.tending == {} and rt.services.latest == {}
    await asyncio.sleep(0.05)
    assert task.done()


async def test_a_windowed_service_reconciles_at_its_leave_by(
    rt: Runtime, api: ReadsApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The window watch reads leaveBy from the last body and reconciles once when it has come."""
    tenders = {
        "retry": (3600.0, pdservice.needs_retry, pdservice._retry),
        "window": (0.01, pdservice.windowed, pdservice._window),
    }
    monkeypatch.setattr(pdservice, "_TENDERS", tenders)
    past = "2025-01-31T12:00:00+00:00"
    await _seen(rt, _body({"phase": "Ready", "observedGeneration": 1, "windowLeaveBy": past}))
    assert sorted(k for k, _ in rt.services.tending) == ["retry", "window"]  # the vacate is followed too
    await _until(lambda: rt.services.window_handled(("ns", "svc")) == past)
    await asyncio.sleep(0.05)
    assert len(api.reads) == 1  # once per leaveBy
    await _seen(rt, _body({"phase": "Ready", "observedGeneration": 1}))
    await _until(lambda: ("window", ("ns", "svc")) not in rt.services.tending)
    await _seen(rt, _body({}), type="DELETED")


def test_no_pdservice_handler_makes_kopf_add_a_finalizer() -> None:
    """kopf adds its finalizer to an object that a timer, a daemon or a mandatory delete handler serves,
    one PATCH and one watch event before the create handler of a new PDService runs."""
    registry = kopf.get_default_registry()
    resource = kopf.Resource(
        GROUP, VERSION, pdservice.PLURAL, kind="PDService", namespaced=True, preferred=True
    )
    handlers = [
        h
        for reg in (registry._spawning, registry._changing)
        for h in reg.get_all_handlers()
        if h.selector is not None and h.selector.check(resource)
    ]
    assert {h.id for h in handlers} >= {"pdservice_reconcile"}
    assert [h.id for h in handlers if h.requires_finalizer] == []


async def test_the_service_s_events_are_counted_for_the_idle_loops(rt: Runtime) -> None:
    memo = kopf.Memo(runtime=rt)
    key = ("ns", "svc")
    labels = {names.LABEL_SERVICE: "svc"}
    await pdservice.owned_pod_changed(namespace="ns", labels=labels, memo=memo)  # type: ignore[arg-type]
    await pdservice.owned_pod_changed(namespace="ns", labels={}, memo=memo)  # type: ignore[arg-type]  # a probe pod
    assert rt.changes.count(key) == 1
    await _seen(rt, _body({"phase": "Ready", "observedGeneration": 1}))
    assert rt.changes.count(key) == 2
    await _seen(rt, _body({}), type="DELETED")
    assert rt.changes.count(key) == 0
