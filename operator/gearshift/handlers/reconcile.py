"""The PDService reconciler: read the PDService, its two GearSets, the fleet and the owned objects; apply
what :mod:`gearshift.control.reconcile` decides; delete what it finds stale; write status, conditions and
events.

Level-triggered and idempotent: every call recomputes the whole desired state from what it reads, applies
it with server-side apply (a no-op when nothing changed: no resourceVersion moves), and patches status only
when it differs. It is plain synchronous code over the :class:`~gearshift.handlers.runtime.Runtime`'s
:class:`~gearshift.adapters.kube.KubeApi`, so unit tests drive it with an in-memory API and kopf runs it
in its thread pool (handlers/pdservice.py). Imports no kopf and registers no handler.

One :func:`reconcile_service`, in order: read the PDService and its GearSets and check them
(:func:`~gearshift.control.reconcile.spec.role_state`, ``explicit_layer_problems``,
``explicit_engine_problems``); read the fleet (through the runtime's
:class:`~gearshift.adapters.caches.FleetCache`) and work out the desired state
(:func:`~gearshift.control.reconcile.desired.desired_state`, plans memoised by inputs hash in the
runtime's :class:`~gearshift.adapters.caches.PlanCache`); write each GearSet's
status and the planning events; apply the owned objects; delete the engine StatefulSets and headless
Services no wanted gear has (``stale_statefulsets``, ``stale_gear_services``); write each GearSet's
readiness; write the PDService's conditions, phase and status
(:func:`~gearshift.control.reconcile.verdict.service_verdict`).

Exceptions (the kopf handlers turn them into kopf errors)::

    gearshift.control.reconcile.state.ReconcileError
     ├── gearshift.control.reconcile.state.SpecInvalid   the PDService or a GearSet cannot be used as
     │                                                   written (permanent)
     └── NotYet                                          something referenced is not there yet (retry
                                                         after ``delay`` s)

A shift in flight (GearSet ``status.executor.step`` in Warming/Draining/Switching/RollingBack/Degraded)
belongs to the gear executor: the reconciler then keeps both gears' pods, leaves the role
Service's selector alone and deletes no gear; the executor drives the objects through
:func:`ensure_gear_sync`, :func:`select_gear_sync` and :func:`delete_gear_sync`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from gearshift import planner
from gearshift.adapters.kube import DEPLOY, GS, PDS, POD, STS, SVC, KubeApi
from gearshift.adapters.memory import ObjectKey, PrunedReports
from gearshift.api.common import REASON_INVALID_SPEC, Condition, ConditionUpdate, format_validation_error
from gearshift.api.gearset import Gear, GearSet
from gearshift.api.pdservice import ROLE_SECTIONS, PDService
from gearshift.control.reconcile.desired import (
    desired_state,
    gearset_status_patch,
    stale_gear_services,
    stale_statefulsets,
)
from gearshift.control.reconcile.placement import bound_nodes
from gearshift.control.reconcile.planning import memory_utilization, service_event_message
from gearshift.control.reconcile.readiness import Readiness, readiness_patch, role_readiness
from gearshift.control.reconcile.rollout import gearset_rollout_ahead, rollout_ahead, rollouts_starting
from gearshift.control.reconcile.settings import Settings
from gearshift.control.reconcile.spec import explicit_engine_problems, explicit_layer_problems, role_state
from gearshift.control.reconcile.state import (
    REASON_GEARSET_MISMATCH,
    DesiredState,
    ReconcileError,
    RoleState,
    SpecInvalid,
)
from gearshift.control.reconcile.verdict import (
    gearsets_missing,
    refusal,
    router_ready,
    service_verdict,
    unschedulable,
)
from gearshift.handlers import common
from gearshift.handlers.common import (
    ConditionBook,
    conditions_from,
    emit,
    now_utc,
    patch_status,
)
from gearshift.handlers.runtime import ReconcileOutcome, Runtime
from gearshift.k8s import applied as applied_objects
from gearshift.k8s import names
from gearshift.k8s.desired import RoleDesire, desired_objects, gear_objects, owner_reference
from gearshift.k8s.engine import EngineSpecError
from gearshift.k8s.services import build_role_service
from gearshift.planner.inputs import gear_links, resource_profile

log = logging.getLogger(__name__)


#: Retry delay when a referenced object is missing, s.
NOT_YET_DELAY_S = 15.0


class NotYet(ReconcileError):
    """Something the PDService references is not there yet; retry after ``delay`` s."""

    def __init__(self, message: str, delay: float = NOT_YET_DELAY_S) -> None:
        super().__init__(message)
        self.delay = delay


def _read_gearsets(
    api: KubeApi, pool: Executor, body: Mapping[str, Any], pds: PDService
) -> dict[str, RoleState]:
    """Each role's GearSet, read at once (``pool``).

    Raises:
        NotYet: a GearSet is missing.
    """
    ns = body["metadata"]["namespace"]
    name = body["metadata"]["name"]
    out: dict[str, RoleState] = {}
    missing = []
    refs = [pds.spec.role_spec(role).gear_set_ref.name for role in pds.spec.roles]
    bodies = pool.map(lambda ref: api.get(*GS, ns, ref), refs)
    for role, ref, gs_body in zip(pds.spec.roles, refs, bodies, strict=True):
        if gs_body is None:
            missing.append(f"{ROLE_SECTIONS[role]}.gearSetRef {ref!r}")
            continue
        out[role] = role_state(pds, name, role, gs_body)
    if missing:
        raise NotYet(f"GearSet not found: {'; '.join(missing)}; create it in namespace {ns}")
    return out


@dataclass
class _ServiceStatus:
    """The PDService's status as one reconcile writes it: its conditions, and the events they call for."""

    api: KubeApi
    reported: PrunedReports
    body: dict[str, Any]
    """The PDService as read at the start of the reconcile."""
    namespace: str
    name: str
    book: ConditionBook
    old_status: dict[str, Any]

    @classmethod
    def read(
        cls, rt: Runtime, body: dict[str, Any], namespace: str, name: str, now: datetime
    ) -> _ServiceStatus:
        """The status of ``body`` to update at ``now``."""
        old = dict(body.get("status") or {})
        book = ConditionBook(conditions_from(old.get("conditions")), body["metadata"].get("generation"), now)
        return cls(rt.api, rt.pruned, body, namespace, name, book, old)

    def set(self, updates: Iterable[ConditionUpdate]) -> None:
        """Set conditions (in order: their events follow it)."""
        for c in updates:
            self.book.set(c.type, c.status, c.reason, c.message, c.warning)

    def finish(self, status: dict[str, Any]) -> None:
        """Write ``status`` with the conditions unless nothing changes; record the conditions' events."""
        status["conditions"] = self.book.as_json()
        status["observedGeneration"] = self.book.generation
        if self.old_status | status != self.old_status:
            patch_status(self.api, *PDS, self.namespace, self.name, status, self.reported)
        for reason, message, warning in self.book.changes:
            emit(self.api, self.body, reason, message, warning)

    def write_ahead(self, updates: Iterable[ConditionUpdate], phase: str) -> None:
        """Write ``updates`` and ``phase`` now, before the reconcile acts (a rollout it is about to start),
        and record their events; :meth:`finish` later writes over them from what it then reads."""
        self.set(updates)
        status = {
            "phase": phase,
            "conditions": self.book.as_json(),
            "observedGeneration": self.book.generation,
        }
        if self.old_status | status != self.old_status:
            patch_status(self.api, *PDS, self.namespace, self.name, status, self.reported)
            self.old_status = self.old_status | status
        for reason, message, warning in self.book.changes:
            emit(self.api, self.body, reason, message, warning)
        self.book.changes.clear()

    def refuse(self, reason: str, msg: str) -> None:
        """Write that the spec cannot be served (:func:`gearshift.control.reconcile.verdict.refusal`)."""
        condition, status = refusal(self.old_status, reason, msg)
        self.set([condition])
        self.finish(status)


