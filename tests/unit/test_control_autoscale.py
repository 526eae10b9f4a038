"""The autoscaler tick's pure rules (control/autoscale/tick.py): which gear, knobs and latency metric apply,
the sample's PromQL and parsing, what the tick reads off pods and StatefulSets, the drain (abort, hold, end,
timeout), and what a decision writes to spec.replicas, status.scaling, the condition, the draining label and
the events. Expected values are worked out by hand in each case's comment."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from gearshift.api.gearset import GearSet
from gearshift.api.gearset_status import ScalingStatus
from gearshift.api.pdservice import PDService, SLOSpec
from gearshift.control.autoscale import scaling as sc
from gearshift.control.autoscale import tick as A
from gearshift.control.signals import GearSelector, SignalsUnavailable
from gearshift.k8s import names

ROOT = Path(__file__).resolve().parents[2]
T0 = 1_800_000_000.0
#: T0 as status stores it: 1.8e9 s = 20833 days + 8 h after the epoch.
T0_RFC3339 = "2027-01-15T08:00:00Z"
SVC = "llama3-8b"


def pds_body() -> dict[str, Any]:
    """The example PDService: decode scales 1..3, SLO TTFT 200 ms, ITL 50 ms, no prometheusUrl."""
    return yaml.safe_load((ROOT / "examples" / "pdservice-llama3-8b.yaml").read_text())


def gs_body(**status: Any) -> dict[str, Any]:
    """Decode GearSet with gears ``a`` (1 stage) and ``b`` (2 stages, 2 pods in stage 0), 2 replicas."""
    return {
        "apiVersion": "gearshift.io/v1alpha1",
        "kind": "GearSet",
        "metadata": {"name": "llama3-8b-decode"},
        "spec": {
            "serviceName": SVC,
            "role": "decode",
            "mode": "explicit",
            "replicas": 2,
            "policy": {"drainTimeoutS": 90},
            "gears": [
                {"name": "a", "stages": [{"layers": [0, 32]}]},
                {
                    "name": "b",
                    "stages": [
                        {"layers": [0, 16], "replicas": 2, "gpus": 1, "nodes": ["n1", "n2"]},
                        {"layers": [16, 32], "gpus": 2, "nodeSelector": {"x": "y"}},
                    ],
                },
            ],
        },
        "status": {"activeGear": "b", **status},
    }


def scope(**status: Any) -> A.ScaleScope:
    s = A.scope_of(GearSet.model_validate(gs_body(**status)), PDService.model_validate(pds_body()), None)
    assert isinstance(s, A.ScaleScope)
    return s


def pod(name: str, stage: int, node: str | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": names.engine_labels(SVC, "decode", "b", stage)},
        "spec": {"nodeName": node} if node else {},
    }


def vector(value: str) -> list[dict[str, Any]]:
    """An instant vector of one sample, as Prometheus' /api/v1/query gives it."""
    return [{"metric": {}, "value": [T0, value]}]


