"""Worker-side checks: block-table writes against each row's capacity, for every group before
anything is written; the batch of copy-on-write copies before it runs; and, on a sample of
steps, the slot mappings the worker computed against ``spec.placement``.

Installed by the plugin (``plugin.py``) around vLLM 0.33.0's worker classes: model runner V1's
``MultiGroupBlockTable.add_row`` / ``append_row`` (vLLM itself checks nothing there, and bumps the
row count before numpy raises) and model runner V2's ``BlockTables.append_block_ids`` (which checks
group by group, so an overflow in group g leaves groups < g already staged: docs/vllm-semantics.md
§10.6); and ``copy_kv_cache_blocks_inplace``, which runs the step's copies as one
gather-then-scatter, so a destination that another copy reads breaks the batch (§10.1). The CPU
staging executor calls :func:`check_copy_batch` directly. Slot mappings come from a GPU kernel in
both model runners (V1 ``MultiGroupBlockTable.compute_slot_mapping``, V2
``BlockTables.compute_slot_mappings``); reading them back costs a device sync, so they are compared
on every :data:`SLOT_CHECK_EVERY`-th call (every call with ``KVPROOF_CONTRACTS=slow``).
"""

from __future__ import annotations

import itertools

from kvproof.integrations.vllm.violations import ViolationSink, contracts_mode
from kvproof.spec.placement import PAD_SLOT, slot_for_position

#: Slot mappings are read back and checked on one call in this many (cheap mode).
SLOT_CHECK_EVERY = 64


def check_copy_batch(copies, sink: ViolationSink, where: str) -> None:
    """Every copy of one batch reads a block no copy of the batch writes, and no block is
    written twice (INV-COW-SOURCE-READY). ``copies`` are vLLM ``KVCacheBlockCopy`` pairs."""
    sources = {c.src_block_id for c in copies}
    written: set[int] = set()
    for c in copies:
        dst = c.dst_block_id
        if dst in sources or dst in written:
            why = "another copy of the batch reads" if dst in sources else "another copy of the batch also writes"
            sink.report(
                "INV-COW-SOURCE-READY",
                f"{where}: copy {c.src_block_id} -> {dst} writes block {dst}, which {why} "
                "(the worker runs the batch as one gather-then-scatter)",
            )
        written.add(dst)


def check_row_writes(where: str, starts, new_block_ids, capacities, sink: ViolationSink) -> None:
    """A write of ``new_block_ids[g]`` at ``starts[g]`` ends inside row capacity
    ``capacities[g]`` in every group (INV-TABLE-WRITE-BOUND); checked for all groups before the
    caller writes any (INV-TABLE-APPEND-ATOMIC)."""
    for g, (start, ids, capacity) in enumerate(zip(starts, new_block_ids, capacities)):
        end = int(start) + len(ids)
        if end > capacity:
            sink.report(
                "INV-TABLE-WRITE-BOUND",
                f"{where}, group {g}: a write of {len(ids)} block ids at entry {int(start)} ends at {end}, "
                f"past the row capacity of {capacity:,}; nothing was written",
            )


def checked_v1_append_row(original, sink: ViolationSink):
    """Wrap ``MultiGroupBlockTable.append_row`` (V1 model runner)."""
    def append_row(self, block_ids, row_idx):
        tables = self.block_tables
        check_row_writes(f"row {row_idx}", [t.num_blocks_per_row[row_idx] for t in tables], block_ids,
                         [t.max_num_blocks_per_req for t in tables], sink)
        return original(self, block_ids, row_idx)
    append_row.__wrapped__ = original
    return append_row


def checked_v1_add_row(original, sink: ViolationSink):
    """Wrap ``MultiGroupBlockTable.add_row`` (V1 model runner; the row starts over)."""
    def add_row(self, block_ids, row_idx):
        tables = self.block_tables
        check_row_writes(f"row {row_idx}", [0] * len(tables), block_ids, [t.max_num_blocks_per_req for t in tables], sink)
        return original(self, block_ids, row_idx)
    add_row.__wrapped__ = original
    return add_row


def checked_v2_append_block_ids(original, sink: ViolationSink):
    """Wrap ``BlockTables.append_block_ids`` (V2 model runner)."""
    def append_block_ids(self, req_index, new_block_ids, overwrite):
        starts = [0 if overwrite else self.num_blocks.np[g, req_index] for g in range(self.num_kv_cache_groups)]
        capacities = [t.gpu.shape[1] for t in self.block_tables]
        check_row_writes(f"request row {req_index}", starts, new_block_ids, capacities, sink)
        return original(self, req_index, new_block_ids, overwrite)
    append_block_ids.__wrapped__ = original
    return append_block_ids


def checked_copy_blocks(original, sink: ViolationSink):
    """Wrap ``copy_kv_cache_blocks_inplace``: check the batch, then copy."""
    def copy_kv_cache_blocks_inplace(kv_caches, num_blocks, kv_cache_block_copies):
        check_copy_batch(kv_cache_block_copies, sink, "worker copy batch")
        return original(kv_caches, num_blocks, kv_cache_block_copies)
    copy_kv_cache_blocks_inplace.__wrapped__ = original
    return copy_kv_cache_blocks_inplace


