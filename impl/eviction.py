"""What each released block is worth to the compute eviction policy (``spec.eviction``).

The pool only sees block ids; the managers know where a block sits in its request's chain. This
valuer keeps, per running request, the two lengths the value model needs -- where the request
resumed (its prefix-cache hit) and how far its hits can reach (the last Mamba state it cached in
every Mamba group; unbounded for an attention-only layout) -- and turns a release into the
``values`` argument of :meth:`BlockPool.free`. Under ``lru`` there is no valuer and the managers
pass no values (the pool's hot path is unchanged).
"""

from __future__ import annotations

from typing import Sequence

from kvproof.impl.block_pool import NULL_BLOCK, BlockPool
from kvproof.spec.arith import cdiv_unchecked
from kvproof.spec import eviction
from kvproof.spec.eviction import DEFAULT_COMPUTE_MODEL, ComputeModel, block_value
from kvproof.spec.groups import GroupKind
from kvproof.spec.layout import Layout


class EvictionValuer:
    """Per-request chain facts, and the values (in releases, ``spec.eviction.block_value``) of released blocks."""

    def __init__(self, layout: Layout, num_blocks: int, model: ComputeModel = DEFAULT_COMPUTE_MODEL, weight: float | None = None) -> None:
        self.model = model
        #: Marconi's alpha (``spec.eviction.DEFAULT_WEIGHT``, read when the valuer is built).
        self.weight = eviction.DEFAULT_WEIGHT if weight is None else weight
        self.generation = num_blocks  # releases in one turnover of the pool
        self._mamba_groups = tuple(g.index for g in layout.groups if g.group.kind is GroupKind.MAMBA)
        self._attention_blocks = tuple(g.effective_block_size for g in layout.groups if g.group.kind is not GroupKind.MAMBA)
        self._unit_tokens = min(self._attention_blocks, default=layout.scheduler_block_size)
        self._resumed: dict[str, int] = {}
        self._states: dict[str, dict[int, int]] = {}

    # --- facts (mutate) -------------------------------------------------------------------------

    def note_resume(self, request_id: str, hit_tokens: int) -> None:
        """Mutates. The request (re)starts from a hit of ``hit_tokens`` tokens."""
        self._resumed[request_id] = hit_tokens
        self._states.pop(request_id, None)

    def note_state(self, request_id: str, group_id: int, position: int) -> None:
        """Mutates. The request cached its Mamba state at ``position`` in ``group_id``."""
        states = self._states.setdefault(request_id, {})
        states[group_id] = max(position, states.get(group_id, 0))

    def forget(self, request_id: str) -> None:
        """Mutates. The request released everything."""
        self._resumed.pop(request_id, None)
        self._states.pop(request_id, None)

    # --- values (no state change) ---------------------------------------------------------------

    def reach(self, request_id: str, computed: int) -> int:
        """How far a later hit through this request's chain can reach: its computed length, and
        in a hybrid model no further than the lowest of the last states it cached per Mamba group
        (where it cached none, where it resumed)."""
        if not self._mamba_groups:
            return computed
        states = self._states.get(request_id, {})
        resumed = self._resumed.get(request_id, 0)
        return min([computed] + [states.get(g, resumed) for g in self._mamba_groups])

    def value(self, length: int) -> float:
        """The value of a block of a chain whose hits reach ``length`` tokens: ``spec.eviction.block_value``."""
        return block_value(self.model, length, self.blocks_for(length), self._unit_tokens, self.generation, self.weight)

    def attention_values(self, request_id: str, computed: int, table: Sequence[int], block_size: int) -> list[float]:
        """Values of ``table``'s real blocks listed tail first (as the managers free them): the
        chain's value for a block that starts below the reach, 0 for one past it (dead)."""
        reach = self.reach(request_id, computed)
        live = self.value(reach)
        return [live if j * block_size < reach else 0.0 for j in range(len(table) - 1, -1, -1) if table[j] != NULL_BLOCK]

    def blocks_for(self, length: int) -> int:
        """Pool blocks a hit of ``length`` tokens holds: every attention group's blocks over it
        and one state per Mamba group."""
        return sum(cdiv_unchecked(length, b) for b in self._attention_blocks) + len(self._mamba_groups)

    def state_value(self, request_id: str, position: int) -> float:
        """Value of the request's Mamba state at ``position``: that of the chain it completes."""
        return self.value(position)

    def by_length(self, pool: BlockPool, blocks: Sequence[int]) -> list[float]:
        """Values of blocks released outside a chain (a hit's source, a superseded state, a block
        out of a sliding window): what a hit on its key saves, its whole prefix."""
        ntok = pool.num_tokens_of
        return [self.value(ntok(b)) if b != NULL_BLOCK else 0.0 for b in blocks]
