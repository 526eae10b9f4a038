"""Fleet → sandbox Node manifests (gearshift.dev.sandbox.nodes): pure, no cluster."""

from __future__ import annotations

import ipaddress
import itertools
from pathlib import Path

import pytest

from gearshift.dev.sandbox.nodes import NodeLayoutError, node_pod_cidr, sandbox_nodes
from gearshift.facts.fleet import load_fleet, parse_fleet

REPO = Path(__file__).resolve().parents[2]
MIXED = load_fleet(REPO / "examples" / "fleets/mixed.yaml")
OCTET = 42


@pytest.fixture(scope="module")
def nodes():
    return {n["metadata"]["name"]: n for n in sandbox_nodes(MIXED, OCTET)}


class TestAddressPlan:
    def test_names_gpu_then_cpu(self):
        names = [n["metadata"]["name"] for n in sandbox_nodes(MIXED, OCTET)]
        assert names[:2] == ["gpu-h100-0", "gpu-h100-1"]
        assert names[-2:] == ["cpu-0", "cpu-1"]
        assert len(names) == 12

    def test_pod_cidrs_disjoint_loopback_and_not_host_block(self, nodes):
        nets = [ipaddress.ip_network(n["spec"]["podCIDR"]) for n in nodes.values()]
        host_block = ipaddress.ip_network("127.0.0.0/24")
        for net in nets:
            assert net.subnet_of(ipaddress.ip_network(f"127.{OCTET}.0.0/16"))
            assert not net.overlaps(host_block)
            assert net.num_addresses == 256
        assert len({str(n) for n in nets}) == len(nets)
        for a in nets:
            assert sum(a.overlaps(b) for b in nets) == 1

    def test_node_ips_outside_every_pod_cidr(self, nodes):
        nets = [ipaddress.ip_network(n["spec"]["podCIDR"]) for n in nodes.values()]
        ips = []
        for n in nodes.values():
            (ip,) = [a["address"] for a in n["status"]["addresses"] if a["type"] == "InternalIP"]
            ips.append(ipaddress.ip_address(ip))
        assert len(set(ips)) == len(ips)
        assert all(ip.is_loopback and not any(ip in net for net in nets) for ip in ips)

    def test_two_octets_give_disjoint_pods(self):
        a = {ipaddress.ip_network(n["spec"]["podCIDR"]) for n in sandbox_nodes(MIXED, 7)}
        b = {ipaddress.ip_network(n["spec"]["podCIDR"]) for n in sandbox_nodes(MIXED, 8)}
        assert not any(x.overlaps(y) for x in a for y in b)

    @pytest.mark.parametrize(("octet", "index"), [(0, 0), (256, 0), (5, 254), (5, -1)])
    def test_bad_octet_or_index(self, octet, index):
        with pytest.raises(NodeLayoutError):
            node_pod_cidr(octet, index)

    def test_too_many_nodes(self):
        big = parse_fleet({"name": "big", "nodePools": [{"name": "t", "gpu": "T4-16GB", "nodes": 1975}]})
        with pytest.raises(NodeLayoutError, match="at most 1976"):
            sandbox_nodes(big, OCTET)


@pytest.fixture(scope="module")
def big():
    fleet = parse_fleet({"name": "big", "nodePools": [
        {"name": "t4", "gpu": "T4-16GB", "nodes": 1000, "gpusPerNode": 2},
        {"name": "h100", "gpu": "H100-80GB", "nodes": 974, "gpusPerNode": 8}]})  # fmt: skip
    return sandbox_nodes(fleet, OCTET)


class TestDensePlan:
    """More than 254 nodes (the fleet-scale benchmark): a /27 per node, still inside 127.<octet>/16."""

    def test_small_fleet_keeps_the_24_plan(self):
        fleet = parse_fleet({"name": "f", "nodePools": [{"name": "t", "gpu": "T4-16GB", "nodes": 252}]})
        nets = {ipaddress.ip_network(n["spec"]["podCIDR"]) for n in sandbox_nodes(fleet, OCTET)}
        assert {n.prefixlen for n in nets} == {24}

    def test_disjoint_loopback_pod_cidrs_and_node_ips(self, big):
        assert len(big) == 1976
        nets = sorted(ipaddress.ip_network(n["spec"]["podCIDR"]) for n in big)
        octet_net = ipaddress.ip_network(f"127.{OCTET}.0.0/16")
        kwok_net = ipaddress.ip_network(f"127.{OCTET}.255.0/24")
        assert all(n.prefixlen == 27 and n.subnet_of(octet_net) and not n.overlaps(kwok_net) for n in nets)
        assert all(not a.overlaps(b) for a, b in itertools.pairwise(nets))
        ips = [
            ipaddress.ip_address(a["address"])
            for n in big
            for a in n["status"]["addresses"]
            if a["type"] == "InternalIP"
        ]
        assert len(set(ips)) == len(ips) == len(big)
        assert all(ip in octet_net and ip not in kwok_net for ip in ips)
        assert not any(ip in net for ip in ips for net in nets[:2] + nets[-2:])
        assert max(ips) < min(n.network_address for n in nets)

    def test_pods_capacity_fits_the_cidr(self, big):
        assert {n["status"]["capacity"]["pods"] for n in big} == {"30"}


