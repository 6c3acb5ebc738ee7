"""Capacity: the fewest blocks one request holds at once, so that a pool too small for it can be
refused before anything runs.

A request of ``n`` computed tokens (the prompt and every output but the last: the KV of the
last sampled token is never computed) reaches, at its last step, a moment where every group
holds its blocks for all ``n`` tokens at once. With the pool to itself and whatever prefix hit
it gets (hit blocks are held too), it then holds at least, per group:

- full attention / MLA: every block of the ``n`` tokens, ``cdiv(n, B_g)``;
- sliding window: the blocks from the one holding position ``n - window`` (the oldest a
  window-``w`` step still reads, one step before the end) to the last,
  ``cdiv(n, B_g) - max(0, n - w) // B_g``;
- Mamba (any mode): the state block and its speculative blocks, ``1 + num_speculative_blocks``.

Blocks of different groups are distinct pool blocks, so the request needs the sum. It is a
lower bound, never more than the scheduler's real need (chunk transitions and copies can need
more): refusing below it never refuses a request that fits.
"""

from __future__ import annotations

import icontract

from kvproof.spec.arith import cdiv
from kvproof.spec.groups import GroupKind
from kvproof.spec.layout import GroupLayout, Layout


def _holds_what_it_must(layout: Layout, num_tokens: int, result: tuple[int, ...]) -> bool:
    """Each count's blocks cover what its group must keep at the request's last step."""
    for gl, count in zip(layout.groups, result):
        b, kind = gl.effective_block_size, gl.group.kind
        if kind is GroupKind.MAMBA:
            ok = count >= 1 + gl.group.num_speculative_blocks
        elif kind is GroupKind.SLIDING_WINDOW:
            ok = count * b >= min(num_tokens, gl.group.sliding_window) and count <= cdiv(num_tokens, b)
        else:
            ok = count * b >= num_tokens > (count - 1) * b
        if not ok:
            return False
    return len(result) == len(layout.groups)


def _group_blocks(gl: GroupLayout, n: int) -> int:
    b = gl.effective_block_size
    if gl.group.kind is GroupKind.MAMBA:
        return 1 + gl.group.num_speculative_blocks
    if gl.group.kind is GroupKind.SLIDING_WINDOW:
        window = gl.group.sliding_window
        return cdiv(n, b) - max(0, n - window) // b
    return cdiv(n, b)


@icontract.ensure(
    lambda layout, num_tokens, result: _holds_what_it_must(layout, num_tokens, result),
    "INV-CAPACITY-ALONE: a lone request's count per group covers what the group keeps at its last "
    "step: attention all n tokens (and no block more), a sliding window the last min(n, window), "
    "Mamba its state and speculative blocks",
)
def blocks_alone(layout: Layout, num_tokens: int) -> tuple[int, ...]:
    """Per group, the fewest blocks a request of ``num_tokens`` computed tokens holds at once,
    even with the pool to itself. Pure; ValueError for ``num_tokens < 1``."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"num_tokens {num_tokens!r} must be a positive integer")
    return tuple(_group_blocks(gl, num_tokens) for gl in layout.groups)


def check_fits_alone(layout: Layout, num_blocks: int, request_id: str, num_tokens: int) -> None:
    """Raise ValueError (naming the request, its need per group and ``num_blocks``) if a request
    of ``num_tokens`` computed tokens can never run in a pool of ``num_blocks`` blocks, block 0
    being the null block. No state change."""
    need = blocks_alone(layout, num_tokens)
    if sum(need) <= num_blocks - 1:
        return
    per_group = ", ".join(f"group {gl.index} {gl.group.label}: {n:,}" for gl, n in zip(layout.groups, need))
    raise ValueError(
        f"request {request_id!r} ({num_tokens:,} tokens) needs at least {sum(need):,} blocks even with the pool "
        f"to itself ({per_group}), but num_blocks {num_blocks:,} leaves {num_blocks - 1:,} (block 0 is the null "
        f"block); expected num_blocks >= {sum(need) + 1:,}"
    )
