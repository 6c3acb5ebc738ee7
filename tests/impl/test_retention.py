"""Shared-prefix junctions and Mamba state retention through the scheduler (docs/coordinator.md's
junction example and each retention interval)."""

from __future__ import annotations

import dataclasses

import pytest

from kvproof.impl.kv_cache_manager import KVCacheManager
from kvproof.impl.request import Request
from kvproof.sim.drive import run_chunk
from kvproof.sim.replay import replay
from kvproof.sim.trace import TraceRequest
from kvproof.spec.groups import CacheGroup, GroupKind
from kvproof.spec.layout import LayoutConfig, resolve_layout
from kvproof.spec.retention import RetentionRule, keeps_state, replay_boundaries

FA, MAMBA = GroupKind.FULL_ATTENTION, GroupKind.MAMBA


def layout(retention=0, exact=False, dcp=2, fa=8, mamba=8, h=4, keys="every-hash"):
    return resolve_layout(LayoutConfig((CacheGroup(FA, fa), CacheGroup(MAMBA, mamba)), dcp=dcp, max_model_len=4096,
                                       hash_block_size=h, retention_interval=retention, shared_prefix_checkpoint=exact,
                                       attention_keys=keys))


def cached(trace, lay, budget=2048):
    result = replay(trace, lay, num_blocks=512, max_num_batched_tokens=budget)
    assert result.violations == []
    return {r.request_id: r.num_cached_tokens for r in result.requests}


def issue_trace():
    """docs/coordinator.md's junction example: A (159 tokens), then B (135, sharing 122 with A),
    then C (143, sharing 122)."""
    shared = tuple(range(1000, 1122))
    a = shared + tuple(range(2000, 2037))
    b = shared + tuple(range(3000, 3013))
    c = shared + tuple(range(4000, 4021))
    return [TraceRequest("A", a, (1, 2), arrival=1), TraceRequest("B", b, (3,), arrival=50),
            TraceRequest("C", c, (4,), arrival=100)]


@pytest.mark.parametrize("retention", [0, None])
@pytest.mark.parametrize("keys, junction", [("chunk-ends", 112), ("every-hash", 120)])
def test_issue_example_sibling_resumes_at_the_junction(retention, keys, junction):
    """vLLM 0.33.0 caches 112 tokens for C: attention reaches 112 for B (A's block [112, 128) is
    full, keyed at 128 only), no Mamba state of A lies there, so B's first chunk stops at the
    junction 112 and its state is kept; C finds it. Without the junction stop C hit 0. With
    every-hash keys A's block also has a key at 120 (its last hash boundary B shares), so the
    junction, B's kept state and C's hit are at 120."""
    hits = cached(issue_trace(), layout(retention, keys=keys))
    assert hits["A"] == 0 and hits["B"] == 0
    assert hits["C"] == junction


@pytest.mark.parametrize("keys, junctions", [("chunk-ends", (112,)), ("every-hash", (112, 120))])
def test_lookup_reports_the_junction_beyond_the_joint_hit(keys, junctions):
    lay = layout(0, keys=keys)
    kv = KVCacheManager(lay, 512)
    a = Request("A", list(issue_trace()[0].prompt), lay.hash_block_size)
    assert run_chunk(kv, a, a.num_tokens).blocks is not None
    b = Request("B", list(issue_trace()[1].prompt), lay.hash_block_size)
    hit = kv.lookup(b)
    # Chunk-end keys: A's block [112, 128) is full, keyed at 128 only, so attention stops at
    # 112. Every-hash keys: that block also carries A's keys at 116 and 120, so attention reaches
    # 120 (B shares 122 tokens). No Mamba state of A lies at or below 122 except the one at 0.
    assert hit.num_tokens == 0
    assert hit.junctions == junctions


def test_retention_zero_keeps_only_reachable_states():
    rule = RetentionRule(0, effective_block_size=8, hash_block_size=4, alignment=4, scheduler_block_size=16)
    keep = [n for n in range(1, 160) if keeps_state(n, rule, num_prompt_tokens=159, junctions=(120,))]
    # replay boundary 158 -> block end 152; tail checkpoint 156; junction 120.
    assert keep == [120, 152, 156]


def test_retention_interval_keeps_one_state_per_segment():
    rule = RetentionRule(32, effective_block_size=8, hash_block_size=4, alignment=4, scheduler_block_size=16)
    keep = [n for n in range(8, 160, 8) if keeps_state(n, rule, num_prompt_tokens=159)]
    assert keep == [32, 64, 96, 128, 152]


