"""The executor run over a world model, step after step, until it is Stable and idle: what tests and
benchmarks drive it with. Pure.

Each state goes through the status codec between steps (:mod:`gearshift.control.shifting.executor_status`), so
a run proves restart safety through the codec production uses; it sits apart from :mod:`~gearshift.control.
executor` because the codec imports the executor's types.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from gearshift.control.shifting.executor import Phase, ShiftRequest, ShiftState, World, step
from gearshift.control.shifting.executor_actions import Action
from gearshift.control.shifting.executor_status import through_status
from gearshift.control.shifting.policy import ShiftRules


class WorldModel(Protocol):
    """Something that can be observed and that applies actions: a scripted world in tests and benches."""

    def observe(self, now: float) -> World: ...

    def apply(self, actions: list[Action], now: float) -> None: ...


@dataclass(frozen=True)
class StepRecord:
    """One step of :func:`simulate_steps`: the time, the world seen, the phase after, the actions."""

    now: float
    world: World
    phase: Phase
    actions: list[Action] = field(default_factory=list)
    state: ShiftState | None = None


def simulate_steps(
    state: ShiftState,
    world: WorldModel,
    policy: ShiftRules,
    *,
    request: ShiftRequest | None,
    start: float = 0.0,
    tick_s: float = 2.0,
    max_steps: int = 10_000,
    persist: bool = True,
) -> list[StepRecord]:
    """Run :func:`step` every ``tick_s`` over ``world`` until the executor is Stable and idle.

    ``request`` is offered at the first step. With ``persist`` every state goes through the status codec
    between steps (:func:`~gearshift.control.shifting.executor_status.through_status`), as it does through
    ``GearSet.status`` in production.

    Raises:
        RuntimeError: not Stable and idle after ``max_steps`` steps (a livelock in the step function).
    """
    records: list[StepRecord] = []
    now = start
    for i in range(max_steps):
        seen = world.observe(now)
        state, actions = step(state, seen, policy, request=request if i == 0 else None)
        if persist:
            state = through_status(state)
        world.apply(actions, now)
        records.append(StepRecord(now, seen, state.phase, actions, state))
        if i > 0 and state.phase is Phase.STABLE and not actions:
            return records
        now += tick_s
    raise RuntimeError(f"executor not Stable and idle after {max_steps} steps (phase {state.phase})")