def reconcile_service(
    rt: Runtime, namespace: str, name: str, body: Mapping[str, Any] | None = None
) -> ReconcileOutcome:
    """Reconcile one PDService (see the module docstring) with the runtime's API, settings and caches.
    Serialised per PDService (``rt.service_locks``).

    ``body`` (kopf's) is not used: the PDService is read afresh, as a kopf body may be older than a status
    written a moment ago.

    Raises:
        SpecInvalid: the PDService or a GearSet is unusable (status and an event say why).
        NotYet: a GearSet is missing (status and an event say which).
    """
    with rt.service_locks.hold((namespace, name)):
        return _reconcile(rt, namespace, name, body)


def _reconcile(rt: Runtime, ns: str, name: str, body: Mapping[str, Any] | None) -> ReconcileOutcome:
    api, settings = rt.api, rt.settings
    # Always read the newest body: a kopf body may be older than a status we wrote a moment ago.
    fresh = api.get(*PDS, ns, name)
    if fresh is None:
        return ReconcileOutcome(phase="Deleted")
    if fresh["metadata"].get("deletionTimestamp"):
        return ReconcileOutcome(phase="Deleting")
    now = now_utc()
    # The pods and owned objects are read while the spec and GearSets are: a round trip each, one after
    # another, were most of a new service's reconcile on a busy API server.
    reads = _OwnedReads.start(rt, ns, name)
    status = _ServiceStatus.read(rt, fresh, ns, name, now)
    pds, roles, nodes, profiles = _read_spec(rt, status)
    service_pods, owned = reads.result()
    live = _named(owned, STS)
    bound = bound_nodes(service_pods, list(live.values()))
    want = desired_state(pds, roles, nodes, profiles, settings, now, bound, memo=rt.plans)
    out = ReconcileOutcome(
        auto=any(rs.gs.spec.mode == "auto" for rs in roles.values()),
        nodes={n for d in want.desires for g in d.gears for st in g.stages for n in st.nodes},
    )
    written: dict[str, dict[str, Any]] = {}
    out.planned = _write_plans(rt, fresh, ns, roles, want, now, written)
    out.applied = _apply(rt, status, pds, want, settings, roles, owned, written)
    out.deleted = _collect_garbage(rt, ns, name, want, roles, owned)
    readiness = _write_readiness(rt, ns, name, pds, roles, now, written, owned)
    router = router_ready(owned.get(_ref(DEPLOY, names.router_name(name))))
    verdict = service_verdict(
        name, ns, want, roles, readiness, unschedulable(service_pods), router, status.old_status
    )
    status.set(verdict.conditions)
    status.finish(verdict.status)
    out.phase, out.ready, out.placed = verdict.phase, verdict.ready, verdict.placed
    return out


