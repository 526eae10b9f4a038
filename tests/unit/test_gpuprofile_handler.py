"""The GPUProfile and Node handlers over an in-memory KubeApi: which calls a timer step makes (the probe
Job's create, read, delete; the status write; the node's label patch) and what it writes.

The probe documents are the real simulated probe's; statuses are checked against the life cycle's rules
(phase, reasons, back-off), not against the handler's own output."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import kopf
import pytest

from gearshift.adapters.kube import KubeApiError
from gearshift.adapters.memory import FLEET_CLASSES_TTL_S, Recent
from gearshift.api.common import API_VERSION
from gearshift.api.gpuprofile import GPUProfileStatus
from gearshift.api.probedoc import compact
from gearshift.dev.sandbox.nodes import gpu_node_manifest
from gearshift.facts.fleet import load_fleet
from gearshift.handlers import gpuprofile, nodes
from gearshift.k8s.names import NODE_COMPUTE_CLASS, NODE_GPU_MODEL, NODE_MEMORY_GIB, NODE_PROFILED
from gearshift.k8s.probejob import ProbeJobConfig
from gearshift.probe.run import TINY
from gearshift.probe.simulated import simulated_probe
from gearshift.profiling.profiles import GpuNodeView, node_view
from gearshift.profiling.settings import ProbeSettings
from gearshift.testing.kube import FakeKubeApi

REPO = Path(__file__).resolve().parents[2]
T0 = datetime(2025, 1, 31, 18, 0, 0, tzinfo=UTC)
NS = "probes"
NODE = "gpu-h100-0"
LABELS = (NODE_GPU_MODEL, NODE_COMPUTE_CLASS, NODE_MEMORY_GIB, NODE_PROFILED)
SETTINGS = ProbeSettings(
    job=ProbeJobConfig(namespace=NS, sandbox=True),
    backoff_base_s=8,
    backoff_max_s=64,
    reprobe_interval_s=0,
    expected_kinds=frozenset({"simulated"}),
)


class ProfilingApi(FakeKubeApi):
    """The in-memory API, where an apply or an Event fails the test: profiling creates its objects (an
    apply would need a patch permission its Role lacks) and its events go through kopf."""

    def apply(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        raise AssertionError("profiling creates, it does not apply")

    def create_event(self, event: Mapping[str, Any]) -> None:
        raise AssertionError("GPUProfile events go through kopf")

    # helpers
    def profile(self, name: str = NODE) -> dict[str, Any]:
        return copy.deepcopy(self.store[("GPUProfile", None, name)])

    def jobs(self) -> list[dict[str, Any]]:
        return [o for (k, _, _), o in self.store.items() if k == "Job"]


def fleet_node(name: str = NODE) -> dict[str, Any]:
    fleet = load_fleet(REPO / "examples" / "fleets/mixed.yaml")
    return next(
        m
        for m in (gpu_node_manifest(n, i, 7) for i, n in enumerate(fleet.nodes))
        if m["metadata"]["name"] == name
    )


def sim_doc(view: GpuNodeView) -> str:
    doc = simulated_probe(
        view.annotations,
        arch=TINY,
        seq_len=64,
        batches=(1, 2),
        gpu_count=view.gpu_count,
        node=view.name,
        now=T0,
    )
    return json.dumps(compact(doc))


class World:
    """A fake API with one GPU node and its GPUProfile, the operator's Runtime over it (kopf's memo), the
    kopf indices, the clock and the events."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.api = ProfilingApi(probe=SETTINGS)
        self.rt = self.api.runtime
        self.memo = kopf.Memo(runtime=self.rt)
        self.events: list[tuple[str, str, str]] = []
        self.now = T0
        monkeypatch.setattr(
            kopf, "event", lambda body, *, type, reason, message: self.events.append((type, reason, message))
        )
        node = fleet_node()
        self.api.put(node)
        self.api.put(
            {"apiVersion": API_VERSION, "kind": "GPUProfile", "metadata": {"name": NODE, "generation": 1},
             "spec": {"nodeName": NODE}}
        )  # fmt: skip
        view = node_view(self.api.store[("Node", None, NODE)])
        assert view is not None
        self.view = view
        self.gpu_nodes: dict[str, list[GpuNodeView]] = {NODE: [view]}
        self.scores: dict[str, list[float]] = {}
        # The fleet's classes are read at most every FLEET_CLASSES_TTL_S s of this world's clock.
        self.rt.profiles.classes = Recent(FLEET_CLASSES_TTL_S, clock=lambda: self.now.timestamp())

    def step(self) -> None:
        body = self.api.profile()
        self.api.calls.clear()
        self.events.clear()
        gpuprofile._step(
            self.rt,
            NODE,
            body,  # type: ignore[arg-type]
            body["spec"],
            body["metadata"],
            self.gpu_nodes,  # type: ignore[arg-type]
            self.scores,  # type: ignore[arg-type]
            _Logger(),
            self.now,
        )

    def reindex(self) -> None:
        """The ``gpu_nodes`` index as kopf's watch keeps it: the node as stored."""
        view = node_view(self.api.store[("Node", None, NODE)])
        assert view is not None
        self.gpu_nodes = {NODE: [view]}

    def finish_job(self, message: str, exit_code: int = 0) -> None:
        (job,) = self.api.jobs()
        name = job["metadata"]["name"]
        # The Job controller's pod: the template's labels and the job-name label.
        labels = {**job["spec"]["template"]["metadata"]["labels"], "batch.kubernetes.io/job-name": name}
        self.api.put(
            {"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": f"{name}-x", "namespace": NS, "creationTimestamp": "2025-01-31T18:00:01Z",
                          "labels": labels},
             "status": {"containerStatuses": [{"name": "probe", "state": {"terminated": {
                 "exitCode": exit_code, "message": message, "reason": "Completed"}}}]}}
        )  # fmt: skip

    def node_labels(self) -> dict[str, str]:
        return dict(self.api.store[("Node", None, NODE)]["metadata"].get("labels") or {})


