"""Kernel 1: apply a step's staged block-table writes, every group in one launch.

A staged write puts ``len`` block ids at columns ``[start, start + len)`` of one request row
of one group's table. The host (:class:`kvproof.kernels.block_table.BlockTables`) refuses a
write that would end past the row before staging it (INV-TABLE-WRITE-BOUND); the kernel masks
every store to the row width anyway, as a second line of defence, and reports a write it had
to cut in ``clipped`` so that the host can name it. vLLM 0.33's write kernel masks only by
content length, which is how a too-narrow Mamba row spilled into the next request's row
(docs/vllm-semantics.md §6.3, §10.6).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from kvproof.kernels._triton import jit, tl

#: Block ids copied per loop iteration of one program.
WRITE_BLOCK = 1024


@dataclasses.dataclass(frozen=True)
class StagedWrites:
    """Writes in the kernel's input layout: int32 tensors on one device.

    ``group``, ``row``, ``start``, ``length``, ``src``: ``[N]`` (``src``: offset of write
    ``i``'s first id in ``contents``); ``contents``: ``[sum(length)]``. All six are views of one
    buffer, so a step's writes reach the device in a single copy.
    """

    group: torch.Tensor
    row: torch.Tensor
    start: torch.Tensor
    length: torch.Tensor
    src: torch.Tensor
    contents: torch.Tensor

    @property
    def num_writes(self) -> int:
        return self.group.numel()

    @classmethod
    def from_lists(
        cls, writes: Sequence[tuple[int, int, int, Sequence[int]]], device: torch.device | str = "cpu"
    ) -> StagedWrites:
        """Pack ``(group, row, start, block_ids)`` tuples. O(total ids); one host-to-device
        copy (from pinned memory, not blocking the host) when ``device`` is a GPU."""
        n = len(writes)
        meta: list[int] = [0] * (5 * n)
        contents: list[int] = []
        for i, (g, r, s, ids) in enumerate(writes):
            meta[i], meta[n + i], meta[2 * n + i] = g, r, s
            meta[3 * n + i], meta[4 * n + i] = len(ids), len(contents)
            contents.extend(ids)
        buf = torch.tensor(meta + contents, dtype=torch.int32)
        device = torch.device(device)
        if device.type == "cuda":
            buf = buf.pin_memory().to(device, non_blocking=True)
        elif device.type != "cpu":
            buf = buf.to(device)
        return cls(*(buf[k * n : (k + 1) * n] for k in range(5)), buf[5 * n :])


@jit
def apply_writes_kernel(
    table_ptr,  # int32 [sum_g rows * W_g]: every group's table, packed (PackedTables.storage)
    group_offset_ptr,  # int64 [G]: first entry of group g's table in table_ptr
    group_width_ptr,  # int32 [G]: row width W_g (entries per request row of group g)
    write_group_ptr,  # int32 [N]: group written by write i
    write_row_ptr,  # int32 [N]: request row written by write i
    write_start_ptr,  # int32 [N]: first column written by write i
    write_len_ptr,  # int32 [N]: number of block ids in write i
    write_src_ptr,  # int32 [N]: offset of write i's first block id in contents_ptr
    contents_ptr,  # int32 [sum_i len_i]: the block ids of all writes, one after another
    clipped_ptr,  # int32 [N], out: 1 where write i reached past its row and was cut, else 0
    BLOCK: tl.constexpr,  # ids copied per loop iteration (power of two)
):
    # Grid (N,): one program per staged write; the host keeps writes disjoint, so programs
    # never race on an entry.
    i = tl.program_id(0)
    g = tl.load(write_group_ptr + i)
    row = tl.load(write_row_ptr + i).to(tl.int64)
    start = tl.load(write_start_ptr + i)
    length = tl.load(write_len_ptr + i)
    width = tl.load(group_width_ptr + g)
    src = tl.load(write_src_ptr + i).to(tl.int64)
    dst = tl.load(group_offset_ptr + g) + row * width + start
    # Second line of defence (INV-TABLE-WRITE-BOUND): cut the write at the row's end so that
    # it can never land in the next request's row.
    n = tl.maximum(tl.minimum(start + length, width) - start, 0)
    tl.store(clipped_ptr + i, (start + length > width).to(tl.int32))
    for k in range(0, n, BLOCK):
        cols = k + tl.arange(0, BLOCK)
        keep = cols < n
        ids = tl.load(contents_ptr + src + cols, mask=keep)
        tl.store(table_ptr + dst + cols, ids, mask=keep)


def apply_writes_reference(
    table: torch.Tensor,
    group_offsets: torch.Tensor,
    group_widths: torch.Tensor,
    writes: StagedWrites,
) -> torch.Tensor:
    """What :func:`apply_writes_kernel` does, in torch. Mutates ``table``; returns ``clipped``
    (int32 ``[N]``, 1 where a write was cut at its row's end)."""
    offsets = group_offsets.tolist()
    widths = group_widths.tolist()
    clipped = []
    for g, row, start, length, src in zip(
        writes.group.tolist(), writes.row.tolist(), writes.start.tolist(),
        writes.length.tolist(), writes.src.tolist(),
    ):
        width = widths[g]
        n = max(min(start + length, width) - start, 0)
        dst = offsets[g] + row * width + start
        table[dst : dst + n] = writes.contents[src : src + n]
        clipped.append(int(start + length > width))
    return torch.tensor(clipped, dtype=torch.int32, device=table.device)
