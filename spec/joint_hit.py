"""The joint prefix-cache hit across cache groups, stated as obviously as possible.

A hit of N tokens is usable only if *every* group can restore the prefix ``[0, N)``. Each
group's predicate is written directly from what its cache entries mean (docs/coordinator.md),
given ``has(N)``: "a key for the N-token prefix exists in this group":

- full attention / MLA (append-only KV): every block wholly below N has its full-block key, and
  the block containing N's end (when N is inside a block) has some key covering at least N
  tokens -- its KV for ``[block start, N)`` is then valid whatever came after;
- Mamba (align): a state for exactly N tokens exists;
- sliding window: N is block-aligned and every block of the last ``window - 1`` tokens is there.

EAGLE groups must also cover one more unit (the draft recomputes it). The joint hit is the
largest N <= the bound that is a multiple of the cache-hit alignment and usable in every group.
The implementation (``kvproof.impl.coordinator``) computes the same number by a fixpoint of
fast per-group finders (``kvproof.impl.fixpoint``); the state machines and the exhaustive check
``EXH-JOINT-FIXPOINT`` (proofs/joint_hit.py) compare the two.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import icontract

from kvproof.spec.arith import floor_to

Has = Callable[[int], bool]

ATTENTION, MAMBA, WINDOW = "attention", "mamba", "window"


@dataclasses.dataclass(frozen=True)
class GroupView:
    """What the joint-hit rule needs to know about one group."""

    kind: str  # ATTENTION, MAMBA or WINDOW
    effective_block_size: int  # B_g
    has: Has
    eagle_unit: int = 0  # tokens the EAGLE draft must recompute (0: not an eagle group)
    window: int = 0  # sliding window, tokens


def usable(view: GroupView, n: int, hash_block_size: int, hashed_len: int) -> bool:
    """Whether ``view``'s group can restore the first ``n`` tokens."""
    if n == 0:
        return True
    b, has = view.effective_block_size, view.has
    if view.kind == MAMBA:
        return has(n)
    if view.kind == WINDOW:
        if n % b:
            return False
        first = max(0, n - (view.window - 1)) // b
        return all(has((j + 1) * b) for j in range(first, n // b))
    need = n + view.eagle_unit
    if need > hashed_len:
        return False
    if not all(has((j + 1) * b) for j in range(need // b)):
        return False
    if need % b == 0:
        return True
    block_end = min((need // b + 1) * b, hashed_len)
    return any(has(m) for m in range(floor_to(need + hash_block_size - 1, hash_block_size), block_end + 1, hash_block_size))


@icontract.require(
    lambda bound, hashed_len: bound >= 0 and hashed_len >= 0,
    error=lambda bound, hashed_len: ValueError(f"bound {bound} and hashed_len {hashed_len} must be >= 0"),
)
@icontract.require(lambda alignment, hash_block_size: alignment % hash_block_size == 0)
@icontract.ensure(
    lambda bound, alignment, hashed_len, result: result % alignment == 0 and 0 <= result <= min(bound, hashed_len),
    "INV-HIT-BOUND: the hit is a multiple of A, at most the bound (num_tokens - 1) and the hashed length",
)
def joint_hit(views: tuple[GroupView, ...], bound: int, alignment: int, hash_block_size: int, hashed_len: int) -> int:
    """The largest N that every group can restore (O(bound / A) candidates; a reference)."""
    n = floor_to(max(min(bound, hashed_len), 0), alignment)
    while n > 0 and not all(usable(v, n, hash_block_size, hashed_len) for v in views):
        n -= alignment
    return n
