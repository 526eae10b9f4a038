"""The demo's orchestration: sandbox, operator, profiles, service, replay with a live line, report.

Thin on purpose: each step calls the sandbox, kubectl, the load generator or a pure helper, and prints
what it did. Traffic goes only to loopback addresses: the router's pod IP and Prometheus on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from gearshift.dev.demo import trace as tracewin
from gearshift.dev.demo.context import Ctx, Inputs, Say
from gearshift.dev.demo.fleet import wait_profiles
from gearshift.dev.demo.install import start_operator, stop_operator
from gearshift.dev.demo.kube import DemoError, Kube, Prometheus
from gearshift.dev.demo.replay import replay
from gearshift.dev.demo.results import write_report
from gearshift.dev.demo.service import apply_service, load_example, router_url
from gearshift.dev.sandbox.layout import env_prefix


def _sandbox(args: argparse.Namespace, say: Say) -> tuple[Any, dict[str, Any]]:
    from gearshift.dev.sandbox import cluster
    from gearshift.dev.sandbox.layout import Layout

    layout = Layout.from_env()
    say(f"sandbox: bringing up {layout.name} with fleet {args.fleet} (reused when already up)")
    state = cluster.up(layout, fleet_path=args.fleet, say=lambda m: say(f"  sandbox: {m}"))
    return layout, state


def _preflight(args: argparse.Namespace) -> Inputs:
    """Read and check the inputs the run uses, before it touches the cluster: the trace and its window,
    the model's config and the example. A mistake costs nothing then: the previous run's service stays.

    Raises:
        DemoError: naming the flag and what is wrong with it.
        TraceError: a bad trace row or column (it names the file and the line).
    """
    from gearshift.dev.loadgen import load_trace

    if not args.trace.exists():
        raise DemoError(f"trace {args.trace} not found (--trace)")
    trace = load_trace(args.trace)
    try:
        scale = args.time_scale or tracewin.auto_time_scale(trace, args.duration)
        window = tracewin.window(trace, scale, args.duration, args.start, getattr(args, "keep_every", 1))
    except ValueError as exc:
        raise DemoError(f"--start/--duration/--time-scale/--keep-every: {exc}") from None
    if args.model is not None:
        from gearshift.facts.model import load_hf_config

        try:
            load_hf_config(args.model)
        except (OSError, ValueError) as exc:
            raise DemoError(f"--model {args.model}: not a readable HF config.json ({exc})") from None
    try:
        docs = load_example(args.example, args.model)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise DemoError(f"--example {args.example}: {exc}") from None
    if not any(d.get("kind") == "PDService" for d in docs):
        raise DemoError(f"--example {args.example}: no PDService in it")
    return Inputs(window, docs)


@contextlib.contextmanager
def _one_demo_at_a_time(state_dir: Path) -> Iterator[None]:
    """Hold the sandbox's demo lock (``<state dir>/demo.lock``, flock) for the run: a second demo would
    delete the first one's service under its replay.

    Raises:
        DemoError: another demo holds it (its pid in the message).
    """
    import fcntl

    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / "demo.lock"
    with path.open("a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "?"
            raise DemoError(
                f"another gearshift demo is running on this sandbox (pid {holder}); wait for it to end, "
                "or stop it (Ctrl-C), then run again"
            ) from None
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def main(args: argparse.Namespace) -> int:
    """Run the demo; returns the exit code."""
    from gearshift.dev.loadgen import LoadgenError
    from gearshift.dev.sandbox import cluster
    from gearshift.dev.sandbox.layout import Layout, SandboxConfigError
    from gearshift.dev.tracefile import TraceError
    from gearshift.facts.fleet import FleetError

    say = Say()
    ctx: Ctx | None = None
    code = 1
    lock = contextlib.ExitStack()
    held = False
    try:
        inputs = _preflight(args)
        lock.enter_context(_one_demo_at_a_time(Layout.from_env().state_dir))
        held = True
        layout, state = _sandbox(args, say)
        kube = Kube(layout.kubeconfig, layout.subprocess_env(), str(layout.binary("kubectl")))
        url = state.get("prometheus_url")
        ctx = Ctx(args, say, layout, kube, Prometheus(url) if url else None, state, inputs=inputs)
        if ctx.prom is None:
            ctx.notes.append("The sandbox ran without Prometheus: no per-stage utilisation plot.")
        start_operator(ctx)
        fleet_table = wait_profiles(ctx)
        gearsets = apply_service(ctx)
        router = router_url(ctx)
        rep, win = replay(ctx, router, gearsets)
        path = write_report(ctx, rep, win, fleet_table, gearsets)
        say(f"report: {path} (and PNG plots beside it)")
        code = 0
    except (
        DemoError,
        SandboxConfigError,
        cluster.SandboxError,
        FleetError,
        LoadgenError,
        TraceError,
        OSError,
        ValueError,
    ) as exc:
        say(f"failed: {exc}")
    except KeyboardInterrupt:
        say("interrupted")
        code = 130
    finally:
        if ctx is not None:
            stop_operator(ctx)
        lock.close()
        # A run that never held the lock (a bad flag, another demo running) leaves the cluster as it
        # found it, --down included.
        if held and args.down:
            cluster.down(Layout.from_env(), say=lambda m: say(f"  sandbox: {m}"))
            say("sandbox: down")
        elif ctx is not None:
            say("the cluster stays up. Explore it with:")
            lines = [
                f'  eval "$({env_prefix()}.venv/bin/gearshift sandbox env)"',
                "  kubectl get gearshift -A",
                f"  kubectl get gearsets,pods -n {args.namespace} -o wide",
            ]
            if ctx.install == "local":
                # The local operator stopped with the demo: resources stay as they are, and deleting them
                # waits for its finalizers. Say how to run it again.
                lines += [
                    "  the operator stopped with the demo; to keep reconciling (and to delete the service):",
                    f"    GEARSHIFT_SANDBOX=1 .venv/bin/gearshift operator --namespace {args.namespace} \\",
                    f"      --kubeconfig {ctx.layout.kubeconfig} --probe-port 0 --metrics-port 0",
                ]
            lines.append(f"tear down: {env_prefix()}.venv/bin/gearshift sandbox down")
            say.block("\n".join(lines))
    return code
