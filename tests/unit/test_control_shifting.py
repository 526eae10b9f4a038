"""The gear-shifting tick's pure parts (control/shifting/tick.py, control/shifting/shift_status.py): the
observed gears, free GPUs and the shadow check (on control/scaling.place_replicas), the executor's request
with a time-limited node, the decision's events, the SignalsAvailable condition, actions → API operations, and
the status patch with its history and gear-health entries."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, ClassVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gearshift.api.common import COND_SIGNALS_AVAILABLE, MAX_HISTORY, REASON_SIGNALS_MISSING
from gearshift.api.gearset import Gear, GearSet
from gearshift.api.gearset_status import GearHealth, GearSignals
from gearshift.control.shifting import tick as cs
from gearshift.control.shifting.adapt import gear_views
from gearshift.control.shifting.decide import MANUAL, Decision, DecisionKind, DecisionState
from gearshift.control.shifting.executor import GearObservation, Phase, ShiftRequest, ShiftState
from gearshift.control.shifting.executor_actions import (
    DeleteGear,
    EnsureGear,
    Event,
    MarkUnhealthy,
    Outcome,
    RecordShift,
    SelectGear,
)
from gearshift.control.shifting.policy import GearTable, ShiftRules
from gearshift.control.shifting.shift_status import (
    MESSAGE_LIMIT,
    STATUS_HEARTBEAT_S,
    Signals,
    gear_fingerprint,
    heartbeat_only,
    history_with,
    records_to_status,
    status_patch,
)
from gearshift.control.signals import Reading, UtilizationSource
from gearshift.control.smoothing import LatencyMetric, Sample
from gearshift.control.windows import TRIGGER_WINDOW
from gearshift.facts.model import load_hf_config
from gearshift.facts.rfc3339 import to_time
from gearshift.k8s import names
from gearshift.k8s.placement import pod_gpus
from gearshift.testing.kube import merge_patch

ARCH = load_hf_config(Path(__file__).resolve().parents[2] / "examples" / "models" / "llama-3-8b.json")
T0 = 1_800_000_000.0
GPU = "nvidia.com/gpu"


def node(name: str, gpus: int, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels}, "status": {"allocatable": {GPU: str(gpus)}}}


def pod_on(host: str, gpus: int, phase: str = "Running", where: str = "limits") -> dict[str, Any]:
    return {
        "spec": {"nodeName": host, "containers": [{"resources": {where: {GPU: str(gpus)}}}]},
        "status": {"phase": phase},
    }


def gear(*stages: dict[str, Any], name: str = "g") -> Gear:
    return Gear.model_validate(
        {"name": name, "stages": [{"layers": [k, k + 1], **s} for k, s in enumerate(stages)]}
    )


# --- free GPUs and the shadow check --------------------------------------------------------------------
class TestFreeGpus:
    def test_allocatable_minus_unfinished_pods(self) -> None:
        nodes = [node("a", 4), node("b", 2), node("c", 0)]
        pods = [
            pod_on("a", 1),
            pod_on("a", 2, where="requests"),  # no limit: the request counts
            pod_on("b", 2, phase="Succeeded"),  # finished pods hold nothing
            pod_on("b", 1, phase="Failed"),
            pod_on("b", 1, phase="Pending"),
            pod_on("elsewhere", 8),  # not one of the nodes
            pod_on("c", 1),  # over-committed: goes negative
        ]
        assert cs.free_gpus(nodes, pods) == {"a": 1, "b": 1, "c": -1}

    def test_pod_gpus_sums_containers_limit_first(self) -> None:
        pod = {
            "spec": {
                "containers": [
                    {"resources": {"limits": {GPU: "2"}, "requests": {GPU: "1"}}},
                    {"resources": {"requests": {GPU: "3"}}},
                    {"resources": {}},
                ]
            }
        }
        assert pod_gpus(pod) == 5
        assert pod_gpus({}) == 0

    def test_gpus_by_gear_counts_each_gears_live_pods(self) -> None:
        def pod(gear: str, gpus: int, phase: str = "Running") -> dict[str, Any]:
            return {
                "metadata": {"labels": {names.LABEL_GEAR: gear}},
                "spec": {"containers": [{"resources": {"limits": {GPU: str(gpus)}}}]},
                "status": {"phase": phase},
            }

        pods = [pod("a", 2), pod("a", 1), pod("b", 4, "Failed"), pod("b", 1, "Pending"), pod("other", 8)]
        assert cs.gpus_by_gear(["a", "b", "c"], pods) == {"a": 3, "b": 1, "c": 0}


class TestShadowFits:
    def test_the_node_with_most_free_gpus_goes_first(self) -> None:
        # Stage 0 (1 GPU) on b (2 free) leaves a=1, b=1: stage 1's two 1-GPU pods take one node each.
        # A tightest-fit choice (stage 0 on a) would leave only b for stage 1: it would not fit.
        nodes = [node("a", 1), node("b", 2)]
        g = gear({"nodes": ["a", "b"]}, {"nodes": ["a", "b"], "replicas": 2})
        assert cs.shadow_fits(g, 1, nodes, [])

    def test_greedy_not_optimal(self) -> None:
        # Most free first puts stage 0 on b (2 free → 1); stage 1 needs 2 GPUs on one node: none left,
        # though stage 0 on a would have left b whole. The check is a greedy fit, as documented.
        nodes = [node("a", 1), node("b", 2)]
        g = gear({"nodes": ["a", "b"]}, {"nodes": ["b"], "gpus": 2})
        assert not cs.shadow_fits(g, 1, nodes, [])

    def test_ties_go_in_the_stage_s_node_order(self) -> None:
        nodes = [node("a", 1), node("b", 1)]
        # Both have 1 free: stage 0 lists b first and takes it, so stage 1 (only b) finds none.
        assert not cs.shadow_fits(gear({"nodes": ["b", "a"]}, {"nodes": ["b"]}), 1, nodes, [])
        assert cs.shadow_fits(gear({"nodes": ["a", "b"]}, {"nodes": ["b"]}), 1, nodes, [])
        # A selector stage lists the nodes in the API's order.
        sel = {"nodeSelector": {"pool": "x"}}
        pool = [node("b", 1, pool="x"), node("a", 1, pool="x")]
        assert not cs.shadow_fits(gear(sel, {"nodes": ["b"]}), 1, pool, [])
        assert cs.shadow_fits(gear(sel, {"nodes": ["a"]}), 1, pool, [])

    def test_one_pod_of_a_stage_per_node_selector_stages_too(self) -> None:
        nodes = [node("a", 8, pool="x")]
        assert cs.shadow_fits(gear({"nodeSelector": {"pool": "x"}}), 1, nodes, [])
        assert not cs.shadow_fits(gear({"nodeSelector": {"pool": "x"}, "replicas": 2}), 1, nodes, [])
        assert not cs.shadow_fits(gear({"nodeSelector": {}}), 2, nodes, [])  # any node: still one each
        # Different stages may share a node.
        assert cs.shadow_fits(gear({"nodes": ["a"], "gpus": 4}, {"nodes": ["a"], "gpus": 4}), 1, nodes, [])
        assert not cs.shadow_fits(
            gear({"nodes": ["a"], "gpus": 4}, {"nodes": ["a"], "gpus": 5}), 1, nodes, []
        )

    def test_pipeline_replicas_multiply_the_pods_and_zero_counts_as_one(self) -> None:
        nodes = [node(f"n{i}", 1) for i in range(3)]
        g = gear({"nodeSelector": {}})
        assert cs.shadow_fits(g, 3, nodes, []) and not cs.shadow_fits(g, 4, nodes, [])
        assert cs.shadow_fits(g, 0, nodes[:1], [])  # scaled to zero: the shadow still has one replica
        g2 = gear({"nodeSelector": {}, "replicas": 2})
        assert cs.shadow_fits(g2, 1, nodes[:2], []) and not cs.shadow_fits(g2, 2, nodes, [])

    def test_running_pods_and_unknown_or_missing_nodes(self) -> None:
        nodes = [node("a", 2), node("b", 1, pool="y")]
        assert not cs.shadow_fits(gear({"nodes": ["a"], "gpus": 2}), 1, nodes, [pod_on("a", 1)])
        assert cs.shadow_fits(gear({"nodes": ["a"], "gpus": 2}), 1, nodes, [pod_on("a", 1, "Succeeded")])
        assert not cs.shadow_fits(gear({"nodes": ["gone"]}), 1, nodes, [])  # a named node not in the fleet
        assert not cs.shadow_fits(gear({"nodeSelector": {"pool": "z"}}), 1, nodes, [])  # no match
        assert cs.shadow_fits(gear({"nodeSelector": {"pool": "y"}}), 1, nodes, [])

    def test_a_node_named_twice_in_a_stage_counts_once(self) -> None:
        # The StatefulSet's required anti-affinity puts one pod of the stage per node, named twice or not.
        assert not cs.shadow_fits(gear({"nodes": ["a", "a"], "replicas": 2}), 1, [node("a", 2)], [])


def _shadow_fits_before(
    g: Gear, pipeline_replicas: int, nodes: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]]
) -> bool:
    """handlers/shifting.shadow_fits as it was before it was built on place_replicas (the reference)."""
    node_list = list(nodes)
    free = {n["metadata"]["name"]: int(n["status"]["allocatable"][GPU]) for n in node_list}
    for p in pods:
        host = (p.get("spec") or {}).get("nodeName")
        if host in free and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
            free[host] -= pod_gpus(p)
    labels = {n["metadata"]["name"]: (n["metadata"].get("labels") or {}) for n in node_list}
    for s in g.stages:
        if s.nodes:
            cands = [n for n in s.nodes if n in free]
        else:
            cands = [n for n in free if all(labels[n].get(k) == v for k, v in s.node_selector.items())]
        need = s.replicas * max(pipeline_replicas, 1)
        for n in sorted(cands, key=lambda x: -free[x]):
            if need == 0:
                break
            if free[n] >= s.gpus:
                free[n] -= s.gpus
                need -= 1
        if need > 0:
            return False
    return True


NODE_NAMES = ["n0", "n1", "n2", "n3", "n4"]
_stage = st.fixed_dictionaries(
    {
        "gpus": st.integers(1, 4),
        "replicas": st.integers(1, 3),
        # Named nodes without repeats (a repeated name is the one case that differs; tested above).
        "where": st.one_of(
            st.lists(st.sampled_from([*NODE_NAMES, "gone"]), min_size=1, max_size=4, unique=True),
            st.sampled_from([{}, {"pool": "x"}, {"pool": "y"}]),
        ),
    }
)


@settings(max_examples=400, deadline=None)
@given(
    free=st.lists(st.integers(0, 8), min_size=len(NODE_NAMES), max_size=len(NODE_NAMES)),
    pools=st.lists(st.sampled_from(["x", "y"]), min_size=len(NODE_NAMES), max_size=len(NODE_NAMES)),
    busy=st.lists(st.tuples(st.sampled_from(NODE_NAMES), st.integers(1, 3)), max_size=4),
    stages=st.lists(_stage, min_size=1, max_size=4),
    pipelines=st.integers(0, 3),
)
def test_shadow_fits_answers_as_before_the_move_onto_place_replicas(
    free: list[int],
    pools: list[str],
    busy: list[tuple[str, int]],
    stages: list[dict[str, Any]],
    pipelines: int,
) -> None:
    nodes = [node(n, f, pool=p) for n, f, p in zip(NODE_NAMES, free, pools, strict=True)]
    pods = [pod_on(host, gpus) for host, gpus in busy]
    g = gear(
        *(
            {"gpus": s["gpus"], "replicas": s["replicas"]}
            | ({"nodes": s["where"]} if isinstance(s["where"], list) else {"nodeSelector": s["where"]})
            for s in stages
        )
    )
    assert cs.shadow_fits(g, pipelines, nodes, pods) == _shadow_fits_before(g, pipelines, nodes, pods)


class TestShadowToCheck:
    target = gear({"nodes": ["a"]}, name="latency")
    gears: ClassVar[dict[str, Gear]] = {
        "latency": target,
        "balanced": gear({"nodes": ["a"]}, name="balanced"),
    }
    stable = ShiftState(active="balanced")

    def test_only_a_shift_about_to_start_to_a_gear_without_objects(self) -> None:
        req = ShiftRequest("latency", "p99-high")
        assert cs.shadow_to_check(req, self.stable, self.gears, {"balanced"}) is self.target
        assert cs.shadow_to_check(None, self.stable, self.gears, set()) is None
        busy = ShiftState(active="balanced", phase=Phase.WARMING, to_gear="latency")
        assert cs.shadow_to_check(req, busy, self.gears, set()) is None
        assert cs.shadow_to_check(req, self.stable, self.gears, {"latency"}) is None  # shadow exists
        assert cs.shadow_to_check(ShiftRequest("gone", "p99-high"), self.stable, self.gears, set()) is None


# --- the observed gears --------------------------------------------------------------------------------
def sts(gear_name: str | None, stage: int, replicas: int = 1, ready: int = 1) -> dict[str, Any]:
    labels = {names.LABEL_STAGE: str(stage)} | ({names.LABEL_GEAR: gear_name} if gear_name else {})
    return {
        "metadata": {"labels": labels},
        "spec": {"replicas": replicas},
        "status": {"readyReplicas": ready},
    }


def ready_pod(gear_name: str, at: float) -> dict[str, Any]:
    return {
        "metadata": {"labels": {names.LABEL_GEAR: gear_name}},
        "status": {"conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": to_time(at)}]},
    }


class TestObserveGears:
    def test_statefulsets_by_gear(self) -> None:
        a0, a1, b0, x = sts("a", 0), sts("a", 1), sts("b", 0), sts(None, 0)
        assert cs.statefulsets_by_gear([a0, b0, a1, x]) == {"a": [a0, a1], "b": [b0], "": [x]}

    def test_drained_sampled_and_per_gear_pods(self) -> None:
        spec = {"a": gear({}, {}, name="a"), "b": gear({}, name="b")}
        by_gear = {"a": [sts("a", 0), sts("a", 1)], "b": [sts("b", 0)], "old": [sts("old", 0)]}
        pods = [ready_pod("a", T0), ready_pod("a", T0 + 5), ready_pod("b", T0 + 9), ready_pod("old", T0)]
        smp = Sample(at=T0, qps=4.0, ttft_p99_ms=120.0, itl_p99_ms=30.0)

        def observe(drained: str | None, in_flight: int | None, metric: LatencyMetric) -> dict[str, Any]:
            return cs.observe_gears(
                spec, by_gear, pods, drained=drained, drained_in_flight=in_flight,
                sample=smp, sample_gear="a", metric=metric,
            )  # fmt: skip

        got = observe("b", 3, LatencyMetric.TTFT)
        assert got["a"] == GearObservation(ready=True, ready_since=T0 + 5, p99_ms=120.0, qps=4.0)
        assert got["b"] == GearObservation(ready=True, ready_since=T0 + 9, in_flight=3)
        # A gear no longer in the spec is observed without a stage count: its one StatefulSet is complete.
        assert got["old"] == GearObservation(ready=True, ready_since=T0)
        assert observe("b", None, LatencyMetric.ITL)["b"].in_flight == 1  # unknown holds the drain
        assert observe("b", None, LatencyMetric.ITL)["a"].p99_ms == 30.0
        assert observe("gone", 0, LatencyMetric.TTFT).keys() == {"a", "b", "old"}
        quiet = cs.observe_gears(spec, by_gear, pods, drained=None, drained_in_flight=None, sample=None,
                                 sample_gear="a", metric=LatencyMetric.TTFT)  # fmt: skip
        assert quiet["a"].p99_ms is None and quiet["a"].qps is None

    def test_a_missing_stage_is_not_ready(self) -> None:
        spec = {"a": gear({}, {}, name="a")}
        got = cs.observe_gears(spec, {"a": [sts("a", 0)]}, [ready_pod("a", T0)], drained=None,
                               drained_in_flight=None, sample=None, sample_gear=None,
                               metric=LatencyMetric.TTFT)  # fmt: skip
        assert got == {"a": GearObservation(ready=False)}


# --- requests, holds, events ---------------------------------------------------------------------------
def gearset(
    active: str,
    windowed: list[dict[str, Any]],
    health: list[dict[str, Any]] | None = None,
    force: str | None = None,
) -> GearSet:
    at = datetime.fromtimestamp(T0, UTC)
    return GearSet.model_validate(
        {
            "apiVersion": "gearshift.io/v1alpha1",
            "kind": "GearSet",
            "metadata": {"name": "gs"},
            "spec": {
                "serviceName": "svc",
                "role": "prefill",
                "mode": "explicit",
                "forceGear": force,
                "gears": [
                    {"name": "on-w", "intent": "latency", "stages": [{"layers": [0, 32], "nodes": ["w"]}]},
                    {"name": "off-w", "intent": "latency", "stages": [{"layers": [0, 32], "nodes": ["d"]}]},
                ],
            },
            "status": {
                "activeGear": active,
                "gearHealth": health or [],
                "windowedNodes": [
                    {
                        "availableUntil": (at + timedelta(hours=1)).isoformat(),
                        "leaveBy": (at + timedelta(minutes=30)).isoformat(),
                        **w,
                    }
                    for w in windowed
                ],
            },
        }
    )


def table(gs: GearSet, active: str, unhealthy: Iterable[str] = ()) -> GearTable:
    marks = [GearHealth(gear=g, healthy=False, reason="NotReadyInTime") for g in unhealthy]
    return GearTable(gear_views(gs.gears(), marks), active=active, arch=ARCH)


SHIFT = Decision(DecisionKind.SHIFT, "P99High", target="off-w", trigger="p99-high", p99_ms=300.0, qps=2.0)
HOLD = Decision(DecisionKind.HOLD, "Steady")


class TestExecutorRequest:
    def test_a_leaving_node_replaces_the_decision(self) -> None:
        gs = gearset("on-w", [{"node": "w", "state": "Leaving"}])
        req, warning = cs.executor_request(HOLD, table(gs, "on-w"), gs, ShiftState(active="on-w"))
        assert req == ShiftRequest("off-w", TRIGGER_WINDOW, None) and warning is None

    def test_no_healthy_gear_off_the_node_warns_and_keeps_the_decision(self) -> None:
        gs = gearset("on-w", [{"node": "w", "state": "Leaving"}])
        t = table(gs, "on-w", unhealthy=["off-w"])
        req, warning = cs.executor_request(SHIFT, t, gs, ShiftState(active="on-w"))
        assert req == ShiftRequest("off-w", "p99-high", None, baseline_p99_ms=300.0, baseline_qps=2.0)
        assert warning is not None and "'on-w'" in warning and "w past their leaveBy" in warning

    def test_nothing_to_vacate(self) -> None:
        for gs, active in (
            (gearset("on-w", [{"node": "w", "state": "InUse"}]), "on-w"),  # not past leaveBy
            (gearset("off-w", [{"node": "w", "state": "Leaving"}]), "off-w"),  # not on the node
        ):
            assert cs.executor_request(HOLD, table(gs, active), gs, ShiftState(active=active)) == (None, None)
        gs = gearset("on-w", [{"node": "w", "state": "Leaving"}])
        busy = ShiftState(active="on-w", phase=Phase.WARMING, to_gear="x", trigger="p99-high")
        assert cs.window_request(gs, table(gs, "on-w"), busy) is None  # a running shift finishes first


class TestDecisionEvent:
    def test_acting_decisions_always(self) -> None:
        raised = Decision(DecisionKind.THRESHOLD_RAISED, "P99High", "raised one step")
        vetoed = Decision(DecisionKind.VETOED, "P99High", "costs more than it brings")
        assert cs.decision_event(raised, "P99High") == Event("ThresholdRaised", "raised one step", False)
        assert cs.decision_event(vetoed, None) == Event("ShiftVetoed", "costs more than it brings", True)
        assert cs.decision_event(SHIFT, None) is None

    def test_holds_only_when_the_reason_changes_and_is_news(self) -> None:
        dwell = Decision(DecisionKind.HOLD, "Dwell", "in the dwell")
        assert cs.decision_event(dwell, None) == Event("Dwell", "in the dwell", False)
        assert cs.decision_event(dwell, "Steady") == Event("Dwell", "in the dwell", False)
        assert cs.decision_event(dwell, "Dwell") is None
        for quiet in ("Steady", "ShiftInProgress", "ForcedGear"):
            assert cs.decision_event(Decision(DecisionKind.HOLD, quiet), None) is None
        unhealthy = Decision(DecisionKind.HOLD, "ForceGearUnhealthy", "forced gear is unhealthy")
        assert cs.decision_event(unhealthy, "Steady") == Event("ForceGearUnhealthy", unhealthy.message, True)


class TestForcedAndMarks:
    def test_forced_shift_reverted(self) -> None:
        gs = gearset("on-w", [])
        forced = ShiftState(active="on-w", phase=Phase.WARMING, to_gear="off-w", trigger=MANUAL)
        assert cs.forced_shift_reverted(gs, forced) == "spec.forceGear was cleared"
        assert (
            cs.forced_shift_reverted(gearset("on-w", [], force="on-w"), forced)
            == "spec.forceGear names 'on-w'"
        )
        assert cs.forced_shift_reverted(gearset("on-w", [], force="off-w"), forced) is None
        assert cs.forced_shift_reverted(gs, ShiftState(active="on-w")) is None
        by_trigger = ShiftState(active="on-w", phase=Phase.WARMING, to_gear="off-w", trigger="p99-high")
        assert cs.forced_shift_reverted(gs, by_trigger) is None

    def test_marks_hold_for_the_gear_and_profiles_they_were_made_under(self) -> None:
        probe = gearset("on-w", [])
        on_w = gear_fingerprint(probe.gears()[0])
        health = [
            {"gear": "on-w", "healthy": False, "gearHash": on_w, "profilesHash": None},
            {"gear": "off-w", "healthy": False, "gearHash": "edited-since"},
            {"gear": "gone", "healthy": False, "gearHash": None},
        ]
        gs = gearset("on-w", [], health)
        assert [m.gear for m in cs.current_marks(gs)] == ["on-w", "gone"]


# --- the SignalsAvailable condition --------------------------------------------------------------------
class TestSignalsCondition:
    url = "http://prom:9090"

    def cond(self, reading: Reading | None, url: str | None = url, why: str = "") -> cs.ConditionUpdate:
        return cs.signals_condition(
            url=url, engine="vllm", reading=reading, metric=LatencyMetric.TTFT, why=why
        )

    def test_ok(self) -> None:
        c = self.cond(Reading(Sample(at=T0, qps=2.0, ttft_p99_ms=100.0)))
        assert c == cs.ConditionUpdate(
            COND_SIGNALS_AVAILABLE, "True", "SignalsOk", f"Prometheus at {self.url} answers"
        )

    def test_no_stage_balance(self) -> None:
        r = Reading(Sample(at=T0, qps=2.0, ttft_p99_ms=100.0), UtilizationSource.NONE, note="no stage times")
        c = self.cond(r)
        assert (c.status, c.reason, c.warning) == ("True", "StageBalanceUnavailable", False)
        assert "no stage times" in c.message and "engine vllm" in c.message
        # A series without a value while requests flow comes first (missing is never fine).
        r = Reading(Sample(at=T0, qps=2.0), UtilizationSource.NONE, note="no stage times")
        assert (self.cond(r).status, self.cond(r).reason) == ("False", "LatencyUnavailable")

    def test_served_without_latency_warns(self) -> None:
        c = self.cond(Reading(Sample(at=T0, qps=2.0, itl_p99_ms=20.0)))  # TTFT is the metric: no data
        assert (c.status, c.reason, c.warning) == ("False", "LatencyUnavailable", True)
        assert c.message == (
            f"Prometheus at {self.url} answers and the gear serves requests, but these series have no "
            "value: vllm:time_to_first_token_seconds P99 (not-a-number) (are they exported by the head "
            "pods and scraped?); the p99-high, p99-low, saturation trigger(s) hold"
        )
        idle = self.cond(Reading(Sample(at=T0, qps=0.0)))  # nothing served: no latency is expected
        assert idle.reason == "SignalsOk"

    def test_missing(self) -> None:
        c = self.cond(None, why="connection refused")
        assert c == cs.ConditionUpdate(
            COND_SIGNALS_AVAILABLE,
            "False",
            REASON_SIGNALS_MISSING,
            "connection refused; no gear shift starts",
            True,
        )
        assert self.cond(None, url=None, why="no URL").reason == "NoPrometheus"
        assert self.cond(None, url="", why="no URL").reason == "NoPrometheus"


# --- actions → API operations --------------------------------------------------------------------------
RECORD = RecordShift("a", "b", "p99-high", T0, Outcome.IN_PROGRESS)


class TestApiOperations:
    def test_order_kept_status_actions_left_to_the_patch(self) -> None:
        acts = [
            RECORD,
            EnsureGear("b", shadow=True),
            MarkUnhealthy("b", "OOMKilled"),
            Event("ShiftStarted", "a -> b"),
            SelectGear("b"),
            DeleteGear("a"),
        ]
        assert cs.api_operations(acts) == [acts[1], acts[3], acts[4], acts[5]]
        assert cs.api_operations([]) == []

    def test_an_unknown_action_raises(self) -> None:
        with pytest.raises(cs.UnknownActionError, match="ScaleGear"):
            cs.api_operations([SelectGear("b"), "ScaleGear(b)"])  # type: ignore[list-item]
        assert issubclass(cs.UnknownActionError, TypeError)


def test_gears_to_free_keeps_the_serving_gear() -> None:
    all_sts = [sts("a", 0), sts("a", 1), sts("b", 0), sts("c", 0), sts(None, 0)]
    assert cs.gears_to_free(all_sts, "b", "a") == ["a", "c"]  # the Service's gear wins
    assert cs.gears_to_free(all_sts, None, "a") == ["b", "c"]
    assert cs.gears_to_free(all_sts, None, None) == ["a", "b", "c"]


# --- status: history, gear health, the patch ----------------------------------------------------------
class TestRecords:
    def test_history_replaces_the_same_shift_and_appends_others(self) -> None:
        first = history_with([], RECORD)
        assert first == [
            {"from": "a", "to": "b", "trigger": "p99-high", "startedAt": to_time(T0), "finishedAt": None,
             "outcome": "InProgress", "message": ""}
        ]  # fmt: skip
        done = RecordShift("a", "b", "p99-high", T0 + 0.0005, Outcome.SUCCEEDED, T0 + 60, "switched")
        second = history_with(first, done)  # same start within 1 ms, same target: the same entry
        assert len(second) == 1 and second[0]["outcome"] == "Succeeded"
        assert second[0]["finishedAt"] == to_time(T0 + 60)
        other = RecordShift("b", "c", "p99-low", T0 + 100, Outcome.IN_PROGRESS)
        assert [h["to"] for h in history_with(second, other)] == ["b", "c"]
        assert (
            history_with([], RecordShift("a", "b", "t", T0, Outcome.FAILED, message="x" * 5000))[0]["message"]
            == "x" * MESSAGE_LIMIT
        )

    def test_history_keeps_the_last_entries(self) -> None:
        raw: list[dict[str, Any]] = []
        for i in range(MAX_HISTORY + 3):
            raw = history_with(raw, RecordShift("a", f"g{i}", "t", T0 + i, Outcome.SUCCEEDED))
        assert len(raw) == MAX_HISTORY and raw[0]["to"] == "g3" and raw[-1]["to"] == f"g{MAX_HISTORY + 2}"

    def test_records_to_status(self) -> None:
        spec = {"b": gear({}, name="b")}
        health = [{"gear": "old", "healthy": False}, {"gear": "b", "healthy": False, "reason": "Old"}]
        marks = [GearHealth(gear="b", healthy=False)]
        acts = [RECORD, EnsureGear("b"), MarkUnhealthy("b", "OOMKilled", "oom"), MarkUnhealthy("x", "Crash")]
        hist, got = records_to_status([], health, acts, marks=marks, gears=spec, now=T0, profiles_hash="p1")
        assert [h["to"] for h in hist] == ["b"]
        assert got == [
            {"gear": "b", "healthy": False, "reason": "OOMKilled", "message": "oom", "since": to_time(T0),
             "profilesHash": "p1", "gearHash": gear_fingerprint(spec["b"])},
            {"gear": "x", "healthy": False, "reason": "Crash", "message": "", "since": to_time(T0),
             "profilesHash": "p1", "gearHash": None},
        ]  # fmt: skip
        # No action: the entries of marks that no longer hold leave, the others stay as stored.
        assert records_to_status([], health, [], marks=marks, gears=spec, now=T0, profiles_hash=None) == (
            [],
            [health[1]],
        )


class TestStatusPatch:
    policy = ShiftRules(dwell_s=100)

    def test_a_shift_in_flight_with_signals(self) -> None:
        state = ShiftState(active="a", phase=Phase.WARMING, from_gear="a", to_gear="b", trigger="p99-high")
        smoothed = Sample(at=T0, qps=2.0, ttft_p99_ms=150.0)
        dstate = DecisionState(smoothed=smoothed, last_shift_at=T0)
        patch = status_patch(
            state, dstate, self.policy, in_flight_old=None, history=[{"to": "b"}], health=[],
            conditions=[{"type": "SignalsAvailable"}], generation=7,
            signals=Signals(smoothed, smoothed, Reading(smoothed), replicas=1),
        )  # fmt: skip
        assert (patch["phase"], patch["activeGear"], patch["targetGear"]) == ("Warming", "a", "b")
        assert patch["executor"]["step"] == "Warming" and patch["executor"]["toGear"] == "b"
        assert patch["control"]["dwellUntil"] == to_time(T0 + 100)
        assert patch["history"] == [{"to": "b"}] and patch["gearHealth"] == []
        assert patch["conditions"] == [{"type": "SignalsAvailable"}] and patch["observedGeneration"] == 7
        assert (
            patch["signals"]["p99TtftMs"] == 150.0 and patch["signals"]["stageUtilizationSource"] == "engine"
        )

    def test_a_tick_without_a_sample_says_so_instead_of_keeping_old_values(self) -> None:
        # status.signals advances every tick; one without a sample records why, with every
        # value null (a merge patch keeps any key it leaves out, so each is sent).
        smoothed = Sample(at=T0, qps=2.0)
        why = "Prometheus at http://127.0.0.1:9 unreachable"
        patch = status_patch(
            ShiftState(active="a", to_gear="stale"), DecisionState(smoothed=smoothed), self.policy,
            in_flight_old=None, history=[], health=[], conditions=[], generation=None,
            signals=Signals(smoothed, None, None, replicas=1, at=T0 + 6, skipped=why, missed_samples=2),
        )  # fmt: skip
        assert patch["targetGear"] is None
        assert patch["control"]["dwellUntil"] is None
        sig = patch["signals"]
        assert (sig["sampleTime"], sig["skipped"], sig["missedSamples"]) == (to_time(T0 + 6), why, 2)
        values = {k: v for k, v in sig.items() if k not in ("sampleTime", "skipped", "missedSamples")}
        assert values.pop("stageUtilization") == []
        assert values and all(v is None for v in values.values()), values
        # Every field of the schema is in the patch: nothing of the last sample survives the merge.
        stored = {(f.alias or n) for n, f in GearSignals.model_fields.items()}
        assert set(sig) == stored

    def test_a_tick_with_a_sample_clears_skipped_and_counts_missed(self) -> None:
        smoothed = Sample(at=T0, qps=2.0, ttft_p99_ms=150.0)
        patch = status_patch(
            ShiftState(active="a"), DecisionState(smoothed=smoothed), self.policy,
            in_flight_old=None, history=[], health=[], conditions=[], generation=None,
            signals=Signals(smoothed, smoothed, Reading(smoothed), replicas=1, at=T0, missed_samples=4),
        )  # fmt: skip
        sig = patch["signals"]
        assert sig["skipped"] is None and sig["missedSamples"] == 4 and sig["sampleTime"] == to_time(T0)
        assert sig["qps"] == 2.0


_JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from(["a", "b"]))
_JSON = st.recursive(
    _JSON_LEAF,
    lambda inner: st.one_of(
        st.lists(inner, max_size=2),
        st.dictionaries(st.sampled_from(["x", "y", "sampleTime"]), inner, max_size=3),
    ),
    max_leaves=8,
)
_STATUS = st.dictionaries(st.sampled_from(["phase", "signals", "conditions"]), _JSON, max_size=3)


class TestHeartbeatOnly:
    """``heartbeat_only`` against the fake API server's RFC 7386 merge (an independent implementation)."""

    @settings(max_examples=300, deadline=None)
    @given(current=_STATUS, patch=_STATUS)
    def test_it_holds_exactly_when_the_merge_moves_nothing_but_sample_time(
        self, current: dict[str, Any], patch: dict[str, Any]
    ) -> None:
        fresh = to_time(T0)
        signals = current.get("signals")
        current = current | {
            "signals": (signals if isinstance(signals, dict) else {}) | {"sampleTime": fresh}
        }

        def without_time(s: Any) -> Any:
            sig = s.get("signals") if isinstance(s, dict) else None
            return (
                s
                if not isinstance(sig, dict)
                else s | {"signals": {k: v for k, v in sig.items() if k != "sampleTime"}}
            )

        merged = merge_patch(current, patch)
        unchanged = without_time(merged) == without_time(current) and isinstance(merged.get("signals"), dict)
        assert heartbeat_only(current, patch, T0 + 1) == unchanged

    def test_an_old_or_unreadable_sample_time_is_written(self) -> None:
        current = {"phase": "Stable", "signals": {"sampleTime": to_time(T0)}}  # as stored: no nulls
        patch = {"phase": "Stable", "signals": {"sampleTime": to_time(T0 + 30), "qps": None}}
        assert heartbeat_only(current, patch, T0 + 30)
        assert not heartbeat_only(current, patch, T0 + STATUS_HEARTBEAT_S)
        assert not heartbeat_only({**current, "signals": {"sampleTime": "soon"}}, patch, T0 + 30)
        assert not heartbeat_only(current, {**patch, "phase": "Warming"}, T0 + 30)
        assert not heartbeat_only(current, {**patch, "signals": {"qps": 1.0}}, T0 + 30)
