"""The plugin's worker-side slot-mapping check (INV-SLOT-MATCHES-SPEC) around vLLM 0.33.0's
model-runner tables.

vLLM computes slot mappings with a GPU kernel in both model runners; on a CPU its Triton import
is a placeholder, so here a stand-in kernel fills vLLM's own buffers: ``_slots`` below, the
DCP placement written out per token (owner = offset in the virtual block // interleave % DCP),
and seeded bugs in it. The check compares with ``spec.placement``; what is tested is that it
reads the right buffers (vLLM's V1 ``MultiGroupBlockTable`` on CPU, V2 ``BlockTables``
members), fires on each bug with the request, token, position and slots, and samples calls."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
import vllm.v1.worker.block_table as v1_module  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from vllm.v1.worker.block_table import MultiGroupBlockTable, SlotMappingMode  # noqa: E402
from vllm.v1.worker.gpu.block_table import BlockTables  # noqa: E402

from kvproof.integrations.vllm import worker_checks  # noqa: E402
from kvproof.integrations.vllm.violations import ViolationSink  # noqa: E402
from kvproof.spec.contracts import InvariantViolation  # noqa: E402

PAD = -1


def _slots(row, position, block_size, dcp, rank, interleave, sharded=True, bug=None):
    """A stand-in kernel's slot for one token (``bug`` seeds one mistake)."""
    if not sharded or dcp == 1:
        return int(row[position // block_size]) * block_size + position % block_size
    virtual = block_size * dcp
    offset = position % virtual
    owner = offset // interleave % dcp
    if bug == "rank-shift":
        owner = (owner + 1) % dcp
    if owner != rank:
        return PAD
    local = offset // (interleave * dcp) * interleave + offset % interleave
    if bug == "interleave-ignored":
        local = offset // dcp
    block = position // virtual
    if bug == "row-divided-twice":
        block //= dcp
    if block >= len(row):
        return 0  # what a GPU kernel reads past its row: anything
    return int(row[block]) * block_size + local


class _V1Kernel:
    """Stands in for vLLM's ``_COMPUTE_SLOT_MAPPING_KERNEL`` (same call signature)."""

    def __init__(self, bug=None):
        self.bug = bug

    def register_warmup(self, **_):
        pass

    def __call__(self, num_reqs, num_tokens, max_num_tokens, query_start_loc, positions, block_table, block_table_stride,
               slot_mapping, kv_cache_block_size, total_cp_world_size, total_cp_rank, cp_kv_cache_interleave_size):
        for r in range(num_reqs):
            for i in range(int(query_start_loc[r]), int(query_start_loc[r + 1])):
                slot_mapping[i] = _slots(block_table[r], int(positions[i]), kv_cache_block_size, total_cp_world_size,
                                         total_cp_rank, cp_kv_cache_interleave_size, bug=self.bug)


def _v1_tables(monkeypatch, dcp, rank, interleave, bug=None):
    monkeypatch.setattr(v1_module, "_COMPUTE_SLOT_MAPPING_KERNEL", _V1Kernel(bug))
    tables = MultiGroupBlockTable(
        max_num_reqs=2, max_num_batched_tokens=64, pin_memory=False, device=torch.device("cpu"), block_sizes=[4, 8],
        max_num_blocks=[8, 8], slot_mapping_modes=[SlotMappingMode.TOKEN_TO_KV_SLOT, SlotMappingMode.NONE],
        cp_kv_cache_interleave_size=interleave,
    )
    sharded = tables.block_tables[0]
    sharded.dcp_world_size, sharded.dcp_rank = dcp, rank  # as the DCP group would set them
    tables.add_row(([3, 5, 7, 11], [2]), 0)
    tables.add_row(([9, 13], [4]), 1)
    sharded.block_table.gpu.copy_(sharded.block_table.cpu)  # the commit, without pinned memory
    return tables


#: Two requests: a prefill chunk of 40 tokens from position 0 (several virtual blocks at DCP 4)
#: and a decode token at position 9.
QUERY_START_LOC = torch.tensor([0, 40, 41], dtype=torch.int32)
POSITIONS = torch.tensor(list(range(40)) + [9], dtype=torch.int64)


@pytest.mark.parametrize("dcp, rank, interleave", [(1, 0, 1), (2, 0, 1), (2, 1, 1), (2, 1, 2), (4, 3, 2)])
def test_v1_a_correct_kernel_passes_and_each_seeded_bug_is_named(monkeypatch, dcp, rank, interleave):
    check = worker_checks.checked_v1_slot_mapping(MultiGroupBlockTable.compute_slot_mapping, ViolationSink("raise"))
    tables = _v1_tables(monkeypatch, dcp, rank, interleave)
    check(tables, 2, QUERY_START_LOC, POSITIONS)
    filled = tables.block_tables[0].slot_mapping.gpu[:41].tolist()
    assert any(s != PAD for s in filled) and (PAD in filled) == (dcp > 1)  # the check read real slots
    bugs = ["rank-shift", "row-divided-twice"] + (["interleave-ignored"] if interleave > 1 else [])
    for bug in bugs if dcp > 1 else []:
        tables = _v1_tables(monkeypatch, dcp, rank, interleave, bug)
        check = worker_checks.checked_v1_slot_mapping(MultiGroupBlockTable.compute_slot_mapping, ViolationSink("raise"))
        with pytest.raises(InvariantViolation, match=r"INV-SLOT-MATCHES-SPEC: V1 slot mapping, group 0, batch row \d, "
                                                     r"token \d+ \(position \d+\): the worker maps it to slot -?\d+, "
                                                     rf"but on rank {rank} of {dcp} .* the placement gives -?\d+"):
            check(tables, 2, QUERY_START_LOC, POSITIONS)


def test_v1_the_divided_width_bug_is_caught_as_a_read_past_the_row(monkeypatch):
    """A row too short for the positions scheduled (the upstream width bug's worker side)."""
    tables = _v1_tables(monkeypatch, 2, 0, 1)
    check = worker_checks.checked_v1_slot_mapping(MultiGroupBlockTable.compute_slot_mapping, ViolationSink("raise"))
    width = tables.block_tables[0].max_num_blocks_per_req  # vLLM widens the 8 asked for
    positions = torch.tensor(list(range(40)) + [width * 8], dtype=torch.int64)  # reads entry ``width`` on rank 0
    with pytest.raises(InvariantViolation, match=r"INV-SLOT-INDEX-BOUND: V1 slot mapping, group 0, batch row 1, token 40: "
                                                 rf"INV-SLOT-INDEX-BOUND: position {width * 8} reads block-table index "
                                                 rf"{width} but the row holds {width} entries"):
        check(tables, 2, QUERY_START_LOC, positions)


def test_cheap_mode_checks_one_call_in_every_slot_check_every(monkeypatch):
    monkeypatch.setenv("KVPROOF_CONTRACTS", "cheap")
    sink = ViolationSink("log")
    check = worker_checks.checked_v1_slot_mapping(MultiGroupBlockTable.compute_slot_mapping, sink)
    tables = _v1_tables(monkeypatch, 2, 1, 1, "rank-shift")
    for _ in range(2 * worker_checks.SLOT_CHECK_EVERY + 1):
        check(tables, 2, QUERY_START_LOC, POSITIONS)
    # Calls 0, 64 and 128: the same violation found three times (one distinct violation).
    assert sink.counts["INV-SLOT-MATCHES-SPEC"] == 1 and found(sink) == 3
    monkeypatch.setenv("KVPROOF_CONTRACTS", "slow")
    sink = ViolationSink("log")
    check = worker_checks.checked_v1_slot_mapping(MultiGroupBlockTable.compute_slot_mapping, sink)
    for _ in range(5):
        check(tables, 2, QUERY_START_LOC, POSITIONS)
    assert found(sink) == 5


def found(sink) -> int:
    """How many times the sink was told of INV-SLOT-MATCHES-SPEC (distinct or not)."""
    return sum(n for (inv, _), n in sink.occurrences.items() if inv == "INV-SLOT-MATCHES-SPEC")


class _Row:
    def __init__(self, rows):
        self.gpu = torch.tensor(rows, dtype=torch.int32)


def _v2_tables(cp_size, cp_rank, interleave, sharded):
    """V2's ``BlockTables`` members the kernel reads (the class needs pinned memory to build)."""
    tables = object.__new__(BlockTables)
    tables.num_kv_cache_groups = 2
    tables.block_sizes = [4, 8]
    tables.block_tables = [_Row([[3, 5, 7, 11], [9, 13, 0, 0]]), _Row([[2, 6, 0, 0], [4, 8, 0, 0]])]
    tables.cp_size, tables.cp_rank, tables.cp_interleave = cp_size, cp_rank, interleave
    tables.slot_mapping_enabled = torch.tensor([True, True])
    tables.dcp_sharded = torch.tensor([sharded, False])  # the second group is replicated
    return tables


def _v2_kernel(bug=None, bug_group=0):
    def compute_slot_mappings(self, idx_mapping, query_start_loc, positions, num_tokens_padded, out=None):
        out = torch.full((self.num_kv_cache_groups, num_tokens_padded), PAD, dtype=torch.int64)
        for g in range(self.num_kv_cache_groups):
            for r, row_index in enumerate(idx_mapping.tolist()):
                for i in range(int(query_start_loc[r]), int(query_start_loc[r + 1])):
                    if row_index >= 0:
                        out[g, i] = _slots(self.block_tables[g].gpu[row_index], int(positions[i]), self.block_sizes[g],
                                           self.cp_size, self.cp_rank, self.cp_interleave, bool(self.dcp_sharded[g]),
                                           bug if g == bug_group else None)
        return out[:, :num_tokens_padded]
    return compute_slot_mappings


@pytest.mark.parametrize("bug, group", [("rank-shift", 0), ("row-divided-twice", 0), ("rank-shift", 1)])
def test_v2_checks_sharded_and_replicated_groups_and_dummy_rows(bug, group):
    tables = _v2_tables(2, 1, 1, True)
    idx = torch.tensor([1, -1, 0])  # a dummy (padding) request in the middle maps to PAD
    qsl = torch.tensor([0, 2, 3, 27], dtype=torch.int32)
    positions = torch.tensor([4, 5, 0] + list(range(24)), dtype=torch.int64)
    worker_checks.checked_v2_slot_mappings(_v2_kernel(), ViolationSink("raise"))(tables, idx, qsl, positions, 32)
    buggy = worker_checks.checked_v2_slot_mappings(_v2_kernel(bug, group), ViolationSink("raise"))
    if group == 1 and bug == "rank-shift":
        # A replicated group: every rank writes every position, so a DCP-only bug cannot show;
        # the check must not invent one.
        buggy(tables, idx, qsl, positions, 32)
        return
    with pytest.raises(InvariantViolation, match=rf"INV-SLOT-MATCHES-SPEC: V2 slot mapping, group {group}, batch row [02]"):
        buggy(tables, idx, qsl, positions, 32)


@settings(max_examples=60, deadline=None)
@given(dcp=st.sampled_from([2, 4, 8]), interleave=st.sampled_from([1, 2, 4]), data=st.data())
def test_v2_every_placement_bug_shows_on_some_rank(dcp, interleave, data):
    """Whichever rank samples, a rank-shift kernel is caught on some rank of the group, and the
    correct one on none (positions 0..31 of one request, group 0 sharded, 4-token blocks)."""
    if 4 % interleave:
        interleave = 1
    positions = torch.arange(32, dtype=torch.int64)
    qsl = torch.tensor([0, 32], dtype=torch.int32)
    fired = 0
    for rank in range(dcp):
        tables = _v2_tables(dcp, rank, interleave, True)
        tables.block_tables[0] = _Row([list(range(1, 9)), [0] * 8])
        worker_checks.checked_v2_slot_mappings(_v2_kernel(), ViolationSink("raise"))(tables, torch.tensor([0]), qsl, positions, 32)
        sink = ViolationSink("log")
        worker_checks.checked_v2_slot_mappings(_v2_kernel("rank-shift"), sink)(tables, torch.tensor([0]), qsl, positions, 32)
        fired += sink.counts["INV-SLOT-MATCHES-SPEC"]
    assert fired == dcp  # every rank sees positions it does not own, or misses its own
