"""Unit tests of the GPUProfile's window: gearshift.profiling.window.window_step."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from gearshift.api.common import COND_WINDOWED, find_condition
from gearshift.api.gpuprofile import GPUProfileStatus, ProfileOverride
from gearshift.k8s.names import ANNOTATION_AVAILABLE_UNTIL
from gearshift.profiling.profiles import GpuNodeView
from gearshift.profiling.window import parse_rfc3339, window_step

NOW = datetime(2025, 1, 31, 12, 0, tzinfo=UTC)


def node(value: str | None) -> GpuNodeView:
    ann = {ANNOTATION_AVAILABLE_UNTIL: value} if value is not None else {}
    return GpuNodeView("gpu-a", 1, "NVIDIA-H100-80GB-HBM3", annotations=ann)


class TestWindowStep:
    def test_annotation_sets_available_until_and_condition(self) -> None:
        step = window_step(GPUProfileStatus(), node("2025-01-31T12:05:00Z"), None, now=NOW, generation=1)
        assert step is not None
        assert step.status.available_until == datetime(2025, 1, 31, 12, 5, tzinfo=UTC)
        cond = find_condition(step.status.conditions, COND_WINDOWED)
        assert cond is not None and cond.status == "True" and "12:05:00" in cond.message
        assert [e.type for e in step.events] == ["Normal"]
        # Applying again changes nothing (no event storm on every timer tick).
        assert window_step(step.status, node("2025-01-31T12:05:00Z"), None, now=NOW, generation=1) is None

    def test_passed_window_is_reported_closed_once(self) -> None:
        declared = window_step(GPUProfileStatus(), node("2025-01-31T12:05:00Z"), None, now=NOW, generation=1)
        assert declared is not None
        later = datetime(2025, 1, 31, 12, 5, 1, tzinfo=UTC)
        closed = window_step(declared.status, node("2025-01-31T12:05:00Z"), None, now=later, generation=1)
        assert closed is not None
        cond = find_condition(closed.status.conditions, COND_WINDOWED)
        assert cond is not None and cond.status == "True" and cond.reason == "WindowClosed"
        assert "has passed" in cond.message and [e.type for e in closed.events] == ["Warning"]
        # Exactly at the deadline it is closed too; ticks after that record nothing new.
        assert window_step(closed.status, node("2025-01-31T12:05:00Z"), None, now=later, generation=1) is None
        at = datetime(2025, 1, 31, 12, 5, tzinfo=UTC)
        step = window_step(declared.status, node("2025-01-31T12:05:00Z"), None, now=at, generation=1)
        assert step is not None
        assert find_condition(step.status.conditions, COND_WINDOWED).reason == "WindowClosed"

    @pytest.mark.parametrize("bad", ["tomorrow", "2025-01-31", "2025-01-31T12:05:00", "1738325100"])
    def test_bad_value_is_ignored_and_reported(self, bad: str) -> None:
        step = window_step(GPUProfileStatus(), node(bad), None, now=NOW, generation=1)
        assert step is not None and step.status.available_until is None
        cond = find_condition(step.status.conditions, COND_WINDOWED)
        assert cond is not None and cond.status == "False" and cond.reason == "InvalidAvailableUntil"
        assert ANNOTATION_AVAILABLE_UNTIL in cond.message and "RFC 3339" in cond.message
        assert [e.type for e in step.events] == ["Warning"]

    def test_removed_annotation_clears_the_window(self) -> None:
        first = window_step(
            GPUProfileStatus(), node("2025-01-31T12:05:00+01:00"), None, now=NOW, generation=1
        )
        assert first is not None
        assert first.status.available_until == datetime(2025, 1, 31, 11, 5, tzinfo=UTC)
        gone = window_step(first.status, node(None), None, now=NOW, generation=1)
        assert gone is not None and gone.status.available_until is None
        cond = find_condition(gone.status.conditions, COND_WINDOWED)
        assert cond is not None and cond.status == "False"

    def test_override_pins_the_window(self) -> None:
        ov = ProfileOverride(availableUntil="2025-02-01T00:00:00Z")
        step = window_step(GPUProfileStatus(), node("garbage"), ov, now=NOW, generation=1)
        assert step is not None and step.status.available_until == datetime(2025, 2, 1, tzinfo=UTC)

    def test_no_window_no_change(self) -> None:
        assert window_step(GPUProfileStatus(), node(None), None, now=NOW, generation=1) is None


def test_parse_rfc3339_needs_an_offset() -> None:
    assert parse_rfc3339("2025-01-31T12:00:00.5Z") == datetime(2025, 1, 31, 12, 0, 0, 500000, tzinfo=UTC)
    with pytest.raises(ValueError):
        parse_rfc3339("2025-01-31T12:00:00")
