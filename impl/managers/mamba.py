"""Mamba / linear attention in ``align`` mode: one recurrent state per request, replicated on
every DCP rank, kept in the block at index ``cdiv(n, B) - 1`` after ``n`` computed tokens."""

from __future__ import annotations

from kvproof.impl.block_pool import NULL_BLOCK
from kvproof.impl.managers.base import SingleTypeManager
from kvproof.impl.request import Request
from kvproof.spec.contracts import InvariantViolation
from kvproof.spec.retention import RetentionRule, keeps_state


class MambaManager(SingleTypeManager):
    """A state summarises exactly one prefix length, so a hit needs a state at exactly N.

    The forward pass of a chunk ``[c, c + k)`` reads the state block of ``c`` and writes the
    one of ``c + k``. When both indices are equal the write is in place; if the state at ``c``
    is cached, the owner first copies it away (copy-on-write for the running owner) and the
    key moves to the copy once the step has run. A hit at N not on a block boundary is copied
    for the new request too (the next chunk may land in the same block index). Older state
    blocks are released after the step that last read them, so a request holds at most two
    real blocks (INV-MAMBA-REAL-BLOCKS). States are keyed where chunks end on a hash boundary
    and the retention policy keeps them (``kvproof.spec.retention``): block-aligned ones as
    full-block keys, others (inside the prompt only) as partial keys.
    """

    def __init__(
        self, *args, retention_interval: int | None = None, scheduler_block_size: int = 0,
        exact_junction: bool = False, **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        if not self.group.prefix_cacheable:
            # Mode 'none': one state block for the whole request, never keyed.
            self.block_size = 1 << 62
        self._spec = self.group.num_speculative_blocks
        self.retention = RetentionRule(
            retention_interval, self.block_size, self.hash_block_size, self.alignment,
            scheduler_block_size or self.block_size, eagle=self.use_eagle,
        )
        self.exact_junction = exact_junction
        # request id -> state block index (-1: no state yet)
        self._state_index: dict[str, int] = {}
        # request id -> (cached state block, its copy): key moves once the step has run
        self._pending_move: dict[str, tuple[int, int]] = {}
        # request id -> row indices of blocks the running step still reads (the old state) or
        # that fell below the new state (old speculative blocks); released once it has run
        self._superseded: dict[str, list[int]] = {}

    def row_length(self, total_tokens: int) -> int:
        return -(-total_tokens // self.block_size) + self._spec

    # --- lookup ---------------------------------------------------------------------------------

    def find_hit(self, request: Request, bound: int) -> tuple[int, list[int]]:
        a, h, b = self.alignment, self.hash_block_size, self.block_size
        hashes, group, lookup = request.block_hashes, self.group_id, self.pool.lookup
        n = min(bound, len(hashes) * h)
        n -= n % a
        while n > 0:
            found = lookup((hashes[n // h - 1], group))
            if found is not None:
                return n, [NULL_BLOCK] * (-(-n // b) - 1) + [found]
            n -= a
        return 0, []

    # --- allocation -----------------------------------------------------------------------------

    # Row layout between steps: the state block at index i, ``num_speculative_blocks`` scratch
    # blocks right after it, null everywhere else. Advancing the state to index j > i grows the
    # row to ``j + Sp + 1`` entries (the worker row is append-only): a scratch block already at j
    # becomes the new state, positions below j that are new stay null, and the old state plus
    # the scratch blocks left below j are released after the step (they are read during it).

    def _fresh_needed(self, length: int, new_index: int) -> int:
        return max(new_index + self._spec + 1 - max(length, new_index), 0)

    def blocks_needed(self, request: Request, total_tokens: int, hit_len: int, hit_blocks: list[int]) -> int:
        b = self.block_size
        new_index = -(-total_tokens // b) - 1
        rid = request.request_id
        table = self.tables.get(rid)
        if table is not None:
            if new_index > self._state_index[rid]:
                return self._fresh_needed(len(table), new_index)
            return 1 if self.pool.key_of(table[new_index]) is not None else 0
        cow = 1 if hit_len % b else 0
        return cow + self._fresh_needed(len(hit_blocks), new_index) + self._evictable(hit_blocks)

    def allocate(self, request: Request, total_tokens: int, hit_len: int, hit_blocks: list[int]) -> list[int]:
        rid, b = request.request_id, self.block_size
        new_index = -(-total_tokens // b) - 1
        table = self.tables.get(rid)
        if table is None:
            table = list(hit_blocks)
            index = len(table) - 1
            if hit_len % b:  # the coordinator has touched the hit block
                # The next chunk may write this block index in place: work on a copy.
                src = table[index]
                dst = self._fresh(1)[0]
                self.ledger.add_copy(self.group_id, rid, src, dst)
                self.ledger.retained.append(src)
                table[index] = dst
            self.tables[rid] = table
            self._state_index[rid] = index
            self._advance(rid, table, index, new_index)
            return list(table)
        index = self._state_index[rid]
        if new_index > index:
            start = len(table)
            self._advance(rid, table, index, new_index)
            return table[start:]
        state = table[index]
        if self.pool.key_of(state) is not None:
            # Running owner writes its cached state block in place: copy the cached state out
            # first (at step start, while the block still holds it).
            copy = self._fresh(1)[0]
            self.ledger.add_copy(self.group_id, rid, state, copy)
            self._pending_move[rid] = (state, copy)
        return []

    def _advance(self, rid: str, table: list[int], index: int, new_index: int) -> None:
        """Mutates. Grow the row so the state sits at ``new_index`` with its scratch blocks."""
        length = len(table)
        first_real = max(length, new_index)
        table.extend([NULL_BLOCK] * (first_real - length))
        table.extend(self._fresh(new_index + self._spec + 1 - first_real))
        self._state_index[rid] = new_index
        if new_index > index:
            below = [i for i in range(max(index, 0), min(new_index, length)) if table[i] != NULL_BLOCK]
            if below:
                self._superseded[rid] = below

    # --- after the step -------------------------------------------------------------------------

    def cache(self, request: Request, num_computed: int) -> None:
        rid = request.request_id
        table = self.tables[rid]
        pool = self.pool
        moved = self._pending_move.pop(rid, None)
        if moved is not None:
            state, copy = moved
            pool.move_key(state, copy)
            pool.free([copy])  # the copy is held by the cache only: evictable, hittable
        index = self._state_index[rid]
        # Release the old state and the scratch blocks below the new state: the step ran.
        below = self._superseded.pop(rid, None)
        if below:
            pool.free([table[i] for i in reversed(below)])
            for i in below:
                table[i] = NULL_BLOCK
        n, b, h = num_computed, self.block_size, self.hash_block_size
        expected_index = -(-n // b) - 1
        if expected_index != index:
            raise InvariantViolation(
                "INV-MAMBA-STATE-INDEX",
                f"request {rid!r}, group {self.group_id}: state after {n} tokens must be at index "
                f"{expected_index}, the table's state is at {index}",
            )
        if n % h or n > request.hashed_len or not self.group.prefix_cacheable:
            return
        if n % b and n > request.num_prompt_tokens:
            return  # past the prompt a state mid-block is the running one: not a checkpoint
        if not keeps_state(n, self.retention, num_prompt_tokens=request.num_prompt_tokens,
                           junctions=request.junctions, exact_junction=self.exact_junction):
            return
        block = table[index]
        key = (request.block_hashes[n // h - 1], self.group_id)
        if n % b == 0:
            if pool.key_of(block) != key and pool.cache_full(block, key, n):
                self.ledger.keyed.add(block)
        elif pool.cache_partial(block, key, n, replace=True):
            self.ledger.keyed.add(block)

    def check_real_blocks(self, request: Request) -> None:
        """INV-MAMBA-REAL-BLOCKS: at most two real blocks between steps (plus speculative)."""
        table = self.tables.get(request.request_id, [])
        real = sum(1 for x in table if x != NULL_BLOCK)
        limit = 1 + self.group.num_speculative_blocks
        if real > limit:
            raise InvariantViolation(
                "INV-MAMBA-REAL-BLOCKS",
                f"request {request.request_id!r}, group {self.group_id}: {real} real state blocks between steps > {limit}",
            )

    def free(self, request: Request) -> None:
        rid = request.request_id
        moved = self._pending_move.pop(rid, None)
        if moved is not None:
            self.pool.free([moved[1]])
        self._state_index.pop(rid, None)
        self._superseded.pop(rid, None)
        super().free(request)
