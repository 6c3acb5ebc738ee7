"""The ``reuse`` checkpoint policy served inside vLLM 0.33.0's real Scheduler: kvproof's manager
(``KVPROOF_OPTIONS="checkpoints=reuse"``) with kvproof's Scheduler split
(integrations/vllm/kvproof_scheduler.py), against stock vLLM's Scheduler and manager.

On generated sequential multi-turn traffic (continuations, next turns that drop a tail of the
previous prompt, siblings, resends), with the manager's slow contracts and the content oracle on:
no violation, every chunk crossing a rung of the prompt's ladder (``spec.checkpoints``) ends
there and the manager keeps the state, and no request caches fewer tokens than with stock vLLM
except in the named class *earlier longer hit* (docs/coordinator.md), which is counted (the
random profile's runs reach it now and then; ``EARLIER_LONGER_HIT`` is one, shortened).
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from kvproof.impl.hashing import key_at  # noqa: E402
from kvproof.integrations.vllm import serving_options  # noqa: E402
from kvproof.integrations.vllm.engine_harness import EngineHarness, StepHook  # noqa: E402
from kvproof.integrations.vllm.kvproof_scheduler import KvproofScheduler  # noqa: E402
from kvproof.integrations.vllm.parity import (  # noqa: E402
    ParityOptions,
    behind_without_earlier_longer_hit,
    run_served,
    run_vllm,
)
from kvproof.sim.trace import TraceRequest  # noqa: E402
from kvproof.spec.checkpoints import REUSE, checkpoint_unit, policy_budget, turn_end_rungs  # noqa: E402
from kvproof.spec.contracts import slow_checks  # noqa: E402
from kvproof.spec.groups import CacheGroup, GroupKind  # noqa: E402
from kvproof.spec.layout import LayoutConfig, resolve_layout  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402

from ..conftest import REACH_SETTINGS  # noqa: E402

FA, MLA, MAMBA = GroupKind.FULL_ATTENTION, GroupKind.MLA, GroupKind.MAMBA
REUSE_OPTIONS = serving_options.parse("checkpoints=reuse")


# --- the option ------------------------------------------------------------------------------------

def test_the_checkpoints_option_selects_the_policy_and_rule_sets_fix_it():
    assert serving_options.parse("").checkpoints == "vllm"  # the default (docs/vllm.md says why)
    assert serving_options.parse("checkpoints=reuse").checkpoints == "reuse"
    assert serving_options.parse("checkpoints=reuse,rules=vllm").checkpoints == "vllm"  # rules= fixes all of its rules
    assert serving_options.parse("rules=vllm,checkpoints=reuse").checkpoints == "reuse"


@pytest.mark.parametrize("text", ["checkpoints=ladder", "checkpoints=REUSE", "checkpoints="])
def test_a_bad_checkpoints_value_is_refused_by_name(text, monkeypatch):
    with pytest.raises(ValueError, match=r"KVPROOF_OPTIONS") as e:
        serving_options.parse(text)
    assert "checkpoints" in str(e.value)
    if text != "checkpoints=":
        assert repr(text.partition("=")[2]) in str(e.value) and "vllm, reuse" in str(e.value)


# --- driving vLLM's Scheduler ------------------------------------------------------------------------

class _Hashes(StepHook):
    """Each request's block hashes (for its state keys). Observes only."""

    def __init__(self) -> None:
        self.hashes: dict[str, list] = {}

    def updated(self, harness, record, output, runner_output) -> None:
        for rid, _, _ in record.chunks:
            request = harness.scheduler.requests.get(rid)
            if request is not None:
                self.hashes[rid] = list(request.block_hashes)


def _options(budget, eagle):
    return ParityOptions(num_blocks=4096, max_num_batched_tokens=budget, use_eagle=eagle)


def _served(layout, trace, budget, eagle, scheduler_cls=None):
    hashes = _Hashes()
    with slow_checks():
        run, harness = run_served(trace, layout, _options(budget, eagle), REUSE_OPTIONS, scheduler_cls, hooks=[hashes])
    return harness, run, hashes.hashes


def _stock(layout, trace, budget, eagle) -> dict[str, int]:
    return run_vllm(trace, layout, _options(budget, eagle)).cached


def _ladder(layout, prompt_len: int, eagle: bool) -> tuple[int, ...]:
    """The rungs of a prompt under ``reuse`` (the spec's definition, not the split's code)."""
    mamba = tuple(g.effective_block_size for g in layout.groups if g.group.kind is MAMBA)
    unit = checkpoint_unit(layout.cache_hit_alignment, mamba)
    return turn_end_rungs(prompt_len, unit, policy_budget(REUSE), eagle)


# --- workloads -----------------------------------------------------------------------------------------

