"""KV-cache events through vLLM 0.33.0's real Scheduler (``--kv-events-config``), both managers on
the same streams (integrations/vllm/cache_events.py; docs/vllm.md, "KV-cache events").

What each run's published events are checked against, for either manager:

* replay (INV-EVENTS-REPLAY): ``BlockStored`` adds one holder per hash, ``BlockRemoved`` takes
  one away and must name a hash with a holder left, ``AllBlocksCleared`` empties everything; at
  the end of the stream (and, in one test, after every step) the holders per (hash, group) are
  exactly the manager's cached blocks per key (vLLM's hash-to-block map; kvproof's pool);
* the request hashes, recomputed here from the trace with vLLM's hasher: each stored hash names
  the prefix its event's tokens end, ``block_size`` tokens after its parent's (None at 0);
* between the two: for a hash both managers stored in an attention group, kvproof's tokens are
  the last ``block_size`` tokens of vLLM's, and the two events agree exactly (parent, tokens,
  block size) where both key that group at the same span (H = the block here; under DCP with a
  finer H, kvproof links one hash unit, vLLM one block). vLLM's Mamba events are left out of
  the shape check: they list only the kept states' hashes but every token since the group's
  last cached block. Every published batch also survives the msgpack round trip the zmq
  publisher makes, and for one LoRA request with a session kvproof's events equal vLLM's field
  for field.
"""

from __future__ import annotations

import dataclasses
import textwrap
from collections import Counter

import msgspec
import pytest

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm")

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_block_hash, get_group_id, maybe_convert_block_hash  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvproof.impl.key_index import KeyIndex  # noqa: E402
from kvproof.integrations.vllm.engine_harness import EngineHarness, StepHook  # noqa: E402
from kvproof.integrations.vllm.kv_specs import kv_cache_config_for  # noqa: E402
from kvproof.integrations.vllm.kvproof_manager import KvproofKVCacheManager  # noqa: E402
from kvproof.sim.trace import TraceRequest  # noqa: E402
from kvproof.spec.contracts import InvariantViolation  # noqa: E402
from kvproof.spec.groups import CacheGroup, GroupKind  # noqa: E402
from kvproof.spec.layout import LayoutConfig, resolve_layout  # noqa: E402

from .test_plugin import _run_fresh  # noqa: E402
from .traces import conversations  # noqa: E402

FA, MAMBA = GroupKind.FULL_ATTENTION, GroupKind.MAMBA
ATTENTION = (CacheGroup(FA, 16),)
HYBRID = (CacheGroup(FA, 16), CacheGroup(MAMBA, 16))


def layout_for(groups, dcp=1, hash_block_size=None):
    return resolve_layout(LayoutConfig(tuple(groups), dcp=dcp, max_model_len=4096, hash_block_size=hash_block_size))


def run(layout, trace, manager_class, num_blocks=64, budget=64):
    """The harness after the whole trace, and every event its manager emitted, oldest first
    (what the Scheduler published, then what a next step would: the last step's frees)."""
    h = EngineHarness(layout, num_blocks, max_num_batched_tokens=budget, manager_class=manager_class, kv_events=True)
    h.run(trace)
    return h, published(h) + h.kv_cache_manager.take_events()


def published(h):
    return [e for batch in h.kv_event_batches for e in batch.events]


def replay(events) -> Counter:
    """Holders per (hash, group) after ``events``; every removal must name a held hash."""
    live = Counter()
    for i, e in enumerate(events):
        if isinstance(e, AllBlocksCleared):
            live.clear()
        elif isinstance(e, BlockStored):
            live.update((h, e.group_idx) for h in e.block_hashes)
        else:
            assert isinstance(e, BlockRemoved) and len(e.block_hashes) == 1, e
            key = (e.block_hashes[0], e.group_idx)
            assert live[key] > 0, f"event {i} removes {key}, which no block holds"
            live[key] -= 1
    return +live


