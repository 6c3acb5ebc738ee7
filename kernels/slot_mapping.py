"""Kernel 3: slot mappings for every group in one launch, under decode context parallelism.

Per token at global position ``p``, in group ``g`` with physical block size ``bs``:

- sharded group, DCP ``D > 1``: positions go to ranks in runs of ``I`` (interleave) tokens.
  With ``V = bs * D``, ``vb = p // V`` and ``off = p % V``, the owner is
  ``(off // I) % D`` and the owner's local position is
  ``vb * bs + (off // (I * D)) * I + off % I``. Other ranks map the token to PAD_SLOT.
- replicated group (Mamba), or ``D == 1``: every rank maps the token, local position ``p``.

The slot is ``row[local // bs] * bs + local % bs``. Unlike vLLM 0.33 (docs/vllm-semantics.md §10.7)
the table index is checked against the row width (INV-SLOT-INDEX-BOUND): an index past the row
yields PAD_SLOT and is recorded in ``worst_index``, which the host turns into an IndexError naming
the request, the group, the index and the width. Dummy rows and tokens past the batch map to
PAD_SLOT. This is the vectorised form of :func:`kvproof.spec.placement.slot_for_position`.
"""

from __future__ import annotations

import torch

from kvproof.kernels._triton import jit, tl
from kvproof.spec.placement import PAD_SLOT

#: Tokens mapped per loop iteration of one program.
SLOT_BLOCK = 256


