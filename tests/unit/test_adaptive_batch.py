"""The PD guide's adaptive batch (docs/sources.md#adaptive-batch), applied: the pure step
(control/adaptive_batch/tick.py:
bounds, cooldown, never during a shift, stale proposals), the handler over an in-memory API (annotation,
status, condition, events), and the router's side (the annotation read by membership, the per-pod cap that
holds requests in the router rather than sending them)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Any

import kopf
import pytest
from test_handlers_reconcile import NS, _example, new_api, put_fleet
from test_router_proxy import COMPLETION, Factory, FakeEngine, make_router  # noqa: F401  # fixture

from gearshift.api.common import COND_BATCH_ADAPTED
from gearshift.api.gearset_status import AdaptiveBatchStatus
from gearshift.control.adaptive_batch import tick as ab
from gearshift.handlers import adaptive_batch as h
from gearshift.k8s import names
from gearshift.router.config import ProxyConfig
from gearshift.router.membership import batch_caps, infos_from_slices, with_caps
from gearshift.router.pool import BackendInfo
from gearshift.router.server import balance_round
from gearshift.testing.daemons import OneTurn
from gearshift.testing.kube import FakeKubeApi

T0 = 1_800_000_000.0


def vote(direction: int, current: int = 100, pod: str = "d0", router: str = "r0") -> ab.Vote:
    proposed = {-1: current - 10, 0: current, 1: current + 10}[direction]
    return ab.Vote(router, pod, current, proposed, "ITL P99 80.0 ms > 1.2 × 50 ms" if direction < 0 else "x")


def started(
    planned: int = 100,
    effective: int = 100,
    changed_at: float | None = T0 - 3600,
    pods: tuple[str, ...] = ("d0", "d1"),
) -> ab.BatchState:
    return ab.BatchState(
        gear="g", planned=planned, pods={p: ab.PodBatch(effective, changed_at) for p in pods}
    )


def decide(state: ab.BatchState, votes: list[ab.Vote], now: float = T0, **kw: Any) -> ab.BatchStep:
    args: dict[str, Any] = {
        "gear": "g",
        "planned": 100,
        "micro_batch": 1,
        "shift_in_flight": False,
        "heads": ("d0", "d1"),
    } | kw
    return ab.decide(state, votes=votes, now=now, **args)


def caps(step: ab.BatchStep) -> dict[str, int]:
    return {p.pod: p.effective for p in step.pods}


class TestSteps:
    def test_seed_factors_with_one_step_at_least_and_the_bounds(self) -> None:
        assert ab.lowered(100, 1) == 90 and ab.lowered(5, 1) == 4 and ab.lowered(2, 2) == 2
        assert ab.raised(90, 100) == 99 and ab.raised(9, 100) == 10 and ab.raised(99, 100) == 100
        assert ab.floor_of(100) == 25 and ab.floor_of(100, micro_batch=32) == 32 and ab.floor_of(2) == 1
        assert ab.floor_of(3, micro_batch=8) == 3  # never above the planned value
        assert ab.per_router_cap(100, 3) == 33 and ab.per_router_cap(2, 4) == 1

    def test_a_new_gear_starts_every_pod_at_its_planned_max_batch(self) -> None:
        step = decide(ab.BatchState(), [vote(-1)])
        assert (step.kind, caps(step), step.reason) == ("Reset", {"d0": 100, "d1": 100}, ab.REASON_INITIAL)
        step = decide(replace(started(effective=50), gear="old"), [vote(-1)])
        assert (step.kind, step.reason, step.effective) == ("Reset", ab.REASON_GEAR_CHANGED, 100)
        step = decide(started(planned=64, effective=50), [], planned=100)
        assert (step.kind, step.effective, step.reason) == ("Reset", 100, ab.REASON_PLAN_CHANGED)

    def test_each_pod_steps_from_its_own_proposals(self) -> None:
        # d0 (a slow card) is over its ITL target, d1 (a fast card) has a backlog under target: d0 goes
        # down, d1 up, in the same round; one cap for both would have to pick one of them.
        state = started(effective=90)
        step = decide(state, [vote(-1, current=90), vote(1, current=90, pod="d1")])
        assert caps(step) == {"d0": 81, "d1": 99}
        assert (step.kind, step.reason) == ("Lower", ab.REASON_ITL_HIGH)  # the most consequential
        assert step.message.startswith("pod d0 max batch 90 → 81: router r0")
        state = ab.advance(state, step, "g", T0)
        assert [(c.pod, c.before, c.after, c.reason) for c in state.history] == [
            ("d0", 90, 81, ab.REASON_ITL_HIGH),
            ("d1", 90, 99, ab.REASON_ITL_LOW),
        ]
        assert state.effective == 81
        reasons = [r for r, _, _ in ab.events(step, started(effective=90), "g")]
        assert reasons == ["MaxBatchLowered", "MaxBatchRaised"]

    def test_a_slow_pod_beside_a_fast_one_settles_instead_of_oscillating(self) -> None:
        # The defect one shared cap had (demo decode gear, H100/A100/A10 pods: 40 <-> 58): here each pod
        # walks to where its own signal stops pushing, and stays there.
        state, now, seen = started(planned=64, effective=64), T0, []
        for _ in range(40):
            now += ab.COOLDOWN_S
            slow = state.pods["d0"].effective
            fast = state.pods["d1"].effective
            votes = [vote(-1, current=slow)] if slow > 16 else [vote(0, current=slow)]
            votes.append(vote(1, current=fast, pod="d1"))
            step = decide(state, votes, now, planned=64)
            state = ab.advance(state, step, "g", now)
            seen.append((state.pods["d0"].effective, state.pods["d1"].effective))
        slow_path = [s for s, _ in seen]
        assert slow_path == sorted(slow_path, reverse=True) and slow_path[-1] == ab.floor_of(64) == 16
        assert {f for _, f in seen} == {64}

    def test_lowering_stops_at_the_floor(self) -> None:
        state = started(effective=25)
        step = decide(state, [vote(-1, current=25)])
        assert (step.kind, caps(step)["d0"], step.reason) == ("Hold", 25, ab.REASON_AT_FLOOR)
        # Walked down from the top, it reaches the floor and no lower.
        now, values = T0, []
        state = started(pods=("d0",))
        for _ in range(30):
            now += ab.COOLDOWN_S
            step = decide(state, [vote(-1, current=state.effective or 0)], now, heads=("d0",))
            state = ab.advance(state, step, "g", now)
            values.append(state.effective)
        assert values[:3] == [90, 81, 72] and min(v or 0 for v in values) == 25 == values[-1]

    def test_raise_only_without_a_lowering_vote_and_never_above_planned(self) -> None:
        two = [vote(1, current=90), vote(0, current=90, router="r1")]
        step = decide(started(effective=90, pods=("d0",)), two, heads=("d0",))
        assert (step.kind, step.effective, step.reason) == ("Raise", 99, ab.REASON_ITL_LOW)
        down = [vote(1, current=90), vote(-1, current=90, router="r1")]
        assert caps(decide(started(effective=90, pods=("d0",)), down, heads=("d0",))) == {"d0": 81}
        step = decide(started(effective=99), [vote(1, current=99)])
        assert (step.kind, caps(step)["d0"]) == ("Raise", 100)
        step = decide(started(effective=100, pods=("d0",)), [vote(1)], heads=("d0",))
        assert (step.kind, step.reason) == ("Hold", ab.REASON_AT_PLANNED)
        step = decide(started(effective=90, pods=("d0",)), [vote(0, current=90)], heads=("d0",))
        assert (step.kind, step.reason) == ("Hold", ab.REASON_WITHIN_BAND)

    def test_cooldown_counts_per_pod(self) -> None:
        state = started(changed_at=T0 - ab.COOLDOWN_S + 1)
        step = decide(state, [vote(-1)])
        assert (step.kind, caps(step)["d0"], step.reason) == ("Hold", 100, ab.REASON_COOLDOWN)
        assert decide(state, [vote(-1)], now=T0 + 1).kind == "Lower"
        assert decide(started(effective=90, changed_at=T0 - 5), [vote(1, current=90)]).reason == "Cooldown"
        # d1 changed a moment ago, d0 long ago: d0 may step, d1 waits.
        state = replace(state, pods={"d0": ab.PodBatch(100, T0 - 3600), "d1": ab.PodBatch(100, T0 - 1)})
        step = decide(state, [vote(-1), vote(-1, pod="d1")])
        assert caps(step) == {"d0": 90, "d1": 100}
        assert [p.reason for p in step.pods] == [ab.REASON_ITL_HIGH, ab.REASON_COOLDOWN]

    def test_a_pod_that_joins_starts_at_planned_and_one_that_leaves_is_forgotten(self) -> None:
        state = started(effective=50)
        step = decide(state, [vote(-1, current=50)], heads=("d0", "d2"))
        assert caps(step) == {"d0": 45, "d2": 100}
        assert [p.reason for p in step.pods] == [ab.REASON_ITL_HIGH, ab.REASON_POD_ADDED]
        after = ab.advance(state, step, "g", T0)
        assert sorted(after.pods) == ["d0", "d2"] and [c.pod for c in after.history] == ["d0"]
        only = decide(started(effective=50), [], heads=("d0", "d2"))
        assert only.kind == "Reset" and ab.events(only, started(effective=50), "g") == []

    def test_never_during_a_shift(self) -> None:
        for state in (started(), started(effective=50), replace(started(), gear="old"), ab.BatchState()):
            step = decide(state, [vote(-1), vote(1)], shift_in_flight=True)
            assert step.kind == "Hold" and step.reason == ab.REASON_SHIFT
            assert ab.advance(state, step, "g", T0) == state

    def test_stale_or_missing_proposals_do_not_vote(self) -> None:
        step = decide(started(), [])
        assert step.reason == ab.REASON_NO_DECISIONS and step.kind == "Hold"
        step = decide(started(effective=90), [vote(-1, current=100)])
        assert (step.kind, caps(step)["d0"]) == ("Hold", 90)
        assert (
            step.pods[0].reason == ab.REASON_STALE and "has not read the annotation" in step.pods[0].message
        )
        # With 2 router replicas each holds 45 of 90 requests per pod: that is the fresh value.
        assert decide(started(effective=90), [vote(-1, current=45)], routers=2).kind == "Lower"
        assert decide(started(), [], heads=()).reason == ab.REASON_NO_PODS

    def test_disabled_goes_back_to_planned_once(self) -> None:
        step = decide(started(effective=50), [vote(-1)], enabled=False)
        assert (step.kind, caps(step), step.reason) == ("Reset", {"d0": 100, "d1": 100}, ab.REASON_DISABLED)
        state = ab.advance(started(effective=50), step, "g", T0)
        assert decide(state, [vote(-1)], enabled=False).kind == "Hold"
        assert [r for r, _, _ in ab.events(step, started(effective=50), "g")] == ["MaxBatchReset"]

    def test_votes_from_a_routers_answer(self) -> None:
        doc = {
            "batch": [
                {"pod": "d0", "current": 10, "proposed": 9, "reason": "ITL high", "changed": True},
                {"pod": "other", "current": 10, "proposed": 9, "reason": "x"},
                {"pod": "d1", "current": "x", "proposed": 9},
                "junk",
            ]
        }
        assert ab.votes_from(doc, "r0", {"d0", "d1"}) == [ab.Vote("r0", "d0", 10, 9, "ITL high")]
        assert ab.votes_from({}, "r0", {"d0"}) == []

    def test_history_and_status_round_trip(self) -> None:
        state = started()
        now = T0
        for _ in range(ab.MAX_CHANGES + 3):
            now += ab.COOLDOWN_S
            step = decide(state, [vote(-1, current=state.pods["d0"].effective)], now)
            state = ab.advance(state, step, "g", now)
        doc = ab.status_json(state, step, 1, now)
        st = AdaptiveBatchStatus.model_validate(doc)
        assert len(st.history) == ab.MAX_CHANGES and st.history[-1].to_value == state.pods["d0"].effective
        assert {p.pod: p.effective for p in st.pods} == {"d0": state.pods["d0"].effective, "d1": 100}
        assert st.effective == state.pods["d0"].effective and st.history[-1].pod == "d0"
        back = ab.state_from_status(st)
        assert (back.gear, back.planned, back.pods) == ("g", 100, state.pods)
        assert back.last_change_at == state.last_change_at and back.history == state.history
        assert not ab.status_changed(st, ab.status_json(state, step, 1, now + 5))
        assert ab.status_changed(st, ab.status_json(state, decide(state, [], now), 1, now))

    def test_condition_says_which_pods_are_capped(self) -> None:
        state = ab.advance(started(), decide(started(), [vote(-1)]), "g", T0)
        status, reason, message = ab.condition(decide(state, []), state)
        assert (status, reason) == ("True", ab.REASON_ITL_HIGH)
        assert message.startswith(
            "max batch 90 of 100 (lowest); below the planned on 1 of 2 head pods: d0 90"
        )
        assert ab.condition(decide(started(), []), started())[:2] == ("False", ab.REASON_AT_PLANNED)


# --- the handler over an in-memory API -------------------------------------------------------------------
GS_NAME = "llama3-8b-decode"
SVC = "llama3-8b"
HEAD = "llama3-8b-decode-g-s0-0"


@dataclass
class FakeRouters:
    """Routers' answers by router pod name: what each proposes for the head pod."""

    docs: dict[str, dict[str, Any]]

    def fetch(self, pods: Any) -> list[tuple[str, dict[str, Any]]]:
        return list(self.docs.items())

    def propose(self, current: int, proposed: int) -> None:
        self.docs = {
            "r0": {"batch": [{"pod": HEAD, "current": current, "proposed": proposed, "reason": "ITL"}]}
        }


