"""E2E on the sandbox: `gearshift operator` reconciles the example PDService into placed, Ready pods.

The operator runs as a local subprocess against the sandbox's kubeconfig, watching the test's namespace
(the probe handlers are disabled: GPUProfiles come from the probe operator when it runs, else this test
writes datasheet ones). Checked: pods Ready on the nodes the planner chose (the planner run here on the
same inputs), the role Service selects the active gear, reconciling again changes nothing, a spec edit
rolls only what changed, a placement failure is reported without touching serving pods, and deleting
the PDService deletes everything (the real garbage collector).

Note: the router's readiness is not asserted: the API server refuses loopback pod IPs in EndpointSlices
("may not be in the loopback range"), so in the sandbox the role Services have no endpoints and the
router, which learns its pods from them, reports no pods.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gearshift import planner
from gearshift.adapters.kube import RestKubeApi
from gearshift.api.common import API_VERSION
from gearshift.api.gearset import GearSet
from gearshift.api.pdservice import PDService
from gearshift.control.reconcile.planning import plan_assumptions
from gearshift.dev.sandbox.harness import holds, settled, teardown_run
from gearshift.k8s import names
from gearshift.planner.inputs import resource_profile
from gearshift.testing import manifests as build

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
G = API_VERSION

PREFILL = build.gearset("llama3-8b-prefill", None, {
    "serviceName": "llama3-8b",
    "role": "prefill",
    "mode": "explicit",
    "gears": [
        {
            "name": "two",
            "microBatch": 4,
            "maxBatch": 64,
            "qpsRange": [0, 10],
            "stages": [
                {"layers": [0, 24], "nodes": ["gpu-h100-0"], "gpuModel": "H100-80GB"},
                {"layers": [24, 32], "nodes": ["gpu-a100-0"], "gpuModel": "A100-40GB"},
            ],
        }
    ],
})  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def operator(sandbox: Any, namespace: str, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    log = (tmp_path / "operator.log").open("wb")
    cmd = [
        sys.executable, "-m", "gearshift.cli", "operator", "--kubeconfig", str(sandbox.kubeconfig),
        "--namespace", namespace, "--disable", "gearshift.handlers.nodes",
        "--disable", "gearshift.handlers.gpuprofile", "--probe-port", "0",
        "--metrics-port", str(_free_port()),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **sandbox.env})
    yield proc
    # Free the namespace's resources while the operator still serves their finalizers (the namespace
    # fixture deletes the namespace after this one; it would otherwise stay Terminating).
    sandbox.kubectl("delete", "pdservice,gearset", "--all", "-n", namespace, "--timeout=30s", check=False)
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    log.close()
    teardown_run(sandbox, namespace)  # whatever the operator did not release loses its finalizers
    print((tmp_path / "operator.log").read_text()[-5000:])


def _owned(api: RestKubeApi, ns: str) -> dict[tuple[str, str], str]:
    """What the operator writes, per owned object: the spec generation of workloads (their controllers
    write status, which moves resourceVersion but not generation) and the resourceVersion of Services."""
    out = {}
    for av, kind in (("apps/v1", "StatefulSet"), ("v1", "Service"), ("apps/v1", "Deployment")):
        for o in api.list(av, kind, ns, {names.LABEL_SERVICE: "llama3-8b"}):
            meta = o["metadata"]
            out[(kind, meta["name"])] = str(
                meta["generation"] if kind != "Service" else meta["resourceVersion"]
            )
    return out


def _cond(body: dict[str, Any], type_: str) -> dict[str, Any]:
    return next((c for c in (body.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


def test_example_pdservice_lifecycle(
    sandbox: Any, namespace: str, operator: Any, wait_for: Any, fleet_profiles: Any
) -> None:
    api = RestKubeApi(sandbox.api_client())
    fleet_profiles(api)
    pds_body = yaml.safe_load((ROOT / "examples/pdservice-llama3-8b.yaml").read_text())
    sandbox.apply(PREFILL, namespace=namespace)
    sandbox.apply(yaml.safe_load((ROOT / "examples/gearset-auto.yaml").read_text()), namespace=namespace)
    sandbox.apply(pds_body, namespace=namespace)

    # --- the planner's choice for decode, computed here on the same split --------------------------
    gs = wait_for(
        lambda: (
            (g := api.get(G, "GearSet", namespace, "llama3-8b-decode"))
            and g.get("status", {}).get("plannedGears")
            and g.get("status", {}).get("activeGear")
            and g
        ),
        90,
        "decode GearSet planned",
    )
    nodes = {n["metadata"]["name"]: n for n in api.list("v1", "Node")}
    profiles = {p["metadata"]["name"]: p for p in api.list(G, "GPUProfile")}
    # prefill's pool is {gpu-h100-0, gpu-a100-0}; each is the only shared node of its model, so prefill keeps
    # it and decode gets the rest of the allowed models (H100, A100-40GB, A10).
    ALLOWED = ("H100-80GB", "A100-40GB", "A10-24GB")  # examples/gearset-auto.yaml gpuModels
    decode_pool = sorted(
        n for n, b in nodes.items()
        if n not in ("gpu-h100-0", "gpu-a100-0")
        and (b["metadata"].get("labels") or {}).get(names.NODE_GPU_MODEL) in ALLOWED
        and (profiles.get(n, {}).get("status") or {}).get("phase") == "Ready"
    )  # fmt: skip
    doc = resource_profile(decode_pool, profiles, nodes, 0.9)
    arch = PDService.model_validate(pds_body).spec.model.to_model_arch()
    # Priced as the operator prices this GearSet: its role (decode steps only) and its workload.
    cost = planner.RooflineCostModel(arch, plan_assumptions(GearSet.model_validate(gs)))
    want = planner.plan(planner.parse_profile(doc), cost, sim_requests=500, worthwhile_only=True)
    planned = gs["status"]["plannedGears"]
    assert [[sorted(s["nodes"]) for s in g["stages"]] for g in planned] == [
        [sorted(s.nodes) for s in g.stages] for g in want.gears
    ]
    active = gs["status"]["activeGear"]
    gear = next(g for g in planned if g["name"] == active)

    # --- pods Ready on the chosen nodes ---------------------------------------------------------------
    def stage_pods(role: str, gname: str, k: int) -> list[dict[str, Any]]:
        sel = {names.LABEL_SERVICE: "llama3-8b", names.LABEL_ROLE: role, names.LABEL_GEAR: gname,
               names.LABEL_STAGE: str(k)}  # fmt: skip
        return api.list("v1", "Pod", namespace, sel)

    def ready(pods: list[dict[str, Any]], n: int) -> bool:
        ok = [p for p in pods if any(c["type"] == "Ready" and c["status"] == "True"
                                     for c in p.get("status", {}).get("conditions") or [])]  # fmt: skip
        return len(ok) == n

    for k, st in enumerate(gear["stages"]):
        n = len(st["nodes"])
        pods = wait_for(lambda k=k, n=n: (p := stage_pods("decode", active, k)) and ready(p, n) and p,
                        120, f"decode {active} stage {k} Ready")  # fmt: skip
        assert sorted(p["spec"]["nodeName"] for p in pods) == sorted(st["nodes"])
    for k, node in enumerate(("gpu-h100-0", "gpu-a100-0")):
        pods = wait_for(
            lambda k=k: (p := stage_pods("prefill", "two", k)) and ready(p, 1) and p, 120, "prefill"
        )
        assert pods[0]["spec"]["nodeName"] == node
    svc = api.get("v1", "Service", namespace, "llama3-8b-decode")
    assert (
        svc["spec"]["selector"][names.LABEL_GEAR] == active
        and svc["spec"]["selector"][names.LABEL_STAGE] == "0"
    )
    body = wait_for(
        lambda: (
            (b := api.get(G, "PDService", namespace, "llama3-8b"))
            and (b.get("status", {}).get("decode") or {}).get("readyReplicas", 0) >= 1
            and (b.get("status", {}).get("prefill") or {}).get("readyReplicas", 0) >= 1
            and b
        ),
        60,
        "PDService status counts ready pipelines",
    )
    assert _cond(body, "Placed")["status"] == "True"
    assert body["status"]["observedGeneration"] == body["metadata"]["generation"]

    # --- reconciling again changes nothing -------------------------------------------------------------
    # The rollout's status-refresh reconciles settle first: the owned objects stop moving for 3 s.
    before = wait_for(lambda: settled(lambda: _owned(api, namespace), 3.0), 60, "owned objects settled")
    sandbox.kubectl("-n", namespace, "annotate", "pds", "llama3-8b", "e2e/poke=1")  # a metadata update
    holds(lambda: _owned(api, namespace) == before, 5, "a metadata update moves no owned object")

    # --- a spec edit rolls only what changed ---------------------------------------------------------
    edited = yaml.safe_load(yaml.safe_dump(PREFILL))
    edited["spec"]["gears"][0]["maxBatch"] = 96
    sandbox.apply(edited, namespace=namespace)
    wait_for(
        lambda: "96" in str(api.get("apps/v1", "StatefulSet", namespace, "llama3-8b-prefill-two-s0")),
        30,
        "prefill StatefulSets updated",
    )
    after = wait_for(lambda: settled(lambda: _owned(api, namespace), 3.0), 60, "owned objects settled")
    moved = {k for k in after if before.get(k) != after[k]}
    assert moved == {("StatefulSet", "llama3-8b-prefill-two-s0"), ("StatefulSet", "llama3-8b-prefill-two-s1")}

    # --- placement failure: reported, serving pods untouched -----------------------------------------
    wait_for(lambda: ready(stage_pods("prefill", "two", 0), 1) and ready(stage_pods("prefill", "two", 1), 1),
             120, "prefill rolled")  # fmt: skip
    serving = {p["metadata"]["uid"] for k in (0, 1) for p in stage_pods("prefill", "two", k)}
    sts_before = _owned(api, namespace)
    broken = yaml.safe_load(yaml.safe_dump(edited))
    broken["spec"]["gears"][0]["stages"][1]["nodes"] = ["gpu-missing-0"]
    sandbox.apply(broken, namespace=namespace)
    body = wait_for(
        lambda: (
            (b := api.get(G, "PDService", namespace, "llama3-8b"))
            and _cond(b, "Placed").get("status") == "False"
            and b
        ),
        30,
        "Placed=False",
    )
    assert "gpu-missing-0" in _cond(body, "Placed")["message"]
    holds(
        lambda: {p["metadata"]["uid"] for k in (0, 1) for p in stage_pods("prefill", "two", k)} == serving,
        2, "the serving prefill pods stay while the placement fails",
    )  # fmt: skip
    assert {k: v for k, v in _owned(api, namespace).items() if "prefill-two-s" in k[1]} == {
        k: v for k, v in sts_before.items() if "prefill-two-s" in k[1]
    }
    events = api.list("v1", "Event", namespace)
    assert any(e.get("reason") == "PlacementFailed" for e in events)

    # --- deletion removes everything -------------------------------------------------------------------
    sandbox.kubectl("-n", namespace, "delete", "pds", "llama3-8b", "--wait=false")
    wait_for(lambda: not _owned(api, namespace), 90, "owned objects garbage-collected")
