"""A GPU node's window (time-limited nodes): when it is reclaimed, from the node annotation
``gearshift.io/available-until`` or ``spec.override.availableUntil``, written to
``status.availableUntil`` with the ``Windowed`` condition (:func:`window_step`).
"""

from __future__ import annotations

from datetime import datetime

from gearshift.api.common import COND_WINDOWED, find_condition
from gearshift.api.gpuprofile import GPUProfileStatus, ProfileOverride
from gearshift.facts.rfc3339 import from_rfc3339
from gearshift.k8s.names import ANNOTATION_AVAILABLE_UNTIL
from gearshift.profiling.profiles import GpuNodeView
from gearshift.profiling.steps import Step, record_condition

#: Condition reasons of ``Windowed``.
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
        record_condition(
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
    record_condition(
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
    """``status.availableUntil`` and the ``Windowed`` condition from the node's window.

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
            record_condition(
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
        record_condition(
            step, COND_WINDOWED, "False", REASON_NO_WINDOW, "the node declares no window", now, generation
        )
    step.status.available_until = until
    if step.status == status:
        return None
    return step
