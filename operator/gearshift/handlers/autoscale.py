"""The pipeline-replica autoscaler: per GearSet whose role has ``PDService.spec.<role>.scaling``, every
``spec.policy.sampleIntervalS``, signals → :func:`gearshift.control.autoscale.scaling.decide_scale` → act.

It acts only by writing ``GearSet.spec.replicas`` (the scale subresource's target: with ``scaling`` absent
the operator never writes it, so HPA/KEDA may drive it instead); the reconciler then sets every stage
StatefulSet of the gear to ``replicas × stage replicas`` together, so there are no half-pipelines.

One tick (:func:`tick`, synchronous, over :class:`~gearshift.adapters.kube.KubeApi`):

1. read the GearSet and its PDService; skip without ``scaling`` or an active gear;
2. ready pipeline replicas of the active gear (the least over its stage StatefulSets);
3. a drain in progress (``status.scaling.draining``) is continued: once the router has had its grace
   period to stop picking the labelled head pods and their in-flight requests are 0 (or the shift
   policy's ``drainTimeoutS`` passed), ``spec.replicas`` goes down; a gear shift starting meanwhile
   aborts the drain (labels removed);
4. a sample: Prometheus (KV-cache usage of the fullest head pod, waiting and running requests, the
   role's P99 against its SLO) plus, for decode, the router pods' ``gearshift_router_no_decode_headroom``
   counter read from their ``/metrics`` (its increase since the last read is the immediate trigger);
5. decide; a scale-up is placed first (:func:`gearshift.control.autoscale.scaling.place_replicas` over free
GPUs of
   the allowed compute classes): what fits is added, what does not sets ``ScalingActive=False``
   (``NoFreeGPU``) and is retried every tick (new nodes make it fit). Nothing is ever evicted. A
   scale-down labels the leaving head pods ``gearshift.io/draining: "true"`` (the router drops them) and
   starts a drain;
6. status: ``status.scaling`` (desired vs ready, the last decision and its reason, the windows' memory),
   ``status.replicas`` (ready pipelines, the scale subresource's), the ``ScalingActive`` condition;
   events for changes.

The rules of a tick (the scope and its knobs, what it reads off pods and StatefulSets, the drain, what a
decision writes) are :mod:`gearshift.control.autoscale.tick`'s; this module reads, calls them, writes and
records. Status writes re-read the GearSet under the reconciler's per-service lock and change only the
``ScalingActive`` condition, so the shifting loop's and the reconciler's conditions survive.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kopf

from gearshift.adapters.kube import GPUP, GS, NODE, POD, STS, KubeApi, KubeApiError
from gearshift.adapters.signals import ScaleSignalSource
from gearshift.api.common import COND_SCALING_ACTIVE
from gearshift.api.gearset_status import ScalingStatus
from gearshift.control.autoscale import scaling as sc
from gearshift.control.autoscale import tick as rules
from gearshift.control.signals import SignalsUnavailable
from gearshift.facts.gpus import UnknownGPUError, compute_score
from gearshift.handlers.common import ConditionBook, conditions_from, emit, patch_status
from gearshift.handlers.loop import load_gearset_and_service, sampling_daemon
from gearshift.handlers.runtime import Runtime
from gearshift.k8s import names
from gearshift.k8s.engine import ENGINE_PORT
from gearshift.k8s.placement import pod_gpus
from gearshift.k8s.services import ROUTER_PORT
from gearshift.planner.inputs import node_gpus, usable_profile

log = logging.getLogger(__name__)

#: Shortest loop period, s.
MIN_INTERVAL_S = 0.5


# --- reads ---------------------------------------------------------------------------------------------
def node_views(
    nodes: Sequence[Mapping[str, Any]],
    pods: Sequence[Mapping[str, Any]],
    profiles: Mapping[str, Mapping[str, Any]],
) -> list[sc.NodeView]:
    """Free GPUs and compute per GPU of every GPU node (GPUProfile, else the datasheet of its label)."""
    used: dict[str, int] = {}
    for p in pods:
        host = (p.get("spec") or {}).get("nodeName")
        if host and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
            used[host] = used.get(host, 0) + pod_gpus(p)
    out = []
    for n in nodes:
        meta = n.get("metadata") or {}
        name, labels = meta["name"], meta.get("labels") or {}
        total = node_gpus(n)
        if total <= 0 or (n.get("spec") or {}).get("unschedulable"):
            continue
        eff = usable_profile(profiles[name]) if name in profiles else None
        per_gpu = 0.0
        cls = labels.get(names.NODE_COMPUTE_CLASS)
        if eff is not None and eff.compute_score:
            per_gpu = eff.compute_score / max(eff.gpu_count or total, 1)
            cls = eff.compute_class or cls
        elif labels.get(names.NODE_GPU_MODEL):
            try:
                per_gpu = compute_score(labels[names.NODE_GPU_MODEL])
            except UnknownGPUError:
                per_gpu = 0.0
        out.append(sc.NodeView(name, total - used.get(name, 0), per_gpu, cls, dict(labels)))
    return out


def _sample(
    api: KubeApi,
    namespace: str,
    scope: rules.ScaleScope,
    old: ScalingStatus,
    scaling: Mapping[str, Any],
    now: float,
    signals: ScaleSignalSource,
) -> tuple[sc.ScaleSample | None, dict[str, Any]]:
    """This tick's sample (Prometheus, and the router's rejection counter for decode) and
    ``status.scaling`` with what the reads leave there."""
    sample: sc.ScaleSample | None = None
    unavailable = rejections = None
    if scope.prometheus_url:
        try:
            sample = signals.sample(
                scope.prometheus_url,
                scope.selector(namespace),
                scope.latency.metric,
                scope.latency.slo_ms,
                now,
            )
        except SignalsUnavailable as exc:
            unavailable = str(exc)
    if scope.role in ("decode", "both"):  # the router places both pods as decode pods (KV headroom)
        router_pods = api.list(
            *POD,
            namespace,
            {names.LABEL_SERVICE: scope.service, names.LABEL_COMPONENT: names.COMPONENT_ROUTER},
        )
        rejections = signals.counter(router_pods, ROUTER_PORT, sc.NO_HEADROOM_TOTAL)
        sample = rules.with_rejections(sample, old.router_rejections, rejections, now)
    return sample, rules.observed(scaling, unavailable=unavailable, rejections=rejections)


def _place(
    api: KubeApi, scope: rules.ScaleScope, gear_pods: Sequence[Mapping[str, Any]], add: int
) -> sc.Placement:
    """Where ``add`` new pipeline replicas of the scope's gear fit on the free GPUs now."""
    profiles = {p["metadata"]["name"]: p for p in api.list(*GPUP)}
    nodes = node_views(api.list(*NODE), api.list(*POD), profiles)
    return sc.place_replicas(rules.stage_needs(scope.gear, gear_pods), add, nodes, scope.compute_classes)


