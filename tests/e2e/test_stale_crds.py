"""On the sandbox: an operator started against older CRDs says so and stops; the documented
upgrade path (server-side apply of the release's ``charts/gearshift/crds/``) lets it start.

What ``helm upgrade`` leaves behind is simulated by applying this release's GearSet CRD without
``status.executor`` (the field whose pruning made a forced shift cycle Warming ↔ Degraded). The CRDs are
put back whatever happens (``install_crds``), since every other test of the session shares them.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from gearshift import GROUP, VERSION
from gearshift.api import crdgen
from gearshift.dev.sandbox.harness import OperatorProcess, holds, install_crds, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
GEARSETS = next(k for k in crdgen.KINDS if k.kind == "GearSet")
PROFILES = next(k for k in crdgen.KINDS if k.kind == "GPUProfile")
API_VERSION = f"{GROUP}/{VERSION}"


def test_stale_crd_stops_the_operator_until_the_crds_are_upgraded(sandbox: Any, tmp_path: Path) -> None:
    ns = f"e2e-crds-{uuid.uuid4().hex[:6]}"
    sandbox.kubectl("create", "namespace", ns)
    old = crdgen.crd(GEARSETS)
    del old["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"][
        "executor"
    ]
    op: OperatorProcess | None = None
    try:
        sandbox.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=json.dumps(old))
        sandbox.kubectl("wait", "--for=condition=Established", f"crd/{GEARSETS.name}", "--timeout=60s")
        op = OperatorProcess(sandbox, ns, tmp_path / "operator.log")
        assert op.proc is not None
        code = op.proc.wait(timeout=120)
        log = op.log_tail(20_000)
        assert code == 3, log
        assert "gearsets.gearshift.io lacks status.executor" in log, log
        assert "kubectl apply --server-side --force-conflicts -f charts/gearshift/crds/" in log
        # The upgrade path the message gives (charts/gearshift/crds/ of this checkout).
        sandbox.kubectl(
            "apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "charts/gearshift/crds")
        )
        sandbox.kubectl("wait", "--for=condition=Established", f"crd/{GEARSETS.name}", "--timeout=60s")
        op.start()
        wait_until(
            lambda: "installed CRDs match this operator" in op.log_tail(20_000) or None, 60, "the check"
        )
        holds(lambda: op.running, 3, "the operator keeps running against current CRDs")
    finally:
        if op is not None:
            op.stop()
        install_crds(sandbox)
        sandbox.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_a_status_write_an_older_crd_prunes_is_reported(sandbox: Any) -> None:
    """Write-back: the same older GearSet CRD, put in while an operator runs. The real API server prunes
    ``status.executor`` from the write; the operator's status writer finds it, records a Warning event and
    ``CRDCurrent=False``, and raises instead of going on from state that was not kept."""
    from gearshift.adapters.kube import RestKubeApi
    from gearshift.handlers import common

    ns = f"e2e-prune-{uuid.uuid4().hex[:6]}"
    sandbox.kubectl("create", "namespace", ns)
    old = crdgen.crd(GEARSETS)
    del old["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"][
        "executor"
    ]
    api = RestKubeApi(sandbox.api_client())
    stage = {"layers": [0, 16], "gpuModel": "A10-24GB", "nodes": ["n"]}
    gear = {"name": "a", "microBatch": 4, "maxBatch": 32, "stages": [stage]}
    gs = {"apiVersion": API_VERSION, "kind": "GearSet", "metadata": {"name": "g", "namespace": ns},
          "spec": {"serviceName": "s", "role": "prefill", "mode": "explicit", "gears": [gear]}}  # fmt: skip
    try:
        sandbox.kubectl("apply", "-f", "-", input=json.dumps(gs))
        sandbox.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=json.dumps(old))
        sandbox.kubectl("wait", "--for=condition=Established", f"crd/{GEARSETS.name}", "--timeout=60s")
        executor = {"phase": "Warming", "target": "a"}

        def pruned() -> str | None:
            # The API server's schema cache follows the CRD update within a second or so.
            try:
                common.patch_status(api, API_VERSION, "GearSet", ns, "g", {"executor": executor})
            except common.StatusPruned as exc:
                return str(exc)
            return None

        message = wait_until(pruned, 30, "the write pruned", interval_s=1.0)
        assert "status.executor" in message and "charts/gearshift/crds/" in message
        stored = get_json_obj(sandbox, ns)
        assert "executor" not in (stored.get("status") or {})
        cond = next(c for c in stored["status"]["conditions"] if c["type"] == "CRDCurrent")
        assert (cond["status"], cond["reason"]) == ("False", "FieldsPruned")
        out = sandbox.kubectl(
            "get", "events", "-n", ns, "--field-selector", "reason=FieldsPruned", "-o", "json"
        )
        events = json.loads(out.stdout)["items"]
        assert len(events) == 1 and events[0]["type"] == "Warning", events
    finally:
        install_crds(sandbox)
        sandbox.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_a_gpuprofile_status_write_an_older_crd_prunes_is_reported(sandbox: Any) -> None:
    """The GPUProfile handler's status writer against the real API server with a GPUProfile CRD that lacks
    ``status.probe`` (where the life cycle keeps the probe Job in flight: lost, the next tick would start
    a second probe). The write is found pruned: ``CRDCurrent=False``, one Warning event in ``default`` (the
    namespace of a cluster-scoped object's events), and the step stops with kopf's delayed retry."""
    import kopf

    from gearshift.adapters.kube import RestKubeApi
    from gearshift.api.gpuprofile import GPUProfileStatus, ProbeInfo
    from gearshift.handlers import gpuprofile
    from gearshift.handlers.runtime import Runtime

    name = f"e2e-prune-{uuid.uuid4().hex[:6]}"
    old = crdgen.crd(PROFILES)
    del old["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["probe"]
    rt = Runtime(api=RestKubeApi(sandbox.api_client()))
    profile = {"apiVersion": API_VERSION, "kind": "GPUProfile", "metadata": {"name": name},
               "spec": {"nodeName": name}}  # fmt: skip
    status = GPUProfileStatus(phase="Probing", probe=ProbeInfo(job=f"gearshift-probe-{name}", attempts=1))
    try:
        sandbox.kubectl("apply", "-f", "-", input=json.dumps(profile))
        sandbox.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=json.dumps(old))
        sandbox.kubectl("wait", "--for=condition=Established", f"crd/{PROFILES.name}", "--timeout=60s")

        def pruned() -> kopf.TemporaryError | None:
            # The API server's schema cache follows the CRD update within a second or so.
            try:
                gpuprofile._write_status(rt, name, status)
            except kopf.TemporaryError as exc:
                return exc
            return None

        exc = wait_until(pruned, 30, "the write pruned", interval_s=1.0)
        assert "status.probe" in str(exc) and "charts/gearshift/crds/" in str(exc), exc
        assert exc.delay == gpuprofile.PRUNED_RETRY_S
        stored = json.loads(sandbox.kubectl("get", "gpuprofile", name, "-o", "json").stdout)
        assert "probe" not in (stored.get("status") or {})
        cond = next(c for c in stored["status"]["conditions"] if c["type"] == "CRDCurrent")
        assert (cond["status"], cond["reason"]) == ("False", "FieldsPruned")
        selector = f"reason=FieldsPruned,involvedObject.name={name}"
        out = sandbox.kubectl("get", "events", "-n", "default", "--field-selector", selector, "-o", "json")
        events = json.loads(out.stdout)["items"]
        assert len(events) == 1 and events[0]["type"] == "Warning", events
        assert events[0]["involvedObject"]["kind"] == "GPUProfile"
        # Tried again while the CRD is old: refused again, not reported again.
        with pytest.raises(kopf.TemporaryError):
            gpuprofile._write_status(rt, name, status)
        out = sandbox.kubectl("get", "events", "-n", "default", "--field-selector", selector, "-o", "json")
        assert len(json.loads(out.stdout)["items"]) == 1
    finally:
        install_crds(sandbox)
        sandbox.kubectl("delete", "gpuprofile", name, "--wait=false", check=False)
        mine = f"involvedObject.name={name}"
        sandbox.kubectl("delete", "events", "-n", "default", "--field-selector", mine, check=False)


def get_json_obj(sandbox: Any, ns: str) -> dict[str, Any]:
    return dict(json.loads(sandbox.kubectl("get", "gearset", "g", "-n", ns, "-o", "json").stdout))
