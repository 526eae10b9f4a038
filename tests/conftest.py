"""Test-wide rules: unit tests are sealed off from any cluster; e2e tests are marked by their path and run
only where a cluster can be had.

- **Sealed unit tests** (:func:`_sealed`): a test not marked ``e2e`` that loads a kubeconfig or the
  in-cluster config, or opens a connection to an address outside loopback, fails with
  :class:`UnitTestLeftTheMachine` naming what it tried. ``KUBECONFIG`` points at a file that does not exist
  and ``GEARSHIFT_PROMETHEUS_URL`` is unset, so nothing falls back to the developer's own cluster or
  Prometheus (``pdservice.api()`` falls back to ``~/.kube/config``). Loopback stays open: unit tests run
  their own stub servers there.
- **e2e only with a cluster**: a bare ``pytest`` on a machine without the sandbox's binaries and without
  ``KUBECONFIG`` deselects the e2e tests and says so in one line. ``make test`` (and ``.ci/run``) set
  ``GEARSHIFT_E2E=1``, under which they always run, and fail loudly if no cluster comes up.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
#: Set by ``make test``/``make e2e``: the e2e tests must run (a missing cluster is a failure, not a skip).
E2E_REQUIRED = "GEARSHIFT_E2E"
_E2E_NOTE = pytest.StashKey[str]()


class UnitTestLeftTheMachine(RuntimeError):
    """A unit test reached for a cluster, a kubeconfig or a non-loopback address."""


def _no_e2e_reason() -> str | None:
    """Why e2e tests cannot run on this machine, or None when they can (a user cluster or the sandbox)."""
    if os.environ.get("KUBECONFIG"):
        return None
    from gearshift.dev.sandbox.layout import Layout

    missing = Layout.from_env().missing_binaries()
    if missing:
        more = ", …" if len(missing) > 3 else ""
        return f"the sandbox's binaries are not built ({', '.join(missing[:3])}{more})"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Everything under tests/e2e is an e2e test and runs after the unit tests.
    e2e_dir = REPO / "tests" / "e2e"
    for item in items:
        if e2e_dir in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)
    items.sort(key=lambda it: it.get_closest_marker("e2e") is not None)
    e2e = [it for it in items if it.get_closest_marker("e2e")]
    if not e2e or os.environ.get(E2E_REQUIRED) == "1":
        return
    reason = _no_e2e_reason()
    if reason:
        config.hook.pytest_deselected(items=e2e)
        items[:] = [it for it in items if not it.get_closest_marker("e2e")]
        config.stash[_E2E_NOTE] = (
            f"e2e: {len(e2e)} tests not run: {reason}; `make test` builds the sandbox and runs them "
            f"(or set KUBECONFIG to a cluster)"
        )


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    note = config.stash.get(_E2E_NOTE, None)
    if note:
        terminalreporter.write_line(note, yellow=True)


def _loopback(address: Any, family: int) -> bool:
    if family not in (socket.AF_INET, socket.AF_INET6):
        return True  # Unix sockets and the like stay on the machine
    host = address[0] if isinstance(address, tuple) else address
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(str(host).split("%")[0]).is_loopback
    except ValueError:
        return False  # a name: resolving it is already leaving the machine


@pytest.fixture(autouse=True)
def _sealed(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if request.node.get_closest_marker("e2e"):
        yield
        return
    monkeypatch.setenv("KUBECONFIG", str(REPO / "tests" / "unit-tests-have-no-kubeconfig"))
    for var in ("GEARSHIFT_PROMETHEUS_URL", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
        monkeypatch.delenv(var, raising=False)

    from kubernetes import config as kube_config

    def refuse(name: str) -> Any:
        real = getattr(kube_config, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            # A kubeconfig file the test wrote itself is the client's own parser at work, not a cluster.
            if name != "load_incluster_config" and (args or kwargs.get("config_file")):
                return real(*args, **kwargs)
            raise UnitTestLeftTheMachine(
                f"a unit test called kubernetes.config.{name}() (the default kubeconfig or the in-cluster "
                "config): give the code under test a fake KubeApi"
            )

        return call

    for name in ("load_kube_config", "load_incluster_config", "new_client_from_config", "load_config"):
        if hasattr(kube_config, name):
            monkeypatch.setattr(kube_config, name, refuse(name))
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex

    def guard(sock: socket.socket, address: Any) -> None:
        if not _loopback(address, sock.family):
            raise UnitTestLeftTheMachine(f"a unit test connected to {address!r}: unit tests stay on loopback")

    def connect(self: socket.socket, address: Any) -> None:
        guard(self, address)
        real_connect(self, address)

    def connect_ex(self: socket.socket, address: Any) -> int:
        guard(self, address)
        return real_connect_ex(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
    yield


@pytest.fixture(scope="session")
def bench_module() -> Callable[[str], ModuleType]:
    """``bench_module("gears")``: the benchmark script ``bench/gears.py`` as a module (bench/ is not a
    package; its scripts import their helpers, such as ``shapes``, by their bare names, so bench/ goes on
    ``sys.path``). Each is loaded once per session and registered in ``sys.modules`` under its name, as its
    dataclasses look their module up there."""
    bench = REPO / "bench"

    def load(name: str) -> ModuleType:
        if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(bench / f"{name}.py"):
            return sys.modules[name]
        if str(bench) not in sys.path:
            sys.path.insert(0, str(bench))
        spec = importlib.util.spec_from_file_location(name, bench / f"{name}.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod

    return load
