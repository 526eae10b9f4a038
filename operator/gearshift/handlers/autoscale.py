"""The pipeline-replica autoscaler: per GearSet whose role has ``PDService.spec.<role>.scaling``, every
``spec.policy.sampleIntervalS``, signals → :func:`gearshift.control.scaling.decide_scale` → act.

It acts only by writing ``GearSet.spec.replicas`` (the scale subresource's target: with ``scaling`` absent
the operator never writes it, so HPA/KEDA may drive it instead); the reconciler then sets every stage
StatefulSet of the gear to ``replicas × stage replicas`` together, so there are no half-pipelines.

One tick (:func:`tick`, synchronous, over :class:`~gearshift.handlers.kubeapi.KubeApi`):

1. read the GearSet and its PDService; skip without ``scaling`` or an active gear;
2. ready pipeline replicas of the active gear (the least over its stage StatefulSets);
3. a drain in progress (``status.scaling.draining``) is continued: once the router has had its grace
   period to stop picking the labelled head pods and their in-flight requests are 0 (or the shift
   policy's ``drainTimeoutS`` passed), ``spec.replicas`` goes down; a gear shift starting meanwhile
   aborts the drain (labels removed);
4. a sample: Prometheus (KV-cache usage of the fullest head pod, waiting and running requests, the
   role's P99 against its SLO) plus, for decode, the router pods' ``gearshift_router_no_decode_headroom``
   counter read from their ``/metrics`` (its increase since the last read is the immediate trigger);
5. decide; a scale-up is placed first (:func:`gearshift.control.scaling.place_replicas` over free GPUs of
   the allowed compute classes): what fits is added, what does not sets ``ScalingActive=False``
   (``NoFreeGPU``) and is retried every tick (new nodes make it fit). Nothing is ever evicted. A
   scale-down labels the leaving head pods ``gearshift.io/draining: "true"`` (the router drops them) and
   starts a drain;
6. status: ``status.scaling`` (desired vs ready, the last decision and its reason, the windows' memory),
   ``status.replicas`` (ready pipelines, the scale subresource's), the ``ScalingActive`` condition;
   events for changes.

Status writes re-read the GearSet under the reconciler's per-service lock and change only the
``ScalingActive`` condition, so the shifting loop's and the reconciler's conditions survive.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import kopf

from gearshift.api.common import (
    COND_SCALING_ACTIVE,
    GROUP,
    REASON_SCALED_DOWN,
    REASON_SCALED_UP,
    VERSION,
    ConditionStatus,
)
from gearshift.api.gearset import Gear, ScalingStatus
from gearshift.control import scaling as sc
from gearshift.control.executor_status import from_time, to_time
from gearshift.control.reconcile import SHIFT_STEPS
from gearshift.control.signals import GearSelector, SignalsUnavailable
from gearshift.facts.gpus import UnknownGPUError, compute_score
from gearshift.handlers.common import ConditionBook, conditions_from, emit, patch_status
from gearshift.handlers.kubeapi import GPUP, GS, NODE, POD, STS, KubeApi, KubeApiError
from gearshift.handlers.loop import every_sample_interval, load_gearset_and_service
from gearshift.handlers.reconcile import NotYet, service_lock
from gearshift.handlers.shifting import _gpu_requests
from gearshift.k8s import names
from gearshift.k8s.engine import ENGINE_PORT
from gearshift.k8s.services import ROUTER_PORT
from gearshift.planner.inputs import node_gpus, usable_profile

log = logging.getLogger(__name__)

PLURAL = "gearsets"
#: Seconds the router gets to drop a labelled pod before its in-flight count is trusted: its pod poll
#: (router.membership.POD_POLL_S, 2 s) plus a scrape and a margin.
DRAIN_GRACE_S = 6.0
#: Condition reasons.
REASON_ACTIVE = "ScalingActive"
REASON_NO_FREE_GPU = "NoFreeGPU"
REASON_SCALE_DOWN_DRAINING = "ScaleDownDraining"
REASON_DRAIN_ABORTED = "DrainAborted"
#: Shortest loop period, s.
MIN_INTERVAL_S = 0.5


# --- signals -----------------------------------------------------------------------------------------
class ScaleSignalSource(Protocol):
    """Where a tick gets its numbers (Prometheus and pod endpoints in the operator, a fake in tests)."""

    def sample(self, url: str, sel: GearSelector, metric: str, slo_ms: float, at: float) -> sc.ScaleSample:
        """KV usage, waiting/running and P99 / SLO of ``sel``'s head pods; raises SignalsUnavailable."""
        ...

    def counter(self, pods: Sequence[Mapping[str, Any]], port: int, name: str) -> float | None:
        """Sum of metric ``name`` over the pods' ``/metrics`` (None: none answered)."""
        ...


