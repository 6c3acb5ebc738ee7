"""The hand-driven vLLM 0.33.0 Scheduler (kvproof.integrations.vllm.engine_harness) on scenarios
whose answers are known from docs/vllm-semantics.md or from vLLM's own
manager driven by kvproof's scheduler (integrations/vllm/manager_adapter.py)."""

from __future__ import annotations

import random

import pytest

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm")

from kvproof.impl.request import Request  # noqa: E402
from kvproof.impl.scheduler import Scheduler  # noqa: E402
from kvproof.integrations.vllm.engine_harness import EngineHarness, HarnessStalled, StepHook  # noqa: E402
from kvproof.integrations.vllm.manager_adapter import VllmManagerAdapter  # noqa: E402
from kvproof.sim.drive import drain  # noqa: E402
from kvproof.sim.replay import replay  # noqa: E402
from kvproof.sim.trace import TraceRequest  # noqa: E402
from kvproof.spec.groups import CacheGroup, GroupKind  # noqa: E402
from kvproof.spec.layout import LayoutConfig, resolve_layout  # noqa: E402

from .traces import conversations  # noqa: E402

FA, MAMBA = GroupKind.FULL_ATTENTION, GroupKind.MAMBA


def layout_for(groups, dcp=1, hash_block_size=None, max_model_len=4096, **options):
    return resolve_layout(LayoutConfig(tuple(groups), dcp=dcp, max_model_len=max_model_len,
                                       hash_block_size=hash_block_size, **options))


def chunk_sizes(result, rid):
    return [n for step in result.steps for r, _, n in step.chunks if r == rid]


# --- known answers (docs/vllm-semantics.md) -------------------------------------------------------

@pytest.mark.parametrize("dcp", [1, 2])
def test_k3_prime_then_replay_hits_256(dcp):
    """docs/vllm-semantics.md §5.1: FA 256 + Mamba 256; a prime of 256+1 tokens (budget 256: chunks
    [256, 1]), then a replay of the same 256 tokens + 2 hits 256 -- under DCP 2 inside the 512-token
    attention block, with one copy-on-write."""
    layout = layout_for([CacheGroup(FA, 256), CacheGroup(MAMBA, 256)], dcp)
    shared = tuple(range(1000, 1256))
    trace = [TraceRequest("prime", shared + (7,), (1, 2), arrival=1),
             TraceRequest("replay", shared + (8, 9), (3,), arrival=10)]
    result = EngineHarness(layout, 32, max_num_batched_tokens=256).run(trace)
    assert result.num_cached_tokens == {"prime": 0, "replay": 256}
    assert chunk_sizes(result, "prime") == [256, 1, 1]
    assert result.copies == (1 if dcp == 2 else 0)
    assert result.disagreements == []
    # docs/replay.md's worked case takes 10 steps with kvproof; vLLM takes as many.
    assert result.num_steps == 10


@pytest.mark.parametrize("dcp", [1, 4])
def test_partial_tail_chunk_schedule(dcp):
    """docs/vllm-semantics.md §9.1 test_mamba_align_split_partial_tail_schedule: block 512, H 32, a
    10,000-token prompt under a budget of 8,192 is scheduled as 8192, 1536, 256, 16 (then one
    decode)."""
    layout = layout_for([CacheGroup(FA, 512), CacheGroup(MAMBA, 512)], dcp, hash_block_size=32, max_model_len=16384)
    result = EngineHarness(layout, 64, max_num_batched_tokens=8192).run(
        [TraceRequest("r", tuple(range(10_000)), (1, 2), arrival=1)])
    assert chunk_sizes(result, "r") == [8192, 1536, 256, 16, 1]