@pytest.fixture
def world() -> FakeKubeApi:
    """A decode GearSet with one 1-stage gear ``g`` (maxBatch 64) serving, one head pod, one router pod."""
    a = new_api()
    put_fleet(a)
    a.put(_example("pdservice-llama3-8b.yaml"), NS)
    stage = {"layers": [0, 32], "nodeSelector": {names.NODE_GPU_MODEL: "A10-24GB"}}
    a.put(
        {
            "apiVersion": "gearshift.io/v1alpha1",
            "kind": "GearSet",
            "metadata": {"name": GS_NAME},
            "spec": {
                "serviceName": SVC,
                "role": "decode",
                "mode": "explicit",
                "gears": [{"name": "g", "maxBatch": 64, "microBatch": 4, "stages": [stage]}],
            },
            "status": {"activeGear": "g", "phase": "Stable"},
        },
        NS,
    )
    for name, labels in (
        (HEAD, names.engine_labels(SVC, "decode", "g", 0)),
        ("llama3-8b-router-0", names.common_labels(SVC, names.COMPONENT_ROUTER)),
    ):
        a.put({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels}}, NS)
    return a


def status(api: FakeKubeApi) -> dict[str, Any]:
    return api.get("gearshift.io/v1alpha1", "GearSet", NS, GS_NAME)["status"]


