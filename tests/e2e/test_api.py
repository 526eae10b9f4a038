"""The three CRDs on a real API server: install, examples, printer columns, subresources, bad input, and
the agreement of pydantic validation with the server's (schema + CEL) on random specs."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from gearshift.api import crdgen
from gearshift.api.common import format_validation_error
from gearshift.api.gearset import GearSet
from gearshift.api.gpuprofile import GPUProfile
from gearshift.api.pdservice import PDService
from gearshift.testing import manifests as build

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = ["gpuprofile.yaml", "gearset-explicit.yaml", "gearset-auto.yaml", "pdservice-llama3-8b.yaml"]
KIND_MODELS: dict[str, Any] = {"GPUProfile": GPUProfile, "GearSet": GearSet, "PDService": PDService}
PLURALS = {k.kind: k.plural for k in crdgen.KINDS}


def _unit_cases() -> Any:
    # The bad-input table lives with the unit tests, which check pydantic against the same cases.
    path = REPO / "tests" / "unit" / "test_api_models.py"
    spec = importlib.util.spec_from_file_location("gearshift_test_api_models", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CASES = _unit_cases()


@pytest.fixture(scope="module")
def crds(sandbox: Any, establish_crds: Any) -> Any:
    """The generated CRDs applied (``kubectl apply -f crds/``) and established."""
    establish_crds(sandbox)
    return sandbox


@pytest.fixture(scope="module")
def api_ns(crds: Any) -> Iterator[str]:
    """One namespace for this module's objects (no pods run in it), deleted afterwards."""
    name = f"e2e-api-{uuid.uuid4().hex[:6]}"
    crds.kubectl("create", "namespace", name)
    try:
        yield name
    finally:
        crds.kubectl("delete", "namespace", name, "--wait=false", check=False)


def header(output: str) -> list[str]:
    return output.splitlines()[0].split()


