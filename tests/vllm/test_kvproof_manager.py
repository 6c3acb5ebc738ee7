"""kvproof's manager inside vLLM 0.33.0's real Scheduler (integrations/vllm/kvproof_manager.py):
it has everything the installed vLLM uses of a manager (the drift guard), serves multi-turn
traffic with prefix hits and never fewer cached tokens per request than vLLM's own manager,
frees every block, survives preemption and ``reset_prefix_cache``, reports prefix-cache stats as
vLLM does, and refuses what it does not serve, naming it, with nothing changed."""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm")

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import CrossAttentionSpec, KVCacheGroupSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402

from kvproof.integrations.vllm import manager_surface as ms  # noqa: E402
from kvproof.integrations.vllm import serving_options  # noqa: E402
from kvproof.integrations.vllm.engine_harness import EngineHarness  # noqa: E402
from kvproof.integrations.vllm.kv_specs import kv_cache_config_for  # noqa: E402
from kvproof.integrations.vllm.kvproof_manager import KvproofKVCacheManager  # noqa: E402
from kvproof.integrations.vllm.worker_model import OracleHook  # noqa: E402
from kvproof.sim.trace import TraceRequest  # noqa: E402
from kvproof.spec.groups import CacheGroup, GroupKind  # noqa: E402
from kvproof.spec.layout import LayoutConfig, resolve_layout  # noqa: E402

from .traces import conversations  # noqa: E402

FA, MAMBA = GroupKind.FULL_ATTENTION, GroupKind.MAMBA
ATTENTION = (CacheGroup(FA, 16),)
HYBRID = (CacheGroup(FA, 16), CacheGroup(MAMBA, 16))


def layout_for(groups, max_model_len=4096):
    return resolve_layout(LayoutConfig(tuple(groups), max_model_len=max_model_len))


def harness(groups, num_blocks=64, manager_class=KvproofKVCacheManager, budget=64):
    return EngineHarness(layout_for(groups), num_blocks, max_num_batched_tokens=budget, manager_class=manager_class)


def manager_for(groups, num_blocks=64, **kwargs):
    layout = layout_for(groups)
    arguments = dict(max_model_len=4096, scheduler_block_size=layout.scheduler_block_size,
                     hash_block_size=layout.hash_block_size)
    arguments.update(kwargs)
    return KvproofKVCacheManager(kv_cache_config_for(layout, num_blocks), **arguments)


def vllm_request(request_id, prompt, block_size=16):
    init_none_hash(sha256)
    return Request(request_id=request_id, prompt_token_ids=list(prompt), sampling_params=SamplingParams(max_tokens=4),
                   pooling_params=None, block_hasher=get_request_block_hasher(block_size, sha256))


# --- the drift guard --------------------------------------------------------------------------------

def test_the_adapter_has_everything_the_installed_vllm_uses():
    uses, sites = ms.extract()
    scheduler_and_engine = ("scheduler", "engine")
    assert ms.missing_from(KvproofKVCacheManager, scheduler_and_engine, surface=uses) == []
    live = harness(HYBRID).kv_cache_manager
    assert isinstance(live, KvproofKVCacheManager)
    assert ms.missing_from(live, scheduler_and_engine, surface=uses) == []  # every path, [*] on every group


def test_the_drift_guard_names_what_a_stand_in_lacks():
    class Lacking(KvproofKVCacheManager):
        take_events = None  # not callable: as good as missing

        def allocate_slots(self, request, num_new_tokens):
            return None

    problems = ms.missing_from(Lacking, ("scheduler",), surface=ms.extract()[0])
    assert any("take_events" in p for p in problems)
    assert any("allocate_slots" in p and "num_lookahead_tokens" in p for p in problems)