class TestScope:
    def test_the_active_gear_and_the_roles_knobs(self) -> None:
        s = scope()
        assert (s.service, s.role, s.gear.name, s.current) == (SVC, "decode", "b", 2)
        assert (s.policy.min_replicas, s.policy.max_replicas) == (1, 3)
        assert s.compute_classes == ()
        assert s.drain_timeout_s == 90.0
        # decode is held to ITL: 50 ms in the example
        assert s.latency == A.LatencySignal("vllm:inter_token_latency_seconds", 50.0)
        assert s.prometheus_url is None
        assert not s.shift_in_flight
        assert s.pod_labels() == {
            names.LABEL_SERVICE: SVC,
            names.LABEL_ROLE: "decode",
            names.LABEL_GEAR: "b",
        }
        assert s.selector("ns1") == GearSelector("ns1", SVC, "decode", "b")

    def test_without_scaling_the_tick_idles(self) -> None:
        body = pds_body()
        del body["spec"]["decode"]["scaling"]
        s = A.scope_of(GearSet.model_validate(gs_body()), PDService.model_validate(body), None)
        assert s == A.Skip("no scaling section: replicas stay as spec.replicas says", idle=True)

    @pytest.mark.parametrize("active", [None, "gone"])
    def test_without_an_active_gear_the_tick_skips_but_does_not_idle(self, active: str | None) -> None:
        gs = GearSet.model_validate(gs_body() | {"status": {"activeGear": active}})
        s = A.scope_of(gs, PDService.model_validate(pds_body()), None)
        assert s == A.Skip("no active gear yet", idle=False)

    def test_the_pdservices_prometheus_wins_over_the_operators(self) -> None:
        gs = GearSet.model_validate(gs_body())
        plain = A.scope_of(gs, PDService.model_validate(pds_body()), "http://op:9090")
        body = pds_body()
        body["spec"]["prometheusUrl"] = "http://svc:9090"
        own = A.scope_of(gs, PDService.model_validate(body), "http://op:9090")
        assert isinstance(plain, A.ScaleScope) and isinstance(own, A.ScaleScope)
        assert (plain.prometheus_url, own.prometheus_url) == ("http://op:9090", "http://svc:9090")

    def test_compute_classes_come_from_the_scaling_section(self) -> None:
        body = pds_body()
        body["spec"]["decode"]["scaling"]["computeClasses"] = ["high", "mid"]
        s = A.scope_of(GearSet.model_validate(gs_body()), PDService.model_validate(body), None)
        assert isinstance(s, A.ScaleScope) and s.compute_classes == ("high", "mid")

    @pytest.mark.parametrize(
        ("step", "shifting"),
        [
            ("Warming", True),
            ("Draining", True),
            ("Switching", True),
            ("RollingBack", True),
            ("Degraded", True),
            ("Stable", False),
            ("Pending", False),
        ],
    )
    def test_shift_steps_are_a_shift_in_flight(self, step: str, shifting: bool) -> None:
        assert scope(executor={"step": step}).shift_in_flight is shifting


class TestLatencySignal:
    def test_prefill_is_held_to_ttft_and_decode_to_itl(self) -> None:
        slo = SLOSpec(ttft_ms=300, itl_ms=40)
        assert A.latency_signal("prefill", slo) == A.LatencySignal("vllm:time_to_first_token_seconds", 300)
        assert A.latency_signal("decode", slo) == A.LatencySignal("vllm:inter_token_latency_seconds", 40)


