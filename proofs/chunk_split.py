"""Exhaustive small-scope check of the Mamba chunk-split rule (spec/chunk_split.py).

Runs ``mamba_chunk_end`` (and through it ``checkpoint_position``) with contracts on over a
fixed scope; the contracts state the invariants: a checkpoint is a multiple of its unit below
the sequence end (INV-SPLIT-CKPT); a chunk makes progress, stays within budget and sequence,
and never runs past a checkpoint (INV-SPLIT-PROGRESS-AND-STOPS). The scope is infinite in
general, so a clean run is ``unrefuted``.
"""

from __future__ import annotations

import itertools
import time

import icontract

from kvproof.proofs.registry import CHECKED, INCOMPLETE, REFUTED, Obligation, Outcome, violation_summary
from kvproof.spec.chunk_split import mamba_chunk_end


def scope():
    """Mamba blocks 1-4 with every H dividing them, sequences up to 8 tokens, budgets 1, 2, 3, 5."""
    for mamba, num_tokens in itertools.product(range(1, 5), range(1, 9)):
        for h in (d for d in range(1, mamba + 1) if mamba % d == 0):
            for prompt in sorted({(num_tokens + 1) // 2, num_tokens}):
                for start, budget in itertools.product(range(num_tokens), (1, 2, 3, 5)):
                    for partial_tail, eagle_drop, lookahead in itertools.product((False, True), (False, True), (0, 1)):
                        yield start, budget, num_tokens, prompt, mamba, h, partial_tail, eagle_drop, lookahead


def check_chunk_split(budget: float) -> Outcome:
    deadline, count = time.monotonic() + budget, 0
    for args in scope():
        if count % 1024 == 0 and time.monotonic() > deadline:
            return Outcome(INCOMPLETE, detail=f"budget spent after {count:,} chunks")
        try:
            mamba_chunk_end(*args)
        except icontract.ViolationError as e:
            names = "start budget num_tokens num_prompt_tokens mamba_block_size hash_block_size partial_tail eagle_drop lookahead"
            call = ", ".join(f"{n}={a}" for n, a in zip(names.split(), args))
            return Outcome(REFUTED, counterexample=f"mamba_chunk_end({call}): {violation_summary(e)}")
        count += 1
    return Outcome(CHECKED, detail=f"{count:,} chunks, every contract held")


OBLIGATIONS = (
    Obligation(
        "EXH-CHUNK-SPLIT",
        ("INV-SPLIT-CKPT", "INV-SPLIT-PROGRESS-AND-STOPS"),
        "exhaustive",
        "every chunk in scope makes progress within budget and stops at the first Mamba checkpoint",
        check_chunk_split,
    ),
)
