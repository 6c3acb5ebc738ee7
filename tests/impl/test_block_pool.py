"""Unit tests of the block pool: vLLM's section 9.2 scenarios (fixed semantics), free-queue order,
safety and bad input. The reference's ``B`` is the group's effective block size, ``H`` the
hash-block size; keys come from ``key_at`` exactly as a manager would build them."""

from __future__ import annotations

import pytest

from kvproof.impl.block_pool import BlockPool
from kvproof.impl.hashing import full_block_key, key_at, request_block_hashes

H = 2


def hashes_of(tokens, h=H, **kw):
    return request_block_hashes(list(tokens), h, **kw)


def snapshot(pool: BlockPool):
    n = pool.num_blocks
    return (
        tuple(pool.ref_count(b) for b in range(n)),
        tuple(pool.key_of(b) for b in range(n)),
        tuple(pool.num_tokens_of(b) for b in range(n)),
        pool.free_order(),
    )


# --- docs/vllm-semantics.md §9.2, pool level ------------------------------------------------------


def test_boundary_hashes_reuse_fine_grained_chain():
    """A coarse (B = 3H) block key is a selection of the fine chain, not a recombination, and the
    hash at 10 tokens is the same whichever longer request it is read from."""
    tokens = [1, 1, 2, 2, 3, 3, 4, 4, 4, 4, 5, 5]
    fine = hashes_of(tokens)
    assert full_block_key(fine, 0, 3 * H, H, 0) == (fine[2], 0)
    assert full_block_key(fine, 1, 3 * H, H, 0) == (fine[5], 0)
    assert key_at(fine, 10, H, 0) == key_at(hashes_of(tokens[:10]), 10, H, 0)


def test_cache_partial_block_registers_the_fine_key_once():
    """H 4, B 12, group 2, partial at 8: the key is (hash@8, 2); a duplicate is a no-op; free and
    reallocation evict it."""
    fine = hashes_of(range(12), 4)
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    key = key_at(fine, 8, 4, 2)
    assert key == (fine[1], 2)
    assert pool.cache_partial(b, key, 8) is True
    before = snapshot(pool)
    assert pool.cache_partial(b, key, 8) is False
    assert snapshot(pool) == before
    pool.free([b])
    assert pool.lookup(key) == b  # still cached while free (evictable)
    assert pool.allocate(3)[-1] == b  # cached blocks sit at the tail, so b is popped last
    assert pool.lookup(key) is None and pool.key_of(b) is None


def test_partial_block_replacement_grows_forward():
    """Partial at 8 then at 10 on the same block: 8 is retired, 10 maps to the block."""
    fine = hashes_of(range(10))
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    assert pool.cache_partial(b, key_at(fine, 8, H, 0), 8) is True
    assert pool.cache_partial(b, key_at(fine, 10, H, 0), 10) is True
    assert pool.lookup(key_at(fine, 8, H, 0)) is None
    assert pool.lookup(key_at(fine, 10, H, 0)) == b
    assert pool.num_tokens_of(b) == 10


def test_later_request_hits_cached_partial_tail():
    replay = [7, 7, 8, 8, 9, 9, 1, 1, 2, 2]
    extended = replay + [3, 3, 4]
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.cache_partial(b, key_at(hashes_of(replay), 10, H, 0), 10)
    assert pool.lookup(key_at(hashes_of(extended), 10, H, 0)) == b


def test_cache_partial_block_uses_fine_grained_boundary_hash():
    """The partial key at 10 is K(10, g) = hash@10, whatever the group's block size (here 6)."""
    fine = hashes_of(range(12))
    assert key_at(fine, 10, H, 0) == (fine[4], 0)


def test_cache_partial_block_requires_hash_boundary():
    fine = hashes_of(range(12))
    with pytest.raises(ValueError, match=r"INV-HASH-BOUNDARY: num_tokens 3 is not a multiple of hash_block_size 2"):
        key_at(fine, 3, H, 0)


def test_duplicate_key_on_two_blocks_keeps_one_key_per_block():
    fine = hashes_of(range(10))
    key = key_at(fine, 10, H, 0)
    pool = BlockPool(4)
    b1, b2 = pool.allocate(2)
    assert pool.cache_partial(b1, key, 10) is True
    assert pool.cache_partial(b2, key, 10) is True
    assert pool.cache_partial(b2, key, 10) is False
    assert pool.holders(key) == (b1, b2)
    assert pool.lookup(key) == b1  # the oldest holder
    assert pool.num_cached_keys() == 1


