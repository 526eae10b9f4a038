"""What the operator remembers per object between handler calls, the per-object locks, and what it knows
of status writes an older CRD prunes (:class:`PrunedReports`).

Each memory is one object the :class:`~gearshift.handlers.runtime.Runtime` holds, keyed by the object it
is about (``(namespace, name)``; a GPUProfile by name), and forgets an object when the handler that sees
its deletion says so (``forget``). Thread-safe unless a class says otherwise. What is remembered is what
the cluster said or was told last (a generation handled, a status written, an event already emitted, a
node's fingerprint), so a tick every few seconds acts and speaks once per change, not once per tick.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from gearshift.k8s.applied import Applied, ObjectRef

#: A namespaced object: ``(namespace, name)``.
ObjectKey = tuple[str, str]
K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


@dataclass
class _Held:
    lock: threading.Lock = field(default_factory=threading.Lock)
    users: int = 0
    """Threads holding or waiting for ``lock``."""


class KeyedLocks(Generic[K]):
    """One :class:`threading.Lock` per key, kept only while some thread holds or waits for it.

    A key's lock is made by the first :meth:`hold` and dropped when the last holder leaves, so the
    table holds the keys in use now, never every object ever seen; a deleted object leaves nothing.
    """

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._held: dict[K, _Held] = {}

    @contextmanager
    def hold(self, key: K) -> Iterator[None]:
        """Hold ``key``'s lock for the ``with`` block (blocks while another thread holds it)."""
        with self._guard:
            entry = self._held.setdefault(key, _Held())
            entry.users += 1
        try:
            with entry.lock:
                yield
        finally:
            with self._guard:
                entry.users -= 1
                if entry.users == 0:
                    del self._held[key]

    def keys(self) -> set[K]:
        """The keys held or waited for now."""
        with self._guard:
            return set(self._held)


class Phased(Protocol):
    """What :class:`ServiceMemory` reads of a reconcile's outcome: the phase it left the service in."""

    @property
    def phase(self) -> str: ...


OutcomeT = TypeVar("OutcomeT", bound=Phased)


class ServiceMemory(Generic[OutcomeT]):
    """Per PDService ``(namespace, name)``: the last reconcile's outcome (which fleet events concern it),
    the ``windowLeaveBy`` a reconcile already ran for, and the debounced reconcile pending.

    Outcomes and windows are written from kopf's threads; ``pending`` belongs to the event loop.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._outcomes: dict[ObjectKey, OutcomeT] = {}
        self._windows: dict[ObjectKey, str] = {}
        self.pending: dict[ObjectKey, asyncio.Task[None]] = {}
        """The scheduled reconcile per service; the task removes itself when its delay ends."""
        self.tending: dict[tuple[str, ObjectKey], asyncio.Task[None]] = {}
        """The periodic watch per (kind, service), ``retry`` or ``window``; a task removes itself when
        what it watches for is over (event loop only)."""
        self.latest: dict[ObjectKey, Mapping[str, Any]] = {}
        """The PDService's last body the watch delivered (event loop only): what a periodic watch
        decides from, as a kopf timer's ``when`` would."""

    def record(self, key: ObjectKey, outcome: OutcomeT | None) -> dict[str, int]:
        """Remember ``outcome`` (None: forget the service's); returns services per phase, counted under
        the same lock."""
        with self._lock:
            if outcome is None:
                self._outcomes.pop(key, None)
            else:
                self._outcomes[key] = outcome
            phases: dict[str, int] = {}
            for out in self._outcomes.values():
                phases[out.phase] = phases.get(out.phase, 0) + 1
            return phases

    def outcomes(self) -> dict[ObjectKey, OutcomeT]:
        """The last outcome per service (a copy)."""
        with self._lock:
            return dict(self._outcomes)

    def window_handled(self, key: ObjectKey) -> str | None:
        """The ``windowLeaveBy`` a reconcile of ``key`` already ran for."""
        with self._lock:
            return self._windows.get(key)

    def handle_window(self, key: ObjectKey, leave_by: str) -> None:
        """Remember that a reconcile of ``key`` ran at ``leave_by``."""
        with self._lock:
            self._windows[key] = leave_by

    def forget(self, key: ObjectKey) -> None:
        """Drop the service's outcome and window and stop its periodic watches; a pending reconcile
        still runs (it finds it gone)."""
        with self._lock:
            self._outcomes.pop(key, None)
            self._windows.pop(key, None)
        self.latest.pop(key, None)
        for kind_key in [k for k in self.tending if k[1] == key]:
            self.tending.pop(kind_key).cancel()

    def known(self, key: ObjectKey) -> bool:
        """Whether anything of ``key`` is remembered (tests)."""
        with self._lock:
            return key in self._outcomes or key in self._windows


