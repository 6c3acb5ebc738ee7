"""Mamba / linear attention in ``align`` mode: one recurrent state per request, replicated on
every DCP rank, kept in the block at index ``cdiv(n, B) - 1`` after ``n`` computed tokens."""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from kvproof.impl.block_pool import NULL_BLOCK
from kvproof.impl.hashing import key_at
from kvproof.impl.managers.base import GroupRequest, SingleTypeManager
from kvproof.impl.request import Request
from kvproof.spec.arith import cdiv_unchecked
from kvproof.spec.contracts import InvariantViolation
from kvproof.spec.retention import RetentionRule, keeps_state


class MambaStep:
    """One allocated step of a request, from its ``allocate``/``grow`` until the step has run
    and been settled (``MambaManager.key`` and ``release``):

    * ``end``: the token count after the step (its state is the one after ``end`` tokens);
    * ``opened``: the scheduler step it was allocated in (``StepLedger.number``);
    * ``move``: (the cached state block it writes in place, the copy the key moves to);
    * ``copy``: the copy it takes of the previous step's end state, which it overwrites in place
      while that state's key is still to come (async scheduling: the previous step had not
      returned when this one was allocated); the key goes to the copy. 0 if none;
    * ``superseded``: the row index of the old state it reads (released once it has run; -1 if
      none).
    """

    __slots__ = ("end", "opened", "move", "copy", "superseded")

    def __init__(self, end: int, opened: int) -> None:
        self.end = end
        self.opened = opened
        self.move: Optional[tuple[int, int]] = None
        self.copy = 0
        self.superseded = -1

    def copies(self) -> list[int]:
        """The blocks it copied a state into (held for a key only, never in the row)."""
        out = [self.move[1]] if self.move is not None else []
        if self.copy:
            out.append(self.copy)
        return out


class MambaRequest(GroupRequest):
    """A request in a Mamba group: its row and

    * ``state_index``: the row index of the block holding its state (>= 0 once ``allocate``
      returns: a request computes a token);
    * ``junctions``: its admission hit's (``Hit.junctions``), where retention keeps states;
    * ``checked_below``: the row index below which every entry was checked to be the null
      block (entries below the state are never made real again), so INV-MAMBA-REAL-BLOCKS
      costs O(entries the state passed since the last check);
    * ``released``: compute policy only, the cached states it released while running (block,
      key), requeued when it ends so they are not evicted before the attention chain they
      complete;
    * ``steps``: its allocated steps not settled yet, oldest first (``MambaStep``): one during a
      step; with async scheduling also the one in flight while the next is allocated;
      ``settling``: those ``key`` settled, for ``release``; ``settled``: the token count the
      last settled step ended on (the admission hit's until one has).
    """

    __slots__ = ("state_index", "junctions", "checked_below", "released", "steps", "settling", "settled")

    def __init__(self, row: list[int], state_index: int, junctions: tuple[int, ...], settled: int) -> None:
        super().__init__(row)
        self.state_index = state_index
        self.junctions = junctions
        self.checked_below = -1  # not checked yet
        self.released: list[tuple[int, object]] = []
        self.steps: list[MambaStep] = []
        self.settling: list[MambaStep] = []
        self.settled = settled


