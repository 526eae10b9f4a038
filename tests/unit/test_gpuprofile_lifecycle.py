"""GPU profiling's pure parts: GPU node detection, fleet classes, labels, overrides, when to probe, what a
finished Job means, and the status after each step. Probe documents come from the real simulated probe."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from gearshift.api.common import find_condition
from gearshift.api.gpuprofile import GPUProfileStatus, ProbeInfo, ProfileOverride
from gearshift.api.probedoc import compact
from gearshift.dev.sandbox.nodes import gpu_node_manifest
from gearshift.facts.errors import SettingsError
from gearshift.facts.fleet import load_fleet
from gearshift.facts.gpus import GPU_SPECS, compute_score
from gearshift.k8s.names import NODE_COMPUTE_CLASS, NODE_GPU_MODEL, NODE_MEMORY_GIB, NODE_PROFILED
from gearshift.probe.run import TINY
from gearshift.probe.simulated import simulated_probe
from gearshift.profiling.lifecycle import (
    ProbeStart,
    backoff_s,
    complete_step,
    dump_status,
    job_create_failed,
    mark_stale,
    node_gone_message,
    node_gone_step,
    probe_due,
    probe_failed,
    probe_finished,
    probe_start,
    probe_succeeded,
    ready_override_step,
    running_job,
    start_probe,
)
from gearshift.profiling.outcome import JobOutcome, job_outcome
from gearshift.profiling.profiles import (
    GpuNodeView,
    SelectorError,
    apply_override,
    card_score,
    classify,
    datasheet_interconnect,
    labels_patch,
    node_labels,
    node_view,
    parse_selector,
)
from gearshift.profiling.settings import ProbeSettings
from gearshift.profiling.steps import Step

REPO = __import__("pathlib").Path(__file__).resolve().parents[2]
T0 = datetime(2025, 1, 31, 18, 0, 0, tzinfo=UTC)
KINDS = {"simulated"}


def fleet_nodes() -> list[dict[str, Any]]:
    fleet = load_fleet(REPO / "examples" / "fleets/mixed.yaml")
    return [gpu_node_manifest(n, i, 7) for i, n in enumerate(fleet.nodes)]


def view(name: str = "gpu-h100-0") -> GpuNodeView:
    body = next(n for n in fleet_nodes() if n["metadata"]["name"] == name)
    v = node_view(body)
    assert v is not None
    return v


def sim_doc(node: GpuNodeView) -> dict[str, Any]:
    """The compact document the real simulated probe writes to its termination log for ``node``."""
    doc = simulated_probe(
        node.annotations,
        arch=TINY,
        seq_len=64,
        batches=(1, 2),
        gpu_count=node.gpu_count,
        node=node.name,
        now=T0,
    )
    return compact(doc)


def job_pod(exit_code: int | None, message: str = "", reason: str = "", waiting: str = "") -> dict[str, Any]:
    state: dict[str, Any]
    if waiting:
        state = {"waiting": {"reason": waiting, "message": "pull access denied"}}
    elif exit_code is None:
        state = {"running": {"startedAt": "2025-01-31T18:00:01Z"}}
    else:
        state = {"terminated": {"exitCode": exit_code, "message": message, "reason": reason or "Completed"}}
    return {
        "metadata": {"name": "p", "creationTimestamp": "2025-01-31T18:00:00Z"},
        "status": {"containerStatuses": [{"name": "probe", "state": state}]},
    }


JOB: dict[str, Any] = {"metadata": {"name": "j"}, "status": {}}


def outcome(pods: list[dict[str, Any]], job: dict[str, Any] | None = JOB, **kw: Any) -> JobOutcome:
    args: dict[str, Any] = {
        "started": T0,
        "now": T0 + timedelta(seconds=5),
        "deadline_s": 600,
        "expected_kinds": KINDS,
    }
    return job_outcome(job, pods, **{**args, **kw})


class TestGpuNodeView:
    def test_gpu_node_from_sandbox_manifest(self) -> None:
        v = view("gpu-a100-1")
        assert (v.gpu_count, v.product) == (1, GPU_SPECS["A100-40GB"].product)
        assert v.gpu_key == f"{GPU_SPECS['A100-40GB'].product}x1"
        assert v.annotations["gearshift.io/gpu-model"] == "A100-40GB"

    def test_node_without_gpu_capacity_is_not_a_gpu_node(self) -> None:
        body = {"metadata": {"name": "cpu-0"}, "status": {"capacity": {"cpu": "16"}}}
        assert node_view(body) is None

    def test_selector_restricts_gpu_nodes(self) -> None:
        body = fleet_nodes()[0]
        assert node_view(body, parse_selector("gearshift.io/node-pool=h100")) is not None
        assert node_view(body, parse_selector("gearshift.io/node-pool!=h100")) is None
        assert node_view(body, parse_selector("!nvidia.com/gpu.present")) is None
        assert node_view(body, parse_selector("nvidia.com/gpu.present")) is not None

    def test_reprobe_annotation_is_the_token(self) -> None:
        body = fleet_nodes()[0]
        body["metadata"]["annotations"]["gearshift.io/reprobe"] = "2"
        v = node_view(body)
        assert v is not None and v.reprobe_token == "2"

    @pytest.mark.parametrize("text", ["a in (b)", "bad key=x", "=v"])
    def test_bad_selector_names_the_forms(self, text: str) -> None:
        with pytest.raises(SelectorError, match="key=value"):
            parse_selector(text)


class TestClassify:
    def test_mixed_fleet_classes_follow_datasheet_gaps(self) -> None:
        scores = {m: compute_score(m) for m in ("H100-80GB", "A100-40GB", "A10-24GB", "T4-16GB")}
        assert classify(scores) == {
            "H100-80GB": "high",
            "A100-40GB": "mid",
            "A10-24GB": "low",
            "T4-16GB": "low",
        }

    def test_classes_are_monotone_in_score(self) -> None:
        scores = {m: compute_score(m) for m in GPU_SPECS}
        rank = {"low": 0, "mid": 1, "high": 2}
        got = classify(scores)
        ordered = sorted(scores, key=scores.__getitem__)
        assert [rank[got[m]] for m in ordered] == sorted(rank[got[m]] for m in ordered)

    def test_noise_within_a_model_does_not_split_a_class(self) -> None:
        got = classify({"h1": 0.71, "h2": 0.69, "h3": 0.70, "a1": 0.22, "a2": 0.21})
        assert got == {"h1": "high", "h2": "high", "h3": "high", "a1": "low", "a2": "low"}

    def test_near_equal_cards_share_a_class(self) -> None:
        sxm, pcie = compute_score("H100-80GB"), compute_score("H100-PCIE-80GB")
        assert classify({"sxm": sxm, "pcie": pcie}) == {"sxm": "high", "pcie": "high"}

    def test_kmeans_is_optimal_against_brute_force(self) -> None:
        # Every 3-way split of 6 sorted log-scores: the chosen one must have the least within-cluster SSE.
        scores = {"a": 1.0, "b": 0.9, "c": 0.3, "d": 0.28, "e": 0.05, "f": 0.045}
        got = classify(scores, min_ratio=1.0)
        logs = sorted((math.log(v), k) for k, v in scores.items())

        def sse(group: list[float]) -> float:
            mu = sum(group) / len(group)
            return sum((x - mu) ** 2 for x in group)

        best = min(
            (
                sse([x for x, _ in logs[:i]])
                + sse([x for x, _ in logs[i:j]])
                + sse([x for x, _ in logs[j:]]),
                i,
                j,
            )
            for i in range(1, 5)
            for j in range(i + 1, 6)
        )
        _, i, j = best
        expect = (
            {k: "low" for _, k in logs[:i]}
            | {k: "mid" for _, k in logs[i:j]}
            | {k: "high" for _, k in logs[j:]}
        )
        assert got == expect

    def test_edge_cases(self) -> None:
        assert classify({}) == {}
        assert classify({"only": 0.3}) == {"only": "high"}
        assert classify({"x": 0.0, "y": float("nan"), "z": 0.5}) == {"z": "high"}

    def test_card_score_divides_multi_card_nodes(self) -> None:
        st = GPUProfileStatus(compute_score=8 * 0.85 * 0.066, gpu_count=8)
        assert card_score(st) == pytest.approx(0.066)
        assert card_score(GPUProfileStatus()) is None


class TestLabelsAndOverrides:
    def ready(self, **kw: Any) -> GPUProfileStatus:
        base = {
            "phase": "Ready",
            "gpu_model": "A10-24GB",
            "memory_gib": 23.6,
            "compute_class": "low",
            "probe_time": T0,
        }
        return GPUProfileStatus(**{**base, **kw})

    def test_ready_profile_labels(self) -> None:
        assert node_labels(self.ready()) == {
            NODE_GPU_MODEL: "A10-24GB",
            NODE_COMPUTE_CLASS: "low",
            NODE_MEMORY_GIB: "24",
            NODE_PROFILED: "true",
        }

    @pytest.mark.parametrize("phase", ["Failed", "Stale", "Pending", None])
    def test_no_labels_unless_ready(self, phase: str | None) -> None:
        assert set(node_labels(self.ready(phase=phase)).values()) == {None}

    def test_no_labels_without_class(self) -> None:
        assert set(node_labels(self.ready(compute_class=None)).values()) == {None}

    def test_patch_only_what_differs(self) -> None:
        want = node_labels(self.ready())
        current = {NODE_GPU_MODEL: "A10-24GB", NODE_COMPUTE_CLASS: "mid", "other": "x"}
        assert labels_patch(current, want) == {
            NODE_COMPUTE_CLASS: "low",
            NODE_MEMORY_GIB: "24",
            NODE_PROFILED: "true",
        }

    def test_override_wins_and_is_listed(self) -> None:
        ov = ProfileOverride.model_validate({"memoryGiB": 20.0, "computeClass": "mid"})
        eff, pinned = apply_override(self.ready(source="probe"), ov)
        assert (eff.memory_gib, eff.compute_class, eff.source) == (20.0, "mid", "override")
        assert pinned == ["computeClass", "memoryGiB"] == eff.overridden

    def test_datasheet_interconnect_uses_slower_nic(self) -> None:
        nodes = [node_view(n) for n in fleet_nodes()]
        h100 = view("gpu-h100-0")
        links = {x["peer"]: x for x in datasheet_interconnect(h100, [n for n in nodes if n], 256)}
        assert "gpu-h100-0" not in links
        assert links["gpu-h100-1"]["bandwidthGbps"] == 200
        assert links["gpu-a10-0"]["bandwidthGbps"] == 25
        assert links["gpu-a10-0"]["latencyUs"] == 10

    def test_datasheet_interconnect_of_a_fleet_past_the_limit_is_empty(self) -> None:
        """Not the first ``limit`` peers by name (an arbitrary part of a large fleet, 16 KB per profile at
        1,000 nodes): none, and the planner's fallback computes every pair from the same annotations."""
        nodes = [n for n in (node_view(x) for x in fleet_nodes()) if n]
        h100 = view("gpu-h100-0")
        peers = len([n for n in nodes if n.name != h100.name])
        assert len(datasheet_interconnect(h100, nodes, peers)) == peers
        assert datasheet_interconnect(h100, nodes, peers - 1) == []


