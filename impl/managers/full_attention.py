"""Full attention and MLA: append-only KV, sharded under DCP (one block id covers
``block_size * dcp`` global positions)."""

from __future__ import annotations

from kvproof.impl.hashing import key_at
from kvproof.impl.managers.base import GroupRequest, SingleTypeManager
from kvproof.impl.request import Request
from kvproof.spec.arith import cdiv_unchecked
from kvproof.spec.contracts import InvariantViolation
from kvproof.spec.layout import eagle_unit



class AttentionRequest(GroupRequest):
    """A request in an attention group: its row, and how far it is keyed (``full_keyed``: the
    leading blocks that have their full-block keys; ``partial_keyed``: the last hash boundary
    given a partial key, 0 if none; ``pending_tail``: under ``prompt-tail``, the prompt tail
    inside a block while it waits for its key, 0 if none)."""

    __slots__ = ("full_keyed", "partial_keyed", "pending_tail")

    def __init__(self, row: list[int], full_keyed: int, partial_keyed: int, pending_tail: int = 0) -> None:
        super().__init__(row)
        self.full_keyed = full_keyed
        self.partial_keyed = partial_keyed
        self.pending_tail = pending_tail


class FullAttentionManager(SingleTypeManager):
    """Hits are downward closed: a block holding a longer prefix also holds every shorter one,
    so a hit may end inside a block (at a hash boundary) by copying that block (copy-on-write:
    the owner keeps appending to it).

    Caching: the full-block key once the block is complete and, with partial hits on, keys
    inside the block -- at every hash boundary the forward pass wrote (``attention_keys``
    ``every-hash``, INV-KEYS-EVERY-HASH), only at each step's last computed hash boundary
    (``chunk-ends``), or only at the request's prompt tail (``prompt-tail``, vLLM 0.33.0's
    ``_cache_partial_tail_block``: ``prompt - 1`` floored to H, ``prompt`` with EAGLE, once
    computed; vLLM re-attaches it on every call, so it outlives the block's growth as an alias,
    which a prefix key is here). The KV is append-only, so the block keeps its earlier keys as
    prefix keys (the pool's extending verbs, ``extend_full``, ``extend_partial``, ``grow_keys``):
    a request that diverges inside the block still finds the longest prefix it shares that has a
    key. They leave with the block (eviction drops them all).
    """

    def __init__(self, *args, attention_keys: str = "every-hash", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        b, h, a = self.effective_block_size, self.hash_block_size, self.alignment
        #: Probe partial entries only if hits may land inside a block.
        self._probe_partial = a < b
        #: Key every hash boundary written (else only chunk ends); moot without partial hits.
        self._every_hash = self._probe_partial and attention_keys == "every-hash"
        #: Key only the prompt tail inside a block (vLLM's rule), not each chunk's last boundary.
        self._tail_only = self._probe_partial and attention_keys == "prompt-tail"
        #: EAGLE: the draft recomputes one hash unit (one block when hits are block-aligned).
        self.eagle_unit = eagle_unit(b, h, a) if self.use_eagle else 0
        self.requests: dict[str, AttentionRequest] = {}

    # --- lookup ---------------------------------------------------------------------------------

    def find_hit(self, request: Request, bound: int) -> tuple[int, list[int]]:
        b, h, a = self.effective_block_size, self.hash_block_size, self.alignment
        hashes, group = request.block_hashes, self.group_id
        hashed = len(hashes) * h
        target = min(bound + self.eagle_unit, hashed)
        lookup = self.pool.lookup
        blocks: list[int] = []
        # Whole blocks: their keys are the fine hash at each block end.
        for j in range(target // b):
            found = lookup(key_at(hashes, (j + 1) * b, h, group))
            if found is None:
                break
            blocks.append(found)
        covered = len(blocks) * b
        if covered < target:
            # The block holding ``target``: its longest key (full, or partial at a hash
            # boundary) covers the block up to that key's length, capped at the target.
            top = min(covered + b, hashed)
            lowest = covered + h if self._probe_partial else top
            n = top
            while n >= lowest:
                found = lookup(key_at(hashes, n, h, group))
                if found is not None:
                    blocks.append(found)
                    covered = min(n, target)
                    break
                n -= h
        hit = covered - self.eagle_unit if covered >= self.eagle_unit else 0
        hit = min(hit, bound)
        hit -= hit % a
        return hit, blocks[: cdiv_unchecked(hit, b)]

    def keyed_lengths(self, request: Request, start: int, end: int):
        """Every length on the hit grid with every-hash keys (and with hits on whole blocks);
        with chunk-end keys only the block ends and the chunk's last hash boundary. No state
        change."""
        grid = super().keyed_lengths(request, start, end)
        if self._every_hash or not self._probe_partial:
            return grid
        b, h = self.effective_block_size, self.hash_block_size
        last = self._prompt_tail(request) if self._tail_only else min(end, request.hashed_len)
        last -= last % h
        return [n for n in grid if n % b == 0 or n == last]

    def _prompt_tail(self, request: Request) -> int:
        """The one hash boundary inside a block that vLLM keys for ``request``: its prompt less
        one token (EAGLE reads the whole prompt), floored to H and to what is hashed. No state
        change."""
        h = self.hash_block_size
        limit = request.num_prompt_tokens if self.use_eagle else request.num_prompt_tokens - 1
        return min(limit // h, len(request.block_hashes)) * h

    # --- allocation -----------------------------------------------------------------------------

    def blocks_needed(self, request: Request, total_tokens: int, hit_len: int, hit_blocks: list[int]) -> int:
        cow = 1 if hit_len % self.effective_block_size else 0
        return max(self.row_length(total_tokens) - len(hit_blocks), 0) + cow + self._evictable(hit_blocks)

    def allocate(
        self, request: Request, total_tokens: int, hit_len: int, hit_blocks: list[int], junctions: tuple[int, ...],
    ) -> list[int]:
        rid = request.request_id
        table = list(hit_blocks)  # the coordinator has touched them
        if hit_len % self.effective_block_size:
            # Copy-on-write: the source's owner keeps appending to it; we take a copy of its
            # first ``hit_len % B`` positions (on every rank's shard) and append to that.
            src = table[-1]
            [dst] = self._fresh(1)
            self.ledger.copy_from_hit(self.group_id, rid, src, dst)  # our hit reference, dropped after the copy ran
            table[-1] = dst
        # Every-hash keying starts after the hit: the boundaries below it already have keys (on
        # the hit's blocks), and the copy-on-write block's would only duplicate them.
        partial = hit_len if self._every_hash else 0
        # As vLLM, the tail is keyed on the request's own block there, also where the hit
        # reaches it: a copy-on-write block then holds the key beside the hit's source.
        tail = self._prompt_tail(request) if self._tail_only else 0
        if tail % self.effective_block_size == 0:
            tail = 0  # a block end: its full key
        self.requests[rid] = AttentionRequest(table, hit_len // self.effective_block_size, partial, tail)
        self._grow(table, total_tokens)
        return list(table)

    # --- caching --------------------------------------------------------------------------------

    def key(self, request: Request, num_computed: int) -> None:
        state = self.requests[request.request_id]
        table = state.row
        b, h = self.effective_block_size, self.hash_block_size
        hashes = request.block_hashes
        limit = min(num_computed, len(hashes) * h)
        if limit < self._next_key(state):
            return  # nothing new to key (most decode steps)
        full_done, partial_done = state.full_keyed, state.partial_keyed
        full = limit // b
        boundary = limit - limit % h
        if self._tail_only:
            # The pending prompt tail (allocate set it), keyed once computed and before its
            # block's full key, which keeps it as a prefix key (vLLM re-attaches it as an alias).
            tail = state.pending_tail
            if tail and tail <= limit:
                if self.pool.extend_partial(table[tail // b], key_at(hashes, tail, h, self.group_id), tail):
                    self.ledger.keyed.add(table[tail // b])
                state.pending_tail = 0
            self._key_full_blocks(request, table, full_done, full, self.pool.extend_full)
            state.full_keyed = max(full, full_done)
            return
        if self._every_hash:
            self._key_every_hash(table, hashes, partial_done, boundary)
            state.full_keyed, state.partial_keyed = max(full, full_done), boundary
            return
        self._key_full_blocks(request, table, full_done, full, self.pool.extend_full)
        if self._probe_partial and boundary % b and boundary > partial_done:
            blk = table[boundary // b]
            if self.pool.extend_partial(blk, key_at(hashes, boundary, h, self.group_id), boundary):
                self.ledger.keyed.add(blk)
            partial_done = boundary
        state.full_keyed, state.partial_keyed = max(full, full_done), partial_done

    def _next_key(self, state: AttentionRequest) -> int:
        """The least hashed length at which ``key`` has something new to key for this
        request: the end of the first block without its full key or, with partial hits, the
        hash boundary after the last one keyed (under ``prompt-tail``, the pending tail). No
        state change."""
        nxt = (state.full_keyed + 1) * self.effective_block_size
        if self._tail_only:
            if state.pending_tail:
                nxt = min(nxt, state.pending_tail)
        elif self._probe_partial:
            nxt = min(nxt, state.partial_keyed + self.hash_block_size)  # a hash boundary (or 0)
        return nxt

    def idle_until(self, request: Request, num_computed: int) -> int:
        """Until the row is full or there is something to key, whichever comes first."""
        state = self.requests[request.request_id]
        return min(len(state.row) * self.effective_block_size, self._next_key(state) - 1)

    def _key_every_hash(self, table: list[int], hashes, done: int, boundary: int) -> None:
        """Mutates. Key every hash boundary in ``(done, boundary]`` on the block holding it, one
        pool call per block (``grow_keys``): the longest becomes the block's primary (the
        full-block key at a block end), the shorter ones and the block's earlier keys prefix
        keys."""
        b, h, gid = self.effective_block_size, self.hash_block_size, self.group_id
        grow, covered, keyed = self.pool.grow_keys, self.pool.num_tokens_of, self.ledger.keyed
        n = done + h
        while n <= boundary:
            j = (n - 1) // b
            last = min(boundary, (j + 1) * b)
            blk = table[j]
            if covered(blk) >= n:
                # The block already covers this boundary under another key: the manager is
                # keying a block this request does not write (its bookkeeping is wrong).
                raise InvariantViolation(
                    "INV-KEYS-EVERY-HASH",
                    f"group {gid}: boundary {n} on block {blk} (row index {j}), which already covers "
                    f"{covered(blk)} tokens under another key",
                )
            grow(blk, [(key_at(hashes, m, h, gid), m) for m in range(n, last + 1, h)])
            keyed.add(blk)
            n = last + h

    def check_keys(self) -> None:
        """INV-KEYS-PER-BLOCK (slow tier, O(keys of the tables' blocks)): every key of row block
        j names a multiple of H in ``(j*B, (j+1)*B]``. The pool keeps a block's key lengths
        distinct (each key must cover more than the block did), so a block carries at most
        ``B / H`` keys (``block_size * dcp / H`` for a sharded group). No state change."""
        b, h, keys_of = self.effective_block_size, self.hash_block_size, self.pool.keys_of
        for rid, state in self.requests.items():
            for j, blk in enumerate(state.row):
                lengths = [n for _, n in keys_of(blk)]
                if any(n % h or not j * b < n <= (j + 1) * b for n in lengths):
                    raise InvariantViolation(
                        "INV-KEYS-PER-BLOCK",
                        f"group {self.group_id}, request {rid!r}: block {blk} at row index {j} has keys of lengths "
                        f"{lengths}; expected at most {b // h} multiples of H={h} in ({j * b}, {(j + 1) * b}]",
                    )