class MambaManager(SingleTypeManager):
    """A state summarises exactly one prefix length, so a hit needs a state at exactly N.

    The forward pass of a chunk ``[c, c + k)`` reads the state block of ``c`` and writes the
    one of ``c + k``. When both indices are equal the write is in place; if the state at ``c``
    is cached, the owner first copies it away (copy-on-write for the running owner) and the
    key moves to the copy once the step has run. A hit at N not on a block boundary is copied
    for the new request too (the next chunk may land in the same block index). Older state
    blocks are released after the step that last read them, so a request holds at most two
    real blocks (INV-MAMBA-REAL-BLOCKS), one more per step of it in flight. States are keyed where
    chunks end on a hash boundary and the retention policy keeps them (``kvproof.spec.retention``):
    block-aligned ones as full-block keys, others (inside the prompt only) as partial keys.

    Keys follow the forward pass, so with async scheduling (a request's next step is allocated
    before its previous one has returned) a state is keyed after the next step was allocated. If
    that next step writes the state's block in place, it copies the state out first (its copies
    run after the previous step's forward pass and before its own), and the key goes to the copy:
    the state is never keyed on a block a later step is overwriting.
    """

    def __init__(
        self, *args, retention_interval: int | None, scheduler_block_size: int, exact_junction: bool,
        rungs: tuple[int, int] = (0, 0), **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        #: Mode 'none': one state block for the whole request, never keyed.
        self._one_state = not self.group.prefix_cacheable
        self._num_speculative = self.group.num_speculative_blocks
        self.retention = RetentionRule(
            retention_interval, self.effective_block_size, self.hash_block_size, self.alignment,
            scheduler_block_size, eagle=self.use_eagle, rungs=rungs[0], rung_unit=rungs[1],
        )
        self.exact_junction = exact_junction
        self._real_limit = 1 + self.group.num_speculative_blocks
        self.requests: dict[str, MambaRequest] = {}

    def row_length(self, total_tokens: int) -> int:
        return self._state_index_after(total_tokens) + 1 + self._num_speculative

    @property
    def max_tokens(self) -> int:
        return sys.maxsize if self._one_state else super().max_tokens

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
        last token; -1 before the first): in mode 'none' always the first."""
        if self._one_state:
            return 0 if num_tokens else -1
        return cdiv_unchecked(num_tokens, self.effective_block_size) - 1

    def _fresh_needed(self, table: list[int], index: int, new_index: int) -> int:
        placed = max(new_index + self._num_speculative + 1 - max(len(table), new_index), 0)
        return max(placed - len(self._relocatable(table, index, new_index)), 0)

    @staticmethod
    def _relocatable(table: list[int], index: int, new_index: int) -> list[int]:
        """Row positions of the scratch blocks that fall below a state advancing to ``new_index``."""
        return [i for i in range(index + 1, min(new_index, len(table))) if table[i] != NULL_BLOCK]

    def blocks_needed(self, request: Request, total_tokens: int, hit_len: int, hit_blocks: list[int]) -> int:
        new_index = self._state_index_after(total_tokens)
        cow = 1 if hit_len % self.effective_block_size else 0
        return cow + self._fresh_needed(hit_blocks, len(hit_blocks) - 1, new_index) + self._evictable(hit_blocks)

    def grow_needed(self, request: Request, total_tokens: int) -> int:
        state = self.requests[request.request_id]
        table, index = state.row, state.state_index
        new_index = self._state_index_after(total_tokens)
        if new_index > index:
            return self._fresh_needed(table, index, new_index)
        return 1 if self.pool.key_of(table[new_index]) is not None or self._keyed_later(request, state) else 0

    def _keyed_later(self, request: Request, state: MambaRequest) -> bool:
        """Whether the state in the request's state block is one a step in flight ends on and
        retention will key once that step has returned (async scheduling; an allocation earlier
        in this same step is not one: its state is never written). No state change."""
        steps = state.steps
        return (bool(steps) and steps[-1].opened != self.ledger.number
                and self._keeps(request, state.junctions, steps[-1].end))

    def allocate(
        self, request: Request, total_tokens: int, hit_len: int, hit_blocks: list[int], junctions: tuple[int, ...],
    ) -> list[int]:
        rid = request.request_id
        table = list(hit_blocks)
        index = len(table) - 1
        if hit_len % self.effective_block_size:  # the coordinator has touched the hit block
            # The next chunk may write this block index in place: work on a copy.
            src = table[index]
            [dst] = self._fresh(1)
            self.ledger.copy_from_hit(self.group_id, rid, src, dst)
            table[index] = dst
        state = self.requests[rid] = MambaRequest(table, index, junctions, hit_len)
        step = MambaStep(total_tokens, self.ledger.number)
        self._advance(state, self._state_index_after(total_tokens), step)
        state.steps.append(step)
        return list(table)

    def grow(self, request: Request, total_tokens: int) -> list[int]:
        state = self.requests[request.request_id]
        table = state.row
        new_index = self._state_index_after(total_tokens)
        step = MambaStep(total_tokens, self.ledger.number)
        if new_index > state.state_index:
            start = len(table)
            self._advance(state, new_index, step)
            state.steps.append(step)
            return table[start:]
        block = table[state.state_index]
        if self.pool.key_of(block) is not None:
            # Running owner writes its cached state block in place: copy the cached state out
            # first (at step start, while the block still holds it).
            [copy] = self._fresh(1)
            self.ledger.add_copy(self.group_id, request.request_id, block, copy)
            step.move = (block, copy)
        elif self._keyed_later(request, state):
            # The step in flight ends on a kept state that this step overwrites: copy it out
            # first (the copy runs after that step), and the key goes to the copy.
            [copy] = self._fresh(1)
            self.ledger.add_copy(self.group_id, request.request_id, block, copy)
            step.copy = copy
        state.steps.append(step)
        return []

    def _advance(self, state: MambaRequest, new_index: int, step: MambaStep) -> None:
        """Mutates. Grow the row so the state sits at ``new_index`` with its scratch blocks,
        moving scratch blocks that fall below it into the new positions; ``step`` supersedes
        the old state."""
        table, index = state.row, state.state_index
        length = len(table)
        first_real = max(length, new_index)
        moved = []
        for i in self._relocatable(table, index, new_index):
            moved.append(table[i])
            table[i] = NULL_BLOCK
        placed = new_index + self._num_speculative + 1 - first_real
        table.extend([NULL_BLOCK] * (first_real - length))
        table.extend(moved + self._fresh(placed - len(moved)))  # placed >= len(moved): see _relocatable
        state.state_index = new_index
        if 0 <= index < new_index and table[index] != NULL_BLOCK:
            step.superseded = index

    # --- after the step -------------------------------------------------------------------------

    def key(self, request: Request, num_computed: int) -> None:
        """Settle the steps that have run (those ending at or before ``num_computed``): a cached
        state block's key moves to its copy first (the running request goes on writing the
        block). Then, if a step ended at ``num_computed`` and retention keeps that state, it is
        keyed: on the block the step left it in or, when a later step already allocated (async
        scheduling) writes that block in place, on the later step's copy of it."""
        rid = request.request_id
        state = self.requests[rid]
        pool = self.pool
        n, b, h = num_computed, self.effective_block_size, self.hash_block_size
        steps = state.steps
        ran = None
        while steps and steps[0].end <= n:
            ran = steps.pop(0)
            if ran.move is not None:
                pool.move_key(*ran.move)
            state.settling.append(ran)
        if ran is None:
            if n != state.settled:
                raise InvariantViolation(
                    "INV-MAMBA-STATE-INDEX",
                    f"request {rid!r}, group {self.group_id}: no step ended after {n} tokens (the last that ran "
                    f"ended at {state.settled}, the next ends at {steps[0].end if steps else 'none'})",
                )
            return  # nothing ran since the last keying
        state.settled = ran.end
        index = self._state_index_after(n)
        if ran.end != n:
            raise InvariantViolation(
                "INV-MAMBA-STATE-INDEX",
                f"request {rid!r}, group {self.group_id}: state after {n} tokens must be at index {index}, "
                f"the last step that ran ended at {ran.end} (index {self._state_index_after(ran.end)})",
            )
        if not self._keeps(request, state.junctions, n):
            return
        block = state.row[index]
        if steps and self._state_index_after(steps[0].end) == index:
            block = steps[0].copy  # a later step writes the block in place; 0: it took no copy
            if not block:
                return
        key = key_at(request.block_hashes, n, h, self.group_id)
        if n % b == 0:
            if pool.key_of(block) != key and pool.cache_full(block, key, n):
                self.ledger.keyed.add(block)
        elif pool.replace_key(block, key, n):
            self.ledger.keyed.add(block)
        if self.valuer is not None and pool.key_of(block) == key:
            self.valuer.note_state(rid, self.group_id, n)

    def release(self, request: Request, num_computed: int) -> None:
        """For each step settled: the copy that took a key, and the old state the step read."""
        rid = request.request_id
        state = self.requests[rid]
        table = state.row
        pool = self.pool
        for step in state.settling:
            for copy in step.copies():  # held by the cache only: evictable, hittable
                pool.free([copy], self._values(rid, [copy]))
                if self.valuer is not None:
                    state.released.append((copy, pool.key_of(copy)))
            below = step.superseded
            if below >= 0:
                old = table[below]
                pool.free([old], self._values(rid, [old]))
                if self.valuer is not None and pool.key_of(old) is not None:
                    state.released.append((old, pool.key_of(old)))
                table[below] = NULL_BLOCK
        state.settling.clear()
        index = state.state_index
        if state.checked_below != index or len(table) - index > self._real_limit:
            self.check_real_blocks(request)  # INV-MAMBA-REAL-BLOCKS, skipped when nothing moved

    def idle_until(self, request: Request, num_computed: int) -> int:
        """Until the state leaves its block or reaches a hash boundary (where ``_keeps`` may
        key it); never while the state block is cached (the next step writes it in place and
        must copy it first). Asked after ``release``, so no copy or release of a step that has
        run is pending. With a step in flight (async scheduling) the range is as safe: a state
        that step ends on is keyed only on a hash boundary, past the range, so every step after
        it is allocated, and copies it if it writes its block in place."""
        state = self.requests[request.request_id]
        index = state.state_index
        if self.pool.key_of(state.row[index]) is not None:
            return num_computed
        if self._one_state:
            return sys.maxsize  # the state never leaves its block and is never keyed
        until = (index + 1) * self.effective_block_size
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

    def _keeps(self, request: Request, junctions: tuple[int, ...], n: int) -> bool:
        """Whether the state after ``n`` computed tokens is keyed (retention, ``spec.retention``);
        only ever on a hash boundary (``idle_until`` relies on it)."""
        if n % self.hash_block_size or n > request.hashed_len or self._one_state:
            return False
        if n % self.effective_block_size and n > request.num_prompt_tokens:
            return False  # past the prompt a state mid-block is the running one: not a checkpoint
        return keeps_state(n, self.retention, num_prompt_tokens=request.num_prompt_tokens,
                           junctions=junctions, exact_junction=self.exact_junction)

    def keyed_lengths(self, request: Request, start: int, end: int) -> Sequence[int]:
        """Only the state the chunk ends on, if it is kept (by an admitted request's junctions;
        one that is not admitted has none yet)."""
        if end > start and end % self.alignment == 0:
            state = self.requests.get(request.request_id)
            return (end,) if self._keeps(request, state.junctions if state is not None else (), end) else ()
        return ()

    def check_real_blocks(self, request: Request) -> None:
        """INV-MAMBA-REAL-BLOCKS: a request holds at most ``1 + speculative`` real blocks (its
        state and the scratch blocks after it), plus, per allocated step not settled yet that
        moved the state to a new block, the old state that step reads. Cheap (amortised O(1)
        per step): the entries below the lowest of those already checked are not read again."""
        self._check_row(request.request_id)

    def check_rows(self) -> None:
        """INV-MAMBA-REAL-BLOCKS for every row (whole-state check)."""
        for rid in self.requests:
            self._check_row(rid)

    def _check_row(self, rid: str) -> None:
        state = self.requests.get(rid)
        if state is None or not state.row:
            return
        table = state.row
        index = max(state.state_index, 0)
        low = max(state.checked_below, 0)
        read = [s.superseded for s in state.steps if s.superseded >= 0]  # old states a step still reads
        limit = self._real_limit + len(read)
        stray = [i for i in range(low, min(index, len(table))) if table[i] != NULL_BLOCK]
        real = len(stray) + sum(1 for x in table[index:] if x != NULL_BLOCK)
        if real > limit:
            when = f"with {len(state.steps)} steps not settled" if state.steps else "between steps"
            where = f" (kept below the state at row index {index}: {stray})" if stray else ""
            raise InvariantViolation(
                "INV-MAMBA-REAL-BLOCKS",
                f"request {rid!r}, group {self.group_id}: {real} real state blocks {when} > {limit}{where}",
            )
        state.checked_below = max(min([index, *read]), low)

    def free(self, request: Request) -> None:
        rid = request.request_id
        state = self.requests.get(rid)
        if state is not None:
            # Copies taken by steps not settled (a preempted or finished request's last steps)
            # are not in the row.
            copies = [c for step in state.steps for c in step.copies()]
            if copies:
                self.pool.free(copies, self._values(rid, copies))
            if state.released:  # still the states this request cached (not evicted and reused since)
                mine = [b for b, k in state.released if self.pool.key_of(b) == k]
                self.pool.requeue(mine, self._values(rid, mine))
        super().free(request)
