"""kopf handlers of PDServices, and the gear operations the gear executor calls.

Thin: every handler ends in :func:`gearshift.handlers.reconcile.reconcile_service` (run in a thread, the
``kubernetes`` client being synchronous). What triggers a reconcile:

- the PDService is created, resumed (operator start) or its spec/metadata changes (kopf's create, resume
  and update causes);
- every :data:`RETRY_S` while the PDService's status lags its generation or its phase is Pending or
  Degraded (placement failed, a profile missing, a node lost): :func:`tend`, not a kopf timer, so a
  PDService carries no finalizer;
- a time-limited node's ``leaveBy`` (``status.windowLeaveBy``), within :data:`WINDOW_TICK_S`;
- an owned StatefulSet or router Deployment changes (status refresh, debounced);
- a GearSet's spec changes (:mod:`gearshift.handlers.gearset`);
- the fleet changes: a Node's readiness, schedulability, GPU count or labels, or a GPUProfile's numbers
  (debounced; only services that plan from profiles, are not placed/ready, or run on that node).

The gear executor (:mod:`gearshift.handlers.shifting`) acts on a role's objects through
:mod:`gearshift.handlers.reconcile`'s ``ensure_gear_sync``, ``select_gear_sync`` and ``delete_gear_sync``,
under the reconciler's per-service lock.

What these handlers remember between calls (each service's last outcome and handled window, the pending
debounced reconciles, the fleet's prints) is the :class:`~gearshift.handlers.runtime.Runtime`'s, which
kopf hands every handler in its ``memo``; a deleted PDService's entries go with it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any

import kopf

from gearshift.adapters import metrics
from gearshift.adapters.kube import KubeApiError
from gearshift.api.common import GROUP, VERSION, inputs_hash
from gearshift.control.reconcile.state import SpecInvalid
from gearshift.control.windows import leave_by_due
from gearshift.handlers.common import StatusPruned
from gearshift.handlers.reconcile import NotYet, reconcile_service
from gearshift.handlers.runtime import ReconcileOutcome, Runtime, runtime_of
from gearshift.k8s import names
from gearshift.planner.inputs import node_gpus, node_ready, usable_profile

log = logging.getLogger(__name__)

PLURAL = "pdservices"
#: Seconds between retries of a PDService that is not Ready (placement pending, pods rolling out).
RETRY_S = 30.0
#: Coalescing window of reconciles triggered by owned-object and fleet events, s.
DEBOUNCE_S = 1.0
#: Retry delay after an API error, s.
API_ERROR_DELAY_S = 5.0
#: Seconds before a reconcile whose status write an older CRD pruned, or that was held for one, is tried
#: again: twice the CRD poll (gearshift.handlers.crdwatch), so a reconcile resumes soon after the fix.
STATUS_HELD_DELAY_S = 10.0
#: How often a PDService that uses a time-limited node checks whether its leaveBy has come, s.
WINDOW_TICK_S = 2.0


def known_services(rt: Runtime) -> dict[tuple[str, str], ReconcileOutcome]:
    """The last outcome per ``(namespace, name)`` (a copy)."""
    return rt.services.outcomes()


def _record(rt: Runtime, namespace: str, name: str, outcome: ReconcileOutcome | None) -> None:
    gone = outcome is None or outcome.phase in ("Deleted", "Deleting")
    phases = rt.services.record((namespace, name), None if gone else outcome)
    for phase in ("Pending", "Progressing", "Ready", "Degraded", "Failed"):
        metrics.SERVICES.labels(phase).set(phases.get(phase, 0))


def run_reconcile(
    rt: Runtime, namespace: str, name: str, body: Mapping[str, Any] | None = None
) -> ReconcileOutcome:
    """Reconcile one PDService with metrics; kopf-independent errors propagate (see :mod:`reconcile`)."""
    start = time.perf_counter()
    try:
        out = reconcile_service(rt, namespace, name, body)
    except SpecInvalid:
        metrics.RECONCILES.labels("PDService", "invalid").inc()
        _record(rt, namespace, name, ReconcileOutcome(phase="Failed"))
        raise
    except NotYet:
        metrics.RECONCILES.labels("PDService", "waiting").inc()
        _record(rt, namespace, name, ReconcileOutcome(phase="Pending", placed=False))
        raise
    except Exception as exc:
        metrics.RECONCILES.labels("PDService", "error").inc()
        metrics.ERRORS.labels("PDService", type(exc).__name__).inc()
        raise
    finally:
        metrics.RECONCILE_SECONDS.labels("PDService").observe(time.perf_counter() - start)
    metrics.RECONCILES.labels("PDService", "ok").inc()
    metrics.APPLIED.labels("PDService").inc(out.applied)
    _record(rt, namespace, name, out)
    return out


def _kopf_errors(rt: Runtime, namespace: str, name: str, body: Mapping[str, Any] | None) -> ReconcileOutcome:
    """Run a reconcile, turning the reconciler's errors into kopf's (permanent vs retry)."""
    try:
        return run_reconcile(rt, namespace, name, body)
    except SpecInvalid as exc:
        raise kopf.PermanentError(str(exc)) from None
    except NotYet as exc:
        raise kopf.TemporaryError(str(exc), delay=exc.delay) from None
    except KubeApiError as exc:
        raise kopf.TemporaryError(str(exc), delay=API_ERROR_DELAY_S) from None
    except StatusPruned as exc:
        # An older CRD: the event and CRDCurrent=False are recorded; try again soon, so
        # the reconcile resumes within this delay of the CRD being current again.
        raise kopf.TemporaryError(str(exc), delay=STATUS_HELD_DELAY_S) from None


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)  # type: ignore[arg-type]  # namespaced kind: kopf's namespace (str | None) is a str
def pdservice_reconcile(namespace: str, name: str, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Reconcile on create, resume and spec/metadata updates.

    Returns nothing: kopf would store a result under ``status.<handler>``, which the CRD's structural
    schema prunes.
    """
    out = _kopf_errors(runtime_of(memo), namespace, name, body)
    log.info(
        "PDService %s/%s: %s, %d applied, %d deleted", namespace, name, out.phase, out.applied, out.deleted
    )


