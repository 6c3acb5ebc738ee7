"""The block pool at edges tools/mutation.py found unreached (docs/testing.md, "Surviving
mutants"): growth by more than two hash boundaries at once, bad block ids with the slow tier on,
a key named by two blocks refused at another length, and a key of one token."""

from __future__ import annotations

import re

import pytest

from kvproof.impl.block_pool import BlockPool
from kvproof.spec import contracts


def test_growth_by_three_boundaries_makes_the_last_the_primary_with_the_slow_tier_on():
    with contracts.slow_checks():
        pool = BlockPool(3)
        (b,) = pool.allocate(1)
        pool.grow_keys(b, [(("k2", 0), 2), (("k4", 0), 4), (("k6", 0), 6)])
    assert pool.keys_of(b) == ((("k6", 0), 6), (("k4", 0), 4), (("k2", 0), 2))
    assert [pool.lookup(("k%d" % n, 0)) for n in (2, 4, 6)] == [b, b, b]


@pytest.mark.parametrize("slow", [False, True])
@pytest.mark.parametrize("verb, call", [
    ("cache_full", lambda pool, b: pool.cache_full(b, ("k", 0), 2)),
    ("cache_partial", lambda pool, b: pool.cache_partial(b, ("k", 0), 2)),
    ("extend_full", lambda pool, b: pool.extend_full(b, ("k", 0), 2)),
    ("extend_partial", lambda pool, b: pool.extend_partial(b, ("k", 0), 2)),
    ("replace_key", lambda pool, b: pool.replace_key(b, ("k", 0), 2)),
    ("grow_keys", lambda pool, b: pool.grow_keys(b, [(("k", 0), 2)])),
])
@pytest.mark.parametrize("block", [-1, 4, 99])
def test_a_block_id_out_of_range_is_named_by_the_verb_whatever_the_slow_switch(slow, verb, call, block):
    """The slow tier's snapshots must not answer a bad id before the verb's own check does."""
    pool = BlockPool(4)
    pool.allocate(3)
    with contracts.slow_checks(slow):
        with pytest.raises(ValueError, match=re.escape(f"{verb}: block id {block} out of range [1, 4)")):
            call(pool, block)
    assert pool.num_cached_keys() == 0


def _key_named_by_two_blocks():
    """Block 1 holds ("k", 0) for 4 tokens as its primary key, block 2 as a prefix key under a
    6-token primary; block 3 is held and unkeyed. The key's oldest holder is block 1."""
    pool = BlockPool(5)
    pool.allocate(3)
    pool.cache_full(1, ("k", 0), 4)
    pool.extend_partial(2, ("k", 0), 4)
    pool.extend_full(2, ("k6", 0), 6)
    assert pool.holders(("k", 0)) == (1, 2)
    return pool


@pytest.mark.parametrize("verb, call", [
    ("cache_full", lambda pool: pool.cache_full(3, ("k", 0), 2)),
    ("cache_partial", lambda pool: pool.cache_partial(3, ("k", 0), 2)),
    ("replace_key", lambda pool: pool.replace_key(3, ("k", 0), 2)),
    ("grow_keys", lambda pool: pool.grow_keys(3, [(("k", 0), 2)])),
])
def test_a_key_held_twice_refuses_another_length_naming_what_a_hit_on_it_returns(verb, call):
    """INV-POOL-KEY-LENGTH: the refusal names the length the key stands for and the block a
    lookup returns for it (the oldest holder), not another holder's primary length."""
    pool = _key_named_by_two_blocks()
    with pytest.raises(ValueError, match=re.escape(f"INV-POOL-KEY-LENGTH: {verb}: key already names a 4-token prefix "
                                                   "(block 1), not 2 tokens")):
        call(pool)
    assert pool.keys_of(3) == () and pool.holders(("k", 0)) == (1, 2)


@pytest.mark.parametrize("verb, call", [
    ("cache_full", lambda pool: pool.cache_full(3, ("k", 0), 2)),
    ("cache_partial", lambda pool: pool.cache_partial(3, ("k", 0), 2)),
    ("replace_key", lambda pool: pool.replace_key(3, ("k", 0), 2)),
    ("grow_keys", lambda pool: pool.grow_keys(3, [(("k", 0), 2)])),
])
def test_a_key_whose_oldest_holder_keeps_it_as_a_prefix_key_is_named_with_its_own_length(verb, call):
    """The other order: the oldest holder carries the key as a prefix key under a 6-token primary;
    the refusal still names the 4 tokens the key stands for, not the holder's primary length."""
    pool = BlockPool(5)
    pool.allocate(3)
    pool.extend_partial(1, ("k", 0), 4)
    pool.extend_full(1, ("k6", 0), 6)
    assert pool.holders(("k", 0)) == (1,) and pool.key_of(1) == ("k6", 0)
    with pytest.raises(ValueError, match=re.escape(f"INV-POOL-KEY-LENGTH: {verb}: key already names a 4-token prefix "
                                                   "(block 1), not 2 tokens")):
        call(pool)
    assert pool.keys_of(3) == ()


@pytest.mark.parametrize("verb", ["cache_full", "extend_full", "cache_partial", "extend_partial", "replace_key"])
def test_every_keying_verb_takes_a_key_of_one_token(verb):
    """The shortest prefix a key can name (H = 1): one token is a length, not a bad input."""
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    assert getattr(pool, verb)(b, ("k1", 0), 1) is True
    assert pool.keys_of(b) == ((("k1", 0), 1),)


def test_a_prefix_key_of_one_token_is_well_formed():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.extend_partial(b, ("k1", 0), 1)
    pool.extend_full(b, ("k2", 0), 2)
    assert pool.keys_of(b) == ((("k2", 0), 2), (("k1", 0), 1)) and pool._check()


@pytest.mark.parametrize("bad", [0, 4, 99, -1])
def test_move_key_names_a_block_id_out_of_range_and_changes_nothing(bad):
    """A bad id on either side of ``move_key`` is refused with the verb's own error, never an
    IndexError from reading its reference count."""
    pool = BlockPool(4)
    pool.allocate(3)
    pool.cache_full(1, ("k", 0), 2)
    for src, dst in ((1, bad), (bad, 2)):
        with pytest.raises(ValueError, match=re.escape(f"move_key needs two distinct held real blocks, got {src} -> {dst}")):
            pool.move_key(src, dst)
    assert pool.lookup(("k", 0)) == 1 and pool.key_of(2) is None
