"""The compute eviction policy (spec/eviction.py): the pool against its spec on generated release
and allocation sequences, the lru policy untouched by values, every INV-EVICT-* contract made to
fire, and the valuer's chain model."""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from kvproof.impl.block_pool import BlockPool
from kvproof.impl.eviction import EvictionValuer
from kvproof.spec import block_pool as spec
from kvproof.spec.contracts import InvariantViolation
from kvproof.spec.eviction import COMPUTE, LRU, ComputeModel, block_value, parse_policy, prefill_flops
from kvproof.spec.groups import CacheGroup, GroupKind
from kvproof.spec.layout import LayoutConfig, resolve_layout

from ..conftest import REACH_SETTINGS
from .test_block_pool_contracts import pool_module

# One step of a generated sequence: allocate n blocks and key them all, release some held blocks
# with values, hit (touch) a cached block, or requeue blocks.
ALLOCATE = st.tuples(st.just("allocate"), st.integers(1, 3))
FREE = st.tuples(st.just("free"), st.lists(st.tuples(st.integers(0, 20), st.sampled_from([0.0, 1.0, 4.0, 30.0])), min_size=1, max_size=4))
STEP = st.one_of(
    ALLOCATE, ALLOCATE, FREE, FREE,
    st.tuples(st.just("touch"), st.integers(0, 20)),
    st.tuples(st.just("requeue"), st.integers(0, 20), st.sampled_from([0.0, 2.0])),
)


def _run(steps, num_blocks, policy, reach=None, with_values=True):
    """Drive a BlockPool and the spec in lockstep; returns every allocation's blocks."""
    pool, model = BlockPool(num_blocks, policy), spec.initial(num_blocks, policy)
    held: list[int] = []
    taken_all = []
    fresh = iter(range(10**6))
    for step in steps:
        if step[0] == "allocate":
            expected = spec.allocate(model, step[1])
            got = pool.allocate(step[1])
            if expected is None:
                assert got is None
                continue
            if reach is not None:
                cached_taken = [b for b in expected[1] if model.key[b] is not None]
                order = [b for b in model.free if model.key[b] is not None]
                if cached_taken:
                    reach("evicted a cached block")
                    if cached_taken[0] != order[0]:
                        reach("evicted out of release order")
                    if len(cached_taken) < len(expected[1]):
                        reach("uncached taken before cached")
            model, taken = expected
            assert tuple(got) == taken
            taken_all.append(taken)
            for b in taken:
                k = ("k", next(fresh))
                pool.cache_full(b, k, 4)
                model, _ = spec.cache_full(model, b, k, 4)
                held.append(b)
        elif step[0] == "free" and held:
            picks = list(dict.fromkeys(i % len(held) for i, _ in step[1]))
            blocks = [held[i] for i in picks]
            values = [v for _, v in step[1][: len(blocks)]] if with_values else None
            pool.free(blocks, values)
            model = spec.free(model, blocks, values)
            for i in sorted(picks, reverse=True):
                del held[i]
        elif step[0] == "touch":
            cached = [b for b in model.free if model.key[b] is not None]
            if cached:
                b = cached[step[1] % len(cached)]
                pool.touch([b])
                model = spec.touch(model, [b])
                held.append(b)
        elif step[0] == "requeue":
            cached = [b for b in model.free if model.key[b] is not None]
            if cached:
                b = cached[step[1] % len(cached)]
                values = [step[2]] if with_values else None
                assert pool.requeue([b], values) == 1
                model = spec.requeue(model, [b], values)
        assert pool._check() and spec.well_formed(model)
        assert pool.released == model.released
    return taken_all


@settings(max_examples=150, **REACH_SETTINGS)
@given(steps=st.lists(STEP, min_size=15, max_size=50), num_blocks=st.integers(3, 9))
def test_compute_pool_matches_its_spec(reach, steps, num_blocks):
    """Allocation order, priorities and every whole-pool check agree with spec.block_pool under
    the compute policy, on sequences that make it evict out of release order."""
    reach.minimums = {"evicted a cached block": 60, "evicted out of release order": 20, "uncached taken before cached": 10}
    _run(steps, num_blocks, COMPUTE, reach)


@settings(max_examples=60, **REACH_SETTINGS)
@given(steps=st.lists(STEP, min_size=5, max_size=40), num_blocks=st.integers(3, 9))
def test_lru_ignores_values_and_compute_without_values_is_lru(steps, num_blocks):
    """Values never change lru's order (the vLLM differential relies on it), and the compute
    policy with every value 0 hands out blocks in exactly lru's order (no evict() here, the one
    call whose effect on the queue differs)."""
    lru = _run(steps, num_blocks, LRU)
    assert _run(steps, num_blocks, LRU, with_values=False) == lru
    assert _run(steps, num_blocks, COMPUTE, with_values=False) == lru


