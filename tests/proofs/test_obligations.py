"""The real obligations hold: z3 lemmas are proved, bounded checks find nothing, and every
invariant id of the covered spec modules has an obligation."""

from __future__ import annotations

import pathlib
import re

import pytest

from kvproof.proofs.registry import (
    CHECKED,
    COVERED_SPEC_MODULES,
    PROVED,
    TESTED_ONLY,
    all_obligations,
)

SPEC = pathlib.Path(__file__).resolve().parents[2] / "spec"
REAL = [o for o in all_obligations() if not o.is_canary]


def _spec_ids() -> set[str]:
    text = "".join((SPEC / f"{m}.py").read_text() for m in COVERED_SPEC_MODULES)
    return set(re.findall(r"INV-[A-Z0-9]+(?:-[A-Z0-9]+)*", text))


def test_every_invariant_of_the_covered_modules_has_an_obligation():
    covered = {i for o in all_obligations() for i in o.invariants}
    missing = _spec_ids() - covered - set(TESTED_ONLY)
    assert not missing, f"invariants without an obligation or a TESTED_ONLY reason: {sorted(missing)}"


def test_obligations_name_only_existing_invariants():
    text = "".join(p.read_text() for p in SPEC.glob("*.py"))
    unknown = {i for o in all_obligations() for i in o.invariants if i not in text}
    assert not unknown


@pytest.mark.parametrize("obligation", [o for o in REAL if o.method == "z3"], ids=lambda o: o.id)
def test_z3_lemma_is_proved(obligation):
    outcome = obligation.check(300.0)  # a deadline only: each step's time is fixed
    assert outcome.verdict == PROVED, outcome.detail


@pytest.mark.parametrize("obligation", [o for o in REAL if o.method == "exhaustive"], ids=lambda o: o.id)
def test_bounded_check_finds_nothing(obligation):
    outcome = obligation.check(120.0)  # the scopes are fixed; the budget only guards a hang
    assert outcome.verdict == CHECKED, outcome.counterexample or outcome.detail


def test_crosshair_proves_the_arithmetic():
    (ch_arith,) = [o for o in REAL if o.id == "CH-ARITH"]
    assert ch_arith.check(60.0).verdict == PROVED