def cap(api: FakeKubeApi) -> str | None:
    return (api.get("v1", "Pod", NS, HEAD)["metadata"].get("annotations") or {}).get(
        names.ANNOTATION_MAX_BATCH
    )


class TestHandler:
    def test_lowers_in_bounded_steps_records_and_annotates(self, world: FakeKubeApi) -> None:
        routers = FakeRouters({})
        res = h.tick(world.runtime, NS, GS_NAME, now=T0, source=routers)
        assert res.step is not None and res.step.kind == "Reset" and cap(world) == "64"
        routers.propose(64, 57)
        res = h.tick(world.runtime, NS, GS_NAME, now=T0 + 5, source=routers)
        assert res.step is not None and res.step.reason == ab.REASON_COOLDOWN and cap(world) == "64"
        res = h.tick(world.runtime, NS, GS_NAME, now=T0 + ab.COOLDOWN_S, source=routers)
        assert res.step is not None and res.step.kind == "Lower" and cap(world) == "57"
        st = status(world)["adaptiveBatch"]
        assert (st["planned"], st["effective"], st["floor"], st["lastDecision"]) == (64, 57, 16, "Lower")
        assert [(c["from"], c["to"], c["reason"]) for c in st["history"][1:]] == [(64, 57, "ItlOverTarget")]
        cond = next(c for c in status(world)["conditions"] if c["type"] == COND_BATCH_ADAPTED)
        assert (cond["status"], cond["reason"]) == ("True", "ItlOverTarget")
        assert [e["reason"] for e in world.events if e["reason"].startswith("MaxBatch")] == [
            "MaxBatchLowered"
        ]
        # The router has not read the new cap yet: its proposal from 64 does not count.
        res = h.tick(world.runtime, NS, GS_NAME, now=T0 + 2 * ab.COOLDOWN_S, source=routers)
        assert res.step is not None and res.step.reason == ab.REASON_STALE

    def test_with_no_router_answering_and_nothing_to_change_the_loop_idles(self, world: FakeKubeApi) -> None:
        silent = FakeRouters({})
        first = h.tick(world.runtime, NS, GS_NAME, now=T0, source=silent)
        assert not first.idle and cap(world) == "64"  # the new gear's caps are written first
        h.tick(world.runtime, NS, GS_NAME, now=T0 + 5, source=silent)  # says NoRouterDecisions once
        assert h.tick(world.runtime, NS, GS_NAME, now=T0 + 10, source=silent).idle
        answering = FakeRouters({"r0": {"batch": []}})  # a router that answers, proposing nothing
        assert not h.tick(world.runtime, NS, GS_NAME, now=T0 + 15, source=answering).idle

    def test_each_head_pod_gets_its_own_cap(self, world: FakeKubeApi) -> None:
        other = "llama3-8b-decode-g-s0-1"
        labels = names.engine_labels(SVC, "decode", "g", 0)
        world.put({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": other, "labels": labels}}, NS)
        routers = FakeRouters({})
        h.tick(world.runtime, NS, GS_NAME, now=T0, source=routers)
        routers.docs = {
            "r0": {
                "batch": [
                    {"pod": HEAD, "current": 64, "proposed": 57, "reason": "ITL P99 90 ms > 1.2 × 50 ms"},
                    {"pod": other, "current": 64, "proposed": 64, "reason": "within band"},
                ]
            }
        }
        res = h.tick(world.runtime, NS, GS_NAME, now=T0 + ab.COOLDOWN_S, source=routers)
        assert res.step is not None and sorted(res.annotated) == [HEAD]
        annotations = {
            n: world.get("v1", "Pod", NS, n)["metadata"]["annotations"][names.ANNOTATION_MAX_BATCH]
            for n in (HEAD, other)
        }
        assert annotations == {HEAD: "57", other: "64"}
        st = status(world)["adaptiveBatch"]
        assert [(p["pod"], p["effective"]) for p in st["pods"]] == [(HEAD, 57), (other, 64)]
        assert st["effective"] == 57 and st["history"][-1]["pod"] == HEAD
        cond = next(c for c in status(world)["conditions"] if c["type"] == COND_BATCH_ADAPTED)
        assert "1 of 2 head pods" in cond["message"]

    def test_nothing_changes_during_a_shift(self, world: FakeKubeApi) -> None:
        routers = FakeRouters({})
        h.tick(world.runtime, NS, GS_NAME, now=T0, source=routers)
        world.patch_status(
            "gearshift.io/v1alpha1",
            "GearSet",
            NS,
            GS_NAME,
            {"executor": {"step": "Draining", "toGear": "g2"}},
        )
        routers.propose(64, 57)
        res = h.tick(world.runtime, NS, GS_NAME, now=T0 + 100, source=routers)
        assert res.step is not None and res.step.reason == ab.REASON_SHIFT and res.annotated == []
        assert cap(world) == "64" and status(world)["adaptiveBatch"]["effective"] == 64

    def test_off_removes_the_caps(self, world: FakeKubeApi) -> None:
        h.tick(world.runtime, NS, GS_NAME, now=T0, source=FakeRouters({}))
        world.patch(
            "gearshift.io/v1alpha1",
            "GearSet",
            NS,
            GS_NAME,
            {"metadata": {"annotations": {names.ANNOTATION_ADAPTIVE_BATCH: "off"}}},
        )
        h.tick(world.runtime, NS, GS_NAME, now=T0 + 100, source=FakeRouters({}))
        assert cap(world) is None and status(world)["adaptiveBatch"]["lastReason"] == ab.REASON_DISABLED

    def test_an_unknown_switch_value_is_ignored_with_a_warning_and_false_turns_it_off(
        self, world: FakeKubeApi
    ) -> None:
        h.tick(world.runtime, NS, GS_NAME, now=T0, source=FakeRouters({}))

        def annotate(value: str) -> None:
            world.patch(
                "gearshift.io/v1alpha1",
                "GearSet",
                NS,
                GS_NAME,
                {"metadata": {"annotations": {names.ANNOTATION_ADAPTIVE_BATCH: value}}},
            )

        annotate("maybe")
        for k in range(3):
            h.tick(world.runtime, NS, GS_NAME, now=T0 + 5 * (k + 1), source=FakeRouters({}))
        assert cap(world) == "64"  # still on
        cond = next(c for c in status(world)["conditions"] if c["type"] == COND_BATCH_ADAPTED)
        assert cond["reason"] == ab.REASON_BAD_SWITCH and "'maybe', not one of on, off" in cond["message"]
        warnings = [e for e in world.events if e["reason"] == ab.REASON_BAD_SWITCH]
        assert len(warnings) == 1 and warnings[0]["type"] == "Warning"  # once, not every tick
        annotate("False")
        h.tick(world.runtime, NS, GS_NAME, now=T0 + 100, source=FakeRouters({}))
        assert cap(world) is None and status(world)["adaptiveBatch"]["lastReason"] == ab.REASON_DISABLED
        assert ab.switch(None) == (True, None) and ab.switch(" ON ") == (True, None)

    def test_only_gearsets_that_decode_run_the_loop(self) -> None:
        assert h._decode(body={"spec": {"role": "decode"}})  # type: ignore[arg-type]
        assert h._decode(body={"spec": {"role": "both"}})  # type: ignore[arg-type]  # aggregated
        assert not h._decode(body={"spec": {"role": "prefill"}})  # type: ignore[arg-type]

    async def test_the_daemon_ticks(self, world: FakeKubeApi) -> None:
        body = world.get("gearshift.io/v1alpha1", "GearSet", NS, GS_NAME)
        await h.gearset_adaptive_batch(
            namespace=NS, name=GS_NAME, body=body, stopped=OneTurn(), memo=kopf.Memo(runtime=world.runtime)
        )  # type: ignore[arg-type]
        assert status(world)["adaptiveBatch"]["effective"] == 64


# --- the router's side -----------------------------------------------------------------------------------
class TestMembership:
    def test_the_annotation_becomes_the_pods_cap_and_the_pipeline_its_max_batch(self) -> None:
        pods = [
            {"metadata": {"name": "a", "annotations": {names.ANNOTATION_MAX_BATCH: "12"}}},
            {"metadata": {"name": "b", "annotations": {names.ANNOTATION_MAX_BATCH: "zero"}}},
            {"metadata": {"name": "c", "annotations": {names.ANNOTATION_MAX_BATCH: "0"}}},
            {"metadata": {"name": "d"}},
        ]
        assert batch_caps(pods) == {"a": 12}
        infos = [BackendInfo(n, f"http://127.0.0.1:{i}", "decode") for i, n in enumerate("ad", 9000)]
        assert [b.batch_cap for b in with_caps(infos, batch_caps(pods))] == [12, None]
        sl = {
            "metadata": {"labels": {"kubernetes.io/service-name": "svc-decode"}},
            "ports": [{"name": "http", "port": 8000}],
            "endpoints": [{"addresses": ["127.0.0.2"], "targetRef": {"name": "a"}}],
        }
        env = {
            "a": {
                "GEARSHIFT_PIPELINE": '{"stages": [{"layers": [0, 32], "gpu": "A10-24GB"}], "maxBatch": 48}'
            }
        }
        (info,) = infos_from_slices([sl], {"svc-decode": "decode"}, {}, env)
        assert info.max_batch == 48


@dataclass
class CountingEngine(FakeEngine):
    """A fake engine that counts the decode legs it serves at once."""

    now: int = 0
    most: int = 0

    async def completions(self, request: Any) -> Any:
        self.now += 1
        self.most = max(self.most, self.now)
        try:
            return await super().completions(request)
        finally:
            self.now -= 1


async def test_the_router_holds_requests_beyond_a_pods_cap(make_router: Factory) -> None:  # noqa: F811
    dec = CountingEngine("d0", delay_s=0.15)
    client, router, _ = await make_router(
        {"p0": ("prefill", FakeEngine("p0")), "d0": ("decode", dec)}, proxy=ProxyConfig(queue_timeout_s=10)
    )
    router.pool.set_members([replace(b.info, batch_cap=2) for b in router.pool.backends.values()])
    body = {**COMPLETION, "stream": False}
    body.pop("stream_options")
    answers = await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(6)))
    assert [a.status for a in answers] == [200] * 6
    assert dec.most == 2 and router.pool.backends["d0"].held == 0
    assert len(dec.requests) == 6
    # The balance round steps from the cap, under the engine's own max batch.
    (d,) = [b for b in balance_round(router.pool, 0.0, 50.0).batch if b.pod == "d0"]
    assert d.current == 2


