"""Tiny programs the pod runner's tests run inside sandbox pods (``gearshift sandbox echo-server|exit-with``).

They stand in for the simulated engine and the probe where a test needs only the runner's side of the
contract: an HTTP server bound to the pod IP, and a program that leaves a termination message and exits.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

#: Environment variables whose values ``/`` echoes (the pod's identity and the runner's additions).
ECHO_PREFIXES = ("POD_", "NODE_", "GEARSHIFT_", "ECHO_")


def run_echo_server(host: str | None, port: int | None, ready_after_s: float = 0.0) -> int:
    """Serve ``/`` (JSON: host, port, pid, and the env vars of ``ECHO_PREFIXES``), ``/health`` (200 once
    ``ready_after_s`` seconds have passed, 503 before) and ``/metrics`` (``gearshift_echo_requests_total``)
    until SIGTERM. Host and port default to ``$GEARSHIFT_HOST`` and ``$GEARSHIFT_PORT`` (8000).
    """
    host = host or os.environ.get("GEARSHIFT_HOST") or "127.0.0.1"
    port = port or int(os.environ.get("GEARSHIFT_PORT") or 8000)
    registry = CollectorRegistry()
    requests = Counter(
        "gearshift_echo_requests", "Requests served by the echo server", ["path"], registry=registry
    )
    started = time.monotonic()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            requests.labels(path=path).inc()
            if path == "/health":
                ok = time.monotonic() - started >= ready_after_s
                self._send(200 if ok else 503, b"ok" if ok else b"warming up", "text/plain")
            elif path == "/metrics":
                self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif path == "/":
                env = {k: v for k, v in os.environ.items() if k.startswith(ECHO_PREFIXES)}
                body = {"host": host, "port": port, "pid": os.getpid(), "env": env}
                self._send(200, json.dumps(body).encode(), "application/json")
            else:
                self._send(404, b"not found", "text/plain")

        def _send(self, code: int, body: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    print(f"echo-server listening on http://{host}:{port}", flush=True)
    # shutdown() blocks until serve_forever() returns, so it cannot run on the serving thread itself.
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def exit_with(code: int, message: str, sleep_s: float = 0.0, leave_child_s: float = 0.0) -> int:
    """Run ``sleep_s`` seconds, write ``message`` to ``$GEARSHIFT_TERMINATION_LOG`` (when set), and return
    ``code`` as the exit status; prints the message to stdout too (for FallbackToLogsOnError).
    ``leave_child_s`` > 0: first start a child process that sleeps that long and is not waited for (as a
    vLLM API server leaves its EngineCore), and print ``child <pid>``."""
    if leave_child_s > 0:
        child = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({leave_child_s!r})"])
        print(f"child {child.pid}", flush=True)
    time.sleep(max(0.0, sleep_s))
    print(message, flush=True)
    path = os.environ.get("GEARSHIFT_TERMINATION_LOG")
    if path and message:
        with open(path, "w") as fh:
            fh.write(message)
    sys.stdout.flush()
    return code