def test_long_prefill_threshold_splits_below_the_block():
    """docs/vllm-semantics.md §9.1 test_mamba_align_split_when_block_exceeds_long_prefill_threshold:
    block 512, threshold 384, prompt 1300 -> [384, 128, 384, 128, 276]. vLLM applies the threshold
    only while another request is eligible, so a long-decoding neighbour runs alongside."""
    layout = layout_for([CacheGroup(FA, 512), CacheGroup(MAMBA, 512)])
    trace = [TraceRequest("long", tuple(range(1300)), (1,), arrival=1),
             TraceRequest("other", (5000,), tuple(range(10)), arrival=1)]
    result = EngineHarness(layout, 64, max_num_batched_tokens=8192, long_prefill_token_threshold=384).run(trace)
    assert chunk_sizes(result, "long") == [384, 128, 384, 128, 276]
    without = EngineHarness(layout, 64, max_num_batched_tokens=8192).run(trace)
    assert chunk_sizes(without, "long") == [1024, 276]


@pytest.mark.parametrize("eagle, chunks, hit", [(True, [4, 5], 4), (False, [8, 1], 8)])
def test_eagle_block_drop(eagle, chunks, hit):
    """docs/vllm-semantics.md §9.1 test_mamba_coarse_checkpoint_retained_below_eagle_proof_boundary:
    H = B = 4, retention 0, EAGLE: [7]*9 is split [4, 5], block 0 is retained, a 13-token request
    hits 4. Without the drop the split is the plain block-aligned one and the hit is 8."""
    layout = layout_for([CacheGroup(FA, 4), CacheGroup(MAMBA, 4)], retention_interval=0)
    trace = [TraceRequest("p", (7,) * 9, (1,), arrival=1), TraceRequest("c", (7,) * 13, (1,), arrival=10)]
    result = EngineHarness(layout, 64, max_num_batched_tokens=8192, use_eagle=eagle).run(trace)
    assert chunk_sizes(result, "p")[:2] == chunks
    assert result.num_cached_tokens["c"] == hit


def test_eagle_under_dcp_rewinds_one_hash_unit():
    """docs/vllm-semantics.md §9.1 test_dcp_partial_hit_with_eagle_rewinds_one_hash_unit: DCP 2, FA
    4, Mamba 4, H 2, EAGLE; the producer [7]*6 is split [4, 2]; a replay of 8 tokens hits 4."""
    layout = layout_for([CacheGroup(FA, 4), CacheGroup(MAMBA, 4)], dcp=2, hash_block_size=2)
    trace = [TraceRequest("p", (7,) * 6, (1,), arrival=1), TraceRequest("c", (7,) * 8, (1,), arrival=10)]
    result = EngineHarness(layout, 64, max_num_batched_tokens=8192, use_eagle=True).run(trace)
    assert chunk_sizes(result, "p")[:2] == [4, 2]
    assert result.num_cached_tokens["c"] == 4


@pytest.mark.parametrize("lookahead, hit", [(0, 32), (1, 16)])
def test_lookahead_hashes_cover_the_next_token(lookahead, hit):
    """docs/vllm-semantics.md §2.2: with L lookahead tokens, a block's hash also covers the L tokens
    after it. A 32-token prompt's second block is hashed together with its first output; a sibling
    that shares the 32 tokens but continues differently then hits only the first block."""
    layout = layout_for([CacheGroup(FA, 16)])
    trace = [TraceRequest("p", tuple(range(32)), (100, 101), arrival=1),
             TraceRequest("s", tuple(range(32)) + (7, 8, 9), (1,), arrival=10)]
    result = EngineHarness(layout, 32, num_hash_lookahead_tokens=lookahead).run(trace)
    assert result.num_cached_tokens == {"p": 0, "s": hit}


def test_shared_prefix_junction_is_checkpointed():
    """docs/coordinator.md's junction example (FA 8 + Mamba 8, H 4, DCP 2): A (159 tokens), then B
    (135, 122 shared): vLLM ends B's first chunk at the block-floored junction 112 and caches the
    Mamba state there; C (143, 122 shared) then hits 112."""
    layout = layout_for([CacheGroup(FA, 8), CacheGroup(MAMBA, 8)], dcp=2, hash_block_size=4)
    rng = random.Random(0)
    shared = tuple(rng.randrange(1000) for _ in range(122))
    tail = lambda n: tuple(rng.randrange(1000) for _ in range(n))  # noqa: E731
    trace = [TraceRequest("A", shared + tail(37), (1, 2), arrival=1),
             TraceRequest("B", shared + tail(13), (3,), arrival=20),
             TraceRequest("C", shared + tail(21), (4,), arrival=40)]
    result = EngineHarness(layout, 200, max_num_batched_tokens=2048).run(trace)
    assert chunk_sizes(result, "B")[0] == 112
    assert result.num_cached_tokens == {"A": 0, "B": 0, "C": 112}


