"""The simulated engine's HTTP server (``gearshift-sim``): vLLM's OpenAI-compatible API over :class:`Engine`.

The process: flags and ``GEARSHIFT_*`` variables read into one :class:`SimConfig` per pod, and every pod's
app (:func:`gearshift.sim.app.build_app`) served in one event loop until SIGINT/SIGTERM. One process can
serve many pods: ``--listen HOST:PORT`` repeated (same engine settings, one engine per listener) or
``--pods FILE`` (YAML/JSON list of ``{listen: HOST:PORT, env: {GEARSHIFT_...}}``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import yaml
from aiohttp import web

from gearshift.sim.app import build_app
from gearshift.sim.config import SimConfig, SimConfigError, config_from_env
from gearshift.sim.engine import EngineConfigError
from gearshift.sim.looplag import LoopLagMonitor


def load_pods_file(path: str | Path, base_env: Mapping[str, str]) -> list[SimConfig]:
    """Read a ``--pods`` file: a list of ``{listen: "HOST:PORT", env: {GEARSHIFT_...: ..}}``; each pod's
    env is laid over ``base_env``. Non-string env values (objects, numbers) are JSON-encoded.

    Raises:
        SimConfigError: naming the entry and field.
    """
    with Path(path).open() as fh:
        doc = yaml.safe_load(fh)
    pods = doc.get("pods") if isinstance(doc, dict) else doc
    if not isinstance(pods, list) or not pods:
        raise SimConfigError(f"{path}: expected a list of pods (or {{pods: [...]}})")
    out = []
    for i, pod in enumerate(pods):
        if not isinstance(pod, dict) or "listen" not in pod:
            raise SimConfigError(f"{path}: pods[{i}] needs 'listen: HOST:PORT'")
        env = dict(base_env)
        for k, v in (pod.get("env") or {}).items():
            env[str(k)] = v if isinstance(v, str) else json.dumps(v)
        host, port = _split_listen(str(pod["listen"]), f"pods[{i}].listen")
        env["GEARSHIFT_HOST"], env["GEARSHIFT_PORT"] = host, str(port)
        try:
            out.append(config_from_env(env))
        except SimConfigError as exc:
            raise SimConfigError(f"{path}: pods[{i}]: {exc}") from None
    return out


def _split_listen(value: str, where: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise SimConfigError(f"{where} must be HOST:PORT, got {value!r}")
    return host.strip("[]"), int(port)


async def serve(configs: Sequence[SimConfig], stop: asyncio.Event | None = None) -> None:
    """Serve every pod of ``configs`` in this event loop until ``stop`` is set (or SIGINT/SIGTERM)."""
    lag = LoopLagMonitor()
    runners = []
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        for cfg in configs:
            # Cancelling a handler whose client left aborts its request, as vLLM does; shutdown does not
            # wait for simulated requests that may run for minutes.
            runner = web.AppRunner(
                build_app(cfg, lag),
                access_log=None,
                handle_signals=False,
                handler_cancellation=True,
                shutdown_timeout=1.0,
            )
            await runner.setup()
            await web.TCPSite(runner, cfg.host, cfg.port, backlog=1024).start()
            runners.append(runner)
            kind = "worker" if cfg.worker else f"head role={cfg.role}"
            name = cfg.served_model_name
            print(f"gearshift-sim: serving {name} ({kind}) on http://{cfg.listen}", flush=True)
        await stop.wait()
    finally:
        for runner in runners:
            await runner.cleanup()
        await lag.stop()


def build_arg_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Flags of ``gearshift-sim`` (also ``gearshift sim``); each overrides its ``GEARSHIFT_*`` variable."""
    p = parser or argparse.ArgumentParser(prog="gearshift-sim", description=__doc__.split("\n")[0])
    p.add_argument("--host", help="listen address (GEARSHIFT_HOST; default 127.0.0.1)")
    p.add_argument("--port", help="listen port (GEARSHIFT_PORT; default 8000)")
    p.add_argument("--role", choices=["prefill", "decode", "both"], help="GEARSHIFT_ROLE (default both)")
    p.add_argument("--stage", help="GEARSHIFT_STAGE: this pod's stage index (0 = head)")
    p.add_argument("--model", help="GEARSHIFT_MODEL: ModelArch JSON or path to an HF config.json")
    p.add_argument("--served-model-name", help="GEARSHIFT_SERVED_MODEL_NAME")
    p.add_argument("--pipeline", help="GEARSHIFT_PIPELINE JSON")
    p.add_argument("--gpu-profile", help="GEARSHIFT_GPU_PROFILE JSON")
    p.add_argument("--kv-link", help='GEARSHIFT_KV_LINK JSON {"gbps": .., "latencyUs": ..}')
    p.add_argument("--max-model-len", help="GEARSHIFT_MAX_MODEL_LEN")
    p.add_argument("--mfu", help="GEARSHIFT_SIM_MFU: prefill FLOPs utilisation (default 0.5)")
    p.add_argument("--mbu", help="GEARSHIFT_SIM_MBU: decode bandwidth utilisation (default 0.7)")
    p.add_argument("--worker", action="store_true", help="a stage k>0 pod: /health and /metrics only")
    p.add_argument(
        "--listen", action="append", metavar="HOST:PORT", help="serve one engine per listener (repeatable)"
    )
    p.add_argument("--pods", metavar="FILE", help="serve many pods: YAML list of {listen, env}")
    return p


_FLAG_ENV = {
    "host": "GEARSHIFT_HOST",
    "port": "GEARSHIFT_PORT",
    "role": "GEARSHIFT_ROLE",
    "stage": "GEARSHIFT_STAGE",
    "model": "GEARSHIFT_MODEL",
    "served_model_name": "GEARSHIFT_SERVED_MODEL_NAME",
    "pipeline": "GEARSHIFT_PIPELINE",
    "gpu_profile": "GEARSHIFT_GPU_PROFILE",
    "kv_link": "GEARSHIFT_KV_LINK",
    "max_model_len": "GEARSHIFT_MAX_MODEL_LEN",
    "mfu": "GEARSHIFT_SIM_MFU",
    "mbu": "GEARSHIFT_SIM_MBU",
}


def configs_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> list[SimConfig]:
    """The pods to serve from parsed flags over ``environ``.

    Raises:
        SimConfigError: a bad variable or flag, naming it.
    """
    env = dict(environ)
    for attr, var in _FLAG_ENV.items():
        value = getattr(args, attr, None)
        if value is not None:
            env[var] = str(value)
    if getattr(args, "worker", False):
        env["GEARSHIFT_WORKER"] = "1"
    if getattr(args, "pods", None):
        return load_pods_file(args.pods, env)
    base = config_from_env(env)
    if not getattr(args, "listen", None):
        return [base]
    out = []
    for i, item in enumerate(args.listen):
        host, port = _split_listen(item, f"--listen[{i}]")
        out.append(replace(base, host=host, port=port))
    return out


def run_from_args(args: argparse.Namespace) -> int:
    """Run the server(s) described by ``args``; returns the exit code (2 on configuration errors)."""
    try:
        configs = configs_from_args(args, os.environ)
        asyncio.run(serve(configs))
    except (SimConfigError, EngineConfigError) as exc:
        print(f"gearshift-sim: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the listening socket: a port in use, an address not on this host
        print(
            f"gearshift-sim: cannot listen: {exc.strerror or exc}; choose another --port/--host",
            file=sys.stderr,
        )
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``gearshift-sim``."""
    args = build_arg_parser().parse_args(argv)
    return run_from_args(args)


if __name__ == "__main__":
    sys.exit(main())
