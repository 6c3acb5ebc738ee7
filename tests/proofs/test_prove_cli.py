"""`kvproof prove`: table and JSON shapes, exit codes (0 as expected, 1 a failed obligation
or a canary that is not refuted, 2 bad input)."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kvproof.cli.main import main
from kvproof.proofs import registry
from kvproof.proofs.registry import CHECKED, INCOMPLETE, REFUTED, TIMEOUT, Obligation, Outcome

FAST = ["--only", "CANARY-PARTIAL", "--only", "EXH-LOCAL-SEQ-LENS", "--only", "LEM-CDIV"]


def test_table_lists_each_obligation_with_method_verdict_time(capsys):
    assert main(["prove", *FAST, "--budget", "20"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["obligation", "method", "verdict", "time"]
    rows = {line.split()[0]: line.split() for line in out[1:4]}
    assert rows["LEM-CDIV-LEAST"][1:3] == ["z3", "proved"]
    assert rows["EXH-LOCAL-SEQ-LENS"][1:3] == ["exhaustive", "checked"]
    assert rows["CANARY-PARTIAL-STRICT-UNDER-DCP"][1:3] == ["exhaustive", "refuted"]
    assert all(r[3].endswith("s") for r in rows.values())
    assert any(line.startswith("counterexample CANARY-PARTIAL-STRICT-UNDER-DCP: dcp 2") for line in out)
    assert out[-1] == "3 obligations, all as expected"


def test_json_is_a_list_of_id_method_verdict_seconds(capsys):
    assert main(["prove", *FAST, "--json", "--budget", "20"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [d["id"] for d in data] == ["LEM-CDIV-LEAST", "EXH-LOCAL-SEQ-LENS", "CANARY-PARTIAL-STRICT-UNDER-DCP"]
    for d in data:
        assert {"id", "method", "verdict", "seconds"} <= set(d)
        assert isinstance(d["seconds"], float)
    assert data[2]["verdict"] == REFUTED and data[2]["counterexample"]


@pytest.mark.parametrize("argv, expected", [
    (["--budget", "0"], "--budget 0.0 must be a number of seconds in (0, 86400]"),
    (["--only", "NOPE"], "no obligation id starts with 'NOPE'"),
])
def test_bad_input_exits_2_with_one_line(capsys, argv, expected):
    assert main(["prove", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0]


def _fake(id, verdict):
    return Obligation(id, ("INV-ARITH-CDIV",), "z3", "fake", lambda budget: Outcome(verdict, "x=1" if verdict == REFUTED else None))


@pytest.mark.parametrize(
    "fake",
    [_fake("FAKE-REFUTED", REFUTED), _fake("FAKE-TIMEOUT", TIMEOUT), _fake("FAKE-INCOMPLETE", INCOMPLETE),
     _fake("CANARY-FAKE", CHECKED)],
    ids=lambda o: o.id,
)
def test_exit_1_when_a_real_obligation_did_not_complete_or_a_canary_is_not_refuted(monkeypatch, capsys, fake):
    monkeypatch.setattr(registry, "all_obligations", lambda: (fake,))
    monkeypatch.setattr("kvproof.proofs.runner.all_obligations", lambda: (fake,))
    assert main(["prove", "--budget", "1"]) == 1
    captured = capsys.readouterr()
    assert f"1 obligations, 1 failed: {fake.id}" in captured.out
    assert f"kvproof prove: {fake.id} did not hold as expected: {fake.check(1).verdict}" in captured.err


def test_an_obligation_the_budget_cuts_short_fails(monkeypatch, capsys):
    """The budget is a deadline: what it leaves unstarted is a timeout, and the run fails."""
    slow = Obligation("FAKE-SLOW", ("INV-ARITH-CDIV",), "z3", "fake", lambda budget: (time.sleep(budget), Outcome(CHECKED))[1])
    never = _fake("FAKE-AFTER", CHECKED)
    monkeypatch.setattr("kvproof.proofs.runner.all_obligations", lambda: (slow, never))
    assert main(["prove", "--budget", "0.3", "--json"]) == 1
    data = {d["id"]: d for d in json.loads(capsys.readouterr().out)}
    assert data["FAKE-AFTER"]["verdict"] == TIMEOUT and "not started" in data["FAKE-AFTER"]["detail"]


def _children(pid: int) -> list[int]:
    out = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:  # field 4 of /proc/PID/stat: the parent's id
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not pathlib.Path("/proc/self/stat").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=lambda s: s.name)
def test_a_killed_prove_leaves_no_crosshair_process(sig):
    """`kvproof prove` killed must not leave its CrossHair subprocess running."""
    parent = subprocess.Popen(
        [sys.executable, "-m", "kvproof.cli.main", "prove", "--only", "CH-PLACEMENT"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        children: list[int] = []
        while not children and time.monotonic() < deadline:
            time.sleep(0.2)
            children = _children(parent.pid)
        assert children, "kvproof prove started no CrossHair process within 60 s"
        parent.send_signal(sig)
        parent.wait(timeout=10)
        gone_by = time.monotonic() + 2
        while any(map(_alive, children)) and time.monotonic() < gone_by:
            time.sleep(0.05)
        assert not any(map(_alive, children)), f"CrossHair {children} outlived kvproof prove ({sig.name})"
    finally:
        if parent.poll() is None:
            parent.kill()
        for pid in _children(parent.pid):
            os.kill(pid, signal.SIGKILL)


#: `kvproof prove` on one obligation whose z3 check runs for up to a minute (cubes: nonlinear).
_LONG_Z3 = textwrap.dedent("""
    import sys
    import z3
    from kvproof.cli.main import main
    from kvproof.proofs import runner, z3kit
    from kvproof.proofs.registry import PROVED, Obligation, Outcome

    def long_check(budget):
        x, y, z = z3.Ints("x y z")
        s = z3kit._solver(60_000)
        s.add(x * x * x + y * y * y == z * z * z, x > 0, y > 0, z > 0, x * y * z > 10**30)
        print("checking", file=sys.stderr, flush=True)
        z3kit._check(s)
        return Outcome(PROVED)

    runner.all_obligations = lambda: (Obligation("FAKE-LONG-Z3", (), "z3", "a long check", long_check),)
    sys.exit(main(["prove"]))
