"""``gearshift render``: print every object the operator would create for PDServices and GearSets in files,
on a fleet file instead of a cluster (like ``helm template``); the work is
:mod:`gearshift.commands.rendering`'s."""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from typing import Any


def register(sub: Any) -> None:
    """Add ``render`` to the ``gearshift`` sub-commands."""
    p = sub.add_parser(
        "render",
        help="print what the operator would create for PDServices and GearSets on a fleet, without a cluster",
        description="Print, as multi-document YAML (or a JSON List), every object the operator would create "
        "for the PDServices and GearSets in the files on the fleet: per role the active gear's headless "
        "Service and stage StatefulSets, the role Services, the router and the client Service; before "
        "them each GearSet with the status the operator writes (planned gears for mode auto, the active "
        "gear). It runs the reconciler's own code, with the fleet file's nodes and datasheet GPUProfiles "
        "standing in for the cluster's.",
    )
    p.add_argument("--fleet", required=True, metavar="FLEET.yaml", help="fleet file (examples/fleets/)")
    p.add_argument(
        "-f",
        "--filename",
        dest="files",
        action="append",
        required=True,
        metavar="FILE_OR_DIR",
        help="a YAML/JSON file, or a directory of them, holding PDServices and GearSets; repeatable",
    )
    p.add_argument(
        "-n", "--namespace", default="default", help="namespace of objects that name none (default: default)"
    )
    p.add_argument(
        "--all-gears",
        action="store_true",
        help="render every gear's StatefulSets, not only the active gears' (the role Services still "
        "select the active ones)",
    )
    p.add_argument(
        "--no-gearsets",
        action="store_true",
        help="leave the GearSets out: only the objects the operator creates",
    )
    p.add_argument("-o", "--output", choices=("yaml", "json"), default="yaml")
    p.add_argument("--vllm-image", default=None, help="engine image for engine: vllm (the operator's flag)")
    p.add_argument("--sim-image", default=None, help="engine image for engine: sim (the operator's flag)")
    p.add_argument("--router-image", default=None, help="router image (the operator's flag)")
    p.add_argument("--prometheus-url", default=None, help="the operator's --prometheus-url")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Render and print; errors go to stderr with exit code 1."""
    from gearshift.commands.rendering import RenderError, documents, load_documents, render, to_json, to_yaml
    from gearshift.control.reconcile.settings import Settings
    from gearshift.facts.fleet import FleetError, load_fleet
    from gearshift.k8s.desired import Images

    try:
        fleet = load_fleet(args.fleet)
    except (FleetError, OSError) as exc:
        print(f"gearshift render: {args.fleet}: {exc}", file=sys.stderr)
        return 1
    defaults = Images()
    images = Images(
        vllm=args.vllm_image or defaults.vllm, sim=args.sim_image or defaults.sim, router=args.router_image
    )
    settings = Settings(images=images, prometheus_url=args.prometheus_url)
    try:
        docs = load_documents(args.files)
        rendered, warnings = render(
            docs,
            fleet,
            now=datetime.now(UTC),
            namespace=args.namespace,
            settings=settings,
            all_gears=args.all_gears,
        )
    except RenderError as exc:
        print(f"gearshift render: {exc}", file=sys.stderr)
        return 1
    for w in warnings:
        print(f"gearshift render: warning: {w}", file=sys.stderr)
    objs = documents(rendered, gearsets=not args.no_gearsets)
    sys.stdout.write(to_json(objs) if args.output == "json" else to_yaml(objs))
    return 0
