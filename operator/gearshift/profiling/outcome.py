"""What a probe Job came to (:func:`job_outcome`): still running, succeeded with a valid probe document
(:mod:`gearshift.api.probedoc`), or failed, and why (OOM, image pull, timeout, a reported error, a crash,
unusable output), read from the Job and its pods as the API returns them.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from gearshift.api.common import REASON_PROBE_SUCCEEDED
from gearshift.api.probedoc import ProbeOutputError, validate_probe_output
from gearshift.profiling.steps import (
    REASON_CRASHED,
    REASON_GARBAGE,
    REASON_IMAGE_PULL,
    REASON_JOB_LOST,
    REASON_OOM,
    REASON_PROBE_ERROR,
    REASON_TIMEOUT,
)

#: Container waiting reasons after which a probe will not start by itself (kubelet's reasons).
STUCK_WAITING = {
    "ErrImagePull": REASON_IMAGE_PULL,
    "ImagePullBackOff": REASON_IMAGE_PULL,
    "InvalidImageName": REASON_IMAGE_PULL,
    "ErrImageNeverPull": REASON_IMAGE_PULL,
    "CreateContainerConfigError": REASON_IMAGE_PULL,
    "CreateContainerError": REASON_IMAGE_PULL,
}
#: Seconds past ``activeDeadlineSeconds`` after which the operator gives up on a Job itself (a Job
#: controller that never marks it failed must not stall profiling).
DEADLINE_GRACE_S = 60.0


@dataclass(frozen=True)
class JobOutcome:
    """What a probe Job came to: still ``running``, ``succeeded`` with a valid document, or ``failed``."""

    state: Literal["running", "succeeded", "failed"]
    reason: str = ""
    message: str = ""
    doc: dict[str, Any] | None = None
    #: Delete the Job now (it would not finish by itself, e.g. an image that never pulls).
    delete_job: bool = False


def _containers(pod: Mapping[str, Any]) -> list[dict[str, Any]]:
    return list((pod.get("status") or {}).get("containerStatuses") or [])


def _job_condition(job: Mapping[str, Any], type_: str) -> dict[str, Any] | None:
    for c in (job.get("status") or {}).get("conditions") or []:
        if c.get("type") == type_ and c.get("status") == "True":
            return dict(c)
    return None


def _short(text: str, n: int = 600) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


def _read_message(message: str, expected_kinds: Collection[str]) -> JobOutcome:
    try:
        doc = validate_probe_output(message, expected_kinds=expected_kinds)
    except ProbeOutputError as exc:
        text = str(exc)
        if text.startswith("the probe reported a failure"):
            return JobOutcome("failed", REASON_PROBE_ERROR, _short(text))
        return JobOutcome("failed", REASON_GARBAGE, _short(text))
    return JobOutcome("succeeded", REASON_PROBE_SUCCEEDED, "", doc)


def job_outcome(
    job: Mapping[str, Any] | None,
    pods: Sequence[Mapping[str, Any]],
    *,
    started: datetime | None,
    now: datetime,
    deadline_s: float,
    expected_kinds: Collection[str],
) -> JobOutcome:
    """Classify a probe Job from the Job and its pods (plain API dicts, camelCase).

    Order of checks: Job gone → ``JobLost``; a container terminated with ``OOMKilled`` → ``OOMKilled``;
    a container stuck waiting on its image or config → ``ImagePullFailed`` (delete the Job); a
    terminated container: exit 0 with a valid document → succeeded, exit 0 with anything else →
    ``GarbageOutput``, exit ≠ 0 with an ``error`` document → ``ProbeError``, else ``ProbeCrashed`` (the log
    tail from ``FallbackToLogsOnError`` in the message); the Job's ``Failed`` condition with
    ``DeadlineExceeded`` → ``Timeout`` (with the pod's scheduling message if it never ran); still running
    ``deadline_s`` + :data:`DEADLINE_GRACE_S` after ``started`` → ``Timeout`` (delete the Job).
    """
    if job is None:
        return JobOutcome("failed", REASON_JOB_LOST, "the probe Job disappeared before it finished")
    newest = sorted(pods, key=lambda p: str((p.get("metadata") or {}).get("creationTimestamp", "")))
    for pod in reversed(newest):
        for cs in _containers(pod):
            term = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get("terminated")
            if term and term.get("reason") == "OOMKilled":
                return JobOutcome(
                    "failed", REASON_OOM, "the probe was OOM-killed; give the probe Job more memory"
                )
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in STUCK_WAITING:
                msg = f"{waiting['reason']}: {waiting.get('message', '')}".strip(": ")
                return JobOutcome("failed", STUCK_WAITING[waiting["reason"]], _short(msg), delete_job=True)
            if term:
                code = int(term.get("exitCode", -1))
                message = str(term.get("message") or "")
                if code == 0:
                    return _read_message(message, expected_kinds)
                if message.lstrip().startswith("{"):
                    out = _read_message(message, expected_kinds)
                    if out.reason == REASON_PROBE_ERROR:
                        return out
                return JobOutcome(
                    "failed",
                    REASON_CRASHED,
                    _short(f"exit code {code} ({term.get('reason', 'Error')}): {message or 'no output'}"),
                )
    failed = _job_condition(job, "Failed")
    if failed is not None:
        reason = str(failed.get("reason", ""))
        if reason == "DeadlineExceeded":
            note = ""
            for pod in newest:
                for c in (pod.get("status") or {}).get("conditions") or []:
                    if c.get("type") == "PodScheduled" and c.get("status") == "False":
                        note = f"; the pod never scheduled: {c.get('message', '')}"
            return JobOutcome(
                "failed",
                REASON_TIMEOUT,
                _short(f"the probe ran past {deadline_s:g} s (activeDeadline){note}"),
            )
        return JobOutcome(
            "failed", REASON_CRASHED, _short(f"Job failed: {reason}: {failed.get('message', '')}")
        )
    if _job_condition(job, "Complete") is not None:
        return JobOutcome("failed", REASON_GARBAGE, "the Job completed but no pod with a result was found")
    if started is not None and (now - started).total_seconds() > deadline_s + DEADLINE_GRACE_S:
        return JobOutcome(
            "failed",
            REASON_TIMEOUT,
            f"the probe Job did not finish within {deadline_s + DEADLINE_GRACE_S:g} s",
            delete_job=True,
        )
    return JobOutcome("running")
