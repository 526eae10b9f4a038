"""Benchmark of the PDService reconciler on the sandbox: apply latency, scale, memory, idle CPU.

Runs ``gearshift operator`` as a subprocess against the sandbox (``gearshift sandbox up``) watching one
fresh namespace, then:

1. latency: applies ``--latency-n`` PDServices one after another (each with its two GearSets) and times
   apply -> every expected StatefulSet exists (target P50 <= 2 s);
2. scale: applies ``--scale-n`` PDServices at once and times until every one has status with
   ``observedGeneration`` and all its StatefulSets (target: 100 within 120 s);
3. operator resident memory after the scale run (target <= 300 MB), from /proc/<pid>/status VmRSS;
4. idle CPU: operator CPU seconds over ``--idle-s`` s with nothing changing (target ~0), from
   /proc/<pid>/stat utime + stime.

Engine ``vllm`` with GearSet ``replicas: 0`` so that the measurement is the operator's work (objects
written, status computed), not hundreds of pods started on a 2-core machine; the sandbox's fleet is used
as it is (a shared sandbox: extra fake nodes would be removed by other sessions' fixtures and probed by
the probe operator). Results go to ``bench/results/reconcile.json``. Every loop is bounded in time.

Usage: ``.venv/bin/python bench/reconcile.py [--latency-n 10] [--scale-n 100]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "operator"))

from benchlib import cpu_seconds, free_port  # noqa: E402
from gearshift.adapters.kube import RestKubeApi  # noqa: E402
from gearshift.api.common import API_VERSION  # noqa: E402
from gearshift.k8s import names  # noqa: E402
from gearshift.testing import manifests as build  # noqa: E402

G = API_VERSION


def objects(
    name: str,
    replicas: int = 0,
    engine: str = "vllm",
    decode_last: str = "A10-24GB",
    policy: dict[str, Any] | None = None,
    second_gear: bool = False,
) -> list[dict[str, Any]]:
    """A PDService and its two explicit GearSets (2 and 3 stages placed by GPU-model labels).

    ``replicas``, ``engine``, the GPU model of decode's last stage, the GearSets' ``spec.policy`` and
    ``second_gear`` (a prefill gear ``g2`` on L40S + A100-80GB, for ``spec.forceGear``) are the fleet
    benchmark's knobs (bench/fleet_operator.py)."""
    model = {"name": "meta-llama/Meta-Llama-3-8B", "numLayers": 32, "hiddenSize": 4096, "numHeads": 32,
             "numKvHeads": 8, "headDim": 128, "intermediateSize": 14336, "vocabSize": 128256}  # fmt: skip

    def gear(gname: str, stages: list[tuple[int, int, str]]) -> dict[str, Any]:
        return {"name": gname, "qpsRange": [0, 10], "stages": [
            {"layers": [a, b], "nodeSelector": {names.NODE_GPU_MODEL: m}} for a, b, m in stages]}  # fmt: skip

    def gs(role: str, gears: list[dict[str, Any]]) -> dict[str, Any]:
        spec = {"serviceName": name, "role": role, "mode": "explicit", "replicas": replicas, "gears": gears}
        if policy:
            spec["policy"] = policy
        return build.gearset(f"{name}-{role}", None, spec)

    prefill = [gear("g1", [(0, 24, "H100-80GB"), (24, 32, "A100-40GB")])]
    if second_gear:
        prefill.append(gear("g2", [(0, 16, "L40S-48GB"), (16, 32, "A100-80GB")]))
    return [
        gs("prefill", prefill),
        gs("decode", [gear("g1", [(0, 12, "A100-40GB"), (12, 22, "A10-24GB"), (22, 32, decode_last)])]),
        build.pdservice(name, None, {"model": model, "engine": engine,
                                     "prefill": {"gearSetRef": {"name": f"{name}-prefill"}},
                                     "decode": {"gearSetRef": {"name": f"{name}-decode"}}}),
    ]  # fmt: skip


STS_PER_SERVICE = 5


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def kubectl(kubeconfig: Path, *args: str, input: str | None = None) -> None:
    subprocess.run(["kubectl", "--kubeconfig", str(kubeconfig), *args], input=input, text=True,
                   check=True, capture_output=True, timeout=120)  # fmt: skip


def apply(kubeconfig: Path, ns: str, objs: list[dict[str, Any]]) -> None:
    kubectl(kubeconfig, "-n", ns, "apply", "-f", "-", input="\n---\n".join(json.dumps(o) for o in objs))


def sandbox_kubeconfig() -> Path:
    """``$KUBECONFIG``, else this checkout's sandbox's; the pinned kubectl first on ``PATH``."""
    kubeconfig = Path(os.environ.get("KUBECONFIG") or "")
    if not kubeconfig.is_file():
        kubeconfig = next((REPO / ".sandbox" / "kwok" / "clusters").glob("*/kubeconfig.yaml"))
    bins = sorted(Path.home().glob(".cache/gearshift/bin/kubernetes-*"))
    os.environ["PATH"] = os.pathsep.join([str(b) for b in bins] + [os.environ.get("PATH", "")])
    os.environ["KUBECONFIG"] = str(kubeconfig)
    return kubeconfig


def rest_api(kubeconfig: Path) -> RestKubeApi:
    from kubernetes import client, config

    config.load_kube_config(str(kubeconfig))
    return RestKubeApi(client.ApiClient())