def needs_retry(body: Mapping[str, Any]) -> bool:
    """Whether a PDService is retried every :data:`RETRY_S`: the safety net for what no event announces
    (a status behind its generation, a placement still pending, a degraded service, a time-limited node
    in use whose vacate the status follows). Ready and Progressing services cost nothing while idle."""
    status = body.get("status") or {}
    lagging = status.get("observedGeneration") != (body.get("metadata") or {}).get("generation")
    return lagging or windowed(body) or status.get("phase") in ("Pending", "Degraded")


def windowed(body: Mapping[str, Any]) -> bool:
    """Whether a PDService uses a time-limited node (``status.windowLeaveBy``): checked every
    :data:`WINDOW_TICK_S` (:func:`window_tick`)."""
    return (body.get("status") or {}).get("windowLeaveBy") is not None


def window_tick(rt: Runtime, namespace: str, name: str, leave_by: str | None, now: datetime) -> bool:
    """Reconcile once when the PDService's ``windowLeaveBy`` has come (:func:`leave_by_due`).

    The reconcile at ``leaveBy`` publishes the window-free plan and reports the node ``Leaving``, which
    starts the vacate; waiting for the :data:`RETRY_S` timer could spend up to 30 s of the window's margin
    first. A reconcile that fails is logged and tried again at the next tick (the deadline does not wait).
    Returns True when a reconcile ran and succeeded.
    """
    key = (namespace, name)
    if not leave_by_due(leave_by, now, rt.services.window_handled(key)):
        return False
    try:
        run_reconcile(rt, namespace, name)
    except (SpecInvalid, NotYet, KubeApiError, StatusPruned) as exc:
        log.info("PDService %s/%s: at windowLeaveBy %s: %s", namespace, name, leave_by, exc)
        return False
    rt.services.handle_window(key, str(leave_by))
    return True


def _retry(rt: Runtime, namespace: str, name: str) -> None:
    """Reconcile a PDService outside kopf's handlers (the retry watch, a debounced trigger): the errors a
    reconcile expects are one log line."""
    try:
        run_reconcile(rt, namespace, name)
    except (SpecInvalid, NotYet, KubeApiError, StatusPruned) as exc:
        log.info("PDService %s/%s: %s", namespace, name, exc)


def _window(rt: Runtime, namespace: str, name: str) -> None:
    leave_by = ((rt.services.latest.get((namespace, name)) or {}).get("status") or {}).get("windowLeaveBy")
    window_tick(rt, namespace, name, leave_by, datetime.now(UTC))