class TestSample:
    SEL = GearSelector("ns1", SVC, "decode", "b")

    def test_queries_read_the_head_pods_kv_queue_and_a_one_minute_p99(self) -> None:
        q = A.sample_queries(self.SEL, "vllm:inter_token_latency_seconds")
        assert list(q) == ["kv", "waiting", "running", "p99"]
        m = self.SEL.matchers()
        assert q["kv"] == f"max(vllm:kv_cache_usage_perc{m}) or max(vllm:gpu_cache_usage_perc{m})"
        assert q["p99"] == (
            f"histogram_quantile(0.99, sum by (le) (rate(vllm:inter_token_latency_seconds_bucket{m}[1m])))"
        )
        assert "vllm:num_requests_waiting" in q["waiting"] and "vllm:num_requests_running" in q["running"]

    def test_values_and_the_p99_against_the_slo(self) -> None:
        q = A.sample_queries(self.SEL, "m")
        results = {q["kv"]: vector("0.6"), q["waiting"]: vector("3"), q["running"]: vector("5")}
        results[q["p99"]] = vector("0.075")
        s = A.sample_from(q, results, slo_ms=50.0, at=T0)
        # P99 0.075 s = 75 ms against 50 ms: 1.5
        assert s == sc.ScaleSample(at=T0, kv_cache_usage=0.6, waiting=3.0, running=5.0, p99_ratio=1.5)

    def test_no_traffic_leaves_kv_and_p99_unknown(self) -> None:
        q = A.sample_queries(self.SEL, "m")
        results = {q["kv"]: [], q["waiting"]: vector("0"), q["running"]: vector("0"), q["p99"]: vector("NaN")}
        s = A.sample_from(q, results, slo_ms=50.0, at=T0)
        assert (s.kv_cache_usage, s.p99_ratio, s.waiting, s.running) == (None, None, 0.0, 0.0)
        assert s.missing == ()  # nothing runs: unknown, not missing

    def test_kv_or_p99_missing_while_requests_run_is_named_not_read_as_no_load(self) -> None:
        # Missing is never fine. KV usage gone (a relabel rule, an engine without the gauge) while
        # 5 requests run; the P99 not a number: both named with their queries.
        q = A.sample_queries(self.SEL, "m")
        results = {q["kv"]: [], q["waiting"]: vector("0"), q["running"]: vector("5"), q["p99"]: vector("NaN")}
        s = A.sample_from(q, results, slo_ms=50.0, at=T0)
        assert s.missing == (f"KV-cache usage ({q['kv']})", f"P99 ({q['p99']})")
        results[q["kv"]] = vector("0.4")
        results[q["p99"]] = vector("0.01")
        assert A.sample_from(q, results, slo_ms=50.0, at=T0).missing == ()

    def test_a_hold_for_a_missing_series_says_so_in_the_condition(self) -> None:
        decision = sc.ScaleDecision(
            sc.ScaleKind.HOLD,
            3,
            sc.REASON_SERIES_MISSING,
            "missing or not a number ...: KV-cache usage (q)",
            1,
        )
        acts = A.act_on(
            decision, before=sc.ScaleState(), after=sc.ScaleState(), scaling={}, current=3,
            placement=None, heads=["h-0", "h-1", "h-2"], pods_per_replica=1, now=T0,
        )  # fmt: skip
        assert acts.condition == ("False", sc.REASON_SERIES_MISSING, decision.message)
        assert acts.replicas is None and not acts.label

    def test_missing_queue_series_make_no_sample(self) -> None:
        q = A.sample_queries(self.SEL, "m")
        results = {q["kv"]: vector("0.5"), q["waiting"]: [], q["running"]: vector("1"), q["p99"]: []}
        with pytest.raises(SignalsUnavailable):
            A.sample_from(q, results, slo_ms=50.0, at=T0)


class TestObjects:
    def test_ready_pipelines_is_the_least_stage(self) -> None:
        gear = scope().gear
        sts = {
            # stage 0 has 2 pods per pipeline: 5 ready pods are 2 whole pipelines
            names.stage_statefulset_name(SVC, "decode", "b", 0): {"status": {"readyReplicas": 5}},
            names.stage_statefulset_name(SVC, "decode", "b", 1): {"status": {"readyReplicas": 1}},
        }
        assert A.ready_pipelines(gear, sts, SVC, "decode") == 1
        sts.pop(names.stage_statefulset_name(SVC, "decode", "b", 1))
        assert A.ready_pipelines(gear, sts, SVC, "decode") == 0

    def test_head_pods_are_stage_0(self) -> None:
        pods = [pod("h0", 0), pod("t0", 1), pod("h1", 0), {"metadata": {"name": "bare"}}]
        assert [p["metadata"]["name"] for p in A.head_pods(pods)] == ["h0", "h1"]

    def test_stage_needs_name_the_nodes_each_stage_occupies(self) -> None:
        pods = [pod("h0", 0, "n1"), pod("h1", 0, "n2"), pod("t0", 1, "m1"), pod("pending", 1)]
        assert A.stage_needs(scope().gear, pods) == [
            sc.StageNeed(1, 2, ("n1", "n2"), {}, frozenset({"n1", "n2"})),
            sc.StageNeed(2, 1, (), {"x": "y"}, frozenset({"m1"})),
        ]

    def test_the_decision_memory_from_status(self) -> None:
        assert A.state_from_status(None) == sc.ScaleState()
        st = ScalingStatus.model_validate(
            {"upSince": T0_RFC3339, "upFloor": 2, "lastScaleTime": "2027-01-15T08:00:10Z", "lastReason": "X"}
        )
        assert A.state_from_status(st) == sc.ScaleState(
            up_since=T0, up_floor=2, last_scale_at=T0 + 10, last_reason="X"
        )


