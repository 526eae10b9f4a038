"""Shared handler pieces: event reasons, Kubernetes Events, condition updates, kopf error mapping.

Every decision the operator takes becomes an Event on the object (reasons are CamelCase constants, most
of them in :mod:`gearshift.api.common`); conditions change only through
:func:`gearshift.api.common.set_condition`, which keeps ``lastTransitionTime`` unless the status flips,
and an Event is emitted only when a condition actually changed (status, reason or message).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from gearshift.adapters.kube import KubeApi, KubeApiError
from gearshift.adapters.memory import PrunedReports
from gearshift.api import crdcheck
from gearshift.api.common import REASON_FIELDS_PRUNED, Condition, ConditionStatus, set_condition

log = logging.getLogger(__name__)

# --- reasons of the gear operations' events (the reconciler's conditions: gearshift.control.reconcile) --
REASON_GEAR_SELECTED = "GearSelected"  # the role Service now selects a gear
REASON_GEAR_ENSURED = "GearEnsured"  # a gear's StatefulSets were applied
REASON_GEAR_DELETED = "GearDeleted"  # a gear's StatefulSets and headless Service were deleted

EVENT_SOURCE = "gearshift-operator"
#: Namespace of the core/v1 Events about cluster-scoped objects (GPUProfiles): the API server accepts an
#: Event whose involved object has no namespace only in ``default`` (or none), so that is where it goes
#: (k8s.io/kubernetes pkg/apis/core/validation/events.go, "does not match event.namespace").
CLUSTER_EVENT_NAMESPACE = "default"


def now_utc() -> datetime:
    """The current time, UTC, whole seconds (Kubernetes serialises times at second precision)."""
    return datetime.now(UTC).replace(microsecond=0)


def event_body(
    involved: Mapping[str, Any], reason: str, message: str, warning: bool, now: datetime
) -> dict[str, Any]:
    """A core/v1 Event about ``involved`` (a full object body with apiVersion, kind, metadata), in its
    namespace (a cluster-scoped object's: :data:`CLUSTER_EVENT_NAMESPACE`)."""
    meta = involved.get("metadata", {})
    ts = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "generateName": f"{meta.get('name', 'gearshift')}.",
            "namespace": meta.get("namespace") or CLUSTER_EVENT_NAMESPACE,
        },
        "involvedObject": {
            "apiVersion": involved.get("apiVersion"),
            "kind": involved.get("kind"),
            "name": meta.get("name"),
            "namespace": meta.get("namespace"),
            "uid": meta.get("uid"),
            "resourceVersion": meta.get("resourceVersion"),
        },
        "reason": reason,
        "message": message[:1024],
        "type": "Warning" if warning else "Normal",
        "source": {"component": EVENT_SOURCE},
        "reportingComponent": EVENT_SOURCE,
        "firstTimestamp": ts,
        "lastTimestamp": ts,
        "count": 1,
    }


def emit(api: KubeApi, involved: Mapping[str, Any], reason: str, message: str, warning: bool = False) -> None:
    """Record an Event; a failure to record is logged, never raised (events are best effort)."""
    log.info(
        "%s %s/%s: %s: %s",
        involved.get("kind"),
        involved.get("metadata", {}).get("namespace"),
        involved.get("metadata", {}).get("name"),
        reason,
        message,
    )
    try:
        api.create_event(event_body(involved, reason, message, warning, now_utc()))
    except (KubeApiError, OSError) as exc:
        log.warning("could not record event %s: %s", reason, exc)


@dataclass
class ConditionBook:
    """Conditions being updated during one reconcile, and the events their changes call for."""

    conditions: list[Condition]
    generation: int | None
    now: datetime
    changes: list[tuple[str, str, bool]] = field(default_factory=list)
    """``(reason, message, warning)`` for each condition that changed."""

    def set(
        self, type_: str, status: ConditionStatus, reason: str, message: str, warning: bool = False
    ) -> None:
        """Set a condition; remember an event when it changed (status, reason or message)."""
        self.conditions, changed = set_condition(
            self.conditions, type_, status, reason, message, self.now, self.generation
        )
        if changed:
            self.changes.append((reason, f"{type_}={status}: {message}", warning))

    def as_json(self) -> list[dict[str, Any]]:
        """The conditions as the status stores them."""
        return [c.to_json() for c in self.conditions]


