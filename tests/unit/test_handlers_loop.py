"""The shared per-GearSet sampling loop of the shifting and autoscale daemons."""

from __future__ import annotations

import asyncio
import contextlib
import time
from types import SimpleNamespace

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
