"""``gearshift router``: run the PD router (the same as the ``gearshift-router`` console script)."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    """Add the ``router`` sub-command."""
    from gearshift.router.server import run
    from gearshift.router.settings import add_arguments

    p: argparse.ArgumentParser = subparsers.add_parser(
        "router", help="run the PD router: OpenAI API proxy choosing a prefill and a decode pod per request"
    )
    add_arguments(p)
    p.set_defaults(func=run)
