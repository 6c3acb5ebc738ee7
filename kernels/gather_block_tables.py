"""Kernel 2: gather the batch's block-table rows into the forward-pass layout, every group in
one launch.

Batch row ``b`` of group ``g`` receives the first ``num_blocks[g, req]`` entries of state row
``req = idx_mapping[b]``; entries past that are left as they were (readers index only below
the count, and rewriting a 65,536-wide Mamba row every step would cost far more than the
copy). Dummy rows (``req == PAD_SLOT``) and padding rows (``b >= num_rows``, added to fill a
captured batch shape) are zeroed over the whole width, so the forward pass reads block 0 (the
null block) there rather than a stale request's blocks.
"""

from __future__ import annotations

import torch

from kvproof.kernels._triton import jit, tl
from kvproof.spec.placement import PAD_SLOT

#: Entries copied per loop iteration of one program.
GATHER_BLOCK = 1024


@jit
def gather_block_tables_kernel(
    table_ptr,  # int32 [sum_g R * W_g]: the request-state tables, packed (PackedTables.storage)
    group_offset_ptr,  # int64 [G]: first entry of group g's state table in table_ptr
    group_width_ptr,  # int32 [G]: row width W_g of group g (same in state and batch tables)
    num_blocks_ptr,  # int32 [G, R]: entries in use per group per state row
    num_blocks_stride,  # int: R, the row stride of num_blocks_ptr
    idx_mapping_ptr,  # int32 [B]: state row of batch row b; PAD_SLOT (-1) for a dummy row
    num_rows,  # int: B, real batch rows; programs b >= B write padding rows
    out_ptr,  # int32 [sum_g B_cap * W_g], out: the batch tables, packed (B_cap >= grid rows)
    out_offset_ptr,  # int64 [G]: first entry of group g's batch table in out_ptr
    PAD: tl.constexpr,  # the padding sentinel (PAD_SLOT) marking a dummy row in idx_mapping
    BLOCK: tl.constexpr,  # entries copied per loop iteration (power of two)
):
    # Grid (G, padded batch rows): one program per group and batch row.
    g = tl.program_id(0)
    b = tl.program_id(1)
    width = tl.load(group_width_ptr + g)
    req = tl.load(idx_mapping_ptr + b, mask=b < num_rows, other=PAD)
    is_real = req != PAD
    safe_req = tl.maximum(req, 0).to(tl.int64)
    used = tl.load(num_blocks_ptr + g * num_blocks_stride + safe_req, mask=is_real, other=0)
    # A real row copies its used entries (never more than the width, even if a count is
    # corrupt); a dummy or padding row copies nothing and zeroes its whole width. Folding the
    # row kind into integer limits keeps every mask a plain vector comparison.
    copied = tl.where(is_real, tl.minimum(used, width), 0)
    limit = tl.where(is_real, copied, width)
    src = tl.load(group_offset_ptr + g) + safe_req * width
    dst = tl.load(out_offset_ptr + g) + b.to(tl.int64) * width
    for k in range(0, limit, BLOCK):
        cols = k + tl.arange(0, BLOCK)
        keep = cols < limit
        ids = tl.load(table_ptr + src + cols, mask=cols < copied, other=0)
        tl.store(out_ptr + dst + cols, ids, mask=keep)


def gather_block_tables_reference(
    table: torch.Tensor,
    group_offsets: torch.Tensor,
    group_widths: torch.Tensor,
    num_blocks: torch.Tensor,
    idx_mapping: torch.Tensor,
    num_rows: int,
    num_padded_rows: int,
    out: torch.Tensor,
    out_offsets: torch.Tensor,
) -> None:
    """What :func:`gather_block_tables_kernel` does, in torch, for batch rows
    ``[0, num_padded_rows)``. Mutates ``out``."""
    widths = group_widths.tolist()
    offsets = group_offsets.tolist()
    out_starts = out_offsets.tolist()
    reqs = torch.full((num_padded_rows,), PAD_SLOT, dtype=torch.int64, device=table.device)
    reqs[:num_rows] = idx_mapping[:num_rows].to(torch.int64)
    is_real = reqs != PAD_SLOT
    safe = reqs.clamp(min=0)
    for g, width in enumerate(widths):
        state = table[offsets[g] : offsets[g] + num_blocks.shape[1] * width].view(-1, width)
        batch = out[out_starts[g] : out_starts[g] + num_padded_rows * width].view(num_padded_rows, width)
        used = torch.where(is_real, num_blocks[g].to(torch.int64)[safe].clamp(max=width), width)
        cols = torch.arange(width, device=table.device)
        written = cols[None, :] < used[:, None]
        values = torch.where(is_real[:, None], state[safe], torch.zeros_like(state[safe]))
        batch[written] = values[written]
