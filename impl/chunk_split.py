"""The Mamba chunk-split rule on the scheduler's hot path: the same rule as
``kvproof.spec.chunk_split.mamba_chunk_end`` (which it is tested against), in plain integer
code -- the spec's contracts cost more than the rule itself on every scheduled chunk."""

from __future__ import annotations


def _checkpoint(num_tokens: int, unit: int, eagle_drop: bool, lookahead: int) -> int:
    if eagle_drop:
        return max(num_tokens - num_tokens % unit - unit, 0)
    n = max(num_tokens - max(1, lookahead), 0)
    return n - n % unit


def chunk_end(
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
    """End (exclusive) of the chunk starting at ``start`` (see the spec for the rule)."""
    end = min(start + budget, num_tokens)
    if end < num_tokens:
        aligned = end - end % mamba_block_size
        if aligned > start:
            end = aligned
    if start % mamba_block_size:
        boundary = start - start % mamba_block_size + mamba_block_size
        if boundary < end:
            end = boundary
    last = _checkpoint(num_tokens, mamba_block_size, eagle_drop, lookahead)
    if start < last < end:
        end = last
    if partial_tail:
        tail = _checkpoint(num_prompt_tokens, hash_block_size, eagle_drop, lookahead)
        if tail > last and start < tail < end:
            end = tail
    if not start < end:
        raise AssertionError(f"INV-SPLIT-PROGRESS-AND-STOPS: chunk [{start}, {end}) makes no progress")
    return end
