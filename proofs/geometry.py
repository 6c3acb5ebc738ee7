"""Exhaustive small-scope checks of the geometry rules (spec/geometry.py, spec/layout.py).

These run the spec's own functions, contracts on, over every layout of a bounded scope, so
they cover what z3 cannot state (gcd, lcm, kinds and modes) and catch a contract that the
code breaks. The scope is fixed (not sized by the budget) so that the verdict is the same on
every machine; the budget only cuts a run short, which then reports ``unrefuted`` with the
count reached. Layout spaces are infinite, so a clean run is ``unrefuted``, not ``proved``.
"""

from __future__ import annotations

import itertools
import time
from typing import Callable, Iterator

import icontract

from kvproof.proofs.registry import CHECKED, ERROR, INCOMPLETE, REFUTED, Obligation, Outcome, violation_summary
from kvproof.spec.geometry import hash_block_size, partial_hash_hits, scheduler_block_size
from kvproof.spec.groups import CacheGroup, GroupKind, MambaCacheMode
from kvproof.spec.layout import LayoutConfig, resolve_layout

FA, MLA, SWA, MAMBA = GroupKind.FULL_ATTENTION, GroupKind.MLA, GroupKind.SLIDING_WINDOW, GroupKind.MAMBA

#: Geometries checked before the enumeration, so that a counterexample names a real model
#: when one breaks (Kimi-K3-like: MLA 256 + linear-attention state 256, DCP 2).
NAMED_CASES: tuple[tuple[tuple[CacheGroup, ...], int], ...] = (
    ((CacheGroup(MLA, 256), CacheGroup(MAMBA, 256)), 2),
    ((CacheGroup(FA, 1536), CacheGroup(MAMBA, 16)), 8),
    ((CacheGroup(FA, 544), CacheGroup(MAMBA, 544)), 1),
    ((CacheGroup(FA, 16), CacheGroup(SWA, 64, dcp_sharded=False, sliding_window=1024), CacheGroup(MAMBA, 64)), 2),
)


def _variants(sizes: tuple[int, ...]) -> list[CacheGroup]:
    out = []
    for bs in sizes:
        out += [
            CacheGroup(FA, bs),
            CacheGroup(MLA, bs),
            CacheGroup(SWA, bs, dcp_sharded=False, sliding_window=4 * bs),
            CacheGroup(SWA, bs, sliding_window=4 * bs),  # sharded: valid only without DCP
            CacheGroup(MAMBA, bs),
            CacheGroup(MAMBA, bs, num_speculative_blocks=1),
            CacheGroup(MAMBA, bs, mamba_cache_mode=MambaCacheMode.NONE),
        ]
    return out


def scope() -> Iterator[tuple[tuple[CacheGroup, ...], int]]:
    """(groups, dcp): the named cases, every one or two groups over block sizes 1, 2, 3, 4, 8
    with DCP 1-4, every three groups over block sizes 1, 2 with DCP 1, 2."""
    yield from NAMED_CASES
    pairs = _variants((1, 2, 3, 4, 8))
    for n in (1, 2):
        for groups in itertools.combinations_with_replacement(pairs, n):
            for dcp in (1, 2, 3, 4):
                yield groups, dcp
    triples = _variants((1, 2))
    for groups in itertools.combinations_with_replacement(triples, 3):
        for dcp in (1, 2):
            yield groups, dcp


def _label(groups, dcp) -> str:
    return f"dcp {dcp}, groups {' + '.join(g.label for g in groups)}"


def serves_every_hash_boundary(group: CacheGroup, dcp: int, h: int) -> bool:
    """Whether ``group`` can return a hit ending at any multiple of H (docs: one key).

    Stated per kind from what each one stores, without the rule's helpers
    (``supports_fine_grained_lookup``, ``effective_block_size``): full attention and MLA keep
    the KV of every position (append-only), so a block holding a longer prefix serves any
    shorter one; an align-mode Mamba group keeps a state at whichever hash boundary it
    checkpoints; Mamba ``none`` keeps nothing reusable; a sliding window restores whole blocks
    only, so every multiple of H is a block end only when one block spans exactly H positions
    (``block_size`` on each of ``dcp`` ranks when sharded).
    """
    if group.kind in (FA, MLA):
        return True
    if group.kind is MAMBA:
        return group.mamba_cache_mode is MambaCacheMode.ALIGN
    span = group.block_size * dcp if group.is_sharded else group.block_size
    return span == h


def _valid(groups, dcp) -> LayoutConfig | None:
    config = LayoutConfig(groups, dcp=dcp, max_model_len=61)
    try:
        resolve_layout(config)  # bad input (ValueError) is not in the scope
    except ValueError:
        return None
    return config


