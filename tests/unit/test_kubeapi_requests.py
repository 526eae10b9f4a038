"""RestKubeApi's requests, as the API server receives them: method, path, query, content type and body of
the calls GPU profiling makes (the Job's create, read, delete; a node label patch; a status write)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gearshift.adapters.kube import JOB, NODE, POD, KubeApiError, RestKubeApi, resource_path


class _Response:
    def __init__(self, status: int, body: Any) -> None:
        self.status = status
        self.reason = {200: "OK", 201: "Created", 404: "Not Found", 409: "Conflict"}.get(status, "")
        self.raw = json.dumps(body).encode() if body is not None else b""

    def read(self) -> bytes:
        return self.raw


class FakeApiClient:
    """The two calls RestKubeApi makes of ``kubernetes.client.ApiClient``: it records each request and
    answers with the next queued (status, body)."""

    def __init__(self, *answers: tuple[int, Any]) -> None:
        self.answers = list(answers)
        self.requests: list[dict[str, Any]] = []

    def param_serialize(self, **kw: Any) -> tuple[str, str, dict[str, str], Any, list[Any]]:
        self.requests.append(kw)
        return kw["method"], kw["resource_path"], kw["header_params"], kw["body"], []

    def call_api(self, method: str, url: str, header_params: dict[str, str], body: Any) -> _Response:
        return _Response(*self.answers.pop(0))


def one(client: FakeApiClient) -> tuple[str, str, list[tuple[str, str]], str | None, Any]:
    (r,) = client.requests
    return (
        r["method"],
        r["resource_path"],
        r["query_params"],
        r["header_params"].get("Content-Type"),
        r["body"],
    )


def test_job_paths() -> None:
    assert resource_path(*JOB, "probes") == "/apis/batch/v1/namespaces/probes/jobs"
    assert resource_path(*JOB, "probes", "gsprobe-a") == "/apis/batch/v1/namespaces/probes/jobs/gsprobe-a"
    with pytest.raises(ValueError, match="namespaced"):
        resource_path(*JOB, None, "gsprobe-a")


def test_create_posts_to_the_collection() -> None:
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "gsprobe-a", "namespace": "probes"}}
    c = FakeApiClient((201, {**job, "status": {}}))
    assert RestKubeApi(c).create(job)["status"] == {}
    assert one(c) == ("POST", "/apis/batch/v1/namespaces/probes/jobs", [], "application/json", job)
    # A cluster-scoped kind: its collection, no namespace.
    prof = {"apiVersion": "gearshift.io/v1alpha1", "kind": "GPUProfile", "metadata": {"name": "n1"}}
    c = FakeApiClient((409, {"reason": "AlreadyExists"}))
    with pytest.raises(KubeApiError) as exc:
        RestKubeApi(c).create(prof)
    assert exc.value.status == 409
    assert one(c)[:2] == ("POST", "/apis/gearshift.io/v1alpha1/gpuprofiles")


def test_create_of_a_namespaced_kind_needs_its_namespace() -> None:
    c = FakeApiClient()
    with pytest.raises(ValueError, match="namespaced"):
        RestKubeApi(c).create({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j"}})
    assert c.requests == []


def test_job_read_and_pods_by_label() -> None:
    c = FakeApiClient((404, {"reason": "NotFound"}), (200, {"items": [{"metadata": {"name": "p"}}]}))
    api = RestKubeApi(c)
    assert api.get(*JOB, "probes", "gsprobe-a") is None
    assert api.list(*POD, "probes", labels={"batch.kubernetes.io/job-name": "gsprobe-a"}) == [
        {"metadata": {"name": "p"}}
    ]
    first, second = c.requests
    assert (first["method"], first["resource_path"]) == (
        "GET",
        "/apis/batch/v1/namespaces/probes/jobs/gsprobe-a",
    )
    assert (second["resource_path"], second["query_params"]) == (
        "/api/v1/namespaces/probes/pods",
        [("labelSelector", "batch.kubernetes.io/job-name=gsprobe-a")],
    )


def test_delete_is_background_and_gone_is_false() -> None:
    c = FakeApiClient((404, {"reason": "NotFound"}))
    assert RestKubeApi(c).delete(*JOB, "probes", "gsprobe-a") is False
    assert one(c) == (
        "DELETE",
        "/apis/batch/v1/namespaces/probes/jobs/gsprobe-a",
        [],
        None,
        {"propagationPolicy": "Background"},
    )


def test_node_label_patch_is_a_merge_patch_with_nulls() -> None:
    body = {"metadata": {"labels": {"gearshift.io/profiled": None, "gearshift.io/gpu-model": "H100-80GB"}}}
    c = FakeApiClient((200, {"metadata": {"name": "n1"}}))
    RestKubeApi(c).patch(*NODE, None, "n1", body)
    assert one(c) == ("PATCH", "/api/v1/nodes/n1", [], "application/merge-patch+json", body)
    c = FakeApiClient((404, {"reason": "NotFound"}))
    with pytest.raises(KubeApiError) as exc:
        RestKubeApi(c).patch(*NODE, None, "gone", body)
    assert exc.value.status == 404


def test_status_write_goes_to_the_subresource() -> None:
    c = FakeApiClient((200, {"metadata": {"resourceVersion": "7"}, "status": {"phase": "Probing"}}))
    out = RestKubeApi(c).patch_status("gearshift.io/v1alpha1", "GPUProfile", None, "n1", {"phase": "Probing"})
    assert out["metadata"]["resourceVersion"] == "7"
    assert one(c) == (
        "PATCH",
        "/apis/gearshift.io/v1alpha1/gpuprofiles/n1/status",
        [],
        "application/merge-patch+json",
        {"status": {"phase": "Probing"}},
    )


def test_every_request_is_counted_by_verb_and_resource() -> None:
    """gearshift_operator_api_requests_total: the fleet benchmark's count of the operator's own calls."""
    from gearshift.adapters.metrics import API_REQUESTS

    def count(verb: str, resource: str) -> float:
        return API_REQUESTS.labels(verb, resource)._value.get()

    before = count("PATCH", "gpuprofiles/status"), count("GET", "jobs")
    api = RestKubeApi(FakeApiClient((200, {"status": {}}), (404, None)))
    api.patch_status("gearshift.io/v1alpha1", "GPUProfile", None, "gpu-a", {"phase": "Ready"})
    assert api.get(*JOB, "probes", "gsprobe-a") is None
    assert (count("PATCH", "gpuprofiles/status"), count("GET", "jobs")) == (before[0] + 1, before[1] + 1)


@pytest.mark.parametrize(
    ("path", "resource"),
    [
        ("/apis/apps/v1/namespaces/n/statefulsets/x", "statefulsets"),
        ("/apis/apps/v1/namespaces/n/statefulsets?labelSelector=a", "statefulsets"),
        ("/api/v1/nodes/x/status", "nodes/status"),
        ("/api/v1/pods", "pods"),
        ("/api/v1/namespaces/n/pods", "pods"),
        ("/api/v1/namespaces/n", "namespaces"),
        ("/apis/gearshift.io/v1alpha1/gpuprofiles/a/status", "gpuprofiles/status"),
    ],
)
def test_resource_of_path(path: str, resource: str) -> None:
    from gearshift.adapters.kube import resource_of_path

    assert resource_of_path(path) == resource
