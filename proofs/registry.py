"""Obligations, verdicts and the list of every obligation ``kvproof prove`` runs.

An obligation names the invariant ids it discharges, the method (``z3``, ``crosshair`` or
``exhaustive``) and a ``check(budget_seconds) -> Outcome``. Obligations whose id starts with
``CANARY-`` check a seeded wrong version of the spec: they pass only when *refuted*, which is
how the checkers show they have teeth.

To add obligations for a new spec module, write ``proofs/<module>.py`` with an
``OBLIGATIONS`` tuple and add its name to :data:`MODULES`.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

PROVED = "proved"  # for every input: z3 proved the negation unsat, or the whole finite domain was checked
UNREFUTED = "unrefuted"  # no counterexample within the budget (CrossHair, bounded enumeration)
REFUTED = "refuted"  # a counterexample, kept in Outcome.counterexample
ERROR = "error"  # the checker itself failed (a crash, a z3 model that no longer mirrors the spec)

VERDICTS = (PROVED, UNREFUTED, REFUTED, ERROR)
CANARY_PREFIX = "CANARY-"


@dataclasses.dataclass(frozen=True)
class Outcome:
    verdict: str
    counterexample: str | None = None
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class Obligation:
    """One thing to discharge. ``weight`` is its share of the time budget (relative)."""

    id: str
    invariants: tuple[str, ...]
    method: str
    statement: str
    check: Callable[[float], Outcome]
    weight: float = 1.0

    @property
    def is_canary(self) -> bool:
        return self.id.startswith(CANARY_PREFIX)

    def failed(self, outcome: Outcome) -> bool:
        """A real obligation fails when refuted (or the checker broke); a canary when it is not refuted."""
        if self.is_canary:
            return outcome.verdict != REFUTED
        return outcome.verdict in (REFUTED, ERROR)


def violation_summary(error: BaseException) -> str:
    """The line of a contract violation that names the invariant (icontract puts the source
    location first)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return next((line for line in lines if "INV-" in line), lines[0] if lines else type(error).__name__)


#: Modules under kvproof.proofs that contribute an ``OBLIGATIONS`` tuple, in run order.
MODULES = (
    "lemmas_arith",
    "lemmas_placement",
    "lemmas_geometry",
    "geometry",
    "placement",
    "chunk_split",
    "block_pool",
    "joint_hit",
    "canaries",
    "crosshair_runs",  # last: CrossHair uses whatever budget the others left
)


#: Spec modules whose every invariant id has an obligation (tests/proofs checks it against the
#: ids in their source). Add a module here together with its obligations.
COVERED_SPEC_MODULES = ("arith", "geometry", "layout", "placement", "chunk_split", "block_pool", "joint_hit")

#: Invariant ids of covered modules that are only tested, with the reason.
TESTED_ONLY: dict[str, str] = {}


def all_obligations() -> tuple[Obligation, ...]:
    out: list[Obligation] = []
    for name in MODULES:
        out.extend(importlib.import_module(f"kvproof.proofs.{name}").OBLIGATIONS)
    ids = [o.id for o in out]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise RuntimeError(f"duplicate obligation ids: {', '.join(duplicates)}")
    return tuple(out)
