"""docs/spec.md's "Proofs" section accounts for every invariant id of the catalogue, and every
obligation it names exists."""

from __future__ import annotations

import pathlib
import re

from kvproof.proofs.registry import all_obligations

SPEC = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "spec.md").read_text()
CATALOGUE, _, PROOFS = SPEC.partition("\n## Proofs\n")


def test_every_invariant_has_an_obligation_or_a_reason():
    ids = set(re.findall(r"^\| (INV-[A-Z0-9-]+) \|", CATALOGUE, re.M))
    covered = set()
    for row in PROOFS.splitlines():
        if row.startswith("| INV-"):
            covered.update(re.findall(r"INV-[A-Z0-9-]+", row.split("|")[1]))
    assert ids and ids <= covered, sorted(ids - covered)


def test_named_obligations_exist():
    known = {o.id for o in all_obligations()}
    named = set(re.findall(r"\b((?:LEM|EXH|CH|CANARY)-[A-Z0-9-]+)", PROOFS))
    assert named and named <= known, sorted(named - known)
