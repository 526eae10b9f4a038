"""The operator's runtime: the one object the kopf handlers share.

``gearshift operator`` (:mod:`gearshift.handlers.main`) builds one :class:`Runtime` before kopf starts and
passes it as ``kopf.run(memo=kopf.Memo(runtime=rt))``. kopf gives every handler, daemon, timer and index
a ``memo`` kwarg: the operator-wide root memo for start-up handlers, a shallow copy of it per resource
object for the others, so each one holds the same Runtime (:func:`runtime_of` reads it back, typed).
Handlers hand it, or the part they need, down as a parameter; no handler module keeps state of its own.

What it holds: the reconciler's :class:`Settings` and the probe settings, the one
:class:`~gearshift.adapters.kube.KubeApi` (built from in-cluster credentials or the kubeconfig the first
time it is asked for, unless one was given: tests give a fake), the loops' signal sources
(:mod:`gearshift.adapters.signals`), the caches of slow reads (:mod:`gearshift.adapters.caches`), and the
state kept per object between handler calls, grouped by who keeps it (:mod:`gearshift.adapters.memory`;
a service's is its last :class:`ReconcileOutcome`). Per-object state is forgotten when the object goes
(``forget_*``, called by the handlers that see the deletion); the per-service locks need no forgetting
(:class:`~gearshift.adapters.memory.KeyedLocks` keeps a lock only while it is held or waited for).

Imports no kopf and no handler module that registers kopf handlers: ``gearshift render`` reaches this
module through :mod:`gearshift.handlers.reconcile`, and ``--disable`` must keep a module's handlers off.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from gearshift.adapters.caches import FleetCache, PlanCache, ProbeJobs
from gearshift.adapters.kube import KubeApi, rest_api_from_config
from gearshift.adapters.memory import (
    AppliedMemory,
    FleetPrints,
    GearSetMemory,
    KeyedLocks,
    ObjectKey,
    ProfileMemory,
    PrunedReports,
    ServiceChanges,
    ServiceMemory,
)
from gearshift.adapters.signals import LiveSignals, PrometheusSignals, ScaleSignalSource, SignalSource
from gearshift.control.reconcile.settings import Settings
from gearshift.profiling.settings import ProbeSettings

#: The key of the :class:`Runtime` in kopf's memo.
MEMO_KEY = "runtime"


#: Threads of the GearSet sampling loops (shifting, autoscale, adaptive batch): a tick mostly waits on the
#: API server and Prometheus; a turn that waits for a thread counts its missed samples.
LOOP_WORKERS = 8
#: Threads that carry a reconcile's independent API calls at once, its reads of what it owns and its
#: server-side applies (shared by all reconciles): as many as kopf's workers keep busy with a read each
#: and an apply in flight, and half the API client's connections (``adapters.kube.CONNECTION_POOL_SIZE``).
APPLY_WORKERS = 16


@dataclass
class ReconcileOutcome:
    """What one reconcile of a PDService did (for metrics, logs and tests); the runtime remembers the last
    per service (:attr:`Runtime.services`): which fleet events concern it."""

    applied: int = 0
    deleted: int = 0
    planned: list[str] = field(default_factory=list)
    phase: str = ""
    ready: bool = False
    placed: bool = True
    auto: bool = False
    """Some role plans from GPUProfiles (a fleet change may re-plan it)."""
    nodes: set[str] = field(default_factory=set)
    """Nodes named by the running gears' stages (a change of one of them concerns this service)."""


# --- the runtime ---------------------------------------------------------------------------------------
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
        # The GearSet sampling loops' ticks get threads of their own: in asyncio's default pool they
        # queued 440 ticks deep in front of the event-driven reconciles (a shifting tick waited 360 s for a
        # thread with 110 services, bench/fleet_operator.py), and a user's edit waited behind them.
        self.loop_pool = ThreadPoolExecutor(max_workers=LOOP_WORKERS, thread_name_prefix="gearshift-loop")
        # A reconcile's reads, and its server-side applies that do not depend on one another, go out together.
        self.apply_pool = ThreadPoolExecutor(max_workers=APPLY_WORKERS, thread_name_prefix="gearshift-apply")
        self.services: ServiceMemory[ReconcileOutcome] = ServiceMemory()
        self.changes = ServiceChanges()
        self.applied = AppliedMemory()
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
            gearshift.facts.errors.SettingsError: a ``GEARSHIFT_PROBE_*`` variable is invalid
                (asked again, the environment is read again).
        """
        with self._lock:
            if self._probe is None:
                self._probe = ProbeSettings.from_env(os.environ)
            return self._probe

    def forget_service(self, namespace: str, name: str, uid: str | None = None) -> None:
        """A PDService was deleted: drop its outcome, window, what its objects' applies left and its
        pruned-write reports."""
        self.services.forget((namespace, name))
        self.changes.forget((namespace, name))
        self.applied.forget((namespace, name))
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
