"""Sliding-window attention: only the last ``window - 1`` tokens are read, so blocks that fall
out of the window are released; hits are block-aligned (no fine-grained lookup)."""

from __future__ import annotations

from kvproof.impl.block_pool import NULL_BLOCK
from kvproof.impl.hashing import key_at
from kvproof.impl.managers.base import GroupRequest, SingleTypeManager
from kvproof.impl.request import Request


class WindowRequest(GroupRequest):
    """A request in a sliding-window group: its row, and the leading blocks that have their
    full-block keys (``full_keyed``)."""

    __slots__ = ("full_keyed",)

    def __init__(self, row: list[int], full_keyed: int) -> None:
        super().__init__(row)
        self.full_keyed = full_keyed


class SlidingWindowManager(SingleTypeManager):
    """A hit at N needs every block overlapping ``[N - window + 1, N)``; earlier entries are
    null. Its presence with an effective block other than H turns partial hits off (the
    geometry's fallback), so hits land on multiples of S, which are block-aligned here."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.window = self.group.sliding_window
        self.requests: dict[str, WindowRequest] = {}

    def _first_needed(self, n: int) -> int:
        return max(0, n - (self.window - 1)) // self.effective_block_size

    def find_hit(self, request: Request, bound: int) -> tuple[int, list[int]]:
        a, b, h = self.alignment, self.effective_block_size, self.hash_block_size
        hashes, group, lookup = request.block_hashes, self.group_id, self.pool.lookup
        n = min(bound, len(hashes) * h)
        n -= n % a
        while n > 0:
            if n % b == 0:
                first = self._first_needed(n)
                found = []
                for j in range(first, n // b):
                    blk = lookup(key_at(hashes, (j + 1) * b, h, group))
                    if blk is None:
                        break
                    found.append(blk)
                if len(found) == n // b - first:
                    return n, [NULL_BLOCK] * first + found
            n -= a
        return 0, []

    def blocks_needed(self, request: Request, total_tokens: int, hit_len: int, hit_blocks: list[int]) -> int:
        return max(self.row_length(total_tokens) - len(hit_blocks), 0) + self._evictable(hit_blocks)

    def allocate(
        self, request: Request, total_tokens: int, hit_len: int, hit_blocks: list[int], junctions: tuple[int, ...],
    ) -> list[int]:
        table = list(hit_blocks)  # the coordinator has touched them
        self.requests[request.request_id] = WindowRequest(table, hit_len // self.effective_block_size)
        self._grow(table, total_tokens)
        return list(table)

    def key(self, request: Request, num_computed: int) -> None:
        state = self.requests[request.request_id]
        full = min(num_computed, request.hashed_len) // self.effective_block_size
        self._key_full_blocks(request, state.row, state.full_keyed, full, self.pool.cache_full)
        state.full_keyed = max(full, state.full_keyed)

    def release(self, request: Request, num_computed: int) -> None:
        """Blocks wholly before the next token's window are no longer read."""
        table = self.requests[request.request_id].row
        out = [j for j in range(self._first_needed(num_computed)) if table[j] != NULL_BLOCK]
        if out:
            released = [table[j] for j in reversed(out)]
            self.pool.free(released, None if self.valuer is None else self.valuer.by_length(self.pool, released))
            for j in out:
                table[j] = NULL_BLOCK

    def idle_until(self, request: Request, num_computed: int) -> int:
        """Until the row is full, a block is complete (to key), or the window passes the
        end of the next block to release."""
        state, b = self.requests[request.request_id], self.effective_block_size
        slide = (self._first_needed(num_computed) + 1) * b + self.window - 1
        return min(len(state.row) * b, (state.full_keyed + 1) * b - 1, slide - 1)