class TestInstall:
    def test_examples_apply_and_show_the_columns(self, crds: Any, api_ns: str) -> None:
        # examples/ also holds non-Kubernetes inputs (fleet and planner files), so the files are named.
        files = [arg for name in EXAMPLES[1:] for arg in ("-f", str(REPO / "examples" / name))]
        crds.kubectl("apply", "-n", api_ns, *files)
        # GPUProfiles are cluster-scoped and named after nodes; a server dry-run leaves real profiles alone.
        crds.kubectl("apply", "--dry-run=server", "-f", str(REPO / "examples" / EXAMPLES[0]))

        out = crds.kubectl("get", "gearshift", "-n", api_ns).stdout
        assert "gearset.gearshift.io/llama3-8b-prefill" in out
        assert "pdservice.gearshift.io/llama3-8b" in out
        gs = crds.kubectl("get", "gs", "-n", api_ns).stdout
        assert header(gs) == [
            "NAME", "SERVICE", "ROLE", "ACTIVE", "TARGET", "PHASE",
            "REPLICAS", "READY", "P99(MS)", "QPS", "AGE",
        ]  # fmt: skip
        pds = crds.kubectl("get", "pds", "-n", api_ns).stdout
        assert header(pds) == ["NAME", "MODEL", "PREFILL", "DECODE", "SERVING", "ROUTER", "READY", "AGE"]
        assert "meta-llama/Meta-Llama-3-8B" in pds and "pd-score" in pds

    def test_the_aggregated_example_applies(self, crds: Any, api_ns: str) -> None:
        # spec.serving alone and a GearSet of role both pass the server's schema and CEL rules.
        crds.kubectl(
            "apply", "-n", api_ns, "-f", str(REPO / "examples" / "vllm" / "tiny-llama-aggregated.yaml")
        )
        obj = crds.kubectl_json("get", "pds", "tiny-llama-agg", "-n", api_ns)
        assert obj["spec"]["serving"] == {"gearSetRef": {"name": "tiny-llama-agg"}}
        assert "prefill" not in obj["spec"] and "decode" not in obj["spec"]
        assert crds.kubectl_json("get", "gs", "tiny-llama-agg", "-n", api_ns)["spec"]["role"] == "both"

    def test_server_fills_the_model_defaults(self, crds: Any, api_ns: str) -> None:
        crds.kubectl("apply", "-n", api_ns, "-f", str(REPO / "examples" / "gearset-auto.yaml"))
        obj = crds.kubectl_json("get", "gs", "llama3-8b-decode", "-n", api_ns)
        policy = obj["spec"]["policy"]
        assert (policy["sampleIntervalS"], policy["emaAlpha"], policy["enterSamples"]) == (2, 0.3, 3)
        assert obj["spec"]["plan"]["constraints"]["linkUtilizationCap"] == 0.7
        # What the server stored parses back to what pydantic makes of the same input.
        local = GearSet.model_validate(yaml.safe_load((REPO / "examples" / "gearset-auto.yaml").read_text()))
        assert GearSet.model_validate(obj).spec == local.spec

    def test_status_subresource_feeds_the_columns(self, crds: Any, api_ns: str) -> None:
        crds.kubectl("apply", "-n", api_ns, "-f", str(REPO / "examples" / "gearset-explicit.yaml"))
        status = {
            "status": {
                "phase": "Stable",
                "activeGear": "balanced",
                "targetGear": "balanced",
                "replicas": 1,
                "readyCopies": 4,
                "desiredCopies": 4,
                "ready": "4/4",
                "signals": {"qps": 12.5, "p99Ms": 180.25, "stageUtilization": [0.5, 0.6, 0.4, 0.55]},
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "Reconciled",
                        "message": "",
                        "lastTransitionTime": "2025-01-01T00:00:00Z",
                    }
                ],
            }
        }
        crds.kubectl(
            "patch", "gs", "llama3-8b-prefill", "-n", api_ns, "--subresource=status", "--type=merge",
            "-p", json.dumps(status),
        )  # fmt: skip
        row = crds.kubectl("get", "gs", "llama3-8b-prefill", "-n", api_ns, "--no-headers").stdout.split()
        # REPLICAS is spec.replicas (the example's default 1, pipeline replicas), READY status.ready
        # (serving copies of the model, ready/wanted).
        assert row[:9] == [
            "llama3-8b-prefill",
            "llama3-8b",
            "prefill",
            "balanced",
            "balanced",
            "Stable",
            "1",
            "4/4",
            "180.25",
        ]
        assert row[9] == "12.5"
        # A status written through the subresource parses with the status model.
        obj = crds.kubectl_json("get", "gs", "llama3-8b-prefill", "-n", api_ns)
        assert GearSet.model_validate(obj).status.signals.stage_utilization == [0.5, 0.6, 0.4, 0.55]  # type: ignore[union-attr]

    def test_scale_subresource_sets_pipeline_replicas(self, crds: Any, api_ns: str) -> None:
        crds.kubectl("apply", "-n", api_ns, "-f", str(REPO / "examples" / "gearset-explicit.yaml"))
        crds.kubectl("scale", "gs", "llama3-8b-prefill", "-n", api_ns, "--replicas=3")
        obj = crds.kubectl_json("get", "gs", "llama3-8b-prefill", "-n", api_ns)
        assert obj["spec"]["replicas"] == 3

    def test_gpuprofile_columns_show_the_status(self, crds: Any) -> None:
        # A profile of a node that does not exist, so the probe's real profiles are left alone.
        name = f"gpu-e2e-api-{uuid.uuid4().hex[:6]}"
        crds.apply(build.gpuprofile(name, {"nodeName": name}))
        try:
            status = {
                "gpuModel": "A100-40GB",
                "gpuCount": 2,
                "memoryGiB": 40,
                "computeScore": 0.54,
                "phase": "Ready",
            }
            crds.kubectl(
                "patch",
                "gpup",
                name,
                "--subresource=status",
                "--type=merge",
                "-p",
                json.dumps({"status": status}),
            )
            out = crds.kubectl("get", "gpup", name).stdout
            assert header(out) == [
                "NAME",
                "NODE",
                "GPU",
                "COUNT",
                "MEM(GIB)",
                "SCORE",
                "PHASE",
                "WINDOW",
                "AGE",
            ]
            assert out.splitlines()[1].split()[:7] == [name, name, "A100-40GB", "2", "40", "0.54", "Ready"]
        finally:
            crds.kubectl("delete", "gpup", name, "--wait=false", check=False)


