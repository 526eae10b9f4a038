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
RetryPeriod 2 s). Added here: a time limit on every Lease request (the client has none, and a hung
renewal would keep a deposed leader acting), and a release on clean shutdown (client-go's
``ReleaseOnCancel``: the holder is cleared, so a standby takes over within one retry period instead of
one lease duration).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
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


class _TimedLeases:
    """The three Lease calls ``LeaseLock`` makes, each with a request time limit."""

    def __init__(self, api: Any, timeout_s: float) -> None:
        self._api, self._timeout = api, timeout_s

    def read_namespaced_lease(self, name: str, namespace: str) -> Any:
        return self._api.read_namespaced_lease(name, namespace, _request_timeout=self._timeout)

    def create_namespaced_lease(self, namespace: str, body: Any) -> Any:
        return self._api.create_namespaced_lease(namespace, body, _request_timeout=self._timeout)

    def replace_namespaced_lease(self, name: str, namespace: str, body: Any) -> Any:
        return self._api.replace_namespaced_lease(
            name=name, namespace=namespace, body=body, _request_timeout=self._timeout
        )


class LeaderElector:
    """Campaign for the Lease ``namespace/name`` in a background thread.

    ``on_lost`` runs (in that thread) when this replica led and could not renew for the renew deadline;
    the operator exits there, as controller-runtime does ("leader election lost"), because kopf's
    handlers cannot be stopped mid-flight from outside.
    """

    def __init__(
        self,
        api_client: Any,
        namespace: str,
        name: str,
        times: LeaseTimes,
        on_lost: Callable[[], None],
        identity: str | None = None,
    ) -> None:
        from kubernetes import client
        from kubernetes.leaderelection import electionconfig, leaderelection
        from kubernetes.leaderelection.resourcelock.leaselock import LeaseLock

        self.namespace, self.name, self.times = namespace, name, times
        self.identity = identity or default_identity()
        self._on_lost = on_lost
        self._leading = threading.Event()
        self._release = threading.Event()
        self._released = False
        self._lock = LeaseLock(name, namespace, self.identity)
        self._lock.api_instance = _TimedLeases(client.CoordinationV1Api(api_client), times.request_timeout_s)  # type: ignore[assignment]  # LeaseLock calls only the three methods _TimedLeases has
        config = electionconfig.Config(
            self._lock,
            lease_duration=times.lease_duration_s,
            renew_deadline=times.renew_deadline_s,
            retry_period=times.retry_period_s,
            onstarted_leading=self._lead,
            onstopped_leading=self._stopped,
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
            # The client's loop only ends by returning; anything else is a bug, and a replica that may
            # be leading without renewing must not go on.
            log.exception("leader election for Lease %s/%s failed", self.namespace, self.name)
            self._stopped()

    def _lead(self) -> None:
        self._leading.set()
        self._release.wait()
        raise _Released

    def _stopped(self) -> None:
        if self._release.is_set():
            return
        self._leading.clear()
        log.error(
            "leader election lost: Lease %s/%s not renewed for %gs", self.namespace, self.name,
            self.times.renew_deadline_s,
        )  # fmt: skip
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
        if self._released:
            return
        self._released = True
        self._release.set()
        if not self._leading.is_set():
            return  # a standby: its campaign thread dies with the process
        # The renew loop looks at its stop flag once per retry period, after at most one renewal.
        self._thread.join(self.times.retry_period_s + 2 * self.times.request_timeout_s + 1)
        self._leading.clear()
        try:
            ok, _ = self._lock.get(self.name, self.namespace)
            lease = self._lock.lease_reference
            if not ok or lease is None or lease.spec is None or lease.spec.holder_identity != self.identity:
                return
            lease.spec.holder_identity = None
            lease.spec.lease_duration_seconds = 1
            self._lock.api_instance.replace_namespaced_lease(self.name, self.namespace, lease)
            log.info("released Lease %s/%s", self.namespace, self.name)
        except Exception as exc:  # see the docstring
            log.warning("could not release Lease %s/%s: %s", self.namespace, self.name, exc)
