"""The single-type managers at edges tools/mutation.py found unreached (docs/testing.md,
"Surviving mutants"): copy sources that are not ready, speculative blocks, hits inside a block
that end where they started, partial hits off with a hash finer than the block, an empty pool
during a step that needs no block, a first chunk-end key, a freed request's per-request check,
a Mamba state in mode 'none', and the bookkeeping checks firing on a manager gone wrong."""

from __future__ import annotations

import re

import pytest

from kvproof.impl.block_pool import NULL_BLOCK
from kvproof.impl.kv_cache_manager import KVCacheManager
from kvproof.impl.managers import FullAttentionManager
from kvproof.impl.managers.base import StepLedger
from kvproof.impl.request import Request
from kvproof.sim.drive import Step, run_chunks
from kvproof.spec.contracts import InvariantViolation
from kvproof.spec.groups import CacheGroup, GroupKind, MambaCacheMode
from kvproof.spec.layout import LayoutConfig, resolve_layout

FA, MAMBA = GroupKind.FULL_ATTENTION, GroupKind.MAMBA


def layout(*groups, **config):
    return resolve_layout(LayoutConfig(groups, **{"max_model_len": 256, **config}))


def step(kv, r, num_new, hit=None):
    """One scheduler step computing ``num_new`` tokens of ``r`` after its computed ones (after
    ``hit`` for a new request); asserts the pool lost exactly what the sizing said. Mutates."""
    with Step(kv) as this_step:
        running = kv.is_running(r)
        total = (r.num_computed_tokens if running else (hit.num_tokens if hit else 0)) + num_new
        need = kv.coordinator.blocks_needed(r, total, None if running else hit or kv.coordinator.miss)
        free = kv.pool.num_free
        assert this_step.schedule(r, num_new, hit).blocks is not None
        assert free - kv.pool.num_free == need  # blocks_needed: exactly the free-queue blocks allocate consumed


# --- the step ledger -------------------------------------------------------------------------------


@pytest.mark.parametrize("where, why", [
    ("allocated", "was allocated this step"),
    ("keyed", "was keyed this step, before the forward pass wrote it"),
    ("copied", "is the destination of another copy this step (chained copy)"),
])
def test_a_copy_reads_only_a_block_that_held_its_tokens_when_the_step_began(where, why):
    """INV-COW-SOURCE-READY: copies run before the forward pass, so each of the three kinds of
    not-yet-written source is refused on its own, naming why."""
    ledger = StepLedger()
    if where == "allocated":
        ledger.allocated.add(5)
    elif where == "keyed":
        ledger.keyed.add(5)
    else:
        ledger.add_copy(0, "other", 9, 5)
    with pytest.raises(InvariantViolation, match=re.escape(f"copy 5 -> 6 reads block 5, which {why}")):
        ledger.add_copy(0, "r", 5, 6)
    ledger.add_copy(0, "r", 7, 6)  # a block untouched this step is a ready source
    assert ledger.copies[-1] == (0, 7, 6)


# --- base: defaults, keyed lengths, row width --------------------------------------------------------


def test_a_manager_built_without_eagle_hits_the_whole_cached_prefix():
    lay = layout(CacheGroup(FA, 4))
    kv = KVCacheManager(lay, 16)
    step(kv, Request("A", list(range(100, 116)), 4), 16)
    manager = FullAttentionManager(0, lay.groups[0], lay.hash_block_size, lay.cache_hit_alignment, kv.pool, StepLedger())
    hit, blocks = manager.find_hit(Request("B", list(range(100, 116)) + [1], 4), 16)
    assert hit == 16 and len(blocks) == 4  # EAGLE would give back the last block


def test_keyed_lengths_are_the_hit_grid_in_start_exclusive_end_inclusive():
    lay = layout(CacheGroup(FA, 1))  # hit grid of 1 token
    kv = KVCacheManager(lay, 32)
    r = Request("A", list(range(10)), lay.hash_block_size)
    assert list(kv.managers[0].keyed_lengths(r, 2, 5)) == [3, 4, 5]
    lay4 = layout(CacheGroup(FA, 4))
    kv4 = KVCacheManager(lay4, 32)
    assert list(kv4.managers[0].keyed_lengths(Request("A", list(range(20)), 4), 8, 16)) == [12, 16]


