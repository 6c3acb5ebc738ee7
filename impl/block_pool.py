"""The prefix-cache block pool: reference counts, composed with a key index and an eviction queue.

The one object the managers talk to. It does one job itself -- reference counts, which blocks
are free, and per-group occupancy -- and gives the other two to its parts:

* ``impl/key_index.py`` (:class:`KeyIndex`): which keys each block carries, which blocks hold
  each key;
* ``impl/eviction_queue.py`` (an :class:`EvictionQueue` per policy, ``lru`` or ``compute``):
  the free blocks in the order ``allocate`` takes them.

Called on every scheduler step, so the hot methods are plain loops over ints: per-block state
lives in lists indexed by block id, and the free queues are int-array linked lists
(``impl/free_list.py``). There are no per-block Python objects.

Semantics are those of ``kvproof.spec.block_pool`` (read that module first): a block's primary
key names the longest prefix it holds, the null block 0 is inert, ``allocate`` pops the free
queue's head and evicts, ``free`` prepends uncached blocks and appends cached ones. Each caller
says what a new key does to the block's earlier keys by the verb it calls:

* ``cache_full`` / ``cache_partial``: the earlier keys are retired (the block was rewritten, or
  only its longest key is worth keeping);
* ``extend_full`` / ``extend_partial`` / ``grow_keys``: they stay as prefix keys (append-only
  attention KV still holds those prefixes);
* ``replace_key``: a rewritten Mamba state, every earlier key goes whatever its length;
* ``move_key``: the keys move to another block.

Differences from vLLM 0.33 (docs/vllm-semantics.md §10.2): no alias keys; a partial key at a
boundary the block already covers is refused; promotion and growth retire the shorter key, so no
stale key can come back.

Contracts, two tiers (docs/spec.md, the block-pool section), each icontract condition naming its
tier where it is declared (``spec.contracts.ensure``):

* cheap, always on: input validation and O(blocks touched) consistency checks written as plain
  code in each method, and the ``tier=CHEAP`` conditions. The plain checks raise ``ValueError``
  (bad input; the message starts with the invariant id and names the block and its ref count)
  or ``InvariantViolation`` (the pool itself is inconsistent). Every failed call leaves the pool
  unchanged (INV-POOL-ATOMIC).
* slow, while the slow switch is on (``kvproof.spec.contracts.slow()``, read at each call): the
  ``tier=SLOW`` conditions, including the whole-pool :meth:`BlockPool._check`. An icontract
  condition costs ~5 us per call here against ~0.1 us for the method body, which is why they
  are not the cheap tier; with the switch off a verb pays one branch for them.

Nothing here depends on ``__debug__``: ``python -O`` keeps every check.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Callable, Iterable, Optional, Protocol, Sequence

from kvproof.impl.eviction_queue import eviction_queue
from kvproof.impl.key_index import Key, KeyIndex
from kvproof.impl.key_log import KeyLog, LoggedKeyIndex
from kvproof.spec.contracts import CHEAP, SLOW, InvariantViolation, check, ensure, snapshot
from kvproof.spec.eviction import LRU, parse_policy
from kvproof.spec.geometry import MAX_NUM_BLOCKS

NULL_BLOCK = 0


class PoolObserver(Protocol):
    """What a pool tells its ``observer`` (a host's block-residency metrics, as vLLM's
    ``--kv-cache-metrics`` collects them from its own pool): after the fact, never asked."""

    def allocated(self, blocks: list[int]) -> None:
        """``blocks`` were handed out (a cached one among them was evicted)."""

    def touched(self, blocks: list[int]) -> None:
        """``blocks`` (real ones) were touched by a cache hit."""

    def reset(self) -> None:
        """Every key was dropped (``reset``)."""


def _count_refs(self: "BlockPool", blocks: Iterable[int]) -> dict[int, int]:
    """Ref counts of the given blocks (snapshot helper for the slow-tier contracts)."""
    return {b: self._ref[b] for b in blocks if isinstance(b, int) and 0 <= b < self._num_blocks}


def _keys_snapshot(self: "BlockPool", block: int):
    """The block's keys before a caching call (None for a bad id: the verb names it)."""
    return self.keys_of(block) if isinstance(block, int) and 0 <= block < self._num_blocks else None


# Conditions the keying verbs share (slow tier, after the call; ``OLD.keys``: ``_keys_snapshot``).


