"""Hit parity with vLLM 0.33.0's real scheduler: on multi-turn traces whose requests never overlap
in time, kvproof caches at least as many tokens as vLLM for every request, with the same layout,
retention and budget, except in the two named classes where an earlier request reused more in
kvproof (``Parity.explain_behind``; docs/coordinator.md, "Hit parity with vLLM 0.33.0"), and the
content oracle confirms every reused token.

Nothing is filtered: every generated trace and layout is compared. The generator aims at the
hard cases (shared system prompts, continuations of an earlier prompt plus its outputs, siblings
cut at and around block and hash boundaries) and a fixed-seed run fails when too few of them
are reached.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm")

from kvproof.integrations.vllm.parity import ParityOptions, compare  # noqa: E402
from kvproof.sim.trace import TraceRequest  # noqa: E402
from kvproof.spec.groups import CacheGroup, GroupKind  # noqa: E402
from kvproof.spec.layout import LayoutConfig, resolve_layout  # noqa: E402

from ..conftest import REACH_SETTINGS  # noqa: E402

FA, MLA, MAMBA = GroupKind.FULL_ATTENTION, GroupKind.MLA, GroupKind.MAMBA


@st.composite
def layouts(draw):
    dcp = draw(st.sampled_from([1, 2, 4, 8]))
    attention = draw(st.sampled_from([FA, MLA]))
    bs = draw(st.sampled_from([2, 4, 8]))
    groups = [CacheGroup(attention, bs)]
    if draw(st.integers(0, 4)):  # one layout in five is attention-only
        groups.append(CacheGroup(MAMBA, bs * draw(st.sampled_from([1, 1, 2, 4]))))
    effective = [bs * dcp] + [g.block_size for g in groups[1:]]
    natural = effective[0] if len(groups) == 1 else min(effective)
    # H: derived, or finer than every block (H < S), when the layout allows one.
    finer = [h for h in (1, 2, 4) if h < natural and all(b % h == 0 for b in effective)]
    h = draw(st.sampled_from([None] + finer)) if len(groups) > 1 else None
    config = LayoutConfig(
        tuple(groups), dcp=dcp, max_model_len=4096, hash_block_size=h,
        retention_interval=draw(st.sampled_from([None, 0])),
        shared_prefix_checkpoint=draw(st.booleans()),
    )
    return resolve_layout(config)


@st.composite
def chat_traces(draw, layout):
    """Requests one after another: new prompts on shared system prompts, siblings of earlier
    prompts cut near block and hash boundaries, continuations (an earlier prompt + its outputs +
    a new turn) and resends."""
    units = sorted({layout.hash_block_size, layout.scheduler_block_size} | {g.effective_block_size for g in layout.groups})
    fresh = itertools.count(10_000)

    def tokens(n):
        return tuple(next(fresh) for _ in range(n))

    def near_boundary():
        unit = draw(st.sampled_from(units))
        return max(1, unit * draw(st.integers(1, 6)) + draw(st.sampled_from([-1, 0, 0, 1, 2])))

    systems = [tokens(draw(st.integers(1, 40)) if draw(st.booleans()) else near_boundary()) for _ in range(2)]
    trace: list[TraceRequest] = []
    for i in range(draw(st.integers(2, 10))):
        kind = draw(st.sampled_from(["new", "sibling", "sibling", "continue", "continue", "resend"])) if trace else "new"
        if kind == "new":
            prompt = draw(st.sampled_from(systems)) + tokens(draw(st.integers(1, 30)))
        else:
            earlier = draw(st.sampled_from(trace))
            if kind == "sibling":
                cut = min(len(earlier.prompt), near_boundary())
                prompt = earlier.prompt[:cut] + tokens(draw(st.integers(1, 30)))
            elif kind == "continue":
                prompt = earlier.prompt + earlier.output + tokens(draw(st.integers(1, 20)))
            else:
                prompt = earlier.prompt
        event(f"request: {kind}")
        trace.append(TraceRequest(f"r{i}", prompt[:400], tokens(draw(st.integers(0, 6))), arrival=0))
    return trace


def _case(prompts, *, fa=8, mamba=8, dcp=2, h=2, retention=0, spc=False, eagle=True, budget=16):
    """Requests one after another, no outputs; by default the layout of the random-seed
    counterexamples: FA 8 + Mamba 8 at DCP 2, H 2, retention 0, EAGLE, 16 tokens per step."""
    layout = resolve_layout(LayoutConfig(
        (CacheGroup(FA, fa), CacheGroup(MAMBA, mamba)), dcp=dcp, max_model_len=4096, hash_block_size=h,
        retention_interval=retention, shared_prefix_checkpoint=spc,
    ))
    trace = [TraceRequest(f"r{i}", tuple(p), (), arrival=0) for i, p in enumerate(prompts)]
    return layout, trace, ParityOptions(max_num_batched_tokens=budget, use_eagle=eagle)


_BASE = tuple(range(10_000, 10_064))
#: Three prefixes of one prompt. r1's lookup reaches 34 tokens of attention (a hit at 32 with
#: EAGLE) and 16 of Mamba: its junctions must include 30, where vLLM's junction lands (its
#: attention keys stop at the block end 32, minus one hash unit), so that r2's hit at 30 finds
#: a state there. kvproof reported the block end below its own hit (16) instead: r2 got 24, vLLM 30.
EAGLE_JUNCTION = _case([_BASE[:35] + (20_000,), _BASE[:34], _BASE[:32]], spc=True)
#: r1 branches off r0 at 7 tokens; kvproof's every-hash keys show the junction (vLLM's keys do
#: not), so r1's chunks stop at 4 and 8 and its budget-cut chunks end at 24 and 40 -- not at 32,
#: where vLLM's end and retention 0 keeps the replay boundary r2 resumes at. The replay stop
#: makes kvproof end a chunk there too: even with vLLM.
REPLAY_STOP = _case([_BASE[:7] + (20_000,), _BASE[:31] + _BASE[40:59], _BASE[:31] + _BASE[40:57]], spc=True)
#: "longer hit": kvproof's r1 hits 16 (vLLM 0) and so never computes [0, 16); vLLM recomputes
#: it and keeps the junction state at 8, where r2 (16 tokens, a hit of at most 14) resumes.
LONGER_HIT = _case([_BASE[:32], _BASE[:18], _BASE[:16]])
#: "shifted chunks" (dense retention: every chunk end is kept): r1 shares 5 tokens with r0, which
#: kvproof's keys show (vLLM's prompt-tail key of r0 is at 6), so r1's first chunk stops at the
#: junction's block (4) and its next ends at 18 with the budget of 16 -- vLLM's first ends at 16,
#: where r2 (17 tokens, 16 shared) resumes.
SHIFTED_CHUNKS = _case([_BASE[:7], _BASE[:5] + _BASE[20:34], _BASE[:5] + _BASE[20:31] + (20_000,)],
                       fa=2, mamba=2, dcp=4, h=1, retention=None, eagle=False)


@st.composite
def cases(draw):
    layout = draw(layouts())
    trace = draw(chat_traces(layout))
    budget = draw(st.sampled_from([16, 64, 2048]))
    return layout, trace, ParityOptions(max_num_batched_tokens=budget, use_eagle=draw(st.booleans()))


def _label(layout, options, parity) -> list[str]:
    labels = [f"dcp {layout.dcp}", "hybrid" if len(layout.groups) > 1 else "attention only",
              "retention none" if layout.config.retention_interval is None else "retention 0",
              "eagle" if options.use_eagle else "no eagle"]
    if any(n % layout.scheduler_block_size for n in parity.vllm.cached.values()):
        labels.append("vLLM partial hit")
    if any(parity.vllm.cached.values()):
        labels.append("vLLM hit")
    if parity.ahead():
        labels.append("kvproof ahead")
    return labels


@settings(max_examples=120, **REACH_SETTINGS)
@given(cases())
@example(case=EAGLE_JUNCTION)
@example(case=REPLAY_STOP)
@example(case=LONGER_HIT)
@example(case=SHIFTED_CHUNKS)
def test_kvproof_caches_at_least_what_vllm_does_for_every_request(reach, case):
    reach.minimums = {"hybrid": 40, "retention 0": 30, "retention none": 30, "eagle": 30, "dcp 8": 10,
                      "vLLM partial hit": 10, "vLLM hit": 60, "kvproof ahead": 10}
    layout, trace, options = case
    parity = compare(trace, layout, options)
    for label in set(_label(layout, options, parity)):
        reach(label)
    assert parity.kvproof.violations == []
    why = parity.explain_behind()
    for reason in why.values():
        reach(f"behind: {reason}")
    assert None not in why.values(), (layout.config, options, parity.behind(), why)


@pytest.mark.parametrize("case, behind", [
    (EAGLE_JUNCTION, {}), (REPLAY_STOP, {}), (LONGER_HIT, {"r2": "longer hit"}),
    (SHIFTED_CHUNKS, {"r2": "shifted chunks"}),
], ids=["eagle junction", "replay stop", "longer hit", "shifted chunks"])
def test_the_named_classes_are_exactly_these_cases(case, behind):
    """The examples above: the EAGLE junction and replay-stop cases (each behind before its fix)
    are even with vLLM; the other two are behind for exactly the named reason, and the request
    before them is at least even."""
    parity = compare(case[1], case[0], case[2])
    assert parity.explain_behind() == behind
    assert parity.kvproof.cached["r1"] >= parity.vllm.cached["r1"]
