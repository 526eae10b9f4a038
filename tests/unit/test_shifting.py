"""The gear-shifting loop (handlers/shifting.py; its pure parts are control/shifting/tick.py and
control/shifting/shift_status.py) over an in-memory API: state round trips, the observed world, free-GPU
check, and whole shifts driven tick by tick (forced, restarts, signals lost, paused)."""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import replace
from typing import Any

import kopf
import pytest
from test_handlers_reconcile import NS, _example, fleet_nodes, new_api, put_fleet

from gearshift.api.gearset import Gear
from gearshift.api.gearset_status import ControlState, ExecutorState
from gearshift.control.shifting import executor_status as es
from gearshift.control.shifting import shift_status as ss
from gearshift.control.shifting import tick as cs
from gearshift.control.shifting.capacity import CapacityEstimate
from gearshift.control.shifting.decide import DecisionState, TriggerTrack
from gearshift.control.shifting.executor import Phase, ShiftState
from gearshift.control.shifting.executor_actions import SelectGear
from gearshift.control.shifting.policy import ShiftRules
from gearshift.control.shifting.shift_status import ORPHAN_MESSAGE, STATUS_HEARTBEAT_S
from gearshift.control.shifting.triggers import Trigger
from gearshift.control.signals import (
    SERIES_NAMES,
    GearSelector,
    PipelineShape,
    Reading,
    SeriesHealth,
    SignalsUnavailable,
    UtilizationSource,
    reading_from_results,
    signal_queries,
)
from gearshift.control.smoothing import Sample
from gearshift.facts.rfc3339 import to_time
from gearshift.handlers import reconcile as rec
from gearshift.handlers import shifting as sh
from gearshift.handlers.common import StatusPruned
from gearshift.k8s import names
from gearshift.testing.daemons import OneTurn
from gearshift.testing.kube import FakeKubeApi

GS_NAME = "llama3-8b-prefill"
T0 = 1_800_000_000.0


class FakeSignals:
    """A signal source with a switch: up (a steady sample, no in-flight requests) or down.

    Subclasses change :meth:`raw` (the sample); :meth:`sample` wraps it as the engine's own reading and
    records the engine and gear shape the tick asked with."""

    def __init__(self) -> None:
        self.up = True
        self.in_flight_n = 0
        self.asked: list[str] = []
        self.engines: list[str] = []
        self.shapes: list[PipelineShape | None] = []
        self.windows: list[str] = []

    def raw(self, url: str, sel: GearSelector, at: float) -> Sample:
        return Sample(at=at, stage_utilization=(0.5, 0.5), qps=3.0, ttft_p99_ms=150.0, itl_p99_ms=20.0)

    def record(self, sel: GearSelector, engine: str, shape: PipelineShape | None, window: str) -> None:
        """Note what a sample was asked for (the tests read it back)."""
        self.windows.append(window)
        self.asked.append(sel.gear)
        self.engines.append(engine)
        self.shapes.append(shape)

    def sample(
        self,
        url: str,
        sel: GearSelector,
        at: float,
        *,
        engine: str,
        shape: PipelineShape | None,
        window: str = "1m",
    ) -> Reading:
        self.record(sel, engine, shape, window)
        if not self.up:
            raise SignalsUnavailable(f"Prometheus at {url} did not answer: connection refused")
        return Reading(self.raw(url, sel, at), UtilizationSource.ENGINE)

    def in_flight(self, url: str, sel: GearSelector) -> int:
        if not self.up:
            raise SignalsUnavailable("down")
        return self.in_flight_n


class PerGearSignals(FakeSignals):
    """Signals with a TTFT P99 and an in-flight count per gear; records whose in-flight count was asked."""

    def __init__(self, p99_by_gear: dict[str, float], qps_by_gear: dict[str, float] | None = None) -> None:
        super().__init__()
        self.p99_by_gear = p99_by_gear
        self.qps_by_gear = qps_by_gear or {}
        self.in_flight_by_gear: dict[str, int] = {}
        self.drained: list[str] = []

    def raw(self, url: str, sel: GearSelector, at: float) -> Sample:
        base = super().raw(url, sel, at)
        return Sample(at=at, stage_utilization=base.stage_utilization,
                      qps=self.qps_by_gear.get(sel.gear, base.qps),
                      ttft_p99_ms=self.p99_by_gear[sel.gear], itl_p99_ms=base.itl_p99_ms)  # fmt: skip

    def in_flight(self, url: str, sel: GearSelector) -> int:
        self.drained.append(sel.gear)
        return self.in_flight_by_gear.get(sel.gear, 0)


def _policy_patch(api: FakeKubeApi, **policy: Any) -> None:
    key = api.key("GearSet", NS, GS_NAME)
    api.store[key]["spec"]["policy"].update(policy)


def kubelet(api: FakeKubeApi, now: float) -> None:
    """Play the StatefulSet controller and kubelet: every StatefulSet gets Ready pods (Ready at ``now``)."""
    for s in api.list("apps/v1", "StatefulSet", NS):
        n = int(s["spec"]["replicas"])
        for i in range(n):
            pname = f"{s['metadata']['name']}-{i}"
            if api.get("v1", "Pod", NS, pname):
                continue
            api.put(
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": pname, "labels": s["spec"]["template"]["metadata"]["labels"]},
                    "spec": {"containers": s["spec"]["template"]["spec"]["containers"]},
                    "status": {
                        "phase": "Running",
                        "conditions": [
                            {"type": "Ready", "status": "True", "lastTransitionTime": to_time(now)}
                        ],
                    },
                },
                NS,
            )
        key = api.key("StatefulSet", NS, s["metadata"]["name"])
        api.store[key]["status"] = {"readyReplicas": n, "replicas": n}
    # pods of deleted StatefulSets go
    live = {s["metadata"]["name"] for s in api.list("apps/v1", "StatefulSet", NS)}
    for p in api.list("v1", "Pod", NS):
        if p["metadata"]["name"].rsplit("-", 1)[0] not in live:
            api.delete("v1", "Pod", NS, p["metadata"]["name"])


@pytest.fixture
def world() -> FakeKubeApi:
    a = new_api()
    put_fleet(a)
    pds = _example("pdservice-llama3-8b.yaml")
    pds["spec"]["prometheusUrl"] = "http://127.0.0.1:9"
    a.put(pds, NS)
    a.put(_example("gearset-explicit.yaml"), NS)
    a.put(_example("gearset-auto.yaml"), NS)
    rec.reconcile_service(a.runtime, NS, "llama3-8b")
    kubelet(a, T0 - 100)
    return a


def run(api: FakeKubeApi, sig: FakeSignals, now: float) -> sh.ShiftTick:
    return sh.tick(api.runtime, NS, GS_NAME, now=now, signals=sig)


def status(api: FakeKubeApi) -> dict[str, Any]:
    return api.get("gearshift.io/v1alpha1", "GearSet", NS, GS_NAME)["status"]


def selected(api: FakeKubeApi) -> str:
    return api.get("v1", "Service", NS, "llama3-8b-prefill")["spec"]["selector"][names.LABEL_GEAR]


def gear_ready(api: FakeKubeApi, gear: str) -> bool:
    sts = api.list("apps/v1", "StatefulSet", NS, {names.LABEL_ROLE: "prefill", names.LABEL_GEAR: gear})
    return bool(sts) and all(s.get("status", {}).get("readyReplicas") == s["spec"]["replicas"] for s in sts)


