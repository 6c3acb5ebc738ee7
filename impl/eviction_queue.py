"""The block pool's free blocks, in the order ``allocate`` takes them: one queue per eviction policy.

The pool (``impl/block_pool.py``) keeps reference counts and keys; it tells its queue which
blocks were released, hit, requeued or lost their keys, and asks it for the next ``n`` blocks.
Both queues answer the same calls, so the pool has no policy branch. The policies are
``spec.eviction``'s:

* :class:`LruQueue` (``lru``, vLLM's): one linked list; released uncached blocks go to its head
  (reused first), released cached blocks to its tail (evicted last, least recently released
  first). A block that loses its keys while free stays where it is.
* :class:`ComputeQueue` (``compute``): a linked list of the free uncached blocks, taken first
  (INV-EVICT-UNCACHED-FIRST), then a min-heap of the evictable cached blocks by priority
  ``release number + value`` (INV-EVICT-CLOCK), ties to the earliest released (INV-EVICT-MIN).
  The heap deletes lazily: an entry is live iff ``_live_seq[block]`` is its release number.
"""

from __future__ import annotations

import heapq
from typing import Optional, Protocol, Sequence

from kvproof.impl.free_list import FreeList
from kvproof.spec.contracts import InvariantViolation, check
from kvproof.spec.eviction import COMPUTE, LRU


class EvictionQueue(Protocol):
    """What the pool asks of its free queue. Blocks in it have ref count 0; the pool keeps count."""

    policy: str

    @property
    def released(self) -> int:
        """Cached blocks released (freed or requeued) so far: the compute policy's clock."""

    def priority(self, block: int) -> Optional[float]:
        """The eviction priority of a queued cached block, where the policy has one."""

    def release(self, uncached: list[int], cached: list[int], values: Optional[Sequence[float]]) -> None:
        """Mutates. Blocks whose last reference went: ``uncached`` ones (reused first, in the
        given order) and ``cached`` ones (evictable, in release order; ``values[i]`` is
        ``cached[i]``'s value, None for all 0)."""

    def take(self, blocks: list[int]) -> None:
        """Mutates. Queued cached blocks a cache hit took a reference on leave the queue."""

    def requeue(self, block: int, value: float) -> None:
        """Mutates. A queued cached block counts as released again now."""

    def uncache(self, block: int) -> None:
        """Mutates. A queued block lost its keys (``BlockPool.evict``)."""

    def forget_keys(self) -> None:
        """Mutates. Every queued block lost its keys at once (``BlockPool.reset``); order kept."""

    def pop(self, n: int) -> list[int]:
        """Mutates. Take the next ``n`` blocks (the caller checked that ``n`` are queued)."""

    def order(self) -> tuple[int, ...]:
        """The queued blocks in the order :meth:`pop` takes them. No state change."""

    def check(self) -> list[int]:
        """Validate the queue's own structure; return its blocks (slow tier)."""


def eviction_queue(policy: str, num_blocks: int, keys: list) -> EvictionQueue:
    """The queue of ``policy`` over blocks ``1 .. num_blocks-1``, all queued in id order;
    ``keys`` is the pool's per-block primary key list (None: uncached), read, never written."""
    if policy == COMPUTE:
        return ComputeQueue(num_blocks, keys)
    return LruQueue(num_blocks)


class LruQueue:
    """``lru``: one linked list, uncached blocks pushed at its head and cached ones at its tail."""

    __slots__ = ("_list",)
    policy = LRU
    released = 0  # lru keeps no clock

    def __init__(self, num_blocks: int) -> None:
        self._list = FreeList(num_blocks, range(1, num_blocks))

    def priority(self, block: int) -> None:
        return None

    def release(self, uncached: list[int], cached: list[int], values: Optional[Sequence[float]]) -> None:
        if cached:
            self._list.push_back(cached)
        if uncached:
            self._list.push_front(uncached)

    def take(self, blocks: list[int]) -> None:
        self._list.unlink(blocks)

    def requeue(self, block: int, value: float) -> None:
        self._list.unlink([block])
        self._list.push_back([block])

    def uncache(self, block: int) -> None:
        pass  # it keeps its place: lru orders by release, not by whether a block is keyed

    def forget_keys(self) -> None:
        pass

    def pop(self, n: int) -> list[int]:
        return self._list.pop_front(n)

    def order(self) -> tuple[int, ...]:
        return tuple(self._list.members())

    def check(self) -> list[int]:
        return self._list.check()