class TestGpuNode:
    def test_gfd_labels(self, nodes):
        labels = nodes["gpu-h100-0"]["metadata"]["labels"]
        assert labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
        assert labels["nvidia.com/gpu.memory"] == str(80 * 1024)
        assert labels["nvidia.com/gpu.count"] == "1"
        assert labels["nvidia.com/gpu.family"] == "hopper"
        assert labels["kubernetes.io/hostname"] == "gpu-h100-0"
        assert labels["type"] == "kwok"
        assert nodes["gpu-t4-1"]["metadata"]["labels"]["nvidia.com/gpu.product"] == "Tesla-T4"
        assert nodes["gpu-t4-1"]["metadata"]["labels"]["nvidia.com/gpu.family"] == "turing"

    def test_datasheet_annotations(self, nodes):
        ann = nodes["gpu-a100-1"]["metadata"]["annotations"]
        # NVIDIA A100 40GB datasheet: 312 dense bf16 TFLOPS, 1555 GB/s; the fleet file: 100 Gb/s NIC.
        assert ann["gearshift.io/bf16-tflops"] == "312"
        assert ann["gearshift.io/hbm-gbps"] == "1555"
        assert ann["gearshift.io/memory-gib"] == "40"
        assert ann["gearshift.io/nic-gbps"] == "100"
        assert ann["gearshift.io/latency-us"] == "10"
        assert ann["gearshift.io/gpu-model"] == "A100-40GB"

    def test_capacity_and_taint(self, nodes):
        node = nodes["gpu-a10-2"]
        # One A10 card, time-sliced into MIXED.gpu_replicas schedulable GPUs (examples/fleets/mixed.yaml: 2).
        assert MIXED.gpu_replicas == 2
        assert node["status"]["capacity"]["nvidia.com/gpu"] == "2"
        assert node["metadata"]["labels"]["nvidia.com/gpu.count"] == "1"
        assert node["metadata"]["labels"]["nvidia.com/gpu.replicas"] == "2"
        assert node["metadata"]["labels"]["nvidia.com/gpu.sharing-strategy"] == "time-slicing"
        assert node["status"]["allocatable"] == node["status"]["capacity"]
        assert node["spec"]["taints"] == [
            {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
        ]

    def test_multi_gpu_node(self):
        fleet = parse_fleet(
            {"name": "t", "nodePools": [{"name": "x", "gpu": "L4-24GB", "nodes": 1, "gpusPerNode": 4}]}
        )
        node = sandbox_nodes(fleet, OCTET, cpu_nodes=0)[0]
        assert node["status"]["capacity"]["nvidia.com/gpu"] == "4"
        assert node["metadata"]["labels"]["nvidia.com/gpu.count"] == "4"
        assert node["metadata"]["labels"]["nvidia.com/gpu.family"] == "ada-lovelace"


class TestCpuNode:
    def test_no_gpu_no_taint(self, nodes):
        cpu = nodes["cpu-1"]
        assert "nvidia.com/gpu" not in cpu["status"]["capacity"]
        assert "taints" not in cpu["spec"]
        assert not any(k.startswith("nvidia.com/") for k in cpu["metadata"]["labels"])
        assert cpu["metadata"]["labels"]["gearshift.io/node-pool"] == "cpu"


def test_a_node_whose_ttl_the_controller_set_does_not_differ():
    """kube-controller-manager's TTL controller owns node.alpha.kubernetes.io/ttl (0-60 s by cluster
    size): a second ``up`` of a 1,000-node sandbox must not rewrite every node for it."""
    from types import SimpleNamespace

    from gearshift.dev.sandbox.cluster import _node_differs

    one = parse_fleet({"name": "f", "nodePools": [{"name": "t", "gpu": "T4-16GB", "nodes": 1}]})
    (m,) = sandbox_nodes(one, OCTET, cpu_nodes=0)
    ttl = {**m["metadata"]["annotations"], "node.alpha.kubernetes.io/ttl": "30"}
    live = SimpleNamespace(
        metadata=SimpleNamespace(labels=dict(m["metadata"]["labels"]), annotations=ttl),
        spec=SimpleNamespace(taints=[SimpleNamespace(**t) for t in m["spec"]["taints"]]),
        status=SimpleNamespace(capacity=dict(m["status"]["capacity"])),
    )  # fmt: skip
    assert not _node_differs(live, m)
    live.metadata.annotations["gearshift.io/gpu-model"] = "A10-24GB"
    assert _node_differs(live, m)


class TestFleetNodesUnderTheSandbox:
    """The sandbox's nodes are ``gearshift.k8s.fleetnodes``' (what ``gearshift render`` stands in for a
    cluster) plus the sandbox's own addresses and kwok markers, and nothing else differs."""

    SANDBOX_ONLY = frozenset(
        {
            "podCIDR",
            "podCIDRs",
            "addresses",
            "type",
            "kwok.x-k8s.io/node",
            "node.alpha.kubernetes.io/ttl",
        }
    )

    def _strip(self, manifest):
        out = {}
        for key, value in manifest.items():
            if key in self.SANDBOX_ONLY:
                continue
            out[key] = self._strip(value) if isinstance(value, dict) else value
        return out

    def test_same_nodes_without_the_address_plan(self):
        from gearshift.k8s.fleetnodes import fleet_nodes

        plain = fleet_nodes(MIXED, cpu_nodes=2)
        sandbox = sandbox_nodes(MIXED, OCTET)
        assert [self._strip(n) for n in sandbox] == [self._strip(n) for n in plain]
        assert all("podCIDR" not in n["spec"] and "addresses" not in n["status"] for n in plain)
        assert all(n["status"]["addresses"][0]["address"].startswith(f"127.{OCTET}.") for n in sandbox)
