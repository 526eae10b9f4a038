"""Test-wide fixtures: unit tests are sealed off from any cluster; e2e tests are marked by their path."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Everything under tests/e2e is an e2e test and runs after the unit tests.
    e2e_dir = REPO / "tests" / "e2e"
    for item in items:
        if e2e_dir in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)
    items.sort(key=lambda it: it.get_closest_marker("e2e") is not None)
