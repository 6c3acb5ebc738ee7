"""The coordinator's idle steps (``RunningRequest.idle_until``): a running request's step
that needs no block and keys nothing skips every group's manager. Checked two ways: replays
with the skip and without it (every manager's ``idle_until`` replaced by the base class's,
which skips nothing) plan the same steps and leave the pool in the same state after every
step; and the slow-tier check INV-IDLE-STEP fires when a manager claims an idle range it does
not have. Cases worked out by hand check the other direction: a range ends right before the
first step that needs a block, keys one or releases one, so no idle step reaches a manager."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproof.impl.coordinator import HybridCoordinator
from kvproof.impl.kv_cache_manager import KVCacheManager
from kvproof.impl.managers import MANAGER_FOR_KIND, SingleTypeManager
from kvproof.impl.request import Request
from kvproof.impl.scheduler import CapacityError
from kvproof.sim.drive import run_chunk
from kvproof.sim.replay import replay
from kvproof.sim.trace import TraceRequest
from kvproof.spec import contracts
from kvproof.spec.contracts import InvariantViolation
from kvproof.spec.groups import CacheGroup, GroupKind, MambaCacheMode
from kvproof.spec.layout import LayoutConfig, resolve_layout

from ..conftest import REACH_SETTINGS


#: Which groups a layout has: attention alone, with each Mamba mode (align, align with
#: speculative blocks, 'none') and with a window, and Mamba or a window alone, so that each
#: manager's own bound decides the idle range in some layouts, not attention's lower one.
SHAPES = ("attention", "attention+align", "attention+speculative", "attention+none", "attention+window",
          "attention+speculative+window", "attention+none+window", "align", "speculative", "window")


@st.composite
def layouts(draw):
    """A layout of one of ``SHAPES``: every manager that has an idle range."""
    dcp = draw(st.sampled_from([1, 2, 4]))
    block = draw(st.sampled_from([1, 2, 4, 4]))
    shape = draw(st.sampled_from(SHAPES)).split("+")
    groups = []
    if "attention" in shape:
        groups.append(CacheGroup(draw(st.sampled_from([GroupKind.FULL_ATTENTION, GroupKind.MLA])), block))
    mamba = next((part for part in shape if part in ("align", "speculative", "none")), None)
    if mamba is not None:
        groups.append(CacheGroup(
            GroupKind.MAMBA, block * draw(st.sampled_from([1, 2, 4])),
            mamba_cache_mode=MambaCacheMode.NONE if mamba == "none" else MambaCacheMode.ALIGN,
            num_speculative_blocks=2 if mamba == "speculative" else 0,
        ))
    if "window" in shape:
        # Window blocks and slides off attention's grid (a window block up to 8, windows not a
        # block plus one), so that the window's idle bound is sometimes the lowest.
        groups.append(CacheGroup(GroupKind.SLIDING_WINDOW, draw(st.sampled_from([4, 8])), dcp_sharded=False,
                                 sliding_window=draw(st.sampled_from([5, 9, 11]))))
    sharded = any(g.kind in (GroupKind.FULL_ATTENTION, GroupKind.MLA) for g in groups)
    finer = sharded and block * dcp > 1 and draw(st.booleans())
    return LayoutConfig(
        tuple(groups), dcp=dcp if sharded else 1, max_model_len=512,
        hash_block_size=(block // 2 or 1) if finer else None,
        retention_interval=draw(st.sampled_from([None, 0])),
        attention_keys=draw(st.sampled_from(["every-hash", "chunk-ends", "prompt-tail"])),
    )


_KIND_NAMES = {GroupKind.FULL_ATTENTION: "attention", GroupKind.MLA: "attention", GroupKind.MAMBA: "mamba",
               GroupKind.SLIDING_WINDOW: "sliding window"}


@st.composite
def traces(draw):
    """Requests on shared prefixes with long decodes (the idle steps), some arriving together so
    that small pools preempt running requests."""
    fresh = itertools.count(1000)
    bases = [tuple(next(fresh) for _ in range(draw(st.integers(1, 24)))) for _ in range(2)]
    trace, arrival = [], 0
    for i in range(draw(st.integers(1, 6))):
        prompt = draw(st.sampled_from(bases))[: draw(st.integers(1, 24))] + tuple(next(fresh) for _ in range(draw(st.integers(0, 12))))
        outputs = tuple(next(fresh) for _ in range(draw(st.integers(0, 40))))
        arrival += draw(st.sampled_from([0, 1, 3, 40]))
        trace.append(TraceRequest(f"r{i}", prompt, outputs, arrival))
    return trace


def _run(config, trace, num_blocks, budget, eagle):
    """Replay; returns what every step planned and the pool after every step (keys and reference
    counts), the hits, and the replay's end (finished, or the error it raised)."""
    layout = resolve_layout(config)
    steps = []

    def on_step(plan, sched):
        pool = sched.kv.pool
        chunks = [(c.request.request_id, c.start, c.num_tokens, c.new_blocks, c.overwrite) for c in plan.chunks]
        state = [(pool.key_of(b), pool.ref_count(b)) for b in range(1, pool.num_blocks)]
        steps.append((plan.step, chunks, plan.copies, [r.request_id for r in plan.preempted], state))

    try:
        result = replay(trace, layout, num_blocks=num_blocks, max_num_batched_tokens=budget, use_eagle=eagle, on_step=on_step)
    except CapacityError as e:
        return steps, None, f"CapacityError: {e}"
    return steps, [r.num_cached_tokens for r in result.requests], result.violations


