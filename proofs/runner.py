"""Run obligations within one time budget and collect their results.

Budget split: each obligation gets ``remaining * weight / remaining_weight``, so time a fast
obligation leaves unused flows to the ones after it (CrossHair runs last and takes what is
left). Obligations run one after another, in registry order, so results are reproducible.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterable

from kvproof.proofs.registry import ERROR, Obligation, Outcome, all_obligations

#: `kvproof prove` with no --budget: every obligation, about 2.5 minutes on 2 cores.
DEFAULT_BUDGET = 150.0


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
        if not any(o.id.startswith(prefix) for o in everything):
            known = ", ".join(o.id for o in everything)
            raise ValueError(f"no obligation id starts with {prefix!r}; expected one of {known}")
    return tuple(o for o in everything if o.id.startswith(ids))


def run_all(
    obligations: tuple[Obligation, ...],
    budget: float = DEFAULT_BUDGET,
    on_result: Callable[[int, Result], None] | None = None,
) -> list[Result]:
    """Run ``obligations`` in order within about ``budget`` seconds (each checker may overrun
    its share a little: a z3 step or a CrossHair condition is not interruptible mid-way)."""
    deadline = time.monotonic() + budget
    weight_left = sum(o.weight for o in obligations)
    results = []
    for i, o in enumerate(obligations):
        share = max(0.5, (deadline - time.monotonic()) * o.weight / weight_left)
        weight_left -= o.weight
        start = time.monotonic()
        try:
            outcome = o.check(share)
        except Exception as e:  # a crashing checker is a failed run, never a silent pass
            outcome = Outcome(ERROR, detail=f"{type(e).__name__}: {e}")
        result = Result(o, outcome, time.monotonic() - start)
        results.append(result)
        if on_result is not None:
            on_result(i, result)
    return results
