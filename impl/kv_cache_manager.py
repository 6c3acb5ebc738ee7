"""The KV-cache manager: the verbs a scheduler uses, over the hybrid coordinator.

Step protocol (docs/coordinator.md)::

    begin_step()                      # drops references kept for the previous step's copies
    lookup(req) -> Hit                # on arrival; no state change
    allocate_slots(req, n, hit)       # atomic: blocks for n more tokens, or None and no change
    take_block_copies()               # the step's copies, run on every rank before the forward
    ... forward pass ...
    cache(req)                        # key what the step computed
    free(req)                         # finished or preempted

Keys are added only after the forward pass has written the blocks (``cache``), so every key a
lookup can see names contents that exist when the step begins; copies therefore never read a
block this step writes, and never chain (INV-COW-SOURCE-READY, checked per copy).
"""

from __future__ import annotations

from typing import Iterator, Optional

from kvproof.impl.block_pool import BlockPool
from kvproof.impl.coordinator import Hit, HybridCoordinator
from kvproof.impl.eviction import EvictionValuer
from kvproof.impl.key_log import KeyLog
from kvproof.impl.managers import FullAttentionManager, MambaManager
from kvproof.impl.request import Request
from kvproof.spec.contracts import InvariantViolation
from kvproof.spec.eviction import COMPUTE
from kvproof.spec.layout import Layout


