"""The test-wide seal (tests/conftest.py): a unit test cannot reach a cluster or leave loopback, and a bare
``pytest`` on a machine without a cluster deselects the e2e tests with one line."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: tests/conftest.py's exception: ``conftest`` is no importable name when several conftest files exist.
UnitTestLeftTheMachine = RuntimeError


def test_the_handlers_default_client_is_refused():
    from gearshift.handlers.runtime import Runtime

    with pytest.raises(UnitTestLeftTheMachine, match="load_incluster_config"):
        Runtime().api  # noqa: B018  (the property builds the client)


def test_the_default_kubeconfig_is_refused():
    from kubernetes import config

    with pytest.raises(UnitTestLeftTheMachine, match="load_kube_config"):
        config.load_kube_config()
    assert not Path(os.environ["KUBECONFIG"]).exists()


def test_non_loopback_connects_are_refused_before_any_packet():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        with pytest.raises(UnitTestLeftTheMachine, match=r"10\.0\.0\.1"):
            s.connect(("10.0.0.1", 80))
        with pytest.raises(UnitTestLeftTheMachine):
            s.connect_ex(("192.168.1.1", 80))


def test_loopback_stays_open():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        with socket.create_connection(server.getsockname(), timeout=5):
            conn, _ = server.accept()
            conn.close()


def test_bare_pytest_without_a_cluster_deselects_e2e_with_one_line(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "GEARSHIFT_E2E")}
    env["GEARSHIFT_CACHE"] = str(tmp_path / "empty-cache")  # no sandbox binaries here
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/e2e/test_api.py",
         "tests/unit/test_sealed.py::test_loopback_stays_open"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    notes = [ln for ln in proc.stdout.splitlines() if ln.startswith("e2e: ")]
    assert len(notes) == 1, proc.stdout[-3000:]
    assert "tests not run: the sandbox's binaries are not built" in notes[0]
    assert "1 passed" in proc.stdout and "deselected" in proc.stdout
