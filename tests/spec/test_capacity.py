"""spec/capacity.py: the fewest blocks a lone request holds, checked against the managers.

The rule refuses a pool up front, so it must never exceed what the scheduler really needs
(else a request that fits would be refused): a pool one block short of it must fail in the
real replay too, and the real peak must reach it."""

from __future__ import annotations


import icontract
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproof.impl.scheduler import CapacityError
from kvproof.sim.replay import replay
from kvproof.sim.trace import TraceRequest
from kvproof.spec.arith import cdiv
from kvproof.spec.capacity import blocks_alone, check_fits_alone
from kvproof.spec.contracts import guard_like
from kvproof.spec.groups import CacheGroup, GroupKind
from kvproof.spec.layout import LayoutConfig, resolve_layout

from ..conftest import REACH_SETTINGS

FA, MLA, SW, MAMBA = GroupKind.FULL_ATTENTION, GroupKind.MLA, GroupKind.SLIDING_WINDOW, GroupKind.MAMBA


def layout(*groups: CacheGroup, dcp: int = 1, max_model_len: int = 4096):
    return resolve_layout(LayoutConfig(groups=groups, dcp=dcp, max_model_len=max_model_len))


def test_worked_examples():
    # Attention 4 (virtual block 8 at DCP 2) + Mamba 8: 48 tokens hold 6 attention blocks and
    # one state block.
    assert blocks_alone(layout(CacheGroup(FA, 4), CacheGroup(MAMBA, 8), dcp=2), 48) == (6, 1)
    # A window of 8 tokens over blocks of 4: at 20 tokens, blocks 3 and 4 (positions 12-19).
    assert blocks_alone(layout(CacheGroup(SW, 4, sliding_window=8), CacheGroup(MAMBA, 4)), 20) == (2, 1)
    # Speculative blocks sit beside the state, in every Mamba mode.
    assert blocks_alone(layout(CacheGroup(FA, 16), CacheGroup(MAMBA, 16, num_speculative_blocks=3)), 1) == (1, 4)


def test_a_request_shorter_than_its_window_holds_every_block_of_it():
    # Window 8 over blocks of 4: 7 tokens sit in blocks 0 and 1, and the window still reads both.
    assert blocks_alone(layout(CacheGroup(SW, 4, sliding_window=8)), 7) == (2,)
    # Blocks of one token: exactly the tokens, up to the window.
    assert [blocks_alone(layout(CacheGroup(SW, 1, sliding_window=3)), n) for n in (2, 3, 4)] == [(2,), (3,), (3,)]


def test_capacity_contract_fires_on_a_rule_that_overcounts_or_drops_window_blocks():
    """INV-CAPACITY-ALONE is exact where it must be: an extra attention block would refuse a pool
    that fits, and a window needs its last min(n, window) tokens, no more blocks than n has."""
    fa = layout(CacheGroup(FA, 16))
    with pytest.raises(icontract.ViolationError, match="INV-CAPACITY-ALONE"):
        guard_like(blocks_alone, lambda layout, num_tokens: (cdiv(num_tokens, 16) + 1,))(fa, 32)
    sw = layout(CacheGroup(SW, 4, sliding_window=8))
    with pytest.raises(icontract.ViolationError, match="INV-CAPACITY-ALONE"):
        guard_like(blocks_alone, lambda layout, num_tokens: (1,))(sw, 20)  # 8 tokens need 2 blocks
    with pytest.raises(icontract.ViolationError, match="INV-CAPACITY-ALONE"):
        guard_like(blocks_alone, lambda layout, num_tokens: (3,))(sw, 7)  # 7 tokens fill only 2 blocks


def test_check_names_the_request_the_need_and_the_pool():
    lay = layout(CacheGroup(FA, 16), CacheGroup(MAMBA, 16))
    check_fits_alone(lay, 4, "ok", 32)  # 2 + 1 blocks: exactly the 3 usable ones
    with pytest.raises(ValueError) as caught:
        check_fits_alone(lay, 4, "big", 49)
    assert str(caught.value) == (
        "request 'big' (49 tokens) needs at least 5 blocks even with the pool to itself (group 0 full_attention:16: 4, "
        "group 1 mamba:16: 1), but num_blocks 4 leaves 3 (block 0 is the null block); expected num_blocks >= 6"
    )


@pytest.mark.parametrize("bad", [0, True, 1.5])
def test_bad_token_count_is_a_value_error(bad):
    with pytest.raises(ValueError, match=f"num_tokens {bad!r} must be a positive integer"):
        blocks_alone(layout(CacheGroup(FA, 16)), bad)