class FleetPrints:
    """What each Node and GPUProfile last looked like to placement (a node's
    :func:`~gearshift.handlers.pdservice.node_fingerprint`, a profile's numbers' hash): a change re-plans
    the services it concerns.

    Event loop only (the fleet handlers are async).
    """

    def __init__(self) -> None:
        self.nodes: dict[str, tuple[Any, ...]] = {}
        self.profiles: dict[str, str] = {}

    def forget_node(self, name: str) -> tuple[Any, ...] | None:
        """Drop a deleted node's print; returns it (None: never seen)."""
        return self.nodes.pop(name, None)

    def forget_profile(self, name: str) -> str | None:
        """Drop a deleted profile's print; returns it (None: never seen)."""
        return self.profiles.pop(name, None)


class ServiceChanges:
    """How many times anything of each PDService ``(namespace, name)`` changed, as the watches delivered it:
    the PDService, its StatefulSets, Deployments and pods. An idle sampling loop sleeps until this count
    moves (or a long heartbeat passes) instead of polling the API on a clock.

    Event loop only (the handlers that count are async).
    """

    def __init__(self) -> None:
        self._counts: dict[ObjectKey, int] = {}

    def bump(self, key: ObjectKey) -> None:
        """Count one change of the service ``key``."""
        self._counts[key] = self._counts.get(key, 0) + 1

    def count(self, key: ObjectKey) -> int:
        """Changes of ``key`` counted so far (0 for one never seen)."""
        return self._counts.get(key, 0)

    def forget(self, key: ObjectKey) -> None:
        """Drop a deleted service's count."""
        self._counts.pop(key, None)


