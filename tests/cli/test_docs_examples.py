"""Every ``console`` example in docs/*.md and README.md is a command whose output matches: run
in process, or, with ``KVPROOF_CLI`` set (CI: the wheel the README's first command installs),
through that installed command."""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess

import pytest

from kvproof.cli.main import main

from ..conftest import INSTALLED_CLI

ROOT = pathlib.Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"```console\n(.*?)```", re.S)


def _examples():
    for path in sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")]):
        for block in BLOCK.findall(path.read_text()):
            command, _, expected = block.partition("\n")
            assert command.startswith("$ kvproof "), f"{path.name}: console block must start with '$ kvproof'"
            yield pytest.param(command[2:], expected, id=f"{path.name}:{command[10:60]}")


@pytest.mark.parametrize("command, expected", list(_examples()))
def test_doc_example_output(capsys, monkeypatch, command, expected):
    monkeypatch.chdir(ROOT)  # examples name files relative to the repository root
    argv = shlex.split(command)[1:]
    if INSTALLED_CLI:
        done = subprocess.run([INSTALLED_CLI, *argv], capture_output=True, text=True, cwd=ROOT, timeout=600,
                              env={**os.environ, "ICONTRACT_SLOW": "0"})
        assert done.returncode == 0, done.stderr
        assert done.stdout == expected
        return
    assert main(argv) == 0
    assert capsys.readouterr().out == expected
