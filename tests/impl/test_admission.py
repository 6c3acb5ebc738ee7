"""Admission never refuses a request that fits: a hit whose copy-on-write (or whose evictable
blocks) cost more than the pool has falls back to a cheaper hit."""

from __future__ import annotations

import pytest

from kvproof.impl.scheduler import CapacityError
from kvproof.sim.replay import replay
from kvproof.sim.trace import TraceRequest
from kvproof.spec.groups import CacheGroup, GroupKind
from kvproof.spec.layout import LayoutConfig, resolve_layout

FA, MAMBA = GroupKind.FULL_ATTENTION, GroupKind.MAMBA


def small_case(num_blocks, retention=None):
    layout = resolve_layout(LayoutConfig((CacheGroup(FA, 8), CacheGroup(MAMBA, 8)), dcp=2, max_model_len=64,
                                         retention_interval=retention))
    trace = [TraceRequest("a", tuple(range(1, 10)), (1,), arrival=0),
             TraceRequest("b", tuple(range(1, 9)) + (10, 11), (1,), arrival=5)]
    return replay(trace, layout, num_blocks=num_blocks)


def test_a_hit_too_costly_for_a_tiny_pool_falls_back_to_no_hit():
    # b hits 8 tokens: attention's 16-token block is copied (1 block) and both hit blocks are
    # evictable (each takes a free block): 4 blocks > 3. Without the hit it needs 2.
    result = small_case(num_blocks=4)
    assert result.violations == []
    assert {r.request_id: r.num_cached_tokens for r in result.requests} == {"a": 0, "b": 0}


def test_the_hit_is_taken_when_the_pool_can_afford_it():
    result = small_case(num_blocks=5)
    assert {r.request_id: r.num_cached_tokens for r in result.requests} == {"a": 0, "b": 8}
    assert result.cow_copies == 1


def test_a_request_that_does_not_fit_even_alone_is_refused_with_the_pool_named():
    with pytest.raises(CapacityError, match=r"request 'a' cannot get blocks .* pool to itself \(1 blocks, 1 free\)"):
        small_case(num_blocks=2)