class GearSetMemory:
    """Per GearSet ``(namespace, name)``: the generation last handled (spec changes reconcile the
    PDService), the shifting loop's last hold reason and window warning (events come once, not per
    tick), and the sample instants its loop let pass (``status.signals.missedSamples``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._generations: dict[ObjectKey, int | None] = {}
        self._holds: dict[ObjectKey, str] = {}
        self._windows: dict[ObjectKey, str] = {}
        self._missed: dict[ObjectKey, int] = {}

    def add_missed(self, key: ObjectKey, count: int) -> None:
        """Add ``count`` sample instants the shifting loop let pass (read back by :meth:`missed`)."""
        with self._lock:
            self._missed[key] = self._missed.get(key, 0) + count

    def missed(self, key: ObjectKey) -> int:
        """Sample instants the shifting loop of ``key`` let pass since this process started."""
        with self._lock:
            return self._missed.get(key, 0)

    def new_generation(self, key: ObjectKey, generation: int | None) -> bool:
        """Remember ``generation``; True unless it is the one last remembered (a GearSet never seen counts
        as generation None)."""
        with self._lock:
            if self._generations.get(key) == generation:
                return False
            self._generations[key] = generation
            return True

    def swap_hold(self, key: ObjectKey, reason: str) -> str | None:
        """Remember ``reason`` as the last hold; returns the previous one."""
        with self._lock:
            previous = self._holds.get(key)
            self._holds[key] = reason
            return previous

    def new_window_warning(self, key: ObjectKey, message: str) -> bool:
        """Remember ``message`` as the last window warning; True unless it was the last one."""
        with self._lock:
            if self._windows.get(key) == message:
                return False
            self._windows[key] = message
            return True

    def forget(self, key: ObjectKey) -> None:
        """Drop everything of a deleted GearSet."""
        with self._lock:
            self._generations.pop(key, None)
            self._holds.pop(key, None)
            self._windows.pop(key, None)
            self._missed.pop(key, None)

    def known(self, key: ObjectKey) -> bool:
        """Whether anything of ``key`` is remembered (tests)."""
        with self._lock:
            return any(key in d for d in (self._generations, self._holds, self._windows, self._missed))


class Recent(Generic[T]):
    """One value of the whole fleet that many handler calls read, computed at most once per ``ttl_s`` s
    (monotonic ``clock``): a reader within ``ttl_s`` of the last computation gets its value, the first
    reader after that computes it again. Thread-safe; two readers may compute at once (both results are
    right), the later one is kept."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._value: tuple[float, T] | None = None

    def get(self, compute: Callable[[], T]) -> T:
        """The value computed within the last ``ttl_s`` s, else ``compute()`` (then kept)."""
        now = self._clock()
        with self._lock:
            held = self._value
        if held is not None and now - held[0] < self.ttl_s:
            return held[1]
        value = compute()
        with self._lock:
            self._value = (now, value)
        return value