class ComputeQueue:
    """``compute``: free uncached blocks in a linked list, then evictable cached ones in a heap."""

    __slots__ = ("_uncached", "_keys", "_heap", "_live_seq", "_prio", "_seq", "_num_live")
    policy = COMPUTE

    def __init__(self, num_blocks: int, keys: list) -> None:
        self._uncached = FreeList(num_blocks, range(1, num_blocks))
        self._keys = keys
        self._heap: list[tuple[float, int, int]] = []  # (priority, release number, block)
        self._live_seq = [-1] * num_blocks  # the release number of the block's live entry, or -1
        self._prio = [0.0] * num_blocks
        self._seq = 0
        self._num_live = 0

    @property
    def released(self) -> int:
        return self._seq

    def priority(self, block: int) -> Optional[float]:
        return self._prio[block] if self._live_seq[block] >= 0 else None

    def release(self, uncached: list[int], cached: list[int], values: Optional[Sequence[float]]) -> None:
        if cached:  # _push per block, inlined: free runs this on every request that ends
            seq, live, prio, heap = self._seq, self._live_seq, self._prio, self._heap
            for i, b in enumerate(cached):
                priority = seq + (values[i] if values is not None else 0.0)
                live[b], prio[b] = seq, priority
                heapq.heappush(heap, (priority, seq, b))
                seq += 1
            self._seq = seq
            self._num_live += len(cached)
            self._compact()
        if uncached:
            self._uncached.push_front(uncached)

    def take(self, blocks: list[int]) -> None:
        for b in blocks:
            self._live_seq[b] = -1  # its heap entry goes stale
        self._num_live -= len(blocks)

    def requeue(self, block: int, value: float) -> None:
        self._num_live -= 1  # the old entry goes stale
        self._push(block, value)

    def uncache(self, block: int) -> None:
        self._live_seq[block] = -1
        self._num_live -= 1
        self._uncached.push_back([block])

    def forget_keys(self) -> None:
        live = self._live_seq
        cached = [b for _, b in sorted((live[b], b) for b in range(len(live)) if live[b] >= 0)]  # in release order
        for b in cached:
            live[b] = -1
        self._uncached.push_back(cached)
        self._heap.clear()
        self._num_live = 0

    def pop(self, n: int) -> list[int]:
        keys = self._keys
        out = self._uncached.pop_front(n)
        if list(map(keys.__getitem__, out)).count(None) != len(out):  # C-level loops on the common path
            b = next(b for b in out if keys[b] is not None)
            raise InvariantViolation("INV-EVICT-UNCACHED-FIRST", f"block {b} in the uncached queue has key {keys[b]!r}")
        heap, live = self._heap, self._live_seq
        while len(out) < n:
            prio, seq, b = heapq.heappop(heap)
            if live[b] != seq:
                continue  # stale: touched, evicted or reset since it was pushed
            if keys[b] is None:
                raise InvariantViolation("INV-POOL-FREE-IFF-UNREF", f"evictable block {b} has no key")
            if prio < seq:
                raise InvariantViolation("INV-EVICT-CLOCK", f"block {b}'s priority {prio} is below its release number {seq}")
            live[b] = -1
            self._num_live -= 1
            out.append(b)
        return out

    def order(self) -> tuple[int, ...]:
        live = self._live_seq
        return tuple(self._uncached.members()) + tuple(b for _, _, b in sorted(e for e in self._heap if live[e[2]] == e[1]))

    def check(self) -> list[int]:
        keys, live_seq = self._keys, self._live_seq
        members = self._uncached.check()
        for b in members:
            check(keys[b] is None, "INV-EVICT-UNCACHED-FIRST", f"cached block {b} is in the uncached queue")
        live = {e[2]: e for e in self._heap if live_seq[e[2]] == e[1]}
        marked = {b for b in range(len(live_seq)) if live_seq[b] >= 0}
        check(set(live) == marked and len(live) == self._num_live and not marked & set(members), "INV-POOL-CONSERVE",
              f"{len(live)} live heap entries, {len(marked)} blocks marked, counter {self._num_live}")
        for b, (prio, _, _) in live.items():
            check(keys[b] is not None, "INV-POOL-FREE-IFF-UNREF", f"evictable block {b} has no key")
            check(prio == self._prio[b] and prio >= live_seq[b], "INV-EVICT-CLOCK",
                  f"block {b}'s priority {prio} is below its release number {live_seq[b]}")
        return members + list(live)

    def _push(self, block: int, value: float) -> None:
        """``block`` waits in the heap with priority its release number plus ``value``; stale
        entries are dropped once they outnumber the live ones."""
        seq = self._seq
        self._seq = seq + 1
        priority = seq + value
        self._live_seq[block] = seq
        self._prio[block] = priority
        self._num_live += 1
        heapq.heappush(self._heap, (priority, seq, block))
        self._compact()

    def _compact(self) -> None:
        """Drop the stale heap entries once they outnumber the live ones."""
        heap = self._heap
        if len(heap) > 2 * self._num_live + 64:
            live = self._live_seq
            self._heap = [e for e in heap if live[e[2]] == e[1]]
            heapq.heapify(self._heap)
