"""The ``gearshift`` command line.

Each sub-command lives in the module that owns the feature; that module exposes
``register(subparsers) -> None``, which adds its parser and sets ``func`` (``args -> int`` exit
code). :data:`COMMANDS` names every sub-command and its module; a command imports only its own
module (the others' imports cost ~0.5 s of start-up), ``--help`` imports them all. A module that
fails to import is an error naming the command, never a command silently missing from the list.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType

from gearshift import __version__

#: Sub-command → the module that registers it, in the order ``gearshift --help`` lists them.
COMMANDS: tuple[tuple[str, str], ...] = (
    ("version", "gearshift.commands.version"),
    ("crds", "gearshift.api.cli"),
    ("plan", "gearshift.planner.cli"),
    ("render", "gearshift.commands.render"),
    ("sim", "gearshift.sim.cli"),
    ("loadgen", "gearshift.dev.loadgen"),
    ("probe", "gearshift.probe.cli"),
    ("router", "gearshift.router.cli"),
    ("operator", "gearshift.handlers.main"),
    ("demo", "gearshift.dev.demo"),
    ("sandbox", "gearshift.dev.sandbox.cli"),
)


class CommandLoadError(RuntimeError):
    """A sub-command's module failed to import; the message names the command, the module and the cause."""


def _load(command: str, module: str) -> ModuleType:
    """Import ``module`` for ``command``.

    Raises:
        CommandLoadError: the import failed (a missing dependency or a broken module).
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise CommandLoadError(
            f"gearshift {command}: cannot import {module}: {exc}. "
            "Reinstall gearshift with its dependencies (`make venv`, or `pip install -e '.[dev]'`)."
        ) from exc


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Return the top-level parser: with ``command`` one of :data:`COMMANDS`, only that sub-command is
    registered; otherwise every one (for ``--help`` and an unknown command's error).

    Raises:
        CommandLoadError: a sub-command's module failed to import.
    """
    parser = argparse.ArgumentParser(
        prog="gearshift",
        description="Serve LLMs on heterogeneous GPU fleets: plan, deploy and shift pipeline gears.",
    )
    parser.add_argument("--version", action="version", version=f"gearshift {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = [(c, m) for c, m in COMMANDS if c == command] or list(COMMANDS)
    for name, module in chosen:
        _load(name, module).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``gearshift``; returns the process exit code (1 when a sub-command cannot load)."""
    given = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser(given[0] if given and not given[0].startswith("-") else None)
    except CommandLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    args = parser.parse_args(given)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
