"""A fuzzer for the ``kvproof`` command: Hypothesis draws argument
lists and trace bytes, small sizes, and every run must

- end with status 0, 1 or 2 -- never a traceback, never an internal error (70);
- on status 2, print exactly one line on stderr, naming the value (a flag or value given, the
  trace file, a request or a line);
- leave no file in the temporary directory and no process behind (the fork server of the e2e
  ranks is this process's one long-lived helper by design; its children are checked).

In-process runs cover many cases quickly; a few real processes check what only they can show
(the interpreter's exit, the ranks' own output, a session left empty)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvproof.cli.main import main

LINUX = sys.platform.startswith("linux")

# --- what is drawn --------------------------------------------------------------------------------

_HOSTILE_NUMBERS = ["0", "-1", "1_6", "+16", "\u0661\u0666", " 2", "", "1e3", "0x10", "nan", "2**3", "9" * 40,
                    str(2**31), str(2**63), str(2**64)]
#: Small valid sizes, or hostile text, or sizes no cap lets through: never one that would make a
#: run allocate gigabytes (that is the memory check's test, with a fake machine).
hostile_numbers = st.one_of(st.integers(1, 64).map(str), st.sampled_from(_HOSTILE_NUMBERS))
_KINDS = ["full_attention", "mla", "sliding_window", "mamba"]
valid_groups = st.builds(
    lambda k, b, opt: f"{k}:{b}{opt}", st.sampled_from(_KINDS), st.sampled_from(["2", "4", "8", "16"]),
    st.sampled_from(["", ":replicated", ":window=8", ":replicated:window=16"]),
)
hostile_groups = st.one_of(valid_groups, st.sampled_from([
    "mamba", "x:1", "full_attention:", "mla:16:fast", "mla:16:replicated:sharded", "mamba:16:sharded",
    "full_attention:4294967296", "sliding_window:4:window=0", "full_attention:1_6", "::", "",
]))
#: flag -> (valid values, hostile values); None for a switch.
_LAYOUT_FLAGS = {
    "--group": (valid_groups, hostile_groups),
    "--preset": (st.sampled_from(["kimi-k3", "qwen3-next", "jamba", "hymba"]), st.sampled_from(["seed-bug-1m", "nope", ""])),
    "--dcp": (st.sampled_from(["1", "2"]), hostile_numbers),
    "--max-model-len": (st.sampled_from(["32", "64", "128", "1024"]), hostile_numbers),
    "--hash-block-size": (st.sampled_from(["1", "2", "4"]), hostile_numbers),
    "--mamba-cache-mode": (st.sampled_from(["align", "none"]), st.just("fast")),
    "--num-speculative-blocks": (st.sampled_from(["0", "1", "2"]), hostile_numbers),
    "--interleave": (st.sampled_from(["1", "2"]), hostile_numbers),
    "--retention-interval": (st.sampled_from(["none", "0", "16"]), hostile_numbers),
    "--shared-prefix-checkpoint": None,
    "--eviction": (st.sampled_from(["lru", "compute"]), st.sampled_from(["fifo", "LRU", ""])),
}
_COMMAND_FLAGS = {
    "geometry": {"--json": None, "--list-presets": None},
    "replay": {"--num-blocks": (st.sampled_from(["16", "64", "256"]), hostile_numbers),
               "--max-num-batched-tokens": (st.sampled_from(["1", "4", "16", "2048"]), hostile_numbers),
               "--eagle": None, "--no-partial-hash-hits": None, "--no-oracle": None, "--json": None},
    "e2e": {"--num-blocks": (st.sampled_from(["32", "64"]), hostile_numbers),
            "--max-num-batched-tokens": (st.sampled_from(["4", "16"]), hostile_numbers),
            "--no-partial-hash-hits": None, "--seed": (st.sampled_from(["0", "7"]), hostile_numbers), "--json": None},
}
#: e2e: at most two ranks, and groups the e2e model has layers for (others are refused: cheap).
_E2E_LAYOUT = {
    "--group": (st.sampled_from(["mla:8", "full_attention:2"]), st.sampled_from(["x:1", "sliding_window:4", "mamba:0"])),
    "--dcp": (st.sampled_from(["1", "2"]), st.sampled_from(["0", "1_6", "9" * 30])),
    "--preset": (st.just("kimi-k3"), st.sampled_from(["nope", "jamba"])),
}


@st.composite
def argument_lists(draw, command: str, trace_path: str) -> list[str]:
    """Mostly-valid argument lists (real runs) and hostile ones (refusals), about half each."""
    hostile = draw(st.booleans())
    flags = {**_LAYOUT_FLAGS, **_COMMAND_FLAGS[command]}
    argv = [command]
    if command == "e2e":
        flags.update(_E2E_LAYOUT)
        argv += ["--group", "full_attention:4", "--group", "mamba:8"]  # never the 8-rank default preset
    if command != "geometry" and (not hostile or draw(st.integers(0, 9))):
        argv.append(trace_path)
    for _ in range(draw(st.integers(0, 5 if hostile else 3))):
        name = draw(st.sampled_from(sorted(flags)))
        if flags[name] is None:
            argv.append(name)
        elif hostile or name not in argv:
            argv += [name, draw(flags[name][1] if hostile and draw(st.booleans()) else flags[name][0])]
    if hostile and not draw(st.integers(0, 7)):
        argv.insert(draw(st.integers(0, len(argv))), draw(st.sampled_from(["--nope", "-x", "extra", "--", "-"])))
    return argv


_HOSTILE_VALUES = [-1, 2**63, 2**64, 1.5, "7", None, True, [], [[1]], {"a": 1}, "\ud800"]


@st.composite
def requests(draw, index: int) -> dict:
    r = {"id": f"r{index}", "prompt": draw(st.lists(st.integers(0, 20), min_size=1, max_size=12))}
    if draw(st.booleans()):
        r["output"] = draw(st.lists(st.integers(0, 20), max_size=4))
    if draw(st.booleans()):
        r["arrival"] = draw(st.integers(0, 6))
    if draw(st.integers(0, 3)) == 0:
        r["cache_salt"] = draw(st.sampled_from(["s", "t", None]))
    if draw(st.integers(0, 9)) == 0:  # one hostile field
        field = draw(st.sampled_from(["id", "prompt", "output", "arrival", "cache_salt", "colour"]))
        value = draw(st.sampled_from(_HOSTILE_VALUES))
        if field in ("prompt", "output") and draw(st.booleans()):
            value = [1, value]
        r[field] = value
    return r


@st.composite
def trace_bytes(draw) -> bytes:
    lines = [json.dumps(draw(requests(i))).encode() for i in range(draw(st.integers(0, 5)))]
    kind = draw(st.integers(0, 14))
    if kind == 0:  # raw bytes
        return draw(st.binary(max_size=120))
    if kind == 1 and lines:  # a byte spliced into a valid line
        i = draw(st.integers(0, len(lines) - 1))
        j = draw(st.integers(0, len(lines[i])))
        lines[i] = lines[i][:j] + draw(st.sampled_from([b"\xff", b"\x00", b"[", b"}", b"\n", b'"', b"\\ud800"])) + lines[i][j:]
    if kind == 2:
        lines.append(b"[" * 3000 + b"]" * 3000)
    if kind == 3 and lines:
        lines.append(lines[0])  # a duplicate id
    return b"\n".join(lines) + (b"\n" if draw(st.booleans()) else b"")


# --- one run and its checks -----------------------------------------------------------------------


def _children() -> dict[int, int]:
    """pid -> parent pid of every process whose parent is this process or one of its children."""
    if not LINUX:
        return {}
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    text = f.read()
            except OSError:
                continue
            fields = text[text.rindex(")") + 2 :].split()
            if fields[0] != "Z":
                table[int(name)] = int(fields[1])
    mine = {p: pp for p, pp in table.items() if pp == os.getpid()}
    return {**mine, **{p: pp for p, pp in table.items() if pp in mine}}


def _helpers() -> set[int]:
    """This process's long-lived multiprocessing helpers: the fork server and resource tracker."""
    import multiprocessing.forkserver
    import multiprocessing.resource_tracker

    pids = {multiprocessing.forkserver._forkserver._forkserver_pid,
            multiprocessing.resource_tracker._resource_tracker._pid}
    return {p for p in pids if p is not None}


