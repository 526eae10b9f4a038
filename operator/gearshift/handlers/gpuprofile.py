"""kopf handlers of GPUProfiles: run probe Jobs, write status, classify the fleet, label the nodes.

One timer per GPUProfile (every :data:`TICK_S`; every :data:`READY_TICK_S` while the profile is Ready)
takes one level-triggered step of the life cycle in
:mod:`gearshift.profiling.lifecycle`: mark the profile Stale when its node is gone, create a probe Job when
one is due, read a finished Job's termination message, back off after failures; then it sets the
compute class from the fleet (:func:`gearshift.profiling.profiles.classify` over the ``profile_scores`` index)
and makes the node's ``gearshift.io/*`` labels match the profile (removed unless Ready).

The decisions are the life cycle's pure functions; this module makes the calls between them, through the
operator's :class:`~gearshift.adapters.kube.KubeApi` (the :class:`~gearshift.handlers.runtime.Runtime`'s,
from kopf's ``memo``). Status is written with the status subresource by this module (not through kopf's
``patch``), and the object returned is remembered (``Runtime.profiles``): a tick that runs before the
watch delivers that write uses the remembered status, so a probe is never started twice. Importing this
module also registers :mod:`gearshift.handlers.nodes`.
"""

from __future__ import annotations

import functools
from datetime import UTC, datetime
from typing import Any

import kopf

from gearshift.adapters.kube import GPUP, JOB, NODE, KubeApi, KubeApiError
from gearshift.adapters.memory import ProfileMemory
from gearshift.api.common import API_VERSION, GROUP, VERSION
from gearshift.api.gpuprofile import GPUProfileSpec, GPUProfileStatus, ProfileOverride
from gearshift.handlers import common, nodes
from gearshift.handlers.loop import step_timer
from gearshift.handlers.runtime import Runtime, runtime_of
from gearshift.k8s.names import COMPONENT_PROBE, LABEL_COMPONENT, LABEL_MANAGED_BY, MANAGED_BY
from gearshift.k8s.probejob import build_probe_job_spec, probe_job_name
from gearshift.profiling.lifecycle import (
    complete_step,
    dump_status,
    job_create_failed,
    node_gone_step,
    probe_finished,
    probe_start,
    ready_override_step,
    running_job,
    start_probe,
)
from gearshift.profiling.outcome import job_outcome
from gearshift.profiling.profiles import GpuNodeView, card_score, classify, labels_patch, node_labels
from gearshift.profiling.settings import ProbeSettings
from gearshift.profiling.steps import Step

PLURAL = nodes.PLURAL
#: Seconds between two steps of one profile; bounds how late a finished probe or a new node is seen.
TICK_S = 2.0
#: Seconds between two steps of a Ready profile. Its steps then only notice slow changes (a node gone or
#: its GPU changed, a declared window, a re-probe due, the fleet's classes), and an idle fleet of many
#: nodes would otherwise keep the operator busy with do-nothing ticks (no hot loop when idle).
READY_TICK_S = 10.0
#: Seconds before a step whose status write was pruned (an older CRD) is tried again: nothing changes
#: until the CRD is upgraded, and each try may start work (a probe Job) whose record would be dropped.
PRUNED_RETRY_S = 60.0


def _rv(body: kopf.Body | dict[str, Any]) -> int:
    try:
        return int(body.get("metadata", {}).get("resourceVersion", "0"))
    except ValueError:
        return 0


@kopf.index(GROUP, VERSION, PLURAL)
async def profile_scores(name: str, status: kopf.Status, **_: Any) -> dict[str, float] | None:
    """Index ``profile name → per-card compute score`` of profiles whose numbers are usable."""
    try:
        st = GPUProfileStatus.model_validate(dict(status))
    except ValueError:
        return None
    if st.phase not in ("Ready", "Probing") or st.probe_time is None:
        return None
    score = card_score(st)
    return {name: score} if score is not None else None


@functools.lru_cache(maxsize=64)
def _classes(items: tuple[tuple[str, float], ...]) -> dict[str, str]:
    return dict(classify(dict(items)))


#: Attempts at reading a kopf index from a handler thread while the event loop may change it.
INDEX_READ_ATTEMPTS = 20


def index_snapshot(index: kopf.Index[str, Any]) -> list[tuple[str, list[Any]]]:
    """``[(key, values)]`` of a kopf index, read from a handler thread.

    kopf updates its indices on the event loop while synchronous handlers run in threads: iterating one
    there raised ``RuntimeError: dictionary changed size during iteration`` when an event landed
    mid-read, and kopf retried the whole timer 60 s later (58 times while 1,000 nodes were profiled,
    bench/fleet_operator.py). A read that meets a change is done again.
    """
    for _ in range(INDEX_READ_ATTEMPTS - 1):
        try:
            return [(k, list(store)) for k, store in list(index.items())]
        except RuntimeError:
            continue
    return [(k, list(store)) for k, store in list(index.items())]


