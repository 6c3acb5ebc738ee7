"""The Mamba chunk-split rule: vLLM's scheduler-split scenarios (reference 9.1) and
properties."""

from __future__ import annotations

import icontract
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvproof.spec.chunk_split import checkpoint_position, mamba_chunk_end, split_checkpoints
from kvproof.spec.contracts import guard_like


def chunks(start, num_tokens, num_prompt, bsm, h, budget, partial, eagle=False):
    out = []
    while start < num_tokens:
        end = mamba_chunk_end(start, budget, num_tokens, num_prompt, bsm, h, partial, eagle)
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
    assert mamba_chunk_end(23_040, 8192, prompt, prompt, 1536, 128, True, eagle) - 23_040 == expected


def test_checkpoint_positions():
    assert checkpoint_position(10_000, 32, False) == 9984
    assert checkpoint_position(24_576, 128, True) == 24_448
    assert checkpoint_position(257, 256, False) == 256
    assert checkpoint_position(1, 16, False) == 0


@st.composite
def split_inputs(draw):
    bsm = draw(st.sampled_from([1, 2, 4, 16, 64, 512]))
    h = draw(st.sampled_from([d for d in (1, 2, 4, 8, 16, 32, 64, 512) if bsm % d == 0]))
    num_prompt = draw(st.integers(1, 3000))
    num_tokens = num_prompt + draw(st.integers(0, 50))
    start = draw(st.integers(0, num_tokens - 1))
    return start, draw(st.integers(1, 2048)), num_tokens, num_prompt, bsm, h, draw(st.booleans()), draw(st.booleans())


@given(split_inputs())
def test_chunks_progress_and_never_cross_a_checkpoint(args):
    start, budget, num_tokens, num_prompt, bsm, h, partial, eagle = args
    end = mamba_chunk_end(start, budget, num_tokens, num_prompt, bsm, h, partial, eagle)
    assert start < end <= min(start + budget, num_tokens)
    for stop in split_checkpoints(start, num_tokens, num_prompt, bsm, h, partial, eagle):
        assert not start < stop < end
    if end < num_tokens and end not in split_checkpoints(start, num_tokens, num_prompt, bsm, h, partial, eagle):
        assert end % bsm == 0 or bsm > budget


def test_contract_fires_on_a_chunk_that_runs_past_a_checkpoint():
    greedy = guard_like(
        mamba_chunk_end,
        lambda start, budget, num_tokens, num_prompt_tokens, mamba_block_size, hash_block_size, partial_tail,
        eagle_drop=False, lookahead=0: min(start + budget, num_tokens),
    )
    with pytest.raises(icontract.ViolationError, match="INV-SPLIT-PROGRESS-AND-STOPS"):
        greedy(8192, 8192, 10_000, 10_000, 512, 32, True)
    with pytest.raises(icontract.ViolationError, match="INV-SPLIT-CKPT"):
        guard_like(checkpoint_position, lambda num_tokens, unit, eagle_drop, lookahead=0: num_tokens)(64, 16, False)


def test_bad_start_is_named():
    with pytest.raises(ValueError, match=r"chunk start 10 must lie in \[0, 10\)"):
        mamba_chunk_end(10, 5, 10, 10, 4, 2, True)


@given(split_inputs(), st.integers(0, 3))
def test_hot_path_rule_matches_the_spec(args, lookahead):
    from kvproof.impl.chunk_split import chunk_end

    start, budget, num_tokens, num_prompt, bsm, h, partial, eagle = args
    assert chunk_end(start, budget, num_tokens, num_prompt, bsm, h, partial, eagle, lookahead) == mamba_chunk_end(
        start, budget, num_tokens, num_prompt, bsm, h, partial, eagle, lookahead
    )
