"""Geometry rules: worked examples (docs/vllm-semantics.md §6.3 and §1's derivation table) and
properties over wide ranges."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproof.spec.arith import cdiv
from kvproof.spec.geometry import (
    block_table_width,
    cache_hit_alignment,
    effective_block_size,
    hash_block_size,
    max_num_blocks_per_req,
    partial_hash_hits,
    scheduler_block_size,
    table_entries_needed,
)
from kvproof.spec.groups import CacheGroup, GroupKind, MambaCacheMode
from kvproof.spec.layout import LayoutConfig, resolve_layout
from kvproof.spec.placement import table_index

FA, MLA, SWA, MAMBA = GroupKind.FULL_ATTENTION, GroupKind.MLA, GroupKind.SLIDING_WINDOW, GroupKind.MAMBA


# --- worked examples: docs/vllm-semantics.md §6.3 -------------------------------------------------

@pytest.mark.parametrize(
    "group, dcp, max_len, blocks, width",
    [
        (CacheGroup(FA, 1536), 8, 1_048_576, 86, 86),
        (CacheGroup(MAMBA, 16), 8, 1_048_576, 65_536, 65_536),
        (CacheGroup(MAMBA, 16, mamba_cache_mode=MambaCacheMode.NONE, num_speculative_blocks=7), 8, 1_048_576, 8, 8),
        (CacheGroup(MLA, 64), 8, 262_144, 512, 512),
        (CacheGroup(MAMBA, 64, num_speculative_blocks=3), 8, 262_144, 4_099, 4_099),
        (CacheGroup(FA, 16), 8, 1_100, 9, 16),
        (CacheGroup(FA, 16), 1, 1_100, 69, 72),
        (CacheGroup(FA, 256), 2, 512, 1, 1),
        (CacheGroup(MAMBA, 256), 2, 512, 2, 2),
        (CacheGroup(FA, 64, dcp_sharded=False), 8, 262_144, 4_096, 4_096),
    ],
    ids=["fa-1536-dcp8", "mamba-16-dcp8", "mamba-none-sp7", "mla-64-dcp8", "mamba-64-sp3",
         "fa-16-dcp8-padded", "fa-16-dcp1-padded", "k3-fa", "k3-mamba", "replicated-draft"],
)
def test_reference_table_widths(group, dcp, max_len, blocks, width):
    n = max_num_blocks_per_req(group, dcp, max_len)
    assert n == blocks
    assert block_table_width(n, group.block_size, group.token_alignment) == width


@pytest.mark.parametrize(
    "fa_bs, m_bs, dcp, explicit, s, h, partial, a",
    [
        (256, 256, 1, None, 256, 256, False, 256),
        (256, 256, 2, None, 512, 256, True, 256),
        (1536, 1536, 8, None, 12288, 1536, True, 1536),
        (1536, 1536, 8, 128, 12288, 128, True, 128),
        (64, 64, 4, 16, 256, 16, True, 16),
        (16, 64, 1, None, 64, 16, True, 16),
    ],
)
def test_reference_derivation_table(fa_bs, m_bs, dcp, explicit, s, h, partial, a):
    groups = (CacheGroup(FA, fa_bs), CacheGroup(MAMBA, m_bs))
    assert scheduler_block_size(groups, dcp) == s
    assert hash_block_size(groups, dcp, explicit) == h
    decision = partial_hash_hits(groups, dcp, h)
    assert decision.enabled is partial
    assert cache_hit_alignment(s, h, decision.enabled) == a


def test_seed_bug_numbers_old_rule_is_an_eighth():
    """The upstream bug: dividing the Mamba width by DCP gives 8,192 rows where 65,536 are
    needed, and the last position of a 1M request reads index 65,535."""
    mamba = CacheGroup(MAMBA, 16)
    old = cdiv(1_048_576, 16 * 8)
    new = max_num_blocks_per_req(mamba, 8, 1_048_576)
    assert (old, new) == (8_192, 65_536)
    assert table_index(1_048_575, 16, 8, sharded=False) == 65_535 >= old


def test_the_eagle_unit_is_a_hash_block_inside_blocks_and_a_block_on_the_block_grid():
    """FA 8 + Mamba 8 at DCP 2 (attention blocks of 16), H 2: hits may end inside attention
    blocks, so the draft recomputes one hash block; with partial hits off they are block
    aligned, and it recomputes the whole 16-token block."""
    groups = (CacheGroup(FA, 8), CacheGroup(MAMBA, 8))
    fine = resolve_layout(LayoutConfig(groups, dcp=2, max_model_len=256, hash_block_size=2))
    assert fine.cache_hit_alignment == 2 and fine.eagle_unit(fine.groups[0]) == 2
    coarse = resolve_layout(LayoutConfig(groups, dcp=2, max_model_len=256, hash_block_size=2, allow_partial_hash_hits=False))
    assert coarse.groups[0].effective_block_size == 16 and coarse.eagle_unit(coarse.groups[0]) == 16


def test_sliding_window_forces_fallback_with_reason():
    groups = (CacheGroup(FA, 2), CacheGroup(MAMBA, 8), CacheGroup(SWA, 4, sliding_window=16))
    h = hash_block_size(groups, 1)
    assert h == 2
    decision = partial_hash_hits(groups, 1, h)
    assert not decision.enabled
    assert decision.warning is not None and "sliding_window:4" in decision.warning


def test_sliding_window_equal_to_hash_block_keeps_partial_hits():
    groups = (CacheGroup(FA, 2), CacheGroup(MAMBA, 8), CacheGroup(SWA, 2, sliding_window=16))
    assert partial_hash_hits(groups, 1, 2).enabled


def test_tp_needs_strictly_larger_mamba_block_dcp_accepts_equal():
    groups = (CacheGroup(FA, 256), CacheGroup(MAMBA, 256))
    assert not partial_hash_hits(groups, 1, 256).enabled
    assert partial_hash_hits(groups, 2, 256).enabled


def test_mamba_none_mode_has_no_partial_hits_and_hash_divides_attention():
    """vLLM 0.33 would set H = S = 64 here, which does not divide the 16-token attention
    block; kvproof keeps H = gcd of the cacheable groups (INV-GEOM-HASH-DIVIDES)."""
    groups = (CacheGroup(FA, 16), CacheGroup(MAMBA, 64, mamba_cache_mode=MambaCacheMode.NONE))
    assert scheduler_block_size(groups, 1) == 64
    assert hash_block_size(groups, 1) == 16
    decision = partial_hash_hits(groups, 1, 16)
    assert not decision.enabled
    assert cache_hit_alignment(64, 16, decision.enabled) == 64


def test_caller_can_turn_partial_hits_off():
    groups = (CacheGroup(FA, 256), CacheGroup(MAMBA, 256))
    decision = partial_hash_hits(groups, 2, 256, allow=False)
    assert not decision.enabled and decision.warning is None


# --- bad input ---------------------------------------------------------------------------------

def test_explicit_hash_block_size_must_divide_every_cacheable_group():
    groups = (CacheGroup(FA, 64), CacheGroup(MAMBA, 64))
    with pytest.raises(ValueError, match=r"hash_block_size 24 does not divide effective block size 128 of group 0"):
        hash_block_size(groups, 2, 24)


def test_single_group_hash_must_equal_block_unless_it_is_append_only_attention():
    with pytest.raises(ValueError, match="hash_block_size 8 must equal the scheduler block size 16"):
        hash_block_size((CacheGroup(SWA, 16, sliding_window=64),), 1, 8)
    with pytest.raises(ValueError, match="hash_block_size 8 must equal the scheduler block size 16"):
        hash_block_size((CacheGroup(MAMBA, 16),), 1, 8)
    with pytest.raises(ValueError, match="hash_block_size 96 does not divide effective block size 2048"):
        hash_block_size((CacheGroup(MLA, 256),), 8, 96)


@pytest.mark.parametrize("kind", [FA, MLA])
def test_lone_attention_group_hashed_finer_than_its_block_hits_inside_blocks(kind):
    """Keys inside a block under DCP: MLA 256 under DCP 8 spans 2,048 tokens per block; hashed every
    256 tokens its hits land on multiples of 256 (append-only KV), not of 2,048. Derived H stays the
    block."""
    groups = (CacheGroup(kind, 256),)
    assert hash_block_size(groups, 8) == 2048 and not partial_hash_hits(groups, 8, 2048).enabled
    assert hash_block_size(groups, 8, 256) == 256
    decision = partial_hash_hits(groups, 8, 256)
    assert decision.enabled and cache_hit_alignment(2048, 256, decision.enabled) == 256
    assert not partial_hash_hits(groups, 8, 256, allow=False).enabled
    # Two attention groups keep vLLM's rule: block-aligned hits.
    assert not partial_hash_hits((CacheGroup(kind, 16), CacheGroup(FA, 32)), 1, 16).enabled


@pytest.mark.parametrize("bad", [0, -16, 1.5, True])
def test_non_positive_block_size_is_rejected(bad):
    with pytest.raises(ValueError, match=f"block size {bad!r}"):
        CacheGroup(FA, bad)


def test_negative_speculative_blocks_rejected():
    with pytest.raises(ValueError, match="num_speculative_blocks -1"):
        CacheGroup(MAMBA, 16, num_speculative_blocks=-1)


def test_unknown_kind_rejected():
    with pytest.raises(ValueError, match="unknown group kind 'gqa'"):
        CacheGroup("gqa", 16)


# --- properties over wide ranges ------------------------------------------------------------

block_sizes = st.integers(1, 4096)
dcps = st.integers(1, 64)
max_lens = st.integers(1, 1 << 24)
kinds = st.sampled_from(list(GroupKind))


@st.composite
def groups_(draw):
    kind = draw(kinds)
    mode = draw(st.sampled_from(list(MambaCacheMode))) if kind is MAMBA else MambaCacheMode.ALIGN
    sharded = None if kind is not SWA else False  # a sharded window is invalid under DCP
    sp = draw(st.integers(0, 8)) if kind is MAMBA else 0
    window = draw(st.integers(1, 1 << 20)) if kind is SWA else None
    return CacheGroup(kind, draw(block_sizes), dcp_sharded=sharded, mamba_cache_mode=mode, num_speculative_blocks=sp,
                      sliding_window=window)


@settings(max_examples=300)
@given(groups_(), dcps, max_lens, st.data())
def test_width_covers_every_table_index_a_request_can_read(group, dcp, max_len, data):
    """INV-TABLE-WIDTH / INV-SLOT-INDEX-BOUND: every position < num_tokens <= max_len reads a
    table index below the row width, and the manager's table length fits."""
    n = max_num_blocks_per_req(group, dcp, max_len)
    width = block_table_width(n, group.block_size, group.token_alignment)
    num_tokens = data.draw(st.integers(1, max_len))
    assert table_entries_needed(group, dcp, num_tokens) <= width
    if group.kind is not MAMBA or group.mamba_cache_mode is MambaCacheMode.ALIGN:
        last = table_index(num_tokens - 1, group.block_size, dcp, group.is_sharded)
        assert last < width


