"""The shared per-GearSet sampling loop of the shifting and autoscale daemons."""

from __future__ import annotations

import asyncio
import contextlib
import time
from types import SimpleNamespace
from typing import Any

from gearshift.handlers.loop import every_sample_interval, sample_interval


def test_interval_from_the_policy_with_a_floor_and_a_default():
    assert sample_interval({"spec": {"policy": {"sampleIntervalS": 5}}}, 0.5) == 5.0
    assert sample_interval({"spec": {"policy": {"sampleIntervalS": 0.01}}}, 0.5) == 0.5
    assert sample_interval({"spec": {"policy": {"sampleIntervalS": "soon"}}}, 0.5) == 2.0
    assert sample_interval({}, 0.2) == 2.0


class _Stopped:
    """Stands in for kopf.DaemonStopped: falsy until set; wait() sleeps at most the given time."""

    def __init__(self) -> None:
        self.flag = asyncio.Event()

    def __bool__(self) -> bool:
        return self.flag.is_set()

    async def wait(self, seconds: float) -> None:  # kopf's DaemonStopped.wait takes the same argument
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.flag.wait(), seconds)


async def _loop(
    body: dict, stopped: _Stopped, tick: Any, *, what: str = "t", limit_s: float = 10, **kw: Any
) -> None:
    """``every_sample_interval`` of ``ns/gs`` at a 0.01 s floor, expecting no error, within ``limit_s`` s."""
    await asyncio.wait_for(
        every_sample_interval("ns", "gs", body, stopped, tick, what=what, floor_s=0.01, expected=(), **kw),
        timeout=limit_s,
    )


async def test_ticks_keep_going_through_errors_until_stopped():
    stopped = _Stopped()
    calls: list[tuple[str, str]] = []

    def tick(ns: str, name: str) -> object:
        calls.append((ns, name))
        if len(calls) == 1:
            raise KeyError("expected error: the loop goes on")
        if len(calls) == 2:
            raise RuntimeError("unexpected error: logged, the loop goes on")
        if len(calls) == 4:
            stopped.flag.set()
        return SimpleNamespace(skipped="nothing to do")

    body = {"spec": {"policy": {"sampleIntervalS": 0.01}}}
    await asyncio.wait_for(
        every_sample_interval(
            "ns", "gs", body, stopped, tick, what="test tick", floor_s=0.01, expected=(KeyError,)
        ),
        timeout=5,
    )
    assert calls == [("ns", "gs")] * 4


async def test_an_idle_tick_waits_the_idle_interval(monkeypatch):
    import gearshift.handlers.loop as loop

    monkeypatch.setattr(loop, "IDLE_INTERVAL_S", 1.5)
    stopped = _Stopped()
    times: list[float] = []
    idle = [True, False, False]

    def tick(ns: str, name: str) -> object:
        times.append(time.monotonic())  # the tick runs in a worker thread
        if len(times) == len(idle):
            stopped.flag.set()
        return SimpleNamespace(skipped="", idle=idle[len(times) - 1])

    body = {"spec": {"policy": {"sampleIntervalS": 0.01}}}
    await asyncio.wait_for(
        every_sample_interval("ns", "gs", body, stopped, tick, what="t", floor_s=0.01, expected=()),
        timeout=5,
    )
    # After the idle tick: the loop waits 1.5 s from the idle turn's start; the tick's own clock reading
    # comes after its worker thread starts, whose delay differs between turns on a busy machine.
    assert times[1] - times[0] >= 1.5 - 0.1
    # Back to the 0.01 s sample interval; the bound leaves room for a loaded machine's scheduling.
    assert times[2] - times[1] < 1.0


async def test_a_spec_edit_ends_an_idle_wait(monkeypatch):
    import gearshift.handlers.loop as loop

    monkeypatch.setattr(loop, "IDLE_INTERVAL_S", 30.0)
    monkeypatch.setattr(loop, "WAKE_POLL_S", 0.05)
    stopped = _Stopped()
    times: list[float] = []
    body = {"metadata": {"generation": 1}, "spec": {"policy": {"sampleIntervalS": 0.01}}}

    def tick(ns: str, name: str) -> object:
        times.append(time.monotonic())
        if len(times) == 2:
            stopped.flag.set()
        return SimpleNamespace(skipped="", idle=True)

    async def edit() -> None:
        await asyncio.sleep(0.3)
        body["metadata"]["generation"] = 2  # kopf's live body follows the watch

    editing = asyncio.create_task(edit())
    await asyncio.wait_for(
        every_sample_interval("ns", "gs", body, stopped, tick, what="t", floor_s=0.01, expected=()),
        timeout=10,
    )
    await editing
    # The second turn came with the edit, not 30 s after the idle first one.
    assert 0.25 <= times[1] - times[0] < 5.0


