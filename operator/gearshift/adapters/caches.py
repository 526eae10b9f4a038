"""The caches of what is slow to get: the fleet's and the probe Jobs' listings from the API server, and the
plans made from them.

Each is one object the :class:`~gearshift.handlers.runtime.Runtime` holds for every handler thread
(thread-safe): :class:`FleetCache` serves the Nodes and GPUProfiles a reconcile reads, :class:`ProbeJobs`
the probe Jobs and their pods every GPUProfile's step reads, :class:`PlanCache` the gears planned for an
inputs hash. The listings are read through the :class:`~gearshift.adapters.kube.KubeApi` they are given and
raise its :class:`~gearshift.adapters.kube.KubeApiError`.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from gearshift.adapters.kube import GPUP, JOB, NODE, POD, KubeApi
from gearshift.api.gearset import Gear

#: Seconds a read of the fleet (Nodes, GPUProfiles) serves other reconciles. Every change a reconcile reads
#: drops it at once (``fleet_node_changed``/``fleet_profile_changed`` compare fingerprints of what placement
#: reads), so this only bounds how stale something read but not fingerprinted can be. At 2 s each of 410
#: reconciles on a 1,008-node fleet listed the whole fleet again (9 MB of JSON, bench/fleet_operator.py).
FLEET_TTL_S = 60.0
#: Plans kept in memory, keyed by their inputs hash (many PDServices of one model share a fleet).
PLAN_CACHE_SIZE = 128

#: ``(nodes, profiles)``, each a body by name.
Fleet = tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]


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
    """The last ``size`` plans made, by inputs hash: a :data:`gearshift.control.reconcile.PlanMemo`.

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