def _the_only_key(self: "BlockPool", block: int, key: Key, num_tokens: int, result) -> bool:
    """A newly attached key is the block's only one (its earlier keys were retired)."""
    return not result or self.keys_of(block) == ((key, num_tokens),)


def _every_key_kept(OLD, self: "BlockPool", block: int, result) -> bool:
    """A newly attached key left the block every key it had."""
    return not result or set(OLD.keys) <= set(self.keys_of(block))


def _refusal_changes_nothing(OLD, self: "BlockPool", block: int, result) -> bool:
    """A refused partial key (None) left the block's keys as they were."""
    return result is not None or self.keys_of(block) == OLD.keys


def _refused_iff_covered(OLD, key: Key, num_tokens: int, result) -> bool:
    """A partial key is refused (None) exactly where the block covers its boundary under another key."""
    return (result is None) == (bool(OLD.keys) and key not in dict(OLD.keys) and OLD.keys[0][1] >= num_tokens)


def _partial_key_contracts(verb: str) -> Callable[[Callable], Callable]:
    """The slow-tier conditions both partial-key verbs carry, worded with the verb's name."""
    declared = (
        snapshot(_keys_snapshot, name="keys", tier=SLOW),
        ensure(_refusal_changes_nothing, f"INV-POOL-ATOMIC: a refused {verb} changes nothing", tier=SLOW),
        ensure(_refused_iff_covered,
               f"INV-POOL-NO-STALE-PARTIAL: {verb} refuses exactly a boundary the block already covers under another key", tier=SLOW),
        ensure(lambda self: self._check(), f"INV-POOL-CONSERVE: whole-pool check after {verb}", tier=SLOW),
    )

    def apply(fn: Callable) -> Callable:
        for decorate in reversed(declared):  # as if stacked in this order above ``fn``
            fn = decorate(fn)
        return fn

    return apply


