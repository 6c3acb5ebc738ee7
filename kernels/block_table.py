"""Worker-side block tables: one row per request slot per cache group, sized by the geometry
spec, written through staged appends and read by the gather and slot-mapping kernels.

Row widths come from :func:`kvproof.spec.geometry.max_num_blocks_per_req` (padded by
:func:`~kvproof.spec.geometry.block_table_width`) via :func:`kvproof.spec.layout.resolve_layout`:
sharded attention rows hold ``cdiv(max_len, block_size * dcp)`` entries, replicated Mamba rows
``cdiv(max_len, block_size) + speculative`` -- never divided by DCP (INV-TABLE-WIDTH).

An append is checked for every group before anything is staged (INV-TABLE-WRITE-BOUND,
INV-TABLE-APPEND-ATOMIC): vLLM 0.33 checked group by group, so an overflow in group 1 left group 0
already staged with its count advanced (docs/vllm-semantics.md §10.6). Staged writes reach the
tables in one kernel launch at :meth:`BlockTables.apply_staged_writes`.

Worked example (docs/vllm-semantics.md §6.3, example 2): Mamba block 16, DCP 8, 1,048,576 tokens
needs 65,536 entries; the old rule ``cdiv(max_len, 16 * 8)`` gave 8,192, and appending the 65,536
blocks of a 1M-token request into such a row is refused here before any write.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from kvproof.kernels import host
from kvproof.kernels.apply_writes import StagedWrites
from kvproof.kernels.packed_tables import PackedTables
from kvproof.spec.contracts import check
from kvproof.spec.geometry import max_num_blocks_per_req
from kvproof.spec.layout import Layout
from kvproof.spec.placement import PAD_SLOT


@dataclasses.dataclass(frozen=True)
class TableGroup:
    """What the worker needs of one cache group: its row width, its physical block size (per
    rank, not DCP-scaled), whether DCP shards it, and a label for messages."""

    width: int
    block_size: int
    sharded: bool
    label: str = ""

    def __post_init__(self) -> None:
        if self.width < 1 or self.block_size < 1:
            raise ValueError(
                f"table group {self.label or '?'}: width {self.width} and block size {self.block_size} must be >= 1"
            )


class BlockTables:
    """Per-request, per-group block tables on one DCP rank (mutable).

    Host-side counts (``num_blocks``) change when an append is staged; table entries change
    when :meth:`apply_staged_writes` runs. The scheduler's view of a request's blocks and the
    rows here agree after every ``apply_staged_writes``.
    """

    def __init__(
        self,
        groups: Sequence[TableGroup],
        max_num_reqs: int,
        *,
        dcp: int = 1,
        dcp_rank: int = 0,
        interleave: int = 1,
        device: torch.device | str = "cpu",
        backend: str | None = None,
    ) -> None:
        if not groups:
            raise ValueError("at least one cache group is required")
        if max_num_reqs < 1:
            raise ValueError(f"max_num_reqs {max_num_reqs} must be >= 1")
        if dcp < 1 or not 0 <= dcp_rank < dcp or interleave < 1:
            raise ValueError(
                f"dcp {dcp}, dcp_rank {dcp_rank}, interleave {interleave}: expected dcp >= 1, "
                f"0 <= dcp_rank < dcp and interleave >= 1"
            )
        self.groups = tuple(groups)
        self.max_num_reqs = max_num_reqs
        self.dcp, self.dcp_rank, self.interleave = dcp, dcp_rank, interleave
        self.device = torch.device(device)
        self.backend = host.resolve_backend(self.device, backend)
        self.widths = tuple(g.width for g in self.groups)
        self.labels = tuple(g.label or f"group {i}" for i, g in enumerate(self.groups))
        self.tables = PackedTables.zeros(self.widths, max_num_reqs, self.device)
        self.input_tables = self.tables.like()
        self._block_sizes = torch.tensor([g.block_size for g in self.groups], dtype=torch.int32, device=self.device)
        self._sharded = host.sharded_flags([g.sharded for g in self.groups], dcp, self.device)
        # Host truth for the counts (Python ints: the append check reads them per call), and
        # the device copy the gather kernel reads, refreshed at apply_staged_writes.
        self._num_blocks = [[0] * max_num_reqs for _ in self.groups]
        self._num_blocks_device = torch.zeros((len(self.groups), max_num_reqs), dtype=torch.int32, device=self.device)
        # One contiguous pending write per (group, row): overwrites replace it and appends
        # extend it, so the writes of one step never overlap (INV-TABLE-STAGE-DISJOINT) and the
        # kernel may apply them in any order.
        self._staged: dict[tuple[int, int], tuple[int, list[int]]] = {}
        self._dirty_counts: set[tuple[int, int]] = set()
        # Stays -1 unless a slot mapping reads past a row (then it is refilled before the
        # IndexError), so the happy path launches nothing to reset it.
        self._slot_worst = torch.full((len(self.groups), max_num_reqs), -1, dtype=torch.int64, device=self.device)

    @classmethod
    def from_layout(
        cls,
        layout: Layout,
        max_num_reqs: int,
        *,
        dcp_rank: int = 0,
        device: torch.device | str = "cpu",
        backend: str | None = None,
    ) -> BlockTables:
        """Tables whose widths are the layout's (INV-TABLE-WIDTH)."""
        groups = []
        for gl in layout.groups:
            needed = max_num_blocks_per_req(gl.group, layout.dcp, layout.config.max_model_len)
            check(
                gl.table_width >= needed,
                "INV-TABLE-WIDTH",
                f"group {gl.index} ({gl.group.label}) row width {gl.table_width} < {needed} entries needed",
            )
            # A Mamba group in mode 'none' keeps one running state for the whole request (entry
            # 0, then speculative blocks), whatever the position: one block spans max_model_len
            # tokens, as vLLM sets mamba_block_size in that mode.
            block = gl.group.block_size if gl.group.prefix_cacheable else layout.config.max_model_len
            groups.append(TableGroup(gl.table_width, block, gl.group.is_sharded, gl.group.label))
        return cls(
            groups, max_num_reqs, dcp=layout.dcp, dcp_rank=dcp_rank,
            interleave=layout.config.interleave, device=device, backend=backend,
        )

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def num_blocks(self, req_index: int) -> tuple[int, ...]:
        """Entries in use in request row ``req_index``, per group (staged ones included)."""
        self._check_row(req_index)
        return tuple(counts[req_index] for counts in self._num_blocks)

    # ----------------------------------------------------------------------------------------
    # Staged appends
    # ----------------------------------------------------------------------------------------

    def append_overflow(
        self, req_index: int, block_ids: Sequence[Sequence[int]], overwrite: bool
    ) -> tuple[int, int, int] | None:
        """The first ``(group, end, width)`` whose row the append would overflow, or None.
        Does not mutate. O(groups)."""
        self._check_row(req_index)
        if len(block_ids) != len(self.groups):
            raise ValueError(f"block ids for {len(block_ids)} groups; expected {len(self.groups)}")
        for g, ids in enumerate(block_ids):
            end = (0 if overwrite else self._num_blocks[g][req_index]) + len(ids)
            if end > self.widths[g]:
                return g, end, self.widths[g]
        return None

    def can_append(self, req_index: int, block_ids: Sequence[Sequence[int]], overwrite: bool) -> bool:
        """Whether :meth:`append_block_ids` would accept these ids. Does not mutate."""
        return self.append_overflow(req_index, block_ids, overwrite) is None

    def append_block_ids(self, req_index: int, block_ids: Sequence[Sequence[int]], overwrite: bool) -> None:
        """Stage ``block_ids[g]`` for row ``req_index`` of every group ``g`` (mutates).

        ``overwrite`` (a new request: its whole block list) writes from column 0; otherwise
        (a running request: only its new blocks) after the row's current entries. Every group
        is checked first: if any would end past its row, RuntimeError names the request, the
        group and ``end > capacity``, and no group's row, count or staged writes change
        (INV-TABLE-WRITE-BOUND, INV-TABLE-APPEND-ATOMIC). O(groups + ids).
        """
        overflow = self.append_overflow(req_index, block_ids, overwrite)
        if overflow is not None:
            g, end, width = overflow
            raise RuntimeError(
                f"INV-TABLE-WRITE-BOUND: block table write for request {req_index}, group {g} "
                f"exceeds row capacity ({end} > {width}) [{self.labels[g]}]; nothing was staged"
            )
        for g, ids in enumerate(block_ids):
            key = (g, req_index)
            count = 0 if overwrite else self._num_blocks[g][req_index]
            pending = None if overwrite else self._staged.get(key)
            if pending is not None:
                pending[1].extend(ids)  # contiguous: the pending write ends at ``count``
            elif ids:
                self._staged[key] = (count, list(ids))
            else:
                self._staged.pop(key, None)  # an empty overwrite leaves nothing to write
            self._num_blocks[g][req_index] = count + len(ids)
            self._dirty_counts.add(key)

    def clear_request(self, req_index: int) -> None:
        """Forget row ``req_index`` in every group (mutates): counts drop to 0 and its staged
        writes are dropped. The entries stay, unread, until the row is overwritten."""
        self._check_row(req_index)
        for g in range(len(self.groups)):
            self._num_blocks[g][req_index] = 0
            self._staged.pop((g, req_index), None)
            self._dirty_counts.add((g, req_index))

    def apply_staged_writes(self) -> None:
        """Write every staged append into the tables in one kernel launch, and publish the
        counts to the device (mutates). O(staged ids)."""
        if self._staged:
            writes = StagedWrites.from_lists(
                [(g, r, start, ids) for (g, r), (start, ids) in self._staged.items()], self.device
            )
            self._staged.clear()
            # append_block_ids already refused every overflow (INV-TABLE-WRITE-BOUND); the
            # kernel's mask stays as the second line, and not reading its flags back keeps the
            # step free of a device sync.
            host.apply_writes(self.tables, writes, backend=self.backend, check=False)
        if self._dirty_counts:
            rows = [(g, r, self._num_blocks[g][r]) for g, r in self._dirty_counts]
            self._dirty_counts.clear()
            update = torch.tensor(rows, dtype=torch.int64)  # [K, 3]: group, row, count
            if self.device.type == "cuda":
                update = update.pin_memory().to(self.device, non_blocking=True)
            else:
                update = update.to(self.device)
            self._num_blocks_device[update[:, 0], update[:, 1]] = update[:, 2].to(torch.int32)

    def row(self, group: int, req_index: int) -> list[int]:
        """The applied entries in use of one row (for tests and debugging; syncs)."""
        self._check_row(req_index)
        n = self._num_blocks[group][req_index]
        return self.tables.group(group)[req_index, :n].tolist()

    # ----------------------------------------------------------------------------------------
    # Forward-pass inputs
    # ----------------------------------------------------------------------------------------

    def gather(self, idx_mapping: Sequence[int] | torch.Tensor, num_padded_rows: int | None = None) -> list[torch.Tensor]:
        """Each group's ``[num_padded_rows, W_g]`` batch table: row ``b`` holds the entries of
        request row ``idx_mapping[b]`` (PAD_SLOT: a dummy row, zeroed); rows past the batch
        are zeroed. Returns views of a buffer the next call overwrites."""
        idx = self._idx_tensor(idx_mapping)
        padded = idx.numel() if num_padded_rows is None else num_padded_rows
        return host.gather_block_tables(
            self.tables, self._num_blocks_device, idx, padded, self.input_tables, backend=self.backend
        )

    def compute_slot_mappings(
        self,
        idx_mapping: Sequence[int] | torch.Tensor,
        query_start: Sequence[int] | torch.Tensor,
        positions: Sequence[int] | torch.Tensor,
        num_padded_tokens: int | None = None,
    ) -> torch.Tensor:
        """int64 ``[G, num_padded_tokens]`` slots of every token in every group on this rank.

        Batch row ``b``'s tokens are ``[query_start[b], query_start[b + 1])`` with global
        positions ``positions[...]``. Raises IndexError (INV-SLOT-INDEX-BOUND) naming the
        request, group, index and width if a position reads past its row (the check reads
        one small error tensor back from the device)."""
        idx = self._idx_tensor(idx_mapping)
        starts = torch.as_tensor(query_start, dtype=torch.int32, device=self.device)
        pos = torch.as_tensor(positions, dtype=torch.int64, device=self.device)
        padded = int(starts[-1]) if num_padded_tokens is None else num_padded_tokens
        worst = self._slot_worst if idx.numel() <= self.max_num_reqs else None
        slots, _ = host.compute_slot_mappings(
            self.tables, self._block_sizes, self._sharded, idx, starts, pos, padded,
            dcp_rank=self.dcp_rank, dcp=self.dcp, interleave=self.interleave,
            backend=self.backend, labels=self.labels, worst_index=worst,
        )
        return slots

    # ----------------------------------------------------------------------------------------
    # Checks
    # ----------------------------------------------------------------------------------------

    def _check_row(self, req_index: int) -> None:
        if not 0 <= req_index < self.max_num_reqs:
            raise ValueError(f"request row {req_index} is out of range; expected 0 <= row < {self.max_num_reqs}")

    def _idx_tensor(self, idx_mapping: Sequence[int] | torch.Tensor) -> torch.Tensor:
        if not isinstance(idx_mapping, torch.Tensor):
            for b, r in enumerate(idx_mapping):
                if r != PAD_SLOT and not 0 <= r < self.max_num_reqs:
                    raise ValueError(
                        f"idx_mapping[{b}] = {r}: expected a request row in [0, {self.max_num_reqs}) "
                        f"or the padding sentinel {PAD_SLOT}"
                    )
        return torch.as_tensor(idx_mapping, dtype=torch.int32, device=self.device)

    def _check(self) -> None:
        """Whole-state check (tests only): counts within widths, staged writes inside their
        rows and ending at the counts."""
        for g, counts in enumerate(self._num_blocks):
            for r, n in enumerate(counts):
                check(0 <= n <= self.widths[g], "INV-TABLE-WRITE-BOUND",
                      f"request {r}, group {g}: count {n} outside [0, {self.widths[g]}]")
        for (g, r), (start, ids) in self._staged.items():
            check(start + len(ids) == self._num_blocks[g][r], "INV-TABLE-STAGE-DISJOINT",
                  f"request {r}, group {g}: staged write [{start}, {start + len(ids)}) does not end "
                  f"at the count {self._num_blocks[g][r]}")