def test_a_request_longer_than_a_speculative_mamba_row_is_refused_before_anything_changes():
    """INV-TABLE-WIDTH at the coordinator: Mamba blocks of 4 with 2 speculative blocks and
    max_model_len 16 give rows of 6 entries; 16 tokens fit (4 + 2), 17 do not (5 + 2)."""
    lay = layout(CacheGroup(MAMBA, 4, num_speculative_blocks=2), max_model_len=16)
    kv = KVCacheManager(lay, 64)
    coordinator = kv.coordinator
    assert coordinator.managers[0].max_tokens == 16
    with pytest.raises(InvariantViolation, match="INV-TABLE-WIDTH.*17 tokens need 7 table entries > row width 6"):
        coordinator.allocate(Request("long", list(range(17)), 4), 17, coordinator.miss)
    assert kv.pool.num_free == 63
    rows = coordinator.allocate(Request("fits", list(range(16)), 4), 16, coordinator.miss)
    assert len(rows[0]) == 6 and sum(b != NULL_BLOCK for b in rows[0]) == 3  # the state and its 2 scratch blocks


# --- full attention ------------------------------------------------------------------------------------


def test_partial_hits_off_keys_whole_blocks_only_even_with_a_finer_hash():
    """Hits land on block ends when partial hits are off, so no key inside a block is written
    (nothing could hit it), however fine the hash."""
    lay = layout(CacheGroup(FA, 8), hash_block_size=4, allow_partial_hash_hits=False)
    assert (lay.hash_block_size, lay.cache_hit_alignment) == (4, 8)
    kv = KVCacheManager(lay, 16)
    r = Request("A", list(range(100, 120)), 4)
    step(kv, r, 12)
    assert kv.pool.num_cached_keys() == 1  # the block end at 8; not the hash boundaries 4 and 12
    step(kv, r, 4)
    assert kv.pool.num_cached_keys() == 2 and kv.pool.num_prefix_keys() == 0


@pytest.mark.parametrize("keys, end, expected", [
    ("every-hash", 16, [4, 8, 12, 16]),
    ("chunk-ends", 16, [8, 16]),
    ("chunk-ends", 14, [8, 12]),  # the chunk's last hash boundary, and the block end below it
])
def test_keyed_lengths_follow_the_attention_keys_rule(keys, end, expected):
    lay = layout(CacheGroup(FA, 8), hash_block_size=4, attention_keys=keys)
    assert lay.cache_hit_alignment == 4
    kv = KVCacheManager(lay, 16)
    assert list(kv.managers[0].keyed_lengths(Request("A", list(range(20)), 4), 0, end)) == expected


def test_a_running_request_inside_its_last_block_needs_no_free_block():
    lay = layout(CacheGroup(FA, 4))
    kv = KVCacheManager(lay, 4)  # blocks 1-3
    r = Request("A", list(range(100, 110)), 4)
    step(kv, r, 10)  # 3 blocks: the pool is empty
    assert kv.pool.num_free == 0
    r.append_output(7)
    step(kv, r, 1)  # token 10 goes into the third block


def test_keying_a_boundary_the_block_already_covers_is_an_every_hash_violation():
    """A manager whose bookkeeping forgot what it keyed would re-key boundary 4 of block 0:
    INV-KEYS-EVERY-HASH names it (not the pool's refusal of a stale partial key)."""
    lay = layout(CacheGroup(FA, 8), hash_block_size=4)
    kv = KVCacheManager(lay, 16)
    r = Request("A", list(range(100, 120)), 4)
    step(kv, r, 4)
    manager = kv.managers[0]
    state = manager.requests["A"]
    state.full_keyed = state.partial_keyed = 0  # the bug: forget boundary 4
    kv.begin_step()
    kv.allocate_slots(r, 4)
    r.num_computed_tokens = 8
    with pytest.raises(InvariantViolation, match=r"INV-KEYS-EVERY-HASH: group 0: boundary 4 on block \d+ \(row index 0\), "
                                                 r"which already covers 4 tokens"):
        kv.cache(r)


