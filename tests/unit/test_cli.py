from __future__ import annotations

import json
import subprocess
import sys

from gearshift import __version__
from gearshift.cli import main


def test_version_text(capsys):
    assert main(["version"]) == 0
    assert capsys.readouterr().out.startswith(f"gearshift {__version__} (API gearshift.io/v1alpha1")


def test_version_json_console_script():
    out = subprocess.run(
        [sys.executable, "-m", "gearshift.cli", "version", "-o", "json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert json.loads(out)["gearshift"] == __version__


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2
    assert "usage: gearshift" in capsys.readouterr().out
