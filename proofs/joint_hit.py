"""Exhaustive small-scope check of the joint prefix-cache hit (spec/joint_hit.py) and of the
fixpoint the coordinator computes it by (docs/coordinator.md, "The joint hit").

What a group can restore is, over the candidate lengths (multiples of the alignment A up to
the bound), a set containing 0; the joint hit is the largest length in every group's set. The
check enumerates *every* such set for small scopes, each realised by the most specific group
kind that can hold it, as a ``GroupView`` the spec evaluates:

- full attention: the downward-closed sets {0, ..., c} (its KV is append-only);
- sliding window (block A or 2A, a window of two blocks): the sets its block keys can produce;
- Mamba: any other set (a state exists exactly at the lengths in the set).

Each realisation is first checked on its own: ``spec.usable`` accepts exactly the lengths the
group's kind says it can restore, stated here from the docs (each realisation's ``rule``). Then, for
every ordered tuple of 1-3 groups, three numbers must agree: the largest length in every set
(the reference), ``spec.joint_hit`` with its contracts on (INV-HIT-BOUND: a multiple of A, at
most the bound and the hashed length), and ``impl.fixpoint.fixpoint``, the loop
``impl.coordinator.find_longest_hit`` calls (each finder returns the largest length <= its input
in its set; passes repeat until none lowers the candidate), which must stop within
``bound / A + 1`` passes -- and within two when every group but one is downward closed and the
downward-closed groups go first (docs: attention plus one Mamba group).

Every order of the groups is enumerated, not only the implementation's (attention first), so
the fixpoint is checked for any order. Scopes and set families are unbounded in general, so a
clean run is ``unrefuted``.
"""

from __future__ import annotations

import itertools
import time
from bisect import bisect_right
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import icontract

from kvproof.impl.fixpoint import fixpoint
from kvproof.proofs.registry import CHECKED, ERROR, INCOMPLETE, REFUTED, Obligation, Outcome, violation_summary
from kvproof.spec.joint_hit import ATTENTION, MAMBA, WINDOW, GroupView, joint_hit, usable

#: The hash block size: 1, so every alignment in scope is valid and every length is hashed.
HASH = 1
ALIGNMENTS = (1, 2, 3)
#: For each number of groups, the most candidate lengths above 0 (top / A), and the largest top
#: candidate: one group up to 12, two up to 6 candidates, three up to 4 (top 12 when A = 3).
MAX_CANDIDATES = {1: 12, 2: 6, 3: 4}
MAX_TOP = 12


@dataclass(frozen=True)
class Group:
    """A group in scope: its restorable candidate lengths and the view that realises them."""

    kind: str
    restorable: frozenset[int]
    view: GroupView
    label: str

    @property
    def downward_closed(self) -> bool:
        return self.kind == ATTENTION

    def __str__(self) -> str:
        return f"{self.label} {{{', '.join(map(str, sorted(self.restorable)))}}}"


#: A realisation: the kind, the view, a label, and which lengths its kind's rule says it can
#: restore (given the hashed length), stated from docs/coordinator.md's table, not from ``usable``.
Realisation = tuple[str, GroupView, str, Callable[[int, int], bool]]


def _attention(top: int) -> Iterator[Realisation]:
    """Keys at every length up to c: append-only KV restores any n whose tokens (plus the EAGLE
    draft's unit) lie within c and the hashed length. The largest c comes first, so that the
    view realising {0, A, ..., kA} restores lengths up to kA + A - 1, off the alignment grid."""
    for c, eagle, block in itertools.product(range(top, -1, -1), (0, 1), (1, 2)):
        view = GroupView(ATTENTION, block, lambda n, c=c: n <= c, eagle_unit=eagle)
        label = f"attention(block {block}{', eagle' if eagle else ''})"
        yield ATTENTION, view, label, lambda n, hashed_len, c=c, e=eagle: n == 0 or n + e <= min(c, hashed_len)


