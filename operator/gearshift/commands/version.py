"""``gearshift version``: print the package version and the API it serves."""

from __future__ import annotations

import argparse
import json
import platform

from gearshift import GROUP, VERSION, __version__


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("version", help="print the gearshift version")
    p.add_argument("-o", "--output", choices=("text", "json"), default="text")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    info = {"gearshift": __version__, "api": f"{GROUP}/{VERSION}", "python": platform.python_version()}
    if args.output == "json":
        print(json.dumps(info))
    else:
        print(f"gearshift {__version__} (API {GROUP}/{VERSION}, Python {info['python']})")
    return 0
