"""What a step of a GPUProfile's probe life cycle produces (:mod:`gearshift.profiling.lifecycle`): a new
status and the events worth emitting (:class:`Step`, :class:`Event`), a condition set with its event
(:func:`record_condition`), and the condition and event reasons beyond :mod:`gearshift.api.common`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from gearshift.api.common import Condition, set_condition
from gearshift.api.gpuprofile import GPUProfileStatus

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


EventType = Literal["Normal", "Warning"]


@dataclass(frozen=True)
class Event:
    """An event to record on the GPUProfile."""

    type: EventType
    reason: str
    message: str


@dataclass
class Step:
    """A new status and the events that go with it."""

    status: GPUProfileStatus
    events: list[Event] = field(default_factory=list)


def record_condition(
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
