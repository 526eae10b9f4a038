"""kopf handlers of GPUProfiles: run probe Jobs, write status, classify the fleet, label the nodes.

One timer per GPUProfile (every :data:`TICK_S`; every :data:`READY_TICK_S` while the profile is Ready)
takes one level-triggered step of the life cycle in
:mod:`gearshift.profiling.lifecycle`: mark the profile Stale when its node is gone, create a probe Job when
one is due, read a finished Job's termination message, back off after failures; then it sets the
compute class from the fleet (:func:`gearshift.profiling.profiles.classify` over the ``profile_scores`` index)
and makes the node's ``gearshift.io/*`` labels match the profile (removed unless Ready).

Status is written with the status subresource by this module (not through kopf's ``patch``), and the
object returned is remembered: a tick that runs before the watch delivers that write uses the
remembered status, so a probe is never started twice. Importing this module also registers
:mod:`gearshift.handlers.nodes`; run both with ``kopf run -m gearshift.handlers.gpuprofile``.
"""

from __future__ import annotations

import functools
import threading
from datetime import UTC, datetime
from typing import Any, cast

import kopf

from gearshift.api.common import API_VERSION, GROUP, MAX_PEERS, VERSION
from gearshift.api.gpuprofile import GPUProfileSpec, GPUProfileStatus
from gearshift.handlers import nodes
from gearshift.k8s.probejob import build_probe_job_spec, probe_job_name
from gearshift.probe.report import ProbeOutputError
from gearshift.profiling.lifecycle import (
    REASON_GPU_CHANGED,
    REASON_JOB_CREATE_FAILED,
    REASON_NODE_GONE,
    JobOutcome,
    Step,
    dump_status,
    job_outcome,
    mark_stale,
    node_gone_message,
    probe_due,
    probe_failed,
    probe_succeeded,
    start_probe,
    window_step,
    with_class,
)
from gearshift.profiling.profiles import (
    GpuNodeView,
    card_score,
    classify,
    datasheet_interconnect,
    labels_patch,
    node_labels,
)

PLURAL = nodes.PLURAL
#: Seconds between two steps of one profile; bounds how late a finished probe or a new node is seen.
TICK_S = 2.0
#: Seconds between two steps of a Ready profile. Its steps then only notice slow changes (a node gone or
#: its GPU changed, a declared window, a re-probe due, the fleet's classes), and an idle fleet of many
#: nodes would otherwise keep the operator busy with do-nothing ticks (issue 6: no hot loop when idle).
READY_TICK_S = 10.0

_lock = threading.Lock()
#: name → (resourceVersion, status dict) of the last status this process wrote.
_written: dict[str, tuple[int, dict[str, Any]]] = {}


def _rv(body: kopf.Body | dict[str, Any]) -> int:
    try:
        return int(body.get("metadata", {}).get("resourceVersion", "0"))
    except ValueError:
        return 0


@kopf.index(GROUP, VERSION, PLURAL)
def profile_scores(name: str, status: kopf.Status, **_: Any) -> dict[str, float] | None:
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


def fleet_classes(index: kopf.Index[str, float]) -> dict[str, str]:
    """Compute class of every usable profile, memoised on the fleet's scores."""
    items = tuple(sorted((n, next(iter(store))) for n, store in index.items() if len(store)))
    return _classes(items)


def _now() -> datetime:
    return datetime.now(UTC)


def _batch() -> Any:
    from kubernetes import client

    return client.BatchV1Api(nodes.api_client())


def _core() -> Any:
    from kubernetes import client

    return client.CoreV1Api(nodes.api_client())


def _read_job(namespace: str, name: str) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    from kubernetes.client.rest import ApiException

    api = nodes.api_client()
    try:
        job = api.sanitize_for_serialization(_batch().read_namespaced_job(name, namespace))
    except ApiException as exc:
        if exc.status == 404:
            return None, []
        raise
    pods = _core().list_namespaced_pod(namespace, label_selector=f"batch.kubernetes.io/job-name={name}")
    return job, [api.sanitize_for_serialization(p) for p in pods.items]


def _delete_job(namespace: str, name: str) -> None:
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    try:
        _batch().delete_namespaced_job(
            name, namespace, body=client.V1DeleteOptions(propagation_policy="Background")
        )
    except ApiException as exc:
        if exc.status != 404:
            raise


