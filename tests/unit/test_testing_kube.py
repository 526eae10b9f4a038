"""The in-memory KubeApi (gearshift.testing.kube) against the semantics of the API server it stands in for:
JSON merge patch as RFC 7386 defines it (its own examples, and a reference written here), 409 on a taken
name, label selection, resourceVersion and generation bookkeeping, server-side apply of an unchanged
manifest, the status subresource, the call log and injected failures."""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import pytest

from gearshift.adapters.caches import PlanCache
from gearshift.adapters.kube import KubeApiError
from gearshift.control.reconcile.settings import Settings
from gearshift.testing.kube import FakeKubeApi, merge_patch

NS = "ns1"


def sts(name: str = "web", replicas: int = 1, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name, "namespace": NS, "labels": labels or {"app": "web"}},
        "spec": {"replicas": replicas, "template": {"spec": {"containers": [{"name": "c"}]}}},
    }


def node(name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels or {}}}


def rv(obj: dict[str, Any]) -> int:
    return int(obj["metadata"]["resourceVersion"])


# --- JSON merge patch --------------------------------------------------------------------------------------
# RFC 7386, Appendix A: (original, patch, result), verbatim.
RFC7386_EXAMPLES = [
    ('{"a":"b"}', '{"a":"c"}', '{"a":"c"}'),
    ('{"a":"b"}', '{"b":"c"}', '{"a":"b","b":"c"}'),
    ('{"a":"b"}', '{"a":null}', "{}"),
    ('{"a":"b","b":"c"}', '{"a":null}', '{"b":"c"}'),
    ('{"a":["b"]}', '{"a":"c"}', '{"a":"c"}'),
    ('{"a":"c"}', '{"a":["b"]}', '{"a":["b"]}'),
    ('{"a":{"b":"c"}}', '{"a":{"b":"d","c":null}}', '{"a":{"b":"d"}}'),
    ('{"a":[{"b":"c"}]}', '{"a":[1]}', '{"a":[1]}'),
    ('["a","b"]', '["c","d"]', '["c","d"]'),
    ('{"a":"b"}', '["c"]', '["c"]'),
    ('{"a":"foo"}', "null", "null"),
    ('{"a":"foo"}', '"bar"', '"bar"'),
    ('{"e":null}', '{"a":1}', '{"e":null,"a":1}'),
    ("[1,2]", '{"a":"b","c":null}', '{"a":"b"}'),
    ("{}", '{"a":{"bb":{"ccc":null}}}', '{"a":{"bb":{}}}'),
]


@pytest.mark.parametrize(("original", "patch", "result"), RFC7386_EXAMPLES)
def test_merge_patch_gives_the_rfcs_results(original: str, patch: str, result: str) -> None:
    target, body = json.loads(original), json.loads(patch)
    kept = copy.deepcopy((target, body))
    assert merge_patch(target, body) == json.loads(result)
    assert (target, body) == kept  # neither input is changed


def reference_merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 section 2, written from its pseudo-code as a fold over the patch's keys."""
    if not isinstance(patch, dict):
        return patch
    base = target if isinstance(target, dict) else {}
    out = {k: v for k, v in base.items() if k not in patch}
    out.update({k: reference_merge_patch(base.get(k), v) for k, v in patch.items() if v is not None})
    return out


def random_json(rng: random.Random, depth: int, nulls: bool) -> Any:
    roll = rng.random()
    if depth == 0 or roll < 0.3:
        return rng.choice([0, 1, "x", "y", True, [1, 2], [{"k": 1}]] + ([None] * 2 if nulls else []))
    keys = rng.sample("abcde", rng.randint(0, 4))
    return {k: random_json(rng, depth - 1, nulls) for k in keys}


def test_merge_patch_agrees_with_a_reference_on_random_documents() -> None:
    rng = random.Random(7386)
    for _ in range(500):
        target, patch = random_json(rng, 4, nulls=False), random_json(rng, 4, nulls=True)
        assert merge_patch(target, patch) == reference_merge_patch(copy.deepcopy(target), patch)


