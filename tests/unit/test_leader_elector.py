"""LeaderElector against an in-memory Lease store with the API server's optimistic concurrency.

The store answers as the API server does (404 with a Status body, 409 on a stale ``resourceVersion`` or
an existing name). Times are short but valid (lease 4 s, renew deadline 2 s, retry 1 s), so each test takes
a few seconds. Also tested: renewals on a slow API server (one PUT each, paced from its sending), the
fence's predicate (:meth:`LeaderElector.may_act`), and what the operator does on a loss (fence, re-exec
with the identity and the back-off; exit 4 only when the exec fails).
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import sys
import threading
import time
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import MaxRetryError

from gearshift.adapters.kube import FENCE, KubeApiError
from gearshift.adapters.leader import LeaderElector, LeaseTimes
from gearshift.adapters.metrics import LEADER_LOSSES
from gearshift.handlers import main
from gearshift.handlers.crds import StaleCRDs

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


# --- Renewals on a starved API server --------------------------------------------------------------------
class Slow(Store):
    """Every call of ``slow`` answers after ``delay_s`` (a starved API server that still answers)."""

    def __init__(self, slow: str, delay_s: float) -> None:
        super().__init__()
        self.slow, self.delay_s = slow, delay_s
        self.sent: list[tuple[str, float]] = []

    def api(self, identity: str) -> Any:
        inner = super().api(identity)
        store = self

        class Api:
            def __getattr__(self, name: str) -> Any:
                fn = getattr(inner, name)

                def call(*args: Any, **kw: Any) -> Any:
                    store.sent.append((name, time.monotonic()))
                    if identity == store.slow:
                        time.sleep(store.delay_s)
                    return fn(*args, **kw)

                return call

        return Api()


def test_a_slow_api_server_costs_no_lease_one_put_per_renewal_paced_from_its_sending():
    # Lease 8 s, renew deadline 5 s, retry 2 s; every request answers after 1.8 s. The kubernetes client's
    # loop renewed with a GET and a PUT and slept the retry period after the answer: 1.8 + 1.8 + 2 = 5.6 s
    # between renewals sent, past the 5 s deadline, so it lost the Lease at its first slow renewal.
    times = LeaseTimes(lease_duration_s=8, renew_deadline_s=5, retry_period_s=2)
    store = Slow("a", 1.8)
    a = Candidate(store, "a", times)
    a.elector.start()
    assert wait(lambda: a.elector.leading, 10)
    led = time.monotonic()
    time.sleep(12)
    assert a.lost_at is None and a.elector.leading and a.elector.may_act()
    renewals = [t for name, t in store.sent if t > led]
    assert {name for name, t in store.sent if t > led} == {"replace_namespaced_lease"}  # no GET
    gaps = [b - a for a, b in itertools.pairwise(renewals)]
    # Sent every 2 s (the retry period from the previous sending), not every 2 + 1.8 s.
    assert len(renewals) >= 5 and all(1.9 <= g <= 2.3 for g in gaps), gaps


def test_a_renewal_slower_than_the_retry_period_is_followed_at_once():
    times = LeaseTimes(lease_duration_s=8, renew_deadline_s=5, retry_period_s=1)
    store = Slow("a", 1.5)  # each PUT takes 1.5 s: longer than the 1 s period
    a = Candidate(store, "a", times)
    a.elector.start()
    assert wait(lambda: a.elector.leading, 10)
    led = time.monotonic()
    time.sleep(7)
    renewals = [t for name, t in store.sent if t > led]
    gaps = [b - a for a, b in itertools.pairwise(renewals)]
    assert a.lost_at is None and len(renewals) >= 4
    assert all(1.45 <= g <= 1.7 for g in gaps), gaps  # the answer's latency, nothing added


def test_a_stale_resource_version_of_our_own_is_no_loss(store: Store):
    # A PUT that timed out on our side but was stored: our cached resourceVersion is stale, the next PUT
    # gets 409, and one GET shows the Lease still names us.
    a = Candidate(store, "a")
    a.elector.start()
    assert wait(lambda: a.elector.leading, 5)
    with store.lock:
        assert store.lease is not None
        store.put(store.lease)  # the server's copy moves on without us seeing its answer
    before = store.rv
    assert wait(lambda: store.rv >= before + 2, 5)  # renewed twice more
    assert a.lost_at is None and a.elector.leading
    assert ("a", "get") in store.calls[-6:]


def test_may_act_turns_false_at_the_deadline_before_the_watchdog_looks(
    store: Store, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(LeaderElector, "WATCH_S", 60.0)  # the watchdog does not look in this test
    a = Candidate(store, "a")
    a.elector.start()
    assert wait(lambda: a.elector.leading, 5)
    assert a.elector.may_act()
    store.fail["a"] = TimeoutError("read timed out")
    cut = time.monotonic()
    assert wait(lambda: not a.elector.may_act(), TIMES.renew_deadline_s + 2)
    # No later than the renew deadline after the last renewal sent (sent before the cut).
    assert time.monotonic() - cut <= TIMES.renew_deadline_s + 0.2


def test_the_first_campaign_waits_the_delay(store: Store):
    a = LeaderElector(client.ApiClient(), "ns", "lease", TIMES, lambda: None, identity="a", delay_s=1.5)
    a._leases._api = store.api("a")
    t0 = time.monotonic()
    a.start()
    assert wait(lambda: a.leading, 5)
    first = store.calls[0]
    assert first == ("a", "get") and time.monotonic() - t0 >= 1.5


def test_a_replica_that_kept_its_identity_takes_its_own_lease_back_at_once(store: Store):
    # After a re-exec the Lease still names this identity, renewed moments ago: client-go's rule lets the
    # holder itself renew at any time, so it waits out no lease duration.
    a = Candidate(store, "a")
    a.elector.start()
    assert wait(lambda: a.elector.leading, 5)
    a.elector._release.set()  # the old image stops without releasing (as an exec does)
    again = Candidate(store, "a")
    t0 = time.monotonic()
    again.elector.start()
    assert wait(lambda: again.elector.leading, 3)
    assert time.monotonic() - t0 < TIMES.lease_duration_s / 2
    lease = store.lease
    assert lease is not None and lease.spec.holder_identity == "a"
    assert lease.spec.lease_transitions == 0  # the same holder: no transition


# --- What the operator does on a loss ---------------------------------------------------------------------
class Execd(Exception):
    """Raised by the stand-in for os.execve: the image would be replaced here."""


class TestReexecOnLoss:
    @pytest.fixture(autouse=True)
    def fence(self) -> Any:
        FENCE.reset()
        yield
        FENCE.reset()

    def lose(
        self,
        monkeypatch: pytest.MonkeyPatch,
        reexec: main.Reexec,
        led_for_s: float | None,
        fail: bool = False,
    ) -> dict[str, Any]:
        seen: dict[str, Any] = {}

        def execve(path: str, argv: list[str], env: dict[str, str]) -> None:
            seen.update(path=path, argv=argv, env=env)
            if fail:
                raise OSError(8, "Exec format error")
            raise Execd

        def _exit(code: int) -> None:
            seen["exit"] = code
            raise Execd

        monkeypatch.setattr(main.os, "execve", execve)
        monkeypatch.setattr(main.os, "_exit", _exit)
        elector = LeaderElector(client.ApiClient(), "ns", "lease", TIMES, lambda: None, identity="pod-1_ab12")
        elector.led_since = None if led_for_s is None else time.monotonic() - led_for_s
        FENCE.guard(lambda: True)
        with pytest.raises(Execd):
            main._lost(elector, reexec)
        return seen

    def test_a_loss_fences_and_re_executes_the_same_command_with_the_identity_and_back_off(
        self, monkeypatch: pytest.MonkeyPatch
    ):
        before = LEADER_LOSSES._value.get()
        seen = self.lose(monkeypatch, main.Reexec(), led_for_s=30.0)
        assert not FENCE.allows("PATCH")  # closed before the exec
        assert seen["path"] == sys.executable and seen["argv"] == list(sys.orig_argv)
        assert "exit" not in seen
        state = json.loads(seen["env"][main.REEXEC_ENV])
        assert state == {"identity": "pod-1_ab12", "attempt": 1, "losses": 1}
        assert LEADER_LOSSES._value.get() == before + 1
        assert main.BACKOFF.delay_s(state["attempt"]) == 4.0

    def test_losses_in_a_row_double_the_back_off_and_a_long_term_resets_it(
        self, monkeypatch: pytest.MonkeyPatch
    ):
        seen = self.lose(monkeypatch, main.Reexec("pod-1_ab12", attempt=2, losses=2), led_for_s=10.0)
        state = json.loads(seen["env"][main.REEXEC_ENV])
        assert (state["attempt"], state["losses"]) == (3, 3) and main.BACKOFF.delay_s(3) == 16.0
        seen = self.lose(monkeypatch, main.Reexec("pod-1_ab12", attempt=4, losses=7), led_for_s=600.0)
        state = json.loads(seen["env"][main.REEXEC_ENV])
        assert (state["attempt"], state["losses"]) == (1, 8)
        # A campaign that never led counts no loss, and continues the run.
        seen = self.lose(monkeypatch, main.Reexec("pod-1_ab12", attempt=1, losses=8), led_for_s=None)
        state = json.loads(seen["env"][main.REEXEC_ENV])
        assert (state["attempt"], state["losses"]) == (2, 8)

    def test_exit_4_only_when_the_exec_fails(self, monkeypatch: pytest.MonkeyPatch):
        seen = self.lose(monkeypatch, main.Reexec(), led_for_s=1.0, fail=True)
        assert seen["exit"] == main.EXIT_LEADERSHIP_LOST == 4
        assert not FENCE.allows("POST")

    def test_the_state_crosses_the_exec_and_leaves_the_environment(self):
        env = {main.REEXEC_ENV: json.dumps({"identity": "pod-1_ab12", "attempt": 3, "losses": 5}), "X": "1"}
        assert main.Reexec.take(env) == main.Reexec("pod-1_ab12", 3, 5)
        assert env == {"X": "1"}
        assert main.Reexec.take(env) == main.Reexec()
        assert main.Reexec.take({main.REEXEC_ENV: "not json"}) == main.Reexec()


def test_a_release_with_a_stale_resource_version_reads_and_still_releases(store: Store):
    a, b = Candidate(store, "a"), Candidate(store, "b")
    a.elector.start()
    assert wait(lambda: a.elector.leading, 5)
    b.elector.start()
    a.elector._release.set()  # stop renewing first, so that nothing moves the version after the next line
    a.elector._thread.join(5)
    a.elector._release.clear()
    with store.lock:
        assert store.lease is not None
        store.put(store.lease)  # the server's copy moved on: a's cached resourceVersion is stale
    t0 = time.monotonic()
    a.elector.release()
    assert store.holder() is None or store.holder() == "b"  # released (b may already have taken it)
    assert wait(lambda: b.elector.leading, 5)
    assert time.monotonic() - t0 < TIMES.lease_duration_s  # released, not waited out


class TestStartUpAfterAReexec:
    """The re-executed operator's first API call (the CRD check) waits for an API server that does not
    answer, instead of exiting: that exit would be the container restart the re-exec avoids."""

    def calls(self, outcomes: list[BaseException | None], retry: bool) -> tuple[int, list[float]]:
        n, slept = 0, []

        def call() -> None:
            nonlocal n
            n += 1
            exc = outcomes.pop(0)
            if exc is not None:
                raise exc

        main._until_answered(call, retry=retry, sleep=slept.append)
        return n, slept

    def test_no_answer_is_tried_again_every_2_s_after_a_reexec(self):
        no_answer: list[BaseException | None] = [
            MaxRetryError(None, "/apis", "connection refused"),  # type: ignore[arg-type]
            KubeApiError("GET /apis/...: 0 timed out", 0),
            KubeApiError("GET /apis/...: 503 Service Unavailable", 503),
            None,
        ]
        assert self.calls(no_answer, retry=True) == (4, [2.0, 2.0, 2.0])

    def test_an_answer_or_a_first_start_fails_at_once(self):
        with pytest.raises(KubeApiError):
            self.calls([KubeApiError("GET: 403 Forbidden", 403), None], retry=True)
        with pytest.raises(StaleCRDs):
            self.calls([StaleCRDs("gearsets: spec.x missing"), None], retry=True)
        with pytest.raises(MaxRetryError):
            self.calls([MaxRetryError(None, "/apis", "refused"), None], retry=False)  # type: ignore[arg-type]
