"""Misuse of the library's verbs: each is refused with a ValueError naming the value and what
was expected, before anything changes, and the whole-state check sees the state a second
allocation in one step would have left."""

from __future__ import annotations

import pytest

from kvproof.impl.block_pool import BlockPool
from kvproof.impl.kv_cache_manager import KVCacheManager
from kvproof.impl.request import Request
from kvproof.spec.contracts import InvariantViolation
from kvproof.spec.geometry import MAX_NUM_BLOCKS
from kvproof.spec.groups import CacheGroup, GroupKind
from kvproof.spec.layout import LayoutConfig, resolve_layout

FA, MAMBA = GroupKind.FULL_ATTENTION, GroupKind.MAMBA
# 4-token blocks in both groups, every chunk end's state kept: a 1-token step after an 8-token
# prefill advances the Mamba state by one block.
LAYOUT = resolve_layout(LayoutConfig((CacheGroup(FA, 4), CacheGroup(MAMBA, 4)), max_model_len=256,
                                     retention_interval=None))


def state(kv: KVCacheManager, *requests: Request):
    return (kv.pool.num_free, [kv.pool.ref_count(b) for b in range(1, kv.pool.num_blocks)],
            [kv.block_table(r) for r in requests], sorted(kv._in_flight))


def running_after_prefill(kv: KVCacheManager, rid: str = "a", prefill: int = 8) -> Request:
    """A request whose first ``prefill`` tokens ran, in a new step."""
    req = Request(rid, list(range(1, 40)), LAYOUT.hash_block_size)
    kv.begin_step()
    assert kv.allocate_slots(req, prefill, kv.lookup(req)) is not None
    req.num_computed_tokens = prefill
    kv.cache(req)
    kv.begin_step()
    return req


def test_a_second_allocation_in_one_step_is_refused_and_changes_nothing():
    kv = KVCacheManager(LAYOUT, 64)
    req = running_after_prefill(kv)
    assert kv.allocate_slots(req, 1) is not None
    before = state(kv, req)
    with pytest.raises(ValueError, match=r"request 'a' was already allocated this step"):
        kv.allocate_slots(req, 8)
    assert state(kv, req) == before
    req.num_computed_tokens += 1
    kv.cache(req)  # the step goes on as if the refused call had not been made
    assert kv.check_state()


def test_the_whole_state_check_counts_the_steps_a_row_was_grown_for():
    # A row grown twice before either step settled (async scheduling: the next step is
    # allocated while the previous one is in flight) holds the old state, the first new one and
    # the second: 3 real blocks, one per unsettled step that moved the state, within the bound.
    # A block more than that fires. (The facade refuses a second allocation in one step; the
    # coordinator, one layer down, does not check the protocol.)
    kv = KVCacheManager(LAYOUT, 64)
    req = running_after_prefill(kv)
    assert kv.allocate_slots(req, 1) is not None
    assert kv.check_state()  # one allocation: old state + new state, within the step's bound
    assert kv.coordinator.allocate(req, 8 + 8, None) is not None
    assert kv.check_state()  # two allocations in flight: 3 real blocks
    row = kv.managers[1].row("a")
    row.append(kv.pool.allocate(1)[0])  # a stray block past the state
    with pytest.raises(InvariantViolation, match=r"INV-MAMBA-REAL-BLOCKS: request 'a', group 1: 4 real state blocks "
                                                 r"with 2 steps not settled > 3"):
        kv.check_state()


def test_the_whole_state_check_sees_a_stray_block_between_steps():
    kv = KVCacheManager(LAYOUT, 64)
    req = running_after_prefill(kv)
    mamba = kv.managers[1]
    row = mamba.row("a")
    assert row[0] == 0 and row[1] != 0  # the state after 8 tokens is at index 1
    [stray] = kv.pool.allocate(1)
    row[0] = stray
    mamba.requests["a"].checked_below = -1  # as after a state move: the entries below are read again
    with pytest.raises(InvariantViolation, match=r"INV-MAMBA-REAL-BLOCKS: request 'a', group 1: 2 real state blocks between steps > 1"):
        kv.check_state()


@pytest.mark.parametrize("bad", [0, -3, True, 1.0, "2", None])
def test_allocate_slots_refuses_a_token_count_that_is_not_a_positive_int(bad):
    kv = KVCacheManager(LAYOUT, 64)
    req = Request("a", list(range(1, 40)), LAYOUT.hash_block_size)
    kv.begin_step()
    before = state(kv, req)
    with pytest.raises(ValueError, match=rf"request 'a': num_new_tokens {bad!r} must be an int > 0"):
        kv.allocate_slots(req, bad)
    assert state(kv, req) == before
    assert req.num_computed_tokens == 0


@pytest.mark.parametrize("bad", [-5, -1, True, 2.5, "8"])
def test_lookup_refuses_a_bound_that_is_not_a_count(bad):
    kv = KVCacheManager(LAYOUT, 64)
    req = Request("a", list(range(1, 40)), LAYOUT.hash_block_size)
    with pytest.raises(ValueError, match=rf"request 'a': bound {bad!r} must be None or an int >= 0"):
        kv.lookup(req, bound=bad)
    assert kv.lookup(req, bound=0).num_tokens == 0


def test_cache_after_free_is_refused_naming_the_request():
    kv = KVCacheManager(LAYOUT, 64)
    req = running_after_prefill(kv)
    kv.free(req)
    before = state(kv, req)
    with pytest.raises(ValueError, match=r"request 'a' holds no blocks \(freed, or never allocated\)"):
        kv.cache(req)
    assert state(kv, req) == before
    never = Request("b", [1, 2, 3], LAYOUT.hash_block_size)
    with pytest.raises(ValueError, match=r"request 'b' holds no blocks"):
        kv.cache(never)


@pytest.mark.parametrize("bad", [0, -1, MAX_NUM_BLOCKS + 1, 2 ** 70, True, 4.0])
def test_a_pool_size_out_of_range_is_a_value_error(bad):
    with pytest.raises(ValueError, match=rf"num_blocks {bad!r} must be an int in \[1, {MAX_NUM_BLOCKS}\]"):
        BlockPool(bad)
    with pytest.raises(ValueError, match=r"must be an int in \[1, "):
        KVCacheManager(LAYOUT, bad)
