"""kvproof's manager against vLLM 0.33.0's own manager (integrations/vllm/manager_adapter.py) on
scenarios where the two agree by design: the hit lengths (and copies) must be equal.

They do not agree everywhere -- kvproof keys blocks after the forward pass, keeps Mamba states
at every hash-aligned chunk end, and has no same-step Mamba deferral (docs/coordinator.md) -- so
the scenarios here have every producer finish its steps before the consumer arrives, and put
chunk ends only where both managers keep a state.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm")

from kvproof.impl.kv_cache_manager import KVCacheManager  # noqa: E402
from kvproof.impl.request import Request  # noqa: E402
from kvproof.impl.scheduler import Scheduler  # noqa: E402
from kvproof.integrations.vllm.manager_adapter import VllmManagerAdapter  # noqa: E402
from kvproof.sim import drive  # noqa: E402
from kvproof.sim.trace import TraceRequest  # noqa: E402
from kvproof.spec.groups import CacheGroup, GroupKind  # noqa: E402
from kvproof.spec.layout import LayoutConfig, resolve_layout  # noqa: E402

FA, MAMBA = GroupKind.FULL_ATTENTION, GroupKind.MAMBA

MANAGERS = {
    "kvproof": lambda layout, n: KVCacheManager(layout, n),
    "vllm": lambda layout, n: VllmManagerAdapter(layout, n),
}


def layout_for(groups, dcp, hash_block_size=None, max_model_len=4096):
    return resolve_layout(LayoutConfig(tuple(groups), dcp=dcp, max_model_len=max_model_len,
                                       hash_block_size=hash_block_size))


def _req(rid, tokens, layout, outputs=()):
    return Request(rid, tokens, layout.hash_block_size, expected_outputs=outputs)


# --- the step protocol, driven by hand (the same calls for both managers) -------------------------

def run_chunks(kv, req, chunks):
    """Schedule ``req`` alone for each chunk size in turn (lookup on its first chunk)."""
    assert all(run.blocks is not None for run in drive.run_chunks(kv, req, chunks))


def admit(kv, req, n):
    """One step admitting ``req``: look it up, allocate ``n`` tokens after its hit, run."""
    run = drive.run_chunk(kv, req, n)
    assert run.blocks is not None
    return run.hit.num_tokens, len(run.copies)


def k3(kind, dcp):
    """docs/vllm-semantics.md §5.1: FA 256 + Mamba 256; prime 256+1 tokens in chunks [256, 1], then
    a replay of 256+2 tokens hits 256 (under DCP 2 inside the 512-token attention block: one
    copy)."""
    layout = layout_for([CacheGroup(FA, 256), CacheGroup(MAMBA, 256)], dcp)
    kv = MANAGERS[kind](layout, 32)
    shared = list(range(1000, 1256))
    prime = _req("prime", shared + [7], layout)
    run_chunks(kv, prime, [256, 1])
    kv.free(prime)
    return admit(kv, _req("replay", shared + [8, 9], layout), 2)


@pytest.mark.parametrize("dcp", [1, 2])
def test_k3_protocol_hits_256_in_both(dcp):
    ours, theirs = k3("kvproof", dcp), k3("vllm", dcp)
    assert ours == theirs == (256, 1 if dcp == 2 else 0)


def test_adapter_layout_matches_vllm_rule_for_k3():
    """kvproof's derived partial-hit rule and alignment are vLLM's own for K3
    (docs/vllm-semantics.md §1)."""
    for dcp, partial in [(1, False), (2, True)]:
        kv = VllmManagerAdapter(layout_for([CacheGroup(FA, 256), CacheGroup(MAMBA, 256)], dcp), 32)
        assert kv.disagreements == []
        assert kv.coordinator.partial_hash_hits is partial
        assert kv.coordinator.alignment == 256


# --- the same scenarios through kvproof's Scheduler (the benchmark's driver) ----------------------

def schedule_trace(kind, layout, trace, budget, num_blocks=256):
    kv = MANAGERS[kind](layout, num_blocks)
    sched = Scheduler(kv, max_num_batched_tokens=budget)
    for t in trace:
        sched.add_request(Request(t.id, t.prompt, layout.hash_block_size, arrival=t.arrival,
                                  expected_outputs=t.output))
    drive.drain(sched)
    assert len(sched.finished) == len(trace)
    # Everything goes back to the pool, CoW retentions included (block 0 is the null block).
    # kvproof releases a step's retentions when the next step begins; vLLM as soon as the
    # copies are taken.
    kv.begin_step()
    assert kv.pool.num_free == num_blocks - 1
    return {r.request_id: r.num_cached_tokens for r in sched.finished}


@pytest.mark.parametrize("dcp", [1, 2])
def test_k3_through_the_scheduler(dcp):
    """A 256-token budget splits the prime into [256, 1]; the replay arrives after it is done."""
    layout = layout_for([CacheGroup(FA, 256), CacheGroup(MAMBA, 256)], dcp)
    shared = tuple(range(1000, 1256))
    trace = [TraceRequest("prime", shared + (7,), (1, 2), arrival=1),
             TraceRequest("replay", shared + (8, 9), (3,), arrival=10)]
    ours, theirs = (schedule_trace(k, layout, trace, budget=256) for k in ("kvproof", "vllm"))
    assert ours == theirs == {"prime": 0, "replay": 256}


@pytest.mark.parametrize("dcp", [1, 2, 4])
def test_shared_prefix_siblings_hit_the_block_aligned_checkpoint(dcp):
    """FA 64 + Mamba 64: the producer's prompt (266 tokens) is split at 256, the last block
    boundary before its end, so both managers hold a state at 256; later siblings sharing the
    first 256 tokens hit exactly 256, and one sharing only 200 tokens hits nothing (no state
    at or below 200 that both managers keep)."""
    layout = layout_for([CacheGroup(FA, 64), CacheGroup(MAMBA, 64)], dcp)
    prefix = tuple(range(5000, 5256))
    trace = [TraceRequest("p", prefix + tuple(range(10)), (1, 2, 3), arrival=1),
             TraceRequest("s1", prefix + tuple(range(100, 140)), (4,), arrival=20),
             TraceRequest("s2", prefix + tuple(range(200, 203)), (5, 6), arrival=30),
             TraceRequest("s3", prefix[:200] + tuple(range(300, 380)), (7,), arrival=40)]
    ours, theirs = (schedule_trace(k, layout, trace, budget=8192) for k in ("kvproof", "vllm"))
    assert ours == theirs == {"p": 0, "s1": 256, "s2": 256, "s3": 0}