@pytest.mark.parametrize(
    ("case", "example", "path", "value", "word"), CASES.BAD_CASES, ids=[c[0] for c in CASES.BAD_CASES]
)
def test_bad_input_is_rejected_at_apply_naming_the_field(
    crds: Any, api_ns: str, case: str, example: str, path: str, value: Any, word: str
) -> None:
    body = CASES.bad_body(example, path, value)
    # A fresh name, so the server reports the create (not a patch that would echo the whole body back).
    body["metadata"]["name"] = body["metadata"]["name"] if body["kind"] != "GearSet" else f"bad-{case}"[:63]
    proc = crds.kubectl("apply", "-n", api_ns, "-f", "-", input=json.dumps(body), check=False)
    assert proc.returncode != 0, f"{case} was accepted: {proc.stdout}"
    assert word in proc.stderr, f"{case}: the error does not name {word!r}: {proc.stderr}"
    if case == "gs-unknown-field":
        assert "unknown field" in proc.stderr


def test_object_rules_name_the_offending_values(crds: Any, api_ns: str) -> None:
    # A rule on an object prints `Invalid value: "object"`; its messageExpression says what was given.
    gs = CASES.bad_body("gearset-explicit.yaml", "spec.gears[0].microBatch", 64)
    gs["metadata"]["name"] = "bad-values-gs"
    max_batch = gs["spec"]["gears"][0]["maxBatch"]
    proc = crds.kubectl("apply", "-n", api_ns, "-f", "-", input=json.dumps(gs), check=False)
    assert proc.returncode != 0
    assert f"microBatch (64) must be <= maxBatch ({max_batch})" in proc.stderr, proc.stderr

    pds = CASES.bad_body("pdservice-llama3-8b.yaml", "spec.router.weights.decode.itl", 0.5)
    w = pds["spec"]["router"]["weights"]["decode"]
    # Summed in the rule's order, and printed as the shortest round-trip form (as CEL's string() does).
    total = w["itl"] + w["memory"] + w["batch"] + w["bandwidth"] + w["network"]
    proc = crds.kubectl("apply", "-n", api_ns, "-f", "-", input=json.dumps(pds), check=False)
    assert proc.returncode != 0
    assert f"must sum to 1; got {total!r}" in proc.stderr, proc.stderr


# --- agreement: pydantic-valid <=> accepted by the API server ------------------------------------------
# Each generator makes a valid spec and then, each with a small probability, one of many mistakes, so that
# about half of the specs are valid and the invalid ones differ from a valid one in one or two places.
def _floats(lo: float, hi: float) -> st.SearchStrategy[float]:
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False)


def rare(draw: st.DrawFn, p: float = 0.06) -> bool:
    """True with probability about ``p``: whether to make one particular mistake.

    Drawn from the top of an integer range: hypothesis favours 0 and the ends of float ranges, so
    ``floats(0, 1) < p`` would fire far more often than ``p``.
    """
    return draw(st.integers(0, 999)) >= 1000 - round(p * 1000)


