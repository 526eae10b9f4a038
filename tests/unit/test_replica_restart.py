"""A failed head restarts its whole pipeline replica (LeaderWorkerSet's
RecreateGroupOnPodRestart): the pure decision, and the handler over an in-memory API."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import kopf
import pytest
from test_handlers_reconcile import NS, _example, new_api

from gearshift.handlers import replicas as rp
from gearshift.handlers.main import HANDLER_MODULES
from gearshift.k8s import names
from gearshift.k8s.engine import KV_EPOCH_ANNOTATION, KV_EPOCH_ENV, KV_EPOCH_GATE
from gearshift.testing.kube import FakeKubeApi

T0 = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)


def at(s: float) -> datetime:
    return T0 + timedelta(seconds=s)


def head(
    restarts: int = 0,
    *,
    uid: str = "u1",
    ordinal: int = 1,
    created: float = 0,
    stopped: float | None = None,
    acted: str | None = None,
) -> rp.HeadState:
    return rp.HeadState(
        name=f"svc-decode-deep-s0-{ordinal}",
        uid=uid,
        ordinal=ordinal,
        created=at(created),
        restart_count=restarts,
        stopped_at=None if stopped is None else at(stopped),
        acted=acted,
    )


def peers(created: float = 0, stages: int = 3, ordinals: tuple[int, ...] = (0, 1, 2)) -> list[rp.StagePod]:
    out = []
    for k in range(stages):
        for r in ordinals:
            out.append(rp.StagePod(f"svc-decode-deep-s{k}-{r}", k, r, at(created)))
    return out


class TestDecide:
    def test_engine_restart_recreates_the_replicas_other_ranks(self) -> None:
        d = rp.decide(head(1, stopped=600), peers())
        assert d.delete == ("svc-decode-deep-s1-1", "svc-decode-deep-s2-1")  # ordinal 1 only, not stage 0
        assert d.record == "u1:1" and d.cause == "restarted"

    def test_already_acted_on(self) -> None:
        assert rp.decide(head(1, stopped=600, acted="u1:1"), peers()) == rp.Decision()
        assert rp.decide(head(1, stopped=600, acted="u1:3"), peers()) == rp.Decision()

    def test_a_second_restart_acts_again(self) -> None:
        d = rp.decide(head(2, stopped=900, acted="u1:1"), peers(created=620))
        assert d.delete == ("svc-decode-deep-s1-1", "svc-decode-deep-s2-1") and d.record == "u1:2"

    def test_ranks_created_after_the_engine_stopped_are_fresh(self) -> None:
        # the operator deleted them, then stopped before writing the annotation: no second delete
        d = rp.decide(head(1, stopped=600), peers(created=605))
        assert d.delete == () and d.record == "u1:1" and d.cause == ""

    def test_unknown_stop_time_recreates_all(self) -> None:
        assert rp.decide(head(1), peers(created=605)).delete == (
            "svc-decode-deep-s1-1",
            "svc-decode-deep-s2-1",
        )

    def test_recreated_head_new_uid(self) -> None:
        # the old head (u1) was deleted at ~1000 s; its replacement u2 came up; the ranks still run
        d = rp.decide(head(0, uid="u2", created=1000, acted=None), peers(created=0))
        assert d.delete == ("svc-decode-deep-s1-1", "svc-decode-deep-s2-1")
        assert d.record == "u2:0" and d.cause == "recreated"
        # a stale record of another UID (the annotation does not survive a new pod, but a patch might)
        d2 = rp.decide(head(0, uid="u2", created=1000, acted="u1:4"), peers(created=0))
        assert d2.delete == d.delete

    def test_first_start_deletes_nothing(self) -> None:
        # ranks are created by separate StatefulSets a moment apart, before or after the head
        for created in (-2.0, 0.0, 3.0):
            d = rp.decide(head(0, created=0), peers(created=created))
            assert d.delete == () and d.record == "u1:0" and d.cause == ""

    def test_recreated_head_with_fresh_ranks(self) -> None:
        assert rp.decide(head(0, uid="u2", created=1000), peers(created=990)).delete == ()

    def test_ranks_already_deleting_are_skipped(self) -> None:
        pods = [
            rp.StagePod("svc-decode-deep-s1-1", 1, 1, at(0), deleting=True),
            rp.StagePod("svc-decode-deep-s2-1", 2, 1, at(0)),
        ]
        assert rp.decide(head(1, stopped=600), pods).delete == ("svc-decode-deep-s2-1",)

    def test_one_stage_gear_has_nothing_to_do(self) -> None:
        assert rp.decide(head(5, stopped=600), peers(stages=1)) == rp.Decision()

    @pytest.mark.parametrize("raw", [None, "", "u1", "u1:x", ":3"])
    def test_malformed_records_read_as_none(self, raw: str | None) -> None:
        assert rp.parse_acted(raw) is None
        assert rp.parse_acted("a:b:7") == ("a:b", 7)


# --- pods as the API shows them, and the handler ------------------------------------------------------


def ts(s: float) -> str:
    return at(s).strftime("%Y-%m-%dT%H:%M:%SZ")


def pod(
    stage: int,
    ordinal: int,
    *,
    stages: int = 3,
    created: float = 0,
    restarts: int = 0,
    stopped: float | None = None,
    engine: str = "vllm",
    gear: str = "deep",
) -> dict[str, Any]:
    sts = names.stage_statefulset_name("llama3-8b", "decode", gear, stage)
    args = ["serve", "m", "--pipeline-parallel-size", str(stages)]
    if stages > 1:
        args += ["--nnodes", str(stages), "--node-rank", str(stage)]
    status: dict[str, Any] = {"name": "engine", "restartCount": restarts}
    if stopped is not None:
        status["lastState"] = {"terminated": {"exitCode": 1, "finishedAt": ts(stopped)}}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{sts}-{ordinal}",
            "namespace": NS,
            "uid": f"uid-{sts}-{ordinal}",
            "creationTimestamp": ts(created),
            "labels": names.engine_labels("llama3-8b", "decode", gear, stage)
            | {rp.POD_INDEX_LABEL: str(ordinal)},
        },
        "spec": {
            "containers": [
                {"name": "engine", "command": [engine], "args": args if engine == "vllm" else ["--worker"]}
            ]
        },
        "status": {"phase": "Running", "containerStatuses": [status]},
    }


@pytest.fixture
def api() -> FakeKubeApi:
    a = new_api()
    a.put(_example("pdservice-llama3-8b.yaml"), NS)
    for k in range(3):
        for r in range(2):
            a.put(pod(k, r), NS)
    return a


def _head(api: FakeKubeApi, r: int = 1) -> dict[str, Any]:
    got = api.get("v1", "Pod", NS, f"llama3-8b-decode-deep-s0-{r}")
    assert got is not None
    return got


def _pods(api: FakeKubeApi) -> set[str]:
    return {p["metadata"]["name"] for p in api.list("v1", "Pod", NS)}


class TestHandler:
    def test_registered(self) -> None:
        assert "gearshift.handlers.replicas" in HANDLER_MODULES

    def test_reads_the_pod(self) -> None:
        h = rp.head_state(pod(0, 1, restarts=2, stopped=50, created=0))
        assert h is not None and (h.ordinal, h.restart_count, h.stopped_at) == (1, 2, at(50))
        assert rp.vllm_ranks(pod(0, 1)) == 3
        assert rp.vllm_ranks(pod(0, 1, stages=1)) == 1
        assert rp.vllm_ranks(pod(0, 1, engine="gearshift-sim")) == 0
        no_label = pod(1, 4)
        del no_label["metadata"]["labels"][rp.POD_INDEX_LABEL]
        assert rp.pod_ordinal(no_label) == 4

    def test_head_restart_deletes_its_replicas_ranks_and_records(self, api: FakeKubeApi) -> None:
        h = pod(0, 1, restarts=1, stopped=600)
        api.put(h, NS)
        d = rp.act(api, _head(api))
        assert d.delete == ("llama3-8b-decode-deep-s1-1", "llama3-8b-decode-deep-s2-1")
        assert _pods(api) == {
            "llama3-8b-decode-deep-s0-0",
            "llama3-8b-decode-deep-s0-1",
            "llama3-8b-decode-deep-s1-0",
            "llama3-8b-decode-deep-s2-0",
        }  # replica 0 untouched
        ann = _head(api)["metadata"]["annotations"]
        assert ann[rp.ANNOTATION_RESTARTS_ACTED] == "uid-llama3-8b-decode-deep-s0-1:1"
        [ev] = [e for e in api.events if e["reason"] == "PipelineReplicaRestarted"]
        assert ev["involvedObject"]["kind"] == "PDService" and ev["involvedObject"]["name"] == "llama3-8b"
        assert ev["message"] == (
            "head llama3-8b-decode-deep-s0-1 restarted (restartCount 1); recreating "
            "llama3-8b-decode-deep-s1-1, llama3-8b-decode-deep-s2-1"
        )
        assert ev["type"] == "Warning"

    def test_operator_restart_does_not_redo_it(self, api: FakeKubeApi) -> None:
        api.put(pod(0, 1, restarts=1, stopped=600), NS)
        rp.act(api, _head(api))
        # the StatefulSet controller recreates the ranks; the operator restarts and sees the head again
        for k in (1, 2):
            api.put(pod(k, 1, created=0), NS)  # even old-looking ranks: the annotation says it was done
        n = len(api.events)
        assert rp.act(api, _head(api)) == rp.Decision()
        assert len(_pods(api)) == 6 and len(api.events) == n

    def test_recreated_head_pod(self, api: FakeKubeApi) -> None:
        new = pod(0, 1, created=1000)
        new["metadata"]["uid"] = "uid-new-head"
        api.delete("v1", "Pod", NS, "llama3-8b-decode-deep-s0-1")
        api.put(new, NS)
        d = rp.act(api, _head(api))
        assert d.cause == "recreated" and "llama3-8b-decode-deep-s1-1" not in _pods(api)
        [ev] = [e for e in api.events if e["reason"] == "PipelineReplicaRestarted"]
        assert ev["message"].startswith("head llama3-8b-decode-deep-s0-1 was recreated (uid uid-new-head)")

    def test_first_start_only_records(self, api: FakeKubeApi) -> None:
        assert rp.act(api, _head(api)).delete == ()
        assert len(_pods(api)) == 6 and not api.events
        assert _head(api)["metadata"]["annotations"][rp.ANNOTATION_RESTARTS_ACTED].endswith(":0")

    def test_sim_and_one_stage_heads_are_left_alone(self, api: FakeKubeApi) -> None:
        sim = pod(0, 1, restarts=3, stopped=600, engine="gearshift-sim")
        assert rp.act(api, sim) == rp.Decision()
        one = pod(0, 1, restarts=3, stopped=600, stages=1)
        assert rp.act(api, one) == rp.Decision()
        assert len(_pods(api)) == 6 and not api.events

    def test_deleted_event_is_ignored(self) -> None:
        # No API needed: an empty memo (no Runtime) would raise if the handler reached for one.
        rp.head_pod_event(type="DELETED", body=pod(0, 1, restarts=1), memo=kopf.Memo())

    def test_the_handler_acts_through_the_runtimes_api(self, api: FakeKubeApi) -> None:
        api.put(pod(0, 1, restarts=1, stopped=600), NS)
        rp.head_pod_event(type="MODIFIED", body=_head(api), memo=kopf.Memo(runtime=api.runtime))
        assert "llama3-8b-decode-deep-s1-1" not in _pods(api)
        assert [e["reason"] for e in api.events] == ["PipelineReplicaRestarted"]


def epoch_pod(
    stage: int, ordinal: int, *, gate: bool = True, epoch: str | None = None, **kw: Any
) -> dict[str, Any]:
    """A stage pod of a multi-stage PD gear (its engine reads the KV epoch), gated or not."""
    p = pod(stage, ordinal, **kw)
    p["spec"]["containers"][0]["env"] = [
        {"name": KV_EPOCH_ENV, "valueFrom": {"fieldRef": {"fieldPath": "x"}}}
    ]
    if gate:
        p["spec"]["schedulingGates"] = [{"name": "other.io/gate"}, {"name": KV_EPOCH_GATE}]
    if epoch is not None:
        p["metadata"]["annotations"] = {KV_EPOCH_ANNOTATION: epoch}
    return p


class TestKvEpoch:
    """A multi-stage PD replica's ranks share one engine id, new for every incarnation of the replica."""

    def test_a_head_takes_its_uid_and_a_rank_its_heads_epoch(self) -> None:
        head = epoch_pod(0, 1)
        head["metadata"]["uid"] = "9f1c2e3a-4b5d-6e7f-8091-a2b3c4d5e6f7"
        assert rp.kv_epoch(head, None) == "9f1c2e3a4b5d"
        rank = epoch_pod(2, 1)
        assert rp.kv_epoch(rank, None) is None  # no head yet: wait
        assert rp.kv_epoch(rank, epoch_pod(0, 1, gate=True, epoch="abc")) is None  # head still gated
        going = epoch_pod(0, 1, gate=False, epoch="abc")
        going["metadata"]["deletionTimestamp"] = ts(5)
        assert rp.kv_epoch(rank, going) is None  # the head of the last incarnation
        assert rp.kv_epoch(rank, epoch_pod(0, 1, gate=False, epoch="abc")) == "abc"

    def test_release_of_a_head_lifts_its_ranks_of_the_same_ordinal(self, api: FakeKubeApi) -> None:
        for k in range(3):
            for r in range(2):
                api.put(epoch_pod(k, r), NS)
        head = _head(api)
        head["metadata"]["uid"] = "0123abcd-4567-89ef-0123-456789abcdef"
        assert rp.release(api, head) == "0123abcd4567"  # the UID's first 12 hex digits
        got = {p["metadata"]["name"]: p for p in api.list("v1", "Pod", NS)}
        for k in range(3):
            p1 = got[f"llama3-8b-decode-deep-s{k}-1"]
            assert p1["metadata"]["annotations"][KV_EPOCH_ANNOTATION] == "0123abcd4567"
            assert p1["spec"]["schedulingGates"] == [{"name": "other.io/gate"}]  # only ours lifted
            assert rp.gated(got[f"llama3-8b-decode-deep-s{k}-0"])  # replica 0 waits for its own head

    def test_a_rank_created_after_its_head_is_released_on_its_own_event(self, api: FakeKubeApi) -> None:
        api.put(epoch_pod(0, 1, gate=False, epoch="e1"), NS)
        api.put(epoch_pod(1, 1), NS)
        rank = api.get("v1", "Pod", NS, "llama3-8b-decode-deep-s1-1")
        assert rank is not None
        rp.gated_pod_event(type="ADDED", body=rank, memo=kopf.Memo(runtime=api.runtime))
        rank = api.get("v1", "Pod", NS, "llama3-8b-decode-deep-s1-1")
        assert rank is not None and not rp.gated(rank)
        assert rank["metadata"]["annotations"][KV_EPOCH_ANNOTATION] == "e1"

    def test_a_restarted_head_is_deleted_with_its_ranks(self, api: FakeKubeApi) -> None:
        """In place it would come back under its old engine id, which NIXL peers never handshake again."""
        for k in range(3):
            api.put(epoch_pod(k, 1, gate=False, epoch="e1"), NS)
        api.put(epoch_pod(0, 1, gate=False, epoch="e1", restarts=1, stopped=600), NS)
        d = rp.act(api, _head(api))
        assert d.delete == (
            "llama3-8b-decode-deep-s1-1",
            "llama3-8b-decode-deep-s2-1",
            "llama3-8b-decode-deep-s0-1",
        )
        assert {n for n in _pods(api) if n.endswith("-1")} == set()
        [ev] = [e for e in api.events if e["reason"] == "PipelineReplicaRestarted"]
        assert "llama3-8b-decode-deep-s0-1" in ev["message"].split("recreating ")[1]
