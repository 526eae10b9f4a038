"""The two small facts every layer shares: the tensor-parallel factor and the RFC 3339 read."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from gearshift.facts.fleet import TP_EFFICIENCY, tp_efficiency
from gearshift.facts.rfc3339 import from_rfc3339


@pytest.mark.parametrize(("gpus", "want"), [(0, 1.0), (1, 1.0), (2, TP_EFFICIENCY), (8, TP_EFFICIENCY)])
def test_tp_efficiency_applies_from_two_cards(gpus: int, want: float) -> None:
    assert tp_efficiency(gpus) == want


def test_tp_efficiency_takes_another_factor() -> None:
    assert tp_efficiency(4, 0.5) == 0.5
    assert tp_efficiency(1, 0.5) == 1.0


def test_from_rfc3339_reads_z_and_offsets() -> None:
    assert from_rfc3339("2025-01-31T18:00:00Z") == datetime(2025, 1, 31, 18, tzinfo=UTC)
    assert from_rfc3339("2025-01-31T18:00:00.5+02:00") == datetime(
        2025, 1, 31, 18, 0, 0, 500000, tzinfo=timezone(timedelta(hours=2))
    )
    # No offset: naive, as datetime.fromisoformat reads it (callers needing one check tzinfo).
    assert from_rfc3339("2025-01-31T18:00:00").tzinfo is None


def test_from_rfc3339_refuses_what_is_not_a_time() -> None:
    with pytest.raises(ValueError):
        from_rfc3339("tomorrow")
