"""Fleet files → nodes and the planner's resource profile (gearshift.facts.fleet)."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest

from gearshift.facts.fleet import FleetError, datasheet_profile, load_fleet, max_micro_batch, parse_fleet

REPO = Path(__file__).resolve().parents[2]
MIXED = REPO / "examples" / "fleets/mixed.yaml"


def _doc(**pool):
    base = {"name": "p", "gpu": "A10-24GB", "nodes": 1}
    base.update(pool)
    return {"name": "t", "nodePools": [base]}


class TestParseFleet:
    def test_mixed_example_nodes_in_pool_order(self):
        fleet = load_fleet(MIXED)
        names = [n.name for n in fleet.nodes]
        expected = [
            f"gpu-{p}-{i}" for p, k in (("h100", 2), ("a100", 2), ("a10", 4), ("t4", 2)) for i in range(k)
        ]
        assert names == expected
        assert fleet.name == "mixed"

    def test_mixed_example_figures(self):
        by_name = {n.name: n for n in load_fleet(MIXED).nodes}
        h100 = by_name["gpu-h100-1"]
        assert (h100.gpu.model, h100.gpus, h100.nic_gbps, h100.latency_us) == ("H100-80GB", 1, 200.0, 10.0)
        assert by_name["gpu-t4-0"].gpu.memory_gib == 16
        assert by_name["gpu-a10-3"].nic_gbps == 25.0

    def test_defaults(self):
        node = parse_fleet({"name": "t", "nodePools": [{"name": "x", "gpu": "T4-16GB", "nodes": 1}]}).nodes[0]
        assert (node.gpus, node.nic_gbps, node.latency_us) == (1, 100.0, 10.0)

    def test_product_name_accepted_as_gpu(self):
        node = parse_fleet(_doc(gpu="NVIDIA-A10")).nodes[0]
        assert node.gpu.model == "A10-24GB"

    def test_memory_of_multi_gpu_node(self):
        node = parse_fleet(_doc(gpu="A100-40GB", gpusPerNode=4)).nodes[0]
        assert node.memory_gib == 160

    @pytest.mark.parametrize(
        ("doc", "needle"),
        [
            ([], "must be a mapping"),
            ({"nodePools": []}, "fleet.name is required"),
            ({"name": "t"}, "fleet.nodePools is required"),
            ({"name": "t", "nodePools": []}, "at least one pool"),
            (_doc(gpu="B300"), "nodePools[0].gpu"),
            (_doc(nodes=0), "nodePools[0].nodes must be a finite number > 0"),
            (_doc(nodes="2"), "nodePools[0].nodes must be an integer"),
            (_doc(nicGbps=-1), "nodePools[0].nicGbps must be a finite number > 0"),
            (_doc(nicGbps=float("nan")), "nodePools[0].nicGbps must be a finite number > 0, got nan"),
            (_doc(pricePerGpuHour=float("inf")), "nodePools[0].pricePerGpuHour must be a finite number > 0"),
            (
                {**_doc(), "network": {"latencyUs": float("nan")}},
                "network.latencyUs must be a finite number >= 0",
            ),
            ({**_doc(), "network": 5}, "fleet.network must be a mapping"),
            ({"name": "t", "nodePools": [{"name": "a", "gpu": "T4-16GB", "nodes": 1}] * 2}, "used twice"),
        ],
    )
    def test_errors_name_the_field(self, doc, needle):
        with pytest.raises(FleetError) as info:
            parse_fleet(doc)
        assert needle in str(info.value)


class TestResourceProfile:
    def test_every_pair_linked_by_slower_nic(self):
        fleet = load_fleet(MIXED)
        prof = {n["node_id"]: n for n in datasheet_profile(fleet)["nodes"]}
        assert len(prof) == 10
        nic = {n.name: n.nic_gbps for n in fleet.nodes}
        for a, b in itertools.permutations(nic, 2):
            assert prof[a]["interconnect"][b]["bandwidth_gbps"] == min(nic[a], nic[b])
            assert prof[a]["interconnect"][b]["latency_us"] == 10.0
        assert all(a not in prof[a]["interconnect"] for a in prof)

    def test_compute_score_relative_to_h100(self):
        fleet = parse_fleet(
            {
                "name": "t",
                "nodePools": [
                    {"name": "h", "gpu": "H100-80GB", "nodes": 1},
                    {"name": "a", "gpu": "A100-40GB", "nodes": 1, "gpusPerNode": 2},
                ],
            }
        )
        prof = {n["node_id"]: n for n in datasheet_profile(fleet)["nodes"]}
        assert prof["gpu-h-0"]["compute_score"] == 1.0
        # Datasheets: A100 312 and H100 989 dense bf16 TFLOPS; the PD guide's 0.85 TP efficiency for 2 cards
        # (docs/sources.md#gpu-prior).
        assert math.isclose(prof["gpu-a-0"]["compute_score"], 2 * 312 / 989 * 0.85, rel_tol=1e-5)
        assert prof["gpu-a-0"]["memory_gb"] == 80
        assert prof["gpu-a-0"]["generation"] == "ampere"

    @pytest.mark.parametrize(("mem", "mb"), [(80, 16), (40, 16), (39.9, 8), (24, 8), (16, 4)])
    def test_max_micro_batch_thresholds(self, mem, mb):
        assert max_micro_batch(mem) == mb


def test_a_misspelled_field_is_an_error_not_a_silent_default():
    import pytest

    from gearshift.facts.fleet import FleetError, parse_fleet

    doc = {"name": "t", "nodePools": [{"name": "a", "gpu": "A10-24GB", "nodes": 1, "gpusPerNod": 4}]}
    with pytest.raises(FleetError, match=r"nodePools\[0\]: unknown field\(s\) gpusPerNod"):
        parse_fleet(doc)
    with pytest.raises(FleetError, match=r"nodePools\[0\]\.nodes must be an integer, got 'two'"):
        parse_fleet({"name": "t", "nodePools": [{"name": "a", "gpu": "A10-24GB", "nodes": "two"}]})


def test_a_fleet_file_that_is_not_yaml_names_the_line(tmp_path):
    bad = tmp_path / "fleet.yaml"
    bad.write_text("nodes: [a\n  b: c\n")
    with pytest.raises(FleetError, match=r"not valid YAML at line 2, column 4"):
        load_fleet(bad)
