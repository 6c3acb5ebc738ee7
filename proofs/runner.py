"""Run obligations within one time budget and collect their results.

Each obligation's effort is fixed by the obligation itself (a scope, a z3 step time, a CrossHair
time per condition), never sized from the budget, so verdicts do not depend on ``--budget``.
The budget is only a deadline for the whole run: an obligation gets what is left of it, and one
that the deadline cuts short reports ``timeout`` or ``incomplete`` (and ``kvproof prove``
fails). Obligations run one after another, in registry order, so results are reproducible.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterable

from kvproof.proofs.registry import ERROR, TIMEOUT, Obligation, Outcome, all_obligations

#: `kvproof prove` with no --budget: a deadline well above what every obligation needs on a
#: loaded 2-core machine (docs/proofs.md gives the measured time).
DEFAULT_BUDGET = 600.0
#: The longest budget accepted (a day): beyond it a deadline means nothing.
MAX_BUDGET = 86400.0


@dataclasses.dataclass(frozen=True)
class Result:
    obligation: Obligation
    outcome: Outcome
    seconds: float

    @property
    def failed(self) -> bool:
        return self.obligation.failed(self.outcome)

    def to_json(self) -> dict:
        o = self.obligation
        return {
            "id": o.id,
            "method": o.method,
            "verdict": self.outcome.verdict,
            "seconds": round(self.seconds, 3),
            "invariants": list(o.invariants),
            "canary": o.is_canary,
            "statement": o.statement,
            "counterexample": self.outcome.counterexample,
            "detail": self.outcome.detail,
        }


def select(ids: Iterable[str] = ()) -> tuple[Obligation, ...]:
    """Every obligation, or those whose id starts with one of ``ids`` (ValueError if none does)."""
    everything = all_obligations()
    ids = tuple(ids)
    if not ids:
        return everything
    for prefix in ids:
        if not prefix:  # it would start every id: refused rather than run everything
            raise ValueError(f"obligation id prefix {prefix!r} is empty; expected the start of an id, e.g. "
                             f"{everything[0].id.split('-')[0]}")
        if not any(o.id.startswith(prefix) for o in everything):
            known = ", ".join(o.id for o in everything)
            raise ValueError(f"no obligation id starts with {prefix!r}; expected one of {known}")
    return tuple(o for o in everything if o.id.startswith(ids))


def run_all(
    obligations: tuple[Obligation, ...],
    budget: float = DEFAULT_BUDGET,
    on_result: Callable[[int, Result], None] | None = None,
) -> list[Result]:
    """Run ``obligations`` in order until done or ``budget`` seconds have passed (a checker may
    overrun the deadline a little: a z3 step is not interruptible mid-way)."""
    deadline = time.monotonic() + budget
    results = []
    for i, o in enumerate(obligations):
        left = deadline - time.monotonic()
        start = time.monotonic()
        if left <= 0:
            outcome = Outcome(TIMEOUT, detail=f"not started: the budget of {budget:g}s was spent")
        else:
            try:
                outcome = o.check(left)
            except Exception as e:  # a crashing checker is a failed run, never a silent pass
                outcome = Outcome(ERROR, detail=f"{type(e).__name__}: {e}")
        result = Result(o, outcome, time.monotonic() - start)
        results.append(result)
        if on_result is not None:
            on_result(i, result)
    return results