# --- serving ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("groups", [ATTENTION, HYBRID], ids=["attention", "hybrid"])
@pytest.mark.parametrize("gap", [60, 3], ids=["sequential", "overlapping"])
def test_multi_turn_chats_hit_at_least_as_much_as_vllm_and_free_every_block(groups, gap):
    trace = conversations(7, num=3, turns=4, gap=gap)
    stock = harness(groups, manager_class=None).run(trace)
    kvproof_harness = harness(groups)
    ours = kvproof_harness.run(trace)
    assert sum(ours.num_cached_tokens.values()) > 0
    fewer = {r: (ours.num_cached_tokens[r], n) for r, n in stock.num_cached_tokens.items() if ours.num_cached_tokens[r] < n}
    assert not fewer, f"fewer cached tokens than vLLM's manager (kvproof, vLLM): {fewer}"
    manager = kvproof_harness.kv_cache_manager
    assert manager.usage == 0.0 and manager.block_pool.get_num_free_blocks() == 63


def test_a_prefix_shared_within_one_step_is_a_junction_as_in_vllm():
    """A and B share 64 tokens and arrive together: vLLM sees A's keys at once and stops B's
    chunk at 64, so the Mamba state there serves C; kvproof keys A after the step and finds the
    junction from the hashes, giving the same chunks and C's hit (without it: B runs to 80, C 0)."""
    shared = tuple(range(64))
    trace = [TraceRequest("A", shared + tuple(range(100, 140)), (1,), arrival=1),
             TraceRequest("B", shared + tuple(range(200, 230)), (2,), arrival=1),
             TraceRequest("C", shared + tuple(range(300, 320)), (3,), arrival=10)]
    stock = harness(HYBRID, manager_class=None, budget=512).run(trace)
    ours = harness(HYBRID, budget=512).run(trace)
    assert ours.num_cached_tokens == stock.num_cached_tokens == {"A": 0, "B": 0, "C": 64}
    assert [s.chunks for s in ours.steps] == [s.chunks for s in stock.steps]


def _sharers(seed=0, groups=8):
    """Groups of four requests arriving together, each group on a prefix of 128 tokens no
    earlier request had: three of each group are admitted in the step that computes it."""
    import random
    rng = random.Random(seed)
    trace = []
    for g in range(groups):
        prefix = tuple(rng.randrange(5000) for _ in range(128))
        trace += [TraceRequest(f"g{g}r{i}", prefix + tuple(rng.randrange(5000) for _ in range(rng.randint(8, 40))),
                               (1, 2), arrival=1 + 6 * g) for i in range(4)]
    return trace


@pytest.mark.parametrize("groups", [ATTENTION, HYBRID], ids=["attention", "hybrid"])
def test_same_step_sharers_wait_a_step_and_never_cache_fewer_than_vllm(groups, monkeypatch):
    """vLLM's manager lets a request admitted in its prefix's producer step hit the blocks that
    step writes (attention) or defers it a step (Mamba); kvproof's keys appear after the step,
    so the adapter makes the request wait one step instead. Without the wait, kvproof caches
    fewer tokens than vLLM for some requests."""
    trace = _sharers()
    stock = harness(groups, num_blocks=256, manager_class=None, budget=256).run(trace).num_cached_tokens
    ours_harness = harness(groups, num_blocks=256, budget=256)
    ours = ours_harness.run(trace).num_cached_tokens
    fewer = {r: (ours[r], n) for r, n in stock.items() if ours[r] < n}
    assert not fewer, fewer
    assert ours_harness.kv_cache_manager.num_producer_waits >= 6  # most groups reach the wait
    monkeypatch.setattr("kvproof.impl.same_step.SameStepKeys.producer_in_flight", lambda self, req, hit: False)
    control = harness(groups, num_blocks=256, budget=256).run(trace).num_cached_tokens
    assert any(control[r] < n for r, n in stock.items())  # the wait is what closes the gap


def test_preempted_requests_are_freed_and_finish():
    trace = [TraceRequest(f"r{i}", tuple(range(100 * i, 100 * i + 90)), tuple(range(40)), arrival=1) for i in range(4)]
    h = harness(ATTENTION, num_blocks=20, budget=256)
    result = h.run(trace)
    assert result.preemptions > 0
    assert set(result.num_cached_tokens) == {t.id for t in trace}
    assert h.kv_cache_manager.usage == 0.0


