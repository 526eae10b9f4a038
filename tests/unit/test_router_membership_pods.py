"""The router's loopback fallback: EndpointSlice-shaped dicts built from role Services and their pods."""

from __future__ import annotations

from typing import Any

import pytest

from gearshift.router.membership import (
    SERVICE_NAME_LABEL,
    infos_from_slices,
    merge_slices,
    slices_from_pods,
)


def service(name: str, selector: dict[str, str], target: Any = "http") -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "spec": {"selector": selector, "ports": [{"name": "http", "port": 8000, "targetPort": target}]},
    }


def pod(
    name: str,
    labels: dict[str, str],
    ip: str | None = "127.9.1.2",
    ready: bool = True,
    phase: str = "Running",
) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "ns", "labels": labels},
        "spec": {
            "nodeName": "gpu-h100-0",
            "containers": [{"ports": [{"name": "http", "containerPort": 8001}]}],
        },
        "status": {
            "phase": phase,
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


HEAD = {"gearshift.io/role": "decode", "gearshift.io/gear": "latency", "gearshift.io/stage": "0"}


class TestSlicesFromPods:
    def test_selected_running_pods_become_endpoints_with_resolved_port(self) -> None:
        [sl] = slices_from_pods(
            [service("s-decode", HEAD)],
            [
                pod("a", HEAD),
                pod("b", {**HEAD, "gearshift.io/gear": "balanced"}),  # another gear: not selected
                pod("c", HEAD, ip=None),  # no IP yet
                pod("d", HEAD, phase="Pending"),
            ],
        )
        assert sl["metadata"]["labels"] == {SERVICE_NAME_LABEL: "s-decode"}
        assert sl["ports"] == [{"name": "http", "port": 8001}]
        assert [e["targetRef"]["name"] for e in sl["endpoints"]] == ["a"]
        assert sl["endpoints"][0]["addresses"] == ["127.9.1.2"]
        assert sl["endpoints"][0]["nodeName"] == "gpu-h100-0"

    def test_not_ready_pods_are_listed_not_ready_and_numeric_target_ports_kept(self) -> None:
        [sl] = slices_from_pods([service("s-decode", HEAD, target=8000)], [pod("a", HEAD, ready=False)])
        assert sl["endpoints"][0]["conditions"] == {"ready": False}
        assert sl["ports"] == [{"name": "http", "port": 8000}]

    def test_service_without_selector_selects_nothing(self) -> None:
        [sl] = slices_from_pods([service("s-decode", {})], [pod("a", HEAD)])
        assert sl["endpoints"] == []

    def test_built_slices_feed_the_same_backend_builder(self) -> None:
        slices = slices_from_pods([service("s-decode", HEAD)], [pod("a", HEAD)])
        [info] = infos_from_slices(slices, {"s-decode": "decode"}, {}, {})
        assert (info.name, info.role, info.url) == ("a", "decode", "http://127.9.1.2:8001")

    def test_unreadable_node_falls_back_to_the_pipeline_head_card(self) -> None:
        # The router's namespaced Role cannot read nodes: no node facts, only the pod's GEARSHIFT_PIPELINE.
        slices = slices_from_pods([service("s-decode", HEAD)], [pod("a", HEAD)])
        pipe = '{"stages": [{"layers": [0, 16], "gpu": "T4-16GB", "gpus": 2}]}'
        [info] = infos_from_slices(slices, {"s-decode": "decode"}, {}, {"a": {"GEARSHIFT_PIPELINE": pipe}})
        assert (info.gpu_model, info.gpu_count, info.tp_size) == ("T4-16GB", 2, 2)
        # T4 HBM 320 GB/s over H100 SXM's 3350, × 2 cards (membership's decode speed)
        assert info.speed == pytest.approx(320 / 3350 * 2)
        # node facts, when readable, win
        [info] = infos_from_slices(
            slices, {"s-decode": "decode"}, {"gpu-h100-0": {"gpuModel": "H100-80GB"}},
            {"a": {"GEARSHIFT_PIPELINE": pipe}},
        )  # fmt: skip
        assert (info.gpu_model, info.gpu_count) == ("H100-80GB", 1)


class TestMergeSlices:
    def test_pod_slices_only_fill_services_without_endpoints(self) -> None:
        watched = [
            {
                "metadata": {"name": "x1", "labels": {SERVICE_NAME_LABEL: "s-prefill"}},
                "endpoints": [{"a": 1}],
            },
            {"metadata": {"name": "x2", "labels": {SERVICE_NAME_LABEL: "s-decode"}}, "endpoints": None},
        ]
        built = [
            {
                "metadata": {"name": "p1", "labels": {SERVICE_NAME_LABEL: "s-prefill"}},
                "endpoints": [{"b": 1}],
            },
            {"metadata": {"name": "p2", "labels": {SERVICE_NAME_LABEL: "s-decode"}}, "endpoints": [{"c": 1}]},
        ]
        merged = merge_slices(watched, built)
        assert [s["metadata"]["name"] for s in merged] == ["x1", "x2", "p2"]
