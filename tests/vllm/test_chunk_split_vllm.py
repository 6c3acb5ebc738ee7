"""kvproof's chunk-split rule against vLLM 0.33.0's own ``Scheduler._mamba_block_aligned_split``,
called unbound on a stand-in scheduler that carries only the attributes it reads: on every
generated input the two end the chunk at the same position (or both make the request wait)."""

from __future__ import annotations

import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.vllm
sched_mod = pytest.importorskip("vllm.v1.core.sched.scheduler")

from kvproof.impl.chunk_split import ChunkSplitter  # noqa: E402
from kvproof.spec.chunk_split import SplitRule, chunk_end  # noqa: E402

from ..conftest import REACH_SETTINGS  # noqa: E402

vllm_split = sched_mod.Scheduler._mamba_block_aligned_split


def vllm_end(rule: SplitRule, scheduler_block: int, start: int, num_new: int, num_tokens: int, num_prompt: int,
             junction: int, threshold: int, budget: int) -> int:
    stand_in = types.SimpleNamespace(
        cache_config=types.SimpleNamespace(block_size=rule.mamba_block_size),
        hash_block_size=rule.hash_block_size,
        block_size=scheduler_block,
        mamba_partial_cache_hit=rule.partial_tail,
        mamba_shared_prefix_checkpoint=rule.shared_prefix_checkpoint and rule.partial_tail,
        use_eagle_block_drop=rule.eagle_drop,
        num_hash_lookahead_tokens=rule.lookahead,
        mamba_has_prefill_checkpoint_blocks=False,
        mamba_prefill_checkpoint_alignment=None,
        max_num_scheduled_tokens=budget,
        scheduler_config=types.SimpleNamespace(long_prefill_token_threshold=threshold),
    )
    request = types.SimpleNamespace(
        num_computed_tokens=start, num_prompt_tokens=num_prompt, num_tokens=num_tokens,
        shared_prefix_boundary=junction,
    )
    return start + vllm_split(stand_in, request, num_new)


@st.composite
def split_cases(draw):
    mamba = draw(st.sampled_from([1, 2, 4, 8, 16, 64]))
    h = draw(st.sampled_from([d for d in (1, 2, 4, 8, 16, 64) if mamba % d == 0]))
    scheduler_block = mamba * draw(st.sampled_from([1, 2, 4]))
    budget = draw(st.sampled_from([1, 3, 8, 16, 24, 64, 256]))
    threshold = draw(st.sampled_from([0, 0, 5, 16]))
    num_prompt = draw(st.integers(1, 300))
    num_tokens = num_prompt + draw(st.integers(0, 4))
    # Starts cluster at block and hash boundaries (and just past them): the interesting cases.
    start = draw(st.one_of(st.integers(0, num_tokens - 1),
                           st.integers(0, num_tokens // mamba).map(lambda k: k * mamba),
                           st.integers(0, num_tokens // h).map(lambda k: k * h + draw(st.integers(0, 1)))))
    start = min(start, num_tokens - 1)
    # What is left of the step's budget after requests scheduled before this one.
    leftover = draw(st.one_of(st.just(budget), st.integers(1, budget)))
    num_new = min(num_tokens - start, leftover, threshold if threshold else budget)
    junction = draw(st.one_of(st.just(0), st.integers(0, num_tokens - 1),
                              st.integers(0, num_tokens // h).map(lambda k: k * h),
                              st.integers(1, num_new).map(lambda k: start + k)))  # inside the chunk
    spc = draw(st.booleans())
    partial = h < scheduler_block and draw(st.booleans())
    rule = SplitRule(
        mamba_block_size=mamba, hash_block_size=h,
        max_prefill_tokens=min(budget, threshold) if threshold else budget,
        partial_tail=partial, eagle_drop=draw(st.booleans()), lookahead=draw(st.sampled_from([0, 0, 1, 3])),
        shared_prefix_checkpoint=spc and partial,
    )
    return rule, scheduler_block, start, num_new, num_tokens, num_prompt, junction, threshold, budget


@settings(max_examples=1500, **REACH_SETTINGS)
@given(split_cases())
def test_kvproof_ends_every_chunk_where_vllm_does(reach, case):
    reach.minimums = {"waits": 30, "junction stop": 60, "tail stop": 60, "stops early": 200}
    rule, s, start, num_new, num_tokens, num_prompt, junction, threshold, budget = case
    theirs = vllm_end(rule, s, start, num_new, num_tokens, num_prompt, junction, threshold, budget)
    junctions = (junction,) if junction else ()
    ours = chunk_end(rule, start, num_new, num_tokens, num_prompt, junctions)
    fast = ChunkSplitter(rule).end(start, num_new, num_tokens, num_prompt, junctions)
    reach(
        "waits" if ours == start
        else "junction stop" if ours != chunk_end(rule, start, num_new, num_tokens, num_prompt, ())
        else "tail stop" if rule.partial_tail and ours % rule.mamba_block_size and ours < num_prompt
        else "stops early" if ours < start + num_new
        else "whole chunk"
    )
    assert ours == fast == theirs
