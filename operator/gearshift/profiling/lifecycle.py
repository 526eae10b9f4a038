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

Nothing here reads the clock or the API: ``now`` and the objects are passed in.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

from gearshift.api.common import (
    COND_PROBED,
    COND_READY,
    COND_STALE,
    COND_WINDOWED,
    MAX_PEERS,
    REASON_NODE_GONE,
    REASON_OVERRIDDEN,
    REASON_PROBE_FAILED,
    REASON_PROBE_STARTED,
    REASON_PROBE_SUCCEEDED,
    Condition,
    find_condition,
    set_condition,
)
from gearshift.api.gpuprofile import GPUProfileStatus, ProbeInfo, ProfileOverride
from gearshift.facts.rfc3339 import from_rfc3339
from gearshift.k8s.names import ANNOTATION_AVAILABLE_UNTIL
from gearshift.k8s.probejob import ProbeJobConfig, ProbeJobError, tolerations_from_json
from gearshift.probe.report import ProbeOutputError, profile_status_from_probe, validate_probe_output
from gearshift.profiling.profiles import GpuNodeView, apply_override, datasheet_interconnect, parse_selector

# --- reasons (conditions and events) -----------------------------------------------------------------
#: The node's GPU product or count changed since the probe.
REASON_GPU_CHANGED = "GpuChanged"
#: A probe Job is running.
REASON_PROBING = "Probing"
#: No probe has finished yet.
REASON_NOT_PROBED = "NotProbed"
#: The container image could not be pulled (or the container not created).
REASON_IMAGE_PULL = "ImagePullFailed"
#: The probe was killed for using too much memory.
REASON_OOM = "OOMKilled"
#: The Job ran past activeDeadlineSeconds (a hung probe, or a pod that never scheduled).
REASON_TIMEOUT = "Timeout"
#: The probe exited 0 but its termination message is not a valid probe document.
REASON_GARBAGE = "GarbageOutput"
#: The probe reported a failure in its document (exit code 1 with an ``error``).
REASON_PROBE_ERROR = "ProbeError"
#: The probe exited non-zero without a document.
REASON_CRASHED = "ProbeCrashed"
#: The Job disappeared before it finished.
REASON_JOB_LOST = "JobLost"
#: The operator could not create the Job.
REASON_JOB_CREATE_FAILED = "JobCreateFailed"
#: The node is back, or the profile was Stale for another reason, and is being probed again.
REASON_NODE_BACK = "NodeBack"

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

EventType = Literal["Normal", "Warning"]


class SettingsError(ValueError):
    """A probe setting (environment variable) with a bad value; the message names the variable."""


@dataclass(frozen=True)
class Event:
    """An event to record on the GPUProfile."""

    type: EventType
    reason: str
    message: str