def test_dense_retention_keeps_every_chunk_end():
    rule = RetentionRule(None, effective_block_size=8, hash_block_size=4, alignment=4, scheduler_block_size=16)
    assert all(keeps_state(n, rule, num_prompt_tokens=159) for n in range(1, 200))


def test_eagle_replay_boundaries_are_one_scheduler_block_lower():
    assert replay_boundaries(100, 16, eagle=False) == (99,)
    assert replay_boundaries(100, 16, eagle=True) == (80,)
    assert replay_boundaries(96, 16, eagle=True) == (64, 80)


def test_retention_is_a_memory_trade_seen_in_held_states():
    """With a budget that splits prompts, dense retention keeps every chunk's state; retention 0
    keeps only the reachable ones, so a sibling sharing only the first chunk hits less."""
    shared = tuple(range(500))
    trace = [TraceRequest("p", shared + (7,), (1,), arrival=1),
             TraceRequest("s", shared[:100] + tuple(range(900, 960)), (2,), arrival=200)]
    dense = cached(trace, layout(None), budget=64)
    sparse = cached(trace, layout(0), budget=64)
    assert dense["s"] == 64  # p's chunks end every 64 tokens; the state at 64 is kept
    assert sparse["s"] == 0


def test_a_short_eagle_prompt_resumes_from_the_start():
    # Under two scheduler blocks, one block lower is position 0: nothing to resume from.
    assert replay_boundaries(20, 16, eagle=True) == (0,)
    assert replay_boundaries(16, 16, eagle=True) == (0,)
    assert replay_boundaries(10, 16, eagle=True) == (0,)  # shorter than one block


def test_a_retention_rule_is_frozen():
    rule = RetentionRule(0, effective_block_size=8, hash_block_size=4, alignment=4, scheduler_block_size=16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        rule.interval = 8


def test_no_state_is_kept_before_the_first_token():
    for interval in (None, 0, 8):
        rule = RetentionRule(interval, effective_block_size=8, hash_block_size=4, alignment=4, scheduler_block_size=8)
        assert not keeps_state(0, rule, num_prompt_tokens=40)


def test_with_eagle_the_state_one_block_below_a_junction_is_kept():
    rule = RetentionRule(0, effective_block_size=8, hash_block_size=4, alignment=4, scheduler_block_size=16, eagle=True)
    keep = [n for n in range(1, 160) if keeps_state(n, rule, num_prompt_tokens=159, junctions=(120,))]
    # replay boundary 128 (one scheduler block below 144); tail checkpoint 152 (one hash block
    # below 156); junction 120, and 112 where the draft resumes below it.
    assert keep == [112, 120, 128, 152]


def test_an_exact_junction_state_is_kept_only_inside_the_prompt_and_when_asked():
    rule = RetentionRule(0, effective_block_size=8, hash_block_size=4, alignment=4, scheduler_block_size=16)
    kept = lambda n, exact=True, junctions=(122,): keeps_state(  # noqa: E731
        n, rule, num_prompt_tokens=122, junctions=junctions, exact_junction=exact)
    assert kept(122)  # a junction at the prompt's very end
    assert not kept(122, exact=False)
    assert kept(121, junctions=(121,))
    assert not kept(123, junctions=(123,))  # past the prompt: not a junction the split stops at
    assert not keeps_state(122, rule, num_prompt_tokens=122, junctions=(122,))  # exact junctions are opt-in


@pytest.mark.parametrize("kwargs, message", [
    ({"interval": -1}, "retention interval -1 must be None or a non-negative integer"),
    ({"interval": 1.5}, "retention interval 1.5 must be None or a non-negative integer"),
    ({"effective_block_size": 0}, "effective_block_size 0 must be positive"),
    ({"scheduler_block_size": 0}, "scheduler_block_size 0 must be positive"),
])
def test_a_bad_retention_rule_is_named(kwargs, message):
    args = {"interval": 0, "effective_block_size": 1, "hash_block_size": 1, "alignment": 1, "scheduler_block_size": 1} | kwargs
    with pytest.raises(ValueError, match=message):
        RetentionRule(**args)
    RetentionRule(**(args | {k: (0 if k == "interval" else 1) for k in kwargs}))  # the edge is accepted