# --- create, get, delete -----------------------------------------------------------------------------------
class TestCreate:
    def test_a_new_object_gets_uid_generation_and_resource_version(self) -> None:
        api = FakeKubeApi()
        made = api.create(sts())
        meta = made["metadata"]
        assert meta["generation"] == 1 and meta["uid"] and rv(made) > 0
        assert api.get("apps/v1", "StatefulSet", NS, "web") == made

    def test_a_taken_name_is_409_and_the_object_is_left_as_it_is(self) -> None:
        api = FakeKubeApi()
        first = api.create(sts(replicas=1))
        with pytest.raises(KubeApiError) as err:
            api.create(sts(replicas=5))
        assert err.value.status == 409
        assert api.get("apps/v1", "StatefulSet", NS, "web") == first

    def test_the_same_name_in_another_namespace_is_another_object(self) -> None:
        api = FakeKubeApi()
        api.create(sts())
        other = sts()
        other["metadata"]["namespace"] = "ns2"
        api.create(other)
        assert len(api.list("apps/v1", "StatefulSet")) == 2

    def test_a_namespaced_kind_needs_a_namespace(self) -> None:
        api = FakeKubeApi()
        body = sts()
        del body["metadata"]["namespace"]
        with pytest.raises(ValueError, match="namespaced"):
            api.create(body)
        assert api.store == {}

    def test_status_is_not_created(self) -> None:
        # Every kind gearshift writes has a status subresource: a create's status is dropped.
        api = FakeKubeApi()
        made = api.create({**sts(), "status": {"readyReplicas": 3}})
        assert "status" not in made


class TestGetAndDelete:
    def test_missing_and_another_api_version_find_nothing(self) -> None:
        api = FakeKubeApi()
        api.create(sts())
        assert api.get("apps/v1", "StatefulSet", NS, "nope") is None
        assert api.get("apps/v1beta1", "StatefulSet", NS, "web") is None
        assert api.get("apps/v1", "StatefulSet", "ns2", "web") is None

    def test_a_read_is_a_copy(self) -> None:
        api = FakeKubeApi()
        api.create(sts())
        got = api.get("apps/v1", "StatefulSet", NS, "web")
        assert got is not None
        got["spec"]["replicas"] = 99
        again = api.get("apps/v1", "StatefulSet", NS, "web")
        assert again is not None and again["spec"]["replicas"] == 1

    def test_cluster_scoped_kinds_have_no_namespace(self) -> None:
        api = FakeKubeApi()
        api.create(node("n1"))
        assert api.get("v1", "Node", None, "n1") is not None
        assert api.get("v1", "Node", "whatever", "n1") is not None
        assert ("Node", None, "n1") in api.store

    def test_delete_says_whether_there_was_something(self) -> None:
        api = FakeKubeApi()
        api.create(sts())
        assert api.delete("apps/v1", "StatefulSet", NS, "web") is True
        assert api.get("apps/v1", "StatefulSet", NS, "web") is None
        assert api.delete("apps/v1", "StatefulSet", NS, "web") is False


# --- list ---------------------------------------------------------------------------------------------------
def test_list_selects_by_namespace_kind_and_every_label() -> None:
    api = FakeKubeApi()
    api.create(sts("a", labels={"app": "web", "tier": "1"}))
    api.create(sts("b", labels={"app": "web", "tier": "2"}))
    api.create(sts("c", labels={"app": "db"}))
    other = sts("d", labels={"app": "web", "tier": "1"})
    other["metadata"]["namespace"] = "ns2"
    api.create(other)
    api.create({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "a", "namespace": NS}})

    def names(namespace: str | None, labels: dict[str, str] | None = None) -> set[str]:
        return {o["metadata"]["name"] for o in api.list("apps/v1", "StatefulSet", namespace, labels)}

    assert names(NS) == {"a", "b", "c"}
    assert names(None) == {"a", "b", "c", "d"}  # no namespace: all of them
    assert names(NS, {"app": "web"}) == {"a", "b"}
    assert names(None, {"app": "web", "tier": "1"}) == {"a", "d"}  # every label must match
    assert names(NS, {"app": "web", "tier": "3"}) == set()
    assert names(NS, {"missing": ""}) == set()  # a label must be there to equal ""
    assert api.list("apps/v1beta1", "StatefulSet", NS) == []


def test_cluster_scoped_lists_ignore_the_namespace() -> None:
    api = FakeKubeApi()
    api.create(node("n1", {"gpu": "a10"}))
    api.create(node("n2", {"gpu": "h100"}))
    assert [n["metadata"]["name"] for n in api.list("v1", "Node", None, {"gpu": "a10"})] == ["n1"]
    assert len(api.list("v1", "Node", NS)) == 2


