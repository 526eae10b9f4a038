"""The pydantic models of GPUProfile, GearSet and PDService: defaults, names, conversions, bad input."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from gearshift.api.common import MAX_GEAR_NAME, SpecError, format_validation_error, parse
from gearshift.api.gearset import Gear, GearSet, GearSetSpec, GearSetStatus
from gearshift.api.gearset_status import ShiftRecord
from gearshift.api.gpuprofile import GPUProfile, GPUProfileStatus
from gearshift.api.modelspec import ModelSpec
from gearshift.api.pdservice import PDService, PDServiceSpec, SLOSpec
from gearshift.api.routerspec import RouterSpec
from gearshift.api.shift_policy import ShiftPolicy
from gearshift.facts.model import load_hf_config

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
LLAMA_CONFIG: dict[str, Any] = json.loads((EXAMPLES / "models" / "llama-3-8b.json").read_text())
KIND_MODELS = {"GPUProfile": GPUProfile, "GearSet": GearSet, "PDService": PDService}


def load_example(name: str) -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / name).read_text())


def set_path(obj: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A deep copy of ``obj`` with ``path`` (``a.b[1].c``) set to ``value`` (or deleted: ``DELETE``)."""
    out = copy.deepcopy(obj)
    keys: list[str | int] = []
    for part in path.split("."):
        name, *indexes = part.replace("]", "").split("[")
        keys.append(name)
        keys.extend(int(i) for i in indexes)
    node: Any = out
    for key in keys[:-1]:
        node = node[key]
    if value is DELETE:
        del node[keys[-1]]
    else:
        node[keys[-1]] = value
    return out


DELETE = object()


class TestDefaults:
    """Defaults are DESIGN.md's numbers (docs/sources.md#flexpipe for shifting, docs/sources.md#pd-scheduling
    for the router and SLOs)."""

    def test_shift_policy_defaults_are_seed_002(self) -> None:
        p = ShiftPolicy()
        assert (p.sample_interval_s, p.ema_alpha, p.enter_samples, p.exit_samples) == (2.0, 0.3, 3, 3)
        assert p.dwell_s == 10 * 60
        assert (p.imbalance_high_utilization, p.imbalance_low_utilization) == (0.9, 0.6)
        assert (p.p99_high_ratio, p.p99_low_ratio) == (1.2, 0.7)
        assert p.warmup_share == 0.2

    def test_link_cap_is_seventy_percent(self) -> None:
        spec = GearSetSpec.model_validate({"serviceName": "s", "role": "decode", "mode": "auto", "plan": {}})
        assert spec.plan is not None
        assert spec.plan.constraints.link_utilization_cap == 0.7
        assert spec.plan.intents == ["latency", "balanced", "throughput"]

    def test_router_weights_are_seed_000(self) -> None:
        w = RouterSpec().weights
        assert (w.prefill.compute, w.prefill.load, w.prefill.queue, w.prefill.network, w.prefill.cache) == (
            0.30,
            0.25,
            0.20,
            0.15,
            0.10,
        )
        assert (w.decode.itl, w.decode.memory, w.decode.batch, w.decode.bandwidth, w.decode.network) == (
            0.35,
            0.25,
            0.20,
            0.15,
            0.05,
        )
        assert RouterSpec().policy == "pd-score"

    def test_slo_defaults(self) -> None:
        assert (SLOSpec().ttft_ms, SLOSpec().itl_ms) == (200.0, 50.0)


