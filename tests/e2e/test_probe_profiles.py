"""E2E: the operator probes every GPU node of the sandbox, writes GPUProfiles and node labels.

Runs ``gearshift operator`` (sandbox mode: ``GEARSHIFT_SANDBOX=1``, so probe pods are run by the sandbox's
pod runner with the simulated device) against the sandbox. Expected values come from the nodes' GFD
product labels through ``gearshift.facts.gpus``, never from the operator's own output.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from gearshift.dev.sandbox.nodes import gpu_node_manifest
from gearshift.facts.fleet import TP_EFFICIENCY, FleetNode
from gearshift.facts.gpus import GPU_SPECS, compute_score, gpu_spec

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
NS = "gearshift-system"
LABELS = (
    "gearshift.io/gpu-model",
    "gearshift.io/compute-class",
    "gearshift.io/memory-gib",
    "gearshift.io/profiled",
)


@pytest.fixture(scope="module")
def operator(sandbox: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """``gearshift operator`` in sandbox mode with a short back-off; stopped (by its pid) afterwards."""
    sandbox.kubectl("apply", "-f", str(REPO / "crds"))
    if sandbox.kubectl("get", "namespace", NS, check=False).returncode != 0:
        sandbox.kubectl("create", "namespace", NS)
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    env = {
        **sandbox.env,
        "GEARSHIFT_SANDBOX": "1",
        "GEARSHIFT_PROBE_NAMESPACE": NS,
        "GEARSHIFT_PROBE_BACKOFF_S": "2",
        "GEARSHIFT_PROBE_BACKOFF_MAX_S": "4",
        "GEARSHIFT_PROBE_TTL_S": "300",
    }
    # handlers.main.run directly rather than through the `gearshift` CLI, so that a sub-command module
    # of another feature cannot keep the operator from starting.
    cmd = [
        sys.executable,
        "-c",
        "import argparse, sys; from gearshift.handlers import main as m; p = argparse.ArgumentParser(); "
        "m.add_arguments(p); sys.exit(m.run(p.parse_args(sys.argv[1:])))",
        "--kubeconfig",
        str(sandbox.kubeconfig),
        "--probe-port",
        "0",
        "--metrics-port",
        "0",
    ]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield log
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)
        print(log.read_text()[-4000:])


def gpu_nodes(sandbox: Any) -> list[dict[str, Any]]:
    return [
        n
        for n in sandbox.kubectl_json("get", "nodes")["items"]
        if int((n["status"].get("capacity") or {}).get("nvidia.com/gpu", "0")) > 0
    ]


def profile(sandbox: Any, name: str) -> dict[str, Any] | None:
    proc = sandbox.kubectl("get", "gpup", name, "-o", "json", check=False)
    return json.loads(proc.stdout) if proc.returncode == 0 else None


def ready_and_labelled(sandbox: Any, name: str) -> dict[str, Any] | None:
    prof = profile(sandbox, name)
    if not prof or (prof.get("status") or {}).get("phase") != "Ready":
        return None
    node = sandbox.kubectl_json("get", "node", name)
    labels = node["metadata"].get("labels") or {}
    if not all(k in labels for k in LABELS):
        return None
    return {"profile": prof, "labels": labels}


def expected_card(node: dict[str, Any]) -> Any:
    return gpu_spec(node["metadata"]["labels"]["nvidia.com/gpu.product"])


def conditions(prof: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in (prof.get("status") or {}).get("conditions") or []}


def make_node(sandbox: Any, model: str, annotations: dict[str, str] | None = None) -> str:
    name = f"gpu-e2e-{uuid.uuid4().hex[:6]}"
    spec = GPU_SPECS[model]
    index = 200 + int(uuid.uuid4().hex[:4], 16) % 50
    manifest = gpu_node_manifest(FleetNode(name, "e2e", spec, 1, 25, 10), index, sandbox.octet)
    manifest["metadata"]["annotations"].update(annotations or {})
    status = manifest.pop("status")
    sandbox.apply(manifest)
    sandbox.kubectl(
        "patch", "node", name, "--subresource=status", "--type=merge", "-p", json.dumps({"status": status})
    )
    return name


def delete_node(sandbox: Any, name: str) -> None:
    sandbox.kubectl("delete", "node", name, "--wait=false", check=False)


def test_every_gpu_node_gets_a_ready_profile_and_labels(sandbox: Any, operator: Path) -> None:
    nodes = gpu_nodes(sandbox)
    assert nodes, "the sandbox has no GPU nodes"
    for node in nodes:
        name = node["metadata"]["name"]
        got = sandbox.wait_for(lambda n=name: ready_and_labelled(sandbox, n), 60, f"GPUProfile {name} Ready")
        st, labels = got["profile"]["status"], got["labels"]
        card = expected_card(node)
        count = physical_cards(node)
        assert st["gpuModel"] == card.model == labels["gearshift.io/gpu-model"]
        assert st["gpuCount"] == count
        assert st["memoryGiB"] == pytest.approx(card.memory_gib)
        assert labels["gearshift.io/memory-gib"] == str(round(card.memory_gib))
        assert labels["gearshift.io/profiled"] == "true"
        assert labels["gearshift.io/compute-class"] == st["computeClass"]
        assert st["source"] == "datasheet" and st["probe"]["device"] == "sim"
        cond = conditions(got["profile"])
        assert cond["Ready"]["status"] == "True" and cond["Probed"]["status"] == "True"


def physical_cards(node: dict[str, Any]) -> int:
    """Cards of a node: ``nvidia.com/gpu`` capacity over the time-slicing replicas GFD labels."""
    slots = int(node["status"]["capacity"]["nvidia.com/gpu"])
    return slots // int(node["metadata"]["labels"].get("nvidia.com/gpu.replicas", "1"))


def test_compute_scores_order_the_fleet_as_the_datasheets(sandbox: Any, operator: Path) -> None:
    measured: dict[str, float] = {}
    datasheet: dict[str, float] = {}
    for node in gpu_nodes(sandbox):
        name = node["metadata"]["name"]
        got = sandbox.wait_for(lambda n=name: ready_and_labelled(sandbox, n), 60, f"GPUProfile {name} Ready")
        count = physical_cards(node)
        measured[name] = got["profile"]["status"]["computeScore"]
        eff = TP_EFFICIENCY if count > 1 else 1.0
        datasheet[name] = compute_score(expected_card(node).model) * count * eff
    for a in measured:
        for b in measured:
            if datasheet[a] > datasheet[b] * 1.001:
                assert measured[a] > measured[b], (a, b, measured[a], measured[b])
            elif abs(datasheet[a] - datasheet[b]) <= 1e-9:
                assert measured[a] == pytest.approx(measured[b], rel=1e-3)
    # The strongest cards of the fleet are class high and the weakest low.
    classes = {
        n: sandbox.kubectl_json("get", "node", n)["metadata"]["labels"]["gearshift.io/compute-class"]
        for n in measured
    }
    top, bottom = max(datasheet.values()), min(datasheet.values())
    assert {classes[n] for n, s in datasheet.items() if s == top} == {"high"}
    if bottom * 1.5 < top:
        assert {classes[n] for n, s in datasheet.items() if s == bottom} == {"low"}


def test_kubectl_get_gpup_reads_well(sandbox: Any, operator: Path) -> None:
    nodes = [n["metadata"]["name"] for n in gpu_nodes(sandbox)]
    for n in nodes:
        sandbox.wait_for(lambda n=n: ready_and_labelled(sandbox, n), 60, f"GPUProfile {n} Ready")
    out = sandbox.kubectl("get", "gpup").stdout.splitlines()
    assert out[0].split() == ["NAME", "NODE", "GPU", "COUNT", "MEM(GIB)", "SCORE", "PHASE", "WINDOW", "AGE"]
    rows = {line.split()[0]: line.split() for line in out[1:]}
    for n in nodes:
        row = rows[n]
        node = sandbox.kubectl_json("get", "node", n)
        assert row[1] == n and row[2] == expected_card(node).model and row[6] == "Ready"
        assert float(row[5]) > 0


def test_new_node_profiled_within_a_minute_reprobed_on_change_and_stale_when_gone(
    sandbox: Any, operator: Path
) -> None:
    name = make_node(sandbox, "L4-24GB")
    try:
        t0 = time.monotonic()
        got = sandbox.wait_for(lambda: ready_and_labelled(sandbox, name), 60, f"new node {name} profiled")
        print(f"new node profiled and labelled in {time.monotonic() - t0:.1f} s")
        assert got["labels"]["gearshift.io/gpu-model"] == "L4-24GB"
        first_job = got["profile"]["status"]["probe"]["job"]

        # Asking for a re-probe through the node annotation runs one new Job.
        token = uuid.uuid4().hex[:8]
        sandbox.kubectl("annotate", "node", name, "--overwrite", f"gearshift.io/reprobe={token}")
        got = sandbox.wait_for(
            lambda: (
                (p := ready_and_labelled(sandbox, name))
                and p["profile"]["status"]["probe"].get("reprobeToken") == token
                and p
            ),
            60,
            "the re-probe asked for by annotation",
        )
        assert got["profile"]["status"]["probe"]["job"] != first_job

        # A GPU change (capacity 1 → 2) makes the profile re-probe and record the new count.
        patch = {"status": {"capacity": {"nvidia.com/gpu": "2"}, "allocatable": {"nvidia.com/gpu": "2"}}}
        sandbox.kubectl(
            "patch", "node", name, "--subresource=status", "--type=merge", "-p", json.dumps(patch)
        )
        got = sandbox.wait_for(
            lambda: (
                (p := ready_and_labelled(sandbox, name)) and p["profile"]["status"]["gpuCount"] == 2 and p
            ),
            60,
            "re-probe after the GPU count changed",
        )
        assert got["profile"]["status"]["computeScore"] == pytest.approx(
            2 * TP_EFFICIENCY * compute_score("L4-24GB"), rel=1e-4
        )
    finally:
        delete_node(sandbox, name)
    prof = sandbox.wait_for(
        lambda: (p := profile(sandbox, name)) and p["status"].get("phase") == "Stale" and p,
        30,
        "profile Stale after its node was deleted",
    )
    stale = conditions(prof)["Stale"]
    assert stale["status"] == "True" and stale["reason"] == "NodeGone"
    assert conditions(prof)["Ready"]["status"] == "False"
    sandbox.kubectl("delete", "gpup", name, "--wait=false", check=False)


def test_failing_probe_is_reported_retried_and_unlabelled(sandbox: Any, operator: Path) -> None:
    # An unknown GPU model in the datasheet annotation makes the simulated probe fail (exit 1, error JSON).
    name = make_node(sandbox, "T4-16GB", {"gearshift.io/gpu-model": "NoSuchGPU"})
    try:

        def failed_twice() -> dict[str, Any] | None:
            p = profile(sandbox, name)
            st = (p or {}).get("status") or {}
            return (
                p if st.get("phase") == "Failed" and (st.get("probe") or {}).get("attempts", 0) >= 2 else None
            )

        prof = sandbox.wait_for(failed_twice, 60, "the failing probe reported and retried")
        cond = conditions(prof)
        assert cond["Probed"]["status"] == "False" and cond["Probed"]["reason"] == "ProbeError"
        assert "NoSuchGPU" in cond["Probed"]["message"]
        assert cond["Ready"]["status"] == "False"
        labels = sandbox.kubectl_json("get", "node", name)["metadata"].get("labels") or {}
        assert not any(k in labels for k in LABELS), labels
        events = sandbox.kubectl_json(
            "get", "events", "-A", "--field-selector", f"involvedObject.name={name},reason=ProbeFailed"
        )["items"]
        assert events and all(e["type"] == "Warning" for e in events)

        # Once the node's data is right again, the next retry succeeds and labels appear.
        sandbox.kubectl("annotate", "node", name, "--overwrite", "gearshift.io/gpu-model=T4-16GB")
        got = sandbox.wait_for(lambda: ready_and_labelled(sandbox, name), 60, "recovery after the fix")
        assert got["labels"]["gearshift.io/gpu-model"] == "T4-16GB"
        assert got["profile"]["status"]["probe"]["attempts"] == 0
    finally:
        delete_node(sandbox, name)
        sandbox.kubectl("delete", "gpup", name, "--wait=false", check=False)


def test_declared_window_reaches_the_profile_and_reads_as_a_time(sandbox: Any, operator: Path) -> None:
    name = make_node(sandbox, "T4-16GB")
    try:
        sandbox.wait_for(lambda: ready_and_labelled(sandbox, name), 60, f"new node {name} profiled")
        # Declared after the profile is Ready: the slower Ready tick must still pick it up.
        until = (datetime.now(UTC) + timedelta(hours=1)).replace(microsecond=0)
        sandbox.kubectl(
            "annotate", "node", name, "--overwrite", f"gearshift.io/available-until={until.isoformat()}"
        )
        prof = sandbox.wait_for(
            lambda: (p := profile(sandbox, name)) and p["status"].get("availableUntil") and p,
            30,
            "the node's window in its GPUProfile",
        )
        assert datetime.fromisoformat(prof["status"]["availableUntil"].replace("Z", "+00:00")) == until
        row = sandbox.kubectl("get", "gpup", name, "--no-headers").stdout.split()
        assert row[7] == prof["status"]["availableUntil"], row  # the time itself, not "<invalid>"
    finally:
        delete_node(sandbox, name)
        sandbox.kubectl("delete", "gpup", name, "--wait=false", check=False)
