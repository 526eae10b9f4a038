"""The demo's access to the cluster and to Prometheus: the pinned kubectl and loopback-only HTTP.

Thin I/O wrappers; the decisions live in the pure modules and in the steps :mod:`gearshift.dev.demo.run` runs.
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gearshift.k8s.apply_text import apply_text


class DemoError(RuntimeError):
    """The demo cannot go on; the message says what failed and where to look."""


def is_loopback_url(url: str) -> bool:
    """True when ``url``'s host is a loopback address (127.0.0.0/8, ::1) or ``localhost``."""
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def http_get(url: str, timeout: float = 5.0) -> bytes:
    """GET ``url`` and return the body; refuses anything but loopback (the sandbox's network rule)."""
    if not is_loopback_url(url):
        raise DemoError(f"refusing to contact {url}: the demo talks to loopback addresses only")
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return bytes(resp.read())


@dataclass
class Kube:
    """The pinned kubectl against one kubeconfig."""

    kubeconfig: Path
    env: dict[str, str]
    kubectl_bin: str = "kubectl"

    def run(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Run ``kubectl --kubeconfig K <args>``; raises DemoError on failure when ``check``."""
        argv = [self.kubectl_bin, "--kubeconfig", str(self.kubeconfig), *args]
        proc = subprocess.run(
            argv, input=input, capture_output=True, text=True, timeout=timeout, env=self.env, check=False
        )
        if check and proc.returncode != 0:
            raise DemoError(
                f"`kubectl {' '.join(args)}` exited {proc.returncode}: {proc.stderr.strip()[-800:]}"
            )
        return proc

    def json(self, *args: str, timeout: float = 60) -> Any:
        """``kubectl <args> -o json``, parsed."""
        return json.loads(self.run(*args, "-o", "json", timeout=timeout).stdout)

    def get(self, *args: str) -> Any | None:
        """``kubectl get <args> -o json``, parsed; None when the object does not exist (or kubectl fails)."""
        proc = self.run("get", *args, "-o", "json", check=False)
        return json.loads(proc.stdout) if proc.returncode == 0 and proc.stdout.strip() else None

    def apply_docs(self, docs: list[dict[str, Any]], namespace: str | None = None) -> str:
        """``kubectl apply -f -`` of ``docs``; returns kubectl's output."""
        ns = ("-n", namespace) if namespace else ()
        return self.run("apply", *ns, "-f", "-", input=apply_text(docs)).stdout

    def ensure_namespace(self, name: str) -> None:
        """Create namespace ``name`` unless it exists."""
        if self.run("get", "namespace", name, check=False).returncode != 0:
            self.run("create", "namespace", name)


@dataclass
class Prometheus:
    """Prometheus' HTTP API on a loopback URL."""

    url: str

    def __post_init__(self) -> None:
        if not is_loopback_url(self.url):
            raise DemoError(f"Prometheus URL {self.url} is not a loopback address")

    def _api(self, path: str, params: dict[str, str], timeout: float = 10.0) -> Any:
        body = json.loads(http_get(f"{self.url}{path}?{urllib.parse.urlencode(params)}", timeout))
        if body.get("status") != "success":
            raise DemoError(f"Prometheus {path} failed: {body.get('error')}")
        return body["data"]["result"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query; ``data.result``."""
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        return list(self._api("/api/v1/query", params))

    def query_range(self, expr: str, start: float, end: float, step_s: float) -> list[dict[str, Any]]:
        """A range query over [start, end] (Unix s); ``data.result`` (a matrix)."""
        params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step_s:g}"}
        return list(self._api("/api/v1/query_range", params, timeout=30.0))


def wait_until(
    predicate: Callable[[], Any],
    timeout_s: float,
    what: str,
    interval_s: float = 1.0,
    on_wait: Callable[[Any], None] | None = None,
) -> Any:
    """Poll ``predicate`` until it returns something truthy (returned); DemoError naming ``what`` at the
    deadline. ``on_wait`` sees each falsy result (for progress output)."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while True:
        try:
            last = predicate()
        except (DemoError, OSError, ValueError) as exc:  # not there yet: keep polling until the deadline
            last = exc
        if last and not isinstance(last, Exception):
            return last
        if on_wait is not None:
            on_wait(last)
        if time.monotonic() >= deadline:
            raise DemoError(f"timed out after {timeout_s:.0f} s waiting for {what}; last: {last!r}")
        time.sleep(interval_s)