class TestJobOutcome:
    def test_valid_simulated_document_succeeds(self) -> None:
        doc = sim_doc(view())
        out = outcome([job_pod(0, json.dumps(doc))])
        assert out.state == "succeeded" and out.doc is not None and out.doc["gpuModel"] == "H100-80GB"

    def test_wrong_kind_is_refused(self) -> None:
        out = outcome([job_pod(0, json.dumps(sim_doc(view())))], expected_kinds={"cuda"})
        assert (out.state, out.reason) == ("failed", "GarbageOutput")
        assert "simulated" in out.message

    @pytest.mark.parametrize("message", ["not json at all", '{"schemaVersion": 1, "probe": "device"}', ""])
    def test_garbage_output(self, message: str) -> None:
        out = outcome([job_pod(0, message)])
        assert (out.state, out.reason) == ("failed", "GarbageOutput")

    def test_reported_error(self) -> None:
        msg = json.dumps(
            {"schemaVersion": 1, "probe": "device", "error": "SimulatedDeviceError: bad annotation"}
        )
        out = outcome([job_pod(1, msg)])
        assert (out.state, out.reason) == ("failed", "ProbeError")
        assert "bad annotation" in out.message

    def test_crash_with_log_tail(self) -> None:
        out = outcome([job_pod(139, "Segmentation fault", reason="Error")])
        assert (out.state, out.reason) == ("failed", "ProbeCrashed")
        assert "139" in out.message and "Segmentation" in out.message

    def test_oom(self) -> None:
        out = outcome([job_pod(137, "", reason="OOMKilled")])
        assert (out.state, out.reason) == ("failed", "OOMKilled")

    def test_image_pull_failure_deletes_the_job(self) -> None:
        out = outcome([job_pod(None, waiting="ImagePullBackOff")])
        assert (out.state, out.reason, out.delete_job) == ("failed", "ImagePullFailed", True)

    def test_deadline_exceeded_says_unschedulable(self) -> None:
        job = {"status": {"conditions": [{"type": "Failed", "status": "True", "reason": "DeadlineExceeded"}]}}
        pod = {
            "metadata": {"creationTimestamp": "x"},
            "status": {
                "conditions": [{"type": "PodScheduled", "status": "False", "message": "0/3 nodes: GPUs"}]
            },
        }
        out = outcome([pod], job=job)
        assert (out.state, out.reason) == ("failed", "Timeout")
        assert "never scheduled" in out.message and "GPUs" in out.message

    def test_running_then_own_timeout(self) -> None:
        assert outcome([job_pod(None)]).state == "running"
        late = outcome([job_pod(None)], now=T0 + timedelta(seconds=700))
        assert (late.state, late.reason, late.delete_job) == ("failed", "Timeout", True)

    def test_missing_job(self) -> None:
        assert outcome([], job=None).reason == "JobLost"


