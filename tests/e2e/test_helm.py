"""E2E on the sandbox: the Helm chart installs a working, least-privileged operator, upgrades it without
touching serving pods, and uninstalls as Helm's convention says.

The release is scoped to one fresh namespace (``watchNamespaces``) with profiling off (GPUProfiles are
cluster-wide: other operators on the shared sandbox may profile; this test writes datasheet profiles where
none exist), so it does not fight other operators. ``sandbox.enabled`` labels the operator pod for the
sandbox's local pod runner, which runs ``gearshift operator`` as a process with a TokenRequest token of the
chart's ServiceAccount (``gearshift.io/sandbox-credentials``): the operator has exactly the chart's RBAC.
The tests run in file order and share one release (module fixture).
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from gearshift.adapters.kube import RestKubeApi
from gearshift.api.common import API_VERSION
from gearshift.k8s import names

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts/gearshift"
G = API_VERSION
RELEASE = "gearshift"
SERVICE = "llama3-8b"
OPERATOR_SELECTOR = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=operator"
#: The prefill GearSet's initial gear in examples/gearset-explicit.yaml and its four stages.
PREFILL_STS = [f"{SERVICE}-prefill-balanced-s{k}" for k in range(4)]


@dataclass
class Release:
    """The installed release: its namespace, the operator's ServiceAccount and the API as admin."""

    namespace: str
    service_account: str
    api: RestKubeApi


def _install_args(ns: str) -> list[str]:
    return [
        "--namespace", ns, "--set", f"watchNamespaces[0]={ns}", "--set", "replicaCount=1",
        "--set", "profiling.enabled=false", "--set", "sandbox.enabled=true",
        "--set", "resources.requests.cpu=10m", "--set", "resources.requests.memory=32Mi",
    ]  # fmt: skip


def _operator_pods(api: RestKubeApi, ns: str) -> list[dict[str, Any]]:
    pods = api.list("v1", "Pod", ns, {"app.kubernetes.io/instance": RELEASE})
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def _ready(pod: dict[str, Any]) -> bool:
    conds = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)


def _pod_kubeconfig(pod: dict[str, Any]) -> Path:
    """The kubeconfig the sandbox runner gave the pod (its ServiceAccount's token)."""
    from gearshift.dev.sandbox.layout import Layout

    meta = pod["metadata"]
    return (
        Layout.from_env().pods_dir
        / f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}"
        / ("serviceaccount.kubeconfig")
    )


