"""Leader election on a ``coordination.k8s.io/v1`` Lease, so that of several operator replicas one acts.

Why not kopf's peering: a peer resumes as soon as its first view of the peering object shows no one of
higher priority, and two replicas started together each first see only themselves, so both handled
resources for about 4 s (#20 row 7; ``kopf/_core/engines/peering.py``, ``process_peering_event``). A Lease
is taken by an optimistic-concurrency write (``resourceVersion``), so two candidates can never both win
the same term, and a standby here does not start kopf at all until it holds the Lease.

The election loop is the kubernetes client's own (``kubernetes.leaderelection``: ``LeaderElection`` with
``LeaseLock``), which follows client-go's ``tools/leaderelection``: a follower takes the Lease when its
holder has not renewed it for ``lease_duration_s`` (timed on the follower's own clock from when it last
saw the record change); a leader that could not renew for ``renew_deadline_s`` stops leading. The
defaults are controller-runtime's (``pkg/leaderelection``: LeaseDuration 15 s, RenewDeadline 10 s,
RetryPeriod 2 s). Added here (:class:`_Leases`, :class:`LeaderElector`): one attempt per Lease request
within a time limit (the client has none and retries three times, so a hung renewal kept a deposed leader
acting beside its successor), every request failure retried and logged instead of ending the campaign, a
watchdog that stops a leader whose last renewal was *sent* more than the renew deadline ago or whose Lease
shows another holder, and a release on clean shutdown (client-go's ``ReleaseOnCancel``: the holder is
cleared, so a standby takes over within one retry period instead of one lease duration).

Needs kubernetes >= 37.0.2: older clients have no ``LeaseLock``, and their renew loop cannot be stopped
(the ``leading_failed`` check that :meth:`LeaderElector.release` relies on).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
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


def default_identity() -> str:
    """``<hostname>_<random>``, as client-go's users build it (hostname + ``_`` + a UUID): in a pod the
    hostname is the pod name, so ``kubectl get lease`` names the pod that leads."""
    host = os.environ.get("HOSTNAME") or socket.gethostname()
    return f"{host}_{uuid.uuid4().hex[:8]}"


class _Released(Exception):
    """Raised in the leading callback to make the client's renew loop stop (its only way out)."""