class TestTransitions:
    def succeed(self, status: GPUProfileStatus, node: GpuNodeView, **kw: Any) -> GPUProfileStatus:
        args: dict[str, Any] = {
            "override": None,
            "interconnect": [],
            "now": T0 + timedelta(seconds=3),
            "generation": 1,
            "reprobe_interval_s": 3600,
        }
        return probe_succeeded(status, node, sim_doc(node), **{**args, **kw}).status

    def test_first_probe_due_then_probing(self) -> None:
        node = view()
        st = GPUProfileStatus()
        assert probe_due(st, node, None, T0) == "Initial"
        step = start_probe(st, node, why="Initial", job_name="j1", now=T0, generation=1)
        assert step.status.phase == "Probing" and step.status.probe is not None
        assert step.status.probe.job == "j1"
        assert find_condition(step.status.conditions, "Ready").status == "False"  # type: ignore[union-attr]
        assert [e.reason for e in step.events] == ["ProbeStarted"]

    def test_success_fills_status_from_the_document(self) -> None:
        node = view("gpu-a100-0")
        st = self.succeed(
            start_probe(GPUProfileStatus(), node, why="Initial", job_name="j", now=T0, generation=1).status,
            node,
        )
        spec = GPU_SPECS["A100-40GB"]
        assert st.phase == "Ready" and st.source == "datasheet"
        assert st.gpu_model == "A100-40GB" and st.memory_gib == spec.memory_gib
        assert st.compute_score == pytest.approx(
            spec.bf16_tflops / GPU_SPECS["H100-80GB"].bf16_tflops, rel=1e-5
        )
        assert st.probe is not None and st.probe.attempts == 0 and st.probe.gpu_key == node.gpu_key
        assert st.probe.next_time == T0 + timedelta(seconds=3 + 3600)
        assert find_condition(st.conditions, "Ready").status == "True"  # type: ignore[union-attr]
        assert probe_due(st, node, None, T0 + timedelta(seconds=10)) is None
        assert probe_due(st, node, None, T0 + timedelta(seconds=3700)) == "Scheduled"

    def test_failures_back_off_exponentially_and_stay_unlabelled(self) -> None:
        node = view()
        st = GPUProfileStatus()
        delays = []
        for i in range(5):
            st = start_probe(st, node, why="x", job_name=f"j{i}", now=T0, generation=1).status
            step = probe_failed(
                st,
                JobOutcome("failed", "Timeout", "too slow"),
                now=T0,
                generation=1,
                backoff_base_s=10,
                backoff_max_s=100,
            )
            st = step.status
            assert st.probe is not None and st.probe.next_time is not None
            delays.append((st.probe.next_time - T0).total_seconds())
            assert [e.type for e in step.events] == ["Warning"]
        assert delays == [10, 20, 40, 80, 100]
        assert st.phase == "Failed" and st.probe is not None and st.probe.failure_reason == "Timeout"
        cond = find_condition(st.conditions, "Probed")
        assert cond is not None and (cond.status, cond.reason) == ("False", "Timeout")
        assert set(node_labels(st).values()) == {None}
        assert probe_due(st, node, None, T0 + timedelta(seconds=99)) is None
        assert probe_due(st, node, None, T0 + timedelta(seconds=100)) == "Retry"

    def test_failure_after_success_keeps_the_good_data(self) -> None:
        node = view()
        st = self.succeed(GPUProfileStatus(), node)
        st = probe_failed(
            st,
            JobOutcome("failed", "OOMKilled", "oom"),
            now=T0,
            generation=1,
            backoff_base_s=1,
            backoff_max_s=2,
        ).status
        assert st.phase == "Ready" and st.gpu_model == "H100-80GB"
        assert find_condition(st.conditions, "Ready").status == "True"  # type: ignore[union-attr]
        assert find_condition(st.conditions, "Probed").reason == "OOMKilled"  # type: ignore[union-attr]

    def test_reprobe_annotation_and_gpu_change(self) -> None:
        node = view()
        st = self.succeed(
            start_probe(GPUProfileStatus(), node, why="Initial", job_name="j", now=T0, generation=1).status,
            node,
        )
        asked = GpuNodeView(
            node.name,
            node.gpu_count,
            node.product,
            node.labels,
            {**node.annotations, "gearshift.io/reprobe": "1"},
        )
        assert probe_due(st, asked, None, T0) == "Requested"
        st2 = start_probe(st, asked, why="Requested", job_name="j2", now=T0, generation=1).status
        st2 = self.succeed(st2, asked)
        assert probe_due(st2, asked, None, T0) is None  # one annotation value, one probe
        changed = GpuNodeView(node.name, 2, node.product, node.labels, node.annotations)
        assert probe_due(st, changed, None, T0) == "GpuChanged"

    def test_stale_node_gone(self) -> None:
        node = view()
        st = self.succeed(GPUProfileStatus(), node)
        step = mark_stale(st, "NodeGone", "gone", now=T0, generation=1)
        assert step.status.phase == "Stale" and step.status.compute_class is None
        assert [e.reason for e in step.events] == ["NodeGone"]
        assert set(node_labels(step.status).values()) == {None}
        assert probe_due(step.status, node, None, T0) == "NodeBack"

    def test_override_removed_triggers_a_probe(self) -> None:
        node = view()
        ov = ProfileOverride.model_validate({"memoryGiB": 10.0})
        st = self.succeed(GPUProfileStatus(), node, override=ov)
        assert st.memory_gib == 10.0 and st.overridden == ["memoryGiB"] and st.source == "override"
        assert probe_due(st, node, ov, T0) is None
        assert probe_due(st, node, None, T0) == "OverrideRemoved"

    def test_dump_status_clears_unset_fields(self) -> None:
        body = dump_status(GPUProfileStatus(phase="Failed", probe=ProbeInfo(attempts=1)))
        assert body["phase"] == "Failed" and body["gpuModel"] is None and body["probe"]["attempts"] == 1