class TestNames:
    def test_json_names_are_camel_case_with_units(self) -> None:
        gs = GearSet.model_validate(load_example("gearset-explicit.yaml"))
        dumped = gs.spec.to_json()
        assert "serviceName" in dumped and "initialGear" in dumped
        assert {"sampleIntervalS", "emaAlpha", "dwellS", "p99HighRatio", "warmupShare"} <= set(
            dumped["policy"]
        )
        assert dumped["gears"][0]["microBatch"] == 2 and dumped["gears"][0]["maxBatch"] == 32
        status = GPUProfileStatus(memory_gib=80, hbm_gbps=3350, matmul_tflops=900.0)
        dumped = status.to_json()
        assert (dumped["memoryGiB"], dumped["hbmGBps"], dumped["matmulTflops"]) == (80, 3350, 900.0)
        assert "memory_gib" not in dumped

    def test_python_names_are_accepted_too(self) -> None:
        a = SLOSpec(ttft_ms=150, itl_ms=40)
        b = SLOSpec.model_validate({"ttftMs": 150, "itlMs": 40})
        assert a == b

    def test_spec_models_are_frozen(self) -> None:
        with pytest.raises(ValidationError, match="frozen"):
            SLOSpec().ttft_ms = 1.0  # type: ignore[misc]

    def test_history_uses_from_and_to(self) -> None:
        rec = ShiftRecord.model_validate(
            {"from": "balanced", "to": "latency", "trigger": "p99-high", "startedAt": "2025-01-01T00:00:00Z"}
        )
        assert (rec.from_gear, rec.to_gear) == ("balanced", "latency")
        assert rec.to_json()["from"] == "balanced"

    def test_spec_round_trips_through_json(self) -> None:
        for name, kind in (("gearset-explicit.yaml", GearSet), ("pdservice-llama3-8b.yaml", PDService)):
            obj = kind.model_validate(load_example(name))
            again = kind.model_validate(json.loads(json.dumps(obj.to_json())))
            assert again.spec == obj.spec

    def test_status_ignores_unknown_keys(self) -> None:
        # kopf stores handler results in status; reading them back must not fail.
        status = GearSetStatus.model_validate({"activeGear": "balanced", "kopf": {"progress": {}}})
        assert status.active_gear == "balanced"

    def test_max_gear_name_leaves_room_in_statefulset_names(self) -> None:
        longest = "x" * 24 + "-prefill-" + "g" * MAX_GEAR_NAME + "-s63"
        assert len(longest) <= 52


class TestModelSpec:
    LLAMA = REPO / "examples" / "models" / "llama-3-8b.json"

    def test_numbers_convert_to_the_same_arch_as_the_hf_config(self) -> None:
        pds = PDService.model_validate(load_example("pdservice-llama3-8b.yaml"))
        from_numbers = pds.spec.model.to_model_arch()
        from_file = load_hf_config(self.LLAMA)
        assert from_numbers.num_layers == 32 and from_numbers.num_kv_heads == 8
        assert from_numbers.layer_weight_bytes == from_file.layer_weight_bytes
        assert from_numbers.kv_bytes_per_token == from_file.kv_bytes_per_token
        assert from_numbers.total_weight_bytes == from_file.total_weight_bytes
        # the context limit too: the demo's sim pods advertised their KV pool (54,400 tokens on an A10)
        assert from_numbers.max_position_embeddings == from_file.max_position_embeddings == 8192

    def test_the_context_limit_is_an_architecture_number_not_beside_hf_config(self) -> None:
        cfg = json.loads(self.LLAMA.read_text())
        with pytest.raises(ValueError, match="maxPositionEmbeddings"):
            ModelSpec.model_validate({"name": "m", "hfConfig": cfg, "maxPositionEmbeddings": 4096})

    def test_inline_hf_config_keeps_unknown_keys_and_converts(self) -> None:
        cfg = json.loads(self.LLAMA.read_text())
        spec = ModelSpec.from_hf_config("llama", cfg)
        assert spec.to_json()["hfConfig"]["rope_theta"] == 500000.0
        arch = spec.to_model_arch()
        assert arch == load_hf_config(self.LLAMA).__class__(
            **{**load_hf_config(self.LLAMA).__dict__, "name": "llama"}
        )

    def test_defaults_of_kv_heads_and_head_dim(self) -> None:
        spec = ModelSpec(
            name="m", num_layers=2, hidden_size=512, num_heads=8, intermediate_size=1024, vocab_size=1000
        )
        arch = spec.to_model_arch()
        assert (arch.num_kv_heads, arch.head_dim) == (8, 64)


class TestGear:
    def test_layer_accessors(self) -> None:
        gs = GearSet.model_validate(load_example("gearset-explicit.yaml"))
        balanced = gs.spec.gear("balanced")
        assert [s.num_layers for s in balanced.stages] == [12, 12, 4, 4]
        assert balanced.num_layers == 32
        balanced.check_model_layers(32)
        with pytest.raises(ValueError, match="last stage's layers end at 40"):
            balanced.check_model_layers(40)

    def test_auto_gearset_uses_planned_gears(self) -> None:
        body = load_example("gearset-auto.yaml")
        gear = {"name": "balanced", "stages": [{"layers": [0, 32]}]}
        body["status"] = {"plannedGears": [gear]}
        gs = GearSet.model_validate(body)
        assert [g.name for g in gs.gears()] == ["balanced"]
        assert gs.gears()[0] == Gear.model_validate(gear)


