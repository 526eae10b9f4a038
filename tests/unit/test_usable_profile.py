"""usable_profile: a stored GPUProfile version is worked out once, and a new version, or a body the API
server did not store, is worked out afresh."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from test_handlers_reconcile import fleet_nodes

from gearshift.planner import inputs
from gearshift.planner.inputs import datasheet_gpuprofile, usable_profile


def _stored(uid: str, rv: str) -> dict[str, Any]:
    body = datasheet_gpuprofile(fleet_nodes()[0])
    body["metadata"] = {**body.get("metadata", {}), "uid": uid, "resourceVersion": rv}
    return body


@pytest.fixture
def validations(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    inputs._usable_stored.cache_clear()
    seen: list[str] = []
    real = inputs._usable

    def counting(body: Any) -> Any:
        seen.append(str((body.get("metadata") or {}).get("resourceVersion")))
        return real(body)

    monkeypatch.setattr(inputs, "_usable", counting)
    return seen


def test_one_stored_version_is_worked_out_once(validations: list[str]) -> None:
    body = _stored("u1", "10")
    first = usable_profile(body)
    assert first is not None and first.gpu_model
    assert usable_profile(copy.deepcopy(body)) is first  # the same stored version, read again
    assert validations == ["10"]


def test_a_new_version_is_worked_out_afresh(validations: list[str]) -> None:
    old = _stored("u1", "10")
    usable_profile(old)
    new = copy.deepcopy(old)
    new["metadata"]["resourceVersion"] = "11"
    new["status"]["phase"] = "Stale"
    assert usable_profile(old) is not None and usable_profile(new) is None
    assert validations == ["10", "11"]


def test_a_body_without_uid_or_version_is_not_kept(validations: list[str]) -> None:
    body = datasheet_gpuprofile(fleet_nodes()[0])
    body["metadata"].pop("resourceVersion", None)
    usable_profile(body)
    usable_profile(body)
    assert len(validations) == 2
