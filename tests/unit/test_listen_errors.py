"""A port already in use is one line naming it and the fix, exit 1: not a traceback (new-user review)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from gearshift.router import server as router_server
from gearshift.sim import server as sim_server

MODEL = Path(__file__).resolve().parents[2] / "examples" / "models" / "llama-3-8b.json"


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def test_the_sim_names_a_port_in_use(taken_port: int, capsys: pytest.CaptureFixture[str]) -> None:
    rc = sim_server.main(["--host", "127.0.0.1", "--port", str(taken_port), "--model", str(MODEL)])
    err = capsys.readouterr().err
    assert rc == 1
    assert f"{taken_port}" in err and "address already in use" in err and "--port" in err
    assert "Traceback" not in err


def test_the_router_names_a_port_in_use(taken_port: int, capsys: pytest.CaptureFixture[str]) -> None:
    rc = router_server.main(
        ["--host", "127.0.0.1", "--port", str(taken_port), "--backend", "both=http://127.0.0.1:9"]
    )
    err = capsys.readouterr().err
    assert rc == 1
    assert f"127.0.0.1:{taken_port}" in err and "address already in use" in err and "--port" in err
    assert "Traceback" not in err
