"""LeaderElector against an in-memory Lease store with the API server's optimistic concurrency.

The election loop is the kubernetes client's own; the store answers as the API server does (404 with a
Status body, 409 on a stale ``resourceVersion`` or an existing name). Times are short but valid
(lease 4 s, renew deadline 2 s, retry 1 s), so each test takes a few seconds.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import MaxRetryError

from gearshift.adapters.leader import LeaderElector, LeaseTimes

TIMES = LeaseTimes(lease_duration_s=4, renew_deadline_s=2, retry_period_s=1)


class Store:
    """One Lease ``ns/lease``; ``fail[identity]`` makes that candidate's calls raise it, after hanging for
    the request's time limit when it is a ``TimeoutError`` (as a hung API server does)."""

    def __init__(self) -> None:
        self.lease: client.V1Lease | None = None
        self.rv = 0
        self.lock = threading.Lock()
        self.fail: dict[str, BaseException] = {}
        self.calls: list[tuple[str, str]] = []

    def api(self, identity: str) -> Any:
        store = self

        class Api:
            def _check(self, what: str, timeout: float | None) -> None:
                store.calls.append((identity, what))
                exc = store.fail.get(identity)
                if isinstance(exc, TimeoutError) and timeout:
                    time.sleep(timeout)
                if exc is not None:
                    raise exc

            def read_namespaced_lease(self, name: str, namespace: str, **kw: Any) -> Any:
                self._check("get", kw.get("_request_timeout"))
                with store.lock:
                    if store.lease is None:
                        e = ApiException(status=404, reason="Not Found")
                        e.body = json.dumps({"kind": "Status", "code": 404})
                        raise e
                    return copy.deepcopy(store.lease)

            def create_namespaced_lease(self, namespace: str, body: Any, **kw: Any) -> Any:
                self._check("create", kw.get("_request_timeout"))
                with store.lock:
                    if store.lease is not None:
                        raise ApiException(status=409, reason="AlreadyExists")
                    return store.put(body)

            def replace_namespaced_lease(self, name: str, namespace: str, body: Any, **kw: Any) -> Any:
                self._check("update", kw.get("_request_timeout"))
                with store.lock:
                    if (
                        store.lease is None
                        or body.metadata.resource_version != store.lease.metadata.resource_version
                    ):
                        raise ApiException(status=409, reason="Conflict")
                    return store.put(body)

        return Api()

    def put(self, body: Any) -> Any:
        self.rv += 1
        lease = copy.deepcopy(body)
        if isinstance(lease.metadata, dict):
            lease.metadata = client.V1ObjectMeta(**lease.metadata)
        lease.metadata.resource_version = str(self.rv)
        self.lease = lease
        return copy.deepcopy(lease)

    def holder(self) -> str | None:
        with self.lock:
            return self.lease.spec.holder_identity if self.lease is not None and self.lease.spec else None


class Candidate:
    def __init__(self, store: Store, identity: str, times: LeaseTimes = TIMES) -> None:
        self.lost_at: float | None = None
        self.elector = LeaderElector(client.ApiClient(), "ns", "lease", times, self._lost, identity=identity)
        self.elector._leases._api = store.api(identity)

    def _lost(self) -> None:
        self.lost_at = time.monotonic()


def wait(pred: Any, timeout: float) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if v := pred():
            return v
        time.sleep(0.05)
    return None


@pytest.fixture()
def store() -> Store:
    return Store()


def test_one_of_two_leads_and_a_release_hands_over(store: Store):
    a, b = Candidate(store, "a"), Candidate(store, "b")
    a.elector.start()
    b.elector.start()
    first = wait(lambda: next((c for c in (a, b) if c.elector.leading), None), 5)
    assert first is not None
    other = b if first is a else a
    time.sleep(TIMES.lease_duration_s + TIMES.retry_period_s)  # longer than a lease: still one leader
    assert first.elector.leading and not other.elector.leading
    assert store.holder() == first.elector.identity
    t0 = time.monotonic()
    first.elector.release()
    assert wait(lambda: other.elector.leading, 5)
    assert time.monotonic() - t0 < TIMES.lease_duration_s  # released, not waited out
    assert first.lost_at is None and other.lost_at is None


def test_a_leader_cut_off_stops_before_the_standby_takes_over(store: Store):
    a = Candidate(store, "a")
    a.elector.start()
    assert wait(lambda: a.elector.leading, 5)
    b = Candidate(store, "b")
    b.elector.start()
    assert wait(lambda: ("b", "get") in store.calls, 5)
    # Every request of the leader now hangs for its time limit (a partition, a hung API server).
    store.fail["a"] = TimeoutError("read timed out")
    cut_at = time.monotonic()
    assert wait(lambda: b.elector.leading, 15)
    b_led_at = time.monotonic()
    assert a.lost_at is not None and a.lost_at < b_led_at, (a.lost_at - cut_at, b_led_at - cut_at)
    # The watchdog: no later than the renew deadline after the last renewal sent (at most a retry period
    # before the cut), plus its own polling.
    assert a.lost_at - cut_at <= TIMES.renew_deadline_s + 0.5
    assert not a.elector.leading


def test_a_connection_error_is_retried_not_fatal(store: Store, caplog: pytest.LogCaptureFixture):
    store.fail["a"] = MaxRetryError(None, "/apis/coordination.k8s.io", "connection refused")  # type: ignore[arg-type]
    a = Candidate(store, "a")
    with caplog.at_level(logging.WARNING, logger="gearshift.leader"):
        a.elector.start()
        assert wait(lambda: sum(1 for c in store.calls if c[0] == "a") >= 3, 10)
        del store.fail["a"]
        assert wait(lambda: a.elector.leading, 5)
    assert a.lost_at is None
    warned = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len(warned) == 1 and "MaxRetryError" in warned[0], warned  # once, not once per retry


def test_a_lease_taken_by_another_stops_the_leader_at_once(store: Store, caplog: pytest.LogCaptureFixture):
    # A renew deadline far beyond the wait below: the stop cannot be the deadline's (the message says why it
    # stopped, too). With a 6 s deadline the wait had to be 3 s, and a loaded CI machine once took longer.
    times = LeaseTimes(lease_duration_s=30, renew_deadline_s=20, retry_period_s=1)
    at_once_s = 8 * times.retry_period_s
    a = Candidate(store, "a", times)
    a.elector.start()
    assert wait(lambda: a.elector.leading, 5)
    with caplog.at_level(logging.ERROR, logger="gearshift.leader"):
        # A user deletes the Lease, and b creates it before a's next renewal.
        store.fail["a"] = TimeoutError("held back")
        with store.lock:
            store.lease = None
        b = Candidate(store, "b", times)
        b.elector.start()
        assert wait(lambda: b.elector.leading, 3)
        del store.fail["a"]
        t0 = time.monotonic()
        assert wait(lambda: a.lost_at, at_once_s)
    assert a.lost_at is not None and a.lost_at - t0 < at_once_s < times.renew_deadline_s
    (msg,) = [r.getMessage() for r in caplog.records if "leader election lost" in r.getMessage()]
    assert msg.endswith("now held by b"), msg