@st.composite
def layouts(draw):
    dcp = draw(st.sampled_from([1, 2, 4, 8]))
    bs = draw(st.sampled_from([2, 4, 8]))
    groups = (CacheGroup(draw(st.sampled_from([FA, MLA])), bs), CacheGroup(MAMBA, bs * draw(st.sampled_from([1, 2, 4]))))
    effective = [bs * dcp, groups[1].block_size]
    h = draw(st.sampled_from([None] + [h for h in (1, 2, 4) if h < min(effective) and all(b % h == 0 for b in effective)]))
    return resolve_layout(LayoutConfig(groups, dcp=dcp, max_model_len=4096, hash_block_size=h,
                                       retention_interval=draw(st.sampled_from([0, 0, None])),
                                       shared_prefix_checkpoint=draw(st.booleans()), checkpoints=REUSE))


@st.composite
def chats(draw, layout):
    """Requests one after another: new prompts on shared system prompts; next turns re-sending an
    earlier prompt but a tail of up to three checkpoint units (a re-rendered template tail, a
    coarse hash id), then new tokens; continuations (prompt + outputs + a new turn); siblings
    cut near a block or hash boundary; resends."""
    unit = checkpoint_unit(layout.cache_hit_alignment, tuple(g.effective_block_size for g in layout.groups[1:]))
    units = sorted({layout.hash_block_size, layout.scheduler_block_size, unit} | {g.effective_block_size for g in layout.groups})
    fresh = itertools.count(10_000)

    def tokens(n):
        return tuple(next(fresh) for _ in range(n))

    systems = [tokens(draw(st.integers(1, 6)) * draw(st.sampled_from(units)) + draw(st.integers(0, 3))) for _ in range(2)]
    trace: list[TraceRequest] = []
    for i in range(draw(st.integers(2, 9))):
        kind = draw(st.sampled_from(["new", "next turn", "next turn", "continue", "sibling", "resend"])) if trace else "new"
        earlier = draw(st.sampled_from(trace)) if trace else None
        if kind == "new":
            prompt = draw(st.sampled_from(systems)) + tokens(draw(st.integers(1, 40)))
        elif kind == "next turn":
            cut = max(1, len(earlier.prompt) - draw(st.integers(1, 3 * unit)))
            prompt = earlier.prompt[:cut] + tokens(draw(st.integers(1, 30)))
        elif kind == "continue":
            prompt = earlier.prompt + earlier.output + tokens(draw(st.integers(1, 20)))
        elif kind == "sibling":
            cut = min(len(earlier.prompt), draw(st.sampled_from(units)) * draw(st.integers(1, 6)) + draw(st.sampled_from([-1, 0, 1])))
            prompt = earlier.prompt[:max(cut, 1)] + tokens(draw(st.integers(1, 30)))
        else:
            prompt = earlier.prompt
        event(f"request: {kind}")
        trace.append(TraceRequest(f"r{i}", prompt[:400], tokens(draw(st.integers(0, 4))), arrival=0))
    return trace


@st.composite
def cases(draw):
    layout = draw(layouts())
    return layout, draw(chats(layout)), draw(st.sampled_from([16, 64, 2048])), draw(st.booleans())


def _case(prompts, fa=8, mamba=8, dcp=1, h=None, budget=2048, spc=False):
    layout = resolve_layout(LayoutConfig((CacheGroup(FA, fa), CacheGroup(MAMBA, mamba)), dcp=dcp, max_model_len=4096,
                                         hash_block_size=h, retention_interval=0, shared_prefix_checkpoint=spc,
                                         checkpoints=REUSE))
    return layout, [TraceRequest(f"r{i}", tuple(p), (1,), arrival=0) for i, p in enumerate(prompts)], budget, False


_BASE = tuple(range(10_000, 10_100))
#: The Mooncake shape: a next turn re-sends the prompt but its last partial unit. Stock vLLM keeps
#: the state at the last checkpoint (96) and r1 resumes at 0 (retention 0 keeps nothing below);
#: the ladder's rung at 88 serves it.
NEXT_TURN = _case([_BASE[:100], _BASE[:90] + tuple(range(20_000, 20_020))])
#: *earlier longer hit* (found by Hypothesis's random profile, shortened): r1 resumes at r0's
#: rung 40 (stock vLLM: 0, no state there), so it never computes [0, 40); stock vLLM recomputes
#: it and stops at its junction 32 (where its attention keys, at DCP 4 blocks of 32, show r0),
#: keeping the state r2 (33 tokens shared) resumes from. Net +40, -32.
EARLIER_LONGER_HIT = _case([_BASE[:52], _BASE[:46] + tuple(range(20_000, 20_011)), _BASE[:33] + tuple(range(30_000, 30_027))],
                           dcp=4, h=2, budget=64, spc=True)


# --- the property ------------------------------------------------------------------------------------------

