"""What every single-type manager shares: a request's state in one group (``GroupRequest``: its
row and the manager's bookkeeping, one object created on admission and dropped on free), the
step's ledger (copies, hit references, blocks allocated and keyed), and freeing."""

from __future__ import annotations

from typing import Callable, Sequence

from kvproof.impl.block_pool import NULL_BLOCK, BlockPool
from kvproof.impl.key_index import Key
from kvproof.impl.eviction import EvictionValuer
from kvproof.impl.hashing import key_at
from kvproof.impl.request import Request
from kvproof.spec.arith import cdiv_unchecked
from kvproof.spec.contracts import InvariantViolation
from kvproof.spec.layout import GroupLayout


class StepLedger:
    """The state of the current scheduler step, shared by every manager: opened by
    :meth:`open` (the facade's ``begin_step``), which settles the step before it.

    Copies run on every rank at the *start* of the step, before the forward pass, as one
    batch. So a copy source must already hold its tokens when the step begins, and no copy may
    read a block another copy of the same step writes (INV-COW-SOURCE-READY). Blocks allocated
    or keyed during this step are recorded to check exactly that. A copy's source is held by
    the copying request's hit reference (``hit_refs``) until the copy has run: the next
    ``open`` hands those references back to be dropped.
    """

    __slots__ = ("number", "copies", "hit_refs", "allocated", "keyed", "_copy_srcs", "_copy_dsts")

    def __init__(self) -> None:
        self.number = 0  # steps opened so far
        self._clear()

    def _clear(self) -> None:
        self.copies: list[tuple[int, int, int]] = []  # (group_id, src, dst), in order
        self.hit_refs: list[int] = []  # copy sources' hit references, dropped once the step has run
        self.allocated: set[int] = set()  # blocks handed out this step (no contents yet)
        self.keyed: set[int] = set()  # blocks given a key this step
        self._copy_srcs: set[int] = set()
        self._copy_dsts: set[int] = set()

    def open(self) -> list[int]:
        """Mutates. Settle the finished step (its copies must have been taken: they ran) and
        open the next; returns the hit references the finished step's copies held, for the
        caller to drop."""
        if self.copies:
            raise InvariantViolation("INV-STEP-PROTOCOL", f"{len(self.copies)} block copies were never taken")
        refs = self.hit_refs
        self._clear()
        self.number += 1
        return refs

    def take_copies(self) -> list[tuple[int, int, int]]:
        """Mutates. The step's copies ``(group_id, src, dst)`` in order, handed out once."""
        copies, self.copies = self.copies, []
        return copies

    def copy_from_hit(self, group_id: int, request_id: str, src: int, dst: int) -> None:
        """Record a copy whose source is a hit block the request holds only for the copy: its
        reference is dropped once the step has run."""
        self.add_copy(group_id, request_id, src, dst)
        self.hit_refs.append(src)

    def add_copy(self, group_id: int, request_id: str, src: int, dst: int) -> None:
        """Record a copy ``src -> dst`` (INV-COW-SOURCE-READY checked here, O(1))."""
        if src in self.allocated or src in self.keyed or src in self._copy_dsts:
            why = (
                "was allocated this step" if src in self.allocated
                else "was keyed this step, before the forward pass wrote it" if src in self.keyed
                else "is the destination of another copy this step (chained copy)"
            )
            raise InvariantViolation(
                "INV-COW-SOURCE-READY",
                f"request {request_id!r}, group {group_id}: copy {src} -> {dst} reads block {src}, which {why}",
            )
        if dst in self._copy_srcs:
            raise InvariantViolation(
                "INV-COW-SOURCE-READY",
                f"request {request_id!r}, group {group_id}: copy {src} -> {dst} writes block {dst}, "
                "which another copy of this step reads (chained copy)",
            )
        self.copies.append((group_id, src, dst))
        self._copy_srcs.add(src)
        self._copy_dsts.add(dst)


