"""A fuzzer for the ``kvproof`` command: Hypothesis draws argument lists for every subcommand
(geometry, replay, plan, prove, e2e), trace bytes, small sizes, where stdout goes (a reader, a
reader that leaves early, closed, a full device) and how the trace arrives (a file, a pipe on
/dev/stdin, a FIFO, ``<(...)``), and every run must

- end with status 0, 1 or 2 -- never a traceback, never an internal error (70); with stdout
  closed or full, the status of the same run into a reader, except that 0 becomes 74 and one
  line saying why ends stderr;
- on status 2, print exactly one line on stderr, naming the value (a flag or value given, the
  trace file, a request or a line);
- read a trace from a pipe, a FIFO or ``<(...)`` exactly as from the file: the same status, stdout
  and stderr (the trace's name aside);
- leave no file in the temporary directory and no process behind (the fork server of the e2e
  ranks is this process's one long-lived helper by design; its children are checked).

In-process runs cover many cases quickly (each drawn case runs twice: into a reader, then into
the drawn stdout); real processes check what only they can show (the interpreter's exit, real
descriptors, pipes and FIFOs, the ranks' own output, a session left empty)."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvproof.cli.main import build_parser, main
from kvproof.spec.arith import cdiv

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
_HOSTILE_DECIMALS = ["0", "-1", "1e3", "nan", "inf", "1_0", "+2", " 1", "\u0661", "", "0x1"]
hostile_decimals = st.sampled_from(_HOSTILE_DECIMALS)
#: prove: obligations that take well under a second, so that a real run fits the budget.
_FAST_OBLIGATIONS = ["LEM-TABLE-PAD", "LEM-FLOOR-LARGEST", "LEM-OWNER-UNIQUE", "EXH-LOCAL-SEQ-LENS",
                     "CANARY-POOL-STALE-PARTIAL", "CANARY-SLOT-OFF-BY-ONE-RANK"]
_COMMAND_FLAGS = {
    "geometry": {"--json": None, "--list-presets": None},
    "replay": {"--num-blocks": (st.sampled_from(["16", "64", "256"]), hostile_numbers),
               "--max-num-batched-tokens": (st.sampled_from(["1", "4", "16", "2048"]), hostile_numbers),
               "--eagle": None, "--no-partial-hash-hits": None, "--no-oracle": None, "--json": None},
    "e2e": {"--num-blocks": (st.sampled_from(["32", "64"]), hostile_numbers),
            "--max-num-batched-tokens": (st.sampled_from(["4", "16"]), hostile_numbers),
            "--no-partial-hash-hits": None, "--seed": (st.sampled_from(["0", "7"]), hostile_numbers), "--json": None},
    "plan": {"--limit": (st.sampled_from(["1", "3"]), hostile_numbers),
             "--step-ms": (st.sampled_from(["1", "50", "0.5"]), hostile_decimals),
             "--dcp": (st.sampled_from(["1", "2", "1,2"]), st.sampled_from(["0", "1,x", "1,,2", "", "1, 2", "2048", "\uff12"])),
             "--num-blocks": (st.sampled_from(["64", "256", "1024"]), hostile_numbers),
             "--kv-memory-gib": (st.sampled_from(["0.02", "0.1"]), hostile_decimals),
             "--eviction": (st.sampled_from(["lru", "compute", "lru,compute"]), st.sampled_from(["fifo", "", "lru,"])),
             "--max-num-batched-tokens": (st.sampled_from(["16", "512", "8192"]), hostile_numbers),
             "--max-num-seqs": (st.sampled_from(["1", "4", "256"]), hostile_numbers),
             "--layers": (st.sampled_from(["12,36", "1,1"]), st.sampled_from(["", "1_2,36", "0,1", "12"])),
             "--model": (st.sampled_from(["llama", "jamba", "qwen3-next"]), st.sampled_from(["nope", "", "/", "kimi"])),
             "--tensor-parallel-size": (st.sampled_from(["1", "2"]), hostile_numbers),
             "--objective": (st.sampled_from(["hit-rate", "per-gpu", "target-hit=5"]),
                             st.sampled_from(["", "best", "target-hit=0", "target-hit=x"])),
             "--gpus": (st.sampled_from(["1", "8"]), hostile_numbers),
             "--memory-sweep": (st.sampled_from(["0.01", "0.02,0.04"]), st.sampled_from(["1e3", "x", "", "-1"])),
             "--jobs": (st.just("1"), st.sampled_from(_HOSTILE_NUMBERS)),  # never dozens of processes
             "--eagle": None, "--no-partial-hash-hits": None, "--json": None},
    "prove": {"--only": (st.sampled_from(_FAST_OBLIGATIONS), st.sampled_from(["", "NOPE", "lem-table", "LEM-TABLE-PAD\n"])),
              "--budget": (st.sampled_from(["30", "60.5"]), hostile_decimals),
              "--json": None},
}
#: e2e: at most two ranks, and groups the e2e model has layers for (others are refused: cheap).
_E2E_LAYOUT = {
    "--group": (st.sampled_from(["mla:8", "full_attention:2"]), st.sampled_from(["x:1", "sliding_window:4", "mamba:0"])),
    "--dcp": (st.sampled_from(["1", "2"]), st.sampled_from(["0", "1_6", "9" * 30])),
    "--preset": (st.just("kimi-k3"), st.sampled_from(["nope", "jamba"])),
}


@st.composite
def argument_lists(draw, command: str, trace_path: str) -> list[str]:
    """Mostly-valid argument lists (real runs) and hostile ones (refusals), about half each.
    Every run stays small: prove runs fast obligations only, plan a trace of a few requests
    (or a generated one as small), one job, no progress bar."""
    hostile = draw(st.booleans())
    flags = {**({} if command == "prove" else _LAYOUT_FLAGS), **_COMMAND_FLAGS[command]}  # plan's --dcp: a list
    argv = [command]
    if command == "e2e":
        flags.update(_E2E_LAYOUT)
        argv += ["--group", "full_attention:4", "--group", "mamba:8"]  # never the 8-rank default preset
    if command == "plan":
        if draw(st.integers(0, 4)):
            argv += ["--trace", trace_path]
        else:  # a generated workload, as small as a trace
            argv += ["--generate", "--requests", draw(st.sampled_from(["1", "4"])), "--system-prompt-len", "5-40",
                     "--suffix-len", "1-9", "--output-len", "1-3"]
        argv += ["--no-progress"]
        if not (hostile and draw(st.booleans())):  # a small pool: the default 40 GiB is a big one
            pool = draw(st.sampled_from(["--num-blocks", "--kv-memory-gib"]))
            argv += [pool, draw(flags.pop(pool)[0])]
        if not (hostile and draw(st.booleans())):
            argv += ["--jobs", "1"]
            flags.pop("--jobs")
    if command == "prove":  # always --only: never every obligation (minutes)
        valid, bad = flags.pop("--only")
        argv += ["--only", draw(bad if hostile and draw(st.booleans()) else valid)]
    if command in ("replay", "e2e") and (not hostile or draw(st.integers(0, 9))):
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


_HOSTILE_VALUES = [-1, 2**63, 2**64, 1.5, "7", None, True, [], [[1]], {"a": 1}, "\ud800", "a\x1b[31m", "a\nb"]


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
def mooncake_lines(draw, index: int) -> dict:
    n = draw(st.integers(1, 1100))
    r = {"timestamp": draw(st.integers(0, 5000)), "input_length": n, "output_length": draw(st.integers(0, 3)),
         "hash_ids": draw(st.lists(st.integers(0, 9), min_size=cdiv(n, 512), max_size=cdiv(n, 512)))}
    if draw(st.integers(0, 9)) == 0:
        r[draw(st.sampled_from(["timestamp", "input_length", "hash_ids", "extra"]))] = draw(
            st.sampled_from([-1, 10**400, 1.5, None, [], "x"]))
    return r


@st.composite
def trace_bytes(draw) -> bytes:
    mooncake = draw(st.integers(0, 5)) == 0
    line = mooncake_lines if mooncake else requests
    lines = [json.dumps(draw(line(i))).encode() for i in range(draw(st.integers(0, 5)))]
    kind = draw(st.integers(0, 16))
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
    if kind == 4 and lines:  # a key twice in one object
        lines[-1] = lines[-1][:-1] + b', "' + draw(st.sampled_from([b"id", b"prompt", b"timestamp"])) + b'": 1}'
    if kind == 5:
        lines.append(b'{"id": "big", "prompt": [' + b"7" * 5000 + b"]}")
    data = b"\n".join(lines) + (b"\n" if draw(st.booleans()) else b"")
    if kind == 6:  # a gzip stream, whole or cut short
        packed = gzip.compress(data)
        data = packed if draw(st.booleans()) else packed[: draw(st.integers(0, len(packed)))]
    return data


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
    request -- or names the missing argument or flag to give, or the trace read as
    ``/dev/fd/N`` (``<(...)``)."""
    message = line.split(": error: ", 1)[-1]
    if "required" in message or set(re.findall(r"--[a-z][a-z-]+", message)) & _FLAGS:
        return True
    given = {a.strip() for a in argv if a.strip()}
    given |= {f.replace("-", sep) for f in (a[2:] for a in argv if a.startswith("--")) for sep in (" ", "_")}
    given |= {"''"} if "" in argv else set()
    return (any(t in message or repr(t)[1:-1] in message for t in given)
            or re.search(r"\bline \d+|/dev/fd/\d+", message) is not None or "request " in message)