def _names_the_value(line: str, argv: list[str]) -> bool:
    """The error (after ``PROG: error:``) quotes something the user gave, a trace line or a
    request -- or names the missing argument."""
    message = line.split(": error: ", 1)[-1]
    if "required" in message:
        return True
    given = {a.strip() for a in argv if a.strip()}
    given |= {f.replace("-", sep) for f in (a[2:] for a in argv if a.startswith("--")) for sep in (" ", "_")}
    given |= {"''"} if "" in argv else set()
    return (any(t in message or repr(t)[1:-1] in message for t in given)
            or re.search(r"\bline \d+", message) is not None or "request " in message)


def check_run(command: str, argv: list[str], reach, tmp: str) -> None:
    out, err = io.StringIO(), io.StringIO()
    before = set(os.listdir(tmp))
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:  # what the console script would turn into the status
            code = e.code
    err_text = err.getvalue()
    assert code in (0, 1, 2), (argv, code, err_text)
    assert "Traceback" not in err_text, (argv, err_text)
    if code == 2:
        lines = err_text.splitlines()
        assert len(lines) == 1 and err_text.endswith("\n"), (argv, err_text)
        assert _names_the_value(lines[0], argv), (argv, lines[0])
    assert set(os.listdir(tmp)) == before, (argv, set(os.listdir(tmp)) - before)
    helpers = _helpers()
    assert set(_children()) <= helpers, (argv, _children(), helpers)  # no rank outlives its run
    reach(f"{command} exit {code}")


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """A temporary directory of our own (others write to the shared one meanwhile)."""
    if "torch" in sys.modules or _torch_available():
        from kvproof.e2e.dcp import rank_context

        rank_context()  # the fork server's socket directory lives in the real temp dir, not ours
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return str(tmp)