def _raw(kubeconfig: Path, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    """One request with a kubeconfig's token to its (loopback) API server; returns (status, JSON body)."""
    cfg = yaml.safe_load(kubeconfig.read_text())
    cluster = cfg["clusters"][0]["cluster"]
    assert cluster["server"].startswith("https://127."), cluster["server"]  # loopback only
    token = cfg["users"][0]["user"]["token"]
    ctx = ssl.create_default_context(cafile=cluster["certificate-authority"])
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(cluster["server"] + path, data=data, method=method)
    req.add_header("Authorization", f"Bearer {token}")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


@pytest.fixture(scope="module")
def release(sandbox: Any) -> Iterator[Release]:
    if not sandbox.is_sandbox:
        pytest.skip("needs the gearshift sandbox: no operator image is built on this machine")
    ns = f"e2e-helm-{uuid.uuid4().hex[:6]}"
    sandbox.kubectl("create", "namespace", ns)
    api = RestKubeApi(sandbox.api_client())
    try:
        sandbox.helm("install", RELEASE, str(CHART), *_install_args(ns), "--wait", "--timeout", "120s")
        yield Release(ns, RELEASE, api)
    finally:
        sandbox.helm("uninstall", RELEASE, "--namespace", ns, check=False)
        # Without an operator nobody releases kopf's finalizers on the user objects: drop them.
        for kind in ("pdservices", "gearsets"):
            out = sandbox.kubectl("get", kind, "-n", ns, "-o", "name", check=False).stdout.split()
            for obj in out:
                sandbox.kubectl(
                    "patch",
                    obj,
                    "-n",
                    ns,
                    "--type=merge",
                    "-p",
                    '{"metadata":{"finalizers":null}}',
                    check=False,
                )
        sandbox.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_chart_lints(sandbox: Any) -> None:
    proc = sandbox.helm("lint", str(CHART), "--strict")
    assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout


def test_operator_pod_runs_with_its_service_account(release: Release, sandbox: Any, wait_for: Any) -> None:
    """The operator pod runs through the pod runner, authenticated as the chart's ServiceAccount."""
    (pod,) = wait_for(
        lambda: [p for p in _operator_pods(release.api, release.namespace) if _ready(p)], 60, "ready"
    )
    assert pod["spec"]["serviceAccountName"] == release.service_account
    kubeconfig = _pod_kubeconfig(pod)
    assert kubeconfig.exists(), (
        f"{kubeconfig} is missing: the sandbox's pod runner predates ServiceAccount credentials; "
        "restart the sandbox (gearshift sandbox down; gearshift sandbox up)"
    )
    status, review = _raw(
        kubeconfig, "POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
    )  # fmt: skip
    assert status == 201, review
    user = review["status"]["userInfo"]
    assert user["username"] == f"system:serviceaccount:{release.namespace}:{release.service_account}"
    # The token is bound to this pod: deleting the pod revokes it.
    assert user["extra"]["authentication.kubernetes.io/pod-name"] == [pod["metadata"]["name"]]


def test_example_pdservice_gets_its_statefulsets(
    release: Release, sandbox: Any, wait_for: Any, fleet_profiles: Any
) -> None:
    ns, api = release.namespace, release.api
    fleet_profiles(api)  # profiling is off here
    for f in ("gearset-explicit.yaml", "gearset-auto.yaml", "pdservice-llama3-8b.yaml"):
        sandbox.kubectl("apply", "-n", ns, "-f", str(ROOT / "examples" / f))

    def sts() -> dict[str, dict[str, Any]]:
        return {
            s["metadata"]["name"]: s
            for s in api.list("apps/v1", "StatefulSet", ns, {names.LABEL_SERVICE: SERVICE})
        }

    wait_for(lambda: all(n in sts() for n in PREFILL_STS), 120, "prefill StatefulSets")
    decode = wait_for(
        lambda: (
            (g := api.get(G, "GearSet", ns, f"{SERVICE}-decode")) and g.get("status", {}).get("activeGear")
        ),
        120,
        "decode GearSet planned",
    )
    wait_for(
        lambda: any(n.startswith(f"{SERVICE}-decode-{decode}-s") for n in sts()), 60, "decode StatefulSets"
    )
    for name in PREFILL_STS:
        wait_for(
            lambda name=name: (sts().get(name, {}).get("status") or {}).get("readyReplicas", 0) >= 1,
            120,
            f"{name} ready",
        )
    assert api.get("apps/v1", "Deployment", ns, names.router_name(SERVICE)) is not None
    # The router's Role was granted by the operator: only possible because it holds those verbs itself.
    role = api.get("rbac.authorization.k8s.io/v1", "Role", ns, names.router_name(SERVICE))
    # services: the router resolves role Services' selectors where EndpointSlices hold no loopback IPs
    router_resources = {"endpointslices", "pods", "services"}
    assert role is not None and {r["resources"][0] for r in role["rules"]} == router_resources


def test_rbac_is_minimal(release: Release, sandbox: Any) -> None:
    """Verbs the chart does not grant are denied, to `kubectl auth can-i` and to a real request."""
    sa = f"system:serviceaccount:{release.namespace}:{release.service_account}"

    def can(*args: str) -> bool:
        out = sandbox.kubectl("auth", "can-i", *args, f"--as={sa}", check=False)
        assert out.stdout.strip() in ("yes", "no"), out.stderr
        return out.stdout.strip() == "yes"

    ns = release.namespace
    assert can("create", "statefulsets.apps", "-n", ns)
    assert can("patch", "pdservices.gearshift.io/status", "-n", ns)
    assert can("list", "nodes")
    assert not can("delete", "nodes")
    assert not can("patch", "nodes")  # profiling is off: no node labels to write
    assert not can("create", "gpuprofiles.gearshift.io")  # likewise
    assert not can("create", "statefulsets.apps", "-n", "default")  # outside watchNamespaces
    # Events about cluster-scoped objects (GPUProfiles) can only go to `default`; nowhere else outside.
    assert can("create", "events", "-n", "default")
    assert not can("create", "events", "-n", "kube-system")
    assert not can("get", "secrets", "-n", ns)
    assert not can("delete", "deployments.apps", "-n", ns)  # the router goes by owner reference
    assert not can("escalate", "roles.rbac.authorization.k8s.io", "-n", ns)
    assert not can("bind", "clusterroles.rbac.authorization.k8s.io")
    # Leader election: any Lease may be created (create cannot go by name), only the release's own read
    # and updated, none deleted, and only in the release namespace.
    assert can("create", "leases.coordination.k8s.io", "-n", ns)
    assert can("update", f"leases.coordination.k8s.io/{RELEASE}", "-n", ns)
    assert not can("update", "leases.coordination.k8s.io/someone-elses", "-n", ns)
    assert not can("delete", f"leases.coordination.k8s.io/{RELEASE}", "-n", ns)
    assert not can("create", "leases.coordination.k8s.io", "-n", "default")

    (pod,) = [p for p in _operator_pods(release.api, ns) if _ready(p)]
    kubeconfig = _pod_kubeconfig(pod)
    # Authorization comes before lookup: a denied verb is 403 even for a node that does not exist.
    status, body = _raw(kubeconfig, "DELETE", "/api/v1/nodes/gearshift-rbac-no-such-node")
    assert status == 403, body
    assert body["reason"] == "Forbidden" and sa in body["message"]
    status, body = _raw(kubeconfig, "GET", f"/api/v1/namespaces/{ns}/secrets")
    assert status == 403, body
    status, _ = _raw(kubeconfig, "GET", "/api/v1/nodes?limit=1")  # granted, for contrast
    assert status == 200


def test_upgrade_rolls_the_operator_not_the_serving_pods(
    release: Release, sandbox: Any, wait_for: Any
) -> None:
    """helm upgrade to two replicas (leader election, active/standby) and DEBUG logs: new operator pods,
    one of them holding the Lease, the same engine pods."""
    ns, api = release.namespace, release.api
    engine = {names.LABEL_SERVICE: SERVICE, names.LABEL_COMPONENT: names.COMPONENT_ENGINE}
    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in api.list("v1", "Pod", ns, engine)}
    assert len(before) >= len(PREFILL_STS)
    (old_op,) = _operator_pods(api, ns)
    sandbox.helm(
        "upgrade", RELEASE, str(CHART), *_install_args(ns),
        "--set", "replicaCount=2", "--set", "logLevel=DEBUG", "--wait", "--timeout", "180s",
    )  # fmt: skip
    ops = wait_for(
        lambda: (p := _operator_pods(api, ns)) and len(p) == 2 and all(_ready(x) for x in p) and p,
        120,
        "2 ready",
    )
    assert old_op["metadata"]["uid"] not in {p["metadata"]["uid"] for p in ops}
    assert all("--leader-elect" in p["spec"]["containers"][0]["args"] for p in ops)
    # The Lease (the release's full name, in the release namespace) is held by one of the two running
    # pods: the old leader released it on SIGTERM. The identity is <hostname>_<id>, and the sandbox's pod
    # runner sets HOSTNAME to the pod name, as the kubelet does.
    pod_names = tuple(sorted(p["metadata"]["name"] for p in ops))

    def holder() -> str:
        lease = _lease(sandbox, ns, RELEASE)
        assert lease is not None, f"no Lease {RELEASE} in {ns}"
        h = lease["spec"].get("holderIdentity") or ""
        assert h.startswith(pod_names), f"holderIdentity {h!r}, running pods {pod_names}"
        return h

    wait_for(holder, 60, "the Lease held by a running operator pod")
    after = {p["metadata"]["name"]: p["metadata"]["uid"] for p in api.list("v1", "Pod", ns, engine)}
    assert after == before