class TestGPUProfile:
    def test_override_wins_over_measurement(self) -> None:
        body = load_example("gpuprofile.yaml")
        body["status"] = {"memoryGiB": 24, "maxMicroBatch": 16, "computeScore": 0.126, "source": "probe"}
        eff = GPUProfile.model_validate(body).effective()
        assert eff.memory_gib == 20  # pinned
        assert eff.max_micro_batch == 4  # pinned
        assert eff.compute_score == 0.126  # measured, not pinned
        assert eff.source == "override"
        assert eff.available_until is not None and eff.available_until.year == 2030

    def test_no_override_keeps_status(self) -> None:
        body = {"metadata": {"name": "n"}, "spec": {"nodeName": "n"}, "status": {"memoryGiB": 80}}
        assert GPUProfile.model_validate(body).effective().memory_gib == 80


#: Invalid resources: (case id, example file, path to change, new value, a word the error must contain).
#: The e2e test sends the same cases to the API server (tests/e2e/test_api_bad_input.py).
BAD_CASES: list[tuple[str, str, str, Any, str]] = [
    ("gs-missing-role", "gearset-explicit.yaml", "spec.role", DELETE, "role"),
    ("gs-micro-batch-wrong-type", "gearset-explicit.yaml", "spec.gears[0].microBatch", "four", "microBatch"),
    ("gs-overlapping-stages", "gearset-explicit.yaml", "spec.gears[1].stages[1].layers", [10, 24], "stages"),
    ("gs-gap-between-stages", "gearset-explicit.yaml", "spec.gears[1].stages[1].layers", [14, 24], "stages"),
    ("gs-first-stage-not-at-0", "gearset-explicit.yaml", "spec.gears[1].stages[0].layers", [1, 12], "stages"),
    ("gs-empty-layer-range", "gearset-explicit.yaml", "spec.gears[1].stages[3].layers", [28, 28], "layers"),
    (
        "gs-layers-three-items",
        "gearset-explicit.yaml",
        "spec.gears[1].stages[0].layers",
        [0, 6, 12],
        "layers",
    ),
    ("gs-negative-replicas", "gearset-explicit.yaml", "spec.gears[0].stages[0].replicas", -1, "replicas"),
    ("gs-micro-batch-above-max", "gearset-explicit.yaml", "spec.gears[0].microBatch", 64, "microBatch"),
    ("gs-unknown-intent", "gearset-explicit.yaml", "spec.gears[0].intent", "turbo", "intent"),
    ("gs-duplicate-gear-names", "gearset-explicit.yaml", "spec.gears[2].name", "balanced", "gears"),
    ("gs-initial-gear-unknown", "gearset-explicit.yaml", "spec.initialGear", "cruise", "initialGear"),
    ("gs-explicit-without-gears", "gearset-explicit.yaml", "spec.gears", [], "gears"),
    ("gs-auto-with-gears", "gearset-explicit.yaml", "spec.mode", "auto", "gears"),
    ("gs-ema-alpha-above-1", "gearset-explicit.yaml", "spec.policy.emaAlpha", 1.5, "emaAlpha"),
    (
        "gs-imbalance-thresholds-inverted",
        "gearset-explicit.yaml",
        "spec.policy.imbalanceLowUtilization",
        0.95,
        "imbalanceLowUtilization",
    ),
    ("gs-gear-name-too-long", "gearset-explicit.yaml", "spec.gears[0].name", "a-very-long-gear-name", "name"),
    ("gs-qps-range-reversed", "gearset-explicit.yaml", "spec.gears[0].qpsRange", [8, 2], "qpsRange"),
    ("gs-unknown-field", "gearset-explicit.yaml", "spec.gears[0].stagez", [], "stagez"),
    ("gs-unknown-role", "gearset-auto.yaml", "spec.role", "encode", "role"),
    ("gs-plan-stage-bounds-inverted", "gearset-auto.yaml", "spec.plan.constraints.minStages", 9, "minStages"),
    ("pds-unknown-router-policy", "pdservice-llama3-8b.yaml", "spec.router.policy", "random", "policy"),
    (
        "pds-weights-not-summing-to-1",
        "pdservice-llama3-8b.yaml",
        "spec.router.weights.decode.itl",
        0.5,
        "decode",
    ),
    ("pds-missing-gearsetref", "pdservice-llama3-8b.yaml", "spec.decode.gearSetRef", DELETE, "gearSetRef"),
    (
        "pds-same-gearset-both-roles",
        "pdservice-llama3-8b.yaml",
        "spec.decode.gearSetRef.name",
        "llama3-8b-prefill",
        "gearSetRef",
    ),
    # Aggregated serving (spec.serving) excludes the PD sections, and a service needs one shape or the other.
    (
        "pds-serving-beside-prefill-decode",
        "pdservice-llama3-8b.yaml",
        "spec.serving",
        {"gearSetRef": {"name": "llama3-8b"}},
        "spec.serving",
    ),
    ("pds-decode-without-prefill", "pdservice-llama3-8b.yaml", "spec.prefill", DELETE, "spec.prefill"),
    ("pds-model-numbers-missing", "pdservice-llama3-8b.yaml", "spec.model.numLayers", DELETE, "numLayers"),
    ("pds-kv-heads-not-dividing", "pdservice-llama3-8b.yaml", "spec.model.numKvHeads", 7, "numKvHeads"),
    ("pds-unknown-engine", "pdservice-llama3-8b.yaml", "spec.engine", "tensorrt", "engine"),
    (
        "pds-scaling-min-above-max",
        "pdservice-llama3-8b.yaml",
        "spec.decode.scaling.minReplicas",
        5,
        "minReplicas",
    ),
    # Scale to zero is not supported (no activator would wake the role): refused at apply.
    ("pds-scaling-min-zero", "pdservice-llama3-8b.yaml", "spec.decode.scaling.minReplicas", 0, "minReplicas"),
    ("pds-negative-ttft-slo", "pdservice-llama3-8b.yaml", "spec.slo.ttftMs", -5, "ttftMs"),
    (
        "pds-bad-prometheus-url",
        "pdservice-llama3-8b.yaml",
        "spec.prometheusUrl",
        "prometheus:9090",
        "prometheusUrl",
    ),
    (
        "pds-name-too-long",
        "pdservice-llama3-8b.yaml",
        "metadata.name",
        "llama3-8b-instruct-production",
        "name",
    ),
    ("pds-hfconfig-and-numbers", "pdservice-llama3-8b.yaml", "spec.model.hfConfig", LLAMA_CONFIG, "hfConfig"),
    (
        "pds-hfconfig-missing-layers",
        "pdservice-llama3-8b.yaml",
        "spec.model",
        {"name": "m", "hfConfig": {k: v for k, v in LLAMA_CONFIG.items() if k != "num_hidden_layers"}},
        "num_hidden_layers",
    ),
    ("gpup-node-name-mismatch", "gpuprofile.yaml", "spec.nodeName", "gpu-a10-1", "nodeName"),
    (
        "gpup-available-until-not-a-time",
        "gpuprofile.yaml",
        "spec.override.availableUntil",
        "tomorrow",
        "availableUntil",
    ),
    ("gpup-negative-memory", "gpuprofile.yaml", "spec.override.memoryGiB", -1, "memoryGiB"),
]