def _read_spec(
    rt: Runtime, status: _ServiceStatus
) -> tuple[PDService, dict[str, RoleState], dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """``(pds, roles, nodes, profiles)``: the PDService, its GearSets and the fleet, checked.

    Raises:
        SpecInvalid: after writing the refusal (:meth:`_ServiceStatus.refuse`).
        NotYet: a GearSet is missing, after writing that the service waits for it.
    """
    try:
        pds = PDService.model_validate(status.body)
    except ValidationError as exc:
        msg = format_validation_error(exc)
        status.refuse(REASON_INVALID_SPEC, msg)
        raise SpecInvalid(msg) from None
    try:
        roles = _read_gearsets(rt.api, rt.apply_pool, status.body, pds)
        explicit_layer_problems(pds, roles)
    except SpecInvalid as exc:
        status.refuse(REASON_GEARSET_MISMATCH, str(exc))
        raise
    except NotYet as exc:
        conditions, pending = gearsets_missing(str(exc))
        status.set(conditions)
        status.finish(pending)
        raise
    nodes, profiles = rt.fleet.read(rt.api)
    try:
        explicit_engine_problems(pds, roles, profiles)
    except SpecInvalid as exc:
        status.refuse(REASON_INVALID_SPEC, str(exc))
        raise
    return pds, roles, nodes, profiles


def _write_plans(
    rt: Runtime,
    body: Mapping[str, Any],
    ns: str,
    roles: Mapping[str, RoleState],
    want: DesiredState,
    now: datetime,
    written: dict[str, dict[str, Any]],
) -> list[str]:
    """Write each GearSet's status (each role's patch kept in ``written``) and record planning's events on
    the GearSet and the PDService, all at once (``rt.apply_pool``: none depends on another); returns the
    roles whose plan was written.

    Raises:
        KubeApiError, StatusPruned, StatusHeld: a GearSet status write was refused (the events still go).
    """
    api, pool = rt.api, rt.apply_pool
    patches = {role: patch for role, rs in roles.items() if (patch := gearset_status_patch(rs, now))}
    writes = {
        role: pool.submit(patch_status, api, *GS, ns, roles[role].gs.metadata["name"], patch, rt.pruned)
        for role, patch in patches.items()
    }
    events = []
    for role, reason, message, warning in want.plan_events:
        gs_name = str(roles[role].gs.metadata["name"])
        events.append(pool.submit(emit, api, roles[role].gs_body, reason, message, warning))
        message = service_event_message(role, gs_name, message)
        events.append(pool.submit(emit, api, body, reason, message, warning))
    for done in events:
        done.result()
    for role, write in writes.items():
        write.result()
        written[role] = patches[role]
    return [role for role in writes if "plannedGears" in patches[role]]


#: The router's RBAC kinds (:func:`gearshift.k8s.router.build_router_rbac`), each named ``<pds>-router``.
ROUTER_RBAC = (
    ("v1", "ServiceAccount"),
    ("rbac.authorization.k8s.io/v1", "Role"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"),
)


def _ref(kind: tuple[str, str], name: str) -> applied_objects.ObjectRef:
    return (kind[0], kind[1], name)


def _named(
    owned: Mapping[applied_objects.ObjectRef, Mapping[str, Any]], kind: tuple[str, str]
) -> dict[str, Mapping[str, Any]]:
    """The objects of ``kind`` in ``owned``, by name."""
    return {r[2]: obj for r, obj in owned.items() if r[:2] == kind}


def _delete_owned(rt: Runtime, service: ObjectKey, kind: tuple[str, str], name: str) -> bool:
    """Delete the owned object ``name`` of ``kind`` of ``service`` and forget what its apply left; returns
    whether it was there."""
    gone = rt.api.delete(*kind, service[0], name)
    rt.applied.drop(service, _ref(kind, name))
    return gone


@dataclass(frozen=True)
class _OwnedReads:
    """The reads of what a PDService owns, in flight on the runtime's ``apply_pool``: its pods, and every
    object it owns as the cluster holds it now (StatefulSets, Services, the router's Deployment and RBAC)."""

    pods: Future[list[dict[str, Any]]]
    lists: tuple[tuple[tuple[str, str], Future[list[dict[str, Any]]]], ...]
    router: tuple[tuple[tuple[str, str], Future[dict[str, Any] | None]], ...]
    router_name: str

    @classmethod
    def start(cls, rt: Runtime, ns: str, name: str) -> _OwnedReads:
        api, pool, labels = rt.api, rt.apply_pool, {names.LABEL_SERVICE: name}
        router = names.router_name(name)
        return cls(
            pool.submit(api.list, *POD, ns, labels),
            tuple((kind, pool.submit(api.list, *kind, ns, labels)) for kind in (STS, SVC)),
            tuple((kind, pool.submit(api.get, *kind, ns, router)) for kind in (DEPLOY, *ROUTER_RBAC)),
            router,
        )

    def result(self) -> tuple[list[dict[str, Any]], dict[applied_objects.ObjectRef, Mapping[str, Any]]]:
        """``(pods, owned)``, ``owned`` by ``(apiVersion, kind, name)`` (a LIST's items carry no apiVersion
        and kind: the reference is made here).

        Raises:
            KubeApiError: the API server refused a read.
        """
        owned: dict[applied_objects.ObjectRef, Mapping[str, Any]] = {}
        for kind, listed in self.lists:
            for obj in listed.result():
                owned[_ref(kind, obj["metadata"]["name"])] = obj
        for kind, got in self.router:
            found = got.result()
            if found is not None:
                owned[_ref(kind, self.router_name)] = found
        return self.pods.result(), owned


def apply_owned(rt: Runtime, service: ObjectKey, manifest: Mapping[str, Any]) -> dict[str, Any]:
    """Server-side apply one owned object of ``service`` and remember what the apply left
    (:class:`~gearshift.adapters.memory.AppliedMemory`); returns the object as stored.

    Raises:
        KubeApiError: the API server refused it (nothing is remembered of it: the next reconcile applies it).
    """
    ref = applied_objects.ref(manifest)
    try:
        result = rt.api.apply(manifest)
    except Exception:
        rt.applied.drop(service, ref)
        raise
    rt.applied.record(service, ref, applied_objects.applied(manifest, result))
    return result


def _apply(
    rt: Runtime,
    status: _ServiceStatus,
    pds: PDService,
    want: DesiredState,
    settings: Settings,
    roles: Mapping[str, RoleState],
    owned: dict[applied_objects.ObjectRef, Mapping[str, Any]],
    written: dict[str, dict[str, Any]],
) -> int:
    """Apply the owned objects of ``want`` that differ from what the cluster holds
    (:func:`~gearshift.k8s.applied.needs_apply` against ``owned``, the objects as read this reconcile,
    which then holds what each apply returned); returns how many were applied. When that starts a
    rollout of a serving gear (:func:`~gearshift.control.reconcile.rollout.rollouts_starting` against the
    StatefulSets as read), the PDService says ``Progressing``/not ``Ready`` first, and so does the
    ``Ready`` condition of each GearSet whose gear rolls (set into the conditions this reconcile wrote,
    ``written``, which keeps the new list).

    Raises:
        SpecInvalid: the engine cannot run a gear, after writing the refusal.
    """
    api = rt.api
    live = _named(owned, STS)
    owner = owner_reference(status.body)
    try:
        objs = desired_objects(
            status.name,
            status.namespace,
            pds.spec,
            want.desires,
            settings.images,
            owner,
            settings.prometheus_url,
        )
    except EngineSpecError as exc:
        status.refuse(REASON_INVALID_SPEC, str(exc))
        raise SpecInvalid(str(exc)) from None
    starting = rollouts_starting(objs, live, {role: rs.active for role, rs in roles.items()})
    if starting:
        status.write_ahead(rollout_ahead(starting), "Progressing")
        for role, rs in roles.items():
            patch = gearset_rollout_ahead(rs, starting, status.book.now, _written_conditions(written, role))
            if patch:
                patch_status(api, *GS, status.namespace, rs.gs.metadata["name"], patch, status.reported)
                written[role] = {**(written.get(role) or {}), **patch}
    return _apply_changed(rt, (status.namespace, status.name), objs, owned)


def _apply_changed(
    rt: Runtime,
    service: ObjectKey,
    objs: Sequence[Mapping[str, Any]],
    owned: dict[applied_objects.ObjectRef, Mapping[str, Any]],
) -> int:
    """Apply those of ``objs`` that :func:`~gearshift.k8s.applied.needs_apply` against ``owned`` (then
    holding what each apply returned); returns how many. The router's Deployment goes last (its pods need
    the ServiceAccount), the rest at once, a few at a time: a new service's 14 applies one after another
    were most of its reconcile on a busy API server."""
    refs = [applied_objects.ref(obj) for obj in objs]
    due = [
        obj
        for obj, ref in zip(objs, refs, strict=True)
        if applied_objects.needs_apply(obj, owned.get(ref), rt.applied.last(service, ref))
    ]
    first = [o for o in due if (o["apiVersion"], o["kind"]) != DEPLOY]
    last = [o for o in due if (o["apiVersion"], o["kind"]) == DEPLOY]
    for batch in (first, last):
        results = rt.apply_pool.map(lambda o: apply_owned(rt, service, o), batch)
        for obj, result in zip(batch, results, strict=True):
            owned[applied_objects.ref(obj)] = result
    return len(due)


def _written_conditions(written: Mapping[str, Mapping[str, Any]], role: str) -> list[Condition] | None:
    """The GearSet conditions this reconcile last wrote for ``role`` (None: none; the GearSet's as read
    stand): a later write of the same reconcile sets into them, not into the list it read."""
    raw = (written.get(role) or {}).get("conditions")
    return None if raw is None else conditions_from(raw)


def _collect_garbage(
    rt: Runtime,
    ns: str,
    name: str,
    want: DesiredState,
    roles: Mapping[str, RoleState],
    owned: dict[applied_objects.ObjectRef, Mapping[str, Any]],
) -> int:
    """Delete the engine StatefulSets and gear Services no wanted gear has, except of roles with a shift in
    flight (the executor's), from ``owned`` (the objects as read and applied this reconcile; what goes is
    taken out of it); returns how many went."""
    flight = {r for r, rs in roles.items() if rs.in_flight}

    def engine(kind: tuple[str, str]) -> list[Mapping[str, Any]]:
        return [
            obj
            for obj in _named(owned, kind).values()
            if ((obj.get("metadata") or {}).get("labels") or {}).get(names.LABEL_COMPONENT)
            == names.COMPONENT_ENGINE
        ]

    deleted = 0
    for kind, stale in (
        (STS, stale_statefulsets(engine(STS), want, flight)),
        (SVC, stale_gear_services(engine(SVC), want, flight)),
    ):
        for obj_name in stale:
            _delete_owned(rt, (ns, name), kind, obj_name)
            owned.pop(_ref(kind, obj_name), None)
            deleted += 1
    return deleted


def _write_readiness(
    rt: Runtime,
    ns: str,
    name: str,
    pds: PDService,
    roles: Mapping[str, RoleState],
    now: datetime,
    written: Mapping[str, Mapping[str, Any]],
    owned: Mapping[applied_objects.ObjectRef, Mapping[str, Any]],
) -> dict[str, Readiness]:
    """Each role's :class:`~gearshift.control.reconcile.readiness.Readiness` from the service's
    StatefulSets (in ``owned``: as read, applied and collected this reconcile), written to its GearSet's
    status where it differs, with its ``Ready`` condition (set into the conditions this reconcile already
    wrote, ``written``, else the GearSet's as read)."""
    sts = _named(owned, STS)
    out = {}
    for role, rs in roles.items():
        out[role] = role_readiness(rs, sts, pds, name, ns, rt.settings.images)
        patch = readiness_patch(rs, out[role], now, _written_conditions(written, role))
        if patch:
            patch_status(rt.api, *GS, ns, rs.gs.metadata["name"], patch, rt.pruned)
    return out


# --- the gear executor's operations (the gear executor calls these) --------------------------------
def _context(
    api: KubeApi, namespace: str, service: str, role: str
) -> tuple[dict[str, Any], PDService, GearSet]:
    body = api.get(*PDS, namespace, service)
    if body is None:
        raise NotYet(f"PDService {namespace}/{service} not found")
    pds = PDService.model_validate(body)
    if role not in pds.spec.roles:
        have = ", ".join(pds.spec.roles)
        raise NotYet(f"PDService {namespace}/{service} has no role {role} (it has {have})")
    ref = pds.spec.role_spec(role).gear_set_ref.name
    gs_body = api.get(*GS, namespace, ref)
    if gs_body is None:
        raise NotYet(f"GearSet {namespace}/{ref} not found")
    return body, pds, GearSet.model_validate(gs_body)


def ensure_gear_sync(rt: Runtime, namespace: str, service: str, role: str, gear: str) -> list[str]:
    """Apply the headless Service and StatefulSets of ``gear`` of ``role``; returns the StatefulSet names.

    Raises:
        NotYet: the PDService or GearSet is missing, or the GearSet is being deleted; KeyError: no such
            gear in the GearSet.
    """
    api, settings = rt.api, rt.settings
    with rt.service_locks.hold((namespace, service)):
        body, pds, gs = _context(api, namespace, service, role)
        # Read under the lock the deletion handler frees gears under: a tick that loaded the GearSet
        # before its deletion must not start a shadow after the handler has run.
        if gs.metadata.get("deletionTimestamp"):
            raise NotYet(f"GearSet {namespace}/{gs.metadata['name']} is being deleted: no {role} gear {gear}")
        g = next((x for x in gs.gears() if x.name == gear), None)
        if g is None:
            raise KeyError(
                f"GearSet {gs.metadata['name']!r} has no gear {gear!r}: {[x.name for x in gs.gears()]}"
            )
        memutil = memory_utilization(gs)
        desire = RoleDesire(
            role,
            [g],
            None,
            gs.spec.replicas,
            gs.spec.policy.drain_timeout_s,
            memutil,
            # The same links the reconciler gives the gear: a pod template that differs from the
            # reconciler's would roll the gear's pods each time either one applies (a shadow restarted
            # by its own switch is "not Ready while draining" and the shift rolls back).
            {g.name: _auto_gear_links(rt, gs, g, memutil)},
        )
        objs = gear_objects(service, namespace, pds.spec, desire, g, settings.images, owner_reference(body))
        for obj in objs:
            apply_owned(rt, (namespace, service), obj)
        emit(
            api,
            body,
            common.REASON_GEAR_ENSURED,
            f"{role} gear {gear}: {len(objs) - 1} StatefulSet(s) applied",
        )
        return [o["metadata"]["name"] for o in objs if o["kind"] == "StatefulSet"]


def _auto_gear_links(rt: Runtime, gs: GearSet, gear: Gear, memutil: float) -> list[dict[str, float]] | None:
    """The simulated pipeline links of ``gear`` as :func:`reconcile_service` computes them: an ``auto`` role's
    gear gets the links between its stages' nodes from their GPUProfiles; explicit gears get none."""
    if gs.spec.mode != "auto":
        return None
    gear_nodes = {n for st in gear.stages for n in st.nodes}
    if not gear_nodes:
        return None
    nodes, profiles = rt.fleet.read(rt.api)
    try:
        doc = resource_profile(gear_nodes, profiles, nodes, memutil)
        return gear_links(gear, planner.parse_profile(doc))
    except (KeyError, ValueError, planner.PlanInputError):
        return None


def select_gear_sync(rt: Runtime, namespace: str, service: str, role: str, gear: str) -> None:
    """Point the role Service ``<pds>-<role>`` at the heads of ``gear`` (switching the role's traffic)."""
    api = rt.api
    with rt.service_locks.hold((namespace, service)):
        body, _pds, _gs = _context(api, namespace, service, role)
        apply_owned(
            rt,
            (namespace, service),
            build_role_service(service, namespace, role, gear, owner_reference(body)),
        )
        emit(api, body, common.REASON_GEAR_SELECTED, f"{role} Service now selects gear {gear}")


def delete_gear_sync(rt: Runtime, namespace: str, service: str, role: str, gear: str) -> int:
    """Delete every StatefulSet and the headless Service of ``gear`` of ``role``; returns how many went."""
    api = rt.api
    with rt.service_locks.hold((namespace, service)):
        labels = {names.LABEL_SERVICE: service, names.LABEL_ROLE: role, names.LABEL_GEAR: gear}
        n = 0
        for obj in api.list(*STS, namespace, labels):
            n += _delete_owned(rt, (namespace, service), STS, obj["metadata"]["name"])
        n += _delete_owned(
            rt, (namespace, service), SVC, names.gear_headless_service_name(service, role, gear)
        )
        body = api.get(*PDS, namespace, service)
        if body is not None:
            emit(api, body, common.REASON_GEAR_DELETED, f"{role} gear {gear}: {n} object(s) deleted")
        return n
