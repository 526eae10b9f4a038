"""A gear's max batch: decode batches every running sequence, so it follows the KV cache reserved."""

from __future__ import annotations

from pathlib import Path

from gearshift.facts.fleet import datasheet_profile, load_fleet
from gearshift.planner.candidates import kv_resident_sequences
from gearshift.planner.costs import RooflineAssumptions, load_model
from gearshift.planner.gears import plan
from gearshift.planner.profile import load_cluster, parse_profile

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _profile():
    return parse_profile(datasheet_profile(load_fleet(EXAMPLES / "fleets/mixed.yaml")))


def test_roofline_gears_batch_as_many_sequences_as_their_kv_reservation():
    model = load_model(EXAMPLES / "models" / "llama-3-8b.json", RooflineAssumptions(kv_sequences=48))
    result = plan(_profile(), model, sim_requests=200)
    for gear in result.gears:
        # 48 sequences fit every stage by construction; a one-stage gear must not serialise decode.
        assert gear.max_batch == max(48, gear.micro_batch * len(gear.stages))


def test_layer_cost_files_keep_micro_batch_times_stages():
    model = load_model(EXAMPLES / "planner/layers-seed002.json")
    assert kv_resident_sequences(model) == 0
    profile = load_cluster(EXAMPLES / "planner/profile-seed002.yaml")
    for gear in plan(profile, model, sim_requests=200).gears:
        assert gear.max_batch == gear.micro_batch * len(gear.stages)