def test_a_valuable_block_outlives_a_cheap_one_released_after_it():
    pool = BlockPool(4, COMPUTE)
    a, b, c = pool.allocate(3)
    for x in (a, b, c):
        pool.cache_full(x, ("k", x), 4)
    pool.free([a, b, c], [10.0, 0.0, 0.0])  # priorities 10, 1, 2
    assert pool.free_order() == (b, c, a)
    assert pool.allocate(2) == [b, c] and pool.key_of(a) == ("k", a)


# --- each INV-EVICT-* contract fires -------------------------------------------------------------


def test_evicting_a_released_cached_block_makes_it_the_last_uncached_one():
    """compute: a free cached block whose keys are dropped leaves the heap for the uncached
    queue's tail, so it is handed out after the uncached blocks freed before it."""
    pool = BlockPool(4, COMPUTE)
    a, b, c = pool.allocate(3)
    pool.cache_full(a, ("k", a), 4)
    pool.free([a, b], [5.0, 0.0])  # a: cached, in the heap; b: uncached, at the queue's head
    assert pool.evict([a]) == 1
    assert pool.priority(a) is None and pool.free_order() == (b, a) and pool._check()
    pool.free([c])
    assert pool.allocate(3) == [c, b, a]


def test_compacting_the_heap_keeps_every_live_entry():
    """compute: hits and releases of one block leave stale heap entries; once they outnumber the
    live ones the heap is rebuilt from the live entries alone, in the same order."""
    pool = BlockPool(4, COMPUTE)
    a, b = pool.allocate(2)
    for x in (a, b):
        pool.cache_full(x, ("k", x), 4)
    pool.free([b, a], [0.0, 0.0])
    for _ in range(80):  # each round: a's entry goes stale, a new one is pushed
        pool.touch([a])
        pool.free([a], [0.0])
    assert len(pool._queue._heap) < 80  # rebuilt at least once
    assert pool._check() and pool.free_order() == (3, b, a)


def test_check_sees_a_live_entry_counter_that_disagrees_with_the_heap():
    """INV-POOL-CONSERVE: the heap's live entries, as marked per block, and their count agree."""
    pool = BlockPool(3, COMPUTE)
    (a,) = pool.allocate(1)
    pool.cache_full(a, ("k", a), 4)
    pool.free([a], [1.0])
    pool._queue._num_live += 1
    with pytest.raises(InvariantViolation, match="INV-POOL-CONSERVE: 1 live heap entries, 1 blocks marked, counter 2"):
        pool._queue.check()


def test_eviction_min_catches_an_allocate_that_ignores_priority(monkeypatch):
    """INV-EVICT-MIN (slow tier): a heap pop replaced by taking the last entry is caught."""
    module = pool_module(monkeypatch, ("            prio, seq, b = heapq.heappop(heap)\n", "            prio, seq, b = heap.pop()\n"))
    pool = module.BlockPool(5, COMPUTE)
    blocks = pool.allocate(4)
    for x in blocks:
        pool.cache_full(x, ("k", x), 4)
    pool.free(blocks, [0.0, 5.0, 1.0, 9.0])
    with pytest.raises(Exception, match="INV-EVICT-MIN"):
        pool.allocate(1)


def test_uncached_first_catches_a_cached_block_in_the_uncached_queue():
    """INV-EVICT-UNCACHED-FIRST: cheap in allocate, and in the whole-pool check."""
    pool = BlockPool(2, COMPUTE)
    (a,) = pool.allocate(1)
    pool.cache_full(a, ("k", a), 4)
    pool.free([a], [1.0])
    pool._queue._uncached.push_back([a])  # corrupt: the cached block is also linked into the uncached queue
    with pytest.raises(InvariantViolation, match="INV-EVICT-UNCACHED-FIRST"):
        pool._check()
    with pytest.raises(InvariantViolation, match="INV-EVICT-UNCACHED-FIRST"):
        pool.allocate(1)


def test_clock_catches_a_priority_below_its_release_number():
    """INV-EVICT-CLOCK: a priority is its release number plus a value >= 0."""
    pool = BlockPool(3, COMPUTE)
    a, b = pool.allocate(2)
    for x in (a, b):
        pool.cache_full(x, ("k", x), 4)
    pool.free([a, b], [0.0, 0.0])  # released as 0 and 1
    queue = pool._queue
    queue._heap[:] = [(-5.0, queue._live_seq[a], a), (1.0, queue._live_seq[b], b)]
    queue._prio[a] = -5.0
    with pytest.raises(InvariantViolation, match="INV-EVICT-CLOCK"):
        pool._check()
    with pytest.raises(InvariantViolation, match="INV-EVICT-CLOCK"):
        pool.allocate(1)


