"""EXH-POOL-SEQUENCES and EXH-JOINT-FIXPOINT have teeth beyond their canaries: seeded wrong
versions of a pool operation (under the real one's contracts), of ``joint_hit``, of ``usable``
and of the fixpoint are each refuted, with a counterexample that says what went wrong."""

from __future__ import annotations

import dataclasses

import pytest

from kvproof.proofs import block_pool as pool_check
from kvproof.proofs import joint_hit as hit_check
from kvproof.proofs.registry import CHECKED, REFUTED
from kvproof.spec import block_pool as pool
from kvproof.spec import joint_hit as spec_hit
from kvproof.spec.arith import floor_to
from kvproof.spec.block_pool import PoolState
from kvproof.spec.contracts import guard_like

SMALL = ((3, 3),)  # two real blocks, sequences of up to three calls


def _allocate_from_the_tail(s, n):
    if n > len(s.free):
        return None
    taken = s.free[len(s.free) - n :]
    state = pool.PoolState(
        tuple(1 if b in taken else r for b, r in enumerate(s.ref)),
        tuple(None if b in taken else k for b, k in enumerate(s.key)),
        tuple(0 if b in taken else t for b, t in enumerate(s.ntok)),
        s.stamp, s.free[: len(s.free) - n], s.clock,
        tuple(() if b in taken else p for b, p in enumerate(s.prefixes)),
    )
    return state, taken


def _touch_once_per_block(s, blocks):
    return pool.touch(s, sorted(set(blocks)))


def _touch_removing_every_block_from_the_free_queue(s, blocks):
    free = list(s.free)
    for b in blocks:
        if b != pool.NULL_BLOCK:
            free.remove(b)  # a held block is not there: ValueError from the body
    ref = tuple(r + sum(1 for x in blocks if x == b) if b else r for b, r in enumerate(s.ref))
    return PoolState(ref, s.key, s.ntok, s.stamp, tuple(free), s.clock, s.prefixes)


def _evict_nothing(s, blocks):
    return s


@pytest.mark.parametrize(
    ("op", "body", "expected"),
    [
        ("allocate", _allocate_from_the_tail, "not the head of the free queue"),
        ("touch", _touch_once_per_block, "listed 2 time(s)"),
        ("touch", _touch_removing_every_block_from_the_free_queue, "ValueError from the body"),
        ("evict", _evict_nothing, "INV-POOL-PREFIX-KEYS: evicted blocks have no key"),
    ],
    ids=lambda x: getattr(x, "__name__", None) if callable(x) else None,
)
def test_a_seeded_pool_bug_is_refuted_with_its_call_sequence(op, body, expected):
    ops = {**pool_check.SPEC_OPS, op: guard_like(pool_check.SPEC_OPS[op], body)}
    outcome = pool_check.check_sequences(ops, 30.0, SMALL)
    assert outcome.verdict == REFUTED
    assert outcome.counterexample.startswith("initial(3); ") and expected in outcome.counterexample


def test_the_real_pool_passes_the_small_scope_and_refuses_bad_input():
    outcome = pool_check.check_sequences(pool_check.SPEC_OPS, 30.0, SMALL)
    assert outcome.verdict == CHECKED, outcome.counterexample
    assert "refused as bad input" in outcome.detail and "budget spent" not in outcome.detail


def test_a_joint_hit_that_ignores_the_alignment_breaks_inv_hit_bound(monkeypatch):
    def hash_aligned(views, bound, alignment, hash_block_size, hashed_len):
        n = floor_to(max(min(bound, hashed_len), 0), hash_block_size)
        while n > 0 and not all(spec_hit.usable(v, n, hash_block_size, hashed_len) for v in views):
            n -= hash_block_size
        return n

    monkeypatch.setattr(hit_check, "joint_hit", guard_like(spec_hit.joint_hit, hash_aligned))
    outcome = hit_check.check_joint_hit(hit_check.coordinator_fixpoint, hit_check.as_given, 30.0)
    assert outcome.verdict == REFUTED
    assert "joint_hit: INV-HIT-BOUND" in outcome.counterexample


def test_a_usable_that_forgets_the_eagle_unit_is_caught_per_group(monkeypatch):
    def no_eagle(view, n, hash_block_size, hashed_len):
        return spec_hit.usable(dataclasses.replace(view, eagle_unit=0), n, hash_block_size, hashed_len)

    monkeypatch.setattr(hit_check, "usable", no_eagle)
    outcome = hit_check.check_joint_hit(hit_check.coordinator_fixpoint, hit_check.as_given, 30.0)
    assert outcome.verdict == REFUTED
    assert "attention(block 1, eagle)" in outcome.counterexample
    assert "the kind's rule says False" in outcome.counterexample


def test_a_fixpoint_that_steps_down_one_unit_per_pass_breaks_the_two_pass_claim():
    def step_down(finders, start):
        hit, passes = max(start, 0), 0
        while True:
            passes += 1
            if hit == 0 or all(find(hit) == hit for find in finders):
                return hit, passes
            hit -= 1  # one token per pass whatever the finders say (A = 1 comes first)

    outcome = hit_check.check_joint_hit(step_down, hit_check.as_given, 30.0)
    assert outcome.verdict == REFUTED
    assert "passes" in outcome.counterexample
