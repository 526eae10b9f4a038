"""The router's goodput counter, ``gearshift_router_slo_requests_total{model_name, result}``: each streamed
client request answered in full is judged once against the PDService's SLO, as the load generator judges it
(TTFT <= slo.ttftMs and TPOT <= slo.itlMs, DistServe's goodput)."""

from __future__ import annotations

import pytest
from test_router_openai import ROLE_DELAY_S, ChatEngine, _metric, _metrics
from test_router_proxy import Factory, FakeEngine, make_router  # noqa: F401  (the fixture)

from gearshift.router.metrics import slo_met

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}


@pytest.mark.parametrize(
    ("ttft_s", "tpot_s", "met"),
    [
        (0.200, 0.050, True),  # both exactly at the SLO: met (<=)
        (0.2001, 0.010, False),  # TTFT over
        (0.100, 0.0501, False),  # TPOT over
        (0.100, None, True),  # one token: only TTFT judged
        (0.300, None, False),
    ],
)
def test_slo_met_is_ttft_and_tpot_within_the_slo(ttft_s: float, tpot_s: float | None, met: bool) -> None:
    assert slo_met(ttft_s, tpot_s, slo_ttft_ms=200.0, slo_itl_ms=50.0) is met


async def _chat(client: object, n: int) -> None:
    for _ in range(n):
        resp = await client.post("/v1/chat/completions", json=CHAT)  # type: ignore[attr-defined]
        assert resp.status == 200
        await resp.read()


@pytest.mark.parametrize(
    ("ttft_ms", "itl_ms", "result"),
    [
        # ChatEngine: first token after ROLE_DELAY_S (0.25 s), then a token every ~10 ms (TPOT ~10 ms)
        (2000.0, 500.0, "met"),
        (ROLE_DELAY_S * 1e3 / 2, 500.0, "missed"),  # TTFT over
        (2000.0, 1.0, "missed"),  # TPOT over
    ],
)
async def test_streams_count_against_the_pools_slo(
    make_router: Factory,  # noqa: F811
    ttft_ms: float,
    itl_ms: float,
    result: str,
) -> None:
    client, router, _ = await make_router({"b0": ("both", ChatEngine("b0", tokens=5))})
    router.pool.config.target_ttft_ms, router.pool.config.target_itl_ms = ttft_ms, itl_ms
    await _chat(client, 3)
    m = await _metrics(client)
    assert f'gearshift_router_slo_requests_total{{model_name="m",result="{result}"}} 3.0' in m
    assert _metric(m, "gearshift_router_slo_requests_total") == 3


async def test_unstreamed_answers_are_not_judged(make_router: Factory) -> None:  # noqa: F811
    client, _router, _ = await make_router({"b0": ("both", FakeEngine("b0"))})
    for _ in range(2):
        assert (await client.post("/v1/completions", json={"model": "m", "prompt": "x"})).status == 200
    m = await _metrics(client)
    assert _metric(m, "vllm:request_success_total") == 2
    assert _metric(m, "gearshift_router_slo_requests_total") == 0  # no TTFT seen: nothing to judge
