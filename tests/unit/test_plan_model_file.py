"""``gearshift plan --model FILE`` reads YAML or JSON, as ``--cluster`` does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from gearshift.cli import main
from gearshift.planner import parse_layer_costs
from gearshift.planner.cli import load_model_file
from gearshift.planner.costs import RooflineAssumptions, RooflineCostModel
from gearshift.planner.errors import PlanInputError

REPO = Path(__file__).resolve().parents[2]
SEED_PROFILE = REPO / "examples" / "planner" / "profile-seed002.yaml"
SEED_LAYERS = REPO / "examples" / "planner" / "layers-seed002.json"
LLAMA_8B = REPO / "examples" / "models" / "llama-3-8b.json"

#: A layer-cost file as a person writes it in YAML: comments, flow mappings, an anchor.
LAYERS_YAML = """\
# four layers, the last one heavier
name: four-layer
activation_mb: 2.0
micro_batch: 1
layers:
  - &layer {compute_ms: 10.0, weight_gb: 2.0, kv_gb: 1.0}
  - *layer
  - *layer
  - {compute_ms: 20.0, weight_gb: 4.0}   # kv_gb defaults to 0
"""


def _plan_json(capsys: pytest.CaptureFixture[str], model: Path) -> dict:
    argv = ["plan", "--cluster", str(SEED_PROFILE), "--model", str(model), "--gear", "throughput"]
    assert main([*argv, "--single-pipeline", "-o", "json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


class TestLayerCostFile:
    def test_yaml_and_json_of_one_file_plan_the_same(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        as_yaml = tmp_path / "layers.yaml"
        as_yaml.write_text(LAYERS_YAML)
        as_json = tmp_path / "layers.json"
        as_json.write_text(json.dumps(yaml.safe_load(LAYERS_YAML)))
        assert _plan_json(capsys, as_yaml) == _plan_json(capsys, as_json)

    def test_yaml_file_parses_to_the_layers_it_lists(self, tmp_path: Path) -> None:
        p = tmp_path / "layers.yml"
        p.write_text(LAYERS_YAML)
        costs = load_model_file(p, RooflineAssumptions()).at(1)
        assert costs.name == "four-layer"
        assert costs.compute_ms == (10.0, 10.0, 10.0, 20.0)
        assert costs.weight_gb == (2.0, 2.0, 2.0, 4.0)
        assert costs.kv_gb == (1.0, 1.0, 1.0, 0.0)

    def test_example_json_file_still_plans_and_its_yaml_twin_matches(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        twin = tmp_path / "layers-seed002.yaml"
        twin.write_text(yaml.safe_dump(json.loads(SEED_LAYERS.read_text()), sort_keys=False))
        from_json = _plan_json(capsys, SEED_LAYERS)
        sizes = sorted(s["layers"][1] - s["layers"][0] for s in from_json["gears"][0]["stages"])
        assert sizes == [4, 6, 10, 12]  # the JSON path is unchanged (tests/unit/test_planner.py's figure)
        assert _plan_json(capsys, twin) == from_json

    def test_json_under_another_suffix_is_read_as_json(self, tmp_path: Path) -> None:
        p = tmp_path / "layers.costs"
        p.write_text(SEED_LAYERS.read_text())
        got = load_model_file(p, RooflineAssumptions()).at(1)
        assert got == parse_layer_costs(json.loads(SEED_LAYERS.read_text())).at(1)


class TestHfConfig:
    def test_hf_config_in_yaml_is_the_same_model(self, tmp_path: Path) -> None:
        twin = tmp_path / "llama-3-8b.yaml"
        twin.write_text(yaml.safe_dump(json.loads(LLAMA_8B.read_text())))
        shape = RooflineAssumptions()
        a, b = load_model_file(LLAMA_8B, shape), load_model_file(twin, shape)
        assert isinstance(a, RooflineCostModel) and isinstance(b, RooflineCostModel)
        assert a.arch == b.arch


class TestErrors:
    def test_invalid_yaml_is_named(self, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
        p = tmp_path / "bad.yaml"
        p.write_text("layers: [unclosed\n")
        assert main(["plan", "--cluster", str(SEED_PROFILE), "--model", str(p)]) == 1
        assert "is not valid YAML/JSON" in capsys.readouterr().err

    def test_a_json_file_keeps_its_json_message(self, tmp_path: Path) -> None:
        p = tmp_path / "bad.json"
        p.write_text("layers: []\n")
        with pytest.raises(PlanInputError, match="is not valid JSON"):
            load_model_file(p, RooflineAssumptions())

    def test_a_yaml_scalar_is_refused(self, tmp_path: Path) -> None:
        p = tmp_path / "model.yaml"
        p.write_text("just a string\n")
        with pytest.raises(PlanInputError, match="must hold a mapping"):
            load_model_file(p, RooflineAssumptions())

    def test_a_missing_file_is_named(self, tmp_path: Path) -> None:
        with pytest.raises(PlanInputError, match="cannot read model file"):
            load_model_file(tmp_path / "nope.yaml", RooflineAssumptions())

    def test_bad_layer_fields_in_yaml_are_named(self, tmp_path: Path) -> None:
        p = tmp_path / "layers.yaml"
        p.write_text("activation_mb: 1\nlayers:\n  - {compute_ms: -1, weight_gb: 1}\n")
        with pytest.raises(PlanInputError, match=r"layers\[0\]\.compute_ms"):
            load_model_file(p, RooflineAssumptions())


@pytest.mark.parametrize(
    ("flag", "value", "named"),
    [
        ("--qps", "nan", "finite load above 0"),
        ("--qps", "inf", "finite load above 0"),
        ("--qps", "-2", "finite load above 0"),
        ("--qps", "ten", "not a number"),
        ("--itl-ms", "-5", "finite time above 0 ms"),
        ("--itl-ms", "nan", "finite time above 0 ms"),
        ("--itl-ms", "fast", "not a number of milliseconds"),
        ("--prompt-tokens", "0", "at least 1 token"),
        ("--kv-context-tokens", "1.5", "whole number"),
        ("--seed", "-1", "seed of 0 or more"),
    ],
)
def test_bad_load_flags_are_named_before_planning(
    capsys: pytest.CaptureFixture[str], flag: str, value: str, named: str
) -> None:
    """``--qps nan`` reached the simulator, which answered "no latency; raise sim_requests"."""
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--cluster", str(SEED_PROFILE), "--model", str(LLAMA_8B), flag, value])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"argument {flag}" in err and named in err, err


class TestContextLengthWarning:
    """Requests longer than the model's ``max_position_embeddings`` were planned for without a word; the
    engine refuses them."""

    def plan(self, capsys: pytest.CaptureFixture[str], model: Path, *flags: str) -> str:
        argv = ["plan", "--cluster", str(SEED_PROFILE), "--model", str(model), "--gear", "latency", *flags]
        assert main([*argv, "--single-pipeline", "-o", "json"]) == 0
        out = capsys.readouterr()
        json.loads(out.out)  # the plan is still printed, stdout untouched by the warning
        return out.err

    def test_prompt_plus_output_over_the_limit_warns_on_stderr(
        self, capsys: pytest.CaptureFixture[str]
    ) -> None:
        err = self.plan(capsys, LLAMA_8B, "--prompt-tokens", "8100", "--output-tokens", "200")
        assert err.count("\n") == 1 and err.startswith("gearshift plan: warning: ")
        assert (
            "--prompt-tokens 8100 + --output-tokens 200 = 8300 exceeds the model's context length of 8192"
            in err
        )
        assert "refuses" in err

    def test_a_prompt_alone_over_the_limit_is_named(self, capsys: pytest.CaptureFixture[str]) -> None:
        err = self.plan(capsys, LLAMA_8B, "--prompt-tokens", "9000")
        assert "--prompt-tokens 9000 alone exceeds the model's context length of 8192" in err
        # equal to the limit: no room for one output token, and the message does not say "exceeds"
        err = self.plan(capsys, LLAMA_8B, "--prompt-tokens", "8192")
        assert "--prompt-tokens 8192 alone fills the model's context length of 8192" in err

    def test_requests_that_fit_or_a_layer_file_do_not_warn(self, capsys: pytest.CaptureFixture[str]) -> None:
        assert self.plan(capsys, LLAMA_8B, "--prompt-tokens", "8000", "--output-tokens", "192") == ""
        assert self.plan(capsys, SEED_LAYERS, "--prompt-tokens", "9000") == ""