@settings(max_examples=200, **REACH_SETTINGS)
@given(config=layouts(), trace=traces(), num_blocks=st.sampled_from([16, 24, 48, 512]), budget=st.sampled_from([4, 16, 64]),
       eagle=st.booleans())
def test_idle_steps_change_nothing(config, trace, num_blocks, budget, eagle, reach, monkeypatch):
    """Skipping idle steps plans the same steps, copies, preemptions and hits, and leaves the
    same keys and reference counts in the pool after every step, as running every manager on
    every step does. The slow switch is on (the suite's default), so every skipped step is also
    checked by INV-IDLE-STEP."""
    # Low floors that prove each case is reached: how often varies a lot from seed to seed.
    reach.minimums = {"idle steps skipped": 60, "idle: mamba speculative": 4, "idle: mamba mode none": 6,
                      "idle: sliding window": 10, "preempted": 5, "idle: eagle": 25,
                      "idle bound set by: attention": 8, "idle bound set by: mamba": 5,
                      "idle bound set by: sliding window": 8, "idle: prompt-tail keys inside a block": 3}
    skipped, binding = [], set()
    check_idle, cache = HybridCoordinator._check_idle, HybridCoordinator.cache

    def counted(self, request, total_tokens):
        skipped.append(request.request_id)
        return check_idle(self, request, total_tokens)

    def noting_the_lowest_bound(self, request, num_computed):
        """After a ``cache`` that did work: which group alone set the idle range (its bound
        below every other group's), so that each manager's bound is seen deciding it."""
        worked = num_computed > self.idle_until(request)
        running = cache(self, request, num_computed)
        if worked:
            bounds = sorted((m.idle_until(request, num_computed), m.group.kind) for m in self.managers)
            if bounds[0][0] > num_computed and (len(bounds) == 1 or bounds[0][0] < bounds[1][0]):
                binding.add(bounds[0][1])
        return running

    with monkeypatch.context() as m:
        m.setattr(HybridCoordinator, "_check_idle", counted)
        m.setattr(HybridCoordinator, "cache", noting_the_lowest_bound)
        with_skip = _run(config, trace, num_blocks, budget, eagle)
    with monkeypatch.context() as m:
        for cls in MANAGER_FOR_KIND.values():
            m.setattr(cls, "idle_until", SingleTypeManager.idle_until)
        without = _run(config, trace, num_blocks, budget, eagle)
    assert with_skip[2] in ([], None) or with_skip[2].startswith("CapacityError"), with_skip[2]
    assert len(with_skip[0]) == len(without[0])
    for ours, full in zip(with_skip[0], without[0]):
        assert ours == full, f"step {full[0]} differs with idle steps skipped"
    assert with_skip[1:] == without[1:]
    if skipped:
        reach("idle steps skipped")
        kinds = {g.kind for g in config.groups}
        mamba = next((g for g in config.groups if g.kind is GroupKind.MAMBA), None)
        if mamba is not None and mamba.num_speculative_blocks:
            reach("idle: mamba speculative")
        if mamba is not None and mamba.mamba_cache_mode is MambaCacheMode.NONE:
            reach("idle: mamba mode none")
        if GroupKind.SLIDING_WINDOW in kinds:
            reach("idle: sliding window")
        if eagle:
            reach("idle: eagle")
        if config.attention_keys == "prompt-tail" and config.hash_block_size and GroupKind.FULL_ATTENTION in kinds:
            reach("idle: prompt-tail keys inside a block")
    for kind in binding:
        reach(f"idle bound set by: {_KIND_NAMES[kind]}")
    if any(step[3] for step in with_skip[0]):
        reach("preempted")


