"""The content oracle has teeth: each deliberately broken piece of the pipeline is caught."""

from __future__ import annotations

import pytest

from kvproof.impl import content_oracle
from kvproof.impl.managers import base
from kvproof.impl.replay import replay
from kvproof.impl.trace import TraceRequest
from kvproof.spec.groups import CacheGroup, GroupKind
from kvproof.spec.layout import LayoutConfig, resolve_layout

SHARED = tuple(range(100, 123))  # 23 tokens


def shared_prefix_trace():
    """A producer, then requests that hit inside attention and Mamba blocks, and one that
    arrives while the producer still decodes (so the producer continues past a cached state)."""
    return [
        TraceRequest("producer", SHARED + (1,), output=(5, 6, 7, 8, 9, 10), arrival=0),
        TraceRequest("sibling", SHARED + (2, 3), output=(4, 4), arrival=3),
        TraceRequest("late", SHARED + (1, 5, 6, 9), output=(1,), arrival=12),
    ]


def layout(dcp=2):
    return resolve_layout(LayoutConfig((CacheGroup(GroupKind.FULL_ATTENTION, 4), CacheGroup(GroupKind.MAMBA, 8)),
                                       dcp=dcp, max_model_len=256, hash_block_size=2))


@pytest.mark.parametrize("dcp", [1, 2, 4])
def test_correct_pipeline_has_no_violations_and_real_hits(dcp):
    result = replay(shared_prefix_trace(), layout(dcp), num_blocks=64, max_num_batched_tokens=16)
    assert result.violations == []
    assert all((r.num_cached_tokens or 0) > 0 for r in result.requests[1:])
    assert result.cow_copies > 0


def test_sharing_a_partial_block_without_copying_is_caught(monkeypatch):
    monkeypatch.setattr(base.StepLedger, "add_copy", lambda self, g, rid, src, dst: None)
    result = replay(shared_prefix_trace(), layout(), num_blocks=64, max_num_batched_tokens=16)
    assert any(v.startswith(("INV-CONTENT-KV", "INV-CONTENT-STATE")) for v in result.violations), result.violations


def test_copies_run_after_the_forward_pass_are_caught(monkeypatch):
    real_run_step = content_oracle.ContentOracle.run_step

    def late_copies(self, plan):
        copies, plan.copies = plan.copies, []
        real_run_step(self, plan)
        self._copy(copies)

    monkeypatch.setattr(content_oracle.ContentOracle, "run_step", late_copies)
    result = replay(shared_prefix_trace(), layout(), num_blocks=64, max_num_batched_tokens=16)
    assert any(v.startswith(("INV-CONTENT-KV", "INV-CONTENT-STATE")) for v in result.violations), result.violations


def test_wrong_slot_mapping_is_caught(monkeypatch):
    real_slot = content_oracle.ContentOracle._slot

    def off_by_one_rank(self, p, g, row):
        rank, blk, off = real_slot(self, p, g, row)
        return (None if rank is None else (rank + 1) % self.dcp), blk, off

    # Writes go to the wrong rank; reads use the right one.
    monkeypatch.setattr(content_oracle.ContentOracle, "_write", _write_with(off_by_one_rank))
    result = replay(shared_prefix_trace(), layout(dcp=2), num_blocks=64, max_num_batched_tokens=16)
    assert any(v.startswith("INV-CONTENT-KV") for v in result.violations), result.violations


def _write_with(slot):
    real_write = content_oracle.ContentOracle._write

    def write(self, chunk):
        saved = content_oracle.ContentOracle._slot
        content_oracle.ContentOracle._slot = slot
        try:
            real_write(self, chunk)
        finally:
            content_oracle.ContentOracle._slot = saved
    return write


def test_mamba_width_divided_by_dcp_is_rejected():
    import dataclasses

    from kvproof.impl.kv_cache_manager import KVCacheManager
    from kvproof.impl.request import Request
    from kvproof.spec.contracts import InvariantViolation

    lay = layout(dcp=8)
    old_width = -(-256 // (8 * 8))  # the old rule: cdiv(max_len, bs * dcp) = 4 rows, not 32
    mamba = dataclasses.replace(lay.groups[1], max_num_blocks_per_req=old_width, table_width=old_width)
    lay = dataclasses.replace(lay, groups=(lay.groups[0], mamba))
    kv = KVCacheManager(lay, 64)
    r = Request("long", list(range(200)), lay.hash_block_size)
    kv.begin_step()
    with pytest.raises(InvariantViolation, match="INV-TABLE-WIDTH"):
        kv.allocate_slots(r, 200, kv.lookup(r))