def test_reset_clears_partial_entries_only_when_idle():
    fine = hashes_of(range(10))
    pool = BlockPool(3)
    b1, b2 = pool.allocate(2)
    pool.cache_partial(b1, key_at(fine, 8, H, 0), 8)
    pool.cache_full(b2, key_at(fine, 10, H, 0), 10)
    before = snapshot(pool)
    assert pool.reset() is False  # blocks in use: refused, nothing changes
    assert snapshot(pool) == before
    pool.free([b2, b1])
    assert pool.reset() is True
    assert pool.num_cached_keys() == 0
    assert all(pool.key_of(b) is None and pool.num_tokens_of(b) == 0 for b in range(3))


@pytest.mark.parametrize("dcp", [1, 2, 4])
def test_eviction_removes_full_and_partial_entries(dcp):
    """B = 6·D; block 0 of the request holds the full key at B, block 1 a partial at 2B - 2.
    Popping both from the free queue drops both keys; evict() drops a key in place."""
    block = 6 * dcp
    fine = hashes_of(range(2 * block))
    pool = BlockPool(4)
    b0, b1 = pool.allocate(2)
    full = full_block_key(fine, 0, block, H, 0)
    partial = key_at(fine, 2 * block - 2, H, 0)
    pool.cache_full(b0, full, block)
    pool.cache_partial(b1, partial, 2 * block - 2)
    assert pool.evict([b1]) == 1 and pool.lookup(partial) is None
    pool.cache_partial(b1, partial, 2 * block - 2)
    pool.free([b1, b0])
    pool.allocate(3)
    assert pool.lookup(full) is None and pool.lookup(partial) is None
    assert pool.num_cached_keys() == 0


