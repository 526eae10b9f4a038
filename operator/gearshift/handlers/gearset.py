"""kopf handlers of GearSets: a spec change reconciles the PDService the GearSet serves.

GearSets are user objects that a PDService refers to; the PDService reconcile plans ``auto`` GearSets and
writes their status (planned gears, active gear, Planned condition). Status writes do not bump
``metadata.generation``, so comparing generations here keeps those writes from triggering reconciles.
The gear-shifting loop (a kopf daemon per GearSet) is :mod:`gearshift.handlers.shifting`'s, and so is
freeing the non-serving gears of a GearSet deleted in mid-shift.
"""

from __future__ import annotations

from typing import Any

import kopf

from gearshift.api.common import GROUP, VERSION
from gearshift.handlers.pdservice import DEBOUNCE_S, poke
from gearshift.handlers.runtime import runtime_of

PLURAL = "gearsets"


@kopf.on.event(GROUP, VERSION, PLURAL)  # type: ignore[arg-type]  # namespaced kind: kopf's namespace (str | None) is a str
async def gearset_changed(
    namespace: str, name: str, body: kopf.Body, type: str | None, memo: kopf.Memo, **_: Any
) -> None:
    """A GearSet was created, deleted or its spec changed: reconcile its PDService (``spec.serviceName``).

    A deleted GearSet is forgotten (its generation, the shifting loop's memory of it, its pruned-write
    reports)."""
    rt = runtime_of(memo)
    service = (body.get("spec") or {}).get("serviceName")
    delay = DEBOUNCE_S
    if type == "DELETED":
        rt.forget_gearset(namespace, name, (body.get("metadata") or {}).get("uid"))
    elif not rt.gearsets.new_generation((namespace, name), (body.get("metadata") or {}).get("generation")):
        return
    elif type == "MODIFIED":
        # A user's edit: the PDService says it is rolling out only once a reconcile has seen the edit, and
        # until then still reads Ready; no coalescing window on top of the watch's delay.
        delay = 0.0
    if service and namespace:
        poke(rt, namespace, str(service), delay=delay)
