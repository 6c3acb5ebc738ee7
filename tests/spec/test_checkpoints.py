"""The checkpoint policy (``spec.checkpoints``): the turn-end ladder's guarantee, its contracts, the
hot path's ladder stops against the spec, and a next turn that finds its state through the
scheduler and the managers."""

from __future__ import annotations

import dataclasses

import icontract
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproof.impl.chunk_split import ChunkSplitter
from kvproof.sim.replay import replay
from kvproof.sim.trace import TraceRequest
from kvproof.spec.checkpoints import (
    CHECKPOINT_POLICIES, REUSE_BUDGET, checkpoint_unit, parse_checkpoints, policy_budget, turn_end_ladder,
    turn_end_rungs,
)
from kvproof.spec.chunk_split import SplitRule, checkpoint_position, chunk_end, stops
from kvproof.spec.contracts import guard_like
from kvproof.spec.groups import CacheGroup, GroupKind
from kvproof.spec.layout import LayoutConfig, resolve_layout
from kvproof.spec.retention import RetentionRule, keeps_state

from ..conftest import REACH_SETTINGS
from .test_chunk_split import split_inputs

FA, MAMBA = GroupKind.FULL_ATTENTION, GroupKind.MAMBA


def test_worked_ladder():
    # Mooncake-like: last checkpoint of a 7,000-token prompt at 256 is 6,912; gaps 256, 512.
    assert turn_end_rungs(7000, 256, 2) == (6656, 6144)
    assert turn_end_rungs(7000, 256, 3) == (6656, 6144, 5120)
    assert turn_end_rungs(7000, 256, 0) == ()
    assert turn_end_rungs(600, 256, 3) == (256,)  # rungs at or below 0 are left out
    assert turn_end_rungs(7000, 256, 1, eagle=True) == (6400,)  # EAGLE's checkpoint is one unit lower


@settings(max_examples=400, **REACH_SETTINGS)
@given(st.integers(1, 5000), st.sampled_from([1, 4, 16, 256]), st.integers(0, 6))
def test_a_next_turn_recomputes_no_more_than_the_tail_it_does_not_share(reach, prompt, unit, budget):
    """INV-CKPT-LADDER by brute force: a next turn sharing ``s`` tokens of the prompt (a multiple
    of the unit between the lowest state and the last checkpoint) resumes at the highest state
    at or below ``s``, recomputing fewer shared tokens than ``s`` lies below the last checkpoint."""
    reach.minimums = {"exact": 50, "recomputes": 50}
    top = checkpoint_position(prompt, unit, False)
    states = {top, *turn_end_rungs(prompt, unit, budget)}
    for s in range(min(states), top + 1, unit):
        resumed = max(x for x in states if x <= s)
        reach("exact" if resumed == s else "recomputes")
        assert resumed == s or s - resumed < top - s
    # ... and the ladder reaches as far as its budget allows (doubling gaps).
    expected_low = top - (2 ** budget - 1) * unit
    assert min(states) == (expected_low if expected_low > 0 else min(states))
    assert len(states) == 1 + len([r for r in range(1, budget + 1) if top - (2 ** r - 1) * unit > 0])


def test_the_grid_contract_fires():
    off = guard_like(turn_end_rungs, lambda num_prompt_tokens, unit, budget, eagle=False, lookahead=0: (num_prompt_tokens - 1,))
    with pytest.raises(icontract.ViolationError, match="INV-CKPT-GRID"):
        off(1000, 256, 2)


def test_the_budget_contract_fires():
    greedy = guard_like(turn_end_rungs, lambda num_prompt_tokens, unit, budget, eagle=False, lookahead=0:
                        tuple(range(unit, num_prompt_tokens, unit)))
    with pytest.raises(icontract.ViolationError, match="INV-CKPT-BUDGET"):
        greedy(2000, 256, 2)
    twice = guard_like(turn_end_rungs, lambda num_prompt_tokens, unit, budget, eagle=False, lookahead=0: (256, 256))
    with pytest.raises(icontract.ViolationError, match="INV-CKPT-BUDGET"):
        twice(2000, 256, 2)


@pytest.mark.parametrize("args, message", [((0, 256, 2), "prompt 0, unit 256, budget 2"),
                                           ((100, 0, 2), "prompt 100, unit 0, budget 2"),
                                           ((100, 4, -1), "prompt 100, unit 4, budget -1")])
def test_bad_ladder_input_is_named(args, message):
    with pytest.raises(ValueError, match=message):
        turn_end_rungs(*args)


def test_policies_and_units():
    assert CHECKPOINT_POLICIES == ("vllm", "reuse")
    assert policy_budget("vllm") == 0 and policy_budget("reuse") == REUSE_BUDGET
    with pytest.raises(ValueError, match="checkpoint policy 'marconi' must be one of vllm, reuse"):
        parse_checkpoints("marconi")
    assert checkpoint_unit(256, (256,)) == 256
    assert checkpoint_unit(4, (8, 6)) == 24  # a hit length and a whole block of every Mamba group
    with pytest.raises(ValueError, match="alignment 0"):
        checkpoint_unit(0, (8,))


