"""A role's readiness from its StatefulSets, counting only pods of the current spec: the Ready pods and
pipelines of its active gear (:func:`role_readiness`), why it has not rolled out, and the GearSet status
fields and ``Ready`` condition that follow (:func:`readiness_patch`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NamedTuple

from gearshift.api.common import COND_READY, Condition, ConditionUpdate, set_condition
from gearshift.api.pdservice import PDService
from gearshift.control.reconcile.state import (
    REASON_ALL_READY,
    REASON_NOT_READY,
    REASON_ROLLING_OUT,
    RoleState,
)
from gearshift.k8s import names
from gearshift.k8s.desired import Images, RoleDesire, engine_context
from gearshift.k8s.statefulset import stage_replicas


class Readiness(NamedTuple):
    """A role's active gear as its StatefulSets report it (:func:`role_readiness`).

    Counts are of pods of the current revision only: a pod of an older revision that still serves does
    not count toward the ready pipelines (:func:`current_ready`)."""

    ready: int
    """Ready pods of the current revision of the narrowest stage."""
    desired: int
    """Pods the narrowest stage wants."""
    rolled: bool
    """Every stage's StatefulSet has observed its generation, finished its rollout (``currentRevision``
    = ``updateRevision``) and has all its pods updated and Ready: what ``kubectl rollout status`` waits
    for."""
    pipelines: int
    """Ready pipeline replicas (every stage has its share of Ready pods), as ``GearSet.status.replicas``."""
    waiting: str = ""
    """Why the gear is not rolled out (the first stage that is not), a sentence for conditions; ``""``
    when it is."""


def current_ready(sts: Mapping[str, Any]) -> int:
    """Ready pods of a StatefulSet that run its current spec, at least (a lower bound).

    Its status counts Ready pods of every revision (``readyReplicas``) and pods of the update revision
    (``updatedReplicas``) among the pods it has (``replicas``); every pod not updated may be one of the
    Ready ones, so ``readyReplicas - (replicas - updatedReplicas)`` are Ready *and* updated. Exact once
    the rollout ends. Until the controller has observed the StatefulSet's generation its counts are of
    the previous spec (as read: the caller does not call the gear rolled out meanwhile)."""
    meta, s = sts.get("metadata") or {}, sts.get("status") or {}
    ready = int(s.get("readyReplicas") or 0)
    if s.get("observedGeneration") != meta.get("generation"):
        return ready
    updated = int(s.get("updatedReplicas") or 0)
    pods = int(s["replicas"]) if s.get("replicas") is not None else max(ready, updated)
    return max(0, ready - max(0, pods - updated))


def rollout_wait(sts: Mapping[str, Any] | None, name: str, want: int) -> str:
    """Why StatefulSet ``name`` (``sts``, None: not there) has not rolled out ``want`` pods of its
    current spec, as ``kubectl rollout status`` judges it; ``""`` when it has.

    In order: not created, generation not observed yet (status is of an older spec), rollout to the
    update revision not complete (``currentRevision`` ≠ ``updateRevision``, or pods not updated), pods
    not Ready."""
    if sts is None:
        return f"StatefulSet {name} not created yet"
    s, gen = sts.get("status") or {}, (sts.get("metadata") or {}).get("generation")
    seen = s.get("observedGeneration")
    if seen != gen:
        return f"StatefulSet {name} has not observed generation {gen} yet (status of {seen})"
    updated, ready = int(s.get("updatedReplicas") or 0), int(s.get("readyReplicas") or 0)
    update_rev, current_rev = s.get("updateRevision"), s.get("currentRevision")
    if updated < want or (update_rev and current_rev and update_rev != current_rev):
        rev = f" {update_rev}" if update_rev else ""
        return (
            f"StatefulSet {name}: {min(updated, want)}/{want} pods at the new revision{rev}, "
            f"{min(current_ready(sts), want)} Ready"
        )
    if ready < want:
        return f"StatefulSet {name}: {ready}/{want} pods Ready"
    return ""


def role_readiness(
    rs: RoleState,
    sts: Mapping[str, Mapping[str, Any]],
    pds: PDService,
    service: str,
    ns: str,
    images: Images,
) -> Readiness:
    """The :class:`Readiness` of a role's active gear from the service's StatefulSets (``sts``, by name);
    all zero and not rolled out while the role has no active gear."""
    if not rs.active:
        return Readiness(0, 0, False, 0, "no active gear yet")
    gear = next(g for g in rs.gears if g.name == rs.active)
    desire = RoleDesire(rs.role, [gear], rs.active, rs.gs.spec.replicas)
    ctx = engine_context(service, ns, pds.spec, desire, images, gear)
    want = [stage_replicas(ctx, gear, k) for k in range(len(gear.stages))]
    desired = min(want) if want else 0
    ready = desired
    pipelines = ctx.pipeline_replicas
    waiting = ""
    for k in range(len(gear.stages)):
        name = names.stage_statefulset_name(service, rs.role, gear.name, k)
        obj = sts.get(name)
        r = 0 if obj is None else current_ready(obj)
        ready = min(ready, r)
        per = want[k] // ctx.pipeline_replicas if ctx.pipeline_replicas else 0
        pipelines = min(pipelines, r // per) if per else pipelines
        waiting = waiting or rollout_wait(obj, name, want[k])
    return Readiness(ready, desired, not waiting, pipelines, waiting)


_COPIES_ATTR = {"readyCopies": "ready_copies", "desiredCopies": "desired_copies", "ready": "ready"}


def copies_status(ready: int, desired: int) -> dict[str, Any]:
    """GearSet status fields of the READY column: serving copies of the model Ready and wanted (pods of
    the active gear's narrowest stage, what the PDService's Ready message counts), and ``"ready/wanted"``
    (a printer column shows one JSONPath, so the pair is written as one string, as a Deployment shows)."""
    return {"readyCopies": ready, "desiredCopies": desired, "ready": f"{ready}/{desired}"}


def gearset_condition_patch(
    rs: RoleState, update: ConditionUpdate, now: datetime, conditions: Sequence[Condition] | None = None
) -> dict[str, Any]:
    """``{"conditions": [...]}`` with ``update`` set into ``conditions`` (default: the GearSet's as read)
    at the GearSet's generation; empty when that changes nothing stored (a bare generation bump counts:
    kubectl's wait reads it)."""
    base = list(rs.gs.status.conditions if conditions is None else conditions)
    generation = rs.gs_body["metadata"].get("generation")
    conds, _ = set_condition(base, update.type, update.status, update.reason, update.message, now, generation)
    new = [c.to_json() for c in conds]
    return {"conditions": new} if new != [c.to_json() for c in base] else {}


def gearset_ready(rs: RoleState, readiness: Readiness) -> ConditionUpdate:
    """The GearSet's ``Ready`` condition: True only when the role's active gear is served by pods of the
    GearSet's current spec (every stage rolled out, as ``kubectl rollout status`` judges it, and every
    wanted pipeline Ready); a pod of an older revision does not count (:class:`Readiness`)."""
    gear = rs.active or "-"
    if not rs.active:
        return ConditionUpdate(COND_READY, "False", REASON_NOT_READY, "no active gear yet")
    if not readiness.rolled:
        why = readiness.waiting or "rolling out"
        return ConditionUpdate(COND_READY, "False", REASON_ROLLING_OUT, f"gear {gear}: {why}")
    if readiness.ready < readiness.desired:
        return ConditionUpdate(
            COND_READY,
            "False",
            REASON_NOT_READY,
            f"gear {gear}: {readiness.ready}/{readiness.desired} pods Ready",
        )
    return ConditionUpdate(
        COND_READY,
        "True",
        REASON_ALL_READY,
        f"gear {gear}: {readiness.pipelines} pipeline(s) of the current spec serve",
    )


def readiness_patch(
    rs: RoleState,
    readiness: Readiness,
    now: datetime | None = None,
    conditions: Sequence[Condition] | None = None,
) -> dict[str, Any]:
    """The GearSet status fields that differ from ``readiness``: the READY column's and, for a role the
    autoscaler does not scale, ``replicas`` (the ready pipelines). With ``now``, also the ``Ready``
    condition (:func:`gearset_ready`) set into ``conditions`` (default: the GearSet's as read), stamped
    with the GearSet's generation so that ``kubectl wait --for=condition=Ready`` waits out an edit the
    reconcile has not rolled out yet (kubectl's wait compares a condition's ``observedGeneration`` with
    ``metadata.generation``). Empty when nothing changes."""
    st = rs.gs.status
    counts = copies_status(readiness.ready, readiness.desired)
    patch = {k: v for k, v in counts.items() if getattr(st, _COPIES_ATTR[k]) != v}
    if not rs.autoscaled and st.replicas != readiness.pipelines:
        # The autoscaler writes it for the roles it scales; the scale subresource (HPA, KEDA) reads it
        # for every role.
        patch["replicas"] = readiness.pipelines
    if now is not None:
        patch |= gearset_condition_patch(rs, gearset_ready(rs, readiness), now, conditions)
    return patch
