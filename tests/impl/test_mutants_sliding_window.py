"""The sliding-window manager at its edges (cases tools/mutation.py found unreached): a request
holds only the blocks its next token's window reads (blocks of one token too), hits reach past
the window, a request that resumed from a hit keeps caching what it computes, a miss is zero
tokens, and an empty pool still serves a step that needs no block."""

from __future__ import annotations

from kvproof.impl.kv_cache_manager import KVCacheManager
from kvproof.impl.request import Request
from kvproof.sim.drive import Step
from kvproof.spec.groups import CacheGroup, GroupKind
from kvproof.spec.layout import LayoutConfig, resolve_layout

LAYOUT = resolve_layout(LayoutConfig((CacheGroup(GroupKind.SLIDING_WINDOW, 4, sliding_window=5),), max_model_len=256))


def step(kv, r, num_new, hit=None):
    """One scheduler step computing ``num_new`` tokens of ``r`` after its computed ones or after
    ``hit`` (mutates ``kv`` and ``r``); the pool must lose exactly the blocks ``blocks_needed``
    said the allocation takes."""
    running = kv.is_running(r)
    total = (r.num_computed_tokens if running else (hit.num_tokens if hit else 0)) + num_new
    with Step(kv) as this_step:
        need = kv.coordinator.blocks_needed(r, total, None if running else hit or kv.coordinator.miss)
        free = kv.coordinator.pool.num_free
        assert this_step.schedule(r, num_new, hit).blocks is not None
        assert free - kv.coordinator.pool.num_free == need


def held(kv):
    return kv.coordinator.pool.num_blocks - 1 - kv.coordinator.pool.num_free


def test_a_request_holds_only_the_blocks_of_its_next_tokens_window():
    # Window 5 over blocks of 4: the token at n reads positions n-4 .. n.
    kv = KVCacheManager(LAYOUT, 64)
    r = Request("A", list(range(100, 140)), LAYOUT.hash_block_size)
    step(kv, r, 15)  # next token 15 reads 11-15: blocks 2 and 3
    assert held(kv) == 2
    step(kv, r, 1)  # next token 16 reads 12-16: block 3 (block 4 is not allocated yet)
    assert held(kv) == 1
    step(kv, r, 8)  # 24 computed; token 24 reads 20-24: block 5
    assert held(kv) == 1


def test_blocks_that_leave_the_window_in_the_step_that_completes_them_are_keyed_first():
    """HybridCoordinator.cache keys before it releases: blocks 0 and 1, completed and out of the
    next token's window in one step, leave as cached blocks, so a sharer of 9 tokens hits 8."""
    kv = KVCacheManager(LAYOUT, 64)
    prompt = list(range(100, 140))
    step(kv, Request("A", prompt[:15], LAYOUT.hash_block_size), 15)
    assert held(kv) == 2 and kv.coordinator.pool.num_cached_keys() == 3  # blocks 0, 1, 2
    assert kv.lookup(Request("D", prompt[:9] + [1], LAYOUT.hash_block_size)).num_tokens == 8


def test_a_hit_reaches_past_the_window_and_the_resumed_request_keeps_caching():
    kv = KVCacheManager(LAYOUT, 64)
    prompt = list(range(100, 140))
    a = Request("A", prompt[:32], LAYOUT.hash_block_size)
    step(kv, a, 32)
    b = Request("B", prompt[:36] + [1], LAYOUT.hash_block_size)
    hit = kv.lookup(b)
    assert hit.num_tokens == 32  # of A's blocks, only block 7 (positions 28-31) is in the window
    step(kv, b, 4, hit)
    c = Request("C", prompt[:40] + [2], LAYOUT.hash_block_size)
    assert kv.lookup(c).num_tokens == 36  # B keyed the block it computed after its hit


def test_nothing_cached_is_a_miss_of_zero_tokens():
    kv = KVCacheManager(LAYOUT, 64)
    assert kv.managers[0].find_hit(Request("A", list(range(100, 120)), LAYOUT.hash_block_size), 16) == (0, [])


def test_one_token_blocks_keep_every_position_the_next_token_reads():
    """Window 4 over blocks of 1 token: the token at n reads n-3 .. n, so after 2 computed
    tokens both blocks stay, after 5 only the last 3 do; a one-token prefix is a hit."""
    lay = resolve_layout(LayoutConfig((CacheGroup(GroupKind.SLIDING_WINDOW, 1, sliding_window=4),), max_model_len=64))
    kv = KVCacheManager(lay, 16)
    r = Request("A", list(range(100, 110)), lay.hash_block_size)
    step(kv, r, 2)
    assert held(kv) == 2
    step(kv, r, 3)
    assert held(kv) == 3
    assert kv.lookup(Request("B", [100, 7], lay.hash_block_size)).num_tokens == 1


def test_an_empty_pool_serves_a_step_inside_the_last_block_and_refuses_one_past_it():
    kv = KVCacheManager(LAYOUT, 3)  # blocks 1 and 2; window 5 over blocks of 4
    r = Request("A", list(range(100, 106)), LAYOUT.hash_block_size)
    step(kv, r, 6)  # blocks 0 and 1 of the row: the pool is empty
    assert kv.coordinator.pool.num_free == 0
    r.append_output(1)
    step(kv, r, 1)  # token 6 goes into block 1
    for token in (2, 3):
        r.append_output(token)
    kv.begin_step()
    assert kv.allocate_slots(r, 2) is None  # token 8 needs a third block, and block 0 is still read
    assert kv.coordinator.pool.num_free == 0


def test_a_hit_on_blocks_only_the_cache_holds_counts_them_as_taken_from_the_pool():
    kv = KVCacheManager(LAYOUT, 64)
    prompt = list(range(100, 140))
    a = Request("A", prompt[:32], LAYOUT.hash_block_size)
    step(kv, a, 32)
    kv.free(a)  # block 7 (positions 28-31), the one a hit at 32 needs, is now cached and evictable
    b = Request("B", prompt[:36] + [1], LAYOUT.hash_block_size)
    hit = kv.lookup(b)
    assert hit.num_tokens == 32
    assert kv.coordinator.blocks_needed(b, 36, hit) == 2  # the evictable hit block and one fresh block
    step(kv, b, 4, hit)
