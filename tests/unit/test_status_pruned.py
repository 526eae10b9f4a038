"""Write-back: a status field the API server dropped (an older CRD) is found and reported."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from gearshift.adapters import memory
from gearshift.api.crdcheck import UPGRADE_HINT, pruned_paths
from gearshift.handlers import common
from gearshift.testing.kube import FakeKubeApi


class TestPrunedPaths:
    def test_nothing_lost(self):
        written = {"phase": "Ready", "executor": {"state": "Warming", "since": "t"}}
        assert pruned_paths(written, dict(written)) == []

    def test_a_missing_top_level_and_nested_field(self):
        written = {"phase": "Ready", "executor": {"state": "Warming"}, "signals": {"p99Ms": 3.0, "qps": 1.0}}
        stored = {"phase": "Ready", "signals": {"qps": 1.0}}
        assert pruned_paths(written, stored) == ["status.executor", "status.signals.p99Ms"]

    def test_deletions_and_changed_scalars_are_not_pruning(self):
        # None deletes in a merge patch; a scalar another writer changed since is no pruning either.
        assert pruned_paths({"executor": None, "phase": "Ready"}, {"phase": "Degraded"}) == []

    def test_list_elements_compared_one_by_one(self):
        written = {"gearHealth": [{"gear": "a", "gearHash": "h1"}, {"gear": "b", "gearHash": "h2"}]}
        stored = {"gearHealth": [{"gear": "a"}, {"gear": "b"}]}
        assert pruned_paths(written, stored) == [
            "status.gearHealth[0].gearHash",
            "status.gearHealth[1].gearHash",
        ]

    def test_no_stored_status(self):
        assert pruned_paths({"phase": "Ready"}, None) == ["status.phase"]


class PruningApi(FakeKubeApi):
    """The in-memory API holding the GearSet ``ns/g``, whose status the API server stores as an older CRD
    would: without ``executor`` (the server prunes what the CRD's schema lacks, a property of that CRD,
    hence a subclass); every status patch is recorded as sent."""

    def __init__(self) -> None:
        super().__init__()
        self.put(
            {"apiVersion": "gearshift.io/v1alpha1", "kind": "GearSet",
             "metadata": {"name": "g", "namespace": "ns", "uid": "u1", "generation": 3}, "status": {}}
        )  # fmt: skip
        self.patches: list[dict[str, Any]] = []

    @property
    def obj(self) -> dict[str, Any]:
        """The stored GearSet."""
        return self.store[("GearSet", "ns", "g")]

    def patch_status(
        self, api_version: str, kind: str, namespace: str | None, name: str, status: Mapping[str, Any]
    ) -> dict[str, Any]:
        self.patches.append(dict(status))
        kept = {k: v for k, v in status.items() if k != "executor"}
        return super().patch_status(api_version, kind, namespace, name, kept)


def test_a_pruned_write_raises_with_one_event_and_the_condition():
    api, reported = PruningApi(), memory.PrunedReports()
    with pytest.raises(common.StatusPruned) as exc:
        common.patch_status(
            api, "gearshift.io/v1alpha1", "GearSet", "ns", "g", {"executor": {"state": "Warming"}}, reported
        )
    assert "status.executor" in str(exc.value) and UPGRADE_HINT in str(exc.value)
    (event,) = api.events
    assert (event["type"], event["reason"]) == ("Warning", "FieldsPruned")
    (cond,) = api.obj["status"]["conditions"]
    assert (cond["type"], cond["status"], cond["reason"]) == ("CRDCurrent", "False", "FieldsPruned")
    assert cond["observedGeneration"] == 3
    # Every tick still refuses to go on, but the event and the condition are not repeated.
    with pytest.raises(common.StatusPruned):
        common.patch_status(
            api, "gearshift.io/v1alpha1", "GearSet", "ns", "g", {"executor": {"state": "Warming"}}, reported
        )
    assert len(api.events) == 1 and len(api.patches) == 3
    assert reported.known("u1")
    # Once the object is forgotten (deleted), a pruned write of its successor's uid reports again.
    reported.forget("u1")
    assert not reported.known("u1")
    with pytest.raises(common.StatusPruned):
        common.patch_status(
            api, "gearshift.io/v1alpha1", "GearSet", "ns", "g", {"executor": {"state": "Warming"}}, reported
        )
    assert len(api.events) == 2


def test_without_a_memory_every_pruned_write_reports():
    # The e2e test (and any caller outside the operator) passes no PrunedReports.
    api = PruningApi()
    for _ in range(2):
        with pytest.raises(common.StatusPruned):
            common.patch_status(api, "gearshift.io/v1alpha1", "GearSet", "ns", "g", {"executor": {}})
    assert [e["reason"] for e in api.events] == ["FieldsPruned", "FieldsPruned"]


def test_a_kept_write_returns_the_stored_object():
    api, reported = PruningApi(), memory.PrunedReports()
    stored = common.patch_status(
        api, "gearshift.io/v1alpha1", "GearSet", "ns", "g", {"phase": "Ready"}, reported
    )
    assert stored["status"]["phase"] == "Ready" and not api.events and not reported.known("u1")
