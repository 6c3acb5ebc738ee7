"""Exhaustive small-scope check of the checkpoint policy's turn-end ladder (spec/checkpoints.py).

``turn_end_rungs`` runs with its contracts on (INV-CKPT-GRID, INV-CKPT-BUDGET) over every prompt,
unit and budget in scope; each ladder is then checked against INV-CKPT-LADDER by brute force (a
next turn sharing any unit multiple the ladder reaches resumes at the highest state at or below
it, recomputing fewer shared tokens than it lies below the last checkpoint); and ``chunk_end``
with the ladder's stops runs with its contracts on over a small scope (INV-SPLIT-PROGRESS,
INV-SPLIT-ALIGNED, INV-SPLIT-STOPS hold with the extra stops). Unrefuted in scope only.
"""

from __future__ import annotations

import itertools
import time

import icontract

from kvproof.proofs.chunk_split import run_chunk_ends
from kvproof.proofs.registry import CHECKED, INCOMPLETE, REFUTED, Obligation, Outcome, violation_summary
from kvproof.spec.checkpoints import turn_end_rungs
from kvproof.spec.chunk_split import SplitRule, checkpoint_position


def ladder_scope():
    """Prompts up to 200 tokens, units 1-8, budgets 0-5, with and without EAGLE."""
    return itertools.product(range(1, 201), range(1, 9), range(6), (False, True))


def split_scope():
    """Mamba blocks 1-3 (H = the block), ladder units 1 and 2 blocks, 1-3 rungs, sequences up to
    8 tokens, chunk limits 1 and 5, EAGLE on and off."""
    for mamba, mult, rungs, num_tokens, max_prefill, eagle in itertools.product(
        range(1, 4), (1, 2), (1, 2, 3), range(1, 9), (1, 5), (False, True),
    ):
        rule = SplitRule(mamba, mamba, max_prefill, eagle_drop=eagle, rungs=rungs, rung_unit=mamba * mult)
        for start in range(num_tokens):
            for num_new in range(1, min(max_prefill, num_tokens - start) + 1):
                yield rule, start, num_new, num_tokens, num_tokens


def _ladder_holds(prompt: int, unit: int, rungs: tuple[int, ...], eagle: bool) -> bool:
    top = checkpoint_position(prompt, unit, eagle)
    states = (top,) + rungs
    for s in range(min(states), top + 1, unit):
        resumed = max(x for x in states if x <= s)
        if resumed != s and s - resumed >= top - s:
            return False
    return True


def check_ladder(budget: float) -> Outcome:
    deadline, count = time.monotonic() + budget, 0
    for prompt, unit, rungs, eagle in ladder_scope():
        if count % 1024 == 0 and time.monotonic() > deadline:
            return Outcome(INCOMPLETE, detail=f"budget spent after {count:,} ladders")
        try:
            ladder = turn_end_rungs(prompt, unit, rungs, eagle)
        except icontract.ViolationError as e:
            return Outcome(REFUTED, counterexample=f"turn_end_rungs({prompt}, {unit}, {rungs}, {eagle}): {violation_summary(e)}")
        if not _ladder_holds(prompt, unit, ladder, eagle):
            return Outcome(REFUTED, counterexample=f"turn_end_rungs({prompt}, {unit}, {rungs}, {eagle}) = {ladder}: "
                           "INV-CKPT-LADDER: a shared length recomputes at least as far as it lies below the checkpoint")
        count += 1
    failed, chunks = run_chunk_ends(split_scope(), deadline)
    if failed is not None:
        return failed
    return Outcome(CHECKED, detail=f"{count:,} ladders and {chunks:,} chunks with ladder stops, every check held")


OBLIGATIONS = (
    Obligation(
        "EXH-CKPT-LADDER",
        ("INV-CKPT-GRID", "INV-CKPT-BUDGET", "INV-CKPT-LADDER", "INV-SPLIT-PROGRESS", "INV-SPLIT-ALIGNED",
         "INV-SPLIT-STOPS"),
        "exhaustive",
        "every ladder in scope stays on the unit grid and within its budget and recomputes less than the unshared "
        "tail; chunks with ladder stops still progress, end aligned or at their first stop",
        check_ladder,
    ),
)