def bad_body(example: str, path: str, value: Any) -> dict[str, Any]:
    """The example ``example`` with one mistake."""
    return set_path(load_example(example), path, value)


@pytest.mark.parametrize(
    ("case", "example", "path", "value", "word"), BAD_CASES, ids=[c[0] for c in BAD_CASES]
)
def test_bad_input_is_rejected_naming_the_field(
    case: str, example: str, path: str, value: Any, word: str
) -> None:
    body = bad_body(example, path, value)
    with pytest.raises(ValidationError) as info:
        KIND_MODELS[body["kind"]].model_validate(body)
    message = format_validation_error(info.value)
    assert word in message, f"{case}: {message}"


def test_bad_cases_are_distinct_and_enough() -> None:
    assert len({(c[2], json.dumps(c[3], default=str)) for c in BAD_CASES}) == len(BAD_CASES)
    assert len(BAD_CASES) >= 15


@pytest.mark.parametrize(
    "name", ["gpuprofile.yaml", "gearset-explicit.yaml", "gearset-auto.yaml", "pdservice-llama3-8b.yaml"]
)
def test_examples_validate(name: str) -> None:
    body = load_example(name)
    obj = KIND_MODELS[body["kind"]].model_validate(body)
    assert obj.metadata["name"] == body["metadata"]["name"]


def test_format_validation_error_gives_camel_case_paths() -> None:
    with pytest.raises(ValidationError) as info:
        PDServiceSpec.model_validate(
            {"model": {"name": "m", "hfConfig": {"num_hidden_layers": 0}}, "prefill": {}, "decode": {}}
        )
    text = format_validation_error(info.value, prefix="spec")
    assert "spec.model.hfConfig.num_hidden_layers: Input should be greater than or equal to 1" in text
    assert "spec.prefill.gearSetRef: Field required" in text


