"""The probe Job builder: pinning, GPU request, tolerations, ownership, limits, sandbox mode, names."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from gearshift.k8s.names import LABEL_PROBE_NODE, LABEL_SANDBOX_RUN
from gearshift.k8s.probejob import (
    MAX_JOB_NAME,
    ProbeJobConfig,
    ProbeJobError,
    build_probe_job_spec,
    probe_job_name,
    probe_node_label_value,
    tolerations_from_json,
)

OWNER = {"apiVersion": "gearshift.io/v1alpha1", "kind": "GPUProfile", "name": "gpu-h100-0", "uid": "u-1"}
T0 = datetime(2025, 1, 31, 18, 0, 0, tzinfo=UTC)
ANN = {"gearshift.io/gpu-model": "H100-80GB", "gearshift.io/bf16-tflops": "989", "other.io/x": "y"}


def job(**cfg: object) -> dict:
    return build_probe_job_spec(
        node="gpu-h100-0",
        gpu_count=8,
        owner=OWNER,
        job_name=probe_job_name("gpu-h100-0", T0),
        config=ProbeJobConfig(**cfg),  # type: ignore[arg-type]
        node_annotations=ANN,
    )


class TestBuildProbeJob:
    def test_one_attempt_bounded_and_collected(self) -> None:
        spec = job(active_deadline_s=300, ttl_s=120)["spec"]
        assert spec["backoffLimit"] == 0
        assert spec["activeDeadlineSeconds"] == 300
        assert spec["ttlSecondsAfterFinished"] == 120
        assert spec["template"]["spec"]["restartPolicy"] == "Never"

    def test_pinned_to_the_node_by_affinity_not_node_name(self) -> None:
        pod = job()["spec"]["template"]["spec"]
        assert "nodeName" not in pod
        terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert terms["nodeSelectorTerms"] == [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-h100-0"]}]}
        ]

    def test_requests_all_gpus_and_tolerates_gpu_taints(self) -> None:
        extra = {"key": "spot", "operator": "Exists", "effect": "NoSchedule"}
        pod = job(tolerations=(extra,))["spec"]["template"]["spec"]
        c = pod["containers"][0]
        assert c["resources"]["limits"] == {"nvidia.com/gpu": "8"}
        assert c["resources"]["requests"] == {"nvidia.com/gpu": "8"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists"} in pod["tolerations"]
        assert extra in pod["tolerations"]

    def test_result_comes_from_the_termination_message(self) -> None:
        c = job()["spec"]["template"]["spec"]["containers"][0]
        assert c["command"] == ["gearshift-probe"]
        assert c["args"][0] == "device"
        assert c["terminationMessagePath"] == "/dev/termination-log"
        assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"

    def test_owned_by_the_profile(self) -> None:
        meta = job()["metadata"]
        assert meta["ownerReferences"] == [{**OWNER, "controller": True, "blockOwnerDeletion": True}]
        assert meta["namespace"] == "gearshift-system"
        assert meta["labels"][LABEL_PROBE_NODE] == "gpu-h100-0"

    def test_real_cluster_mode_has_no_sandbox_label_and_no_simulation(self) -> None:
        tpl = job()["spec"]["template"]
        assert LABEL_SANDBOX_RUN not in tpl["metadata"]["labels"]
        names = {e["name"] for e in tpl["spec"]["containers"][0]["env"]}
        assert "GEARSHIFT_PROBE_SIMULATED" not in names and "GEARSHIFT_NODE_ANNOTATIONS" not in names

    def test_sandbox_mode_labels_pod_and_passes_gearshift_annotations(self) -> None:
        tpl = job(sandbox=True)["spec"]["template"]
        assert tpl["metadata"]["labels"][LABEL_SANDBOX_RUN] == "true"
        env = {e["name"]: e for e in tpl["spec"]["containers"][0]["env"]}
        assert env["GEARSHIFT_PROBE_SIMULATED"]["value"] == "1"
        assert json.loads(env["GEARSHIFT_NODE_ANNOTATIONS"]["value"]) == {
            "gearshift.io/gpu-model": "H100-80GB",
            "gearshift.io/bf16-tflops": "989",
        }
        assert env["GEARSHIFT_GPU_COUNT"]["value"] == "8"
        assert env["GEARSHIFT_NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}

    @pytest.mark.parametrize(
        ("kwargs", "fragment"),
        [
            ({"gpu_count": 0}, "gpu_count"),
            ({"owner": {**OWNER, "uid": ""}}, "uid"),
            ({"job_name": "x" * 64}, "63"),
        ],
    )
    def test_bad_arguments_name_the_argument(self, kwargs: dict, fragment: str) -> None:
        args = {"node": "n", "gpu_count": 1, "owner": OWNER, "job_name": "j", "config": ProbeJobConfig()}
        with pytest.raises(ProbeJobError, match=fragment):
            build_probe_job_spec(**{**args, **kwargs})

    @pytest.mark.parametrize(
        ("kwargs", "fragment"),
        [
            ({"namespace": "Bad_NS"}, "namespace"),
            ({"active_deadline_s": 0}, "deadline"),
            ({"image": ""}, "image"),
        ],
    )
    def test_bad_config_is_refused(self, kwargs: dict, fragment: str) -> None:
        with pytest.raises(ProbeJobError, match=fragment):
            ProbeJobConfig(**kwargs)  # type: ignore[arg-type]


class TestNames:
    def test_short_node_name_is_kept_and_time_separates_runs(self) -> None:
        a = probe_job_name("gpu-h100-0", T0)
        b = probe_job_name("gpu-h100-0", datetime(2025, 1, 31, 18, 0, 1, tzinfo=UTC))
        assert a.startswith("gsprobe-gpu-h100-0-") and a != b

    def test_long_names_fit_63_and_stay_distinct(self) -> None:
        n1 = "node-" + "a" * 200 + ".example.com"
        n2 = "node-" + "a" * 200 + ".example.org"
        j1, j2 = probe_job_name(n1, T0), probe_job_name(n2, T0)
        assert len(j1) <= MAX_JOB_NAME and len(j2) <= MAX_JOB_NAME
        assert j1 != j2
        assert "." not in j1

    def test_label_value_of_long_node_is_hashed_within_63(self) -> None:
        long = "n" * 100
        v = probe_node_label_value(long)
        assert len(v) <= 63 and v != probe_node_label_value("n" * 101)
        assert probe_node_label_value("short") == "short"


class TestTolerations:
    def test_json_list_parsed(self) -> None:
        assert tolerations_from_json('[{"operator": "Exists"}]') == ({"operator": "Exists"},)

    @pytest.mark.parametrize("text", ["{", "{}", "[1]", '[{"value": "x"}]'])
    def test_bad_tolerations_refused(self, text: str) -> None:
        with pytest.raises(ProbeJobError, match="tolerations"):
            tolerations_from_json(text)
