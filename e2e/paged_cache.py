"""One DCP rank's cache memory: paged attention KV and recurrent-state blocks, addressed by the
block ids kvproof hands out.

As in vLLM's hybrid allocator, a block id names one page of memory that layers of different
groups view in their own shape: memory slot ``s`` is one buffer ``[num_blocks, page]``, and
layer ``s`` of every group views it (attention: K and V pages ``[num_blocks, bs, H, Dh]``;
recurrence: states ``[num_blocks, H, Dh, Dh]``). A block therefore must never serve two
groups at once -- if the pool ever handed one out twice, the layers would overwrite each
other and the logits would show it.

Each rank holds its own memory: for a DCP-sharded group a block's page on rank r holds only
the positions rank r owns; a replicated (Mamba) block holds the same state on every rank.
"""

from __future__ import annotations

import torch

from kvproof.e2e.model import DTYPE, LayerSpec, ModelConfig
from kvproof.spec.layout import Layout
from kvproof.spec.placement import PAD_SLOT


def memory_shape(layout: Layout, layers: tuple[LayerSpec, ...], config: ModelConfig) -> tuple[int, int]:
    """``(slots, page)``: the cache is ``slots`` buffers of ``[num_blocks, page]`` elements, a
    page being the largest of one block's K and V (attention) or one state (recurrence)."""
    h, dh = config.heads, config.head_dim
    pages = [h * dh * dh if s.recurrent else 2 * layout.groups[s.group].group.block_size * h * dh for s in layers]
    return 1 + max(s.slot for s in layers), max(pages)


def bytes_per_block(layout: Layout, layers: tuple[LayerSpec, ...], config: ModelConfig) -> int:
    """Bytes of cache memory one block id costs on each rank."""
    slots, page = memory_shape(layout, layers, config)
    return slots * page * DTYPE.itemsize


class PagedCache:
    """Mutable per-rank cache memory (zeros at start; never read before written unless a
    block table or slot mapping is wrong)."""

    def __init__(self, layout: Layout, layers: tuple[LayerSpec, ...], config: ModelConfig, num_blocks: int) -> None:
        h, dh = config.heads, config.head_dim
        self.block_sizes = [g.group.block_size for g in layout.groups]  # physical, per rank
        num_slots, page = memory_shape(layout, layers, config)
        self.memory = [torch.zeros(num_blocks, page, dtype=DTYPE) for _ in range(num_slots)]
        # Per layer: (K pages, V pages) or (state blocks,), views into its slot's memory.
        self.views: list[tuple[torch.Tensor, ...]] = []
        for spec in layers:
            mem = self.memory[spec.slot]
            if spec.recurrent:
                self.views.append((mem[:, : h * dh * dh].view(num_blocks, h, dh, dh),))
            else:
                bs = self.block_sizes[spec.group]
                n = bs * h * dh
                self.views.append((mem[:, :n].view(num_blocks, bs, h, dh), mem[:, n : 2 * n].view(num_blocks, bs, h, dh)))
        self.layers = layers

    # --- copy-on-write --------------------------------------------------------------------------

    def copy_blocks(self, copies: list[tuple[int, int, int]]) -> None:
        """Mutates. Run the coordinator's copies ``(group_id, src, dst)`` as one batched
        gather-then-scatter over every layer of each copy's group: every source is read before
        any destination is written (the worker's semantics; a chained copy would read stale
        contents, which kvproof never emits -- INV-COW-SOURCE-READY)."""
        if not copies:
            return
        gathered = []
        for spec, views in zip(self.layers, self.views):
            pairs = [(src, dst) for gid, src, dst in copies if gid == spec.group]
            if pairs:
                src = torch.tensor([p[0] for p in pairs], dtype=torch.int64)
                dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
                gathered.extend((view, dst, view[src].clone()) for view in views)
        for view, dst, contents in gathered:
            view[dst] = contents

    # --- attention KV ---------------------------------------------------------------------------

    def write_kv(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Mutates. Store ``k``, ``v`` ``[T, H, Dh]`` at ``slots`` int64 ``[T]`` (``block_id *
        bs + offset`` on this rank; PAD_SLOT where another rank owns the position)."""
        keep = slots != PAD_SLOT
        slots = slots[keep]
        bs = self.block_sizes[self.layers[layer].group]
        k_pages, v_pages = self.views[layer]
        k_pages[slots // bs, slots % bs] = k[keep]
        v_pages[slots // bs, slots % bs] = v[keep]

    def read_kv(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[L, H, Dh]`` at (``blocks``, ``offsets``), int64 ``[L]`` each."""
        k_pages, v_pages = self.views[layer]
        return k_pages[blocks, offsets], v_pages[blocks, offsets]

    # --- recurrent state ------------------------------------------------------------------------

    def read_states(self, layer: int, blocks: torch.Tensor) -> torch.Tensor:
        """States ``[N, H, Dh, Dh]`` of ``blocks`` int64 ``[N]`` (a copy)."""
        return self.views[layer][0][blocks].clone()

    def write_states(self, layer: int, blocks: torch.Tensor, states: torch.Tensor) -> None:
        """Mutates. Store ``states`` ``[N, H, Dh, Dh]`` into ``blocks`` int64 ``[N]``."""
        self.views[layer][0][blocks] = states
