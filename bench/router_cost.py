"""The router's own cost at 500 requests/s → the ``router_cost`` entry of ``bench/results/router_peers.json``.

Loopback only; every process is ours and is stopped by its pid. A null engine (bench/router_null.py)
answers at once, so what a front end adds is all that differs between a run through it and a run straight
to the engine. ``gearshift loadgen`` sends a constant ``--rate`` (500 requests/s) for ``--seconds``:

- ``direct``: to the null engine;
- ``gearshift-plain``: through ``gearshift-router`` in plain mode (one ``both`` pod);
- ``gearshift-pd``: through ``gearshift-router`` in PD mode (a prefill and a decode null pod: two upstream
  legs per request, vLLM's disaggregated-prefill protocol);
- ``vllm-toy-proxy``: through vLLM's own PD proxy (toy_proxy_server.py from the vLLM sdist, as
  bench/router_peers.py runs it), the front end a vLLM user runs for PD instead, on the same null pods;
- ``aiohttp-floor``: a bare aiohttp pass-through (:data:`FLOOR_PROXY`, one upstream POST, nothing else):
  what any aiohttp front end costs on these cores, the floor under gearshift-plain.

Added latency = front end P50/P99 − direct P50/P99 (non-streamed E2E). Two layouts:

- ``shared``, at ``--rate``: every process on both cores (the load generator, the engines and the front
  end compete), as the figures the issue started from were measured;
- ``pinned``, at each of ``--pinned-rates`` and ``--rate``: the front end alone on core 1, the load
  generator and the null engines on core 0, as a router pod with its own CPU runs in a cluster.

On 2 cores neither layout isolates the router: shared, its P99 is the scheduler's; pinned, core 0 carries
the load generator and two null engines (PD) at 500 requests/s. The goals (added P99 ≤ 2 ms plain, ≤ 5 ms
PD at 500 requests/s) are judged on the pinned layout, the shared figure beside it.

Per front end also its CPU per request (user + system, /proc; the median over its runs), which depends
little on the layout, and requests/s per core at that cost; and, pinned, the CPU per request of a streamed
answer of 64 token events in one chunk (plus the usage chunk the router asks for): the per-event cost of
the SSE scan and the token metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import cpu_seconds, free_port, write_result
from router import BIN, PY, REPO, Procs, loadgen, wait_http, write_trace
from router_peers import RESULTS, VLLM_VENV_PY, vllm_proxy

GOAL_PLAIN_P99_MS = 2.0
GOAL_PD_P99_MS = 5.0
FRONTS = ("gearshift-plain", "gearshift-pd", "vllm-toy-proxy", "aiohttp-floor")
STREAM_RPS, STREAM_TOKENS = 50.0, 64

#: The floor: an aiohttp server whose handler POSTs the body upstream and returns the answer (uvloop, one
#: pooled session), run with ``python -c``.
FLOOR_PROXY = """
import sys, aiohttp, uvloop
from aiohttp import web
port, up = int(sys.argv[1]), sys.argv[2]
async def start(app):
    app["s"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
async def forward(request):
    body = await request.read()
    async with request.app["s"].post(up + request.path, data=body,
                                     headers={"Content-Type": "application/json"}) as r:
        return web.Response(body=await r.read(), status=r.status, content_type="application/json")
async def health(_r):
    return web.json_response({})
app = web.Application()
app.on_startup.append(start)
app.router.add_post("/v1/completions", forward)
app.router.add_get("/health", health)
web.run_app(app, host="127.0.0.1", port=port, loop=uvloop.new_event_loop(), access_log=None, print=None)
"""


def added(front: dict[str, Any], direct: dict[str, Any]) -> dict[str, float]:
    """Front-end E2E minus direct E2E at P50 and P99, ms."""
    f, d = front["e2e_ms"], direct["e2e_ms"]
    return {"p50": round(f["p50"] - d["p50"], 3), "p99": round(f["p99"] - d["p99"], 3)}


def noisy(layouts: dict[str, dict[str, Any]]) -> list[str]:
    """The runs whose added P99 is negative: the direct run's own tail was larger than a front end's,
    i.e. the machine, not the front end, set that P99 (seen on a busy machine: -268 ms)."""
    return [
        f"{layout} {key} {front}: added P99 {row['added_ms']['p99']} ms"
        for layout, res in layouts.items()
        for key, at in res.items()
        if key.endswith("_rps")
        for front, row in at.items()
        if front != "direct" and row.get("added_ms", {}).get("p99", 0) < 0
    ]


def goals(layouts: dict[str, dict[str, Any]], rate: float) -> dict[str, Any]:
    """The issue's goals at ``rate`` requests/s (added P99 ≤ 2 ms plain, ≤ 5 ms PD), judged on the pinned
    layout, with the shared layout's figure beside it; ``met`` is False when the pinned figure is missing."""
    out: dict[str, Any] = {}
    for front, goal in (("gearshift-plain", GOAL_PLAIN_P99_MS), ("gearshift-pd", GOAL_PD_P99_MS)):
        row: dict[str, Any] = {"rate_rps": rate, "goal_added_p99_ms": goal}
        for layout, res in layouts.items():
            a = res.get(f"{rate:g}_rps", {}).get(front, {}).get("added_ms")
            row[f"{layout}_added_p99_ms"] = None if a is None else a["p99"]
        pinned = row.get("pinned_added_p99_ms")
        row["met"] = pinned is not None and pinned <= goal
        out[front] = row
    return out


def cpu_per_request(layouts: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per front end: the median over every run of its CPU per request, µs, and the requests/s one core
    sustains at that cost (1e6 / µs)."""
    out: dict[str, dict[str, float]] = {}
    for front in FRONTS:
        us = sorted(
            row[front]["cpu_us_per_request"]
            for res in layouts.values()
            for key, row in res.items()
            if key.endswith("_rps") and "cpu_us_per_request" in row.get(front, {})
        )
        if us:
            mid = us[len(us) // 2] if len(us) % 2 else (us[len(us) // 2 - 1] + us[len(us) // 2]) / 2
            out[front] = {"cpu_us_per_request": mid, "requests_per_s_per_core": round(1e6 / mid)}
    return out


def _summary(r: dict[str, Any]) -> dict[str, Any]:
    keys = ("issued", "completed", "failed", "incomplete", "request_rate", "e2e_ms", "errors")
    return {k: r.get(k) for k in keys}


def run(seconds: float, rates: list[float], tmp: Path, pin: bool) -> dict[str, Any]:
    """One layout: start the null pods and the front ends, warm each, measure each at each rate (requests/s);
    stop them all."""
    procs = Procs()
    cpus = sorted(os.sched_getaffinity(0))
    if pin and len(cpus) < 2:
        raise SystemExit("the pinned layout needs two CPUs")
    front_cpu, rest_cpu = (cpus[1], cpus[0]) if pin else (None, None)
    before = os.sched_getaffinity(0)
    if rest_cpu is not None:
        os.sched_setaffinity(0, {rest_cpu})  # the null engines and every loadgen inherit core 0
    pinned = ["taskset", "-c", str(front_cpu)] if front_cpu is not None else []

    def trace(rate: float) -> Path:
        path = tmp / f"const-{rate:g}.csv"
        if not path.exists():
            write_trace(path, [(i / rate, 16, 1) for i in range(int(seconds * rate))])
        return path

    out: dict[str, Any] = {"cpus": {"front_end": front_cpu, "load_and_engines": rest_cpu}}
    try:
        port = {k: free_port() for k in ("null", "pre", "dec", *FRONTS)}
        for k in ("null", "pre", "dec"):
            procs.start([PY, "bench/router_null.py", "--port", str(port[k])], tmp / f"{k}.log")
        for k in ("null", "pre", "dec"):
            wait_http(f"http://127.0.0.1:{port[k]}/health")
        common = ["--scrape-interval", "1", "--log-level", "WARNING", "--max-inflight", "2048"]
        router = str(BIN / "gearshift-router")
        started = {
            "gearshift-plain": procs.start(
                [
                    *pinned,
                    router,
                    "--port",
                    str(port["gearshift-plain"]),
                    "--policy",
                    "least-request",
                    "--backend",
                    f"both=http://127.0.0.1:{port['null']}",
                    *common,
                ],
                tmp / "gearshift-plain.log",
            ),
            "gearshift-pd": procs.start(
                [
                    *pinned,
                    router,
                    "--port",
                    str(port["gearshift-pd"]),
                    "--policy",
                    "pd-score",
                    "--backend",
                    f"prefill=http://127.0.0.1:{port['pre']};gpu=H100-80GB",
                    "--backend",
                    f"decode=http://127.0.0.1:{port['dec']};gpu=H100-80GB",
                    *common,
                ],
                tmp / "gearshift-pd.log",
            ),
            "vllm-toy-proxy": procs.start(
                [
                    *pinned,
                    str(VLLM_VENV_PY) if VLLM_VENV_PY.exists() else PY,
                    str(vllm_proxy()),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port["vllm-toy-proxy"]),
                    "--prefiller-hosts",
                    "127.0.0.1",
                    "--prefiller-ports",
                    str(port["pre"]),
                    "--decoder-hosts",
                    "127.0.0.1",
                    "--decoder-ports",
                    str(port["dec"]),
                ],
                tmp / "vllm-toy-proxy.log",
            ),
            "aiohttp-floor": procs.start(
                [
                    *pinned,
                    PY,
                    "-c",
                    FLOOR_PROXY,
                    str(port["aiohttp-floor"]),
                    f"http://127.0.0.1:{port['null']}",
                ],
                tmp / "aiohttp-floor.log",
            ),
        }
        health = {"vllm-toy-proxy": "/healthcheck"}
        for k in FRONTS:
            wait_http(f"http://127.0.0.1:{port[k]}{health.get(k, '/health')}", 90)
        urls = {"direct": f"http://127.0.0.1:{port['null']}"} | {
            k: f"http://127.0.0.1:{port[k]}" for k in FRONTS
        }
        for url in urls.values():  # warm-up: connections, code paths
            loadgen(url, trace(rates[0]), time_scale=1.0, max_requests=200, seconds=2, stream=False, drain=10)
        for rate in rates:
            n = int(seconds * rate)
            at: dict[str, Any] = {}
            for name, url in urls.items():
                pid = started[name].pid if name in started else None
                c0 = cpu_seconds(pid) if pid else 0.0
                r = loadgen(
                    url,
                    trace(rate),
                    time_scale=1.0,
                    max_requests=n,
                    seconds=seconds + 1,
                    stream=False,
                    drain=10,
                )
                row = _summary(r)
                if pid:
                    row["cpu_us_per_request"] = round((cpu_seconds(pid) - c0) / max(1, r["issued"]) * 1e6)
                at[name] = row
                print(
                    f"{'pinned' if pin else 'shared'} {rate:g}/s {name}: e2e {json.dumps(r['e2e_ms'])}",
                    flush=True,
                )
            for name in FRONTS:
                at[name]["added_ms"] = added(at[name], at["direct"])
            out[f"{rate:g}_rps"] = at
        if pin:
            stream_n = int(seconds * STREAM_RPS)
            write_trace(tmp / "stream.csv", [(i / STREAM_RPS, 16, STREAM_TOKENS) for i in range(stream_n)])
            streamed: dict[str, Any] = {"rate_rps": STREAM_RPS, "tokens_per_stream": STREAM_TOKENS}
            for name in ("gearshift-plain", "gearshift-pd"):
                pid = started[name].pid
                c0 = cpu_seconds(pid)
                r = loadgen(
                    urls[name],
                    tmp / "stream.csv",
                    time_scale=1.0,
                    max_requests=stream_n,
                    seconds=seconds + 1,
                    stream=True,
                    drain=10,
                )
                streamed[name] = {
                    "completed": r["completed"],
                    "failed": r["failed"],
                    "cpu_us_per_request": round((cpu_seconds(pid) - c0) / max(1, r["issued"]) * 1e6),
                }
            out["streamed"] = streamed
    finally:
        procs.stop_all()
        os.sched_setaffinity(0, before)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=10.0, help="seconds per measured run")
    p.add_argument("--rate", type=float, default=500.0, help="requests/s of the goal and the shared layout")
    p.add_argument(
        "--pinned-rates", default="100,250,500", help="requests/s of the pinned layout (comma-separated)"
    )
    p.add_argument("-o", "--output", type=Path, default=RESULTS, help=f"result file (default {RESULTS})")
    a = p.parse_args()
    try:
        pinned_rates = sorted({float(x) for x in a.pinned_rates.split(",")} | {a.rate})
    except ValueError:
        p.error(f"--pinned-rates must be numbers separated by commas, got {a.pinned_rates!r}")
    if not 0 < a.seconds < 600:  # NaN fails too
        p.error(f"--seconds must be in (0, 600), got {a.seconds}")
    if not 0 < a.rate <= 5000:
        p.error(f"--rate must be in (0, 5000] requests/s, got {a.rate}")
    if not all(0 < r <= 5000 for r in pinned_rates):
        p.error(f"every --pinned-rates value must be in (0, 5000] requests/s, got {a.pinned_rates!r}")
    # The result file is checked before minutes of measuring, not after.
    if a.output.is_dir():
        p.error(f"-o {a.output} is a directory; give a file")
    if a.output.exists():
        try:
            json.loads(a.output.read_text())
        except (OSError, ValueError) as exc:
            p.error(f"-o {a.output} exists and is not a JSON document this script can add to ({exc})")
    elif not a.output.parent.is_dir():
        p.error(f"-o {a.output}: no directory {a.output.parent}")
    # SIGTERM, and SIGINT even when started in the background (where it is ignored), unwind through the
    # finally blocks that stop every process started here.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    load_before = os.getloadavg()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gs-router-cost-") as d:
        layouts = {
            "shared": run(a.seconds, [a.rate], Path(d), pin=False),
            "pinned": run(a.seconds, pinned_rates, Path(d), pin=True),
        }
    entry = {
        "what": __doc__.split("\n\n")[0] if __doc__ else "",
        "rate_rps": a.rate,
        "seconds_per_run": a.seconds,
        "requests_per_run": int(a.rate * a.seconds),
        "layouts": layouts,
        "goals": goals(layouts, a.rate),
        "cpu": cpu_per_request(layouts),
        "noisy_runs": noisy(layouts),
        "wall_s": round(time.monotonic() - t0, 1),
        "loadavg_1_5_15": {"before": load_before, "after": os.getloadavg()},
        "machine": {"cpus": os.cpu_count(), "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
    }
    write_result(a.output, "router_cost", entry)
    print(json.dumps(entry["goals"], indent=2))
    print(
        f"wrote router_cost into {a.output.relative_to(REPO) if a.output.is_relative_to(REPO) else a.output}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
