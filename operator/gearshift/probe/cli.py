"""``gearshift probe``: the probe program (``gearshift-probe``) as a sub-command of the ``gearshift`` CLI."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    """Add ``gearshift probe {device,link-server,link-client,pairs}``."""
    from gearshift.probe.__main__ import add_commands

    parser = subparsers.add_parser(
        "probe",
        help="measure this node's GPUs, or the link between two nodes (JSON out)",
        description="Measure GPU nodes and the links between them; prints one JSON document.",
    )
    add_commands(parser)
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from gearshift.probe.__main__ import build_parser, run_args

    if getattr(args, "probe_command", None) is None:
        # ``gearshift probe`` alone probes the device, like a bare ``gearshift-probe``.
        args = build_parser().parse_args(
            ["--termination-log", args.termination_log, "device"] if args.termination_log else ["device"]
        )
    return run_args(args)