def start_operator(
    kubeconfig: Path,
    ns: str,
    metrics_port: int,
    log: Any,
    extra: list[str],
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """``gearshift operator`` watching ``ns`` (its log to ``log``), metrics on ``metrics_port``."""
    return subprocess.Popen(
        # handlers.main directly: the CLI imports every sub-command module, any of which may be mid-edit.
        [sys.executable, "-c", "import argparse, sys; from gearshift.handlers import main as m; "
         "p = argparse.ArgumentParser(); m.add_arguments(p); sys.exit(m.run(p.parse_args(sys.argv[1:])))",
         "--kubeconfig", str(kubeconfig), "--namespace", ns, *extra,
         "--probe-port", "0", "--metrics-port", str(metrics_port), "--log-level", "WARNING"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
    )  # fmt: skip


def stop_operator(op: subprocess.Popen[bytes]) -> None:
    op.send_signal(signal.SIGINT)
    try:
        op.wait(timeout=30)
    except subprocess.TimeoutExpired:
        op.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--latency-n", type=int, default=10)
    ap.add_argument("--scale-n", type=int, default=100)
    ap.add_argument("--scale-timeout", type=float, default=300.0)
    ap.add_argument("--idle-s", type=float, default=30.0)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "reconcile.json")
    args = ap.parse_args()

    kubeconfig = sandbox_kubeconfig()
    api = rest_api(kubeconfig)
    ns = f"bench-reconcile-{uuid.uuid4().hex[:6]}"
    kubectl(kubeconfig, "create", "namespace", ns)
    mport = free_port()
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"{ns}-operator.log"
    log = log_path.open("w")  # the operator's log, for a failed run; not a result
    op = start_operator(
        kubeconfig,
        ns,
        mport,
        log,
        ["--disable", "gearshift.handlers.nodes", "--disable", "gearshift.handlers.gpuprofile"],
    )
    time.sleep(0.5)
    load = os.getloadavg()
    result: dict[str, Any] = {
        "benchmark": "reconcile",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "shared": True,
                    "loadavg_1m_at_start": round(load[0], 2)},
        "setup": {"engine": "vllm", "gearset_replicas": 0, "statefulsets_per_service": STS_PER_SERVICE,
                  "nodes": len(api.list("v1", "Node"))},
    }  # fmt: skip
    try:
        time.sleep(3)

        def sts_count(prefix: str | None = None) -> int:
            items = api.list("apps/v1", "StatefulSet", ns)
            return sum(1 for o in items if prefix is None or o["metadata"]["name"].startswith(prefix + "-"))

        lat = []
        for i in range(args.latency_n):
            name = f"lat{i}"
            t0 = time.perf_counter()
            apply(kubeconfig, ns, objects(name))
            deadline = t0 + 30
            while sts_count(name) < STS_PER_SERVICE and time.perf_counter() < deadline:
                time.sleep(0.05)
            lat.append(time.perf_counter() - t0 if sts_count(name) >= STS_PER_SERVICE else float("inf"))
        result["latency"] = {
            "n": len(lat),
            "apply_to_all_statefulsets_s": [round(x, 3) for x in lat],
            "p50_s": round(statistics.median(lat), 3),
            "max_s": round(max(lat), 3),
            "target_p50_s": 2.0,
        }

        cpu0 = cpu_seconds(op.pid)
        t0 = time.perf_counter()
        objs = [o for i in range(args.scale_n) for o in objects(f"s{i}")]
        for k in range(0, len(objs), 60):
            apply(kubeconfig, ns, objs[k : k + 60])
        applied_s = time.perf_counter() - t0

        def done() -> int:
            bodies = api.list(G, "PDService", ns)
            ok = {
                b["metadata"]["name"]
                for b in bodies
                if (b.get("status") or {}).get("observedGeneration") == b["metadata"].get("generation")
            }
            counts: dict[str, int] = {}
            for o in api.list("apps/v1", "StatefulSet", ns):
                svc = o["metadata"]["labels"].get(names.LABEL_SERVICE, "")
                counts[svc] = counts.get(svc, 0) + 1
            return sum(
                1 for i in range(args.scale_n) if f"s{i}" in ok and counts.get(f"s{i}", 0) >= STS_PER_SERVICE
            )

        n_done = 0
        while time.perf_counter() - t0 < args.scale_timeout:
            n_done = done()
            if n_done >= args.scale_n:
                break
            time.sleep(1.0)
        total = time.perf_counter() - t0
        result["scale"] = {
            "services": args.scale_n,
            "reconciled": n_done,
            "apply_s": round(applied_s, 2),
            "all_reconciled_s": round(total, 2) if n_done >= args.scale_n else None,
            "timeout_s": args.scale_timeout,
            "operator_cpu_s": round(cpu_seconds(op.pid) - cpu0, 2),
            "target_s": 120.0,
        }
        time.sleep(5)
        result["memory"] = {"operator_rss_mb": round(rss_mb(op.pid), 1), "target_mb": 300,
                            "services": args.scale_n + args.latency_n}  # fmt: skip
        c0 = cpu_seconds(op.pid)
        time.sleep(args.idle_s)
        idle = cpu_seconds(op.pid) - c0
        result["idle"] = {"window_s": args.idle_s, "operator_cpu_s": round(idle, 3),
                          "cpu_share": round(idle / args.idle_s, 4)}  # fmt: skip
    finally:
        # The namespace goes while the operator still runs: its finalizers on the PDServices and GearSets
        # need it, and a namespace deleted after it stopped stays Terminating in the shared sandbox.
        kc = ["kubectl", "--kubeconfig", str(kubeconfig)]
        subprocess.run([*kc, "delete", "namespace", ns, "--timeout=240s"], capture_output=True, timeout=300)
        stop_operator(op)
        log.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"operator log: {log_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