""")


@pytest.mark.parametrize("to_group, sig, code, line", [
    (True, signal.SIGINT, 130, "interrupted"), (False, signal.SIGINT, 130, "interrupted"),
    (False, signal.SIGTERM, 143, "terminated"),
], ids=["ctrl-c", "sigint", "sigterm"])
def test_a_signal_during_a_z3_check_stops_the_run_at_once(to_group, sig, code, line):
    """z3 runs in C: SIGINT is z3's to catch (it cancels the check, which used to end as a
    verdict "timeout" and the run went on), SIGTERM waited for the check. Both stop now."""
    p = subprocess.Popen([sys.executable, "-c", _LONG_Z3], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        assert p.stderr.readline() == "checking\n"
        time.sleep(0.5)  # inside z3's check
        sent = time.monotonic()
        os.killpg(p.pid, sig) if to_group else p.send_signal(sig)
        out, err = p.communicate(timeout=30)
        took = time.monotonic() - sent
    finally:
        if p.poll() is None:
            p.kill()
    assert (p.returncode, out, err) == (code, "", f"kvproof prove: {line}\n")
    assert took < 10, f"stopped {took:.1f} s after the signal (the check runs for 60 s)"


@pytest.mark.parametrize("budget, message", [
    ("inf", "argument --budget: 'inf' is not a decimal number"),
    ("nan", "argument --budget: 'nan' is not a decimal number"),
    ("1e3", "argument --budget: '1e3' is not a decimal number"),
    ("-1", "--budget -1.0 must be a number of seconds in (0, 86400]"),
    ("86401", "--budget 86401.0 must be a number of seconds in (0, 86400]"),
])
def test_a_budget_that_is_not_a_finite_positive_number_exits_2(capsys, budget, message):
    assert main(["prove", "--budget", budget]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_an_empty_only_is_refused_not_everything_run(capsys):
    assert main(["prove", "--only", ""]) == 2
    assert capsys.readouterr().err == (
        "kvproof prove: error: obligation id prefix '' is empty; expected the start of an id, e.g. LEM\n")


#: One or more obligations of each method and of each kind of verdict, fast enough for the suite
#: (.ci/run runs every obligation at the default budget).
TWO_BUDGETS = ["--only", "LEM-CDIV", "--only", "LEM-OWNER-UNIQUE", "--only", "EXH-LOCAL-SEQ-LENS", "--only",
               "EXH-SLOT-MAPPING", "--only", "CANARY-PARTIAL", "--only", "CANARY-SLOT", "--only", "CH-ARITH"]


def test_verdicts_do_not_depend_on_the_budget():
    """The same obligations at the default budget and at four times it give the same
    verdicts (each checker's effort is fixed; the budget is only a deadline)."""
    from kvproof.proofs.runner import DEFAULT_BUDGET

    def verdicts(*budget):
        proc = subprocess.run([sys.executable, "-m", "kvproof.cli.main", "prove", "--json", *TWO_BUDGETS, *budget],
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return {d["id"]: (d["verdict"], d["counterexample"]) for d in json.loads(proc.stdout)}

    default = verdicts()
    assert {v for v, _ in default.values()} == {"proved", "checked", "refuted"}
    assert verdicts("--budget", str(4 * DEFAULT_BUDGET)) == default
