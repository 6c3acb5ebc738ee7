"""Abstract model of the prefix-cache block pool: pure functions on a frozen state.

This is the obviously-correct reference that ``kvproof.impl.block_pool.BlockPool`` is checked
against (tests/impl/test_block_pool_machine.py drives both in lockstep). Every operation is a
pure function ``op(state, ...) -> (new_state, result)``; nothing here mutates.

Vocabulary
----------
* Block ids are ints in ``[0, num_blocks)``. Block 0 is the null block: never handed out, cached,
  touched or freed (touch/free skip it, caching rejects it). ``-1`` is never a block id.
* A key is any hashable. In kvproof it is ``(fine_hash_at_N, group_id)`` (``impl.hashing.key_at``);
  the model never looks inside it.
* **A primary key per block.** A block whose contents are the prefix ``[0, N)`` of some request is
  named by one primary key, and the pool records ``N`` (``ntok``) with it. Several blocks may hold
  the same key (nothing is deduplicated); a lookup returns the block that has held it longest.
* **Prefix keys, on request.** Attention KV is append-only: a block that holds ``[0, N)`` also holds
  every shorter prefix it held before. A caller that says so (``keep_prefixes``) keeps the keys its
  block had as *prefix keys* when the block grows, so a request that diverges inside the block can
  still hit the longest prefix it shares (vLLM 0.33 keeps such keys as "aliases" by accident,
  with stale ones among them, docs/vllm-semantics.md §10.2). Without ``keep_prefixes`` (a Mamba
  state, which summarises one length) growing retires every older key. Either way a key is added only above
  what the block covers (a boundary it has outgrown is refused), so no retired key comes back
  (INV-POOL-NO-STALE-PARTIAL), and all of a block's keys leave together (INV-POOL-PREFIX-KEYS).
* The free queue holds every real block with ref count 0, head first. ``allocate`` pops from the
  head and drops the popped block's key (eviction). ``free`` puts keyless blocks at the head (as
  one batch, in the order given, so they are reused first) and cached blocks at the tail (LRU).

Invariant ids used here: INV-POOL-NULL, INV-POOL-REF-NONNEG, INV-POOL-FREE-IFF-UNREF,
INV-POOL-CONSERVE, INV-POOL-KEY-CONSISTENT, INV-POOL-KEY-LENGTH, INV-POOL-NO-STALE-PARTIAL,
INV-POOL-PREFIX-KEYS, INV-POOL-ATOMIC, INV-POOL-ALLOC-FRESH, INV-POOL-HELD-TO-CACHE,
INV-POOL-RESET-IDLE; the eviction policy's INV-EVICT-UNCACHED-FIRST, INV-EVICT-MIN,
INV-EVICT-CLOCK, INV-EVICT-VALUE (``spec.eviction``)
(docs/spec.md, the block-pool and eviction sections).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass
from typing import Hashable, Optional, Sequence

import icontract

from kvproof.spec.eviction import COMPUTE, LRU, POLICIES, victims

NULL_BLOCK = 0

Key = Hashable


@dataclass(frozen=True)
class PoolState:
    """The pool's whole abstract state; index ``b`` of each tuple describes block ``b``.

    ``key[b]`` is the primary key naming block b's contents (None: uncached), ``ntok[b]`` the
    prefix length that key covers (0 iff uncached) and ``stamp[b]`` the logical time it was
    attached, which orders the holders of a key (the oldest is what a lookup returns).
    ``prefixes[b]`` holds b's prefix keys as ``(key, ntok, stamp)``, shortest first. ``free`` is
    the free queue, head first. ``clock`` is the next stamp.
    """

    ref: tuple[int, ...]
    key: tuple[Optional[Key], ...]
    ntok: tuple[int, ...]
    stamp: tuple[int, ...]
    free: tuple[int, ...]
    clock: int = 0
    prefixes: tuple[tuple[tuple[Key, int, int], ...], ...] = ()
    #: The eviction policy (``spec.eviction``). Under ``compute`` the free queue is the uncached
    #: run then the cached run (in release order), ``prio[b]`` is cached free block b's
    #: priority -- its release number (``released`` counts cached blocks released so far) plus
    #: the value its release gave it.
    policy: str = LRU
    prio: tuple[float, ...] = ()
    released: int = 0

    @property
    def num_blocks(self) -> int:
        return len(self.ref)


# --- invariants (each returns a bool so icontract and the state machine can use it) -----------


def null_block_inert(s: PoolState) -> bool:
    """INV-POOL-NULL: block 0 has ref 0, no key and is never in the free queue."""
    return s.ref[0] == 0 and s.key[0] is None and s.ntok[0] == 0 and NULL_BLOCK not in s.free


def refs_nonnegative(s: PoolState) -> bool:
    """INV-POOL-REF-NONNEG: no ref count is negative."""
    return all(r >= 0 for r in s.ref)


def free_iff_unreferenced(s: PoolState) -> bool:
    """INV-POOL-FREE-IFF-UNREF: a real block is in the free queue (once) iff its ref count is 0."""
    return len(set(s.free)) == len(s.free) and set(s.free) == {
        b for b in range(1, s.num_blocks) if s.ref[b] == 0
    }


def conserved(s: PoolState) -> bool:
    """INV-POOL-CONSERVE: free-uncached + evictable-cached + in-use + null == num_blocks."""
    free_uncached = sum(1 for b in s.free if s.key[b] is None)
    evictable_cached = sum(1 for b in s.free if s.key[b] is not None)
    in_use = sum(1 for b in range(1, s.num_blocks) if s.ref[b] > 0)
    return free_uncached + evictable_cached + in_use + 1 == s.num_blocks


def keys_consistent(s: PoolState) -> bool:
    """INV-POOL-KEY-CONSISTENT: a block has a key iff it records a positive ntok; stamps are in the past."""
    return all(
        (s.key[b] is None) == (s.ntok[b] == 0) and s.ntok[b] >= 0 and s.stamp[b] < max(s.clock, 1)
        for b in range(s.num_blocks)
    )


def entries(s: PoolState, b: int) -> tuple[tuple[Key, int, int], ...]:
    """Every key of block b as ``(key, ntok, stamp)``: its prefix keys, then its primary."""
    if s.key[b] is None:
        return ()
    return s.prefixes[b] + ((s.key[b], s.ntok[b], s.stamp[b]),)


def key_lengths_agree(s: PoolState) -> bool:
    """INV-POOL-KEY-LENGTH: every holder of a key records the same prefix length for it."""
    length: dict[Key, int] = {}
    for b in range(s.num_blocks):
        for k, n, _ in entries(s, b):
            if length.setdefault(k, n) != n:
                return False
    return True


def prefix_keys_nest(s: PoolState) -> bool:
    """INV-POOL-PREFIX-KEYS: prefix keys exist only beside a primary key, name strictly shorter
    prefixes of distinct lengths (and distinct keys), and were attached in the past."""
    for b in range(s.num_blocks):
        extra = s.prefixes[b]
        if s.key[b] is None and extra:
            return False
        lengths = [n for _, n, _ in extra]
        if lengths != sorted(set(lengths)) or any(n >= s.ntok[b] or n <= 0 for n in lengths):
            return False
        if len({k for k, _, _ in extra} | {s.key[b]}) != len(extra) + 1 or any(t >= s.clock for _, _, t in extra):
            return False
    return True


def compute_queue_ordered(s: PoolState) -> bool:
    """INV-EVICT-UNCACHED-FIRST: under ``compute`` no free uncached block follows a cached one
    in the queue."""
    if s.policy != COMPUTE:
        return True
    cached = [s.key[b] is not None for b in s.free]
    return cached == sorted(cached)


def well_formed(s: PoolState) -> bool:
    """All whole-state invariants at once."""
    return (
        s.policy in POLICIES
        and (len(s.prio) == len(s.ref) or (s.policy == LRU and not s.prio))
        and compute_queue_ordered(s)
        and         len(s.ref) == len(s.key) == len(s.ntok) == len(s.stamp) == len(s.prefixes)
        and null_block_inert(s)
        and refs_nonnegative(s)
        and free_iff_unreferenced(s)
        and conserved(s)
        and keys_consistent(s)
        and key_lengths_agree(s)
        and prefix_keys_nest(s)
    )


# --- queries (no state change) ---------------------------------------------------------------


def holders(s: PoolState, key: Key) -> tuple[int, ...]:
    """The blocks holding ``key`` (as their primary or a prefix key), oldest first."""
    held = [(t, b) for b in range(s.num_blocks) for k, _, t in entries(s, b) if k == key]
    return tuple(b for _, b in sorted(held))


def keys_of(s: PoolState, b: int) -> tuple[tuple[Key, int], ...]:
    """Block b's keys with their lengths, longest (the primary) first."""
    return tuple((k, n) for k, n, _ in reversed(entries(s, b)))


