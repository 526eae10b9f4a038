"""``gearshift demo``: the README's first command — serve a real trace on the sandbox and write a report.

Brings up the sandbox with the mixed GPU fleet (or reuses it), runs the operator, waits for every GPU node
to be profiled, applies the example PDService with ``auto`` GearSets, replays the Azure LLM trace through
the router's pod IP with a live line, and writes ``demo-report/`` (``report.md`` and PNG plots).

Modules: :mod:`~gearshift.dev.demo.trace` (windowing), :mod:`~gearshift.dev.demo.series` (time series from
measurements), :mod:`~gearshift.dev.demo.gears` (gear tables),
:mod:`~gearshift.dev.demo.live` (the live line),
:mod:`~gearshift.dev.demo.report` and :mod:`~gearshift.dev.demo.plots` (the report) are pure;
:mod:`~gearshift.dev.demo.kube` and :mod:`~gearshift.dev.demo.run` do the I/O.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from gearshift.dev.loadgen import DEFAULT_TRACE, finite_number

#: The repository root (operator/gearshift/dev/demo/__init__.py → four levels up).
REPO_ROOT = Path(__file__).resolve().parents[4]
DEFAULT_EXAMPLE = REPO_ROOT / "examples" / "demo" / "pdservice-demo.yaml"
DEFAULT_FLEET = REPO_ROOT / "examples" / "fleets/mixed.yaml"
DEFAULT_NAMESPACE = "gearshift-demo"
#: Issuing time of a default run, s: with up to 60 s of drain and about a minute of set-up and report,
#: the whole command stays within the issue's 10 minutes on a sandbox that is already built.
DEFAULT_DURATION_S = 480.0
#: Default replay speed (trace seconds per run second). The sandbox fleet's decode gear serves about
#: 24 req/s of this trace on 2 shared cores (the simulated engines and the router are Python processes);
#: at 3x the first 24 trace minutes offer 15.6 req/s on average (two thirds of that) and climb to 20 req/s
#: in 20 s bins at the end, so the bursts push the service without drowning it. Fitting the whole trace
#: into 480 s (7.3x, 40 req/s) would only measure an overloaded queue.
DEFAULT_TIME_SCALE = 3.0


def register(subparsers: Any) -> None:
    """Add ``gearshift demo``."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "demo",
        help="the end-to-end demo: sandbox + mixed GPU fleet, serve a real trace, write demo-report/",
        description="Bring up the sandbox (or reuse it), run the operator, profile every GPU node, "
        "deploy the example PDService with auto GearSets, replay a trace through the router "
        "(time-compressed, live progress) and write a report with plots. Traffic goes to loopback only.",
    )
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="CSV trace (Azure LLM 2023 format)")
    p.add_argument(
        "--time-scale",
        type=finite_number(0, True, "a speed-up factor; 0 fits the trace into --duration"),
        default=DEFAULT_TIME_SCALE,
        help=f"replay this many times faster than recorded ({DEFAULT_TIME_SCALE:g}; 0: fit the whole trace "
        "into --duration)",
    )
    p.add_argument(
        "--duration",
        type=finite_number(0, False, "seconds"),
        default=DEFAULT_DURATION_S,
        help="cap on the replay's issuing time, s (480)",
    )
    p.add_argument(
        "--start",
        type=finite_number(0, True, "trace seconds"),
        default=0.0,
        help="where in the trace to start, trace seconds (0)",
    )
    p.add_argument("--fleet", type=Path, default=DEFAULT_FLEET, help="fleet file for the sandbox's GPU nodes")
    p.add_argument(
        "--model", type=Path, default=None, help="HF config.json of the model to serve (default: Llama-3-8B)"
    )
    p.add_argument("--example", type=Path, default=DEFAULT_EXAMPLE, help="PDService + GearSets to apply")
    p.add_argument(
        "--namespace", default=DEFAULT_NAMESPACE, help=f"namespace to deploy in ({DEFAULT_NAMESPACE})"
    )
    keep = p.add_mutually_exclusive_group()
    keep.add_argument("--keep", dest="down", action="store_false", help="leave the cluster up (default)")
    keep.add_argument("--down", dest="down", action="store_true", help="tear the sandbox down at the end")
    p.set_defaults(down=False)
    p.add_argument("--report-dir", type=Path, default=Path("demo-report"), help="where to write the report")
    p.add_argument(
        "--results",
        type=Path,
        default=None,
        help="also write the run's figures (the report's summary.json) to this file, e.g. "
        "bench/results/demo.json",
    )
    p.add_argument(
        "--install",
        choices=("auto", "helm", "local"),
        default="auto",
        help="how to run the operator: the Helm chart, or a local `gearshift operator` process (auto: "
        "the chart when it is installable, else local)",
    )
    p.add_argument(
        "--ready-timeout",
        type=finite_number(0, False, "seconds"),
        default=300.0,
        help="seconds to wait for the service (300)",
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from gearshift.dev.demo.run import main

    return main(args)
