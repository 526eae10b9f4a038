"""The generated CRDs: committed YAML matches the models, the schemas are structural, CEL is bounded."""

from __future__ import annotations

import functools
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gearshift.api import crdgen

REPO = Path(__file__).resolve().parents[2]

#: Printer columns exactly as the API design lists them.
COLUMNS = {
    "GPUProfile": ["NODE", "GPU", "COUNT", "MEM(GiB)", "SCORE", "PHASE", "WINDOW", "AGE"],
    "GearSet": ["SERVICE", "ROLE", "ACTIVE", "TARGET", "PHASE", "REPLICAS", "READY", "P99(ms)", "QPS", "AGE"],
    "PDService": ["MODEL", "PREFILL", "DECODE", "SERVING", "ROUTER", "READY", "AGE"],
}
SHORT = {"GPUProfile": "gpup", "GearSet": "gs", "PDService": "pds"}


def committed(directory: str) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted((REPO / directory).glob("*.yaml"))}


@pytest.mark.parametrize("directory", crdgen.CRD_DIRS)
def test_committed_crds_match_the_models(directory: str) -> None:
    """Drift test: regenerate and compare; on failure run `make crds`."""
    assert committed(directory) == crdgen.rendered(), (
        f"{directory} is stale: run `gearshift crds --out {directory}`"
    )


def test_cli_prints_the_same_yaml() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "gearshift.cli", "crds"], check=True, capture_output=True, text=True
    ).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    assert [d["spec"]["names"]["kind"] for d in docs] == ["GPUProfile", "GearSet", "PDService"]


@functools.cache
def crds() -> dict[str, dict[str, Any]]:
    # Parsed once: YAML parsing dominates this file's run time. Tests only read the result.
    return {k.kind: yaml.safe_load(crdgen.render(k)) for k in crdgen.KINDS}


def walk(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from walk(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}{{}}")


@pytest.mark.parametrize("kind", list(COLUMNS))
class TestCRD:
    def test_names_scope_and_category(self, kind: str) -> None:
        spec = crds()[kind]["spec"]
        assert spec["group"] == "gearshift.io"
        assert spec["names"]["shortNames"] == [SHORT[kind]]
        assert spec["names"]["categories"] == ["gearshift"]
        assert spec["scope"] == ("Cluster" if kind == "GPUProfile" else "Namespaced")

    def test_printer_columns(self, kind: str) -> None:
        version = crds()[kind]["spec"]["versions"][0]
        assert [c["name"] for c in version["additionalPrinterColumns"]] == COLUMNS[kind]
        schema = version["schema"]["openAPIV3Schema"]
        for col in version["additionalPrinterColumns"]:
            # Every column's path must exist in the schema, or kubectl prints <none> forever.
            parts = col["jsonPath"].split("[?")[0].strip(".").split(".")
            if parts[0] == "metadata":
                continue
            node = schema
            for part in parts:
                node = node["properties"][part]
                node = node.get("items", node)
            assert node["type"] in ("string", "integer", "number", "boolean", "array", "object"), col

    def test_status_subresource(self, kind: str) -> None:
        sub = crds()[kind]["spec"]["versions"][0]["subresources"]
        assert sub["status"] == {}
        if kind == "GearSet":
            assert sub["scale"]["specReplicasPath"] == ".spec.replicas"

    def test_schema_is_structural(self, kind: str) -> None:
        schema = crds()[kind]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        for path, node in walk(schema):
            assert not {"$ref", "anyOf", "oneOf", "allOf", "not", "title", "const", "prefixItems"} & set(
                node
            ), path
            assert (
                "type" in node
                or node.get("x-kubernetes-int-or-string")
                or node.get("x-kubernetes-preserve-unknown-fields")
            ), f"{path} has no type"
            assert not ("properties" in node and "additionalProperties" in node), path
            assert not isinstance(node.get("additionalProperties"), bool), path
            if node.get("x-kubernetes-list-type") == "map":
                item = node["items"]
                for key in node["x-kubernetes-list-map-keys"]:
                    assert key in item.get("required", []) or "default" in item["properties"][key], path

    def test_spec_lists_and_strings_are_bounded_for_cel_cost(self, kind: str) -> None:
        spec = crds()[kind]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
        for path, node in walk(spec):
            if node.get("type") == "array":
                assert "maxItems" in node, f"spec{path} needs maxItems"
            if node.get("type") == "string":
                assert "maxLength" in node or "enum" in node, f"spec{path} needs maxLength"
            if node.get("type") == "object" and "additionalProperties" in node:
                assert "maxProperties" in node, f"spec{path} needs maxProperties"

    def test_cel_rules_have_messages_and_valid_field_paths(self, kind: str) -> None:
        schema = crds()[kind]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        rules = 0
        for path, node in walk(schema):
            for rule in node.get("x-kubernetes-validations", []):
                rules += 1
                assert rule["message"] and rule["rule"], path
                if "fieldPath" in rule:
                    field = rule["fieldPath"].lstrip(".").split(".")[0]
                    assert field in node["properties"], f"{path}: fieldPath {rule['fieldPath']}"
                    assert field in rule["message"] or field in rule["rule"], path
        assert rules > 0

    def test_defaults_appear_in_the_schema(self, kind: str) -> None:
        schema = crds()[kind]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        defaults = {path: node["default"] for path, node in walk(schema) if "default" in node}
        expected = {
            "GearSet": {
                ".spec.policy.sampleIntervalS": 2.0,
                ".spec.policy.emaAlpha": 0.3,
                ".spec.policy.dwellS": 600.0,
                ".spec.policy.p99LowRatio": 0.7,
                ".spec.mode": "explicit",
            },
            "PDService": {
                ".spec.slo.ttftMs": 200.0,
                ".spec.slo.itlMs": 50.0,
                ".spec.router.policy": "pd-score",
            },
            "GPUProfile": {},
        }[kind]
        for path, value in expected.items():
            assert defaults[path] == value, path
        assert None not in defaults.values()
        if kind == "GearSet":
            # A nested object's default is whole: the API server checks it against CEL before nested defaults.
            assert defaults[".spec.policy"]["imbalanceHighUtilization"] == 0.9


def test_gear_stage_rules_use_two_variable_comprehension() -> None:
    # Contiguity needs the index of each stage: cel-go's two-variable all(i, s, ...), in Kubernetes >= 1.32.
    gear = crds()["GearSet"]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"
    ]["gears"]["items"]
    assert any("all(i, s," in r["rule"] for r in gear["x-kubernetes-validations"])


def test_unsupported_union_is_refused() -> None:
    with pytest.raises(crdgen.CRDGenError, match="union"):
        crdgen.structural({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, {}, "x")


def test_int_or_string_union() -> None:
    out = crdgen.structural({"anyOf": [{"type": "integer"}, {"type": "string"}], "description": "d"}, {}, "x")
    assert out == {"description": "d", "x-kubernetes-int-or-string": True}