class KVCacheManager:
    def __init__(self, layout: Layout, num_blocks: int, use_eagle: bool = False, key_log: Optional[KeyLog] = None) -> None:
        """``key_log``: where the pool records the keys it attaches and drops (a host reporting
        them, ``impl/key_log.py``); None records nothing."""
        self.layout = layout
        self.pool = BlockPool(num_blocks, policy=layout.config.eviction, key_log=key_log)
        #: The compute policy's valuer (None under lru: releases carry no values).
        self.valuer = EvictionValuer(layout, num_blocks) if layout.config.eviction == COMPUTE else None
        self.coordinator = HybridCoordinator(layout, self.pool, use_eagle=use_eagle, valuer=self.valuer)
        self.managers = self.coordinator.managers
        self._mamba_managers = [m for m in self.managers if isinstance(m, MambaManager)]
        self._step = 0
        self._in_flight: set[str] = set()  # allocated this step, not yet cached
        self._max_model_len = layout.config.max_model_len
        self.num_copies = 0

    @property
    def step(self) -> int:
        return self._step

    # --- what the scheduler and replay read (the facade is their only door) ---------------------

    @property
    def alignment(self) -> int:
        """The cache-hit alignment A: every hit length is a multiple of it."""
        return self.coordinator.alignment

    @property
    def hash_block_size(self) -> int:
        """H: tokens per hash block (a key names a prefix of a multiple of H tokens)."""
        return self.layout.hash_block_size

    @property
    def use_eagle(self) -> bool:
        return self.coordinator.use_eagle

    @property
    def exact_junction(self) -> bool:
        """Whether junction states are kept at the exact junction (``shared_prefix_checkpoint``
        in effect) rather than block-floored."""
        return self.coordinator.exact_junction

    @property
    def num_blocks(self) -> int:
        """Pool size, the null block included."""
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free uncached plus evictable cached)."""
        return self.pool.num_free

    @property
    def num_evictions(self) -> int:
        """Cached blocks evicted so far."""
        return self.pool.num_evictions

    def occupancy(self) -> tuple[int, ...]:
        """Blocks each group occupies now (held, or cached and not evicted)."""
        return self.pool.occupancy()

    # --- queries --------------------------------------------------------------------------------

    def lookup(self, request: Request, bound: Optional[int] = None) -> Hit:
        """The prefix-cache hit for a waiting request: at most ``num_tokens - 1`` tokens (one
        must be computed to sample) -- or at most ``bound`` -- at most the hashed length, a
        multiple of the cache-hit alignment (INV-HIT-BOUND). No state change."""
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int) or bound < 0):
            raise ValueError(f"request {request.request_id!r}: bound {bound!r} must be None or an int >= 0")
        limit = request.num_tokens - 1 if bound is None else min(bound, request.num_tokens - 1)
        hit = self.coordinator.find_longest_hit(request, limit)
        n = hit.num_tokens
        if n % self.coordinator.alignment or n > limit or n > request.hashed_len:
            raise InvariantViolation(
                "INV-HIT-BOUND",
                f"request {request.request_id!r}: hit {n} must be a multiple of {self.coordinator.alignment} "
                f"and <= min(bound, hashed) = {min(limit, request.hashed_len)}",
            )
        return hit

    def cheaper_hits(self, request: Request, hit: Hit) -> Iterator[Hit]:
        """Shorter hits to fall back to when taking ``hit`` costs more blocks than the pool has
        (a hit inside a block needs a copy-on-write block; an evictable hit block consumes a
        free one): the longest hit on a scheduler-block boundary (no copy in any group), then
        none. No state change."""
        s = self.layout.scheduler_block_size
        aligned = hit.num_tokens - hit.num_tokens % s
        if 0 < aligned < hit.num_tokens:
            yield self.lookup(request, bound=aligned)
        if hit.num_tokens:
            yield self.coordinator.miss

    def keyed_lengths(self, request: Request, start: int, end: int) -> list[int]:
        """The lengths in ``(start, end]`` a request sharing that prefix can hit once a chunk
        computing ``[start, end)`` of ``request`` has run: where every group will hold an entry
        (each manager's own caching rule says where, ``keyed_lengths``). No state change."""
        a = self.coordinator.alignment
        if end // a == start // a:
            return []  # no length on the hit grid in (start, end]: most decode steps
        per_group = [m.keyed_lengths(request, start, end) for m in self.managers]
        fewest = min(per_group, key=len)
        return [n for n in fewest if all(n in lengths for lengths in per_group)]

    def block_table(self, request: Request) -> tuple[list[int], ...]:
        """The request's current block list per group (copies; for tests and the oracle)."""
        return tuple(list(m.row(request.request_id)) for m in self.managers)

    def is_running(self, request: Request) -> bool:
        """Whether ``request`` is admitted: allocated on its hit and not freed since."""
        return self.coordinator.is_running(request)

    def junctions(self, request: Request) -> tuple[int, ...]:
        """Where a running request branches off cached content: its admission hit's
        ``Hit.junctions`` (its prefill chunks stop there; retention keeps the states). No
        state change."""
        return self.coordinator.junctions(request)

    # --- verbs ----------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """Mutates. Start a scheduler step: the previous step's copies have run, so the
        references that kept their sources alive are dropped."""
        if self._in_flight:
            raise InvariantViolation(
                "INV-STEP-PROTOCOL", f"begin_step while requests {sorted(self._in_flight)} were allocated but not cached"
            )
        self.coordinator.begin_step()
        self._step += 1

    def allocate_slots(self, request: Request, num_new_tokens: int, hit: Optional[Hit] = None) -> Optional[tuple[list[int], ...]]:
        """Mutates unless it returns None. Blocks for ``num_new_tokens`` more tokens after the
        computed ones (after ``hit`` for a waiting request, which must come from ``lookup`` in
        this step). Returns, per group, the block ids to append to the worker's row (the whole
        row for a new request), or None when the pool is short; then nothing changed."""
        return self._allocate(request, num_new_tokens, hit, "num_new_tokens", known_only=True)

    def _allocate(self, request: Request, count: int, hit: Optional[Hit], name: str,
                  known_only: bool) -> Optional[tuple[list[int], ...]]:
        """``allocate_slots`` and ``reserve_slots``: ``count`` slots after the computed tokens
        (after the hit), only for known tokens when ``known_only``."""
        rid = request.request_id
        if type(count) is not int and (isinstance(count, bool) or not isinstance(count, int)) or count <= 0:
            raise ValueError(f"request {rid!r}: {name} {count!r} must be an int > 0")
        if rid in self._in_flight:
            raise ValueError(
                f"request {rid!r} was already allocated this step; "
                "a request gets one allocate_slots per step, and cache() after its forward pass"
            )
        coordinator = self.coordinator
        running = coordinator.running(request)
        if running is not None:
            if hit is not None and hit.num_tokens:
                raise ValueError(f"request {rid!r} is running; a running request takes no hit")
            start = request.num_computed_tokens
        else:
            hit = hit if hit is not None else coordinator.miss
            start = hit.num_tokens
        total = start + count
        if known_only and total > len(request.token_ids):
            raise ValueError(f"request {rid!r}: {start} + {count} tokens exceed the {request.num_tokens} known tokens")
        if total > self._max_model_len:
            raise ValueError(f"request {rid!r}: {start} + {count} {'tokens' if known_only else 'slots'} exceed "
                             f"max_model_len {self._max_model_len}")
        free_before = self.pool.num_free
        if running is not None:
            result = coordinator.grow(request, running, total)
        else:
            result = coordinator.admit(request, total, hit)
        if result is None:
            if self.pool.num_free != free_before:
                raise InvariantViolation("INV-ALLOC-ATOMIC", f"request {rid!r}: a failed allocation changed the pool")
            return None
        if running is None:
            request.num_computed_tokens = hit.num_tokens
            if request.num_cached_tokens is None:
                request.num_cached_tokens = hit.num_tokens
        self._in_flight.add(rid)
        return result

    def take_block_copies(self) -> list[tuple[int, int, int]]:
        """Mutates. The step's copies ``(group_id, src, dst)`` in order; run them on every rank
        before the forward pass (each rank copies its own shard or replica)."""
        copies = self.coordinator.ledger.take_copies()
        self.num_copies += len(copies)
        return copies

    def cache(self, request: Request) -> None:
        """Mutates. After the forward pass: key what it computed (``request.num_computed_tokens``
        must already count the step's tokens), then release blocks the step no longer needs
        (the order and why: ``HybridCoordinator.cache``)."""
        if not self.coordinator.cache(request, request.num_computed_tokens):
            raise ValueError(
                f"request {request.request_id!r} holds no blocks (freed, or never allocated); "
                "cache() follows its allocate_slots, before free()"
            )
        self._in_flight.discard(request.request_id)

    def free(self, request: Request) -> None:
        """Mutates. Release every block of ``request`` (finished, or preempted)."""
        if request.request_id in self._in_flight:
            raise InvariantViolation(
                "INV-STEP-PROTOCOL",
                f"request {request.request_id!r} was allocated this step and freed before its step ran; "
                "its copies would write blocks it no longer holds",
            )
        self.coordinator.free(request)
        if self.valuer is not None:
            self.valuer.forget(request.request_id)

    # --- checks ---------------------------------------------------------------------------------

    def check_request(self, request: Request) -> None:
        """Per-request invariants between steps (``MambaManager.release`` runs the same check
        after every step, skipping it when the row did not move)."""
        for m in self._mamba_managers:
            m.check_real_blocks(request)

    def check_state(self) -> bool:
        """Whole-state check (slow tier): pool conservation, every table entry is held, the
        attention blocks' keys stay on their hash grid (INV-KEYS-PER-BLOCK), and every Mamba row
        holds no more real blocks than its state needs (INV-MAMBA-REAL-BLOCKS)."""
        self.pool._check()
        for m in self._mamba_managers:
            m.check_rows()
        for m in self.managers:
            if isinstance(m, FullAttentionManager):
                m.check_keys()
        holders: dict[int, int] = {}
        for m in self.managers:
            for state in m.requests.values():
                for b in state.row:
                    if b:
                        holders[b] = holders.get(b, 0) + 1
        for b, n in holders.items():
            ref = self.pool.ref_count(b)
            if ref < n:
                raise InvariantViolation("INV-TABLE-HELD", f"block {b} is in {n} tables but has ref count {ref}")
        return True

    # --- for a host scheduler that allocates ahead of its tokens (vLLM's: the adapter) -----------

    def reserve_slots(self, request: Request, num_slots: int, hit: Optional[Hit] = None) -> Optional[tuple[list[int], ...]]:
        """Mutates unless it returns None. ``allocate_slots`` for ``num_slots`` slots after the
        computed tokens, some of which may hold tokens not known yet: vLLM's Scheduler allocates
        for draft tokens, EAGLE lookahead and async-scheduling placeholders before they are
        sampled. Nothing unknown is ever keyed: ``cache`` keys only hashed (known) tokens."""
        return self._allocate(request, num_slots, hit, "num_slots", known_only=False)

    def blocks_needed(self, request: Request, total_tokens: int, hit: Optional[Hit] = None) -> int:
        """Free blocks an allocation to ``total_tokens`` would take now (``hit``: a waiting
        request's). No state change."""
        return self.coordinator.blocks_needed(request, total_tokens, hit)

    def keyed_tokens(self, request: Request) -> int:
        """Tokens of a running request's prefix that its own blocks have keyed in every group
        (the least over groups of the longest key in its row). No state change."""
        rows = self.block_table(request)
        return min((max((self.pool.num_tokens_of(b) for b in row if b), default=0) for row in rows), default=0)

    def reset_prefix_cache(self) -> bool:
        """Mutates if it succeeds. Drop every key; False with nothing changed while any block is
        held (a request's, or a source kept for the last step's copies until ``begin_step``)."""
        return self.pool.reset()

    def evict(self, block_ids) -> int:
        """Mutates. Drop the keys of the listed blocks (a host found their contents invalid);
        returns how many keys were dropped. An id out of range raises ValueError, nothing changed."""
        return self.pool.evict(sorted(block_ids))

    def cached_block(self, block_hash: bytes, group_id: int) -> Optional[int]:
        """The block a hit on the prefix named by ``block_hash`` (one of a request's block
        hashes) returns in a group, or None. No state change."""
        return self.pool.lookup((block_hash, group_id))
