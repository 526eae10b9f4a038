"""`gearshift operator --priority` and the kopf peering objects the operator creates (no cluster)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from gearshift import operator_main
from gearshift.operator_main import RANDOM_PRIORITY_MAX, ensure_peering, priority_arg


class TestPriority:
    def test_integers_pass_through(self):
        assert priority_arg("100") == 100
        assert priority_arg("-3") == -3

    def test_random_is_in_range_and_varies(self):
        drawn = {priority_arg("random") for _ in range(50)}
        assert all(1 <= p <= RANDOM_PRIORITY_MAX for p in drawn)
        assert len(drawn) > 45  # identical replicas must not share a priority

    def test_other_text_is_refused_naming_the_flag(self):
        with pytest.raises(argparse.ArgumentTypeError, match="--priority 'high'"):
            priority_arg("high")


class FakeCustomObjects:
    """Records creations; objects listed in ``existing`` answer 409 like the API server."""

    def __init__(self, existing: set[str]) -> None:
        self.existing = existing
        self.calls: list[tuple[str, ...]] = []

    def create_namespaced_custom_object(
        self, group: str, version: str, ns: str, plural: str, body: Any
    ) -> None:
        self.calls.append((group, version, ns, plural, body["kind"], body["metadata"]["name"]))
        if f"{ns}/{body['metadata']['name']}" in self.existing:
            raise ApiException(status=409, reason="AlreadyExists")

    def create_cluster_custom_object(self, group: str, version: str, plural: str, body: Any) -> None:
        self.calls.append((group, version, plural, body["kind"], body["metadata"]["name"]))
        if status := (403 if "forbidden" in self.existing else 0):
            raise ApiException(status=status, reason="Forbidden")


class TestEnsurePeering:
    def test_one_kopfpeering_per_watched_namespace(self, monkeypatch):
        fake = FakeCustomObjects({"b/gs"})
        monkeypatch.setattr("kubernetes.client.CustomObjectsApi", lambda _client: fake)
        assert ensure_peering(object(), "gs", ["a", "b"]) == ["a/gs"]
        assert fake.calls == [
            ("kopf.dev", "v1", "a", "kopfpeerings", "KopfPeering", "gs"),
            ("kopf.dev", "v1", "b", "kopfpeerings", "KopfPeering", "gs"),
        ]

    def test_cluster_wide_gets_a_clusterkopfpeering(self, monkeypatch):
        fake = FakeCustomObjects(set())
        monkeypatch.setattr("kubernetes.client.CustomObjectsApi", lambda _client: fake)
        assert ensure_peering(object(), "gs", []) == ["gs"]
        assert fake.calls == [("kopf.dev", "v1", "clusterkopfpeerings", "ClusterKopfPeering", "gs")]

    def test_other_refusals_propagate(self, monkeypatch):
        monkeypatch.setattr(
            "kubernetes.client.CustomObjectsApi", lambda _client: FakeCustomObjects({"forbidden"})
        )
        with pytest.raises(ApiException):
            ensure_peering(object(), "gs", [])

    def test_group_matches_the_chart(self):
        assert (operator_main.PEERING_GROUP, operator_main.PEERING_VERSION) == ("kopf.dev", "v1")
