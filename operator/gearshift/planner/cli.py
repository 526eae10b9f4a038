"""``gearshift plan``: plan the gears of a model on a fleet and print them."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gearshift.planner.costs import CostModel, RooflineAssumptions

FORMATS = ("table", "json", "yaml")


def _positive_number(of: str, fix: str) -> Callable[[str], float]:
    """An argparse type: a finite number > 0; the errors say ``is not a number of {of}`` and, for NaN,
    infinity or a value ≤ 0, ``fix`` (NaN or infinity reached the simulator, which then reported "no
    latency; raise sim_requests")."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of {of}") from None
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r}: {fix}")
        return value

    return parse


#: ``--qps`` and ``--load``, req/s; ``--itl-ms`` and ``--slo-ms``, ms.
_positive_qps = _positive_number("requests per second", "give a finite load above 0 req/s, e.g. --qps 10")
_positive_load = _positive_number("requests per second", "give a finite load above 0 req/s, e.g. --load 10")
_positive_ms = _positive_number("milliseconds", "give a finite time above 0 ms, e.g. --itl-ms 150")
_positive_slo = _positive_number("milliseconds", "give a finite time above 0 ms, e.g. --slo-ms 1500")


def _whole_number(minimum: int, of: str, fix: str) -> Callable[[str], int]:
    """An argparse type: a whole number ≥ ``minimum``; the errors say ``is not a whole number{of}`` and,
    below the minimum, ``fix``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number{of}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: {fix}")
        return value

    return parse


#: ``--seed``: numpy's generators take seeds ≥ 0 (a negative one raised from inside the simulator).
_seed = _whole_number(0, "", "give a seed of 0 or more")
_positive_int = _whole_number(1, " of tokens", "give at least 1 token")


def register(sub: Any) -> None:
    """Add ``plan`` to the ``gearshift`` sub-commands."""
    p = sub.add_parser(
        "plan",
        help="plan pipeline gears of a model on a heterogeneous fleet",
        description="Plan latency/balanced/throughput gears: unequal layer splits with equal stage times.",
    )
    p.add_argument("--cluster", required=True, help="resource profile (nodes:) or fleet file (nodePools:)")
    p.add_argument(
        "--model", required=True, help="HF config.json, or a layer-cost file (layers:) in YAML or JSON"
    )
    p.add_argument("--gear", default="all", choices=["latency", "balanced", "throughput", "all"])
    p.add_argument(
        "--single-pipeline",
        action="store_true",
        help="one pipeline, no replicas; with --gear throughput: the exact minimum-bottleneck pipeline",
    )
    p.add_argument("--qps", type=_positive_qps, default=None, help="load for latency predictions, req/s")
    p.add_argument(
        "--prompt-tokens",
        type=_positive_int,
        default=512,
        help="mean prompt tokens per request (HF config only)",
    )
    p.add_argument(
        "--output-tokens",
        type=_positive_int,
        default=128,
        help="mean output tokens per request (HF config only)",
    )
    p.add_argument(
        "--role",
        default="both",
        choices=["both", "prefill", "decode"],
        help="what the gears serve (HF config only)",
    )
    p.add_argument(
        "--kv-context-tokens",
        type=_positive_int,
        default=None,
        help="KV tokens reserved per sequence (HF config only; default: 1.2 x (prompt + output))",
    )
    p.add_argument(
        "--itl-ms",
        type=_positive_ms,
        default=None,
        help="TPOT target, ms (role both/decode, HF config): a gear's capacity is then the load whose "
        "predicted time per output token meets it (default: none, capacity is the busy rate)",
    )
    p.add_argument("--seed", type=_seed, default=0, help="seed of the simulated arrivals")
    fleet = p.add_argument_group(
        "fleet-scale questions (--fleet)",
        "Answer two questions over the whole fleet instead of planning gears, each beside a bound: the most "
        "load it serves at the SLO, and the cheapest plan for --load; card classes and counts, not nodes "
        "(gearshift.planner.fleetplan).",
    )
    fleet.add_argument("--fleet", action="store_true", help="answer the fleet-scale questions")
    fleet.add_argument(
        "--load",
        type=_positive_load,
        default=None,
        help="target req/s of the cheapest plan (default: half the max load)",
    )
    fleet.add_argument(
        "--slo-ms",
        type=_positive_slo,
        default=None,
        help="most TTFT (ITL for --role decode) of an unloaded pipeline, ms (default: none)",
    )
    fleet.add_argument(
        "--price",
        action="append",
        default=[],
        metavar="CLASS=PRICE",
        help="price per GPU-hour of a GPU model or pool, over the fleet file's pricePerGpuHour (repeatable)",
    )
    p.add_argument("-o", "--output", default="table", choices=FORMATS)
    p.set_defaults(func=run)


def load_model_file(path: str | Path, assumptions: RooflineAssumptions) -> CostModel:
    """Read ``--model`` like ``--cluster``: YAML or JSON.

    A file that parses as JSON (any ``.json`` file, and JSON under another name) goes to
    :func:`gearshift.planner.load_model` unchanged, messages included. Anything else is read as YAML: a
    mapping with ``layers`` is a layer-cost file, another mapping an HF config written as YAML.

    Raises:
        PlanInputError: unreadable file, neither YAML nor JSON, or invalid fields.
    """
    import yaml

    from gearshift.facts.model import ModelConfigError, arch_from_hf_config
    from gearshift.planner import load_model
    from gearshift.planner.costs import RooflineCostModel, parse_layer_costs
    from gearshift.planner.errors import PlanInputError

    p = Path(path)
    if p.suffix.lower() == ".json":
        return load_model(p, assumptions)
    try:
        text = p.read_text()
    except OSError:
        return load_model(p, assumptions)  # its "cannot read model file" message
    try:
        json.loads(text)
    except json.JSONDecodeError:
        pass
    else:
        return load_model(p, assumptions)
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PlanInputError(f"model file {str(p)!r} is not valid YAML/JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise PlanInputError(
            f"model file {str(p)!r} must hold a mapping: a layer-cost file (layers:) or an HF config"
        )
    if "layers" in doc:
        return parse_layer_costs(doc)
    try:
        arch = arch_from_hf_config(doc, name=doc.get("_name_or_path") or p.stem)
    except (ModelConfigError, TypeError, ValueError) as exc:
        raise PlanInputError(f"model file {str(p)!r}: {exc}") from None
    return RooflineCostModel(arch, assumptions)


def context_warnings(model: CostModel, prompt_tokens: int, output_tokens: int) -> list[str]:
    """Warnings, one line each, when the request shape does not fit the model's context length (its
    ``max_position_embeddings``, vLLM's default ``max_model_len``): such requests are planned for, but
    an engine refuses them (vLLM answers 400 "maximum context length") unless a client shortens them
    (``gearshift loadgen`` clips rows to the served ``max_model_len``). None for a layer-cost file, which
    names no context length."""
    arch = getattr(model, "arch", None)
    limit = getattr(arch, "max_position_embeddings", None)
    if not limit:
        return []
    total = prompt_tokens + output_tokens
    if total <= limit:
        return []
    what = (
        f"--prompt-tokens {prompt_tokens} alone {'fills' if prompt_tokens == limit else 'exceeds'}"
        if prompt_tokens >= limit
        else f"--prompt-tokens {prompt_tokens} + --output-tokens {output_tokens} = {total} exceeds"
    )
    return [
        f"gearshift plan: warning: {what} the model's context length of {limit} tokens "
        f"(max_position_embeddings in {getattr(arch, 'name', 'its config')}); the engine refuses such "
        "requests (vLLM: 400, maximum context length) or a client clips them, so the plan is for requests "
        "that will not be served as given"
    ]


def _gear_flags(args: argparse.Namespace) -> list[tuple[str, bool]]:
    """The flags of gear planning that the fleet questions do not read, and whether each was given."""
    return [
        ("--gear", args.gear != "all"),
        ("--single-pipeline", bool(args.single_pipeline)),
        ("--qps", args.qps is not None),
        ("--itl-ms", args.itl_ms is not None),
    ]


def run(args: argparse.Namespace) -> int:
    """Run ``gearshift plan``; exit 0 on success, 1 when planning fails (message on stderr). Requests
    longer than the model's context length only warn on stderr (:func:`context_warnings`)."""
    from gearshift.planner import PlanError, load_cluster, plan
    from gearshift.planner.costs import RooflineAssumptions
    from gearshift.planner.render import to_json, to_table, to_yaml

    if args.fleet:
        gear_only = [f for f, v in _gear_flags(args) if v]
        if gear_only:
            print(
                f"gearshift plan: {', '.join(gear_only)} plan gears and mean nothing with --fleet; drop them "
                "(the fleet questions take --load, --slo-ms with --role, and --price)",
                file=sys.stderr,
            )
            return 2
        return run_fleet(args)
    given = [f for f, v in (("--load", args.load), ("--slo-ms", args.slo_ms), ("--price", args.price)) if v]
    if given:
        print(
            f"gearshift plan: {', '.join(given)} answer the fleet-scale questions: add --fleet",
            file=sys.stderr,
        )
        return 2
    try:
        profile = load_cluster(args.cluster)
        shape = RooflineAssumptions(
            prompt_tokens=args.prompt_tokens,
            output_tokens=args.output_tokens,
            role=args.role,
            kv_context_tokens=args.kv_context_tokens,
        )
        model = load_model_file(args.model, shape)
        for line in context_warnings(model, args.prompt_tokens, args.output_tokens):
            print(line, file=sys.stderr)
        intents = ("latency", "balanced", "throughput") if args.gear == "all" else (args.gear,)
        result = plan(
            profile,
            model,
            intents=intents,
            qps=args.qps,
            single_pipeline=args.single_pipeline,
            seed=args.seed,
            itl_target_ms=args.itl_ms,
            worthwhile_only=True,
        )
    except PlanError as exc:
        print(f"gearshift plan: {exc}", file=sys.stderr)
        return 1
    for intent, why in result.left_out.items():
        print(f"gearshift plan: no {intent} gear: its pick {why}", file=sys.stderr)
    render = {"table": to_table, "json": to_json, "yaml": to_yaml}[args.output]
    if args.output == "table":
        # Node → card model, so a stage replicated over different cards shows its mix.
        sys.stdout.write(to_table(result, {n.node_id: n.gpu_model for n in profile.nodes}))
        return 0
    sys.stdout.write(render(result))
    return 0


