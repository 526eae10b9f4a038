"""p99-low cannot fire while requests wait (the demo's wrong-way shift: a full queue beside an engine P99
that looked healthy moved the service to a gear with less capacity). Table-driven."""

from __future__ import annotations

import pytest

from gearshift.control.shifting.decide import DecisionKind, DecisionState, decide
from gearshift.control.shifting.policy import GearTable, GearView, Intent, ShiftRules, StageView
from gearshift.control.shifting.triggers import Trigger, conditions
from gearshift.control.smoothing import LatencyMetric, Sample
from gearshift.facts.model import ModelArch

POLICY = ShiftRules(target_p99_ms=200.0, latency_metric=LatencyMetric.TTFT, dwell_s=0.0)


@pytest.mark.parametrize(
    ("p99_ms", "queue", "pipelines", "fires"),
    [
        (100.0, 0.0, 1, True),  # low P99, nothing waiting: FlexPipe's rule (docs/sources.md#shift-triggers)
        (100.0, 0.9, 1, True),  # under one waiting per replica (saturationQueue 1.0)
        (100.0, 1.5, 1, False),  # requests wait: the low P99 is only the admitted requests'
        (100.0, 447.0, 1, False),  # the demo's decode backlog
        (100.0, 1.5, 2, True),  # 0.75 per replica of two pipelines
        (100.0, 4.0, 2, False),
        (150.0, 0.0, 1, False),  # P99 above 0.7 x target: not low
        (None, 0.0, 1, False),  # no traffic: no latency trigger
    ],
)
def test_p99_low_needs_an_empty_queue(
    p99_ms: float | None, queue: float, pipelines: int, fires: bool
) -> None:
    s = Sample(at=0.0, stage_utilization=(0.5,), queue=queue, ttft_p99_ms=p99_ms)
    levels = dict.fromkeys(Trigger, 0)
    assert conditions(s, POLICY, levels, pipelines)[Trigger.LATENCY_LOW] is fires


def _table() -> GearTable:
    arch = ModelArch(
        name="m",
        num_layers=32,
        hidden_size=4096,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
    )
    return GearTable(
        gears=(
            GearView("latency", Intent.LATENCY, (StageView(0, 32),), 66.7, 40.0),
            GearView(
                "balanced", Intent.BALANCED, tuple(StageView(a, a + 8) for a in range(0, 32, 8)), 104.0, 96.0
            ),
        ),
        active="latency",
        arch=arch,
    )


@pytest.mark.parametrize(("queue", "wants"), [(0.0, True), (25.0, False)])
def test_decide_holds_on_a_low_p99_while_requests_wait(queue: float, wants: bool) -> None:
    """With an empty queue p99-low latches and asks for the balanced gear (a shift, or the cost check's
    veto); with requests waiting it never latches and the decision holds."""
    state = DecisionState()
    asked = []
    for k in range(POLICY.enter_samples + 1):
        s = Sample(at=2.0 * k, stage_utilization=(0.5,), queue=queue, ttft_p99_ms=80.0)
        state, d = decide(state, s, POLICY, _table(), 2.0 * k)
        asked.append(
            d.trigger == Trigger.LATENCY_LOW.value and d.kind in (DecisionKind.SHIFT, DecisionKind.VETOED)
        )
        assert wants or d.kind is DecisionKind.HOLD
    assert any(asked) is wants
