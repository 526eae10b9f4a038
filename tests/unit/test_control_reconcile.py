"""The reconciler's pure decisions (gearshift.control.reconcile): the PDService's phase ladder and conditions,
refusals, which owned objects are garbage-collected, readiness, the GearSet status patch, the plan's
fingerprint and memo, and the events of time-limited nodes. Expected values are written out by hand."""

from __future__ import annotations

import copy
import itertools
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_handlers_reconcile import fleet_nodes

from gearshift import planner
from gearshift.api.common import ConditionUpdate, inputs_hash
from gearshift.api.gearset import Gear
from gearshift.api.pdservice import PDService
from gearshift.control.reconcile.desired import (
    desired_state,
    gearset_status_patch,
    pick_active,
    role_desire,
    stale_gear_services,
    stale_statefulsets,
)
from gearshift.control.reconcile.placement import bound_nodes
from gearshift.control.reconcile.planning import plan_key, window_events
from gearshift.control.reconcile.readiness import Readiness, current_ready, readiness_patch, role_readiness
from gearshift.control.reconcile.rollout import rollout_ahead, rollouts_starting
from gearshift.control.reconcile.spec import role_state, services_using
from gearshift.control.reconcile.state import DesiredState, RoleState
from gearshift.control.reconcile.verdict import (
    degraded_condition,
    gearsets_missing,
    placed_condition,
    refusal,
    router_ready,
    service_phase,
    service_verdict,
    unschedulable,
)
from gearshift.k8s import names
from gearshift.k8s.desired import Images, RoleDesire
from gearshift.k8s.statefulset import ANNOTATION_TEMPLATE_HASH
from gearshift.planner.inputs import datasheet_gpuprofile

ROOT = Path(__file__).resolve().parents[2]
NS = "ns1"
SERVICE = "llama3-8b"
NOW = datetime(2026, 1, 1, tzinfo=UTC)


def _yaml(name: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "examples" / name).read_text())


def _pds(engine: str = "sim", decode_scaling: bool = True) -> PDService:
    body = _yaml("pdservice-llama3-8b.yaml")
    body["spec"]["engine"] = engine
    if not decode_scaling:
        del body["spec"]["decode"]["scaling"]
    return PDService.model_validate(body)


def _gs_body(example: str, role: str | None = None, **status: Any) -> dict[str, Any]:
    body = _yaml(example)
    body["metadata"].update(namespace=NS, generation=3)
    if role is not None:
        body["spec"]["role"] = role
        body["metadata"]["name"] = f"{SERVICE}-{role}"
    body["status"] = status
    return body


def _explicit(role: str = "prefill", pds: PDService | None = None, **status: Any) -> RoleState:
    """A role with the example's explicit gears (latency, balanced, throughput; initial gear balanced)."""
    rs = role_state(pds or _pds(), SERVICE, role, _gs_body("gearset-explicit.yaml", role, **status))
    rs.gears = list(rs.gs.spec.gears)
    return rs


def _auto(pds: PDService | None = None, **status: Any) -> RoleState:
    return role_state(pds or _pds(), SERVICE, "decode", _gs_body("gearset-auto.yaml", **status))