def _prices(items: list[str]) -> dict[str, float]:
    """``--price CLASS=PRICE`` items as a mapping.

    Raises:
        PlanInputError: an item without ``=`` or whose price is not a number.
    """
    from gearshift.planner.errors import PlanInputError

    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep or not key.strip():
            raise PlanInputError(f"--price {item!r}: write CLASS=PRICE, e.g. --price T4-16GB=0.35")
    return out


def run_fleet(args: argparse.Namespace) -> int:
    """``gearshift plan --fleet``: the max-load and cheapest plans with their bounds and the peer's; exit 1
    with the message on stderr when the input is wrong or no plan exists."""
    import yaml

    from gearshift.facts.fleet import FleetError, parse_fleet
    from gearshift.planner import PlanError, load_cluster
    from gearshift.planner.costs import RooflineAssumptions
    from gearshift.planner.errors import PlanInputError
    from gearshift.planner.fleetclasses import Workload, fleet_classes, profile_classes
    from gearshift.planner.render import fleet_report, fleet_table

    try:
        shape = RooflineAssumptions(
            prompt_tokens=args.prompt_tokens,
            output_tokens=args.output_tokens,
            role=args.role,
            kv_context_tokens=args.kv_context_tokens,
        )
        model = load_model_file(args.model, shape)
        prices = _prices(args.price)
        try:
            doc = yaml.safe_load(Path(args.cluster).read_text())
        except (OSError, yaml.YAMLError):
            doc = None
        if isinstance(doc, dict) and "nodePools" in doc:
            try:
                fleet = parse_fleet(doc)
            except FleetError as exc:
                raise PlanInputError(f"fleet file {args.cluster!r}: {exc}") from None
            classes, name = fleet_classes(fleet, prices), fleet.name
        else:
            if prices:
                raise PlanInputError(
                    "--price needs a fleet file (nodePools:); a resource profile counts nodes"
                )
            classes, name = profile_classes(load_cluster(args.cluster)), str(args.cluster)
        report = fleet_report(name, classes, Workload(model, args.slo_ms), args.load)
    except PlanError as exc:
        print(f"gearshift plan: {exc}", file=sys.stderr)
        return 1
    if args.output == "json":
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    elif args.output == "yaml":
        sys.stdout.write(yaml.safe_dump(report, sort_keys=False))
    else:
        sys.stdout.write(fleet_table(report))
    return 0
