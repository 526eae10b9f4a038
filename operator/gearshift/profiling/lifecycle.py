"""One GPUProfile's probe life cycle as pure steps: when a probe is due, what a finished Job means, and
the status (phase, conditions, back-off) after each step, with the events worth emitting.

States (``status.phase``)::

    Pending ──probe due──▶ Probing ──success──▶ Ready ──schedule / reprobe annotation──▶ Probing ...
                              │                   ▲
                              └──failure──▶ Failed (no earlier data; retried after back-off)
                                            or Ready with Probed=False (earlier data kept)
    any ──node gone / GPU changed──▶ Stale (labels removed; a returning or changed node is re-probed)

A probe is due when: there is no result yet (``Initial``), the node's GPU (product label × capacity)
differs from the one probed (``GpuChanged``), the node's ``gearshift.io/reprobe`` annotation has a value
not acted on yet (``Requested``), an override that was applied has been removed (``OverrideRemoved``:
the measured value is gone from status), or ``probe.nextTime`` has passed (``Scheduled`` after a
success, ``Retry`` after a failure). Failures back off exponentially: ``base × 2^(attempts-1)``, capped.

What a finished Job means is :mod:`gearshift.profiling.outcome`'s, a node's window
:mod:`gearshift.profiling.window`'s, the settings :mod:`gearshift.profiling.settings`' and a step's status
and events :mod:`gearshift.profiling.steps`'; this module chains them into the steps the handler takes.

Nothing here reads the clock or the API: ``now`` and the objects are passed in.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from gearshift.api.common import (
    COND_PROBED,
    COND_READY,
    COND_STALE,
    MAX_PEERS,
    REASON_NODE_GONE,
    REASON_OVERRIDDEN,
    REASON_PROBE_FAILED,
    REASON_PROBE_STARTED,
    REASON_PROBE_SUCCEEDED,
    find_condition,
)
from gearshift.api.gpuprofile import GPUProfileStatus, ProbeInfo, ProfileOverride
from gearshift.api.probedoc import ProbeOutputError, profile_status_from_probe
from gearshift.profiling.outcome import JobOutcome
from gearshift.profiling.profiles import GpuNodeView, apply_override, datasheet_interconnect
from gearshift.profiling.settings import ProbeSettings
from gearshift.profiling.steps import (
    REASON_GARBAGE,
    REASON_GPU_CHANGED,
    REASON_JOB_CREATE_FAILED,
    REASON_NODE_BACK,
    REASON_NOT_PROBED,
    REASON_PROBING,
    Event,
    Step,
    record_condition,
)
from gearshift.profiling.window import window_step


def backoff_s(attempts: int, base_s: float, max_s: float) -> float:
    """Delay after ``attempts`` consecutive failures: ``base·2^(attempts-1)`` capped at ``max_s``, s."""
    return min(max_s, base_s * 2 ** max(0, attempts - 1))


def probe_due(
    status: GPUProfileStatus, node: GpuNodeView, override: ProfileOverride | None, now: datetime
) -> str | None:
    """Why a probe should start now (see the module docstring), or None. ``status.phase`` must not be
    Probing (a Job is then in flight)."""
    probe = status.probe or ProbeInfo()
    if status.phase in (None, "Pending") or (status.probe_time is None and status.phase != "Failed"):
        return "Initial"
    if probe.gpu_key is not None and probe.gpu_key != node.gpu_key:
        return REASON_GPU_CHANGED
    if status.phase == "Stale":
        return REASON_NODE_BACK
    if node.reprobe_token is not None and node.reprobe_token != probe.reprobe_token:
        return "Requested"
    pinned = set(override.model_dump(by_alias=True, exclude_none=True)) if override else set()
    if set(status.overridden) - pinned:
        return "OverrideRemoved"
    if probe.next_time is not None and probe.next_time <= now:
        return "Retry" if status.phase == "Failed" or probe.attempts else "Scheduled"
    return None


def _probe_info(status: GPUProfileStatus) -> ProbeInfo:
    return (status.probe or ProbeInfo()).model_copy(deep=True)


def start_probe(
    status: GPUProfileStatus,
    node: GpuNodeView,
    *,
    why: str,
    job_name: str,
    now: datetime,
    generation: int | None,
) -> Step:
    """Status once a probe Job for ``node`` has been created (phase Probing; Probed Unknown)."""
    step = Step(status.model_copy(deep=True))
    info = _probe_info(status)
    info.job, info.started_time, info.next_time = job_name, now, None
    info.reprobe_token = node.reprobe_token
    step.status.probe = info
    step.status.phase = "Probing"
    step.status.observed_generation = generation
    step.status.message = f"probing ({why}) with Job {job_name}"
    record_condition(
        step,
        COND_PROBED,
        "Unknown",
        REASON_PROBING,
        f"Job {job_name} is measuring the node ({why})",
        now,
        generation,
    )
    if find_condition(step.status.conditions, COND_READY) is None:
        record_condition(
            step, COND_READY, "False", REASON_NOT_PROBED, "no probe has finished yet", now, generation
        )
    step.events.append(Event("Normal", REASON_PROBE_STARTED, f"probe Job {job_name} created ({why})"))
    return step


def probe_succeeded(
    status: GPUProfileStatus,
    node: GpuNodeView,
    doc: Mapping[str, Any],
    *,
    override: ProfileOverride | None,
    interconnect: list[dict[str, Any]],
    now: datetime,
    generation: int | None,
    reprobe_interval_s: float,
) -> Step:
    """Status after a valid probe document: measured fields, override applied, phase Ready.

    ``interconnect`` (datasheet links) fills ``status.interconnect`` when the document carries no
    measured links. ``computeClass`` is kept from before: it depends on the whole fleet and is set by
    :func:`with_class`.

    Raises:
        ProbeOutputError: ``doc`` is not a valid device probe document.
    """
    measured = profile_status_from_probe(doc)
    if not measured.get("interconnect"):
        measured["interconnect"] = interconnect
    old = status
    fresh = GPUProfileStatus.model_validate(measured)
    # Only what the document says: bookkeeping (reprobe token, job) of the run stays.
    measured_info = fresh.probe.model_dump(exclude_none=True) if fresh.probe else {}
    info = _probe_info(old).model_copy(update=measured_info)
    info.attempts, info.failure_reason, info.gpu_key = 0, None, node.gpu_key
    info.next_time = now + timedelta(seconds=reprobe_interval_s) if reprobe_interval_s > 0 else None
    fresh.probe = info
    fresh.conditions = list(old.conditions)
    fresh.compute_class = old.compute_class
    fresh.phase = "Ready"
    fresh.observed_generation = generation
    fresh.message = None
    fresh.available_until = old.available_until  # window_step keeps it in step with the node
    eff, pinned = apply_override(fresh, override)
    step = Step(eff)
    summary = (
        f"{eff.gpu_count}× {eff.gpu_model}, {eff.memory_gib:g} GiB, score {eff.compute_score:g} "
        f"(source {eff.source})"
    )
    record_condition(step, COND_PROBED, "True", REASON_PROBE_SUCCEEDED, summary, now, generation, "Normal")
    record_condition(step, COND_READY, "True", REASON_PROBE_SUCCEEDED, summary, now, generation)
    record_condition(
        step,
        COND_STALE,
        "False",
        REASON_PROBE_SUCCEEDED,
        "probed after the node's last change",
        now,
        generation,
    )
    if pinned and pinned != list(old.overridden):
        step.events.append(
            Event("Normal", REASON_OVERRIDDEN, f"spec.override pins {', '.join(pinned)} over the measurement")
        )
    return step


def probe_failed(
    status: GPUProfileStatus,
    outcome: JobOutcome,
    *,
    now: datetime,
    generation: int | None,
    backoff_base_s: float,
    backoff_max_s: float,
) -> Step:
    """Status after a failed probe: the reason in ``Probed`` (and ``Ready`` when no earlier data exists),
    a Warning event, and the next try after exponential back-off.

    With an earlier good result (``probeTime`` set and not Stale) the profile stays Ready on it;
    otherwise phase Failed (its node then carries no profile labels).
    """
    step = Step(status.model_copy(deep=True))
    info = _probe_info(status)
    info.attempts = (info.attempts or 0) + 1
    info.failure_reason = outcome.reason
    delay = backoff_s(info.attempts, backoff_base_s, backoff_max_s)
    info.next_time = now + timedelta(seconds=delay)
    step.status.probe = info
    step.status.observed_generation = generation
    has_data = status.probe_time is not None and not _stale(status)
    step.status.phase = "Ready" if has_data else "Failed"
    text = f"{outcome.message} (attempt {info.attempts}; retry in {delay:g} s)"
    step.status.message = f"{outcome.reason}: {text}"[:4000]
    record_condition(step, COND_PROBED, "False", outcome.reason, text, now, generation)
    if not has_data:
        record_condition(step, COND_READY, "False", outcome.reason, text, now, generation)
    # One Warning per failed attempt: each is a separate try the admin may want to see.
    step.events.append(Event("Warning", REASON_PROBE_FAILED, f"{outcome.reason}: {text}"))
    return step


def _stale(status: GPUProfileStatus) -> bool:
    cond = find_condition(status.conditions, COND_STALE)
    return cond is not None and cond.status == "True"


def mark_stale(
    status: GPUProfileStatus, reason: str, message: str, *, now: datetime, generation: int | None
) -> Step:
    """Status when the node is gone (``NodeGone``) or its GPU changed (``GpuChanged``): phase Stale,
    ``Stale`` True, ``Ready`` False; the measured numbers stay for reference but no labels derive from
    them."""
    step = Step(status.model_copy(deep=True))
    step.status.phase = "Stale"
    step.status.observed_generation = generation
    step.status.message = message
    step.status.compute_class = None
    record_condition(step, COND_STALE, "True", reason, message, now, generation, "Warning")
    record_condition(step, COND_READY, "False", reason, message, now, generation)
    return step


def with_class(
    status: GPUProfileStatus, fleet_class: str | None, override: ProfileOverride | None
) -> str | None:
    """The compute class to record: the override's, else the fleet clustering's (None when unclassified)."""
    if override is not None and override.compute_class is not None:
        return override.compute_class
    return fleet_class


def node_gone_message(node: str) -> str:
    """The Stale message for a node that left the cluster (or lost its GPUs)."""
    return f"node {node} is gone or no longer has nvidia.com/gpu capacity; profile kept for reference"


def dump_status(status: GPUProfileStatus) -> dict[str, Any]:
    """The status as a JSON merge-patch body; ``None`` for optional fields now unset (merge patch deletes)."""
    body = status.to_json()
    for name, info in GPUProfileStatus.model_fields.items():
        key = info.alias or name
        if key not in body and getattr(status, name) is None:
            body[key] = None
    return json.loads(json.dumps(body))


def running_job(status: GPUProfileStatus) -> str | None:
    """The name of the probe Job in flight (``status.probe.job`` while Probing), else None."""
    if status.phase == "Probing" and status.probe is not None and status.probe.job:
        return status.probe.job
    return None


def node_gone_step(
    status: GPUProfileStatus, node_name: str, *, now: datetime, generation: int | None
) -> Step | None:
    """Stale with reason ``NodeGone`` for a profile whose node left (or lost its GPUs); None when it
    already is (the step was taken: the Job deleted, the labels removed)."""
    gone = status.phase == "Stale" and any(
        c.type == COND_STALE and c.reason == REASON_NODE_GONE for c in status.conditions or []
    )
    if gone:
        return None
    return mark_stale(status, REASON_NODE_GONE, node_gone_message(node_name), now=now, generation=generation)


def probe_finished(
    status: GPUProfileStatus,
    node: GpuNodeView,
    outcome: JobOutcome,
    *,
    override: ProfileOverride | None,
    peers: Iterable[GpuNodeView],
    now: datetime,
    generation: int | None,
    settings: ProbeSettings,
) -> Step | None:
    """The status after the probe Job came to ``outcome``; None while it runs.

    A succeeded document that :func:`probe_succeeded` refuses counts as ``GarbageOutput``. ``peers`` (every
    GPU node) give the datasheet interconnect; the back-off and the re-probe interval are ``settings``'.
    """
    if outcome.state == "succeeded" and outcome.doc is not None:
        try:
            return probe_succeeded(
                status,
                node,
                outcome.doc,
                override=override,
                interconnect=datasheet_interconnect(node, peers, MAX_PEERS),
                now=now,
                generation=generation,
                reprobe_interval_s=settings.reprobe_interval_s,
            )
        except ProbeOutputError as exc:
            outcome = JobOutcome("failed", REASON_GARBAGE, str(exc)[:600])
    if outcome.state != "failed":
        return None
    return probe_failed(
        status,
        outcome,
        now=now,
        generation=generation,
        backoff_base_s=settings.backoff_base_s,
        backoff_max_s=settings.backoff_max_s,
    )


@dataclass(frozen=True)
class ProbeStart:
    """A probe to start: why (a :func:`probe_due` reason), the status it starts from, and the Stale step
    recorded first when the node's GPU changed (its events are emitted before the Job is created)."""

    why: str
    base: GPUProfileStatus
    stale: Step | None = None