def _pod_url(pod: Mapping[str, Any], port: int) -> str | None:
    ip = (pod.get("status") or {}).get("podIP")
    return f"http://{ip}:{port}/metrics" if ip else None


class LiveSignals:
    """:class:`ScaleSignalSource` over Prometheus' HTTP API and the pods' own ``/metrics``."""

    def __init__(self, timeout_s: float = 2.0) -> None:
        self.timeout_s = timeout_s

    def sample(self, url: str, sel: GearSelector, metric: str, slo_ms: float, at: float) -> sc.ScaleSample:
        from gearshift.adapters import prometheus
        from gearshift.control.signals import quantile_query, queue_query, running_query, scalar

        queries = {
            "kv": sc.kv_usage_query(sel.matchers()),
            "waiting": queue_query(sel),
            "running": running_query(sel),
            "p99": quantile_query(metric, 0.99, sel),
        }
        results = prometheus.instant_queries(url, queries.values(), self.timeout_s)
        out = {
            key: scalar(results[q], q, required=key in ("waiting", "running")) for key, q in queries.items()
        }
        p99 = out["p99"]
        return sc.ScaleSample(
            at=at,
            kv_cache_usage=out["kv"],
            waiting=out["waiting"] or 0.0,
            running=out["running"] or 0.0,
            p99_ratio=None if p99 is None else p99 * 1000.0 / slo_ms,
        )

    def counter(self, pods: Sequence[Mapping[str, Any]], port: int, name: str) -> float | None:
        import requests

        total, seen = 0.0, False
        for p in pods:
            url = _pod_url(p, port)
            if url is None:
                continue
            try:
                text = requests.get(url, timeout=self.timeout_s).text
            except requests.RequestException:
                continue
            v = sc.parse_counter(text, name)
            if v is not None:
                total, seen = total + v, True
        return total if seen else None


# --- pure helpers over API objects -------------------------------------------------------------------
def state_from_status(s: ScalingStatus | None) -> sc.ScaleState:
    """The decision memory from ``status.scaling``."""
    if s is None:
        return sc.ScaleState()
    return sc.ScaleState(
        up_since=from_time(s.up_since),
        up_floor=s.up_floor,
        down_since=from_time(s.down_since),
        down_ceiling=s.down_ceiling,
        idle_since=from_time(s.idle_since),
        last_scale_at=from_time(s.last_scale_time),
        last_reason=s.last_reason or "",
    )


def ready_pipelines(
    gear: Gear, statefulsets: Mapping[str, Mapping[str, Any]], service: str, role: str
) -> int:
    """Ready pipeline replicas of ``gear``: the least over stages of ready pods / pods per replica."""
    ready = None
    for k, st in enumerate(gear.stages):
        obj = statefulsets.get(names.stage_statefulset_name(service, role, gear.name, k)) or {}
        r = int((obj.get("status") or {}).get("readyReplicas") or 0) // max(st.replicas, 1)
        ready = r if ready is None else min(ready, r)
    return ready or 0


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
            used[host] = used.get(host, 0) + _gpu_requests(p)
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