def lookup(s: PoolState, key: Key) -> Optional[int]:
    """The block a cache hit on ``key`` returns (the oldest holder), or None on a miss."""
    found = holders(s, key)
    return found[0] if found else None


def num_free(s: PoolState) -> int:
    return len(s.free)


def _is_real(s: PoolState, b: int) -> bool:
    return isinstance(b, int) and 0 < b < s.num_blocks


def _in_range(s: PoolState, b: int) -> bool:
    return isinstance(b, int) and 0 <= b < s.num_blocks


def _replace(t: tuple, index: int, value: object) -> tuple:
    return t[:index] + (value,) + t[index + 1 :]


# --- operations (pure: each returns a new state) ---------------------------------------------


@icontract.require(lambda num_blocks: num_blocks >= 1, error=lambda num_blocks: ValueError(f"num_blocks {num_blocks} must be >= 1 (block 0 is the null block)"), enabled=True)
@icontract.require(lambda policy: policy in POLICIES, error=lambda policy: ValueError(f"eviction policy {policy!r} must be one of {', '.join(POLICIES)}"), enabled=True)
@icontract.ensure(lambda result: well_formed(result), "INV-POOL-CONSERVE: the initial pool is well formed", enabled=True)
def initial(num_blocks: int, policy: str = LRU) -> PoolState:
    """A pool of ``num_blocks`` blocks; blocks 1..num_blocks-1 are free, in id order."""
    zeros = (0,) * num_blocks
    return PoolState(ref=zeros, key=(None,) * num_blocks, ntok=zeros, stamp=zeros, free=tuple(range(1, num_blocks)),
                     prefixes=((),) * num_blocks, policy=policy, prio=(0.0,) * num_blocks)