class TestSettings:
    def test_defaults_and_sandbox(self) -> None:
        s = ProbeSettings.from_env({})
        assert s.expected_kinds == {"cuda"} and not s.job.sandbox and s.job.namespace == "gearshift-system"
        sb = ProbeSettings.from_env({"GEARSHIFT_SANDBOX": "1", "GEARSHIFT_NAMESPACE": "ops"})
        assert sb.expected_kinds == {"simulated"} and sb.job.sandbox and sb.job.namespace == "ops"

    @pytest.mark.parametrize(
        ("env", "fragment"),
        [
            ({"GEARSHIFT_REPROBE_INTERVAL_S": "daily"}, "GEARSHIFT_REPROBE_INTERVAL_S"),
            ({"GEARSHIFT_PROBE_KINDS": "tpu"}, "GEARSHIFT_PROBE_KINDS"),
            ({"GEARSHIFT_GPU_NODE_SELECTOR": "a in (b)"}, "GEARSHIFT_GPU_NODE_SELECTOR"),
            ({"GEARSHIFT_PROBE_BACKOFF_S": "0"}, "back-off"),
            ({"GEARSHIFT_PROBE_NAMESPACE": "Bad"}, "namespace"),
        ],
    )
    def test_bad_values_name_the_variable(self, env: dict[str, str], fragment: str) -> None:
        with pytest.raises(SettingsError, match=fragment):
            ProbeSettings.from_env(env)

    def test_backoff(self) -> None:
        assert [backoff_s(n, 30, 1800) for n in (1, 2, 3, 7, 20)] == [30, 60, 120, 1800, 1800]


