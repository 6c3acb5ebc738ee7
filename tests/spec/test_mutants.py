"""Tests that kill mutants tools/mutation.py found alive (docs/testing.md, "Surviving mutants"):
boundaries nothing else touched, defaults, and helpers used one way only."""

from __future__ import annotations

import dataclasses
import inspect
import re

import icontract
import pytest

from kvproof.impl.block_pool import BlockPool
from kvproof.spec import block_pool as spec_pool
from kvproof.spec import contracts, placement
from kvproof.spec.contracts import guard_like
from kvproof.spec.geometry import PartialHitDecision
from kvproof.spec.groups import CacheGroup, GroupKind
from kvproof.spec.layout import Layout, LayoutConfig, resolve_layout


def test_can_allocate_zero_and_every_free_block_but_not_more():
    pool = BlockPool(3)
    assert pool.can_allocate(0) and pool.can_allocate(2)
    assert not pool.can_allocate(3) and not pool.can_allocate(-1)


def test_slow_checks_turns_the_switch_on_by_default_and_restores_it():
    with contracts.slow_checks(False):
        with contracts.slow_checks():
            assert contracts.slow()
        assert not contracts.slow()


def test_guard_like_keeps_the_preconditions_with_their_errors():
    guarded = guard_like(placement.owner_rank, lambda position, dcp, interleave: 0)
    with pytest.raises(ValueError, match="position -1 must be >= 0"):
        guarded(-1, 2, 1)
    with pytest.raises(ValueError, match="dcp 0 and interleave 1 must both be >= 1"):
        guarded(0, 0, 1)


def test_owning_ranks_of_a_replicated_position_is_every_rank():
    assert placement.owning_ranks(5, 4, 3, 1, sharded=False) == (0, 1, 2)
    assert placement.owning_ranks(5, 4, 3, 1, sharded=True) == (2,)
    assert placement.owning_ranks(0, 1, 1, 1, sharded=True) == (0,)


def test_local_lengths_of_an_empty_sequence():
    assert placement.local_seq_lens(0, 3, 2) == (0, 0, 0)
    assert placement.local_seq_len(0, 0, 1, 1) == 0


def test_the_spec_pool_takes_a_one_token_key_and_refuses_zero():
    s, (b, other) = spec_pool.allocate(spec_pool.initial(3), 2)
    s, attached = spec_pool.cache_partial(s, b, "k1", 1)
    assert attached is True and s.ntok[b] == 1
    with pytest.raises(ValueError, match="cache: num_tokens 0 must be an int > 0"):
        spec_pool.cache_partial(s, other, "k0", 0)


def test_sliding_window_of_one_token_is_accepted_and_of_zero_refused():
    assert CacheGroup(GroupKind.SLIDING_WINDOW, 4, sliding_window=1).sliding_window == 1
    with pytest.raises(ValueError, match="sliding window 0 of a sliding_window group must be a positive integer"):
        CacheGroup(GroupKind.SLIDING_WINDOW, 4, sliding_window=0)


@pytest.mark.parametrize("window", [None, True, 1.5, "8"])
def test_a_sliding_window_group_without_a_whole_window_is_refused(window):
    """A window-less sliding-window group has no meaning (capacity, the manager and vLLM's spec
    all read the window): refused at construction (the -O run: tests/spec/test_contracts.py)."""
    with pytest.raises(ValueError, match=re.escape(f"sliding window {window!r} of a sliding_window group must be a "
                                                   "positive integer number of tokens")):
        CacheGroup(GroupKind.SLIDING_WINDOW, 4, sliding_window=window)


@pytest.mark.parametrize("kind", [GroupKind.FULL_ATTENTION, GroupKind.MLA, GroupKind.MAMBA])
def test_only_a_sliding_window_group_takes_a_window(kind):
    assert CacheGroup(kind, 4).sliding_window is None
    with pytest.raises(ValueError, match=f"sliding_window given for a {kind.value} group"):
        CacheGroup(kind, 4, sliding_window=8)