def fleet_classes(index: kopf.Index[str, float]) -> dict[str, str]:
    """Compute class of every usable profile, memoised on the fleet's scores."""
    items = tuple(sorted((n, store[0]) for n, store in index_snapshot(index) if store))
    return _classes(items)


def _now() -> datetime:
    return datetime.now(UTC)


def _read_job(rt: Runtime, namespace: str, name: str) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The probe Job and its pods (API dicts), or ``(None, [])`` when the Job is gone: from the listing of
    every probe Job that all profiles share (:class:`~gearshift.adapters.caches.ProbeJobs`)."""
    selector = {LABEL_COMPONENT: COMPONENT_PROBE, LABEL_MANAGED_BY: MANAGED_BY}
    return rt.probe_jobs.job(rt.api, namespace, name, selector)


def _delete_job(api: KubeApi, namespace: str, name: str) -> None:
    api.delete(*JOB, namespace, name)  # background propagation: its pods go too; gone already is fine


def _write_status(rt: Runtime, name: str, status: GPUProfileStatus) -> None:
    """Write ``status`` and remember what was stored (``Runtime.profiles``).

    Through the same pruning check as GearSet and PDService writes (:func:`common.patch_status`): a
    GPUProfile CRD older than the operator would drop fields the life cycle goes on from (a probe Job's
    name: the next tick would start another probe).

    Raises:
        kopf.TemporaryError: fields were pruned, after the ``FieldsPruned`` Warning event and
            ``CRDCurrent=False`` (once per profile and loss); the step stops there and is tried again.
        KubeApiError: the patch failed.
    """
    try:
        obj = common.patch_status(rt.api, *GPUP, None, name, dump_status(status), rt.pruned)
    except common.StatusPruned as exc:
        raise kopf.TemporaryError(str(exc), delay=PRUNED_RETRY_S) from None
    rt.profiles.wrote(name, _rv(obj), obj.get("status") or {})


def _known_status(memory: ProfileMemory, name: str, body: kopf.Body) -> GPUProfileStatus:
    """The profile's status: the one this process last wrote when the watch has not delivered it yet."""
    raw = dict(body.get("status") or {})
    cached = memory.written(name)
    if cached is not None and cached[0] > _rv(body):
        raw = cached[1]
    return GPUProfileStatus.model_validate(raw)


def _label_node(
    api: KubeApi, node: str, status: GPUProfileStatus | None, current: dict[str, str], logger: Any
) -> bool:
    patch = labels_patch(current, node_labels(status))
    if not patch:
        return False
    try:
        api.patch(*NODE, None, node, {"metadata": {"labels": patch}})
    except KubeApiError as exc:
        if exc.status == 404:
            return False
        raise kopf.TemporaryError(f"cannot label node {node}: {exc}", delay=5) from None
    logger.info("node %s labels: %s", node, patch)
    return True


def _create_job(api: KubeApi, s: ProbeSettings, body: kopf.Body, node: GpuNodeView, now: datetime) -> str:
    name = probe_job_name(node.name, now)
    owner = {"apiVersion": API_VERSION, "kind": "GPUProfile", "name": body["metadata"]["name"]}
    owner["uid"] = body["metadata"]["uid"]
    job = build_probe_job_spec(
        node=node.name,
        gpu_count=node.gpu_count,
        owner=owner,
        job_name=name,
        config=s.job,
        node_annotations=node.annotations,
    )
    api.create(job)
    return name


def _is_ready(body: kopf.Body, **_: Any) -> bool:
    return (body.get("status") or {}).get("phase") == "Ready"


def _is_not_ready(body: kopf.Body, **_: Any) -> bool:
    return not _is_ready(body)


def _timer_step(
    rt: Runtime,
    *,
    name: str,
    body: kopf.Body,
    spec: kopf.Spec,
    meta: kopf.Meta,
    gpu_nodes: kopf.Index[str, GpuNodeView],
    profile_scores: kopf.Index[str, float],
    logger: Any,
    **_: Any,
) -> None:
    """One step of the probe life cycle of this profile, now (see the module docstring)."""
    _step(rt, name, body, spec, meta, gpu_nodes, profile_scores, logger, _now())


# kopf starts and stops a timer as its filter starts and stops matching, so one of the two runs: a Ready
# profile steps at the slower READY_TICK_S.
gpuprofile_reconcile = step_timer(
    "gpuprofile_reconcile", PLURAL, _timer_step, interval=TICK_S, when=_is_not_ready
)
gpuprofile_ready_reconcile = step_timer(
    "gpuprofile_ready_reconcile",
    PLURAL,
    _timer_step,
    interval=READY_TICK_S,
    initial_delay=READY_TICK_S,
    when=_is_ready,
)


