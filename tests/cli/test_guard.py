"""cli/guard.py: every subcommand ends with its own status and one line, whatever happens around
it -- Ctrl-C, SIGTERM, a closed stdout, a bug."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from kvproof.cli import geometry
from kvproof.cli.main import main


def _run(capsys, argv):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("signum, code, line", [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")])
def test_a_signal_is_one_line_and_128_plus_its_number(capsys, monkeypatch, signum, code, line):
    cleaned = []

    def killed_midway(args):
        try:
            os.kill(os.getpid(), signum)  # delivered to this (main) thread before kill() returns
            raise AssertionError("the signal did not interrupt the command")
        finally:
            cleaned.append(True)  # the command's cleanup runs before the status is reported

    monkeypatch.setattr(geometry, "run", killed_midway)
    got, out, err = _run(capsys, ["geometry"])
    assert (got, out, err) == (code, "", f"kvproof geometry: {line}\n")
    assert cleaned == [True]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored


def test_ctrl_c_in_a_real_process_prints_one_line_and_exits_130(tmp_path):
    """What a terminal does: SIGINT to the whole process group while the command runs."""
    script = textwrap.dedent("""
        import sys, time
        from kvproof.cli import geometry
        from kvproof.cli.main import main
        def slow(args):
            print("started", flush=True)
            time.sleep(60)
        geometry.run = slow
        sys.exit(main(["geometry"]))
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        assert p.stdout.readline() == "started\n"
        os.killpg(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130
    assert err == "kvproof geometry: interrupted\n"


def _writes_then_fails(lines: int):
    def run(args):
        for i in range(lines):
            print(f"row {i}")
        return 1  # a run that found violations

    return run


class _ClosedPipe:
    """A stdout whose reader has gone."""

    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        raise BrokenPipeError(32, "Broken pipe")


def test_a_closed_stdout_keeps_the_commands_status(monkeypatch, capsys):
    monkeypatch.setattr(geometry, "run", _writes_then_fails(10))
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    assert main(["geometry"]) == 1
    assert capsys.readouterr().err == ""


def test_a_closed_pipe_in_a_real_process_keeps_status_1_and_says_nothing():
    """``kvproof replay big.jsonl | head -1`` of a run with a violation: exit 1, not 0."""
    script = textwrap.dedent("""
        import sys
        from kvproof.cli import geometry
        from kvproof.cli.main import main
        def run(args):
            for i in range(200_000):
                print(f"row {i} " + "x" * 40)
            return 1
        geometry.run = run
        sys.exit(main(["geometry"]))
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.readline()
    p.stdout.close()  # the reader leaves after one line, like `head -1`
    err = p.stderr.read()
    assert p.wait(timeout=60) == 1
    assert err == b""


def test_a_bug_is_one_line_with_status_70(capsys, monkeypatch):
    def broken(args):
        raise KeyError("oops\nsecond line")

    monkeypatch.setattr(geometry, "run", broken)
    code, out, err = _run(capsys, ["geometry"])
    assert code == 70 and out == ""
    assert err.count("\n") == 1
    assert err.startswith("kvproof geometry: error: internal error (a bug in kvproof, please report it): KeyError:")
    monkeypatch.setenv("KVPROOF_DEBUG", "1")
    with pytest.raises(KeyError):
        main(["geometry"])


def test_out_of_memory_is_bad_input(capsys, monkeypatch):
    def huge(args):
        raise MemoryError()

    monkeypatch.setattr(geometry, "run", huge)
    assert _run(capsys, ["geometry"]) == (2, "", "kvproof geometry: error: out of memory: the input is too large for this machine\n")
