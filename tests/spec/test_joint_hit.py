"""spec/joint_hit.py by worked examples: what each kind of group can restore and the joint hit's
bounds (the coordinator's state machine compares the spec with the implementation on generated
traffic; these pin the cases it reaches rarely; the fixpoint's edge cases: tests/impl/test_fixpoint.py)."""

from __future__ import annotations

import pytest

from kvproof.spec.joint_hit import ATTENTION, MAMBA, WINDOW, GroupView, joint_hit, usable


def keys(*lengths):
    return set(lengths).__contains__


def test_attention_restores_a_partial_block_only_from_a_key_inside_that_block():
    # Blocks of 8, hash blocks of 4, 16 hashed tokens.
    view = GroupView(ATTENTION, 8, keys(8, 12))
    assert usable(view, 12, 4, 16)  # block 0 whole, block 1's key at 12
    assert usable(view, 8, 4, 16)  # exactly block 0
    assert not usable(GroupView(ATTENTION, 8, keys(12)), 4, 4, 16)  # a key in block 1 says nothing of block 0's
    assert usable(GroupView(ATTENTION, 8, keys(8)), 4, 4, 16)  # block 0's full key covers its first 4 tokens
    assert not usable(view, 16, 4, 16)  # block 1 is not keyed at 16


def test_an_eagle_group_must_also_hold_the_unit_the_draft_recomputes():
    view = GroupView(ATTENTION, 4, keys(4, 8), eagle_unit=4)
    assert usable(view, 4, 4, 12) and not usable(view, 8, 4, 12)
    assert not usable(view, 8, 4, 8)  # 8 + 4 tokens are more than are hashed


def test_mamba_restores_exactly_its_stored_lengths_and_a_window_its_last_blocks():
    assert usable(GroupView(MAMBA, 8, keys(12)), 12, 4, 16) and not usable(GroupView(MAMBA, 8, keys(12)), 8, 4, 16)
    window = GroupView(WINDOW, 4, keys(8, 12), window=5)  # 12 tokens: the window reads positions 8-11
    assert usable(window, 12, 4, 16) and not usable(window, 10, 4, 16)
    assert not usable(GroupView(WINDOW, 4, keys(12), window=6), 12, 4, 16)  # needs positions 7-11: block 1 too


def test_the_joint_hit_is_the_largest_length_every_group_restores():
    attention = GroupView(ATTENTION, 4, keys(4, 8, 12, 16))
    mamba = GroupView(MAMBA, 4, keys(8, 16))
    assert joint_hit((attention, mamba), bound=15, alignment=4, hash_block_size=4, hashed_len=16) == 8
    assert joint_hit((attention, mamba), bound=16, alignment=4, hash_block_size=4, hashed_len=16) == 16
    assert joint_hit((GroupView(ATTENTION, 4, keys(4)),), bound=7, alignment=1, hash_block_size=1, hashed_len=16) == 4
    assert joint_hit((GroupView(MAMBA, 4, keys()),), bound=5, alignment=1, hash_block_size=1, hashed_len=8) == 0
    assert joint_hit((GroupView(MAMBA, 4, keys(1)),), bound=0, alignment=1, hash_block_size=1, hashed_len=8) == 0


def test_the_joint_hit_refuses_negative_bounds():
    view = GroupView(MAMBA, 4, keys())
    with pytest.raises(ValueError, match="bound -1 and hashed_len 0 must be >= 0"):
        joint_hit((view,), bound=-1, alignment=1, hash_block_size=1, hashed_len=0)
    with pytest.raises(ValueError, match="bound 0 and hashed_len -1 must be >= 0"):
        joint_hit((view,), bound=0, alignment=1, hash_block_size=1, hashed_len=-1)
    assert joint_hit((view,), bound=0, alignment=1, hash_block_size=1, hashed_len=0) == 0
