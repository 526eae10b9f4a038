"""A CRD replaced under the running operator. The pure parts (gearshift.api.crdcheck's
sightings, changes and prunable paths), the held status writes (handlers.common.patch_status) and the
poller's decisions (handlers.crdwatch.poll) on the in-memory API, with values worked out by hand."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from datetime import UTC, datetime
from typing import Any

import pytest

from gearshift.adapters import memory
from gearshift.api import crdcheck, crdgen
from gearshift.control.reconcile.settings import Settings
from gearshift.handlers import common, crdwatch, loop
from gearshift.testing.kube import FakeKubeApi

G = "gearshift.io/v1alpha1"
CRD = ("apiextensions.k8s.io/v1", "CustomResourceDefinition")
GEARSETS = next(k for k in crdgen.KINDS if k.kind == "GearSet")
PDSERVICES = next(k for k in crdgen.KINDS if k.kind == "PDService")
NOW = datetime(2026, 12, 6, 1, 0, tzinfo=UTC)


def older(kind: crdgen.Kind = GEARSETS, drop: str = "executor") -> dict[str, Any]:
    """This release's CRD of ``kind`` without ``status.<drop>`` (what an older chart's crds/ holds)."""
    crd = crdgen.crd(kind)
    del crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"][drop]
    return crd


def schema_of(crd: dict[str, Any]) -> dict[str, Any]:
    return dict(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


# --- gearshift.api.crdcheck ------------------------------------------------------------------------------
def test_crd_gaps_is_the_start_up_checks_per_kind() -> None:
    assert crdcheck.crd_gaps(GEARSETS, crdgen.crd(GEARSETS)) == []
    assert crdcheck.crd_gaps(GEARSETS, older()) == ["status.executor"]
    assert crdcheck.crd_gaps(GEARSETS, None) == ["(not installed)"]
    unserved = crdgen.crd(GEARSETS)
    unserved["spec"]["versions"][0]["name"] = "v1beta9"
    assert crdcheck.crd_gaps(GEARSETS, unserved) == ["(no version v1alpha1)"]


def test_schema_hash_is_sha256_of_canonical_json() -> None:
    schema = {"b": 1, "a": {"y": [1, 2], "x": "s"}}
    # Written out by hand: keys sorted at every level, no spaces.
    canonical = '{"a":{"x":"s","y":[1,2]},"b":1}'
    assert crdcheck.schema_hash(schema) == hashlib.sha256(canonical.encode()).hexdigest()[:16]
    assert crdcheck.schema_hash({"a": {"x": "s", "y": [1, 2]}, "b": 1}) == crdcheck.schema_hash(schema)
    assert crdcheck.schema_hash(None) is None


def test_seen_crd_keeps_resource_version_hash_and_gaps() -> None:
    crd = older()
    crd["metadata"]["resourceVersion"] = "532"
    seen = crdcheck.seen_crd(GEARSETS, crd)
    want_hash = hashlib.sha256(
        json.dumps(schema_of(crd), sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()[:16]
    assert seen == crdcheck.SeenCRD("gearsets.gearshift.io", "532", want_hash, ("status.executor",))
    assert not seen.current
    gone = crdcheck.seen_crd(GEARSETS, None)
    assert gone == crdcheck.SeenCRD("gearsets.gearshift.io", None, None, ("(not installed)",))


def test_crd_change_decisions() -> None:
    cur = crdcheck.SeenCRD("x", "10", "aaaa", ())
    cur_status_written = crdcheck.SeenCRD("x", "11", "aaaa", ())  # only the CRD's status moved
    old = crdcheck.SeenCRD("x", "12", "bbbb", ("status.executor",))
    older_still = crdcheck.SeenCRD("x", "13", "cccc", ("status.executor", "status.phase"))
    newer = crdcheck.SeenCRD("x", "14", "dddd", ())
    assert crdcheck.crd_change(None, cur) == "current"  # first sighting: sweep leftovers
    assert crdcheck.crd_change(None, old) == "outdated"
    assert crdcheck.crd_change(cur, cur_status_written) is None
    assert crdcheck.crd_change(cur, old) == "outdated"
    assert crdcheck.crd_change(old, old) is None  # the same episode goes on
    assert crdcheck.crd_change(old, older_still) == "outdated"  # another schema: a new episode
    assert crdcheck.crd_change(old, cur) == "current"
    assert crdcheck.crd_change(cur, newer) == "changed"


def test_prunable_paths_follow_structural_pruning() -> None:
    status_schema = {
        "type": "object",
        "properties": {
            "phase": {"type": "string"},
            "executor": {"type": "object", "properties": {"phase": {"type": "string"}}},
            "history": {"type": "array", "items": {"type": "object", "properties": {"a": {}}}},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
            "any": {"type": "object", "additionalProperties": True},
        },
    }
    written = {
        "phase": "Stable",
        "executor": {"phase": "Warming", "target": "a"},
        "history": [{"a": 1, "b": 2}, {"a": 3}],
        "labels": {"k": "v"},
        "free": {"z": {"deep": 1}},
        "any": {"q": 1},
        "gone": 1,
        "deleted": None,
    }
    assert crdcheck.prunable_paths(written, status_schema) == [
        "status.executor.target",
        "status.history[0].b",
        "status.gone",
    ]
    assert crdcheck.prunable_paths({"phase": "x"}, status_schema) == []
    assert crdcheck.prunable_paths({"a": {"b": 1}}, {}) == ["status.a"]


def test_prunable_paths_on_the_real_older_gearset_schema_match_what_the_server_prunes() -> None:
    held = crdcheck.status_schema(schema_of(older()))
    assert held is not None
    write = {"phase": "Warming", "executor": {"step": "Warming", "toGear": "a"}, "activeGear": "b"}
    assert crdcheck.prunable_paths(write, held) == ["status.executor"]
    # What the API server stores of that write (executor dropped) gives pruned_paths the same answer.
    stored = {k: v for k, v in write.items() if k != "executor"}
    assert crdcheck.pruned_paths(write, stored) == ["status.executor"]
    current = crdcheck.status_schema(schema_of(crdgen.crd(GEARSETS)))
    assert current is not None and crdcheck.prunable_paths(write, current) == []
    assert crdcheck.status_schema({"properties": {}}) == {}


# --- handlers.common.patch_status while a CRD is held -----------------------------------------------------
def gearset(name: str, uid: str, conditions: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": G,
        "kind": "GearSet",
        "metadata": {"name": name, "namespace": "ns", "uid": uid, "generation": 2},
        "spec": {"serviceName": "s", "role": "both"},
    }
    if conditions is not None:
        body["status"] = {"conditions": conditions}
    return body


def test_a_write_the_held_schema_would_prune_is_not_sent() -> None:
    api = FakeKubeApi()
    api.put(gearset("g", "u1"))
    reported = memory.PrunedReports()
    schema = crdcheck.status_schema(schema_of(older()))
    assert schema is not None
    reported.hold("GearSet", memory.HeldKind(schema, "the installed CRD is older; Fix: apply"))
    with pytest.raises(common.StatusHeld) as exc:
        common.patch_status(
            api, G, "GearSet", "ns", "g", {"phase": "Warming", "executor": {"a": 1}}, reported
        )
    assert isinstance(exc.value, common.StatusPruned)
    assert "would lose status.executor" in str(exc.value) and "Fix: apply" in str(exc.value)
    assert ("patch_status", "GearSet") not in api.verbs()  # nothing half-written
    assert "status" not in api.get(G, "GearSet", "ns", "g")  # type: ignore[operator]
    # A write the installed schema keeps whole goes through; other kinds are not held.
    stored = common.patch_status(api, G, "GearSet", "ns", "g", {"phase": "Stable"}, reported)
    assert stored["status"] == {"phase": "Stable"}
    assert reported.held("PDService") is None
    reported.hold("GearSet", None)
    stored = common.patch_status(api, G, "GearSet", "ns", "g", {"executor": {"a": 1}}, reported)
    assert stored["status"]["executor"] == {"a": 1}


def test_a_pruned_write_wakes_the_poller() -> None:
    reported, woken = memory.PrunedReports(), []

    class Pruning(FakeKubeApi):
        def patch_status(self, *args: Any) -> dict[str, Any]:
            *head, status = args
            return super().patch_status(*head, {k: v for k, v in status.items() if k != "executor"})

    api = Pruning()
    api.put(gearset("g", "u1"))
    reported.on_suspect(lambda: woken.append(1))
    with pytest.raises(common.StatusPruned):
        common.patch_status(api, G, "GearSet", "ns", "g", {"executor": {"a": 1}}, reported)
    assert woken == [1]
    common.patch_status(api, G, "GearSet", "ns", "g", {"phase": "x"}, reported)
    assert woken == [1]  # a kept write does not


# --- handlers.crdwatch -------------------------------------------------------------------------------------
def cluster(settings: Settings | None = None) -> FakeKubeApi:
    api = FakeKubeApi(settings=settings)
    for kind in crdgen.KINDS:
        api.put(crdgen.crd(kind))
    return api


def crd_current(api: FakeKubeApi, ns: str, name: str, kind: str = "GearSet") -> dict[str, Any]:
    body = api.get(G, kind, ns, name) or {}
    return next(
        (c for c in (body.get("status") or {}).get("conditions") or [] if c["type"] == "CRDCurrent"), {}
    )


def warnings(api: FakeKubeApi, reason: str) -> list[str]:
    return [
        e["involvedObject"]["name"] for e in api.events if e["reason"] == reason and e["type"] == "Warning"
    ]


def test_an_episode_marks_every_object_once_holds_writes_and_recovers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    api = cluster()
    api.put(gearset("a", "ua"))
    api.put(gearset("b", "ub", [{"type": "Ready", "status": "True", "reason": "AllReady", "message": "m"}]))
    rt, state = api.runtime, crdwatch.PollState()
    crdwatch.poll(rt, state, NOW)
    # Current CRDs at the first poll: nothing to mark, nothing held, no event.
    assert not api.events and crd_current(api, "ns", "a") == {} and rt.pruned.held("GearSet") is None

    old = older()
    api.put(old)
    rv = api.get(*CRD, None, "gearsets.gearshift.io")["metadata"]["resourceVersion"]  # type: ignore[index]
    with caplog.at_level(logging.INFO, logger="gearshift.crdwatch"):
        crdwatch.poll(rt, state, NOW)
        crdwatch.poll(rt, state, NOW)  # the same episode: no second event, no second ERROR line
    for name in ("a", "b"):
        c = crd_current(api, "ns", name)
        assert (c["status"], c["reason"], c["observedGeneration"]) == ("False", "CRDOutdated", 2)
        assert f"gearsets.gearshift.io (resourceVersion {rv})" in c["message"]
        assert "it lacks status.executor" in c["message"] and crdcheck.UPGRADE_HINT in c["message"]
    # Other conditions are kept.
    assert [c["type"] for c in api.get(G, "GearSet", "ns", "b")["status"]["conditions"]] == [
        "Ready",
        "CRDCurrent",
    ]  # type: ignore[index]
    assert sorted(warnings(api, "CRDOutdated")) == ["a", "b"]
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "gearsets.gearshift.io" in errors[0].getMessage()
    assert "status.executor" in errors[0].getMessage()
    held = rt.pruned.held("GearSet")
    assert held is not None and "executor" not in held.status_schema["properties"]
    assert rt.pruned.held("PDService") is None

    # An object created during the episode is marked at the next poll; another writer's overwrite of the
    # condition is put back without a second event.
    api.put(gearset("c", "uc"))
    api.patch_status(G, "GearSet", "ns", "a", {"conditions": []})
    crdwatch.poll(rt, state, NOW)
    assert (
        crd_current(api, "ns", "c")["status"] == "False" and crd_current(api, "ns", "a")["status"] == "False"
    )
    assert sorted(warnings(api, "CRDOutdated")) == ["a", "b", "c"]

    # The fix: every marked object says True (Normal events), and writes are no longer held.
    api.put(crdgen.crd(GEARSETS))
    crdwatch.poll(rt, state, NOW)
    for name in ("a", "b", "c"):
        c = crd_current(api, "ns", name)
        assert (c["status"], c["reason"]) == ("True", "CRDUpToDate")
    normal = [e for e in api.events if e["reason"] == "CRDUpToDate"]
    assert sorted(e["involvedObject"]["name"] for e in normal) == ["a", "b", "c"]
    assert all(e["type"] == "Normal" for e in normal)
    assert rt.pruned.held("GearSet") is None

    # A later episode with the same older schema warns again.
    api.put(old)
    crdwatch.poll(rt, state, NOW)
    assert sorted(warnings(api, "CRDOutdated")) == ["a", "a", "b", "b", "c", "c"]


def test_first_poll_clears_a_left_over_false_and_leaves_unmarked_objects_alone() -> None:
    api = cluster()
    left = {"type": "CRDCurrent", "status": "False", "reason": "FieldsPruned", "message": "m",
            "lastTransitionTime": "2026-12-05T00:00:00Z"}  # fmt: skip
    api.put(gearset("old", "u1", [left]))
    api.put(gearset("plain", "u2"))
    crdwatch.poll(api.runtime, crdwatch.PollState(), NOW)
    assert crd_current(api, "ns", "old")["status"] == "True"
    assert crd_current(api, "ns", "plain") == {}
    assert ("patch_status", "GearSet") in api.verbs() and len(api.events) == 1


def test_only_served_namespaces_are_marked() -> None:
    api = cluster(Settings(namespaces=("llm",), profiles=False))
    for ns in ("llm", "other"):
        body = gearset("g", f"u-{ns}")
        body["metadata"]["namespace"] = ns
        api.put(body)
    api.put(older())
    crdwatch.poll(api.runtime, crdwatch.PollState(), NOW)
    assert crd_current(api, "llm", "g")["status"] == "False"
    assert crd_current(api, "other", "g") == {}
    assert ("list", "GPUProfile") not in api.verbs()
    assert crdwatch.served("team-a", ("team-*",)) and not crdwatch.served("ops", ("team-*",))
    assert crdwatch.served(None, ("team-*",)) and crdwatch.served("x", ())


def test_a_crd_without_conditions_in_its_schema_gets_events_only() -> None:
    api = cluster()
    api.put(gearset("g", "u1"))
    api.put(older(PDSERVICES, "conditions"))
    pds = {"apiVersion": G, "kind": "PDService", "metadata": {"name": "s", "namespace": "ns", "uid": "p1"}}
    api.put(pds)
    crdwatch.poll(api.runtime, crdwatch.PollState(), NOW)
    assert warnings(api, "CRDOutdated") == ["s"]
    assert ("patch_status", "PDService") not in api.verbs()
    assert crdwatch.conditions_storable(crdcheck.SeenCRD("x", "1", "h", ("status.phase",)))
    assert not crdwatch.conditions_storable(crdcheck.SeenCRD("x", "1", "h", ("status.conditions",)))


def test_a_forbidden_crd_read_is_said_once_and_the_poll_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    from gearshift.adapters.kube import KubeApiError

    api = cluster()
    api.refuse[("get", "CustomResourceDefinition")] = KubeApiError("forbidden", 403)
    state = crdwatch.PollState()
    with caplog.at_level(logging.WARNING, logger="gearshift.crdwatch"):
        crdwatch.poll(api.runtime, state, NOW)
        crdwatch.poll(api.runtime, state, NOW)
    assert len([r for r in caplog.records if "cannot read CRD" in r.getMessage()]) == 1


def test_the_messages_cut_long_gap_lists() -> None:
    seen = crdcheck.SeenCRD("gearsets.gearshift.io", "7", "h", tuple(f"status.f{i}" for i in range(10)))
    msg = crdwatch.outdated_message(seen)
    assert (
        "status.f0, status.f1, status.f2, status.f3, status.f4, status.f5, status.f6, status.f7 and 2 more"
        in msg
    )
    assert "status.f8" not in msg


async def test_the_poller_polls_at_once_when_a_write_is_pruned() -> None:
    api = cluster()
    rt = api.runtime
    stop = asyncio.Event()
    task = asyncio.create_task(crdwatch.watch_crds(rt, stop, interval_s=60.0))
    for _ in range(100):
        await asyncio.sleep(0.01)
        if api.verbs().count(("get", "CustomResourceDefinition")) == 3:
            break
    assert api.verbs().count(("get", "CustomResourceDefinition")) == 3
    rt.pruned.suspect()  # as a pruned write does, from a handler's thread
    for _ in range(100):
        await asyncio.sleep(0.01)
        if api.verbs().count(("get", "CustomResourceDefinition")) == 6:
            break
    assert api.verbs().count(("get", "CustomResourceDefinition")) == 6  # well before the 60 s interval
    stop.set()
    rt.pruned.suspect()
    await asyncio.wait_for(task, 5)


async def test_a_held_tick_logs_one_warning_line_without_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Stopped:
        def __init__(self) -> None:
            self.turns = 0

        def __bool__(self) -> bool:
            self.turns += 1
            return self.turns > 1

        async def wait(self, _: float) -> None:
            return None

    def tick(_ns: str, _name: str) -> None:
        raise common.StatusHeld("status write of GearSet ns/g held (it would lose status.executor)")

    with caplog.at_level(logging.WARNING, logger="gearshift.loop"):
        await loop.every_sample_interval(
            "ns",
            "g",
            {},
            Stopped(),
            tick,
            what="shifting tick",
            floor_s=0.0,
            expected=(),  # type: ignore[arg-type]
        )
    (record,) = [r for r in caplog.records if "held" in r.getMessage()]
    assert record.levelno == logging.WARNING and record.exc_info is None