# --- apply --------------------------------------------------------------------------------------------------
class TestApply:
    def test_an_unchanged_manifest_is_a_no_op(self) -> None:
        api = FakeKubeApi()
        first = api.apply(sts())
        assert first["metadata"]["generation"] == 1
        again = api.apply(sts())
        assert again == first and rv(again) == rv(first)

    def test_a_spec_change_moves_resource_version_and_generation_and_keeps_uid_and_status(self) -> None:
        api = FakeKubeApi()
        first = api.apply(sts(replicas=1))
        api.patch_status("apps/v1", "StatefulSet", NS, "web", {"readyReplicas": 1})
        changed = api.apply(sts(replicas=2))
        assert changed["spec"]["replicas"] == 2 and rv(changed) > rv(first)
        assert (
            changed["metadata"]["generation"] == 2 and changed["metadata"]["uid"] == first["metadata"]["uid"]
        )
        assert changed["status"] == {"readyReplicas": 1}

    def test_a_metadata_change_moves_resource_version_but_not_generation(self) -> None:
        api = FakeKubeApi()
        first = api.apply(sts())
        relabelled = api.apply(sts(labels={"app": "web", "new": "1"}))
        assert rv(relabelled) > rv(first) and relabelled["metadata"]["generation"] == 1

    def test_a_manifests_status_is_ignored_and_every_manifest_is_recorded(self) -> None:
        api = FakeKubeApi()
        first = api.apply(sts())
        with_status = {**sts(), "status": {"readyReplicas": 7}}
        assert api.apply(with_status) == first  # status is the status subresource's
        assert api.applied == [sts(), with_status]


# --- patches ------------------------------------------------------------------------------------------------
class TestPatch:
    def test_merge_patch_of_the_object(self) -> None:
        api = FakeKubeApi()
        first = api.create(sts(labels={"app": "web", "old": "1"}))
        body = {"metadata": {"labels": {"old": None, "new": "2"}}, "spec": {"replicas": 3}}
        patched = api.patch("apps/v1", "StatefulSet", NS, "web", body)
        want = merge_patch({k: v for k, v in first.items() if k != "metadata"}, {"spec": {"replicas": 3}})
        assert {k: v for k, v in patched.items() if k != "metadata"} == want
        assert patched["metadata"]["labels"] == {"app": "web", "new": "2"}
        assert patched["metadata"]["generation"] == 2 and rv(patched) > rv(first)

    def test_status_and_the_servers_metadata_are_not_patched(self) -> None:
        api = FakeKubeApi()
        first = api.create(sts())
        body = {"status": {"readyReplicas": 9}, "metadata": {"uid": "mine", "generation": 40}}
        patched = api.patch("apps/v1", "StatefulSet", NS, "web", body)
        assert patched == first  # nothing it may change changed: not even the resourceVersion

    def test_a_label_patch_leaves_generation(self) -> None:
        api = FakeKubeApi()
        api.create(node("n1"))
        patched = api.patch("v1", "Node", None, "n1", {"metadata": {"labels": {"gpu": "a10"}}})
        assert patched["metadata"]["labels"] == {"gpu": "a10"} and patched["metadata"]["generation"] == 1

    def test_a_missing_object_is_404(self) -> None:
        api = FakeKubeApi()
        api.create(sts("other"))
        for call in (api.patch, api.patch_status):
            with pytest.raises(KubeApiError) as err:
                call("apps/v1", "StatefulSet", NS, "web", {})
            assert err.value.status == 404
            with pytest.raises(KubeApiError) as err:  # another group/version: another resource
                call("apps/v1beta1", "StatefulSet", NS, "other", {})
            assert err.value.status == 404
        assert api.delete("apps/v1beta1", "StatefulSet", NS, "other") is False
        assert api.get("apps/v1", "StatefulSet", NS, "other") is not None