def prefill_gears(api: FakeKubeApi) -> set[str]:
    sts = api.list("apps/v1", "StatefulSet", NS, {names.LABEL_ROLE: "prefill"})
    return {s["metadata"]["labels"][names.LABEL_GEAR] for s in sts}


class TestStateRoundTrip:
    @pytest.mark.parametrize("phase", list(Phase))
    def test_executor(self, phase: Phase) -> None:
        s = ShiftState(
            active="balanced",
            phase=phase,
            from_gear="balanced",
            to_gear="latency",
            trigger="p99-high",
            started_at=T0 + 0.25,
            step_started_at=T0 + 10.5,
            deadline=T0 + 70.125,
            degraded=phase is Phase.DEGRADED,
            predicted_p99_ms=120.0,
            baseline_p99_ms=150.0,
            baseline_qps=11.5,
            failure="NotReadyInTime" if phase is Phase.ROLLING_BACK else None,
            failure_message="late" if phase is Phase.ROLLING_BACK else "",
            paused_at=T0 + 20.0,
        )
        raw = es.executor_to_status(s, in_flight=3)
        back = es.executor_from_status("balanced", ExecutorState.model_validate(raw))
        assert back == s
        assert raw["rollbackUntil"] == (raw["deadline"] if phase is Phase.SWITCHING else None)

    def test_control(self) -> None:
        d = DecisionState(
            smoothed=Sample(
                at=T0,
                stage_utilization=(0.95, 0.2, 0.1),
                qps=7.5,
                arrival_rps=8.25,
                queue=2.0,
                ttft_p99_ms=250.0,
            ),
            tracks={
                Trigger.IMBALANCE: TriggerTrack(on=2, off=0, latched=False, level=1),
                Trigger.SATURATION: TriggerTrack(on=4, off=0, latched=True, level=3),
                Trigger.LATENCY_HIGH: TriggerTrack(on=3, off=0, latched=True, level=0),
                Trigger.LATENCY_LOW: TriggerTrack(on=0, off=5, latched=False, level=2),
                Trigger.LOAD_HIGH: TriggerTrack(on=1, off=0, latched=False, level=0),
                Trigger.LOAD_LOW: TriggerTrack(on=0, off=4, latched=True, level=0),
            },
            last_shift_at=T0 - 30,
            last_retrigger_at=T0 - 10,
            capacity={
                "latency": CapacityEstimate(23.0, 18.5, 26.25, T0 - 5, 24.0, T0 - 20),
                "throughput": CapacityEstimate(30.4),
            },
        )
        raw = ss.control_to_status(d, ShiftRules(dwell_s=600))
        assert raw["dwellUntil"] == to_time(T0 + 570)
        back = ss.control_from_status(ControlState.model_validate(raw))
        assert back == d

    def test_initial(self) -> None:
        assert ss.control_from_status(None) == DecisionState()
        assert es.executor_from_status("x", None) == ShiftState(active="x")


def _sts(stage: int, replicas: int, ready: int) -> dict[str, Any]:
    return {
        "metadata": {"labels": {names.LABEL_STAGE: str(stage)}},
        "spec": {"replicas": replicas},
        "status": {"readyReplicas": ready},
    }


def _pod(ready: bool, at: float, waiting: str | None = None) -> dict[str, Any]:
    cs = [{"state": {"waiting": {"reason": waiting}}}] if waiting else []
    return {
        "metadata": {},
        "status": {
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True" if ready else "False",
                    "lastTransitionTime": to_time(at),
                }
            ],
            "containerStatuses": cs,
        },
    }


class TestObserveGear:
    gear = Gear.model_validate({"name": "g", "stages": [{"layers": [0, 16]}, {"layers": [16, 32]}]})

    def test_absent(self) -> None:
        assert not cs.observe_gear(self.gear, [], []).exists

    def test_ready_since_latest_pod(self) -> None:
        o = cs.observe_gear(self.gear, [_sts(0, 1, 1), _sts(1, 1, 1)], [_pod(True, T0), _pod(True, T0 + 7)])
        assert o.exists and o.ready and o.ready_since == pytest.approx(T0 + 7)

    @pytest.mark.parametrize(
        ("sts", "pods"),
        [
            ([_sts(0, 1, 1)], [_pod(True, T0)]),  # stage 1 missing
            ([_sts(0, 1, 1), _sts(1, 1, 0)], [_pod(True, T0), _pod(False, T0)]),  # a pod not Ready
            ([_sts(0, 1, 1), _sts(1, 2, 2)], [_pod(True, T0), _pod(True, T0)]),  # a pod not there yet
        ],
    )
    def test_not_ready(self, sts: list[dict[str, Any]], pods: list[dict[str, Any]]) -> None:
        o = cs.observe_gear(self.gear, sts, pods)
        assert o.exists and not o.ready and o.ready_since is None

    def test_crash_loop_is_a_failure(self) -> None:
        o = cs.observe_gear(
            self.gear, [_sts(0, 1, 0), _sts(1, 1, 1)], [_pod(False, T0, "CrashLoopBackOff"), _pod(True, T0)]
        )
        assert o.failure == "CrashLoopBackOff"

    @staticmethod
    def _unplaced(since: float) -> dict[str, Any]:
        pod = _pod(False, since)
        pod["metadata"]["name"] = "svc-prefill-throughput-s0-0"
        pod["status"]["conditions"].append(
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/12 nodes are available: 1 Insufficient nvidia.com/gpu.",
                "lastTransitionTime": to_time(since),
            }
        )
        return pod

    def test_a_pod_unschedulable_past_the_grace_fails_its_gear_with_the_schedulers_message(self) -> None:
        sts = [_sts(0, 1, 0), _sts(1, 1, 1)]
        pods = [self._unplaced(T0), _pod(True, T0)]
        grace = cs.UNSCHEDULABLE_GRACE_S
        assert cs.observe_gear(self.gear, sts, pods, now=T0 + grace - 1).failure is None
        assert cs.observe_gear(self.gear, sts, pods).failure is None  # no clock: no judgement of time
        o = cs.observe_gear(self.gear, sts, pods, now=T0 + grace)
        assert o.failure == "Unschedulable" and not o.ready
        assert o.failure_message == (
            "pod svc-prefill-throughput-s0-0: 0/12 nodes are available: 1 Insufficient nvidia.com/gpu."
        )

    def test_selected_gear(self) -> None:
        assert cs.selected_gear(None) is None
        assert cs.selected_gear({"spec": {"selector": {names.LABEL_GEAR: "x"}}}) == "x"


class TestShadowFits:
    def _gear(self, stages: list[dict[str, Any]]) -> Gear:
        return Gear.model_validate({"name": "g", "stages": stages})

    def test_free_and_taken_cards(self) -> None:
        nodes = fleet_nodes()
        g = self._gear(
            [
                {"layers": [0, 20], "nodes": ["gpu-h100-0"]},
                {"layers": [20, 32], "nodeSelector": {names.NODE_GPU_MODEL: "A100-40GB"}},
            ]
        )
        assert cs.shadow_fits(g, 1, nodes, [])
        busy = {
            "spec": {
                "nodeName": "gpu-h100-0",
                "containers": [{"resources": {"limits": {"nvidia.com/gpu": "1"}}}],
            },
            "status": {"phase": "Running"},
        }
        assert not cs.shadow_fits(g, 1, nodes, [busy])
        done = copy.deepcopy(busy)
        done["status"]["phase"] = "Succeeded"
        assert cs.shadow_fits(g, 1, nodes, [done])
        # Time-sliced cards (2 nvidia.com/gpu each, as the sandbox's fleet advertises them): the shadow
        # takes the second slot of the busy card, a third pod would not fit.
        sliced = fleet_nodes(gpu_replicas=2)
        assert cs.shadow_fits(g, 1, sliced, [busy])
        assert not cs.shadow_fits(g, 1, sliced, [busy, copy.deepcopy(busy)])
        # two A100 nodes: two pipeline replicas fit the A100 stage, three do not (the H100 stage: one node)
        g2 = self._gear([{"layers": [0, 32], "nodeSelector": {names.NODE_GPU_MODEL: "A100-40GB"}}])
        assert cs.shadow_fits(g2, 2, nodes, []) and not cs.shadow_fits(g2, 3, nodes, [])