#: The periodic watches of a PDService: kind → (interval s, whether its last body calls for it, the work).
_Tender = tuple[float, Callable[[Mapping[str, Any]], bool], Callable[[Runtime, str, str], None]]
_TENDERS: Mapping[str, _Tender] = MappingProxyType(
    {
        "retry": (RETRY_S, needs_retry, _retry),
        "window": (WINDOW_TICK_S, windowed, _window),
    }
)


async def _tend(rt: Runtime, kind: str, namespace: str, name: str) -> None:
    interval, wanted, work = _TENDERS[kind]
    key = (namespace, name)
    try:
        while True:
            await asyncio.sleep(interval)
            body = rt.services.latest.get(key)
            if body is None or not wanted(body):
                return
            try:
                await asyncio.get_running_loop().run_in_executor(None, work, rt, namespace, name)
            except Exception:
                log.exception("%s of PDService %s/%s failed", kind, namespace, name)
    finally:
        if rt.services.tending.get((kind, key)) is asyncio.current_task():
            rt.services.tending.pop((kind, key), None)


def tend(rt: Runtime, namespace: str, name: str, body: Mapping[str, Any]) -> list[str]:
    """Start the periodic watches a PDService's body calls for (:data:`_TENDERS`) that are not running.

    These are this module's own tasks rather than ``kopf.timer``s: kopf puts its finalizer on every object
    a timer may serve, and adding it costs a new PDService a PATCH and a watch round trip before its
    create handler runs (``kopf/_core/reactor/processing.py``, "Adding the finalizer"), on the path to its
    StatefulSets; owner references already delete what a PDService owns. A watch ends by itself once the
    service's last body no longer calls for it, and with the service. Event loop only.
    Returns the kinds started.
    """
    key = (namespace, name)
    rt.services.latest[key] = body
    started = []
    for kind, (_, wanted, _) in _TENDERS.items():
        task = rt.services.tending.get((kind, key))
        if wanted(body) and (task is None or task.done()):
            rt.services.tending[(kind, key)] = asyncio.get_running_loop().create_task(
                _tend(rt, kind, namespace, name)
            )
            started.append(kind)
    return started


@kopf.on.event(GROUP, VERSION, PLURAL)  # type: ignore[arg-type]  # namespaced kind: kopf's namespace (str | None) is a str
async def pdservice_seen(
    namespace: str, name: str, type: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any
) -> None:
    """Every PDService event: start the retry and window watches its status calls for (:func:`tend`);
    forget a deleted PDService (its objects go with it through owner references): its outcome (and so
    the phase metrics), its window, its watches, its pruned-write reports. Its lock went when its last
    holder left."""
    rt = runtime_of(memo)
    if type == "DELETED":
        _record(rt, namespace, name, None)
        rt.forget_service(namespace, name, (body.get("metadata") or {}).get("uid"))
        return
    rt.changes.bump((namespace, name))
    tend(
        rt,
        namespace,
        name,
        {"metadata": dict(body.get("metadata") or {}), "status": dict(body.get("status") or {})},
    )


# --- debounced triggers ------------------------------------------------------------------------------
async def _later(rt: Runtime, namespace: str, name: str, delay: float) -> None:
    try:
        await asyncio.sleep(delay)
    finally:
        rt.services.pending.pop((namespace, name), None)
    try:
        await asyncio.to_thread(_retry, rt, namespace, name)
    except Exception:
        log.exception("reconcile of PDService %s/%s failed", namespace, name)


def poke(rt: Runtime, namespace: str, name: str, delay: float = DEBOUNCE_S) -> bool:
    """Schedule a reconcile of one PDService in ``delay`` s unless one is already scheduled.

    Must run in the event loop (kopf's). Returns True when a new reconcile was scheduled.
    """
    key, pending = (namespace, name), rt.services.pending
    task = pending.get(key)
    if task is not None and not task.done():
        return False
    pending[key] = asyncio.get_running_loop().create_task(_later(rt, namespace, name, delay))
    return True


@kopf.on.event("apps", "v1", "statefulsets", labels={names.LABEL_MANAGED_BY: names.MANAGED_BY})
@kopf.on.event("apps", "v1", "deployments", labels={names.LABEL_MANAGED_BY: names.MANAGED_BY})  # type: ignore[arg-type]  # namespaced kind: kopf's namespace (str | None) is a str
async def owned_changed(namespace: str, labels: Mapping[str, str], memo: kopf.Memo, **_: Any) -> None:
    """An owned StatefulSet or Deployment changed (pods became ready, a rollout moved): refresh status."""
    service = labels.get(names.LABEL_SERVICE)
    if service and namespace:
        rt = runtime_of(memo)
        rt.changes.bump((namespace, service))
        poke(rt, namespace, service)


