"""k8s.applied: which owned objects a reconcile must apply again."""

from __future__ import annotations

import copy
from typing import Any

from gearshift.k8s.applied import applied, needs_apply


def _sts(image: str = "sim:1") -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": "s-prefill-g1-s0", "namespace": "ns"},
        "spec": {"replicas": 1, "template": {"spec": {"containers": [{"name": "e", "image": image}]}}},
    }


def _stored(manifest: dict[str, Any], generation: int, rv: str) -> dict[str, Any]:
    out = copy.deepcopy(manifest)
    out["metadata"] |= {"generation": generation, "resourceVersion": rv}
    return out


def _listed(obj: dict[str, Any]) -> dict[str, Any]:
    """An item of a LIST as the API server sends it: no apiVersion, no kind."""
    return {k: v for k, v in obj.items() if k not in ("apiVersion", "kind")}


def test_a_statefulsets_status_writes_do_not_call_for_an_apply() -> None:
    want = _sts()
    last = applied(want, _stored(want, 3, "100"))
    live = _listed(_stored(want, 3, "187"))  # the controller wrote its status: resourceVersion moved
    live["status"] = {"readyReplicas": 1}
    assert not needs_apply(want, live, last)


def test_a_spec_edit_by_someone_else_or_a_new_manifest_calls_for_an_apply() -> None:
    want = _sts()
    last = applied(want, _stored(want, 3, "100"))
    assert needs_apply(want, _listed(_stored(want, 4, "190")), last)  # edited by hand: generation 4
    assert needs_apply(_sts("sim:2"), _listed(_stored(want, 3, "100")), last)  # the operator's change


def test_a_service_is_followed_by_its_resource_version() -> None:
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "s-decode"}, "spec": {"ports": []}}
    last = applied(svc, _stored(svc, 1, "50"))
    assert not needs_apply(svc, _listed(_stored(svc, 1, "50")), last)
    assert needs_apply(svc, _listed(_stored(svc, 1, "51")), last)


def test_missing_deleting_or_unknown_objects_are_applied() -> None:
    want = _sts()
    last = applied(want, _stored(want, 3, "100"))
    assert needs_apply(want, None, last)
    deleting = _listed(_stored(want, 3, "100"))
    deleting["metadata"]["deletionTimestamp"] = "2026-12-06T22:00:00Z"
    assert needs_apply(want, deleting, last)
    assert needs_apply(want, _listed(_stored(want, 3, "100")), None)  # a restarted operator
