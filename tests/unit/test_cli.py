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


def test_every_listed_command_is_the_one_its_module_registers():
    """Each entry of COMMANDS names the sub-command its module adds (so ``gearshift X`` loads the right
    module alone), and ``--help`` lists exactly COMMANDS, in order."""
    import argparse

    from gearshift.cli import COMMANDS, build_parser

    for command, _module in COMMANDS:
        sub = build_parser(command)._subparsers
        assert sub is not None
        actions = [a for a in sub._group_actions if isinstance(a, argparse._SubParsersAction)]
        assert list(actions[0].choices) == [command]
    full = build_parser()
    (action,) = [a for a in full._actions if isinstance(a, argparse._SubParsersAction)]
    assert list(action.choices) == [c for c, _ in COMMANDS]


def test_a_command_whose_module_fails_to_import_is_an_error_naming_it(monkeypatch, capsys):
    """A broken sub-command module is reported (command, module, cause, fix), never skipped."""
    import gearshift.cli as cli

    monkeypatch.setattr(cli, "COMMANDS", (*cli.COMMANDS, ("broken", "gearshift.no_such_module")))
    assert main(["broken"]) == 1
    err = capsys.readouterr().err
    assert "gearshift broken: cannot import gearshift.no_such_module" in err
    assert "make venv" in err
    # --help loads every module: the broken one fails it too, rather than vanishing from the list.
    assert main(["--help"]) == 1