async def test_a_request_that_finds_no_room_in_time_is_refused(make_router: Factory) -> None:  # noqa: F811
    dec = CountingEngine("b0", delay_s=0.5)
    client, router, _ = await make_router({"b0": ("both", dec)}, proxy=ProxyConfig(queue_timeout_s=0.1))
    router.pool.set_members([replace(b.info, batch_cap=1) for b in router.pool.backends.values()])
    body = {"model": "m", "prompt": "hi", "max_tokens": 3}
    answers = await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(2)))
    assert sorted(a.status for a in answers) == [200, 503]
    assert dec.most == 1
    (err,) = [await a.json() for a in answers if a.status == 503]
    assert "max batch" in err["error"]["message"]


def test_with_signals_from_prometheus_the_round_reads_its_itl_p99() -> None:
    # The router of a PDService reads Prometheus when the operator knows one (the sandbox, a cluster):
    # without this quantile every proposal said "no ITL samples" and the operator never stepped.
    from gearshift.router.pool import PolicyConfig, Pool
    from gearshift.router.signals import PrometheusSource

    pool = Pool(PolicyConfig())
    pool.set_members([BackendInfo("d-0", "http://127.0.0.1:1", "decode", max_batch=16, batch_cap=16)])

    def query(qs: list[str]) -> dict[str, list[dict[str, Any]]]:
        row = {"metric": {"pod": "d-0"}, "value": [0, "0.08"]}
        return {q: [row] if "inter_token_latency_seconds_bucket" in q else [] for q in qs}

    PrometheusSource(pool, "http://127.0.0.1:9", query=query).poll()
    (d,) = balance_round(pool, 0.0, 50.0).batch
    assert (d.current, d.proposed) == (16, 14) and "ITL P99 80.0 ms" in d.reason
    (d,) = balance_round(pool, 5.0, 50.0).batch  # taken once: no fresh quantile, no samples
    assert d.proposed == 16 and d.reason == "no ITL samples"