class GroupRequest:
    """A request's state in one group: its ``row`` (one entry per effective block,
    ``NULL_BLOCK`` where nothing is kept; the worker's block-table row for this group) and what
    the group's manager keeps about it (subclasses add their fields). Created when the request
    is admitted, dropped when it is freed."""

    __slots__ = ("row",)

    def __init__(self, row: list[int]) -> None:
        self.row = row


class SingleTypeManager:
    """The admitted requests of one cache group. Subclasses define lookup, sizing and caching.

    ``requests[request_id]`` is the request's state in this group (a :class:`GroupRequest`).
    The coordinator decides whether a request is running: one that is not is admitted
    (``blocks_needed`` / ``allocate``, with its hit); one that is grows (``grow_needed`` /
    ``grow``). Verbs mutate; ``find_hit`` and the ``*_needed`` queries do not.
    """

    #: Tokens below its coverage at which this group's hits end with EAGLE (the draft
    #: recomputes them); attention sets it, the others never drop.
    eagle_unit = 0

    def __init__(
        self,
        group_id: int,
        layout: GroupLayout,
        hash_block_size: int,
        alignment: int,
        pool: BlockPool,
        ledger: StepLedger,
        use_eagle: bool = False,
    ) -> None:
        self.group_id = group_id
        self.group = layout.group
        self.effective_block_size = layout.effective_block_size  # B_g, global tokens per block id
        self.max_blocks = layout.max_num_blocks_per_req
        self.hash_block_size = hash_block_size
        self.alignment = alignment
        self.pool = pool
        self.ledger = ledger
        self.use_eagle = use_eagle
        self.requests: dict[str, GroupRequest] = {}
        #: The compute eviction policy's valuer (set by the coordinator; None under lru).
        self.valuer: EvictionValuer | None = None

    # --- queries --------------------------------------------------------------------------------

    def find_hit(self, request: Request, bound: int) -> tuple[int, list[int]]:
        """Largest N <= ``bound`` (a multiple of the alignment) this group can restore, and the
        blocks that realise it. No state change."""
        raise NotImplementedError

    def blocks_needed(self, request: Request, total_tokens: int, hit_len: int, hit_blocks: list[int]) -> int:
        """Free-queue blocks ``allocate`` would consume for a request without a row: fresh
        blocks plus evictable hit blocks (touching a ref-0 cached block takes it out of the free
        queue). No state change."""
        raise NotImplementedError

    def grow_needed(self, request: Request, total_tokens: int) -> int:
        """Free-queue blocks ``grow`` would take for a request with a row (this default: the
        blocks its row lacks). No state change."""
        return max(self.row_length(total_tokens) - len(self.requests[request.request_id].row), 0)

    def keyed_lengths(self, request: Request, start: int, end: int) -> Sequence[int]:
        """The lengths in ``(start, end]`` at which, once a chunk computing ``[start, end)`` of
        ``request`` has run, this group holds an entry a sharer can hit (attention and sliding
        window: every length on the hit grid, up to what is hashed). No state change."""
        a = self.alignment
        return range((start // a + 1) * a, min(end, request.hashed_len) + 1, a)

    def idle_until(self, request: Request, num_computed: int) -> int:
        """The largest token count T such that, right after ``key`` and ``release`` of
        ``num_computed``, ``allocate`` of any total in ``(num_computed, T]`` takes nothing and
        returns no entries, and ``key`` and ``release`` of any such count change nothing: the
        steps the coordinator may skip this group for (most decode steps). No state change.
        This default skips nothing."""
        return num_computed

    def check_width(self, request: Request, total_tokens: int) -> None:
        """INV-TABLE-WIDTH at the scheduler: the row this allocation needs fits the worker row."""
        need = self.row_length(total_tokens)
        if need > self.max_blocks:
            raise InvariantViolation(
                "INV-TABLE-WIDTH",
                f"request {request.request_id!r}, group {self.group_id} ({self.group.label}): "
                f"{total_tokens} tokens need {need} table entries > row width {self.max_blocks}",
            )

    def row_length(self, total_tokens: int) -> int:
        return cdiv_unchecked(total_tokens, self.effective_block_size)

    @property
    def max_tokens(self) -> int:
        """The most tokens a request may hold before its row exceeds the worker's width."""
        return (self.max_blocks - self.group.num_speculative_blocks) * self.effective_block_size

    def _evictable(self, blocks: list[int]) -> int:
        ref = self.pool.ref_count
        return sum(1 for b in blocks if b != NULL_BLOCK and ref(b) == 0)

    # --- verbs ----------------------------------------------------------------------------------

    def row(self, request_id: str) -> list[int]:
        """The request's row in this group (empty when it is not admitted). No state change."""
        state = self.requests.get(request_id)
        return state.row if state is not None else []

    def allocate(
        self, request: Request, total_tokens: int, hit_len: int, hit_blocks: list[int], junctions: tuple[int, ...],
    ) -> list[int]:
        """Mutates. Admit a request, resuming after its hit of ``hit_len`` tokens on
        ``hit_blocks`` (``junctions``: the hit's, ``Hit.junctions``): its state in this group,
        with a row for ``total_tokens`` tokens; returns the whole row."""
        raise NotImplementedError

    def grow(self, request: Request, total_tokens: int) -> list[int]:
        """Mutates. Extend a running request's row to ``total_tokens`` tokens; returns the
        entries to append to the worker row (this default: fresh blocks at the end)."""
        return self._grow(self.requests[request.request_id].row, total_tokens)

    def key(self, request: Request, num_computed: int) -> None:
        """Mutates. Key what the forward pass just computed (called after the step ran, before
        :meth:`release`; the order: ``HybridCoordinator.cache``)."""
        raise NotImplementedError

    def release(self, request: Request, num_computed: int) -> None:
        """Mutates. Release the blocks the request no longer reads now that the step ran (vLLM's
        ``remove_skipped_blocks``). This default releases nothing: a row that only grows."""

    def free(self, request: Request) -> None:
        """Mutates. Drop the request's references, tail first (its tail is evicted first)."""
        state = self.requests.pop(request.request_id, None)
        table = state.row if state is not None else None
        if table:
            blocks = [b for b in reversed(table) if b != NULL_BLOCK]
            self.pool.free(blocks, None if self.valuer is None else self._release_values(request, table, blocks))

    def _release_values(self, request: Request, table: list[int], blocks: list[int]) -> list[float]:
        """The compute policy's values of ``blocks`` (``table``'s real blocks, tail first) as the
        request releases them: an attention chain's (``EvictionValuer.attention_values``). No state change."""
        return self.valuer.attention_values(request.request_id, request.num_computed_tokens, table, self.effective_block_size)

    def _grow(self, table: list[int], total_tokens: int) -> list[int]:
        """Mutates. Append fresh blocks until ``table`` covers ``total_tokens``; returns them."""
        n = self.row_length(total_tokens) - len(table)
        if n <= 0:
            return []  # most decode steps: the last block still has room
        new = self._fresh(n)
        table.extend(new)
        return new

    def _key_full_blocks(self, request: Request, table: list[int], first: int, last: int, attach: Callable[[int, Key, int], bool]) -> None:
        """Mutates. Give blocks ``first .. last-1`` of ``table`` their full-block keys (the fine
        hash at each block's end) with the pool verb ``attach`` (``cache_full``: the blocks'
        partial keys are retired; ``extend_full``: they stay as prefix keys); null entries are
        skipped."""
        b, h, gid = self.effective_block_size, self.hash_block_size, self.group_id
        hashes, keyed = request.block_hashes, self.ledger.keyed
        for j in range(first, last):
            blk = table[j]
            if blk != NULL_BLOCK and attach(blk, key_at(hashes, (j + 1) * b, h, gid), (j + 1) * b):
                keyed.add(blk)

    def _fresh(self, n: int) -> list[int]:
        blocks = self.pool.allocate(n, self.group_id)
        if blocks is None:
            # The coordinator sized every group before allocating anything, so this is a bug.
            raise InvariantViolation(
                "INV-ALLOC-ATOMIC", f"group {self.group_id}: pool could not supply {n} blocks after sizing said it could"
            )
        self.ledger.allocated.update(blocks)
        return blocks