@pytest.mark.parametrize("dcp", [1, 2, 4])
def test_partial_block_promotes_to_full_key(dcp):
    block = 6 * dcp
    fine = hashes_of(range(2 * block))
    pool = BlockPool(4)
    _, b1 = pool.allocate(2)
    partial = key_at(fine, 2 * block - 2, H, 0)
    pool.cache_partial(b1, partial, 2 * block - 2)
    assert pool.cache_full(b1, full_block_key(fine, 1, block, H, 0), 2 * block) is True
    assert pool.key_of(b1) == (fine[2 * block // H - 1], 0)
    assert pool.lookup(partial) is None


@pytest.mark.parametrize("dcp", [1, 2, 4])
def test_no_stale_partial_after_promotion(dcp):
    """Prompt 10·D with B 6·D: the tail block gets a partial at 10·D, is promoted at 12·D, and the
    prompt boundary offered again (as vLLM 0.33 does every step) is refused: no resurrection."""
    block, prompt = 6 * dcp, 10 * dcp
    fine = hashes_of(range(2 * block))
    pool = BlockPool(4)
    _, tail = pool.allocate(2)
    assert pool.cache_partial(tail, key_at(fine, prompt, H, 0), prompt) is True
    pool.cache_full(tail, full_block_key(fine, 1, block, H, 0), 2 * block)
    before = snapshot(pool)
    assert pool.cache_partial(tail, key_at(fine, prompt, H, 0), prompt) is None
    assert snapshot(pool) == before
    assert pool.lookup(key_at(fine, prompt, H, 0)) is None


@pytest.mark.parametrize("dcp", [1, 2, 4])
def test_cache_partial_refuses_a_boundary_the_block_has_outgrown(dcp):
    block = 6 * dcp
    fine = hashes_of(range(2 * block))
    pool = BlockPool(4)
    _, tail = pool.allocate(2)
    pool.cache_full(tail, full_block_key(fine, 1, block, H, 0), 2 * block)
    before = snapshot(pool)
    assert pool.cache_partial(tail, key_at(fine, 2 * block - 2, H, 0), 2 * block - 2) is None
    assert snapshot(pool) == before


def test_promoted_tail_lets_the_manager_skip_the_pool():
    """The pool exposes the length a block covers, so a manager need not call into the pool again
    for a boundary the block has outgrown (vLLM 0.33 calls it on every decode step)."""
    fine = hashes_of(range(12))
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.cache_partial(b, key_at(fine, 10, H, 0), 10)
    pool.cache_full(b, key_at(fine, 12, H, 0), 12)
    assert pool.num_tokens_of(b) >= 10


def test_mamba_partial_tail_registers_unless_superseded():
    """Mamba H 2, B 6, prompt 10: a fresh state block takes K(10); one already holding a later
    state (12) refuses it; replace_key (the state was rewritten) takes it regardless."""
    fine = hashes_of(range(12))
    pool = BlockPool(4)
    fresh, later = pool.allocate(2)
    assert pool.cache_partial(fresh, key_at(fine, 10, H, 1), 10) is True
    pool.cache_partial(later, key_at(fine, 12, H, 1), 12)
    assert pool.cache_partial(later, key_at(fine, 8, H, 1), 8) is None
    assert pool.replace_key(later, key_at(fine, 8, H, 1), 8) is True
    assert pool.lookup(key_at(fine, 12, H, 1)) is None


# --- free-queue order (docs/vllm-semantics.md §3.2) -----------------------------------------------


def test_free_prepends_uncached_as_a_batch_and_appends_cached():
    pool = BlockPool(7)
    assert pool.allocate(6) == [1, 2, 3, 4, 5, 6]
    pool.cache_full(2, ("k2", 0), 2)
    pool.cache_full(4, ("k4", 0), 2)
    pool.free([4, 3, 2, 1])  # reverse table order, as managers free
    assert pool.free_order() == (3, 1, 4, 2)
    pool.free([6, 5])
    assert pool.free_order() == (6, 5, 3, 1, 4, 2)
    assert pool.allocate(6) == [6, 5, 3, 1, 4, 2]


def test_touch_takes_a_cached_free_block_out_of_the_queue():
    pool = BlockPool(4)
    b1, b2, b3 = pool.allocate(3)
    pool.cache_full(b2, ("k", 0), 2)
    pool.free([b3, b2, b1])
    assert pool.free_order() == (b3, b1, b2)
    pool.touch([b2])
    assert pool.free_order() == (b3, b1) and pool.ref_count(b2) == 1
    pool.touch([b2, 0])  # the null block is skipped
    assert pool.ref_count(b2) == 2 and pool.ref_count(0) == 0


def test_conservation_and_usage():
    pool = BlockPool(5)
    assert pool.usage() == 0.0 and pool.can_allocate(4) and not pool.can_allocate(5)
    pool.allocate(2)
    assert pool.num_free == 2 and pool.usage() == 0.5
    assert pool._check()


# --- safety ------------------------------------------------------------------------------------


def test_allocate_more_than_free_fails_atomically():
    pool = BlockPool(4)
    pool.allocate(1)
    before = snapshot(pool)
    assert pool.allocate(3) is None
    assert snapshot(pool) == before
    assert pool.allocate(0) == []


def test_null_block_is_never_handed_out():
    pool = BlockPool(3)
    assert 0 not in pool.allocate(2)
    assert pool.allocate(1) is None


def test_double_free_raises_naming_block_and_ref_and_changes_nothing():
    pool = BlockPool(4)
    b1, b2 = pool.allocate(2)
    pool.free([b1])
    before = snapshot(pool)
    with pytest.raises(ValueError, match=rf"INV-POOL-REF-NONNEG: free of block {b1} with ref count 0"):
        pool.free([b2, b1])
    assert snapshot(pool) == before


def test_freeing_a_block_twice_in_one_call_raises():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    with pytest.raises(ValueError, match=rf"block {b} listed 2 times in one free but its ref count is 1"):
        pool.free([b, b])
    assert pool.ref_count(b) == 1


def test_free_and_touch_skip_the_null_block():
    pool = BlockPool(3)
    before = snapshot(pool)
    pool.free([0])
    pool.touch([0])
    assert snapshot(pool) == before


def test_touching_a_free_uncached_block_is_refused():
    pool = BlockPool(3)
    with pytest.raises(ValueError, match=r"INV-POOL-FREE-IFF-UNREF: touch of block 1: it is free \(ref count 0\) and has no key"):
        pool.touch([1])


# --- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, 3, 10**9])
def test_unknown_block_ids_are_rejected(bad):
    pool = BlockPool(3)
    pool.allocate(2)
    before = snapshot(pool)
    for call in (lambda: pool.free([1, bad]), lambda: pool.touch([1, bad])):
        with pytest.raises(ValueError, match=rf"block id {bad} out of range \[0, 3\)"):
            call()
    with pytest.raises(ValueError, match=rf"block id {bad} out of range \[1, 3\)"):
        pool.cache_full(bad, ("k", 0), 2)
    with pytest.raises(ValueError, match=rf"evict: block id {bad} out of range \[1, 3\)"):
        pool.evict([bad])
    with pytest.raises(ValueError, match=rf"ref_count: block id {bad} out of range"):
        pool.ref_count(bad)
    assert snapshot(pool) == before


def test_negative_sizes_are_rejected():
    pool = BlockPool(3)
    with pytest.raises(ValueError, match=r"allocate: block count -1 must be an int >= 0"):
        pool.allocate(-1)
    (b,) = pool.allocate(1)
    with pytest.raises(ValueError, match=r"cache_partial: num_tokens -2 must be > 0"):
        pool.cache_partial(b, ("k", 0), -2)
    with pytest.raises(ValueError, match=r"num_blocks 0 must be an int in \[1, "):
        BlockPool(0)


def test_caching_the_null_or_a_free_block_is_rejected():
    pool = BlockPool(3)
    with pytest.raises(ValueError, match=r"INV-POOL-NULL: cache_full: the null block 0 is never cached"):
        pool.cache_full(0, ("k", 0), 2)
    with pytest.raises(ValueError, match=r"INV-POOL-HELD-TO-CACHE: cache_partial: block 1 has ref count 0"):
        pool.cache_partial(1, ("k", 0), 2)


def test_full_key_going_backwards_is_rejected():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.cache_full(b, ("k12", 0), 12)
    with pytest.raises(ValueError, match=rf"INV-POOL-NO-STALE-PARTIAL: cache_full of block {b} at 6 tokens, but it already covers 12"):
        pool.cache_full(b, ("k6", 0), 6)


def test_a_key_names_one_prefix_length():
    pool = BlockPool(3)
    b1, b2 = pool.allocate(2)
    pool.cache_full(b1, ("k", 0), 4)
    with pytest.raises(ValueError, match=r"INV-POOL-KEY-LENGTH: cache_full: key already names a 4-token prefix \(block 1\), not 6"):
        pool.cache_full(b2, ("k", 0), 6)


def test_move_key_moves_length_and_age():
    pool = BlockPool(5)
    b1, b2, b3 = pool.allocate(3)
    pool.cache_partial(b1, ("k", 1), 4)
    pool.cache_partial(b2, ("k", 1), 4)
    pool.move_key(b1, b3)
    assert pool.holders(("k", 1)) == (b3, b2) and pool.num_tokens_of(b3) == 4 and pool.key_of(b1) is None
    with pytest.raises(ValueError, match=r"move_key: block 1 must have a key and block 2 none"):
        pool.move_key(b1, b2)


def test_allocate_counts_evictions_of_cached_blocks():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache_full(a, ("k", 0), 4)
    pool.free([a, b])  # b (uncached) goes to the head, a (cached) to the tail
    assert pool.num_evictions == 0
    pool.allocate(2)
    assert pool.num_evictions == 0  # b and block 3: neither held a key
    pool.allocate(1)
    assert pool.num_evictions == 1 and pool.lookup(("k", 0)) is None


def test_the_observer_hears_every_block_handed_out_every_hit_touch_and_a_reset():
    heard = []

    class Observer:
        def allocated(self, blocks):
            heard.append(("allocated", list(blocks)))

        def touched(self, blocks):
            heard.append(("touched", list(blocks)))

        def reset(self):
            heard.append(("reset",))

    pool = BlockPool(4)
    pool.observer = Observer()
    [a, b] = pool.allocate(2)
    assert pool.cache_full(a, (b"k", 0), 16)
    pool.free([a, b])
    pool.touch([0, a])  # a hit on the cached block; the null block is no block
    assert pool.allocate(5) is None  # refused: nothing handed out, nothing heard
    pool.free([a])
    assert pool.reset()
    assert heard == [("allocated", [a, b]), ("touched", [a]), ("reset",)]