@pytest.mark.parametrize("value", [
    CacheGroup(GroupKind.MAMBA, 4),
    LayoutConfig((CacheGroup(GroupKind.MAMBA, 4),)),
    PartialHitDecision(False, "off"),
])
def test_spec_values_are_frozen(value):
    field = dataclasses.fields(value)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(value, field, getattr(value, field))


def test_resolved_layouts_are_frozen():
    layout = resolve_layout(LayoutConfig((CacheGroup(GroupKind.FULL_ATTENTION, 4),)))
    assert isinstance(layout, Layout)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.hash_block_size = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.groups[0].table_width = 1


def test_layout_config_defaults():
    config = LayoutConfig((CacheGroup(GroupKind.FULL_ATTENTION, 4),))
    assert (config.dcp, config.max_model_len, config.interleave, config.hash_block_size) == (1, 8192, 1, None)
    assert config.allow_partial_hash_hits is True and config.shared_prefix_checkpoint is False
    assert config.retention_interval == 0


@pytest.mark.parametrize("field, value, message", [
    ("dcp", 0, "dcp 0 must be a positive integer"),
    ("dcp", True, "dcp True must be a positive integer"),
    ("dcp", 1025, "dcp 1025 is too large; expected at most 1024"),
    ("max_model_len", (1 << 30) + 1, f"max_model_len {(1 << 30) + 1} is too large; expected at most {1 << 30}"),
    ("interleave", 0, "interleave 0 must be a positive integer"),
])
def test_layout_bounds(field, value, message):
    config = dataclasses.replace(LayoutConfig((CacheGroup(GroupKind.FULL_ATTENTION, 4),)), **{field: value})
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_layout(config)
    edge = {"dcp": 1024, "max_model_len": 1 << 30, "interleave": 1}[field]
    resolve_layout(dataclasses.replace(config, **{field: edge}))


