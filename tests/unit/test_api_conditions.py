"""The condition setter: lastTransitionTime moves only when status flips (the API conventions)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from gearshift.api.common import (
    COND_DEGRADED,
    COND_READY,
    CONDITION_TYPES,
    Condition,
    condition_is_true,
    find_condition,
    set_condition,
)

T0 = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)
T1 = T0 + timedelta(minutes=5)
T2 = T0 + timedelta(minutes=9)


class TestSetCondition:
    def test_set_condition_keeps_last_transition_time_unless_status_flips(self) -> None:
        conds, changed = set_condition([], COND_READY, "False", "Placing", "waiting for pods", T0, 1)
        assert changed and conds[0].last_transition_time == T0

        # Same status, new reason, message and generation: recorded, transition time kept.
        conds, changed = set_condition(conds, COND_READY, "False", "PlacementFailed", "no A100 free", T1, 2)
        ready = find_condition(conds, COND_READY)
        assert ready is not None
        assert changed
        assert ready.last_transition_time == T0
        assert (ready.reason, ready.message, ready.observed_generation) == (
            "PlacementFailed",
            "no A100 free",
            2,
        )

        # Status flips: transition time moves.
        conds, changed = set_condition(conds, COND_READY, "True", "Reconciled", "", T2, 2)
        ready = find_condition(conds, COND_READY)
        assert ready is not None and changed and ready.last_transition_time == T2

    def test_generation_bump_alone_is_not_a_change(self) -> None:
        conds, _ = set_condition([], COND_READY, "True", "Reconciled", "ok", T0, 1)
        conds, changed = set_condition(conds, COND_READY, "True", "Reconciled", "ok", T1, 2)
        ready = find_condition(conds, COND_READY)
        assert ready is not None
        assert not changed
        assert ready.observed_generation == 2 and ready.last_transition_time == T0

    def test_other_conditions_keep_their_order_and_the_input_is_untouched(self) -> None:
        start, _ = set_condition([], COND_READY, "True", "Reconciled", "", T0)
        start, _ = set_condition(start, COND_DEGRADED, "False", "AllHealthy", "", T0)
        snapshot = list(start)
        after, _ = set_condition(start, COND_READY, "False", "NodeLost", "gpu-a10-2 gone", T1)
        assert [c.type for c in after] == [COND_READY, COND_DEGRADED]
        assert start == snapshot
        assert not condition_is_true(after, COND_READY)
        assert after[1] is start[1]

    def test_a_condition_read_without_time_gets_one(self) -> None:
        old = [Condition(type=COND_READY, status="True", reason="Reconciled")]
        conds, _ = set_condition(old, COND_READY, "True", "Reconciled", "", T1)
        assert conds[0].last_transition_time == T1

    @pytest.mark.parametrize(("status", "reason"), [("Yes", "Reconciled"), ("True", "")])
    def test_bad_status_or_empty_reason_is_refused(self, status: str, reason: str) -> None:
        with pytest.raises(ValueError, match=r"status|reason"):
            set_condition([], COND_READY, status, reason, "", T0)  # type: ignore[arg-type]

    def test_condition_serialises_as_metav1(self) -> None:
        conds, _ = set_condition([], COND_READY, "True", "Reconciled", "all stages ready", T0, 3)
        assert conds[0].to_json() == {
            "type": "Ready",
            "status": "True",
            "reason": "Reconciled",
            "message": "all stages ready",
            "lastTransitionTime": "2025-01-01T12:00:00Z",
            "observedGeneration": 3,
        }


def test_condition_types_are_distinct_camel_case() -> None:
    assert len(set(CONDITION_TYPES)) == len(CONDITION_TYPES)
    assert all(t[0].isupper() and t.isalnum() for t in CONDITION_TYPES)


def test_naive_times_are_refused() -> None:
    # Status times must carry a zone: the API server stores RFC 3339, and a naive time is ambiguous.
    with pytest.raises(ValueError, match="timezone"):
        set_condition([], COND_READY, "True", "Reconciled", "", datetime(2025, 1, 1, 12, 0))
