"""The hybrid coordinator: one joint prefix-cache hit across all cache groups, and allocation
that is atomic across them."""

from __future__ import annotations

import dataclasses
import logging

from kvproof.impl.block_pool import BlockPool
from kvproof.impl.managers import MANAGER_FOR_KIND, SingleTypeManager, StepLedger
from kvproof.impl.request import Request
from kvproof.spec.contracts import InvariantViolation
from kvproof.spec.layout import Layout

logger = logging.getLogger("kvproof")


@dataclasses.dataclass(frozen=True)
class Hit:
    """A joint prefix-cache hit: ``num_tokens`` and, per group, the blocks that restore it."""

    num_tokens: int
    blocks: tuple[list[int], ...]


class HybridCoordinator:
    """Owns one manager per group over one shared block pool.

    The partial-hit rule and the cache-hit alignment come from the geometry spec
    (:func:`kvproof.spec.layout.resolve_layout`); the fallback to block-aligned hits is logged
    once, as a warning naming the groups that force it.
    """

    def __init__(self, layout: Layout, pool: BlockPool, use_eagle: bool = False) -> None:
        self.layout = layout
        self.pool = pool
        self.ledger = StepLedger()
        self.hash_block_size = layout.hash_block_size
        self.alignment = layout.cache_hit_alignment
        self.use_eagle = use_eagle
        if layout.partial.warning:
            logger.warning(layout.partial.warning)
        self.managers: tuple[SingleTypeManager, ...] = tuple(
            MANAGER_FOR_KIND[g.group.kind](
                g.index, g, layout.hash_block_size, self.alignment, pool, self.ledger,
                use_eagle=use_eagle,
            )
            for g in layout.groups
        )
        # Only prefix-cacheable groups take part in lookups (a Mamba group in mode 'none'
        # would veto every hit: it keeps no reusable state).
        self._lookup_order = tuple(
            m for m in sorted(self.managers, key=lambda m: not m.group.kind.is_attention)
        )
        self._cacheable = all(m.group.prefix_cacheable for m in self.managers)
        #: Longest request every group's worker row can hold (checked in full only above it).
        self._max_tokens = min(m.max_tokens for m in self.managers)

    # --- lookup ---------------------------------------------------------------------------------

    def find_longest_hit(self, request: Request, bound: int) -> Hit:
        """The largest N <= ``bound`` that every group can restore (no state change).

        A fixpoint: each finder returns the largest length <= its input that its group can
        restore, so passes never raise the candidate. A pass in which no finder lowers it ends
        the loop: every group accepted that length. It is also the *largest* jointly restorable
        length J: J <= candidate holds initially and is kept by every finder (J is restorable
        in that group and <= its input, so the finder returns >= J).

        Termination: the candidate is a non-negative multiple of the alignment A and strictly
        decreases on every pass that does not end the loop, so there are at most
        ``bound / A + 1`` passes (two in practice: attention first narrows it, Mamba lowers it
        to a stored state, attention accepts that).
        """
        hit = min(bound, request.hashed_len)
        hit -= hit % self.alignment
        if not self._cacheable or hit <= 0:
            return Hit(0, tuple([] for _ in self.managers))
        found: dict[int, list[int]] = {}
        while True:
            before = hit
            for m in self._lookup_order:
                hit, blocks = m.find_hit(request, hit)
                found[m.group_id] = blocks
                if hit == 0:
                    return Hit(0, tuple([] for _ in self.managers))
            if hit == before:
                break
        blocks = tuple(found[m.group_id] for m in self.managers)
        for m, bl in zip(self.managers, blocks):
            if len(bl) != -(-hit // m.block_size) and not (len(bl) == 0 and hit == 0):
                raise InvariantViolation(
                    "INV-HIT-BLOCKS",
                    f"request {request.request_id!r}, group {m.group_id}: hit {hit} needs "
                    f"{-(-hit // m.block_size)} blocks, finder returned {len(bl)}",
                )
        return Hit(hit, blocks)

    # --- allocation -----------------------------------------------------------------------------

    def blocks_needed(self, request: Request, total_tokens: int, hit: Hit) -> int:
        return sum(
            m.blocks_needed(request, total_tokens, hit.num_tokens, bl) for m, bl in zip(self.managers, hit.blocks)
        )

    def allocate(self, request: Request, total_tokens: int, hit: Hit | None) -> tuple[list[int], ...] | None:
        """Mutates unless it returns None. Blocks for ``total_tokens`` tokens in every group
        (``hit`` None: a running request), or None with nothing changed when the pool cannot
        supply them all (INV-ALLOC-ATOMIC). Every group's row width is checked before any
        group is touched (INV-TABLE-WIDTH)."""
        if total_tokens > self._max_tokens:
            for m in self.managers:
                m.check_width(request, total_tokens)
        managers = self.managers
        if hit is None:
            needed = 0
            for m in managers:
                needed += m.blocks_needed(request, total_tokens, 0, _EMPTY)
            if needed > self.pool.num_free:
                return None
            return tuple([m.allocate(request, total_tokens, 0, _EMPTY) for m in managers])
        if self.blocks_needed(request, total_tokens, hit) > self.pool.num_free:
            return None
        # Take every group's hit blocks out of the free queue before any group allocates, or a
        # fresh allocation could evict (and reuse) an evictable block another group just hit.
        self.pool.touch([b for bl in hit.blocks for b in bl])
        n = hit.num_tokens
        return tuple([m.allocate(request, total_tokens, n, bl) for m, bl in zip(managers, hit.blocks)])


#: The hit block list of a running request (never mutated).
_EMPTY: list[int] = []
