"""The hybrid coordinator: one joint prefix-cache hit across all cache groups, and allocation
that is atomic across them."""

from __future__ import annotations

import dataclasses
import logging

from kvproof.impl.block_pool import BlockPool
from kvproof.impl.eviction import EvictionValuer
from kvproof.impl.fixpoint import fixpoint
from kvproof.impl.managers import MANAGER_FOR_KIND, SingleTypeManager, StepLedger
from kvproof.impl.request import Request
from kvproof.spec.arith import cdiv_unchecked
from kvproof.spec.checkpoints import turn_end_ladder
from kvproof.spec.contracts import InvariantViolation, slow
from kvproof.spec.layout import Layout
from kvproof.spec.groups import GroupKind

logger = logging.getLogger("kvproof")

#: Kinds whose manager keys hash boundaries inside a block (``LayoutConfig.attention_keys``).
_APPEND_ONLY = (GroupKind.FULL_ATTENTION, GroupKind.MLA)


@dataclasses.dataclass(frozen=True)
class Hit:
    """A joint prefix-cache hit: ``num_tokens`` and, per group, the blocks that restore it.

    ``junctions``: lengths beyond the hit that this request shares with cached content in some
    group (attention reaches further than a Mamba state does) -- where the next sibling will
    branch, so the chunk split stops there and retention keeps the state (INV-JUNCTION).
    """

    num_tokens: int
    blocks: tuple[list[int], ...]
    junctions: tuple[int, ...] = ()


class RunningRequest:
    """What the coordinator keeps about an admitted request (from ``allocate`` on its hit to
    ``free``): being here is what "running" means.

    ``junctions``: its admission hit's (``Hit.junctions``). ``idle_until``: the token count up
    to which its steps need no block and key nothing in any group
    (``SingleTypeManager.idle_until``, taken after each ``cache`` that did work): those steps
    skip the managers. Most decode steps are such steps.
    """

    __slots__ = ("junctions", "idle_until")

    def __init__(self, junctions: tuple[int, ...]) -> None:
        self.junctions = junctions
        self.idle_until = 0


