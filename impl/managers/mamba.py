"""Mamba / linear attention in ``align`` mode: one recurrent state per request, replicated on
every DCP rank, kept in the block at index ``cdiv(n, B) - 1`` after ``n`` computed tokens."""

from __future__ import annotations

from typing import Sequence

from kvproof.impl.block_pool import NULL_BLOCK
from kvproof.impl.hashing import key_at
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
        self, *args, retention_interval: int | None, scheduler_block_size: int, exact_junction: bool, **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        if not self.group.prefix_cacheable:
            # Mode 'none': one state block for the whole request, never keyed.
            self.block_size = 1 << 62
        self._spec = self.group.num_speculative_blocks
        self.retention = RetentionRule(
            retention_interval, self.block_size, self.hash_block_size, self.alignment,
            scheduler_block_size, eagle=self.use_eagle,
        )
        self.exact_junction = exact_junction
        # request id -> state block index (>= 0 once ``allocate`` returns: a request computes a token)
        self._state_index: dict[str, int] = {}
        # request id -> (cached state block, its copy): key moves once the step has run
        self._pending_move: dict[str, tuple[int, int]] = {}
        # request id -> row index of the old state, which the running step still reads;
        # released once it has run
        self._superseded: dict[str, list[int]] = {}
        # request id -> row index below which every entry was checked to be the null block
        # (entries below the state are never made real again), so INV-MAMBA-REAL-BLOCKS costs
        # O(entries the request's state passed since the last check)
        self._checked_below: dict[str, int] = {}
        self._real_limit = 1 + self.group.num_speculative_blocks
        #: Compute policy: cached states a running request released (block, key), requeued when
        #: it ends so they are not evicted before the attention chain they complete.
        self._released: dict[str, list[tuple[int, object]]] = {}

    def row_length(self, total_tokens: int) -> int:
        return -(-total_tokens // self.block_size) + self._spec

    # --- lookup ---------------------------------------------------------------------------------

    def find_hit(self, request: Request, bound: int) -> tuple[int, list[int]]:
        a, h = self.alignment, self.hash_block_size
        hashes, group, lookup = request.block_hashes, self.group_id, self.pool.lookup
        n = min(bound, len(hashes) * h)
        n -= n % a
        while n > 0:
            found = lookup(key_at(hashes, n, h, group))
            if found is not None:
                return n, [NULL_BLOCK] * self._state_index_after(n) + [found]
            n -= a
        return 0, []

    # --- allocation -----------------------------------------------------------------------------

    # Row layout between steps: the state block at index i, ``num_speculative_blocks`` scratch
    # blocks right after it, null everywhere else. Advancing the state to index j > i grows the
    # row to ``j + Sp + 1`` entries (the worker row is append-only): a scratch block already at j
    # becomes the new state, scratch blocks left below j move up to fill the new positions (they
    # hold nothing the step reads), new positions below j stay null, and the old state is
    # released after the step (it is read during it). So a request holds at most 2 + Sp real
    # blocks during a step, as in vLLM (its speculative blocks are relocated the same way).

    def _state_index_after(self, num_tokens: int) -> int:
        """The row index of the block holding the state after ``num_tokens`` tokens (that of the
        last token)."""
        return -(-num_tokens // self.block_size) - 1

    def _fresh_needed(self, table: list[int], index: int, new_index: int) -> int:
        placed = max(new_index + self._spec + 1 - max(len(table), new_index), 0)
        return max(placed - len(self._relocatable(table, index, new_index)), 0)

    @staticmethod
    def _relocatable(table: list[int], index: int, new_index: int) -> list[int]:
        """Row positions of the scratch blocks that fall below a state advancing to ``new_index``."""
        return [i for i in range(index + 1, min(new_index, len(table))) if table[i] != NULL_BLOCK]

    def blocks_needed(self, request: Request, total_tokens: int, hit_len: int, hit_blocks: list[int]) -> int:
        new_index = self._state_index_after(total_tokens)
        cow = 1 if hit_len % self.block_size else 0
        return cow + self._fresh_needed(hit_blocks, len(hit_blocks) - 1, new_index) + self._evictable(hit_blocks)

    def grow_needed(self, request: Request, total_tokens: int) -> int:
        rid = request.request_id
        table, index = self.tables[rid], self._state_index[rid]
        new_index = self._state_index_after(total_tokens)
        if new_index > index:
            return self._fresh_needed(table, index, new_index)
        return 1 if self.pool.key_of(table[new_index]) is not None else 0

    def allocate(self, request: Request, total_tokens: int, hit_len: int, hit_blocks: list[int]) -> list[int]:
        rid = request.request_id
        table = list(hit_blocks)
        index = len(table) - 1
        if hit_len % self.block_size:  # the coordinator has touched the hit block
            # The next chunk may write this block index in place: work on a copy.
            src = table[index]
            [dst] = self._fresh(1)
            self.ledger.add_copy(self.group_id, rid, src, dst)
            self.ledger.retained.append(src)
            table[index] = dst
        self.tables[rid] = table
        self._state_index[rid] = index
        self._advance(rid, table, index, self._state_index_after(total_tokens))
        return list(table)

    def grow(self, request: Request, total_tokens: int) -> list[int]:
        rid = request.request_id
        table, index = self.tables[rid], self._state_index[rid]
        new_index = self._state_index_after(total_tokens)
        if new_index > index:
            start = len(table)
            self._advance(rid, table, index, new_index)
            return table[start:]
        state = table[index]
        if self.pool.key_of(state) is not None:
            # Running owner writes its cached state block in place: copy the cached state out
            # first (at step start, while the block still holds it).
            [copy] = self._fresh(1)
            self.ledger.add_copy(self.group_id, rid, state, copy)
            self._pending_move[rid] = (state, copy)
        return []

    def _advance(self, rid: str, table: list[int], index: int, new_index: int) -> None:
        """Mutates. Grow the row so the state sits at ``new_index`` with its scratch blocks,
        moving scratch blocks that fall below it into the new positions."""
        length = len(table)
        first_real = max(length, new_index)
        moved = []
        for i in self._relocatable(table, index, new_index):
            moved.append(table[i])
            table[i] = NULL_BLOCK
        placed = new_index + self._spec + 1 - first_real
        table.extend([NULL_BLOCK] * (first_real - length))
        table.extend(moved + self._fresh(placed - len(moved)))  # placed >= len(moved): see _relocatable
        self._state_index[rid] = new_index
        if 0 <= index < new_index and table[index] != NULL_BLOCK:
            self._superseded[rid] = [index]

    # --- after the step -------------------------------------------------------------------------

    def cache(self, request: Request, num_computed: int) -> None:
        rid = request.request_id
        table = self.tables[rid]
        pool = self.pool
        moved = self._pending_move.pop(rid, None)
        if moved is not None:
            state, copy = moved
            pool.move_key(state, copy)
            pool.free([copy], self._values(rid, [copy]))  # the copy is held by the cache only: evictable, hittable
            if self.valuer is not None:
                self._released.setdefault(rid, []).append((copy, pool.key_of(copy)))
        index = self._state_index[rid]
        # Release the old state: the step that read it ran.
        below = self._superseded.pop(rid, None)
        if below:
            released = [table[i] for i in reversed(below)]
            pool.free(released, self._values(rid, released))
            if self.valuer is not None:
                self._released.setdefault(rid, []).extend((x, pool.key_of(x)) for x in released if pool.key_of(x) is not None)
            for i in below:
                table[i] = NULL_BLOCK
        n, b, h = num_computed, self.block_size, self.hash_block_size
        expected_index = self._state_index_after(n)
        if expected_index != index:
            raise InvariantViolation(
                "INV-MAMBA-STATE-INDEX",
                f"request {rid!r}, group {self.group_id}: state after {n} tokens must be at index "
                f"{expected_index}, the table's state is at {index}",
            )
        if self._checked_below.get(rid) != index or len(table) - index > self._real_limit:
            self.check_real_blocks(request)  # INV-MAMBA-REAL-BLOCKS, skipped when nothing moved
        if not self._keeps(request, n):
            return
        block = table[index]
        key = key_at(request.block_hashes, n, h, self.group_id)
        if n % b == 0:
            if pool.key_of(block) != key and pool.cache_full(block, key, n):
                self.ledger.keyed.add(block)
        elif pool.cache_partial(block, key, n, replace=True):
            self.ledger.keyed.add(block)
        if self.valuer is not None and pool.key_of(block) == key:
            self.valuer.note_state(rid, self.group_id, n)

    def idle_until(self, request: Request, num_computed: int) -> int:
        """Until the state leaves its block or reaches a hash boundary (where ``_keeps`` may
        key it); never while the state block is cached (the next step writes it in place and
        must copy it first) or a copy or a release is pending."""
        rid = request.request_id
        if rid in self._pending_move or rid in self._superseded:
            return num_computed
        index = self._state_index[rid]
        if self.pool.key_of(self.tables[rid][index]) is not None:
            return num_computed
        until = (index + 1) * self.block_size
        if self.group.prefix_cacheable:
            h = self.hash_block_size
            until = min(until, num_computed - num_computed % h + h - 1)
        return until

    def _values(self, request_id: str, blocks: list[int]) -> list[float] | None:
        """The compute policy's values of this request's state blocks (None under lru): a cached
        state is worth what it saves over where the request resumed; an uncached block nothing.
        No state change."""
        if self.valuer is None:
            return None
        ntok = self.pool.num_tokens_of
        return [self.valuer.state_value(request_id, ntok(b)) if ntok(b) else 0.0 for b in blocks]

    def _release_values(self, request: Request, table: list[int], blocks: list[int]) -> list[float]:
        return self._values(request.request_id, blocks)

    def _keeps(self, request: Request, n: int) -> bool:
        """Whether the state after ``n`` computed tokens is keyed (retention, ``spec.retention``);
        only ever on a hash boundary (``idle_until`` relies on it)."""
        if n % self.hash_block_size or n > request.hashed_len or not self.group.prefix_cacheable:
            return False
        if n % self.block_size and n > request.num_prompt_tokens:
            return False  # past the prompt a state mid-block is the running one: not a checkpoint
        return keeps_state(n, self.retention, num_prompt_tokens=request.num_prompt_tokens,
                           junctions=request.junctions, exact_junction=self.exact_junction)

    def keyed_lengths(self, request: Request, start: int, end: int) -> Sequence[int]:
        """Only the state the chunk ends on, if it is kept."""
        return (end,) if end > start and end % self.alignment == 0 and self._keeps(request, end) else ()

    def check_real_blocks(self, request: Request) -> None:
        """INV-MAMBA-REAL-BLOCKS: between steps a request holds at most ``1 + speculative`` real
        blocks: its state and the scratch blocks after it. Cheap (amortised O(1) per step): the
        entries below the state already checked are not read again."""
        self._check_row(request.request_id, during_step=False)

    def check_rows(self, in_flight: set[str]) -> None:
        """INV-MAMBA-REAL-BLOCKS for every row (whole-state check): a request allocated this
        step and not yet cached may also hold the old state its step reads (``2 + speculative``)."""
        for rid in self.tables:
            self._check_row(rid, during_step=rid in in_flight)

    def _check_row(self, rid: str, during_step: bool) -> None:
        table = self.tables.get(rid)
        if not table:
            return
        index = max(self._state_index[rid], 0)
        low = self._checked_below.get(rid, 0)
        limit = self._real_limit + during_step
        stray = [i for i in range(low, min(index, len(table))) if table[i] != NULL_BLOCK]
        real = len(stray) + sum(1 for x in table[index:] if x != NULL_BLOCK)
        if real > limit:
            when = "during its step" if during_step else "between steps"
            where = f" (kept below the state at row index {index}: {stray})" if stray else ""
            raise InvariantViolation(
                "INV-MAMBA-REAL-BLOCKS",
                f"request {rid!r}, group {self.group_id}: {real} real state blocks {when} > {limit}{where}",
            )
        if not during_step:  # the old state below the index is still real during the step
            self._checked_below[rid] = max(index, low)

    def free(self, request: Request) -> None:
        rid = request.request_id
        moved = self._pending_move.pop(rid, None)
        if moved is not None:
            self.pool.free([moved[1]], self._values(rid, [moved[1]]))
        self._state_index.pop(rid, None)
        self._superseded.pop(rid, None)
        self._checked_below.pop(rid, None)
        released = self._released.pop(rid, None)
        if released:  # still the states this request cached (not evicted and reused since)
            mine = [b for b, k in released if self.pool.key_of(b) == k]
            self.pool.requeue(mine, self._values(rid, mine))
        super().free(request)
