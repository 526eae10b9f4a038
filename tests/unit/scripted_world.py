"""Test double (not shipped in the package): a scripted world for the shift executor, with gears that
become Ready, fail, drain and report P99 on cue.

It applies the executor's actions the way the handler and Kubernetes would (create, delete, select),
with timings given per gear, so tests can run :func:`gearshift.control.shifting.executor_sim.simulate_steps`
and check invariants at every step. Pure: time is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gearshift.control.shifting.executor import GearObservation, World
from gearshift.control.shifting.executor_actions import (
    Action,
    DeleteGear,
    EnsureGear,
    Event,
    MarkUnhealthy,
    SelectGear,
)


@dataclass
class GearScript:
    """How one gear behaves once its objects are created; times in s after creation."""

    ready_after_s: float = 20.0
    fail_after_s: float | None = None
    failure: str = "CrashLoopBackOff"
    failure_message: str = ""
    p99_ms: float | None = None
    p99_ms_per_s: float = 0.0
    """The P99 grows this much per second of age (a queue that keeps growing under overload), ms/s."""
    qps: float | None = None
    """Its served rate, completed requests/s (``None``: not sampled)."""
    in_flight: int = 0
    """Requests on the gear while it is selected, and when it stops being selected."""
    drain_per_s: float = 5.0
    """Requests it finishes per second once it takes no new ones; 0 means they never finish."""


@dataclass
class ScriptedWorld:
    """Gears with scripted behaviour, the role Service's selection, and a log of what was applied."""

    scripts: dict[str, GearScript]
    created: dict[str, float] = field(default_factory=dict)
    selected: str | None = None
    deselected_at: dict[str, float] = field(default_factory=dict)
    full_shadow_fits: bool = True
    kv_pool: dict[str, bool] = field(default_factory=dict)
    unhealthy: dict[str, str] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    deleted_while_selected: list[str] = field(default_factory=list)
    lost: dict[str, int] = field(default_factory=dict)
    """Requests a gear still held when it was deleted, by gear (each one a failed request)."""

    @classmethod
    def serving(cls, active: str, scripts: dict[str, GearScript], at: float = -1000.0) -> ScriptedWorld:
        """A world where ``active`` has long been created, Ready and selected."""
        return cls(scripts=scripts, created={active: at}, selected=active, kv_pool={active: True})

    def _obs(self, name: str, now: float) -> GearObservation:
        script, born = self.scripts[name], self.created[name]
        age = now - born
        failed = script.fail_after_s is not None and age >= script.fail_after_s
        ready = age >= script.ready_after_s and not failed
        in_flight = script.in_flight
        if name in self.deselected_at:
            done = script.drain_per_s * (now - self.deselected_at[name])
            in_flight = max(0, int(script.in_flight - done)) if script.drain_per_s > 0 else script.in_flight
        return GearObservation(
            exists=True,
            ready=ready,
            ready_since=born + script.ready_after_s if ready else None,
            in_flight=in_flight,
            failure=script.failure if failed else None,
            failure_message=script.failure_message if failed else "",
            p99_ms=None if script.p99_ms is None else script.p99_ms + script.p99_ms_per_s * age,
            qps=script.qps,
            kv_pool=self.kv_pool.get(name, True),
        )

    def observe(self, now: float) -> World:
        """The world as the handler would read it at ``now``."""
        gears = {name: self._obs(name, now) for name in self.created}
        return World(now=now, gears=gears, selected=self.selected, full_shadow_fits=self.full_shadow_fits)

    def is_ready(self, name: str | None, now: float) -> bool:
        return name in self.created and self._obs(name, now).ready

    def apply(self, actions: list[Action], now: float) -> None:
        """Apply the executor's actions in order."""
        for action in actions:
            match action:
                case EnsureGear(gear=gear, kv_pool=kv):
                    self.created.setdefault(gear, now)
                    self.kv_pool[gear] = kv
                case SelectGear(gear=gear):
                    if self.selected is not None and self.selected != gear:
                        self.deselected_at[self.selected] = now
                    self.deselected_at.pop(gear, None)
                    self.selected = gear
                case DeleteGear(gear=gear):
                    if gear == self.selected:
                        self.deleted_while_selected.append(gear)
                    if gear in self.created and (held := self._obs(gear, now).in_flight) > 0:
                        self.lost[gear] = self.lost.get(gear, 0) + held
                    self.created.pop(gear, None)
                    self.deselected_at.pop(gear, None)
                case MarkUnhealthy(gear=gear, reason=reason):
                    self.unhealthy[gear] = reason
                case Event():
                    self.events.append(action)
                case _:
                    pass
