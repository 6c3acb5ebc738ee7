"""kvproof's checks inside vLLM 0.33.0's real Scheduler (integrations/vllm/checked_scheduler.py,
manager_checks.py), driven by the engine harness: silent on clean runs, in agreement with the
content oracle on generated workloads, and each check shown to fire -- on vLLM 0.33.0's own
copy-on-write hazard (found by Hypothesis) and on seeded bugs, each beside an unmutated control."""

from __future__ import annotations


import pytest
from hypothesis import HealthCheck, Phase, event, find, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.utils.math_utils import cdiv  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import MambaManager  # noqa: E402
from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec  # noqa: E402

from kvproof.integrations.vllm.checked_scheduler import CheckedScheduler, install_checks  # noqa: E402
from kvproof.integrations.vllm.engine_harness import EngineHarness  # noqa: E402
from kvproof.integrations.vllm.worker_model import OracleHook  # noqa: E402
from kvproof.sim.trace import TraceRequest  # noqa: E402
from kvproof.spec.contracts import InvariantViolation  # noqa: E402
from kvproof.spec.groups import CacheGroup, GroupKind  # noqa: E402
from kvproof.spec.layout import LayoutConfig, resolve_layout  # noqa: E402

from .traces import conversations  # noqa: E402

FA, MLA, MAMBA = GroupKind.FULL_ATTENTION, GroupKind.MLA, GroupKind.MAMBA


@pytest.fixture(autouse=True)
def _checks_env(monkeypatch):
    monkeypatch.setenv("KVPROOF_CONTRACTS", "slow")
    monkeypatch.delenv("KVPROOF_ON_VIOLATION", raising=False)


def layout_for(groups, dcp=1, hash_block_size=None, max_model_len=4096, **options):
    return resolve_layout(LayoutConfig(tuple(groups), dcp=dcp, max_model_len=max_model_len,
                                       hash_block_size=hash_block_size, **options))




def run_checked(layout, trace, num_blocks=200, budget=64, scheduler_cls=CheckedScheduler, **kw):
    harness = EngineHarness(layout, num_blocks, max_num_batched_tokens=budget, scheduler_cls=scheduler_cls, **kw)
    return harness, harness.run(trace)


# --- clean runs are silent --------------------------------------------------------------------------

LAYOUTS = [
    ([CacheGroup(FA, 16)], None),
    ([CacheGroup(FA, 16), CacheGroup(MAMBA, 16)], None),
    ([CacheGroup(FA, 4), CacheGroup(MAMBA, 4)], 2),
    ([CacheGroup(MLA, 8), CacheGroup(MAMBA, 16)], 8),
]


@pytest.mark.parametrize("groups, h", LAYOUTS)
@pytest.mark.parametrize("dcp", [1, 2, 4])
def test_checks_stay_silent_on_one_request_at_a_time(groups, h, dcp):
    """Multi-turn chats, no two requests in flight together, a pool small enough to evict:
    every check (slow tier included) passes, and the checker saw every step and copy."""
    layout = layout_for(groups, dcp, hash_block_size=h)
    harness, result = run_checked(layout, conversations(dcp), num_blocks=60)
    checker = harness.kv_cache_manager._kvproof_checker
    assert checker.step == result.num_steps
    assert checker.num_copies == result.copies
    assert sum(result.num_cached_tokens.values()) > 0


# --- agreement with the content oracle ----------------------------------------------------------------

@st.composite
def workloads(draw, alphabet=st.integers(0, 3)):
    """Requests that share prefixes by construction (a prefix of an earlier prompt + output,
    then new tokens), arriving close together so that steps hold several of them."""
    reqs = []
    for i in range(draw(st.integers(2, 6))):
        if reqs and draw(st.booleans()):
            parent = draw(st.sampled_from(reqs))
            known = parent.prompt + parent.output
            pre = known[:draw(st.integers(1, len(known)))]
        else:
            pre = ()
        ext = tuple(draw(st.lists(alphabet, min_size=0 if pre else 1, max_size=12)))
        out = tuple(draw(st.lists(alphabet, max_size=3)))
        reqs.append(TraceRequest(f"r{i}", pre + ext, out, draw(st.integers(1, 4))))
    return reqs