# --- one tick ----------------------------------------------------------------------------------------
@dataclass
class ScaleTick:
    """What one autoscaler tick did (logs and tests)."""

    skipped: str = ""
    idle: bool = False
    """Nothing to do until the spec changes: the loop waits longer before the next turn."""
    decision: sc.ScaleDecision | None = None
    replicas: int | None = None
    """``spec.replicas`` written this tick, if any."""
    draining: list[str] = field(default_factory=list)


def _label_draining(api: KubeApi, namespace: str, pods: Sequence[str], on: bool) -> None:
    for p in pods:
        try:
            api.patch(
                "v1",
                "Pod",
                namespace,
                p,
                {"metadata": {"labels": {names.LABEL_DRAINING: "true" if on else None}}},
            )
        except KubeApiError as exc:
            if exc.status != 404:
                raise


def _set_replicas(api: KubeApi, namespace: str, name: str, replicas: int | None) -> None:
    if replicas is not None:
        api.patch(*GS, namespace, name, {"spec": {"replicas": replicas}})


def _drain_step(
    scope: rules.ScaleScope,
    old: ScalingStatus,
    heads: Sequence[Mapping[str, Any]],
    now: float,
    signals: ScaleSignalSource,
) -> rules.DrainStep:
    """The drain in ``old`` one tick on: the leaving heads' requests read off their ``/metrics``."""
    leaving = [p for p in heads if p["metadata"]["name"] in old.draining]
    running = signals.counter(leaving, ENGINE_PORT, rules.RUNNING_GAUGE)
    waiting = signals.counter(leaving, ENGINE_PORT, rules.WAITING_GAUGE)
    return rules.continue_drain(
        old,
        in_flight=rules.drain_in_flight(running, waiting, len(leaving)),
        now=now,
        current=scope.current,
        timeout_s=scope.drain_timeout_s,
    )


def _decide(
    api: KubeApi,
    scope: rules.ScaleScope,
    old: ScalingStatus,
    sample: sc.ScaleSample | None,
    scaling: Mapping[str, Any],
    ready: int,
    gear_pods: Sequence[Mapping[str, Any]],
    now: float,
) -> tuple[sc.ScaleDecision, rules.ScaleActions]:
    """The decision on ``sample`` and what it writes (a scale-up placed on the free GPUs read now)."""
    state = rules.state_from_status(old)
    new_state, decision = sc.decide_scale(
        state,
        sample,
        scope.policy,
        current=scope.current,
        ready=ready,
        now=now,
        shift_in_flight=scope.shift_in_flight,
    )
    add = decision.target - scope.current
    placement = _place(api, scope, gear_pods, add) if decision.kind is sc.ScaleKind.UP else None
    return decision, rules.act_on(
        decision,
        before=state,
        after=new_state,
        scaling=scaling,
        current=scope.current,
        placement=placement,
        heads=[p["metadata"]["name"] for p in rules.head_pods(gear_pods)],
        pods_per_replica=scope.gear.stages[0].replicas,
        now=now,
    )