@pytest.mark.parametrize("kwargs, message", [
    ({"rungs": 2}, "rungs 2 and rung_unit 0: expected both set"),
    ({"rungs": 2, "rung_unit": 12}, "rung_unit 12 must be a multiple of the Mamba block 8"),
    ({"rungs": -1, "rung_unit": 8}, "rungs -1 must be a non-negative integer"),
])
def test_bad_ladder_rule_is_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SplitRule(8, 4, 64, **kwargs)


def test_bad_retention_ladder_is_named():
    with pytest.raises(ValueError, match="rungs 2 and rung_unit 4"):
        RetentionRule(0, effective_block_size=8, hash_block_size=4, alignment=4, scheduler_block_size=8,
                      rungs=2, rung_unit=4)


# --- the chunk split: ladder stops, the hot path, progress -----------------------------------------

@st.composite
def ladder_inputs(draw):
    rule, start, num_new, num_tokens, num_prompt, junctions = draw(split_inputs())
    unit = rule.mamba_block_size * draw(st.sampled_from([1, 2]))
    rule = dataclasses.replace(rule, rungs=draw(st.integers(1, 4)), rung_unit=unit)
    return rule, start, num_new, num_tokens, num_prompt, junctions


@settings(max_examples=1000, **REACH_SETTINGS)
@given(ladder_inputs())
def test_hot_path_ladder_matches_the_spec(reach, args):
    reach.minimums = {"rung stop": 30, "other": 30}
    rule, start, num_new, num_tokens, num_prompt, junctions = args
    ours = chunk_end(rule, start, num_new, num_tokens, num_prompt, junctions)
    rungs = turn_end_rungs(num_prompt, rule.rung_unit, rule.rungs, rule.eagle_drop, rule.lookahead)
    without = chunk_end(dataclasses.replace(rule, rungs=0, rung_unit=0), start, num_new, num_tokens, num_prompt, junctions)
    reach("rung stop" if ours != without else "other")
    if ours != without:
        assert ours in rungs and ours < without  # a ladder stop only ever shortens the chunk, to a rung
    assert ChunkSplitter(rule).end(start, num_new, num_tokens, num_prompt, junctions) == ours


@settings(max_examples=300, **REACH_SETTINGS)
@given(st.integers(1, 3000), st.sampled_from([1, 4, 16, 64]), st.sampled_from([1, 2]), st.integers(1, 4),
       st.sampled_from([16, 64, 512, 2048]), st.integers(0, 2000))
def test_a_ladder_schedule_progresses_and_ends_a_chunk_at_every_rung(reach, prompt, block, mult, rungs, budget, hit):
    """INV-SPLIT-PROGRESS with the ladder: a prefill from any block-aligned hit, every step given
    the full budget, makes progress every step and ends a chunk at every rung above its start
    (a state exists there)."""
    reach.minimums = {"rung above the hit": 30}
    rule = SplitRule(block, block, max(budget, block), rungs=rungs, rung_unit=block * mult)
    start = min(hit - hit % block, prompt - 1)
    start -= start % block
    first, ends = start, []
    while start < prompt:
        end = chunk_end(rule, start, min(rule.max_prefill_tokens, prompt - start), prompt, prompt)
        assert end > start
        ends.append(end)
        start = end
    for r in turn_end_rungs(prompt, block * mult, rungs):
        if r > first:
            reach("rung above the hit")
            assert r in ends


def test_vllm_policy_adds_no_stop():
    rule = SplitRule(256, 256, 8192)
    assert stops(rule, 0, 8192, 7000, 7000) == (6912,)
    assert stops(dataclasses.replace(rule, rungs=2, rung_unit=256), 0, 8192, 7000, 7000) == (6144, 6656, 6912)


# --- retention and the whole path -----------------------------------------------------------------

def test_retention_keeps_the_rungs_under_every_interval():
    added_per_interval = {}
    for interval in (0, 64):
        rule = RetentionRule(interval, effective_block_size=8, hash_block_size=4, alignment=4, scheduler_block_size=8,
                             rungs=2, rung_unit=8)
        plain = dataclasses.replace(rule, rungs=0, rung_unit=0)
        added = [n for n in range(1, 160) if keeps_state(n, rule, num_prompt_tokens=159)
                 and not keeps_state(n, plain, num_prompt_tokens=159)]
        assert added == sorted(n for n in turn_end_rungs(159, 8, 2) if not keeps_state(n, plain, num_prompt_tokens=159))
        assert len(added) <= 2  # INV-CKPT-BUDGET: never more than the budget beyond vLLM's rule
        added_per_interval[interval] = added
    # Last checkpoint 152 (kept anyway), rungs 144 and 128; interval 64 keeps 128 on its own.
    assert added_per_interval == {0: [128, 144], 64: [144]}