@settings(max_examples=300)
@given(block_sizes, dcps, max_lens, st.integers(0, 8))
def test_mamba_width_never_divided_by_dcp(bs, dcp, max_len, sp):
    mamba = CacheGroup(MAMBA, bs, num_speculative_blocks=sp)
    assert max_num_blocks_per_req(mamba, dcp, max_len) == max_num_blocks_per_req(mamba, 1, max_len)
    assert max_num_blocks_per_req(mamba, dcp, max_len) >= math.ceil(max_len / bs)


@settings(max_examples=300)
@given(st.lists(groups_(), min_size=1, max_size=4), dcps)
def test_derived_sizes_divide_each_other(groups, dcp):
    groups = tuple(groups)
    s = scheduler_block_size(groups, dcp)
    h = hash_block_size(groups, dcp)
    decision = partial_hash_hits(groups, dcp, h)
    a = cache_hit_alignment(s, h, decision.enabled)
    assert s % a == 0 and a % h == 0
    for g in groups:
        b = effective_block_size(g, dcp)
        assert s % b == 0
        if g.prefix_cacheable:
            assert b % h == 0
    if decision.enabled:
        assert a == h
        assert any(g.kind is MAMBA and g.mamba_cache_mode is MambaCacheMode.ALIGN for g in groups)