@icontract.require(lambda n: isinstance(n, int) and n >= 0, error=lambda n: ValueError(f"allocate: block count {n} must be an int >= 0"), enabled=True)
@icontract.ensure(
    lambda s, n, result: result is None if n > len(s.free) else len(result[1]) == n,
    "INV-POOL-ATOMIC: allocate(n) with n > num_free fails (None) and changes nothing",
    enabled=True,
)
@icontract.ensure(
    lambda result: result is None
    or all(result[0].ref[b] == 1 and result[0].key[b] is None and b != NULL_BLOCK for b in result[1]),
    "INV-POOL-ALLOC-FRESH: allocated blocks are real, have ref 1 and no key",
    enabled=True,
)
@icontract.ensure(
    lambda s, result: result is None or s.policy != COMPUTE
    or all(s.key[b] is None for b in result[1]) or all(s.key[b] is not None for b in s.free if b not in result[1]),
    "INV-EVICT-UNCACHED-FIRST: compute evicts a cached block only when no free uncached block is left",
    enabled=True,
)
@icontract.ensure(
    lambda s, result: result is None or s.policy != COMPUTE
    or max([-math.inf] + [s.prio[b] for b in result[1] if s.key[b] is not None])
    <= min([math.inf] + [s.prio[b] for b in s.free if s.key[b] is not None and b not in result[1]]),
    "INV-EVICT-MIN: compute evicts no block of higher priority than one it keeps",
    enabled=True,
)
@icontract.ensure(lambda result: result is None or well_formed(result[0]), "INV-POOL-CONSERVE: allocate keeps the pool well formed", enabled=True)
def allocate(s: PoolState, n: int) -> Optional[tuple[PoolState, tuple[int, ...]]]:
    """Take ``n`` free blocks, evicting their keys; None if fewer are free. ``lru``: the queue's
    head. ``compute``: :func:`kvproof.spec.eviction.victims`."""
    if n > len(s.free):
        return None
    if s.policy == COMPUTE:
        cached = {b for b in s.free if s.key[b] is not None}
        taken = victims(s.free, cached, {b: s.prio[b] for b in cached}, n)
        chosen = set(taken)
        rest = tuple(b for b in s.free if b not in chosen)
    else:
        taken = s.free[:n]
        rest = s.free[n:]
    ref, key, ntok, prefixes = list(s.ref), list(s.key), list(s.ntok), list(s.prefixes)
    for b in taken:
        ref[b], key[b], ntok[b], prefixes[b] = 1, None, 0, ()
    return dataclasses.replace(s, ref=tuple(ref), key=tuple(key), ntok=tuple(ntok), free=rest, prefixes=tuple(prefixes)), taken


