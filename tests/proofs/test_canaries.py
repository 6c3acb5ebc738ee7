"""Every canary is refuted, and its counterexample is the golden one (proofs/golden/<id>.txt).

A canary that stops being refuted means a checker lost its teeth; a changed counterexample
means the checker (or the spec it runs on) changed: look, then update the golden file with
the counterexample `kvproof prove --only <id>` prints.

z3 and exhaustive canaries are deterministic and compared exactly. CrossHair's search order
depends on CPU-time budgets, so under load it may meet a different counterexample of the same
bug first: its golden output is compared with every number masked (the function, the group
kind and mode, the shape of the call stay pinned), and the reported numbers are re-checked
against the bug they must expose.
"""

from __future__ import annotations

import pathlib
import re

import pytest

from kvproof.proofs.registry import REFUTED, all_obligations
from kvproof.spec.arith import cdiv

GOLDEN = pathlib.Path(__file__).resolve().parents[2] / "proofs" / "golden"
CANARIES = [o for o in all_obligations() if o.is_canary]


def test_there_are_canaries_for_each_method():
    assert {o.method for o in CANARIES} == {"z3", "exhaustive", "crosshair"}


def test_every_golden_file_belongs_to_a_canary():
    assert sorted(p.stem for p in GOLDEN.glob("*.txt")) == sorted(o.id for o in CANARIES)


@pytest.mark.parametrize("canary", CANARIES, ids=lambda o: o.id)
def test_canary_is_refuted_with_the_golden_counterexample(canary):
    outcome = canary.check(300.0)  # a deadline only: each checker's effort is fixed
    assert outcome.verdict == REFUTED, outcome.detail
    golden = (GOLDEN / f"{canary.id}.txt").read_text()
    if canary.method != "crosshair":
        assert outcome.counterexample + "\n" == golden
        return
    assert _masked(outcome.counterexample + "\n") == _masked(golden)
    assert _is_old_width_bug(outcome.counterexample), outcome.counterexample


def _masked(text: str) -> str:
    return re.sub(r"\b\d+\b", "N", text)


def _is_old_width_bug(counterexample: str) -> bool:
    """The CrossHair counterexample's numbers really expose the DCP-divided Mamba width."""
    m = re.search(r"GroupKind\.MAMBA, (\d+),.*num_speculative_blocks=(\d+).*\), (\d+), (\d+)\) \(which returns (\d+)\): breaks INV-TABLE-WIDTH",
                  counterexample)
    if m is None:
        return False
    bs, sp, dcp, max_len, returned = map(int, m.groups())
    needed = cdiv(max_len, bs) + sp
    return returned == cdiv(max_len, bs * dcp) + sp and returned < needed
