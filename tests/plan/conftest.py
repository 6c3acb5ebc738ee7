"""Helpers for the planner tests.

The suite runs with the slow contract tier on (tests/conftest.py), whose whole-pool checks make
a replay on a pool of thousands of blocks crawl. Runs on real-sized pools therefore go through
the installed command in a subprocess with the cheap tier only, as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from ..conftest import kvproof_command


def plan_cli(*argv: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "ICONTRACT_SLOW": "0"}
    return subprocess.run(
        [*kvproof_command(), "plan", *argv], capture_output=True, text=True, env=env, timeout=timeout,
    )


def plan_json(*argv: str) -> dict:
    done = plan_cli(*argv, "--json", "--no-progress")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(name="plan_cli")
def plan_cli_fixture():
    return plan_cli


@pytest.fixture(name="plan_json")
def plan_json_fixture():
    return plan_json