@icontract.require(
    lambda s, blocks: all(_in_range(s, b) for b in blocks),
    error=lambda s, blocks: ValueError(f"touch: block ids {list(blocks)} must lie in [0, {s.num_blocks})"),
    enabled=True,
)
@icontract.require(
    lambda s, blocks: not all(_in_range(s, b) for b in blocks)
    or all(b == NULL_BLOCK or s.ref[b] > 0 or s.key[b] is not None for b in blocks),
    error=lambda s, blocks: ValueError(f"INV-POOL-FREE-IFF-UNREF: touch of a free block without a key in {list(blocks)}"),
    enabled=True,
)
@icontract.ensure(lambda result: well_formed(result), "INV-POOL-CONSERVE: touch keeps the pool well formed", enabled=True)
def touch(s: PoolState, blocks: Sequence[int]) -> PoolState:
    """Take one more reference on each block (a cache hit); a ref-0 block leaves the free queue."""
    ref = list(s.ref)
    free = list(s.free)
    for b in blocks:
        if b == NULL_BLOCK:
            continue
        if ref[b] == 0:
            free.remove(b)
        ref[b] += 1
    return dataclasses.replace(s, ref=tuple(ref), free=tuple(free))


@icontract.require(
    lambda s, blocks: all(_in_range(s, b) for b in blocks),
    error=lambda s, blocks: ValueError(f"free: block ids {list(blocks)} must lie in [0, {s.num_blocks})"),
    enabled=True,
)
@icontract.require(
    lambda s, blocks: not all(_in_range(s, b) for b in blocks)
    or all(s.ref[b] >= c for b, c in Counter(b for b in blocks if b != NULL_BLOCK).items()),
    error=lambda s, blocks: ValueError(f"INV-POOL-REF-NONNEG: free of {list(blocks)} would drive a ref count negative"),
    enabled=True,
)
@icontract.require(
    lambda blocks, values: values is None or (len(values) == len(blocks) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in values)),
    error=lambda blocks, values: ValueError(f"INV-EVICT-VALUE: free: values {values!r} must be one finite number >= 0 per block of {list(blocks)}"),
    enabled=True,
)
@icontract.ensure(lambda result: well_formed(result), "INV-POOL-CONSERVE: free keeps the pool well formed", enabled=True)
def free(s: PoolState, blocks: Sequence[int], values: Optional[Sequence[float]] = None) -> PoolState:
    """Drop one reference per listed block; blocks reaching 0 join the free queue.

    Uncached ones go to the head as one batch in the given order (reused first); cached ones go to
    the tail in the given order (evicted last-freed-last, i.e. LRU). Under ``compute`` a cached
    block released gets priority ``released + values[i]`` (INV-EVICT-CLOCK; values 0 when none
    are given), ``released`` counting up by one per cached block released.
    """
    ref = list(s.ref)
    uncached: list[int] = []
    cached: list[tuple[int, float]] = []
    for i, b in enumerate(blocks):
        if b == NULL_BLOCK:
            continue
        ref[b] -= 1
        if ref[b] == 0:
            if s.key[b] is None:
                uncached.append(b)
            else:
                cached.append((b, values[i] if values is not None else 0.0))
    if s.policy == COMPUTE:
        prio = list(s.prio)
        for i, (b, v) in enumerate(cached):
            prio[b] = s.released + i + v
        return dataclasses.replace(s, ref=tuple(ref), prio=tuple(prio), free=tuple(uncached) + s.free + tuple(b for b, _ in cached),
                                   released=s.released + len(cached))
    return dataclasses.replace(s, ref=tuple(ref), free=tuple(uncached) + s.free + tuple(b for b, _ in cached))


