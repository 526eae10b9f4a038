"""Leader election on a ``coordination.k8s.io/v1`` Lease, so that of several operator replicas one acts.

Why not kopf's peering: a peer resumes as soon as its first view of the peering object shows no one of
higher priority, and two replicas started together each first see only themselves, so both handled
resources for about 4 s (``kopf/_core/engines/peering.py``, ``process_peering_event``). A Lease
is taken by an optimistic-concurrency write (``resourceVersion``), so two candidates can never both win
the same term, and a standby here does not start kopf at all until it holds the Lease.

The record and its rules are client-go's ``tools/leaderelection`` (``tryAcquireOrRenew``): a candidate
takes the Lease when it is free or when its holder has not changed the record for the record's
``leaseDurationSeconds``, timed on the candidate's own clock from when it last saw the record change
(client-go's ``observedTime``); ``acquireTime`` and ``leaseTransitions`` change only with the holder; a
leader that could not renew for ``renew_deadline_s`` stops leading. The defaults are controller-runtime's
(``pkg/leaderelection``: LeaseDuration 15 s, RenewDeadline 10 s, RetryPeriod 2 s).

The loop is this module's own (:class:`LeaderElector`), not the kubernetes client's
``kubernetes.leaderelection``, because that one lost the Lease on a starved API server (at
load 30 the leader exited, "not renewed for 10 s"): each of its renewals is a GET then a PUT, and it
sleeps a retry period *after* the renewal returned, so with requests taking 3 s a renewal cycle took
2 × 3 + 2 = 8 s and one slow answer passed the 10 s deadline. Here:

- a renewal is **one PUT** of the Lease this replica last wrote, guarded by its ``resourceVersion`` (a
  409 means someone else wrote it: one GET says whether it still names this replica);
- renewals are **paced from when each was sent**: the next goes ``retry_period_s`` after the previous
  was sent, or at once when that one took longer, so a slow API server delays no renewal beyond its
  own latency;
- one attempt per request within ``request_timeout_s`` (the client has no limit and retries three
  times, so a hung renewal kept a deposed leader acting beside its successor); every failure is retried
  and logged once until the next success;
- a watchdog stops a leader whose last successful renewal was *sent* more than the renew deadline ago
  (a standby takes the Lease no sooner than the lease duration after the server stored it, so the
  leader stops at least ``lease - renew`` s earlier) or whose Lease shows another holder;
- :meth:`LeaderElector.may_act` is that same test, asked by the write fence
  (:mod:`gearshift.adapters.kube`) before every write, so nothing is written between a missed deadline
  and the watchdog's next look;
- a release on clean shutdown (client-go's ``ReleaseOnCancel``): the holder is cleared, so a standby
  takes over within one retry period instead of one lease duration.

While it campaigns, a standby answers ``/healthz`` itself (:func:`standby_health`): kopf, whose endpoint
it is once the replica leads, has not started. What the operator does once the Lease is lost (re-exec
itself after :class:`Backoff`) is in :mod:`gearshift.handlers.main`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("gearshift.leader")

#: client-go's ``JitterFactor``: ``NewLeaderElector`` refuses ``renewDeadline <= JitterFactor * retryPeriod``.
JITTER_FACTOR = 1.2


@dataclass(frozen=True)
class LeaseTimes:
    """How the election is timed, in s. Defaults: controller-runtime's (see the module docstring)."""

    lease_duration_s: int = 15
    renew_deadline_s: float = 10.0
    retry_period_s: float = 2.0

    def problems(self) -> list[str]:
        """What is wrong with these times, each naming the operator flag; ``[]`` when they are usable.

        The rules are client-go's ``NewLeaderElector`` (``leaseDuration > renewDeadline >
        JitterFactor × retryPeriod``) and the kubernetes client's ``electionconfig.Config`` (each ≥ 1 s).
        """
        out = []
        if self.lease_duration_s <= self.renew_deadline_s:
            out.append(
                f"--lease-duration ({self.lease_duration_s}) must exceed --renew-deadline "
                f"({self.renew_deadline_s:g}): a standby must not take the Lease while the leader still acts"
            )
        if self.renew_deadline_s <= JITTER_FACTOR * self.retry_period_s:
            out.append(
                f"--renew-deadline ({self.renew_deadline_s:g}) must exceed {JITTER_FACTOR} × --retry-period "
                f"({self.retry_period_s:g}): the leader needs more than one try before it gives up"
            )
        for flag, value in (
            ("--lease-duration", self.lease_duration_s),
            ("--renew-deadline", self.renew_deadline_s),
            ("--retry-period", self.retry_period_s),
        ):
            if not value >= 1:  # also refuses NaN
                out.append(f"{flag} ({value}) must be at least 1 s")
        return out

    @property
    def request_timeout_s(self) -> float:
        """Time limit of one Lease request: half the renew deadline, so a leader gets at least two tries."""
        return self.renew_deadline_s / 2