def _gear(name: str, *stage_nodes: list[str]) -> Gear:
    n = len(stage_nodes)
    return Gear.model_validate(
        {
            "name": name,
            "intent": "latency",
            "stages": [
                {"layers": [k * 32 // n, (k + 1) * 32 // n], "nodes": ns} for k, ns in enumerate(stage_nodes)
            ],
        }
    )


# --- the phase ladder and the conditions -------------------------------------------------------------
#: (lost, ready, unplaced, serving_any) -> phase, every combination.
PHASES = {
    (False, False, False, False): "Progressing",
    (False, False, False, True): "Progressing",
    (False, False, True, False): "Pending",
    (False, False, True, True): "Progressing",
    (False, True, False, False): "Ready",
    (False, True, False, True): "Ready",
    (False, True, True, False): "Ready",
    (False, True, True, True): "Ready",
    (True, False, False, False): "Degraded",
    (True, False, False, True): "Degraded",
    (True, False, True, False): "Degraded",
    (True, False, True, True): "Degraded",
    (True, True, False, False): "Degraded",
    (True, True, False, True): "Degraded",
    (True, True, True, False): "Degraded",
    (True, True, True, True): "Degraded",
}


def test_phase_table_covers_every_combination() -> None:
    assert set(PHASES) == set(itertools.product([False, True], repeat=4))


@pytest.mark.parametrize(("inputs", "phase"), sorted(PHASES.items()))
def test_service_phase(inputs: tuple[bool, bool, bool, bool], phase: str) -> None:
    assert service_phase(*inputs) == phase


@pytest.mark.parametrize(
    ("missing", "problems", "unsched", "plan_failed", "reason"),
    [
        (["m"], [], [], False, "ProfilesMissing"),
        (["m"], ["p"], [], False, "PlacementFailed"),
        (["m"], [], ["u"], False, "PlacementFailed"),
        ([], ["p"], [], False, "PlacementFailed"),
        ([], ["p"], [], True, "PlanFailed"),
        (["m"], ["p"], [], True, "PlanFailed"),
        ([], ["p"], ["u"], True, "PlacementFailed"),  # a pod the scheduler refuses outweighs the plan
        ([], [], ["u"], False, "Unschedulable"),
        ([], ["p"], ["u"], False, "PlacementFailed"),
    ],
)
def test_placed_condition_reasons(
    missing: list[str], problems: list[str], unsched: list[str], plan_failed: bool, reason: str
) -> None:
    c = placed_condition(missing, problems, unsched, plan_failed)
    assert (c.type, c.status, c.reason, c.warning) == ("Placed", "False", reason, True)
    assert c.message == "; ".join(missing + problems + unsched)


def test_placed_condition_all_placed() -> None:
    assert placed_condition([], [], [], False) == ConditionUpdate(
        "Placed", "True", "AllPlaced", "every stage of the active gears has its nodes"
    )
    # plan_failed alone (nothing to report) does not unplace the service
    assert placed_condition([], [], [], True).status == "True"


def test_degraded_condition() -> None:
    assert degraded_condition(["n2", "n1", "n2"]) == ConditionUpdate(
        "Degraded", "True", "NodeLost", "node(s) n1, n2 under running stages are gone or not Ready", True
    )
    assert degraded_condition([]) == ConditionUpdate(
        "Degraded", "False", "AsPlanned", "every node under a running stage is Ready"
    )


def test_refusal_keeps_a_serving_service_ready() -> None:
    serving = {"conditions": [{"type": "Ready", "status": "True"}]}
    cond, status = refusal(serving, "InvalidSpec", "bad gear")
    assert cond == ConditionUpdate(
        "Progressing", "False", "InvalidSpec", "bad gear; still serving the last applied spec", True
    )
    assert status == {
        "phase": "Degraded",
        "message": "spec not applied, serving the last applied one: bad gear",
    }


@pytest.mark.parametrize(
    "old", [{}, {"conditions": [{"type": "Ready", "status": "False"}]}, {"conditions": [{"type": "Placed"}]}]
)
def test_refusal_of_a_service_not_serving_fails_it(old: dict[str, Any]) -> None:
    cond, status = refusal(old, "GearSetMismatch", "wrong role")
    assert cond == ConditionUpdate("Ready", "False", "GearSetMismatch", "wrong role", True)
    assert status == {"phase": "Failed", "message": "wrong role"}


def test_gearsets_missing() -> None:
    conds, status = gearsets_missing("GearSet not found: decode.gearSetRef 'x'")
    assert conds == [
        ConditionUpdate(
            "Placed", "False", "GearSetMissing", "GearSet not found: decode.gearSetRef 'x'", True
        ),
        ConditionUpdate("Ready", "False", "GearSetMissing", "GearSet not found: decode.gearSetRef 'x'"),
    ]
    assert status == {"phase": "Pending", "message": "GearSet not found: decode.gearSetRef 'x'"}


# --- garbage collection ------------------------------------------------------------------------------
def _owned(name: str, role: str | None, gear: str | None, stage: int | None = None) -> dict[str, Any]:
    labels = {names.LABEL_SERVICE: SERVICE}
    if role is not None:
        labels[names.LABEL_ROLE] = role
    if gear is not None:
        labels[names.LABEL_GEAR] = gear
    if stage is not None:
        labels[names.LABEL_STAGE] = str(stage)
    return {"metadata": {"name": name, "labels": labels}}


def _want() -> DesiredState:
    """prefill runs gear ``a`` (2 stages), decode runs ``x`` (1 stage) and leaves ``broken`` unplaced."""
    desires = [
        RoleDesire("prefill", [_gear("a", ["n0"], ["n1"])], "a"),
        RoleDesire("decode", [_gear("x", ["n2"])], "x"),
    ]
    return DesiredState(desires, [], [], [], {("decode", "broken")}, [])


STATEFULSETS = [
    _owned("p-a-0", "prefill", "a", 0),
    _owned("p-a-1", "prefill", "a", 1),
    _owned("p-a-2", "prefill", "a", 2),  # past the end of gear a (it lost a stage)
    _owned("p-old-0", "prefill", "old", 0),  # a gear no longer wanted
    _owned("d-x-0", "decode", "x", 0),
    _owned("d-x", "decode", "x"),  # no stage label: stage 0
    _owned("d-broken-0", "decode", "broken", 0),  # cannot be placed: left as it is
    _owned("d-y-0", "decode", "y", 0),
]


def test_stale_statefulsets() -> None:
    assert stale_statefulsets(STATEFULSETS, _want(), set()) == ["p-a-2", "p-old-0", "d-y-0"]


def test_stale_statefulsets_spare_a_role_in_flight() -> None:
    assert stale_statefulsets(STATEFULSETS, _want(), {"decode"}) == ["p-a-2", "p-old-0"]
    assert stale_statefulsets(STATEFULSETS, _want(), {"prefill", "decode"}) == []


SERVICES = [
    _owned("p-a", "prefill", "a"),
    _owned("p-old", "prefill", "old"),
    _owned("p-role", "prefill", None),  # the role Service: no gear label, never deleted here
    _owned("d-broken", "decode", "broken"),
    _owned("d-y", "decode", "y"),
]


def test_stale_gear_services() -> None:
    assert stale_gear_services(SERVICES, _want(), set()) == ["p-old", "d-y"]
    assert stale_gear_services(SERVICES, _want(), {"prefill"}) == ["d-y"]
    assert stale_gear_services(SERVICES, _want(), {"prefill", "decode"}) == []


def test_bound_nodes_from_pods_and_pinned_statefulsets() -> None:
    pods = [{"spec": {"nodeName": "n1"}}, {"spec": {}}, {"metadata": {}}, {"spec": {"nodeName": "n2"}}]
    pinned = {
        "spec": {
            "template": {
                "spec": {
                    "affinity": {
                        "nodeAffinity": {
                            "requiredDuringSchedulingIgnoredDuringExecution": {
                                "nodeSelectorTerms": [
                                    {
                                        "matchExpressions": [
                                            {
                                                "key": "kubernetes.io/hostname",
                                                "operator": "In",
                                                "values": ["n3"],
                                            }
                                        ]
                                    }
                                ]
                            }
                        }
                    }
                }
            }
        }
    }
    assert bound_nodes(pods, [pinned, {"spec": {}}]) == {"n1", "n2", "n3"}
    assert bound_nodes([], []) == set()


# --- readiness -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("router", "ready"),
    [
        (None, False),
        ({}, False),
        ({"status": {}}, False),
        ({"status": {"availableReplicas": 0}}, False),
        ({"status": {"availableReplicas": 1}}, True),
        ({"status": {"availableReplicas": 3}}, True),
    ],
)
def test_router_ready(router: dict[str, Any] | None, ready: bool) -> None:
    assert router_ready(router) is ready


def test_unschedulable_pods_sorted() -> None:
    def pod(name: str, **cond: str) -> dict[str, Any]:
        return {"metadata": {"name": name}, "status": {"conditions": [{"type": "PodScheduled", **cond}]}}

    pods = [
        pod("z", status="False", reason="Unschedulable", message="0/3 nodes have GPUs"),
        pod("a", status="False", reason="Unschedulable"),
        pod("b", status="False", reason="SchedulerError"),
        pod("c", status="True"),
        {"metadata": {"name": "d"}},
    ]
    assert unschedulable(pods) == ["pod a: unschedulable", "pod z: 0/3 nodes have GPUs"]


def _stage_sts(
    gear: str,
    k: int,
    ready: int = 1,
    updated: int = 1,
    generation: int = 2,
    seen: int = 2,
    update: str = "r1",
    current: str = "r1",
) -> Any:
    return {
        "metadata": {
            "name": names.stage_statefulset_name(SERVICE, "prefill", gear, k),
            "generation": generation,
        },
        "status": {
            "readyReplicas": ready,
            "replicas": 1,
            "updatedReplicas": updated,
            "observedGeneration": seen,
            "updateRevision": update,
            "currentRevision": current,
        },
    }


def _balanced_sts(**changes: dict[str, Any]) -> dict[str, Any]:
    """The StatefulSets of the explicit gear ``balanced`` (4 stages of 1 pod), all rolled out and Ready."""
    out = {}
    for k in range(4):
        obj = _stage_sts("balanced", k, **changes.get(str(k), {}))
        out[obj["metadata"]["name"]] = obj
    return out


def _active(rs: RoleState) -> RoleState:
    pick_active(rs)
    return rs


class TestRoleReadiness:
    def test_all_stages_ready_and_rolled_out(self) -> None:
        rs = _active(_explicit())
        assert rs.active == "balanced"
        assert role_readiness(rs, _balanced_sts(), _pds(), SERVICE, NS, Images()) == Readiness(1, 1, True, 1)

    def test_a_missing_stage_is_neither_ready_nor_rolled_out(self) -> None:
        sts = _balanced_sts()
        del sts[names.stage_statefulset_name(SERVICE, "prefill", "balanced", 2)]
        assert role_readiness(_active(_explicit()), sts, _pds(), SERVICE, NS, Images()) == Readiness(
            0, 1, False, 0, "StatefulSet llama3-8b-prefill-balanced-s2 not created yet"
        )

    def test_a_stage_behind_its_generation_is_ready_but_rolling(self) -> None:
        sts = _balanced_sts(**{"1": {"seen": 1}})
        assert role_readiness(_active(_explicit()), sts, _pds(), SERVICE, NS, Images()) == Readiness(
            1,
            1,
            False,
            1,
            "StatefulSet llama3-8b-prefill-balanced-s1 has not observed generation 2 yet (status of 1)",
        )

    def test_an_old_revision_pod_that_serves_does_not_count(self) -> None:
        # (dynamo#3567's class): the StatefulSet has the new updateRevision, and its one pod, still
        # Ready, is of the old revision: nothing of the current spec serves.
        sts = _balanced_sts(**{"0": {"updated": 0, "update": "r2", "current": "r1"}})
        assert role_readiness(_active(_explicit()), sts, _pds(), SERVICE, NS, Images()) == Readiness(
            0,
            1,
            False,
            0,
            "StatefulSet llama3-8b-prefill-balanced-s0: 0/1 pods at the new revision r2, 0 Ready",
        )

    def test_a_rollout_is_done_when_the_current_revision_is_the_update_revision(self) -> None:
        # Every pod updated and Ready, but the controller has not yet called the rollout complete.
        sts = _balanced_sts(**{"3": {"update": "r2", "current": "r1"}})
        got = role_readiness(_active(_explicit()), sts, _pds(), SERVICE, NS, Images())
        assert (got.ready, got.rolled, got.pipelines) == (1, False, 1)
        assert (
            got.waiting
            == "StatefulSet llama3-8b-prefill-balanced-s3: 1/1 pods at the new revision r2, 1 Ready"
        )
        sts = _balanced_sts(**{"3": {"update": "r2", "current": "r2"}})
        assert role_readiness(_active(_explicit()), sts, _pds(), SERVICE, NS, Images()) == Readiness(
            1, 1, True, 1
        )

    def test_a_stage_not_updated_is_rolling(self) -> None:
        sts = _balanced_sts(**{"3": {"updated": 0}})
        assert role_readiness(_active(_explicit()), sts, _pds(), SERVICE, NS, Images()).rolled is False

    def test_no_active_gear(self) -> None:
        rs = _explicit()  # pick_active not run: no active gear
        assert role_readiness(rs, _balanced_sts(), _pds(), SERVICE, NS, Images()) == Readiness(
            0, 0, False, 0, "no active gear yet"
        )


class TestCurrentReady:
    """Ready pods of the current spec: a lower bound from readyReplicas, replicas and updatedReplicas."""

    @pytest.mark.parametrize(
        ("ready", "pods", "updated", "seen", "want"),
        [
            (3, 3, 3, 2, 3),  # rolled out
            (3, 3, 1, 2, 1),  # two old pods, both may be among the Ready three
            (2, 3, 1, 2, 0),  # the updated pod is one of those not Ready, at worst
            (1, 1, 0, 2, 0),  # the one Ready pod is of the old revision
            (2, 2, 1, 1, 2),  # generation not observed: the counts are of the older spec, as read
        ],
    )
    def test_lower_bound(self, ready: int, pods: int, updated: int, seen: int, want: int) -> None:
        sts = {
            "metadata": {"generation": 2},
            "status": {
                "readyReplicas": ready,
                "replicas": pods,
                "updatedReplicas": updated,
                "observedGeneration": seen,
            },
        }
        assert current_ready(sts) == want


class TestReadinessPatch:
    def test_fresh_status_gets_copies_and_replicas(self) -> None:
        rs = _explicit()
        assert readiness_patch(rs, Readiness(2, 3, True, 1)) == {
            "readyCopies": 2,
            "desiredCopies": 3,
            "ready": "2/3",
            "replicas": 1,
        }

    def test_only_what_differs(self) -> None:
        rs = _explicit(readyCopies=2, desiredCopies=3, ready="2/3", replicas=1)
        assert readiness_patch(rs, Readiness(2, 3, True, 1)) == {}
        assert readiness_patch(rs, Readiness(3, 3, True, 2)) == {
            "readyCopies": 3,
            "ready": "3/3",
            "replicas": 2,
        }

    def test_an_autoscaled_role_leaves_replicas_to_the_autoscaler(self) -> None:
        rs = _explicit("decode")  # the example PDService scales decode
        assert rs.autoscaled
        assert "replicas" not in readiness_patch(rs, Readiness(1, 1, True, 1))


# --- the PDService's status ------------------------------------------------------------------------------
def _roles() -> dict[str, RoleState]:
    return {"prefill": _active(_explicit("prefill")), "decode": _active(_explicit("decode"))}


def _verdict(
    want: DesiredState | None = None,
    readiness: dict[str, Readiness] | None = None,
    unsched: list[str] | None = None,
    router: bool = True,
    roles: dict[str, RoleState] | None = None,
    old: dict[str, Any] | None = None,
) -> Any:
    roles = roles or _roles()
    readiness = readiness or {"prefill": Readiness(1, 1, True, 1), "decode": Readiness(1, 1, True, 1)}
    want = want or DesiredState([], [], [], [], set(), [])
    return service_verdict(SERVICE, NS, want, roles, readiness, unsched or [], router, old or {})


class TestServiceVerdict:
    def test_all_serving(self) -> None:
        v = _verdict()
        assert [(c.type, c.status, c.reason) for c in v.conditions] == [
            ("Placed", "True", "AllPlaced"),
            ("Degraded", "False", "AsPlanned"),
            ("Progressing", "False", "Reconciled"),
            ("Ready", "True", "AllReady"),
        ]
        assert (v.phase, v.ready, v.placed) == ("Ready", True, True)
        assert v.status == {
            "phase": "Ready",
            "prefill": {
                "gearSet": "llama3-8b-prefill",
                "activeGear": "balanced",
                "readyReplicas": 1,
                "desiredReplicas": 1,
            },
            "decode": {
                "gearSet": "llama3-8b-decode",
                "activeGear": "balanced",
                "readyReplicas": 1,
                "desiredReplicas": 1,
            },
            "routerReady": True,
            "endpoint": "llama3-8b.ns1.svc:8000",
            "message": "",
        }

    def test_router_not_ready(self) -> None:
        v = _verdict(router=False)
        progressing, ready = v.conditions[2], v.conditions[3]
        assert (progressing.status, progressing.reason) == ("True", "RollingOut")
        assert ready == ConditionUpdate(
            "Ready", "False", "NotReady", "ready pipelines: prefill 1/1, decode 1/1; router not ready"
        )
        assert (v.phase, v.ready) == ("Progressing", False)

    def test_rolling_out_while_serving(self) -> None:
        v = _verdict(readiness={"prefill": Readiness(1, 2, False, 0), "decode": Readiness(1, 1, True, 1)})
        assert v.conditions[2] == ConditionUpdate(
            "Progressing", "True", "RollingOut", "prefill gear balanced: rolling out"
        )
        assert (
            v.conditions[3].message
            == "prefill gear balanced: rolling out; ready pipelines: prefill 1/2, decode 1/1; router ready"
        )
        assert v.phase == "Progressing"

    def test_every_pod_ready_but_a_new_revision_rolling_is_not_ready(self) -> None:
        # The counts are all there (pods of the old revision serve) but decode rolls to a new spec.
        why = "StatefulSet d-s0: 1/1 pods at the new revision r2, 1 Ready"
        v = _verdict(
            readiness={"prefill": Readiness(1, 1, True, 1), "decode": Readiness(1, 1, False, 1, why)}
        )
        assert v.conditions[2:] == [
            ConditionUpdate("Progressing", "True", "RollingOut", f"decode gear balanced: {why}"),
            ConditionUpdate(
                "Ready",
                "False",
                "NotReady",
                f"decode gear balanced: {why}; ready pipelines: prefill 1/1, decode 1/1; router ready",
            ),
        ]
        assert (v.phase, v.ready) == ("Progressing", False)

    def test_scaled_to_zero_is_served(self) -> None:
        v = _verdict(readiness={"prefill": Readiness(0, 0, True, 0), "decode": Readiness(1, 1, True, 1)})
        assert (v.phase, v.ready) == ("Ready", True)

    def test_unplaced_and_nothing_ready_is_pending(self) -> None:
        want = DesiredState(
            [], ["prefill: no usable GPUProfile for node(s) n9"], ["decode: p"], [], set(), []
        )
        v = _verdict(
            want,
            {"prefill": Readiness(0, 1, False, 0), "decode": Readiness(0, 1, False, 0)},
            unsched=["pod x: full"],
        )
        assert v.conditions[0] == ConditionUpdate(
            "Placed",
            "False",
            "PlacementFailed",
            "prefill: no usable GPUProfile for node(s) n9; decode: p; pod x: full",
            True,
        )
        assert (v.phase, v.placed, v.ready) == ("Pending", False, False)
        assert v.status["message"] == "prefill: no usable GPUProfile for node(s) n9; decode: p; pod x: full"

    def test_unplaced_while_a_role_serves_is_progressing(self) -> None:
        want = DesiredState([], [], ["decode: p"], [], set(), [])
        v = _verdict(want, {"prefill": Readiness(1, 1, True, 1), "decode": Readiness(0, 1, False, 0)})
        assert v.phase == "Progressing"

    def test_plan_failure_names_the_reason(self) -> None:
        roles = _roles()
        roles["decode"].plan_error = "decode: the planner found no gear"
        want = DesiredState([], [], ["decode: the planner found no gear"], [], set(), [])
        assert _verdict(want, roles=roles).conditions[0].reason == "PlanFailed"

    def test_lost_node_degrades_even_when_ready(self) -> None:
        want = DesiredState([], [], [], ["n4", "n3"], set(), [])
        v = _verdict(want)
        assert v.conditions[1].message == "node(s) n3, n4 under running stages are gone or not Ready"
        assert (v.phase, v.ready, v.placed) == ("Degraded", True, True)

    def test_message_bounded(self) -> None:
        want = DesiredState([], [], ["x" * 5000], [], set(), [])
        assert len(_verdict(want).status["message"]) == 4000

    def test_window_leave_by_earliest_then_cleared(self) -> None:
        roles = _roles()
        roles["prefill"].window_leave_by = "2026-01-01T10:00:00Z"
        roles["decode"].window_leave_by = "2026-01-01T09:00:00Z"
        assert _verdict(roles=roles).status["windowLeaveBy"] == "2026-01-01T09:00:00Z"
        # Once no role uses a time-limited node, a leaveBy written before is deleted (merge patch null).
        v = _verdict(old={"windowLeaveBy": "2026-01-01T09:00:00Z"})
        assert "windowLeaveBy" in v.status and v.status["windowLeaveBy"] is None
        assert "windowLeaveBy" not in _verdict().status


# --- what runs -----------------------------------------------------------------------------------------
class TestPickActive:
    def test_initial_gear_when_the_status_has_none(self) -> None:
        rs = _explicit()
        assert [g.name for g in pick_active(rs)] == ["balanced"]
        assert (rs.active, rs.in_flight) == ("balanced", False)
        assert role_desire(rs, []).selected == "balanced"

    def test_active_gear_kept(self) -> None:
        rs = _explicit(activeGear="throughput")
        assert [g.name for g in pick_active(rs)] == ["throughput"]

    def test_an_active_gear_gone_falls_back_to_the_initial_gear(self) -> None:
        rs = _explicit(activeGear="renamed")
        pick_active(rs)
        assert rs.active == "balanced"

    def test_a_shift_in_flight_runs_both_ends_and_frees_the_selector(self) -> None:
        rs = _explicit(
            activeGear="throughput",
            targetGear="latency",
            executor={"step": "Draining", "fromGear": "throughput", "toGear": "latency"},
        )
        gears = pick_active(rs)
        assert [g.name for g in gears] == ["latency", "throughput"]  # in the GearSet's order
        assert rs.in_flight
        desire = role_desire(rs, gears)
        assert desire.selected is None
        assert (desire.role, desire.pipeline_replicas, desire.drain_s) == ("prefill", 1, 120.0)

    def test_a_stable_executor_is_not_in_flight(self) -> None:
        rs = _explicit(activeGear="throughput", executor={"step": "Stable", "fromGear": "latency"})
        assert [g.name for g in pick_active(rs)] == ["throughput"]
        assert not rs.in_flight


class TestGearSetStatusPatch:
    def test_first_reconcile_of_an_explicit_role(self) -> None:
        rs = _active(_explicit())
        patch = gearset_status_patch(rs, NOW)
        selector = patch.pop("selector")
        assert patch == {"activeGear": "balanced", "phase": "Stable", "observedGeneration": 3}
        assert set(selector.split(",")) >= {
            "gearshift.io/service=llama3-8b",
            "gearshift.io/role=prefill",
            "gearshift.io/gear=balanced",
            "gearshift.io/stage=0",
        }

    def test_nothing_to_write(self) -> None:
        first = gearset_status_patch(_active(_explicit()), NOW)
        rs = _active(
            _explicit(activeGear="balanced", phase="Stable", selector=first["selector"], observedGeneration=3)
        )
        assert gearset_status_patch(rs, NOW) == {}

    def test_a_spec_edit_alone_is_observed_at_once(self) -> None:
        # A gear's microBatch edited changes nothing else this patch writes; the GearSet still says
        # that this generation was read (it lagged 27 s behind the edit under load).
        first = gearset_status_patch(_active(_explicit()), NOW)
        rs = _active(
            _explicit(activeGear="balanced", phase="Stable", selector=first["selector"], observedGeneration=2)
        )
        assert gearset_status_patch(rs, NOW) == {"observedGeneration": 3}

    def test_a_shift_in_flight_keeps_the_active_gear(self) -> None:
        rs = _active(_explicit(activeGear="gone", phase="Warming", executor={"step": "Warming"}))
        assert rs.in_flight and rs.active == "balanced"
        assert "activeGear" not in gearset_status_patch(rs, NOW)

    def test_autoscaled_follows_the_scaling_section(self) -> None:
        assert gearset_status_patch(_active(_explicit("decode")), NOW)["autoscaled"] is True
        rs = _active(_explicit("decode", pds=_pds(decode_scaling=False), autoscaled=True))
        assert gearset_status_patch(rs, NOW)["autoscaled"] is False

    def test_scaling_state_dropped_with_the_section(self) -> None:
        conds = [
            {"type": "ScalingActive", "status": "True", "reason": "Scaling", "message": "m"},
            {"type": "Other", "status": "True", "reason": "R", "message": "m"},
        ]
        rs = _active(_explicit("decode", pds=_pds(decode_scaling=False), conditions=conds))
        patch = gearset_status_patch(rs, NOW)
        assert patch["scaling"] is None
        assert [c["type"] for c in patch["conditions"]] == ["Other"]

    def test_planned_condition_of_an_auto_role(self) -> None:
        rs = _auto()
        rs.gears = [_gear("latency", ["n0"])]
        (cond,) = gearset_status_patch(rs, NOW)["conditions"]
        assert (cond["type"], cond["status"], cond["reason"], cond["message"]) == (
            "Planned",
            "True",
            "Planned",
            "1 gear(s) planned",
        )
        assert cond["observedGeneration"] == 3
        again = _auto(conditions=[cond])
        again.gears = rs.gears
        assert "conditions" not in gearset_status_patch(again, NOW)  # unchanged: nothing to write

    def test_plan_failure_condition(self) -> None:
        rs = _auto()
        rs.plan_error = "decode: no usable GPU node"
        (cond,) = gearset_status_patch(rs, NOW)["conditions"]
        assert (cond["status"], cond["reason"], cond["message"]) == ("False", "PlanFailed", rs.plan_error)


# --- planning ----------------------------------------------------------------------------------------------
DOC: dict[str, Any] = {"nodes": [{"name": "n0"}], "links": []}


class TestPlanKey:
    def test_the_fingerprint_format_is_kept(self) -> None:
        # Plans made by earlier operators keep their hash: no re-plan on upgrade.
        gs = _auto().gs
        arch = _pds().spec.model.to_model_arch().to_dict()
        assert gs.spec.plan is not None and gs.spec.plan.constraints is not None
        cons = gs.spec.plan.constraints.to_json()
        want = inputs_hash(DOC, cons, arch, ["latency", "balanced", "throughput"], 500)
        assert plan_key(_pds(), gs, DOC, 500, {}) == want
        assert plan_key(_pds(), gs, DOC, 500, {"n0": "left"}) == inputs_hash(
            DOC, cons, arch, ["latency", "balanced", "throughput"], 500, {"n0": "left"}
        )

    def test_inputs_that_move_it(self) -> None:
        gs = _auto().gs
        base = plan_key(_pds(), gs, DOC, 500, {})
        assert plan_key(_pds(), gs, DOC, 200, {}) != base
        assert plan_key(_pds(), gs, {**DOC, "nodes": [{"name": "n1"}]}, 500, {}) != base
        assert plan_key(_pds(), gs, DOC, 500, {"n0": "open"}) != base
        assert plan_key(_pds("vllm"), gs, DOC, 500, {}) != base  # vLLM's decode: one stage


class TestWindowEvents:
    def _w(self, node: str, state: str, stages: list[str]) -> dict[str, Any]:
        return {"node": node, "state": state, "stages": stages, "availableUntil": "T1", "leaveBy": "T0"}

    def test_each_transition(self) -> None:
        report = [
            self._w("a", "Leaving", ["latency/0"]),
            self._w("b", "Left", []),
            self._w("c", "Left", []),
            self._w("d", "InUse", ["balanced/1", "latency/0"]),
            self._w("e", "InUse", ["balanced/1"]),
            self._w("f", "Leaving", []),
        ]
        before = {"a": "InUse", "b": "InUse", "c": "Leaving", "e": "InUse", "f": "Leaving"}
        assert window_events("decode", report, before) == [
            (
                "decode",
                "WindowClosing",
                "node a is reclaimed at T1: past its leaveBy T0, re-planned without it; "
                "latency/0 shift(s) off it",
                False,
            ),
            (
                "decode",
                "WindowClosing",
                "node b is reclaimed at T1: past its leaveBy T0, re-planned without it",
                False,
            ),
            (
                "decode",
                "WindowVacated",
                "nothing of this role runs on node c any more (reclaimed at T1)",
                False,
            ),
            (
                "decode",
                "WindowedInUse",
                "time-limited node d (reclaimed at T1) holds balanced/1, latency/0; work leaves it by T0",
                False,
            ),
        ]

    def test_no_change_no_event(self) -> None:
        assert window_events("decode", [self._w("a", "InUse", ["x"])], {"a": "InUse"}) == []
        assert window_events("decode", [], {"a": "InUse"}) == []
        # A node the role never used, or left before, says nothing.
        assert window_events("decode", [self._w("g", "Left", []), self._w("h", "Leaving", [])], {}) == []
        assert window_events("decode", [self._w("g", "Left", [])], {"g": "Left"}) == []


class TestDesiredStateMemo:
    """desired_state plans an ``auto`` role through ``memo`` (the handler's plan cache), keyed by the plan's
    inputs hash, and re-plans only when that hash moves."""

    def _fleet(self) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
        nodes = {n["metadata"]["name"]: n for n in fleet_nodes()}
        profiles = {
            name: datasheet_gpuprofile(n)
            for name, n in nodes.items()
            if n["status"]["allocatable"].get("nvidia.com/gpu")
        }
        return nodes, profiles

    def test_plans_through_the_memo_once(self) -> None:
        nodes, profiles = self._fleet()
        planned = [_gear("latency", ["gpu-h100-0"])]
        keys: list[str] = []

        def memo(key: str, plan: Any) -> list[Gear]:
            keys.append(key)
            return [g.model_copy() for g in planned]

        settings = type("S", (), {"sim_requests": 200})()
        roles = {"prefill": _explicit(), "decode": _auto()}
        want = desired_state(_pds(), roles, nodes, profiles, settings, NOW, memo=memo)
        (key,) = keys
        rs = roles["decode"]
        h100_gpus = int(nodes["gpu-h100-0"]["status"]["allocatable"]["nvidia.com/gpu"])
        assert [s.gpus for s in rs.gears[0].stages] == [h100_gpus]  # from the node's profile
        assert rs.gs_status_patch["profilesHash"] == key
        assert [g["name"] for g in rs.gs_status_patch["plannedGears"]] == ["latency"]
        assert [(e[0], e[1]) for e in want.plan_events] == [("decode", "Planned")]
        assert want.plan_events[0][2].startswith("planned 1 gear(s) on 1 node(s) of ")
        assert [(d.role, [g.name for g in d.gears], d.selected) for d in want.desires] == [
            ("prefill", ["balanced"], "balanced"),
            ("decode", ["latency"], "latency"),
        ]
        assert want.problems == want.lost == [] and want.skip_gears == set()

        # The stored plan under the same hash: no re-plan, no event.
        stored = _auto(
            profilesHash=key, plannedGears=rs.gs_status_patch["plannedGears"], activeGear="latency"
        )
        roles = {"prefill": _explicit(), "decode": stored}
        want = desired_state(_pds(), roles, nodes, profiles, settings, NOW, memo=memo)
        assert keys == [key] and want.plan_events == []
        assert "plannedGears" not in stored.gs_status_patch

    def test_a_gear_on_a_lost_node_is_skipped(self) -> None:
        nodes, profiles = self._fleet()
        nodes = copy.deepcopy(nodes)
        nodes["gpu-h100-0"]["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
        roles = {
            "prefill": _explicit(activeGear="balanced"),
            "decode": _explicit("decode", activeGear="latency"),
        }
        settings = type("S", (), {"sim_requests": 200})()
        want = desired_state(_pds(), roles, nodes, profiles, settings, NOW, memo=lambda k, p: [])
        # balanced names gpu-h100-0 for its first stage; latency places by labels (an H100 is still Ready).
        assert want.lost == ["gpu-h100-0"]
        assert want.skip_gears == {("prefill", "balanced")}
        assert [(d.role, [g.name for g in d.gears]) for d in want.desires] == [
            ("prefill", []),
            ("decode", ["latency"]),
        ]


def test_plan_error_when_no_node_is_left() -> None:
    roles = {"prefill": _explicit(), "decode": _auto()}
    settings = type("S", (), {"sim_requests": 200})()

    def memo(key: str, plan: Any) -> list[Gear]:
        raise AssertionError("no plan without nodes")

    want = desired_state(_pds(), roles, {}, {}, settings, NOW, memo=memo)
    assert roles["decode"].plan_error is not None and roles["decode"].plan_error.startswith(
        "decode: no usable GPU"
    )
    # (prefill's explicit gear names nodes this empty fleet lacks: its problems come first)
    assert want.problems[-2:] == [
        roles["decode"].plan_error,
        "decode: GearSet 'llama3-8b-decode' has no gears yet",
    ]
    assert [d.role for d in want.desires] == ["prefill"]


def test_plan_errors_from_the_planner_are_reported() -> None:
    nodes, profiles = TestDesiredStateMemo()._fleet()
    roles = {"prefill": _explicit(), "decode": _auto()}
    settings = type("S", (), {"sim_requests": 200})()

    def memo(key: str, plan: Any) -> list[Gear]:
        raise planner.PlanError("nothing fits")

    desired_state(_pds(), roles, nodes, profiles, settings, NOW, memo=memo)
    assert roles["decode"].plan_error is not None
    assert roles["decode"].plan_error.endswith("node(s): nothing fits")
    assert "plannedGears" not in roles["decode"].gs_status_patch


def test_services_using() -> None:
    bodies = [
        {"metadata": {"name": "b"}, "spec": {"prefill": {"gearSetRef": {"name": "gs1"}}}},
        {"metadata": {"name": "a"}, "spec": {"decode": {"gearSetRef": {"name": "gs1"}}}},
        {"metadata": {"name": "c"}, "spec": {"decode": {"gearSetRef": {"name": "gs2"}}}},
        {"metadata": {"name": "d"}},
    ]
    assert services_using(bodies, "gs1") == ["a", "b"]
    assert services_using(bodies, "none") == []


class TestRolloutsStarting:
    @staticmethod
    def _sts(name: str, role: str, gear: str, template_hash: str | None) -> dict[str, Any]:
        notes = {} if template_hash is None else {ANNOTATION_TEMPLATE_HASH: template_hash}
        labels = {names.LABEL_ROLE: role, names.LABEL_GEAR: gear}
        return {"kind": "StatefulSet", "metadata": {"name": name, "labels": labels, "annotations": notes}}

    def test_only_a_serving_gears_changed_template_starts_a_rollout(self) -> None:
        live = {
            "p-a-s0": self._sts("p-a-s0", "prefill", "a", "h1"),
            "p-b-s0": self._sts("p-b-s0", "prefill", "b", "h1"),
            "d-a-s0": self._sts("d-a-s0", "decode", "a", None),  # an older operator's: no fingerprint
        }
        desired = [
            self._sts("p-a-s0", "prefill", "a", "h2"),  # active, new template: rolls
            self._sts("p-b-s0", "prefill", "b", "h2"),  # not active: nothing serves from it
            self._sts("p-a-s1", "prefill", "a", "h2"),  # not there yet: nothing to roll
            self._sts("d-a-s0", "decode", "a", "h1"),  # no fingerprint live: counted, the safe side
            {"kind": "Service", "metadata": {"name": "p-a-s0"}},
        ]
        got = rollouts_starting(desired, live, {"prefill": "a", "decode": "a"})
        assert got == [
            "prefill gear a: StatefulSet p-a-s0 gets a new pod template",
            "decode gear a: StatefulSet d-a-s0 gets a new pod template",
        ]
        assert rollouts_starting(desired[:1], live, {"prefill": "b"}) == []
        assert rollouts_starting([self._sts("p-a-s0", "prefill", "a", "h1")], live, {"prefill": "a"}) == []
        conds = rollout_ahead(got[:1])
        assert [(c.type, c.status, c.reason) for c in conds] == [
            ("Progressing", "True", "RollingOut"),
            ("Ready", "False", "RollingOut"),
        ]
