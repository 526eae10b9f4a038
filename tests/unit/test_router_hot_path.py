"""The router's per-request and per-event shortcuts give what the long way gives.

Each shortcut (bench/router_cost.py measures what it saves) is held equal to the code it stands in for:
batched histogram observations to one ``observe`` per event, the JSON fast path to Python's ``json``, the
lax fast path to pydantic, and the router's clock to a clock that moves within one loop iteration.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time

import pytest
import uvloop
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram

from gearshift.facts import fastjson
from gearshift.facts.lax import LAX_BOOL, LAX_FLOAT, LAX_INT, read_lax
from gearshift.router.legs import RequestIds, request_id_for
from gearshift.router.metrics import ITL_BUCKETS, VLLM_ITL_BUCKETS, observe_many
from gearshift.router.server import Router


def _samples(h: Histogram) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for metric in h.collect()
        for s in metric.samples
        if not s.name.endswith("_created")
    }


def _pair(buckets: tuple[float, ...]) -> tuple[Histogram, Histogram]:
    return (
        Histogram("a", "a", ["m"], buckets=buckets, registry=CollectorRegistry()),
        Histogram("a", "a", ["m"], buckets=buckets, registry=CollectorRegistry()),
    )


@pytest.mark.parametrize("buckets", [ITL_BUCKETS, VLLM_ITL_BUCKETS])
@given(
    obs=st.lists(
        st.tuples(
            st.one_of(
                st.floats(min_value=-1.0, max_value=200.0, allow_nan=False),
                st.sampled_from([0.0, 0.001, 0.005, 0.01, 80.0, math.inf, math.nan]),
            ),
            st.integers(min_value=0, max_value=7),
        ),
        max_size=12,
    )
)
def test_observe_many_equals_one_observe_per_event(
    buckets: tuple[float, ...], obs: list[tuple[float, int]]
) -> None:
    batched, one_by_one = _pair(buckets)
    for amount, n in obs:
        observe_many(batched.labels("m"), amount, n)
        one = one_by_one.labels("m")
        for _ in range(n):
            one.observe(amount)
    got, want = _samples(batched), _samples(one_by_one)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, nan_ok=True, rel=1e-12, abs=1e-12), key


def test_observe_many_counts_a_bucket_edge_in_that_bucket() -> None:
    h = Histogram("e", "e", buckets=(0.01, 0.1), registry=CollectorRegistry())
    observe_many(h, 0.01, 3)  # "le" is inclusive: 0.01 belongs to le="0.01"
    le = {s.labels["le"]: s.value for s in next(iter(h.collect())).samples if s.name == "e_bucket"}
    assert le == {"0.01": 3.0, "0.1": 3.0, "+Inf": 3.0}


@pytest.mark.parametrize(
    "doc",
    [
        b'{"choices":[{"text":" a","finish_reason":null}]}',
        b'{"a": [1, 2.5, "x", null, true, {"b": {}}]}',
        b'"just a string"',
        '{"é": "ü"}',
        b"[]",
    ],
)
def test_fastjson_reads_what_json_reads(doc: bytes | str) -> None:
    assert fastjson.loads(doc) == json.loads(doc)


def test_fastjson_falls_back_for_nan_and_names_bad_json() -> None:
    got = fastjson.loads(b'{"temperature": NaN, "x": -Infinity}')
    assert math.isnan(got["temperature"]) and got["x"] == -math.inf
    with pytest.raises(ValueError, match="Expecting"):  # json's message, not orjson's
        fastjson.loads(b'{"a": ')


@given(st.one_of(st.booleans(), st.integers(), st.floats(), st.text(max_size=6), st.none()))
def test_read_lax_fast_path_agrees_with_pydantic(value: object) -> None:
    import pydantic

    for adapter in (LAX_BOOL, LAX_INT, LAX_FLOAT):
        try:
            want = adapter.validate_python(value)
        except pydantic.ValidationError:
            want = None
        got = read_lax(adapter, value)
        assert type(got) is type(want)
        assert got == want or (isinstance(got, float) and math.isnan(got) and math.isnan(want))


def test_request_ids_are_unique_32_hex_digits_per_router_and_across_routers() -> None:
    a, b = RequestIds(), RequestIds()
    ids = [a() for _ in range(1000)] + [b() for _ in range(1000)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids)
    assert len(set(ids)) == len(ids)
    # the client's id still wins; a fresh one only when it gave none
    assert request_id_for({"X-Request-Id": "mine"}, {}, a) == "mine"
    assert request_id_for({}, {"request_id": "body-id"}, a) == "body-id"
    assert re.fullmatch(r"[0-9a-f]{32}", request_id_for({}, {}, a))


def test_the_router_clock_moves_within_one_uvloop_iteration() -> None:
    """uvloop's ``loop.time()`` has 1 ms resolution (libuv's ``uv_now``); the router's TTFT, ITL and E2E
    would read 0 for anything shorter. Two readings 0.3 ms apart, with no await between, must differ."""

    async def two_readings() -> tuple[float, float, float, float]:
        loop = asyncio.get_running_loop()
        c0, l0 = Router.clock(), loop.time()
        deadline = time.perf_counter() + 0.0003
        while time.perf_counter() < deadline:
            pass
        return c0, Router.clock(), l0, loop.time()

    c0, c1, l0, l1 = uvloop.run(two_readings())
    assert c1 - c0 >= 0.0003
    # why Router.clock does not use the loop's time: whole milliseconds (if uvloop changes, this tells)
    assert all(abs(t * 1000 - round(t * 1000)) < 1e-6 for t in (l0, l1))
