"""Host API of the block-table kernels: picks a backend, launches, and turns the kernels'
error outputs into exceptions that name the request, the group and the numbers.

Backends:
- ``"triton"``: the Triton kernels -- natively on a CUDA device, or in Triton's interpreter on
  CPU tensors when ``TRITON_INTERPRET=1`` is set;
- ``"torch"``: the torch references (any device), used when Triton is missing or cannot run
  on the tensors' device.

``backend=None`` means ``$KVPROOF_KERNEL_BACKEND`` if set (``auto``, ``triton`` or ``torch``),
else ``auto``: Triton where it can run, the reference otherwise. No call waits for the device
except the error checks (``check=True``), which read one small error tensor back.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from kvproof.kernels._triton import HAVE_TRITON, launchable
from kvproof.kernels.apply_writes import (
    WRITE_BLOCK,
    StagedWrites,
    apply_writes_kernel,
    apply_writes_reference,
)
from kvproof.kernels.gather_block_tables import (
    GATHER_BLOCK,
    gather_block_tables_kernel,
    gather_block_tables_reference,
)
from kvproof.kernels.packed_tables import PackedTables
from kvproof.kernels.slot_mapping import SLOT_BLOCK, slot_mapping_kernel, slot_mapping_reference
from kvproof.spec.placement import PAD_SLOT

BACKENDS = ("auto", "triton", "torch")
BACKEND_ENV = "KVPROOF_KERNEL_BACKEND"


def triton_runs_on(device: torch.device | str) -> bool:
    """Whether the Triton kernels can run on tensors of ``device``: natively on CUDA, or in
    Triton's interpreter on CPU when ``TRITON_INTERPRET=1`` (at import or now)."""
    return launchable(apply_writes_kernel, torch.device(device).type) is not None


def resolve_backend(device: torch.device | str, backend: str | None = None) -> str:
    """``"triton"`` or ``"torch"`` for tensors on ``device`` (see the module docstring).

    Raises ValueError for an unknown name, or for ``"triton"`` where Triton cannot run."""
    choice = backend if backend is not None else os.environ.get(BACKEND_ENV, "auto")
    if choice not in BACKENDS:
        raise ValueError(f"kernel backend {choice!r} is unknown; expected one of {', '.join(BACKENDS)}")
    runs = triton_runs_on(device)
    if choice == "triton" and not runs:
        why = "Triton is not installed" if not HAVE_TRITON else (
            "Triton kernels need a CUDA device, or TRITON_INTERPRET=1 for CPU tensors"
        )
        raise ValueError(f"kernel backend 'triton' cannot run on device {torch.device(device)}: {why}")
    if choice == "auto":
        return "triton" if runs else "torch"
    return choice


def _launch(kernel, device: torch.device):
    """``kernel`` in the form that runs on ``device`` (compiled, or interpreted on CPU)."""
    return launchable(kernel, device.type)


# --------------------------------------------------------------------------------------------
# Kernel 1: staged writes
# --------------------------------------------------------------------------------------------


def apply_writes(
    tables: PackedTables, writes: StagedWrites, *, backend: str | None = None, check: bool = True
) -> torch.Tensor:
    """Apply ``writes`` to ``tables`` (mutates ``tables.storage``) in one launch for all groups.

    Returns ``clipped`` (int32 ``[N]``). With ``check`` a write that the kernel had to cut at
    its row's end raises RuntimeError (INV-TABLE-WRITE-BOUND) -- after the in-bounds part was
    written, but nothing was written past any row. :class:`BlockTables` refuses such writes
    before staging them, so this fires only when that check was bypassed.
    """
    n = writes.num_writes
    if n == 0:
        return torch.zeros(0, dtype=torch.int32, device=tables.device)
    if resolve_backend(tables.device, backend) == "triton":
        clipped = torch.empty(n, dtype=torch.int32, device=tables.device)
        _launch(apply_writes_kernel, tables.device)[(n,)](
            tables.storage, tables.offsets, tables.widths,
            writes.group, writes.row, writes.start, writes.length, writes.src, writes.contents,
            clipped, BLOCK=WRITE_BLOCK,
        )
    else:
        clipped = apply_writes_reference(tables.storage, tables.offsets, tables.widths, writes)
    if check and bool(clipped.any()):
        i = int(torch.nonzero(clipped)[0, 0])
        g, row = int(writes.group[i]), int(writes.row[i])
        end = int(writes.start[i]) + int(writes.length[i])
        raise RuntimeError(
            f"INV-TABLE-WRITE-BOUND: block table write for request {row}, group {g} exceeds row "
            f"capacity ({end} > {tables.widths_host[g]}); the kernel stopped it at the row's end"
        )
    return clipped


