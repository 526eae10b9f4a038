"""bench/router_cost.py's pure parts: added latency, the goals on the pinned layout, CPU per request."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest


@pytest.fixture(scope="module")
def rc(bench_module: Callable[[str], ModuleType]) -> ModuleType:
    return bench_module("router_cost")


def _run(p50: float, p99: float, cpu: float | None = None) -> dict[str, Any]:
    row: dict[str, Any] = {"e2e_ms": {"p50": p50, "p99": p99}}
    if cpu is not None:
        row["cpu_us_per_request"] = cpu
    return row


def _layout(rate: float, plain_p99: float, pd_p99: float, cpus: tuple[float, float]) -> dict[str, Any]:
    direct = _run(1.0, 2.0)
    at: dict[str, Any] = {"direct": direct}
    for name, p99, cpu in (
        ("gearshift-plain", plain_p99, cpus[0]),
        ("gearshift-pd", pd_p99, cpus[1]),
        ("vllm-toy-proxy", 900.0, 9000.0),
        ("aiohttp-floor", 3.0, 800.0),
    ):
        at[name] = _run(2.0, p99, cpu)
    for name in ("gearshift-plain", "gearshift-pd", "vllm-toy-proxy", "aiohttp-floor"):
        at[name]["added_ms"] = {
            "p50": at[name]["e2e_ms"]["p50"] - 1.0,
            "p99": at[name]["e2e_ms"]["p99"] - 2.0,
        }
    return {f"{rate:g}_rps": at}


def test_added_is_front_minus_direct(rc: ModuleType) -> None:
    assert rc.added(_run(3.5, 9.25), _run(1.25, 2.0)) == {"p50": 2.25, "p99": 7.25}


def test_goals_are_judged_on_the_pinned_layout_at_the_goal_rate(rc: ModuleType) -> None:
    layouts = {
        "shared": _layout(500, plain_p99=30.0, pd_p99=40.0, cpus=(1200, 1500)),  # added 28 / 38 ms
        "pinned": _layout(500, plain_p99=3.5, pd_p99=8.0, cpus=(1100, 1400))  # added 1.5 / 6 ms
        | _layout(100, plain_p99=2.5, pd_p99=3.0, cpus=(1000, 1300)),
    }
    g = rc.goals(layouts, 500.0)
    assert g["gearshift-plain"] == {
        "rate_rps": 500.0,
        "goal_added_p99_ms": 2.0,
        "shared_added_p99_ms": 28.0,
        "pinned_added_p99_ms": 1.5,
        "met": True,
    }
    assert g["gearshift-pd"]["pinned_added_p99_ms"] == 6.0 and g["gearshift-pd"]["met"] is False
    # a rate that was not run is not met
    assert rc.goals(layouts, 250.0)["gearshift-plain"]["met"] is False


def test_cpu_per_request_is_the_median_over_every_run(rc: ModuleType) -> None:
    layouts = {
        "shared": _layout(500, 3.0, 3.0, cpus=(1200, 1500)),
        "pinned": _layout(500, 3.0, 3.0, cpus=(1100, 1400)) | _layout(100, 3.0, 3.0, cpus=(1000, 1600)),
    }
    cpu = rc.cpu_per_request(layouts)
    assert cpu["gearshift-plain"] == {"cpu_us_per_request": 1100, "requests_per_s_per_core": 909}
    assert cpu["gearshift-pd"]["cpu_us_per_request"] == 1500
    assert cpu["vllm-toy-proxy"] == {"cpu_us_per_request": 9000.0, "requests_per_s_per_core": 111}


def test_a_negative_added_p99_is_flagged_as_noise(rc: ModuleType) -> None:
    layouts = {"pinned": _layout(500, plain_p99=1.5, pd_p99=8.0, cpus=(1100, 1400))}  # plain: 1.5 - 2.0 < 0
    assert rc.noisy(layouts) == ["pinned 500_rps gearshift-plain: added P99 -0.5 ms"]
    assert rc.noisy({"pinned": _layout(500, 3.0, 8.0, cpus=(1100, 1400))}) == []