def cached(h, universe) -> Counter:
    """Cached blocks per (hash, group), read from the manager's own state."""
    manager = h.kv_cache_manager
    if isinstance(manager, KvproofKVCacheManager):
        pool = manager.manager.pool
        groups = range(len(manager.coordinator.single_type_managers))
        found = Counter({(maybe_convert_block_hash(raw), g): len(pool.holders((raw, g)))
                         for raw in universe.raw for g in groups if pool.holders((raw, g))})
        assert len(found) == pool.num_cached_keys(), "the pool holds keys no trace request hashes to"
        return found
    found = Counter()
    for key, blocks in manager.block_pool.cached_block_hash_to_block._cache.items():
        found[maybe_convert_block_hash(get_block_hash(key)), get_group_id(key)] += (
            1 if isinstance(blocks, KVCacheBlock) else len(blocks))
    return found


class Universe:
    """Every prefix a trace request hashes to (vLLM's hasher at H): event hash -> its tokens."""

    def __init__(self, h, trace):
        self.prefix, self.raw = {}, set()
        for t in trace:
            tokens = list(t.prompt + t.output)
            request = Request(request_id=t.id, prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=1),
                              pooling_params=None, cache_salt=t.cache_salt, block_hasher=h._block_hasher)
            unit = h.layout.hash_block_size
            for i, raw in enumerate(request.block_hashes):
                self.raw.add(raw)
                self.prefix[maybe_convert_block_hash(raw)] = tuple(tokens[:(i + 1) * unit])


def links(events, universe, groups) -> dict:
    """(hash, group) -> (parent, tokens, block_size, extra keys) for each stored hash of ``groups``, checking
    each against the prefix its hash names (the last stored link per hash: they all agree)."""
    out = {}
    for e in events:
        if not isinstance(e, BlockStored) or e.group_idx not in groups:
            continue
        size = e.block_size
        assert e.block_hashes and len(e.token_ids) == size * len(e.block_hashes), e
        start = len(universe.prefix[e.block_hashes[0]]) - size
        assert (e.parent_block_hash is None) == (start == 0), e
        if start:
            assert len(universe.prefix[e.parent_block_hash]) == start, e
        parent = e.parent_block_hash
        for i, h in enumerate(e.block_hashes):
            prefix = universe.prefix[h]
            assert len(prefix) == start + (i + 1) * size, (e, i)
            tokens = tuple(e.token_ids[i * size:(i + 1) * size])
            assert prefix[-size:] == tokens, (e, i)
            link = (parent, tokens, size, e.extra_keys[i])
            assert out.setdefault((h, e.group_idx), link) == link, (e, i)
            parent = h
    return out


def attention_groups(layout):
    return {g.index for g in layout.groups if g.group.kind is not MAMBA}


def check_stream(layout, trace, **kwargs):
    """Both managers on ``trace``: each one's events replay to its cache and match the request
    hashes; kvproof's agree with vLLM's on the hashes both stored. Returns both runs."""
    runs = {}
    for name, cls in (("vllm", None), ("kvproof", KvproofKVCacheManager)):
        h, events = run(layout, trace, cls, **kwargs)
        for batch in h.kv_event_batches:  # what the zmq publisher sends, read back as a consumer would
            assert msgspec.msgpack.decode(msgspec.msgpack.encode(batch), type=KVEventBatch) == batch
        universe = Universe(h, trace)
        assert replay(events) == cached(h, universe), name
        groups = attention_groups(layout) if cls is None else {g.index for g in layout.groups}
        runs[name] = (h, events, links(events, universe, groups))
    ours, theirs = runs["kvproof"][2], runs["vllm"][2]
    common = [k for k in theirs if k in ours]
    assert len(common) >= len(theirs) // 2 > 0, (len(common), len(theirs))
    for k in common:
        parent, tokens, size, _ = ours[k]
        assert theirs[k][1][-size:] == tokens, k
        if size == theirs[k][2]:
            assert ours[k] == theirs[k], k
    return runs


def salted(trace):
    """The trace with every other conversation under a cache salt (vLLM's extra key on block 0)."""
    return [dataclasses.replace(t, cache_salt="tenant-b" if int(t.id[1:].split("t")[0]) % 2 else None) for t in trace]


