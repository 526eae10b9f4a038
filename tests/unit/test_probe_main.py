"""``gearshift-probe`` and ``gearshift probe``: JSON on stdout, the termination log, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from gearshift.api.probedoc import ProbeOutputError, validate_link_output, validate_probe_output
from gearshift.cli import main as gearshift_main
from gearshift.dev.sandbox.nodes import gpu_node_manifest
from gearshift.probe import link
from gearshift.probe.__main__ import main

REPO = Path(__file__).resolve().parents[2]
#: A CPU probe that takes about a second.
SMALL = ["--backend", "numpy", "--model", "tiny-llama", "--seq-len", "16", "--batches", "1,2"]
SMALL += ["--matmul-size", "64", "--copy-mib", "1", "--max-micro-batch", "2", "--reps", "3", "--warmup", "1"]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("GEARSHIFT_TERMINATION_LOG", "GEARSHIFT_PROBE_SIMULATED", "GEARSHIFT_NODE_ANNOTATIONS"):
        monkeypatch.delenv(var, raising=False)


def stdout_json(capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    return json.loads(capsys.readouterr().out)


class TestDevice:
    def test_cpu_probe_prints_and_writes_termination_log(self, tmp_path, capsys):
        log = tmp_path / "termination-log"
        assert main(["--termination-log", str(log), "device", *SMALL, "--node", "n1"]) == 0
        doc = stdout_json(capsys)
        validate_probe_output(doc, expected_kinds={"cpu"})
        assert doc["node"] == "n1" and doc["shape"]["model"] == "tiny-llama" and "devices" in doc
        written = log.read_text()
        assert len(written.encode()) <= 4096
        short = validate_probe_output(written)
        assert "devices" not in short and short["summary"] == doc["summary"]

    def test_device_is_the_default_command_and_env_names_the_log(self, tmp_path, capsys, monkeypatch):
        log = tmp_path / "from-env"
        monkeypatch.setenv("GEARSHIFT_TERMINATION_LOG", str(log))
        assert main(SMALL) == 0
        assert validate_probe_output(log.read_text())["kind"] == "cpu"

    def test_flag_wins_over_env(self, tmp_path, monkeypatch, capsys):
        monkeypatch.setenv("GEARSHIFT_TERMINATION_LOG", str(tmp_path / "env"))
        assert main([f"--termination-log={tmp_path / 'flag'}", *SMALL]) == 0
        assert (tmp_path / "flag").exists() and not (tmp_path / "env").exists()

    def test_simulated_from_node_annotations(self, tmp_path, capsys, monkeypatch):
        from gearshift.facts.fleet import load_fleet

        node = load_fleet(REPO / "examples" / "fleets/mixed.yaml").nodes[-1]
        ann = gpu_node_manifest(node, 3, 7)["metadata"]["annotations"]
        monkeypatch.setenv("GEARSHIFT_NODE_ANNOTATIONS", json.dumps(ann))
        monkeypatch.setenv("GEARSHIFT_PROBE_SIMULATED", "1")
        log = tmp_path / "log"
        assert main(["--termination-log", str(log), "device", "--node", node.name]) == 0
        doc = validate_probe_output(log.read_text(), expected_kinds={"simulated"})
        assert (doc["gpuModel"], doc["backend"], doc["node"]) == (node.gpu.model, "datasheet", node.name)

    def test_failure_writes_the_reason_and_exits_1(self, tmp_path, capsys):
        log = tmp_path / "log"
        assert main(["--termination-log", str(log), "device", "--simulated"]) == 1
        assert "GEARSHIFT_NODE_ANNOTATIONS" in capsys.readouterr().err
        with pytest.raises(ProbeOutputError, match="reported a failure: SimulatedDeviceError"):
            validate_probe_output(log.read_text())

    def test_bad_flag_value_exits_2_naming_it(self, tmp_path, capsys):
        assert main(["--termination-log", str(tmp_path / "l"), "device", *SMALL, "--batches", "2,4"]) == 2
        assert "--batches" in capsys.readouterr().err

    def test_unwritable_explicit_log_fails(self, tmp_path, capsys):
        assert main(["--termination-log", str(tmp_path / "missing" / "log"), *SMALL]) == 1

    def test_console_script_module(self, tmp_path):
        log = tmp_path / "log"
        proc = subprocess.run(
            [sys.executable, "-m", "gearshift.probe", "--termination-log", str(log), *SMALL],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        assert validate_probe_output(proc.stdout)["backend"] == "numpy"


class TestLinkCommands:
    def test_client_against_server(self, tmp_path, capsys):
        server = link.LinkServer("127.0.0.1", 0, idle_timeout_s=10)
        port = server.bind()
        t = threading.Thread(target=server.serve, daemon=True)
        t.start()
        log = tmp_path / "log"
        args = ["--termination-log", str(log), "link-client", "--peer-address", f"127.0.0.1:{port}"]
        args += ["--peer", "gpu-b", "--node", "gpu-a", "--max-mib", "4", "--frame-mib", "1", "--pings", "5"]
        assert main(args) == 0
        t.join(timeout=10)
        doc = validate_link_output(log.read_text())
        assert (doc["node"], doc["peer"], doc["bytes"]) == ("gpu-a", "gpu-b", 4 << 20)

    def test_server_command_serves_then_exits(self, tmp_path, capsys):
        with __import__("socket").socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        log = tmp_path / "log"
        result: list[int] = []
        args = ["--termination-log", str(log), "link-server", "--host", "127.0.0.1", "--port", str(port)]
        t = threading.Thread(
            target=lambda: result.append(main([*args, "--idle-timeout-s", "10"])), daemon=True
        )
        t.start()
        link.measure_link("127.0.0.1", port, link.LinkBudget(pings=2, frame_bytes=1024, max_bytes=2048))
        t.join(timeout=10)
        assert result == [0]
        assert json.loads(log.read_text())["sessions"] == 1

    def test_client_with_nobody_listening_fails_cleanly(self, tmp_path, capsys):
        with __import__("socket").socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            log = tmp_path / "log"
            args = ["--termination-log", str(log), "link-client", "--peer-address", f"127.0.0.1:{port}"]
            assert main([*args, "--connect-timeout-s", "0.5"]) == 1
        with pytest.raises(ProbeOutputError, match="cannot connect"):
            validate_link_output(log.read_text())


class TestGearshiftCli:
    def test_pairs_of_the_mixed_fleet(self, capsys, tmp_path):
        fleet = str(REPO / "examples" / "fleets/mixed.yaml")
        assert gearshift_main(["probe", "--termination-log", str(tmp_path / "l"), "pairs", fleet]) == 0
        doc = stdout_json(capsys)
        assert doc["nodes"] == 10 and doc["allPairs"] == 45
        assert 0 < len(doc["pairs"]) < 45
        assert sorted(p for r in doc["rounds"] for p in r) == doc["pairs"]

    def test_probe_device_via_gearshift(self, capsys, tmp_path):
        assert gearshift_main(["probe", "--termination-log", str(tmp_path / "l"), "device", *SMALL]) == 0
        assert validate_probe_output(stdout_json(capsys))["kind"] == "cpu"
