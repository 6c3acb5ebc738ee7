"""The coordinator's lookup and allocation at their edges (cases tools/mutation.py found that
the scenarios and the state machine's few examples did not reach): what a lookup reports when
nothing can be reused or everything is, and a running request taking the pool's last block."""

from __future__ import annotations

import dataclasses

import pytest

from kvproof.impl.kv_cache_manager import KVCacheManager
from kvproof.impl.request import Request
from kvproof.sim.drive import run_chunk, run_chunks
from kvproof.spec.groups import CacheGroup, GroupKind
from kvproof.spec.layout import LayoutConfig, resolve_layout

FA, MAMBA = GroupKind.FULL_ATTENTION, GroupKind.MAMBA


def run_prompt(kv, lay, request_id, prompt):
    """Admit ``prompt`` as one chunk, compute it and cache it (mutates ``kv``); the request."""
    r = Request(request_id, list(prompt), lay.hash_block_size)
    assert run_chunk(kv, r, r.num_tokens).blocks is not None
    return r


def test_a_hit_within_one_group_reports_no_junction_and_is_frozen():
    lay = resolve_layout(LayoutConfig((CacheGroup(FA, 4),), max_model_len=256))
    kv = KVCacheManager(lay, 64)
    run_prompt(kv, lay, "A", range(100, 116))
    hit = kv.lookup(Request("B", list(range(100, 116)) + [7, 8, 9], lay.hash_block_size))
    assert hit.num_tokens == 16 and hit.junctions == ()  # nothing beyond the hit is shared
    with pytest.raises(dataclasses.FrozenInstanceError):
        hit.num_tokens = 0


def test_a_one_token_prefix_is_a_hit_with_one_token_blocks():
    lay = resolve_layout(LayoutConfig((CacheGroup(FA, 1),), max_model_len=256))
    kv = KVCacheManager(lay, 16)
    run_prompt(kv, lay, "A", [5, 6, 7])
    assert kv.lookup(Request("B", [5, 9], lay.hash_block_size)).num_tokens == 1  # the most a 2-token prompt can hit


def test_a_request_that_resumed_from_a_hit_keys_what_it_computes():
    lay = resolve_layout(LayoutConfig((CacheGroup(FA, 4),), max_model_len=256))
    kv = KVCacheManager(lay, 64)
    run_prompt(kv, lay, "A", range(100, 108))
    b = Request("B", list(range(100, 116)), lay.hash_block_size)
    hit = kv.lookup(b)
    assert hit.num_tokens == 8
    assert run_chunk(kv, b, 8, hit).blocks is not None
    assert kv.lookup(Request("C", list(range(100, 116)) + [1], lay.hash_block_size)).num_tokens == 16


def test_a_layout_with_a_stateless_mamba_group_never_hits_nor_reports_junctions():
    lay = resolve_layout(LayoutConfig((CacheGroup(FA, 4), CacheGroup(MAMBA, 4, mamba_cache_mode="none")),
                                      max_model_len=256))
    kv = KVCacheManager(lay, 64)
    run_prompt(kv, lay, "A", range(100, 116))
    hit = kv.lookup(Request("B", list(range(100, 116)) + [7], lay.hash_block_size))
    assert (hit.num_tokens, hit.junctions) == (0, ())
    assert all(blocks == [] for blocks in hit.blocks)


def test_a_running_request_may_take_the_last_free_block():
    lay = resolve_layout(LayoutConfig((CacheGroup(FA, 4),), max_model_len=256))
    kv = KVCacheManager(lay, 4)  # blocks 1-3 usable
    r = run_prompt(kv, lay, "A", range(100, 108))  # blocks for 8 tokens: 2
    for token in range(6):
        r.append_output(token)
    assert run_chunk(kv, r, 4).blocks is not None  # 4 more tokens: the third and last block
    assert run_chunk(kv, r, 1).blocks is None  # token 13 needs a fourth block, which does not exist


def test_a_partial_mamba_hit_copies_one_block_and_every_block_comes_back():
    lay = resolve_layout(LayoutConfig((CacheGroup(FA, 4), CacheGroup(MAMBA, 8)), max_model_len=256, hash_block_size=4))
    kv = KVCacheManager(lay, 32)
    a = Request("A", list(range(100, 113)), lay.hash_block_size)
    # Chunks as the split rule cuts them: the tail state at 12 is kept.
    assert all(run.blocks is not None for run in run_chunks(kv, a, (12, 1)))
    b = Request("B", list(range(100, 112)) + [1, 2, 3, 4, 5, 6], lay.hash_block_size)
    hit = kv.lookup(b)
    assert hit.num_tokens == 12  # inside Mamba block 1: B works on a copy of A's state block
    run = run_chunk(kv, b, 6, hit)
    assert run.blocks is not None and len([c for c in run.copies if c[0] == 1]) == 1
    kv.free(a)
    kv.free(b)
    kv.begin_step()  # drops the reference that kept the copy's source alive during the step
    pool = kv.coordinator.pool
    assert pool.num_free == pool.num_blocks - 1  # nothing leaked: every block is free or evictable


def test_a_junction_inside_an_attention_block_also_reports_the_block_boundary_below_it():
    lay = resolve_layout(LayoutConfig((CacheGroup(FA, 8), CacheGroup(MAMBA, 8)), max_model_len=256, hash_block_size=4))
    kv = KVCacheManager(lay, 64)
    run_prompt(kv, lay, "A", range(100, 114))  # attention keys 8 and the tail 12; Mamba keeps no state below 14
    hit = kv.lookup(Request("B", list(range(100, 113)) + [1, 2, 3], lay.hash_block_size))
    assert (hit.num_tokens, hit.junctions) == (0, (8, 12))


def test_junctions_lie_beyond_the_hit_and_are_never_repeated():
    """A hit's junctions are distinct lengths beyond it: a longest single-group hit that is
    already block-aligned is reported once (not also as "the block boundary below it"), and a
    boundary the joint hit itself sits on is not a junction."""
    lay = resolve_layout(LayoutConfig((CacheGroup(FA, 4), CacheGroup(MAMBA, 4)), max_model_len=256, hash_block_size=2,
                                      retention_interval=None))
    kv = KVCacheManager(lay, 64)
    run_prompt(kv, lay, "A", range(100, 116))  # attention keys every 2 tokens; Mamba keeps only 16
    hit = kv.lookup(Request("B", list(range(100, 112)) + [1, 2, 3], lay.hash_block_size))
    assert (hit.num_tokens, hit.junctions) == (0, (12,))  # attention reaches the block boundary 12
    c = Request("C", list(range(200, 216)), lay.hash_block_size)
    # Mamba keeps every chunk end (retention none): 8 and 16.
    assert all(run.blocks is not None for run in run_chunks(kv, c, (8, 8)))
    hit = kv.lookup(Request("D", list(range(200, 210)) + [1, 2, 3], lay.hash_block_size))
    assert (hit.num_tokens, hit.junctions) == (8, (10,))  # the boundary below 10 is the hit itself


def test_the_first_step_of_one_token_is_keyed():
    """The coordinator's idle skip starts only after a request's first ``cache``: a first step
    that computed a single token is keyed like any other."""
    lay = resolve_layout(LayoutConfig((CacheGroup(FA, 1),), max_model_len=256))
    kv = KVCacheManager(lay, 16)
    a = Request("A", [5, 6, 7], lay.hash_block_size)
    assert run_chunk(kv, a, 1).blocks is not None
    assert kv.lookup(Request("B", [5, 9], lay.hash_block_size)).num_tokens == 1
