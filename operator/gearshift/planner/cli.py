"""``gearshift plan``: plan the gears of a model on a fleet and print them."""

from __future__ import annotations

import argparse
import sys
from typing import Any

FORMATS = ("table", "json", "yaml")


def register(sub: Any) -> None:
    """Add ``plan`` to the ``gearshift`` sub-commands."""
    p = sub.add_parser(
        "plan",
        help="plan pipeline gears of a model on a heterogeneous fleet",
        description="Plan latency/balanced/throughput gears: unequal layer splits with equal stage times.",
    )
    p.add_argument("--cluster", required=True, help="resource profile (nodes:) or fleet file (nodePools:)")
    p.add_argument("--model", required=True, help="HF config.json or layer-cost file (layers:)")
    p.add_argument("--gear", default="all", choices=["latency", "balanced", "throughput", "all"])
    p.add_argument(
        "--single-pipeline",
        action="store_true",
        help="one pipeline, no replicas; with --gear throughput: the exact minimum-bottleneck pipeline",
    )
    p.add_argument("--qps", type=float, default=None, help="load for latency predictions, req/s")
    p.add_argument(
        "--prompt-tokens", type=int, default=512, help="mean prompt tokens per request (HF config only)"
    )
    p.add_argument(
        "--output-tokens", type=int, default=128, help="mean output tokens per request (HF config only)"
    )
    p.add_argument(
        "--role",
        default="both",
        choices=["both", "prefill", "decode"],
        help="what the gears serve (HF config only)",
    )
    p.add_argument(
        "--kv-context-tokens",
        type=int,
        default=None,
        help="KV tokens reserved per sequence (HF config only; default: 1.2 x (prompt + output))",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the simulated arrivals")
    p.add_argument("-o", "--output", default="table", choices=FORMATS)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``gearshift plan``; exit 0 on success, 1 when planning fails (message on stderr)."""
    from gearshift.planner import PlanError, load_cluster, load_model, plan
    from gearshift.planner.costs import RooflineAssumptions
    from gearshift.planner.render import to_json, to_table, to_yaml

    try:
        profile = load_cluster(args.cluster)
        shape = RooflineAssumptions(
            prompt_tokens=args.prompt_tokens,
            output_tokens=args.output_tokens,
            role=args.role,
            kv_context_tokens=args.kv_context_tokens,
        )
        model = load_model(args.model, shape)
        intents = ("latency", "balanced", "throughput") if args.gear == "all" else (args.gear,)
        result = plan(
            profile,
            model,
            intents=intents,
            qps=args.qps,
            single_pipeline=args.single_pipeline,
            seed=args.seed,
        )
    except PlanError as exc:
        print(f"gearshift plan: {exc}", file=sys.stderr)
        return 1
    render = {"table": to_table, "json": to_json, "yaml": to_yaml}[args.output]
    if args.output == "table":
        # Node → card model, so a stage replicated over different cards shows its mix.
        sys.stdout.write(to_table(result, {n.node_id: n.gpu_model for n in profile.nodes}))
        return 0
    sys.stdout.write(render(result))
    return 0