class TestPatchStatus:
    def test_merges_deeply_and_null_deletes(self) -> None:
        api = FakeKubeApi()
        api.create(sts())
        api.patch_status("apps/v1", "StatefulSet", NS, "web", {"a": {"x": 1, "y": 2}, "b": [1, 2], "c": "c"})
        got = api.patch_status(
            "apps/v1", "StatefulSet", NS, "web", {"a": {"x": None, "z": 3}, "b": [3], "c": None}
        )
        assert got["status"] == {"a": {"y": 2, "z": 3}, "b": [3]}

    def test_touches_nothing_but_status_and_moves_the_resource_version_not_generation(self) -> None:
        api = FakeKubeApi()
        first = api.create(sts())
        got = api.patch_status("apps/v1", "StatefulSet", NS, "web", {"readyReplicas": 1})
        assert {k: v for k, v in got.items() if k != "status"} == {
            **first,
            "metadata": {**first["metadata"], "resourceVersion": got["metadata"]["resourceVersion"]},
        }
        assert rv(got) > rv(first) and got["metadata"]["generation"] == 1

    def test_the_same_status_again_is_a_no_op(self) -> None:
        api = FakeKubeApi()
        api.create(sts())
        first = api.patch_status("apps/v1", "StatefulSet", NS, "web", {"readyReplicas": 1})
        again = api.patch_status("apps/v1", "StatefulSet", NS, "web", {"readyReplicas": 1})
        assert again == first


def test_every_write_that_changes_an_object_moves_its_resource_version() -> None:
    api = FakeKubeApi()
    seen = [rv(api.create(sts()))]
    seen.append(rv(api.apply(sts(replicas=2))))
    seen.append(rv(api.patch("apps/v1", "StatefulSet", NS, "web", {"spec": {"replicas": 3}})))
    seen.append(rv(api.patch_status("apps/v1", "StatefulSet", NS, "web", {"replicas": 3})))
    seen.append(rv(api.put(sts(replicas=4))))
    api.delete("apps/v1", "StatefulSet", NS, "web")
    seen.append(rv(api.create(sts())))
    assert seen == sorted(set(seen))  # strictly increasing: never reused, never back


# --- what it adds for tests ---------------------------------------------------------------------------------
class TestForTests:
    def test_put_stores_a_tests_own_write(self) -> None:
        api = FakeKubeApi()
        stored = api.put({**sts(), "status": {"readyReplicas": 2}}, "other")
        assert stored["metadata"]["namespace"] == "other" and stored["status"] == {"readyReplicas": 2}
        assert (stored["metadata"]["uid"], stored["metadata"]["generation"]) == ("uid-web", 1)
        again = api.put({**stored, "spec": {"replicas": 5}})
        assert again["metadata"]["generation"] == 1 and rv(again) > rv(stored)  # the test's generation
        assert api.put(node("n1"), "other")["metadata"].get("namespace") is None
        assert api.calls == []  # not calls through the API

    def test_calls_events_and_verbs(self) -> None:
        api = FakeKubeApi()
        api.create(sts())
        api.get("apps/v1", "StatefulSet", NS, "web")
        api.list("v1", "Pod", NS, {"b": "2", "a": "1"})
        api.get("v1", "Node", "ignored", "n1")
        event = {"metadata": {"generateName": "web.", "namespace": NS}, "reason": "Planned"}
        api.create_event(event)
        assert api.calls == [
            ("create", "StatefulSet", NS, "web"),
            ("get", "StatefulSet", NS, "web"),
            ("list", "Pod", NS, "a=1,b=2"),  # the selector as RestKubeApi sends it
            ("get", "Node", None, "n1"),
            ("create_event", "Event", NS, "web."),
        ]
        assert api.verbs()[:2] == [("create", "StatefulSet"), ("get", "StatefulSet")]
        assert api.events == [event] and api.events[0] is not event

    def test_a_refused_call_is_logged_and_changes_nothing(self) -> None:
        api = FakeKubeApi()
        api.create(sts())
        before = copy.deepcopy(api.store)
        api.refuse[("patch", "StatefulSet")] = KubeApiError("PATCH: 403 Forbidden", 403)
        with pytest.raises(KubeApiError) as err:
            api.patch("apps/v1", "StatefulSet", NS, "web", {"spec": {"replicas": 2}})
        assert err.value.status == 403 and api.store == before
        assert api.calls[-1] == ("patch", "StatefulSet", NS, "web")
        api.patch_status("apps/v1", "StatefulSet", NS, "web", {"replicas": 1})  # other verbs still work

    def test_one_runtime_over_the_api_with_the_settings_given(self) -> None:
        settings, plans = Settings(sim_requests=7), PlanCache()
        api = FakeKubeApi(settings=settings, plans=plans)
        rt = api.runtime
        assert api.runtime is rt and rt.api is api and rt.settings is settings and rt.plans is plans
        assert FakeKubeApi().runtime.settings == Settings()