@st.composite
def siblings(draw, alphabet=st.integers(0, 1)):
    """A producer, then siblings arriving together later that extend all or part of its prompt:
    the shape in which vLLM admits several requests onto one shared prefix in one step."""
    base = tuple(draw(st.lists(alphabet, min_size=2, max_size=24)))
    reqs = [TraceRequest("p", base, tuple(draw(st.lists(alphabet, max_size=2))), 1)]
    later = draw(st.integers(15, 40))
    for i in range(draw(st.integers(2, 4))):
        pre = base if draw(st.booleans()) else base[:draw(st.integers(1, len(base)))]
        ext = tuple(draw(st.lists(alphabet, min_size=1, max_size=10)))
        reqs.append(TraceRequest(f"s{i}", pre + ext, tuple(draw(st.lists(alphabet, max_size=2))),
                                 later + draw(st.integers(0, 1))))
    return reqs


AGREEMENT_COUNTS: dict[str, int] = {}


@settings(max_examples=400, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(dcp=st.sampled_from([1, 2, 4]), mamba=st.sampled_from([4, 8]), eagle=st.booleans(),
       retention=st.sampled_from([0, 0, None]), budget=st.sampled_from([16, 64, 64]),
       trace=st.one_of(workloads(alphabet=st.integers(0, 2)), siblings(st.just(0)), siblings()))
def test_scheduler_checks_and_the_content_oracle_agree(monkeypatch_env, dcp, mamba, eagle, retention, budget, trace):
    """The scheduler-side readiness model (INV-COW-SOURCE-READY, INV-CONTENT-STATE) and the worker
    model (kvproof's content oracle fed vLLM's SchedulerOutputs) are independent; on every
    workload they must flag the same first step, or both none."""
    layout = layout_for([CacheGroup(FA, 4), CacheGroup(MAMBA, mamba)], dcp, hash_block_size=2,
                        max_model_len=512, retention_interval=retention)
    hook = OracleHook(layout)
    harness = EngineHarness(layout, 96, max_num_batched_tokens=budget, scheduler_cls=CheckedScheduler,
                            hooks=[hook], use_eagle=eagle)
    checker = harness.kv_cache_manager._kvproof_checker
    harness.run(trace)
    found = {int(m.split(": step ")[1].split(",")[0].split(":")[0]) for m in checker.sink.messages}
    first_checker = min(found) if found else None
    first_oracle = min(hook.violations_by_step) if hook.violations_by_step else None
    for label, hit in (("copy", checker.num_copies > 0), ("violation", first_checker is not None),
                       ("multi-request step", any(len(s.chunks) > 1 for s in harness.result().steps))):
        if hit:
            event(label)
            AGREEMENT_COUNTS[label] = AGREEMENT_COUNTS.get(label, 0) + 1
    assert first_checker == first_oracle, (checker.sink.messages[:2], hook.violations_by_step)


@pytest.fixture
def monkeypatch_env(monkeypatch):
    monkeypatch.setenv("KVPROOF_ON_VIOLATION", "log")


def test_the_agreement_run_reaches_the_hard_cases():
    """The fixed-seed agreement run above must reach copies, multi-request steps and real
    violations often enough to mean something (runs after it in file order)."""
    if not AGREEMENT_COUNTS:
        pytest.skip("runs only together with test_scheduler_checks_and_the_content_oracle_agree")
    assert AGREEMENT_COUNTS.get("copy", 0) >= 200
    assert AGREEMENT_COUNTS.get("multi-request step", 0) >= 250
    assert AGREEMENT_COUNTS.get("violation", 0) >= 3, AGREEMENT_COUNTS


# --- vLLM 0.33.0's copy-on-write hazard (docs/vllm-semantics.md §10.1) ----------------------------

COW_LAYOUT = dict(groups=[CacheGroup(FA, 4), CacheGroup(MAMBA, 4)], hash_block_size=2, max_model_len=256)


def _copies_an_unwritten_block(case) -> bool:
    dcp, trace = case
    try:
        run_checked(layout_for(dcp=dcp, **COW_LAYOUT), trace, num_blocks=64)
    except InvariantViolation as e:
        return e.inv_id == "INV-COW-SOURCE-READY"
    return False


def test_hypothesis_finds_a_copy_of_a_block_not_yet_written():
    """Search vLLM's real Scheduler (FA 4 + Mamba 4, H 2, DCP 1/2/4) for a workload on which it
    copies a block that the same step's forward pass is still to write; the check must name
    INV-COW-SOURCE-READY. A fixed-seed search of at most 400 workloads finds one."""
    case = find(
        st.tuples(st.sampled_from([1, 2, 4]), workloads(alphabet=st.just(0))),
        _copies_an_unwritten_block,
        settings=settings(max_examples=400, database=None, deadline=None, derandomize=True,
                          suppress_health_check=list(HealthCheck), phases=[Phase.generate]),
    )
    assert _copies_an_unwritten_block(case)


#: What the search found (shrunk): three prompts of zeros; at step 23, r2 and r1 are admitted
#: together with a hit of 10; r2 copies its partial attention block 4 -> 5 and keys block 5 at its
#: prompt tail; r1 finds that key, the joint hit shrinks to the Mamba state at 10, and r1 copies
#: block 5 -> 8 -- from a block that is itself the destination of a copy of the same batch.
PINNED_COW_TRACE = [TraceRequest("r0", (0,) * 11, (), 20), TraceRequest("r1", (0,) * 13, (), 21),
                    TraceRequest("r2", (0,) * 17, (), 20)]


def test_vllm_copy_of_an_unwritten_block_is_reported_with_request_step_and_blocks():
    with pytest.raises(InvariantViolation) as info:
        run_checked(layout_for(dcp=1, **COW_LAYOUT), PINNED_COW_TRACE, num_blocks=64)
    assert info.value.inv_id == "INV-COW-SOURCE-READY"
    assert "step 23, request 'r1', group 0 (full_attention:4): copy 5 -> 8" in str(info.value)


def test_the_content_oracle_sees_the_same_hazard_and_vllm_alone_does_not():
    """Control: vLLM without the checks runs the pinned workload to the end; the worker model
    finds r1 reading attention KV that its copy never delivered, in the same step."""
    layout = layout_for(dcp=1, **COW_LAYOUT)
    hook = OracleHook(layout)
    result = EngineHarness(layout, 64, max_num_batched_tokens=64, hooks=[hook]).run(PINNED_COW_TRACE)
    assert result.num_cached_tokens == {"r0": 0, "r1": 10, "r2": 10}
    assert min(hook.violations_by_step) == 23
    assert "INV-CONTENT-KV: request 'r1'" in hook.violations_by_step[23][0]


# --- start-up geometry ------------------------------------------------------------------------------

def _pre_fix_width(self, vllm_config, max_model_len):
    """The old rule: every group's row divided by DCP (docs/vllm-semantics.md §6.3, example 2)."""
    dcp = vllm_config.parallel_config.decode_context_parallel_size
    return cdiv(max_model_len, self.block_size * dcp)


def test_pre_fix_width_rule_fails_start_up_naming_both_widths(monkeypatch):
    """1M context, DCP 8, 16-token Mamba: vLLM's width rule patched back to dividing every group
    by DCP sizes the Mamba row at 8,192 entries where 65,536 are needed."""
    layout = layout_for([CacheGroup(FA, 16), CacheGroup(MAMBA, 16)], dcp=8, max_model_len=1 << 20)
    EngineHarness(layout, 64, scheduler_cls=CheckedScheduler)  # control: the real rule passes
    monkeypatch.setattr(MambaSpec, "max_num_blocks_per_req", _pre_fix_width)
    monkeypatch.setattr(AttentionSpec, "max_num_blocks_per_req", _pre_fix_width)
    with pytest.raises(InvariantViolation, match=r"INV-TABLE-WIDTH: group 1 \(mamba:16\): vLLM sizes the block-table "
                                                 r"row at 8,192 entries; kvproof's geometry needs 65,536"):
        EngineHarness(layout, 64, scheduler_cls=CheckedScheduler)


def _mutant(mutate):
    """A Scheduler whose state is corrupted by ``mutate`` before the checks are installed."""
    class Mutant(Scheduler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            mutate(self)
            install_checks(self)
    return Mutant


@pytest.mark.parametrize("inv, mutate", [
    ("INV-GEOM-EFFECTIVE-BLOCK", lambda s: setattr(s.kv_cache_manager.coordinator.single_type_managers[1], "block_size", 8)),
    ("INV-GEOM-SCHED-LCM", lambda s: setattr(s, "block_size", 64)),
    ("INV-GEOM-HASH-DIVIDES", lambda s: setattr(s, "hash_block_size", 8)),
    ("INV-GEOM-PARTIAL-RULE", lambda s: setattr(s.kv_cache_manager.coordinator, "enable_partial_hash_hits", False)),
    ("INV-GEOM-HIT-ALIGN", lambda s: setattr(s.kv_cache_manager.coordinator.single_type_managers[0],
                                             "cache_hit_alignment_tokens", 32)),
])
def test_each_geometry_check_fires_on_a_seeded_bug(inv, mutate):
    layout = layout_for([CacheGroup(FA, 16), CacheGroup(MAMBA, 16)], dcp=2)
    EngineHarness(layout, 64, scheduler_cls=_mutant(lambda s: None))  # control
    with pytest.raises(InvariantViolation, match=inv):
        EngineHarness(layout, 64, scheduler_cls=_mutant(mutate))


# --- per-call checks on seeded bugs -----------------------------------------------------------------

HYBRID = [CacheGroup(FA, 16), CacheGroup(MAMBA, 16)]
REPLAY = [TraceRequest("a", tuple(range(100)), (1, 2), 1), TraceRequest("b", tuple(range(90)) + (7, 8), (3,), 20),
          TraceRequest("c", tuple(range(100)) + (1, 9), (4,), 40)]


def _run_with(mutate, trace=REPLAY, groups=HYBRID, **kw):
    """Run ``trace`` through the checked scheduler after ``mutate(scheduler)`` (a seeded bug)."""
    layout = layout_for(groups, **kw)
    harness = EngineHarness(layout, 64, max_num_batched_tokens=64, scheduler_cls=CheckedScheduler)
    mutate(harness.scheduler)
    return harness.run(trace)


def _wrap_coordinator_hit(change):
    def mutate(scheduler):
        coordinator = scheduler.kv_cache_manager.coordinator
        find_hit = coordinator.find_longest_cache_hit

        def buggy(*args, **kwargs):
            return change(*find_hit(*args, **kwargs))
        coordinator.find_longest_cache_hit = buggy
    return mutate


def _take_a_block_when_short(scheduler):
    """A sizing step that takes a block even when the allocation then fails."""
    coordinator = scheduler.kv_cache_manager.coordinator
    count = coordinator.get_num_blocks_to_allocate

    def buggy(*args, **kwargs):
        n = count(*args, **kwargs)
        if n > coordinator.block_pool.get_num_free_blocks():
            coordinator.block_pool.get_new_blocks(1)
        return n
    coordinator.get_num_blocks_to_allocate = buggy


def _free_twice(scheduler):
    kvm = scheduler.kv_cache_manager
    pool, coordinator = kvm.block_pool, kvm.coordinator
    free = coordinator.free

    def buggy(request_id):
        held = [list(m.req_to_blocks.get(request_id, ())) for m in coordinator.single_type_managers]
        free(request_id)
        pool.free_blocks(reversed(held[0]))  # a second release of the attention row
    coordinator.free = buggy


def _forget_one_group(scheduler):
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    managers[1].free = lambda request_id: None


def _overlong_request(scheduler):
    """A request past max_model_len, as if vLLM's length checks were skipped."""
    scheduler.max_model_len = scheduler.kv_cache_manager.max_model_len = 1 << 20
    for m in scheduler.kv_cache_manager.coordinator.single_type_managers:
        m.max_model_len = 1 << 20


@pytest.mark.parametrize("inv, mutate, trace", [
    ("INV-HIT-BOUND", _wrap_coordinator_hit(lambda blocks, hit, uncached: (blocks, hit + 1 if hit else hit, uncached)), REPLAY),
    ("INV-HIT-BLOCKS", _wrap_coordinator_hit(lambda blocks, hit, uncached: (tuple(b[:-1] for b in blocks), hit, uncached)), REPLAY),
    ("INV-JUNCTION", _wrap_coordinator_hit(lambda blocks, hit, uncached: (blocks, hit, uncached or 3)), REPLAY),
    ("INV-ALLOC-ATOMIC", _take_a_block_when_short, [TraceRequest("x", tuple(range(1500)), (1,), 1)]),
    ("INV-POOL-REF-NONNEG", _free_twice, REPLAY),
    ("INV-FREE-RELEASES", _forget_one_group, REPLAY),
])
def test_each_per_call_check_fires_on_a_seeded_bug(inv, mutate, trace):
    _run_with(lambda s: None, trace=REPLAY)  # control
    with pytest.raises(InvariantViolation, match=inv):
        _run_with(mutate, trace=trace)


def test_row_width_check_fires_when_a_request_outgrows_max_model_len():
    layout = layout_for([CacheGroup(FA, 16)], max_model_len=64)
    harness = EngineHarness(layout, 64, max_num_batched_tokens=128, scheduler_cls=CheckedScheduler)
    _overlong_request(harness.scheduler)
    harness._expected["long"] = (1,)
    harness.scheduler.add_request(harness._vllm_request(TraceRequest("long", tuple(range(100)), (1,), 1)))
    with pytest.raises(InvariantViolation, match=r"INV-TABLE-WIDTH: step 1, request 'long', group 0 \(full_attention:16\): "
                                                 r"the row grows to 7 entries, past the worker's width of 4"):
        harness.step()


class _Forgetful(set):
    def add(self, item):  # the same-step Mamba deferral never sees a key
        pass


def test_mamba_state_read_check_fires_without_vllms_same_step_deferral(monkeypatch):
    """vLLM defers a hit on a Mamba state cached in the same step (the state does not exist
    before the forward pass). With that guard seeded out, two identical prompts admitted together
    make the second read a state nobody has written yet."""
    layout = layout_for([CacheGroup(FA, 4), CacheGroup(MAMBA, 4)], hash_block_size=2)
    twins = [TraceRequest("r0", (0,) * 5, (), 1), TraceRequest("r1", (0,) * 5, (), 1)]
    run_checked(layout, twins, num_blocks=64)  # control: vLLM defers r1 by one step
    init = MambaManager.__init__

    def forgetful_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.cached_blocks_this_step = _Forgetful()
    monkeypatch.setattr(MambaManager, "__init__", forgetful_init)
    with pytest.raises(InvariantViolation, match=r"INV-CONTENT-STATE: step 1, request 'r1', group 1 \(mamba:4\): "
                                                 r"the chunk starting at 4 reads block \d+ at row index 0, which holds no state"):
        run_checked(layout, twins, num_blocks=64)


# --- slow tier on corrupted state ------------------------------------------------------------------

def _corrupt_after(step, corrupt):
    def mutate(scheduler):
        kvm = scheduler.kv_cache_manager
        start = kvm.new_step_starts
        seen = [0]

        def counting():
            seen[0] += 1
            if seen[0] == step:
                corrupt(kvm)
            return start()
        kvm.new_step_starts = counting
    return mutate


def _first_queued(kvm):
    return kvm.block_pool.free_block_queue.fake_free_list_head.next_free_block


def _listed_twice(kvm):
    """A row that lists one block twice (one reference, two holders)."""
    row = next(iter(kvm.coordinator.single_type_managers[0].req_to_blocks.values()))
    row.append(row[0])


@pytest.mark.parametrize("inv, corrupt", [
    ("INV-POOL-FREE-IFF-UNREF", lambda kvm: setattr(_first_queued(kvm), "ref_cnt", 1)),
    ("INV-POOL-CONSERVE", lambda kvm: setattr(kvm.block_pool.free_block_queue, "num_free_blocks",
                                              kvm.block_pool.free_block_queue.num_free_blocks + 1)),
    ("INV-TABLE-HELD", _listed_twice),
    ("INV-FREE-RELEASES", lambda kvm: kvm.block_pool.get_new_blocks(1)),
])
def test_each_whole_state_check_fires_on_corrupted_state(inv, corrupt):
    trace = [TraceRequest("a", tuple(range(100)), tuple(range(10)), 1)]
    _run_with(lambda s: None, trace=trace, groups=[CacheGroup(FA, 16)])  # control
    with pytest.raises(InvariantViolation, match=inv):
        _run_with(_corrupt_after(5, corrupt), trace=trace, groups=[CacheGroup(FA, 16)])


def test_cheap_tier_skips_the_whole_state_checks(monkeypatch):
    """The leak above goes unnoticed in the cheap tier (no whole-state walk per step)."""
    monkeypatch.setenv("KVPROOF_CONTRACTS", "cheap")
    trace = [TraceRequest("a", tuple(range(100)), tuple(range(10)), 1)]
    result = _run_with(_corrupt_after(5, lambda kvm: kvm.block_pool.get_new_blocks(1)), trace=trace,
                       groups=[CacheGroup(FA, 16)])
    assert result.steps[-1].finished == ("a",)


def test_log_mode_counts_and_keeps_going(monkeypatch):
    """Logged, counted (also in the process's Prometheus registry, which vLLM's /metrics reads),
    and the run goes on."""
    from prometheus_client import REGISTRY

    def exported():
        return REGISTRY.get_sample_value("kvproof_violations_total", {"invariant": "INV-COW-SOURCE-READY"}) or 0

    monkeypatch.setenv("KVPROOF_ON_VIOLATION", "log")
    layout = layout_for(dcp=1, **COW_LAYOUT)
    before = exported()
    harness, result = run_checked(layout, PINNED_COW_TRACE, num_blocks=64)
    sink = harness.kv_cache_manager._kvproof_checker.sink
    assert sink.counts["INV-COW-SOURCE-READY"] == 2
    assert exported() - before == 2
    assert set(result.num_cached_tokens) == {"r0", "r1", "r2"}


@pytest.mark.parametrize("name, value, match", [
    ("KVPROOF_CONTRACTS", "fast", "KVPROOF_CONTRACTS='fast'; expected one of cheap, slow"),
    ("KVPROOF_ON_VIOLATION", "ignore", "KVPROOF_ON_VIOLATION='ignore'; expected one of raise, log"),
])
def test_bad_switches_are_rejected_by_name(monkeypatch, name, value, match):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=match):
        EngineHarness(layout_for(HYBRID), 64, scheduler_cls=CheckedScheduler)


def test_checks_attach_once():
    harness = EngineHarness(layout_for(HYBRID), 64, scheduler_cls=CheckedScheduler)
    checker = harness.kv_cache_manager._kvproof_checker
    assert install_checks(harness.scheduler) is checker
    assert isinstance(harness.kv_cache_manager, KVCacheManager)


def test_checks_that_cannot_be_installed_stop_the_scheduler_at_construction():
    """A cache group kvproof has no model of: asking for checks then fails (KV connectors are
    checked: tests/vllm/test_checked_connector.py)."""
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    from kvproof.integrations.vllm.kv_specs import group_for_spec

    spec = ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16,
                                     attention_chunk_size=64)
    with pytest.raises(ValueError, match="KV-cache group 2 has a ChunkedLocalAttentionSpec; kvproof models full "
                                         "attention, MLA, sliding window and Mamba groups only"):
        group_for_spec(spec, 2)