def test_parse_raises_spec_error_with_every_bad_field() -> None:
    body = load_example("gearset-explicit.yaml")["spec"]
    body = set_path(body, "gears[0].microBatch", 0)
    body = set_path(body, "policy.emaAlpha", 2)
    with pytest.raises(SpecError) as info:
        parse(GearSetSpec, body, prefix="spec")
    lines = str(info.value).splitlines()
    assert any(line.startswith("spec.gears[0].microBatch: ") for line in lines)
    assert any(line.startswith("spec.policy.emaAlpha: ") for line in lines)
    assert parse(GearSetSpec, load_example("gearset-auto.yaml")["spec"]).mode == "auto"


class TestServingShapes:
    """Disaggregated (``prefill`` + ``decode``) or aggregated (``serving`` alone, GearSet role ``both``)."""

    def _pd(self) -> dict[str, Any]:
        return load_example("pdservice-llama3-8b.yaml")["spec"]

    def _aggregated(self) -> dict[str, Any]:
        spec = self._pd()
        del spec["prefill"], spec["decode"]
        spec["serving"] = {"gearSetRef": {"name": "llama3-8b"}, "scaling": {"maxReplicas": 2}}
        return spec

    def test_serving_alone_is_aggregated_with_the_role_both(self) -> None:
        spec = PDServiceSpec.model_validate(self._aggregated())
        assert spec.aggregated
        assert spec.roles == ("both",)
        assert spec.role_spec("both").gear_set_ref.name == "llama3-8b"
        assert spec.role_spec("both").scaling is not None
        with pytest.raises(KeyError, match=r"spec\.prefill is not set"):
            spec.role_spec("prefill")

    def test_prefill_and_decode_are_disaggregated(self) -> None:
        spec = PDServiceSpec.model_validate(self._pd())
        assert not spec.aggregated
        assert spec.roles == ("prefill", "decode")
        assert spec.role_spec("decode").gear_set_ref.name == "llama3-8b-decode"
        with pytest.raises(KeyError, match=r"spec\.serving is not set"):
            spec.role_spec("both")

    @pytest.mark.parametrize("keep", ["prefill", "decode"])
    def test_serving_beside_one_pd_section_names_both_shapes_and_the_fix(self, keep: str) -> None:
        spec = self._aggregated()
        spec[keep] = self._pd()[keep]
        with pytest.raises(ValidationError) as info:
            PDServiceSpec.model_validate(spec)
        msg = format_validation_error(info.value)
        assert "spec.serving" in msg and "excludes spec.prefill and spec.decode" in msg
        assert "keep spec.serving alone" in msg

    @pytest.mark.parametrize("drop", [("prefill",), ("decode",), ("prefill", "decode")])
    def test_a_missing_shape_says_what_to_give(self, drop: tuple[str, ...]) -> None:
        spec = self._pd()
        for section in drop:
            del spec[section]
        with pytest.raises(ValidationError) as info:
            PDServiceSpec.model_validate(spec)
        assert "give spec.prefill and spec.decode" in format_validation_error(info.value)
        assert "or spec.serving alone" in format_validation_error(info.value)

    def test_the_cel_rules_say_what_pydantic_says(self) -> None:
        from gearshift.api import pdservice

        rules = {r["rule"]: r["message"] for r in pdservice.CEL["PDServiceSpec"]}
        mixed = "!has(self.serving) || (!has(self.prefill) && !has(self.decode))"
        missing = "has(self.serving) || (has(self.prefill) && has(self.decode))"
        assert rules[mixed] == pdservice._MIXED_SHAPES
        assert rules[missing] == pdservice._NO_SHAPE
        # The distinct-GearSets rule may read prefill and decode only where both exist: reading a missing
        # field is an evaluation error in CEL, which would refuse every aggregated service.
        distinct = next(r for r in rules if "!=" in r)
        assert distinct.startswith("!has(self.prefill) || !has(self.decode) || ")

    def test_gearset_role_both(self) -> None:
        body = load_example("gearset-auto.yaml")
        body["spec"]["role"] = "both"
        assert GearSet.model_validate(body).spec.role == "both"

    def test_status_has_a_serving_entry(self) -> None:
        body = {"metadata": {"name": "agg"}, "spec": self._aggregated()}
        body["status"] = {"serving": {"gearSet": "llama3-8b", "activeGear": "latency", "readyReplicas": 1}}
        pds = PDService.model_validate(body)
        assert pds.status.serving is not None and pds.status.serving.active_gear == "latency"
