"""Measure the sandbox's start-up: ``gearshift sandbox up`` cold and warm, and ``down``, on a throw-away
sandbox in its own state directory (so a sandbox already up, and the people using it, are not disturbed:
the second sandbox gets its own name, ports and pod-IP octet).

Usage: .venv/bin/python e2e/sandbox/measure_up.py [--build-log BUILD_LOG] [--out bench/results/sandbox.json]

Writes JSON: seconds for a cold ``up`` (binaries cached, no cluster), three warm ``up`` runs, ``down``; the
load average around the runs (the machine is shared, so figures vary with it); and, when a build log of
``e2e/sandbox/build.sh`` is given, its per-part and total build seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _timed(argv: list[str], env: dict[str, str]) -> tuple[float, str, str]:
    t0 = time.monotonic()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, check=False)
    took = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{proc.stdout}\n{proc.stderr}")
    return took, proc.stdout, proc.stderr


def build_times(log: Path) -> dict[str, float]:
    """Seconds per part from build.sh's ``[sandbox-build  Ns] <part> <version>: done`` lines."""
    out: dict[str, float] = {}
    last = 0.0
    for line in log.read_text().splitlines():
        m = re.match(r"\[sandbox-build\s+(\d+)s\] (\S+) \S+: done", line)
        if m:
            t = float(m.group(1))
            out[m.group(2)] = t - last
            last = t
        m = re.match(r"\[sandbox-build\s+(\d+)s\] all binaries ready", line)
        if m:
            out["total"] = float(m.group(1))
    return out


def main() -> int:
    """Run the measurement and write the JSON file."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build-log", type=Path, help="log of a cold `bash e2e/sandbox/build.sh` run")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "sandbox.json")
    args = ap.parse_args()
    gearshift = str(Path(sys.executable).parent / "gearshift")
    with tempfile.TemporaryDirectory(prefix="gs-measure-") as tmp:
        env = dict(os.environ, GEARSHIFT_SANDBOX_DIR=str(Path(tmp) / "sandbox"))
        env.pop("KUBECONFIG", None)
        load_before = os.getloadavg()
        try:
            cold, _, cold_log = _timed([gearshift, "sandbox", "up"], env)
            warm = [_timed([gearshift, "sandbox", "up"], env)[0] for _ in range(3)]
            status = json.loads(_timed([gearshift, "sandbox", "status", "--json"], env)[1])
        finally:
            down = _timed([gearshift, "sandbox", "down"], env)[0]
        load_after = os.getloadavg()
    result = {
        "what": "gearshift sandbox up/down on a fresh state directory (binaries cached)",
        "cold_up_s": round(cold, 2),
        "warm_up_s": [round(w, 2) for w in warm],
        "down_s": round(down, 2),
        "nodes": len(status["nodes"]),
        "prometheus": bool(status["prometheus_ready"]),
        "cpus": os.cpu_count(),
        "loadavg_1m_before_after": [round(load_before[0], 2), round(load_after[0], 2)],
        "cold_up_log": cold_log.strip().splitlines(),
    }
    if args.build_log:
        result["cold_build_s"] = build_times(args.build_log)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "cold_up_log"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