class _Logger:
    def info(self, *args: Any) -> None:
        pass


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> World:
    return World(monkeypatch)


def test_a_new_profile_creates_one_probe_job_and_writes_probing(world: World) -> None:
    world.step()
    (job,) = world.api.jobs()
    assert world.api.verbs() == [("create", "Job"), ("patch_status", "GPUProfile")]
    assert job["metadata"]["namespace"] == NS and job["metadata"]["name"].startswith("gsprobe-gpu-h100-0-")
    (owner,) = job["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("GPUProfile", NODE, f"uid-{NODE}")
    st = world.api.profile()["status"]
    assert st["phase"] == "Probing" and st["probe"]["job"] == job["metadata"]["name"]
    assert [r for _, r, _ in world.events] == ["ProbeStarted"]
    # The next tick runs before the watch delivers the write: the remembered status keeps it from a
    # second Job, and a Job still running changes nothing.
    body = world.api.profile()
    body["metadata"]["resourceVersion"] = "0"
    body.pop("status")
    world.api.calls.clear()
    gpuprofile._step(
        world.rt, NODE, body, body["spec"], body["metadata"], world.gpu_nodes, {}, _Logger(), world.now
    )  # type: ignore[arg-type]
    # One listing of every probe Job and probe pod, which every profile's step shares for a second.
    selector = "app.kubernetes.io/component=probe,app.kubernetes.io/managed-by=gearshift"
    assert world.api.calls == [("list", "Job", NS, selector), ("list", "Pod", NS, selector)]
    assert len(world.api.jobs()) == 1


def test_probe_steps_share_one_listing_of_the_probe_jobs(world: World) -> None:
    """1,000 probes in flight made 2,000 calls every 2 s (a GET and a label-selected LIST each); the steps
    of every profile now share two LISTs a second, and a Job created after the listing is read directly."""
    world.step()
    body = world.api.profile()
    world.api.calls.clear()
    for _ in range(3):
        gpuprofile._step(
            world.rt, NODE, body, body["spec"], body["metadata"], world.gpu_nodes, {}, _Logger(), world.now
        )  # type: ignore[arg-type]
    assert world.api.verbs() == [("list", "Job"), ("list", "Pod")]
    world.api.calls.clear()
    job, pods = world.rt.probe_jobs.job(world.api, NS, "gsprobe-made-after-the-listing", {})
    assert (job, pods) == (None, []) and world.api.verbs() == [("get", "Job")]


def test_a_finished_probe_makes_the_profile_ready_and_labels_the_node(world: World) -> None:
    world.step()
    world.finish_job(sim_doc(world.view))
    world.now = T0 + timedelta(seconds=5)
    world.step()
    st = world.api.profile()["status"]
    assert st["phase"] == "Ready" and st["gpuModel"] == "H100-80GB" and st["probe"]["attempts"] == 0
    assert "computeClass" not in st  # the fleet index does not hold it yet: no class, no labels
    assert not any(k in world.node_labels() for k in LABELS)
    assert [r for _, r, _ in world.events] == ["ProbeSucceeded"]
    # With its score in the fleet index the profile is the fleet's one class, high; then labelled, once
    # the fleet's classes are read again (at most FLEET_CLASSES_TTL_S s after the last reading).
    world.scores = {NODE: [1.0]}
    world.step()
    assert world.api.verbs() == []
    world.now += timedelta(seconds=FLEET_CLASSES_TTL_S)
    world.step()
    assert world.api.verbs() == [("patch_status", "GPUProfile"), ("patch", "Node")]
    assert world.api.profile()["status"]["computeClass"] == "high"
    labels = world.node_labels()
    assert (labels[NODE_GPU_MODEL], labels[NODE_COMPUTE_CLASS], labels[NODE_PROFILED]) == (
        "H100-80GB",
        "high",
        "true",
    )
    assert labels[NODE_MEMORY_GIB] == "80"
    # Nothing changed (the index has seen the labels): nothing is written.
    world.reindex()
    world.step()
    assert world.api.verbs() == []


def test_a_stuck_image_pull_deletes_the_job_and_backs_off(world: World) -> None:
    world.step()
    (job,) = world.api.jobs()
    name = job["metadata"]["name"]
    labels = {**job["spec"]["template"]["metadata"]["labels"], "batch.kubernetes.io/job-name": name}
    world.api.put(
        {"apiVersion": "v1", "kind": "Pod",
         "metadata": {"name": f"{name}-x", "namespace": NS, "labels": labels},
         "status": {"containerStatuses": [
             {"name": "probe", "state": {"waiting": {"reason": "ImagePullBackOff"}}}]}}
    )  # fmt: skip
    world.step()
    assert world.api.verbs() == [
        ("list", "Job"),
        ("list", "Pod"),
        ("delete", "Job"),
        ("patch_status", "GPUProfile"),
    ]
    assert world.api.calls[2] == ("delete", "Job", NS, name) and world.api.jobs() == []
    st = world.api.profile()["status"]
    assert st["phase"] == "Failed" and st["probe"]["failureReason"] == "ImagePullFailed"
    assert st["probe"]["nextTime"] == "2025-01-31T18:00:08Z"  # back-off base 8 s after the first failure


def test_a_lost_job_is_a_failure(world: World) -> None:
    world.step()
    world.api.store = {k: v for k, v in world.api.store.items() if k[0] != "Job"}
    world.step()
    assert world.api.profile()["status"]["probe"]["failureReason"] == "JobLost"
    assert ("delete", "Job") not in world.api.verbs()


def test_a_refused_job_is_a_failed_attempt(world: World) -> None:
    world.api.refuse[("create", "Job")] = KubeApiError(
        "POST /apis/batch/v1/namespaces/probes/jobs: 403 Forbidden", 403
    )
    world.step()
    st = world.api.profile()["status"]
    assert st["phase"] == "Failed" and st["probe"]["failureReason"] == "JobCreateFailed"
    assert "cannot create the probe Job: POST /apis/batch/v1/namespaces/probes/jobs: 403" in st["message"]
    assert [(t, r) for t, r, _ in world.events] == [("Warning", "ProbeFailed")]


def test_the_node_going_deletes_the_job_and_marks_stale_once(world: World) -> None:
    world.step()
    (job,) = world.api.jobs()
    world.gpu_nodes = {}  # the node lost its GPUs (it is still there)
    world.api.patch("v1", "Node", None, NODE, {"metadata": {"labels": {NODE_PROFILED: "true"}}})
    world.step()
    assert world.api.verbs() == [
        ("delete", "Job"),
        ("get", "Node"),
        ("patch", "Node"),
        ("patch_status", "GPUProfile"),
    ]
    assert world.api.calls[0] == ("delete", "Job", NS, job["metadata"]["name"])
    assert NODE_PROFILED not in world.node_labels()
    st = world.api.profile()["status"]
    assert st["phase"] == "Stale" and [r for _, r, _ in world.events] == ["NodeGone"]
    world.step()
    assert world.api.verbs() == [] and world.events == []


def test_a_changed_gpu_is_recorded_stale_before_the_new_probe(world: World) -> None:
    world.step()
    world.finish_job(sim_doc(world.view))
    world.step()
    world.api.store = {k: v for k, v in world.api.store.items() if k[0] not in ("Job", "Pod")}
    v = world.view
    world.gpu_nodes = {NODE: [GpuNodeView(v.name, 2, v.product, v.labels, v.annotations)]}
    world.step()
    assert [r for _, r, _ in world.events] == ["GpuChanged", "ProbeStarted"]
    assert world.api.verbs() == [("create", "Job"), ("patch_status", "GPUProfile")]
    st = world.api.profile()["status"]
    assert st["phase"] == "Probing" and st["probe"]["gpuKey"] == v.gpu_key  # the probed GPU until it finishes


def test_the_timer_steps_with_the_runtime_in_kopfs_memo(world: World) -> None:
    body = world.api.profile()
    gpuprofile.gpuprofile_reconcile(
        name=NODE, body=body, spec=body["spec"], meta=body["metadata"], gpu_nodes=world.gpu_nodes,
        profile_scores={}, logger=_Logger(), memo=world.memo,
    )  # type: ignore[arg-type]  # fmt: skip
    assert world.api.verbs() == [("create", "Job"), ("patch_status", "GPUProfile")]
    written = world.rt.profiles.written(NODE)
    assert written is not None and written[1]["phase"] == "Probing"


def test_label_patch_errors(world: World) -> None:
    ready = {"phase": "Ready", "gpuModel": "A", "memoryGiB": 8.0, "computeClass": "low",
             "probeTime": "2025-01-31T18:00:00Z"}  # fmt: skip
    st = GPUProfileStatus.model_validate(ready)
    assert gpuprofile._label_node(world.api, "no-such-node", st, {}, _Logger()) is False  # 404: gone
    world.api.refuse[("patch", "Node")] = KubeApiError("PATCH /api/v1/nodes/x: 403 Forbidden", 403)
    with pytest.raises(kopf.TemporaryError, match="cannot label node gpu-h100-0: PATCH /api/v1/nodes/x: 403"):
        gpuprofile._label_node(world.api, NODE, st, {}, _Logger())


def test_deleting_a_profile_removes_its_labels(world: World) -> None:
    world.api.patch("v1", "Node", None, NODE, {"metadata": {"labels": {NODE_PROFILED: "true", "keep": "1"}}})
    world.rt.profiles.wrote(NODE, 1, {})
    gpuprofile.gpuprofile_delete(name=NODE, spec={"nodeName": NODE}, logger=_Logger(), memo=world.memo)  # type: ignore[arg-type]
    assert world.rt.profiles.written(NODE) is None
    assert NODE_PROFILED not in world.node_labels() and world.node_labels()["keep"] == "1"
    world.api.store.pop(("Node", None, NODE))
    gpuprofile.gpuprofile_delete(name=NODE, spec={"nodeName": NODE}, logger=_Logger(), memo=world.memo)  # type: ignore[arg-type]


class TestNodeEvent:
    def event(self, world: World, body: dict[str, Any], type_: str | None = "ADDED") -> None:
        asyncio.run(
            nodes.node_event(
                type=type_, name=body["metadata"]["name"], body=body, logger=_Logger(), memo=world.memo
            )  # type: ignore[arg-type]
        )

    def test_creates_the_profile_once(self, world: World) -> None:
        body = fleet_node("gpu-a10-0")
        self.event(world, body)
        assert world.api.calls == [("create", "GPUProfile", None, "gpu-a10-0")]
        prof = world.api.profile("gpu-a10-0")
        assert prof["apiVersion"] == API_VERSION and prof["spec"] == {"nodeName": "gpu-a10-0"}
        assert prof["metadata"]["labels"] == {"app.kubernetes.io/managed-by": "gearshift"}
        self.event(world, body)  # a heartbeat: known to exist, no call
        assert len(world.api.calls) == 1

    def test_an_existing_profile_is_left_alone(self, world: World) -> None:
        before = world.api.profile()
        self.event(world, fleet_node())
        assert world.api.profile() == before and world.rt.profiles.ensured(NODE)

    def test_other_refusals_are_retried(self, world: World) -> None:
        world.api.refuse[("create", "GPUProfile")] = KubeApiError("POST x: 403 Forbidden", 403)
        with pytest.raises(kopf.TemporaryError, match="cannot create GPUProfile gpu-a10-0: POST x: 403"):
            self.event(world, fleet_node("gpu-a10-0"))
        assert not world.rt.profiles.ensured("gpu-a10-0")

    def test_a_deleted_profile_is_forgotten_and_made_again(self, world: World) -> None:
        body = fleet_node("gpu-a10-0")
        self.event(world, body)
        world.rt.profiles.wrote("gpu-a10-0", 5, {"phase": "Ready"})
        world.api.store.pop(("GPUProfile", None, "gpu-a10-0"))
        asyncio.run(nodes.gpuprofile_event_forget(type="DELETED", name="gpu-a10-0", memo=world.memo))  # type: ignore[arg-type]
        assert not world.rt.profiles.known("gpu-a10-0")
        world.api.calls.clear()
        self.event(world, body)  # the node's next heartbeat
        assert world.api.calls == [("create", "GPUProfile", None, "gpu-a10-0")]

    def test_deleted_and_cpu_nodes_make_no_call(self, world: World) -> None:
        self.event(world, fleet_node("gpu-a10-0"), "DELETED")
        self.event(world, {"metadata": {"name": "cpu-0"}, "status": {"capacity": {"cpu": "8"}}})
        assert world.api.calls == []


class OldCrdApi(ProfilingApi):
    """The in-memory API whose GPUProfile CRD is older than the operator: the server prunes ``probe``
    from every status write (what a structural schema without it does). The pruning report is an Event
    the handler posts itself (not through kopf)."""

    def patch_status(
        self, api_version: str, kind: str, namespace: str | None, name: str, status: Mapping[str, Any]
    ) -> dict[str, Any]:
        kept = {k: v for k, v in status.items() if not (kind == "GPUProfile" and k == "probe")}
        return super().patch_status(api_version, kind, namespace, name, kept)

    def create_event(self, event: Mapping[str, Any]) -> None:
        FakeKubeApi.create_event(self, event)


def test_a_pruned_profile_status_write_stops_the_step_and_reports_once(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    # GPUProfile status writes go through the pruning check GearSet and PDService writes have.
    api = OldCrdApi(probe=SETTINGS)
    api.store = world.api.store
    monkeypatch.setattr(world, "api", api)
    monkeypatch.setattr(world.rt, "_api", api)
    with pytest.raises(kopf.TemporaryError, match=r"status\.probe") as exc:
        world.step()
    assert exc.value.delay == gpuprofile.PRUNED_RETRY_S
    (event,) = api.events
    assert (event["type"], event["reason"]) == ("Warning", "FieldsPruned")
    # A cluster-scoped object's Event goes to `default`: the only namespace the API server accepts for it.
    assert event["metadata"]["namespace"] == "default"
    assert event["involvedObject"]["kind"] == "GPUProfile" and event["involvedObject"]["name"] == NODE
    conds = {c["type"]: c for c in api.profile()["status"]["conditions"]}
    assert (conds["CRDCurrent"]["status"], conds["CRDCurrent"]["reason"]) == ("False", "FieldsPruned")
    assert world.events == []  # the step stopped before its own events: nothing acts on a lost write
    # Tried again: still refused, the event is not repeated; a deleted profile's reports are forgotten.
    with pytest.raises(kopf.TemporaryError):
        world.step()
    assert len(api.events) == 1
    uid = api.profile()["metadata"]["uid"]
    assert world.rt.pruned.known(uid)
    asyncio.run(nodes.gpuprofile_event_forget(type="DELETED", name=NODE, memo=world.memo, body=api.profile()))  # type: ignore[arg-type]
    assert not world.rt.pruned.known(uid)


class _ChangingIndex(dict):  # type: ignore[type-arg]
    """A kopf index the event loop changes while a handler thread reads it: the first reads fail."""

    def __init__(self, data: dict[str, list[Any]], failures: int) -> None:
        super().__init__(data)
        self.failures = failures

    def items(self):  # type: ignore[no-untyped-def]
        if self.failures:
            self.failures -= 1
            raise RuntimeError("dictionary changed size during iteration")
        return super().items()


def test_fleet_classes_reads_an_index_that_changes_under_it() -> None:
    """58 profile timers failed (and waited 60 s) on this race while 1,000 nodes were profiled."""
    index = _ChangingIndex({"a": [1.0], "b": [0.1], "c": []}, failures=3)
    assert gpuprofile.fleet_classes(index) == gpuprofile.fleet_classes({"a": [1.0], "b": [0.1]})  # type: ignore[arg-type]
    assert index.failures == 0
    assert gpuprofile.index_snapshot(_ChangingIndex({"n": ["v"]}, failures=2)) == [("n", ["v"])]  # type: ignore[arg-type]