def test_keys_outside_a_blocks_span_are_named_with_that_span():
    """INV-KEYS-PER-BLOCK: row index 1 of blocks of 8 spans (8, 16]."""
    lay = layout(CacheGroup(FA, 8), hash_block_size=4)
    kv = KVCacheManager(lay, 16)
    r = Request("A", list(range(100, 130)), 4)
    step(kv, r, 16)
    manager = kv.managers[0]
    manager.check_keys()
    blk = kv.block_table(r)[0][1]
    kv.pool.grow_keys(blk, [(("stray", 0), 20)])  # the bug: a key past the block's span
    with pytest.raises(InvariantViolation, match=re.escape(f"block {blk} at row index 1 has keys of lengths [20, 16, 12]; "
                                                           "expected at most 2 multiples of H=4 in (8, 16]")):
        manager.check_keys()


# --- Mamba -----------------------------------------------------------------------------------------------

HYBRID = dict(hash_block_size=4, retention_interval=None)  # dense retention: every chunk end on the hash grid is kept


def test_a_hit_inside_the_block_the_request_ends_in_costs_only_the_copy():
    """Mamba blocks of 8: a hit at 12 and a request of 14 tokens stay in state block 1, so the
    Mamba group needs just the copy of the hit state; attention needs its fourth block."""
    lay = layout(CacheGroup(FA, 4), CacheGroup(MAMBA, 8), **HYBRID)
    kv = KVCacheManager(lay, 32)
    a = Request("A", list(range(100, 116)), 4)
    step(kv, a, 12)  # A keeps running: its blocks are held, none evictable
    b = Request("B", list(range(100, 112)) + [1, 2], 4)
    hit = kv.lookup(b)
    assert hit.num_tokens == 12
    assert kv.coordinator.blocks_needed(b, 14, hit) == 2
    step(kv, b, 2, hit)


@pytest.mark.parametrize("start, end, expected", [(0, 8, (8,)), (4, 8, (8,)), (8, 8, ()), (0, 6, ())])
def test_mamba_keys_only_the_state_a_chunk_ends_on(start, end, expected):
    lay = layout(CacheGroup(FA, 4), CacheGroup(MAMBA, 8), **HYBRID)
    kv = KVCacheManager(lay, 32)
    assert tuple(kv.managers[1].keyed_lengths(Request("A", list(range(20)), 4), start, end)) == expected


def test_a_mid_block_state_past_the_prompt_is_not_kept():
    """Past the prompt a state inside a block is the running one, not a checkpoint: a decode
    step ending at 12 (Mamba blocks of 8, prompt 8) keys no state, one ending at 16 does."""
    lay = layout(CacheGroup(FA, 4), CacheGroup(MAMBA, 8), **HYBRID)
    kv = KVCacheManager(lay, 32)
    r = Request("A", list(range(100, 108)), 4)
    step(kv, r, 8)
    for token in range(9):
        r.append_output(token)
    mamba = kv.managers[1]
    assert list(mamba.keyed_lengths(r, 8, 12)) == []
    step(kv, r, 4)
    assert kv.pool.key_of(kv.block_table(r)[1][1]) is None
    step(kv, r, 4)
    assert kv.pool.key_of(kv.block_table(r)[1][1]) is not None


def test_the_copy_of_a_state_written_in_place_comes_back_if_the_request_is_dropped_mid_step():
    """A running request writing its cached state block in place works on a copy ordered at
    allocation; a manager told to free the request before the step's caching must release that
    copy too (nothing leaks)."""
    lay = layout(CacheGroup(FA, 4), CacheGroup(MAMBA, 8), **HYBRID)
    kv = KVCacheManager(lay, 32)
    r = Request("A", list(range(100, 116)), 4)
    step(kv, r, 12)  # state at 12 kept (a partial key) in state block 1
    state = kv.block_table(r)[1][1]
    assert kv.pool.key_of(state) is not None
    kv.begin_step()
    kv.allocate_slots(r, 2)  # 14 tokens: still state block 1, so the cached state is copied out first
    assert [c for c in kv.take_block_copies() if c[0] == 1] != []
    for m in kv.managers:  # below the step protocol: the managers' own free
        m.free(r)
    pool = kv.pool
    assert pool.num_free == pool.num_blocks - 1