def test_reset_prefix_cache_drops_every_key_and_refuses_while_blocks_are_held():
    shared = tuple(range(64))
    h = harness(ATTENTION)
    h.run([TraceRequest("a", shared + (1,), (2,), arrival=1)])
    h.add_trace([TraceRequest("b", shared + (3,), tuple(range(5)), arrival=h.step_count + 1)])
    h.step()
    assert h.result().num_cached_tokens["b"] == 64  # the prefix hit
    assert h.scheduler.reset_prefix_cache() is False  # "b" holds blocks
    while h.has_unfinished():
        h.step()
    assert h.scheduler.reset_prefix_cache() is True
    h.add_trace([TraceRequest("c", shared + (4,), (5,), arrival=h.step_count + 1)])
    h.step()
    assert h.result().num_cached_tokens["c"] == 0


def test_prefix_cache_stats_count_queries_and_hits_as_vllm_does():
    manager = manager_for(ATTENTION, log_stats=True)
    fresh, again = vllm_request("fresh", range(40)), vllm_request("again", range(40))
    again.num_preemptions = 1
    manager.record_prefix_cache_stats(fresh, 32)
    manager.record_prefix_cache_stats(again, 16)
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (1, 40, 32)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 40, 16)
    assert manager.make_prefix_cache_stats().queries == 0  # taken and reset
    assert manager_for(ATTENTION).make_prefix_cache_stats() is None  # log_stats off


# --- refusals ---------------------------------------------------------------------------------------

def test_allocate_slots_refuses_encoder_tokens_and_changes_nothing():
    manager = manager_for(ATTENTION)
    request = vllm_request("r", range(40))
    free = manager.block_pool.get_num_free_blocks()
    with pytest.raises(NotImplementedError, match=re.escape("num_encoder_tokens=8")):
        manager.allocate_slots(request, 40, num_encoder_tokens=8)
    assert manager.block_pool.get_num_free_blocks() == free and manager.get_block_ids("r") == ([],)
    assert manager.allocate_slots(request, 40) is not None  # control: the same call without it


@pytest.mark.parametrize("delayed", [True, False], ids=["async-load", "load-in-step"])
def test_connector_tokens_are_keyed_only_once_vllm_says_they_are_written(delayed):
    manager = manager_for(ATTENTION)
    loaded = vllm_request("loaded", range(64))
    assert manager.allocate_slots(loaded, 0 if delayed else 16, num_external_computed_tokens=48,
                                  delay_cache_blocks=delayed) is not None
    assert len(manager.get_block_ids("loaded")[0]) == (3 if delayed else 4)
    loaded.num_computed_tokens, loaded.num_in_flight_tokens = (48, 0) if delayed else (64, 16)
    manager.new_step_starts()
    sibling = vllm_request("sibling", range(64))
    assert manager.get_computed_blocks(sibling)[1] == 0  # the load is not known to be done
    manager.cache_blocks(loaded, 48)  # vLLM: the load (or the step) is done
    assert manager.get_computed_blocks(sibling)[1] == 48


@pytest.mark.parametrize("groups,keyword,value", [
    (HYBRID, "num_hash_lookahead_tokens", 1), (ATTENTION, "pcp_world_size", 2),
])
def test_construction_refuses_what_it_does_not_serve(groups, keyword, value):
    with pytest.raises(NotImplementedError, match=keyword):
        manager_for(groups, **{keyword: value})


def test_hash_lookahead_with_kv_cache_events_is_refused():
    with pytest.raises(NotImplementedError, match="num_hash_lookahead_tokens"):
        manager_for(ATTENTION, num_hash_lookahead_tokens=1, enable_kv_cache_events=True)