# --------------------------------------------------------------------------------------------
# Kernel 2: gather into the forward-pass layout
# --------------------------------------------------------------------------------------------


def gather_block_tables(
    tables: PackedTables,
    num_blocks: torch.Tensor,
    idx_mapping: torch.Tensor,
    num_padded_rows: int,
    out: PackedTables,
    *,
    backend: str | None = None,
) -> list[torch.Tensor]:
    """Gather batch rows ``idx_mapping`` (int32 ``[B]``, PAD_SLOT for dummies) of ``tables``
    into the first ``num_padded_rows`` rows of ``out`` (mutates ``out``): real rows get their
    first ``num_blocks[g, req]`` entries, dummy and padding rows are zeroed.

    Returns each group's ``[num_padded_rows, W_g]`` view of ``out``."""
    num_rows = idx_mapping.numel()
    if not num_rows <= num_padded_rows <= out.rows:
        raise ValueError(
            f"num_padded_rows {num_padded_rows} must lie in [{num_rows}, {out.rows}] "
            f"(batch rows .. rows of the output tables)"
        )
    if out.widths_host != tables.widths_host:
        raise ValueError(f"output widths {out.widths_host} differ from the table widths {tables.widths_host}")
    if num_padded_rows > 0:
        if resolve_backend(tables.device, backend) == "triton":
            _launch(gather_block_tables_kernel, tables.device)[(tables.num_groups, num_padded_rows)](
                tables.storage, tables.offsets, tables.widths, num_blocks, num_blocks.stride(0),
                idx_mapping, num_rows, out.storage, out.offsets,
                PAD=PAD_SLOT, BLOCK=GATHER_BLOCK,
            )
        else:
            gather_block_tables_reference(
                tables.storage, tables.offsets, tables.widths, num_blocks, idx_mapping,
                num_rows, num_padded_rows, out.storage, out.offsets,
            )
    return [out.group(g)[:num_padded_rows] for g in range(out.num_groups)]


# --------------------------------------------------------------------------------------------
# Kernel 3: slot mappings
# --------------------------------------------------------------------------------------------


def sharded_flags(sharded: Sequence[bool], dcp: int, device: torch.device | str) -> torch.Tensor:
    """The kernel's ``group_sharded`` input: 1 where a group is DCP-sharded and ``dcp > 1``."""
    return torch.tensor([int(s and dcp > 1) for s in sharded], dtype=torch.int32, device=device)


