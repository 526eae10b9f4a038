"""Repository hygiene that pytest itself would only report as a confusing collection error."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_module_basenames_are_unique():
    # pytest's default (prepend) import mode imports test modules by basename, and unit tests import
    # shared fakes from each other by that name, so tests/unit/x.py and tests/e2e/x.py cannot coexist.
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert [n for n, c in names.items() if c > 1] == []
