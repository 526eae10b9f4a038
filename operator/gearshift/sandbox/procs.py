"""Managed local processes: start detached with a pid file, find, and stop only what we started.

A pid file (JSON ``{"pid", "argv", "started"}``) records each process. Before signalling a pid we check
that ``/proc/<pid>/cmdline`` still is the recorded command line, so a pid reused by an unrelated
process after a crash or reboot is never killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path


def _cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    if not raw:
        return None  # a zombie has an empty command line
    return raw.rstrip(b"\0").decode(errors="replace").split("\0")


def is_ours(pid: int, argv: list[str]) -> bool:
    """True when ``pid`` is alive and runs exactly ``argv`` (the command line we started)."""
    return _cmdline(pid) == argv


def start(
    pidfile: Path, argv: list[str], log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start ``argv`` detached (own session, stdin closed, output appended to ``log``); write ``pidfile``.

    Returns the process (its ``poll()`` tells whether it still runs while this caller lives; later
    callers use ``running(pidfile)``). Raises OSError when the program cannot be executed.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    pidfile.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    write_pidfile(pidfile, proc.pid, argv)
    return proc


def write_pidfile(pidfile: Path, pid: int, argv: list[str]) -> None:
    """Record ``pid`` with its command line as the kernel reports it (a ``#!`` script shows as its
    interpreter followed by the script), falling back to ``argv``."""
    cmd = _cmdline(pid) or argv
    pidfile.write_text(json.dumps({"pid": pid, "argv": cmd, "started": time.time()}))


def running(pidfile: Path) -> int | None:
    """The pid recorded in ``pidfile`` when that process is still ours and alive, else None."""
    try:
        rec = json.loads(pidfile.read_text())
    except (OSError, ValueError):
        return None
    pid, argv = rec.get("pid"), rec.get("argv")
    if isinstance(pid, int) and isinstance(argv, list) and is_ours(pid, argv):
        return pid
    return None


def stop(pidfile: Path, timeout_s: float = 10.0) -> bool:
    """Stop the process of ``pidfile`` (SIGTERM, then SIGKILL after ``timeout_s``) and remove the file.

    Returns True when a live process of ours was stopped; a stale pid file is just removed.
    """
    pid = running(pidfile)
    stopped = False
    if pid is not None:
        stopped = terminate(pid, timeout_s)
    with contextlib.suppress(FileNotFoundError):
        pidfile.unlink()
    return stopped


def terminate(pid: int, timeout_s: float = 10.0) -> bool:
    """SIGTERM ``pid``, wait up to ``timeout_s`` for it to go, then SIGKILL. True if it was alive."""
    argv = _cmdline(pid)
    if argv is None:
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _cmdline(pid) != argv:
            return True
        _reap(pid)
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    _reap(pid)
    return True


def _reap(pid: int) -> None:
    # Only our own children can be reaped; for others waitpid fails and that is fine.
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)