def test_a_request_not_running_is_idle_nowhere():
    """``HybridCoordinator.idle_until`` of a request never admitted, or freed, is 0: no step of it skips."""
    config = LayoutConfig((CacheGroup(GroupKind.FULL_ATTENTION, 4),), max_model_len=512)
    kv = KVCacheManager(resolve_layout(config), 64)
    r = Request("r", tuple(range(6)), kv.layout.hash_block_size)
    assert kv.coordinator.idle_until(r) == 0
    assert run_chunk(kv, r, 6).blocks is not None and kv.coordinator.idle_until(r) > 6
    kv.free(r)
    assert kv.coordinator.idle_until(r) == 0


def test_a_claimed_idle_range_that_needs_blocks_is_caught():
    """INV-IDLE-STEP: a manager whose ``idle_until`` overstates its range (here attention
    claiming every length idle, so its row would stop growing) is caught on the first skipped
    step that needs a block, with the slow switch on; with it off the skip goes unchecked."""
    config = LayoutConfig((CacheGroup(GroupKind.FULL_ATTENTION, 4),), dcp=1, max_model_len=512)

    def run(slow: bool):
        kv = KVCacheManager(resolve_layout(config), 64)
        kv.coordinator.managers[0].idle_until = lambda request, num_computed: 1 << 30
        req = Request("r", tuple(range(6)), kv.layout.hash_block_size)
        with contracts.slow_checks(slow):
            run_chunk(kv, req, 6)
            for token in range(6, 12):
                req.append_output(100 + token)
                run_chunk(kv, req, 1)
        return kv

    with pytest.raises(InvariantViolation, match="INV-IDLE-STEP.*request 'r', group 0: a step to 9 tokens"):
        run(slow=True)
    kv = run(slow=False)
    assert len(kv.coordinator.managers[0].row("r")) == 2  # the lie went unnoticed: 12 tokens in 8 slots


def _decode(kv, request, prompt_len, end):
    """Compute ``prompt_len`` tokens in one step, then decode one token per step to ``end``."""
    assert run_chunk(kv, request, prompt_len).blocks is not None
    for token in range(prompt_len, end):
        request.append_output(100 + token)
        assert run_chunk(kv, request, 1).blocks is not None


def test_only_the_steps_that_need_a_block_or_complete_one_reach_the_manager(monkeypatch):
    """Attention, blocks of 4, decoding from 6 to 16 tokens: a step is idle unless it completes
    a block (8, 12, 16: keyed) or its token starts a new one (9, 13: a fresh block). The skip
    covers every other step, and only those."""
    config = LayoutConfig((CacheGroup(GroupKind.FULL_ATTENTION, 4),), max_model_len=512)
    kv = KVCacheManager(resolve_layout(config), 64)
    manager = kv.coordinator.managers[0]
    grown, keyed, released = [], [], []
    grow, key, release = manager.grow, manager.key, manager.release
    monkeypatch.setattr(manager, "grow", lambda request, total: grown.append(total) or grow(request, total))
    monkeypatch.setattr(manager, "key", lambda request, n: keyed.append(n) or key(request, n))
    monkeypatch.setattr(manager, "release", lambda request, n: released.append(n) or release(request, n))
    _decode(kv, Request("r", tuple(range(6)), kv.layout.hash_block_size), 6, 16)
    assert grown == [8, 9, 12, 13, 16]
    assert keyed == released == [6, 8, 9, 12, 13, 16]


@pytest.mark.parametrize("computed, idle_until", [
    (10, 11),  # at 12 the next token's window (8-12) no longer reads block 0: it is released
    (13, 15),  # at 16 block 1 is complete: it is keyed
    (16, 16),  # the row is full: the next token needs block 2
])
def test_a_window_is_idle_exactly_until_a_block_is_released_keyed_or_needed(computed, idle_until):
    config = LayoutConfig((CacheGroup(GroupKind.SLIDING_WINDOW, 8, sliding_window=5),), max_model_len=512)
    kv = KVCacheManager(resolve_layout(config), 64)
    r = Request("r", tuple(range(computed)), kv.layout.hash_block_size)
    _decode(kv, r, computed, computed)
    assert kv.coordinator.managers[0].idle_until(r, computed) == idle_until


@pytest.mark.parametrize("computed, idle_until", [
    (6, 7),  # at 8 the state reaches a hash boundary (and its block's end), where it may be kept
    (9, 11),  # the same at 12
])
def test_a_mamba_state_is_idle_exactly_until_a_boundary_where_it_may_be_kept(computed, idle_until):
    config = LayoutConfig((CacheGroup(GroupKind.MAMBA, 4),), max_model_len=512, retention_interval=None)
    kv = KVCacheManager(resolve_layout(config), 64)
    r = Request("r", tuple(range(computed)), kv.layout.hash_block_size)
    _decode(kv, r, computed, computed)
    assert kv.coordinator.managers[0].idle_until(r, computed) == idle_until
