"""``gearshift-probe``: the probe program of the worker image (also ``gearshift probe`` and ``python -m``).

Sub-commands (``device`` when none is given):
  - ``device``: probe this node's GPUs (or the CPU, or the sandbox's simulated GPU with ``--simulated``);
  - ``link-server`` / ``link-client``: the two ends of a pairwise link measurement;
  - ``pairs``: which node pairs a fleet file's link probes would measure, and in which rounds.

Each prints one JSON document on stdout and writes it (``device``: without per-device detail) to the
termination log: ``--termination-log``, else ``$GEARSHIFT_TERMINATION_LOG``, else
``/dev/termination-log``, where Kubernetes reads it into the pod status for the operator. On failure it
writes ``{"schemaVersion": 1, "probe": ..., "error": "..."}`` there, prints the reason on stderr, and
exits 1 (2 for bad arguments).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

DEFAULT_TERMINATION_LOG = "/dev/termination-log"
ENV_TERMINATION_LOG = "GEARSHIFT_TERMINATION_LOG"
ENV_SIMULATED = "GEARSHIFT_PROBE_SIMULATED"
ENV_NODE = ("GEARSHIFT_NODE_NAME", "NODE_NAME")
ENV_HOST = ("GEARSHIFT_HOST", "POD_IP")
#: Seconds the hard watchdog allows past ``--time-budget-s`` (for releasing the GPU and writing output).
WATCHDOG_GRACE_S = 30


class UsageError(ValueError):
    """Bad command-line values; the message names the flag."""


def _env(names: Sequence[str], default: str | None = None) -> str | None:
    for n in names:
        if os.environ.get(n):
            return os.environ[n]
    return default


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def add_commands(parser: argparse.ArgumentParser) -> None:
    """Add the probe's sub-commands to ``parser`` (used by ``gearshift-probe`` and ``gearshift probe``)."""
    parser.add_argument(
        "--termination-log",
        default=None,
        help=f"where to write the result (${ENV_TERMINATION_LOG}, else {DEFAULT_TERMINATION_LOG})",
    )
    sub = parser.add_subparsers(dest="probe_command", metavar="{device,link-server,link-client,pairs}")

    dev = sub.add_parser("device", help="probe this node's GPUs (or CPU, or simulated GPU)")
    dev.add_argument(
        "--simulated",
        action="store_true",
        default=os.environ.get(ENV_SIMULATED, "") in ("1", "true", "yes"),
        help=f"report the sandbox node's datasheet GPU (${ENV_SIMULATED}=1)",
    )
    dev.add_argument("--backend", default="auto", choices=("auto", "torch", "numpy"))
    dev.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    dev.add_argument("--dtype", default=None, help="torch dtype (default bfloat16 on CUDA, float32 on CPU)")
    dev.add_argument(
        "--cpu-threads",
        type=int,
        default=1,
        help="threads of a CPU run (0: the library default; 1: steadiest)",
    )
    dev.add_argument(
        "--model", default=None, help="HF config.json path, or llama-3-8b / tiny-llama (default by device)"
    )
    dev.add_argument("--seq-len", type=int, default=None, help="tokens per sequence in the blocks")
    dev.add_argument("--batches", type=_int_list, default=None, help="micro-batches, e.g. 1,4,16 (needs 1)")
    dev.add_argument("--matmul-size", type=int, default=None, help="square matmul side m = n = k")
    dev.add_argument("--copy-mib", type=int, default=None, help="bytes per copy, MiB")
    dev.add_argument("--memory-budget-gib", type=float, default=None, help="activation budget of a layer")
    dev.add_argument("--memory-fraction", type=float, default=None, help="budget as a share of free memory")
    dev.add_argument("--max-micro-batch", type=int, default=None, help="cap of the micro-batch ramp")
    dev.add_argument("--warmup", type=int, default=None)
    dev.add_argument("--reps", type=int, default=None)
    dev.add_argument("--time-budget-s", type=float, default=None, help="whole probe's time budget, s")
    dev.add_argument("--node", default=_env(ENV_NODE), help="node name ($GEARSHIFT_NODE_NAME, $NODE_NAME)")
    dev.set_defaults(probe_func=_device)

    srv = sub.add_parser("link-server", help="serve link measurements on this pod's IP")
    srv.add_argument("--host", default=_env(ENV_HOST, "127.0.0.1"), help="listen address ($POD_IP)")
    srv.add_argument("--port", type=int, default=None)
    srv.add_argument("--sessions", type=int, default=1, help="sessions before exiting (0: until idle)")
    srv.add_argument("--idle-timeout-s", type=float, default=120.0)
    srv.set_defaults(probe_func=_link_server)

    cli = sub.add_parser("link-client", help="measure the link to a link-server")
    cli.add_argument("--peer-address", required=True, help="server IP[:PORT]")
    cli.add_argument("--port", type=int, default=None)
    cli.add_argument("--peer", default=None, help="the server's node name")
    cli.add_argument("--node", default=_env(ENV_NODE), help="this node's name")
    cli.add_argument("--pings", type=int, default=50)
    cli.add_argument("--frame-mib", type=int, default=16)
    cli.add_argument("--max-mib", type=int, default=1024, help="most bytes to send, MiB")
    cli.add_argument("--max-seconds", type=float, default=10.0)
    cli.add_argument("--connect-timeout-s", type=float, default=30.0)
    cli.set_defaults(probe_func=_link_client)

    pairs = sub.add_parser("pairs", help="the node pairs a fleet's link probes measure, in rounds")
    pairs.add_argument("fleet", help="fleet YAML file (gearshift.facts.fleet format)")
    pairs.add_argument("--nearest", type=int, default=1)
    pairs.set_defaults(probe_func=_pairs)


