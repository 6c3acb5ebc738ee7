"""Junctions with EAGLE, and when ``shared_prefix_checkpoint`` is in effect (both as in vLLM
0.33.0; the differential cases are in tests/vllm/test_hit_parity.py)."""

from __future__ import annotations

import pytest

from kvproof.impl.kv_cache_manager import KVCacheManager
from kvproof.impl.request import Request
from kvproof.impl.scheduler import Scheduler
from kvproof.sim.drive import drain, run_chunk
from kvproof.sim.replay import replay
from kvproof.sim.trace import TraceRequest
from kvproof.spec.groups import CacheGroup, GroupKind
from kvproof.spec.layout import LayoutConfig, resolve_layout

FA, MAMBA = GroupKind.FULL_ATTENTION, GroupKind.MAMBA
BASE = tuple(range(1000, 1064))


def layout(exact=True, h=2, fa=8, mamba=8, dcp=2, retention=0):
    return resolve_layout(LayoutConfig((CacheGroup(FA, fa), CacheGroup(MAMBA, mamba)), dcp=dcp, max_model_len=4096,
                                       hash_block_size=h, retention_interval=retention, shared_prefix_checkpoint=exact))


def _computed(kv: KVCacheManager, rid: str, prompt) -> None:
    """Mutates. ``prompt`` computed in one step and cached."""
    r = Request(rid, list(prompt), kv.layout.hash_block_size)
    assert run_chunk(kv, r, r.num_tokens).blocks is not None


@pytest.mark.parametrize("eagle, junctions", [(False, (32,)), (True, (30, 32))])
def test_the_eagle_junction_is_the_block_end_below_the_coverage_minus_one_unit(eagle, junctions):
    """FA 8 at DCP 2 (16-token blocks), H 2. A 36-token prompt is cached (states at its end
    only); a 34-token prefix of it: attention covers 34 tokens, no state below. Without EAGLE
    the hit could reach 32 (33 is not a hash boundary), a block end: one junction. With EAGLE
    the hit is one hash unit below the coverage (32), and a lookup whose attention keys end at
    the block end 32 -- vLLM's, and kvproof's with chunk-end keys -- lands at 30: that is the
    junction a sibling's state must be kept at (it was 16, the block end below 32 - 2)."""
    lay = layout()
    kv = KVCacheManager(lay, 512, use_eagle=eagle)
    _computed(kv, "a", BASE[:35] + (7,))
    hit = kv.lookup(Request("b", list(BASE[:34]), lay.hash_block_size))
    assert hit.num_tokens == 0
    assert hit.junctions == junctions


@pytest.mark.parametrize("option, eagle, exact_in_effect", [(True, False, False), (True, True, True), (False, True, False)])
def test_shared_prefix_checkpoint_needs_eagle(option, eagle, exact_in_effect):
    """``shared_prefix_checkpoint`` stops a chunk exactly at a junction only when it is asked
    for, with EAGLE and partial hits (vLLM 0.33.0 narrows the option the same way); asked for
    without EAGLE the junction stop is block-floored. B shares 13 tokens with A (Mamba 8, H 1):
    junction 13, floored 8."""
    lay = layout(exact=option, h=1, fa=2, mamba=8, dcp=1, retention=None)
    kv = KVCacheManager(lay, 512, use_eagle=eagle)
    assert kv.coordinator.exact_junction is exact_in_effect
    sched = Scheduler(kv, max_num_batched_tokens=2048)
    ends = []
    for t in (TraceRequest("a", BASE[:20], (1,), arrival=1), TraceRequest("b", BASE[:13] + (5, 6, 7, 8, 9), (1,), arrival=1)):
        r = Request(t.id, t.prompt, lay.hash_block_size, arrival=sched.step + 1, expected_outputs=t.output)
        sched.add_request(r)
        drain(sched, on_plan=lambda plan: ends.extend((c.request.request_id, c.start + c.num_tokens) for c in plan.chunks))
    b_ends = [e for rid, e in ends if rid == "b"]
    junction = 13 - (1 if eagle else 0)  # with EAGLE the hit (and junction) is one unit below the coverage
    assert (junction in b_ends) is exact_in_effect
    if option:
        assert (8 in b_ends) is not exact_in_effect


def test_replay_with_eagle_resumes_a_prefix_at_the_junction_state():
    """The differential's EAGLE_JUNCTION case through kvproof alone: the third prefix hits 30."""
    lay = layout()
    trace = [TraceRequest("r0", BASE[:35] + (7,), (), arrival=1), TraceRequest("r1", BASE[:34], (), arrival=20),
             TraceRequest("r2", BASE[:32], (), arrival=40)]
    result = replay(trace, lay, num_blocks=512, max_num_batched_tokens=16, use_eagle=True)
    assert result.violations == []
    assert [r.num_cached_tokens for r in result.requests] == [0, 16, 30]
