"""Worker-side checks: block-table writes against each row's capacity, for every group before
anything is written, and the batch of copy-on-write copies before it runs.

Installed by the plugin (``plugin.py``) around vLLM 0.33.0's worker classes: model runner V1's
``MultiGroupBlockTable.add_row`` / ``append_row`` (vLLM itself checks nothing there, and bumps
the row count before numpy raises) and model runner V2's ``BlockTables.append_block_ids``
(which checks group by group, so an overflow in group g leaves groups < g already staged:
reference 10.6); and ``copy_kv_cache_blocks_inplace``, which runs the step's copies as one
gather-then-scatter, so a destination that another copy reads breaks the batch (10.1). The CPU
staging executor calls :func:`check_copy_batch` directly.
"""

from __future__ import annotations

from kvproof.integrations.vllm.violations import ViolationSink


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