def stage_needs(gear: Gear, pods: Sequence[Mapping[str, Any]]) -> list[sc.StageNeed]:
    """What each stage of ``gear`` needs per new pipeline replica; ``pods``: the gear's pods now."""
    out = []
    for k, st in enumerate(gear.stages):
        occupied = frozenset(
            str((p.get("spec") or {}).get("nodeName"))
            for p in pods
            if ((p.get("metadata") or {}).get("labels") or {}).get(names.LABEL_STAGE) == str(k)
            and (p.get("spec") or {}).get("nodeName")
        )
        out.append(sc.StageNeed(st.gpus, st.replicas, tuple(st.nodes), dict(st.node_selector), occupied))
    return out


# --- one tick ----------------------------------------------------------------------------------------
@dataclass
class TickResult:
    """What one tick did (logs and tests)."""

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


def _set_replicas(api: KubeApi, namespace: str, name: str, replicas: int) -> None:
    api.patch(*GS, namespace, name, {"spec": {"replicas": replicas}})


def tick(
    api: KubeApi,
    namespace: str,
    name: str,
    *,
    now: float,
    prometheus_url: str | None,
    signals: ScaleSignalSource,
) -> TickResult:
    """One turn of the autoscaler for GearSet ``namespace/name`` (module docstring).

    Raises:
        KubeApiError: the API server refused a read or write (the loop retries next turn).
    """
    loaded = load_gearset_and_service(api, namespace, name)
    if isinstance(loaded, str):
        return TickResult(skipped=loaded)
    gs_body, gs, pds = loaded
    role, service = gs.spec.role, gs.spec.service_name
    role_spec = getattr(pds.spec, role)
    if role_spec.scaling is None:
        return TickResult(skipped="no scaling section: replicas stay as spec.replicas says", idle=True)
    gears = {g.name: g for g in gs.gears()}
    active = gs.status.active_gear
    if active not in gears:
        return TickResult(skipped="no active gear yet")
    gear = gears[active]
    policy = sc.ScalingPolicy.from_spec(role_spec.scaling)
    allowed = list(role_spec.scaling.compute_classes)
    current = gs.spec.replicas
    shifting = gs.status.executor is not None and gs.status.executor.step in SHIFT_STEPS
    labels = {names.LABEL_SERVICE: service, names.LABEL_ROLE: role, names.LABEL_GEAR: active}
    sts = {s["metadata"]["name"]: s for s in api.list(*STS, namespace, labels)}
    ready = ready_pipelines(gear, sts, service, role)
    gear_pods = api.list(*POD, namespace, labels)
    heads = [p for p in gear_pods if ((p["metadata"].get("labels") or {}).get(names.LABEL_STAGE)) == "0"]
    old = gs.status.scaling or ScalingStatus()
    st: dict[str, Any] = old.to_json()
    result = TickResult()
    events: list[tuple[str, str, bool]] = []
    cond: tuple[ConditionStatus, str, str] | None = None

    # --- a drain in progress --------------------------------------------------------------------------
    if old.draining:
        started = from_time(old.drain_started_at) or now
        if shifting:
            _label_draining(api, namespace, old.draining, on=False)
            events.append(
                (REASON_DRAIN_ABORTED, "a gear shift started; the scale-down drain is aborted", False)
            )
            st.update(draining=[], drainTarget=None, drainStartedAt=None)
        else:
            draining_pods = [p for p in heads if p["metadata"]["name"] in old.draining]
            in_flight = signals.counter(draining_pods, ENGINE_PORT, "vllm:num_requests_running")
            waiting = signals.counter(draining_pods, ENGINE_PORT, "vllm:num_requests_waiting")
            total = None if in_flight is None or waiting is None else int(in_flight + waiting)
            if not draining_pods:
                total = 0  # the pods are gone already
            d = sc.drain_done(
                started, now, total, grace_s=DRAIN_GRACE_S, timeout_s=gs.spec.policy.drain_timeout_s
            )
            st["lastMessage"] = d.message
            if d.done:
                target = old.drain_target if old.drain_target is not None else current
                _set_replicas(api, namespace, name, target)
                result.replicas = target
                events.append(
                    (
                        REASON_SCALED_DOWN,
                        f"{current} -> {target} pipeline replicas: {d.message}",
                        d.reason == "DrainTimeout",
                    )
                )
                st.update(
                    draining=[],
                    drainTarget=None,
                    drainStartedAt=None,
                    lastScaleTime=to_time(now),
                    desiredReplicas=target,
                )
            else:
                result.draining = list(old.draining)
            _write_status(api, namespace, name, service, st, ready, None, now, gs_body)
            _emit_all(api, gs_body, events)
            return result

    # --- sample and decide -----------------------------------------------------------------------------
    state = state_from_status(old)
    sample: sc.ScaleSample | None = None
    if prometheus_url := (pds.spec.prometheus_url or prometheus_url):
        metric = (
            "vllm:time_to_first_token_seconds" if role == "prefill" else "vllm:inter_token_latency_seconds"
        )
        slo = pds.spec.slo.ttft_ms if role == "prefill" else pds.spec.slo.itl_ms
        try:
            sample = signals.sample(
                prometheus_url, GearSelector(namespace, service, role, active), metric, slo, now
            )
        except SignalsUnavailable as exc:
            st["lastMessage"] = str(exc)[:4000]
    if role == "decode":
        router_pods = api.list(
            *POD, namespace, {names.LABEL_SERVICE: service, names.LABEL_COMPONENT: names.COMPONENT_ROUTER}
        )
        value = signals.counter(router_pods, ROUTER_PORT, sc.NO_HEADROOM_TOTAL)
        delta = sc.counter_delta(old.router_rejections, value)
        if value is not None:
            st["routerRejections"] = value
        if sample is not None:
            sample = replace(sample, no_headroom=delta)
        elif delta > 0:
            sample = sc.ScaleSample(at=now, no_headroom=delta, running=1.0)
    new_state, decision = sc.decide_scale(
        state, sample, policy, current=current, ready=ready, now=now, shift_in_flight=shifting
    )
    result.decision = decision
    desired = current
    if decision.kind is sc.ScaleKind.UP:
        add = decision.target - current
        placement = sc.place_replicas(
            stage_needs(gear, gear_pods),
            add,
            node_views(api.list(*NODE), api.list(*POD), {p["metadata"]["name"]: p for p in api.list(*GPUP)}),
            allowed,
        )
        if placement.replicas > 0:
            desired = current + placement.replicas
            _set_replicas(api, namespace, name, desired)
            result.replicas = desired
            where = "; ".join(",".join(r) for r in placement.nodes)
            st["placement"] = f"new replicas on: {where}"[:4000]
            events.append(
                (
                    REASON_SCALED_UP,
                    f"{current} -> {desired} pipeline replicas ({decision.reason}): "
                    f"{decision.message}; nodes {where}",
                    False,
                )
            )
        if placement.short:
            cond = (
                "False",
                REASON_NO_FREE_GPU,
                f"{decision.reason} asks {decision.target} replicas, {desired} placed: {placement.short}; "
                "retried when nodes appear, nothing is evicted",
            )
            if placement.replicas == 0:
                # Keep the window's memory so that the next tick retries at once.
                new_state = replace(
                    new_state,
                    up_since=state.up_since,
                    up_floor=state.up_floor,
                    last_scale_at=state.last_scale_at,
                )
    elif decision.kind is sc.ScaleKind.DOWN:
        leaving = sc.pods_to_drain(
            [p["metadata"]["name"] for p in heads], decision.target, gear.stages[0].replicas
        )
        if leaving:
            _label_draining(api, namespace, leaving, on=True)
            st.update(draining=leaving, drainTarget=decision.target, drainStartedAt=to_time(now))
            result.draining = leaving
            events.append(
                (
                    REASON_SCALE_DOWN_DRAINING,
                    f"{current} -> {decision.target}: draining {', '.join(leaving)} "
                    f"({decision.reason}: {decision.message})",
                    False,
                )
            )
        else:
            desired = decision.target
            _set_replicas(api, namespace, name, desired)
            result.replicas = desired
            events.append((REASON_SCALED_DOWN, f"{current} -> {desired} pipeline replicas", False))
    if cond is None:
        cond = ("True", REASON_ACTIVE, f"{decision.reason}: {decision.message}"[:4000])
    st.update(
        desiredReplicas=desired,
        lastDecision=decision.kind.value,
        lastReason=decision.reason,
        lastMessage=decision.message[:4000],
        upSince=to_time(new_state.up_since),
        upFloor=new_state.up_floor,
        downSince=to_time(new_state.down_since),
        downCeiling=new_state.down_ceiling,
        idleSince=to_time(new_state.idle_since),
        lastScaleTime=to_time(new_state.last_scale_at),
    )
    _write_status(api, namespace, name, service, st, ready, cond, now, gs_body)
    _emit_all(api, gs_body, events)
    return result