# --- sub-commands ---------------------------------------------------------------------------------------


def _device(args: argparse.Namespace) -> dict[str, Any]:
    from gearshift.probe import run

    if args.simulated:
        return _simulated(args)
    from gearshift.probe.backends import select_backends

    if args.cpu_threads < 0:
        raise UsageError(f"--cpu-threads must be >= 0, got {args.cpu_threads}")
    backends = select_backends(args.backend, args.device, args.dtype, args.cpu_threads or None)
    cfg = _config(args, run.ProbeConfig() if backends[0].device == "cuda" else run.CPU_CONFIG)
    with _watchdog(cfg.time_budget_s + WATCHDOG_GRACE_S):
        return run.run_device_probe(backends, cfg, node=args.node)


def _config(args: argparse.Namespace, base: Any) -> Any:
    from gearshift.probe import ops, run

    arch = base.arch
    if args.model:
        arch = _arch(args.model)
    overrides: dict[str, Any] = {"arch": arch}
    for flag, field in (
        ("seq_len", "seq_len"),
        ("batches", "batches"),
        ("matmul_size", "matmul_size"),
        ("memory_budget_gib", "memory_budget_gib"),
        ("memory_fraction", "memory_fraction"),
        ("max_micro_batch", "micro_batch_cap"),
        ("time_budget_s", "time_budget_s"),
    ):
        if getattr(args, flag) is not None:
            overrides[field] = getattr(args, flag)
    if args.copy_mib is not None:
        overrides["copy_bytes"] = args.copy_mib << 20
    rep = base.repeats
    if args.warmup is not None or args.reps is not None:
        reps = args.reps if args.reps is not None else rep.reps
        rep = ops.Repeats(
            warmup=args.warmup if args.warmup is not None else rep.warmup,
            reps=reps,
            min_reps=min(rep.min_reps, reps),
        )
    overrides["repeats"] = rep
    try:
        cfg: run.ProbeConfig = replace(base, **overrides)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return cfg


def _arch(spec: str) -> Any:
    from gearshift.facts.model import load_hf_config
    from gearshift.probe.run import LLAMA3_8B, TINY

    presets = {a.name: a for a in (LLAMA3_8B, TINY)}
    if spec in presets:
        return presets[spec]
    if not Path(spec).is_file():
        raise UsageError(f"--model {spec!r} is neither a config.json file nor one of {sorted(presets)}")
    return load_hf_config(spec)


def _simulated(args: argparse.Namespace) -> dict[str, Any]:
    from gearshift.probe import run, simulated

    cfg = _config(args, run.ProbeConfig())
    count_raw = os.environ.get(simulated.ENV_GPU_COUNT, "1")
    try:
        count = int(count_raw)
    except ValueError:
        raise UsageError(f"{simulated.ENV_GPU_COUNT}={count_raw!r} must be an integer") from None
    return simulated.simulated_probe(
        simulated.annotations_from_env(os.environ),
        arch=cfg.arch,
        seq_len=cfg.seq_len,
        batches=cfg.batches,
        gpu_count=count,
        node=args.node,
        memory_fraction=cfg.memory_fraction,
        micro_batch_cap=cfg.micro_batch_cap,
    )


def _link_server(args: argparse.Namespace) -> dict[str, Any]:
    from gearshift.probe import link

    server = link.LinkServer(
        args.host,
        args.port if args.port is not None else link.DEFAULT_PORT,
        max_sessions=args.sessions or None,
        idle_timeout_s=args.idle_timeout_s,
    )
    port = server.bind()
    print(f"gearshift-probe: link server listening on {args.host}:{port}", file=sys.stderr, flush=True)
    stats = server.serve()
    return {"schemaVersion": 1, "probe": "link-server", "address": f"{args.host}:{port}", **stats}