def test_a_released_cached_state_is_released_again_when_its_request_ends():
    """Compute eviction: a state the running request cached and then moved past is requeued
    when the request ends, so it is not evicted before the attention chain it completes."""
    lay = layout(CacheGroup(FA, 4), CacheGroup(MAMBA, 8), eviction="compute", **HYBRID)
    kv = KVCacheManager(lay, 64)
    r = Request("A", list(range(100, 124)), 4)
    step(kv, r, 8)  # state at 8 kept, a full-block key on state block 0
    state = kv.block_table(r)[1][0]
    step(kv, r, 8)  # the state moves to block 1; block 0 is released, still cached
    assert kv.pool.ref_count(state) == 0 and kv.pool.key_of(state) is not None
    released_at = kv.pool.priority(state)
    step(kv, r, 8)
    kv.free(r)
    assert kv.pool.priority(state) > released_at


def test_with_eagle_an_empty_cache_is_a_miss_of_zero_tokens():
    """EAGLE gives back the last hit unit; with nothing cached there is nothing to give back,
    and the hit is 0, never negative."""
    lay = layout(CacheGroup(FA, 4))
    kv = KVCacheManager(lay, 16)
    manager = FullAttentionManager(0, lay.groups[0], lay.hash_block_size, lay.cache_hit_alignment, kv.pool, StepLedger(),
                                   use_eagle=True)
    assert manager.find_hit(Request("A", list(range(100, 116)), 4), 12) == (0, [])


@pytest.mark.parametrize("keys", ["every-hash", "chunk-ends"])
def test_a_step_ending_inside_a_hash_unit_keys_only_the_boundaries_it_wrote(keys):
    """7 tokens computed with hash units of 4: the boundary at 4 is keyed, the one at 8 is not
    (a hit there would read a token nobody wrote)."""
    lay = layout(CacheGroup(FA, 16), hash_block_size=4, attention_keys=keys)
    kv = KVCacheManager(lay, 16)
    a = Request("A", list(range(100, 132)), 4)
    step(kv, a, 7)
    assert kv.lookup(Request("B", list(range(100, 108)) + [1, 2], 4)).num_tokens == 4


def test_a_state_one_token_long_is_a_hit():
    lay = layout(CacheGroup(MAMBA, 1))
    kv = KVCacheManager(lay, 16)
    a = Request("A", [5, 6], 1)
    step(kv, a, 1)  # a chunk ends at the prompt's tail checkpoint (one token before its end): kept
    step(kv, a, 1)
    assert kv.lookup(Request("B", [5, 9], 1)).num_tokens == 1


def test_decode_steps_are_not_skipped_past_a_state_the_retention_rule_keeps():
    """Mamba alone, dense retention: decoding from 6 to 8 tokens, the state at 8 (a hash and
    block boundary) is kept, so the coordinator's idle range after 6 and after 7 ends below 8."""
    lay = layout(CacheGroup(MAMBA, 4), retention_interval=None)
    kv = KVCacheManager(lay, 16)
    a = Request("A", list(range(100, 106)), 4)
    step(kv, a, 6)
    for token in (106, 107):
        a.append_output(token)
        step(kv, a, 1)
    assert kv.lookup(Request("B", list(range(100, 108)) + [1], 4)).num_tokens == 8


def test_with_chunk_end_keys_a_completed_block_keeps_its_chunk_end_key():
    """Chunk-end keys: the key a chunk left at 6 inside a block of 8 stays (as a prefix key)
    once the block is complete, so a request diverging at 6 still hits 6."""
    lay = layout(CacheGroup(FA, 8), hash_block_size=2, attention_keys="chunk-ends")
    kv = KVCacheManager(lay, 16)
    a = Request("A", list(range(100, 116)), 2)
    step(kv, a, 6)
    step(kv, a, 4)
    assert kv.lookup(Request("B", list(range(100, 106)) + [1, 2, 3], 2)).num_tokens == 6


def test_with_chunk_end_keys_a_first_step_ending_on_the_first_hash_boundary_is_keyed():
    """Chunk-end keys: nothing is keyed before a new request's first step, so a step of 2
    tokens (one hash unit, inside a block of 8) keys 2 and a request sharing them hits 2."""
    lay = layout(CacheGroup(FA, 8), hash_block_size=2, attention_keys="chunk-ends")
    kv = KVCacheManager(lay, 16)
    step(kv, Request("A", list(range(100, 116)), 2), 2)
    assert kv.lookup(Request("B", list(range(100, 102)) + [1, 2, 3], 2)).num_tokens == 2