@settings(max_examples=40, **REACH_SETTINGS)
@given(cases())
@example(case=NEXT_TURN)
@example(case=EARLIER_LONGER_HIT)
def test_reuse_served_in_vllms_scheduler_keeps_ladder_states_and_stock_vllms_floor(reach, case):
    reach.minimums = {"hit at a rung": 8, "ahead of stock vLLM": 8, "retention 0": 15, "eagle": 10, "dcp 8": 5}
    layout, trace, budget, eagle = case
    harness, run, hashes = _served(layout, trace, budget, eagle)
    assert run.violations == []  # the content oracle checked every token the forward pass read
    assert harness.result().preemptions == 0 and harness.evictions == 0
    cached, stock = run.cached, _stock(layout, trace, budget, eagle)
    manager, mamba = harness.kv_cache_manager, layout.groups[1].index
    for i, t in enumerate(trace):
        rid = t.id
        rungs = _ladder(layout, len(t.prompt), eagle)
        above = [r for r in rungs if r > cached[rid]]
        # Every rung above the hit is a chunk end (the split) and a state the manager keeps.
        assert set(above) <= set(run.chunk_ends[rid]), (rid, rungs, cached[rid], run.chunk_ends[rid])
        for r in above:
            assert r % layout.hash_block_size == 0
            assert manager.manager.cached_block(key_at(hashes[rid], r, layout.hash_block_size, mamba)[0], mamba) is not None, (rid, r)
        if cached[rid] and any(cached[rid] in _ladder(layout, len(e.prompt), eagle) for e in trace[:i]):
            reach("hit at a rung")
        if cached[rid] < stock[rid]:
            reach("behind: earlier longer hit")  # counted; any other request behind fails below
    # The named class: an earlier request resumed further than in stock vLLM, so it did not
    # recompute the prefix whose chunk ends left, there, the state a later one resumes from.
    assert behind_without_earlier_longer_hit(trace, cached, stock) == [], (cached, stock)
    if any(cached[r] > stock[r] for r in stock):
        reach("ahead of stock vLLM")
    for label, on in (("retention 0", layout.config.retention_interval == 0), ("eagle", eagle), ("dcp 8", layout.dcp == 8)):
        if on:
            reach(label)


def test_the_next_turn_resumes_at_the_rung_only_with_kvprofs_split():
    """NEXT_TURN's r1 caches 88 tokens where stock vLLM caches 0; with vLLM's Scheduler unchanged
    (the manager keeping the ladder but the split never ending a chunk at 88) it caches 0 too: the
    Scheduler must carry the rule."""
    layout, trace, budget, eagle = NEXT_TURN
    assert _ladder(layout, 100, False) == (88,)
    _, run, _ = _served(layout, trace, budget, eagle)
    assert run.violations == [] and run.cached == {"r0": 0, "r1": 88} and 88 in run.chunk_ends["r0"]
    assert _stock(layout, trace, budget, eagle) == {"r0": 0, "r1": 0}
    _, unsplit, _ = _served(layout, trace, budget, eagle, scheduler_cls=Scheduler)
    assert unsplit.cached == {"r0": 0, "r1": 0} and 88 not in unsplit.chunk_ends["r0"]


def test_the_earlier_longer_hit_class_in_vllms_scheduler():
    layout, trace, budget, eagle = EARLIER_LONGER_HIT
    _, run, _ = _served(layout, trace, budget, eagle)
    stock = _stock(layout, trace, budget, eagle)
    assert run.violations == [] and run.cached == {"r0": 0, "r1": 40, "r2": 0} and stock == {"r0": 0, "r1": 0, "r2": 32}
    assert 32 not in run.chunk_ends["r1"]
    assert behind_without_earlier_longer_hit(trace, run.cached, stock) == []


def test_a_request_behind_stock_vllm_with_no_earlier_one_ahead_is_named():
    """The class check itself: behind after an earlier request ahead is the named class; behind
    first, or after requests only even, is not."""
    trace = [TraceRequest(f"r{i}", (i,), (), 0) for i in range(3)]
    assert behind_without_earlier_longer_hit(trace, {"r0": 8, "r1": 0, "r2": 4}, {"r0": 0, "r1": 4, "r2": 4}) == []
    assert behind_without_earlier_longer_hit(trace, {"r0": 0, "r1": 0, "r2": 8}, {"r0": 4, "r1": 0, "r2": 4}) == ["r0"]
    assert behind_without_earlier_longer_hit(trace, {"r0": 4, "r1": 0, "r2": 8}, {"r0": 4, "r1": 4, "r2": 0}) == ["r1"]


def test_vllms_own_manager_leaves_vllms_split_unchanged():
    """KvproofScheduler with stock vLLM's manager (no ladder) splits exactly as vLLM's Scheduler."""
    layout, trace, budget, eagle = NEXT_TURN
    runs = []
    for cls in (Scheduler, KvproofScheduler):
        harness = EngineHarness(layout, 4096, max_num_batched_tokens=budget, scheduler_cls=cls)
        runs.append([s.chunks for s in harness.run(trace).steps])
    assert runs[0] == runs[1]
