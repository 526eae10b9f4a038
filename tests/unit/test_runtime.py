"""The operator's Runtime (one runtime object): the API built once or the one given, the probe
settings, the keyed locks that keep nothing once released, the caches, the per-object memory that the
deleting handlers forget, and how kopf's memo carries it from ``gearshift operator`` to every handler."""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import kopf
import pytest
from kopf._core.reactor.inventory import ResourceMemories
from test_handlers_reconcile import NS, PLANS, SETTINGS, new_api, service_api, stateful_sets

from gearshift.adapters.caches import FleetCache, PlanCache
from gearshift.adapters.kube import RestKubeApi
from gearshift.adapters.memory import GearSetMemory, KeyedLocks, Recent, ServiceMemory
from gearshift.api.gearset import Gear
from gearshift.control.reconcile.settings import Settings
from gearshift.facts.errors import SettingsError
from gearshift.handlers import gearset, nodes, pdservice, shifting
from gearshift.handlers import reconcile as rec
from gearshift.handlers.main import add_arguments, build_runtime
from gearshift.handlers.runtime import ReconcileOutcome, Runtime, runtime_of
from gearshift.k8s import names
from gearshift.profiling.settings import ProbeSettings
from gearshift.testing.kube import FakeKubeApi

REPO = Path(__file__).resolve().parents[2]


