"""The twin (gearshift.dev.twin): card contention, arrivals from a replay's requests, and a static gear's
figures on a few requests. Expected values are worked out by hand in each test."""

from __future__ import annotations

from array import array
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from gearshift.control.shifting.policy import ShiftRules
from gearshift.dev import twin
from gearshift.facts.model import load_hf_config

ARCH = load_hf_config(twin.MODEL)


def _spec(name: str, cards: int, rps: float, load_s: float = 10.0) -> Any:
    api = SimpleNamespace(predicted=SimpleNamespace(throughput_qps=rps))
    return twin.GearSpec(name, api, {}, 1, frozenset(), load_s, cards={f"{name}-n": cards})  # type: ignore[arg-type]


class _Engine:
    def __init__(self, busy: int) -> None:
        self.busy = busy

    def num_running(self) -> int:
        return self.busy

    def num_waiting(self) -> int:
        return 0


class TestContention:
    def _sim(self, share: float = 0.2) -> Any:
        trace = twin.Trace(np.array([0.0, 1.0]), np.array([10, 10]), np.array([5, 5]))
        return twin.Sim(ARCH, trace, ShiftRules(warmup_share=share), array("d"))

    def _gear(self, sim: Any, name: str, busy: int, shadow: bool, nodes: tuple[str, ...]) -> Any:
        head = twin.Head(_Engine(busy), nodes=nodes, gear=name)  # type: ignore[arg-type]
        sim.gears[name] = twin.LiveGear(_spec(name, 1, 10.0), [head], 0.0, 0.0, shadow=shadow)
        return head

    def test_alone_on_its_card(self) -> None:
        sim = self._sim()
        a = self._gear(sim, "a", 3, False, ("n1",))
        self._gear(sim, "b", 3, True, ("n2",))  # another card
        assert sim.share(a) == 1.0

    def test_a_busy_shadow_takes_at_most_warmup_share(self) -> None:
        sim = self._sim(share=0.2)
        a = self._gear(sim, "a", 3, False, ("n1", "n2"))
        s = self._gear(sim, "s", 1, True, ("n2",))
        assert sim.share(a) == pytest.approx(0.8) and sim.share(s) == pytest.approx(0.2)

    def test_an_idle_shadow_costs_nothing(self) -> None:
        sim = self._sim()
        a = self._gear(sim, "a", 3, False, ("n1",))
        self._gear(sim, "s", 0, True, ("n1",))
        assert sim.share(a) == 1.0

    def test_serving_and_draining_split_the_card(self) -> None:
        sim = self._sim()
        new = self._gear(sim, "new", 4, False, ("n1",))
        old = self._gear(sim, "old", 2, False, ("n1",))
        assert sim.share(new) == 0.5 and sim.share(old) == 0.5
