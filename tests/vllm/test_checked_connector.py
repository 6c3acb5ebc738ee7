"""kvproof's checks on vLLM's real Scheduler with a KV connector: tokens the connector writes
(``num_external_computed_tokens``), loaded within the step or between steps, are part of the
readiness model, so the checks stay on with ``--kv-transfer-config``."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvproof.integrations.vllm.checked_scheduler import CheckedScheduler  # noqa: E402
from kvproof.integrations.vllm.engine_harness import EngineHarness, StepHook  # noqa: E402
from kvproof.spec.contracts import InvariantViolation  # noqa: E402
from kvproof.spec.groups import CacheGroup, GroupKind  # noqa: E402
from kvproof.spec.layout import LayoutConfig, resolve_layout  # noqa: E402

from .traces import conversations  # noqa: E402

FA, MLA, MAMBA = GroupKind.FULL_ATTENTION, GroupKind.MLA, GroupKind.MAMBA

LAYOUTS = {
    "attention": ([CacheGroup(FA, 16)], 1),
    "hybrid": ([CacheGroup(FA, 16), CacheGroup(MAMBA, 16)], 1),
    "hybrid-dcp2": ([CacheGroup(MLA, 8), CacheGroup(MAMBA, 16)], 2),
}


@pytest.fixture(autouse=True)
def _checks_env(monkeypatch):
    monkeypatch.setenv("KVPROOF_CONTRACTS", "slow")
    monkeypatch.delenv("KVPROOF_ON_VIOLATION", raising=False)


def connector(is_async: bool, external_blocks: int = 2, block_size: int = 16) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="StandInConnector", kv_role="kv_both",
        kv_connector_module_path="kvproof.integrations.vllm.stand_in_connector",
        kv_connector_extra_config={"external_blocks": external_blocks, "block_size": block_size, "is_async": is_async},
    )


def harness_for(name: str, is_async: bool, scheduler_cls=CheckedScheduler, **kw) -> EngineHarness:
    groups, dcp = LAYOUTS[name]
    layout = resolve_layout(LayoutConfig(tuple(groups), dcp=dcp, max_model_len=4096))
    block = min(g.effective_block_size for g in layout.groups)
    return EngineHarness(layout, 200, max_num_batched_tokens=64, scheduler_cls=scheduler_cls,
                         kv_transfer_config=connector(is_async, block_size=max(block, layout.cache_hit_alignment)), **kw)


class _SeesLoads(StepHook):
    """Counts the requests that were waiting for a load when a step was scheduled."""

    def __init__(self):
        self.waited = set()

    def scheduled(self, harness, step, output):
        self.waited |= {r.request_id for r in harness.scheduler.requests.values()
                        if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("is_async, load_steps", [(False, 1), (True, 1), (True, 3)], ids=["sync", "async", "async-slow"])
def test_checks_stay_silent_with_a_connector(name, is_async, load_steps):
    """Whole-state checks every step, sync and async loads (arriving in one step or three),
    attention only and hybrid (the Mamba state a chunk starts from is the one the connector
    loaded)."""
    seen = _SeesLoads()
    harness = harness_for(name, is_async, hooks=[seen], kv_load_steps=load_steps)
    trace = conversations(3, num=3, turns=3)
    result = harness.run(trace)
    loads = harness.scheduler.connector.loads
    assert len(loads) >= 3 and all(n > 0 for n in loads.values())  # the connector loaded for several requests
    assert bool(seen.waited) == is_async and (not is_async or seen.waited <= set(loads))
    checker = harness.kv_cache_manager._kvproof_checker
    assert not checker.sink.counts  # raise mode: a violation would have stopped the run
    assert not checker._loads and not checker._arrived  # every load arrived and was applied
    assert set(result.num_cached_tokens) == {t.id for t in trace}


def _no_load_modelling(monkeypatch):
    """The checker as it was before loads were modelled: external tokens count as nobody's write."""
    from kvproof.integrations.vllm import manager_checks

    original = manager_checks.ManagerChecker._allocate_slots

    def allocate_slots(self, original_call, request, num_new_tokens, num_new_computed_tokens=0,
                       new_computed_blocks=None, num_lookahead_tokens=0, num_external_computed_tokens=0, *args, **kwargs):
        result = original(self, original_call, request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                          num_lookahead_tokens, num_external_computed_tokens, *args, **kwargs)
        self._loads.pop(request.request_id, None)
        return result
    monkeypatch.setattr(manager_checks.ManagerChecker, "_allocate_slots", allocate_slots)


def test_without_the_load_model_a_loaded_mamba_state_reads_as_missing(monkeypatch):
    """The silent async hybrid run above depends on the load model: with loads dropped, the
    first chunk after a load reads a state nobody wrote (INV-CONTENT-STATE)."""
    _no_load_modelling(monkeypatch)
    harness = harness_for("hybrid", is_async=True)
    with pytest.raises(InvariantViolation, match=r"INV-CONTENT-STATE: step \d+, request '[^']+', group 1 \(mamba:16\): "
                                                 r"the chunk starting at \d+ reads block \d+ at row index \d+, which holds no state"):
        harness.run(conversations(3, num=3, turns=3))


class _EagerPromotion(CheckedScheduler):
    """A seeded vLLM bug: a request waiting for remote KV is promoted (and its blocks cached)
    as soon as it is looked at, before the worker side reports the load received."""

    def _handle_blocked_waiting_request(self, request):
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            self.finished_recving_kv_req_ids.add(request.request_id)
        return super()._handle_blocked_waiting_request(request)


@pytest.mark.parametrize("name", ["attention", "hybrid"])
def test_caching_a_load_before_it_arrived_is_reported(name):
    with pytest.raises(InvariantViolation, match=r"INV-CONNECTOR-LOAD-ARRIVED: step \d+, request '[^']+': vLLM caches "
                                                 r"\d+ computed tokens while the connector's load into its blocks is "
                                                 r"still in flight"):
        harness_for(name, is_async=True, scheduler_cls=_EagerPromotion, kv_load_steps=3).run(conversations(3, num=3, turns=3))


def test_bad_connector_options_are_refused_by_name():
    with pytest.raises(ValueError, match="StandInConnector: external_blocks 0 must be an integer >= 1"):
        groups, dcp = LAYOUTS["attention"]
        EngineHarness(resolve_layout(LayoutConfig(tuple(groups), dcp=dcp, max_model_len=4096)), 64,
                      scheduler_cls=CheckedScheduler, kv_transfer_config=connector(False, external_blocks=0))
