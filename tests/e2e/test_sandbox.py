"""The sandbox cluster itself: fake GPU nodes, real scheduling, controllers, kubectl and helm."""

from __future__ import annotations

import ipaddress
import json
import uuid
from pathlib import Path

import pytest
import yaml

from gearshift.dev.sandbox.nodes import gpu_node_manifest
from gearshift.facts.fleet import FleetNode
from gearshift.facts.gpus import gpu_spec

REPO = Path(__file__).resolve().parents[2]

# What NVIDIA's feature discovery writes for these cards, and their memory (nvidia.com/gpu.memory, MiB),
# written out here rather than taken from gearshift.facts.gpus so the test checks the code against the facts.
PRODUCT = {
    "H100-80GB": ("NVIDIA-H100-80GB-HBM3", 80 * 1024, "hopper"),
    "A100-40GB": ("NVIDIA-A100-SXM4-40GB", 40 * 1024, "ampere"),
    "A10-24GB": ("NVIDIA-A10", 24 * 1024, "ampere"),
    "T4-16GB": ("Tesla-T4", 16 * 1024, "turing"),
}
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def _needs_sandbox(sandbox):
    if not sandbox.is_sandbox:
        pytest.skip("checks the gearshift sandbox's own fake nodes; KUBECONFIG points at another cluster")


def _expected_nodes(fleet_file: Path) -> dict[str, dict]:
    doc = yaml.safe_load(fleet_file.read_text())
    out = {}
    for pool in doc["nodePools"]:
        for i in range(pool["nodes"]):
            out[f"gpu-{pool['name']}-{i}"] = {
                "gpu": pool["gpu"],
                "gpus": pool.get("gpusPerNode", 1),
                "replicas": (doc.get("gpuSharing") or {}).get("replicas", 1),
            }
    return out