def compute_slot_mappings(
    tables: PackedTables,
    block_sizes: torch.Tensor,
    sharded: torch.Tensor,
    idx_mapping: torch.Tensor,
    query_start: torch.Tensor,
    positions: torch.Tensor,
    num_padded_tokens: int,
    *,
    dcp_rank: int = 0,
    dcp: int = 1,
    interleave: int = 1,
    backend: str | None = None,
    check: bool = True,
    labels: Sequence[str] | None = None,
    out: torch.Tensor | None = None,
    worst_index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot mappings of every group for this rank, in one launch.

    ``block_sizes``: int32 ``[G]`` physical block sizes; ``sharded``: int32 ``[G]`` from
    :func:`sharded_flags`; ``idx_mapping``: int32 ``[B]`` state rows (PAD_SLOT for dummies);
    ``query_start``: int32 ``[B + 1]``; ``positions``: int64 ``[>= query_start[B]]``.
    Returns ``(slots, worst_index)``: int64 ``[G, num_padded_tokens]`` (PAD_SLOT for tokens
    another rank owns, dummy rows and tokens past the batch) and int64 ``[G, B]`` (largest
    out-of-row table index per group and batch row, -1 if none). With ``check`` an
    out-of-row read raises IndexError (INV-SLOT-INDEX-BOUND) naming it.

    ``out`` (int64 ``[G, >= num_padded_tokens]``) and ``worst_index`` (int64 ``[G, >= B]``,
    all -1 on entry) may be kept by the caller across steps: the kernel touches
    ``worst_index`` only to record an error, so it stays -1 on the happy path and needs no
    refill launch; after an error it is refilled here before raising.
    """
    if not 0 <= dcp_rank < dcp or interleave < 1:
        raise ValueError(f"dcp_rank {dcp_rank} must lie in [0, {dcp}) and interleave {interleave} must be >= 1")
    num_rows = idx_mapping.numel()
    if query_start.numel() != num_rows + 1:
        raise ValueError(f"query_start has {query_start.numel()} entries; expected batch rows + 1 = {num_rows + 1}")
    num_groups = tables.num_groups
    if resolve_backend(tables.device, backend) == "triton":
        if out is None:
            out = torch.empty((num_groups, num_padded_tokens), dtype=torch.int64, device=tables.device)
        if worst_index is None:
            worst_index = torch.full((num_groups, num_rows), -1, dtype=torch.int64, device=tables.device)
        slots, worst = out[:, :num_padded_tokens], worst_index[:, :num_rows]
        _launch(slot_mapping_kernel, tables.device)[(num_groups, num_rows + 1)](
            tables.storage, tables.offsets, tables.widths, block_sizes, sharded,
            idx_mapping, query_start, positions, num_rows, num_padded_tokens,
            dcp_rank, dcp, interleave, slots, slots.stride(0), worst, worst.stride(0),
            PAD=PAD_SLOT, BLOCK=SLOT_BLOCK,
        )
    else:
        slots, worst = slot_mapping_reference(
            tables.storage, tables.offsets, tables.widths, block_sizes, sharded, idx_mapping,
            query_start, positions, num_rows, num_padded_tokens, dcp_rank, dcp, interleave,
        )
        if out is not None:
            out[:, :num_padded_tokens] = slots
            slots = out[:, :num_padded_tokens]
    if check:
        try:
            raise_if_out_of_row(worst, idx_mapping, tables.widths_host, labels)
        except IndexError:
            if worst_index is not None:
                worst_index.fill_(-1)  # the caller's buffer must be -1 again for the next step
            raise
    return slots, worst


def raise_if_out_of_row(
    worst_index: torch.Tensor,
    idx_mapping: torch.Tensor,
    widths: Sequence[int],
    labels: Sequence[str] | None = None,
) -> None:
    """Raise IndexError (INV-SLOT-INDEX-BOUND) naming the first group and batch row whose slot
    mapping read past its row. Reads ``worst_index`` back from the device (one sync)."""
    if worst_index.numel() == 0 or int(worst_index.max()) < 0:
        return
    g, b = (int(x) for x in torch.nonzero(worst_index >= 0)[0])
    name = f" ({labels[g]})" if labels is not None else ""
    raise IndexError(
        f"INV-SLOT-INDEX-BOUND: slot mapping for request {int(idx_mapping[b])} (batch row {b}), "
        f"group {g}{name} reads block-table index {int(worst_index[g, b])} but the row holds "
        f"{widths[g]} entries"
    )


__all__ = [
    "BACKENDS",
    "apply_writes",
    "compute_slot_mappings",
    "gather_block_tables",
    "raise_if_out_of_row",
    "resolve_backend",
    "sharded_flags",
    "triton_runs_on",
]