def _link_client(args: argparse.Namespace) -> dict[str, Any]:
    from gearshift.probe import link

    host, _, port_text = args.peer_address.rpartition(":") if "]" not in args.peer_address else ("", "", "")
    if not host or not port_text.isdigit():
        host, port_text = args.peer_address.strip("[]"), ""
    port = args.port or (int(port_text) if port_text else link.DEFAULT_PORT)
    try:
        budget = link.LinkBudget(
            pings=args.pings,
            frame_bytes=args.frame_mib << 20,
            max_bytes=args.max_mib << 20,
            max_seconds=args.max_seconds,
            connect_timeout_s=args.connect_timeout_s,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return link.measure_link(host, port, budget, node=args.node, peer=args.peer)


def _pairs(args: argparse.Namespace) -> dict[str, Any]:
    from gearshift.facts.fleet import load_fleet
    from gearshift.probe import link

    fleet = load_fleet(args.fleet)
    nodes = [link.LinkNode(n.name, n.gpu.model, n.compute_score) for n in fleet.nodes]
    pairs = link.pairs_to_measure(nodes, nearest=args.nearest)
    n = len(nodes)
    return {
        "schemaVersion": 1,
        "probe": "pairs",
        "nodes": n,
        "allPairs": n * (n - 1) // 2,
        "pairs": [list(p) for p in pairs],
        "rounds": [[list(p) for p in r] for r in link.schedule_rounds(pairs)],
    }


# --- plumbing -------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _watchdog(seconds: float) -> Iterator[None]:
    """Raise ProbeTimeoutError in the main thread after ``seconds`` (a hang past every Deadline check)."""
    from gearshift.probe.timing import ProbeTimeoutError

    # Signal handlers can only be installed from the main thread (an embedding caller may use another).
    if (
        not hasattr(signal, "SIGALRM")
        or seconds <= 0
        or threading.current_thread() is not threading.main_thread()
    ):
        yield
        return

    def fire(signum: int, frame: Any) -> None:
        raise ProbeTimeoutError(f"probe watchdog fired after {seconds:g} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def termination_log_path(flag: str | None) -> tuple[str, bool]:
    """The termination log path and whether it was asked for explicitly (flag or environment)."""
    if flag:
        return flag, True
    env = os.environ.get(ENV_TERMINATION_LOG)
    if env:
        return env, True
    return DEFAULT_TERMINATION_LOG, False


def _write_termination_log(path: str, explicit: bool, doc: dict[str, Any]) -> bool:
    from gearshift.api.probedoc import compact

    try:
        body = compact(doc) if doc.get("probe") == "device" and "error" not in doc else doc
        Path(path).write_text(json.dumps(body, separators=(",", ":")))
    except OSError as exc:
        # Outside a pod /dev/termination-log does not exist: only an explicit path is an error.
        print(f"gearshift-probe: cannot write termination log {path}: {exc}", file=sys.stderr)
        return not explicit
    return True


def run_args(args: argparse.Namespace) -> int:
    """Run the parsed sub-command; prints, writes the termination log; returns the exit code."""
    from gearshift.api.probedoc import ProbeOutputError
    from gearshift.probe.backends import BackendError
    from gearshift.probe.link import LinkProbeError
    from gearshift.probe.simulated import SimulatedDeviceError
    from gearshift.probe.timing import ProbeTimeoutError

    path, explicit = termination_log_path(args.termination_log)
    command = args.probe_command or "device"
    kind = "link" if command == "link-client" else command
    try:
        doc = args.probe_func(args)
        if doc.get("probe") == "device":
            from gearshift.api.probedoc import validate_probe_output

            validate_probe_output(doc)
        elif doc.get("probe") == "link":
            from gearshift.api.probedoc import validate_link_output

            validate_link_output(doc)
    except UsageError as exc:
        print(f"gearshift-probe: {exc}", file=sys.stderr)
        _write_termination_log(path, explicit, {"schemaVersion": 1, "probe": kind, "error": str(exc)})
        return 2
    except (
        BackendError,
        LinkProbeError,
        ProbeOutputError,
        ProbeTimeoutError,
        SimulatedDeviceError,
        OSError,
        ValueError,
        MemoryError,
        RuntimeError,
    ) as exc:
        msg = f"{type(exc).__name__}: {exc}"
        print(f"gearshift-probe: failed: {msg}", file=sys.stderr)
        _write_termination_log(path, explicit, {"schemaVersion": 1, "probe": kind, "error": msg[:3000]})
        return 1
    print(json.dumps(doc, indent=None if doc.get("probe") == "device" else 2))
    return 0 if _write_termination_log(path, explicit, doc) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gearshift-probe", description="Measure GPU nodes and the links between them (JSON out)."
    )
    add_commands(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``gearshift-probe``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"device", "link-server", "link-client", "pairs", "-h", "--help"}
    # ``device`` is the default: a bare ``gearshift-probe`` (the probe Job's command) probes the node.
    split = 0
    if argv[:1] == ["--termination-log"]:
        split = 2
    elif argv[:1] and argv[0].startswith("--termination-log="):
        split = 1
    if not any(a in commands for a in argv[split : split + 1]):
        argv.insert(split, "device")
    args = build_parser().parse_args(argv)
    return run_args(args)


if __name__ == "__main__":
    sys.exit(main())
