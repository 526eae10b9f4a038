"""Repository hygiene that pytest itself would only report as a confusing collection error."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_module_basenames_are_unique():
    # pytest's default (prepend) import mode imports test modules by basename, and unit tests import
    # shared fakes from each other by that name, so tests/unit/x.py and tests/e2e/x.py cannot coexist.
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert [n for n, c in names.items() if c > 1] == []


#: The longest a kopf handler module's function may be (nested functions count inside their outer one):
#: a handler reads, calls pure functions, writes and records (issue 17); decisions live in control/,
#: profiling/ and planner/, where they are unit-tested without a cluster.
HANDLER_MAX_LINES = 60


def test_handler_functions_are_thin():
    handlers = TESTS.parent / "operator" / "gearshift" / "handlers"
    long = []
    for path in sorted(handlers.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > HANDLER_MAX_LINES:
                    long.append(f"{path.name}:{node.name} ({lines} lines)")
    assert long == [], f"handler functions over {HANDLER_MAX_LINES} lines: move their decisions out"


def test_the_package_root_holds_only_the_command_line():
    # Loose modules at the root hid the layers (issue 17): each module lives in the package of its layer.
    root = TESTS.parent / "operator" / "gearshift"
    assert sorted(p.name for p in root.glob("*.py")) == ["__init__.py", "cli.py"]
