"""Every canary is refuted, and its counterexample is the golden one (proofs/golden/<id>.txt).

A canary that stops being refuted means a checker lost its teeth; a changed counterexample
means the checker (or the spec it runs on) changed: look, then update the golden file with
the counterexample `kvproof prove --only <id>` prints.
"""

from __future__ import annotations

import pathlib

import pytest

from kvproof.proofs.registry import REFUTED, all_obligations

GOLDEN = pathlib.Path(__file__).resolve().parents[2] / "proofs" / "golden"
CANARIES = [o for o in all_obligations() if o.is_canary]


def test_there_are_canaries_for_each_method():
    assert {o.method for o in CANARIES} == {"z3", "exhaustive", "crosshair"}


def test_every_golden_file_belongs_to_a_canary():
    assert sorted(p.stem for p in GOLDEN.glob("*.txt")) == sorted(o.id for o in CANARIES)


@pytest.mark.parametrize("canary", CANARIES, ids=lambda o: o.id)
def test_canary_is_refuted_with_the_golden_counterexample(canary):
    outcome = canary.check(10.0)
    assert outcome.verdict == REFUTED, outcome.detail
    assert outcome.counterexample + "\n" == (GOLDEN / f"{canary.id}.txt").read_text()
