"""``gearshift plan``'s table: a stage replicated over different cards shows its card mix, the ms column
and the P99 say what they are, and ``make demo`` passes ``DEMO_ARGS`` on."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from gearshift.planner.gears import Gear, PlanResult, Prediction, Stage
from gearshift.planner.render import card_mix, to_table

REPO = Path(__file__).resolve().parents[2]
MODELS = {"a10-0": "A10-24GB", "a10-1": "A10-24GB", "h100-0": "H100-80GB", "a100-0": "A100-40GB"}


def result() -> PlanResult:
    wide = Stage((0, 20), "a10-0", ("a10-0", "h100-0", "a10-1", "a100-0"), 900.0, 12.0)
    tail = Stage((20, 32), "h100-0", ("h100-0",), 450.0, 8.0)
    gear = Gear(
        name="balanced",
        stages=(wide, tail),
        micro_batch=8,
        max_batch=64,
        pipelines=1,
        bottleneck_ms=900.0,
        effective_ms=300.0,
        lower_bound_ms=800.0,
        exact=True,
        predicted=Prediction(100.0, 20.0, 15.0, 42.7, False, 3.0),
        qps_range=(10.0, 80.0),
    )
    return PlanResult("m", (gear,), 20.0)


def test_card_mix_counts_models_in_order_of_first_appearance() -> None:
    assert card_mix(["a10-0", "h100-0", "a10-1", "a100-0"], MODELS) == "A10-24GB×2, H100-80GB, A100-40GB"
    assert card_mix(["x"], MODELS) == "?"


def test_table_shows_card_mix_nodes_and_what_the_figures_are() -> None:
    lines = to_table(result(), MODELS).splitlines()
    s0 = next(ln for ln in lines if ln.strip().startswith("s0"))
    assert s0.endswith("900.00 ms   12.0 GiB  ×4 A10-24GB×2, H100-80GB, A100-40GB")
    assert lines[lines.index(s0) + 1].strip() == "on a10-0, h100-0, a10-1, a100-0"
    s1 = next(ln for ln in lines if ln.strip().startswith("s1"))
    assert s1.endswith("H100-80GB on h100-0") and s1.count("█") == 15  # half the slowest stage's bar
    text = "\n".join(lines)
    assert "time per micro-batch of the stage's slowest replica" in text
    assert "replicas serving in parallel: P50 15.0 ms, P99 42.7 ms" in text


def test_table_without_models_names_the_nodes() -> None:
    s0 = next(ln for ln in to_table(result()).splitlines() if ln.strip().startswith("s0"))
    assert s0.endswith("×4 a10-0, h100-0, a10-1, a100-0")


@pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")
def test_make_demo_passes_demo_args() -> None:
    out = subprocess.run(
        ["make", "-n", "-C", str(REPO), "demo", "DEMO_ARGS=--duration 150 --keep"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert ".venv/bin/gearshift demo --duration 150 --keep" in out