def _cacheable(s: PoolState, b: int) -> bool:
    return _is_real(s, b) and s.ref[b] > 0


def _length_agrees(s: PoolState, key: Key, n: int) -> bool:
    return all(length == n for b in range(s.num_blocks) for k, length, _ in entries(s, b) if k == key)


def _holds(s: PoolState, b: int, key: Key) -> bool:
    return any(k == key for k, _, _ in entries(s, b))


def _attach(s: PoolState, b: int, key: Key, n: int, keep_prefixes: bool) -> PoolState:
    """Name b by ``key`` covering ``n`` tokens; b's keys so far become prefix keys (keep) or are
    retired."""
    kept = entries(s, b) if keep_prefixes else ()
    return dataclasses.replace(
        s, key=_replace(s.key, b, key), ntok=_replace(s.ntok, b, n), stamp=_replace(s.stamp, b, s.clock), clock=s.clock + 1,
        prefixes=_replace(s.prefixes, b, kept),
    )


_CACHE_PRECONDITIONS = (
    icontract.require(
        lambda s, block: _cacheable(s, block),
        error=lambda s, block: ValueError(
            f"INV-POOL-HELD-TO-CACHE: block {block} must be a real block ([1, {s.num_blocks})) with ref > 0"
        ),
        enabled=True,
    ),
    icontract.require(
        lambda num_tokens: isinstance(num_tokens, int) and num_tokens > 0,
        error=lambda num_tokens: ValueError(f"cache: num_tokens {num_tokens} must be an int > 0"),
        enabled=True,
    ),
    icontract.require(
        lambda s, key, num_tokens: not (isinstance(num_tokens, int) and num_tokens > 0) or _length_agrees(s, key, num_tokens),
        error=lambda s, key, num_tokens: ValueError(
            f"INV-POOL-KEY-LENGTH: key already names a prefix of a different length than {num_tokens}"
        ),
        enabled=True,
    ),
)


def _with_cache_preconditions(fn):
    # icontract does not promise an order among preconditions, so each one guards its own domain.
    for decorator in reversed(_CACHE_PRECONDITIONS):
        fn = decorator(fn)
    return fn


@_with_cache_preconditions
@icontract.require(
    lambda s, block, key, num_tokens: not _cacheable(s, block) or not isinstance(num_tokens, int)
    or _holds(s, block, key) or s.ntok[block] < num_tokens,
    error=lambda s, block, num_tokens: ValueError(
        f"INV-POOL-NO-STALE-PARTIAL: block {block} already covers {s.ntok[block]} tokens; "
        f"a full key at {num_tokens} would go backwards"
    ),
    enabled=True,
)
@icontract.ensure(
    lambda s, block, key, num_tokens, result: not result[1]
    or (result[0].key[block] == key and result[0].ntok[block] == num_tokens),
    "INV-POOL-NO-STALE-PARTIAL: after cache_full the block's primary key is the full key",
    enabled=True,
)
@icontract.ensure(lambda result: well_formed(result[0]), "INV-POOL-CONSERVE: cache_full keeps the pool well formed", enabled=True)
def cache_full(s: PoolState, block: int, key: Key, num_tokens: int, keep_prefixes: bool = False) -> tuple[PoolState, bool]:
    """Name a held block by its full-block key (promotion): its shorter keys become prefix keys
    with ``keep_prefixes``, else they are retired.

    Returns ``(state, True)`` when the key was newly attached, ``(s, False)`` when already there.
    """
    if _holds(s, block, key):
        return s, False
    return _attach(s, block, key, num_tokens, keep_prefixes), True