class TestRejections:
    def test_the_increase_since_the_last_read_joins_the_sample(self) -> None:
        s = sc.ScaleSample(at=T0, kv_cache_usage=0.5)
        assert A.with_rejections(s, 3.0, 7.0, T0) == sc.ScaleSample(at=T0, kv_cache_usage=0.5, no_headroom=4)

    def test_rejections_alone_make_a_busy_sample(self) -> None:
        assert A.with_rejections(None, 3.0, 5.0, T0 + 1) == sc.ScaleSample(
            at=T0 + 1, no_headroom=2, running=1.0
        )

    @pytest.mark.parametrize(("previous", "value"), [(None, 4.0), (4.0, 4.0), (4.0, None)])
    def test_no_increase_and_no_sample_is_no_sample(
        self, previous: float | None, value: float | None
    ) -> None:
        assert A.with_rejections(None, previous, value, T0) is None

    def test_a_router_restart_counts_from_zero(self) -> None:
        s = A.with_rejections(sc.ScaleSample(at=T0), 10.0, 2.0, T0)
        assert s is not None and s.no_headroom == 2

    def test_the_reading_is_the_next_baseline_and_the_failure_is_cut(self) -> None:
        st = A.observed({"lastMessage": "old"}, unavailable="x" * 5000, rejections=7.0)
        assert st == {"lastMessage": "x" * 4000, "routerRejections": 7.0}
        assert A.observed({"routerRejections": 2.0}, unavailable=None, rejections=None) == {
            "routerRejections": 2.0
        }


class TestDrain:
    OLD = ScalingStatus.model_validate(
        {"draining": ["h-2", "h-3"], "drainTarget": 1, "drainStartedAt": T0_RFC3339, "desiredReplicas": 2}
    )

    def test_a_shift_aborts_it(self) -> None:
        step = A.abort_drain(self.OLD.to_json(), self.OLD.draining)
        assert step.unlabel == ("h-2", "h-3")
        assert step.scaling == {
            "draining": [],
            "drainTarget": None,
            "drainStartedAt": None,
            "desiredReplicas": 2,
            "lastMessage": "",
            "placement": "",
        }
        assert step.events == (
            A.ScaleEvent("DrainAborted", "a gear shift started; the scale-down drain is aborted", False),
        )
        assert step.replicas is None

    @pytest.mark.parametrize(
        ("running", "waiting", "pods", "want"),
        [(2.0, 1.0, 2, 3), (None, 0.0, 2, None), (0.0, None, 1, None), (None, None, 0, 0)],
    )
    def test_in_flight(
        self, running: float | None, waiting: float | None, pods: int, want: int | None
    ) -> None:
        assert A.drain_in_flight(running, waiting, pods) == want

    def test_it_holds_through_the_grace_period(self) -> None:
        step = A.continue_drain(self.OLD, in_flight=0, now=T0 + 2, current=2, timeout_s=90)
        assert (step.replicas, step.draining, step.events) == (None, ("h-2", "h-3"), ())
        assert step.scaling["lastMessage"] == "router excluding the pods (2/6 s)"
        assert step.scaling["draining"] == ["h-2", "h-3"]

    def test_it_holds_while_requests_are_in_flight(self) -> None:
        step = A.continue_drain(self.OLD, in_flight=3, now=T0 + 10, current=2, timeout_s=90)
        assert step.replicas is None and step.scaling["lastMessage"] == "3 request(s) in flight"

    def test_empty_pods_after_the_grace_lower_replicas_to_the_target(self) -> None:
        step = A.continue_drain(self.OLD, in_flight=0, now=T0 + 10, current=2, timeout_s=90)
        assert step.replicas == 1 and step.draining == ()
        assert step.scaling == {
            "draining": [],
            "drainTarget": None,
            "drainStartedAt": None,
            "desiredReplicas": 1,
            "lastScaleTime": "2027-01-15T08:00:10Z",
            "lastMessage": "no request in flight after 10 s",
            "placement": "",
        }
        assert step.events == (
            A.ScaleEvent("ScaledDown", "2 -> 1 pipeline replicas: no request in flight after 10 s", False),
        )

    def test_the_timeout_cuts_requests_and_warns(self) -> None:
        step = A.continue_drain(self.OLD, in_flight=None, now=T0 + 90, current=2, timeout_s=90)
        assert step.replicas == 1
        assert step.events == (
            A.ScaleEvent(
                "ScaledDown", "2 -> 1 pipeline replicas: None request(s) still in flight after 90 s", True
            ),
        )

    def test_without_a_stored_target_replicas_stay_current(self) -> None:
        old = self.OLD.model_copy(update={"drain_target": None})
        step = A.continue_drain(old, in_flight=0, now=T0 + 10, current=2, timeout_s=90)
        assert step.replicas == 2 and step.scaling["desiredReplicas"] == 2


