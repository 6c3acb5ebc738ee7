"""`kvproof prove`: table and JSON shapes, exit codes (0 as expected, 1 a failed obligation
or a canary that is not refuted, 2 bad input)."""

from __future__ import annotations

import json

import pytest

from kvproof.cli.main import main
from kvproof.proofs import registry
from kvproof.proofs.registry import REFUTED, UNREFUTED, Obligation, Outcome

FAST = ["--only", "CANARY-PARTIAL", "--only", "EXH-LOCAL-SEQ-LENS", "--only", "LEM-CDIV"]


def test_table_lists_each_obligation_with_method_verdict_time(capsys):
    assert main(["prove", *FAST, "--budget", "20"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["obligation", "method", "verdict", "time"]
    rows = {line.split()[0]: line.split() for line in out[1:4]}
    assert rows["LEM-CDIV-LEAST"][1:3] == ["z3", "proved"]
    assert rows["EXH-LOCAL-SEQ-LENS"][1:3] == ["exhaustive", "unrefuted"]
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
    (["--budget", "0"], "--budget 0.0 must be a positive number of seconds"),
    (["--only", "NOPE"], "no obligation id starts with 'NOPE'"),
])
def test_bad_input_exits_2_with_one_line(capsys, argv, expected):
    assert main(["prove", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0]


def _fake(id, verdict):
    return Obligation(id, ("INV-ARITH-CDIV",), "z3", "fake", lambda budget: Outcome(verdict, "x=1" if verdict == REFUTED else None))


@pytest.mark.parametrize("fake", [_fake("FAKE-REAL", REFUTED), _fake("CANARY-FAKE", UNREFUTED)], ids=lambda o: o.id)
def test_exit_1_when_a_real_obligation_is_refuted_or_a_canary_is_not(monkeypatch, capsys, fake):
    monkeypatch.setattr(registry, "all_obligations", lambda: (fake,))
    monkeypatch.setattr("kvproof.proofs.runner.all_obligations", lambda: (fake,))
    assert main(["prove", "--budget", "1"]) == 1
    assert "1 obligations, 1 failed" in capsys.readouterr().out
