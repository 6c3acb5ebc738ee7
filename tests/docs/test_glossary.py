"""docs/glossary.md's worked example is what ``python examples/block_sizes.py`` prints."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_worked_example_is_the_scripts_output():
    text = (ROOT / "docs" / "glossary.md").read_text()
    [quoted] = re.findall(r"```text\n(.*?)```", text, re.S)
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "block_sizes.py")],
                          capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout == quoted