class _Quiet(logging.Filter):
    """Drop the client's INFO chatter (one line per retry) and its traceback for our own release."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], _Released):
            return False
        return record.levelno >= logging.WARNING or log.isEnabledFor(logging.DEBUG)


class _Leases:
    """The three Lease calls ``LeaseLock`` makes, made safe for an election.

    - one attempt each, within ``timeout_s`` (the client retries a timed-out request three times by
      default, so a hung renewal took 4 × the limit and a deposed leader went on acting);
    - every failure is an ``ApiException`` (a refused connection escaped the client's loop as urllib3's
      ``MaxRetryError`` and ended the campaign), and is logged once until the next success, since the
      client logs its failures at INFO only (a 403 from missing RBAC was otherwise silent);
    - for the watchdog: when the last write naming this replica as holder was *sent* (the server stored it
      no earlier), and the holder of the last read.
    """

    def __init__(self, api: Any, timeout_s: float, identity: str, label: str) -> None:
        self._api, self._timeout, self.identity, self._label = api, timeout_s, identity, label
        self.renewed_at: float | None = None
        self.holder_seen: str | None = None
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

    def _wrote(self, sent: float, lease: Any) -> None:
        holder = lease.spec.holder_identity if lease is not None and lease.spec is not None else None
        if holder == self.identity:
            self.renewed_at, self.holder_seen = sent, holder

    def read_namespaced_lease(self, name: str, namespace: str) -> Any:
        lease = self._call("get", self._api.read_namespaced_lease, name, namespace, quiet=(404,))
        self.holder_seen = lease.spec.holder_identity if lease.spec is not None else None
        return lease

    def create_namespaced_lease(self, namespace: str, body: Any) -> Any:
        sent = time.monotonic()
        lease = self._call("create", self._api.create_namespaced_lease, namespace, body, quiet=(409,))
        self._wrote(sent, lease)
        return lease

    def replace_namespaced_lease(self, name: str, namespace: str, body: Any) -> Any:
        sent = time.monotonic()
        lease = self._call(
            "update",
            self._api.replace_namespaced_lease,
            name=name,
            namespace=namespace,
            body=body,
            quiet=(409,),
        )
        self._wrote(sent, lease)
        return lease


class LeaderElector:
    """Campaign for the Lease ``namespace/name`` in a background thread.

    ``on_lost`` runs once (from a background thread) when this replica led and may lead no longer; the
    operator exits there, as controller-runtime does ("leader election lost"), because kopf's handlers
    cannot be stopped mid-flight from outside. A watchdog calls it, not only the client's renew loop,
    whose deadline starts after a retry-period sleep and whose last try may overrun it:

    - when no renewal naming this replica was sent within the renew deadline: a standby takes the Lease
      no sooner than the lease duration after the server stored that renewal, so the leader stops at
      least ``lease - renew`` s earlier;
    - at once when a read shows another holder (a user deleted or edited the Lease, and a standby took it).
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
    ) -> None:
        import copy

        from kubernetes import client
        from kubernetes.leaderelection import electionconfig, leaderelection
        from kubernetes.leaderelection.resourcelock.leaselock import LeaseLock

        self.namespace, self.name, self.times = namespace, name, times
        self.identity = identity or default_identity()
        self._on_lost = on_lost
        self._leading = threading.Event()
        self._release = threading.Event()
        self._lost = threading.Lock()
        self._done = False
        # A client of its own without urllib3's retries (see _Leases).
        config_copy = copy.deepcopy(api_client.configuration)
        config_copy.retries = False
        self._leases = _Leases(
            client.CoordinationV1Api(client.ApiClient(config_copy)), times.request_timeout_s, self.identity,
            f"{namespace}/{name}",
        )  # fmt: skip
        self._lock = LeaseLock(name, namespace, self.identity)
        self._lock.api_instance = self._leases  # type: ignore[assignment]  # LeaseLock calls only these three methods
        config = electionconfig.Config(
            self._lock,
            lease_duration=times.lease_duration_s,
            renew_deadline=times.renew_deadline_s,
            retry_period=times.retry_period_s,
            onstarted_leading=self._lead,
            onstopped_leading=lambda: self._lose(f"not renewed for {times.renew_deadline_s:g} s"),
        )
        self._election = leaderelection.LeaderElection(config)
        client_log = logging.getLogger("leaderelection")
        if not any(isinstance(f, _Quiet) for f in client_log.filters):
            client_log.addFilter(_Quiet())
        self._thread = threading.Thread(target=self._run, name=f"leader-election {name}", daemon=True)

    def start(self) -> None:
        """Start campaigning (returns at once)."""
        self._thread.start()

    def _run(self) -> None:
        try:
            self._election.run()
        except Exception:
            # _Leases turns every request failure into a retry; anything else is a bug, and a replica
            # that may be leading without renewing must not go on.
            log.exception("leader election for Lease %s/%s failed", self.namespace, self.name)
            self._lose("the campaign failed")

    def _lead(self) -> None:
        threading.Thread(target=self._watch, name=f"leader watchdog {self.name}", daemon=True).start()
        self._leading.set()
        self._release.wait()
        raise _Released

    def _watch(self) -> None:
        while not self._release.wait(self.WATCH_S):
            renewed = self._leases.renewed_at
            if renewed is None or time.monotonic() - renewed > self.times.renew_deadline_s:
                self._lose(f"not renewed for {self.times.renew_deadline_s:g} s")
                return
            holder = self._leases.holder_seen
            if holder and holder != self.identity:
                self._lose(f"now held by {holder}")
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

    @property
    def leading(self) -> bool:
        """Whether this replica holds the Lease (as of its last renewal)."""
        return self._leading.is_set()

    def holder(self) -> str | None:
        """The holder this replica last saw in the Lease (``None`` before its first read, or when free)."""
        record = self._election.observed_record
        return getattr(record, "holder_identity", None) or None

    def wait_leading(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` for leadership; whether this replica leads."""
        return self._leading.wait(timeout_s)

    def release(self) -> None:
        """Stop renewing and, when this replica holds the Lease, clear its holder (client-go's
        ``ReleaseOnCancel``), so a standby takes over at its next try. Idempotent; never raises (a
        failed release only means the standby waits out the lease duration)."""
        if self._release.is_set():
            return
        self._release.set()
        if not self._leading.is_set():
            return  # a standby: its campaign thread dies with the process
        # The renew loop looks at its stop flag once per retry period, after at most one renewal.
        self._thread.join(self.times.retry_period_s + 2 * self.times.request_timeout_s + 1)
        self._leading.clear()
        if self._thread.is_alive():
            # Still retrying a failing renewal: a write now would race it. The standby waits it out.
            log.warning("Lease %s/%s not released: a renewal is still in flight", self.namespace, self.name)
            return
        ok, _ = self._lock.get(self.name, self.namespace)
        lease = self._lock.lease_reference
        if not ok or lease is None or lease.spec is None or lease.spec.holder_identity != self.identity:
            return  # failures were logged by _Leases
        lease.spec.holder_identity = None
        lease.spec.lease_duration_seconds = 1
        try:
            self._leases.replace_namespaced_lease(self.name, self.namespace, lease)
        except Exception:  # logged by _Leases; see the docstring
            return
        log.info("released Lease %s/%s", self.namespace, self.name)