def check_slot_mapping(where: str, slots, positions, query_start_loc, rows, block_size: int, dcp: int,
                       interleave: int, rank: int, sharded: bool, sink: ViolationSink) -> None:
    """Every token's slot equals ``spec.placement.slot_for_position`` on this rank
    (INV-SLOT-MATCHES-SPEC), and no token reads past its row (INV-SLOT-INDEX-BOUND). ``rows[r]``
    is the block-table row request ``r`` of the batch reads (None for a dummy request: all PAD);
    ``query_start_loc`` has ``len(rows) + 1`` entries; a row is any int64 sequence (numpy rows
    avoid copying wide tables into Python lists). Reports the first wrong token only."""
    for r, row in enumerate(rows):
        for i in range(int(query_start_loc[r]), int(query_start_loc[r + 1])):
            p = int(positions[i])
            try:
                want = PAD_SLOT if row is None else slot_for_position(p, row, block_size, dcp, interleave, rank, sharded)
            except IndexError as e:
                sink.report("INV-SLOT-INDEX-BOUND", f"{where}, batch row {r}, token {i}: {e}")
                return
            got = int(slots[i])
            if got != want:
                sink.report(
                    "INV-SLOT-MATCHES-SPEC",
                    f"{where}, batch row {r}, token {i} (position {p}): the worker maps it to slot {got}, but on rank "
                    f"{rank} of {dcp} (block size {block_size}, interleave {interleave}, "
                    f"{'sharded' if sharded else 'replicated'}) the placement gives {want} "
                    f"({'another rank owns it' if want == PAD_SLOT else 'block ' + str(want // block_size)})",
                )
                return


def _sampler():
    """True on the calls to check: every call in slow mode, one in SLOT_CHECK_EVERY otherwise."""
    every = 1 if contracts_mode() == "slow" else SLOT_CHECK_EVERY
    calls = itertools.count()
    return lambda: next(calls) % every == 0


def checked_v1_slot_mapping(original, sink: ViolationSink):
    """Wrap ``MultiGroupBlockTable.compute_slot_mapping`` (V1 model runner): after the kernel,
    on sampled calls, check every group that maps tokens to slots (every such group is sharded
    under DCP in V1)."""
    from vllm.v1.worker.block_table import SlotMappingMode

    sampled = _sampler()

    def compute_slot_mapping(self, num_reqs, query_start_loc, positions):
        original(self, num_reqs, query_start_loc, positions)
        if not sampled():
            return
        qsl = query_start_loc[: num_reqs + 1].tolist()
        pos = positions[: qsl[-1]].tolist()
        for g, t in enumerate(self.block_tables):
            if t.slot_mapping_mode != SlotMappingMode.TOKEN_TO_KV_SLOT:
                continue
            rows = t.block_table.gpu[:num_reqs].cpu().numpy().astype("int64")  # what the kernel read
            check_slot_mapping(f"V1 slot mapping, group {g}", t.slot_mapping.gpu[: qsl[-1]].tolist(), pos, qsl,
                               list(rows), t.block_size, t.dcp_world_size,
                               t.cp_kv_cache_interleave_size, t.dcp_rank, t.dcp_world_size > 1, sink)
    compute_slot_mapping.__wrapped__ = original
    return compute_slot_mapping


def checked_v2_slot_mappings(original, sink: ViolationSink):
    """Wrap ``BlockTables.compute_slot_mappings`` (V2 model runner): after the kernel, on sampled
    calls, check every group with slot mapping enabled, sharded or not as the table says."""
    sampled = _sampler()

    def compute_slot_mappings(self, idx_mapping, query_start_loc, positions, num_tokens_padded, out=None):
        result = original(self, idx_mapping, query_start_loc, positions, num_tokens_padded, out)
        if self.num_kv_cache_groups == 0 or not sampled():
            return result
        num_reqs = idx_mapping.shape[0]
        qsl = query_start_loc[: num_reqs + 1].tolist()
        pos = positions[: qsl[-1]].tolist()
        req_rows = idx_mapping.tolist()
        enabled, sharded = self.slot_mapping_enabled.tolist(), self.dcp_sharded.tolist()
        for g in range(self.num_kv_cache_groups):
            if not enabled[g]:
                continue
            table = self.block_tables[g].gpu[idx_mapping.clamp(min=0)].cpu().numpy().astype("int64")
            rows = [None if i < 0 else table[r] for r, i in enumerate(req_rows)]
            check_slot_mapping(f"V2 slot mapping, group {g}", result[g, : qsl[-1]].tolist(), pos, qsl, rows,
                               self.block_sizes[g], self.cp_size, self.cp_interleave, self.cp_rank,
                               bool(sharded[g]) and self.cp_size > 1, sink)
        return result
    compute_slot_mappings.__wrapped__ = original
    return compute_slot_mappings
