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

PROVED = "proved"  # for every input: z3 proved each step, or CrossHair confirmed every path
CHECKED = "checked"  # every case of a fixed, finite scope ran and none failed (no claim beyond it)
REFUTED = "refuted"  # a counterexample, replayed concretely, in Outcome.counterexample
TIMEOUT = "timeout"  # the checker hit its time limit before deciding (z3 "unknown", CrossHair "not confirmed")
INCOMPLETE = "incomplete"  # a bounded check ran out of budget before covering its scope
ERROR = "error"  # the checker itself failed (a crash, a tool error, a model that no longer mirrors the spec)

#: Verdicts that discharge a (real) obligation; every other verdict means it did not complete.
COMPLETE = (PROVED, CHECKED)
CANARY_PREFIX = "CANARY-"


@dataclasses.dataclass(frozen=True)
class Outcome:
    verdict: str
    counterexample: str | None = None
    detail: str = ""


@dataclasses.dataclass(frozen=True)
class Obligation:
    """One thing to discharge. ``check(seconds_left)`` must return within about that long."""

    id: str
    invariants: tuple[str, ...]
    method: str
    statement: str
    check: Callable[[float], Outcome]

    @property
    def is_canary(self) -> bool:
        return self.id.startswith(CANARY_PREFIX)

    def failed(self, outcome: Outcome) -> bool:
        """A real obligation fails unless it completed (proved, or its whole scope checked); a
        canary fails unless it is refuted."""
        if self.is_canary:
            return outcome.verdict != REFUTED
        return outcome.verdict not in COMPLETE


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
    "checkpoints",
    "block_pool",
    "joint_hit",
    "canaries",
    "crosshair_runs",  # last: CrossHair uses whatever budget the others left
)


#: Spec modules whose every invariant id has an obligation (tests/proofs checks it against the
#: ids in their source). Add a module here together with its obligations.
COVERED_SPEC_MODULES = ("arith", "geometry", "layout", "placement", "chunk_split", "checkpoints", "block_pool", "joint_hit")

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