@st.composite
def stages(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Contiguous stages from layer 0; rarely a nudge that overlaps, gaps, empties or mis-starts a range."""
    cuts = sorted(draw(st.sets(st.integers(1, 39), min_size=0, max_size=5)))
    end = draw(st.integers((cuts[-1] + 1) if cuts else 1, 40))
    bounds = [0, *cuts, end]
    out: list[dict[str, Any]] = [{"layers": [bounds[i], bounds[i + 1]]} for i in range(len(bounds) - 1)]
    if rare(draw, 0.1):
        k = draw(st.integers(0, len(out) - 1))
        out[k]["layers"][draw(st.integers(0, 1))] += draw(st.sampled_from([-2, -1, 1, 2]))
    if rare(draw):
        out[0]["layers"].append(end)
    for s in out:
        if draw(st.booleans()):
            s["replicas"] = draw(st.integers(-1, 0)) if rare(draw) else draw(st.integers(1, 3))
        if rare(draw, 0.2):
            s["gpus"] = draw(st.sampled_from([0, 17])) if rare(draw, 0.3) else draw(st.integers(1, 8))
        if rare(draw, 0.2):
            value = "bad value!" if rare(draw, 0.3) else draw(st.sampled_from(["H100-80GB", "A10-24GB"]))
            s["nodeSelector"] = {"gearshift.io/gpu-model": value}
        if rare(draw, 0.2):
            s["nodes"] = draw(st.lists(st.sampled_from(["gpu-h100-0", "gpu-a10-1"]), max_size=2))
    return out


@st.composite
def gears(draw: st.DrawFn) -> list[dict[str, Any]]:
    pool = ["latency", "balanced", "throughput", "g-1"]
    names = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3, unique=True))
    if rare(draw):
        names.append(names[0])  # duplicate name
    if rare(draw):
        names[0] = draw(st.sampled_from(["a-very-long-gear-name", "Bad", "-x"]))
    out = []
    for name in names:
        gear: dict[str, Any] = {"name": name, "stages": draw(stages())}
        max_batch = draw(st.integers(1, 64))
        if draw(st.booleans()):
            gear["maxBatch"] = max_batch
        if draw(st.booleans()) or rare(draw):
            micro = draw(st.integers(1, max_batch)) if not rare(draw, 0.1) else draw(st.integers(0, 300))
            gear["microBatch"] = micro
        if draw(st.booleans()):
            intents = ["latency", "balanced", "throughput"]
            gear["intent"] = "turbo" if rare(draw) else draw(st.sampled_from(intents))
        if rare(draw, 0.3):
            low = draw(_floats(0, 50))
            pair = [low, draw(_floats(low, 60))]
            if rare(draw, 0.3):
                pair = [pair[1] + 1, pair[0]] if not rare(draw, 0.3) else pair[:1]
            gear["qpsRange"] = pair
        if rare(draw, 0.2):
            gear["targetLatencyMs"] = draw(_floats(-10, 0)) if rare(draw, 0.3) else draw(_floats(1, 500))
        out.append(gear)
    return out


@st.composite
def gearset_specs(draw: st.DrawFn) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "serviceName": draw(st.sampled_from(["x" * 25, "Bad_Name"])) if rare(draw) else "llama3-8b",
        "role": "encode" if rare(draw) else draw(st.sampled_from(["prefill", "decode"])),
    }
    auto = draw(st.integers(0, 3)) == 0
    if auto or draw(st.booleans()):
        spec["mode"] = "auto" if auto else "explicit"
    if not auto or rare(draw):
        gear_list = draw(gears())
        spec["gears"] = [] if rare(draw) else gear_list
    if (auto and draw(st.booleans())) or rare(draw):
        plan: dict[str, Any] = {}
        if draw(st.booleans()):
            intents = draw(
                st.lists(st.sampled_from(["latency", "balanced", "throughput"]), min_size=1, unique=True)
            )
            plan["intents"] = intents + intents[:1] if rare(draw) else intents
        if draw(st.booleans()):
            lo = draw(st.integers(1, 8))
            hi = draw(st.integers(lo, 12)) if not rare(draw, 0.2) else draw(st.integers(0, lo - 1))
            plan["constraints"] = {"minStages": lo, "maxStages": hi}
        spec["plan"] = plan
    gear_names = [g["name"] for g in spec.get("gears", [])]
    for key in ("initialGear", "forceGear"):
        if rare(draw, 0.3):
            spec[key] = "nope" if rare(draw, 0.3) or not gear_names else draw(st.sampled_from(gear_names))
    if draw(st.booleans()):
        low_u = draw(_floats(0, 0.85))
        low_r = draw(_floats(0.05, 1.0))
        policy = {
            "emaAlpha": draw(_floats(0.01, 1)),
            "imbalanceLowUtilization": low_u,
            "imbalanceHighUtilization": draw(_floats(low_u + 0.01, 1)),
            "p99LowRatio": low_r,
            "p99HighRatio": draw(_floats(low_r + 0.01, 3)),
            "enterSamples": draw(st.integers(1, 5)),
        }
        if rare(draw, 0.3):
            key = draw(st.sampled_from(sorted(policy)))
            policy[key] = draw(st.sampled_from([-0.5, 0.0, 1.5, 2.5]))
        spec["policy"] = {k: v for k, v in policy.items() if draw(st.booleans())}
    if rare(draw, 0.2):
        spec["replicas"] = draw(st.integers(-1, 3))
    return {
        "apiVersion": "gearshift.io/v1alpha1",
        "kind": "GearSet",
        "metadata": {"name": "agree"},
        "spec": spec,
    }


SEED_PREFILL = {"compute": 0.30, "load": 0.25, "queue": 0.20, "network": 0.15, "cache": 0.10}
SEED_DECODE = {"itl": 0.35, "memory": 0.25, "batch": 0.20, "bandwidth": 0.15, "network": 0.05}


@st.composite
def weights(draw: st.DrawFn, seed: dict[str, float]) -> dict[str, float]:
    """The PD guide's weights (docs/sources.md#prefill-score), random weights normalised to sum 1 (float
    rounding included), or a broken set."""
    how = draw(st.sampled_from(["seed", "normalised", "normalised", "random", "partial"]))
    if how == "seed":
        return dict(seed)
    if how == "partial":
        return {k: v for k, v in seed.items() if draw(st.booleans())}
    raw = {k: draw(_floats(0.0, 1.0)) for k in seed}
    total = sum(raw.values())
    if how == "normalised" and total > 0:
        raw = {k: v / total for k, v in raw.items()}
    return raw


@st.composite
def pdservice_specs(draw: st.DrawFn) -> dict[str, Any]:
    model: dict[str, Any] = {"name": "meta-llama/Meta-Llama-3-8B"}
    if draw(st.integers(0, 3)) == 0:
        cfg = dict(CASES.LLAMA_CONFIG)
        if draw(st.booleans()):
            cfg["num_key_value_heads"] = draw(st.sampled_from([1, 2, 4, 8, 32])) if not rare(draw, 0.5) else 7
        if rare(draw, 0.15):
            del cfg["vocab_size"]
        if rare(draw, 0.15):
            model["numLayers"] = 32  # both forms
        model["hfConfig"] = cfg
    else:
        arch = {
            "numLayers": 32,
            "hiddenSize": 4096,
            "numHeads": 32,
            "intermediateSize": 14336,
            "vocabSize": 128256,
        }
        if rare(draw, 0.15):
            del arch[draw(st.sampled_from(sorted(arch)))]
        model.update(arch)
        if draw(st.booleans()):
            model["numKvHeads"] = draw(st.sampled_from([1, 2, 4, 8, 32])) if not rare(draw, 0.5) else 7
        if rare(draw, 0.4):
            experts = draw(st.integers(1, 8))
            model["numExperts"] = experts
            model["expertsPerToken"] = draw(st.integers(1, experts)) if not rare(draw, 0.5) else experts + 1
    spec: dict[str, Any] = {
        "model": model,
        "prefill": {"gearSetRef": {"name": "p"}},
        "decode": {"gearSetRef": {"name": "p" if rare(draw, 0.15) else "d"}},
    }
    if rare(draw, 0.15):
        del spec[draw(st.sampled_from(["prefill", "decode"]))]["gearSetRef"]
    if rare(draw, 0.3):  # aggregated: serving alone; rarely beside a PD section, or neither shape
        spec["serving"] = {"gearSetRef": {"name": "s"}}
        for section in ("prefill", "decode"):
            if not rare(draw, 0.15):
                del spec[section]
    elif rare(draw, 0.06):
        del spec[draw(st.sampled_from(["prefill", "decode"]))]
    if draw(st.booleans()):
        low = draw(st.integers(0, 4))
        high = (
            draw(st.integers(max(low, 1), 6))
            if not rare(draw, 0.4)
            else draw(st.integers(0, max(low - 1, 0)))
        )
        spec[next(r for r in ("decode", "serving", "prefill") if r in spec)]["scaling"] = {
            "minReplicas": low,
            "maxReplicas": high,
        }
    if draw(st.booleans()):
        policies = ["pd-score", "shortest-queue", "lottery", "round-robin"]
        spec["router"] = {
            "policy": "random" if rare(draw, 0.15) else draw(st.sampled_from(policies)),
            "weights": {"prefill": draw(weights(SEED_PREFILL)), "decode": draw(weights(SEED_DECODE))},
        }
    if draw(st.booleans()):
        spec["slo"] = {"ttftMs": draw(_floats(-5, 400)) if rare(draw, 0.5) else draw(_floats(1, 400))}
    if rare(draw, 0.5):
        spec["engine"] = "tensorrt" if rare(draw, 0.5) else draw(st.sampled_from(["vllm", "sim"]))
    if rare(draw, 0.5):
        spec["prometheusUrl"] = "prometheus:9090" if rare(draw, 0.5) else "http://127.0.0.1:9090"
    name = "a-name-of-exactly-25-char" if rare(draw, 0.15) else "agree"
    return {
        "apiVersion": "gearshift.io/v1alpha1",
        "kind": "PDService",
        "metadata": {"name": name},
        "spec": spec,
    }


@st.composite
def gpuprofile_specs(draw: st.DrawFn) -> dict[str, Any]:
    override: dict[str, Any] = {}
    if draw(st.booleans()):
        override["memoryGiB"] = draw(_floats(-1, 0)) if rare(draw, 0.2) else draw(_floats(0.5, 200))
    if draw(st.booleans()):
        override["maxMicroBatch"] = draw(st.integers(-1, 0)) if rare(draw, 0.2) else draw(st.integers(1, 64))
    if draw(st.booleans()):
        times = ["2030-01-01T18:00:00Z", "2030-01-01T18:00:00.5+02:00", "2025-02-30T00:00:00Z", "tomorrow"]
        override["availableUntil"] = draw(st.sampled_from(times))
    if draw(st.booleans()):
        override["computeClass"] = (
            "huge" if rare(draw, 0.2) else draw(st.sampled_from(["high", "mid", "low"]))
        )
    spec: dict[str, Any] = {"nodeName": "gpu-other-1" if rare(draw, 0.1) else "gpu-agree-0"}
    if override or draw(st.booleans()):
        spec["override"] = override
    meta = {"name": "gpu-agree-0"}
    return {"apiVersion": "gearshift.io/v1alpha1", "kind": "GPUProfile", "metadata": meta, "spec": spec}


def pydantic_verdict(body: dict[str, Any]) -> tuple[bool, str]:
    try:
        KIND_MODELS[body["kind"]].model_validate(body)
    except ValidationError as exc:
        return False, format_validation_error(exc)
    return True, ""


def server_verdict(api: Any, namespace: str, body: dict[str, Any]) -> tuple[bool, str]:
    from kubernetes.client.exceptions import ApiException

    plural = PLURALS[body["kind"]]
    try:
        if body["kind"] == "GPUProfile":
            api.create_cluster_custom_object(
                "gearshift.io", "v1alpha1", plural, body, dry_run="All", field_validation="Strict"
            )
        else:
            api.create_namespaced_custom_object(
                "gearshift.io", "v1alpha1", namespace, plural, body, dry_run="All", field_validation="Strict"
            )
    except ApiException as exc:
        if exc.status in (400, 422):
            return False, str(exc.body)
        raise
    return True, ""


@pytest.mark.parametrize(
    ("kind", "strategy", "examples"),
    [
        ("GearSet", gearset_specs(), 150),
        ("PDService", pdservice_specs(), 150),
        ("GPUProfile", gpuprofile_specs(), 60),
    ],
)
def test_pydantic_and_api_server_agree(
    crds: Any, api_ns: str, kind: str, strategy: Any, examples: int
) -> None:
    """Random specs are valid in pydantic exactly when the API server (schema + CEL) accepts them.

    ``GEARSHIFT_AGREEMENT_SCALE=10`` runs ten times the examples (a longer hunt for disagreements).
    """
    from kubernetes import client

    api = client.CustomObjectsApi(crds.api_client())
    verdicts: list[bool] = []

    @settings(
        max_examples=examples * int(os.environ.get("GEARSHIFT_AGREEMENT_SCALE", "1")),
        deadline=None,
        database=None,
        # One fixed sample per CI run: a random one of 60 GPUProfiles once held 6 invalid (the bound below
        # needs 9); GEARSHIFT_AGREEMENT_SCALE still widens the hunt.
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(body=strategy)
    def check(body: dict[str, Any]) -> None:
        ours, why_ours = pydantic_verdict(body)
        theirs, why_theirs = server_verdict(api, api_ns, body)
        assert ours == theirs, (
            f"pydantic {'accepts' if ours else 'rejects'} but the API server "
            f"{'accepts' if theirs else 'rejects'}:\n{json.dumps(body)}\n"
            f"pydantic: {why_ours}\nserver: {why_theirs}"
        )
        verdicts.append(ours)

    check()
    accepted = sum(verdicts)
    # Both outcomes must be well represented, or the test would prove little.
    assert accepted >= math.ceil(0.15 * len(verdicts)), f"{kind}: only {accepted}/{len(verdicts)} valid"
    assert len(verdicts) - accepted >= math.ceil(0.15 * len(verdicts)), (
        f"{kind}: {accepted}/{len(verdicts)} valid"
    )