@pytest.mark.parametrize("policy", [LRU, COMPUTE])
@pytest.mark.parametrize("values", [[-1.0], [math.inf], [math.nan], [1.0, 2.0]])
def test_bad_values_are_refused_and_change_nothing(policy, values):
    """INV-EVICT-VALUE: one finite value >= 0 per block, else ValueError naming them, no change."""
    pool = BlockPool(3, policy)
    (a,) = pool.allocate(1)
    pool.cache_full(a, ("k", a), 4)
    before = (pool.ref_count(a), pool.free_order(), pool.num_free)
    with pytest.raises(ValueError, match="INV-EVICT-VALUE"):
        pool.free([a], values)
    assert (pool.ref_count(a), pool.free_order(), pool.num_free) == before
    pool.free([a])
    with pytest.raises(ValueError, match="INV-EVICT-VALUE"):
        pool.requeue([a], values)
    with pytest.raises(ValueError, match="INV-EVICT-VALUE"):
        spec.free(spec.initial(3, policy), [], values)


@pytest.mark.parametrize("policy", [LRU, COMPUTE])
def test_values_past_the_fast_check_get_the_exact_one(policy):
    """INV-EVICT-VALUE where a min-and-sum check alone would be wrong: a NaN after a valid value
    (min skips it) is refused; finite values whose sum overflows are accepted."""
    pool = BlockPool(4, policy)
    a, b = pool.allocate(2)
    for x in (a, b):
        pool.cache_full(x, ("k", x), 4)
    with pytest.raises(ValueError, match="INV-EVICT-VALUE"):
        pool.free([a, b], [1.0, math.nan])
    assert pool.ref_count(a) == pool.ref_count(b) == 1
    pool.free([a, b], [1e308, 1e308])
    assert pool.ref_count(a) == pool.ref_count(b) == 0
    if policy == COMPUTE:
        assert pool.priority(a) == 1e308 and pool.free_order() == (3, a, b)


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="eviction policy 'fifo' must be one of lru, compute"):
        parse_policy("fifo")
    with pytest.raises(ValueError, match="eviction policy 'fifo'"):
        BlockPool(3, "fifo")
    with pytest.raises(ValueError, match="eviction policy 'fifo'"):
        resolve_layout(LayoutConfig((CacheGroup(GroupKind.FULL_ATTENTION, 16),), eviction="fifo"))


# --- the value model -------------------------------------------------------------------------------


def test_prefill_flops_sums_the_per_token_cost():
    m = ComputeModel(flops_per_token=3.0, flops_per_pair=2.0)
    assert prefill_flops(m, 4, 7) == sum(3.0 + 2.0 * t for t in range(4, 7))
    assert prefill_flops(m, 7, 7) == 0.0 and prefill_flops(m, 8, 7) == 0.0
    with pytest.raises(ValueError, match="flops_per_pair -1"):
        ComputeModel(flops_per_pair=-1)


def test_block_value_grows_with_efficiency_and_a_chain_no_hit_uses_is_worth_nothing():
    m = ComputeModel(flops_per_token=1.0, flops_per_pair=1.0)
    assert block_value(m, 0, 3, 16, 100, weight=1.0) == 0.0
    short = block_value(m, 16, 3, 16, 100, weight=1.0)  # one block and two states: below the reference
    long = block_value(m, 4096, 258, 16, 100, weight=1.0)
    assert short == 100.0 and long > short
    assert block_value(m, 4096, 258, 16, 100, weight=0.0) == 100.0


def _hybrid(dcp=1):
    return resolve_layout(LayoutConfig((CacheGroup(GroupKind.MLA, 4), CacheGroup(GroupKind.MAMBA, 4)), dcp=dcp,
                                       max_model_len=256, eviction=COMPUTE))


def test_valuer_marks_attention_blocks_past_the_last_state_dead():
    valuer = EvictionValuer(_hybrid(), num_blocks=50)
    valuer.note_resume("r", 0)
    valuer.note_state("r", 1, 8)
    assert valuer.reach("r", 14) == 8
    values = valuer.attention_values("r", 14, [5, 6, 7, 0], 4)  # index 3 is null: skipped
    assert values == [0.0, valuer.value(8), valuer.value(8)]  # tail first: block [8, 12) is dead
    assert valuer.value(8) == 50.0  # weight 0: one generation for every live block
    valuer.forget("r")
    assert valuer.reach("r", 14) == 0  # no state cached: nothing past where it resumed is reachable


def test_attention_only_chains_reach_what_was_computed():
    lay = resolve_layout(LayoutConfig((CacheGroup(GroupKind.FULL_ATTENTION, 4),), max_model_len=64, eviction=COMPUTE))
    valuer = EvictionValuer(lay, num_blocks=10)
    assert valuer.reach("r", 13) == 13
    assert valuer.attention_values("r", 13, [1, 2, 3, 4], 4) == [valuer.value(13)] * 4
