"""KV memory per GPU -> pool blocks, the way vLLM 0.33.0's KV planner sizes the pool.

What vLLM does (``v1/core/kv_cache_planning.py``, ``platforms/interface.py``), restated for a
kvproof layout whose groups each stand for a set of identical layers:

1. **Pages.** One block of one layer on one GPU: attention ``block_size * bytes_per_token``
   (``block_size`` is the per-rank physical block, so DCP does not change it); Mamba / linear
   attention ``bytes_per_state``, whatever the block size.
2. **One page size.** Every page is padded to the largest (``unify_kv_cache_spec_page_size``;
   in align mode the platform first grows the attention block until its page is at least the
   Mamba page, see :func:`vllm_attention_block_size`).
3. **Groups of equal size.** Layers of one kind are split into vLLM groups of ``group_size``
   layers: the fewest layers of any kind, or the most when that is under 1.5x the fewest
   (``_get_kv_cache_groups_uniform_page_size``). A kind with ``L`` layers becomes
   ``cdiv(L, group_size)`` vLLM groups, each taking its own block from the shared pool.
4. **Blocks.** One pool block holds one page of every layer of a vLLM group:
   ``group_size * page`` bytes, and ``num_blocks = kv_memory // block_bytes`` (the null
   block included, as in vLLM's ``BlockPool``).

The replay therefore runs each kvproof group as ``cdiv(L, group_size)`` identical groups
(:func:`expand_groups`), so the pool fills exactly as vLLM's would.
"""

from __future__ import annotations

import dataclasses
import math

from kvproof.spec.arith import cdiv
from kvproof.spec.geometry import TABLE_ENTRY_BYTES
from kvproof.spec.groups import CacheGroup, GroupKind, MambaCacheMode
from kvproof.spec.layout import Layout

GIB = 1 << 30
#: Smallest kernel block of vLLM's attention backends (FlashAttention) and of its MLA backends,
#: which need a multiple of 128 in hybrid models (``platforms/interface.py``).
KERNEL_BLOCK_ALIGNMENT = 16
MLA_KERNEL_BLOCK_ALIGNMENT = 128
#: Upper bounds on user figures (a bad flag is refused, never a 10**30-byte page).
MAX_BYTES = 1 << 40
MAX_LAYERS = 10_000


