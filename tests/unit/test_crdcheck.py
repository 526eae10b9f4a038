"""gearshift.api.crdcheck on the operator's own CRDs with fields taken out (what `helm upgrade` leaves)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from gearshift.adapters.kube import KubeApiError
from gearshift.api import crdcheck, crdgen
from gearshift.handlers.crds import StaleCRDs, check_installed_crds


def current() -> dict[str, dict[str, Any]]:
    return {k.name: crdgen.crd(k) for k in crdgen.KINDS}


def schema(crd: dict[str, Any]) -> dict[str, Any]:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_current_crds_have_no_gap() -> None:
    assert crdcheck.stale_crds(current()) == {}


def test_a_status_field_taken_out_is_named_with_its_path() -> None:
    crds = current()
    status = schema(crds["gearsets.gearshift.io"])["properties"]["status"]["properties"]
    assert "executor" in status, sorted(status)
    del status["executor"]
    gaps = crdcheck.stale_crds(crds)
    assert list(gaps) == ["gearsets.gearshift.io"]
    assert gaps["gearsets.gearshift.io"] == ["status.executor"]
    msg = crdcheck.stale_message(gaps)
    assert "gearsets.gearshift.io lacks status.executor" in msg and "kubectl apply --server-side" in msg


def test_an_enum_value_the_operator_writes_is_checked() -> None:
    crds = current()
    status = schema(crds["gearsets.gearshift.io"])["properties"]["status"]["properties"]
    outcome = status["history"]["items"]["properties"]["outcome"]
    outcome["enum"] = [v for v in outcome["enum"] if v != "Aborted"]
    assert crdcheck.stale_crds(crds) == {
        "gearsets.gearshift.io": ["status.history[].outcome value 'Aborted'"]
    }


def test_nested_list_items_and_maps_are_descended() -> None:
    items_want = {"type": "array", "items": {"properties": {"b": {}, "c": {}}}}
    map_want = {"type": "object", "additionalProperties": {"properties": {"x": {}}}}
    want = {"properties": {"a": items_want, "m": map_want}}
    items_have = {"type": "array", "items": {"properties": {"b": {}}}}
    map_have = {"type": "object", "additionalProperties": {"properties": {}}}
    have = {"properties": {"a": items_have, "m": map_have}}
    assert crdcheck.schema_gaps(have, want) == ["a[].c", "m{}.x"]
    assert crdcheck.schema_gaps({"x-kubernetes-preserve-unknown-fields": True}, want) == []


def test_missing_crd_and_missing_version() -> None:
    crds: dict[str, Any] = current()
    crds["pdservices.gearshift.io"] = None
    old = copy.deepcopy(crds["gpuprofiles.gearshift.io"])
    old["spec"]["versions"][0]["name"] = "v1alpha0"
    crds["gpuprofiles.gearshift.io"] = old
    assert crdcheck.stale_crds(crds) == {
        "pdservices.gearshift.io": ["(not installed)"],
        "gpuprofiles.gearshift.io": ["(no version v1alpha1)"],
    }


class Api:
    def __init__(self, crds: dict[str, Any], status: int | None = None) -> None:
        self.crds, self.status = crds, status

    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        assert (api_version, kind, namespace) == ("apiextensions.k8s.io/v1", "CustomResourceDefinition", None)
        if self.status is not None:
            raise KubeApiError("forbidden", self.status)
        return self.crds.get(name)


def test_start_up_check_raises_on_stale_and_runs_on_without_rbac() -> None:
    crds = current()
    check_installed_crds(Api(crds))  # type: ignore[arg-type]
    del schema(crds["pdservices.gearshift.io"])["properties"]["status"]["properties"]["conditions"]
    with pytest.raises(StaleCRDs, match=r"pdservices\.gearshift\.io lacks status\.conditions"):
        check_installed_crds(Api(crds))  # type: ignore[arg-type]
    check_installed_crds(Api(crds, status=403))  # type: ignore[arg-type]
    with pytest.raises(KubeApiError):
        check_installed_crds(Api(crds, status=500))  # type: ignore[arg-type]