def _write_status(name: str, status: GPUProfileStatus) -> None:
    from kubernetes import client

    api = client.CustomObjectsApi(nodes.api_client())
    # The client types a custom object as `object`; it is the patched object's JSON.
    obj = cast(
        "dict[str, Any]",
        api.patch_cluster_custom_object_status(GROUP, VERSION, PLURAL, name, {"status": dump_status(status)}),
    )
    with _lock:
        _written[name] = (_rv(obj), dict(obj.get("status") or {}))


def _label_node(node: str, status: GPUProfileStatus | None, current: dict[str, str], logger: Any) -> bool:
    from kubernetes.client.rest import ApiException

    patch = labels_patch(current, node_labels(status))
    if not patch:
        return False
    try:
        _core().patch_node(node, {"metadata": {"labels": patch}})
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise kopf.TemporaryError(f"cannot label node {node}: {exc.status} {exc.reason}", delay=5) from None
    logger.info("node %s labels: %s", node, patch)
    return True


def _create_job(body: kopf.Body, node: GpuNodeView, why: str, now: datetime) -> str:
    s = nodes.settings()
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
    _batch().create_namespaced_job(s.job.namespace, job)
    return name


def _is_ready(body: kopf.Body, **_: Any) -> bool:
    return (body.get("status") or {}).get("phase") == "Ready"


def _is_not_ready(body: kopf.Body, **_: Any) -> bool:
    return not _is_ready(body)


# kopf starts and stops a timer as its filter starts and stops matching, so one of the two runs.
@kopf.timer(GROUP, VERSION, PLURAL, interval=TICK_S, when=_is_not_ready)  # type: ignore[arg-type]  # kopf passes its indices as keywords its protocol does not name
def gpuprofile_reconcile(
    name: str,
    body: kopf.Body,
    spec: kopf.Spec,
    meta: kopf.Meta,
    gpu_nodes: kopf.Index[str, GpuNodeView],
    profile_scores: kopf.Index[str, float],
    logger: Any,
    **_: Any,
) -> None:
    """One step of the probe life cycle of this profile (see the module docstring)."""
    _step(name, body, spec, meta, gpu_nodes, profile_scores, logger)


@kopf.timer(GROUP, VERSION, PLURAL, interval=READY_TICK_S, initial_delay=READY_TICK_S, when=_is_ready)  # type: ignore[arg-type]  # kopf passes its indices as keywords its protocol does not name
def gpuprofile_ready_reconcile(
    name: str,
    body: kopf.Body,
    spec: kopf.Spec,
    meta: kopf.Meta,
    gpu_nodes: kopf.Index[str, GpuNodeView],
    profile_scores: kopf.Index[str, float],
    logger: Any,
    **_: Any,
) -> None:
    """The same step for a Ready profile, at the slower :data:`READY_TICK_S`."""
    _step(name, body, spec, meta, gpu_nodes, profile_scores, logger)


