"""``gearshift crds``: print or write the CustomResourceDefinitions generated from the models."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(subparsers: Any) -> None:
    """Add the ``crds`` sub-command to the ``gearshift`` parser."""
    parser = subparsers.add_parser(
        "crds",
        help="generate the CRD YAML of GPUProfile, GearSet and PDService",
        description="Print the CRDs as one YAML stream, or write one file per kind with --out "
        "(the repository keeps them in crds/ and charts/gearshift/crds/).",
    )
    parser.add_argument("--out", action="append", metavar="DIR", help="directory to write (repeatable)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the CRDs or write them under each ``--out`` directory; returns the exit code."""
    from gearshift.api import crdgen

    if not args.out:
        sys.stdout.write("---\n".join(crdgen.rendered().values()))
        return 0
    for out in args.out:
        for path in crdgen.write(out):
            print(path)
    return 0
