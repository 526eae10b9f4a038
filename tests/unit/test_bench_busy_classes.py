"""bench/busy_classes.py's reading of pytest's own JUnit XML (the file a real pytest run writes)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def bc(bench_module: Callable[[str], ModuleType]) -> ModuleType:
    return bench_module("busy_classes")


def test_outcomes_of_a_real_pytest_run(bc: ModuleType, tmp_path: Path) -> None:
    (tmp_path / "test_mix.py").write_text(
        "import pytest\n"
        "def test_ok():\n    pass\n"
        "def test_bad():\n    assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='not here')\ndef test_skipped():\n    pass\n"
        "@pytest.fixture\ndef broken():\n    raise RuntimeError('set-up failed')\n"
        "def test_error(broken):\n    pass\n"
    )
    junit = tmp_path / "out.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_mix.py"]
    cmd.append(f"--junitxml={junit}")
    subprocess.run(cmd, cwd=tmp_path, capture_output=True, check=False)
    rows = {r["test"].split("::")[-1]: r for r in bc.outcomes(junit)}
    assert {k: r["outcome"] for k, r in rows.items()} == {
        "test_ok": "passed",
        "test_bad": "failed",
        "test_skipped": "skipped",
        "test_error": "error",
    }
    assert "one is not two" in rows["test_bad"]["message"]
    assert "set-up failed" in rows["test_error"]["message"]
    assert "message" not in rows["test_ok"]
    assert all(r["duration_s"] >= 0 for r in rows.values())