class HybridCoordinator:
    """Owns one manager per group over one shared block pool.

    The partial-hit rule and the cache-hit alignment come from the geometry spec
    (:func:`kvproof.spec.layout.resolve_layout`); the fallback to block-aligned hits is logged
    once, as a warning naming the groups that force it.
    """

    def __init__(self, layout: Layout, pool: BlockPool, *, use_eagle: bool, valuer: EvictionValuer | None) -> None:
        self.layout = layout
        self.pool = pool
        self.valuer = valuer
        self.ledger = StepLedger()
        self.hash_block_size = layout.hash_block_size
        self.alignment = layout.cache_hit_alignment
        self.use_eagle = use_eagle
        if layout.partial.warning:
            logger.warning(layout.partial.warning)
        #: ``shared_prefix_checkpoint`` in effect: as in vLLM 0.33.0, only for EAGLE with partial
        #: hits (docs/vllm-semantics.md §5.4); otherwise junction states are block-floored.
        self.exact_junction = layout.config.shared_prefix_checkpoint and use_eagle and layout.partial_hash_hits
        retention = dict(
            retention_interval=layout.config.retention_interval,
            scheduler_block_size=layout.scheduler_block_size,
            exact_junction=self.exact_junction,
            rungs=turn_end_ladder(layout),
        )
        keys = dict(attention_keys=layout.config.attention_keys)
        self.managers: tuple[SingleTypeManager, ...] = tuple(
            MANAGER_FOR_KIND[g.group.kind](
                g.index, g, layout.hash_block_size, self.alignment, pool, self.ledger,
                use_eagle=use_eagle, **(retention if g.group.kind is GroupKind.MAMBA else keys if g.group.kind in _APPEND_ONLY else {}),
            )
            for g in layout.groups
        )
        for m in self.managers:
            m.valuer = valuer
        # Attention first: its hits are downward closed, so the fixpoint takes two passes
        # (attention narrows, Mamba lowers to a stored state, attention accepts it). A layout
        # with a group that keeps no reusable state (Mamba in mode 'none') never hits.
        self._lookup_order = tuple(sorted(self.managers, key=lambda m: not m.group.kind.is_attention))
        self._first_block = self._lookup_order[0].effective_block_size
        self._first_eagle_unit = self._lookup_order[0].eagle_unit
        self._cacheable = all(m.group.prefix_cacheable for m in self.managers)
        #: The empty hit (no tokens, no blocks, no junctions).
        self.miss = Hit(0, tuple([] for _ in self.managers))
        #: Longest request every group's worker row can hold (checked in full only above it).
        self._max_tokens = min(m.max_tokens for m in self.managers)
        #: The admitted requests, by id (``RunningRequest``).
        self._running: dict[str, RunningRequest] = {}
        #: What an idle step allocates: no entries in any group (never mutated).
        self._no_entries: tuple[list[int], ...] = tuple([] for _ in self.managers)

    # --- queries --------------------------------------------------------------------------------

    def is_running(self, request: Request) -> bool:
        """Whether ``request`` is admitted (allocated on its hit, not freed since)."""
        return request.request_id in self._running

    def running(self, request: Request) -> RunningRequest | None:
        """What the coordinator keeps about ``request`` while it is admitted (None: it is not);
        the facade asks once per call and hands it to ``grow``. No state change."""
        return self._running.get(request.request_id)

    def junctions(self, request: Request) -> tuple[int, ...]:
        """The junctions of a running request's admission hit (``Hit.junctions``; () for one
        that is not running). No state change."""
        running = self._running.get(request.request_id)
        return running.junctions if running is not None else ()

    def idle_until(self, request: Request) -> int:
        """The token count up to which a running request's steps skip the managers
        (``RunningRequest.idle_until``; 0 for one that is not running). No state change."""
        running = self._running.get(request.request_id)
        return running.idle_until if running is not None else 0

    # --- lookup ---------------------------------------------------------------------------------

    def find_longest_hit(self, request: Request, bound: int) -> Hit:
        """The largest N <= ``bound`` that every group can restore, and the junctions beyond it
        (no state change). Computed by :func:`kvproof.impl.fixpoint.fixpoint` over the groups'
        finders (why it is the largest and why it ends: its docstring), attention first, so
        it takes two passes in practice: attention narrows the candidate, Mamba lowers it to a
        stored state, attention accepts that.
        """
        hit = min(bound, request.hashed_len)
        hit -= hit % self.alignment
        if not self._cacheable or hit <= 0:
            return self.miss
        finders = [lambda n, m=m: m.find_hit(request, n) for m in self._lookup_order]
        hit, found, longest, _ = fixpoint(finders, hit)
        blocks = [[] for _ in self.managers] if hit == 0 else [None] * len(self.managers)
        if hit:
            for m, bl in zip(self._lookup_order, found):
                blocks[m.group_id] = bl
                if len(bl) != cdiv_unchecked(hit, m.effective_block_size):
                    raise InvariantViolation(
                        "INV-HIT-BLOCKS",
                        f"request {request.request_id!r}, group {m.group_id}: hit {hit} needs "
                        f"{cdiv_unchecked(hit, m.effective_block_size)} blocks, finder returned {len(bl)}",
                    )
        return Hit(hit, tuple(blocks), self._junctions(hit, longest))

    def _junctions(self, hit: int, longest: int) -> tuple[int, ...]:
        """Where this request branches off cached content: the longest single-group hit, and
        where a hit lands on the last attention block boundary below its coverage (without a
        partial key: vLLM's junction), when beyond the joint hit. With EAGLE a hit ends one
        unit below the coverage, so that is the boundary below ``longest + unit``, minus the
        unit."""
        if longest <= hit:
            return ()
        unit = self._first_eagle_unit
        covered = longest + unit
        coarse = covered - covered % self._first_block - unit
        return (coarse, longest) if hit < coarse < longest else (longest,)

    # --- the step -----------------------------------------------------------------------------

    def begin_step(self) -> None:
        """Mutates. Settle the finished step (its copies ran: drop the hit references that kept
        their sources) and open the next (``StepLedger.open``)."""
        refs = self.ledger.open()
        if refs:
            self.pool.free(refs, None if self.valuer is None else self.valuer.by_length(self.pool, refs))

    # --- allocation -----------------------------------------------------------------------------

    def blocks_needed(self, request: Request, total_tokens: int, hit: Hit | None = None) -> int:
        """Free-queue blocks ``allocate`` would take (``hit``: a waiting request's, None for a
        miss; a running request's is ignored). No state change."""
        if request.request_id in self._running:
            return sum(m.grow_needed(request, total_tokens) for m in self.managers)
        hit = hit if hit is not None else self.miss
        return sum(
            m.blocks_needed(request, total_tokens, hit.num_tokens, bl) for m, bl in zip(self.managers, hit.blocks)
        )

    def allocate(self, request: Request, total_tokens: int, hit: Hit | None = None) -> tuple[list[int], ...] | None:
        """Mutates unless it returns None. Blocks for ``total_tokens`` tokens in every group:
        a running request grows (``grow``); any other is admitted on ``hit`` (``admit``; None:
        a miss). None with nothing changed when the pool cannot supply them all
        (INV-ALLOC-ATOMIC)."""
        running = self._running.get(request.request_id)
        if running is not None:
            return self.grow(request, running, total_tokens)
        return self.admit(request, total_tokens, hit)

    def grow(self, request: Request, running: RunningRequest, total_tokens: int) -> tuple[list[int], ...] | None:
        """Mutates unless it returns None. A running request (``running``: its ``running()``)
        grows to ``total_tokens`` in every group; a step within its idle span allocates
        nothing. Every group's row width is checked before any group is touched
        (INV-TABLE-WIDTH)."""
        if total_tokens > self._max_tokens:
            self._check_widths(request, total_tokens)
        if total_tokens <= running.idle_until:
            if slow():
                self._check_idle(request, total_tokens)
            return self._no_entries
        managers = self.managers
        if sum(m.grow_needed(request, total_tokens) for m in managers) > self.pool.num_free:
            return None
        return tuple([m.grow(request, total_tokens) for m in managers])

    def admit(self, request: Request, total_tokens: int, hit: Hit | None = None) -> tuple[list[int], ...] | None:
        """Mutates unless it returns None. Admit a request that is not running on ``hit``
        (None: a miss) with blocks for ``total_tokens`` tokens in every group (the whole rows).
        Every group's row width is checked before any group is touched (INV-TABLE-WIDTH)."""
        if total_tokens > self._max_tokens:
            self._check_widths(request, total_tokens)
        hit = hit if hit is not None else self.miss
        if self.blocks_needed(request, total_tokens, hit) > self.pool.num_free:
            return None
        # Take every group's hit blocks out of the free queue before any group allocates, or a
        # fresh allocation could evict (and reuse) an evictable block another group just hit.
        self.pool.touch([b for bl in hit.blocks for b in bl])
        n, junctions = hit.num_tokens, hit.junctions
        if self.valuer is not None:
            self.valuer.note_resume(request.request_id, n)
        self._running[request.request_id] = RunningRequest(junctions)
        return tuple([m.allocate(request, total_tokens, n, bl, junctions) for m, bl in zip(self.managers, hit.blocks)])

    def _check_widths(self, request: Request, total_tokens: int) -> None:
        """INV-TABLE-WIDTH: every group's row can hold ``total_tokens`` (asked only above the
        narrowest row's capacity, before any group is touched)."""
        for m in self.managers:
            m.check_width(request, total_tokens)

    def _check_idle(self, request: Request, total_tokens: int) -> None:
        """INV-IDLE-STEP (slow tier): a step the coordinator skips needs no block in any group."""
        for m in self.managers:
            need = m.grow_needed(request, total_tokens)
            if need:
                raise InvariantViolation(
                    "INV-IDLE-STEP",
                    f"request {request.request_id!r}, group {m.group_id}: a step to {total_tokens} tokens was skipped "
                    f"as idle (idle until {self.idle_until(request)}) but needs {need} blocks",
                )

    # --- after the step -------------------------------------------------------------------------

    def cache(self, request: Request, num_computed: int) -> bool:
        """Mutates. After the step, unless the request is idle: in every group, key what the step
        computed, then release what it no longer reads.

        The one place that fixes the order, keying first: a block released after it is keyed
        joins the free queue as a cached block (hittable, evicted last), where released first it
        would be an uncached one (reused first, its contents lost). A sliding window keys its
        last full blocks before they leave the window; Mamba moves its key to the copy (and keys
        its new state) before it releases the copy and the old state.

        Returns False, changing nothing, when ``request`` is not running (the facade refuses
        it); True otherwise."""
        running = self._running.get(request.request_id)
        if running is None:
            return False
        if num_computed <= running.idle_until:
            return True
        managers = self.managers
        for m in managers:
            m.key(request, num_computed)
        for m in managers:
            m.release(request, num_computed)
        running.idle_until = min([m.idle_until(request, num_computed) for m in managers])
        return True

    def free(self, request: Request) -> None:
        """Mutates. Release every block of ``request`` in every group; it is no longer running."""
        self._running.pop(request.request_id, None)
        for m in self.managers:
            m.free(request)