@_with_cache_preconditions
@icontract.ensure(
    lambda s, result: result[1] is not None or result[0] == s,
    "INV-POOL-ATOMIC: a refused cache_partial changes nothing",
    enabled=True,
)
@icontract.ensure(
    lambda s, block, key, num_tokens, replace, result: result[1] is not None
    or (not replace and not _holds(s, block, key) and s.ntok[block] >= num_tokens),
    "INV-POOL-NO-STALE-PARTIAL: cache_partial refuses exactly a boundary the block already covers",
    enabled=True,
)
@icontract.ensure(lambda result: well_formed(result[0]), "INV-POOL-CONSERVE: cache_partial keeps the pool well formed", enabled=True)
@icontract.require(
    lambda replace, keep_prefixes: not (replace and keep_prefixes),
    error=lambda: ValueError("cache_partial: replace (a rewritten state) and keep_prefixes (append-only) exclude each other"),
    enabled=True,
)
def cache_partial(
    s: PoolState, block: int, key: Key, num_tokens: int, replace: bool = False, keep_prefixes: bool = False
) -> tuple[PoolState, Optional[bool]]:
    """Offer a partial (sub-block, hash-aligned) key for a held block.

    Result: True newly attached (the entry grows forward: the block's keys so far become prefix
    keys with ``keep_prefixes``, else they are retired), False already attached, None refused
    because the block already covers ``>= num_tokens`` tokens under another key (attaching it
    would bring back a retired boundary: the vLLM 0.33 alias bug, docs/vllm-semantics.md §10.2).
    ``replace=True`` (a rewritten Mamba state) retires every key and attaches regardless of the
    length the block covered before.
    """
    if _holds(s, block, key):
        return s, False
    if not replace and s.ntok[block] >= num_tokens:
        return s, None
    return _attach(s, block, key, num_tokens, keep_prefixes), True


def grow_keys(s: PoolState, block: int, entries: Sequence[tuple[Key, int]]) -> PoolState:
    """Append-only growth by several boundaries in one call (attention KV written in one step):
    ``cache_partial(..., keep_prefixes=True)`` for each ``(key, n)`` in order, every one newly
    attached. A boundary the block already covers is the caller's bug here (ValueError naming
    INV-POOL-NO-STALE-PARTIAL), as is any input ``cache_partial`` rejects; a failed call leaves
    ``s`` as it was (pure)."""
    out = s
    for key, n in entries:
        if _in_range(out, block) and out.ntok[block] >= n:
            raise ValueError(f"INV-POOL-NO-STALE-PARTIAL: grow_keys of block {block} at {n} tokens, "
                             f"but it already covers {out.ntok[block]}")
        out, attached = cache_partial(out, block, key, n, False, True)
    return out


@icontract.require(
    lambda s, blocks: all(_is_real(s, b) for b in blocks),
    error=lambda s, blocks: ValueError(f"evict: block ids {list(blocks)} must lie in [1, {s.num_blocks})"),
    enabled=True,
)
@icontract.ensure(
    lambda blocks, result: all(result.key[b] is None and not result.prefixes[b] for b in blocks),
    "INV-POOL-PREFIX-KEYS: evicted blocks have no key, primary or prefix",
    enabled=True,
)
@icontract.ensure(lambda result: well_formed(result), "INV-POOL-CONSERVE: evict keeps the pool well formed", enabled=True)
def evict(s: PoolState, blocks: Sequence[int]) -> PoolState:
    """Drop every key of each listed block; ref counts and the free queue are unchanged."""
    key, ntok, prefixes = list(s.key), list(s.ntok), list(s.prefixes)
    for b in blocks:
        key[b], ntok[b], prefixes[b] = None, 0, ()
    free = s.free
    if s.policy == COMPUTE:  # a free block that lost its key ends the uncached run
        moved = [b for b in dict.fromkeys(blocks) if s.key[b] is not None and s.ref[b] == 0]
        if moved:
            rest = [b for b in s.free if b not in moved]
            cut = next((i for i, b in enumerate(rest) if s.key[b] is not None and b not in moved), len(rest))
            free = tuple(rest[:cut] + moved + rest[cut:])
    return dataclasses.replace(s, key=tuple(key), ntok=tuple(ntok), free=free, prefixes=tuple(prefixes))