def _step(
    rt: Runtime,
    name: str,
    body: kopf.Body,
    spec: kopf.Spec,
    meta: kopf.Meta,
    gpu_nodes: kopf.Index[str, GpuNodeView],
    profile_scores: kopf.Index[str, float],
    logger: Any,
    now: datetime,
) -> None:
    """Read the profile and its node, take the life cycle's step (with its Job calls) at ``now``, write
    the status, record the events, label the node.

    Raises:
        kopf.PermanentError: an invalid spec.
        kopf.TemporaryError: the node's labels could not be written.
        KubeApiError: another API call refused (kopf retries the timer).
    """
    api, s, generation = rt.api, rt.probe_settings(), meta.get("generation")
    try:
        pspec = GPUProfileSpec.model_validate(dict(spec))
    except ValueError as exc:
        raise kopf.PermanentError(f"invalid spec: {exc}") from None
    status = _known_status(rt.profiles, name, body)
    node_store = gpu_nodes.get(pspec.node_name)
    node = next(iter(node_store)) if node_store else None
    job = running_job(status)
    step: Step | None
    if node is None:
        step = _node_gone(api, s, status, pspec.node_name, now, generation, logger)
    elif job is not None:
        peers = _all_nodes(gpu_nodes)
        step = _probe_outcome(rt, s, status, job, node, pspec.override, peers, now, generation)
    else:
        step = _start_if_due(api, s, body, status, node, pspec.override, now, generation)
    fleet_class = rt.profiles.classes.get(lambda: fleet_classes(profile_scores)).get(name)
    step = complete_step(step, status, node, pspec.override, fleet_class, now=now, generation=generation)
    current = status
    if step is not None:
        _write_status(rt, name, step.status)
        _emit(body, step)
        current = step.status
    if node is not None:
        _label_node(api, node.name, current, dict(node.labels), logger)


def _node_gone(
    api: KubeApi,
    s: ProbeSettings,
    status: GPUProfileStatus,
    node_name: str,
    now: datetime,
    generation: int | None,
    logger: Any,
) -> Step | None:
    """Stale once its node is gone: the probe Job in flight deleted, the labels of a node that stays (it
    lost its GPUs) removed."""
    step = node_gone_step(status, node_name, now=now, generation=generation)
    if step is None:
        return None
    job = running_job(status)
    if job is not None:
        _delete_job(api, s.job.namespace, job)
    _label_node_if_exists(api, node_name, None, logger)
    return step


def _probe_outcome(
    rt: Runtime,
    s: ProbeSettings,
    status: GPUProfileStatus,
    job_name: str,
    node: GpuNodeView,
    override: ProfileOverride | None,
    peers: list[GpuNodeView],
    now: datetime,
    generation: int | None,
) -> Step | None:
    """Read the probe Job ``job_name`` in flight; the status once it finished (a Job that would not finish
    by itself is deleted)."""
    started = status.probe.started_time if status.probe else None
    job, pods = _read_job(rt, s.job.namespace, job_name)
    outcome = job_outcome(
        job,
        pods,
        started=started,
        now=now,
        deadline_s=s.job.active_deadline_s,
        expected_kinds=s.expected_kinds,
    )
    if outcome.delete_job:
        _delete_job(rt.api, s.job.namespace, job_name)
    return probe_finished(
        status, node, outcome, override=override, peers=peers, now=now, generation=generation, settings=s
    )


def _start_if_due(
    api: KubeApi,
    s: ProbeSettings,
    body: kopf.Body,
    status: GPUProfileStatus,
    node: GpuNodeView,
    override: ProfileOverride | None,
    now: datetime,
    generation: int | None,
) -> Step | None:
    """Create the probe Job when one is due (a GPU change recorded as Stale first); else re-apply the
    override of a Ready profile."""
    start = probe_start(status, node, override, now=now, generation=generation)
    if start is None:
        return ready_override_step(status, override)
    if start.stale is not None:
        _emit(body, start.stale)
    try:
        job_name = _create_job(api, s, body, node, now)
    except Exception as exc:  # the API refusing a Job is a failed attempt, reported and retried
        return job_create_failed(start.base, str(exc), now=now, generation=generation, settings=s)
    return start_probe(start.base, node, why=start.why, job_name=job_name, now=now, generation=generation)


def _all_nodes(index: kopf.Index[str, GpuNodeView]) -> list[GpuNodeView]:
    return [v for _, store in index_snapshot(index) for v in store]


def _label_node_if_exists(api: KubeApi, node: str, status: GPUProfileStatus | None, logger: Any) -> None:
    """Remove the profile labels of a node that still exists but is no longer a GPU node."""
    obj = api.get(*NODE, None, node)
    if obj is None:
        return
    _label_node(api, node, status, dict((obj.get("metadata") or {}).get("labels") or {}), logger)


def _emit(body: kopf.Body, step: Step) -> None:
    for ev in step.events:
        kopf.event(body, type=ev.type, reason=ev.reason, message=ev.message[:1000])


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
def gpuprofile_delete(name: str, spec: kopf.Spec, logger: Any, memo: kopf.Memo, **_: Any) -> None:
    """Remove the profile labels from the node (they came from this profile) and forget the status last
    written (the rest of the profile is forgotten at its DELETED event, :mod:`gearshift.handlers.nodes`)."""
    rt = runtime_of(memo)
    rt.profiles.forget_written(name)
    _label_node_if_exists(rt.api, str(spec.get("nodeName", name)), None, logger)