@dataclass(frozen=True)
class Backoff:
    """Delay before a replica that lost the Lease campaigns again, in s: ``first_s`` doubling per loss up to
    ``max_s``, back to ``first_s`` once a term lasted ``reset_after_s``.

    The kubelet's container back-off has the same shape (10 s doubling to 300 s, reset after a container
    ran 2 × 300 s without a restart: ``pkg/kubelet/kuberuntime``, ``backOff``); ours starts lower, because
    the campaign that follows is one GET per retry period, not a process start-up, and the re-exec keeps
    the container running, so the kubelet's own back-off never applies (see ``gearshift.handlers.main``).
    ``reset_after_s`` is 2 × ``max_s``, as the kubelet's is.
    """

    first_s: float = 4.0
    max_s: float = 60.0
    reset_after_s: float = 120.0

    def delay_s(self, attempt: int) -> float:
        """Delay before re-campaign ``attempt`` (1: after the first loss of a run of short terms); 0 for 0."""
        if attempt <= 0:
            return 0.0
        return float(min(self.max_s, self.first_s * 2 ** min(attempt - 1, 32)))

    def next_attempt(self, attempt: int, term_s: float | None) -> int:
        """The attempt after a loss: 1 when the lost term lasted ``reset_after_s``, else ``attempt + 1``
        (also when no term began: ``term_s`` None, the campaign itself failed)."""
        if term_s is not None and term_s >= self.reset_after_s:
            return 1
        return attempt + 1


def default_identity() -> str:
    """``<hostname>_<random>``, as client-go's users build it (hostname + ``_`` + a UUID): in a pod the
    hostname is the pod name, so ``kubectl get lease`` names the pod that leads."""
    host = os.environ.get("HOSTNAME") or socket.gethostname()
    return f"{host}_{uuid.uuid4().hex[:8]}"


class _Leases:
    """The three Lease calls the election makes, made safe for it.

    - one attempt each, within ``timeout_s`` (the kubernetes client retries a timed-out request three
      times by default, so a hung renewal took 4 × the limit);
    - every failure is an ``ApiException`` (a refused connection escapes the client as urllib3's
      ``MaxRetryError``), and is logged once until the next success (a 403 from missing RBAC would
      otherwise be retried silently).
    """

    def __init__(self, api: Any, timeout_s: float, label: str) -> None:
        self._api, self._timeout, self._label = api, timeout_s, label
        self._problem: str | None = None

    def _call(
        self, what: str, fn: Callable[..., Any], *args: Any, quiet: tuple[int, ...] = (), **kw: Any
    ) -> Any:
        from kubernetes.client.exceptions import ApiException

        try:
            out = fn(*args, _request_timeout=self._timeout, **kw)
        except ApiException as exc:
            if exc.status not in quiet:
                self._warn(what, f"{exc.status} {exc.reason}")
            raise
        except Exception as exc:
            self._warn(what, f"{type(exc).__name__}: {exc}")
            raise ApiException(status=0, reason=f"{type(exc).__name__}: {exc}") from None
        self._problem = None
        return out

    def _warn(self, what: str, problem: str) -> None:
        if problem != self._problem:
            log.warning("Lease %s: %s failed: %s", self._label, what, problem)
            self._problem = problem

    def read(self, name: str, namespace: str) -> Any:
        return self._call("get", self._api.read_namespaced_lease, name, namespace, quiet=(404,))

    def create(self, namespace: str, body: Any) -> Any:
        return self._call("create", self._api.create_namespaced_lease, namespace, body, quiet=(409,))

    def replace(self, name: str, namespace: str, body: Any) -> Any:
        return self._call(
            "update", self._api.replace_namespaced_lease, name=name, namespace=namespace, body=body,
            quiet=(409,),
        )  # fmt: skip