@jit
def slot_mapping_kernel(
    table_ptr,  # int32 [sum_g R * W_g]: the request-state tables, packed (PackedTables.storage)
    group_offset_ptr,  # int64 [G]: first entry of group g's table in table_ptr
    group_width_ptr,  # int32 [G]: row width W_g; a table index >= W_g is out of bounds
    group_block_size_ptr,  # int32 [G]: physical block size bs_g (tokens per block on one rank)
    group_sharded_ptr,  # int32 [G]: 1 if DCP > 1 shards group g's positions over ranks, else 0
    idx_mapping_ptr,  # int32 [B]: state row of batch row b; PAD (-1) for a dummy row
    query_start_ptr,  # int32 [B + 1]: batch row b's tokens are [query_start[b], query_start[b+1])
    positions_ptr,  # int64 [>= query_start[B]]: global position of each token in its request
    num_rows,  # int: B, batch rows; program b == B pads the tokens past the batch
    num_padded_tokens,  # int: T_pad, columns of out_ptr (>= query_start[B])
    dcp_rank,  # int: this rank, in [0, dcp)
    dcp,  # int: D, the DCP world size
    interleave,  # int: I, tokens per run handed to one rank (divides every sharded bs_g)
    out_ptr,  # int64 [G, >= T_pad], out: slot of each token in each group, PAD where none
    out_stride,  # int: row stride of out_ptr
    worst_index_ptr,  # int64 [G, >= B], in/out (-1 on entry): largest out-of-row table index of (g, b)
    worst_stride,  # int: row stride of worst_index_ptr
    PAD: tl.constexpr,  # the padding sentinel PAD_SLOT
    BLOCK: tl.constexpr,  # tokens per loop iteration (power of two)
):
    # Grid (G, B + 1): one program per group and batch row, plus one that pads.
    g = tl.program_id(0)
    b = tl.program_id(1)
    out_row = out_ptr + g.to(tl.int64) * out_stride
    if b == num_rows:
        first_pad = tl.load(query_start_ptr + num_rows)
        for k in range(first_pad, num_padded_tokens, BLOCK):
            t = k + tl.arange(0, BLOCK)
            tl.store(out_row + t, tl.full((BLOCK,), PAD, tl.int64), mask=t < num_padded_tokens)
    else:
        start = tl.load(query_start_ptr + b)
        end = tl.load(query_start_ptr + b + 1)
        req = tl.load(idx_mapping_ptr + b)
        width = tl.load(group_width_ptr + g)
        bs = tl.load(group_block_size_ptr + g).to(tl.int64)
        sharded = tl.load(group_sharded_ptr + g) != 0
        # A replicated group is a sharded one with DCP 1: every position is local (owner 0 ==
        # rank 0) and the local position is the global one. Folding it into these scalars
        # keeps one formula and every mask a plain vector comparison.
        d = tl.where(sharded, dcp, 1)
        rank = tl.where(sharded, dcp_rank, 0)
        # A dummy row keeps no token: its live range is empty.
        live_end = tl.where(req != PAD, end, start)
        row_base = tl.load(group_offset_ptr + g) + tl.maximum(req, 0).to(tl.int64) * width
        for k in range(start, end, BLOCK):
            t = k + tl.arange(0, BLOCK)
            in_batch = t < end
            p = tl.load(positions_ptr + t, mask=in_batch, other=0).to(tl.int64)
            virtual = bs * d
            off = p % virtual
            owner = (off // interleave) % d
            local = (p // virtual) * bs + (off // (interleave * d)) * interleave + off % interleave
            index = local // bs
            live = (t < live_end) & (owner == rank)
            in_row = index < width
            block_id = tl.load(table_ptr + row_base + index, mask=live & in_row, other=0)
            slot = block_id.to(tl.int64) * bs + local % bs
            tl.store(out_row + t, tl.where(live & in_row, slot, PAD), mask=in_batch)
            # Out-of-row reads are recorded, not performed. Only the offending lanes touch
            # the (g, b) cell, so the happy path issues no atomics.
            out_of_row = live & (index >= width)
            cell = worst_index_ptr + g * worst_stride + b + index * 0  # one address, broadcast to the block
            tl.atomic_max(cell, index, mask=out_of_row)


def slot_mapping_reference(
    table: torch.Tensor,
    group_offsets: torch.Tensor,
    group_widths: torch.Tensor,
    group_block_sizes: torch.Tensor,
    group_sharded: torch.Tensor,
    idx_mapping: torch.Tensor,
    query_start: torch.Tensor,
    positions: torch.Tensor,
    num_rows: int,
    num_padded_tokens: int,
    dcp_rank: int,
    dcp: int,
    interleave: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`slot_mapping_kernel` does, in torch: returns ``(slots, worst_index)``,
    int64 ``[G, T_pad]`` and int64 ``[G, B]``."""
    device = table.device
    num_groups = group_widths.numel()
    slots = torch.full((num_groups, num_padded_tokens), PAD_SLOT, dtype=torch.int64, device=device)
    worst = torch.full((num_groups, num_rows), -1, dtype=torch.int64, device=device)
    bounds = query_start[: num_rows + 1].to(torch.int64)
    num_tokens = int(bounds[-1]) if num_rows else 0
    if num_tokens == 0:
        return slots, worst
    token_row = torch.repeat_interleave(torch.arange(num_rows, device=device), bounds[1:] - bounds[:-1])
    req = idx_mapping[:num_rows].to(torch.int64)[token_row]
    p = positions[:num_tokens].to(torch.int64)
    for g in range(num_groups):
        width = int(group_widths[g])
        bs = int(group_block_sizes[g])
        if int(group_sharded[g]) and dcp > 1:
            virtual = bs * dcp
            off = p % virtual
            mine = (off // interleave) % dcp == dcp_rank
            local = (p // virtual) * bs + (off // (interleave * dcp)) * interleave + off % interleave
        else:
            mine = torch.ones_like(p, dtype=torch.bool)
            local = p
        index = local // bs
        live = mine & (req != PAD_SLOT)
        in_row = index < width
        ok = live & in_row
        entry = int(group_offsets[g]) + req.clamp(min=0) * width + index.clamp(max=width - 1)
        block_id = table[entry].to(torch.int64)
        slots[g, :num_tokens] = torch.where(ok, block_id * bs + local % bs, PAD_SLOT)
        bad = torch.where(live & ~in_row, index, -1)
        worst[g].scatter_reduce_(0, token_row, bad, reduce="amax")
    return slots, worst