# --- the same answers as vLLM's manager under kvproof's driver ------------------------------------

@pytest.mark.parametrize("dcp", [1, 2, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_hits_equal_the_baseline_adapter_on_attention_only_chats(dcp, seed):
    """With one full-attention group there is no chunk-split rule and no junction, and the
    requests never overlap: vLLM's Scheduler and vLLM's manager under kvproof's driver
    (integrations/vllm/manager_adapter.py) must agree on every request's hit, the steps and the copies.
    Zero-output turns are in the trace (the harness finishes them right after prefill)."""
    layout = layout_for([CacheGroup(FA, 16)], dcp)
    trace = conversations(seed)
    assert any(not t.output for t in trace)
    result = EngineHarness(layout, 400, max_num_batched_tokens=64).run(trace)

    kv = VllmManagerAdapter(layout, 400, max_num_batched_tokens=64)
    sched = Scheduler(kv, max_num_batched_tokens=64)
    for t in trace:
        sched.add_request(Request(t.id, t.prompt, layout.hash_block_size, arrival=t.arrival, expected_outputs=t.output))
    drain(sched)
    assert result.num_cached_tokens == {r.request_id: r.num_cached_tokens for r in sched.finished}
    assert sum(result.num_cached_tokens.values()) > 0
    assert (result.num_steps, result.copies) == (sched.step, kv.num_copies)


@pytest.mark.parametrize("dcp", [1, 2, 4])
def test_hits_equal_the_baseline_adapter_on_block_aligned_siblings(dcp):
    """tests/vllm/test_vllm_differential.py's sibling scenario (FA 64 + Mamba 64), through vLLM's
    whole Scheduler: the producer is split at 256, later siblings sharing 256 tokens hit 256,
    one sharing only 200 hits nothing."""
    layout = layout_for([CacheGroup(FA, 64), CacheGroup(MAMBA, 64)], dcp)
    prefix = tuple(range(5000, 5256))
    trace = [TraceRequest("p", prefix + tuple(range(10)), (1, 2, 3), arrival=1),
             TraceRequest("s1", prefix + tuple(range(100, 140)), (4,), arrival=20),
             TraceRequest("s2", prefix + tuple(range(200, 203)), (5, 6), arrival=30),
             TraceRequest("s3", prefix[:200] + tuple(range(300, 380)), (7,), arrival=40)]
    result = EngineHarness(layout, 256, max_num_batched_tokens=8192).run(trace)
    kv = VllmManagerAdapter(layout, 256, retention_interval=layout.config.retention_interval)
    sched = Scheduler(kv, max_num_batched_tokens=8192)
    for t in trace:
        sched.add_request(Request(t.id, t.prompt, layout.hash_block_size, arrival=t.arrival, expected_outputs=t.output))
    drain(sched)
    assert result.num_cached_tokens == {r.request_id: r.num_cached_tokens for r in sched.finished}
    assert result.num_cached_tokens == {"p": 0, "s1": 256, "s2": 256, "s3": 0}


@pytest.mark.parametrize("num_blocks", [12, 14, 20])
def test_evictions_and_steps_equal_kvproof_replay_on_attention_only_chats(num_blocks):
    """Attention only, one request at a time, a pool small enough to evict: kvproof's replay and
    vLLM's Scheduler free and reuse blocks in the same order (docs/coordinator.md), so hits,
    steps and evictions agree."""
    layout = layout_for([CacheGroup(FA, 16)])
    trace = conversations(0)
    result = EngineHarness(layout, num_blocks, max_num_batched_tokens=64).run(trace)
    ours = replay(trace, layout, num_blocks, 64)
    assert result.evictions == ours.evictions > 0
    assert result.num_steps == ours.steps
    assert result.num_cached_tokens == {r.request_id: r.num_cached_tokens for r in ours.requests}
    assert 0 < result.peak_blocks_in_use <= num_blocks - 1


# --- the loop itself --------------------------------------------------------------------------------

class Recorder(StepHook):
    def __init__(self):
        self.calls = []

    def scheduled(self, harness, step, output):
        self.calls.append(("scheduled", step, dict(output.num_scheduled_tokens)))

    def updated(self, harness, record, output, runner_output):
        self.calls.append(("updated", record.step, {rid: n for rid, _, n in record.chunks}))


def test_hooks_see_every_step_in_order():
    layout = layout_for([CacheGroup(FA, 16), CacheGroup(MAMBA, 16)])
    hook = Recorder()
    trace = [TraceRequest("a", tuple(range(40)), (1, 2), arrival=1), TraceRequest("b", tuple(range(30)), (3,), arrival=3)]
    result = EngineHarness(layout, 64, max_num_batched_tokens=16, hooks=[hook]).run(trace)
    assert len(hook.calls) == 2 * result.num_steps
    for i, record in enumerate(result.steps):
        scheduled, updated = hook.calls[2 * i], hook.calls[2 * i + 1]
        assert scheduled[0] == "scheduled" and updated[0] == "updated"
        assert scheduled[1] == updated[1] == record.step == i + 1
        assert scheduled[2] == updated[2]


def test_arrivals_follow_the_step_index():
    """A request with arrival s is added before the s-th schedule() call: with a one-token
    prompt and no output it runs exactly in step s (and nothing runs before)."""
    layout = layout_for([CacheGroup(FA, 16)])
    trace = [TraceRequest("late", (1,), (), arrival=5), TraceRequest("early", (2,), (), arrival=2)]
    result = EngineHarness(layout, 16, max_num_batched_tokens=16).run(trace)
    ran = {rid: step.step for step in result.steps for rid, _, _ in step.chunks}
    assert ran == {"early": 2, "late": 5}
    assert result.num_steps == 5
    assert {rid for step in result.steps for rid in step.finished} == {"early", "late"}


def test_a_request_that_never_fits_stalls_with_its_name():
    layout = layout_for([CacheGroup(FA, 16)])
    with pytest.raises(HarnessStalled, match=r"\['huge'\] cannot be scheduled with 4 blocks"):
        EngineHarness(layout, 4, max_num_batched_tokens=64).run([TraceRequest("huge", tuple(range(200)), (1,), 1)])


@pytest.mark.parametrize("trace, match", [
    ([TraceRequest("a", (1,), (), 1), TraceRequest("a", (2,), (), 1)], "duplicate request id 'a'"),
    ([TraceRequest("long", tuple(range(100)), (1,), 1)], "request 'long': 100 prompt tokens \\+ 1 outputs exceed max_model_len 64"),
])
def test_bad_traces_are_rejected_by_name(trace, match):
    harness = EngineHarness(layout_for([CacheGroup(FA, 16)], max_model_len=64), 16)
    with pytest.raises(ValueError, match=match):
        harness.add_trace(trace)


def test_bad_options_are_rejected_by_name():
    layout = layout_for([CacheGroup(FA, 16), CacheGroup(MAMBA, 16)])
    with pytest.raises(ValueError, match="num_blocks 1 must be an integer >= 2"):
        EngineHarness(layout, 1)
    with pytest.raises(ValueError, match="vLLM turns the EAGLE block drop off"):
        EngineHarness(layout, 16, use_eagle=True, num_hash_lookahead_tokens=1)
    with pytest.raises(ValueError, match="max_num_batched_tokens \\(8\\) must be greater than or equal to max_num_seqs \\(16\\)"):
        EngineHarness(layout, 16, max_num_batched_tokens=8, max_num_seqs=16)
