"""cli/guard.py: every subcommand ends with its own status and one line, whatever happens around
it -- Ctrl-C, SIGTERM, a closed stdout, a bug."""

from __future__ import annotations

import os
import shlex
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


# --- output that cannot be written --------------------------------------------------------------

_SMALL_TRACE = '{"id": "a", "prompt": [1, 2, 3]}\n'


def _kvproof(argv, stdout, tmp_path, **popen):
    """A real ``kvproof`` process; ``stdout`` is "closed" (``>&-``) or a path."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(_SMALL_TRACE)
    argv = [str(trace) if a == "TRACE" else a for a in argv]
    command = " ".join(map(shlex.quote, [sys.executable, "-m", "kvproof", *argv]))
    redirect = ">&-" if stdout == "closed" else f"> {shlex.quote(stdout)}"
    return subprocess.run(["bash", "-c", f"{command} {redirect}"], capture_output=True, text=True, timeout=300, **popen)


_EVERY_COMMAND = [
    ["geometry"], ["geometry", "--json"], ["replay", "TRACE"], ["--help"], ["--version"], ["replay", "--help"],
    ["plan", "--trace", "TRACE", "--group", "full_attention:16", "--num-blocks", "64", "--dcp", "1", "--no-progress"],
    ["prove", "--only", "LEM-CDIV"],
    ["e2e", "TRACE", "--group", "full_attention:4", "--group", "mamba:8", "--max-model-len", "64"],
]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("stdout", ["closed", "/dev/full"])
@pytest.mark.parametrize("argv", _EVERY_COMMAND, ids=lambda a: " ".join(a[:2]))
def test_output_that_cannot_be_written_is_one_line_and_status_74(tmp_path, argv, stdout):
    done = _kvproof(argv, stdout, tmp_path)
    prog = "kvproof" if argv[0].startswith("-") else f"kvproof {argv[0]}"
    reason = "stdout is closed" if stdout == "closed" else "No space left on device"
    # prove's progress lines come first (stderr); the output error is the last line.
    assert done.returncode == 74 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines()[-1] == f"{prog}: error: cannot write the output: {reason}", done.stderr


@pytest.mark.parametrize("stdout", ["closed", "/dev/full"])
@pytest.mark.parametrize("argv, line", [
    (["replay", "/nonexistent.jsonl"], "kvproof replay: error: cannot read trace '/nonexistent.jsonl'"),
    (["geometry", "--nope"], "kvproof geometry: error: unrecognized arguments: --nope"),
    (["replay", "TRACE", "--dcp", "1_6"], "kvproof replay: error: argument --dcp: '1_6' is not a decimal integer"),
])
def test_bad_input_keeps_status_2_whatever_stdout_is(tmp_path, argv, line, stdout):
    done = _kvproof(argv, stdout, tmp_path)
    assert done.returncode == 2 and done.stderr.startswith(line) and done.stderr.count("\n") == 1, done.stderr


def test_a_malformed_trace_with_stdout_closed_is_still_bad_input(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a"}\n')
    done = _kvproof(["replay", str(bad)], "closed", tmp_path)
    assert (done.returncode, done.stderr) == (2, f"kvproof replay: error: {bad}: line 1 (request 'a'): missing 'prompt'\n")


def test_a_property_failure_keeps_status_1_and_adds_the_output_line(monkeypatch, capsys):
    class Full:
        def write(self, text):
            raise OSError(28, "No space left on device")

        def flush(self):
            pass

    monkeypatch.setattr(geometry, "run", _writes_then_fails(3))
    monkeypatch.setattr(sys, "stdout", Full())
    assert main(["geometry"]) == 1
    assert capsys.readouterr().err == "kvproof geometry: error: cannot write the output: No space left on device\n"


def test_nothing_written_to_a_closed_stdout_is_no_error(monkeypatch, capsys):
    monkeypatch.setattr(geometry, "run", lambda args: 0)
    monkeypatch.setattr(sys, "stdout", None)  # what Python sets when descriptor 1 is closed at start
    assert main(["geometry"]) == 0
    assert capsys.readouterr().err == ""


def test_a_closed_stderr_stays_silent_and_never_falls_back_to_stdout(tmp_path):
    done = subprocess.run(["bash", "-c", f"{sys.executable} -m kvproof replay /nonexistent.jsonl 2>&-"],
                          capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (2, "")


def test_a_closed_stdout_is_not_taken_by_the_next_file_opened(tmp_path):
    """With descriptor 1 closed, the trace file would open as descriptor 1, and anything a child
    process printed would land in it: /dev/null takes the slot first."""
    script = textwrap.dedent("""
        import os, sys
        from kvproof.cli import geometry
        from kvproof.cli.main import main
        def run(args):
            fd = os.open(sys.argv[1], os.O_RDONLY)
            os.write(2, f"fd {fd} {os.path.realpath(f'/proc/self/fd/1')}\\n".encode())
            return 0
        geometry.run = run
        sys.exit(main(["geometry"]))
    """)
    path = tmp_path / "f"
    path.write_text("x")
    done = subprocess.run(["bash", "-c", f"{sys.executable} -c {shlex.quote(script)} {path} >&-"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.split()[1] != "1" and done.stderr.split()[2] == "/dev/null", done.stderr