def test_nodes_match_the_fleet_file(sandbox):
    _needs_sandbox(sandbox)
    expected = _expected_nodes(sandbox.fleet_file)
    nodes = {n["metadata"]["name"]: n for n in sandbox.kubectl_json("get", "nodes")["items"]}
    assert set(expected) <= set(nodes)
    assert {"cpu-0", "cpu-1"} <= set(nodes)
    pod_nets = []
    for name, want in expected.items():
        node = nodes[name]
        labels = node["metadata"]["labels"]
        product, mib, family = PRODUCT[want["gpu"]]
        assert labels["nvidia.com/gpu.product"] == product
        assert labels["nvidia.com/gpu.memory"] == str(mib)
        assert labels["nvidia.com/gpu.family"] == family
        assert labels["nvidia.com/gpu.count"] == str(want["gpus"])
        assert labels["kubernetes.io/hostname"] == name
        # Cards are time-sliced: each is advertised gpuSharing.replicas times.
        slots = str(want["gpus"] * want["replicas"])
        assert node["status"]["capacity"]["nvidia.com/gpu"] == slots
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == slots
        assert labels["nvidia.com/gpu.replicas"] == str(want["replicas"])
        assert {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"} in node["spec"]["taints"]
        ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"]
        assert ready == "True"
        net = ipaddress.ip_network(node["spec"]["podCIDR"])
        assert net.subnet_of(ipaddress.ip_network(f"127.{sandbox.octet}.0.0/16"))
        pod_nets.append(net)
    assert nodes["gpu-h100-0"]["metadata"]["annotations"]["gearshift.io/bf16-tflops"] == "989"
    assert "nvidia.com/gpu" not in nodes["cpu-0"]["status"]["capacity"]
    assert len(set(pod_nets)) == len(pod_nets)

    # The column view the README shows.
    out = sandbox.kubectl("get", "nodes", "-L", "nvidia.com/gpu.product").stdout
    assert "NVIDIA-H100-80GB-HBM3" in out and "Tesla-T4" in out


@pytest.fixture
def own_gpu_nodes(sandbox):
    """Factory of GPU nodes private to one test: a unique pool and taint keep other users' pods off them
    (the sandbox is shared), and the test's pods select and tolerate them. Deleted afterwards."""
    _needs_sandbox(sandbox)
    tag = uuid.uuid4().hex[:6]
    made: list[str] = []

    def make(models: list[str]) -> tuple[str, list[str]]:
        pool = f"e2e-{tag}"
        names = []
        for model in models:
            name = f"gpu-{pool}-{len(made)}"
            # podCIDR indices 150-199: away from the fleet's (from 1) and other tests' nodes.
            index = 150 + (int(tag, 16) + len(made)) % 50
            node = gpu_node_manifest(FleetNode(name, pool, gpu_spec(model), 1, 25, 10), index, sandbox.octet)
            node["spec"]["taints"].append({"key": "gearshift.io/e2e", "value": tag, "effect": "NoSchedule"})
            status = node.pop("status")
            sandbox.apply(node)
            sandbox.kubectl(
                "patch",
                "node",
                name,
                "--subresource=status",
                "--type=merge",
                "-p",
                json.dumps({"status": status}),
            )
            made.append(name)
            names.append(name)
        return pool, names

    make.toleration = {"key": "gearshift.io/e2e", "operator": "Equal", "value": tag, "effect": "NoSchedule"}
    yield make
    for name in made:
        sandbox.kubectl("delete", "node", name, "--wait=false", check=False)


def test_statefulset_lands_on_matching_gpu_nodes_and_gets_ready(sandbox, namespace, own_gpu_nodes, wait_for):
    pool, names = own_gpu_nodes(["A10-24GB", "T4-16GB", "A10-24GB", "A10-24GB"])
    a10s = {n for n, m in zip(names, ["A10", "T4", "A10", "A10"], strict=True) if m == "A10"}
    wait_for(
        lambda: all(
            {
                c["type"]: c["status"]
                for c in sandbox.kubectl_json("get", "node", n)["status"].get("conditions", [])
            }.get("Ready")
            == "True"
            for n in names
        ),
        60,
        "the test's nodes to be Ready",
    )
    match = [
        {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-A10"]},
        {"key": "gearshift.io/node-pool", "operator": "In", "values": [pool]},
    ]
    sts = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": "a10-pool"},
        "spec": {
            "replicas": 3,
            "serviceName": "a10-pool",
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": {"app": "a10-pool"}},
            "template": {
                "metadata": {"labels": {"app": "a10-pool"}},
                "spec": {
                    "affinity": {
                        "nodeAffinity": {
                            "requiredDuringSchedulingIgnoredDuringExecution": {
                                "nodeSelectorTerms": [{"matchExpressions": match}]
                            }
                        }
                    },
                    "tolerations": [GPU_TOLERATION, own_gpu_nodes.toleration],
                    "containers": [
                        {
                            "name": "engine",
                            "image": "engine:1",
                            "resources": {"limits": {"nvidia.com/gpu": "1"}},
                        }
                    ],
                },
            },
        },
    }
    sandbox.apply(sts, namespace)

    def ready():
        s = sandbox.kubectl_json("get", "statefulset", "a10-pool", "-n", namespace)
        return s["status"].get("readyReplicas") == 3

    wait_for(ready, 90, "3 ready replicas of the A10 StatefulSet")
    pods = sandbox.kubectl_json("get", "pods", "-n", namespace, "-l", "app=a10-pool")["items"]
    nodes = {n["metadata"]["name"]: n for n in sandbox.kubectl_json("get", "nodes")["items"]}
    used = set()
    for pod in pods:
        node = nodes[pod["spec"]["nodeName"]]
        assert node["metadata"]["labels"]["nvidia.com/gpu.product"] == "NVIDIA-A10"
        assert ipaddress.ip_address(pod["status"]["podIP"]) in ipaddress.ip_network(node["spec"]["podCIDR"])
        used.add(pod["spec"]["nodeName"])
    # One GPU per node: three pods need the three A10 nodes, never the T4.
    assert used == a10s


def test_scheduler_respects_gpu_capacity(sandbox, namespace, own_gpu_nodes, wait_for):
    pool, names = own_gpu_nodes(["H100-80GB", "H100-80GB"])
    pods = []
    for i in range(len(names) + 1):
        pods.append(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": f"big-{i}"},
                "spec": {
                    "nodeSelector": {
                        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
                        "gearshift.io/node-pool": pool,
                    },
                    "tolerations": [GPU_TOLERATION, own_gpu_nodes.toleration],
                    "containers": [
                        {"name": "c", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
                    ],
                },
            }
        )
    sandbox.apply(pods, namespace)

    def settled():
        items = sandbox.kubectl_json("get", "pods", "-n", namespace)["items"]
        bound = [p for p in items if p["spec"].get("nodeName")]
        unsched = [
            p
            for p in items
            if any(c.get("reason") == "Unschedulable" for c in p["status"].get("conditions", []))
        ]
        return (bound, unsched) if len(bound) == len(names) and len(unsched) == 1 else None

    bound, unsched = wait_for(settled, 90, f"{len(names)} pods bound and one unschedulable")
    assert sorted(p["spec"]["nodeName"] for p in bound) == sorted(names)
    msg = next(c["message"] for c in unsched[0]["status"]["conditions"] if c["type"] == "PodScheduled")
    assert "Insufficient nvidia.com/gpu" in msg


def test_job_completes(sandbox, namespace, wait_for):
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "once"},
        "spec": {
            "completions": 2,
            "backoffLimit": 0,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "nodeSelector": {"gearshift.io/node-pool": "cpu"} if sandbox.is_sandbox else {},
                    "containers": [{"name": "c", "image": "busybox", "command": ["true"]}],
                }
            },
        },
    }
    sandbox.apply(job, namespace)

    def done():
        j = sandbox.kubectl_json("get", "job", "once", "-n", namespace)
        return any(
            c["type"] == "Complete" and c["status"] == "True" for c in j["status"].get("conditions", [])
        )

    wait_for(done, 90, "the Job to complete")
    assert sandbox.kubectl_json("get", "job", "once", "-n", namespace)["status"]["succeeded"] == 2