@icontract.require(
    lambda s, blocks: all(_is_real(s, b) for b in blocks),
    error=lambda s, blocks: ValueError(f"requeue: block ids {list(blocks)} must lie in [1, {s.num_blocks})"),
    enabled=True,
)
@icontract.require(
    lambda blocks, values: values is None or (len(values) == len(blocks) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in values)),
    error=lambda blocks, values: ValueError(f"INV-EVICT-VALUE: requeue: values {values!r} must be one finite number >= 0 per block of {list(blocks)}"),
    enabled=True,
)
@icontract.ensure(lambda s, result: set(result.free) == set(s.free), "INV-POOL-FREE-IFF-UNREF: requeue moves blocks within the free queue", enabled=True)
@icontract.ensure(lambda result: well_formed(result), "INV-POOL-CONSERVE: requeue keeps the pool well formed", enabled=True)
def requeue(s: PoolState, blocks: Sequence[int], values: Optional[Sequence[float]] = None) -> PoolState:
    """Count each listed evictable cached block as released again now, in the given order: it
    moves to the tail of the free queue, and under ``compute`` gets priority ``released +
    value`` (as if freed now). Blocks that are held, uncached, or listed before are skipped."""
    moved: dict[int, float] = {}
    for i, b in enumerate(blocks):
        if s.ref[b] == 0 and s.key[b] is not None and b not in moved:
            moved[b] = values[i] if values is not None else 0.0
    free = tuple(b for b in s.free if b not in moved) + tuple(moved)
    if s.policy != COMPUTE:
        return dataclasses.replace(s, free=free)
    prio = list(s.prio)
    for i, (b, v) in enumerate(moved.items()):
        prio[b] = s.released + i + v
    return dataclasses.replace(s, free=free, prio=tuple(prio), released=s.released + len(moved))


@icontract.ensure(
    lambda s, result: result[1] == all(r == 0 for r in s.ref),
    "INV-POOL-RESET-IDLE: reset succeeds exactly when no real block is in use",
    enabled=True,
)
@icontract.ensure(lambda s, result: result[1] or result[0] == s, "INV-POOL-ATOMIC: a refused reset changes nothing", enabled=True)
@icontract.ensure(lambda result: not result[1] or all(k is None for k in result[0].key), "INV-POOL-KEY-CONSISTENT: reset drops every key", enabled=True)
def reset(s: PoolState) -> tuple[PoolState, bool]:
    """Drop every key if no block is in use (free-queue order kept); otherwise refuse (False)."""
    if any(r > 0 for r in s.ref):
        return s, False
    n = s.num_blocks
    return dataclasses.replace(s, key=(None,) * n, ntok=(0,) * n, prefixes=((),) * n), True


@icontract.require(
    lambda s, src, dst: _cacheable(s, src) and _cacheable(s, dst) and src != dst,
    error=lambda s, src, dst: ValueError(f"INV-POOL-HELD-TO-CACHE: move_key needs two distinct held real blocks, got {src} -> {dst}"),
    enabled=True,
)
@icontract.require(
    lambda s, src, dst: not (_in_range(s, src) and _in_range(s, dst)) or (s.key[src] is not None and s.key[dst] is None),
    error=lambda s, src, dst: ValueError(f"move_key: block {src} must have a key and block {dst} none"),
    enabled=True,
)
@icontract.ensure(
    lambda s, src, dst, result: entries(result, dst) == entries(s, src) and result.key[src] is None
    and not result.prefixes[src],
    "INV-POOL-KEY-CONSISTENT: every key of src moved to dst",
    enabled=True,
)
@icontract.ensure(lambda result: well_formed(result), "INV-POOL-CONSERVE: move_key keeps the pool well formed", enabled=True)
def move_key(s: PoolState, src: int, dst: int) -> PoolState:
    """Move src's keys (with their lengths and ages) to dst: the running Mamba owner keeps writing
    src, whose cached contents now live in the copy dst."""
    key = _replace(_replace(s.key, dst, s.key[src]), src, None)
    ntok = _replace(_replace(s.ntok, dst, s.ntok[src]), src, 0)
    stamp = _replace(s.stamp, dst, s.stamp[src])
    prefixes = _replace(_replace(s.prefixes, dst, s.prefixes[src]), src, ())
    return dataclasses.replace(s, key=key, ntok=ntok, stamp=stamp, prefixes=prefixes)