def check_layouts(budget: float) -> Outcome:
    """Every layout in scope resolves with all contracts holding, plus two independent facts:
    with partial hits on, every prefix-cacheable group serves every multiple of H; with them
    off, A is a multiple of every B_g (hits land on every group's block grid)."""
    deadline, count = time.monotonic() + budget, 0
    for groups, dcp in scope():
        if time.monotonic() > deadline:
            return Outcome(INCOMPLETE, detail=f"budget spent after {count:,} layouts")
        explicit: list[int | None] = [None]
        while explicit:  # the derived H first, then every smaller divisor of it
            h = explicit.pop()
            try:
                layout = resolve_layout(LayoutConfig(groups, dcp=dcp, max_model_len=61, hash_block_size=h))
            except ValueError:
                break  # bad input is not in the scope (and an explicit H that divides is valid)
            except icontract.ViolationError as e:
                return Outcome(REFUTED, counterexample=f"{_label(groups, dcp)}, H {h}: {violation_summary(e)}")
            if h is None and layout.hash_block_size != layout.scheduler_block_size:
                explicit = [d for d in range(1, layout.hash_block_size) if layout.hash_block_size % d == 0]
            count += 1
            bad = _layout_fact_broken(layout)
            if bad:
                return Outcome(REFUTED, counterexample=f"{_label(groups, dcp)}, H {layout.hash_block_size}: {bad}")
    return Outcome(CHECKED, detail=f"{count:,} layouts, every contract held")


def _layout_fact_broken(layout) -> str | None:
    h, a = layout.hash_block_size, layout.cache_hit_alignment
    for gl in layout.groups:
        if layout.partial_hash_hits and gl.group.prefix_cacheable and not serves_every_hash_boundary(gl.group, layout.dcp, h):
            return f"partial hits on, but group {gl.index} ({gl.group.label}) cannot serve a hit at N={h}"
        g = gl.group
        span = g.block_size * layout.dcp if g.is_sharded else g.block_size  # positions per block id
        if not layout.partial_hash_hits and a % span:
            return f"block-aligned hits at A={a} are not on group {gl.index}'s block grid ({span})"
    return None


PartialRule = Callable[[tuple[CacheGroup, ...], int, int], bool]


def spec_partial_rule(groups: tuple[CacheGroup, ...], dcp: int, h: int) -> bool:
    return partial_hash_hits(groups, dcp, h).enabled


def check_partial_complete(rule: PartialRule, budget: float) -> Outcome:
    """Under DCP, with an align-mode Mamba group and every group able to serve every multiple
    of H < S, ``rule`` must turn partial hits on: the K3 case (MLA 256 + Mamba 256, DCP 2) has
    H 256 < S 512, and a block-aligned rule would throw away every hit at 256 mod 512."""
    deadline, count = time.monotonic() + budget, 0
    for groups, dcp in scope():
        if time.monotonic() > deadline:
            return Outcome(INCOMPLETE, detail=f"budget spent after {count:,} layouts")
        if dcp == 1 or _valid(groups, dcp) is None:
            continue
        if not any(g.kind is MAMBA and g.mamba_cache_mode is MambaCacheMode.ALIGN for g in groups):
            continue
        h, s = hash_block_size(groups, dcp), scheduler_block_size(groups, dcp)
        if h == s or not all(serves_every_hash_boundary(g, dcp, h) for g in groups):
            continue
        count += 1
        try:
            enabled = rule(groups, dcp, h)
        except Exception as e:  # a crash in the rule is a finding, not a checker error
            return Outcome(REFUTED, counterexample=f"{_label(groups, dcp)}: {type(e).__name__}: {e}")
        if not enabled:
            return Outcome(
                REFUTED,
                counterexample=f"{_label(groups, dcp)}, H {h}, S {s}: every group can serve a hit at N={h}, "
                "but partial hash hits are off",
            )
    if count == 0:
        return Outcome(ERROR, detail="the scope holds no DCP layout the property applies to")
    return Outcome(CHECKED, detail=f"{count:,} DCP layouts, partial hits on in each")


OBLIGATIONS = (
    Obligation(
        "EXH-LAYOUT",
        (
            "INV-GEOM-EFFECTIVE-BLOCK", "INV-GEOM-MAMBA-REPLICATED", "INV-GEOM-SCHED-LCM", "INV-GEOM-HASH-DIVIDES",
            "INV-GEOM-PARTIAL-RULE", "INV-GEOM-PARTIAL-GRID", "INV-GEOM-HIT-ALIGN", "INV-TABLE-WIDTH", "INV-TABLE-PAD",
        ),
        "exhaustive",
        "every layout of <= 3 groups in scope resolves with every geometry contract holding",
        check_layouts,
    ),
    Obligation(
        "EXH-PARTIAL-DCP-COMPLETE",
        ("INV-GEOM-PARTIAL-RULE",),
        "exhaustive",
        "under DCP, partial hits are on whenever every group can serve every multiple of H < S",
        lambda budget: check_partial_complete(spec_partial_rule, budget),
    ),
)
