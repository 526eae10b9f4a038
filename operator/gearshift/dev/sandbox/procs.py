"""Managed local processes: start detached with a pid file, find, and stop only what we started.

A pid file (JSON ``{"pid", "argv", "started"}``) records each process with the command line we *asked*
for. Before signalling a pid we check that ``/proc/<pid>/cmdline`` still runs that command
(:func:`cmdline_matches`: exactly, or as a ``#!`` script behind its interpreter), so a pid reused by an
unrelated process after a crash or reboot is never killed.

The pid file never records what ``/proc`` shows right after the start: ``Popen`` returns once the
close-on-exec pipe closes, which is before the kernel has set up the new program's arguments, so that
read can catch an empty or not-yet-replaced command line; a live process of ours then looked stale.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

#: How long :func:`_cmdline` waits for a live process's empty command line to appear (mid-exec), s.
EXEC_GRACE_S = 0.5


def _read_cmdline(pid: int) -> bytes | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None


def _zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    # "pid (comm) S ...": the state follows the last ')' (comm may hold parentheses).
    return stat[stat.rfind(")") + 2 : stat.rfind(")") + 3] in ("Z", "X")


def _cmdline(pid: int) -> list[str] | None:
    """The kernel's command line of ``pid``; None when it is gone or a zombie.

    A live process shows an empty command line for a moment while it execs; that is waited out (up to
    :data:`EXEC_GRACE_S`) rather than taken for a dead process.
    """
    deadline = time.monotonic() + EXEC_GRACE_S
    raw = _read_cmdline(pid)
    while raw is not None and not raw and not _zombie(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
        raw = _read_cmdline(pid)
    if not raw:
        return None  # gone, or a zombie (its command line is empty)
    return raw.rstrip(b"\0").decode(errors="replace").split("\0")


def cmdline_matches(cmdline: list[str] | None, argv: list[str]) -> bool:
    """Whether a kernel command line ``cmdline`` is the process started with ``argv``.

    Exactly ``argv``, or a ``#!`` script: the kernel shows ``interpreter [arg] script args...``, where
    ``script`` is the path the program was found at (``argv[0]`` or its ``PATH`` resolution, so only the
    base names are compared) and the rest is ``argv[1:]``.
    """
    if not cmdline or not argv:
        return False
    if cmdline == argv:
        return True
    n = len(argv)
    if len(cmdline) <= n or cmdline[len(cmdline) - n + 1 :] != argv[1:]:
        return False
    return Path(cmdline[len(cmdline) - n]).name == Path(argv[0]).name


def is_ours(pid: int, argv: list[str]) -> bool:
    """True when ``pid`` is alive and runs ``argv`` (the command line we started; :func:`cmdline_matches`)."""
    return cmdline_matches(_cmdline(pid), argv)


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
    """Record ``pid`` with ``argv``, the command line it was started with (not ``/proc``'s, which may
    not show the new program yet; :func:`running` compares with :func:`cmdline_matches`)."""
    tmp = pidfile.with_name(pidfile.name + ".tmp")
    tmp.write_text(json.dumps({"pid": pid, "argv": list(argv), "started": time.time()}))
    tmp.replace(pidfile)


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
        _reap(pid)
        # Gone (or a zombie) reads as None; a different command line is a pid reused after it exited.
        if _cmdline(pid) != argv:
            return True
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    _reap(pid)
    return True


def _reap(pid: int) -> None:
    # Only our own children can be reaped; for others waitpid fails and that is fine.
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)
