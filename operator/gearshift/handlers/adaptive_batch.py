"""The PD guide's adaptive batch (docs/sources.md#adaptive-batch), applied: per decode GearSet, every 5 s (the
router's balance round), the
routers' proposals → :func:`gearshift.control.adaptive_batch.tick.decide` → the active gear's head pods.

One tick (:func:`tick`, synchronous, over :class:`~gearshift.adapters.kube.KubeApi`):

1. read the GearSet and its PDService; skip unless the role is ``decode`` with an active gear;
2. the router pods' ``GET /debug/decisions`` (their pod IPs, port 8000: the same seam the autoscaler
   reads the router's ``/metrics`` through), the proposals for the active gear's head pods;
3. decide (bounded step, cooldown, never while the executor's shift is in flight: the pure module says
   why a router-side cap, not a restart, is what "apply" means);
4. write each head pod's ``gearshift.io/max-batch`` (that pod's own per-router-replica cap; removed when
   the GearSet is annotated ``gearshift.io/adaptive-batch: "off"``), where it differs;
5. ``status.adaptiveBatch`` (planned, each pod's effective value, floor, the decision and the change
   history) and the ``BatchAdapted`` condition, under the per-service lock on a fresh read; an event
   for every kind of change (``MaxBatchLowered``, ``MaxBatchRaised``, ``MaxBatchReset``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kopf

from gearshift.adapters.kube import GS, POD, KubeApi, KubeApiError
from gearshift.adapters.signals import HttpRouterDecisions, RouterDecisionSource
from gearshift.api.common import COND_BATCH_ADAPTED
from gearshift.api.gearset import GearSet
from gearshift.control.adaptive_batch import tick as rules
from gearshift.control.adaptive_batch.pd_balance import INTERVAL_S
from gearshift.control.autoscale.tick import head_pods
from gearshift.control.shifting.executor_status import executor_from_status
from gearshift.handlers.common import ConditionBook, conditions_from, emit, patch_status
from gearshift.handlers.loop import load_gearset_and_service, sampling_daemon
from gearshift.handlers.runtime import Runtime
from gearshift.k8s import names

log = logging.getLogger(__name__)


@dataclass
class BatchTick:
    """What one tick did (logs and tests)."""

    skipped: str = ""
    idle: bool = False
    step: rules.BatchStep | None = None
    annotated: list[str] = field(default_factory=list)
    """Head pods whose ``gearshift.io/max-batch`` was written (or removed) this tick."""


def _annotate(
    api: KubeApi, namespace: str, heads: Sequence[Mapping[str, Any]], values: Mapping[str, str | None]
) -> list[str]:
    """Write each head pod's ``gearshift.io/max-batch`` to ``values[pod]`` (None: remove it) if it differs."""
    done = []
    for p in heads:
        meta = p.get("metadata") or {}
        value = values.get(str(meta.get("name")))
        if (meta.get("annotations") or {}).get(names.ANNOTATION_MAX_BATCH) == value:
            continue
        try:
            api.patch(
                "v1",
                "Pod",
                namespace,
                meta["name"],
                {"metadata": {"annotations": {names.ANNOTATION_MAX_BATCH: value}}},
            )
        except KubeApiError as exc:
            if exc.status != 404:
                raise
            continue
        done.append(str(meta["name"]))
    return done


def _votes(
    api: KubeApi,
    source: RouterDecisionSource,
    namespace: str,
    service: str,
    heads: Sequence[Mapping[str, Any]],
) -> tuple[list[rules.Vote], int]:
    """Every router replica's proposals for ``heads``, and how many replicas answered."""
    router_pods = api.list(
        *POD, namespace, {names.LABEL_SERVICE: service, names.LABEL_COMPONENT: names.COMPONENT_ROUTER}
    )
    head_names = {str(p["metadata"]["name"]) for p in heads}
    answers = source.fetch(router_pods)
    return [v for router, doc in answers for v in rules.votes_from(doc, router, head_names)], len(answers)