class AppliedMemory:
    """Per PDService (``(namespace, name)``): what the operator's last server-side apply of each owned
    object left (:class:`~gearshift.k8s.applied.Applied`: the manifest's digest and the object's
    version), so a reconcile applies only what changed (:func:`~gearshift.k8s.applied.needs_apply`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_service: dict[ObjectKey, dict[ObjectRef, Applied]] = {}

    def last(self, service: ObjectKey, obj: ObjectRef) -> Applied | None:
        """What the last apply of ``obj`` of ``service`` left, if remembered."""
        with self._lock:
            return self._by_service.get(service, {}).get(obj)

    def record(self, service: ObjectKey, obj: ObjectRef, applied: Applied) -> None:
        """Remember what an apply of ``obj`` of ``service`` left."""
        with self._lock:
            self._by_service.setdefault(service, {})[obj] = applied

    def drop(self, service: ObjectKey, obj: ObjectRef) -> None:
        """Forget ``obj`` (deleted, or its apply failed: the next reconcile applies it)."""
        with self._lock:
            self._by_service.get(service, {}).pop(obj, None)

    def forget(self, service: ObjectKey) -> None:
        """Drop everything of a deleted PDService."""
        with self._lock:
            self._by_service.pop(service, None)

    def known(self, service: ObjectKey) -> int:
        """How many objects of ``service`` are remembered (tests)."""
        with self._lock:
            return len(self._by_service.get(service, {}))


#: Seconds one reading of the fleet's compute classes serves every GPUProfile's step. A class depends on
#: every node's score (a 1-D k-means over the fleet), so reading the index in each step made one step O(N)
#: and the fleet's steps O(N²): 26% of the operator's CPU while 1,008 nodes were probed
#: (py-spy over bench/fleet_operator.py). A new score reaches the classes within this time.
FLEET_CLASSES_TTL_S = 2.0


class ProfileMemory:
    """Per GPUProfile (cluster-scoped, by name): the last status this process wrote, with its
    resourceVersion (a timer step before the watch delivers it uses it), and whether the profile is known
    to exist (saves a create call on every node heartbeat). For the whole fleet: its compute classes,
    read at most every :data:`FLEET_CLASSES_TTL_S` s (``classes``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._written: dict[str, tuple[int, dict[str, Any]]] = {}
        self._ensured: set[str] = set()
        self.classes: Recent[dict[str, str]] = Recent(FLEET_CLASSES_TTL_S)

    def wrote(self, name: str, resource_version: int, status: Mapping[str, Any]) -> None:
        """Remember the status written to ``name`` and the resourceVersion it got."""
        with self._lock:
            self._written[name] = (resource_version, dict(status))

    def written(self, name: str) -> tuple[int, dict[str, Any]] | None:
        """``(resourceVersion, status)`` last written to ``name``, if any."""
        with self._lock:
            return self._written.get(name)

    def forget_written(self, name: str) -> None:
        """Drop the status last written to ``name``."""
        with self._lock:
            self._written.pop(name, None)

    def ensured(self, name: str) -> bool:
        """Whether the GPUProfile ``name`` is known to exist."""
        with self._lock:
            return name in self._ensured

    def ensure(self, name: str) -> None:
        """Remember that the GPUProfile ``name`` exists."""
        with self._lock:
            self._ensured.add(name)

    def forget(self, name: str) -> None:
        """Drop everything of a deleted GPUProfile."""
        with self._lock:
            self._written.pop(name, None)
            self._ensured.discard(name)

    def known(self, name: str) -> bool:
        """Whether anything of ``name`` is remembered (tests)."""
        with self._lock:
            return name in self._written or name in self._ensured


@dataclass(frozen=True)
class HeldKind:
    """A kind whose installed CRD is older than this operator, as the CRD poller found it: the installed
    schema of ``status`` (what a write keeps) and the message that names the gaps and the fix."""

    status_schema: Mapping[str, Any]
    message: str


class PrunedReports:
    """What this process knows of status pruning (the operator's one lives in its
    :class:`~gearshift.handlers.runtime.Runtime`):

    - ``(uid, paths)`` of status writes an older CRD pruned that were reported: the event and the error
      log come once per object and loss, not per tick;
    - per kind, the installed CRD's status schema while the CRD poller (:mod:`gearshift.handlers.crdwatch`)
      finds it older than the operator: :func:`~gearshift.handlers.common.patch_status` then holds a
      write it would prune;
    - a wake-up for that poller: a pruned write is the earliest sign of a CRD replaced under the operator
      (about a second after the apply, where the next poll may be seconds away), so it reads the CRDs at
      once (:meth:`suspect` calls what :meth:`on_suspect` registered).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: set[tuple[str, tuple[str, ...]]] = set()
        self._held: dict[str, HeldKind] = {}
        self._wake: Callable[[], None] | None = None

    def first(self, uid: str, paths: tuple[str, ...]) -> bool:
        """True the first time ``(uid, paths)`` is seen (remembered)."""
        with self._lock:
            if (uid, paths) in self._seen:
                return False
            self._seen.add((uid, paths))
            return True

    def forget(self, uid: str) -> None:
        """Drop the reports of a deleted object."""
        with self._lock:
            self._seen = {k for k in self._seen if k[0] != uid}

    def known(self, uid: str) -> bool:
        """Whether a report of ``uid`` is remembered (tests)."""
        with self._lock:
            return any(k[0] == uid for k in self._seen)

    def hold(self, kind: str, held: HeldKind | None) -> None:
        """Hold writes of ``kind`` (``GearSet``, ...) that ``held``'s schema would prune; None: release."""
        with self._lock:
            if held is None:
                self._held.pop(kind, None)
            else:
                self._held[kind] = held

    def held(self, kind: str) -> HeldKind | None:
        """What holds writes of ``kind`` now, if anything."""
        with self._lock:
            return self._held.get(kind)

    def on_suspect(self, wake: Callable[[], None] | None) -> None:
        """Register what :meth:`suspect` calls (from any thread; None: nothing)."""
        with self._lock:
            self._wake = wake

    def suspect(self) -> None:
        """A status write was pruned: wake the CRD poller, if one registered."""
        with self._lock:
            wake = self._wake
        if wake is not None:
            wake()
