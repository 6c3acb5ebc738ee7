"""``kvproof plan``'s progress: counted in the workload's requests, per phase, with how many
configurations are done; drawn on a terminal's stderr only, and never with --no-progress."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import struct
import termios
import subprocess
import threading

import pytest

from kvproof.cli.main import build_parser
from kvproof.cli.plan import build_request
from kvproof.planner.plan import PHASES, Progress, prepare, progress_bar, run_plan

from ..conftest import kvproof_command

SMALL = ["plan", "--group", "full_attention:128", "--group", "mamba:256", "--max-model-len", "8192",
         "--num-blocks", "400", "--generate", "--requests", "12", "--dcp", "1,2", "--eviction", "lru,compute"]


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_progress_counts_the_workloads_requests_per_phase(jobs):
    req = build_request(build_parser().parse_args([*SMALL, "--jobs", jobs]))
    _, tasks, _ = prepare(req)
    seen: list[Progress] = []
    run_plan(req, seen.append)
    assert seen, "no progress reported"
    phases = list(dict.fromkeys(p.phase for p in seen))
    assert phases[0] == PHASES[0] and phases == [ph for ph in PHASES if ph in phases]
    for phase in phases:
        mine = [p for p in seen if p.phase == phase]
        assert all(p.workload == len(req.workload) == 12 for p in mine)
        assert all(0 <= p.requests <= p.workload and 0 <= p.configs_done <= p.configs for p in mine)
        assert [p.requests for p in mine] == sorted(p.requests for p in mine)
        assert [p.configs_done for p in mine] == sorted(p.configs_done for p in mine)
        assert (mine[-1].requests, mine[-1].configs_done) == (12, mine[-1].configs)
    first = [p for p in seen if p.phase == PHASES[0]]
    assert first[-1].configs == len(tasks) > 2  # 2 DCP sizes x 2 policies, and the stock rows
    # Half the phase's replays done reads as half the workload's requests, whatever the split.
    assert any(0 < p.requests < 12 for p in first)


def test_the_bar_reads_requests_of_the_workload_and_configurations():
    out = io.StringIO()
    update, close = progress_bar(True, out)
    update(Progress("replaying", 412, 1000, 3, 9))
    close()
    assert "replaying: requests 412/1,000, 3/9 configurations done" in out.getvalue()
    assert progress_bar(False)[0] is None


def _stderr_on_a_terminal(*argv: str) -> str:
    """Run the installed command with stderr on a pseudo-terminal; what it drew there."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 200, 0, 0))  # a fresh pty is 0 columns wide
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    env = {**os.environ, "ICONTRACT_SLOW": "0"}
    done = subprocess.run([*kvproof_command(), *argv], stdout=subprocess.DEVNULL, stderr=slave, env=env, timeout=600)
    os.close(slave)
    reader.join(timeout=10)
    os.close(master)
    assert done.returncode == 0
    return b"".join(chunks).decode(errors="replace")


def test_a_terminal_shows_the_bar_and_no_progress_hides_it():
    argv = [*SMALL, "--jobs", "1"]
    drawn = _stderr_on_a_terminal(*argv)
    shown = set(re.findall(r"[a-z -]+: requests \d+/\d+, \d+/\d+ configurations done", drawn))
    # 2 DCP sizes x 2 policies and the 2 stock rows, then the recommendation's 2 step times.
    assert {"replaying: requests 12/12, 6/6 configurations done",
            "step-time check: requests 12/12, 2/2 configurations done"} <= shown
    assert all(re.search(r"requests \d+/12,", line) for line in shown)  # never requests x configurations
    assert _stderr_on_a_terminal(*argv, "--no-progress") == ""