@dataclass(frozen=True)
class ProbeSettings:
    """The operator's profiling settings.

    Attributes:
        job: how probe Jobs look (namespace, image, sandbox, deadline, TTL).
        node_selector: label selector GPU nodes must match besides ``nvidia.com/gpu`` capacity ("" = all).
        reprobe_interval_s: seconds between scheduled re-probes of a Ready node, s (0 = never).
        backoff_base_s: first retry delay after a failed probe, s; doubles each failure.
        backoff_max_s: cap of the retry delay, s.
        expected_kinds: probe document kinds accepted (``cuda`` on a real cluster, ``simulated`` in the
            sandbox), so a CPU fallback never becomes a GPU node's profile.
    """

    job: ProbeJobConfig = field(default_factory=ProbeJobConfig)
    node_selector: str = ""
    reprobe_interval_s: float = 24 * 3600.0
    backoff_base_s: float = 30.0
    backoff_max_s: float = 1800.0
    expected_kinds: frozenset[str] = frozenset({"cuda"})

    def __post_init__(self) -> None:
        parse_selector(self.node_selector)
        if self.reprobe_interval_s < 0:
            raise SettingsError(f"reprobe interval must be >= 0 s, got {self.reprobe_interval_s}")
        if not 0 < self.backoff_base_s <= self.backoff_max_s:
            raise SettingsError(
                f"probe back-off must satisfy 0 < base ({self.backoff_base_s}) <= max ({self.backoff_max_s})"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ProbeSettings:
        """Settings from environment variables (all optional):

        ``GEARSHIFT_SANDBOX`` (1/true: sandbox pods, simulated probe), ``GEARSHIFT_PROBE_NAMESPACE``
        (else ``GEARSHIFT_NAMESPACE``, else ``gearshift-system``), ``GEARSHIFT_PROBE_IMAGE``,
        ``GEARSHIFT_GPU_NODE_SELECTOR``, ``GEARSHIFT_REPROBE_INTERVAL_S``, ``GEARSHIFT_PROBE_BACKOFF_S``,
        ``GEARSHIFT_PROBE_BACKOFF_MAX_S``, ``GEARSHIFT_PROBE_DEADLINE_S``, ``GEARSHIFT_PROBE_TTL_S``,
        ``GEARSHIFT_PROBE_ARGS`` (space-separated), ``GEARSHIFT_PROBE_TOLERATIONS`` (JSON list),
        ``GEARSHIFT_PROBE_KINDS`` (comma-separated: cuda, cpu, simulated).

        Raises:
            SettingsError: a variable with a bad value (named, with what it must be).
        """

        def num(name: str, default: float) -> float:
            raw = env.get(name)
            if raw is None or raw == "":
                return default
            try:
                return float(raw)
            except ValueError:
                raise SettingsError(f"{name}={raw!r} must be a number of seconds") from None

        sandbox = env.get("GEARSHIFT_SANDBOX", "").lower() in ("1", "true", "yes")
        kinds_raw = env.get("GEARSHIFT_PROBE_KINDS") or ("simulated" if sandbox else "cuda")
        kinds = frozenset(k.strip() for k in kinds_raw.split(",") if k.strip())
        if not kinds <= {"cuda", "cpu", "simulated"}:
            raise SettingsError(
                f"GEARSHIFT_PROBE_KINDS={kinds_raw!r} must list cuda, cpu or simulated, comma-separated"
            )
        try:
            job = ProbeJobConfig(
                namespace=env.get("GEARSHIFT_PROBE_NAMESPACE")
                or env.get("GEARSHIFT_NAMESPACE")
                or ProbeJobConfig.namespace,
                image=env.get("GEARSHIFT_PROBE_IMAGE") or ProbeJobConfig.image,
                sandbox=sandbox,
                active_deadline_s=int(num("GEARSHIFT_PROBE_DEADLINE_S", ProbeJobConfig.active_deadline_s)),
                ttl_s=int(num("GEARSHIFT_PROBE_TTL_S", ProbeJobConfig.ttl_s)),
                probe_args=tuple((env.get("GEARSHIFT_PROBE_ARGS") or "").split()),
                tolerations=tolerations_from_json(env["GEARSHIFT_PROBE_TOLERATIONS"])
                if env.get("GEARSHIFT_PROBE_TOLERATIONS")
                else (),
            )
            return cls(
                job=job,
                node_selector=env.get("GEARSHIFT_GPU_NODE_SELECTOR", ""),
                reprobe_interval_s=num("GEARSHIFT_REPROBE_INTERVAL_S", cls.reprobe_interval_s),
                backoff_base_s=num("GEARSHIFT_PROBE_BACKOFF_S", cls.backoff_base_s),
                backoff_max_s=num("GEARSHIFT_PROBE_BACKOFF_MAX_S", cls.backoff_max_s),
                expected_kinds=kinds,
            )
        except ProbeJobError as exc:
            raise SettingsError(f"probe Job setting: {exc}") from None
        except ValueError as exc:
            if isinstance(exc, SettingsError):
                raise
            raise SettingsError(f"GEARSHIFT_GPU_NODE_SELECTOR: {exc}") from None


def backoff_s(attempts: int, base_s: float, max_s: float) -> float:
    """Delay after ``attempts`` consecutive failures: ``base·2^(attempts-1)`` capped at ``max_s``, s."""
    return min(max_s, base_s * 2 ** max(0, attempts - 1))


# --- when to probe -------------------------------------------------------------------------------------


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


# --- reading a finished Job ----------------------------------------------------------------------------


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


# --- status transitions --------------------------------------------------------------------------------


@dataclass
class Step:
    """A new status and the events that go with it."""

    status: GPUProfileStatus
    events: list[Event] = field(default_factory=list)


def _cond(
    step: Step,
    type_: str,
    status: Literal["True", "False", "Unknown"],
    reason: str,
    message: str,
    now: datetime,
    generation: int | None,
    event: EventType | None = None,
) -> None:
    conds: list[Condition]
    conds, changed = set_condition(
        step.status.conditions, type_, status, reason, message, now, observed_generation=generation
    )
    step.status.conditions = conds
    if changed and event is not None:
        step.events.append(Event(event, reason, message))


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
    _cond(
        step,
        COND_PROBED,
        "Unknown",
        REASON_PROBING,
        f"Job {job_name} is measuring the node ({why})",
        now,
        generation,
    )
    if find_condition(step.status.conditions, COND_READY) is None:
        _cond(step, COND_READY, "False", REASON_NOT_PROBED, "no probe has finished yet", now, generation)
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
    _cond(step, COND_PROBED, "True", REASON_PROBE_SUCCEEDED, summary, now, generation, "Normal")
    _cond(step, COND_READY, "True", REASON_PROBE_SUCCEEDED, summary, now, generation)
    _cond(
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


#: Condition reasons of ``Windowed`` (issue 13).
REASON_WINDOW_DECLARED = "AvailableUntil"
REASON_WINDOW_INVALID = "InvalidAvailableUntil"
#: The declared window has passed: the node is reclaimed, the planner leaves it out.
REASON_WINDOW_CLOSED = "WindowClosed"
REASON_NO_WINDOW = "NoWindow"


def parse_rfc3339(text: str) -> datetime:
    """An RFC 3339 time with an offset (``2025-01-31T18:00:00Z``) as an aware datetime.

    Raises:
        ValueError: not a date-time, or no offset (RFC 3339 requires one).
    """
    t = from_rfc3339(text.strip().replace("z", "Z"))
    if "T" not in text.upper() or t.tzinfo is None:
        raise ValueError(f"{text!r} is not an RFC 3339 date-time with an offset")
    return t


def _window_cond(step: Step, source: str, until: datetime, now: datetime, generation: int | None) -> None:
    """``Windowed=True``: declared (a Normal event) or, once ``until`` has passed, closed (a Warning).

    The message names the deadline only (not the seconds left), so it changes -- and an event is
    recorded -- only when the deadline does or when it passes.
    """
    if until <= now:
        _cond(
            step,
            COND_WINDOWED,
            "True",
            REASON_WINDOW_CLOSED,
            f"{source}: reclaimed at {until.isoformat()}, which has passed; gearshift plans no work on the "
            "node (remove the annotation if the node stays)",
            now,
            generation,
            "Warning",
        )
        return
    _cond(
        step,
        COND_WINDOWED,
        "True",
        REASON_WINDOW_DECLARED,
        f"{source}: reclaimed at {until.isoformat()}",
        now,
        generation,
        "Normal",
    )


def window_step(
    status: GPUProfileStatus,
    node: GpuNodeView,
    override: ProfileOverride | None,
    *,
    now: datetime,
    generation: int | None,
) -> Step | None:
    """``status.availableUntil`` and the ``Windowed`` condition from the node's window (issue 13).

    The node annotation ``gearshift.io/available-until`` (RFC 3339) declares when the node is reclaimed;
    ``spec.override.availableUntil`` pins it instead. A value that is not RFC 3339 is ignored (no
    window) and reported in ``Windowed=False`` (reason ``InvalidAvailableUntil``, naming the annotation
    and the expected format) with a Warning event. Returns None when nothing changes.
    """
    step = Step(status.model_copy(deep=True))
    raw = node.available_until
    pinned = override.available_until if override is not None else None
    until: datetime | None = None
    if pinned is not None:
        until = parse_rfc3339(pinned)  # validated by the spec model
        _window_cond(step, "spec.override.availableUntil", until, now, generation)
    elif raw:
        try:
            until = parse_rfc3339(raw)
        except ValueError:
            _cond(
                step,
                COND_WINDOWED,
                "False",
                REASON_WINDOW_INVALID,
                f"node annotation {ANNOTATION_AVAILABLE_UNTIL}={raw!r} is not an RFC 3339 time "
                "(expected e.g. 2025-01-31T18:00:00Z); the window is ignored",
                now,
                generation,
                "Warning",
            )
        else:
            _window_cond(step, f"node annotation {ANNOTATION_AVAILABLE_UNTIL}", until, now, generation)
    elif find_condition(status.conditions, COND_WINDOWED) is not None:
        _cond(step, COND_WINDOWED, "False", REASON_NO_WINDOW, "the node declares no window", now, generation)
    step.status.available_until = until
    if step.status == status:
        return None
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
    _cond(step, COND_PROBED, "False", outcome.reason, text, now, generation)
    if not has_data:
        _cond(step, COND_READY, "False", outcome.reason, text, now, generation)
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
    _cond(step, COND_STALE, "True", reason, message, now, generation, "Warning")
    _cond(step, COND_READY, "False", reason, message, now, generation)
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


# --- one timer step, between the handler's reads and writes ---------------------------------------------


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


__all__ = [
    "DEADLINE_GRACE_S",
    "REASON_NODE_GONE",
    "Event",
    "JobOutcome",
    "ProbeSettings",
    "ProbeStart",
    "SettingsError",
    "Step",
    "backoff_s",
    "complete_step",
    "dump_status",
    "job_create_failed",
    "job_outcome",
    "mark_stale",
    "node_gone_message",
    "node_gone_step",
    "probe_due",
    "probe_failed",
    "probe_finished",
    "probe_start",
    "probe_succeeded",
    "ready_override_step",
    "running_job",
    "start_probe",
    "window_step",
    "with_class",
]