@settings(max_examples=300)
@given(st.integers(0, 1 << 20), st.integers(1, 4096), st.sampled_from([None, 16, 64, 128, 256]))
def test_table_width_padding_is_least_aligned_multiple(n, bs, align):
    w = block_table_width(n, bs, align)
    if align is None:
        assert w == n
    else:
        step = align // math.gcd(align, bs)
        assert w % step == 0 and n <= w < n + step


@settings(max_examples=200)
@given(
    st.sampled_from([FA, MLA, MAMBA]), st.integers(1, 6), st.integers(1, 4), st.integers(1, 40),
    st.integers(0, 2), st.data(),
)
def test_demand_is_what_the_slot_mapping_reads(kind, bs, dcp, max_len, sp, data):
    """table_entries_needed (the demand INV-TABLE-WIDTH checks widths against) equals what the
    slot mapping really reads: a row of demand - speculative entries maps every position below
    max_len on every rank, and one entry fewer makes some position read past it."""
    sp = sp if kind is MAMBA else 0
    group = CacheGroup(kind, bs, num_speculative_blocks=sp)
    interleave = data.draw(st.sampled_from([i for i in range(1, bs + 1) if bs % i == 0]))
    entries = table_entries_needed(group, dcp, max_len) - sp
    from kvproof.spec.placement import slot_for_position

    def reads_past(width):
        row = tuple(range(1, width + 1))
        for p in range(max_len):
            for rank in range(dcp):
                try:
                    slot_for_position(p, row, bs, dcp, interleave, rank, group.is_sharded)
                except IndexError:
                    return True
        return False

    assert not reads_past(entries)
    assert reads_past(entries - 1)
