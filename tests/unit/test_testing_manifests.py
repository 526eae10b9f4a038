"""The manifest builders tests and benchmarks share: kind and apiVersion from the API models, the spec
checked by them and sent exactly as written."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from gearshift import GROUP, VERSION
from gearshift.testing import manifests as build

GEARSET_SPEC: dict[str, Any] = {
    "serviceName": "svc",
    "role": "prefill",
    "mode": "explicit",
    "gears": [{"name": "p", "intent": "balanced", "microBatch": 4, "maxBatch": 64,
               "stages": [{"layers": [0, 16], "nodes": ["n1"], "gpuModel": "A10-24GB"}]}],
    "policy": {"sampleIntervalS": 1, "dwellS": 600},
}  # fmt: skip
MODEL = {"name": "m", "numLayers": 16, "hiddenSize": 2048, "numHeads": 32, "numKvHeads": 8, "headDim": 64,
         "intermediateSize": 8192, "vocabSize": 128256}  # fmt: skip
PDS_SPEC: dict[str, Any] = {
    "model": MODEL,
    "engine": "sim",
    "prefill": {"gearSetRef": {"name": "svc-prefill"}},
    "decode": {"gearSetRef": {"name": "svc-decode"}},
    "slo": {"ttftMs": 200, "itlMs": 50},
}


def test_a_gearset_is_the_hand_written_manifest() -> None:
    hand = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "GearSet",
        "metadata": {"name": "svc-prefill", "namespace": "ns"},
        "spec": GEARSET_SPEC,
    }
    built = build.gearset("svc-prefill", "ns", GEARSET_SPEC)
    # The same JSON to the letter (key order and whole numbers included: 600, not 600.0).
    assert json.dumps(built) == json.dumps(hand)


def test_a_pdservice_carries_extra_metadata_and_no_namespace_when_none() -> None:
    built = build.pdservice("svc", None, PDS_SPEC, annotations={"a": "b"})
    assert built == {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "PDService",
        "metadata": {"name": "svc", "annotations": {"a": "b"}},
        "spec": PDS_SPEC,
    }
    assert json.dumps(built["spec"]) == json.dumps(PDS_SPEC)


def test_a_gpuprofile_is_cluster_scoped() -> None:
    assert build.gpuprofile("gpu-a", {"nodeName": "gpu-a"}) == {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "GPUProfile",
        "metadata": {"name": "gpu-a"},
        "spec": {"nodeName": "gpu-a"},
    }


@pytest.mark.parametrize(
    "make",
    [
        lambda: build.gearset("g", "ns", {**GEARSET_SPEC, "mode": "sideways"}),
        lambda: build.gearset("g", "ns", {**GEARSET_SPEC, "unknownField": 1}),
        lambda: build.pdservice("s", "ns", {**PDS_SPEC, "engine": "tensorrt"}),
        lambda: build.gpuprofile("gpu-a", {"nodeName": "gpu-b"}),  # the name must be the node's
    ],
)
def test_what_the_models_refuse_is_refused_where_it_is_written(make: Any) -> None:
    with pytest.raises(ValidationError):
        make()