@dataclasses.dataclass(frozen=True)
class ModelMemory:
    """What one GPU stores per cached token or state, and how many layers each group stands for.

    ``layers[i]`` counts the model's layers in the layout's group ``i``; ``bytes_per_token`` is
    one token of one attention layer on one GPU (K and V, or MLA's latent), ``bytes_per_state``
    one Mamba / linear-attention state (recurrent + convolution) of one layer on one GPU.
    """

    layers: tuple[int, ...]
    bytes_per_token: int
    bytes_per_state: int

    def validate(self, groups: tuple[CacheGroup, ...]) -> None:
        """Raise ValueError naming the figure that does not fit ``groups``."""
        if len(self.layers) != len(groups):
            raise ValueError(
                f"{len(self.layers)} layer count(s) for {len(groups)} cache group(s); expected one per group "
                f"({', '.join(g.label for g in groups)})"
            )
        for i, n in enumerate(self.layers):
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_LAYERS:
                raise ValueError(f"layer count {n!r} of group {i} must be an integer in [1, {MAX_LAYERS}]")
        kinds = {g.kind for g in groups}
        for name, value, needed in (
            ("bytes per token", self.bytes_per_token, any(k.is_attention for k in kinds)),
            ("bytes per state", self.bytes_per_state, GroupKind.MAMBA in kinds),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_BYTES:
                raise ValueError(f"{name} {value!r} must be an integer in [0, {MAX_BYTES}]")
            if needed and value == 0:
                raise ValueError(f"{name} is 0, but the layout has a group that stores it; expected a positive size")


@dataclasses.dataclass(frozen=True)
class PoolPlan:
    """The pool vLLM would build, and what it means for the layout."""

    page_bytes: tuple[int, ...]  # per group: one block of one layer, before padding
    padded_page_bytes: int  # every page padded to the largest
    group_size: int  # layers per vLLM group
    vllm_groups: tuple[int, ...]  # per group: vLLM groups it becomes (blocks per block)
    block_bytes: int  # one pool block: group_size * padded page
    num_blocks: int  # the null block included

    @property
    def pool_bytes(self) -> int:
        return self.block_bytes * self.num_blocks


def page_bytes(group: CacheGroup, memory: ModelMemory) -> int:
    """Bytes of one block of one layer of ``group`` on one GPU (step 1)."""
    if group.kind is GroupKind.MAMBA:
        return memory.bytes_per_state
    return group.block_size * memory.bytes_per_token


def vllm_group_size(layers: tuple[int, ...]) -> int:
    """Layers per vLLM group (step 3): the fewest of any kind, or the most when that is under
    1.5x the fewest (fewer padding layers)."""
    low, high = min(layers), max(layers)
    return high if high < low * 1.5 else low


def plan_pool(layout: Layout, memory: ModelMemory, kv_memory_bytes: int | None = None, num_blocks: int | None = None) -> PoolPlan:
    """Size the pool from ``kv_memory_bytes`` per GPU, or take ``num_blocks`` as given (then
    the block bytes still say what that pool costs). Pure; ValueError on bad figures."""
    groups = tuple(g.group for g in layout.groups)
    memory.validate(groups)
    pages = tuple(page_bytes(g, memory) for g in groups)
    padded = max(pages)
    size = vllm_group_size(memory.layers)
    block_bytes = size * padded
    if num_blocks is None:
        if kv_memory_bytes is None:
            raise ValueError("either the KV memory per GPU or the number of blocks is required")
        num_blocks = kv_memory_bytes // block_bytes
    return PoolPlan(pages, padded, size, tuple(cdiv(n, size) for n in memory.layers), block_bytes, num_blocks)


def expand_groups(groups: tuple[CacheGroup, ...], plan: PoolPlan) -> tuple[CacheGroup, ...]:
    """The groups vLLM runs: each of ``groups`` repeated once per vLLM group it becomes."""
    return tuple(g for g, m in zip(groups, plan.vllm_groups) for _ in range(m))


def blocks_per_request(group: CacheGroup, dcp: int, num_tokens: int, max_num_batched_tokens: int) -> int:
    """The most pool blocks one request of ``num_tokens`` tokens holds in one vLLM group, as
    vLLM's startup check counts them (``KVCacheSpec.max_memory_usage_bytes / page``)."""
    if group.kind is GroupKind.MAMBA:
        extra = 2 if group.mamba_cache_mode is MambaCacheMode.ALIGN else 1
        return extra + group.num_speculative_blocks
    if group.kind is GroupKind.SLIDING_WINDOW:
        held = min(group.sliding_window - 1 + max_num_batched_tokens, num_tokens)
        return cdiv(held, group.block_size) + 1
    local = cdiv(num_tokens, dcp) if group.is_sharded and dcp > 1 else num_tokens
    return cdiv(local, group.block_size)


def request_blocks(groups: tuple[CacheGroup, ...], dcp: int, num_tokens: int, max_num_batched_tokens: int) -> int:
    """Pool blocks one request of ``num_tokens`` tokens may hold across ``groups`` (expanded)."""
    return sum(blocks_per_request(g, dcp, num_tokens, max_num_batched_tokens) for g in groups)


def largest_request(groups: tuple[CacheGroup, ...], dcp: int, usable_blocks: int, max_model_len: int, max_num_batched_tokens: int) -> int:
    """The longest request (tokens, at most ``max_model_len``) whose blocks fit in
    ``usable_blocks``; 0 if not even one token fits. Binary search, as vLLM's
    ``_estimate_max_model_len_from_groups`` (the count is non-decreasing in the length)."""
    def fits(n: int) -> bool:
        return request_blocks(groups, dcp, n, max_num_batched_tokens) <= usable_blocks

    if not fits(1):
        return 0
    low, high = 1, max_model_len
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


def table_bytes_per_gpu(layout: Layout, max_num_seqs: int) -> tuple[int, ...]:
    """Per layout group: the worker's block-table buffer on one GPU, one row of
    ``table_width`` int32 entries per schedulable request (vLLM's ``BlockTable``)."""
    return tuple(g.table_width * TABLE_ENTRY_BYTES * max_num_seqs for g in layout.groups)


def vllm_attention_block_size(group: CacheGroup, memory: ModelMemory, mamba_page: int) -> int:
    """The attention block vLLM's platform would use next to a Mamba page in align mode: the
    least multiple of the kernel alignment (at least the requested block) whose page holds
    the Mamba page (``Platform.update_block_size_for_backend``)."""
    kernel = MLA_KERNEL_BLOCK_ALIGNMENT if group.kind is GroupKind.MLA else KERNEL_BLOCK_ALIGNMENT
    align = max(kernel, group.block_size)
    return align * cdiv(mamba_page, align * memory.bytes_per_token)


def gib(num_bytes: int | float) -> float:
    return num_bytes / GIB


def bytes_from_gib(value: float) -> int:
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"KV memory {value!r} GiB must be a positive finite number")
    return int(value * GIB)
