"""A request whose prefix another request computes in the same step waits one step and takes
that prefix from the cache (keys appear only after the forward pass; vLLM 0.33.0 defers a
same-step Mamba hit the same way). Found by the overlapping-arrivals differential against vLLM
(docs/coordinator.md, "Hit parity with vLLM 0.33.0")."""

from __future__ import annotations

import pytest

from kvproof.impl.kv_cache_manager import KVCacheManager
from kvproof.impl.request import Request
from kvproof.impl.scheduler import Scheduler
from kvproof.oracle.content_oracle import ContentOracle
from kvproof.sim.drive import drain
from kvproof.spec.groups import CacheGroup, GroupKind
from kvproof.spec.layout import LayoutConfig, resolve_layout

FA, MAMBA = GroupKind.FULL_ATTENTION, GroupKind.MAMBA
SHARED = list(range(100, 124))  # 24 tokens: three 8-token blocks


def run(prompts, arrivals, groups=((FA, 8), (MAMBA, 8)), retention=0, budget=64, threshold=0):
    """Replay ``prompts`` (one output token each) with the content oracle; returns the requests
    (their ``num_cached_tokens``), the step each was first scheduled in, and the scheduler."""
    layout = resolve_layout(LayoutConfig(tuple(CacheGroup(k, b) for k, b in groups), max_model_len=256,
                                         retention_interval=retention))
    sched = Scheduler(KVCacheManager(layout, 128), max_num_batched_tokens=budget, long_prefill_token_threshold=threshold)
    oracle = ContentOracle(layout)
    requests = [Request(f"r{i}", p, layout.hash_block_size, arrival=a, expected_outputs=(1,))
                for i, (p, a) in enumerate(zip(prompts, arrivals))]
    for r in requests:
        sched.add_request(r)
    first: dict[str, int] = {}

    def note_first(plan):
        for c in plan.chunks:
            first.setdefault(c.request.request_id, plan.step)

    drain(sched, oracle, note_first)
    assert oracle.violations == []
    return requests, first, sched


@pytest.mark.parametrize("groups", [((FA, 8), (MAMBA, 8)), ((FA, 8),)], ids=["hybrid", "attention-only"])
def test_a_sibling_arriving_with_its_producer_waits_one_step_and_hits(groups):
    """r0 computes SHARED + 1 token (hybrid: in a chunk that stops at its tail checkpoint 24,
    kept by retention 0; attention only: in one chunk whose full blocks are keyed); r1 (SHARED +
    3 tokens) arrives in the same step: it waits, then hits 24."""
    (r0, r1), first, sched = run([SHARED + [1], SHARED + [2, 3, 4]], [1, 1], groups)
    assert first == {"r0": 1, "r1": 2}
    assert r1.num_cached_tokens == 24 and sched.num_producer_waits == 1


def test_a_sibling_diverging_inside_the_producers_chunk_waits_for_what_it_shares():
    """Attention only: r0 keys blocks 8, 16, 24 in its chunk; r1 shares 16 of them."""
    (r0, r1), first, sched = run([SHARED + [1], SHARED[:16] + [7] * 5], [1, 1], ((FA, 8),))
    assert first == {"r0": 1, "r1": 2} and r1.num_cached_tokens == 16


def test_no_wait_when_the_step_keys_nothing_the_waiting_request_shares():
    """r0's chunk ends at 25, which no group keys (not on the 8-token grid), and r1 shares only
    20 tokens: r1 is admitted at once, in the same step."""
    (r0, r1), first, sched = run([SHARED + [1, 9, 9, 9], SHARED[:20] + [7] * 8], [1, 1], budget=64)
    assert first == {"r0": 1, "r1": 1}
    assert sched.num_producer_waits == 0 and r1.num_cached_tokens == 0


def test_the_wait_ends_with_the_producers_prefill():
    """A long shared prefix computed in several chunks: the sibling waits while each step keys
    more of what it shares (attention only: every chunk end is keyed), then is admitted and hits
    the whole shared part."""
    long_shared = list(range(1000, 1096))  # 96 tokens, 16-token chunks
    (r0, r1), first, sched = run([long_shared + [1], long_shared + [2, 3]], [1, 1], ((FA, 8),), budget=24, threshold=16)
    assert r1.num_cached_tokens == 96
    assert sched.num_producer_waits == first["r1"] - first["r0"] > 1
