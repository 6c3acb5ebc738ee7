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


def write_next_turn_trace(path, conversations: int) -> None:
    """A Mooncake-format trace shaped as the real one: ``conversations`` chats of three turns,
    each next turn re-sending all but the last (partial) id of the previous prompt, so it shares
    the prompt up to a multiple of 512 below its end."""
    lines, next_id = [], 0
    for conv in range(conversations):
        ids = [next_id, next_id + 1]
        next_id += 2
        for turn in range(3):
            lines.append({"timestamp": 2000 * (3 * conv + turn), "input_length": 512 * (len(ids) - 1) + 300,
                          "output_length": 2, "hash_ids": list(ids)})
            ids = ids[:-1] + [next_id, next_id + 1]
            next_id += 2
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
