"""The rollout write-ahead: which serving gears applying the desired objects starts rolling
(:func:`rollouts_starting`), and the conditions written *before* they are applied (Progressing=True,
Ready=False on the PDService and the GearSet), so that no read after the StatefulSets changed finds the
service Ready on the old revision.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from gearshift.api.common import COND_PROGRESSING, COND_READY, Condition, ConditionUpdate
from gearshift.control.reconcile.readiness import gearset_condition_patch
from gearshift.control.reconcile.state import REASON_ROLLING_OUT, RoleState
from gearshift.k8s import names
from gearshift.k8s.statefulset import ANNOTATION_TEMPLATE_HASH


def rollouts_starting(
    desired: Iterable[Mapping[str, Any]],
    live: Mapping[str, Mapping[str, Any]],
    active: Mapping[str, str | None],
) -> list[str]:
    """What applying ``desired`` will start rolling among the serving gears: ``"<role> gear <gear>:
    StatefulSet <name> gets a new pod template"`` for each desired StatefulSet of a role's active gear
    (``active``: role → gear) whose template fingerprint (``ANNOTATION_TEMPLATE_HASH``) differs from the
    live one's (``live``: by name; a StatefulSet not there yet starts no rollout: nothing serves from
    it). A live StatefulSet without the annotation (written by an older operator) counts as changing:
    saying Progressing once too often is the safe side."""
    out = []
    for obj in desired:
        if obj.get("kind") != "StatefulSet":
            continue
        meta = obj.get("metadata") or {}
        labels = meta.get("labels") or {}
        role, gear, name = labels.get(names.LABEL_ROLE), labels.get(names.LABEL_GEAR), meta.get("name")
        old = live.get(str(name))
        if old is None or not isinstance(role, str) or active.get(role) != gear:
            continue
        want = (meta.get("annotations") or {}).get(ANNOTATION_TEMPLATE_HASH)
        have = ((old.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_TEMPLATE_HASH)
        if want != have:
            out.append(f"{role} gear {gear}: StatefulSet {name} gets a new pod template")
    return out


def rollout_ahead(starting: Sequence[str]) -> list[ConditionUpdate]:
    """The conditions written *before* applying objects that start ``starting`` (:func:`rollouts_starting`):
    ``Progressing=True`` and ``Ready=False`` (``RollingOut``), so that no read of the PDService after the
    StatefulSets changed can find it Ready on the old revision."""
    msg = "; ".join(starting)
    return [
        ConditionUpdate(COND_PROGRESSING, "True", REASON_ROLLING_OUT, msg),
        ConditionUpdate(COND_READY, "False", REASON_ROLLING_OUT, msg),
    ]


def gearset_rollout_ahead(
    rs: RoleState, starting: Sequence[str], now: datetime, conditions: Sequence[Condition] | None = None
) -> dict[str, Any]:
    """The GearSet status patch written before a rollout of its role's gear starts (``starting`` as
    :func:`rollouts_starting` gives it): ``Ready=False`` (``RollingOut``) at the GearSet's generation, set
    into ``conditions`` (default: the GearSet's as read). Empty when none of ``starting`` is this role's."""
    mine = [m for m in starting if m.startswith(f"{rs.role} gear ")]
    if not mine:
        return {}
    ready = ConditionUpdate(COND_READY, "False", REASON_ROLLING_OUT, "; ".join(mine))
    return gearset_condition_patch(rs, ready, now, conditions)