def tick(rt: Runtime, namespace: str, name: str, *, now: float, source: RouterDecisionSource) -> BatchTick:
    """One turn for GearSet ``namespace/name`` (module docstring).

    Raises:
        KubeApiError: the API server refused a read or write (the loop retries next turn).
    """
    api = rt.api
    loaded = load_gearset_and_service(api, namespace, name)
    if isinstance(loaded, str):
        return BatchTick(skipped=loaded)
    gs_body, gs, pds = loaded
    if gs.spec.role not in rules.ROLES:
        return BatchTick(
            skipped="adaptive batch is a rule of the roles that decode (docs/sources.md#adaptive-batch)",
            idle=True,
        )
    gear = {g.name: g for g in gs.gears()}.get(gs.status.active_gear or "")
    if gear is None:
        return BatchTick(skipped="no active gear yet")
    service = gs.spec.service_name
    enabled, bad_switch = rules.switch(
        (gs.metadata.get("annotations") or {}).get(names.ANNOTATION_ADAPTIVE_BATCH)
    )
    shift = executor_from_status(gear.name, gs.status.executor).busy
    routers = max(1, pds.spec.router.replicas)
    labels = {names.LABEL_SERVICE: service, names.LABEL_ROLE: gs.spec.role, names.LABEL_GEAR: gear.name}
    pods = api.list(*POD, namespace, labels)
    heads = [p for p in head_pods(pods) if not p["metadata"].get("deletionTimestamp")]
    head_names = [str(p["metadata"]["name"]) for p in heads]
    votes, answered = _votes(api, source, namespace, service, heads) if enabled and not shift else ([], -1)
    old = rules.state_from_status(gs.status.adaptive_batch)
    step = rules.decide(
        old,
        gear=gear.name,
        planned=gear.max_batch,
        micro_batch=gear.micro_batch,
        heads=head_names,
        votes=votes,
        now=now,
        shift_in_flight=shift,
        routers=routers,
        enabled=enabled,
    )
    new = rules.advance(old, step, gear.name, now)
    annotated: list[str] = []
    if not shift:
        caps = rules.pod_annotations(step, head_names, routers, enabled)
        annotated = _annotate(api, namespace, heads, caps)
    wrote = _record(rt, (namespace, name), gs_body, gs, gear.name, step, (old, new), routers, bad_switch, now)
    # No router replica answered (none running yet, none reachable) and nothing changed: the next round
    # would read the same nothing, so the loop waits longer (110 decode GearSets at 5 s were 90 API reads/s
    # on the 1,008-node fleet, bench/fleet_operator.py). A spec edit still wakes it.
    idle = answered == 0 and not annotated and not wrote and new == old
    return BatchTick(step=step, annotated=annotated, idle=idle)


def _record(
    rt: Runtime,
    key: tuple[str, str],
    gs_body: Mapping[str, Any],
    gs: GearSet,
    gear: str,
    step: rules.BatchStep,
    states: tuple[rules.BatchState, rules.BatchState],
    routers: int,
    bad_switch: str | None,
    now: float,
) -> bool:
    """Write ``status.adaptiveBatch`` and the BatchAdapted condition of the GearSet ``key`` where they
    changed, and the events of the step on ``gear`` from ``states`` (old, new); returns whether the status
    was written."""
    (namespace, name), (old, new) = key, states
    doc = rules.status_json(new, step, routers, now)
    cond = rules.condition(step, new, bad_switch)
    old_cond = next((c for c in gs.status.conditions if c.type == COND_BATCH_ADAPTED), None)
    wrote = (
        rules.status_changed(gs.status.adaptive_batch, doc) or old_cond is None or old_cond.reason != cond[1]
    )
    if wrote:
        _write_status(rt, namespace, name, gs.spec.service_name, doc, cond, now)
        if bad_switch is not None:
            emit(rt.api, gs_body, rules.REASON_BAD_SWITCH, bad_switch, True)
    if new != old:
        for ev in rules.events(step, old, gear):
            emit(rt.api, gs_body, *ev)
    return wrote


def _write_status(
    rt: Runtime,
    namespace: str,
    name: str,
    service: str,
    doc: Mapping[str, Any],
    cond: tuple[str, str, str],
    now: float,
) -> None:
    """``status.adaptiveBatch`` and the BatchAdapted condition (fresh read, under the service lock)."""
    api = rt.api
    with rt.service_locks.hold((namespace, service)):
        fresh = api.get(*GS, namespace, name)
        if fresh is None:
            return
        raw = (fresh.get("status") or {}).get("conditions")
        book = ConditionBook(
            conditions_from(raw),
            fresh["metadata"].get("generation"),
            datetime.fromtimestamp(now, UTC).replace(microsecond=0),
        )
        book.set(COND_BATCH_ADAPTED, *cond)  # type: ignore[arg-type]  # "True" | "False"
        patch_status(
            api, *GS, namespace, name, {"adaptiveBatch": doc, "conditions": book.as_json()}, rt.pruned
        )


# --- kopf ----------------------------------------------------------------------------------------------
def run_tick(rt: Runtime, namespace: str, name: str) -> BatchTick:
    """One tick now, reading the routers over HTTP (see :func:`tick`)."""
    return tick(rt, namespace, name, now=time.time(), source=HttpRouterDecisions())


def _decode(body: kopf.Body, **_: Any) -> bool:
    """Only GearSets whose engines decode run the loop (the PD guide's batch rule is a decode-node rule,
    docs/sources.md#adaptive-batch)."""
    return (body.get("spec") or {}).get("role") in rules.ROLES


# Every router balance round (5 s, or spec.policy.sampleIntervalS when longer): one tick.
gearset_adaptive_batch = sampling_daemon(
    "gearset_adaptive_batch", run_tick, what="adaptive batch tick", floor_s=INTERVAL_S, when=_decode
)
