"""Exhaustive small-scope check of the Mamba chunk-split rule (spec/chunk_split.py).

Runs ``chunk_end`` (and through it ``checkpoint_position``) with contracts on over a fixed
scope; the contracts state the invariants: a checkpoint is a multiple of its unit below the
sequence end (INV-SPLIT-CKPT); a chunk stays within its tokens and waits only when it must
(INV-SPLIT-PROGRESS); it ends block-aligned, at the prefill end or at a stop, and is as long as
allowed (INV-SPLIT-ALIGNED); it never runs past a checkpoint or junction (INV-SPLIT-STOPS). The
scope is infinite in general, so a clean run is ``unrefuted``.
"""

from __future__ import annotations

import itertools
import time
from typing import Optional

import icontract

from kvproof.proofs.registry import CHECKED, INCOMPLETE, REFUTED, Obligation, Outcome, violation_summary
from kvproof.spec.chunk_split import SplitRule, chunk_end


def scope():
    """Mamba blocks 1-4 with every H dividing them, sequences up to 6 tokens, chunk limits 1 and
    5, no junction or one at every position, both junction modes, with and without replay stops
    (scheduler block 2 * Mamba, alignment H)."""
    for mamba, num_tokens in itertools.product(range(1, 5), range(1, 7)):
        for h in (d for d in range(1, mamba + 1) if mamba % d == 0):
            for flags in itertools.product((False, True), (False, True), (0, 1), (False, True), (1, 5), (0, 2 * mamba)):
                partial_tail, eagle_drop, lookahead, exact, max_prefill, s = flags
                rule = SplitRule(mamba, h, max_prefill, partial_tail, eagle_drop, lookahead, exact,
                                 scheduler_block_size=s, replay_alignment=h if s else 0)
                for prompt in sorted({(num_tokens + 1) // 2, num_tokens}):
                    for start in range(num_tokens):
                        for num_new in range(1, min(max_prefill, num_tokens - start) + 1):
                            for junctions in ((),) + tuple((j,) for j in range(1, num_tokens)):
                                yield rule, start, num_new, num_tokens, prompt, junctions


def run_chunk_ends(chunks, deadline: float) -> tuple[Optional[Outcome], int]:
    """``chunk_end(*args)`` with its contracts on for every ``args`` in ``chunks`` until
    ``deadline`` (``time.monotonic()``): (the REFUTED or INCOMPLETE outcome, or None when all
    held; how many ran)."""
    count = 0
    for args in chunks:
        if count % 1024 == 0 and time.monotonic() > deadline:
            return Outcome(INCOMPLETE, detail=f"budget spent after {count:,} chunks"), count
        try:
            chunk_end(*args)
        except icontract.ViolationError as e:
            names = "rule start num_new num_tokens num_prompt_tokens junctions"
            call = ", ".join(f"{n}={a}" for n, a in zip(names.split(), args))
            return Outcome(REFUTED, counterexample=f"chunk_end({call}): {violation_summary(e)}"), count
        count += 1
    return None, count


def check_chunk_split(budget: float) -> Outcome:
    failed, count = run_chunk_ends(scope(), time.monotonic() + budget)
    return failed or Outcome(CHECKED, detail=f"{count:,} chunks, every contract held")


OBLIGATIONS = (
    Obligation(
        "EXH-CHUNK-SPLIT",
        ("INV-SPLIT-CKPT", "INV-SPLIT-PROGRESS", "INV-SPLIT-ALIGNED", "INV-SPLIT-STOPS"),
        "exhaustive",
        "every chunk in scope stays within its tokens, ends aligned or at its first stop, and is as long as allowed",
        check_chunk_split,
    ),
)
