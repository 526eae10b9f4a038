"""Probe benchmarks: the device probe on this host, the loopback link probe, and pair-selection size.

Run: ``.venv/bin/python bench/probe.py`` (about a minute on two cores); writes
``bench/results/probe-cpu.json`` (device probes) and ``bench/results/probe-link.json`` (link, pairs).
With PyTorch importable (``pip install 'gearshift[probe]'``, or ``PYTHONPATH`` pointing at a venv that
has it) the device part also runs the torch backend; on a CUDA machine it runs the real GPU probe with
its default (Llama-3-8B) sizes and writes ``bench/results/probe-cuda-<model>.json``.

- device: the whole ``gearshift-probe device`` run with its CPU defaults, three times: wall time against
  the time budget, and how much the headline figures move between runs (max/min of each); once with one
  CPU thread (the default) and once with the BLAS library's default thread count.
- simulated: the sandbox probe of every node of ``examples/fleets/mixed.yaml``; the fleet order by
  compute score must equal the datasheet order.
- link: loopback TCP (127.0.0.1) at 1 and 16 MiB frames within a 256 MiB / 3 s budget: bandwidth,
  latency, and the run time against the budget.
- pairs: pairs measured vs all N(N-1)/2 for fleets of 10 to 400 nodes in 4 classes x 2 zones.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path
from typing import Any

from gearshift.api.probedoc import profile_status_from_probe, validate_probe_output
from gearshift.dev.sandbox.nodes import gpu_node_manifest
from gearshift.facts.fleet import load_fleet
from gearshift.facts.gpus import compute_score
from gearshift.probe import link, run
from gearshift.probe.backends import NumpyBackend, TorchBackend, select_backends, torch_available
from gearshift.probe.simulated import simulated_probe

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def host() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "loadavg1": os.getloadavg()[0],
        "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }


def device_runs(backend_factory: Any, cfg: run.ProbeConfig, runs: int = 3) -> dict[str, Any]:
    docs = []
    walls = []
    for _ in range(runs):
        t0 = time.monotonic()
        doc = run.run_device_probe(backend_factory(), cfg)
        walls.append(time.monotonic() - t0)
        validate_probe_output(doc)
        docs.append(doc)
    keys = ("matmulTflops", "hbmGBps", "h2dGBps", "attentionMs", "ffnMs", "maxMicroBatch")
    spread = {
        k: round(max(d["summary"][k] for d in docs) / min(d["summary"][k] for d in docs), 3) for k in keys
    }
    return {
        "backend": docs[0]["backend"],
        "kind": docs[0]["kind"],
        "device": docs[0]["gpuProduct"],
        "shape": docs[0]["shape"],
        "timeBudgetS": cfg.time_budget_s,
        "wallS": [round(w, 2) for w in walls],
        "summaries": [d["summary"] for d in docs],
        "maxOverMin": spread,
        "status": profile_status_from_probe(docs[-1]),
        "lastDocument": docs[-1],
    }


def simulated_fleet() -> dict[str, Any]:
    fleet = load_fleet(ROOT / "examples" / "fleets/mixed.yaml")
    rows = []
    for i, node in enumerate(fleet.nodes):
        ann = gpu_node_manifest(node, i, 9)["metadata"]["annotations"]
        doc = simulated_probe(ann, arch=run.LLAMA3_8B, seq_len=512, batches=(1, 4, 16), node=node.name)
        st = profile_status_from_probe(doc)
        rows.append(
            {
                "node": node.name,
                "gpuModel": st["gpuModel"],
                "computeScore": st["computeScore"],
                "datasheetScore": round(compute_score(node.gpu.model), 6),
                "attentionMs": round(st["attentionMs"], 4),
                "ffnMs": round(st["ffnMs"], 4),
                "maxMicroBatch": st["maxMicroBatch"],
            }
        )
    by_probe = [r["node"] for r in sorted(rows, key=lambda r: (-r["computeScore"], r["node"]))]
    by_sheet = [r["node"] for r in sorted(rows, key=lambda r: (-r["datasheetScore"], r["node"]))]
    return {"nodes": rows, "orderMatchesDatasheets": by_probe == by_sheet}


def link_loopback() -> list[dict[str, Any]]:
    out = []
    for frame_mib in (1, 16):
        server = link.LinkServer("127.0.0.1", 0, idle_timeout_s=10)
        port = server.bind()
        t = threading.Thread(target=server.serve, daemon=True)
        t.start()
        budget = link.LinkBudget(pings=200, frame_bytes=frame_mib << 20, max_bytes=256 << 20, max_seconds=3)
        t0 = time.monotonic()
        doc = link.measure_link("127.0.0.1", port, budget, node="loopback-a", peer="loopback-b")
        wall = time.monotonic() - t0
        t.join(timeout=10)
        out.append(
            {
                "frameMiB": frame_mib,
                "budget": {"maxBytes": budget.max_bytes, "maxSeconds": budget.max_seconds},
                "wallS": round(wall, 3),
                "bytes": doc["bytes"],
                "bandwidthGBps": round(doc["bandwidthGBps"], 3),
                "bandwidthGbps": round(doc["bandwidthGbps"], 3),
                "latencyUs": round(doc["latencyUs"], 2),
                "rttUs": {k: round(v, 2) for k, v in doc["rttUs"].items()},
            }
        )
    return out


def pairs_scaling() -> list[dict[str, Any]]:
    rows = []
    for n in (10, 50, 100, 400):
        nodes = [
            link.LinkNode(f"n{i:03d}", ("high", "mid", "low", "tiny")[i % 4], 1.0 / (1 + i % 4), f"z{i % 2}")
            for i in range(n)
        ]
        t0 = time.perf_counter()
        pairs = link.pairs_to_measure(nodes)
        ms = (time.perf_counter() - t0) * 1e3
        rounds = link.schedule_rounds(pairs)
        rows.append(
            {
                "nodes": n,
                "pairs": len(pairs),
                "allPairs": n * (n - 1) // 2,
                "rounds": len(rounds),
                "selectMs": round(ms, 2),
            }
        )
    return rows


def main() -> int:
    RESULTS.mkdir(parents=True, exist_ok=True)
    cpu: dict[str, Any] = {"host": host(), "runs": {}}
    cpu["runs"]["numpy"] = device_runs(lambda: [NumpyBackend(threads=1)], run.CPU_CONFIG)
    # The library's default thread count, for the comparison behind the one-thread default.
    cpu["runs"]["numpy-default-threads"] = device_runs(lambda: [NumpyBackend(threads=None)], run.CPU_CONFIG)
    if torch_available():
        backends = select_backends("torch", "auto")
        if backends[0].device == "cuda":
            doc = run.run_device_probe(backends, run.ProbeConfig(), node=os.environ.get("NODE_NAME"))
            validate_probe_output(doc, expected_kinds={"cuda"})
            path = RESULTS / f"probe-cuda-{doc['gpuModel'].lower()}.json"
            path.write_text(json.dumps({"host": host(), "document": doc}, indent=1) + "\n")
            print(f"wrote {path}")
        cpu["runs"]["torch-cpu"] = device_runs(lambda: [TorchBackend("cpu")], run.CPU_CONFIG)
    cpu["simulatedFleet"] = simulated_fleet()
    path = RESULTS / "probe-cpu.json"
    path.write_text(json.dumps(cpu, indent=1) + "\n")
    print(f"wrote {path}")
    linkres = {"host": host(), "loopback": link_loopback(), "pairs": pairs_scaling()}
    path = RESULTS / "probe-link.json"
    path.write_text(json.dumps(linkres, indent=1) + "\n")
    print(f"wrote {path}")
    for name, r in cpu["runs"].items():
        print(name, "wall s", r["wallS"], "max/min", r["maxOverMin"])
    print("simulated order matches datasheets:", cpu["simulatedFleet"]["orderMatchesDatasheets"])
    for r in linkres["loopback"]:
        print(
            "link",
            r["frameMiB"],
            "MiB frames:",
            r["bandwidthGbps"],
            "Gb/s",
            r["latencyUs"],
            "us",
            r["wallS"],
            "s",
        )
    for r in linkres["pairs"]:
        print("pairs", r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
