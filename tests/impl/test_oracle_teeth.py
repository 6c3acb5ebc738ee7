"""The content oracle has teeth: each deliberately broken piece of the implementation (the
managers, the copies they order, the rows they hand the worker) is caught."""

from __future__ import annotations

import pytest

from kvproof.impl.kv_cache_manager import KVCacheManager
from kvproof.impl.managers import base
from kvproof.oracle import content_oracle
from kvproof.sim.replay import replay
from kvproof.sim.trace import TraceRequest
from kvproof.spec.arith import cdiv
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
    """The worker running the step's copies after the forward pass: the hit reads its copied
    block before the copy landed."""
    real_run_step = content_oracle.ContentOracle.run_step

    def late_copies(self, plan):
        copies, plan.copies = plan.copies, []
        real_run_step(self, plan)
        self._copy(copies)

    monkeypatch.setattr(content_oracle.ContentOracle, "run_step", late_copies)
    result = replay(shared_prefix_trace(), layout(), num_blocks=64, max_num_batched_tokens=16)
    assert any(v.startswith(("INV-CONTENT-KV", "INV-CONTENT-STATE")) for v in result.violations), result.violations


@pytest.mark.parametrize("dcp", [1, 2])
def test_a_copy_from_a_block_nothing_wrote_is_caught(monkeypatch, dcp):
    """The manager records copy-on-write copies whose source is a block no step ever wrote (a
    stale id that passes INV-COW-SOURCE-READY: neither allocated nor keyed this step)."""
    real_add_copy = base.StepLedger.add_copy
    never_used = 63  # the pool has 64 blocks; this trace never reaches the last one

    def add_copy(self, group_id, request_id, src, dst):
        real_add_copy(self, group_id, request_id, src, dst)
        self.copies[-1] = (group_id, never_used, dst)

    monkeypatch.setattr(base.StepLedger, "add_copy", add_copy)
    result = replay(shared_prefix_trace(), layout(dcp), num_blocks=64, max_num_batched_tokens=16)
    assert any(v.startswith(("INV-CONTENT-KV", "INV-CONTENT-STATE")) for v in result.violations), result.violations


@pytest.mark.parametrize("dcp", [1, 2, 4])
def test_blocks_handed_to_the_worker_in_the_wrong_slot_are_caught(monkeypatch, dcp):
    """The KV-cache manager hands the worker the neighbouring block id for each new attention
    block: the worker writes each position into another block than the one the manager keys
    for it (and than the one another request owns), and whoever reads those blocks next reads
    the wrong KV."""
    real = KVCacheManager.allocate_slots

    def shifted(self, request, num_new_tokens, hit=None):
        out = real(self, request, num_new_tokens, hit)
        if out is not None:
            out[0][:] = [b + 1 for b in out[0]]
        return out

    monkeypatch.setattr(KVCacheManager, "allocate_slots", shifted)
    result = replay(shared_prefix_trace(), layout(dcp), num_blocks=64, max_num_batched_tokens=16)
    assert any(v.startswith("INV-CONTENT-KV") for v in result.violations), result.violations


@pytest.mark.parametrize("dcp, interleave", [(1, 1), (2, 1), (2, 2), (4, 1)])
def test_what_each_rank_holds_is_what_the_spec_slot_mapping_writes(dcp, interleave):
    """The oracle's per-rank pages agree with spec.placement.slot_mapping: after a prefill, rank
    r holds exactly the positions whose slot on r is not PAD, in the block the slot names."""
    from kvproof.impl.request import Request
    from kvproof.impl.scheduler import ScheduledChunk, StepPlan
    from kvproof.spec.placement import PAD_SLOT, slot_mapping

    lay = resolve_layout(LayoutConfig((CacheGroup(GroupKind.FULL_ATTENTION, 4),), dcp=dcp, max_model_len=256,
                                      interleave=interleave))
    oracle = content_oracle.ContentOracle(lay)
    req = Request("r", list(range(1, 30)), lay.hash_block_size)
    row = [10 + i for i in range(cdiv(29, 4 * dcp))]
    oracle.run_step(StepPlan(0, [ScheduledChunk(req, 0, 29, ([*row],), True)], [], []))
    assert oracle.violations == []
    for rank in range(dcp):
        slots = slot_mapping(tuple(range(29)), tuple(row), 4, dcp, interleave, rank, True)
        want = {(s // 4, p) for p, s in enumerate(slots) if s != PAD_SLOT}
        spanned = {
            (blk, base + offset)
            for blk in row
            for lo, hi, _, base in oracle._kv[(0, blk)][rank]
            for offset in range(lo, hi)
        }
        assert {(blk, p) for blk, p in spanned if slots[p] != PAD_SLOT} == want
        # a position a segment of this rank spans but the slot mapping does not keep here
        # belongs to another rank
        assert all(slots[p] == PAD_SLOT for _, p in spanned - want)


def test_mamba_width_divided_by_dcp_is_rejected():
    import dataclasses

    from kvproof.impl.request import Request
    from kvproof.spec.contracts import InvariantViolation

    lay = layout(dcp=8)
    old_width = cdiv(256, 8 * 8)  # the old rule: cdiv(max_len, bs * dcp) = 4 rows, not 32
    mamba = dataclasses.replace(lay.groups[1], max_num_blocks_per_req=old_width, table_width=old_width)
    lay = dataclasses.replace(lay, groups=(lay.groups[0], mamba))
    kv = KVCacheManager(lay, 64)
    r = Request("long", list(range(200)), lay.hash_block_size)
    kv.begin_step()
    with pytest.raises(InvariantViolation, match="INV-TABLE-WIDTH"):
        kv.allocate_slots(r, 200, kv.lookup(r))