def test_a_request_one_block_over_the_usable_pool_is_refused():
    lay = layout(CacheGroup(FA, 16), CacheGroup(MAMBA, 16))
    with pytest.raises(ValueError, match="needs at least 4 blocks"):
        check_fits_alone(lay, 4, "one over", 33)  # 3 + 1 blocks, 3 usable


def test_capacity_contract_fires_on_a_rule_that_undercounts():
    """INV-CAPACITY-ALONE has teeth: floor instead of ceiling leaves the last tokens blockless."""
    lay = layout(CacheGroup(FA, 16), CacheGroup(MAMBA, 16))
    floor_rule = guard_like(blocks_alone, lambda layout, num_tokens: (num_tokens // 16, 1))
    assert floor_rule(lay, 32) == (2, 1)
    with pytest.raises(icontract.ViolationError, match="INV-CAPACITY-ALONE"):
        floor_rule(lay, 33)
    no_speculative = guard_like(blocks_alone, lambda layout, num_tokens: (1, 1))
    spec_layout = layout(CacheGroup(FA, 16), CacheGroup(MAMBA, 16, num_speculative_blocks=2))
    with pytest.raises(icontract.ViolationError, match="INV-CAPACITY-ALONE"):
        no_speculative(spec_layout, 10)


# --- against the implementation -------------------------------------------------------------------

_GROUP_SETS = [
    (CacheGroup(FA, 4), CacheGroup(MAMBA, 8)),
    (CacheGroup(MLA, 8), CacheGroup(MAMBA, 8, num_speculative_blocks=2)),
    (CacheGroup(FA, 4), CacheGroup(SW, 4, dcp_sharded=False, sliding_window=8), CacheGroup(MAMBA, 4)),
    (CacheGroup(FA, 2), CacheGroup(FA, 8)),
]


def _lone_run(lay, prompt_len: int, outputs: int, budget: int, num_blocks: int):
    """Replay one request; returns (its peak real blocks per group, peak total)."""
    request = TraceRequest("r", tuple(range(100, 100 + prompt_len)), tuple(range(outputs)))
    peaks = [0] * len(lay.groups)
    total = [0]

    def on_step(plan, sched):
        (req,) = [r for r in sched.running if r.request_id == "r"] or [None]
        if req is None:
            return
        held = [len({b for b in row if b != 0}) for row in sched.kv.block_table(req)]
        for g, n in enumerate(held):
            peaks[g] = max(peaks[g], n)
        total[0] = max(total[0], sum(held))

    replay([request], lay, num_blocks, budget, oracle=False, on_step=on_step)
    return peaks, total[0], request.num_computed_tokens


@settings(max_examples=120, **REACH_SETTINGS)
@given(
    groups=st.sampled_from(_GROUP_SETS),
    dcp=st.sampled_from([1, 2]),
    prompt_len=st.integers(1, 40),
    outputs=st.integers(0, 6),
    budget=st.sampled_from([1, 3, 8, 64]),
)
def test_the_rule_is_what_a_lone_request_holds_and_a_pool_below_it_fails(reach, groups, dcp, prompt_len, outputs, budget):
    reach.minimums = {"window dropped blocks": 5, "speculative blocks": 5, "chunked prefill": 5, "rule is tight": 5}
    lay = layout(*groups, dcp=dcp, max_model_len=256)
    peaks, total, n = _lone_run(lay, prompt_len, outputs, budget, num_blocks=200)
    rule = blocks_alone(lay, n)
    # A lower bound on what the managers really hold, group by group and in all.
    assert all(p >= r for p, r in zip(peaks, rule)), (peaks, rule)
    assert total >= sum(rule)
    # Attention holds exactly every block of its tokens.
    for g, (p, r) in enumerate(zip(peaks, rule)):
        if groups[g].kind in (FA, MLA):
            assert p == r, (g, p, r)
    # One block short of the rule: the real scheduler cannot run it either.
    with pytest.raises(CapacityError):
        replay([TraceRequest("r", tuple(range(100, 100 + prompt_len)), tuple(range(outputs)))],
               lay, sum(rule), budget, oracle=False)
    for g, r in zip(groups, rule):
        if g.kind is SW and n > (g.sliding_window or 1):
            reach("window dropped blocks")
        if g.kind is MAMBA and g.num_speculative_blocks:
            reach("speculative blocks")
    if budget < prompt_len:
        reach("chunked prefill")
    if total == sum(rule):
        reach("rule is tight")
