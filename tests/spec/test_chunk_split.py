"""The Mamba chunk-split rule: vLLM's scheduler-split scenarios (docs/vllm-semantics.md §9.1), the
shared-prefix junction stop (docs/vllm-semantics.md §5.4), properties, and contracts that fire."""

from __future__ import annotations

import dataclasses

import icontract
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproof.impl.chunk_split import ChunkSplitter
from kvproof.spec.chunk_split import SplitRule, checkpoint_position, chunk_end, stops
from kvproof.spec.contracts import guard_like

from ..conftest import REACH_SETTINGS


def chunks(start, num_tokens, num_prompt, bsm, h, budget, partial, eagle=False, junctions=(), exact=False):
    rule = SplitRule(bsm, h, budget, partial_tail=partial, eagle_drop=eagle, shared_prefix_checkpoint=exact)
    out = []
    while start < num_tokens:
        end = chunk_end(rule, start, min(budget, num_tokens - start), num_tokens, num_prompt, junctions)
        out.append(end - start)
        start = end
    return out


def test_partial_tail_schedule():
    assert chunks(0, 10_000, 10_000, 512, 32, 8192, partial=True) == [8192, 1536, 256, 16]


def test_partial_hits_off_skips_the_tail_checkpoint():
    assert chunks(9728, 10_000, 10_000, 512, 32, 8192, partial=False) == [272]


def test_block_larger_than_budget():
    assert chunks(0, 30_000, 30_000, 11_392, 11_392, 8192, partial=False) == [8192, 3200, 8192, 3200, 7216]


def test_block_larger_than_long_prefill_threshold():
    assert chunks(0, 1300, 1300, 512, 512, 384, partial=False) == [384, 128, 384, 128, 276]


@pytest.mark.parametrize("prompt, eagle, expected", [(24_576, True, 1408), (24_577, True, 1408), (24_577, False, 1536)])
def test_eagle_stops_below_proof_boundary(prompt, eagle, expected):
    rule = SplitRule(1536, 128, 8192, partial_tail=True, eagle_drop=eagle)
    assert chunk_end(rule, 23_040, 8192 if prompt - 23_040 > 8192 else prompt - 23_040, prompt, prompt) - 23_040 == expected


def test_issue_junction_example_stops_at_the_block_below_the_junction():
    """docs/coordinator.md's junction example: B (135 tokens) shares 122 with A; attention reaches
    120 (H 4) but no Mamba state does: the first chunk ends at the last Mamba block boundary below
    the junction (or exactly at it with ``shared_prefix_checkpoint``), so a sibling C sharing 122
    finds a state there."""
    assert chunks(0, 135, 135, 8, 4, 2048, partial=True, junctions=(120,)) == [120, 8, 4, 3]
    assert chunks(0, 135, 135, 8, 4, 2048, partial=True, junctions=(122,)) == [120, 8, 4, 3]
    assert chunks(0, 135, 135, 8, 4, 2048, partial=True, junctions=(122,), exact=True) == [122, 6, 4, 3]


def test_junction_stop_is_block_floored_from_the_start():
    # From a partial hit at 4 the first chunk stops at the end of the start's block (8); from
    # there the junction at 21 floors to 8 + 8 = 16 (whole Mamba blocks from the start).
    assert chunks(4, 40, 40, 8, 4, 64, partial=False, junctions=(21,)) == [4, 8, 16, 8]
    # Had the chunk started at 4 and reached 21, vLLM's floor is 4 + 16 = 20, not a block end.
    rule = SplitRule(8, 4, 64)
    assert stops(rule, 4, 40, 40, 40, (21,)) == (8, 20, 32)


def test_a_request_waits_when_no_aligned_end_is_within_the_leftover_budget():
    rule = SplitRule(16, 16, 2048)
    assert chunk_end(rule, 0, 10, 100, 100) == 0  # 10 tokens left this step, the block needs 16
    assert chunk_end(rule, 0, 100, 100, 100) == 96


def test_checkpoint_positions():
    assert checkpoint_position(10_000, 32, False) == 9984
    assert checkpoint_position(24_576, 128, True) == 24_448
    assert checkpoint_position(257, 256, False) == 256
    assert checkpoint_position(1, 16, False) == 0
    assert checkpoint_position(20, 4, False, lookahead=3) == 16


@st.composite
def split_inputs(draw):
    bsm = draw(st.sampled_from([1, 2, 4, 16, 64, 512]))
    h = draw(st.sampled_from([d for d in (1, 2, 4, 8, 16, 32, 64, 512) if bsm % d == 0]))
    num_prompt = draw(st.integers(1, 3000))
    num_tokens = num_prompt + draw(st.integers(0, 50))
    start = draw(st.integers(0, num_tokens - 1))
    max_prefill = draw(st.sampled_from([1, 7, 64, 512, 2048]))
    num_new = min(num_tokens - start, draw(st.integers(1, max_prefill)))
    junctions = tuple(sorted(draw(st.sets(st.integers(0, num_tokens - 1), max_size=2))))
    # Replay stops (sparse retention): S a multiple of the Mamba block, A either H or S.
    s = bsm * draw(st.sampled_from([1, 2, 8]))
    replay = draw(st.sampled_from([(0, 0), (s, h), (s, s)]))
    rule = SplitRule(bsm, h, max_prefill, partial_tail=draw(st.booleans()), eagle_drop=draw(st.booleans()),
                     lookahead=draw(st.sampled_from([0, 0, 1, 3])), shared_prefix_checkpoint=draw(st.booleans()),
                     scheduler_block_size=replay[0], replay_alignment=replay[1])
    return rule, start, num_new, num_tokens, num_prompt, junctions