def _record(lease: Any) -> tuple[Any, ...]:
    """What a candidate compares to see the record change (client-go compares the whole record)."""
    s = lease.spec
    if s is None:
        return ()
    return (s.holder_identity, s.lease_duration_seconds, s.acquire_time, s.renew_time, s.lease_transitions)


def _now() -> datetime:
    return datetime.now(UTC)


class LeaderElector:
    """Campaign for the Lease ``namespace/name`` in a background thread (see the module docstring).

    ``on_lost`` runs once (from a background thread) when this replica led and may lead no longer, or when
    the campaign itself failed; :meth:`may_act` is False from that moment on. ``delay_s`` holds the first
    campaign back (the re-campaign back-off, :class:`Backoff`).
    """

    #: How often the watchdog looks, s.
    WATCH_S = 0.25

    def __init__(
        self,
        api_client: Any,
        namespace: str,
        name: str,
        times: LeaseTimes,
        on_lost: Callable[[], None],
        identity: str | None = None,
        delay_s: float = 0.0,
    ) -> None:
        import copy

        from kubernetes import client

        self.namespace, self.name, self.times = namespace, name, times
        self.identity = identity or default_identity()
        self.delay_s = delay_s
        self._on_lost = on_lost
        self._leading = threading.Event()
        self._release = threading.Event()
        self._lost = threading.Lock()
        self._done = False
        #: monotonic time the last successful write naming this replica was *sent* (the server stored it
        #: no earlier); None before the first.
        self.renewed_at: float | None = None
        #: monotonic time this replica began to lead (None while it does not).
        self.led_since: float | None = None
        self._lease: Any = (
            None  # the Lease as this replica last wrote it (its resourceVersion guards the next PUT)
        )
        self._observed: tuple[Any, ...] | None = None
        self._observed_at = 0.0
        self._holder: str | None = None
        # A client of its own without urllib3's retries (see _Leases).
        config_copy = copy.deepcopy(api_client.configuration)
        config_copy.retries = False
        self._leases = _Leases(
            client.CoordinationV1Api(client.ApiClient(config_copy)), times.request_timeout_s,
            f"{namespace}/{name}",
        )  # fmt: skip
        self._thread = threading.Thread(target=self._run, name=f"leader-election {name}", daemon=True)

    def start(self) -> None:
        """Start campaigning (returns at once)."""
        self._thread.start()

    # --- the campaign ------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self.delay_s > 0 and self._release.wait(self.delay_s):
                return
            while not self._try_acquire():
                if self._release.wait(self.times.retry_period_s):
                    return
            if self._release.is_set():
                return
            self.led_since = time.monotonic()
            self._leading.set()
            threading.Thread(target=self._watch, name=f"leader watchdog {self.name}", daemon=True).start()
            self._renew_loop()
        except Exception:
            # _Leases turns every request failure into a retry; anything else is a bug, and a replica
            # that may be leading without renewing must not go on.
            log.exception("leader election for Lease %s/%s failed", self.namespace, self.name)
            self._lose("the campaign failed")

    def _try_acquire(self) -> bool:
        """One try of client-go's ``tryAcquireOrRenew`` as a candidate: GET, then create or PUT."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        try:
            lease = self._leases.read(self.name, self.namespace)
        except ApiException as exc:
            if exc.status != 404:
                return False
            spec = client.V1LeaseSpec(
                holder_identity=self.identity, lease_duration_seconds=self.times.lease_duration_s,
                acquire_time=_now(), renew_time=_now(), lease_transitions=0,
            )  # fmt: skip
            body = client.V1Lease(
                metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace), spec=spec
            )
            try:
                # Timed from the write's sending, not the GET's: a standby times the lease from when it
                # sees the record change, which is after the server stored this write.
                sent = time.monotonic()
                return self._wrote(sent, self._leases.create(self.namespace, body))
            except ApiException:
                return False
        record = _record(lease)
        if record != self._observed:
            self._observed, self._observed_at = record, time.monotonic()
        spec = lease.spec or client.V1LeaseSpec()
        holder = spec.holder_identity or None
        self._holder = holder
        duration = spec.lease_duration_seconds or self.times.lease_duration_s
        if holder and holder != self.identity and time.monotonic() < self._observed_at + duration:
            return False
        now = _now()
        if holder != self.identity:
            spec.acquire_time = now
            spec.lease_transitions = (spec.lease_transitions or 0) + 1
        spec.holder_identity, spec.renew_time = self.identity, now
        spec.lease_duration_seconds = self.times.lease_duration_s
        lease.spec = spec
        sent = time.monotonic()
        try:
            return self._wrote(sent, self._leases.replace(self.name, self.namespace, lease))
        except ApiException:
            return False

    def _wrote(self, sent: float, lease: Any) -> bool:
        """Record a write's answer; whether it names this replica as holder."""
        holder = lease.spec.holder_identity if lease is not None and lease.spec is not None else None
        self._holder = holder
        if holder != self.identity:
            return False
        self._lease, self.renewed_at = lease, sent
        self._observed, self._observed_at = _record(lease), time.monotonic()
        return True

    def _renew_loop(self) -> None:
        """Renew every ``retry_period_s`` *from when the last renewal was sent*, until released or lost."""
        assert self.renewed_at is not None
        next_at = self.renewed_at + self.times.retry_period_s
        while not self._done:
            if self._release.wait(max(0.0, next_at - time.monotonic())):
                return
            sent = time.monotonic()
            next_at = sent + self.times.retry_period_s
            why = self._renew(sent)
            if why:
                self._lose(why)
                return
            renewed = self.renewed_at or 0.0
            if time.monotonic() - renewed > self.times.renew_deadline_s:
                self._lose(f"not renewed for {self.times.renew_deadline_s:g} s")
                return

    def _renew(self, sent: float) -> str | None:
        """One renewal: a PUT guarded by the ``resourceVersion`` this replica last wrote. ``None`` when
        renewed or worth retrying; why the Lease is lost when an answer shows it is."""
        from kubernetes.client.exceptions import ApiException

        lease = self._lease
        lease.spec.renew_time = _now()
        lease.spec.lease_duration_seconds = self.times.lease_duration_s
        try:
            self._wrote(sent, self._leases.replace(self.name, self.namespace, lease))
            return None
        except ApiException as exc:
            if exc.status not in (404, 409):
                return None  # no answer, or a refusal that says nothing of the holder: retried
        # Someone else wrote the Lease (a user, a successor), or a PUT of ours that timed out was stored
        # after all: one GET says which.
        try:
            current = self._leases.read(self.name, self.namespace)
        except ApiException as exc:
            return "was deleted" if exc.status == 404 else None
        holder = current.spec.holder_identity if current.spec is not None else None
        self._holder = holder or None
        if holder != self.identity:
            return f"now held by {holder}" if holder else "was released by someone else"
        self._lease = current  # ours still: the next PUT (at once, sent now) carries its resourceVersion
        with contextlib.suppress(ApiException):  # logged by _Leases; retried at the next period
            self._wrote(time.monotonic(), self._leases.replace(self.name, self.namespace, current))
        return None

    def _watch(self) -> None:
        while not self._release.wait(self.WATCH_S) and not self._done:
            renewed = self.renewed_at
            if renewed is None or time.monotonic() - renewed > self.times.renew_deadline_s:
                self._lose(f"not renewed for {self.times.renew_deadline_s:g} s")
                return

    def _lose(self, why: str) -> None:
        with self._lost:
            if self._done or self._release.is_set():
                return
            self._done = True
        led = self._leading.is_set()
        self._leading.clear()
        if led:
            log.error("leader election lost: Lease %s/%s %s", self.namespace, self.name, why)
        else:
            log.error("leader election for Lease %s/%s stopped: %s", self.namespace, self.name, why)
        self._on_lost()

    # --- what the operator asks --------------------------------------------------------------------------
    @property
    def leading(self) -> bool:
        """Whether this replica holds the Lease (as of its last renewal)."""
        return self._leading.is_set()

    def may_act(self) -> bool:
        """Whether this replica may write now: it leads, and its last successful renewal was sent within
        the renew deadline (the watchdog's test, asked at the moment of each write, not every 0.25 s)."""
        renewed = self.renewed_at
        return (
            self._leading.is_set()
            and not self._done
            and renewed is not None
            and time.monotonic() - renewed <= self.times.renew_deadline_s
        )

    def holder(self) -> str | None:
        """The holder this replica last saw in the Lease (``None`` before its first read, or when free)."""
        return self._holder

    def wait_leading(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` for leadership; whether this replica leads."""
        return self._leading.wait(timeout_s)

    def release(self) -> None:
        """Stop renewing and, when this replica holds the Lease, clear its holder (client-go's
        ``ReleaseOnCancel``), so a standby takes over at its next try. Idempotent; never raises (a
        failed release only means the standby waits out the lease duration)."""
        from kubernetes.client.exceptions import ApiException

        if self._release.is_set():
            return
        self._release.set()
        if not self._leading.is_set():
            return  # a standby: its campaign thread ends at its next wait
        # The renew loop wakes at once, unless a renewal is in flight (at most one request time limit).
        self._thread.join(self.times.request_timeout_s + 1)
        self._leading.clear()
        if self._thread.is_alive():
            # Still waiting for a renewal's answer: a write now would race it. The standby waits it out.
            log.warning("Lease %s/%s not released: a renewal is still in flight", self.namespace, self.name)
            return
        lease = self._lease
        if lease is None or lease.spec is None or lease.spec.holder_identity != self.identity:
            return
        for _ in range(2):
            lease.spec.holder_identity = None
            lease.spec.lease_duration_seconds = 1
            try:
                self._leases.replace(self.name, self.namespace, lease)
                log.info("released Lease %s/%s", self.namespace, self.name)
                return
            except ApiException as exc:  # other failures were logged by _Leases
                if exc.status != 409:
                    return
            # A stale resourceVersion: a renewal of ours that timed out was stored after all, or someone
            # else wrote the Lease. Release it only if it still names this replica.
            try:
                lease = self._leases.read(self.name, self.namespace)
            except ApiException:
                return
            if lease.spec is None or lease.spec.holder_identity != self.identity:
                return


def standby_health(host: str, port: int, elector: LeaderElector) -> ThreadingHTTPServer:
    """Serve ``GET /healthz`` on ``host:port`` from a daemon thread while this replica stands by: 200 with
    ``{"leader": false, "lease": "<namespace>/<name>", "holder": <the holder's identity or null>}`` (a
    standby is ready to take over), 404 for any other path. The caller shuts it down once it leads (kopf's
    own ``/healthz`` binds the port next).

    Raises:
        OSError: ``host:port`` cannot be bound.
    """

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # http.server's name
            if self.path.split("?")[0] != "/healthz":
                self.send_error(404)
                return
            body = json.dumps({"leader": False, "lease": f"{elector.namespace}/{elector.name}",
                               "holder": elector.holder()}).encode()  # fmt: skip
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:  # the kubelet probes every 10 s
            pass

    server = ThreadingHTTPServer((host, port), Health)
    threading.Thread(target=server.serve_forever, name="standby /healthz", daemon=True).start()
    return server