def probe_start(
    status: GPUProfileStatus,
    node: GpuNodeView,
    override: ProfileOverride | None,
    *,
    now: datetime,
    generation: int | None,
) -> ProbeStart | None:
    """The probe to start now, or None when none is due. ``status.phase`` must not be Probing.

    A GPU that changed under a profile not yet Stale marks it Stale (``GpuChanged``) first: the probe then
    starts from that status.
    """
    why = probe_due(status, node, override, now)
    if why is None:
        return None
    if why == REASON_GPU_CHANGED and status.phase != "Stale":
        was = status.probe.gpu_key if status.probe else "?"
        msg = f"the node's GPU changed from {was} to {node.gpu_key}"
        stale = mark_stale(status, REASON_GPU_CHANGED, msg, now=now, generation=generation)
        return ProbeStart(why, stale.status, stale)
    return ProbeStart(why, status)


def job_create_failed(
    base: GPUProfileStatus, error: str, *, now: datetime, generation: int | None, settings: ProbeSettings
) -> Step:
    """The status after the API refused the probe Job (``error``: its message): a failed attempt
    (``JobCreateFailed``), retried after the back-off."""
    outcome = JobOutcome("failed", REASON_JOB_CREATE_FAILED, f"cannot create the probe Job: {error}"[:600])
    return probe_failed(
        base,
        outcome,
        now=now,
        generation=generation,
        backoff_base_s=settings.backoff_base_s,
        backoff_max_s=settings.backoff_max_s,
    )


