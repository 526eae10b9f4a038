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
from gearshift.handlers.pdservice import poke

PLURAL = "gearsets"

_generations: dict[tuple[str, str], int | None] = {}


@kopf.on.event(GROUP, VERSION, PLURAL)  # type: ignore[arg-type]  # namespaced kind: kopf's namespace (str | None) is a str
async def gearset_changed(namespace: str, name: str, body: kopf.Body, type: str | None, **_: Any) -> None:
    """A GearSet was created, deleted or its spec changed: reconcile its PDService (``spec.serviceName``)."""
    key = (namespace, name)
    service = (body.get("spec") or {}).get("serviceName")
    if type == "DELETED":
        _generations.pop(key, None)
    else:
        gen = (body.get("metadata") or {}).get("generation")
        if _generations.get(key) == gen:
            return
        _generations[key] = gen
    if service and namespace:
        poke(namespace, str(service))
