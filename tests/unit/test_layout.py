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
#: a handler reads, calls pure functions, writes and records; decisions live in control/,
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
    # Loose modules at the root hid the layers: each module lives in the package of its layer.
    root = TESTS.parent / "operator" / "gearshift"
    assert sorted(p.name for p in root.glob("*.py")) == ["__init__.py", "cli.py"]


#: Calls that make a mutable object (by the called name's last dotted part, or its module: asyncio,
#: threading, collections). prometheus_client's metrics (adapters/metrics.py) are not among them: they
#: register in the library's process-wide registry when made, which one /metrics endpoint serves.
_MUTABLE_CALLS = {"dict", "set", "list", "bytearray", "defaultdict", "OrderedDict", "deque",
                  "Lock", "RLock", "Event", "Condition", "Semaphore", "BoundedSemaphore"}  # fmt: skip
#: Annotations that say the value is mutable.
_MUTABLE_TYPES = {"dict", "set", "list", "defaultdict", "OrderedDict", "deque", "Counter", "MutableMapping"}


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Subscript):
        return _dotted(node.value)
    return ""


def _mutable_value(value: ast.expr | None) -> bool:
    if isinstance(value, ast.Dict | ast.Set | ast.List | ast.DictComp | ast.SetComp | ast.ListComp):
        return True
    if isinstance(value, ast.Call):
        called = _dotted(value.func)
        return called.split(".")[-1] in _MUTABLE_CALLS or called.startswith(
            ("asyncio.", "threading.", "collections.")
        )
    return False


def module_state(source: str) -> list[str]:
    """``name (line)`` of every module-level mutable binding in ``source``: an assignment of a mutable
    display, comprehension or constructor, an annotation that says dict/set/list, and every ``global``."""
    tree = ast.parse(source)
    found = [f"global {', '.join(n.names)} ({n.lineno})" for n in ast.walk(tree) if isinstance(n, ast.Global)]
    # Module level includes the bodies of its if/try blocks (TYPE_CHECKING, optional imports).
    todo = list(tree.body)
    while todo:
        stmt = todo.pop(0)
        if isinstance(stmt, ast.If | ast.Try):
            todo += [*stmt.body, *stmt.orelse, *getattr(stmt, "finalbody", [])]
            todo += [s for h in getattr(stmt, "handlers", []) for s in h.body]
            continue
        if isinstance(stmt, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            names = ", ".join(_dotted(t) or ast.unparse(t) for t in targets)
            hinted = isinstance(stmt, ast.AnnAssign) and _dotted(stmt.annotation) in _MUTABLE_TYPES
            if isinstance(stmt, ast.AugAssign) or hinted or _mutable_value(stmt.value):
                found.append(f"{names} ({stmt.lineno})")
    return found


def test_the_mutable_state_check_finds_what_it_should():
    source = (
        "import asyncio, threading\nfrom types import MappingProxyType\nfrom typing import TYPE_CHECKING\n"
        "a = {}\n_b: dict[str, int] = make()\nC = [1]\nd = set()\ne = threading.Lock()\nf = asyncio.Queue()\n"
        "if TYPE_CHECKING:\n    g = {k: 1 for k in 'ab'}\n"
        "def h():\n    global a\n"
        "OK = (1, 2)\nOK2 = frozenset({1})\nOK3 = MappingProxyType({'a': 1})\nlog = get_logger()\n"
    )
    assert module_state(source) == [
        "global a (13)", "a (4)", "_b (5)", "C (6)", "d (7)", "e (8)", "f (9)", "g (11)",
    ]  # fmt: skip


def test_handler_modules_keep_no_mutable_state():
    # One runtime object: what the handlers share between calls lives in the Runtime kopf hands
    # them (handlers/runtime.py); module globals could not be forgotten per object, nor faked per test.
    handlers = TESTS.parent / "operator" / "gearshift" / "handlers"
    found = {p.name: module_state(p.read_text()) for p in sorted(handlers.glob("*.py"))}
    assert {name: state for name, state in found.items() if state} == {}
