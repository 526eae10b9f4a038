"""The failure classes of the reliability rows, proven again on a busy machine: their e2e modules run
with one core taken by the busy-machine CPU hog (``GEARSHIFT_E2E_LOAD=one-core-busy``: the e2e session's
``harness.machine_load``), on the sandbox.

What a user would pick instead is the same tests on a quiet machine: ``make test`` runs them that way, so
this file adds the busy run. Written as the ``busy_classes`` section of ``bench/results/reliability.json``
(other sections are kept): per module its outcome counts and wall time, per test its outcome and
duration, and the 1-minute load average sampled every 10 s over the run. The goal: every test passes.

Classes and modules (the rows of ``bench/reliability.py``'s ``ROWS`` they re-prove):

- objects near the API's limits (row 4): ``tests/e2e/test_api_limits.py``;
- bad inputs refused at the API with a message naming the field: ``tests/e2e/test_api.py``;
- stale and replaced CRDs, status writes pruned (row 5): ``tests/e2e/test_stale_crds.py``
  (``test_crd_replaced_live.py`` runs busy in ``make test`` already);
- operator kills at the shift boundaries, deletes while daemons run, recovery rules (rows 2, 3, 6):
  ``tests/e2e/test_shifting_e2e.py``;
- leader election (row 7): ``tests/e2e/test_leader_election.py`` (``test_lease_starved.py`` is busy by
  itself).

Run: ``.venv/bin/python bench/busy_classes.py [--out FILE] [--modules M ...]``; it uses the sandbox the
e2e fixtures use (brought up when missing, left up). About 15 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchlib, also when loaded by file

from benchlib import write_result

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench/results/reliability.json"
MODULES = (
    "tests/e2e/test_api_limits.py",
    "tests/e2e/test_api.py",
    "tests/e2e/test_stale_crds.py",
    "tests/e2e/test_shifting_e2e.py",
    "tests/e2e/test_leader_election.py",
)
#: Seconds between two load-average samples.
LOAD_SAMPLE_S = 10.0


def outcomes(junit: Path) -> list[dict[str, Any]]:
    """``[{"test", "outcome", "duration_s", "message"?}]`` from a pytest JUnit XML file.

    ``outcome`` is passed, failed, error or skipped (JUnit's child elements of a testcase).
    """
    rows: list[dict[str, Any]] = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome, message = "passed", None
        for tag in ("failure", "error", "skipped"):
            child = case.find(tag)
            if child is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (child.get("message") or "")[:300]
                break
        row: dict[str, Any] = {
            "test": f"{case.get('classname', '')}::{case.get('name', '')}",
            "outcome": outcome,
            "duration_s": round(float(case.get("time") or 0.0), 1),
        }
        if message:
            row["message"] = message
        rows.append(row)
    return rows


def run_module(module: str, junit: Path) -> dict[str, Any]:
    """Run one e2e module under the busy-machine load; its counts, wall time and tests."""
    env = {**os.environ, "GEARSHIFT_E2E": "1", "GEARSHIFT_E2E_LOAD": "one-core-busy"}
    env["PYTHONPATH"] = str(REPO / "operator")
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", module, f"--junitxml={junit}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    tests = outcomes(junit) if junit.exists() else []
    counts: dict[str, int] = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    return {
        "module": module,
        "exit_code": proc.returncode,
        "wall_s": round(time.monotonic() - t0, 1),
        "counts": counts,
        "tests": tests,
        "tail": proc.stdout[-1500:] if proc.returncode else "",
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--modules", nargs="+", default=list(MODULES))
    a = ap.parse_args(argv)
    loads: list[float] = []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(LOAD_SAMPLE_S):
            loads.append(os.getloadavg()[0])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    t0 = time.monotonic()
    results = []
    try:
        for i, module in enumerate(a.modules):
            results.append(run_module(module, Path(f"/tmp/gs-busy-classes-{os.getpid()}-{i}.xml")))
            print(module, json.dumps(results[-1]["counts"]), f"{results[-1]['wall_s']} s", flush=True)
    finally:
        done.set()
    bad = [t["test"] for r in results for t in r["tests"] if t["outcome"] in ("failed", "error")]
    broken = [r["module"] for r in results if r["exit_code"] not in (0,) and not bad]
    section = {
        "command": "bench/busy_classes.py",
        "started": started,
        "load": "one-core-busy (GEARSHIFT_E2E_LOAD: harness.machine_load's CPU hog for the whole session)",
        "machine": {"cpus": os.cpu_count()},
        "loadavg_1m": {
            "min": round(min(loads), 2) if loads else None,
            "max": round(max(loads), 2) if loads else None,
            "mean": round(sum(loads) / len(loads), 2) if loads else None,
        },
        "wall_s": round(time.monotonic() - t0, 1),
        "modules": results,
        "goal": "every test of the modules passes on the busy machine",
        "not_passed": bad + broken,
        "goal_met": not bad and not broken,
    }
    write_result(a.out, "busy_classes", section, indent=1, ensure_ascii=False)
    return 0 if section["goal_met"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