class BlockPool:
    """KV-cache blocks ``0 .. num_blocks-1`` with ref counts and prefix-cache keys.

    Block 0 is the null block (placeholder in block tables): never allocated, cached or keyed.
    ``touch`` and ``free`` skip it silently, because block tables hand it back with the real
    blocks (as in vLLM); every caching call rejects it. ``-1`` is never a block id; "no block"
    is ``None``.
    """

    __slots__ = ("_num_blocks", "_ref", "_index", "_queue", "_num_free", "num_evictions", "_group", "_occupied",
                 "observer")

    @ensure(lambda self: self._check(), "INV-POOL-CONSERVE: a new pool is well formed", tier=SLOW)
    def __init__(self, num_blocks: int, policy: str = LRU, key_log: Optional[KeyLog] = None) -> None:
        """A pool whose blocks 1..num_blocks-1 start free, in id order (allocated in that order),
        evicting by ``policy`` (``spec.eviction``: ``lru``, vLLM's, or ``compute``). With
        ``key_log``, every key attached or lost is recorded there (``impl/key_log.py``)."""
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or not 1 <= num_blocks <= MAX_NUM_BLOCKS:
            raise ValueError(
                f"num_blocks {num_blocks!r} must be an int in [1, {MAX_NUM_BLOCKS}] "
                "(block 0 is the null block; block ids are int32 table entries)"
            )
        parse_policy(policy)
        self._num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._index = KeyIndex(num_blocks) if key_log is None else LoggedKeyIndex(num_blocks, key_log)
        self._queue = eviction_queue(policy, num_blocks, self._index.key)
        self._num_free = num_blocks - 1
        #: Cached blocks ``allocate`` has evicted (their key dropped to reuse the block).
        self.num_evictions = 0
        # The group each block was last allocated to, and per group the blocks it occupies:
        # held (ref > 0) or cached (keyed, evictable). Memory accounting only.
        self._group = [0] * num_blocks
        self._occupied: list[int] = []
        #: Told of every block handed out, every hit touched and every reset (a host's block
        #: residency metrics: ``PoolObserver``); None tells nothing.
        self.observer: Optional[PoolObserver] = None

    def __repr__(self) -> str:
        return f"BlockPool(num_blocks={self._num_blocks}, free={self._num_free}, keys={len(self._index.holders)}, policy={self.policy})"

    @property
    def policy(self) -> str:
        """The eviction policy: ``lru`` or ``compute``."""
        return self._queue.policy

    @property
    def released(self) -> int:
        """The compute policy's clock: cached blocks released (freed or requeued) so far."""
        return self._queue.released

    def priority(self, block: int) -> Optional[float]:
        """The compute policy's eviction priority of an evictable cached block (None otherwise)."""
        self._require_in_range(block, "priority")
        return self._queue.priority(block)

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
        return self._index.key[block]

    def keys_of(self, block: int) -> tuple[tuple[Key, int], ...]:
        """Every key of ``block`` with the prefix length it names, longest (the primary) first."""
        self._require_in_range(block, "keys_of")
        return self._index.keys_of(block)

    def num_tokens_of(self, block: int) -> int:
        """Prefix length the block's key covers (0 if uncached): a manager can skip offering a
        partial boundary the block already covers without calling into the pool."""
        self._require_in_range(block, "num_tokens_of")
        return self._index.ntok[block]

    def lookup(self, key: Key) -> Optional[int]:
        """The block a cache hit on ``key`` returns (the oldest holder), or None. No state change;
        the caller takes a reference with :meth:`touch`."""
        found = self._index.holders.get(key)
        return found[0] if found else None

    def holders(self, key: Key) -> tuple[int, ...]:
        """All blocks holding ``key``, oldest first. No state change."""
        return tuple(self._index.holders.get(key, ()))

    def free_order(self) -> tuple[int, ...]:
        """The free blocks in the order ``allocate`` takes them, head first: the free queue
        (``lru``), or the uncached queue then the cached blocks by (priority, release)
        (``compute``). O(num_free log num_free); for tests and debugging."""
        return self._queue.order()

    def occupancy(self) -> tuple[int, ...]:
        """Blocks each group occupies now -- held by a request, or cached and not yet evicted --
        indexed by the group ids ``allocate`` was given. O(groups)."""
        return tuple(self._occupied)

    def num_cached_keys(self) -> int:
        """Number of distinct keys in the cache (primary and prefix keys)."""
        return len(self._index.holders)

    def num_prefix_keys(self) -> int:
        """Prefix keys held beside primary keys (the memory the extending verbs cost). O(blocks with some)."""
        return self._index.num_prefix_keys()

    # --- verbs: references and the free queue (mutate state) ------------------------------------

    @snapshot(lambda self: self.free_order(), name="free_order", tier=SLOW)
    @ensure(
        lambda OLD, self, n, result: result is not None or self.free_order() == OLD.free_order,
        "INV-POOL-ATOMIC: a failed allocate changes nothing",
        tier=SLOW,
    )
    @ensure(
        lambda self, n, result: result is None
        or (len(result) == n == len(set(result)) and all(self._ref[b] == 1 and self._index.key[b] is None and b != NULL_BLOCK for b in result)),
        "INV-POOL-ALLOC-FRESH: allocate returns n distinct real blocks with ref 1 and no key",
        tier=SLOW,
    )
    @ensure(
        lambda OLD, self, n, result: result is None or tuple(result) == OLD.free_order[:n],
        "INV-EVICT-MIN: allocate takes the first n blocks of the free order (lru: the queue head; compute: "
        "uncached first, then the lowest priorities)",
        tier=SLOW,
    )
    @ensure(lambda self: self._check(), "INV-POOL-CONSERVE: whole-pool check after allocate", tier=SLOW)
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
        ref, key, occupied, owner = self._ref, self._index.key, self._occupied, self._group
        while len(occupied) <= group:
            occupied.append(0)
        out = self._queue.pop(n)
        for b in out:
            if ref[b]:
                raise InvariantViolation("INV-POOL-FREE-IFF-UNREF", f"block {b} popped from the free queue has ref count {ref[b]}")
            if key[b] is not None:
                self._index.drop(b)
                self.num_evictions += 1
                occupied[owner[b]] -= 1
            owner[b] = group
            ref[b] = 1
        occupied[group] += n
        self._num_free -= n
        if self.observer is not None:
            self.observer.allocated(out)
        return out

    @snapshot(lambda self, blocks: _count_refs(self, blocks), name="refs", tier=SLOW)
    @ensure(
        lambda OLD, self, blocks: all(self._ref[b] == OLD.refs[b] + c for b, c in Counter(blocks).items() if b != NULL_BLOCK),
        "INV-POOL-REF-NONNEG: touch adds one reference per listed real block",
        tier=SLOW,
    )
    @ensure(lambda self: self._check(), "INV-POOL-CONSERVE: whole-pool check after touch", tier=SLOW)
    def touch(self, blocks: Sequence[int]) -> None:
        """Mutates. Take one more reference on each listed block (a cache hit).

        A ref-0 block (cached, evictable) leaves the free queue. The null block is skipped.
        Touching a free block that has no key is refused: nothing can have hit it, so the caller
        would be reading a block the next ``allocate`` may hand to someone else.
        """
        if not blocks:
            return
        ref, key, nb = self._ref, self._index.key, self._num_blocks
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
        taken = []
        for b in blocks:
            if b == NULL_BLOCK:
                continue
            if ref[b] == 0:  # an evictable cached block: it leaves the free queue
                taken.append(b)
            ref[b] += 1
        if taken:
            self._queue.take(taken)
            self._num_free -= len(taken)
        if self.observer is not None:
            self.observer.touched([b for b in blocks if b != NULL_BLOCK])

    @snapshot(lambda self, blocks: _count_refs(self, blocks), name="refs", tier=SLOW)
    @ensure(
        lambda OLD, self, blocks: all(self._ref[b] == OLD.refs[b] - c for b, c in Counter(blocks).items() if b != NULL_BLOCK),
        "INV-POOL-REF-NONNEG: free drops one reference per listed real block",
        tier=SLOW,
    )
    @ensure(lambda self: self._check(), "INV-POOL-CONSERVE: whole-pool check after free", tier=SLOW)
    def free(self, blocks: Sequence[int], values: Optional[Sequence[float]] = None) -> None:
        """Mutates. Drop one reference per listed block (the null block is skipped).

        Blocks reaching ref 0 join the free queue: uncached ones at the head, as one batch in the
        given order (reused first); cached ones at the tail in the given order (evicted last, LRU).
        Callers pass a request's blocks tail first so its tail is evicted first. Freeing a block
        more times than it is referenced, or an id out of range, raises ValueError naming the
        block and its ref count, and changes nothing.

        Under the compute policy a cached block reaching ref 0 gets priority ``released +
        values[i]`` (its release number plus its value, INV-EVICT-CLOCK) (``values``: one finite
        number >= 0 per listed block, the FLOPs per byte its loss would cost, ``spec.eviction``;
        0 when None) and waits in the eviction heap instead. ``lru`` ignores ``values``.
        """
        if not blocks:
            return
        if values is not None:
            self._require_values(values, blocks, "free")
        ref, nb = self._ref, self._num_blocks
        # Validate everything first (a failed call changes nothing), with C-level loops on the
        # common path: ids in range, every ref > 0, no id listed twice.
        if min(blocks) < 1 or max(blocks) >= nb or 0 in map(ref.__getitem__, blocks) or (
            len(blocks) > 1 and len(set(blocks)) != len(blocks)
        ):
            self._validate_free(blocks)
        key, occupied, owner = self._index.key, self._occupied, self._group
        uncached, cached, worth = [], [], []
        for i, b in enumerate(blocks):
            if b == NULL_BLOCK:
                continue
            r = ref[b] - 1
            ref[b] = r
            if r == 0:
                if key[b] is None:
                    uncached.append(b)
                    occupied[owner[b]] -= 1
                else:
                    cached.append(b)
                    if values is not None:
                        worth.append(values[i])
        self._queue.release(uncached, cached, worth if values is not None else None)
        self._num_free += len(uncached) + len(cached)

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

    @ensure(lambda self: self._check(), "INV-POOL-CONSERVE: whole-pool check after requeue", tier=SLOW)
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
        if values is not None:
            self._require_values(values, blocks, "requeue")
        ref, key = self._ref, self._index.key
        done = 0
        seen: set[int] = set()
        for i, b in enumerate(blocks):
            if ref[b] or key[b] is None or b in seen:
                continue
            seen.add(b)
            self._queue.requeue(b, values[i] if values is not None else 0.0)
            done += 1
        return done

    # --- verbs: keys (mutate state) -------------------------------------------------------------

    @ensure(_the_only_key, "INV-POOL-NO-STALE-PARTIAL: after cache_full the full key is the block's only key", tier=SLOW)
    @ensure(lambda self: self._check(), "INV-POOL-CONSERVE: whole-pool check after cache_full", tier=SLOW)
    def cache_full(self, block: int, key: Key, num_tokens: int) -> bool:
        """Mutates. Name a held block by its full-block key covering ``num_tokens`` tokens; its
        shorter keys (partial entries) are retired (promotion). Returns True if the key was newly
        attached, False if the block already held it. A block already covering ``>= num_tokens``
        tokens under another key is a caller bug: ValueError, no change."""
        return self._attach_full(block, key, num_tokens, self._index.drop, "cache_full")

    @snapshot(_keys_snapshot, name="keys", tier=SLOW)
    @ensure(_every_key_kept, "INV-POOL-PREFIX-KEYS: extend_full keeps every key the block had", tier=SLOW)
    @ensure(
        lambda self, block, key, num_tokens, result: not result or self.keys_of(block)[0] == (key, num_tokens),
        "INV-POOL-NO-STALE-PARTIAL: after extend_full the full key is the block's primary",
        tier=SLOW,
    )
    @ensure(lambda self: self._check(), "INV-POOL-CONSERVE: whole-pool check after extend_full", tier=SLOW)
    def extend_full(self, block: int, key: Key, num_tokens: int) -> bool:
        """Mutates. :meth:`cache_full` for append-only KV: the block's shorter keys stay as prefix
        keys, so a request that diverges inside the block still finds the longest prefix it shares."""
        return self._attach_full(block, key, num_tokens, self._index.demote, "extend_full")

    @_partial_key_contracts("cache_partial")
    def cache_partial(self, block: int, key: Key, num_tokens: int) -> Optional[bool]:
        """Mutates unless refused. Offer a partial (sub-block, hash-aligned) key for a held block.

        Returns True if newly attached (the entry grows forward: the block's keys so far are
        retired), False if the block already holds this key, and None (no change) if the block
        already covers ``>= num_tokens`` tokens under another key: it has outgrown that boundary,
        and attaching it would bring back a retired key (vLLM 0.33, docs/vllm-semantics.md §10.2).
        """
        return self._offer_partial(block, key, num_tokens, self._index.drop, "cache_partial")

    @ensure(_every_key_kept, "INV-POOL-PREFIX-KEYS: extend_partial keeps every key the block had", tier=SLOW)
    @_partial_key_contracts("extend_partial")
    def extend_partial(self, block: int, key: Key, num_tokens: int) -> Optional[bool]:
        """Mutates unless refused. :meth:`cache_partial` for append-only KV: the block's keys so
        far stay as prefix keys. Same results."""
        return self._offer_partial(block, key, num_tokens, self._index.demote, "extend_partial")

    @ensure(_the_only_key, "INV-POOL-NO-STALE-PARTIAL: after replace_key the new key is the block's only key", tier=SLOW)
    @ensure(lambda self: self._check(), "INV-POOL-CONSERVE: whole-pool check after replace_key", tier=SLOW)
    def replace_key(self, block: int, key: Key, num_tokens: int) -> bool:
        """Mutates. Name a held block whose contents were rewritten (a Mamba state at a new
        position) by ``key``: every old key goes, whatever its length. Returns True if newly
        attached, False if the block already holds this key."""
        holders = self._validated_holders(block, key, num_tokens, "replace_key")
        if self._index.holds(block, key, holders):
            return False
        if self._index.key[block] is not None:
            self._index.drop(block)
        self._index.attach(block, key, num_tokens, holders)
        return True

    @snapshot(_keys_snapshot, name="keys", tier=SLOW)
    @ensure(
        lambda OLD, self, block, entries: not entries
        or (set(OLD.keys) <= set(self.keys_of(block)) and self.keys_of(block)[0] == tuple(entries[-1])),
        "INV-POOL-PREFIX-KEYS: grow_keys keeps every key the block had and ends on its last entry",
        tier=SLOW,
    )
    @ensure(lambda self: self._check(), "INV-POOL-CONSERVE: whole-pool check after grow_keys", tier=SLOW)
    def grow_keys(self, block: int, entries: Sequence[tuple[Key, int]]) -> None:
        """Mutates unless it raises. Append-only growth by several hash boundaries at once
        (attention KV written in one step): the same as ``extend_partial(block, key, n)`` for
        each ``(key, n)`` in order -- the last becomes the primary, the block's earlier keys
        prefix keys -- in one call. Each length must exceed the one before and what the block
        covers (a covered boundary is the caller's bug here: INV-POOL-NO-STALE-PARTIAL), and a
        key held elsewhere must name the same length (INV-POOL-KEY-LENGTH); else ValueError and
        no change."""
        if not entries:
            return
        index = self._index
        if not (0 < block < self._num_blocks and self._ref[block] > 0 and entries[0][1] > 0):
            self._reject_uncacheable(block, entries[0][1], "grow_keys")
        covered, holders_map = index.ntok[block], index.holders
        for key, n in entries:  # validate everything first: a failed call changes nothing
            if n <= covered:
                raise ValueError(f"INV-POOL-NO-STALE-PARTIAL: grow_keys of block {block} at {n} tokens, but it already covers {covered}")
            found = holders_map.get(key)
            if found is not None and index.length_of(key, found[0]) != n:
                self._reject_other_length(key, found[0], n, "grow_keys")
            covered = n
        if len(entries) > 1 and len({k for k, _ in entries}) < len(entries):
            raise ValueError(f"INV-POOL-KEY-LENGTH: grow_keys of block {block}: one key given for two lengths")
        if index.key[block] is not None:
            index.demote(block)
        for key, n in entries[:-1]:
            index.add_prefix(block, key, n)
        key, n = entries[-1]
        index.attach(block, key, n, holders_map.get(key))

    @ensure(
        lambda self, src, dst: self._index.key[src] is None and src not in self._index.prefixes and self._index.key[dst] is not None,
        "INV-POOL-KEY-CONSISTENT: the keys moved",
        tier=CHEAP,
    )
    @ensure(lambda self: self._check(), "INV-POOL-CONSERVE: whole-pool check after move_key", tier=SLOW)
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
        if self._index.key[src] is None or self._index.key[dst] is not None:
            raise ValueError(f"move_key: block {src} must have a key and block {dst} none")
        self._index.move(src, dst)

    @ensure(
        lambda self, blocks: all(self._index.key[b] is None and b not in self._index.prefixes for b in blocks),
        "INV-POOL-PREFIX-KEYS: evicted blocks have no key, primary or prefix",
        tier=CHEAP,
    )
    @ensure(lambda self: self._check(), "INV-POOL-CONSERVE: whole-pool check after evict", tier=SLOW)
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
            if self._index.key[b] is not None:
                self._index.drop(b)
                dropped += 1
                if self._ref[b] == 0:  # a free block that no longer caches anything
                    self._occupied[self._group[b]] -= 1
                    self._queue.uncache(b)
        return dropped

    @ensure(
        lambda self, result: result == (self._num_free == self._num_blocks - 1),
        "INV-POOL-RESET-IDLE: reset succeeds exactly when no real block is in use",
        tier=CHEAP,
    )
    @ensure(
        lambda self, result: not result or not self._index.holders,
        "INV-POOL-KEY-CONSISTENT: a successful reset drops every key",
        tier=CHEAP,
    )
    @ensure(lambda self: self._check(), "INV-POOL-RESET-IDLE: whole-pool check after reset", tier=SLOW)
    def reset(self) -> bool:
        """Mutates if it succeeds. Drop every key, but only when no real block is in use
        (INV-POOL-RESET-IDLE); otherwise return False and change nothing. The free-queue order is
        kept."""
        if self._num_free != self._num_blocks - 1:
            return False
        self._queue.forget_keys()
        self._index.clear()
        self._occupied = [0] * len(self._occupied)  # no block is held or cached any more
        if self.observer is not None:
            self.observer.reset()
        return True

    # --- internals -----------------------------------------------------------------------------

    def _attach_full(self, block: int, key: Key, num_tokens: int, retire: Callable[[int], None], verb: str) -> bool:
        """The full-key verbs: ``retire`` says what happens to the block's current primary key."""
        holders = self._validated_holders(block, key, num_tokens, verb)
        index = self._index
        if index.holds(block, key, holders):
            return False
        if index.ntok[block] >= num_tokens:
            raise ValueError(
                f"INV-POOL-NO-STALE-PARTIAL: {verb} of block {block} at {num_tokens} tokens, "
                f"but it already covers {index.ntok[block]} tokens under another key"
            )
        if index.key[block] is not None:
            retire(block)
        index.attach(block, key, num_tokens, holders)
        return True

    def _offer_partial(self, block: int, key: Key, num_tokens: int, retire: Callable[[int], None], verb: str) -> Optional[bool]:
        """The partial-key verbs: a boundary the block already covers is refused (None)."""
        holders = self._validated_holders(block, key, num_tokens, verb)
        index = self._index
        if index.holds(block, key, holders):
            return False
        if index.key[block] is not None:
            if index.ntok[block] >= num_tokens:
                return None
            retire(block)
        index.attach(block, key, num_tokens, holders)
        return True

    def _validated_holders(self, block: int, key: Key, num_tokens: int, verb: str) -> Optional[list[int]]:
        """``key``'s holder list (None if nobody holds it), after checking that ``block`` can be
        keyed and that the key names ``num_tokens`` wherever it is held; ValueError otherwise."""
        if not (0 < block < self._num_blocks and self._ref[block] > 0 and num_tokens > 0):
            self._reject_uncacheable(block, num_tokens, verb)
        holders = self._index.holders.get(key)
        if holders is not None and self._index.length_of(key, holders[0]) != num_tokens:
            self._reject_other_length(key, holders[0], num_tokens, verb)
        return holders

    def _require_in_range(self, block: int, what: str) -> None:
        if not (isinstance(block, int) and 0 <= block < self._num_blocks):
            raise ValueError(f"{what}: block id {block!r} out of range [0, {self._num_blocks})")

    @staticmethod
    def _require_values(values: Sequence[float], blocks: Sequence[int], verb: str) -> None:
        # Common path in C-level loops: min >= 0 and a finite sum mean every value is finite,
        # >= 0 and not NaN; anything else (a NaN, an overflowing sum) takes the exact check.
        if len(values) == len(blocks) and (not values or (min(values) >= 0.0 and sum(values) < math.inf)):
            return
        if len(values) != len(blocks) or not all(0.0 <= v < math.inf for v in values):
            raise ValueError(f"INV-EVICT-VALUE: {verb}: values {list(values)!r} must be one finite number >= 0 per block of {list(blocks)!r}")

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
            f"INV-POOL-KEY-LENGTH: {what}: key already names a {self._index.length_of(key, holder)}-token prefix "
            f"(block {holder}), not {num_tokens} tokens"
        )

    def _check(self) -> bool:
        """Validate the whole pool (slow tier, O(num_blocks + keys)); True or InvariantViolation.

        The state machine calls it after every step; the icontract postconditions call it only
        while the slow switch is on.
        """
        nb, ref, key, ntok = self._num_blocks, self._ref, self._index.key, self._index.ntok
        check(len(ref) == len(key) == len(ntok) == nb, "INV-POOL-CONSERVE", f"per-block arrays have lengths {len(ref)}, {len(key)}, {len(ntok)}; expected {nb}")
        queued = self._queue.check()
        check(len(queued) == self._num_free, "INV-POOL-CONSERVE", f"free counter says {self._num_free} blocks but the queue holds {len(queued)}")
        free = set(queued)
        check(ref[NULL_BLOCK] == 0 and key[NULL_BLOCK] is None and ntok[NULL_BLOCK] == 0 and NULL_BLOCK not in free,
              "INV-POOL-NULL", f"null block has ref {ref[0]}, key {key[0]!r}, ntok {ntok[0]}, in free queue: {NULL_BLOCK in free}")
        for b in range(1, nb):
            check(ref[b] >= 0, "INV-POOL-REF-NONNEG", f"block {b} has ref count {ref[b]}")
            check((b in free) == (ref[b] == 0), "INV-POOL-FREE-IFF-UNREF", f"block {b} has ref count {ref[b]} but in free queue: {b in free}")
        in_use = sum(1 for b in range(1, nb) if ref[b] > 0)
        cached_free = sum(1 for b in free if key[b] is not None)
        check((len(free) - cached_free) + cached_free + in_use + 1 == nb, "INV-POOL-CONSERVE",
              f"free-uncached {len(free) - cached_free} + evictable-cached {cached_free} + in-use {in_use} + null 1 != {nb} blocks")
        self._index.check()
        occupied = [0] * len(self._occupied)
        for b in range(1, nb):
            if ref[b] > 0 or key[b] is not None:
                occupied[self._group[b]] += 1
        check(occupied == self._occupied, "INV-POOL-CONSERVE", f"occupancy per group counted {occupied}, kept {self._occupied}")
        return True