def test_the_per_request_check_of_a_freed_mamba_request_finds_nothing_to_check():
    """KVCacheManager.check_request of a request that holds no blocks in a Mamba group (freed)
    raises nothing: INV-MAMBA-REAL-BLOCKS bounds the blocks a request holds."""
    kv = KVCacheManager(layout(CacheGroup(FA, 8), CacheGroup(MAMBA, 8), hash_block_size=8), 32)
    r = Request("A", list(range(100, 120)), 8)
    step(kv, r, 16)
    kv.check_request(r)
    kv.free(r)
    kv.check_request(r)


def test_a_mamba_group_in_mode_none_never_keys_its_state():
    """Mode 'none' keeps one running state nothing can resume from: after a prompt of two
    attention blocks only the attention blocks carry keys, even with dense retention (which
    would keep every state of a mode-'align' group)."""
    mamba = CacheGroup(MAMBA, 8, mamba_cache_mode=MambaCacheMode.NONE)
    kv = KVCacheManager(layout(CacheGroup(FA, 8), mamba, hash_block_size=8, retention_interval=None), 32)
    r = Request("A", list(range(100, 116)), 8)
    step(kv, r, 16)
    attention, states = kv.block_table(r)
    assert all(kv.pool.key_of(b) is not None for b in attention)
    assert all(kv.pool.key_of(b) is None for b in states if b != NULL_BLOCK)


def test_a_key_at_the_start_of_a_blocks_span_is_outside_it():
    """INV-KEYS-PER-BLOCK: 8 tokens end block 0's span (0, 8], so a key of length 8 on block 1,
    whose span is (8, 16], is a key on the wrong block."""
    lay = layout(CacheGroup(FA, 8), hash_block_size=4)
    kv = KVCacheManager(lay, 16)
    r = Request("A", list(range(100, 130)), 4)
    step(kv, r, 9)  # block 1 holds position 8 only: no key yet
    manager = kv.managers[0]
    manager.check_keys()
    blk = kv.block_table(r)[0][1]
    kv.pool.grow_keys(blk, [(("stray", 0), 8)])  # the bug: block 0's boundary keyed on block 1
    with pytest.raises(InvariantViolation, match=re.escape(f"block {blk} at row index 1 has keys of lengths [8]")):
        manager.check_keys()


def test_under_lru_freeing_a_request_leaves_the_blocks_it_no_longer_held_in_place():
    """LRU orders free blocks by release. The cached Mamba states a request released while it
    ran (retention keeps every chunk end) were queued then; freeing the request must not move
    them behind blocks released since -- re-valuing them on free is the compute policy's alone."""
    kv = KVCacheManager(layout(CacheGroup(MAMBA, 4), retention_interval=None), 24)
    a, b = Request("a", list(range(16)), kv.layout.hash_block_size), Request("b", list(range(100, 116)), kv.layout.hash_block_size)
    assert all(run.blocks is not None for run in run_chunks(kv, a, [4, 4, 4, 3]))
    released_by_a = [blk for blk in kv.pool.free_order() if kv.pool.key_of(blk) is not None]
    assert all(run.blocks is not None for run in run_chunks(kv, b, [4, 4, 4, 3]))
    kv.free(b)
    cached = [blk for blk in kv.pool.free_order() if kv.pool.key_of(blk) is not None]
    assert released_by_a and cached[: len(released_by_a)] == released_by_a and len(cached) > len(released_by_a)  # a's states, then b's
    kv.free(a)
    assert [blk for blk in kv.pool.free_order() if blk in set(cached)] == cached


@pytest.mark.parametrize("shared", [9, 13, 17, 21])
def test_with_eagle_a_layout_without_full_attention_drops_nothing_at_its_junctions(shared):
    """Only full attention's hits end a unit early under EAGLE (its draft recomputes them). With
    a sliding window and Mamba alone, a request sharing ``shared`` tokens of a cached one misses
    (no Mamba state there) and branches at the window's last whole block below them, exactly."""
    kv = KVCacheManager(layout(CacheGroup(GroupKind.SLIDING_WINDOW, 4, sliding_window=8), CacheGroup(MAMBA, 4)), 64, use_eagle=True)
    h = kv.layout.hash_block_size
    assert all(run.blocks is not None for run in run_chunks(kv, Request("a", list(range(24)), h), [24]))
    hit = kv.lookup(Request("b", list(range(shared)) + [999] * 6, h))
    assert (hit.num_tokens, hit.junctions) == (0, (shared // 4 * 4,))