def test_missed_samples_of_a_long_turn():
    from gearshift.handlers.loop import missed_samples

    # At 2 s: the next turn starts at once after an overrun, in place of the latest instant passed.
    assert [missed_samples(e, 2.0) for e in (0.0, 1.9, 2.0, 2.5, 3.99, 4.0, 4.5, 10.1)] == [
        0,
        0,
        0,
        0,
        0,
        1,
        1,
        4,
    ]


async def test_a_turn_longer_than_the_interval_is_counted_and_logged(caplog):
    # The loop never falls behind silently.
    from gearshift.adapters import metrics

    stopped = _Stopped()
    calls: list[float] = []

    def tick(ns: str, name: str) -> object:
        calls.append(time.monotonic())
        if len(calls) == 1:
            time.sleep(0.26)  # five intervals of 0.05 s and a bit: four instants missed
        else:
            stopped.flag.set()
        return SimpleNamespace()

    handed: list[int] = []  # what the shifting loop adds to status.signals.missedSamples
    counter = metrics.SAMPLES_MISSED.labels("slow tick")
    before = counter._value.get()
    body = {"spec": {"policy": {"sampleIntervalS": 0.05}}}
    with caplog.at_level("WARNING", logger="gearshift.loop"):
        await _loop(body, stopped, tick, what="slow tick", limit_s=5, on_missed=handed.append)
    missed = counter._value.get() - before
    assert missed >= 4  # floor(0.26 / 0.05) - 1; a loaded machine may stretch the sleep, never shorten it
    assert sum(handed) == missed
    assert any("slow tick took" in r.getMessage() and "missed" in r.getMessage() for r in caplog.records)
    assert len(calls) == 2


async def test_a_change_of_the_service_ends_an_idle_wait_and_only_an_idle_one(monkeypatch):
    """After an idle turn the loop sleeps IDLE_INTERVAL_S unless ``idle_wake_on`` moves (the watches saw
    the service change); after a sampling turn that key is not looked at."""
    import gearshift.handlers.loop as loop

    monkeypatch.setattr(loop, "IDLE_INTERVAL_S", 30.0)
    monkeypatch.setattr(loop, "WAKE_POLL_S", 0.05)
    stopped = _Stopped()
    times: list[float] = []
    changes = [0]
    idle = [True, False, False]

    def tick(ns: str, name: str) -> object:
        times.append(time.monotonic())
        if len(times) == 3:
            stopped.flag.set()
        return SimpleNamespace(skipped="", idle=idle[len(times) - 1])

    async def change() -> None:
        await asyncio.sleep(0.3)
        changes[0] += 1  # a pod of the service changed (Runtime.changes)
        await asyncio.sleep(0.3)
        changes[0] += 1  # during the sampling wait: not a wake-up

    body = {"metadata": {"generation": 1}, "spec": {"policy": {"sampleIntervalS": 1.0}}}
    changing = asyncio.create_task(change())
    await _loop(body, stopped, tick, idle_wake_on=lambda b: changes[0])
    await changing
    assert 0.25 <= times[1] - times[0] < 5.0  # woken by the change, not 30 s later
    assert times[2] - times[1] >= 1.0 - 0.1  # the sampling interval, whatever the count did


def test_the_idle_wake_key_follows_the_reconciler_and_the_service_not_the_loops_own_writes():
    from gearshift.handlers.loop import idle_wake_key, spec_generation

    body = {
        "metadata": {"generation": 3},
        "status": {"profilesHash": "a", "plannedGears": [{}, {}], "selector": "s", "autoscaled": False},
    }
    key = idle_wake_key(body, spec_generation, 7)
    loops_own = {
        "signals": {"sampleTime": "t"},
        "executor": {"step": "Stable"},
        "history": [{}],
        "phase": "x",
    }
    assert idle_wake_key({**body, "status": {**body["status"], **loops_own}}, spec_generation, 7) == key
    for moved in (
        {"profilesHash": "b"},
        {"plannedGears": [{}]},
        {"selector": "t"},
        {"autoscaled": True},
        {"windowedNodes": ["n1"]},
    ):
        assert idle_wake_key({**body, "status": {**body["status"], **moved}}, spec_generation, 7) != key, (
            moved
        )
    assert idle_wake_key({**body, "metadata": {"generation": 4}}, spec_generation, 7) != key
    assert idle_wake_key(body, spec_generation, 8) != key