def conditions_from(raw: Sequence[Mapping[str, Any]] | None) -> list[Condition]:
    """Parse stored conditions, skipping malformed entries (another writer's, an older operator's)."""
    out = []
    for c in raw or []:
        try:
            out.append(Condition.model_validate(dict(c)))
        except ValueError:
            continue
    return out


#: Condition set when a status write lost fields to an older CRD (positive polarity, API conventions).
CONDITION_CRD_CURRENT = "CRDCurrent"


class StatusPruned(RuntimeError):
    """A status write lost fields: the installed CRD is older than this operator."""


class StatusHeld(StatusPruned):
    """A status write was not sent: the installed CRD, replaced under the running operator, would prune
    part of it. Holding the whole write keeps the object's status from being half-written (a phase
    without the executor state it goes with); the write is made again once the CRD is current."""


def hold_if_prunable(
    reported: PrunedReports, kind: str, namespace: str | None, name: str, status: Mapping[str, Any]
) -> None:
    """Raise :class:`StatusHeld` when ``kind``'s writes are held (``reported.held``) and the installed
    schema would prune part of ``status``; return otherwise."""
    held = reported.held(kind)
    if held is None:
        return
    would_lose = crdcheck.prunable_paths(status, held.status_schema)
    if would_lose:
        shown = ", ".join(would_lose[:8]) + (" …" if len(would_lose) > 8 else "")
        raise StatusHeld(
            f"status write of {kind} {namespace}/{name} held (it would lose {shown}): {held.message}"
        )


def patch_status(
    api: KubeApi,
    api_version: str,
    kind: str,
    namespace: str | None,
    name: str,
    status: Mapping[str, Any],
    reported: PrunedReports | None = None,
) -> dict[str, Any]:
    """``api.patch_status``, then check that every field written was stored.

    The start-up check (:mod:`gearshift.handlers.crds`) catches old CRDs before kopf runs; this catches a
    CRD replaced by an older one while the operator runs. A pruned write would otherwise go unnoticed and
    the next tick would act on state that is not there (a forced shift cycled Warming ↔ Degraded).
    ``reported``: what this process reported already (the event and the condition come once per object
    and loss); None: nothing is remembered, every pruned write reports. While the CRD poller finds
    ``kind``'s CRD older than the operator (``reported.held(kind)``), a write the installed schema would
    prune is not sent at all (:func:`hold_if_prunable`); one it keeps whole goes through.

    Returns the stored object.

    Raises:
        StatusHeld: the write was held (message: the paths, the CRD and the fix); nothing was written.
        StatusPruned: fields were pruned (message: the paths and :data:`crdcheck.UPGRADE_HINT`), after a
            Warning event ``FieldsPruned`` and the condition ``CRDCurrent=False`` on the object, so the
            handler stops here instead of going on from state that was not kept.
        KubeApiError: the patch itself failed.
    """
    if reported is not None:
        hold_if_prunable(reported, kind, namespace, name, status)
    stored = api.patch_status(api_version, kind, namespace, name, status)
    lost = crdcheck.pruned_paths(status, (stored or {}).get("status"))
    if not lost:
        return stored
    message = (
        f"the API server dropped {', '.join(lost[:8])}{' …' if len(lost) > 8 else ''} from this {kind}'s "
        f"status: its CRD is older than the operator; {crdcheck.UPGRADE_HINT}"
    )
    reported = reported if reported is not None else PrunedReports()
    reported.suspect()
    if reported.first(str(stored.get("metadata", {}).get("uid")), tuple(lost)):
        log.error("%s %s/%s: %s", kind, namespace, name, message)
        emit(api, stored, REASON_FIELDS_PRUNED, message, warning=True)
        if "status.conditions" not in lost:
            conditions, changed = set_condition(
                conditions_from((stored.get("status") or {}).get("conditions")),
                CONDITION_CRD_CURRENT, "False", REASON_FIELDS_PRUNED, message, now_utc(),
                stored.get("metadata", {}).get("generation"),
            )  # fmt: skip
            if changed:
                try:
                    api.patch_status(
                        api_version, kind, namespace, name, {"conditions": [c.to_json() for c in conditions]}
                    )
                except KubeApiError as exc:
                    log.warning(
                        "could not set %s on %s %s/%s: %s", CONDITION_CRD_CURRENT, kind, namespace, name, exc
                    )
    raise StatusPruned(message)
