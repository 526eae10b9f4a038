"""E2E: every panel of the chart's Grafana dashboard (``charts/gearshift/dashboards/gearshift.json``) has
data in the sandbox's Prometheus during a ``gearshift demo`` run.

Runs the real command (local operator, its metrics scraped through the sandbox Prometheus' local target
file) with a replay of ``REPLAY_S`` s of the Azure trace at its recorded speed, in a namespace of its own.
Once the service is Ready the test forces a prefill gear shift (``spec.forceGear``), so the shift panel has a
finished shift to show (the demo's own policy shifts only after 60 s of dwell under load). After the demo
ends, every panel target's PromQL, with the dashboard's variables filled in as Grafana would (namespace,
service, ``$__rate_interval`` = 4 scrape intervals), is run as a range query over the replay, and each must
return a series with a finite value. The variables' own ``label_values`` queries must offer the demo's
namespace and service.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from gearshift.dev import dashboard
from gearshift.dev.loadgen import DEFAULT_TRACE as TRACE
from gearshift.dev.sandbox.prometheus import SCRAPE_INTERVAL_S

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SERVICE = "llama3-8b"
PREFILL_GS = "llama3-8b-prefill"
#: The 8B prefill/decode example, whose service and GearSet names are the two above.
PD_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "demo" / "pdservice-demo.yaml"
#: Replay seconds: a forced shift takes about 56 s on the sandbox (30 s warm, drain, 20 s rollback window).
REPLAY_S = 100
#: Start-up (~60 s on a reused sandbox), the replay, up to 60 s of drain, the report.
DEMO_TIMEOUT_S = 480
#: Grafana's $__rate_interval at a step of one scrape interval: max(step + scrape, 4 x scrape).
RATE_INTERVAL = f"{4 * SCRAPE_INTERVAL_S}s"


@pytest.fixture
def demo_namespace(sandbox: Any) -> Any:
    """A namespace for the demo, deleted afterwards; the finalizers of the stopped local operator go first
    (as in test_demo_smoke), or the namespace would stay Terminating."""
    name = f"e2e-dash-{uuid.uuid4().hex[:6]}"
    yield name
    for kind in ("pdservices", "gearsets"):
        for obj in sandbox.kubectl("get", kind, "-n", name, "-o", "name", check=False).stdout.split():
            patch = '{"metadata":{"finalizers":null}}'
            sandbox.kubectl("patch", obj, "-n", name, "--type=merge", "-p", patch, check=False)
    sandbox.kubectl("delete", "namespace", name, "--wait=false", check=False)


def _prom(url: str, path: str, params: dict[str, str]) -> Any:
    with urllib.request.urlopen(f"{url}{path}?{urllib.parse.urlencode(params)}", timeout=30) as resp:
        body = json.loads(resp.read())
    assert body["status"] == "success", body
    return body["data"]


def _finite(series: list[dict[str, Any]]) -> list[float]:
    vals = [float(v) for s in series for _, v in s.get("values") or []]
    return [v for v in vals if math.isfinite(v)]


def _service_ready(sandbox: Any, ns: str, proc: subprocess.Popen[bytes]) -> dict[str, Any] | str | None:
    """The prefill GearSet once the PDService is Ready with planned gears; "exited" if the demo ended."""
    if proc.poll() is not None:
        return "exited"
    pds = sandbox.kubectl("get", "pdservice", SERVICE, "-n", ns, "-o", "json", check=False)
    if pds.returncode != 0 or (json.loads(pds.stdout).get("status") or {}).get("phase") != "Ready":
        return None
    gs: dict[str, Any] = sandbox.kubectl_json("get", "gearset", PREFILL_GS, "-n", ns)
    st = gs.get("status") or {}
    return gs if st.get("activeGear") and len(st.get("plannedGears") or []) >= 2 else None


def test_every_dashboard_panel_has_data_during_a_demo(
    sandbox: Any, demo_namespace: str, tmp_path: Path
) -> None:
    if not sandbox.is_sandbox:
        pytest.skip("gearshift demo drives the gearshift sandbox, not a user's cluster")
    if not sandbox.prometheus_url:
        pytest.skip("the sandbox runs without Prometheus")
    if not TRACE.exists():
        pytest.skip(f"the trace {TRACE} is not on this machine")
    ns, prom = demo_namespace, sandbox.prometheus_url
    cmd = [
        str(Path(sys.executable).parent / "gearshift"),
        "demo",
        "--duration", str(REPLAY_S),
        "--time-scale", "1",
        # The PD demo: the dashboard's panels are prefill's and decode's (the default is the 70B aggregated).
        "--example", str(PD_EXAMPLE),
        "--keep-every", "1",
        "--namespace", ns,
        "--report-dir", str(tmp_path / "report"),
        "--install", "local",
        "--ready-timeout", "150",
        "--keep",
    ]  # fmt: skip
    log = tmp_path / "demo.log"
    t0 = time.time()
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=sandbox.env)
    try:
        gs = sandbox.wait_for(
            lambda: _service_ready(sandbox, ns, proc), 300, "the demo's service to be Ready", 2.0
        )
        assert gs != "exited", log.read_text()[-4000:]
        active = gs["status"]["activeGear"]
        others = [g["name"] for g in gs["status"]["plannedGears"] if g["name"] != active]
        target = "latency" if "latency" in others else others[0]
        patch = json.dumps({"spec": {"forceGear": target}})
        sandbox.kubectl("patch", "gearset", PREFILL_GS, "-n", ns, "--type=merge", "-p", patch)
        proc.wait(timeout=DEMO_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    t1 = time.time()
    out_text = log.read_text()
    assert proc.returncode == 0, out_text[-4000:]
    assert "scraped by the sandbox's Prometheus" in out_text  # the local operator's metrics target
    history = (sandbox.kubectl_json("get", "gearset", PREFILL_GS, "-n", ns).get("status") or {}).get(
        "history"
    )
    finished = [h for h in history or [] if h.get("to") == target and h.get("outcome") != "InProgress"]
    assert finished, f"the forced shift {active} -> {target} did not finish during the demo: {history}"

    # The variables: Grafana's label_values(metric{...}, label) is the label values API with a match[].
    namespaces = _prom(prom, "/api/v1/label/namespace/values", {"match[]": "gearshift_router_inflight"})
    services = _prom(
        prom,
        "/api/v1/label/gearshift_io_service/values",
        {"match[]": f'gearshift_router_inflight{{namespace="{ns}"}}'},
    )
    assert ns in namespaces and services == [SERVICE], (namespaces, services)

    values = {"namespace": ns, "service": SERVICE, "__rate_interval": RATE_INTERVAL}
    missing, rows = [], []
    for t in dashboard.panel_targets(dashboard.load()):
        expr = dashboard.fill(t.expr, values)
        params = {"query": expr, "start": f"{t0:.3f}", "end": f"{t1:.3f}", "step": f"{SCRAPE_INTERVAL_S}"}
        series = _prom(prom, "/api/v1/query_range", params)["result"]
        vals = _finite(series)
        rows.append(
            f"{t.panel} [{t.ref_id}]: {len(series)} series, {len(vals)} finite points"
            + (f", min {min(vals):.4g}, max {max(vals):.4g}" if vals else "")
        )
        if not vals:
            missing.append(f"{t.panel} [{t.ref_id}] {t.legend!r}: {expr}")
    print("\n".join(["dashboard panels over the demo:", *rows]))
    assert not missing, "panels without data:\n" + "\n".join(missing)