@pytest.mark.parametrize("lookahead", [1, 2])
@pytest.mark.parametrize("gap", [60, 3], ids=["sequential", "overlapping"])
@pytest.mark.parametrize("dcp", [1, 2])
def test_hash_lookahead_on_attention_hits_what_vllm_hits_and_the_oracle_confirms_it(dcp, gap, lookahead):
    """vLLM 0.33.0's default with EAGLE/MTP: a block's hash also covers the L tokens after it
    (the drafter's KV at the block's last position reads them) and exists only once they do.
    kvproof keys and looks up vLLM's own hashes, so on attention groups it serves them as they
    are: per request never fewer cached tokens than vLLM's manager, and every reused token
    confirmed by the content oracle."""
    layout = resolve_layout(LayoutConfig(ATTENTION, dcp=dcp, max_model_len=4096))
    trace = conversations(11, num=3, turns=4, gap=gap)
    stock = EngineHarness(layout, 64, max_num_batched_tokens=64, num_hash_lookahead_tokens=lookahead).run(trace)
    hook = OracleHook(layout)
    ours = EngineHarness(layout, 64, max_num_batched_tokens=64, num_hash_lookahead_tokens=lookahead,
                         manager_class=KvproofKVCacheManager, hooks=[hook]).run(trace)
    assert sum(stock.num_cached_tokens.values()) > 0 and not hook.violations_by_step
    fewer = {r: (ours.num_cached_tokens[r], n) for r, n in stock.num_cached_tokens.items() if ours.num_cached_tokens[r] < n}
    assert not fewer, f"fewer cached tokens than vLLM's manager (kvproof, vLLM): {fewer}"
    assert sum(ours.num_cached_tokens.values()) > 0  # the oracle checked reads of reused blocks