def _write_status(
    api: KubeApi,
    namespace: str,
    name: str,
    service: str,
    scaling: dict[str, Any],
    ready: int,
    cond: tuple[ConditionStatus, str, str] | None,
    now: float,
    gs_body: Mapping[str, Any],
) -> None:
    """Write ``status.scaling``, ``status.replicas`` and the ScalingActive condition (fresh read, locked)."""
    from datetime import UTC, datetime

    scaling["readyReplicas"] = ready
    with service_lock(namespace, service):
        fresh = api.get(*GS, namespace, name)
        if fresh is None:
            return
        patch: dict[str, Any] = {"scaling": scaling, "replicas": ready}
        if cond is not None:
            gen = fresh["metadata"].get("generation")
            raw = (fresh.get("status") or {}).get("conditions")
            book = ConditionBook(
                conditions_from(raw), gen, datetime.fromtimestamp(now, UTC).replace(microsecond=0)
            )
            book.set(COND_SCALING_ACTIVE, cond[0], cond[1], cond[2], warning=cond[0] == "False")
            if book.changes and (cond[0] == "False" or _flipped(raw, cond[0])):
                for reason, message, warning in book.changes:
                    emit(api, gs_body, reason, message, warning)
            patch["conditions"] = book.as_json()
        patch_status(api, *GS, namespace, name, patch)