def test_deployment_controller_rolls_pods(sandbox, namespace, wait_for):
    dep = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {"containers": [{"name": "c", "image": "web:1"}]},
            },
        },
    }
    sandbox.apply(dep, namespace)
    wait_for(
        lambda: (
            sandbox.kubectl_json("get", "deploy", "web", "-n", namespace)["status"].get("availableReplicas")
            == 2
        ),
        60,
        "2 available replicas",
    )
    sandbox.kubectl("set", "image", "deploy/web", "c=web:2", "-n", namespace)
    sandbox.kubectl("rollout", "status", "deploy/web", "-n", namespace, "--timeout=60s", timeout=90)
    images = {
        p["spec"]["containers"][0]["image"]
        for p in sandbox.kubectl_json("get", "pods", "-n", namespace, "-l", "app=web")["items"]
        if not p["metadata"].get("deletionTimestamp")
    }
    assert images == {"web:2"}


def test_kubectl_and_helm_versions(sandbox):
    out = json.loads(sandbox.kubectl("version", "-o", "json").stdout)
    if sandbox.is_sandbox:
        versions = dict(
            line.split("=", 1)
            for line in (REPO / "e2e" / "sandbox" / "versions.env").read_text().splitlines()
            if "=" in line and not line.startswith("#")
        )
        assert out["serverVersion"]["gitVersion"] == versions["KUBE_VERSION"]
        assert out["clientVersion"]["gitVersion"] == versions["KUBE_VERSION"]
        assert sandbox.helm("version", "--short").stdout.startswith(versions["HELM_VERSION"])
    else:
        assert out["serverVersion"]["gitVersion"].startswith("v1.")
    assert sandbox.helm("list", "--all-namespaces").returncode == 0


def test_helm_installs_a_chart(sandbox, namespace, tmp_path, wait_for):
    chart = tmp_path / "tiny"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: tiny\nversion: 0.1.0\n")
    (chart / "values.yaml").write_text("greeting: hello\n")
    (chart / "templates" / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-cm\n"
        "data:\n  greeting: {{ .Values.greeting | quote }}\n"
    )
    sandbox.helm("install", "t1", str(chart), "-n", namespace, "--set", "greeting=gearshift", "--wait")
    cm = sandbox.kubectl_json("get", "configmap", "t1-cm", "-n", namespace)
    assert cm["data"]["greeting"] == "gearshift"
    sandbox.helm("uninstall", "t1", "-n", namespace, "--wait")
    wait_for(
        lambda: sandbox.kubectl("get", "configmap", "t1-cm", "-n", namespace, check=False).returncode != 0,
        30,
        "the chart's ConfigMap to be removed",
    )
