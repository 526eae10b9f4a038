"""The executor's state as ``GearSet.status`` stores it: the one codec, used by the shifting loop and by
:func:`gearshift.control.shifting.executor_sim.simulate_steps` (so restart safety is proven through the codec
production uses). Pure.

``status.activeGear`` holds :attr:`ShiftState.active`; ``status.executor`` (:class:`ExecutorState`) the
rest, times as RFC 3339 UTC strings.
"""

from __future__ import annotations

import json
from typing import Any

from gearshift.api.gearset_status import ExecutorState
from gearshift.control.shifting.executor import Phase, ShiftState
from gearshift.facts.rfc3339 import from_time, to_time


# --- executor state <-> status ---------------------------------------------------------------------------
def executor_from_status(active: str, ex: ExecutorState | None) -> ShiftState:
    """The executor's :class:`ShiftState` from ``status.activeGear`` and ``status.executor``.

    ``Pending`` (never written by the executor) reads as ``Stable``.
    """
    if ex is None:
        return ShiftState(active=active)
    step_name = ex.step if ex.step != "Pending" else "Stable"
    return ShiftState(
        active=active,
        phase=Phase(step_name),
        from_gear=ex.from_gear,
        to_gear=ex.to_gear,
        trigger=ex.trigger,
        started_at=from_time(ex.started_at),
        step_started_at=from_time(ex.step_started_at),
        deadline=from_time(ex.deadline),
        degraded=ex.degraded,
        predicted_p99_ms=ex.predicted_p99_ms,
        baseline_p99_ms=ex.baseline_p99_ms,
        baseline_qps=ex.baseline_qps,
        failure=ex.failure,
        failure_message=ex.failure_message,
        paused_at=from_time(ex.paused_at),
    )


def executor_to_status(state: ShiftState, in_flight: int | None = None) -> dict[str, Any]:
    """``status.executor`` (camelCase JSON) of ``state``; ``state.active`` goes to ``status.activeGear``."""
    return {
        "step": state.phase.value,
        "fromGear": state.from_gear,
        "toGear": state.to_gear,
        "trigger": state.trigger,
        "startedAt": to_time(state.started_at),
        "stepStartedAt": to_time(state.step_started_at),
        "deadline": to_time(state.deadline),
        "rollbackUntil": to_time(state.deadline) if state.phase is Phase.SWITCHING else None,
        "degraded": state.degraded,
        "inFlight": in_flight,
        "predictedP99Ms": state.predicted_p99_ms,
        "baselineP99Ms": state.baseline_p99_ms,
        "baselineQps": state.baseline_qps,
        "failure": state.failure,
        "failureMessage": state.failure_message,
        "pausedAt": to_time(state.paused_at),
    }


def through_status(state: ShiftState) -> ShiftState:
    """``state`` after a write to ``GearSet.status`` and a read back: JSON, the status model, and back.

    Raises:
        pydantic.ValidationError: the state does not fit the status schema.
    """
    raw = json.loads(json.dumps(executor_to_status(state)))
    return executor_from_status(state.active, ExecutorState.model_validate(raw))