class TestTimerStep:
    """The decisions of one timer step (:mod:`gearshift.handlers.gpuprofile` does the calls between)."""

    S = ProbeSettings(backoff_base_s=8, backoff_max_s=64, reprobe_interval_s=600, expected_kinds=KINDS)

    def probing(self, node: GpuNodeView, job: str = "j1") -> GPUProfileStatus:
        return start_probe(GPUProfileStatus(), node, why="Initial", job_name=job, now=T0, generation=1).status

    def ready(self, node: GpuNodeView) -> GPUProfileStatus:
        st = self.probing(node)
        return probe_succeeded(
            st,
            node,
            sim_doc(node),
            override=None,
            interconnect=[],
            now=T0,
            generation=1,
            reprobe_interval_s=0,
        ).status

    def finished(
        self, status: GPUProfileStatus, node: GpuNodeView, out: JobOutcome, **kw: Any
    ) -> Step | None:
        args: dict[str, Any] = {"override": None, "peers": [node], "now": T0, "generation": 2}
        return probe_finished(status, node, out, settings=self.S, **{**args, **kw})

    def test_running_job_only_while_probing(self) -> None:
        node = view()
        assert running_job(self.probing(node, "gsprobe-x")) == "gsprobe-x"
        assert running_job(GPUProfileStatus(phase="Probing")) is None
        ready = self.ready(node)
        assert ready.probe is not None and ready.probe.job == "j1"  # the last Job stays recorded
        assert running_job(ready) is None

    def test_node_gone_is_marked_once(self) -> None:
        step = node_gone_step(self.ready(view()), "gpu-h100-0", now=T0, generation=3)
        assert step is not None and step.status.phase == "Stale"
        cond = find_condition(step.status.conditions, "Stale")
        assert cond is not None and (cond.status, cond.reason) == ("True", "NodeGone")
        assert step.status.message == node_gone_message("gpu-h100-0")
        assert [(e.type, e.reason) for e in step.events] == [("Warning", "NodeGone")]
        assert node_gone_step(step.status, "gpu-h100-0", now=T0, generation=3) is None
        # Stale for another reason: the node going is still recorded.
        changed = mark_stale(self.ready(view()), "GpuChanged", "x", now=T0, generation=1).status
        again = node_gone_step(changed, "gpu-h100-0", now=T0, generation=3)
        assert again is not None
        assert find_condition(again.status.conditions, "Stale").reason == "NodeGone"  # type: ignore[union-attr]

    def test_probe_finished_running_success_and_failure(self) -> None:
        node, peer = view("gpu-h100-0"), view("gpu-a10-0")
        st = self.probing(node)
        assert self.finished(st, node, JobOutcome("running")) is None
        ok = self.finished(st, node, JobOutcome("succeeded", doc=sim_doc(node)), peers=[node, peer])
        assert ok is not None and ok.status.phase == "Ready"
        assert ok.status.probe is not None and ok.status.probe.next_time == T0 + timedelta(seconds=600)
        # The datasheet link: the A10's 25 Gb/s NIC bounds it (the fleet file's numbers).
        assert [(i.peer, i.bandwidth_gbps) for i in ok.status.interconnect] == [("gpu-a10-0", 25)]
        bad = self.finished(st, node, JobOutcome("failed", "OOMKilled", "oom"))
        assert bad is not None and bad.status.phase == "Failed"
        assert bad.status.probe is not None and bad.status.probe.next_time == T0 + timedelta(seconds=8)
        assert [e.reason for e in bad.events] == ["ProbeFailed"]

    def test_a_refused_document_is_garbage_output(self) -> None:
        node = view()
        step = self.finished(self.probing(node), node, JobOutcome("succeeded", doc={"schemaVersion": 99}))
        assert step is not None and step.status.phase == "Failed"
        assert step.status.probe is not None and step.status.probe.failure_reason == "GarbageOutput"
        assert "schemaVersion" in (step.status.message or "")

    def test_probe_start_initial_not_due_and_gpu_changed(self) -> None:
        node = view()
        fresh = GPUProfileStatus()
        assert probe_start(fresh, node, None, now=T0, generation=1) == ProbeStart("Initial", fresh)
        ready = self.ready(node)
        assert probe_start(ready, node, None, now=T0, generation=1) is None
        two = GpuNodeView(node.name, 2, node.product, node.labels, node.annotations)
        start = probe_start(ready, two, None, now=T0, generation=4)
        assert start is not None and start.why == "GpuChanged" and start.stale is not None
        assert start.base == start.stale.status and start.base.phase == "Stale"
        assert start.base.message == f"the node's GPU changed from {node.gpu_key} to {two.gpu_key}"
        assert [(e.type, e.reason) for e in start.stale.events] == [("Warning", "GpuChanged")]
        # Already Stale: probed again without a second Stale step.
        again = probe_start(start.base, two, None, now=T0, generation=4)
        assert again == ProbeStart("GpuChanged", start.base)

    def test_job_create_failed_is_a_failed_attempt(self) -> None:
        step = job_create_failed(
            GPUProfileStatus(), "403 Forbidden" + "x" * 700, now=T0, generation=1, settings=self.S
        )
        info = step.status.probe
        assert step.status.phase == "Failed" and info is not None
        assert (info.failure_reason, info.attempts, info.next_time) == (
            "JobCreateFailed",
            1,
            T0 + timedelta(seconds=8),
        )
        cond = find_condition(step.status.conditions, "Probed")
        assert cond is not None and cond.message.startswith("cannot create the probe Job: 403 Forbidden")
        # The outcome's message is cut at 600 characters before the attempt note is added.
        assert (
            cond.message
            == "cannot create the probe Job: 403 Forbidden" + "x" * 558 + " (attempt 1; retry in 8 s)"
        )

    def test_ready_override_step(self) -> None:
        ready = self.ready(view())
        ov = ProfileOverride.model_validate({"memoryGiB": 12.0})
        step = ready_override_step(ready, ov)
        assert step is not None and (step.status.memory_gib, step.status.overridden) == (12.0, ["memoryGiB"])
        assert step.events == []
        assert ready_override_step(step.status, ov) is None
        assert ready_override_step(ready, None) is None
        assert ready_override_step(GPUProfileStatus(phase="Failed"), ov) is None

    def test_complete_step_adds_window_and_class(self) -> None:
        node = view()
        ready = self.ready(node)
        assert ready.compute_class is None
        assert complete_step(None, ready, node, None, None, now=T0, generation=1) is None
        classed = complete_step(None, ready, node, None, "mid", now=T0, generation=1)
        assert classed is not None and classed.status.compute_class == "mid" and classed.events == []
        assert ready.compute_class is None  # a copy
        pinned = ProfileOverride.model_validate({"computeClass": "low"})
        step = complete_step(None, ready, node, pinned, "high", now=T0, generation=1)
        assert step is not None and step.status.compute_class == "low"
        # A window on the node: its event comes after the step's own.
        windowed = GpuNodeView(
            node.name, 1, node.product, node.labels, {"gearshift.io/available-until": "2025-02-01T00:00:00Z"}
        )
        first = Step(ready.model_copy(deep=True), [])
        first.events.append(probe_failed(ready, JobOutcome("failed", "X", "y"), now=T0, generation=1,
                                         backoff_base_s=1, backoff_max_s=1).events[0])  # fmt: skip
        out = complete_step(first, ready, windowed, None, None, now=T0, generation=1)
        assert out is not None and [e.reason for e in out.events] == ["ProbeFailed", "AvailableUntil"]
        assert out.status.available_until == datetime(2025, 2, 1, tzinfo=UTC)
        assert len(first.events) == 1  # the step passed in is left as it was
        # No node (gone): no window, and a Stale profile gets no class.
        gone = node_gone_step(ready, node.name, now=T0, generation=1)
        assert gone is not None
        assert complete_step(gone, ready, None, None, "high", now=T0, generation=1) == gone
