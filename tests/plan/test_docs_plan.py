"""docs/plan.md shows real output: each ``text`` block that starts with ``$ kvproof plan`` is
run (as a user runs it, cheap contract tier; with ``KVPROOF_CLI``, through that installed
command) and must print exactly what the block shows -- or, where the installed command lacks
an optional extra the example needs, refuse with the line naming it."""

from __future__ import annotations

import pathlib
import re
import shlex

import pytest

from kvproof.extras import message

from ..conftest import INSTALLED_CLI

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "plan.md"
BLOCK = re.compile(r"```text\n(\$ kvproof plan[^\n]*)\n(.*?)```", re.S)
EXAMPLES = BLOCK.findall(DOC.read_text())


def test_the_guide_shows_the_default_run():
    assert [c for c, _ in EXAMPLES][:1] == ["$ kvproof plan"]


@pytest.mark.slow
@pytest.mark.parametrize("command, expected", EXAMPLES, ids=[c for c, _ in EXAMPLES])
def test_documented_output(command, expected, plan_cli, tmp_path, monkeypatch):
    argv = shlex.split(command)[3:]  # after "$ kvproof plan"
    argv = [str(tmp_path / pathlib.Path(a).name) if a.endswith(".png") else a for a in argv]  # never overwrite the docs' plot
    done = plan_cli(*argv, "--no-progress")
    if INSTALLED_CLI and "--plot" in argv and done.returncode == 2:  # a wheel installed without [plot]
        assert done.stderr == f"kvproof plan: error: {message('plot', '--plot')}\n"
        return
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected
