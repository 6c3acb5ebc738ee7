"""The pool spec model on its own: worked examples, its preconditions, and its invariant checks.

The differential state machine (tests/impl/test_block_pool_machine.py) exercises the model against
the implementation; here each model rule is shown once on small numbers, and each invariant
function is shown to reject a state that breaks it.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvproof.spec import block_pool as spec


def held(num_blocks: int, n: int):
    state, blocks = spec.allocate(spec.initial(num_blocks), n)
    return state, blocks


def test_initial_pool_and_allocation_order():
    s = spec.initial(4)
    assert s.free == (1, 2, 3) and spec.well_formed(s)
    s, got = spec.allocate(s, 2)
    assert got == (1, 2) and s.ref == (0, 1, 1, 0)
    assert spec.allocate(s, 2) is None


def test_free_order_uncached_to_head_cached_to_tail():
    s, _ = held(6, 5)
    s, _ = spec.cache_full(s, 2, "k2", 2)
    s = spec.free(s, [3, 2, 1])
    assert s.free == (3, 1, 2)
    s = spec.free(s, [5, 4])
    assert s.free == (5, 4, 3, 1, 2)


def test_lookup_returns_the_oldest_holder_and_move_key_keeps_its_age():
    s, _ = held(5, 3)
    s, _ = spec.cache_partial(s, 2, "k", 4)
    s, _ = spec.cache_partial(s, 1, "k", 4)
    assert spec.holders(s, "k") == (2, 1) and spec.lookup(s, "k") == 2
    s = spec.move_key(s, 2, 3)
    assert spec.holders(s, "k") == (3, 1)


def test_partial_entries_grow_promote_and_refuse():
    s, _ = held(3, 1)
    s, r = spec.cache_partial(s, 1, "@8", 8)
    assert r is True
    s, r = spec.cache_partial(s, 1, "@10", 10)
    assert r is True and spec.lookup(s, "@8") is None
    s, r = spec.cache_full(s, 1, "@12", 12)
    assert r is True and s.key[1] == "@12"
    same, r = spec.cache_partial(s, 1, "@10", 10)
    assert r is None and same == s
    s, r = spec.cache_partial(s, 1, "@6", 6, replace=True)
    assert r is True and s.ntok[1] == 6


def test_reset_only_when_idle():
    s, _ = held(3, 1)
    s, _ = spec.cache_full(s, 1, "k", 2)
    assert spec.reset(s) == (s, False)
    s, ok = spec.reset(spec.free(s, [1]))
    assert ok and s.key == (None, None, None)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda s: spec.allocate(s, -1), r"allocate: block count -1 must be an int >= 0"),
        (lambda s: spec.free(s, [3]), r"INV-POOL-REF-NONNEG: free of \[3\] would drive a ref count negative"),
        (lambda s: spec.free(s, [1, 1]), r"INV-POOL-REF-NONNEG"),
        (lambda s: spec.free(s, [9]), r"free: block ids \[9\] must lie in \[0, 4\)"),
        (lambda s: spec.touch(s, [3]), r"INV-POOL-FREE-IFF-UNREF: touch of a free block without a key"),
        (lambda s: spec.cache_full(s, 0, "k", 2), r"INV-POOL-HELD-TO-CACHE: block 0 must be a real block"),
        (lambda s: spec.cache_partial(s, 3, "k", 2), r"INV-POOL-HELD-TO-CACHE: block 3"),
        (lambda s: spec.cache_partial(s, 1, "k", 0), r"cache: num_tokens 0 must be an int > 0"),
        (lambda s: spec.cache_full(s, 2, "k", 4), r"INV-POOL-KEY-LENGTH"),
        (lambda s: spec.cache_full(s, 1, "short", 1), r"INV-POOL-NO-STALE-PARTIAL: block 1 already covers 2 tokens"),
        (lambda s: spec.evict(s, [0]), r"evict: block ids \[0\] must lie in \[1, 4\)"),
        (lambda s: spec.move_key(s, 2, 1), r"move_key: block 2 must have a key and block 1 none"),
        (lambda s: spec.initial(0), r"num_blocks 0 must be >= 1"),
    ],
)
def test_preconditions_reject_bad_calls(call, message):
    s, _ = held(4, 2)
    s, _ = spec.cache_full(s, 1, "k", 2)
    with pytest.raises(ValueError, match=message):
        call(s)


BROKEN = {
    "INV-POOL-NULL": (spec.null_block_inert, lambda s: dataclasses.replace(s, ref=(1,) + s.ref[1:])),
    "INV-POOL-REF-NONNEG": (spec.refs_nonnegative, lambda s: dataclasses.replace(s, ref=s.ref[:3] + (-1,))),
    "INV-POOL-FREE-IFF-UNREF": (spec.free_iff_unreferenced, lambda s: dataclasses.replace(s, free=s.free + (1,))),
    "INV-POOL-CONSERVE": (spec.conserved, lambda s: dataclasses.replace(s, free=s.free + (1,))),
    "INV-POOL-KEY-CONSISTENT": (spec.keys_consistent, lambda s: dataclasses.replace(s, ntok=s.ntok[:2] + (5,) + s.ntok[3:])),
    "INV-POOL-KEY-LENGTH": (spec.key_lengths_agree, lambda s: dataclasses.replace(s, key=s.key[:2] + ("k",) + s.key[3:], ntok=s.ntok[:2] + (9,) + s.ntok[3:])),
}


@pytest.mark.parametrize("inv_id", sorted(BROKEN))
def test_each_invariant_rejects_a_state_that_breaks_it(inv_id):
    holds, breaks = BROKEN[inv_id]
    assert holds.__doc__.startswith(inv_id)
    s, _ = held(4, 2)
    s, _ = spec.cache_full(s, 1, "k", 2)
    assert holds(s) and spec.well_formed(s)
    assert not holds(breaks(s)) and not spec.well_formed(breaks(s))