def _torch_available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


FUZZ_SETTINGS = dict(
    deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                                          HealthCheck.function_scoped_fixture],
)


def _run_one(command: str, data, tmp: str, trace_path: str, reach) -> None:
    if command != "geometry":
        with open(trace_path, "wb") as f:
            f.write(data.draw(trace_bytes(), label="trace"))
    check_run(command, data.draw(argument_lists(command, trace_path), label="argv"), reach, tmp)


@pytest.mark.parametrize("command", ["geometry", "replay"])
@settings(max_examples=120, **FUZZ_SETTINGS)
@given(data=st.data())
def test_fuzz_in_process(reach, private_tmp, tmp_path, command, data):
    # A fixed-seed run must reach both refusals and real runs.
    reach.minimums = {f"{command} exit 2": 30, f"{command} exit 0": 10}
    _run_one(command, data, private_tmp, str(tmp_path / "trace.jsonl"), reach)


@settings(max_examples=25, **FUZZ_SETTINGS)
@given(data=st.data())
def test_fuzz_e2e_in_process(reach, private_tmp, tmp_path, data):
    pytest.importorskip("torch")
    reach.minimums = {"e2e exit 2": 5, "e2e exit 0": 3}
    _run_one("e2e", data, private_tmp, str(tmp_path / "trace.jsonl"), reach)


# --- real processes -------------------------------------------------------------------------------


def _session_processes(session: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    text = f.read()
            except OSError:
                continue
            fields = text[text.rindex(")") + 2 :].split()
            if int(fields[3]) == session and fields[0] != "Z":
                found.append(int(name))
    return found


@pytest.mark.skipif(not LINUX, reason="reads the process table in /proc")
@settings(max_examples=10, **FUZZ_SETTINGS)
@given(data=st.data())
def test_fuzz_real_processes(reach, tmp_path, data):
    """Real ``kvproof`` processes: status, one line on stderr (the ranks' output included), and
    after exit an empty temporary directory and no process left in the session."""
    reach.minimums = {"geometry": 1, "replay": 1}
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    trace_path = str(tmp_path / "trace.jsonl")
    commands = ["geometry", "replay"] + (["e2e"] if _torch_available() else [])
    command = data.draw(st.sampled_from(commands), label="command")
    if command == "e2e" and reach.counts["e2e"] >= 2:  # each one starts torch and a fork server: a few suffice
        command = "replay"
    reach(command)
    with open(trace_path, "wb") as f:
        f.write(data.draw(trace_bytes(), label="trace"))
    argv = data.draw(argument_lists(command, trace_path), label="argv")
    p = subprocess.Popen([sys.executable, "-m", "kvproof", *argv], env={**os.environ, "TMPDIR": str(tmp)},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        _, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
    text = err.decode("utf-8", "backslashreplace")
    assert p.returncode in (0, 1, 2), (argv, p.returncode, text)
    assert "Traceback" not in text, (argv, text)
    if p.returncode == 2:
        assert len(text.splitlines()) == 1, (argv, text)
        assert _names_the_value(text.splitlines()[0], argv), (argv, text)
    end = time.monotonic() + 5
    while (os.listdir(tmp) or _session_processes(p.pid)) and time.monotonic() < end:
        time.sleep(0.05)
    left = _session_processes(p.pid)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left and not os.listdir(tmp), (argv, left, os.listdir(tmp))
    reach(f"{command} exit {p.returncode}")
