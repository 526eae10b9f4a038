"""``gearshift sandbox up|down|status|env``: the local sandbox cluster from the command line.

Two more sub-commands exist for the pod runner's tests and are not listed in ``--help``:
``echo-server`` (a tiny HTTP server with ``/health``, ``/metrics`` and ``/`` echoing the pod's identity)
and ``exit-with`` (writes a termination message and exits with a given code, like a probe Job).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    """Add ``sandbox`` and its sub-commands to the ``gearshift`` parser."""
    p = subparsers.add_parser(
        "sandbox",
        help="local Kubernetes sandbox with fake GPU nodes (up, down, status, env)",
        description="A real control plane (kube-apiserver, scheduler, controller-manager, etcd) run as "
        "local processes by kwokctl, fake GPU nodes from a fleet file, Prometheus, and a local pod runner. "
        "State in .sandbox/ (GEARSHIFT_SANDBOX_DIR overrides).",
    )
    sub = p.add_subparsers(dest="sandbox_command", metavar="{up,down,status,env}")

    up = sub.add_parser("up", help="bring the sandbox up, or check and repair it (idempotent)")
    up.add_argument(
        "--fleet", type=Path, default=None, help="fleet file (default examples/fleets/mixed.yaml)"
    )
    up.add_argument("--cpu-nodes", type=int, default=2, help="plain CPU nodes besides the GPU nodes (2)")
    up.add_argument("--no-prometheus", action="store_true", help="do not run Prometheus")
    up.add_argument("--quiet", action="store_true", help="print only the summary")
    up.add_argument(
        "--light-pods",
        action="store_true",
        help="run pods as forks of the pod runner (simulated probes in-process, engines asleep and "
        "Ready): fleets of hundreds of nodes (bench/fleet_operator.py)",
    )
    up.set_defaults(func=_up)

    down = sub.add_parser("down", help="stop everything the sandbox started and delete its cluster")
    down.set_defaults(func=_down)

    st = sub.add_parser("status", help="report the sandbox's parts; exit 1 when it is not up")
    st.add_argument("--json", action="store_true", help="print JSON")
    st.set_defaults(func=_status)

    env = sub.add_parser("env", help='print shell exports: eval "$(gearshift sandbox env)"')
    env.set_defaults(func=_env)

    echo = sub.add_parser("echo-server", help=argparse.SUPPRESS)
    echo.add_argument("--host", default=None, help="listen address (default $GEARSHIFT_HOST)")
    echo.add_argument("--port", type=int, default=None, help="port (default $GEARSHIFT_PORT or 8000)")
    echo.add_argument("--ready-after", type=float, default=0.0, help="answer /health 503 for this long, s")
    echo.set_defaults(func=_echo)

    ex = sub.add_parser("exit-with", help=argparse.SUPPRESS)
    ex.add_argument("--code", type=int, default=0, help="exit code")
    ex.add_argument("--message", default="", help="termination message")
    ex.add_argument("--sleep", type=float, default=0.0, help="seconds to run before exiting")
    ex.add_argument(
        "--leave-child", type=float, default=0.0, help="start a child that sleeps this long, s, and leave it"
    )
    ex.set_defaults(func=_exit_with)
    # argparse lists a sub-parser even with help=SUPPRESS (as "==SUPPRESS=="); the two test entry points
    # stay callable but out of --help.
    sub._choices_actions[:] = [a for a in sub._choices_actions if a.help != argparse.SUPPRESS]

    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def invoked_as() -> str:
    """How to run this ``gearshift`` again from the same directory: the path it was started by when that
    was a path (``.venv/bin/gearshift``: a venv's command is on no PATH until activated), else
    ``gearshift``."""
    argv0 = sys.argv[0] if sys.argv else ""
    return shlex.quote(argv0) if "/" in argv0 and Path(argv0).name == "gearshift" else "gearshift"


def _layout() -> Any:
    from gearshift.dev.sandbox.layout import Layout

    return Layout.from_env()


def _up(args: argparse.Namespace) -> int:
    from gearshift.dev.sandbox import cluster
    from gearshift.dev.sandbox.layout import SandboxConfigError
    from gearshift.facts.fleet import FleetError

    layout = _layout()
    say = cluster.Progress(quiet=args.quiet)
    try:
        state = cluster.up(
            layout,
            fleet_path=args.fleet or cluster.DEFAULT_FLEET,
            cpu_nodes=args.cpu_nodes,
            prometheus=not args.no_prometheus,
            say=say,
            light_pods=args.light_pods,
        )
    except (SandboxConfigError, cluster.SandboxError, FleetError, OSError) as exc:
        print(f"gearshift sandbox up: {exc}", file=sys.stderr)
        return 1
    say("ready")
    print(f"sandbox {state['name']} is up ({len(state['nodes'])} nodes, pod IPs 127.{state['octet']}.x.x)")
    print(f"  kubeconfig:  {state['kubeconfig']}")
    print(f"  prometheus:  {state.get('prometheus_url') or '(not running)'}")
    from gearshift.dev.sandbox.layout import env_prefix

    pre, prog = env_prefix(), invoked_as()
    print(f'  shell:       eval "$({pre}{prog} sandbox env)"')
    print(f"  tear down:   {pre}{prog} sandbox down")
    return 0


def _down(args: argparse.Namespace) -> int:
    from gearshift.dev.sandbox import cluster

    cluster.down(_layout())
    return 0


def _status(args: argparse.Namespace) -> int:
    from gearshift.dev.sandbox import cluster

    st = cluster.status(_layout())
    if args.json:
        print(json.dumps(st, indent=2))
    else:
        print(f"sandbox {st['name']}: {'up' if st['up'] else 'DOWN'}  (state in {st['state_dir']})")
        for comp, pid in st["components"].items():
            print(f"  {comp:24s} {'pid ' + str(pid) if pid else 'not running'}")
        print(f"  {'api server':24s} {'ready' if st['api_ready'] else 'not ready'}")
        prom = st["prometheus_url"] or "(not running)"
        print(f"  {'prometheus':24s} {prom}{'' if st['prometheus_ready'] else '  (not ready)'}")
        runner = st["podrunner_pid"]
        print(f"  {'pod runner':24s} {'pid ' + str(runner) if runner else 'not running'}")
        print(f"  {'nodes':24s} {len(st['nodes'])}; kubeconfig {st['kubeconfig']}")
    return 0 if st["up"] else 1


def _env(args: argparse.Namespace) -> int:
    from gearshift.dev.sandbox import cluster

    print("\n".join(cluster.env_lines(_layout())))
    return 0


def _echo(args: argparse.Namespace) -> int:
    from gearshift.testing.servers import run_echo_server

    return run_echo_server(args.host, args.port, args.ready_after)


def _exit_with(args: argparse.Namespace) -> int:
    from gearshift.testing.servers import exit_with

    return exit_with(args.code, args.message, args.sleep, args.leave_child)