@pytest.mark.parametrize("groups", [ATTENTION, HYBRID], ids=["attention", "hybrid"])
@pytest.mark.parametrize("gap", [60, 3], ids=["sequential", "overlapping"])
def test_events_replay_to_each_managers_cache_and_agree_with_vllms(groups, gap):
    runs = check_stream(layout_for(groups), salted(conversations(7, num=3, turns=4, gap=gap)))
    ours, theirs = runs["kvproof"][2], runs["vllm"][2]
    assert all(ours[k] == v for k, v in theirs.items() if k in ours)  # H = block: the same links
    assert any(link[3] == ("tenant-b",) for link in ours.values())  # the salt, on its first block


def test_under_dcp_with_a_finer_hash_unit_kvproof_links_one_hash_unit():
    layout = layout_for(HYBRID, dcp=2, hash_block_size=16)
    runs = check_stream(layout, conversations(3, num=3, turns=3, gap=3), budget=128)
    sizes = {e.block_size for e in runs["kvproof"][1] if isinstance(e, BlockStored)}
    assert sizes == {16} and {e.block_size for e in runs["vllm"][1] if isinstance(e, BlockStored)} >= {32}


def test_with_vllms_rule_set_the_events_link_as_vllms_do(monkeypatch):
    """``rules=vllm`` keys block ends and the prompt's tail: block-end hashes link one block
    (32 tokens at DCP 2), the tail one hash unit, as vLLM's full and partial entries do."""
    monkeypatch.setenv("KVPROOF_OPTIONS", "rules=vllm")
    layout = layout_for(HYBRID, dcp=2, hash_block_size=16)
    runs = check_stream(layout, conversations(3, num=3, turns=3, gap=3), budget=128)
    ours, theirs = runs["kvproof"][2], runs["vllm"][2]
    assert {k[1] for k in ours} == {0, 1}
    assert all(ours[k] == v for k, v in theirs.items() if k in ours)
    assert {link[2] for link in ours.values()} == {16, 32}


@pytest.mark.parametrize("groups", [ATTENTION, HYBRID], ids=["attention", "hybrid"])
def test_evicted_keys_are_removed_as_their_blocks_are_reused(groups):
    trace = conversations(11, num=6, turns=3, gap=3)
    runs = check_stream(layout_for(groups), trace, num_blocks=24)
    for name, (h, events, _) in runs.items():
        removed = sum(isinstance(e, BlockRemoved) for e in events)
        assert h.evictions > 0 and removed >= h.evictions, (name, h.evictions, removed)


class ReplayEveryStep(StepHook):
    """After every step, the events so far (published, then what the next step would publish:
    taken here, so the stream is the same, cut at each step) replay to the manager's cache."""

    def __init__(self, universe):
        self.universe, self.events, self.published, self.steps = universe, [], 0, 0

    def updated(self, harness, record, output, runner_output):
        fresh = published(harness)[self.published:]
        self.published += len(fresh)
        self.events += fresh + harness.kv_cache_manager.take_events()
        assert replay(self.events) == cached(harness, self.universe), f"step {record.step}"
        self.steps += 1


@pytest.mark.parametrize("groups", [ATTENTION, HYBRID], ids=["attention", "hybrid"])
@pytest.mark.parametrize("manager_class", [None, KvproofKVCacheManager], ids=["vllm", "kvproof"])
def test_after_every_step_the_events_replay_to_the_cache(groups, manager_class):
    trace = salted(conversations(5, num=5, turns=3, gap=3))
    layout = layout_for(groups)
    h = EngineHarness(layout, 24, max_num_batched_tokens=64, manager_class=manager_class, kv_events=True)
    hook = ReplayEveryStep(Universe(h, trace))
    h.hooks = (hook,)
    h.run(trace)
    assert hook.steps == h.step_count and h.evictions > 0
    assert any(isinstance(e, BlockRemoved) for e in hook.events)