@settings(max_examples=1500, **REACH_SETTINGS)
@given(split_inputs())
def test_hot_path_rule_matches_the_spec(reach, args):
    reach.minimums = {"waits": 30, "stops": 30, "whole": 30, "replay stop": 10}
    rule, start, num_new, num_tokens, num_prompt, junctions = args
    ours = chunk_end(rule, start, num_new, num_tokens, num_prompt, junctions)
    reach("waits" if ours == start else "stops" if ours < start + num_new else "whole")
    if rule.replay_alignment:
        with_replay = stops(rule, start, start + num_new + 1, num_tokens, num_prompt, junctions)
        without = stops(dataclasses.replace(rule, scheduler_block_size=0, replay_alignment=0), start,
                        start + num_new + 1, num_tokens, num_prompt, junctions)
        if ours in set(with_replay) - set(without):
            reach("replay stop")
    assert ChunkSplitter(rule).end(start, num_new, num_tokens, num_prompt, junctions) == ours


@given(split_inputs())
def test_a_chunk_ends_at_its_first_stop_or_its_aligned_target(args):
    rule, start, num_new, num_tokens, num_prompt, junctions = args
    end = chunk_end(rule, start, num_new, num_tokens, num_prompt, junctions)
    assert start <= end <= start + num_new
    if end > start and end < max(num_prompt, num_tokens - 1):
        inside = stops(rule, start, end + 1, num_tokens, num_prompt, junctions)
        assert end % rule.mamba_block_size == 0 or end in inside or rule.mamba_block_size > rule.max_prefill_tokens


# --- contracts that fire -------------------------------------------------------------------------

def _guarded(body):
    return guard_like(chunk_end, body)


def test_a_chunker_that_always_takes_one_token_is_refused():
    one = _guarded(lambda rule, start, num_new, num_tokens, num_prompt_tokens, junctions=(): start + 1)
    with pytest.raises(icontract.ViolationError, match="INV-SPLIT-ALIGNED"):
        one(SplitRule(16, 16, 2048), 0, 100, 100, 100)


def test_a_greedy_chunker_that_runs_past_a_stop_is_refused():
    greedy = _guarded(lambda rule, start, num_new, num_tokens, num_prompt_tokens, junctions=(): start + num_new)
    with pytest.raises(icontract.ViolationError, match="INV-SPLIT-STOPS"):
        greedy(SplitRule(512, 32, 8192, partial_tail=True), 8192, 1808, 10_000, 10_000)


def test_a_chunker_that_ignores_the_junction_is_refused():
    blind = _guarded(lambda rule, start, num_new, num_tokens, num_prompt_tokens, junctions=(): 128)
    with pytest.raises(icontract.ViolationError, match="INV-SPLIT-STOPS"):
        blind(SplitRule(8, 4, 2048, partial_tail=True), 0, 135, 135, 135, (120,))


def test_a_chunker_that_waits_needlessly_is_refused():
    idle = _guarded(lambda rule, start, num_new, num_tokens, num_prompt_tokens, junctions=(): start)
    with pytest.raises(icontract.ViolationError, match="INV-SPLIT-PROGRESS"):
        idle(SplitRule(16, 16, 2048), 0, 100, 100, 100)


def test_checkpoint_contract_fires():
    with pytest.raises(icontract.ViolationError, match="INV-SPLIT-CKPT"):
        guard_like(checkpoint_position, lambda num_tokens, unit, eagle_drop, lookahead=0: num_tokens)(64, 16, False)


@pytest.mark.parametrize("start, num_new, message", [(10, 1, r"chunk start 10 must lie in \[0, 10\)"),
                                                     (2, 9, r"chunk of 9 tokens from 2 must hold 1 .. 8 tokens"),
                                                     (2, 0, r"chunk of 0 tokens from 2 must hold 1 .. 8 tokens")])
def test_bad_input_is_named(start, num_new, message):
    with pytest.raises(ValueError, match=message):
        chunk_end(SplitRule(4, 2, 16), start, num_new, 10, 10)


def test_bad_rule_is_named():
    with pytest.raises(ValueError, match=r"mamba_block_size 0 must be a positive integer"):
        SplitRule(0, 2, 16)


def test_a_mid_block_start_stops_at_its_own_block_end():
    # A partial hit of 1 token with Mamba blocks of 2: the first chunk ends at 2, not further.
    assert chunk_end(SplitRule(2, 1, 3), 1, 9, 12, 12, (12,)) == 2


