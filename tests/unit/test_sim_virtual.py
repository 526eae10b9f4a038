"""The simulated engine in virtual time (``Engine.begin_step``/``end_step``: no event loop, no sleeps)."""

from __future__ import annotations

import math

import pytest

from gearshift.facts.model import load_hf_config
from gearshift.sim.engine import Engine
from gearshift.sim.perfmodel import PerfModel, single_stage_pipeline


class VClock:
    """A settable virtual clock, s."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _engine(role: str = "both") -> tuple[Engine, VClock]:
    arch = load_hf_config("examples/models/llama-3-8b.json")
    clock = VClock()
    return Engine(PerfModel(arch, single_stage_pipeline(arch)), role=role, clock=clock), clock


def _drain(engine: Engine, clock: VClock, limit: int = 10_000) -> int:
    """Run steps back to back until the engine is idle; returns the steps run."""
    for n in range(limit):
        step = engine.begin_step(clock.now)
        if step is None:
            nxt = engine.next_transfer_at()
            if nxt is None:
                return n
            clock.now = nxt
            continue
        clock.now = step.end
        engine.end_step(step)
    raise AssertionError("engine never went idle")


def test_lone_request_in_virtual_time_matches_the_model_exactly() -> None:
    engine, clock = _engine()
    clock.now = 5.0
    req = engine.new_request(300, 6)
    _drain(engine, clock)
    ttft, itls = engine.model.single_request(300, 6)
    assert req.finished and req.generated == 6
    assert req.first_token_at is not None and req.finished_at is not None
    assert req.first_token_at - 5.0 == pytest.approx(ttft, rel=1e-12)
    assert req.finished_at - req.first_token_at == pytest.approx(sum(itls), rel=1e-12)
    stats = engine.stats()
    assert stats["steps"] == 6 and stats["lag_s"] == 0.0
    assert stats["planned_step_s"] == pytest.approx(ttft + sum(itls), rel=1e-12)
    assert engine.free_blocks == engine.total_blocks


def test_begin_step_is_none_when_idle_and_end_step_records_utilisation() -> None:
    engine, clock = _engine()
    assert engine.begin_step(0.0) is None
    engine.new_request(1000, 1)
    step = engine.begin_step(0.0)
    assert step is not None and step.start == 0.0 and step.end > 0.0
    # Nothing is emitted before end_step: the batch is applied at the step's end.
    assert step.batch[0][0].generated == 0
    clock.now = step.end
    engine.end_step(step)
    assert step.batch[0][0].finished
    # The single stage was busy the whole step: utilisation over the window = step / window.
    from gearshift.sim.metrics import UTILIZATION_WINDOW_S

    (u,) = engine.stage_utilization()
    assert u == pytest.approx(min(1.0, step.end / UTILIZATION_WINDOW_S))


def test_late_end_counts_as_lag_and_emits_at_that_time() -> None:
    engine, clock = _engine()
    req = engine.new_request(10, 1)
    step = engine.begin_step(0.0)
    assert step is not None
    clock.now = step.end + 0.01
    engine.end_step(step, clock.now)
    assert engine.stats()["lag_s"] == pytest.approx(0.01)
    assert req.first_token_at == pytest.approx(step.end + 0.01)


def test_remote_kv_request_waits_for_its_transfer_in_virtual_time() -> None:
    engine, clock = _engine(role="decode")
    req = engine.new_request(2000, 3, remote_kv_tokens=2000)
    assert engine.begin_step(0.0) is None  # admitted, its KV is in flight
    landed = engine.next_transfer_at()
    assert landed is not None and landed == pytest.approx(engine.model.kv_transfer_s(2000, engine.kv_link))
    _drain(engine, clock)
    assert req.finished and req.first_token_at is not None
    assert req.first_token_at > landed
    assert not math.isnan(req.first_token_at)