@pytest.mark.parametrize("manager_class", [None, KvproofKVCacheManager], ids=["vllm", "kvproof"])
def test_a_reset_publishes_all_blocks_cleared_and_the_cache_starts_over(manager_class):
    shared = tuple(range(64))
    first = [TraceRequest("a", shared + (1,), (2,), arrival=1)]
    h, _ = run(layout_for(ATTENTION), first, manager_class)
    before = len(published(h))
    assert h.scheduler.reset_prefix_cache() is True
    later = [TraceRequest("b", shared + (3,), (4, 5), arrival=h.step_count + 1)]
    h.add_trace(later)
    while h.has_unfinished():
        h.step()
    events = published(h) + h.kv_cache_manager.take_events()
    cleared = [i for i, e in enumerate(events) if isinstance(e, AllBlocksCleared)]
    assert len(cleared) == 1 and cleared[0] >= before
    assert h.result().num_cached_tokens["b"] == 0  # nothing survived the reset
    universe = Universe(h, first + later)
    after = replay(events[cleared[0]:])
    assert after == cached(h, universe) and len(after) == 4  # b's own 4 blocks of 16


def test_events_off_means_a_plain_index_and_none_taken():
    layout = layout_for(ATTENTION)
    h, events = run(layout, conversations(7, num=1, turns=2), KvproofKVCacheManager)
    assert events  # on
    for kwargs in ({}, {"enable_kv_cache_events": True, "enable_caching": False}):
        manager = KvproofKVCacheManager(kv_cache_config_for(layout, 64), max_model_len=4096, scheduler_block_size=16,
                                        hash_block_size=16, **kwargs)
        assert type(manager.manager.pool._index) is KeyIndex and manager.take_events() == []


def test_a_key_attached_outside_a_requests_keying_is_an_invariant_violation():
    layout = layout_for(ATTENTION)
    manager = KvproofKVCacheManager(kv_cache_config_for(layout, 64), max_model_len=4096, scheduler_block_size=16,
                                    hash_block_size=16, enable_kv_cache_events=True)
    pool = manager.manager.pool
    (block,) = pool.allocate(1)
    pool.cache_full(block, (b"h" * 32, 0), 16)
    with pytest.raises(InvariantViolation, match="INV-EVENTS-REQUEST"):
        manager.take_events()


def test_stored_and_full_report_events_equal_vllms_with_lora_and_a_session():
    """A LoRA request with a session id: kvproof's ``BlockStored`` (after the step) equals vLLM's
    (at allocation) field for field. ``kv_cache_report_mode="full"`` (a request's
    ``extra_args``): the lookup that hits reports the hit's blocks from token 0, as vLLM's
    manager does."""
    from vllm.lora.request import LoRARequest
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    hasher = get_request_block_hasher(16, sha256)
    layout = layout_for(ATTENTION)

    lora = LoRARequest("adapter-a", 3, "/nowhere")

    def request(rid, prompt, mode="incremental"):
        params = SamplingParams(max_tokens=1, extra_args={"kv_cache_report_mode": mode})
        return Request(request_id=rid, prompt_token_ids=list(prompt), sampling_params=params, pooling_params=None,
                       block_hasher=hasher, lora_request=lora, session_id="chat-9")

    reports = {}
    for cls in (KVCacheManager, KvproofKVCacheManager):
        manager = cls(kv_cache_config_for(layout, 64), max_model_len=4096, scheduler_block_size=16, hash_block_size=16,
                      enable_kv_cache_events=True)
        a = request("a", range(65))
        assert manager.allocate_slots(a, 65) is not None
        a.num_computed_tokens = 65
        manager.new_step_starts()  # kvproof keys what the step wrote (vLLM keyed at allocation)
        stored = manager.take_events()
        assert [len(e.block_hashes) for e in stored] == [4]
        quiet = request("quiet", tuple(range(64)) + (7, 8))
        assert manager.get_computed_blocks(quiet)[1] == 64 and manager.take_events() == []
        full = request("full", tuple(range(64)) + (9, 9), "full")
        assert manager.get_computed_blocks(full)[1] == 64
        (report,) = manager.take_events()
        assert report.parent_block_hash is None and report.block_hashes == stored[0].block_hashes
        reports[cls] = (stored[0], report)
    assert reports[KVCacheManager] == reports[KvproofKVCacheManager]
    assert reports[KVCacheManager][0].lora_name == "adapter-a" and reports[KVCacheManager][0].session_id == "chat-9"
    assert reports[KVCacheManager][0].extra_keys == [("adapter-a",)] * 4


# --- served: an in-process engine publishing over zmq ------------------------------------------------

