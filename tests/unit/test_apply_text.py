"""apply_text: kubectl input that the API server reads back exactly as written."""

import json

import yaml

from gearshift.k8s.apply_text import apply_text


def test_digit_only_string_stays_a_string():
    node = {"apiVersion": "v1", "kind": "Node", "spec": {"taints": [{"key": "k", "value": "084543"}]}}
    # PyYAML writes this scalar unquoted, which Go's YAML reader takes for a number: the bug this avoids.
    assert "value: 084543" in yaml.safe_dump(node)
    assert json.loads(apply_text(node))["spec"]["taints"][0]["value"] == "084543"


def test_many_manifests_become_one_v1_list():
    docs = [{"kind": "ConfigMap", "metadata": {"name": "a"}}, {"kind": "Service", "metadata": {"name": "b"}}]
    parsed = json.loads(apply_text(docs))
    assert parsed["apiVersion"] == "v1" and parsed["kind"] == "List"
    assert parsed["items"] == docs