class TestActOn:
    BEFORE = sc.ScaleState(up_since=T0 - 40, up_floor=3, last_scale_at=T0 - 500)
    #: decide_scale's state after a scale-up: runs reset, last scale now.
    AFTER = sc.ScaleState(last_scale_at=T0, last_reason="KvCacheHigh")

    def act(self, decision: sc.ScaleDecision, placement: sc.Placement | None = None) -> A.ScaleActions:
        return A.act_on(
            decision,
            before=self.BEFORE,
            after=self.AFTER,
            scaling={"routerRejections": 4.0},
            current=1,
            placement=placement,
            heads=[],
            pods_per_replica=1,
            now=T0,
        )

    def test_a_placed_scale_up_writes_replicas_and_the_nodes(self) -> None:
        d = sc.ScaleDecision(sc.ScaleKind.UP, 3, "KvCacheHigh", "load ratio 2")
        a = self.act(d, sc.Placement(2, (("n1",), ("n2",))))
        assert (a.replicas, a.label) == (3, ())
        assert a.scaling == {
            "routerRejections": 4.0,
            "placement": "new replicas on: n1; n2",
            "desiredReplicas": 3,
            "lastDecision": "ScaleUp",
            "lastReason": "KvCacheHigh",
            "lastMessage": "load ratio 2",
            "upSince": None,
            "upFloor": None,
            "downSince": None,
            "downCeiling": None,
            "idleSince": None,
            "lastScaleTime": T0_RFC3339,
        }
        assert a.condition == ("True", "ScalingActive", "KvCacheHigh: load ratio 2")
        assert a.events == (
            A.ScaleEvent(
                "ScaledUp", "1 -> 3 pipeline replicas (KvCacheHigh): load ratio 2; nodes n1; n2", False
            ),
        )

    def test_a_partly_placed_scale_up_adds_what_fits_and_says_what_does_not(self) -> None:
        d = sc.ScaleDecision(sc.ScaleKind.UP, 3, "KvCacheHigh", "m")
        a = self.act(d, sc.Placement(1, (("n1", "n2"),), "stage 1: no node"))
        assert a.replicas == 2 and a.scaling["desiredReplicas"] == 2
        assert a.scaling["placement"] == "new replicas on: n1,n2"
        assert a.condition == (
            "False",
            "NoFreeGPU",
            "KvCacheHigh asks 3 replicas, 2 placed: stage 1: no node; retried when nodes appear, "
            "nothing is evicted",
        )
        # something was placed: the decision's memory (last scale now) stands
        assert a.scaling["lastScaleTime"] == T0_RFC3339

    def test_an_unplaceable_scale_up_keeps_the_windows_memory_for_a_retry(self) -> None:
        d = sc.ScaleDecision(sc.ScaleKind.UP, 2, "KvCacheHigh", "m")
        a = self.act(d, sc.Placement(0, (), "stage 0: no node"))
        assert a.replicas is None and a.events == ()
        assert a.condition[:2] == ("False", "NoFreeGPU")
        assert "placement" not in a.scaling
        # BEFORE's run: up since T0 - 40 s, floor 3, last scale T0 - 500 s
        assert (a.scaling["upSince"], a.scaling["upFloor"]) == ("2027-01-15T07:59:20Z", 3)
        assert a.scaling["lastScaleTime"] == "2027-01-15T07:51:40Z"
        assert a.scaling["desiredReplicas"] == 1

    def test_a_scale_up_needs_its_placement(self) -> None:
        with pytest.raises(ValueError, match="placement"):
            self.act(sc.ScaleDecision(sc.ScaleKind.UP, 2, "KvCacheHigh", "m"))

    @staticmethod
    def act_from_three(decision: sc.ScaleDecision, heads: list[str]) -> A.ScaleActions:
        """``act_on`` at 3 replicas, one pod each, no scaling history, with these head pods."""
        return A.act_on(
            decision,
            before=sc.ScaleState(),
            after=sc.ScaleState(),
            scaling={},
            current=3,
            placement=None,
            heads=heads,
            pods_per_replica=1,
            now=T0,
        )

    def test_a_scale_down_drains_the_highest_ordinals_first(self) -> None:
        d = sc.ScaleDecision(sc.ScaleKind.DOWN, 1, "LowLoad", "load ratio 0.1")
        a = self.act_from_three(d, ["g-s0-2", "g-s0-0", "g-s0-1"])
        assert (a.replicas, a.label) == (None, ("g-s0-1", "g-s0-2"))
        assert (a.scaling["draining"], a.scaling["drainTarget"]) == (["g-s0-1", "g-s0-2"], 1)
        assert a.scaling["drainStartedAt"] == T0_RFC3339
        # replicas stay 3 until the drain ends
        assert (a.scaling["desiredReplicas"], a.scaling["lastDecision"]) == (3, "ScaleDown")
        assert a.events == (
            A.ScaleEvent(
                "ScaleDownDraining", "3 -> 1: draining g-s0-1, g-s0-2 (LowLoad: load ratio 0.1)", False
            ),
        )

    def test_a_scale_down_with_nothing_to_drain_lowers_replicas_at_once(self) -> None:
        # no head pod has an ordinal at or above 2 x 1
        d = sc.ScaleDecision(sc.ScaleKind.DOWN, 2, "LowLoad", "m")
        a = self.act_from_three(d, ["g-s0-0", "g-s0-1", "not-a-statefulset-pod"])
        assert (a.replicas, a.label, a.scaling["desiredReplicas"]) == (2, (), 2)
        assert "draining" not in a.scaling
        assert a.events == (A.ScaleEvent("ScaledDown", "3 -> 2 pipeline replicas", False),)

    def test_a_hold_writes_only_status(self) -> None:
        d = sc.ScaleDecision(sc.ScaleKind.HOLD, 1, "Steady", "x" * 5000)
        a = self.act(d)
        assert (a.replicas, a.label, a.events) == (None, (), ())
        assert a.condition == ("True", "ScalingActive", ("Steady: " + "x" * 5000)[:4000])
        assert a.scaling["lastMessage"] == "x" * 4000
        assert (a.scaling["desiredReplicas"], a.scaling["lastDecision"]) == (1, "Hold")


class TestStatusWrite:
    def test_the_patch_carries_ready_pipelines_twice(self) -> None:
        scaling = {"desiredReplicas": 2}
        before = copy.deepcopy(scaling)
        assert A.status_patch(scaling, 1) == {
            "scaling": {"desiredReplicas": 2, "readyReplicas": 1},
            "replicas": 1,
        }
        assert scaling == before

    @pytest.mark.parametrize(
        ("stored", "status", "announce"),
        [
            (None, "True", True),
            ([{"type": "Ready", "status": "True"}], "True", True),
            ([{"type": "ScalingActive", "status": "False"}], "True", True),
            ([{"type": "ScalingActive", "status": "True"}], "True", False),
            ([{"type": "ScalingActive", "status": "False"}], "False", True),
        ],
    )
    def test_events_for_a_flip_or_a_problem_not_for_each_message(
        self, stored: list[dict[str, str]] | None, status: Any, announce: bool
    ) -> None:
        assert A.announce_condition(stored, status) is announce
