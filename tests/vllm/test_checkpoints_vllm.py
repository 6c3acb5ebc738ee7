"""The ``reuse`` checkpoint policy served inside vLLM 0.33.0's real Scheduler: kvproof's manager
(``KVPROOF_OPTIONS="checkpoints=reuse"``) with kvproof's Scheduler split
(integrations/vllm/kvproof_scheduler.py), against stock vLLM's Scheduler and manager.

On generated sequential multi-turn traffic (continuations, next turns that drop a tail of the
previous prompt, siblings, resends), with the manager's slow contracts and the content oracle on:
no violation, every chunk crossing a rung of the prompt's ladder (``spec.checkpoints``) ends
there and the manager keeps the state, and no request caches fewer tokens than with stock vLLM
except in the named class *earlier longer hit* (docs/coordinator.md), which is counted.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from kvproof.impl.hashing import key_at  # noqa: E402
from kvproof.integrations.vllm import serving_options  # noqa: E402
from kvproof.integrations.vllm.engine_harness import EngineHarness, StepHook  # noqa: E402
from kvproof.integrations.vllm.kvproof_manager import KvproofKVCacheManager  # noqa: E402
from kvproof.integrations.vllm.kvproof_scheduler import KvproofScheduler  # noqa: E402
from kvproof.integrations.vllm.worker_model import OracleHook  # noqa: E402
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

class _Chunks(StepHook):
    """Each request's chunk ends in order, and its block hashes (for the state keys). Observes only."""

    def __init__(self) -> None:
        self.ends: dict[str, list[int]] = {}
        self.hashes: dict[str, list] = {}

    def updated(self, harness, record, output, runner_output) -> None:
        for rid, start, n in record.chunks:
            self.ends.setdefault(rid, []).append(start + n)
            request = harness.scheduler.requests.get(rid)
            if request is not None:
                self.hashes[rid] = list(request.block_hashes)


def _sequential(harness: EngineHarness, trace) -> dict[str, int]:
    """Each request arrives in the step after the previous one finished; cached tokens per request."""
    for t in trace:
        harness.add_trace([dataclasses.replace(t, arrival=harness.step_count + 1)])
        while harness.has_unfinished():
            harness.step()
    return dict(harness.result().num_cached_tokens)


def _served(layout, trace, budget, eagle, scheduler_cls=KvproofScheduler):
    chunks, oracle = _Chunks(), OracleHook(layout)
    harness = EngineHarness(layout, 4096, max_num_batched_tokens=budget, use_eagle=eagle, scheduler_cls=scheduler_cls,
                            manager_class=functools.partial(KvproofKVCacheManager, options=REUSE_OPTIONS),
                            hooks=[chunks, oracle])
    with slow_checks():
        cached = _sequential(harness, trace)
    return harness, cached, chunks, oracle.worker.violations


def _stock(layout, trace, budget, eagle) -> dict[str, int]:
    return _sequential(EngineHarness(layout, 4096, max_num_batched_tokens=budget, use_eagle=eagle), trace)


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


def _case(prompts, fa=8, mamba=8, dcp=1, h=None, budget=2048):
    layout = resolve_layout(LayoutConfig((CacheGroup(FA, fa), CacheGroup(MAMBA, mamba)), dcp=dcp, max_model_len=4096,
                                         hash_block_size=h, retention_interval=0, checkpoints=REUSE))
    return layout, [TraceRequest(f"r{i}", tuple(p), (1,), arrival=0) for i, p in enumerate(prompts)], budget, False


_BASE = tuple(range(10_000, 10_100))
#: The Mooncake shape: a next turn re-sends the prompt but its last partial unit. Stock vLLM keeps
#: the state at the last checkpoint (96) and r1 resumes at 0 (retention 0 keeps nothing below);
#: the ladder's rung at 88 serves it.
NEXT_TURN = _case([_BASE[:100], _BASE[:90] + tuple(range(20_000, 20_020))])


# --- the property ------------------------------------------------------------------------------------------

@settings(max_examples=40, **REACH_SETTINGS)
@given(cases())
@example(case=NEXT_TURN)
def test_reuse_served_in_vllms_scheduler_keeps_ladder_states_and_stock_vllms_floor(reach, case):
    reach.minimums = {"hit at a rung": 8, "ahead of stock vLLM": 8, "retention 0": 15, "eagle": 10, "dcp 8": 5}
    layout, trace, budget, eagle = case
    harness, cached, chunks, violations = _served(layout, trace, budget, eagle)
    assert violations == []  # the content oracle checked every token the forward pass read
    assert harness.result().preemptions == 0 and harness.evictions == 0
    stock = _stock(layout, trace, budget, eagle)
    manager, mamba = harness.kv_cache_manager, layout.groups[1].index
    for i, t in enumerate(trace):
        rid = t.id
        rungs = _ladder(layout, len(t.prompt), eagle)
        above = [r for r in rungs if r > cached[rid]]
        # Every rung above the hit is a chunk end (the split) and a state the manager keeps.
        assert set(above) <= set(chunks.ends[rid]), (rid, rungs, cached[rid], chunks.ends[rid])
        for r in above:
            assert r % layout.hash_block_size == 0
            assert manager.manager.cached_block(key_at(chunks.hashes[rid], r, layout.hash_block_size, mamba)[0], mamba) is not None, (rid, r)
        if cached[rid] and any(cached[rid] in _ladder(layout, len(e.prompt), eagle) for e in trace[:i]):
            reach("hit at a rung")
        if cached[rid] < stock[rid]:
            # The named class: an earlier request resumed further than in stock vLLM, so it did not
            # recompute the prefix whose chunk ends left, there, the state this request resumes from.
            assert any(cached[e.id] > stock[e.id] for e in trace[:i]), (rid, cached, stock)
            reach("behind: earlier longer hit")
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
    _, cached, chunks, violations = _served(layout, trace, budget, eagle)
    assert violations == [] and cached == {"r0": 0, "r1": 88} and 88 in chunks.ends["r0"]
    assert _stock(layout, trace, budget, eagle) == {"r0": 0, "r1": 0}
    _, unsplit, chunks, _ = _served(layout, trace, budget, eagle, scheduler_cls=Scheduler)
    assert unsplit == {"r0": 0, "r1": 0} and 88 not in chunks.ends["r0"]


def test_vllms_own_manager_leaves_vllms_split_unchanged():
    """KvproofScheduler with stock vLLM's manager (no ladder) splits exactly as vLLM's Scheduler."""
    layout, trace, budget, eagle = NEXT_TURN
    runs = []
    for cls in (Scheduler, KvproofScheduler):
        harness = EngineHarness(layout, 4096, max_num_batched_tokens=budget, scheduler_cls=cls)
        _sequential(harness, trace)
        runs.append([s.chunks for s in harness.result().steps])
    assert runs[0] == runs[1]