def layout(checkpoints):
    return resolve_layout(LayoutConfig((CacheGroup(FA, 8), CacheGroup(MAMBA, 8)), dcp=1, max_model_len=4096,
                                       hash_block_size=4, checkpoints=checkpoints))


def test_layout_ladder():
    assert turn_end_ladder(layout("vllm")) == (0, 0)
    assert turn_end_ladder(layout("reuse")) == (REUSE_BUDGET, 8)
    with pytest.raises(ValueError, match="checkpoint policy 'every' must be one of"):
        resolve_layout(LayoutConfig((CacheGroup(FA, 8), CacheGroup(MAMBA, 8)), checkpoints="every"))


@pytest.mark.parametrize("checkpoints, expected", [("vllm", 0), ("reuse", 88)])
def test_a_next_turn_sharing_all_but_the_prompts_tail_resumes_at_a_rung(checkpoints, expected):
    """A (100 tokens) finishes; its next turn B re-sends A's first 90 tokens (the template
    re-rendered A's tail) and more. Attention restores 88 (the hash grid); under vLLM's rule A's
    states lie at 96 and 100 only, so B hits nothing; the ladder made and kept one at 88."""
    a = tuple(range(1000, 1100))
    b = a[:90] + tuple(range(5000, 5040))
    trace = [TraceRequest("A", a, (1, 2), arrival=1), TraceRequest("B", b, (3,), arrival=50)]
    result = replay(trace, layout(checkpoints), num_blocks=512, max_num_batched_tokens=2048)
    assert result.violations == []
    hits = {r.request_id: r.num_cached_tokens for r in result.requests}
    assert hits == {"A": 0, "B": expected}


# --- per-request dominance over vLLM's rule on sequential traffic -------------------------------

@st.composite
def conversations(draw):
    """Sequential chat: each request a fresh prompt (after one of two system prompts) or a next
    turn re-sending an earlier prompt cut anywhere near its end (its tail re-rendered) and more."""
    system = [tuple(range(10_000 * (k + 1), 10_000 * (k + 1) + draw(st.integers(1, 40)))) for k in range(2)]
    prompts, trace = [], []
    for i in range(draw(st.integers(2, 7))):
        fresh = tuple(range(100_000 * (i + 1), 100_000 * (i + 1) + draw(st.integers(1, 60))))
        if prompts and draw(st.booleans()):
            earlier = draw(st.sampled_from(prompts))
            prompt = earlier[:max(1, len(earlier) - draw(st.integers(0, 24)))] + fresh
        else:
            prompt = draw(st.sampled_from(system)) + fresh
        prompts.append(prompt)
        trace.append(TraceRequest(f"r{i}", prompt, (1, 2), arrival=1 + 1000 * i))
    return trace


@settings(max_examples=60, **REACH_SETTINGS)
@given(conversations(), st.sampled_from([1, 2]), st.sampled_from([(4, 8, 4), (8, 8, 4), (4, 16, 2)]),
       st.sampled_from([0, None]), st.sampled_from([16, 64, 2048]))
def test_on_sequential_traffic_the_ladder_never_costs_a_request_hits(reach, trace, dcp, blocks, retention, budget):
    """No request caches fewer tokens under ``reuse`` than under vLLM's rule (sequential requests,
    a pool that never evicts), except in one named class, *earlier longer hit*: an earlier request
    resumed further under ``reuse`` (at a rung), so it did not recompute the prefix whose chunk
    ends left, under vLLM's rule, the state this request resumes from (found by Hypothesis: a
    junction state made by a sibling that, under ``reuse``, hit past the junction)."""
    reach.minimums = {"more": 15}
    fa, mamba, h = blocks
    hits = {}
    for policy in CHECKPOINT_POLICIES:
        lay = resolve_layout(LayoutConfig((CacheGroup(FA, fa), CacheGroup(MAMBA, mamba)), dcp=dcp, max_model_len=4096,
                                          hash_block_size=h, retention_interval=retention, checkpoints=policy))
        result = replay(trace, lay, num_blocks=4096, max_num_batched_tokens=budget)
        assert result.violations == [] and result.evictions == 0
        hits[policy] = {r.request_id: r.num_cached_tokens for r in result.requests}
    order = [r.id for r in trace]
    for i, rid in enumerate(order):
        if hits["reuse"][rid] < hits["vllm"][rid]:
            assert any(hits["reuse"][e] > hits["vllm"][e] for e in order[:i]), (rid, hits)
            reach("earlier longer hit")
    if sum(hits["reuse"].values()) > sum(hits["vllm"].values()):
        reach("more")
