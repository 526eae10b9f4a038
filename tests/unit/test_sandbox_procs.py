"""gearshift.dev.sandbox.procs: pid files record the intended command line, so a process caught mid-exec
at start is not later taken for a stale one (the demo's pid-file race)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gearshift.dev.sandbox import procs

ARGV = ["gearshift-sim", "--listen", "127.1.0.5:8000"]


@pytest.mark.parametrize(
    ("cmdline", "argv", "want"),
    [
        (ARGV, ARGV, True),  # a binary: the kernel shows argv as given
        (["/venv/bin/python3.11", "/venv/bin/gearshift-sim", *ARGV[1:]], ARGV, True),  # #! script via PATH
        (["/bin/sh", "-e", "/x/run.sh", "a"], ["/x/run.sh", "a"], True),  # interpreter with an argument
        (["/venv/bin/python3.11", "/venv/bin/gearshift-router", *ARGV[1:]], ARGV, False),  # another script
        (["/venv/bin/python3.11", "/venv/bin/gearshift-sim", "--listen", "127.1.0.6:8000"], ARGV, False),
        (
            ["/venv/bin/python3.11", "-m", "gearshift.dev.sandbox.podrunner"],
            ARGV,
            False,
        ),  # the parent, pre-exec
        (ARGV[1:], ARGV, False),  # shorter
        (None, ARGV, False),  # gone or a zombie
        ([], ARGV, False),
        (ARGV, [], False),
    ],
)
def test_cmdline_matches(cmdline: list[str] | None, argv: list[str], want: bool) -> None:
    assert procs.cmdline_matches(cmdline, argv) is want


def test_pidfile_records_the_intended_argv_not_a_mid_exec_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race: right after Popen returns, /proc may show nothing or the parent's command line."""
    parent = b"/venv/bin/python3.11\0-m\0gearshift.dev.sandbox.podrunner\0"
    monkeypatch.setattr(procs, "_read_cmdline", lambda pid: parent)
    pidfile = tmp_path / "c.pid"
    procs.write_pidfile(pidfile, 4242, ARGV)
    rec = json.loads(pidfile.read_text())
    assert rec["pid"] == 4242 and rec["argv"] == ARGV
    # Later the process runs the script: it is ours and alive.
    shown = b"\0".join(a.encode() for a in ["/venv/bin/python3.11", "/venv/bin/gearshift-sim", *ARGV[1:]])
    monkeypatch.setattr(procs, "_read_cmdline", lambda pid: shown)
    assert procs.running(pidfile) == 4242


def test_empty_cmdline_of_a_live_process_is_waited_out(monkeypatch: pytest.MonkeyPatch) -> None:
    reads = iter([b"", b"", b"\0".join(a.encode() for a in ARGV) + b"\0"])
    monkeypatch.setattr(procs, "_read_cmdline", lambda pid: next(reads))
    monkeypatch.setattr(procs, "_zombie", lambda pid: False)
    assert procs.is_ours(4242, ARGV)


def test_empty_cmdline_of_a_zombie_is_not_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(procs, "_read_cmdline", lambda pid: b"")
    monkeypatch.setattr(procs, "_zombie", lambda pid: True)
    assert procs._cmdline(4242) is None


def test_old_pidfiles_with_the_kernel_cmdline_still_match(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        pidfile = tmp_path / "old.pid"
        kernel = [sys.executable, "-c", "import time; time.sleep(30)"]
        pidfile.write_text(json.dumps({"pid": proc.pid, "argv": kernel, "started": 0}))
        assert procs.running(pidfile) == proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_start_running_stop_a_script(tmp_path: Path) -> None:
    """A ``#!`` script started by name: the kernel shows its interpreter first; still ours, then stopped."""
    script = tmp_path / "napper"
    script.write_text("#!/bin/sh\nsleep 30\n")
    script.chmod(0o755)
    pidfile = tmp_path / "run" / "napper.pid"
    proc = procs.start(pidfile, [str(script), "x"], tmp_path / "napper.log")
    try:
        assert json.loads(pidfile.read_text())["argv"] == [str(script), "x"]
        assert procs.running(pidfile) == proc.pid
        assert procs.stop(pidfile, timeout_s=5) is True
        assert not pidfile.exists()
        assert proc.wait(timeout=5) is not None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_stale_pidfile_is_removed_without_signalling(tmp_path: Path) -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    pidfile = tmp_path / "gone.pid"
    procs.write_pidfile(pidfile, proc.pid, ["true"])
    assert procs.running(pidfile) is None
    assert procs.stop(pidfile) is False
    assert not pidfile.exists()
