"""The prefix-cache block pool: ref counts, the free queue and the key -> blocks map.

Called on every scheduler step, so the hot methods are plain loops over ints: per-block state
lives in lists indexed by block id, and the free queue is an intrusive doubly linked list kept in
two int lists (``_next``/``_prev``, with head and tail sentinels at ids ``num_blocks`` and
``num_blocks + 1``), unlinked and relinked inline. There are no per-block Python objects.
Measured against an ``OrderedDict`` queue, the int arrays are ~2x faster per pop/push (the
OrderedDict's ``popitem(last=False)``/``move_to_end`` go through its hash table); see
docs/benchmarks.md.

Semantics are those of ``kvproof.spec.block_pool`` (read that module first): a block's primary
key names the longest prefix it holds (with ``keep_prefixes`` its earlier, shorter keys stay as
prefix keys), the null block 0 is inert, ``allocate`` pops the free-queue head and evicts,
``free`` prepends uncached blocks and appends cached ones. Differences from vLLM 0.33 (docs/vllm-semantics.md §10.2):
no alias keys; a partial key at a boundary the block already covers is refused; promotion and
growth retire the shorter key, so no stale key can come back.

Contracts, two tiers (docs/spec.md, the block-pool section):

* cheap, always on: input validation and O(blocks touched) consistency checks written as plain
  code in each method. They raise ``ValueError`` (bad input; the message starts with the
  invariant id and names the block and its ref count) or ``InvariantViolation`` (the pool itself
  is inconsistent). Every failed call leaves the pool unchanged (INV-POOL-ATOMIC).
* slow, while the slow switch is on (``kvproof.spec.contracts.slow()``, read at each call):
  the icontract conditions under ``@slow_tier`` on every verb, including the whole-pool
  :meth:`BlockPool._check`. An icontract condition costs ~5 us per call here against ~0.1 us
  for the method body, which is why they are not the cheap tier; with the switch off a verb
  pays one branch for them.

Nothing here depends on ``__debug__``: ``python -O`` keeps every check.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from typing import Hashable, Iterable, Optional, Sequence

import icontract

from kvproof.spec.contracts import InvariantViolation, check, slow_tier
from kvproof.spec.eviction import COMPUTE, LRU, parse_policy
from kvproof.spec.geometry import MAX_NUM_BLOCKS

NULL_BLOCK = 0

Key = Hashable


def _count_refs(self: "BlockPool", blocks: Iterable[int]) -> dict[int, int]:
    """Ref counts of the given blocks (snapshot helper for the slow-tier contracts)."""
    return {b: self._ref[b] for b in blocks if isinstance(b, int) and 0 <= b < self._num_blocks}


class BlockPool:
    """KV-cache blocks ``0 .. num_blocks-1`` with ref counts and prefix-cache keys.

    Block 0 is the null block (placeholder in block tables): never allocated, cached or keyed.
    ``touch`` and ``free`` skip it silently, because block tables hand it back with the real
    blocks (as in vLLM); every caching call rejects it. ``-1`` is never a block id; "no block"
    is ``None``.
    """

    __slots__ = (
        "_num_blocks", "_ref", "_key", "_ntok", "_prefixes", "_holders", "_next", "_prev", "_head", "_tail", "_num_free",
        "num_evictions", "_group", "_occupied", "_compute", "_heap", "_hseq", "_prio", "_seq",
        "_num_cached_free",
    )

    @slow_tier
    @icontract.ensure(lambda self: self._check(), "INV-POOL-CONSERVE: a new pool is well formed", enabled=True)
    def __init__(self, num_blocks: int, policy: str = LRU) -> None:
        """A pool whose blocks 1..num_blocks-1 start free, in id order (allocated in that order),
        evicting by ``policy`` (``spec.eviction``: ``lru``, vLLM's, or ``compute``)."""
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or not 1 <= num_blocks <= MAX_NUM_BLOCKS:
            raise ValueError(
                f"num_blocks {num_blocks!r} must be an int in [1, {MAX_NUM_BLOCKS}] "
                "(block 0 is the null block; block ids are int32 table entries)"
            )
        parse_policy(policy)
        self._num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._key: list[Optional[Key]] = [None] * num_blocks
        # Prefix length covered by the block's (primary) key; 0 iff the block has no key.
        self._ntok = [0] * num_blocks
        # block -> its prefix keys as (key, ntok), shortest first; only blocks that have some
        # (attention blocks cached with keep_prefixes), so most blocks cost nothing here.
        self._prefixes: dict[int, list[tuple[Key, int]]] = {}
        # key -> the blocks holding it (as primary or prefix key), oldest first (lookups return the first).
        self._holders: dict[Key, list[int]] = {}
        # Free queue: _next/_prev links, -1 for a block that is not queued (ref > 0, or null).
        self._head, self._tail = num_blocks, num_blocks + 1
        self._next = [-1] * (num_blocks + 2)
        self._prev = [-1] * (num_blocks + 2)
        chain = [self._head, *range(1, num_blocks), self._tail]
        for a, b in zip(chain, chain[1:]):
            self._next[a], self._prev[b] = b, a
        self._num_free = num_blocks - 1
        #: Cached blocks ``allocate`` has evicted (their key dropped to reuse the block).
        self.num_evictions = 0
        # The group each block was last allocated to, and per group the blocks it occupies:
        # held (ref > 0) or cached (keyed, evictable). Memory accounting only.
        self._group = [0] * num_blocks
        self._occupied: list[int] = []
        # The compute policy (spec.eviction): the linked queue holds only free uncached blocks;
        # evictable cached ones live in a min-heap of (priority, release seq, block) with lazy
        # deletion (an entry is live iff _hseq[block] is its seq, the block's release number).
        self._compute = policy == COMPUTE
        self._heap: list[tuple[float, int, int]] = []
        self._hseq = [-1] * num_blocks
        self._prio = [0.0] * num_blocks
        self._seq = 0
        self._num_cached_free = 0

    def __repr__(self) -> str:
        return f"BlockPool(num_blocks={self._num_blocks}, free={self._num_free}, keys={len(self._holders)}, policy={self.policy})"

    @property
    def policy(self) -> str:
        """The eviction policy: ``lru`` or ``compute``."""
        return COMPUTE if self._compute else LRU

    @property
    def released(self) -> int:
        """The compute policy's clock: cached blocks released (freed or requeued) so far."""
        return self._seq

    def priority(self, block: int) -> Optional[float]:
        """The compute policy's eviction priority of an evictable cached block (None otherwise)."""
        self._require_in_range(block, "priority")
        return self._prio[block] if self._hseq[block] >= 0 else None

    # --- queries (no state change) -------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Total block count, the null block included."""
        return self._num_blocks

    @property
    def num_free(self) -> int:
        """Blocks ``allocate`` can hand out now: uncached free blocks plus evictable cached ones."""
        return self._num_free

    def can_allocate(self, n: int) -> bool:
        """Whether ``allocate(n)`` would succeed. No state change."""
        return 0 <= n <= self._num_free

    def usage(self) -> float:
        """Fraction of real blocks in use (ref > 0), in [0, 1]."""
        real = self._num_blocks - 1
        return 1.0 - self._num_free / real if real else 0.0

    def ref_count(self, block: int) -> int:
        """Reference count of ``block``."""
        self._require_in_range(block, "ref_count")
        return self._ref[block]

    def key_of(self, block: int) -> Optional[Key]:
        """The primary key naming ``block``'s contents (its longest), or None if it is not cached."""
        self._require_in_range(block, "key_of")
        return self._key[block]

    def keys_of(self, block: int) -> tuple[tuple[Key, int], ...]:
        """Every key of ``block`` with the prefix length it names, longest (the primary) first."""
        self._require_in_range(block, "keys_of")
        if self._key[block] is None:
            return ()
        return ((self._key[block], self._ntok[block]),) + tuple(reversed(self._prefixes.get(block, ())))

    def num_tokens_of(self, block: int) -> int:
        """Prefix length the block's key covers (0 if uncached): a manager can skip offering a
        partial boundary the block already covers without calling into the pool."""
        self._require_in_range(block, "num_tokens_of")
        return self._ntok[block]

    def lookup(self, key: Key) -> Optional[int]:
        """The block a cache hit on ``key`` returns (the oldest holder), or None. No state change;
        the caller takes a reference with :meth:`touch`."""
        found = self._holders.get(key)
        return found[0] if found else None

    def holders(self, key: Key) -> tuple[int, ...]:
        """All blocks holding ``key``, oldest first. No state change."""
        return tuple(self._holders.get(key, ()))

    def free_order(self) -> tuple[int, ...]:
        """The free blocks in the order ``allocate`` takes them, head first: the free queue
        (``lru``), or the uncached queue then the cached blocks by (priority, release)
        (``compute``). O(num_free log num_free); for tests and debugging."""
        out, nxt, b = [], self._next, self._next[self._head]
        while b != self._tail and len(out) < self._num_blocks:  # the bound stops a corrupted cycle
            out.append(b)
            b = nxt[b]
        if self._compute:
            out += [b for _, _, b in sorted(e for e in self._heap if self._hseq[e[2]] == e[1])]
        return tuple(out)

    def occupancy(self) -> tuple[int, ...]:
        """Blocks each group occupies now -- held by a request, or cached and not yet evicted --
        indexed by the group ids ``allocate`` was given. O(groups)."""
        return tuple(self._occupied)

    def num_cached_keys(self) -> int:
        """Number of distinct keys in the cache (primary and prefix keys)."""
        return len(self._holders)

    def num_prefix_keys(self) -> int:
        """Prefix keys held beside primary keys (the memory keep_prefixes costs). O(blocks with some)."""
        return sum(len(p) for p in self._prefixes.values())

    # --- verbs (mutate state) ------------------------------------------------------------------

    @slow_tier
    @icontract.snapshot(lambda self: self.free_order(), name="free_order", enabled=True)
    @icontract.ensure(
        lambda OLD, self, n, result: result is not None or self.free_order() == OLD.free_order,
        "INV-POOL-ATOMIC: a failed allocate changes nothing",
        enabled=True,
    )
    @icontract.ensure(
        lambda self, n, result: result is None
        or (len(result) == n == len(set(result)) and all(self._ref[b] == 1 and self._key[b] is None and b != NULL_BLOCK for b in result)),
        "INV-POOL-ALLOC-FRESH: allocate returns n distinct real blocks with ref 1 and no key",
        enabled=True,
    )
    @icontract.ensure(
        lambda OLD, self, n, result: result is None or tuple(result) == OLD.free_order[:n],
        "INV-EVICT-MIN: allocate takes the first n blocks of the free order (lru: the queue head; compute: "
        "uncached first, then the lowest priorities)",
        enabled=True,
    )
    @icontract.ensure(lambda self: self._check(), "INV-POOL-CONSERVE: whole-pool check after allocate", enabled=True)
    def allocate(self, n: int, group: int = 0) -> Optional[list[int]]:
        """Mutates. Take ``n`` blocks from the head of the free queue, each with ref 1 and no key,
        for cache group ``group`` (memory accounting: :meth:`occupancy`).

        A popped cached block is evicted: its key is dropped (so it is never hit again). Returns
        None and changes nothing when fewer than ``n`` blocks are free (INV-POOL-ATOMIC); callers
        that need to know beforehand use :meth:`can_allocate`.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"allocate: block count {n!r} must be an int >= 0")
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < 1 << 16:
            raise ValueError(f"allocate: group {group!r} must be an int in [0, 65536)")
        if n > self._num_free:
            return None
        if self._compute:
            return self._allocate_compute(n, group)
        ref, key, nxt, prv = self._ref, self._key, self._next, self._prev
        occupied, owner = self._occupied, self._group
        while len(occupied) <= group:
            occupied.append(0)
        out = []
        b = nxt[self._head]
        for _ in range(n):
            if ref[b]:
                raise InvariantViolation("INV-POOL-FREE-IFF-UNREF", f"block {b} popped from the free queue has ref count {ref[b]}")
            if key[b] is not None:
                self._drop_key(b)
                self.num_evictions += 1
                occupied[owner[b]] -= 1
            owner[b] = group
            occupied[group] += 1
            ref[b] = 1
            out.append(b)
            following = nxt[b]
            nxt[b] = prv[b] = -1
            b = following
        nxt[self._head], prv[b] = b, self._head  # splice the popped run out in one step
        self._num_free -= n
        return out

    def _allocate_compute(self, n: int, group: int) -> list[int]:
        """Mutates. ``allocate`` under the compute policy (n <= num_free checked): free uncached
        blocks first, from the queue's head (INV-EVICT-UNCACHED-FIRST), then the cached blocks of
        lowest priority, ties to the earliest released (INV-EVICT-MIN)."""
        ref, key, nxt, prv = self._ref, self._key, self._next, self._prev
        occupied, owner = self._occupied, self._group
        while len(occupied) <= group:
            occupied.append(0)
        out: list[int] = []
        b = nxt[self._head]
        while len(out) < n and b != self._tail:
            if ref[b] or key[b] is not None:
                raise InvariantViolation("INV-EVICT-UNCACHED-FIRST", f"block {b} in the uncached queue has ref {ref[b]}, key {key[b]!r}")
            owner[b] = group
            occupied[group] += 1
            ref[b] = 1
            out.append(b)
            following = nxt[b]
            nxt[b] = prv[b] = -1
            b = following
        nxt[self._head], prv[b] = b, self._head
        heap, hseq = self._heap, self._hseq
        while len(out) < n:
            prio, seq, b = heapq.heappop(heap)
            if hseq[b] != seq:
                continue  # stale: touched, evicted or reset since it was pushed
            if ref[b] or key[b] is None:
                raise InvariantViolation("INV-POOL-FREE-IFF-UNREF", f"evictable block {b} has ref {ref[b]}, key {key[b]!r}")
            if prio < seq:
                raise InvariantViolation("INV-EVICT-CLOCK", f"block {b}'s priority {prio} is below its release number {seq}")
            hseq[b] = -1
            self._num_cached_free -= 1
            self._drop_key(b)
            self.num_evictions += 1
            occupied[owner[b]] -= 1
            owner[b] = group
            occupied[group] += 1
            ref[b] = 1
            out.append(b)
        self._num_free -= n
        return out

    @slow_tier
    @icontract.snapshot(lambda self, blocks: _count_refs(self, blocks), name="refs", enabled=True)
    @icontract.ensure(
        lambda OLD, self, blocks: all(self._ref[b] == OLD.refs[b] + c for b, c in Counter(blocks).items() if b != NULL_BLOCK),
        "INV-POOL-REF-NONNEG: touch adds one reference per listed real block",
        enabled=True,
    )
    @icontract.ensure(lambda self: self._check(), "INV-POOL-CONSERVE: whole-pool check after touch", enabled=True)
    def touch(self, blocks: Sequence[int]) -> None:
        """Mutates. Take one more reference on each listed block (a cache hit).

        A ref-0 block (cached, evictable) leaves the free queue. The null block is skipped.
        Touching a free block that has no key is refused: nothing can have hit it, so the caller
        would be reading a block the next ``allocate`` may hand to someone else.
        """
        if not blocks:
            return
        ref, key, nb = self._ref, self._key, self._num_blocks
        # Validate everything first (a failed call changes nothing); the common case is a run
        # of held or cached blocks, checked with C-level loops.
        if min(blocks) < 1 or max(blocks) >= nb or (0 in map(ref.__getitem__, blocks) and None in map(key.__getitem__, blocks)):
            for b in blocks:
                if not 0 < b < nb:
                    if b == NULL_BLOCK:
                        continue
                    raise ValueError(f"touch: block id {b!r} out of range [0, {nb})")
                if ref[b] == 0 and key[b] is None:
                    raise ValueError(f"INV-POOL-FREE-IFF-UNREF: touch of block {b}: it is free (ref count 0) and has no key, so it is not a cache hit")
        nxt, prv = self._next, self._prev
        compute = self._compute
        for b in blocks:
            if b == NULL_BLOCK:
                continue
            if ref[b] == 0:  # an evictable cached block: take it out of the free queue
                if compute:  # its heap entry goes stale
                    self._hseq[b] = -1
                    self._num_cached_free -= 1
                else:
                    before, after = prv[b], nxt[b]
                    nxt[before], prv[after] = after, before
                    nxt[b] = prv[b] = -1
                self._num_free -= 1
            ref[b] += 1

    @slow_tier
    @icontract.snapshot(lambda self, blocks: _count_refs(self, blocks), name="refs", enabled=True)
    @icontract.ensure(
        lambda OLD, self, blocks: all(self._ref[b] == OLD.refs[b] - c for b, c in Counter(blocks).items() if b != NULL_BLOCK),
        "INV-POOL-REF-NONNEG: free drops one reference per listed real block",
        enabled=True,
    )
    @icontract.ensure(lambda self: self._check(), "INV-POOL-CONSERVE: whole-pool check after free", enabled=True)
    def free(self, blocks: Sequence[int], values: Optional[Sequence[float]] = None) -> None:
        """Mutates. Drop one reference per listed block (the null block is skipped).

        Blocks reaching ref 0 join the free queue: uncached ones at the head, as one batch in the
        given order (reused first); cached ones at the tail in the given order (evicted last, LRU).
        Callers pass a request's blocks tail first so its tail is evicted first. Freeing a block
        more times than it is referenced, or an id out of range, raises ValueError naming the
        block and its ref count, and changes nothing.

        Under the compute policy a cached block reaching ref 0 gets priority ``released +
        values[i]`` (its release number plus its value, INV-EVICT-CLOCK) (``values``: one finite number >= 0 per listed block, the FLOPs per byte its
        loss would cost, ``spec.eviction``; 0 when None) and waits in the eviction heap instead.
        ``lru`` ignores ``values``.
        """
        if not blocks:
            return
        if values is not None and (len(values) != len(blocks) or not all(0.0 <= v < math.inf for v in values)):
            raise ValueError(f"INV-EVICT-VALUE: free: values {list(values)!r} must be one finite number >= 0 per block of {list(blocks)!r}")
        ref, nb = self._ref, self._num_blocks
        # Validate everything first (a failed call changes nothing), with C-level loops on the
        # common path: ids in range, every ref > 0, no id listed twice.
        if min(blocks) < 1 or max(blocks) >= nb or 0 in map(ref.__getitem__, blocks) or (
            len(blocks) > 1 and len(set(blocks)) != len(blocks)
        ):
            self._validate_free(blocks)
        key, nxt, prv, tail, compute = self._key, self._next, self._prev, self._tail, self._compute
        uncached = []
        freed = 0
        for i, b in enumerate(blocks):
            if b == NULL_BLOCK:
                continue
            r = ref[b] - 1
            ref[b] = r
            if r == 0:
                freed += 1
                if key[b] is None:
                    uncached.append(b)
                    self._occupied[self._group[b]] -= 1
                elif compute:  # cached: into the eviction heap, by priority
                    self._push_evictable(b, values[i] if values is not None else 0.0)
                else:  # cached: append at the tail (evicted last)
                    last = prv[tail]
                    nxt[last], prv[b], nxt[b], prv[tail] = b, last, tail, b
        if uncached:  # link the batch in order, then splice it in after the head
            head = self._head
            first = nxt[head]
            before = head
            for b in uncached:
                nxt[before], prv[b] = b, before
                before = b
            nxt[before], prv[first] = first, before
        self._num_free += freed

    def _validate_free(self, blocks: Sequence[int]) -> None:
        """The slow path of free's validation: skips null blocks, raises naming the bad block."""
        ref, nb = self._ref, self._num_blocks
        for b in blocks:
            if not 0 < b < nb:
                if b == NULL_BLOCK:
                    continue
                raise ValueError(f"free: block id {b!r} out of range [0, {nb})")
            if ref[b] <= 0:
                raise ValueError(f"INV-POOL-REF-NONNEG: free of block {b} with ref count {ref[b]} (double free, or a block the caller does not hold)")
        for b, times in Counter(blocks).items():
            if b != NULL_BLOCK and times > ref[b]:
                raise ValueError(f"INV-POOL-REF-NONNEG: block {b} listed {times} times in one free but its ref count is {ref[b]}")

    @slow_tier
    @icontract.ensure(lambda self: self._check(), "INV-POOL-CONSERVE: whole-pool check after requeue", enabled=True)
    def requeue(self, blocks: Sequence[int], values: Optional[Sequence[float]] = None) -> int:
        """Mutates. Count each listed evictable cached block (ref 0, keyed) as released again now,
        in the given order: ``lru`` moves it to the queue's tail, ``compute`` gives it priority
        ``released + values[i]`` (as :meth:`free` would). Other blocks are skipped: a Mamba
        state released while its request ran is requeued when the request ends, so it is not
        evicted before the chain it completes. Returns how many were requeued. Bad ids or
        values raise ValueError and change nothing."""
        nb = self._num_blocks
        for b in blocks:
            if isinstance(b, bool) or not isinstance(b, int) or not 0 < b < nb:
                raise ValueError(f"requeue: block id {b!r} out of range [1, {nb})")
        if values is not None and (len(values) != len(blocks) or not all(0.0 <= v < math.inf for v in values)):
            raise ValueError(f"INV-EVICT-VALUE: requeue: values {list(values)!r} must be one finite number >= 0 per block of {list(blocks)!r}")
        ref, key, nxt, prv = self._ref, self._key, self._next, self._prev
        done = 0
        seen: set[int] = set()
        for i, b in enumerate(blocks):
            if ref[b] or key[b] is None or b in seen:
                continue
            seen.add(b)
            if self._compute:
                self._num_cached_free -= 1  # the old entry goes stale
                self._push_evictable(b, values[i] if values is not None else 0.0)
            else:
                before, after = prv[b], nxt[b]
                nxt[before], prv[after] = after, before
                self._link_last(b)
            done += 1
        return done

    @slow_tier
    @icontract.snapshot(lambda self, block: self.keys_of(block) if isinstance(block, int) and 0 <= block < self._num_blocks else None, name="keys", enabled=True)
    @icontract.ensure(
        lambda OLD, self, block, keep_prefixes, result: not (result and keep_prefixes) or set(OLD.keys) <= set(self.keys_of(block)),
        "INV-POOL-PREFIX-KEYS: with keep_prefixes the block keeps every key it had",
        enabled=True,
    )
    @icontract.ensure(
        lambda self, block, key, num_tokens, result: not result or (self._key[block] == key and self._ntok[block] == num_tokens),
        "INV-POOL-NO-STALE-PARTIAL: after cache_full the block's primary key is the full key",
        enabled=True,
    )
    @icontract.ensure(lambda self: self._check(), "INV-POOL-CONSERVE: whole-pool check after cache_full", enabled=True)
    def cache_full(self, block: int, key: Key, num_tokens: int, keep_prefixes: bool = False) -> bool:
        """Mutates. Name a held block by its full-block key covering ``num_tokens`` tokens.

        The block's shorter keys (partial entries) are retired -- promotion -- or, with
        ``keep_prefixes`` (append-only attention KV), kept as prefix keys. Returns True if the key
        was newly attached, False if the block already held it. A block already covering
        ``>= num_tokens`` tokens under another key is a caller bug: ValueError, no change.
        """
        if not (0 < block < self._num_blocks and self._ref[block] > 0 and num_tokens > 0):
            self._reject_uncacheable(block, num_tokens, "cache_full")
        holders = self._holders.get(key)
        if holders is not None and self._length_of(key, holders[0]) != num_tokens:
            self._reject_other_length(key, holders[0], num_tokens, "cache_full")
        current = self._key[block]
        if current == key or (holders is not None and block in holders):
            return False
        if self._ntok[block] >= num_tokens:
            raise ValueError(
                f"INV-POOL-NO-STALE-PARTIAL: cache_full of block {block} at {num_tokens} tokens, "
                f"but it already covers {self._ntok[block]} tokens under another key"
            )
        if current is not None:
            self._demote(block) if keep_prefixes else self._drop_key(block)
        self._attach(block, key, num_tokens, holders)
        return True

    @slow_tier
    @icontract.snapshot(lambda self, block: self.keys_of(block) if isinstance(block, int) and 0 <= block < self._num_blocks else None, name="keys", enabled=True)
    @icontract.ensure(
        lambda OLD, self, block, keep_prefixes, result: not (result and keep_prefixes) or set(OLD.keys) <= set(self.keys_of(block)),
        "INV-POOL-PREFIX-KEYS: with keep_prefixes the block keeps every key it had",
        enabled=True,
    )
    @icontract.ensure(
        lambda OLD, self, block, result: result is not None or self.keys_of(block) == OLD.keys,
        "INV-POOL-ATOMIC: a refused cache_partial changes nothing",
        enabled=True,
    )
    @icontract.ensure(
        lambda OLD, key, num_tokens, replace, result: (result is None)
        == (not replace and bool(OLD.keys) and key not in dict(OLD.keys) and OLD.keys[0][1] >= num_tokens),
        "INV-POOL-NO-STALE-PARTIAL: cache_partial refuses exactly a boundary the block already covers under another key",
        enabled=True,
    )
    @icontract.ensure(lambda self: self._check(), "INV-POOL-CONSERVE: whole-pool check after cache_partial", enabled=True)
    def cache_partial(self, block: int, key: Key, num_tokens: int, replace: bool = False, keep_prefixes: bool = False) -> Optional[bool]:
        """Mutates unless refused. Offer a partial (sub-block, hash-aligned) key for a held block.

        Returns True if newly attached (the entry grows forward: the block's keys so far are
        retired, or kept as prefix keys with ``keep_prefixes``), False if the block already holds
        this key, and None (no change) if the block already covers ``>= num_tokens`` tokens under
        another key: it has outgrown that boundary, and attaching it would bring back a retired key
        (vLLM 0.33, docs/vllm-semantics.md §10.2). ``replace=True`` is for a rewritten Mamba state:
        every old key goes whatever its length (and ``keep_prefixes`` makes no sense with it).
        """
        if replace and keep_prefixes:
            raise ValueError("cache_partial: replace (a rewritten state) and keep_prefixes (append-only) exclude each other")
        if not (0 < block < self._num_blocks and self._ref[block] > 0 and num_tokens > 0):
            self._reject_uncacheable(block, num_tokens, "cache_partial")
        holders = self._holders.get(key)
        if holders is not None and self._length_of(key, holders[0]) != num_tokens:
            self._reject_other_length(key, holders[0], num_tokens, "cache_partial")
        current = self._key[block]
        if current == key or (holders is not None and block in holders):
            return False
        if current is not None:
            if not replace and self._ntok[block] >= num_tokens:
                return None
            self._demote(block) if keep_prefixes else self._drop_key(block)
        self._attach(block, key, num_tokens, holders)
        return True

    @icontract.ensure(
        lambda self, blocks: all(self._key[b] is None and b not in self._prefixes for b in blocks),
        "INV-POOL-PREFIX-KEYS: evicted blocks have no key, primary or prefix",
        enabled=True,
    )
    @slow_tier
    @icontract.ensure(lambda self: self._check(), "INV-POOL-CONSERVE: whole-pool check after evict", enabled=True)
    def evict(self, blocks: Sequence[int]) -> int:
        """Mutates. Drop every key of each listed block; ref counts and the free queue are unchanged.
        Returns how many keys were dropped. An id outside [1, num_blocks) raises ValueError and
        changes nothing."""
        nb = self._num_blocks
        for b in blocks:
            if isinstance(b, bool) or not isinstance(b, int) or not 0 < b < nb:
                raise ValueError(f"evict: block id {b!r} out of range [1, {nb})")
        dropped = 0
        for b in blocks:
            if self._key[b] is not None:
                self._drop_key(b)
                dropped += 1
                if self._ref[b] == 0:  # a free block that no longer caches anything
                    self._occupied[self._group[b]] -= 1
                    if self._compute:  # leaves the heap, ends the uncached queue
                        self._hseq[b] = -1
                        self._num_cached_free -= 1
                        self._link_last(b)
        return dropped

    @slow_tier
    @icontract.snapshot(lambda self, block: self.keys_of(block) if isinstance(block, int) and 0 <= block < self._num_blocks else None, name="keys", enabled=True)
    @icontract.ensure(
        lambda OLD, self, block, entries: not entries
        or (set(OLD.keys) <= set(self.keys_of(block)) and self.keys_of(block)[0] == tuple(entries[-1])),
        "INV-POOL-PREFIX-KEYS: grow_keys keeps every key the block had and ends on its last entry",
        enabled=True,
    )
    @icontract.ensure(lambda self: self._check(), "INV-POOL-CONSERVE: whole-pool check after grow_keys", enabled=True)
    def grow_keys(self, block: int, entries: Sequence[tuple[Key, int]]) -> None:
        """Mutates unless it raises. Append-only growth by several hash boundaries at once
        (attention KV written in one step): the same as ``cache_partial(block, key, n,
        keep_prefixes=True)`` for each ``(key, n)`` in order -- the last becomes the primary, the
        block's earlier keys prefix keys -- in one call. Each length must exceed the one before
        and what the block covers (a covered boundary is the caller's bug here:
        INV-POOL-NO-STALE-PARTIAL), and a key held elsewhere must name the same length
        (INV-POOL-KEY-LENGTH); else ValueError and no change."""
        if not entries:
            return
        if not (0 < block < self._num_blocks and self._ref[block] > 0 and entries[0][1] > 0):
            self._reject_uncacheable(block, entries[0][1], "grow_keys")
        covered, holders_map = self._ntok[block], self._holders
        for key, n in entries:  # validate everything first: a failed call changes nothing
            if n <= covered:
                raise ValueError(f"INV-POOL-NO-STALE-PARTIAL: grow_keys of block {block} at {n} tokens, but it already covers {covered}")
            found = holders_map.get(key)
            if found is not None and self._length_of(key, found[0]) != n:
                self._reject_other_length(key, found[0], n, "grow_keys")
            covered = n
        if len(entries) > 1 and len({k for k, _ in entries}) < len(entries):
            raise ValueError(f"INV-POOL-KEY-LENGTH: grow_keys of block {block}: one key given for two lengths")
        if self._key[block] is not None:
            self._demote(block)
        if len(entries) > 1:
            kept = self._prefixes.setdefault(block, [])
            for key, n in entries[:-1]:
                kept.append((key, n))
                found = holders_map.get(key)
                if found is None:
                    holders_map[key] = [block]
                else:
                    found.append(block)
        key, n = entries[-1]
        self._attach(block, key, n, holders_map.get(key))

    @icontract.ensure(
        lambda self, result: result == (self._num_free == self._num_blocks - 1),
        "INV-POOL-RESET-IDLE: reset succeeds exactly when no real block is in use",
        enabled=True,
    )
    @icontract.ensure(
        lambda self, result: not result or not self._holders,
        "INV-POOL-KEY-CONSISTENT: a successful reset drops every key",
        enabled=True,
    )
    @slow_tier
    @icontract.ensure(lambda self: self._check(), "INV-POOL-RESET-IDLE: whole-pool check after reset", enabled=True)
    def reset(self) -> bool:
        """Mutates if it succeeds. Drop every key, but only when no real block is in use
        (INV-POOL-RESET-IDLE); otherwise return False and change nothing. The free-queue order is
        kept."""
        if self._num_free != self._num_blocks - 1:
            return False
        if self._compute:  # every cached block becomes uncached: onto the queue, in release order
            for _, b in sorted((self._hseq[b], b) for b in range(1, self._num_blocks) if self._hseq[b] >= 0):
                self._hseq[b] = -1
                self._link_last(b)
            self._heap.clear()
            self._num_cached_free = 0
        for b in range(1, self._num_blocks):
            self._key[b] = None
            self._ntok[b] = 0
        self._prefixes.clear()
        self._holders.clear()
        occupied = [0] * len(self._occupied)  # no block is cached any more: only held ones count
        for b in range(1, self._num_blocks):
            if self._ref[b]:
                occupied[self._group[b]] += 1
        self._occupied = occupied
        return True

    @icontract.ensure(
        lambda self, src, dst: self._key[src] is None and src not in self._prefixes and self._key[dst] is not None,
        "INV-POOL-KEY-CONSISTENT: the keys moved",
        enabled=True,
    )
    @slow_tier
    @icontract.ensure(lambda self: self._check(), "INV-POOL-CONSERVE: whole-pool check after move_key", enabled=True)
    def move_key(self, src: int, dst: int) -> None:
        """Mutates. Move src's keys, their lengths and their places among each key's holders to
        dst (a running Mamba request keeps writing src; its cached state now lives in the copy
        dst). Two distinct held real blocks, src keyed and dst not, else ValueError and no change."""
        nb, ref = self._num_blocks, self._ref
        for b in (src, dst):
            if isinstance(b, bool) or not isinstance(b, int) or not 0 < b < nb or ref[b] <= 0:
                raise ValueError(f"INV-POOL-HELD-TO-CACHE: move_key needs two distinct held real blocks, got {src!r} -> {dst!r}")
        if src == dst:
            raise ValueError(f"INV-POOL-HELD-TO-CACHE: move_key needs two distinct held real blocks, got {src} -> {dst}")
        if self._key[src] is None or self._key[dst] is not None:
            raise ValueError(f"move_key: block {src} must have a key and block {dst} none")
        moved = self._prefixes.pop(src, None)
        for k in [self._key[src], *(k for k, _ in moved or ())]:
            holders = self._holders[k]
            holders[holders.index(src)] = dst
        if moved:
            self._prefixes[dst] = moved
        self._key[dst], self._ntok[dst] = self._key[src], self._ntok[src]
        self._key[src], self._ntok[src] = None, 0

    # --- internals -----------------------------------------------------------------------------

    def _require_in_range(self, block: int, what: str) -> None:
        if not (isinstance(block, int) and 0 <= block < self._num_blocks):
            raise ValueError(f"{what}: block id {block!r} out of range [0, {self._num_blocks})")

    def _reject_uncacheable(self, block: int, num_tokens: int, what: str) -> None:
        """Raise the ValueError for a block that cannot be cached or a non-positive length."""
        if block == NULL_BLOCK:
            raise ValueError(f"INV-POOL-NULL: {what}: the null block 0 is never cached")
        if not (isinstance(block, int) and 0 < block < self._num_blocks):
            raise ValueError(f"{what}: block id {block!r} out of range [1, {self._num_blocks})")
        if self._ref[block] <= 0:
            raise ValueError(f"INV-POOL-HELD-TO-CACHE: {what}: block {block} has ref count {self._ref[block]}; only a held block (ref > 0) can be cached")
        raise ValueError(f"{what}: num_tokens {num_tokens} must be > 0")

    def _reject_other_length(self, key: Key, holder: int, num_tokens: int, what: str) -> None:
        raise ValueError(
            f"INV-POOL-KEY-LENGTH: {what}: key already names a {self._length_of(key, holder)}-token prefix "
            f"(block {holder}), not {num_tokens} tokens"
        )

    def _length_of(self, key: Key, holder: int) -> int:
        """The prefix length ``key`` names on ``holder`` (its primary, or one of its prefix keys)."""
        if self._key[holder] == key:
            return self._ntok[holder]
        return next(n for k, n in self._prefixes[holder] if k == key)

    def _push_evictable(self, block: int, value: float) -> None:
        """Compute policy: ``block`` (ref 0, cached) waits in the heap with priority its release
        number plus ``value``; stale entries are dropped once they outnumber the live ones."""
        seq = self._seq
        self._seq = seq + 1
        priority = seq + value
        self._hseq[block] = seq
        self._prio[block] = priority
        self._num_cached_free += 1
        heap = self._heap
        heapq.heappush(heap, (priority, seq, block))
        if len(heap) > 2 * self._num_cached_free + 64:
            hseq = self._hseq
            self._heap = [e for e in heap if hseq[e[2]] == e[1]]
            heapq.heapify(self._heap)

    def _link_last(self, block: int) -> None:
        """Link ``block`` at the tail of the (uncached) free queue."""
        nxt, prv, tail = self._next, self._prev, self._tail
        last = prv[tail]
        nxt[last], prv[block], nxt[block], prv[tail] = block, last, tail, block

    def _demote(self, block: int) -> None:
        """Make the block's primary key one of its prefix keys (it stays in the key map)."""
        self._prefixes.setdefault(block, []).append((self._key[block], self._ntok[block]))
        self._key[block] = None
        self._ntok[block] = 0

    def _attach(self, block: int, key: Key, num_tokens: int, holders: Optional[list[int]]) -> None:
        """Name a block that has no primary key by ``key``; ``holders`` is the key's current
        holder list or None."""
        self._key[block] = key
        self._ntok[block] = num_tokens
        if holders is None:
            self._holders[key] = [block]
        else:
            holders.append(block)

    def _drop_key(self, block: int) -> None:
        """Drop every key of ``block``: its primary and its prefix keys."""
        extra = self._prefixes.pop(block, None)
        for k in [self._key[block], *(k for k, _ in extra or ())]:
            found = self._holders[k]
            if len(found) == 1:
                del self._holders[k]
            else:
                found.remove(block)
        self._key[block] = None
        self._ntok[block] = 0

    def _check(self) -> bool:
        """Validate the whole pool (slow tier, O(num_blocks + keys)); True or InvariantViolation.

        The state machine calls it after every step; the icontract postconditions call it only
        while the slow switch is on.
        """
        nb, ref, key, ntok = self._num_blocks, self._ref, self._key, self._ntok
        check(len(ref) == len(key) == len(ntok) == nb, "INV-POOL-CONSERVE", f"per-block arrays have lengths {len(ref)}, {len(key)}, {len(ntok)}; expected {nb}")
        free = self._check_free_queue()
        check(ref[NULL_BLOCK] == 0 and key[NULL_BLOCK] is None and ntok[NULL_BLOCK] == 0 and NULL_BLOCK not in free,
              "INV-POOL-NULL", f"null block has ref {ref[0]}, key {key[0]!r}, ntok {ntok[0]}, in free queue: {NULL_BLOCK in free}")
        for b in range(1, nb):
            check(ref[b] >= 0, "INV-POOL-REF-NONNEG", f"block {b} has ref count {ref[b]}")
            check((b in free) == (ref[b] == 0), "INV-POOL-FREE-IFF-UNREF", f"block {b} has ref count {ref[b]} but in free queue: {b in free}")
            check((key[b] is None) == (ntok[b] == 0) and ntok[b] >= 0, "INV-POOL-KEY-CONSISTENT", f"block {b} has key {key[b]!r} with ntok {ntok[b]}")
        in_use = sum(1 for b in range(1, nb) if ref[b] > 0)
        cached_free = sum(1 for b in free if key[b] is not None)
        check((len(free) - cached_free) + cached_free + in_use + 1 == nb, "INV-POOL-CONSERVE",
              f"free-uncached {len(free) - cached_free} + evictable-cached {cached_free} + in-use {in_use} + null 1 != {nb} blocks")
        # Every key a block carries (primary or prefix), with its length, must be in the map.
        carried: dict[tuple[int, Key], int] = {}
        for b in range(nb):
            if key[b] is not None:
                carried[b, key[b]] = ntok[b]
        for b, extra in self._prefixes.items():
            lengths = [n for _, n in extra]
            check(key[b] is not None and lengths == sorted(set(lengths)) and all(0 < n < ntok[b] for n in lengths)
                  and len({k for k, _ in extra} | {key[b]}) == len(extra) + 1,
                  "INV-POOL-PREFIX-KEYS", f"block {b} has prefix keys of lengths {lengths} beside a primary of {ntok[b]}")
            for k, n in extra:
                carried[b, k] = n
        listed = 0
        for k, blocks in self._holders.items():
            check(len(blocks) > 0 and len(set(blocks)) == len(blocks), "INV-POOL-KEY-CONSISTENT",
                  f"key {k!r} is in the map with holders {blocks}")
            lengths = []
            for b in blocks:
                check((b, k) in carried, "INV-POOL-KEY-CONSISTENT", f"key {k!r} lists block {b}, which does not carry it")
                lengths.append(carried[b, k])
            listed += len(blocks)
            check(len(set(lengths)) == 1, "INV-POOL-KEY-LENGTH", f"key {k!r} is held with lengths {lengths} by blocks {blocks}")
        check(listed == len(carried), "INV-POOL-KEY-CONSISTENT", f"blocks carry {len(carried)} keys but the key map lists {listed}")
        occupied = [0] * len(self._occupied)
        for b in range(1, nb):
            if ref[b] > 0 or key[b] is not None:
                occupied[self._group[b]] += 1
        check(occupied == self._occupied, "INV-POOL-CONSERVE", f"occupancy per group counted {occupied}, kept {self._occupied}")
        return True

    def _check_free_queue(self) -> set[int]:
        """Walk the free queue; check its links and its counter; return its members."""
        nb, nxt, prv = self._num_blocks, self._next, self._prev
        members: list[int] = []
        b = nxt[self._head]
        while b != self._tail:
            check(0 < b < nb and len(members) < nb, "INV-POOL-FREE-IFF-UNREF",
                  f"free queue reaches id {b} after {len(members)} blocks (expected real ids in [1, {nb}), no cycle)")
            check(prv[b] == (members[-1] if members else self._head), "INV-POOL-FREE-IFF-UNREF",
                  f"free queue link broken at block {b}: prev is {prv[b]}")
            members.append(b)
            b = nxt[b]
        linked = set(members)
        if self._compute:
            for b in members:
                check(self._key[b] is None, "INV-EVICT-UNCACHED-FIRST", f"cached block {b} is in the uncached queue")
            live = {e[2]: e for e in self._heap if self._hseq[e[2]] == e[1]}
            marked = {b for b in range(nb) if self._hseq[b] >= 0}
            check(set(live) == marked and len(live) == self._num_cached_free and not marked & linked, "INV-POOL-CONSERVE",
                  f"{len(live)} live heap entries, {len(marked)} blocks marked, counter {self._num_cached_free}")
            for b, (prio, _, _) in live.items():
                check(self._key[b] is not None and self._ref[b] == 0, "INV-POOL-FREE-IFF-UNREF",
                      f"evictable block {b} has ref {self._ref[b]}, key {self._key[b]!r}")
                check(prio == self._prio[b] and prio >= self._hseq[b], "INV-EVICT-CLOCK",
                      f"block {b}'s priority {prio} is below its release number {self._hseq[b]}")
            members += list(live)
        check(len(members) == self._num_free, "INV-POOL-CONSERVE",
              f"free counter says {self._num_free} blocks but the queue holds {len(members)}")
        queued = set(members)
        for b in range(nb):
            if b not in linked:
                check(nxt[b] == prv[b] == -1, "INV-POOL-FREE-IFF-UNREF", f"block {b} is not queued but has links {prv[b]}, {nxt[b]}")
        return queued
