"""The operator's runtime: the one object the kopf handlers share.

``gearshift operator`` (:mod:`gearshift.handlers.main`) builds one :class:`Runtime` before kopf starts and
passes it as ``kopf.run(memo=kopf.Memo(runtime=rt))``. kopf gives every handler, daemon, timer and index
a ``memo`` kwarg: the operator-wide root memo for start-up handlers, a shallow copy of it per resource
object for the others, so each one holds the same Runtime (:func:`runtime_of` reads it back, typed).
Handlers hand it, or the part they need, down as a parameter; no handler module keeps state of its own.

What it holds: the reconciler's :class:`Settings` and the probe settings, the one
:class:`~gearshift.handlers.kubeapi.KubeApi` (built from in-cluster credentials or the kubeconfig the first
time it is asked for, unless one was given: tests give a fake), the loops' signal sources, and the state
kept per object between handler calls, grouped by who keeps it. Per-object state is forgotten when the
object goes (``forget_*``, called by the handlers that see the deletion); the per-service locks need no
forgetting (:class:`KeyedLocks` keeps a lock only while it is held or waited for).

Imports no kopf and no handler module that registers kopf handlers: ``gearshift render`` reaches this
module through :mod:`gearshift.handlers.reconcile`, and ``--disable`` must keep a module's handlers off.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from gearshift.api.gearset import Gear
from gearshift.handlers.common import PrunedReports
from gearshift.handlers.kubeapi import GPUP, JOB, NODE, POD, KubeApi, RestKubeApi
from gearshift.handlers.signals import LiveSignals, PrometheusSignals, ScaleSignalSource, SignalSource
from gearshift.k8s.desired import Images
from gearshift.profiling.settings import ProbeSettings

if TYPE_CHECKING:  # reconcile imports this module (its Settings)
    from gearshift.handlers.reconcile import ReconcileOutcome

#: The key of the :class:`Runtime` in kopf's memo.
MEMO_KEY = "runtime"
#: Seconds a read of the fleet (Nodes, GPUProfiles) serves other reconciles. Every change a reconcile reads
#: drops it at once (``fleet_node_changed``/``fleet_profile_changed`` compare fingerprints of what placement
#: reads), so this only bounds how stale something read but not fingerprinted can be. At 2 s each of 410
#: reconciles on a 1,008-node fleet listed the whole fleet again (9 MB of JSON, bench/fleet_operator.py).
FLEET_TTL_S = 60.0
#: Plans kept in memory, keyed by their inputs hash (many PDServices of one model share a fleet).
PLAN_CACHE_SIZE = 128

#: A namespaced object: ``(namespace, name)``.
ObjectKey = tuple[str, str]
K = TypeVar("K", bound=Hashable)
Fleet = tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]


@dataclass(frozen=True)
class Settings:
    """Operator-wide settings (from ``gearshift operator`` flags)."""

    images: Images = field(default_factory=Images)
    prometheus_url: str | None = None
    sim_requests: int = 500
    """Requests per planner simulation run (bounds planning time per gear candidate)."""
    namespaces: tuple[str, ...] = ()
    """The namespaces served (``--namespace``, globs as kopf allows them); empty: all."""
    profiles: bool = True
    """Whether this operator writes GPUProfiles (False under ``--disable gearshift.handlers.gpuprofile``)."""


# --- keyed locks ---------------------------------------------------------------------------------------
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


# --- caches --------------------------------------------------------------------------------------------
class FleetCache:
    """The fleet, ``(nodes, profiles)`` by name, read at most every ``ttl_s`` s (monotonic clock) and
    dropped by :meth:`forget` on every change that matters.

    One entry, for the API it was read from: another API object reads afresh. A read that a
    :meth:`forget` overtook (the lists were sent before the change arrived) is returned but not kept:
    kept, it would serve the fleet before the change for up to ``ttl_s``.
    """

    def __init__(self, ttl_s: float = FLEET_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._entry: tuple[KubeApi, float, Fleet] | None = None
        self._generation = 0

    def read(self, api: KubeApi) -> Fleet:
        """``(nodes, profiles)`` by name: the cached read when it is younger than ``ttl_s`` s, else the
        lists of ``api`` (kept unless a :meth:`forget` came meanwhile). Raises KubeApiError from the lists."""
        now = self._clock()
        with self._lock:
            hit, generation = self._entry, self._generation
        if hit is not None and hit[0] is api and now - hit[1] < self.ttl_s:
            return hit[2]
        nodes = {n["metadata"]["name"]: n for n in api.list(*NODE)}
        profiles = {p["metadata"]["name"]: p for p in api.list(*GPUP)}
        with self._lock:
            if self._generation == generation:
                self._entry = (api, now, (nodes, profiles))
        return nodes, profiles

    def forget(self) -> None:
        """Drop the cached fleet (a Node or GPUProfile changed), and any read in flight with it."""
        with self._lock:
            self._entry = None
            self._generation += 1


#: Seconds a listing of the probe Jobs and their pods serves every GPUProfile's step (its tick is 2 s).
PROBE_JOBS_TTL_S = 1.0


class ProbeJobs:
    """The probe Jobs of one namespace and their pods, by Job name, listed at most every ``ttl_s`` s and
    shared by every GPUProfile's step.

    A profile whose probe runs reads its Job and the Job's pods on every step (2 s). Read one by one, a
    fleet probing 1,000 nodes at once made 1,000 GETs and 1,000 label-selected pod LISTs every 2 s, each LIST
    filtering all 1,000 probe pods in the API server: O(probes²) work, and through the operator's 8 handler
    threads a finished probe waited 95 s (P99) for its profile's step (bench/fleet_operator.py). Two LISTs
    a second serve them all. A Job this process created after the listing is not in it: :meth:`job` then
    reads it directly, so a young Job never looks lost.
    """

    def __init__(self, ttl_s: float = PROBE_JOBS_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._entry: tuple[KubeApi, str, float, dict[str, Any], dict[str, list[Any]]] | None = None

    def job(
        self, api: KubeApi, namespace: str, name: str, labels: Mapping[str, str]
    ) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """The Job ``name`` and its pods (``(None, [])`` when it is gone), from a listing of the Jobs and
        pods labelled ``labels`` in ``namespace`` younger than ``ttl_s`` s. Raises KubeApiError."""
        now = self._clock()
        with self._lock:
            hit = self._entry
            fresh = hit is not None and hit[0] is api and hit[1] == namespace and now - hit[2] < self.ttl_s
            if not fresh:
                # Under the lock: the threads that find the listing stale wait for one read, not one each.
                jobs = {j["metadata"]["name"]: j for j in api.list(*JOB, namespace, labels)}
                pods: dict[str, list[Any]] = {}
                for pod in api.list(*POD, namespace, labels):
                    owner = ((pod.get("metadata") or {}).get("labels") or {}).get(JOB_NAME_LABEL, "")
                    pods.setdefault(owner, []).append(pod)
                hit = self._entry = (api, namespace, now, jobs, pods)
        assert hit is not None
        job = hit[3].get(name)
        if job is None:
            # Created after the listing (or gone): read it and its pods directly.
            job = api.get(*JOB, namespace, name)
            if job is None:
                return None, []
            return job, api.list(*POD, namespace, {JOB_NAME_LABEL: name})
        return job, list(hit[4].get(name, []))


#: The label the Job controller puts on a Job's pods.
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"


class PlanCache:
    """The last ``size`` plans made, by inputs hash: a :data:`gearshift.control.reconcile.state.PlanMemo`.

    Keyed by what a plan reads, not by object: many PDServices of one model share a plan, and the size
    bounds it (least recently used go first).
    """

    def __init__(self, size: int = PLAN_CACHE_SIZE) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._plans: OrderedDict[str, list[Gear]] = OrderedDict()

    def __call__(self, key: str, plan: Callable[[], list[Gear]]) -> list[Gear]:
        """The gears of the plan with inputs hash ``key``: kept, else ``plan()``'s, kept. A copy."""
        with self._lock:
            if key in self._plans:
                self._plans.move_to_end(key)
                return list(self._plans[key])
        gears = plan()
        with self._lock:
            self._plans[key] = gears
            while len(self._plans) > self.size:
                self._plans.popitem(last=False)
        return list(gears)

    def __len__(self) -> int:
        with self._lock:
            return len(self._plans)