@kopf.on.event("", "v1", "pods", labels={names.LABEL_MANAGED_BY: names.MANAGED_BY})  # type: ignore[arg-type]  # namespaced kind: kopf's namespace (str | None) is a str
async def owned_pod_changed(namespace: str, labels: Mapping[str, str], memo: kopf.Memo, **_: Any) -> None:
    """A pod of a service changed (started, Ready, restarted, OOM-killed): count it, which ends the wait of
    the service's idle sampling loops (:mod:`gearshift.handlers.loop`). No reconcile: the StatefulSet's
    and the Deployment's own events bring those."""
    service = labels.get(names.LABEL_SERVICE)
    if service and namespace:
        runtime_of(memo).changes.bump((namespace, service))


def node_fingerprint(node: Mapping[str, Any]) -> tuple[Any, ...]:
    """Everything of a node the reconcile reads: readiness, GPU count, every label (a PDService's
    ``nodeSelector`` may name any), the ``gearshift.io/`` annotations (reclaim time, re-probe, link
    speeds), cordoning and taints. Nothing else: the kubelet's heartbeats (conditions' times, usage)
    must not count as a change, or the fleet cache would be dropped every few seconds per node."""
    meta, spec = node.get("metadata") or {}, node.get("spec") or {}
    labels = tuple(sorted((meta.get("labels") or {}).items()))
    notes = tuple(
        sorted((k, str(v)) for k, v in (meta.get("annotations") or {}).items() if k.startswith(names.DOMAIN))
    )
    taints = tuple(sorted((t.get("key"), t.get("value"), t.get("effect")) for t in spec.get("taints") or []))
    return (node_ready(node), node_gpus(node), labels, notes, bool(spec.get("unschedulable")), taints)


def fleet_concerns(outcome: ReconcileOutcome, node: str | None) -> bool:
    """Whether a change of ``node`` (None: of some GPUProfile) may change this service's reconcile."""
    return (
        outcome.auto
        or not outcome.placed
        or not outcome.ready
        or (node is not None and node in outcome.nodes)
    )


def _fleet_changed(rt: Runtime, node: str | None) -> None:
    rt.fleet.forget()
    for (ns, name), out in known_services(rt).items():
        if fleet_concerns(out, node):
            poke(rt, ns, name, delay=2 * DEBOUNCE_S)


@kopf.on.event("", "v1", "nodes")
async def fleet_node_changed(name: str, body: kopf.Body, type: str | None, memo: kopf.Memo, **_: Any) -> None:
    """A node appeared, went, or changed readiness/GPUs/labels: reconcile the services it concerns."""
    rt = runtime_of(memo)
    if type == "DELETED":
        if rt.fleet_prints.forget_node(name) is not None:
            _fleet_changed(rt, name)
        return
    prints, fp = rt.fleet_prints.nodes, node_fingerprint(body)
    if prints.get(name) != fp:
        first = name not in prints
        prints[name] = fp
        if not first or known_services(rt):
            _fleet_changed(rt, name)


@kopf.on.event(GROUP, VERSION, "gpuprofiles")
async def fleet_profile_changed(
    name: str, body: kopf.Body, type: str | None, memo: kopf.Memo, **_: Any
) -> None:
    """A GPUProfile's numbers changed (a probe finished, an override): services planning on it re-plan."""
    rt = runtime_of(memo)
    if type == "DELETED":
        # A deleted profile's print goes; it counts as a change unless its numbers were unusable already.
        if rt.fleet_prints.forget_profile(name) != "":
            _fleet_changed(rt, None)
        return
    # Only the numbers a plan reads: probe bookkeeping (times, attempts) must not trigger reconciles.
    eff = usable_profile(body)
    skip = {"probe_time", "probe", "conditions", "message", "observed_generation"}
    fp = "" if eff is None else inputs_hash(eff.model_dump(mode="json", exclude=skip))
    if rt.fleet_prints.profiles.get(name) != fp:
        rt.fleet_prints.profiles[name] = fp
        _fleet_changed(rt, None)
