"""The sliding-window manager at its edges (cases tools/mutation.py found unreached): a request
holds only the blocks its next token's window reads, hits reach past the window, and a request
that resumed from a hit keeps caching what it computes."""

from __future__ import annotations

from kvproof.impl.kv_cache_manager import KVCacheManager
from kvproof.impl.request import Request
from kvproof.spec.groups import CacheGroup, GroupKind
from kvproof.spec.layout import LayoutConfig, resolve_layout

LAYOUT = resolve_layout(LayoutConfig((CacheGroup(GroupKind.SLIDING_WINDOW, 4, sliding_window=5),), max_model_len=256))


def step(kv, r, num_new, hit=None):
    """One scheduler step computing ``num_new`` tokens of ``r`` after its computed ones or after
    ``hit`` (mutates ``kv`` and ``r``)."""
    kv.begin_step()
    assert kv.allocate_slots(r, num_new, hit) is not None
    kv.take_block_copies()
    r.num_computed_tokens = (hit.num_tokens if hit is not None else r.num_computed_tokens) + num_new
    kv.cache(r)


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
