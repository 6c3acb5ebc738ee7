"""Where the scheduler may end a prefill chunk of a request with align-mode Mamba groups.

A Mamba state exists only where a scheduled chunk ends, so chunk ends decide which prefix
lengths can ever be reused. The rule (vLLM 0.33, reference 5.4):

1. A chunk that does not reach the end of the known tokens is lowered to a multiple of the
   Mamba block, so that its state is a whole-block checkpoint -- unless that would leave no
   progress because the Mamba block exceeds the budget; then the chunk stays unaligned.
2. The chunk then stops at the earliest *checkpoint* strictly inside it: the next Mamba block
   boundary when it starts mid-block; the last cacheable position of the sequence; and, with
   partial hash hits, the prompt's tail checkpoint at hash granularity.
"""

from __future__ import annotations

import icontract

from kvproof.spec.arith import floor_to


@icontract.require(lambda num_tokens: num_tokens >= 1)
@icontract.require(lambda unit: unit >= 1)
@icontract.require(lambda lookahead: lookahead >= 0)
@icontract.ensure(
    lambda num_tokens, unit, result: 0 <= result < num_tokens and result % unit == 0,
    "INV-SPLIT-CKPT: a checkpoint is a multiple of its unit strictly below the sequence end",
)
def checkpoint_position(num_tokens: int, unit: int, eagle_drop: bool, lookahead: int = 0) -> int:
    """The last position at which a state of a ``num_tokens`` sequence is worth keeping.

    At least one token must remain to compute (a hit never covers the whole sequence); with
    lookahead L the last L tokens stay uncomputed; with EAGLE the state is one unit earlier,
    because the draft recomputes the final unit.
    """
    if eagle_drop:
        return max(floor_to(num_tokens, unit) - unit, 0)
    return max(floor_to(max(num_tokens - max(1, lookahead), 0), unit), 0)


def split_checkpoints(
    start: int,
    num_tokens: int,
    num_prompt_tokens: int,
    mamba_block_size: int,
    hash_block_size: int,
    partial_tail: bool,
    eagle_drop: bool,
    lookahead: int = 0,
) -> tuple[int, ...]:
    """The positions a chunk starting at ``start`` must not run past (sorted, all > start)."""
    stops = []
    if start % mamba_block_size:
        stops.append(start - start % mamba_block_size + mamba_block_size)
    last = checkpoint_position(num_tokens, mamba_block_size, eagle_drop, lookahead)
    stops.append(last)
    if partial_tail:
        tail = checkpoint_position(num_prompt_tokens, hash_block_size, eagle_drop, lookahead)
        if tail > last:
            stops.append(tail)
    return tuple(sorted(p for p in set(stops) if p > start))


def _chunk_ok(start, budget, num_tokens, num_prompt_tokens, mamba_block_size, hash_block_size,
              partial_tail, eagle_drop, lookahead, result) -> bool:
    if not start < result <= min(start + budget, num_tokens):
        return False
    stops = split_checkpoints(start, num_tokens, num_prompt_tokens, mamba_block_size, hash_block_size,
                              partial_tail, eagle_drop, lookahead)
    return all(not start < s < result for s in stops)


@icontract.require(
    lambda start, num_tokens: 0 <= start < num_tokens,
    error=lambda start, num_tokens: ValueError(f"chunk start {start} must lie in [0, {num_tokens})"),
)
@icontract.require(lambda budget: budget >= 1, error=lambda budget: ValueError(f"token budget {budget} must be >= 1"))
@icontract.require(lambda mamba_block_size, hash_block_size: mamba_block_size >= 1 and hash_block_size >= 1)
@icontract.ensure(
    _chunk_ok,
    "INV-SPLIT-PROGRESS-AND-STOPS: a chunk makes progress, stays within budget and sequence, and "
    "never runs past a Mamba checkpoint",
)
def mamba_chunk_end(
    start: int,
    budget: int,
    num_tokens: int,
    num_prompt_tokens: int,
    mamba_block_size: int,
    hash_block_size: int,
    partial_tail: bool,
    eagle_drop: bool = False,
    lookahead: int = 0,
) -> int:
    """End (exclusive) of the chunk that starts at ``start`` with ``budget`` tokens to spend.

    ``num_tokens`` is the number of tokens known for the request (prompt plus outputs so
    far); ``partial_tail`` is "align mode, partial hash hits on and H < S".
    """
    end = min(start + budget, num_tokens)
    if end < num_tokens:
        aligned = floor_to(end, mamba_block_size)
        if aligned > start:
            end = aligned
        # else: the Mamba block exceeds the budget; an unaligned chunk is the only progress.
    stops = split_checkpoints(start, num_tokens, num_prompt_tokens, mamba_block_size, hash_block_size,
                              partial_tail, eagle_drop, lookahead)
    for stop in stops:
        if stop < end:
            return stop
    return end