#: Every flag of every command (a message that names one says what to give).
_FLAGS = {flag for sub in build_parser().get_default("command_parsers").values() for action in sub._actions
          for flag in action.option_strings}


class _Gone:
    """A stdout whose reader has left (a broken pipe)."""

    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        raise BrokenPipeError(32, "Broken pipe")


class _Full:
    """A stdout on a full device."""

    def write(self, text):
        raise OSError(28, "No space left on device")

    def flush(self):
        pass


#: Where stdout goes: a reader, a reader that left, closed at start (Python's None), a full device.
STDOUTS = ("reader", "gone", "closed", "full")
_LOST = {"closed": "stdout is closed", "full": "No space left on device"}


def _run_in_process(argv: list[str], stdout: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    sink = {"reader": out, "gone": _Gone(), "closed": None, "full": _Full()}[stdout]
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:  # what the console script would turn into the status
            code = e.code
    return code, out.getvalue(), err.getvalue()


def expected_with(stdout: str, prog: str, code: int, err: str) -> tuple[int, str]:
    """(status, stderr) of a run into ``stdout`` whose run into a reader gave ``code`` and
    ``err``: a reader that leaves changes nothing; closed or full, the output is lost -- said
    in one last line, and status 74 where the run itself succeeded."""
    if stdout in ("reader", "gone") or code == 2:
        return code, err
    return (74 if code == 0 else code), err + f"{prog}: error: cannot write the output: {_LOST[stdout]}\n"


def check_outcome(argv: list[str], code: int, err: str) -> None:
    """What every run into a reader must show (module docstring)."""
    assert code in (0, 1, 2), (argv, code, err)
    assert "Traceback" not in err, (argv, err)
    if code == 2:
        lines = err.splitlines()
        assert len(lines) == 1 and err.endswith("\n"), (argv, err)
        assert _names_the_value(lines[0], argv), (argv, lines[0])


def _prog(argv: list[str]) -> str:
    command = next((a for a in argv if not a.startswith("-")), None)
    return f"kvproof {command}" if command in _COMMAND_FLAGS else "kvproof"


def check_run(command: str, argv: list[str], reach, tmp: str, stdouts=("reader",)) -> None:
    before = set(os.listdir(tmp))
    code, _, err = _run_in_process(argv, "reader")
    check_outcome(argv, code, err)
    for stdout in stdouts:
        if stdout != "reader":
            got = _run_in_process(argv, stdout)
            want = _timeless_pair(expected_with(stdout, _prog(argv), code, err))
            assert (got[0], _timeless(got[2])) == want, (argv, stdout)
            reach(f"stdout {stdout}")
    assert set(os.listdir(tmp)) == before, (argv, set(os.listdir(tmp)) - before)
    helpers = _helpers()
    assert set(_children()) <= helpers, (argv, _children(), helpers)  # no rank outlives its run
    reach(f"{command} exit {code}")


def _timeless(text: str) -> str:
    """prove's progress lines, table and JSON give seconds, which differ from run to run."""
    return re.sub(r'"seconds": [0-9.]+', '"seconds": _', re.sub(r"\d+\.\d+s\b", "_s", text))


def _timeless_pair(pair: tuple[int, str]) -> tuple[int, str]:
    return pair[0], _timeless(pair[1])


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """A temporary directory of our own (others write to the shared one meanwhile)."""
    if "torch" in sys.modules or _torch_available():
        from kvproof.e2e.ranks import rank_context

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


def _run_one(command: str, data, tmp: str, trace_path: str, reach, every_stdout: bool = False) -> None:
    """One drawn case, into a reader and then into a drawn stdout -- or, with ``every_stdout``
    (commands with few cases), into each way output can be lost."""
    if command != "geometry":
        with open(trace_path, "wb") as f:
            f.write(data.draw(trace_bytes(), label="trace"))
    stdouts = STDOUTS[1:] if every_stdout else [data.draw(st.sampled_from(STDOUTS), label="stdout")]
    check_run(command, data.draw(argument_lists(command, trace_path), label="argv"), reach, tmp, stdouts)


@pytest.mark.parametrize("command", ["geometry", "replay"])
@settings(max_examples=120, **FUZZ_SETTINGS)
@given(data=st.data())
def test_fuzz_in_process(reach, private_tmp, tmp_path, command, data):
    # A fixed-seed run must reach refusals, real runs and each way output is lost.
    reach.minimums = {f"{command} exit 2": 30, f"{command} exit 0": 10, "stdout gone": 10, "stdout closed": 10,
                      "stdout full": 10}
    _run_one(command, data, private_tmp, str(tmp_path / "trace.jsonl"), reach)


@pytest.mark.parametrize("command", ["plan", "prove"])
@settings(max_examples=50, **FUZZ_SETTINGS)
@given(data=st.data())
def test_fuzz_plan_and_prove_in_process(reach, private_tmp, tmp_path, command, data):
    reach.minimums = {f"{command} exit 2": 10, f"{command} exit 0": 6, "stdout closed": 3, "stdout full": 3}
    _run_one(command, data, private_tmp, str(tmp_path / "trace.jsonl"), reach, every_stdout=True)


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


#: How the trace reaches the command: the file, a pipe read as /dev/stdin, a FIFO, ``<(...)``.
INPUTS = ("file", "stdin", "fifo", "substitution")


def _shell(argv: list[str], trace: str, fifo: str, how: str, stdout: str) -> tuple[str, str]:
    """A bash script running ``kvproof argv`` with the trace (``TRACE`` in ``argv``) arriving
    ``how`` and stdout going to ``stdout``; it exits with kvproof's status. Returns the script
    and the name the trace has for kvproof."""
    name = {"file": trace, "stdin": "/dev/stdin", "fifo": fifo, "substitution": "/dev/fd/63"}[how]
    command = shlex.join([sys.executable, "-m", "kvproof", *[name if a == "TRACE" else a for a in argv]])
    if how == "substitution":
        command = command.replace(shlex.quote(name), f"<(cat {shlex.quote(trace)})")
    stages = [command]
    if how == "stdin":
        stages.insert(0, f"cat {shlex.quote(trace)}")
    redirect = {"reader": "", "gone": "", "closed": " >&-", "full": " > /dev/full"}[stdout]
    if stdout == "gone":
        stages.append("head -c 1 > /dev/null")  # the reader leaves after one byte
    script = " | ".join(stages) + redirect + f"; s=${{PIPESTATUS[{1 if how == 'stdin' else 0}]}}"
    if how == "fifo":  # a writer that blocks until kvproof opens the FIFO (and goes if it never does)
        script = f"cat {shlex.quote(trace)} > {shlex.quote(fifo)} 2>/dev/null & w=$!; {script}; " \
                 "kill $w 2>/dev/null; wait $w 2>/dev/null"
    return script + "; exit $s", name


def _run_real(script: str, tmp: str) -> tuple[int, str, str, list[int]]:
    """Run ``script``; its status, stdout and stderr, and the processes its session left."""
    p = subprocess.Popen(["bash", "-c", script], env={**os.environ, "TMPDIR": tmp}, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    end = time.monotonic() + 5
    while (os.listdir(tmp) or _session_processes(p.pid)) and time.monotonic() < end:
        time.sleep(0.05)
    left = _session_processes(p.pid)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return p.returncode, out.decode("utf-8", "backslashreplace"), err.decode("utf-8", "backslashreplace"), left


def _real_case(command: str, reach, tmp_path, data) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    trace, fifo = str(tmp_path / "trace.jsonl"), str(tmp_path / "trace.fifo")
    if not os.path.exists(fifo):
        os.mkfifo(fifo)
    with open(trace, "wb") as f:
        f.write(data.draw(trace_bytes(), label="trace"))
    argv = data.draw(argument_lists(command, "TRACE"), label="argv")
    how = data.draw(st.sampled_from(INPUTS[1:]), label="input") if "TRACE" in argv else "file"
    stdout = data.draw(st.sampled_from(STDOUTS), label="stdout")

    code, out, err, left = _run_real(_shell(argv, trace, fifo, "file", "reader")[0], str(tmp))
    check_outcome([trace if a == "TRACE" else a for a in argv], code, err)
    assert not left and not os.listdir(tmp), (argv, left, os.listdir(tmp))

    script, name = _shell(argv, trace, fifo, how, stdout)
    got_code, got_out, got_err, left = _run_real(script, str(tmp))
    assert not left and not os.listdir(tmp), (script, left, os.listdir(tmp))
    want_code, want_err = expected_with(stdout, _prog(argv), code, err)
    same = lambda text: _timeless(text.replace(name, "TRACE"))  # noqa: E731
    assert (got_code, same(got_err)) == (want_code, same(want_err.replace(trace, name))), (script, got_err, want_err)
    if stdout == "reader":
        assert same(got_out) == same(out.replace(trace, name)), script
    reach(f"input {how}")
    reach(f"stdout {stdout}")
    if stdout in _LOST:
        reach("stdout lost")
    reach(f"{command} exit {code}")


@pytest.mark.skipif(not LINUX, reason="reads the process table in /proc")
@pytest.mark.parametrize("command", ["geometry", "replay", "plan", "prove"])
@settings(max_examples=10, **FUZZ_SETTINGS)
@given(data=st.data())
def test_fuzz_real_processes(reach, tmp_path, command, data):
    """Real ``kvproof`` processes, each drawn case twice: reading the trace file into a reader,
    then with the trace on a pipe, a FIFO or ``<(...)`` and stdout to a reader, one that leaves,
    closed or full. The first run: a status, one line on stderr for bad input. The second: what
    the first gives, changed only as :func:`expected_with` says (the trace's name aside). After
    each: an empty temporary directory, no process left in the session."""
    reach.minimums = {"stdout lost": 2} | (
        {"input stdin": 1, "input fifo": 1, "input substitution": 1} if command == "replay" else {})
    _real_case(command, reach, tmp_path, data)


@pytest.mark.skipif(not LINUX, reason="reads the process table in /proc")
@settings(max_examples=3, **FUZZ_SETTINGS)
@given(data=st.data())
def test_fuzz_e2e_real_processes(reach, tmp_path, data):
    """As above for e2e, a few cases (each run starts torch and a fork server): the ranks' own
    output included, nothing may reach stderr beside kvproof's line."""
    pytest.importorskip("torch")
    _real_case("e2e", reach, tmp_path, data)
