"""Warm-up marks on a warming shadow's head pods (gearshift.k8s.warming) and the shifting tick that sets and
clears them (handlers/shifting.py ``_mark_warming``): the cap, the patches, and a whole forced shift over
the in-memory API in which the shadow's heads are marked while it warms, unmarked once it serves, and
never recreated."""

from __future__ import annotations

from typing import Any

import pytest
from test_shifting import GS_NAME, NS, T0, FakeSignals, _policy_patch, kubelet, run, selected, status, world

from gearshift.api.gearset import Gear
from gearshift.control.shifting.executor import Phase
from gearshift.k8s import names
from gearshift.k8s.names import format_mirror_rps
from gearshift.k8s.warming import gear_mirror_rps, head_pods_per_pipeline, warming_mark_patches
from gearshift.testing.kube import FakeKubeApi

__all__ = ["world"]  # the fixture, shared with test_shifting


def _gear(throughput: float | None, head_replicas: int = 1, stages: int = 2) -> Gear:
    doc: dict[str, Any] = {
        "name": "two",
        "stages": [
            {"layers": [k * 8, (k + 1) * 8], "replicas": head_replicas if k == 0 else 1}
            for k in range(stages)
        ],
    }
    if throughput is not None:
        doc["predicted"] = {"throughputQps": throughput}
    return Gear.model_validate(doc)


def test_cap_is_the_share_of_the_predicted_throughput_per_head_and_router() -> None:
    assert gear_mirror_rps(0.2, _gear(10.0)) == pytest.approx(2.0)
    assert gear_mirror_rps(0.2, _gear(10.0), router_replicas=2) == pytest.approx(1.0)
    # a hot head stage of 2 replicas: the pipeline's share split over its 2 heads
    assert gear_mirror_rps(0.2, _gear(10.0, head_replicas=2)) == pytest.approx(1.0)
    # vLLM runs one head per pipeline replica (it cannot replicate one stage)
    assert head_pods_per_pipeline(_gear(10.0, head_replicas=2), "vllm") == 1
    assert gear_mirror_rps(0.2, _gear(10.0, head_replicas=2), engine="vllm") == pytest.approx(2.0)


@pytest.mark.parametrize("gear", [None, _gear(None), _gear(0.0)])
def test_no_predicted_throughput_no_cap(gear: Gear | None) -> None:
    assert gear_mirror_rps(0.2, gear) == 0.0


def test_format_rps() -> None:
    assert (format_mirror_rps(2.0), format_mirror_rps(0.0), format_mirror_rps(1 / 3)) == (
        "2",
        "0",
        "0.333333",
    )


def _pod(
    name: str, gear: str, stage: int, labels: dict[str, str] | None = None, **ann: str
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "labels": names.engine_labels("svc", "prefill", gear, stage) | (labels or {}),
            "annotations": {k.replace("_", "/"): v for k, v in ann.items()},
        }
    }


WARM = {names.LABEL_WARMING: "true"}
CAP = names.ANNOTATION_MIRROR_RPS


def test_patches_mark_the_warming_heads_only_and_unmark_the_rest() -> None:
    marked = _pod("svc-prefill-one-s0-0", "one", 0, WARM)
    marked["metadata"]["annotations"] = {CAP: "2"}
    pods = [
        _pod("svc-prefill-two-s0-0", "two", 0),
        _pod("svc-prefill-two-s1-0", "two", 1),  # not a head: no HTTP
        marked,  # a gear that no longer warms
        _pod("svc-prefill-one-s1-0", "one", 1),
    ]
    got = dict(warming_mark_patches(pods, "two", 2.5))
    assert got == {
        "svc-prefill-two-s0-0": {"metadata": {"labels": WARM, "annotations": {CAP: "2.5"}}},
        "svc-prefill-one-s0-0": {
            "metadata": {"labels": {names.LABEL_WARMING: None}, "annotations": {CAP: None}}
        },
    }


def test_no_patch_for_pods_already_right_or_being_deleted() -> None:
    done = _pod("svc-prefill-two-s0-0", "two", 0, WARM)
    done["metadata"]["annotations"] = {CAP: "2.5"}
    going = _pod("svc-prefill-two-s0-1", "two", 0)
    going["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    plain = _pod("svc-prefill-one-s0-0", "one", 0)
    assert warming_mark_patches([done, going, plain], "two", 2.5) == []
    # a changed cap re-marks
    assert [n for n, _ in warming_mark_patches([done], "two", 1.0)] == ["svc-prefill-two-s0-0"]
    # no gear warms: the mark goes
    assert [n for n, _ in warming_mark_patches([done, plain], None, 0.0)] == ["svc-prefill-two-s0-0"]


def _heads(api: FakeKubeApi, gear: str) -> list[dict[str, Any]]:
    return api.list(
        "v1", "Pod", NS, {names.LABEL_ROLE: "prefill", names.LABEL_GEAR: gear, names.LABEL_STAGE: "0"}
    )


def _marked(api: FakeKubeApi) -> dict[str, str | None]:
    out = {}
    for p in api.list("v1", "Pod", NS, {names.LABEL_ROLE: "prefill"}):
        meta = p["metadata"]
        if names.LABEL_WARMING in (meta.get("labels") or {}):
            out[meta["name"]] = (meta.get("annotations") or {}).get(CAP)
    return out


def test_a_forced_shift_marks_the_shadow_heads_while_warming_and_unmarks_them_at_the_switch(
    world: FakeKubeApi,
) -> None:
    _policy_patch(world, warmS=6, rollbackWindowS=10, drainTimeoutS=30, warmupShare=0.25)
    key = world.key("GearSet", NS, GS_NAME)
    gs = world.store[key]
    latency = next(g for g in gs["spec"]["gears"] if g["name"] == "latency")
    latency["predicted"] = {"throughputQps": 16.0}
    gs["spec"]["forceGear"] = "latency"
    sig = FakeSignals()
    now = T0
    seen: dict[Phase, list[dict[str, str | None]]] = {}
    uids: dict[str, Any] = {}
    for _ in range(40):
        r = run(world, sig, now)
        assert r.phase is not None
        seen.setdefault(r.phase, []).append(_marked(world))
        for p in _heads(world, "latency"):
            uids.setdefault(p["metadata"]["name"], p["metadata"].get("uid"))
        kubelet(world, now)
        now += 2.0
        if r.phase is Phase.STABLE and status(world)["activeGear"] == "latency":
            break
    # 16 req/s × 0.25 over the latency gear's 2 head pods (its stage 0 runs 2 replicas), one router
    heads = {p["metadata"]["name"] for p in _heads(world, "latency")}
    assert len(heads) == 2
    assert {n: "2" for n in heads} in seen[Phase.WARMING]
    for phase in (Phase.DRAINING, Phase.SWITCHING, Phase.STABLE):
        assert all(m == {} for m in seen[phase]), (phase, seen[phase])
    assert selected(world) == "latency" and _marked(world) == {}
    # the same pods serve: the marks were patched on them, no pod was recreated
    assert {p["metadata"]["name"]: p["metadata"].get("uid") for p in _heads(world, "latency")} == uids
    sts = world.list("apps/v1", "StatefulSet", NS, {names.LABEL_GEAR: "latency"})
    assert all(names.LABEL_WARMING not in s["spec"]["template"]["metadata"]["labels"] for s in sts)