def _lease(sandbox: Any, ns: str, name: str) -> dict[str, Any] | None:
    out = sandbox.kubectl("get", "lease", name, "-n", ns, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else None


def test_uninstall_keeps_crds_and_user_resources(release: Release, sandbox: Any, wait_for: Any) -> None:
    ns, api = release.namespace, release.api
    sandbox.helm("uninstall", RELEASE, "--namespace", ns, "--wait", "--timeout", "120s")
    wait_for(lambda: not _operator_pods(api, ns), 60, "operator pods gone")
    assert api.get("apps/v1", "Deployment", ns, RELEASE) is None
    assert api.get("v1", "ServiceAccount", ns, RELEASE) is None
    assert sandbox.kubectl("get", "clusterrole", f"{RELEASE}-{ns}-fleet", check=False).returncode != 0
    crds = sandbox.kubectl("get", "crd", "-o", "name").stdout.split()
    for crd in ("pdservices.gearshift.io", "gearsets.gearshift.io", "gpuprofiles.gearshift.io"):
        assert f"customresourcedefinition.apiextensions.k8s.io/{crd}" in crds
    assert api.get(G, "PDService", ns, SERVICE) is not None
    assert api.get(G, "GearSet", ns, f"{SERVICE}-prefill") is not None
    assert api.list("apps/v1", "StatefulSet", ns, {names.LABEL_SERVICE: SERVICE})
