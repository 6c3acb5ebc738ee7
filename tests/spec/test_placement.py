"""DCP token placement: worked examples (docs/vllm-semantics.md §7.2) and per-rank properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproof.spec.arith import cdiv
from kvproof.spec.placement import (
    PAD_SLOT,
    local_position,
    local_seq_len,
    local_seq_lens,
    owner_rank,
    owning_ranks,
    slot_for_position,
    slot_mapping,
)

ROW = (5, 9, 2)


def test_reference_slots_bs4_dcp2_interleave1():
    rank0 = [slot_for_position(p, ROW, 4, 2, 1, 0, True) for p in range(16)]
    rank1 = [slot_for_position(p, ROW, 4, 2, 1, 1, True) for p in range(16)]
    assert rank0 == [20, -1, 21, -1, 22, -1, 23, -1, 36, -1, 37, -1, 38, -1, 39, -1]
    assert rank1 == [-1, 20, -1, 21, -1, 22, -1, 23, -1, 36, -1, 37, -1, 38, -1, 39]


def test_reference_slots_bs4_dcp2_interleave2():
    rank0 = [slot_for_position(p, ROW, 4, 2, 2, 0, True) for p in range(10)]
    assert rank0 == [20, 21, -1, -1, 22, 23, -1, -1, 36, 37]


@pytest.mark.parametrize("n, dcp, lens", [(7, 2, (4, 3)), (13, 8, (2, 2, 2, 2, 2, 1, 1, 1)), (65, 4, (17, 16, 16, 16)), (96, 4, (24,) * 4)])
def test_reference_local_lengths(n, dcp, lens):
    assert local_seq_lens(n, dcp, 1) == lens


def test_replicated_group_maps_every_position_on_every_rank():
    for rank in range(8):
        assert slot_for_position(1_048_575, tuple(range(65_536)), 16, 8, 1, rank, False) == 65_535 * 16 + 15


@st.composite
def placements(draw):
    dcp = draw(st.integers(1, 8))
    interleave = draw(st.sampled_from([1, 2, 4, 8, 16]))
    block_size = interleave * draw(st.integers(1, 8))
    return block_size, dcp, interleave


@settings(max_examples=200)
@given(placements(), st.integers(0, 600))
def test_every_sharded_position_has_exactly_one_owner_and_distinct_slots(placement, num_tokens):
    block_size, dcp, interleave = placement
    n_blocks = cdiv(max(num_tokens, 1), block_size * dcp)
    row = tuple(range(7, 7 + n_blocks))  # distinct block ids
    positions = tuple(range(num_tokens))
    per_rank = [slot_mapping(positions, row, block_size, dcp, interleave, r, True) for r in range(dcp)]
    for p in positions:
        owners = [r for r in range(dcp) if per_rank[r][p] != PAD_SLOT]
        assert owners == [owner_rank(p, dcp, interleave)]
    for r in range(dcp):
        kept = [s for s in per_rank[r] if s != PAD_SLOT]
        assert len(kept) == len(set(kept)) == local_seq_len(num_tokens, r, dcp, interleave)
        # a rank's slots lie in its own pages of the row's blocks
        assert all(s // block_size in row for s in kept)


@settings(max_examples=300)
@given(placements(), st.integers(0, 10_000))
def test_owner_formula_matches_vllm_virtual_block_form(placement, position):
    block_size, dcp, interleave = placement
    offset = position % (block_size * dcp)
    assert owner_rank(position, dcp, interleave) == (offset // interleave) % dcp
    assert owning_ranks(position, block_size, dcp, interleave, True) == ((position // interleave) % dcp,) if dcp > 1 else (0,)


@settings(max_examples=200)
@given(placements(), st.integers(0, 1_500))
def test_local_positions_are_dense_per_rank(placement, num_tokens):
    """Rank r's owned positions in [0, n) map to local positions 0..local_len-1 in order."""
    block_size, dcp, interleave = placement
    for r in range(dcp):
        local = [local_position(p, block_size, dcp, interleave) for p in range(num_tokens) if owner_rank(p, dcp, interleave) == r]
        assert local == list(range(local_seq_len(num_tokens, r, dcp, interleave)))


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="position -1"):
        owner_rank(-1, 2, 1)
    with pytest.raises(ValueError, match="interleave 3 must divide block size 16"):
        local_position(0, 16, 2, 3)