@pytest.mark.parametrize("gap", [60, 3], ids=["sequential", "overlapping"])
@pytest.mark.parametrize("dcp", [1, 2])
def test_async_scheduling_over_mamba_hits_what_vllm_hits_and_the_oracle_confirms_it(dcp, gap, monkeypatch):
    """vLLM's AsyncScheduler (GPU runs' default) allocates each step before the previous one
    has returned, so kvproof keys a step's Mamba state after the next step was allocated; with
    H below the Mamba block (states inside blocks: prompt tails, junctions) that next step often
    writes the state's block in place and must copy it out first. Both managers on the same
    multi-turn chats, the content oracle beside each: no wrong read, per request never fewer
    cached tokens than vLLM's manager and exactly what kvproof's caches with sync scheduling."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from kvproof.impl.managers.mamba import MambaManager

    layout = resolve_layout(LayoutConfig(HYBRID, dcp=dcp, hash_block_size=4, max_model_len=4096))
    trace = conversations(7, num=3, turns=4, gap=gap)
    copied = []
    grow = MambaManager.grow

    def counting_grow(self, request, total_tokens):
        appended = grow(self, request, total_tokens)
        copied.append(bool(self.requests[request.request_id].steps[-1].copy))
        return appended

    monkeypatch.setattr(MambaManager, "grow", counting_grow)
    runs, hooks = {}, {}
    for name, manager_class, is_async in (("vllm", None, True), ("kvproof", KvproofKVCacheManager, True),
                                          ("kvproof sync", KvproofKVCacheManager, False)):
        hooks[name] = OracleHook(layout)
        h = EngineHarness(layout, 64, max_num_batched_tokens=64, manager_class=manager_class, hooks=[hooks[name]],
                          async_scheduling=is_async)
        assert isinstance(h.scheduler, AsyncScheduler) == is_async
        runs[name] = h.run(trace).num_cached_tokens
        if name == "kvproof":
            assert sum(copied) > 0  # states the next step overwrote, copied out before it ran
    assert not any(hook.violations_by_step for hook in hooks.values())
    stock, ours = runs["vllm"], runs["kvproof"]
    assert sum(stock.values()) > 0
    fewer = {r: (ours[r], n) for r, n in stock.items() if ours[r] < n}
    assert not fewer, f"fewer cached tokens than vLLM's manager (kvproof, vLLM): {fewer}"
    assert ours == runs["kvproof sync"]


def test_a_second_allocation_in_one_step_copies_no_state_that_step_never_wrote():
    """vLLM may allocate a request twice in one step. The first allocation's chunk end (12, a
    kept state inside the 16-token Mamba block) is no step in flight: the one forward pass writes
    the state after the second's end only, so nothing is copied out for it (a copy would read a
    block allocated in this step: INV-COW-SOURCE-READY)."""
    manager = manager_for(HYBRID, hash_block_size=4)
    request = vllm_request("a", range(30), block_size=4)
    manager.new_step_starts()
    blocks, hit, _ = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, 12, num_new_computed_tokens=hit, new_computed_blocks=blocks) is not None
    request.num_computed_tokens = request.num_in_flight_tokens = 12  # scheduled, not returned
    assert manager.allocate_slots(request, 2) is not None
    assert manager.take_kv_cache_block_copies() == ([], [])


@pytest.mark.parametrize("groups", [ATTENTION, HYBRID], ids=["attention", "hybrid"])
def test_block_residency_metrics_report_what_vllms_pool_reports(groups, monkeypatch):
    """``--kv-cache-metrics`` with every block sampled: vLLM's collector, fed from kvproof's pool,
    reports one eviction event per block handed out again, with its reuse gaps (hits between
    allocations), as it does fed from vLLM's pool. With vLLM's rules (where both managers hit
    and evict alike) the events match vLLM's manager's, gap for gap, on chats that evict."""
    layout = layout_for(groups)
    trace = conversations(7, num=6, turns=5, gap=3)
    reports = {}
    for name, manager_class in (("vllm", None), ("kvproof", KvproofKVCacheManager)):
        monkeypatch.setenv("KVPROOF_OPTIONS", "rules=vllm")
        h = EngineHarness(layout, 28, max_num_batched_tokens=64, manager_class=manager_class, kv_cache_metrics=True)
        result = h.run(trace)
        events = h.scheduler.kv_metrics_collector.drain_events()
        reports[name] = (result.evictions, sorted(len(e.reuse_gaps_seconds) for e in events))
    evictions, gaps = reports["vllm"]
    assert evictions > 0 and any(gaps)  # blocks were evicted, some after hits
    assert reports["kvproof"] == reports["vllm"]


def test_a_group_kind_without_a_kvproof_manager_fails_at_start_naming_it():
    layout = layout_for(ATTENTION)
    config = kv_cache_config_for(layout, 64)
    cross = CrossAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=config.kv_cache_groups[0].kv_cache_spec.dtype)
    config.kv_cache_groups.append(KVCacheGroupSpec(["cross"], cross))
    with pytest.raises(ValueError, match="CrossAttentionSpec"):
        KvproofKVCacheManager(config, max_model_len=4096, scheduler_block_size=16, hash_block_size=16)


@pytest.mark.parametrize("text,named", [
    ("rules=sglang", "rules='sglang'"), ("eviction=fifo", "eviction='fifo'"), ("retention=-1", "retention='-1'"),
    ("attention_keys=all", "attention_keys='all'"), ("hash=16", "unknown option 'hash'"), ("rules", "name=value"),
])
def test_a_bad_option_is_refused_naming_it(text, named, monkeypatch):
    with pytest.raises(ValueError, match=re.escape(named)):
        serving_options.parse(text)
    monkeypatch.setenv(serving_options.ENV, text)
    with pytest.raises(ValueError, match=serving_options.ENV):
        manager_for(ATTENTION)


def test_the_vllm_rule_set_and_single_overrides():
    assert serving_options.parse("") == serving_options.ServingOptions()
    vllm = serving_options.parse("rules=vllm, eviction=compute, retention=dense")
    assert (vllm.rules, vllm.attention_keys, vllm.eviction, vllm.retention_interval(0)) == ("vllm", "prompt-tail", "compute", None)
    assert serving_options.parse("retention=32").retention_interval(0) == 32
    assert serving_options.parse("rules=vllm").retention_interval(0) == 0  # vLLM's configured value
    manager = manager_for(ATTENTION, options=serving_options.parse("rules=vllm"))
    assert manager.manager.layout.config.attention_keys == "prompt-tail"