def _window(alignment: int, top: int) -> Iterator[Realisation]:
    """Full-block keys at some block ends: a window restores a block-aligned n when every block
    overlapping its last ``window - 1`` tokens has its key."""
    for block in (alignment, 2 * alignment):
        window = 2 * block + 1
        ends = range(block, top + 1, block)
        for k in range(len(ends) + 1):
            for keyed in map(frozenset, itertools.combinations(ends, k)):

                def rule(n, hashed_len, b=block, keyed=keyed, w=window):
                    overlapping = [e for e in range(b, n + 1, b) if e > n - (w - 1)]
                    return n == 0 or (n % b == 0 and all(e in keyed for e in overlapping))

                view = GroupView(WINDOW, block, keyed.__contains__, window=window)
                yield WINDOW, view, f"window(block {block}, window {window})", rule


def _mamba(alignment: int, top: int) -> Iterator[Realisation]:
    """States at some candidate lengths: Mamba restores exactly those (and 0)."""
    candidates = range(alignment, top + 1, alignment)
    for k in range(len(candidates) + 1):
        for states in map(frozenset, itertools.combinations(candidates, k)):
            view = GroupView(MAMBA, alignment, states.__contains__)
            yield MAMBA, view, "mamba", lambda n, hashed_len, s=states: n == 0 or n in s


