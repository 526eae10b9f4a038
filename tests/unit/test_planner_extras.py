"""Unit tests: hot-stage extras are a variant of a planner candidate, not forced on it.

The fleet is two cards that both hold the whole model: a fast one (compute score 2) and a slow one (0.5).
The model is four layers of 2.5 ms each per request on a score-1 card (10 ms for the whole model), and a
layer-cost file scales linearly with the micro-batch, so a card of score ``s`` serves ``100 · s`` req/s
whatever the micro-batch. Expected values below follow from that by hand:

- fast card alone: 5 ms per request, 200 req/s; with the slow card as an extra replica (20 ms per
  request): 200 + 50 = 250 req/s. A two-stage pipeline over both cards is no better than the fast card
  alone (its best split, 3 layers on the fast card and 1 on the slow one, has a 5 ms bottleneck).
- at 20 req/s the fast card is 10 % busy: a request the slow card served would take 20 ms, four times
  the fast card's, so it lowers no latency; the latency gear leaves it out, the throughput gear (the
  most capacity) takes it.
"""

from __future__ import annotations

import pytest

from gearshift.planner import parse_layer_costs, parse_profile, plan

FAST, SLOW = ("fast", 2.0), ("slow", 0.5)
LAYER_MS, LAYERS = 2.5, 4


def two_cards() -> object:
    """The fast and the slow card, 80 GB each, linked at 100 Gb/s."""
    return parse_profile(
        {
            "nodes": [
                {
                    "node_id": nid,
                    "memory_gb": 80,
                    "compute_score": score,
                    "max_batch_microbatch": 16,
                    "interconnect": {"slow": {"bandwidth_gbps": 100, "latency_us": 10}}
                    if nid == "fast"
                    else {},
                }
                for nid, score in (FAST, SLOW)
            ]
        }
    )


def model() -> object:
    """Four layers of 2.5 ms per request on a score-1 card, 2 GB of weights each."""
    layers = [{"compute_ms": LAYER_MS, "weight_gb": 2.0} for _ in range(LAYERS)]
    return parse_layer_costs({"name": "four", "activation_mb": 1, "layers": layers})


def req_per_s(*scores: float) -> float:
    """Requests/s of whole-model replicas on cards of these compute scores (by hand, module docstring)."""
    return sum(1000.0 * s / (LAYER_MS * LAYERS) for s in scores)


class TestExtrasAreAVariant:
    def test_latency_leaves_the_slow_card_out_throughput_takes_it(self) -> None:
        res = plan(two_cards(), model(), intents=["latency", "throughput"], qps=20.0, sim_requests=2000)
        lat, thr = res.gear("latency"), res.gear("throughput")
        assert [(s.layers, s.nodes) for s in lat.stages] == [((0, LAYERS), ("fast",))]
        assert lat.predicted.throughput_rps == pytest.approx(req_per_s(FAST[1]))  # 200 req/s
        # No request waited long enough on the fast card for the slow card's 20 ms to be quicker.
        assert lat.predicted.p99_ms < LAYER_MS * LAYERS / SLOW[1]
        assert [(s.layers, s.nodes) for s in thr.stages] == [((0, LAYERS), ("fast", "slow"))]
        assert thr.predicted.throughput_rps == pytest.approx(req_per_s(FAST[1], SLOW[1]))  # 250 req/s

    def test_single_pipeline_gets_no_extras(self) -> None:
        res = plan(two_cards(), model(), intents=["throughput"], single_pipeline=True, sim_requests=200)
        thr = res.gear("throughput")
        # One pipeline, no extras: the best it can do is the fast card's 200 req/s (5 ms bottleneck).
        assert all(len(s.nodes) == 1 for s in thr.stages)
        assert thr.predicted.throughput_rps == pytest.approx(req_per_s(FAST[1]))
