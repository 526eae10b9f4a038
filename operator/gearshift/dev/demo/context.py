"""What the demo's steps share: the flags, the cluster's handles, the output, and the checked inputs."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gearshift.dev.demo import trace as tracewin
from gearshift.dev.demo.kube import Kube, Prometheus

#: Live-line refresh and router scrape interval, s (the sandbox's Prometheus scrapes every 2 s too).
TICK_S = 2.0
#: Window of the live line's QPS and P99, s.
LIVE_WINDOW_S = 20.0


class Say:
    """Step-by-step output on stderr with the seconds since the demo started."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    def __call__(self, msg: str) -> None:
        print(f"[demo {time.monotonic() - self.start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    def block(self, text: str) -> None:
        print(text.rstrip(), flush=True)


@dataclass(frozen=True)
class Inputs:
    """What :func:`gearshift.dev.demo.run._preflight` read and checked, before the cluster was touched."""

    window: tracewin.Window
    """The requests the replay sends, at its time scale."""
    docs: list[dict[str, Any]]
    """The example's documents (with ``--model``'s architecture in the PDService)."""


@dataclass
class Ctx:
    """What the steps share."""

    args: argparse.Namespace
    say: Say
    layout: Any
    kube: Kube
    prom: Prometheus | None
    state: dict[str, Any]
    service: str = ""
    slo: dict[str, float] = field(default_factory=dict)
    install: str = "local"
    notes: list[str] = field(default_factory=list)
    operator: subprocess.Popen[bytes] | None = None
    """The local ``gearshift operator`` process, when the demo started one."""
    metrics_target: Path | None = None
    """The sandbox Prometheus' target file of the local operator's ``/metrics``, while it runs."""
    inputs: Inputs | None = None
    """The checked trace window and example (:func:`gearshift.dev.demo.run._preflight`)."""