def _lose_a_shifts_progress(world: FakeKubeApi) -> FakeSignals:
    """A forced shift to ``latency`` started and warming, then its ``status.executor`` gone as an older
    CRD's pruning leaves it (phase Stable, the force removed so that no new shift starts); the signals."""
    _policy_patch(world, warmS=60)
    key = world.key("GearSet", NS, GS_NAME)
    world.store[key]["spec"]["forceGear"] = "latency"
    sig = FakeSignals()
    run(world, sig, T0)
    kubelet(world, T0)
    run(world, sig, T0 + 2)
    assert status(world)["history"][-1]["outcome"] == "InProgress"
    del world.store[key]["spec"]["forceGear"]
    world.store[key]["status"].pop("executor")
    world.store[key]["status"]["phase"] = "Stable"
    return sig


class TestTicks:
    def test_waits_for_the_reconciler(self, world: FakeKubeApi) -> None:
        key = world.key("GearSet", NS, GS_NAME)
        world.store[key]["status"].pop("activeGear")
        assert run(world, FakeSignals(), T0).skipped.startswith("no active gear")

    def test_zero_replicas_is_idle_without_sampling_but_one_gear_is_sampled(self, world: FakeKubeApi) -> None:
        key = world.key("GearSet", NS, GS_NAME)
        full = copy.deepcopy(world.store[key])
        active = full["status"]["activeGear"]
        world.store[key]["spec"]["replicas"] = 0
        sig = FakeSignals()
        r = run(world, sig, T0)
        assert r.idle and r.skipped.startswith("scaled to zero") and sig.asked == []
        assert not sh._serving_or_busy(world.store[key])
        # A forced gear is work to do, whatever the replica count.
        world.store[key]["spec"]["forceGear"] = active
        assert sh._serving_or_busy(world.store[key]) and not run(world, sig, T0).idle
        # One gear has nothing to shift to, but its signals still feed `kubectl get gearsets` (P99, QPS).
        world.store[key] = copy.deepcopy(full)
        world.store[key]["spec"]["gears"] = [g for g in full["spec"]["gears"] if g["name"] == active]
        sig = FakeSignals()
        r = run(world, sig, T0)
        assert not r.idle and r.signals_ok and sig.asked == [active]
        assert sh._serving_or_busy(world.store[key])

    def test_steady_writes_signals_and_condition(self, world: FakeKubeApi) -> None:
        sig = FakeSignals()
        r = run(world, sig, T0)
        assert r.signals_ok and r.phase is Phase.STABLE and not r.actions
        st = status(world)
        assert st["signals"]["qps"] == 3.0 and st["signals"]["p99Ms"] == 150.0  # prefill: TTFT P99
        assert st["signals"]["stageUtilization"] == [0.5, 0.5]
        cond = next(c for c in st["conditions"] if c["type"] == "SignalsAvailable")
        assert cond["status"] == "True"
        # The tick's second condition: no latency miss that no gear would fix.
        latency = next(c for c in st["conditions"] if c["type"] == "LatencyAttainable")
        assert (latency["status"], latency["reason"]) == ("True", "Attainable")
        assert sig.asked == ["balanced"]  # the gear the role Service selects

    def test_every_tick_advances_the_signals_and_records_a_missing_sample_and_missed_instants(
        self, world: FakeKubeApi
    ) -> None:
        # status.signals.sampleTime moves every tick; one without a sample says why, with no
        # value of the last sample left standing; instants the loop let pass are shown as they add up.
        sig = FakeSignals()
        run(world, sig, T0)
        assert status(world)["signals"]["qps"] == 3.0 and status(world)["signals"].get("skipped") is None
        world.runtime.gearsets.add_missed((NS, GS_NAME), 2)  # what the loop does after an overrun
        sig.up = False
        run(world, sig, T0 + 4)
        st = status(world)["signals"]
        assert st["sampleTime"] == to_time(T0 + 4)
        assert "connection refused" in st["skipped"] and st["missedSamples"] == 2
        # A merge patch's null removes the key: none of the last sample's values is left.
        assert st.get("qps") is None and st.get("p99Ms") is None and not st.get("stageUtilization")
        world.runtime.gearsets.add_missed((NS, GS_NAME), 1)
        sig.up = True
        run(world, sig, T0 + 6)
        st = status(world)["signals"]
        assert st["sampleTime"] == to_time(T0 + 6) and st.get("skipped") is None
        assert st["missedSamples"] == 3
        assert st["qps"] is not None and st["qps"] > 0

    def test_no_traffic_blanks_the_latency_instead_of_keeping_the_last_one(self, world: FakeKubeApi) -> None:
        # First a sample with traffic, then Prometheus shows no completed request in the window (qps 0,
        # no histogram values): the moving average still holds 150 ms, the status must not show it.
        sig = FakeSignals()
        run(world, sig, T0)
        assert status(world)["signals"]["p99Ms"] == 150.0

        class Idle(FakeSignals):
            def raw(self, url: str, sel: GearSelector, at: float) -> Sample:
                return Sample(at=at, stage_utilization=(0.0, 0.0))

        patches: list[dict[str, Any]] = []
        real = world.patch_status

        def record(*args: Any) -> dict[str, Any]:
            patches.append(copy.deepcopy(dict(args[-1])))
            return real(*args)

        world.patch_status = record  # type: ignore[method-assign]
        run(world, Idle(), T0 + 5)
        sent = next(p["signals"] for p in patches if "signals" in p)
        # An explicit null: the API server merges a status patch, so a missing key would keep 150.
        assert "p99Ms" in sent and sent["p99Ms"] is None
        assert all(sent[k] is None for k in ss.LATENCY_SIGNAL_KEYS)
        assert sent["qps"] == pytest.approx(0.7 * 3.0)  # the smoothed rate (alpha 0.3) still decays
        assert status(world)["signals"].get("p99Ms") is None

    def test_served_requests_without_latency_histograms_warn_once(self, world: FakeKubeApi) -> None:
        # The head pods serve (qps > 0) but export no TTFT histogram: the P99 triggers are
        # blind, which the condition and one Warning event say; truthful status: missing is never fine, so
        # SignalsAvailable is False while it lasts.
        class NoHistograms(FakeSignals):
            def raw(self, url: str, sel: GearSelector, at: float) -> Sample:
                return Sample(at=at, stage_utilization=(0.5, 0.5), qps=3.0)

        for k in range(3):
            run(world, NoHistograms(), T0 + 5 * k)
        cond = _signals_condition(world)
        assert (cond["status"], cond["reason"]) == ("False", "LatencyUnavailable")
        assert "vllm:time_to_first_token_seconds P99" in cond["message"]  # prefill role: TTFT
        warned = [e for e in world.events if e["reason"] == "LatencyUnavailable"]
        assert len(warned) == 1 and warned[0]["type"] == "Warning"
        run(world, FakeSignals(), T0 + 20)
        assert _signals_condition(world)["reason"] == "SignalsOk"

    def test_each_written_sample_records_its_lag_to_the_status(self, world: FakeKubeApi) -> None:
        # The sample → status lag is measured (gearshift_operator_sample_to_status_seconds).
        from gearshift.adapters import metrics

        def count() -> float:
            (fam,) = metrics.SAMPLE_TO_STATUS_SECONDS.collect()
            return next(x.value for x in fam.samples if x.name.endswith("_count"))

        before = count()
        run(world, FakeSignals(), time.time())
        run(world, FakeSignals(), time.time())
        assert count() - before == 2

    def test_a_missing_arrival_rate_while_serving_is_reported_once_and_clears(
        self, world: FakeKubeApi
    ) -> None:
        # Missing is never fine. The arrival-rate series is absent while requests complete: False
        # with SeriesMissing naming it, one Warning event over several ticks, and back by itself.
        class NoArrivals(FakeSignals):
            def sample(self, url: str, sel: GearSelector, at: float, **kw: Any) -> Reading:
                r = super().sample(url, sel, at, **kw)
                health = {k: SeriesHealth.OK for k in SERIES_NAMES} | {"arrival_rps": SeriesHealth.MISSING}
                return replace(r, health=health)

        for k in range(3):
            run(world, NoArrivals(), T0 + 2 * k)
        cond = _signals_condition(world)
        assert (cond["status"], cond["reason"]) == ("False", "SeriesMissing")
        assert (
            "arrival rate (vllm:request_success_total" in cond["message"] and "(missing)" in cond["message"]
        )
        assert "load-high, load-low trigger(s) hold" in cond["message"]
        warned = [e for e in world.events if e["reason"] == "SeriesMissing"]
        assert len(warned) == 1 and warned[0]["type"] == "Warning"
        run(world, FakeSignals(), T0 + 10)
        assert _signals_condition(world)["reason"] == "SignalsOk"

    def test_signals_to_status_shows_latency_only_with_completions(self) -> None:
        policy = ShiftRules()
        smoothed = Sample(at=T0, qps=1.5, ttft_p99_ms=690.514, itl_p99_ms=21.0)
        busy = Sample(at=T0, qps=0.5, ttft_p99_ms=500.0, itl_p99_ms=None)
        out = ss.signals_to_status(smoothed, policy, 1, busy)
        # measured this window: the smoothed value; not measured (ITL): blank
        assert out["p99TtftMs"] == 690.51 and out["p99ItlMs"] is None and out["qps"] == 1.5
        idle = Sample(at=T0, qps=0.0, ttft_p99_ms=500.0)
        assert ss.signals_to_status(smoothed, policy, 1, idle)["p99TtftMs"] is None

    def test_forced_shift_end_to_end_keeps_a_ready_gear_selected(self, world: FakeKubeApi) -> None:
        _policy_patch(world, warmS=5, rollbackWindowS=10, drainTimeoutS=30)
        key = world.key("GearSet", NS, GS_NAME)
        world.store[key]["spec"]["forceGear"] = "latency"
        sig = FakeSignals()
        phases = []
        now = T0
        for _ in range(40):
            r = run(world, sig, now)
            phases.append(r.phase)
            assert gear_ready(world, selected(world)), f"role Service on a gear not Ready at {now - T0}"
            kubelet(world, now)
            now += 2.0
            if r.phase is Phase.STABLE and status(world)["activeGear"] == "latency" and len(phases) > 3:
                break
        # every phase of a shift, in order
        order = [p for i, p in enumerate(phases) if i == 0 or phases[i - 1] != p]
        assert order == [Phase.WARMING, Phase.DRAINING, Phase.SWITCHING, Phase.STABLE]
        st = status(world)
        assert st["activeGear"] == "latency" and "targetGear" not in st
        assert selected(world) == "latency" and prefill_gears(world) == {"latency"}
        (h,) = st["history"]
        assert (h["from"], h["to"], h["trigger"], h["outcome"]) == (
            "balanced",
            "latency",
            "forced",
            "Succeeded",
        )
        reasons = [e["reason"] for e in world.events]
        for r in ("ShiftStarted", "ShadowReady", "DrainStarted", "Switched", "ShiftCompleted"):
            assert r in reasons

    def test_a_shift_whose_progress_was_lost_is_closed_and_said(self, world: FakeKubeApi) -> None:
        """An older CRD pruned status.executor mid-shift (a new user's check): the history entry stayed
        InProgress for good and the shadow went without a word. Now it is closed as Aborted, once."""
        sig = _lose_a_shifts_progress(world)
        run(world, sig, T0 + 4)
        (h,) = status(world)["history"]
        assert (h["to"], h["outcome"]) == ("latency", "Aborted")
        assert h["message"] == ORPHAN_MESSAGE
        abandoned = [e for e in world.events if e["reason"] == "ShiftAbandoned"]
        assert len(abandoned) == 1 and abandoned[0]["type"] == "Warning"
        run(world, sig, T0 + 6)
        assert len([e for e in world.events if e["reason"] == "ShiftAbandoned"]) == 1

    def test_a_shift_closed_in_a_pruned_write_is_still_said(
        self, world: FakeKubeApi, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The tick that closes the entry can be the one whose write an older CRD prunes (it wrote before
        the CRD poller noticed): the history was written, so the event goes too, and the error still
        stops the tick."""
        sig = _lose_a_shifts_progress(world)
        real = sh.patch_status

        def pruning(*args: Any, **kwargs: Any) -> Any:
            real(*args, **kwargs)
            raise StatusPruned("GearSet status.executor was pruned (test)")

        monkeypatch.setattr(sh, "patch_status", pruning)
        with pytest.raises(StatusPruned):
            run(world, sig, T0 + 4)
        assert status(world)["history"][-1]["outcome"] == "Aborted"
        assert len([e for e in world.events if e["reason"] == "ShiftAbandoned"]) == 1

    def test_drain_waits_for_in_flight_requests(self, world: FakeKubeApi) -> None:
        _policy_patch(world, warmS=0, drainTimeoutS=100)
        key = world.key("GearSet", NS, GS_NAME)
        world.store[key]["spec"]["forceGear"] = "latency"
        sig = FakeSignals()
        sig.in_flight_n = 4
        now = T0
        for _ in range(3):
            run(world, sig, now)
            kubelet(world, now)
            now += 2
        assert status(world)["phase"] == "Draining" and status(world)["executor"]["inFlight"] == 4
        run(world, sig, now + 2)
        assert status(world)["phase"] == "Draining"
        sig.in_flight_n = 0
        run(world, sig, now + 4)
        assert status(world)["phase"] == "Switching"

    def test_crash_between_persist_and_act_resumes(self, world: FakeKubeApi) -> None:
        """The operator dies after writing Warming/Draining but before acting: the next tick repairs."""
        _policy_patch(world, warmS=0, rollbackWindowS=0)
        key = world.key("GearSet", NS, GS_NAME)
        world.store[key]["spec"]["forceGear"] = "latency"
        sig = FakeSignals()
        real_apply = world.apply

        def dying(manifest: Any) -> Any:
            raise RuntimeError("SIGKILL")

        world.apply = dying  # type: ignore[method-assign]
        with pytest.raises(RuntimeError):
            run(world, sig, T0)
        assert status(world)["phase"] == "Warming" and "latency" not in prefill_gears(world)
        world.apply = real_apply  # type: ignore[method-assign]
        run(world, sig, T0 + 2)  # restarted: the shadow is created now
        assert "latency" in prefill_gears(world)
        kubelet(world, T0 + 2)
        world.apply = dying  # type: ignore[method-assign]
        with pytest.raises(RuntimeError):
            run(world, sig, T0 + 4)  # → Draining persisted, the selector not moved yet
        assert status(world)["phase"] == "Draining" and selected(world) == "balanced"
        world.apply = real_apply  # type: ignore[method-assign]
        for i in range(3, 8):
            run(world, sig, T0 + 2 * i)
            kubelet(world, T0 + 2 * i)
        assert status(world)["phase"] == "Stable" and selected(world) == "latency"
        assert prefill_gears(world) == {"latency"}

    def test_no_signals_no_shift_then_resume(self, world: FakeKubeApi) -> None:
        key = world.key("GearSet", NS, GS_NAME)
        world.store[key]["spec"]["forceGear"] = "latency"
        sig = FakeSignals()
        sig.up = False
        for i in range(5):
            r = run(world, sig, T0 + 2 * i)
            assert r.phase is Phase.STABLE and not r.signals_ok
        st = status(world)
        cond = next(c for c in st["conditions"] if c["type"] == "SignalsAvailable")
        assert (cond["status"], cond["reason"]) == ("False", "SignalsMissing")
        assert "connection refused" in cond["message"] and prefill_gears(world) == {"balanced"}
        assert [e["reason"] for e in world.events].count("SignalsMissing") == 1  # once, on the change
        sig.up = True
        r = run(world, sig, T0 + 20)
        assert r.phase is Phase.WARMING and "latency" in prefill_gears(world)
        cond = next(c for c in status(world)["conditions"] if c["type"] == "SignalsAvailable")
        assert cond["status"] == "True"

    def test_no_prometheus_url(self, world: FakeKubeApi) -> None:
        key = world.key("PDService", NS, "llama3-8b")
        del world.store[key]["spec"]["prometheusUrl"]
        r = run(world, FakeSignals(), T0)
        assert not r.signals_ok and "prometheusUrl" in r.message
        cond = next(c for c in status(world)["conditions"] if c["type"] == "SignalsAvailable")
        assert cond["reason"] == "NoPrometheus"

    def test_without_prometheus_an_unchanged_status_is_written_only_at_the_heartbeat(
        self, world: FakeKubeApi
    ) -> None:
        """Writes follow changes: with nothing to sample, a tick that would only move sampleTime writes
        nothing (nor reads the GearSet again) until STATUS_HEARTBEAT_S has passed; a change writes."""
        key = world.key("PDService", NS, "llama3-8b")
        del world.store[key]["spec"]["prometheusUrl"]

        def gearset_calls() -> list[str]:
            return [verb for verb, kind, _, name in world.calls if kind == "GearSet" and name == GS_NAME]

        run(world, FakeSignals(), T0)
        first = status(world)["signals"]["sampleTime"]
        assert first == to_time(T0)
        world.calls.clear()
        run(world, FakeSignals(), T0 + 30)
        run(world, FakeSignals(), T0 + 60)
        assert "patch_status" not in gearset_calls() and gearset_calls().count("get") == 2  # one per tick
        assert status(world)["signals"]["sampleTime"] == first
        world.runtime.gearsets.add_missed((NS, GS_NAME), 1)  # a change: written at once
        run(world, FakeSignals(), T0 + 90)
        assert "patch_status" in gearset_calls() and status(world)["signals"]["missedSamples"] == 1
        world.calls.clear()
        run(world, FakeSignals(), T0 + 90 + STATUS_HEARTBEAT_S)
        assert gearset_calls().count("patch_status") == 1
        assert status(world)["signals"]["sampleTime"] == to_time(T0 + 90 + STATUS_HEARTBEAT_S)

    def test_a_condition_written_during_the_tick_is_not_overwritten_by_its_stale_copy(
        self, world: FakeKubeApi
    ) -> None:
        """The reconciler writes Ready=False (RollingOut) ahead of a rollout while a tick samples; the tick,
        which read Ready=True before, writes its SignalsAvailable and leaves Ready as stored."""
        key = world.key("GearSet", NS, GS_NAME)
        ready = {"type": "Ready", "status": "True", "reason": "AllReady", "message": "serving",
                 "lastTransitionTime": to_time(T0 - 50)}  # fmt: skip
        world.store[key].setdefault("status", {})["conditions"] = [ready]

        class RolloutDuringSample(FakeSignals):
            def raw(self, url: str, sel: GearSelector, at: float) -> Sample:
                rolling = {**ready, "status": "False", "reason": "RollingOut", "message": "new template"}
                world.patch_status("gearshift.io/v1alpha1", "GearSet", NS, GS_NAME, {"conditions": [rolling]})
                return super().raw(url, sel, at)

        run(world, RolloutDuringSample(), T0)
        conds = {c["type"]: c for c in status(world)["conditions"]}
        assert conds["Ready"]["status"] == "False" and conds["Ready"]["reason"] == "RollingOut"
        assert conds["SignalsAvailable"]["status"] == "True"

    def test_a_failing_prometheus_is_written_every_tick(self, world: FakeKubeApi) -> None:
        sig = FakeSignals()
        sig.up = False
        run(world, sig, T0)
        run(world, sig, T0 + 2)
        assert status(world)["signals"]["sampleTime"] == to_time(T0 + 2)  # each attempt shown

    def test_without_prometheus_the_loop_idles_until_a_shift_is_asked_for(self, world: FakeKubeApi) -> None:
        key = world.key("PDService", NS, "llama3-8b")
        del world.store[key]["spec"]["prometheusUrl"]
        gs_key = world.key("GearSet", NS, GS_NAME)
        assert run(world, FakeSignals(), T0).idle  # no sample can move the decision: wait longer
        settled = sh.wake_key(world.store[gs_key])
        world.store[gs_key]["spec"]["forceGear"] = "latency"
        world.store[gs_key]["metadata"]["generation"] += 1
        assert sh.wake_key(world.store[gs_key]) != settled  # the idle wait ends
        r = run(world, FakeSignals(), T0 + 2)
        assert not r.idle and r.phase is Phase.WARMING and "latency" in prefill_gears(world)
        # Held on the forced gear once the shift is done: at rest again.
        held = copy.deepcopy(world.store[gs_key])
        held["status"] = {"activeGear": "latency", "executor": {"step": "Stable"}}
        assert sh.wake_key(held) == (held["metadata"]["generation"], True)

    def test_a_window_to_vacate_wakes_the_loop(self, world: FakeKubeApi) -> None:
        gs_key = world.key("GearSet", NS, GS_NAME)
        before = sh.wake_key(world.store[gs_key])
        world.store[gs_key].setdefault("status", {})["windowedNodes"] = ["gpu-a10-0"]
        assert sh.wake_key(world.store[gs_key]) != before

    def test_paused_holds(self, world: FakeKubeApi) -> None:
        key = world.key("GearSet", NS, GS_NAME)
        world.store[key]["spec"]["forceGear"] = "latency"
        world.store[key]["spec"]["paused"] = True
        r = run(world, FakeSignals(), T0)
        assert r.phase is Phase.STABLE and r.decision is not None and r.decision.reason == "Paused"
        assert prefill_gears(world) == {"balanced"}

    def test_not_ready_in_time_rolls_back_and_marks_unhealthy(self, world: FakeKubeApi) -> None:
        _policy_patch(world, warmupTimeoutS=10)
        key = world.key("GearSet", NS, GS_NAME)
        world.store[key]["spec"]["forceGear"] = "latency"
        sig = FakeSignals()
        for i in range(8):  # no kubelet: the shadow never becomes Ready
            run(world, sig, T0 + 2 * i)
            assert selected(world) == "balanced"
        st = status(world)
        assert st["phase"] == "Stable" and st["activeGear"] == "balanced"
        assert st["history"][-1]["outcome"] == "RolledBack"
        (mark,) = st["gearHealth"]
        assert (mark["gear"], mark["healthy"], mark["reason"]) == ("latency", False, "NotReadyInTime")
        assert prefill_gears(world) == {"balanced"}
        # the forced gear is now unhealthy: no new attempt
        r = run(world, sig, T0 + 40)
        assert r.decision is not None and r.decision.reason == "ForceGearUnhealthy"
        assert "change the gear to retry" in r.decision.message
        assert prefill_gears(world) == {"balanced"}
        # The user changes the gear, as the hold says: the edited gear is tried again
        latency = next(g for g in world.store[key]["spec"]["gears"] if g["name"] == "latency")
        latency["maxBatch"] = latency["maxBatch"] // 2
        r = run(world, sig, T0 + 42)
        assert r.decision is not None and r.decision.reason != "ForceGearUnhealthy", r.decision
        assert r.phase is Phase.WARMING and "latency" in prefill_gears(world)
        # ... and the status no longer shows the old mark.
        assert [h["gear"] for h in status(world).get("gearHealth") or []] == []

    @pytest.mark.parametrize("revert", ["balanced", None])
    def test_force_reverted_while_warming_cancels_the_shift(
        self, world: FakeKubeApi, revert: str | None
    ) -> None:
        # The shadow is still warming when the user reverts spec.forceGear: the shift is
        # cancelled (shadow deleted, history Aborted), not completed and then undone by a second shift.
        key = world.key("GearSet", NS, GS_NAME)
        world.store[key]["spec"]["forceGear"] = "latency"
        sig = FakeSignals()
        r = run(world, sig, T0)
        assert r.phase is Phase.WARMING and prefill_gears(world) == {"balanced", "latency"}
        if revert is None:
            del world.store[key]["spec"]["forceGear"]
        else:
            world.store[key]["spec"]["forceGear"] = revert
        r = run(world, sig, T0 + 2)
        st = status(world)
        assert r.phase is Phase.STABLE and st["activeGear"] == "balanced"
        assert prefill_gears(world) == {"balanced"} and selected(world) == "balanced"
        assert st["history"][-1]["outcome"] == "Aborted"
        assert "cancelled while 'latency' warmed" in st["history"][-1]["message"]
        assert "ShiftCancelled" in [e["reason"] for e in world.events]
        assert st.get("gearHealth") in (None, [])  # a cancel is not a failure of the gear
        r = run(world, sig, T0 + 4)
        assert r.phase is Phase.STABLE and prefill_gears(world) == {"balanced"}

    def test_deleting_the_gearset_mid_shift_frees_the_shadow_and_keeps_the_serving_gear(
        self, world: FakeKubeApi
    ) -> None:
        key = world.key("GearSet", NS, GS_NAME)
        world.store[key]["spec"]["forceGear"] = "latency"
        run(world, FakeSignals(), T0)
        assert prefill_gears(world) == {"balanced", "latency"}
        freed = sh.free_gears_of_deleted_gearset(world.runtime, NS, world.store[key])
        assert freed == ["latency"]
        assert prefill_gears(world) == {"balanced"} and selected(world) == "balanced"
        assert cs.gears_to_free([], None, "balanced") == []

    def test_the_active_gear_and_the_gpus_of_each_gear_are_exported(self, world: FakeKubeApi) -> None:
        """The dashboard's gear panels: gearshift_operator_active_gear and _gear_gpus per gear, the
        shadow's GPUs counted while it warms, and gone with the GearSet."""
        from prometheus_client import REGISTRY

        def value(name: str, gear: str) -> float | None:
            labels = {"service_namespace": NS, "service": "llama3-8b", "role": "prefill", "gear": gear}
            return REGISTRY.get_sample_value(f"gearshift_operator_{name}", labels)

        run(world, FakeSignals(), T0)
        # gearset-explicit.yaml: balanced is 4 one-GPU stages; latency 2 + 1 pods (its H100 stage twice)
        assert [value("active_gear", g) for g in ("latency", "balanced", "throughput")] == [0.0, 1.0, 0.0]
        assert [value("gear_gpus", g) for g in ("latency", "balanced", "throughput")] == [0.0, 4.0, 0.0]
        key = world.key("GearSet", NS, GS_NAME)
        world.store[key]["spec"]["forceGear"] = "latency"
        run(world, FakeSignals(), T0 + 1)
        kubelet(world, T0 + 1)
        run(world, FakeSignals(), T0 + 2)
        assert (value("gear_gpus", "latency"), value("gear_gpus", "balanced")) == (3.0, 4.0)
        assert value("active_gear", "balanced") == 1.0
        sh.gearset_deleted(
            namespace=NS, name=GS_NAME, body=world.store[key], memo=kopf.Memo(runtime=world.runtime)
        )
        assert value("active_gear", "balanced") is None and value("gear_gpus", "latency") is None

    def test_p99_regression_rolls_back_then_drains_the_failed_gear(self, world: FakeKubeApi) -> None:
        """Baseline = balanced's smoothed TTFT P99 at the decision (150 ms): latency at 1000 ms exceeds
        2 × max(150, target 200) = 400 ms. The Service returns to balanced first; latency is deleted only
        once Prometheus reports no request left on it."""
        _policy_patch(world, warmS=0, rollbackWindowS=30, drainTimeoutS=100)
        key = world.key("GearSet", NS, GS_NAME)
        world.store[key]["spec"]["forceGear"] = "latency"
        sig = PerGearSignals({"balanced": 150.0, "latency": 1000.0})
        phases = []
        # T0 Warming, +2 Draining, +4 Switching; the P99 is judged from +29 (Switching + half the 30 s
        # rollback window + MIN_WINDOW_S): +6 still Switching, +30 RollingBack.
        for t in (T0, T0 + 2, T0 + 4, T0 + 6, T0 + 30):
            r = run(world, sig, t)
            phases.append(r.phase)
            kubelet(world, t)
        assert phases == [Phase.WARMING, Phase.DRAINING, Phase.SWITCHING, Phase.SWITCHING, Phase.ROLLING_BACK]
        st = status(world)
        assert st["executor"]["baselineP99Ms"] == 150.0
        assert st["executor"]["baselineQps"] == 3.0  # balanced's (smoothed) served rate at the decision
        assert selected(world) == "balanced" and prefill_gears(world) == {"balanced", "latency"}
        sig.in_flight_by_gear["latency"] = 3
        run(world, sig, T0 + 32)
        st = status(world)
        assert st["phase"] == "RollingBack" and st["executor"]["inFlight"] == 3
        assert "latency" in prefill_gears(world) and sig.drained[-1] == "latency"
        sig.in_flight_by_gear["latency"] = 0
        run(world, sig, T0 + 34)
        st = status(world)
        assert st["phase"] == "Stable" and st["activeGear"] == "balanced"
        assert prefill_gears(world) == {"balanced"} and selected(world) == "balanced"
        assert st["history"][-1]["outcome"] == "RolledBack"
        (mark,) = st["gearHealth"]
        assert (mark["gear"], mark["reason"]) == ("latency", "P99Regression")
        assert "400 ms" in mark["message"]

    @pytest.mark.parametrize(("latency_qps", "phase"), [(3.5, Phase.SWITCHING), (2.5, Phase.ROLLING_BACK)])
    def test_saturation_shift_kept_while_it_serves_more(
        self, world: FakeKubeApi, latency_qps: float, phase: Phase
    ) -> None:
        """The handler passes the selected gear's sampled served rate into its observation: a saturation
        shift whose new gear (P99 1000 > 2 × max(150, 200) = 400 ms) serves 3.5 req/s, more than balanced's
        3.0 at the decision, stays in Switching; at 2.5 req/s it rolls back. (The shift is forced to reach
        Switching, then its persisted trigger is set to saturation, as a saturation decision records it.)"""
        _policy_patch(world, warmS=0, rollbackWindowS=30, drainTimeoutS=100)
        key = world.key("GearSet", NS, GS_NAME)
        world.store[key]["spec"]["forceGear"] = "latency"
        sig = PerGearSignals({"balanced": 150.0, "latency": 1000.0}, {"latency": latency_qps})
        for i in range(3):  # T0 Warming, +2 Draining, +4 Switching
            run(world, sig, T0 + 2 * i)
            kubelet(world, T0 + 2 * i)
        st = status(world)
        assert st["phase"] == "Switching" and st["executor"]["baselineQps"] == 3.0
        world.store[key]["status"]["executor"]["trigger"] = "saturation"
        r = run(world, sig, T0 + 30)  # Switching (+4) + 15 s initial delay + MIN_WINDOW_S: judged
        assert r.phase is phase
        assert selected(world) == ("latency" if phase is Phase.SWITCHING else "balanced")
        assert status(world)["executor"]["trigger"] == "saturation"

    def test_a_reconcile_mid_shift_keeps_both_gears(self, world: FakeKubeApi) -> None:
        key = world.key("GearSet", NS, GS_NAME)
        world.store[key]["spec"]["forceGear"] = "latency"
        run(world, FakeSignals(), T0)
        rec.reconcile_service(world.runtime, NS, "llama3-8b")
        assert prefill_gears(world) == {"balanced", "latency"} and selected(world) == "balanced"


def _vec(value: str) -> list[dict[str, Any]]:
    return [{"metric": {}, "value": [T0, value]}]


class VllmProm(FakeSignals):
    """Prometheus in front of a vLLM head: answers the controller's own queries for the engine it asks
    with (:func:`signal_queries`) with canned series, parsed by the real :func:`reading_from_results`.
    Only vLLM's names exist: a sim-engine sample finds no ``gearshift:stage_utilization`` and fails."""

    def __init__(self, concurrency: str = "24", ttft_p99_s: str = "0.15", waiting: str = "0") -> None:
        super().__init__()
        self.concurrency, self.ttft_p99_s, self.waiting = concurrency, ttft_p99_s, waiting

    def sample(
        self,
        url: str,
        sel: GearSelector,
        at: float,
        *,
        engine: str,
        shape: PipelineShape | None,
        window: str = "1m",
    ) -> Reading:
        self.record(sel, engine, shape, window)
        q = signal_queries(sel, engine=engine)  # type: ignore[arg-type]
        answers = {q.queue: _vec(self.waiting), q.running: _vec("24"), q.qps: _vec("3")}
        if q.concurrency is not None:
            answers[q.concurrency] = _vec(self.concurrency)
        # Every series a vLLM head exports: TTFT and E2E quantiles with values; ITL's NaN, as
        # histogram_quantile gives over buckets that did not move (one-token prefill legs).
        for name, query in q.quantiles.items():
            value = self.ttft_p99_s if name.startswith("ttft_") else "0.4"
            answers[query] = _vec("NaN" if name.startswith("itl_") else value)
        if q.arrivals is not None:
            answers[q.arrivals] = _vec("3")
        # The router's traffic mix: 3 req/s of 700 prompt tokens (bucket le=1000) and 90 output tokens.
        mix = q.mix()
        answers[mix["prompt_tokens_mean"]] = _vec("700")
        answers[mix["output_tokens_mean"]] = _vec("90")
        answers[mix["prompt_tokens_buckets"]] = [
            {"metric": {"le": le}, "value": [T0, n]}
            for le, n in (("500.0", "0"), ("1000.0", "3"), ("+Inf", "3"))
        ]
        return reading_from_results(at, q, answers, shape)


def _engine(api: FakeKubeApi, engine: str) -> None:
    key = api.key("PDService", NS, "llama3-8b")
    api.store[key]["spec"]["engine"] = engine


def _stage_times(api: FakeKubeApi, gear: str, times: list[float]) -> None:
    key = api.key("GearSet", NS, GS_NAME)
    (g,) = [g for g in api.store[key]["spec"]["gears"] if g["name"] == gear]
    for stage, t in zip(g["stages"], times, strict=True):
        stage["predictedTimeMs"] = t


def _signals_condition(api: FakeKubeApi) -> dict[str, Any]:
    return next(c for c in status(api)["conditions"] if c["type"] == "SignalsAvailable")


class TestVllmService:
    """An ``engine: vllm`` PDService: no ``gearshift:stage_utilization`` anywhere, yet the loop samples,
    decides and shifts. The example's balanced gear has 4 stages, maxBatch 64 and no predictedTimeMs."""

    def test_explicit_gear_without_stage_times_still_samples(self, world: FakeKubeApi) -> None:
        _engine(world, "vllm")
        sig = VllmProm(concurrency="24")
        r = run(world, sig, T0)
        assert r.signals_ok and sig.engines == ["vllm"]
        shape = sig.shapes[0]
        assert shape is not None and shape.gear == "balanced" and shape.max_num_seqs == 64
        assert shape.stage_times_ms == (None, None, None, None)
        cond = _signals_condition(world)
        assert (cond["status"], cond["reason"]) == ("True", "StageBalanceUnavailable")
        assert "predictedTimeMs" in cond["message"] and "imbalance trigger is off" in cond["message"]
        sig_st = status(world)["signals"]
        assert sig_st["stageUtilizationSource"] == "none" and sig_st["stageUtilization"] == []
        assert sig_st["pipelineUtilization"] == 0.375  # 24 requests in execution / 64 seats
        # No ITL: blank, which the status patch's null makes an absent key (RFC 7386: null deletes).
        assert sig_st["p99Ms"] == 150.0 and "p99ItlMs" not in sig_st
        assert (sig_st["promptTokensMean"], sig_st["outputTokensMean"]) == (700.0, 90.0)

    def test_stage_times_give_derived_utilization(self, world: FakeKubeApi) -> None:
        _engine(world, "vllm")
        _stage_times(world, "balanced", [20.0, 20.0, 10.0, 10.0])
        run(world, VllmProm(concurrency="48"), T0)
        # busy 48/64 = 0.75; bottleneck 20 ms: 0.75, 0.75, 0.75 * 10/20, 0.75 * 10/20
        sig_st = status(world)["signals"]
        assert sig_st["stageUtilizationSource"] == "derived"
        assert sig_st["stageUtilization"] == [0.75, 0.75, 0.375, 0.375]
        assert sig_st["pipelineUtilization"] == 0.75
        assert _signals_condition(world)["reason"] == "SignalsOk"

    def test_sim_records_the_engine_source(self, world: FakeKubeApi) -> None:
        sig = FakeSignals()
        run(world, sig, T0)
        assert sig.engines == ["sim"]
        sig_st = status(world)["signals"]
        assert sig_st["stageUtilizationSource"] == "engine" and sig_st.get("pipelineUtilization") is None

    def test_p99_high_shifts_without_stage_times(self, world: FakeKubeApi) -> None:
        # TTFT P99 500 ms > 1.2 x the 200 ms target, three samples in a row → the latency gear.
        _engine(world, "vllm")
        sig = VllmProm(ttft_p99_s="0.5")
        results = [run(world, sig, T0 + 2 * i) for i in range(3)]
        d = results[-1].decision
        assert d is not None and d.kind.value == "Shift" and d.trigger == "p99-high" and d.target == "latency"
        assert results[-1].phase is Phase.WARMING and "latency" in prefill_gears(world)
        assert _signals_condition(world)["status"] == "True"

    def test_imbalance_shifts_on_derived_utilization(self, world: FakeKubeApi) -> None:
        # Stage times 30, 10, 10, 10 ms and 62 of 64 seats busy (0.96875): the bottleneck reads 0.969 >
        # 0.9 while the others read 0.96875 * 10/30 = 0.323 < 0.6 → the throughput gear. P99 150 ms is
        # between 0.7 and 1.2 x 200 ms, so no latency trigger competes.
        _engine(world, "vllm")
        _stage_times(world, "balanced", [30.0, 10.0, 10.0, 10.0])
        sig = VllmProm(concurrency="62", ttft_p99_s="0.15")
        results = [run(world, sig, T0 + 2 * i) for i in range(3)]
        assert status(world)["signals"]["stageUtilization"] == [0.9688, 0.3229, 0.3229, 0.3229]
        d = results[-1].decision
        assert d is not None and d.trigger == "imbalance" and d.target == "throughput"
        assert results[-1].phase is Phase.WARMING

    def test_sim_engine_without_its_series_is_signals_missing(self, world: FakeKubeApi) -> None:
        # The sim path is unchanged: its per-stage series are required.
        r = run(world, VllmProm(), T0)
        assert not r.signals_ok and "gearshift:stage_utilization" in r.message
        assert _signals_condition(world)["status"] == "False"


def test_non_finite_values_never_reach_the_status_patch(world: FakeKubeApi) -> None:
    class Broken(FakeSignals):
        def raw(self, url: str, sel: GearSelector, at: float) -> Sample:
            return Sample(at=at, stage_utilization=(math.nan, 0.5), qps=math.inf, ttft_p99_ms=math.nan,
                          itl_p99_ms=math.inf, queue=math.nan)  # fmt: skip

    patches: list[dict[str, Any]] = []
    real = world.patch_status

    def record(*args: Any) -> dict[str, Any]:
        patches.append(copy.deepcopy(dict(args[-1])))
        return real(*args)

    world.patch_status = record  # type: ignore[method-assign]
    run(world, Broken(), T0)
    run(world, Broken(), T0 + 2)
    assert patches
    for p in patches:
        json.dumps(p, allow_nan=False)  # raises ValueError on NaN/Inf
    sent = patches[-1]["signals"]
    assert sent.get("qps") is None and sent["p99ItlMs"] is None and sent["stageUtilization"] == []


def test_json_safe() -> None:
    assert ss.json_safe({"a": [1.0, math.nan, {"b": -math.inf}], "c": "x", "d": 2}) == {
        "a": [1.0, None, {"b": None}],
        "c": "x",
        "d": 2,
    }


def test_signals_to_status_always_sends_the_source_keys() -> None:
    out = ss.signals_to_status(Sample(at=T0, qps=1.0), ShiftRules(), 1)
    assert "stageUtilizationSource" in out and out["stageUtilizationSource"] is None
    assert "pipelineUtilization" in out and out["pipelineUtilization"] is None


def test_signals_to_status_shows_the_smoothed_traffic_mix() -> None:
    """``promptTokensMean`` and ``outputTokensMean``: the moving average (alpha 0.3) to 0.1 token, kept
    through an idle window, persisted in ``status.control.ema``; ``null`` before any was measured."""
    from gearshift.api.gearset_status import GearSignals
    from gearshift.control.smoothing import smooth

    policy = ShiftRules()
    first = Sample(at=T0, qps=2.0, prompt_tokens_mean=812.46, output_tokens_mean=97.04)
    idle = Sample(at=T0 + 2, qps=0.0)
    later = Sample(at=T0 + 4, qps=2.0, prompt_tokens_mean=1000.0, output_tokens_mean=50.0)
    s1 = smooth(None, first, 0.3)
    s2 = smooth(s1, idle, 0.3)
    s3 = smooth(s2, later, 0.3)
    shown = [ss.signals_to_status(s, policy, 1, raw) for s, raw in ((s1, first), (s2, idle), (s3, later))]
    assert [(o["promptTokensMean"], o["outputTokensMean"]) for o in shown] == [
        (812.5, 97.0),
        (812.5, 97.0),
        (868.7, 82.9),  # 0.3 x 1000 + 0.7 x 812.46 = 868.722; 0.3 x 50 + 0.7 x 97.04 = 82.928
    ]
    assert GearSignals.model_validate(shown[-1]).prompt_tokens_mean == 868.7
    unknown = ss.signals_to_status(Sample(at=T0, qps=1.0), policy, 1)
    assert "promptTokensMean" in unknown and unknown["promptTokensMean"] is None
    assert "outputTokensMean" in unknown and unknown["outputTokensMean"] is None

    control = ss.control_to_status(DecisionState(smoothed=s3), policy)
    assert control["ema"]["promptTokensMean"] == pytest.approx(868.722)
    back = ss.control_from_status(ControlState.model_validate(control)).smoothed
    assert back is not None
    assert (back.prompt_tokens_mean, back.output_tokens_mean) == (
        s3.prompt_tokens_mean,
        s3.output_tokens_mean,
    )


def test_an_unknown_executor_action_fails_the_tick_before_anything_is_written(
    world: FakeKubeApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tick used to drop an action it had no case for (``case _: pass``); now it raises before the
    status write, so the step is neither persisted nor half applied."""
    real_step = sh.step

    def step_with_a_new_action(*args: Any, **kwargs: Any) -> tuple[ShiftState, list[Any]]:
        state, actions = real_step(*args, **kwargs)
        return state, [*actions, SelectGear("latency"), "ResizeKvPool(latency)"]

    monkeypatch.setattr(sh, "step", step_with_a_new_action)
    before = copy.deepcopy(world.store)
    with pytest.raises(cs.UnknownActionError, match="ResizeKvPool"):
        run(world, FakeSignals(), T0)
    assert world.store == before  # no status patch, no Service selector change


async def test_the_daemon_ticks_with_the_runtime_and_signals_in_kopfs_memo(world: FakeKubeApi) -> None:
    sig = FakeSignals()
    world.runtime.shift_signals = sig
    body = world.get("gearshift.io/v1alpha1", "GearSet", NS, GS_NAME)
    assert "SignalsAvailable" not in [c["type"] for c in body["status"].get("conditions") or []]
    await sh.gearset_shifting(
        namespace=NS, name=GS_NAME, body=body, stopped=OneTurn(), memo=kopf.Memo(runtime=world.runtime)
    )  # type: ignore[arg-type]
    assert sig.asked  # sampled through the runtime's source
    types = [c["type"] for c in status(world)["conditions"]]
    assert "SignalsAvailable" in types