def _flipped(raw: Any, status: str) -> bool:
    old = next((c for c in raw or [] if c.get("type") == COND_SCALING_ACTIVE), None)
    return old is None or old.get("status") != status


def _emit_all(api: KubeApi, body: Mapping[str, Any], events: Sequence[tuple[str, str, bool]]) -> None:
    for reason, message, warning in events:
        emit(api, body, reason, message, warning)


# --- kopf ----------------------------------------------------------------------------------------------
_signals: ScaleSignalSource = LiveSignals()


def configure(signals: ScaleSignalSource) -> None:
    """Swap the signal source (tests)."""
    global _signals
    _signals = signals


def run_tick(namespace: str, name: str) -> TickResult:
    """One tick with the operator's API client and settings."""
    from gearshift.handlers import pdservice

    return tick(
        pdservice.api(),
        namespace,
        name,
        now=time.time(),
        prometheus_url=pdservice.settings().prometheus_url,
        signals=_signals,
    )


def _autoscaled(body: kopf.Body, **_: Any) -> bool:
    """The reconciler marks GearSets whose role the PDService scales; kopf starts the daemon only then
    (and stops it when the mark goes), so idle services cost no sampling."""
    return bool((body.get("status") or {}).get("autoscaled"))


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=10.0, when=_autoscaled)  # type: ignore[arg-type]  # namespaced kind: kopf's namespace (str | None) is a str
async def gearset_autoscale(
    namespace: str, name: str, body: kopf.Body, stopped: kopf.DaemonStopped, **_: Any
) -> None:
    """Every ``spec.policy.sampleIntervalS``: one :func:`tick` (in a thread: the API client is sync)."""
    await every_sample_interval(
        namespace,
        name,
        body,
        stopped,
        run_tick,
        what="autoscale tick",
        floor_s=MIN_INTERVAL_S,
        expected=(KubeApiError, NotYet, KeyError),
    )
