"""``gearshift sim``: the simulated engine, the same as the ``gearshift-sim`` console script."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    """Add ``gearshift sim`` (flags as ``gearshift-sim``)."""
    from gearshift.sim.server import build_arg_parser

    parser: argparse.ArgumentParser = subparsers.add_parser(
        "sim", help="run the simulated LLM engine (OpenAI API + vLLM metrics) for one or many pods"
    )
    build_arg_parser(parser)
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from gearshift.sim.server import run_from_args

    return run_from_args(args)