# --- per-object memory ---------------------------------------------------------------------------------
class ServiceMemory:
    """Per PDService ``(namespace, name)``: the last reconcile's outcome (which fleet events concern it),
    the ``windowLeaveBy`` a reconcile already ran for, and the debounced reconcile pending.

    Outcomes and windows are written from kopf's threads; ``pending`` belongs to the event loop.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._outcomes: dict[ObjectKey, ReconcileOutcome] = {}
        self._windows: dict[ObjectKey, str] = {}
        self.pending: dict[ObjectKey, asyncio.Task[None]] = {}
        """The scheduled reconcile per service; the task removes itself when its delay ends."""

    def record(self, key: ObjectKey, outcome: ReconcileOutcome | None) -> dict[str, int]:
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

    def outcomes(self) -> dict[ObjectKey, ReconcileOutcome]:
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
        """Drop the service's outcome and window; a pending reconcile still runs (it finds it gone)."""
        with self._lock:
            self._outcomes.pop(key, None)
            self._windows.pop(key, None)

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


class ProfileMemory:
    """Per GPUProfile (cluster-scoped, by name): the last status this process wrote, with its
    resourceVersion (a timer step before the watch delivers it uses it), and whether the profile is known
    to exist (saves a create call on every node heartbeat)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._written: dict[str, tuple[int, dict[str, Any]]] = {}
        self._ensured: set[str] = set()

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


# --- the runtime ---------------------------------------------------------------------------------------
def rest_api_from_config() -> RestKubeApi:
    """A :class:`RestKubeApi` over in-cluster credentials, else ``$KUBECONFIG`` / ``~/.kube/config``.

    Raises:
        kubernetes.config.ConfigException: neither is there.
    """
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return RestKubeApi(client.ApiClient())


class Runtime:
    """Everything the operator's handlers share (see the module docstring). Thread-safe.

    Args:
        settings: the reconciler's settings (images, Prometheus URL, planning effort).
        api: the API to use (tests: a fake); None: :attr:`api` builds one the first time.
        probe: the profiling settings; None: read from the environment the first time they are asked
            for (:meth:`probe_settings`), as the GPUProfile handlers' start-up check does.
        shift_signals, scale_signals: where the shifting loop and the autoscaler sample.
        plans: the plan cache (tests share one across runtimes: planning takes seconds).
    """

    def __init__(
        self,
        *,
        settings: Settings | None = None,
        api: KubeApi | None = None,
        probe: ProbeSettings | None = None,
        shift_signals: SignalSource | None = None,
        scale_signals: ScaleSignalSource | None = None,
        plans: PlanCache | None = None,
    ) -> None:
        self.settings = settings or Settings()
        self.shift_signals: SignalSource = shift_signals or PrometheusSignals()
        self.scale_signals: ScaleSignalSource = scale_signals or LiveSignals()
        self.plans = plans if plans is not None else PlanCache()
        self.fleet = FleetCache()
        self.service_locks: KeyedLocks[ObjectKey] = KeyedLocks()
        """Serialise the work on one PDService: kopf's threads, fleet triggers, the gear executor."""
        self.services = ServiceMemory()
        self.gearsets = GearSetMemory()
        self.profiles = ProfileMemory()
        self.probe_jobs = ProbeJobs()
        self.fleet_prints = FleetPrints()
        self.pruned = PrunedReports()
        self._lock = threading.Lock()
        self._api = api
        self._probe = probe

    @property
    def api(self) -> KubeApi:
        """The API: the one given, else a :func:`rest_api_from_config` built on first use (then kept).

        Raises:
            kubernetes.config.ConfigException: no API was given and no credentials are found.
        """
        with self._lock:
            if self._api is None:
                self._api = rest_api_from_config()
            return self._api

    def probe_settings(self) -> ProbeSettings:
        """The profiling settings: the ones given, else read from the environment once.

        Raises:
            gearshift.profiling.settings.SettingsError: a ``GEARSHIFT_PROBE_*`` variable is invalid
                (asked again, the environment is read again).
        """
        with self._lock:
            if self._probe is None:
                self._probe = ProbeSettings.from_env(os.environ)
            return self._probe

    def forget_service(self, namespace: str, name: str, uid: str | None = None) -> None:
        """A PDService was deleted: drop its outcome, window and pruned-write reports."""
        self.services.forget((namespace, name))
        if uid:
            self.pruned.forget(uid)

    def forget_gearset(self, namespace: str, name: str, uid: str | None = None) -> None:
        """A GearSet was deleted: drop its generation, hold and window memory and pruned-write reports."""
        self.gearsets.forget((namespace, name))
        if uid:
            self.pruned.forget(uid)

    def forget_profile(self, name: str, uid: str | None = None) -> None:
        """A GPUProfile was deleted: drop its last written status, that it exists and its pruned-write
        reports."""
        self.profiles.forget(name)
        if uid:
            self.pruned.forget(uid)


def runtime_of(memo: Mapping[str, Any]) -> Runtime:
    """The :class:`Runtime` in kopf's ``memo`` (the handlers' ``memo`` kwarg).

    Raises:
        LookupError: the memo holds none: kopf was started without ``memo=kopf.Memo(runtime=...)`` (run
            the operator with ``gearshift operator``, which builds it).
    """
    rt = memo.get(MEMO_KEY)
    if not isinstance(rt, Runtime):
        raise LookupError(
            "kopf's memo holds no gearshift Runtime: start the operator with `gearshift operator` "
            "(gearshift.handlers.main builds one and passes kopf.run(memo=kopf.Memo(runtime=...)))"
        )
    return rt