def tick(rt: Runtime, namespace: str, name: str, *, now: float, signals: ScaleSignalSource) -> ScaleTick:
    """One turn of the autoscaler for GearSet ``namespace/name`` (module docstring), with the runtime's
    API and Prometheus URL (``rt.settings.prometheus_url``, unless the PDService names one), sampling
    ``signals``.

    Raises:
        KubeApiError: the API server refused a read or write (the loop retries next turn).
    """
    api = rt.api
    loaded = load_gearset_and_service(api, namespace, name)
    if isinstance(loaded, str):
        return ScaleTick(skipped=loaded)
    gs_body, gs, pds = loaded
    scope = rules.scope_of(gs, pds, rt.settings.prometheus_url)
    if isinstance(scope, rules.Skip):
        return ScaleTick(skipped=scope.reason, idle=scope.idle)
    sts = {s["metadata"]["name"]: s for s in api.list(*STS, namespace, scope.pod_labels())}
    ready = rules.ready_pipelines(scope.gear, sts, scope.service, scope.role)
    gear_pods = api.list(*POD, namespace, scope.pod_labels())
    old = gs.status.scaling or ScalingStatus()
    scaling = old.to_json()
    events: list[rules.ScaleEvent] = []
    if old.draining and scope.shift_in_flight:
        aborted = rules.abort_drain(scaling, old.draining)
        _label_draining(api, namespace, aborted.unlabel, on=False)
        scaling, events = aborted.scaling, list(aborted.events)
    elif old.draining:
        step = _drain_step(scope, old, rules.head_pods(gear_pods), now, signals)
        _set_replicas(api, namespace, name, step.replicas)
        _write_status(rt, namespace, name, scope.service, step.scaling, ready, None, now, gs_body)
        _emit_all(api, gs_body, step.events)
        return ScaleTick(replicas=step.replicas, draining=list(step.draining))
    sample, scaling = _sample(api, namespace, scope, old, scaling, now, signals)
    decision, act = _decide(api, scope, old, sample, scaling, ready, gear_pods, now)
    _set_replicas(api, namespace, name, act.replicas)
    _label_draining(api, namespace, act.label, on=True)
    _write_status(rt, namespace, name, scope.service, act.scaling, ready, act.condition, now, gs_body)
    _emit_all(api, gs_body, [*events, *act.events])
    return ScaleTick(decision=decision, replicas=act.replicas, draining=list(act.label))


def _write_status(
    rt: Runtime,
    namespace: str,
    name: str,
    service: str,
    scaling: Mapping[str, Any],
    ready: int,
    cond: rules.ScalingCondition | None,
    now: float,
    gs_body: Mapping[str, Any],
) -> None:
    """Write ``status.scaling``, ``status.replicas`` and the ScalingActive condition (fresh read, locked)."""
    api = rt.api
    with rt.service_locks.hold((namespace, service)):
        fresh = api.get(*GS, namespace, name)
        if fresh is None:
            return
        patch = rules.status_patch(scaling, ready)
        if cond is not None:
            gen = fresh["metadata"].get("generation")
            raw = (fresh.get("status") or {}).get("conditions")
            book = ConditionBook(
                conditions_from(raw), gen, datetime.fromtimestamp(now, UTC).replace(microsecond=0)
            )
            book.set(COND_SCALING_ACTIVE, cond[0], cond[1], cond[2], warning=cond[0] == "False")
            if book.changes and rules.announce_condition(raw, cond[0]):
                for reason, message, warning in book.changes:
                    emit(api, gs_body, reason, message, warning)
            patch["conditions"] = book.as_json()
        patch_status(api, *GS, namespace, name, patch, rt.pruned)


def _emit_all(api: KubeApi, body: Mapping[str, Any], events: Iterable[rules.ScaleEvent]) -> None:
    for reason, message, warning in events:
        emit(api, body, reason, message, warning)


# --- kopf ----------------------------------------------------------------------------------------------
def run_tick(rt: Runtime, namespace: str, name: str) -> ScaleTick:
    """One tick now, sampling the runtime's signal source (see :func:`tick`)."""
    return tick(rt, namespace, name, now=time.time(), signals=rt.scale_signals)


def _autoscaled(body: kopf.Body, **_: Any) -> bool:
    """The reconciler marks GearSets whose role the PDService scales; kopf starts the daemon only then
    (and stops it when the mark goes), so idle services cost no sampling."""
    return bool((body.get("status") or {}).get("autoscaled"))


gearset_autoscale = sampling_daemon(
    "gearset_autoscale", run_tick, what="autoscale tick", floor_s=MIN_INTERVAL_S, when=_autoscaled
)
