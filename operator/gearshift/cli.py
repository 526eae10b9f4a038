"""The ``gearshift`` command line.

Each sub-command lives in the module that owns the feature; that module exposes
``register(subparsers) -> None``, which adds its parser and sets ``func`` (``args -> int`` exit
code). Modules are imported only when listed here, and a sub-command's heavy imports stay inside
its ``func`` so that ``gearshift version`` starts fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from gearshift import __version__

#: Sub-command modules, in the order ``gearshift --help`` lists them.
COMMAND_MODULES: tuple[str, ...] = (
    "gearshift.commands.version",
    "gearshift.api.cli",
    "gearshift.planner.cli",
    "gearshift.commands.render",
    "gearshift.sim.cli",
    "gearshift.dev.loadgen",
    "gearshift.probe.cli",
    "gearshift.router.cli",
    "gearshift.handlers.main",
    "gearshift.dev.demo",
    "gearshift.dev.sandbox.cli",
)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Return the top-level parser with every available sub-command registered; with ``command``, only the
    modules up to the one that registers it (the others' imports cost a command ~0.5 s of start-up)."""
    parser = argparse.ArgumentParser(
        prog="gearshift",
        description="Serve LLMs on heterogeneous GPU fleets: plan, deploy and shift pipeline gears.",
    )
    parser.add_argument("--version", action="version", version=f"gearshift {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            # A feature module not built yet must not break the others.
            if exc.name and name.startswith(exc.name):
                continue
            raise
        module.register(sub)
        if command is not None and command in sub.choices:
            break
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``gearshift``; returns the process exit code."""
    given = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(given[0] if given and not given[0].startswith("-") else None)
    args = parser.parse_args(given)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