def _step(
    name: str,
    body: kopf.Body,
    spec: kopf.Spec,
    meta: kopf.Meta,
    gpu_nodes: kopf.Index[str, GpuNodeView],
    profile_scores: kopf.Index[str, float],
    logger: Any,
) -> None:
    s = nodes.settings()
    now = _now()
    generation = meta.get("generation")
    try:
        pspec = GPUProfileSpec.model_validate(dict(spec))
    except ValueError as exc:
        raise kopf.PermanentError(f"invalid spec: {exc}") from None
    override = pspec.override
    raw_status = dict(body.get("status") or {})
    with _lock:
        cached = _written.get(name)
    if cached is not None and cached[0] > _rv(body):
        raw_status = cached[1]
    status = GPUProfileStatus.model_validate(raw_status)
    node_store = gpu_nodes.get(pspec.node_name)
    node = next(iter(node_store)) if node_store else None

    step: Step | None = None
    if node is None:
        gone = (
            status.phase == "Stale"
            and status.conditions
            and any(c.type == "Stale" and c.reason == REASON_NODE_GONE for c in status.conditions)
        )
        if not gone:
            if status.phase == "Probing" and status.probe and status.probe.job:
                _delete_job(s.job.namespace, status.probe.job)
            step = mark_stale(
                status, REASON_NODE_GONE, node_gone_message(pspec.node_name), now=now, generation=generation
            )
            _label_node_if_exists(pspec.node_name, None, logger)
    elif status.phase == "Probing" and status.probe and status.probe.job:
        job, pods = _read_job(s.job.namespace, status.probe.job)
        outcome = job_outcome(
            job,
            pods,
            started=status.probe.started_time,
            now=now,
            deadline_s=s.job.active_deadline_s,
            expected_kinds=s.expected_kinds,
        )
        if outcome.state == "succeeded" and outcome.doc is not None:
            try:
                step = probe_succeeded(
                    status,
                    node,
                    outcome.doc,
                    override=override,
                    interconnect=datasheet_interconnect(node, _all_nodes(gpu_nodes), MAX_PEERS),
                    now=now,
                    generation=generation,
                    reprobe_interval_s=s.reprobe_interval_s,
                )
            except ProbeOutputError as exc:
                outcome = JobOutcome("failed", "GarbageOutput", str(exc)[:600])
        if outcome.state == "failed":
            if outcome.delete_job:
                _delete_job(s.job.namespace, status.probe.job)
            step = probe_failed(
                status,
                outcome,
                now=now,
                generation=generation,
                backoff_base_s=s.backoff_base_s,
                backoff_max_s=s.backoff_max_s,
            )
    else:
        why = probe_due(status, node, override, now)
        base = status
        if why == REASON_GPU_CHANGED and status.phase != "Stale":
            was = status.probe.gpu_key if status.probe else "?"
            msg = f"the node's GPU changed from {was} to {node.gpu_key}"
            stale = mark_stale(status, REASON_GPU_CHANGED, msg, now=now, generation=generation)
            _emit(body, stale)
            base = stale.status
        if why is not None:
            try:
                job_name = _create_job(body, node, why, now)
            except Exception as exc:  # the API refusing a Job is a failed attempt, reported and retried
                step = probe_failed(
                    base,
                    JobOutcome(
                        "failed", REASON_JOB_CREATE_FAILED, f"cannot create the probe Job: {exc}"[:600]
                    ),
                    now=now,
                    generation=generation,
                    backoff_base_s=s.backoff_base_s,
                    backoff_max_s=s.backoff_max_s,
                )
            else:
                step = start_probe(base, node, why=why, job_name=job_name, now=now, generation=generation)
        elif status.phase == "Ready":
            from gearshift.profiling.profiles import apply_override

            eff, _pinned = apply_override(status, override)
            if eff != status:
                step = Step(eff)

    current = step.status if step is not None else status
    if node is not None:
        # The node's window (gearshift.io/available-until), whatever the probe is doing (issue 13).
        win = window_step(current, node, override, now=now, generation=generation)
        if win is not None:
            if step is None:
                step = win
            else:
                step.status = win.status
                step.events += win.events
            current = step.status
    if current.phase in ("Ready", "Probing") and current.probe_time is not None:
        cls = with_class(current, fleet_classes(profile_scores).get(name), override)
        if cls != current.compute_class:
            if step is None:
                step = Step(current.model_copy(deep=True))
            step.status.compute_class = cls  # type: ignore[assignment]
    if step is not None:
        _write_status(name, step.status)
        _emit(body, step)
        current = step.status
    if node is not None:
        _label_node(node.name, current, dict(node.labels), logger)


def _all_nodes(index: kopf.Index[str, GpuNodeView]) -> list[GpuNodeView]:
    return [v for store in index.values() for v in store]


def _label_node_if_exists(node: str, status: GPUProfileStatus | None, logger: Any) -> None:
    """Remove the profile labels of a node that still exists but is no longer a GPU node."""
    from kubernetes.client.rest import ApiException

    try:
        current = dict(_core().read_node(node).metadata.labels or {})
    except ApiException as exc:
        if exc.status == 404:
            return
        raise
    _label_node(node, status, current, logger)


def _emit(body: kopf.Body, step: Step) -> None:
    for ev in step.events:
        kopf.event(body, type=ev.type, reason=ev.reason, message=ev.message[:1000])


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
def gpuprofile_delete(name: str, spec: kopf.Spec, logger: Any, **_: Any) -> None:
    """Remove the profile labels from the node (they came from this profile) and forget its cache."""
    with _lock:
        _written.pop(name, None)
    _label_node_if_exists(str(spec.get("nodeName", name)), None, logger)
