"""Processes and files of ``kvproof e2e``: killed in any way, it leaves no rank and no
file behind; a rank that dies is named; errors are one line whatever the ranks print."""

from __future__ import annotations

import collections
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from kvproof import leftovers
from kvproof.e2e.ranks import RankError
from kvproof.e2e.faults import Faults
from kvproof.e2e.runner import E2EOptions, run_e2e
from kvproof.e2e.workloads import hybrid_workload
from kvproof.sim.trace import dump_trace

from .conftest import layout_config

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process table in /proc")

HYBRID = ["--group", "full_attention:4", "--group", "mamba:8", "--hash-block-size", "2"]


def _process_table() -> dict[int, tuple[int, str, int]]:
    """pid -> (parent pid, state, start time) of every process."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                text = f.read()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        table[int(name)] = (int(fields[1]), fields[0], int(fields[19]))
    return table


def _descendants(pid: int) -> dict[int, tuple[int, int]]:
    """pid -> (depth below ``pid``, start time) of every descendant."""
    table = _process_table()
    children = collections.defaultdict(list)
    for child, (parent, _, _) in table.items():
        children[parent].append(child)
    found, stack = {}, [(pid, 0)]
    while stack:
        parent, depth = stack.pop()
        for child in children[parent]:
            found[child] = (depth + 1, table[child][2])
            stack.append((child, depth + 1))
    return found


def _alive(processes: dict[int, tuple[int, int]]) -> list[int]:
    table = _process_table()
    return [p for p, (_, start) in processes.items() if p in table and table[p][2] == start and table[p][1] != "Z"]


def _wait_until(condition, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.fixture
def long_trace(tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"id": "long", "prompt": list(range(8)), "output": list(range(20_000))}) + "\n")
    return str(path)


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM", "Ctrl-C"])
def test_a_killed_e2e_leaves_no_rank_and_no_file(tmp_path, long_trace, how):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    p = subprocess.Popen(
        [sys.executable, "-m", "kvproof", "e2e", long_trace, *HYBRID, "--max-model-len", "32768",
         "--num-blocks", "2048", "--dcp", "4"],
        env={**os.environ, "TMPDIR": str(tmp)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        # Rank processes are the caller's grandchildren (children of the fork server).
        assert _wait_until(lambda: sum(d == 2 for d, _ in _descendants(p.pid).values()) == 4, 180), "ranks never started"
        family = _descendants(p.pid)
        ranks = {pid: v for pid, v in family.items() if v[0] == 2}
        if how == "SIGKILL":
            os.kill(p.pid, signal.SIGKILL)
        elif how == "SIGTERM":
            os.kill(p.pid, signal.SIGTERM)
        else:
            os.killpg(p.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole process group
        assert _wait_until(lambda: not _alive(ranks), 2.0), f"ranks alive 2 s after {how}: {_alive(ranks)}"
        # The fork server and the resource tracker follow; nothing holds the output pipe open.
        out, err = p.communicate(timeout=10)
        assert _wait_until(lambda: not _alive(family), 5.0), _alive(family)
        assert _wait_until(lambda: not os.listdir(tmp), 5.0), os.listdir(tmp)
    finally:
        if p.poll() is None:
            p.kill()
        for pid in _alive(_descendants(p.pid)):
            os.kill(pid, signal.SIGKILL)
    expected = {"SIGKILL": (-9, b""), "SIGTERM": (143, b"kvproof e2e: terminated\n"),
                "Ctrl-C": (130, b"kvproof e2e: interrupted\n")}[how]
    assert (p.returncode, err) == expected
    assert out == b""


def test_what_a_process_group_sigkill_leaves_the_next_run_removes(tmp_path, long_trace):
    """SIGKILL to the whole process group (``kill -9 -PGID``): the caller and its fork server die
    with no cleanup, so the fork server's socket directory stays behind; it names its dead
    owner, and the next e2e run removes it before it starts its own. (A short TMPDIR: under a
    long one, such as pytest's under xdist, the directory goes to /tmp, shared with others.)"""
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="kvp-", dir="/tmp"))
    try:
        _sigkill_then_rerun(tmp, tmp_path, long_trace)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _sigkill_then_rerun(tmp, tmp_path, long_trace) -> None:
    env = {**os.environ, "TMPDIR": str(tmp)}
    p = subprocess.Popen(
        [sys.executable, "-m", "kvproof", "e2e", long_trace, *HYBRID, "--max-model-len", "32768",
         "--num-blocks", "2048", "--dcp", "4"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        assert _wait_until(lambda: sum(d == 2 for d, _ in _descendants(p.pid).values()) == 4, 180), "ranks never started"
        family = _descendants(p.pid)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait(timeout=10)
        assert _wait_until(lambda: not _alive(family), 5.0), _alive(family)
    finally:
        if p.poll() is None:
            p.kill()
    left = os.listdir(tmp)
    assert len(left) == 1 and left[0].startswith(f"kvproof-{leftovers.owner_tag(p.pid).partition('.')[0]}."), left
    trace = tmp_path / "hybrid.jsonl"
    trace.write_text(dump_trace(hybrid_workload()))
    done = subprocess.run([sys.executable, "-m", "kvproof", "e2e", str(trace), *HYBRID, "--max-model-len", "128",
                           "--dcp", "2"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert _wait_until(lambda: not os.listdir(tmp), 5.0), os.listdir(tmp)


def test_a_rank_that_dies_is_named_not_its_peers_connection_reset():
    with pytest.raises(RankError) as caught:
        run_e2e(hybrid_workload(), layout_config(dcp=4), E2EOptions(max_num_batched_tokens=12),
                faults=Faults(rank_killed_at_step=(2, 3)))
    assert (caught.value.rank, caught.value.kind) == (2, "RankDied")
    assert caught.value.message.startswith("rank 2 was killed by SIGKILL before it could report an error")


def test_errors_raised_on_ranks_are_one_line_and_leave_no_file(tmp_path):
    """A pool that passes the up-front check but runs short during a chunk transition: rank 0's
    scheduler raises, every rank stops, one line, status 2, an empty temp directory."""
    trace = tmp_path / "hybrid.jsonl"
    trace.write_text(dump_trace(hybrid_workload()))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "kvproof", "e2e", str(trace), *HYBRID, "--max-model-len", "128",
         "--max-num-batched-tokens", "12", "--dcp", "2", "--num-blocks", "9"],
        env={**os.environ, "TMPDIR": str(tmp)}, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("kvproof e2e: error: request 'd' cannot get blocks")
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert _wait_until(lambda: not os.listdir(tmp), 5.0), os.listdir(tmp)
