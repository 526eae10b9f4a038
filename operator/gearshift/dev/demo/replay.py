"""The demo's replay: the trace window sent through the router by the load generator on a thread, while
the main thread scrapes the router, polls the gears and the cards held, and prints the live line."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from gearshift.dev.demo import cost, live, series
from gearshift.dev.demo import trace as tracewin
from gearshift.dev.demo.context import LIVE_WINDOW_S, TICK_S, Ctx
from gearshift.dev.demo.kube import DemoError, http_get
from gearshift.k8s import names

#: Seconds to wait for requests still in flight when issuing stops.
DRAIN_S = 60.0


@dataclass
class Replay:
    """What the replay measured, kept for the report."""

    t0: float
    """Unix time the replay started."""
    perf0: float
    run_s: float
    result: Any
    scrapes: list[series.RouterScrape]
    first_gears: dict[str, str]
    cards: list[cost.CardSample] = field(default_factory=list)
    """The physical cards the service's engine pods held, polled through the run."""


def _card_sample(ctx: Ctx, nodes: dict[str, cost.NodeCards], t: float) -> cost.CardSample:
    """The cards the service's engine pods hold now (every gear's: active, shadow and draining)."""
    sel = f"{names.LABEL_SERVICE}={ctx.service},{names.LABEL_COMPONENT}={names.COMPONENT_ENGINE}"
    pods = ctx.kube.json("get", "pods", "-n", ctx.args.namespace, "-l", sel)["items"]
    return cost.CardSample(t, cost.cards_held(pods, nodes))


def _gear_states(ctx: Ctx, refs: dict[str, str]) -> dict[str, live.GearState]:
    out = {}
    items = {
        g["metadata"]["name"]: g for g in ctx.kube.json("get", "gearsets", "-n", ctx.args.namespace)["items"]
    }
    for role, name in refs.items():
        st = (items.get(name) or {}).get("status") or {}
        out[role] = live.GearState(st.get("activeGear"), st.get("phase"), st.get("targetGear"))
    return out


def replay(ctx: Ctx, url: str, gearsets: dict[str, dict[str, Any]]) -> tuple[Replay, tracewin.Window]:
    from gearshift.dev.loadgen import run_load

    assert ctx.inputs is not None  # main sets it from _preflight
    win = ctx.inputs.window
    scale = win.time_scale
    due = win.due_s
    ctx.say(
        f"replay: {len(win.requests)} requests of {ctx.args.trace.name} (trace {win.start_s:.0f}–"
        f"{win.start_s + win.span_s:.0f} s) at {scale:g}× → {win.run_s:.0f} s, "
        f"mean {win.mean_rate():.1f} req/s, to {url}"
    )
    refs = {role: gs["metadata"]["name"] for role, gs in gearsets.items()}
    first = {role: str(gs["status"]["activeGear"]) for role, gs in gearsets.items()}
    box: dict[str, Any] = {}
    nodes = cost.node_cards(ctx.kube.json("get", "nodes")["items"])
    cards: list[cost.CardSample] = []
    perf0 = time.perf_counter()
    t0 = time.time()

    def load() -> None:
        try:
            box["result"] = asyncio.run(
                run_load(
                    [url],
                    list(win.requests),
                    time_scale=scale,
                    max_requests=len(win.requests),
                    max_duration_s=win.run_s + 1.0,
                    drain_s=DRAIN_S,
                    stream=True,
                    slo_ttft_ms=ctx.slo.get("ttftMs"),
                    slo_itl_ms=ctx.slo.get("itlMs"),
                )
            )
        except Exception as exc:  # reported by the main thread
            box["error"] = exc

    thread = threading.Thread(target=load, name="loadgen", daemon=True)
    thread.start()
    scrapes: list[series.RouterScrape] = []
    tty = sys.stdout.isatty()
    last_print = 0.0
    gears = {r: live.GearState(g) for r, g in first.items()}
    tick = 0
    while thread.is_alive():
        now = time.perf_counter() - perf0
        # A missed scrape leaves a gap; the next one covers the window.
        with contextlib.suppress(OSError, ValueError, DemoError):
            scrapes.append(series.parse_router_metrics(http_get(url + "/metrics").decode(), now))
        if tick % 2 == 0:
            with contextlib.suppress(DemoError, ValueError):
                gears = _gear_states(ctx, refs)
            # A missed poll leaves the previous sample standing until the next one.
            with contextlib.suppress(DemoError, ValueError, subprocess.TimeoutExpired):
                cards.append(_card_sample(ctx, nodes, time.perf_counter() - perf0))
        tick += 1
        recent = [s for s in scrapes if s.t >= now - LIVE_WINDOW_S]
        w = series.router_window(recent[0], recent[-1]) if len(recent) >= 2 else {}
        line = live.status_line(
            now,
            win.run_s,
            tracewin.issued_by(due, now),
            len(due),
            gears,
            w.get("qps"),
            w.get("ttft_p99_ms"),
            w.get("itl_p99_ms"),
        )
        if tty:
            print("\r" + line, end="", flush=True)
        elif now - last_print >= 15.0:
            print(line, flush=True)
            last_print = now
        thread.join(TICK_S)
    with contextlib.suppress(OSError, ValueError, DemoError):
        scrapes.append(
            series.parse_router_metrics(http_get(url + "/metrics").decode(), time.perf_counter() - perf0)
        )
    if tty:
        print()
    if "error" in box:
        raise DemoError(f"the load generator failed: {box['error']}")
    res = box["result"]
    from gearshift.dev.loadgen import format_table

    ctx.say("replay: done; the load generator measured on the wire:")
    ctx.say.block(format_table(res))
    return Replay(t0, perf0, res.duration_s, res, scrapes, first, cards), win
