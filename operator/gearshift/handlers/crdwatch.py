"""Notice a CRD replaced under the running operator, and say so on every object it concerns.

The start-up check (:mod:`gearshift.handlers.crds`) catches CRDs older than the operator before kopf runs.
A CRD applied *while* it runs (``kubectl apply`` of an older chart's ``crds/``, a Helm CRD upgrade job)
went unnoticed: kopf has no notion of a resource's schema changing under it (kopf#574), its watch met
``429 storage is (re)initializing`` while the API server rebuilt the resource's storage, and for 75 s
there was no status write, no event and no log line, while the API server pruned the fields the old schema
lacks from every write.

A background task, started by kopf's start-up handler and stopped by its cleanup handler, reads the three
CRDs every :data:`POLL_S` s (three GETs; a poll rather than a watch, because a watch is what goes quiet
here), and at once when a status write comes back pruned, the earliest sign (about a second after the
apply). A change of the served schema (:func:`gearshift.api.crdcheck.crd_change`: the schema hash, not the
``resourceVersion``, which also moves when only the CRD's status is written) that leaves it older than
the operator starts an *episode* for that CRD:

- every object of the kind gets ``CRDCurrent=False``, reason ``CRDOutdated``, the message naming the
  missing paths and the fix (the API conventions' positive-polarity condition; Kubernetes API conventions,
  "Typical status properties"), and one Warning event ``CRDOutdated`` per object per episode; one ERROR
  log line per episode names them too;
- status writes of that kind which the installed schema would prune are held whole
  (:class:`~gearshift.handlers.common.StatusHeld`), so no status is half-written; writes it keeps go on;
- objects created during the episode, or whose condition another writer overwrote, are marked on the
  next poll (the event still once).

When the schema holds every field again the held writes are released, each object that carries
``CRDCurrent`` other than True gets ``CRDCurrent=True`` (reason ``CRDUpToDate``) and a Normal event, and
the loops' next ticks (and a held PDService reconcile's retry) write again. kopf's own watches recover by
themselves, so nothing here restarts them: the API server ends the resource's watches when it rebuilds
its storage, and kopf lists again (``continuous_watch`` on a 410, ``infinite_watch`` after a 429 it
retried, ``kopf/_cogs/clients/watching.py``; on the sandbox kopf logs "Restarting the watch-stream for
gearsets" at both applies), which ``tests/e2e/test_crd_replaced_live.py`` checks by editing the GearSet
after the CRD was put back and waiting for the operator to reconcile the edit.
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import kopf

from gearshift.adapters.kube import CRD, KubeApiError
from gearshift.adapters.memory import HeldKind
from gearshift.api import crdcheck
from gearshift.api.common import (
    API_VERSION,
    REASON_CRD_OUTDATED,
    REASON_CRD_UP_TO_DATE,
    ConditionUpdate,
    find_condition,
    set_condition,
)
from gearshift.api.crdgen import KINDS, Kind
from gearshift.handlers.common import CONDITION_CRD_CURRENT, conditions_from, emit, now_utc
from gearshift.handlers.runtime import Runtime, runtime_of

log = logging.getLogger("gearshift.crdwatch")

#: Seconds between two reads of the CRDs. The issue asks for detection within 30 s; at 5 s a change is
#: seen within one poll plus the time to mark the objects, and the three GETs cost the API server little.
POLL_S = 5.0
#: The key of the poller's (stop event, task) in kopf's root memo.
MEMO_TASK = "gearshift.crdwatch"
#: Paths shown per message before `` and N more`` (events and conditions hold 1,024 characters).
SHOWN_PATHS = 8


def outdated_message(seen: crdcheck.SeenCRD) -> str:
    """The condition's and event's message for a CRD older than the operator: the CRD, its
    resourceVersion, the missing paths (at most :data:`SHOWN_PATHS`), what the operator does, the fix."""
    gaps = list(seen.gaps)
    shown = ", ".join(gaps[:SHOWN_PATHS]) + (
        f" and {len(gaps) - SHOWN_PATHS} more" if len(gaps) > SHOWN_PATHS else ""
    )
    return (
        f"the installed CRD {seen.name} (resourceVersion {seen.resource_version}) is older than this "
        f"operator: it lacks {shown}, which the API server would prune from what the operator writes; "
        f"status writes that include them are held until it is current. Fix: {crdcheck.UPGRADE_HINT}"
    )


def current_message(seen: crdcheck.SeenCRD) -> str:
    """The message of ``CRDCurrent=True``."""
    return (
        f"the installed CRD {seen.name} (resourceVersion {seen.resource_version}) holds every field this "
        "operator writes"
    )


def condition_for(seen: crdcheck.SeenCRD) -> ConditionUpdate:
    """``CRDCurrent`` as ``seen`` decides it: False (``CRDOutdated``, a Warning) while it has gaps, else
    True (``CRDUpToDate``)."""
    if seen.current:
        return ConditionUpdate(CONDITION_CRD_CURRENT, "True", REASON_CRD_UP_TO_DATE, current_message(seen))
    return ConditionUpdate(
        CONDITION_CRD_CURRENT, "False", REASON_CRD_OUTDATED, outdated_message(seen), warning=True
    )


def conditions_update(
    obj: Mapping[str, Any], update: ConditionUpdate, now: datetime
) -> list[dict[str, Any]] | None:
    """The object's conditions with ``update`` set (to write whole: a merge patch replaces a list), or
    None when its stored ``CRDCurrent`` already says the same (status, reason and message)."""
    stored = conditions_from((obj.get("status") or {}).get("conditions"))
    generation = (obj.get("metadata") or {}).get("generation")
    conditions, changed = set_condition(
        stored, update.type, update.status, update.reason, update.message, now, generation
    )
    return [c.to_json() for c in conditions] if changed else None


def marked_not_current(obj: Mapping[str, Any]) -> bool:
    """Whether the object carries ``CRDCurrent`` with a status other than True (set by an episode, or by a
    pruned write's ``FieldsPruned``): on recovery only those are set True, the rest are left alone."""
    cond = find_condition(conditions_from((obj.get("status") or {}).get("conditions")), CONDITION_CRD_CURRENT)
    return cond is not None and cond.status != "True"


def conditions_storable(seen: crdcheck.SeenCRD) -> bool:
    """Whether the installed schema keeps ``status.conditions`` whole (else only the event can tell)."""
    return not any(g == "status" or g.startswith("status.conditions") for g in seen.gaps)


def served(namespace: str | None, patterns: tuple[str, ...]) -> bool:
    """Whether an object in ``namespace`` is the operator's: every namespace when ``patterns`` is empty,
    else those matching a pattern (kopf's globs, as ``fnmatch``); cluster-scoped objects always."""
    if namespace is None or not patterns:
        return True
    return any(fnmatch.fnmatchcase(namespace, p) for p in patterns)


@dataclass
class PollState:
    """What the poller remembers between polls (its task's own; nothing else reads it)."""

    seen: dict[str, crdcheck.SeenCRD] = field(default_factory=dict)
    """The last sighting per CRD name."""
    warned: set[tuple[str, str, str | None]] = field(default_factory=set)
    """``(CRD name, object uid, schema hash)``: the objects given this episode's Warning event."""
    forbidden: bool = False
    """A read of a CRD was refused (403) and said so once."""

    def first_warning(self, crd: str, uid: str, schema_hash: str | None) -> bool:
        """True the first time an object is warned of this schema (remembered)."""
        key = (crd, uid, schema_hash)
        if key in self.warned:
            return False
        self.warned.add(key)
        return True

    def end_episode(self, crd: str) -> None:
        """Forget the warnings of ``crd``'s episode (a later one warns again)."""
        self.warned = {k for k in self.warned if k[0] != crd}


def list_objects(rt: Runtime, kind: Kind) -> list[dict[str, Any]]:
    """The operator's objects of ``kind``, each with its ``apiVersion`` and ``kind`` (events need them):
    per namespace when ``--namespace`` names plain namespaces, else listed cluster-wide and filtered by
    :func:`served`; GPUProfiles only when this operator writes them.

    Raises:
        KubeApiError: a list was refused.
    """
    api, patterns = rt.api, rt.settings.namespaces
    if kind.scope == "Cluster":
        items = rt.api.list(API_VERSION, kind.kind) if rt.settings.profiles else []
    elif patterns and not any(c in p for p in patterns for c in "*?[!"):
        items = [o for ns in patterns for o in api.list(API_VERSION, kind.kind, ns)]
    else:
        items = [
            o for o in api.list(API_VERSION, kind.kind) if served(o["metadata"].get("namespace"), patterns)
        ]
    return [{**o, "apiVersion": API_VERSION, "kind": kind.kind} for o in items]


def mark(rt: Runtime, state: PollState, kind: Kind, seen: crdcheck.SeenCRD, now: datetime) -> int:
    """Set ``CRDCurrent`` as ``seen`` decides on the objects of ``kind`` (while outdated: all of them,
    each warned once per episode; when current: those marked otherwise). Returns the objects written.

    Raises:
        KubeApiError: the list was refused (a write that fails is logged: the next poll tries again).
    """
    update = condition_for(seen)
    written = 0
    for obj in list_objects(rt, kind):
        meta = obj["metadata"]
        if seen.current and not marked_not_current(obj):
            continue
        conditions = conditions_update(obj, update, now)
        if conditions is not None and conditions_storable(seen):
            try:
                rt.api.patch_status(
                    API_VERSION, kind.kind, meta.get("namespace"), meta["name"], {"conditions": conditions}
                )
                written += 1
            except KubeApiError as exc:
                log.warning(
                    "could not set %s on %s %s/%s: %s",
                    CONDITION_CRD_CURRENT, kind.kind, meta.get("namespace"), meta["name"], exc,
                )  # fmt: skip
        if seen.current:
            if conditions is not None:
                emit(rt.api, obj, update.reason, f"{update.type}=True: {update.message}")
        elif state.first_warning(seen.name, str(meta.get("uid")), seen.schema_hash):
            emit(rt.api, obj, update.reason, f"{update.type}=False: {update.message}", warning=True)
    return written


def poll(rt: Runtime, state: PollState, now: datetime) -> None:
    """Read the three CRDs once and act on what changed (see the module docstring); synchronous.

    Raises:
        KubeApiError: a read other than a 403 on a CRD was refused (the next poll tries again).
    """
    for kind in KINDS:
        try:
            body = rt.api.get(*CRD, None, kind.name)
        except KubeApiError as exc:
            if exc.status != 403:
                raise
            if not state.forbidden:
                log.warning(
                    "cannot read CRD %s (%s): a CRD replaced under the operator goes unseen", kind.name, exc
                )
                state.forbidden = True
            continue
        before = state.seen.get(kind.name)
        seen = crdcheck.seen_crd(kind, body)
        change = crdcheck.crd_change(before, seen)
        state.seen[kind.name] = seen
        if change == "outdated":
            message = outdated_message(seen)
            schema = crdcheck.status_schema(crdcheck.version_schema(body) if body is not None else None)
            rt.pruned.hold(kind.kind, HeldKind(schema or {}, message))
            state.end_episode(kind.name)  # a different outdated schema is a new episode
            log.error("CRD %s changed under the running operator: %s", kind.name, message)
        elif change == "current":
            rt.pruned.hold(kind.kind, None)
            state.end_episode(kind.name)
            if before is not None:
                log.info("CRD %s is current again (resourceVersion %s): status writes resume",
                         kind.name, seen.resource_version)  # fmt: skip
        elif change == "changed":
            log.info("CRD %s changed (resourceVersion %s); it holds every field this operator writes",
                     kind.name, seen.resource_version)  # fmt: skip
        if not seen.current or change == "current":
            try:
                mark(rt, state, kind, seen, now)
            except KubeApiError as exc:
                log.warning("could not list %s to mark %s: %s", kind.plural, CONDITION_CRD_CURRENT, exc)


async def watch_crds(rt: Runtime, stop: asyncio.Event, interval_s: float = POLL_S) -> None:
    """:func:`poll` in a thread (the API client is synchronous) every ``interval_s`` s, and at once when a
    status write was pruned (``rt.pruned.suspect()``, from a handler's thread), until ``stop`` is set."""
    state = PollState()
    loop, wake = asyncio.get_running_loop(), asyncio.Event()

    def woken() -> None:  # called from a handler's thread
        loop.call_soon_threadsafe(wake.set)

    rt.pruned.on_suspect(woken)
    try:
        while not stop.is_set():
            try:
                await asyncio.to_thread(poll, rt, state, now_utc())
            except KubeApiError as exc:
                log.warning("CRD poll failed: %s", exc)
            except Exception:
                log.exception("CRD poll failed")
            waits = [asyncio.ensure_future(e.wait()) for e in (stop, wake)]
            try:
                await asyncio.wait(waits, timeout=interval_s, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
            wake.clear()
    finally:
        rt.pruned.on_suspect(None)


@kopf.on.startup()
async def crdwatch_start(memo: kopf.Memo, **_: Any) -> None:
    """Start the CRD poller (kopf passes every start-up and cleanup handler the same root memo)."""
    stop = asyncio.Event()
    task = asyncio.get_running_loop().create_task(watch_crds(runtime_of(memo), stop), name="CRD poller")
    memo[MEMO_TASK] = (stop, task)


@kopf.on.cleanup()
async def crdwatch_stop(memo: kopf.Memo, **_: Any) -> None:
    """Stop the CRD poller and wait for its poll in flight (at most 10 s)."""
    held = memo.pop(MEMO_TASK, None)
    if held is None:
        return
    stop, task = held
    stop.set()
    try:
        await asyncio.wait_for(task, 10.0)
    except (TimeoutError, asyncio.CancelledError):
        task.cancel()