# --- the API ---------------------------------------------------------------------------------------------
class TestApi:
    def test_a_given_api_is_used_and_nothing_is_loaded(self) -> None:
        fake = new_api()
        rt = Runtime(api=fake)
        # The seal (tests/conftest.py) would raise had a kubeconfig or the in-cluster config been read.
        assert rt.api is fake and rt.api is fake

    def test_the_default_api_is_built_once_from_in_cluster_credentials(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from kubernetes import config

        loads: list[str] = []
        monkeypatch.setattr(config, "load_incluster_config", lambda: loads.append("in-cluster"))
        rt = Runtime()
        assert loads == []  # lazily: nothing until the first use
        first = rt.api
        assert isinstance(first, RestKubeApi) and rt.api is first and loads == ["in-cluster"]

    def test_outside_a_cluster_the_kubeconfig_is_loaded_once_even_from_many_threads(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from kubernetes import config

        loads: list[str] = []

        def not_in_cluster() -> None:
            loads.append("in-cluster")
            time.sleep(0.01)  # widen the window in which a second thread could build another
            raise config.ConfigException("not in a pod")

        monkeypatch.setattr(config, "load_incluster_config", not_in_cluster)
        monkeypatch.setattr(config, "load_kube_config", lambda: loads.append("kubeconfig"))
        rt = Runtime()
        built: list[Any] = []
        threads = [threading.Thread(target=lambda: built.append(rt.api)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert loads == ["in-cluster", "kubeconfig"]
        assert len(built) == 8 and all(b is built[0] for b in built)


class TestProbeSettings:
    def test_given_settings_are_used(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("GEARSHIFT_PROBE_BACKOFF_S", "not a number")
        given = ProbeSettings(backoff_base_s=7)
        assert Runtime(probe=given).probe_settings() is given

    def test_read_from_the_environment_once(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("GEARSHIFT_PROBE_BACKOFF_S", "12")
        rt = Runtime()
        first = rt.probe_settings()
        assert first.backoff_base_s == 12.0
        monkeypatch.setenv("GEARSHIFT_PROBE_BACKOFF_S", "13")
        assert rt.probe_settings() is first

    def test_a_bad_variable_stops_the_start_up_named(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("GEARSHIFT_PROBE_BACKOFF_S", "soon")
        rt = Runtime()
        with pytest.raises(SettingsError, match="GEARSHIFT_PROBE_BACKOFF_S"):
            rt.probe_settings()
        with pytest.raises(kopf.PermanentError, match="GEARSHIFT_PROBE_BACKOFF_S='soon'"):
            nodes.nodes_startup(logger=None, memo=kopf.Memo(runtime=rt))  # type: ignore[arg-type]


# --- kopf's memo -----------------------------------------------------------------------------------------
class TestMemo:
    def test_runtime_of_reads_the_memo(self) -> None:
        rt = Runtime()
        assert runtime_of(kopf.Memo(runtime=rt)) is rt

    def test_a_memo_without_a_runtime_names_the_way_to_start(self) -> None:
        with pytest.raises(LookupError, match="gearshift operator"):
            runtime_of(kopf.Memo())
        with pytest.raises(LookupError):
            runtime_of(kopf.Memo(runtime="not one"))

    async def test_every_resources_memo_holds_the_one_runtime(self) -> None:
        # kopf copies the root memo (kopf.run(memo=...)) shallowly for each object it sees: one Runtime.
        rt = Runtime()
        root = kopf.Memo(runtime=rt)
        memories = ResourceMemories()
        bodies = [{"metadata": {"uid": uid, "name": uid, "namespace": NS}} for uid in ("a", "b")]
        memos = [await memories.recall_memo(b, memobase=root) for b in bodies]  # type: ignore[arg-type]
        assert memos[0] is not memos[1] and memos[0] is not root
        assert all(runtime_of(m) is rt for m in memos)  # type: ignore[arg-type]
        assert runtime_of(copy.copy(root)) is rt


# --- keyed locks -----------------------------------------------------------------------------------------
class TestKeyedLocks:
    def test_a_key_is_held_only_inside_the_block(self) -> None:
        locks: KeyedLocks[tuple[str, str]] = KeyedLocks()
        with locks.hold(("ns", "a")):
            assert locks.keys() == {("ns", "a")}
            with locks.hold(("ns", "b")):  # another key does not wait
                assert locks.keys() == {("ns", "a"), ("ns", "b")}
        assert locks.keys() == set()

    def test_an_error_inside_releases_and_forgets(self) -> None:
        locks: KeyedLocks[str] = KeyedLocks()
        with pytest.raises(RuntimeError), locks.hold("a"):
            raise RuntimeError("boom")
        assert locks.keys() == set()
        with locks.hold("a"):  # not left locked
            pass

    def test_one_key_serialises_its_holders(self) -> None:
        locks: KeyedLocks[str] = KeyedLocks()
        inside, overlaps = [0], []

        def work() -> None:
            for _ in range(50):
                with locks.hold("svc"):
                    inside[0] += 1
                    overlaps.append(inside[0])
                    time.sleep(0.0001)
                    inside[0] -= 1

        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(overlaps) == 200 and max(overlaps) == 1
        assert locks.keys() == set()

    def test_a_waiter_keeps_the_lock_until_it_is_done(self) -> None:
        locks: KeyedLocks[str] = KeyedLocks()
        entered, release = threading.Event(), threading.Event()
        order: list[str] = []

        def first() -> None:
            with locks.hold("k"):
                entered.set()
                release.wait(5)
                order.append("first")

        def second() -> None:
            with locks.hold("k"):
                order.append("second")

        t1 = threading.Thread(target=first)
        t1.start()
        entered.wait(5)
        t2 = threading.Thread(target=second)
        t2.start()
        time.sleep(0.05)
        assert order == [] and locks.keys() == {"k"}
        release.set()
        t1.join()
        t2.join()
        assert order == ["first", "second"] and locks.keys() == set()


class LockWatchingApi(FakeKubeApi):
    """Records, at every read of the PDService, which service locks are held (a read that looks at the
    operator's own state: no behaviour of the API server, so a subclass of this test's own)."""

    def __init__(self) -> None:
        super().__init__(settings=SETTINGS, plans=PLANS)
        self.held: list[set[tuple[str, str]]] = []

    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        if kind == "PDService":
            self.held.append(self.runtime.service_locks.keys())
        return super().get(api_version, kind, namespace, name)


def test_a_reconcile_holds_its_services_lock_and_leaves_none_behind() -> None:
    api = LockWatchingApi()
    for obj in service_api().store.values():
        api.put(obj)
    rec.reconcile_service(api.runtime, NS, "llama3-8b")
    assert api.held and all(h == {(NS, "llama3-8b")} for h in api.held)
    assert api.runtime.service_locks.keys() == set()
    # The gear executor's operations hold the same lock.
    rec.delete_gear_sync(api.runtime, NS, "llama3-8b", "prefill", "no-such-gear")
    assert api.held[-1] == {(NS, "llama3-8b")} and api.runtime.service_locks.keys() == set()


# --- caches ----------------------------------------------------------------------------------------------
class CountingFleet:
    def __init__(self) -> None:
        self.lists: list[str] = []

    def list(self, api_version: str, kind: str, *_: Any) -> list[dict[str, Any]]:
        self.lists.append(kind)
        return [{"metadata": {"name": f"{kind.lower()}-{len(self.lists)}"}}]


class TestFleetCache:
    def test_a_read_serves_for_ttl_seconds(self) -> None:
        clock = [100.0]
        cache = FleetCache(ttl_s=2.0, clock=lambda: clock[0])
        api = CountingFleet()
        nodes_, profiles = cache.read(api)  # type: ignore[arg-type]
        assert (list(nodes_), list(profiles)) == (["node-1"], ["gpuprofile-2"])
        clock[0] = 101.9
        assert cache.read(api) == (nodes_, profiles) and api.lists == ["Node", "GPUProfile"]  # type: ignore[arg-type]
        clock[0] = 102.0
        cache.read(api)  # type: ignore[arg-type]
        assert api.lists == ["Node", "GPUProfile"] * 2

    def test_forget_and_another_api_read_afresh(self) -> None:
        cache = FleetCache(ttl_s=60.0, clock=lambda: 0.0)
        a, b = CountingFleet(), CountingFleet()
        cache.read(a)  # type: ignore[arg-type]
        cache.read(b)  # type: ignore[arg-type]
        assert len(a.lists) == 2 and len(b.lists) == 2
        cache.forget()
        cache.read(b)  # type: ignore[arg-type]
        assert len(b.lists) == 4

    def test_a_read_overtaken_by_a_change_is_not_kept(self) -> None:
        # The node list was sent before a node changed; the change's forget() lands while the profile
        # list is on its way. That read answers its caller but must not serve the next one.
        cache = FleetCache(ttl_s=60.0, clock=lambda: 0.0)

        class ChangedMidRead(CountingFleet):
            def list(self, api_version: str, kind: str, *rest: Any) -> list[dict[str, Any]]:
                if kind == "GPUProfile" and len(self.lists) == 1:
                    cache.forget()
                return super().list(api_version, kind, *rest)

        api = ChangedMidRead()
        first = cache.read(api)  # type: ignore[arg-type]
        assert list(first[0]) == ["node-1"]
        second = cache.read(api)  # type: ignore[arg-type]
        assert list(second[0]) == ["node-3"] and len(api.lists) == 4
        assert cache.read(api) == second and len(api.lists) == 4  # type: ignore[arg-type]


def test_node_fingerprint_changes_with_what_placement_reads_and_not_with_heartbeats() -> None:
    def node(**over: Any) -> dict[str, Any]:
        body: dict[str, Any] = {
            "metadata": {"name": "n", "labels": {"pool": "a", "gearshift.io/class": "high"},
                         "annotations": {"gearshift.io/available-until": "2026-12-06T18:00:00Z", "x": "1"}},
            "spec": {},
            "status": {"allocatable": {"nvidia.com/gpu": "8"},
                       "conditions": [{"type": "Ready", "status": "True", "lastHeartbeatTime": "t0"}]},
        }  # fmt: skip
        for path, value in over.items():
            *head, last = path.split("__")
            at = body
            for k in head:
                at = at[k]
            at[last] = value
        return body

    base = pdservice.node_fingerprint(node())
    same = [
        node(status__conditions=[{"type": "Ready", "status": "True", "lastHeartbeatTime": "t1"}]),
        node(metadata__annotations={"gearshift.io/available-until": "2026-12-06T18:00:00Z", "x": "2"}),
    ]
    assert all(pdservice.node_fingerprint(n) == base for n in same)
    changed = [
        node(metadata__labels={"pool": "b", "gearshift.io/class": "high"}),  # a nodeSelector may name it
        node(metadata__annotations={"gearshift.io/available-until": "2026-12-06T19:00:00Z"}),
        node(spec__unschedulable=True),
        node(spec__taints=[{"key": "k", "value": "v", "effect": "NoSchedule"}]),
        node(status__allocatable={"nvidia.com/gpu": "4"}),
        node(status__conditions=[{"type": "Ready", "status": "False", "lastHeartbeatTime": "t1"}]),
    ]
    assert all(pdservice.node_fingerprint(n) != base for n in changed)


class TestPlanCache:
    def _gear(self, name: str) -> Gear:
        return Gear.model_validate(
            {"name": name, "microBatch": 1, "maxBatch": 8,
             "stages": [{"layers": [0, 16], "gpuModel": "A10-24GB", "nodes": ["n"]}]}
        )  # fmt: skip

    def test_a_plan_is_made_once_per_key_and_copies_are_returned(self) -> None:
        cache, made = PlanCache(size=2), []

        def plan(name: str) -> Any:
            def make() -> list[Gear]:
                made.append(name)
                return [self._gear(name)]

            return make

        first = cache("k1", plan("a"))
        first.append(self._gear("mine"))  # the caller's copy
        assert [g.name for g in cache("k1", plan("b"))] == ["a"] and made == ["a"]

    def test_the_least_recently_used_plan_goes_beyond_size(self) -> None:
        cache, made = PlanCache(size=2), []

        def plan(name: str) -> Any:
            return lambda: made.append(name) or [self._gear(name)]

        cache("k1", plan("1"))
        cache("k2", plan("2"))
        cache("k1", plan("x"))  # k1 used: k2 is the oldest now
        cache("k3", plan("3"))
        assert len(cache) == 2
        cache("k1", plan("x"))
        cache("k2", plan("2-again"))
        assert made == ["1", "2", "3", "2-again"]


# --- per-object memory and its forgetting ----------------------------------------------------------------
class TestRecent:
    def test_computes_once_per_ttl_and_again_after(self) -> None:
        clock = [100.0]
        calls: list[float] = []
        recent: Recent[int] = Recent(2.0, clock=lambda: clock[0])

        def compute() -> int:
            calls.append(clock[0])
            return len(calls)

        assert recent.get(compute) == 1
        clock[0] = 101.9
        assert recent.get(compute) == 1  # within 2 s: the value kept
        clock[0] = 102.0
        assert recent.get(compute) == 2  # 2 s after the first computation: computed again
        assert calls == [100.0, 102.0]

    def test_a_failed_computation_keeps_nothing(self) -> None:
        recent: Recent[int] = Recent(60.0)

        def fails() -> int:
            raise RuntimeError("index changed")

        with pytest.raises(RuntimeError):
            recent.get(fails)
        assert recent.get(lambda: 7) == 7


class TestServiceMemory:
    def test_record_counts_phases_and_none_forgets(self) -> None:
        mem = ServiceMemory()
        assert mem.record(("ns", "a"), ReconcileOutcome(phase="Ready")) == {"Ready": 1}
        assert mem.record(("ns", "b"), ReconcileOutcome(phase="Pending")) == {"Ready": 1, "Pending": 1}
        assert mem.record(("ns", "a"), None) == {"Pending": 1}
        assert list(mem.outcomes()) == [("ns", "b")]

    def test_forget_drops_the_outcome_and_the_window(self) -> None:
        mem = ServiceMemory()
        mem.record(("ns", "a"), ReconcileOutcome(phase="Ready"))
        mem.handle_window(("ns", "a"), "2025-01-31T12:00:00+00:00")
        mem.handle_window(("ns", "b"), "2025-01-31T12:00:00+00:00")
        mem.forget(("ns", "a"))
        assert not mem.known(("ns", "a")) and mem.window_handled(("ns", "b")) is not None


async def test_a_deleted_pdservice_is_forgotten_by_its_delete_event() -> None:
    api = service_api()
    rt = api.runtime
    out = pdservice.run_reconcile(rt, NS, "llama3-8b")
    key = (NS, "llama3-8b")
    assert pdservice.known_services(rt) == {key: out}
    rt.services.handle_window(key, "2025-01-31T12:00:00+00:00")
    rt.pruned.first("uid-llama3-8b", ("status.x",))
    body = api.get("gearshift.io/v1alpha1", "PDService", NS, "llama3-8b")
    await pdservice.pdservice_seen(
        namespace=NS, name="llama3-8b", type="DELETED", body=body, memo=kopf.Memo(runtime=rt)
    )  # type: ignore[arg-type]
    assert not rt.services.known(key) and pdservice.known_services(rt) == {}
    assert not rt.pruned.known("uid-llama3-8b")
    assert rt.service_locks.keys() == set()


def test_the_pdservice_handlers_reconcile_with_the_runtime_in_kopfs_memo() -> None:
    api = service_api()
    memo = kopf.Memo(runtime=api.runtime)
    body = api.get("gearshift.io/v1alpha1", "PDService", NS, "llama3-8b")
    pdservice.pdservice_reconcile(namespace=NS, name="llama3-8b", body=body, memo=memo)  # type: ignore[arg-type]
    assert stateful_sets(api) and list(pdservice.known_services(api.runtime)) == [(NS, "llama3-8b")]


async def test_an_owned_objects_change_reconciles_later_through_the_runtime() -> None:
    api = service_api()
    rt = api.runtime
    labels = {names.LABEL_SERVICE: "llama3-8b"}
    await pdservice.owned_changed(namespace=NS, labels=labels, memo=kopf.Memo(runtime=rt))  # type: ignore[arg-type]
    await pdservice.owned_changed(namespace=NS, labels=labels, memo=kopf.Memo(runtime=rt))  # type: ignore[arg-type]
    (task,) = rt.services.pending.values()  # debounced: one reconcile scheduled
    await task
    assert rt.services.pending == {} and list(pdservice.known_services(rt)) == [(NS, "llama3-8b")]


async def test_other_events_of_a_pdservice_forget_nothing() -> None:
    rt = Runtime()
    rt.services.record(("ns", "a"), ReconcileOutcome(phase="Ready"))
    memo = kopf.Memo(runtime=rt)
    await pdservice.pdservice_seen(namespace="ns", name="a", type="MODIFIED", body={}, memo=memo)  # type: ignore[arg-type]
    assert rt.services.known(("ns", "a"))


class TestGearSetMemory:
    def test_generations(self) -> None:
        mem = GearSetMemory()
        assert mem.new_generation(("ns", "g"), 1) and not mem.new_generation(("ns", "g"), 1)
        assert mem.new_generation(("ns", "g"), 2)
        # A GearSet never seen counts as generation None (as the handler always did).
        assert not mem.new_generation(("ns", "h"), None)

    def test_holds_and_window_warnings(self) -> None:
        mem = GearSetMemory()
        assert mem.swap_hold(("ns", "g"), "cooldown") is None
        assert mem.swap_hold(("ns", "g"), "no signals") == "cooldown"
        assert mem.new_window_warning(("ns", "g"), "w") and not mem.new_window_warning(("ns", "g"), "w")
        mem.forget(("ns", "g"))
        assert not mem.known(("ns", "g"))
        assert mem.swap_hold(("ns", "g"), "cooldown") is None and mem.new_window_warning(("ns", "g"), "w")


async def test_a_deleted_gearset_is_forgotten_by_its_event() -> None:
    rt = Runtime()
    key = ("ns", "g")
    rt.gearsets.new_generation(key, 3)
    rt.gearsets.swap_hold(key, "cooldown")
    rt.gearsets.new_window_warning(key, "no window-free gear")
    rt.pruned.first("uid-g", ("status.executor",))
    body = {"metadata": {"name": "g", "namespace": "ns", "uid": "uid-g", "generation": 3}, "spec": {}}
    memo = kopf.Memo(runtime=rt)
    await gearset.gearset_changed(namespace="ns", name="g", body=body, type="DELETED", memo=memo)  # type: ignore[arg-type]
    assert not rt.gearsets.known(key) and not rt.pruned.known("uid-g")


def test_a_gearset_deleted_mid_shift_is_forgotten_by_its_delete_handler() -> None:
    api = new_api()
    rt = api.runtime
    rt.gearsets.swap_hold((NS, "g"), "cooldown")
    body = {"metadata": {"name": "g", "namespace": NS}, "spec": {}, "status": {}}
    shifting.gearset_deleted(namespace=NS, name="g", body=body, memo=kopf.Memo(runtime=rt))  # type: ignore[arg-type]
    assert not rt.gearsets.known((NS, "g"))


def test_a_deleted_gpuprofile_is_forgotten_by_its_event() -> None:
    rt = Runtime()
    mem = rt.profiles
    mem.wrote("gpu-0", 7, {"phase": "Ready"})
    mem.ensure("gpu-0")
    mem.ensure("gpu-1")
    asyncio.run(nodes.gpuprofile_event_forget(type="MODIFIED", name="gpu-0", memo=kopf.Memo(runtime=rt)))  # type: ignore[arg-type]
    assert mem.known("gpu-0")
    asyncio.run(nodes.gpuprofile_event_forget(type="DELETED", name="gpu-0", memo=kopf.Memo(runtime=rt)))  # type: ignore[arg-type]
    assert not mem.known("gpu-0") and mem.written("gpu-0") is None and mem.ensured("gpu-1")


async def test_deleted_nodes_and_profiles_leave_no_print() -> None:
    rt = Runtime()
    memo = kopf.Memo(runtime=rt)
    node = {"metadata": {"name": "n1", "labels": {}}, "status": {"conditions": []}}
    await pdservice.fleet_node_changed(name="n1", body=node, type="ADDED", memo=memo)  # type: ignore[arg-type]
    profile = {"metadata": {"name": "n1"}, "spec": {"nodeName": "n1"}}
    await pdservice.fleet_profile_changed(name="n1", body=profile, type="ADDED", memo=memo)  # type: ignore[arg-type]
    assert "n1" in rt.fleet_prints.nodes and "n1" in rt.fleet_prints.profiles
    await pdservice.fleet_node_changed(name="n1", body=node, type="DELETED", memo=memo)  # type: ignore[arg-type]
    await pdservice.fleet_profile_changed(name="n1", body=profile, type="DELETED", memo=memo)  # type: ignore[arg-type]
    assert rt.fleet_prints.nodes == {} and rt.fleet_prints.profiles == {}
    assert rt.services.pending == {}  # no service known: nothing to reconcile


# --- gearshift operator builds it ------------------------------------------------------------------------
def test_the_flags_make_the_runtimes_settings() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(
        ["--prometheus-url", "http://prom:9090", "--router-image", "r:1", "--sim-image", "s:2"]
    )
    rt = build_runtime(args)
    assert rt.settings.prometheus_url == "http://prom:9090"
    assert (rt.settings.images.router, rt.settings.images.sim) == ("r:1", "s:2")
    assert rt.settings.images.vllm == Settings().images.vllm


#: ``gearshift operator`` as tests/e2e and dev/sandbox/harness.py start it (``handlers.main.run`` in a
#: fresh interpreter), with in-cluster credentials that load nothing, no CRD check and kopf.run recorded
#: (its keywords checked against kopf's own signature).
_OPERATOR = """
import argparse, inspect, json, sys
import kopf
from kubernetes import config
from gearshift.handlers import crds, main as m
loads = []
config.load_incluster_config = lambda: loads.append("in-cluster")
crds.check_installed_crds = lambda api: loads.append("crd check")
seen = {}
real_run = kopf.run
kopf.run = lambda **kw: (inspect.signature(real_run).bind(**kw), seen.update(kw))  # kopf's own keywords
p = argparse.ArgumentParser(); m.add_arguments(p)
rc = m.run(p.parse_args(sys.argv[1:]))
rt = seen["memo"]["runtime"]
print(json.dumps({
    "rc": rc, "runtime": type(rt).__module__ + "." + type(rt).__name__, "api": type(rt.api).__name__,
    "prometheus": rt.settings.prometheus_url, "loads": loads, "namespaces": seen["namespaces"],
    "modules": sorted(n for n in sys.modules if n.startswith("gearshift.handlers.")),
}))
"""


def test_gearshift_operator_hands_kopf_one_runtime_and_keeps_disabled_modules_off(tmp_path: Path) -> None:
    argv = [
        "--namespace", "team-a", "--probe-port", "0", "--metrics-port", "0",
        "--prometheus-url", "http://prom:9090",
        "--disable", "gearshift.handlers.gpuprofile", "--disable", "gearshift.handlers.nodes",
    ]  # fmt: skip
    env = {"PATH": "/usr/bin:/bin", "KUBECONFIG": str(tmp_path / "none"), "HOME": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", _OPERATOR, *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["rc"] == 0 and out["runtime"] == "gearshift.handlers.runtime.Runtime"
    assert out["api"] == "RestKubeApi" and out["loads"] == ["in-cluster", "crd check"]  # one API, built once
    assert out["prometheus"] == "http://prom:9090" and out["namespaces"] == ["team-a"]
    mods = set(out["modules"])
    for on in ("pdservice", "gearset", "shifting", "autoscale", "replicas"):
        assert f"gearshift.handlers.{on}" in mods
    assert not mods & {"gearshift.handlers.gpuprofile", "gearshift.handlers.nodes"}
