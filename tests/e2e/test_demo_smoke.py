"""E2E smoke test of ``gearshift demo``: a short replay on the sandbox, end to end, and its report.

Runs the real command (sandbox reuse, local operator, profiles, example PDService with auto GearSets,
router on its loopback pod IP, load generator, Prometheus queries, the twin's comparison, plots) with a
30 s replay of the default window (Llama-3-70B aggregated; the Azure trace at 7.5x, every 25th request: about
40 requests), in a namespace of its own, and checks what it wrote. Bounded: the
command gets at most ``DEMO_TIMEOUT_S``. The report's numbers are the load generator's and the router's
own; this test reads them back, it does not recompute them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from gearshift.dev.loadgen import DEFAULT_TRACE as TRACE

pytestmark = pytest.mark.e2e

#: Startup (~30 s), 30 s of replay, up to 60 s of drain, the report: well under 5 minutes.
DEMO_TIMEOUT_S = 280


@pytest.fixture
def demo_namespace(sandbox: Any) -> Any:
    """A namespace for the demo, deleted afterwards. The demo stops its local operator when it ends, so
    nothing would remove the operator's finalizers: they are dropped here first, or the namespace would
    stay Terminating."""
    name = f"e2e-demo-{uuid.uuid4().hex[:6]}"
    yield name
    for kind in ("pdservices", "gearsets"):
        for obj in sandbox.kubectl("get", kind, "-n", name, "-o", "name", check=False).stdout.split():
            sandbox.kubectl(
                "patch",
                obj,
                "-n",
                name,
                "--type=merge",
                "-p",
                '{"metadata":{"finalizers":null}}',
                check=False,
            )
    sandbox.kubectl("delete", "namespace", name, "--wait=false", check=False)


def test_short_demo_writes_a_report_from_measurements(
    sandbox: Any, demo_namespace: str, tmp_path: Path
) -> None:
    if not sandbox.is_sandbox:
        pytest.skip("gearshift demo drives the gearshift sandbox, not a user's cluster")
    if not TRACE.exists():
        pytest.skip(f"the trace {TRACE} is not on this machine")
    report_dir = tmp_path / "report"
    cmd = [
        str(Path(sys.executable).parent / "gearshift"),
        "demo",
        "--duration",
        "30",
        "--namespace",
        demo_namespace,
        "--report-dir",
        str(report_dir),
        "--install",
        "local",
        "--ready-timeout",
        "150",
        "--keep",
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=DEMO_TIMEOUT_S, env=sandbox.env, check=False
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]

    # Step 1: every GPU node profiled, the table printed.
    assert "$ kubectl get gpup" in out and "profiles: " in out
    # Step 2: the planner's gears of the aggregated role shown, uneven pipelines among them.
    assert "both (auto, GearSet" in out and "← active" in out
    assert "stage(s)" in out and "gear throughput (throughput): 1 stage(s)" not in out
    # Step 3: traffic only to the router's loopback pod IP.
    assert "the router's pod IP is http://127." in out

    md = (report_dir / "report.md").read_text()
    for heading in (
        "## Results",
        "## Gear shifts",
        "## Plots",
        "## The fleet",
        "## Explore",
        "## Cost",
        "## Goals",
    ):
        assert heading in md
    for png in ("traffic.png", "utilization.png", "placement.png"):
        data = (report_dir / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, png

    load = json.loads((report_dir / "load.json").read_text())
    assert load["issued"] > 20 and load["completed"] > 0, load
    assert load["ttft_ms"] is not None and load["ttft_ms"]["p99"] > 0
    assert "From the router's own `/metrics`" in md
    # The router counted the requests it answered; its OK count is in the report.
    ok = int(md.split("requests, ", 1)[1].split(" OK", 1)[0])
    assert ok >= 1

    # Step 5: the cluster stays up with the service in it.
    pds = sandbox.kubectl_json("get", "pdservices", "-n", demo_namespace)["items"]
    assert [p["metadata"]["name"] for p in pds] == ["llama3-70b"]

    # The twin's comparison: the shifting loop, every static gear and the peer layouts, with the goals.
    summary = json.loads((report_dir / "summary.json").read_text())
    kinds = [r["kind"] for r in summary["cost"]["twin"]["rows"]]
    assert kinds[0] == "dynamic" and "static" in kinds and "peer" in kinds
    assert "planned_vs_best_peer" in summary["goals"] and "wall_time" in summary["goals"]