def test_a_junction_on_a_block_boundary_is_itself_the_stop():
    assert chunk_end(SplitRule(2, 1, 16), 0, 5, 5, 4, (4,)) == 4
    # A junction inside the first block floors to the start: no stop, the chunk runs to its target.
    rule = SplitRule(2, 1, 16, partial_tail=True, eagle_drop=True)
    assert chunk_end(rule, 0, 7, 11, 9, (1,)) == 6


def test_a_junction_the_chunk_ends_at_anyway_is_no_stop():
    # A resumed request (10 known tokens, prompt 8) with the junction at its target, 10: vLLM
    # stops only at junctions strictly inside the chunk, so the block floor 8 is no stop.
    rule = SplitRule(4, 4, 3, partial_tail=True, eagle_drop=True, shared_prefix_checkpoint=True)
    assert chunk_end(rule, 4, 6, 10, 8, (10,)) == 10


def test_chunks_that_end_at_an_exact_junction_or_the_prefill_end_meet_the_contracts():
    rule = SplitRule(8, 4, 3, partial_tail=True, eagle_drop=True, shared_prefix_checkpoint=True)
    assert chunk_end(rule, 5, 4, 13, 11, (11,)) == 8  # a mid-block start stops at its block end
    assert chunk_end(SplitRule(8, 4, 16, shared_prefix_checkpoint=True), 17, 1, 18, 18, (18,)) == 18


@pytest.mark.parametrize("kwargs, message", [
    ({"mamba_block_size": True}, "mamba_block_size True must be a positive integer"),
    ({"max_prefill_tokens": 16.0}, "max_prefill_tokens 16.0 must be a positive integer"),
    ({"hash_block_size": 0}, "hash_block_size 0 must be a positive integer"),
    ({"lookahead": -1}, "lookahead -1 must be a non-negative integer"),
    ({"lookahead": True}, "lookahead True must be a non-negative integer"),
])
def test_every_bad_rule_field_is_named(kwargs, message):
    args = {"mamba_block_size": 1, "hash_block_size": 1, "max_prefill_tokens": 1} | kwargs
    with pytest.raises(ValueError, match=message):
        SplitRule(**args)
    SplitRule(1, 1, 1, lookahead=0)  # the smallest rule is accepted


@pytest.mark.parametrize("rule, start, num_new, num_tokens, num_prompt, junctions, end", [
    # A resumed request starting mid-block stops at its block end (also its junction).
    (SplitRule(2, 1, 3, lookahead=3), 7, 2, 10, 8, (8,), 8),
    # No block-aligned end and not the prefill end within the tokens: the request waits.
    (SplitRule(8, 4, 16, partial_tail=True, lookahead=3), 0, 4, 7, 5, (5,), 0),
    (SplitRule(8, 4, 16, eagle_drop=True, shared_prefix_checkpoint=True), 2, 5, 10, 10, (3,), 2),
    (SplitRule(4, 2, 16, lookahead=3), 0, 1, 2, 2, (), 0),
    # A Mamba block wider than any chunk: the chunk takes all its tokens.
    (SplitRule(8, 4, 3, partial_tail=True, eagle_drop=True, lookahead=3), 0, 7, 14, 14, (13,), 7),
    # An exact junction inside the chunk is where it ends.
    (SplitRule(4, 4, 3, partial_tail=True, eagle_drop=True, lookahead=3, shared_prefix_checkpoint=True),
     9, 3, 18, 17, (10,), 10),
])
def test_worked_chunk_ends(rule, start, num_new, num_tokens, num_prompt, junctions, end):
    assert chunk_end(rule, start, num_new, num_tokens, num_prompt, junctions) == end


@pytest.mark.parametrize("retention_stops, ends", [(False, [2304, 4352, 6400, 8448, 9984, 10_240]),
                                                   (True, [2304, 4352, 6144, 8192, 9984, 10_240])])
def test_with_eagle_a_chunk_stops_at_the_replay_boundary_retention_keeps(retention_stops, ends):
    """Mooncake-like: MLA 256 at DCP 8 (S = 2048) + Mamba 256, H 256, EAGLE, budget 2048, a
    10,240-token prompt resuming after a 256-token hit (the chunk ends are listed). Its replay
    boundaries are 6,144 and 8,192 (one scheduler block below the prompt's multiples of S): with
    retention 0 the states kept there must exist, but chunks of 2,048 from 256 end at 2,304,
    4,352, ... -- never there. vLLM has those states only when its chunks start on the S grid;
    kvproof stops at them."""
    s = 2048 if retention_stops else 0
    rule = SplitRule(256, 256, 2048, partial_tail=False, eagle_drop=True, scheduler_block_size=s,
                     replay_alignment=256 if retention_stops else 0)
    got, start = [], 256
    while start < 10_240:
        start = chunk_end(rule, start, min(2048, 10_240 - start), 10_240, 10_240)
        got.append(start)
    assert got == ends
    assert ChunkSplitter(rule).end(4352, 2048, 10_240, 10_240) == (6144 if retention_stops else 6400)
