"""Mirrored warm-up traffic (gearshift.router.mirror): the token bucket, the pick, the warming pods read off
pod JSON, the copies' bodies, and copies sent through a router to fake engines: bounded by the cap, never
seen by the client, never delaying it, failures only counted."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from test_router_proxy import COMPLETION, Factory, FakeEngine, closed_port, make_router, pd_engines

from gearshift.k8s import names
from gearshift.router.mirror import (
    BUSY,
    DROPPED,
    FAILED,
    OK,
    Mirror,
    MirrorTarget,
    TokenBucket,
    _Slot,
    mirror_body,
    pick,
    warming_targets,
)
from gearshift.router.server import Router

__all__ = ["make_router"]  # the fixture, shared with test_router_proxy


# --- the bucket ------------------------------------------------------------------------------------
def test_bucket_starts_full_with_one_second_of_burst_and_refills_at_its_rate() -> None:
    b = TokenBucket(3.0, now=0.0)
    assert [b.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert not b.take(0.2)  # 0.6 of a token
    assert b.take(0.34)  # 1.02
    assert not b.take(0.34)


def test_bucket_below_one_per_second_still_bursts_one() -> None:
    b = TokenBucket(0.5, now=0.0)
    assert b.take(0.0) and not b.take(1.0) and b.take(2.0)


@pytest.mark.parametrize("rate", [0.3, 2.0, 7.5, 40.0])
def test_bucket_never_exceeds_rate_times_time_plus_burst(rate: float) -> None:
    b = TokenBucket(rate, now=0.0)
    taken = sum(b.take(k * 0.003) for k in range(10_000))  # 30 s of offers every 3 ms
    assert taken <= rate * 30.0 + b.burst
    assert taken >= rate * 30.0 - 1


def test_bucket_ignores_a_clock_going_back() -> None:
    b = TokenBucket(1.0, now=10.0)
    assert b.take(10.0) and not b.take(5.0) and not b.take(10.5) and b.take(11.0)


# --- the pick --------------------------------------------------------------------------------------
def _slot(name: str, rate: float = 100.0) -> _Slot:
    return _Slot(
        MirrorTarget(name, "prefill", "g", f"http://127.0.0.1:1/{name}", rate), TokenBucket(rate, 0.0), {}
    )


def test_pick_is_round_robin_and_skips_routed_pods_and_empty_buckets() -> None:
    slots = [_slot("a"), _slot("b", rate=0.5), _slot("c")]
    never = lambda _n: False  # noqa: E731
    assert pick(slots, 0, 0.0, never) == 0
    assert pick(slots, 1, 0.0, never) == 1
    assert pick(slots, 1, 0.0, never) == 2  # b's one token is spent
    assert pick(slots, 3, 0.0, never) == 0  # the start wraps
    assert pick(slots, 0, 0.0, lambda n: n in ("a", "c")) is None  # b has no token, a and c are routed


def test_pick_gives_none_when_every_bucket_is_empty() -> None:
    slots = [_slot("a", rate=1.0)]
    assert pick(slots, 0, 0.0, lambda _n: False) == 0
    assert pick(slots, 0, 0.0, lambda _n: False) is None


# --- warming pods from pod JSON --------------------------------------------------------------------
def _pod(
    name: str,
    *,
    service: str = "svc",
    role: str = "prefill",
    stage: str = "0",
    warming: str | None = "true",
    cap: str | None = "2.5",
    ready: bool = True,
    ip: str = "127.0.0.5",
    port: int | None = 8000,
) -> dict[str, Any]:
    labels = names.engine_labels(service, role, "two", int(stage))
    if warming is not None:
        labels[names.LABEL_WARMING] = warming
    ann = {names.ANNOTATION_MIRROR_RPS: cap} if cap is not None else {}
    ports = [{"name": "http", "containerPort": port}] if port is not None else []
    return {
        "metadata": {"name": name, "labels": labels, "annotations": ann},
        "spec": {"containers": [{"name": "engine", "ports": ports}]},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def test_warming_targets_are_the_ready_marked_heads_of_this_service_with_a_cap() -> None:
    pods = [
        _pod("svc-prefill-two-s0-1", ip="127.0.0.6", port=9000),
        _pod("svc-prefill-two-s0-0"),
        _pod("svc-decode-two-s0-0", role="decode", cap="0.75"),
        _pod("svc-prefill-two-s1-0", stage="1"),  # not a head
        _pod("other-prefill-two-s0-0", service="other"),  # another PDService
        _pod("svc-prefill-one-s0-0", warming=None),  # serving, unmarked
        _pod("svc-prefill-two-s0-2", warming="false"),
        _pod("svc-prefill-two-s0-3", ready=False),
        _pod("svc-prefill-two-s0-4", cap="0"),  # no predicted capacity: no mirror
        _pod("svc-prefill-two-s0-5", cap=None),
        _pod("svc-prefill-two-s0-6", cap="lots"),
        _pod("svc-prefill-two-s0-7", cap="inf"),
        _pod("svc-prefill-two-s0-8", port=None, ip="::1"),  # no named port: the engine's default
    ]
    got = warming_targets(pods, "svc")
    assert got == [
        MirrorTarget("svc-decode-two-s0-0", "decode", "two", "http://127.0.0.5:8000", 0.75),
        MirrorTarget("svc-prefill-two-s0-0", "prefill", "two", "http://127.0.0.5:8000", 2.5),
        MirrorTarget("svc-prefill-two-s0-1", "prefill", "two", "http://127.0.0.6:9000", 2.5),
        MirrorTarget("svc-prefill-two-s0-8", "prefill", "two", "http://[::1]:8000", 2.5),
    ]


def test_an_aggregated_shadow_is_a_target_and_gets_the_whole_request() -> None:
    (got,) = warming_targets([_pod("svc-both-two-s0-0", role="both", cap="2")], "svc")
    assert got == MirrorTarget("svc-both-two-s0-0", "both", "two", "http://127.0.0.5:8000", 2.0)
    body = {**COMPLETION, "stream": True}
    assert mirror_body("both", body, chat=False) == body  # all of it: prefill and every output token


def test_a_pod_being_deleted_is_no_target() -> None:
    pod = _pod("svc-prefill-two-s0-0")
    pod["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert warming_targets([pod], "svc") == []


# --- the copies' bodies ----------------------------------------------------------------------------
def test_prefill_copy_is_the_prefill_leg_without_kv_transfer() -> None:
    body = {**COMPLETION, "kv_transfer_params": {"x": 1}}
    before = dict(body)
    got = mirror_body("prefill", body, chat=False)
    assert got == {
        "model": "m",
        "prompt": "hello world",
        "max_tokens": 1,
        "temperature": 0.5,
        "stream": False,
    }
    assert body == before


def test_decode_copy_is_the_clients_request_without_kv_transfer() -> None:
    body = {**COMPLETION, "kv_transfer_params": {"x": 1}}
    got = mirror_body("decode", body, chat=False)
    assert got == COMPLETION and "kv_transfer_params" in body


# --- through a router ------------------------------------------------------------------------------
def _count(router: Router, role: str, pod: str, outcome: str) -> float:
    v = router.metrics.registry.get_sample_value(
        "gearshift_router_mirror_requests_total", {"role": role, "pod": pod, "outcome": outcome}
    )
    return v or 0.0


async def _warm(router: Router, *targets: MirrorTarget, **kw: Any) -> Mirror:
    assert router.session is not None and router.proxy is not None
    m = Mirror(router.session, router.mirror_metrics, router.clock, lambda p: p in router.pool.backends, **kw)
    m.set_targets(targets)
    router.mirror = router.proxy.mirror = m
    return m


async def _settle(m: Mirror) -> None:
    """Wait for the copies still out."""
    async with asyncio.timeout(5.0):
        await asyncio.gather(*list(m._tasks))
    assert m.in_flight == 0


async def _url(eng: FakeEngine) -> str:
    from aiohttp.test_utils import TestServer

    srv = TestServer(eng.app(), host="127.0.0.1")
    await srv.start_server()
    _SERVERS.append(srv)
    return str(srv.make_url("")).rstrip("/")


_SERVERS: list[Any] = []


@pytest.fixture(autouse=True)
async def _close_servers() -> Any:
    yield
    while _SERVERS:
        await _SERVERS.pop().close()


async def test_no_warming_pod_no_copy(make_router: Factory) -> None:
    client, router, eng = await make_router(pd_engines())
    m = await _warm(router)
    assert not m.active
    resp = await client.post("/v1/completions", json={**COMPLETION, "stream": False})
    assert resp.status == 200
    assert len(eng["p0"].requests) == len(eng["d0"].requests) == 1


async def test_prefill_shadow_gets_copies_within_its_cap_and_clients_see_none(make_router: Factory) -> None:
    client, router, eng = await make_router(pd_engines())
    shadow = FakeEngine("p1")
    m = await _warm(router, MirrorTarget("p1", "prefill", "two", await _url(shadow), 2.0))
    n = 12
    t0 = time.monotonic()
    for i in range(n):
        resp = await client.post(
            "/v1/completions", json={**COMPLETION, "stream": False}, headers={"X-Request-Id": f"r{i}"}
        )
        assert resp.status == 200
        assert (await resp.json())["by"] == "d0"  # every answer from the serving gear
    elapsed = time.monotonic() - t0
    await _settle(m)
    sent = len(shadow.requests)
    assert 1 <= sent <= 2.0 * elapsed + 2.0  # the bucket: 2/s, a burst of 2
    assert _count(router, "prefill", "p1", OK) == sent
    assert _count(router, "prefill", "p1", DROPPED) == n - sent
    assert len(eng["p0"].requests) == len(eng["d0"].requests) == n  # the live legs are untouched
    for body, headers in zip(shadow.requests, shadow.headers, strict=True):
        assert "kv_transfer_params" not in body and body["max_tokens"] == 1 and body["stream"] is False
        assert headers["X-Request-Id"].endswith("-mirror")
    assert "p1" not in router.pool.backends  # the shadow never joins the routing set


async def test_decode_shadow_gets_streamed_copies_drained_and_dropped(make_router: Factory) -> None:
    client, router, _eng = await make_router(pd_engines())
    shadow = FakeEngine("d1", tokens=5)
    m = await _warm(router, MirrorTarget("d1", "decode", "two", await _url(shadow), 50.0))
    resp = await client.post("/v1/completions", json=COMPLETION)
    text = await resp.text()
    assert resp.status == 200 and '"by": "d0"' in text and "d1" not in text
    await _settle(m)
    (copy,) = shadow.requests
    assert copy == COMPLETION  # streamed as the client asked, no kv_transfer_params
    assert _count(router, "decode", "d1", OK) == 1


async def test_a_slow_shadow_never_delays_the_client(make_router: Factory) -> None:
    client, router, _eng = await make_router(pd_engines())
    shadow = FakeEngine("p1", delay_s=1.5)
    m = await _warm(router, MirrorTarget("p1", "prefill", "two", await _url(shadow), 50.0))
    t0 = time.monotonic()
    resp = await client.post("/v1/completions", json={**COMPLETION, "stream": False})
    assert resp.status == 200 and (await resp.json())["by"] == "d0"
    assert time.monotonic() - t0 < 1.0
    assert m.in_flight == 1  # the copy still out
    await _settle(m)
    assert _count(router, "prefill", "p1", OK) == 1


async def test_an_unreachable_shadow_is_counted_failed_never_retried(make_router: Factory) -> None:
    client, router, eng = await make_router(pd_engines())
    m = await _warm(router, MirrorTarget("p9", "prefill", "two", f"http://127.0.0.1:{closed_port()}", 50.0))
    for _ in range(3):
        resp = await client.post("/v1/completions", json={**COMPLETION, "stream": False})
        assert resp.status == 200
    await _settle(m)
    assert _count(router, "prefill", "p9", FAILED) == 3
    assert len(eng["p0"].requests) == 3  # no retry landed on a live pod


async def test_a_shadow_answering_5xx_is_counted_failed(make_router: Factory) -> None:
    client, router, _eng = await make_router(pd_engines())
    shadow = FakeEngine("p1")
    url = await _url(shadow)
    m = await _warm(router, MirrorTarget("p1", "prefill", "two", url + "/nowhere", 50.0))  # a 404
    resp = await client.post("/v1/completions", json={**COMPLETION, "stream": False})
    assert resp.status == 200
    await _settle(m)
    assert _count(router, "prefill", "p1", FAILED) == 1 and _count(router, "prefill", "p1", OK) == 0


async def test_a_pod_the_router_routes_to_gets_no_copy(make_router: Factory) -> None:
    # The switch: the role Service selects the shadow before the operator unmarks it.
    client, router, eng = await make_router(pd_engines())
    m = await _warm(router, MirrorTarget("p0", "prefill", "two", "http://127.0.0.1:1", 50.0))
    resp = await client.post("/v1/completions", json={**COMPLETION, "stream": False})
    assert resp.status == 200
    await _settle(m)
    assert len(eng["p0"].requests) == 1  # only the live leg
    assert sum(_count(router, "prefill", "p0", o) for o in (OK, FAILED, DROPPED, BUSY)) == 0


async def test_copies_in_flight_are_bounded(make_router: Factory) -> None:
    client, router, _eng = await make_router(pd_engines())
    shadow = FakeEngine("p1", delay_s=0.5)
    m = await _warm(router, MirrorTarget("p1", "prefill", "two", await _url(shadow), 100.0), max_in_flight=2)
    for _ in range(5):
        assert (await client.post("/v1/completions", json={**COMPLETION, "stream": False})).status == 200
    await _settle(m)
    assert _count(router, "prefill", "p1", OK) == 2 and _count(router, "prefill", "p1", BUSY) == 3


async def test_targets_keep_their_buckets_and_go_away(make_router: Factory) -> None:
    _client, router, _eng = await make_router(pd_engines())
    t = MirrorTarget("p1", "prefill", "two", "http://127.0.0.1:1", 1.0)
    m = await _warm(router, t)
    (slot,) = m._by_role["prefill"]
    slot.bucket.tokens = 0.0
    m.set_targets([t])
    assert m._by_role["prefill"][0].bucket.tokens < 1.0  # same pod, same cap: the same bucket
    m.set_targets([])
    assert not m.active and m.targets == []
    val = router.metrics.registry.get_sample_value("gearshift_router_mirror_targets", {"role": "prefill"})
    assert val == 0