def groups_in_scope(alignment: int, top: int) -> tuple[list[Group], Optional[str]]:
    """Every set of candidate lengths {0, A, ..., top} that contains 0, each realised by the
    first kind (attention, window, Mamba) that can hold it; or a finding when ``spec.usable``
    disagrees with a realisation's rule."""
    by_set: dict[frozenset[int], Group] = {}
    for kind, view, label, rule in itertools.chain(_attention(top), _window(alignment, top), _mamba(alignment, top)):
        restorable = set()
        for n in range(top + 1):
            got, want = usable(view, n, HASH, top), rule(n, top)
            if got != want:
                return [], f"{label}, hashed length {top}: usable({n}) is {got}, the kind's rule says {want}"
            if got and n % alignment == 0:
                restorable.add(n)
        by_set.setdefault(frozenset(restorable), Group(kind, frozenset(restorable), view, label))
    if len(by_set) != 2 ** (top // alignment):
        return [], f"A {alignment}, top {top}: {len(by_set)} sets realised, expected every subset"
    return list(by_set.values()), None


#: A fixpoint: (finders in lookup order, start) -> (hit, passes). A finder maps a candidate to
#: the largest restorable length <= it.
Fixpoint = Callable[[list[Callable[[int], int]], int], tuple[int, int]]


def coordinator_fixpoint(finders: list[Callable[[int], int]], start: int) -> tuple[int, int]:
    """The loop ``impl.coordinator.find_longest_hit`` runs: :func:`kvproof.impl.fixpoint.fixpoint`
    itself (the coordinator calls it), over finders that carry no block lists."""
    hit, _, _, passes = fixpoint([lambda n, find=find: (find(n), None) for find in finders], start)
    return hit, passes


def _finder(group: Group) -> Callable[[int], int]:
    lengths = sorted(group.restorable)
    return lambda x: lengths[bisect_right(lengths, x) - 1]


#: The order a fixpoint visits the groups in.
Order = Callable[[tuple[Group, ...]], tuple[Group, ...]]


def as_given(groups: tuple[Group, ...]) -> tuple[Group, ...]:
    return groups


def lookup_order(groups: tuple[Group, ...]) -> tuple[Group, ...]:
    """The implementation's order: downward-closed (attention) groups first, the rest after."""
    return tuple(sorted(groups, key=lambda g: not g.downward_closed))


def _configs(alignment: int, num_groups: int) -> Iterator[tuple[int, int, int]]:
    """(top candidate, bound, hashed length): the bound as ``num_tokens - 1`` with the hashed
    length ``num_tokens`` (not a multiple of A when A > 1); one group also gets the hashed length
    as the binding limit, and a bound that is itself a multiple of A."""
    for m in range(min(MAX_CANDIDATES[num_groups], MAX_TOP // alignment) + 1):
        top = m * alignment
        yield top, top + alignment - 1, top + alignment
        if num_groups == 1:
            yield top, top, top
            yield top, top + alignment, top


def check_joint_hit(fixpoint: Fixpoint, order: Order, budget: float) -> Outcome:
    """For every configuration in scope: reference == ``spec.joint_hit`` == ``fixpoint`` run over
    the groups in ``order(groups)``, within the pass bounds."""
    deadline, count = time.monotonic() + budget, 0
    families: dict[tuple[int, int], list[Group]] = {}
    for num_groups, alignment in itertools.product((1, 2, 3), ALIGNMENTS):
        for top, bound, hashed_len in _configs(alignment, num_groups):
            if (alignment, top) not in families:
                families[alignment, top], bad = groups_in_scope(alignment, top)
                if bad:
                    return Outcome(REFUTED, counterexample=bad)
            family = families[alignment, top]
            for groups in itertools.product(family, repeat=num_groups):
                if count % 1024 == 0 and time.monotonic() > deadline:
                    return Outcome(INCOMPLETE, detail=f"budget spent after {count:,} configurations")
                count += 1
                bad = _config_broken(fixpoint, order, groups, alignment, bound, hashed_len)
                if bad:
                    where = f"A {alignment}, bound {bound}, hashed length {hashed_len}, groups "
                    return Outcome(REFUTED, counterexample=where + " + ".join(map(str, groups)) + f": {bad}")
    if count == 0:
        return Outcome(ERROR, detail="the scope holds no configuration")
    return Outcome(CHECKED, detail=f"{count:,} configurations, every hit agreed")


def _config_broken(
    fixpoint: Fixpoint, order: Order, groups: tuple[Group, ...], alignment: int, bound: int, hashed_len: int
) -> Optional[str]:
    start = min(bound, hashed_len) // alignment * alignment
    want = max(set.intersection(*(set(g.restorable) for g in groups)) & set(range(start + 1)))
    try:
        spec_hit = joint_hit(tuple(g.view for g in groups), bound, alignment, HASH, hashed_len)
    except icontract.ViolationError as e:
        return f"joint_hit: {violation_summary(e)}"
    if spec_hit != want:
        return f"joint_hit returned {spec_hit}; the largest length every group can restore is {want}"
    ordered = order(groups)
    hit, passes = fixpoint([_finder(g) for g in ordered], start)
    if hit != want:
        return f"the fixpoint returned {hit} after {passes} pass(es); the joint hit is {want}"
    if passes > bound // alignment + 1:
        return f"the fixpoint took {passes} passes, more than bound / A + 1 = {bound // alignment + 1}"
    if sum(not g.downward_closed for g in groups) <= 1:
        _, passes = fixpoint([_finder(g) for g in lookup_order(groups)], start)
        if passes > 2:
            return f"downward-closed groups first and at most one other: {passes} passes, not <= 2"
    return None


def single_pass(finders: list[Callable[[int], int]], start: int) -> tuple[int, int]:
    """SEEDED BUG: the fixpoint cut to one pass ("attention narrows, Mamba lowers, done")."""
    hit = max(start, 0)
    for find in finders:
        hit = find(hit)
    return hit, 1


def by_kind(groups: tuple[Group, ...]) -> tuple[Group, ...]:
    """Attention first, then sliding window, then Mamba (the docs' order, made total)."""
    rank = {ATTENTION: 0, WINDOW: 1, MAMBA: 2}
    return tuple(sorted(groups, key=lambda g: rank[g.kind]))


OBLIGATIONS = (
    Obligation(
        "EXH-JOINT-FIXPOINT",
        ("INV-HIT-BOUND",),
        "exhaustive",
        "for every 1-3 restorable sets in scope, spec.joint_hit and the coordinator's fixpoint (any group order) "
        "return the largest jointly restorable multiple of A, within bound/A + 1 passes",
        lambda budget: check_joint_hit(coordinator_fixpoint, as_given, budget),
    ),
    Obligation(
        "CANARY-HIT-SINGLE-PASS",
        ("INV-HIT-BOUND",),
        "exhaustive",
        "one pass of the finders (attention, window, then Mamba) returns a length some group cannot restore",
        lambda budget: check_joint_hit(single_pass, by_kind, budget),
    ),
)