def ready_override_step(status: GPUProfileStatus, override: ProfileOverride | None) -> Step | None:
    """A Ready profile with no probe due: ``spec.override`` applied again (it may have been edited);
    None when that changes nothing or the profile is not Ready."""
    if status.phase != "Ready":
        return None
    eff, _pinned = apply_override(status, override)
    return Step(eff) if eff != status else None


def complete_step(
    step: Step | None,
    status: GPUProfileStatus,
    node: GpuNodeView | None,
    override: ProfileOverride | None,
    fleet_class: str | None,
    *,
    now: datetime,
    generation: int | None,
) -> Step | None:
    """``step`` (or, when None, the unchanged ``status``) with the node's window (:func:`window_step`,
    whatever the probe is doing) and, for a Ready or Probing profile with data, the compute class
    (:func:`with_class` of ``fleet_class``). Returns a new step, or None when nothing is to be written."""
    out = Step(step.status, list(step.events)) if step is not None else None
    current = out.status if out is not None else status
    if node is not None:
        win = window_step(current, node, override, now=now, generation=generation)
        if win is not None:
            out = win if out is None else Step(win.status, out.events + win.events)
            current = out.status
    if current.phase in ("Ready", "Probing") and current.probe_time is not None:
        cls = with_class(current, fleet_class, override)
        if cls != current.compute_class:
            if out is None:
                out = Step(current.model_copy(deep=True))
            out.status.compute_class = cls  # type: ignore[assignment]
    return out