_SERVED = textwrap.dedent("""
    import json, socket, time
    from collections import Counter
    import msgspec, zmq
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    from vllm import SamplingParams
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_block_hash, get_group_id, maybe_convert_block_hash
    from vllm.v1.engine.llm_engine import LLMEngine
    from kvproof.integrations.vllm.tiny_model import tiny_model_dir
    probe = socket.socket(); probe.bind(("127.0.0.1", 0)); port = probe.getsockname()[1]; probe.close()
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=tiny_model_dir(), skip_tokenizer_init=True, block_size=4, prefix_match_unit=2,
        num_gpu_blocks_override=48, enable_prefix_caching=True, max_model_len=128, max_num_seqs=16,
        max_num_batched_tokens=64, kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq",
                                                     "endpoint": f"tcp://*:{port}", "topic": "kv"},
        distributed_executor_backend="kvproof.integrations.vllm.cpu_executor.CpuStagingExecutor"))
    sub = zmq.Context().socket(zmq.SUB); sub.connect(f"tcp://127.0.0.1:{port}"); sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    time.sleep(1.0)  # PUB/SUB: the subscription must reach the publisher before the first batch
    manager = engine.engine_core.engine_core.scheduler.kv_cache_manager
    report = {"manager": type(manager).__name__, "hits": {}}
    system = list(range(1, 30))
    turns = [(f"t{i}", system + list(range(100 * i, 100 * i + 7 + i))) for i in range(8)]
    for rid, prompt in turns:
        engine.add_request(rid, {"prompt_token_ids": prompt}, SamplingParams(max_tokens=3, ignore_eos=True))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    report["hits"][out.request_id] = out.num_cached_tokens
    if report["manager"] == "KvproofKVCacheManager":  # every key the pool holds, with its holder count
        cached = Counter({(maybe_convert_block_hash(raw), g): len(b) for (raw, g), b in manager.manager.pool._index.holders.items()})
        report["evictions"] = manager.manager.num_evictions
    else:
        cached = Counter({(maybe_convert_block_hash(get_block_hash(k)), get_group_id(k)): 1 if isinstance(b, KVCacheBlock) else len(b)
                          for k, b in manager.block_pool.cached_block_hash_to_block._cache.items()})
    engine.engine_core.shutdown()  # the publisher sends what it queued, then stops
    events, seqs = [], []
    while sub.poll(2000):
        topic, seq, payload = sub.recv_multipart()
        seqs.append(int.from_bytes(seq, "big"))
        events += msgspec.msgpack.decode(payload, type=KVEventBatch).events
    live, bad = Counter(), 0
    for e in events:
        if isinstance(e, AllBlocksCleared):
            live.clear()
        elif isinstance(e, BlockStored):
            live.update((h, e.group_idx) for h in e.block_hashes)
        else:
            key = (e.block_hashes[0], e.group_idx); bad += live[key] == 0; live[key] -= 1
    report.update(batches=len(seqs), contiguous=seqs == list(range(len(seqs))), kinds=dict(Counter(type(e).__name__ for e in events)),
                  replay_matches=+live == cached, bad_removals=bad, cached_keys=len(cached))
    print("REPORT " + json.dumps(report))
""")


@pytest.mark.parametrize("manager", ["kvproof", "vllm"])
def test_served_events_reach_a_zmq_subscriber_and_replay_to_the_cache(manager):
    """An engine built by vLLM (``LLMEngine``, the staging executor, the plugin), KV-cache events
    on with vLLM's zmq publisher: eight turns on a shared system prompt in a 48-block pool. A
    subscriber receives every batch in sequence; replaying them gives the manager's cache at the
    end, every removal names a held hash, and kvproof's manager hits what vLLM's does."""
    report = _run_fresh(_SERVED, KVPROOF_MANAGER=manager)
    assert report["status"] == 0, report["last"]
    assert report["manager"] == ("KvproofKVCacheManager" if manager == "kvproof" else "KVCacheManager")
    assert report["batches"] > 0 and report["contiguous"] and report["bad_removals"] == 0
    assert report["replay_matches"] and report["cached_keys"] > 0
    assert report["kinds"]["BlockRemoved"] > 0  # the pool reused cached blocks
    assert report["hits"] == {"t0": 0, "t1": 0, **{f"t{i}": 28 for i in range(2, 8)}}