def test_a_disabled_precondition_would_be_noticed():
    """Each spec precondition that validates input refuses its bad value (and is not an
    icontract violation, which would mean a condition without its error)."""
    from kvproof.spec import geometry

    for call, message in (
        (lambda: geometry.scheduler_block_size((), 1), "at least one cache group is required"),
        (lambda: geometry.hash_block_size((), 1), "at least one cache group is required"),
        (lambda: geometry.max_num_blocks_per_req(CacheGroup(GroupKind.FULL_ATTENTION, 4), 0, 16), "dcp 0 must be >= 1"),
        (lambda: geometry.block_table_width(-1, 4, 128), "num_blocks -1 must be >= 0"),
        (lambda: geometry.block_table_width(4, 4, 0), "token_alignment 0 must be None or > 0"),
        (lambda: placement.local_seq_len(4, 0, 2, 0), "interleave 0 must be >= 1"),
        (lambda: placement.local_seq_lens(4, 0, 1), "dcp 0 and interleave 1 must both be >= 1"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            call()
    assert geometry.max_num_blocks_per_req(CacheGroup(GroupKind.FULL_ATTENTION, 4), 1, 16) == 4
    with pytest.raises(icontract.ViolationError, match="INV-DCP-LOCAL-LEN-BALANCE"):
        guard_like(placement.local_seq_lens, lambda num_tokens, dcp, interleave: (0, 1))(1, 2, 1)


def _config(*groups, **kwargs):
    return LayoutConfig(groups or (CacheGroup(GroupKind.FULL_ATTENTION, 4), CacheGroup(GroupKind.MAMBA, 8)), **kwargs)


@pytest.mark.parametrize("config, message", [
    (LayoutConfig(()), "at least one cache group is required"),
    (_config(CacheGroup(GroupKind.MAMBA, 8, dcp_sharded=True)), "group 0 (mamba:8) is marked DCP-sharded"),
    (_config(CacheGroup(GroupKind.SLIDING_WINDOW, 8, sliding_window=16), dcp=2),
     "group 0 (sliding_window:8) is a DCP-sharded sliding window under dcp 2"),
    (_config(CacheGroup(GroupKind.FULL_ATTENTION, 6), dcp=2, interleave=4),
     "interleave 4 does not divide block size 6 of group 0"),
    (_config(retention_interval=-16), "retention_interval -16 must be None (dense), 0 or a positive multiple"),
    (_config(retention_interval=True), "retention_interval True must be None (dense), 0 or a positive multiple"),
    (_config(retention_interval=16.0), "retention_interval 16.0 must be None (dense), 0 or a positive multiple"),
    (_config(CacheGroup(GroupKind.FULL_ATTENTION, 8), retention_interval=8),
     "retention_interval 8 has no effect without a Mamba or sliding-window group"),
    (_config(retention_interval=12), "retention_interval 12 must be a multiple of the scheduler block size 8"),
])
def test_every_layout_check_names_its_value(config, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve_layout(config)


@pytest.mark.parametrize("config", [
    _config(retention_interval=None), _config(retention_interval=16), _config(retention_interval=8),
    _config(CacheGroup(GroupKind.SLIDING_WINDOW, 8, sliding_window=16), retention_interval=8),
    _config(CacheGroup(GroupKind.SLIDING_WINDOW, 8, sliding_window=16, dcp_sharded=False), dcp=2),
    _config(CacheGroup(GroupKind.SLIDING_WINDOW, 8, sliding_window=16)),  # sharded is harmless at dcp 1
    _config(CacheGroup(GroupKind.FULL_ATTENTION, 6), interleave=4),  # interleave means nothing at dcp 1
    _config(CacheGroup(GroupKind.FULL_ATTENTION, 8), dcp=2, interleave=4),
    _config(CacheGroup(GroupKind.FULL_ATTENTION, 6, dcp_sharded=False), dcp=2, interleave=4),
])
def test_the_layouts_next_to_each_check_are_accepted(config):
    assert resolve_layout(config).config == config


def test_only_a_mamba_group_in_mode_none_is_not_prefix_cacheable():
    assert not CacheGroup(GroupKind.MAMBA, 8, mamba_cache_mode="none").prefix_cacheable
    assert CacheGroup(GroupKind.MAMBA, 8).prefix_cacheable
    assert CacheGroup(GroupKind.FULL_ATTENTION, 8).prefix_cacheable
    assert CacheGroup(GroupKind.SLIDING_WINDOW, 8, sliding_window=4).prefix_cacheable


def test_the_partial_hit_reason_names_the_comparison_that_failed():
    from kvproof.spec.geometry import partial_hash_hits

    mamba = (CacheGroup(GroupKind.FULL_ATTENTION, 4), CacheGroup(GroupKind.MAMBA, 4))
    assert partial_hash_hits(mamba, 1, 4).reason == "no align-mode Mamba group with block size > hash block size 4"
    assert partial_hash_hits(mamba, 2, 8).reason == "no align-mode Mamba group with block size >= hash block size 8"


def test_partial_hits_with_only_a_stateless_mamba_group_break_the_rule():
    """INV-GEOM-PARTIAL-RULE: a Mamba group in mode 'none' gains nothing from partial hits."""
    from kvproof.spec.geometry import partial_hash_hits

    groups = (CacheGroup(GroupKind.FULL_ATTENTION, 4), CacheGroup(GroupKind.MAMBA, 8, mamba_cache_mode="none"))
    assert not partial_hash_hits(groups, 1, 4).enabled
    always = guard_like(partial_hash_hits, lambda groups, dcp, hash_block_size, allow=True: PartialHitDecision(True, "on"))
    with pytest.raises(icontract.ViolationError, match="INV-GEOM-PARTIAL-RULE"):
        always(groups, 1, 4)


def _pool_with_a_prefix_key():
    """A spec pool whose block ``b`` holds key k8 (8 tokens) and the prefix key k4."""
    s, (b,) = spec_pool.allocate(spec_pool.initial(6), 1)
    s, _ = spec_pool.cache_partial(s, b, "k4", 4)
    s, _ = spec_pool.cache_full(s, b, "k8", 8, keep_prefixes=True)
    return s, b


def _lose_a_free_block(result):
    """``result`` (a state, or a tuple starting with one) with the free queue's last block lost."""
    if isinstance(result, tuple):
        return (_lose_a_free_block(result[0]), *result[1:])
    return dataclasses.replace(result, free=result.free[:-1])


def test_every_spec_pool_operation_checks_it_leaves_a_well_formed_pool():
    """INV-POOL-CONSERVE fires on each operation whose body loses a free block and does its
    own job otherwise."""
    s, b = _pool_with_a_prefix_key()
    held = spec_pool.allocate(s, 1)[0]
    calls = [
        ("initial", (6,)), ("allocate", (s, 1)), ("touch", (s, [b])), ("free", (s, [b])),
        ("cache_full", (s, b, "k12", 12)), ("cache_partial", (s, b, "k10", 10)),
        ("evict", (spec_pool.free(s, [b]), [b])), ("move_key", (held, b, 2)),
    ]
    for name, args in calls:
        op = getattr(spec_pool, name)
        result = op(*args)
        assert spec_pool.well_formed(result[0] if isinstance(result, tuple) else result)
        def spoiled_body(*a, op=op, **k):
            return _lose_a_free_block(op(*a, **k))

        spoiled_body.__signature__ = inspect.signature(op)
        spoiled = guard_like(op, spoiled_body)
        with pytest.raises(icontract.ViolationError, match=f"INV-POOL-CONSERVE: (the )?{name}"):
            spoiled(*args)


def test_prefix_keys_must_differ_from_the_primary_and_lie_in_the_past():
    s, b = _pool_with_a_prefix_key()
    assert spec_pool.prefix_keys_nest(s)
    (key, ntok, stamp), = s.prefixes[b]
    for bad in ((("k8", ntok, stamp),), ((key, ntok, s.clock),)):
        prefixes = s.prefixes[:b] + (bad,) + s.prefixes[b + 1:]
        assert not spec_pool.prefix_keys_nest(dataclasses.replace(s, prefixes=prefixes))


def test_spec_pool_refusals_change_nothing_and_a_held_prefix_key_is_no_new_key():
    s, b = _pool_with_a_prefix_key()
    assert spec_pool.cache_full(s, b, "k4", 4) == (s, False)  # k4 is already b's (as a prefix key)
    assert spec_pool.cache_partial(s, b, "k6", 6) == (s, None)  # b already covers 8 tokens: refused, unchanged
    changed = spec_pool.free(s, [b])
    refuse_but_change = guard_like(spec_pool.cache_partial,
                                   lambda s, block, key, num_tokens, replace=False, keep_prefixes=False: (changed, None))
    with pytest.raises(icontract.ViolationError, match="INV-POOL-ATOMIC"):
        refuse_but_change(s, b, "k6", 6)


def test_the_pool_takes_every_group_id_of_its_range_and_no_other():
    pool = BlockPool(4)
    assert len(pool.allocate(1, 0)) == 1 and len(pool.allocate(1, 65535)) == 1
    for bad in (-1, 65536, True):
        with pytest.raises(ValueError, match=re.escape(f"allocate: group {bad!r} must be an int in [0, 65536)")):
            pool.allocate(1, bad)
    assert pool.num_free == 1  # the refusals took nothing


@pytest.mark.parametrize("call", [
    lambda p: placement.owner_rank(p, 2, 1),
    lambda p: placement.local_position(p, 4, 2, 1),
    lambda p: placement.table_index(p, 4, 2, True),
    lambda p: placement.owning_ranks(p, 4, 2, 1, True),
    lambda p: placement.slot_for_position(p, (7,), 4, 2, 1, 0, True),
])
def test_placement_takes_position_zero_and_names_a_negative_one(call):
    call(0)
    with pytest.raises(ValueError, match="position -1 must be >= 0"):
        call(-1)


def test_a_rank_outside_the_group_and_repeated_positions_are_named():
    assert placement.local_seq_len(4, 0, 2, 1) == 2 and placement.local_seq_len(4, 1, 2, 1) == 2
    for rank in (-1, 2):
        with pytest.raises(ValueError, match=re.escape(f"rank {rank} must lie in [0, dcp 2)")):
            placement.local_seq_len(4, rank, 2, 1)
    with pytest.raises(ValueError, match="positions must be distinct"):
        placement.slot_mapping((1, 1), (7,), 4, 1, 1, 0, True)


def test_row_widths_and_bytes_by_example():
    from kvproof.spec import geometry

    # Mamba in mode 'none' keeps one running state and its speculative blocks, however long.
    stateless = CacheGroup(GroupKind.MAMBA, 16, mamba_cache_mode="none", num_speculative_blocks=2)
    assert geometry.max_num_blocks_per_req(stateless, 1, 100_000) == 3
    # 8192 tokens in blocks of 16: 512 int32 entries, 2 KiB per request row.
    row = resolve_layout(LayoutConfig((CacheGroup(GroupKind.FULL_ATTENTION, 16),), max_model_len=8192)).groups[0]
    assert (row.table_width, row.table_row_bytes) == (512, 2048)


def test_a_row_narrower_than_a_stateless_mamba_groups_demand_breaks_the_width_rule():
    from kvproof.spec import geometry

    stateless = CacheGroup(GroupKind.MAMBA, 16, mamba_cache_mode="none", num_speculative_blocks=2)
    narrow = guard_like(geometry.max_num_blocks_per_req, lambda group, dcp, max_len: 2)
    with pytest.raises(icontract.ViolationError, match="INV-TABLE-WIDTH"):
        narrow(stateless, 1, 100)


def test_partial_hits_where_a_group_cannot_end_a_prefix_at_every_hash_boundary_break_the_rule():
    """INV-GEOM-PARTIAL-RULE: with sliding-window blocks of 2 and H = 1, a hit of 1 token would
    end inside a window block, which a window cannot restore (the Mamba group would gain)."""
    from kvproof.spec.geometry import partial_hash_hits

    groups = (CacheGroup(GroupKind.SLIDING_WINDOW, 2, sliding_window=4), CacheGroup(GroupKind.MAMBA, 2))
    assert not partial_hash_hits(groups, 1, 1).enabled
    always = guard_like(partial_hash_hits, lambda groups, dcp, hash_block_size, allow=True: PartialHitDecision(True, "on"))
    with pytest.raises(icontract.ViolationError, match="INV-GEOM-PARTIAL-RULE"):
        always(groups, 1, 1)


def test_a_key_stamped_now_or_later_is_inconsistent_and_move_key_names_bad_blocks():
    s, b = _pool_with_a_prefix_key()
    assert spec_pool.keys_consistent(s)
    stamp = s.stamp[:b] + (s.clock,) + s.stamp[b + 1:]
    assert not spec_pool.keys_consistent(dataclasses.replace(s, stamp=stamp))
    ntok = s.ntok[:b] + (-1,) + s.ntok[b + 1:]
    assert not spec_pool.keys_consistent(dataclasses.replace(s, ntok=ntok))
    held, (other, third) = spec_pool.allocate(s, 2)
    keyed, _ = spec_pool.cache_full(held, third, "k3", 3)
    for src, dst in ((99, b), (b, 99), (-1, b), (other, b), (b, third)):  # dst keyed, or src without a key
        with pytest.raises(ValueError, match="move_key"):
            spec_pool.move_key(keyed, src, dst)


@pytest.mark.parametrize("speculative", [0, 2])
def test_a_capacity_rule_that_forgets_the_mamba_state_block_breaks_the_rule(speculative):
    """INV-CAPACITY-ALONE: a Mamba group holds its state block beside its speculative ones."""
    from kvproof.spec.capacity import blocks_alone

    lay = resolve_layout(LayoutConfig((CacheGroup(GroupKind.FULL_ATTENTION, 16),
                                       CacheGroup(GroupKind.MAMBA, 16, num_speculative_blocks=speculative))))
    assert blocks_alone(lay, 20) == (2, 1 + speculative)
    stateless = guard_like(blocks_alone, lambda layout, num_tokens: (2, speculative))
    with pytest.raises(icontract.ViolationError, match="INV-CAPACITY-ALONE"):
        stateless(lay, 20)
