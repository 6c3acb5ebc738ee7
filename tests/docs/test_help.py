"""What ``--help`` says a command does by default is what it does."""

from __future__ import annotations

import pytest

from kvproof.cli import plan
from kvproof.cli.main import main
from kvproof.cli.presets import DEFAULT_PRESET


@pytest.mark.parametrize("command, preset", [("plan", plan.DEFAULT_PRESET), ("replay", DEFAULT_PRESET),
                                             ("geometry", DEFAULT_PRESET)])
def test_help_names_the_preset_the_command_uses_by_default(command, preset, capsys):
    assert main([command, "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert f"a named layout (default {preset} when no --group" in text

