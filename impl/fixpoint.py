"""The joint prefix-cache hit as the coordinator computes it: a fixpoint over per-group finders.

Beside the coordinator, its one caller, and apart from ``kvproof.spec.joint_hit``, the rule it is
checked against (the spec states the joint hit directly; this is the fast way to reach it).
Pure: no state, no contracts on the hot path.
"""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar

T = TypeVar("T")


def fixpoint(finders: Sequence[Callable[[int], tuple[int, T]]], candidate: int) -> tuple[int, list[T], int, int]:
    """The joint hit as the coordinator computes it: passes over per-group finders until a
    pass lowers nothing. Each finder maps a candidate to the largest length <= it that its
    group can restore (and what realises it). Returns ``(hit, payloads, longest, passes)``:
    the payloads of the final pass, ``longest`` the largest single-group answer seen (the
    first finder's first answer: no answer exceeds its input), and the number of passes.

    Why it is the largest jointly restorable length J: J <= candidate initially, and a finder
    given c >= J returns >= J (J is restorable in its group and <= c); at the end every finder
    accepted the candidate, so it is jointly restorable, hence J. Why it ends: every pass that
    does not end the loop strictly lowers the candidate, a non-negative integer (with lengths on
    an alignment grid A, at most ``candidate / A + 1`` passes). ``impl.coordinator`` calls this
    function; ``proofs/joint_hit.py`` checks it exhaustively against ``spec.joint_hit``. No state change.
    """
    payloads: list = [None] * len(finders)
    longest, passes = 0, 0
    if candidate <= 0:
        return 0, payloads, 0, 0
    while True:
        before, passes = candidate, passes + 1
        for i, find in enumerate(finders):
            candidate, payloads[i] = find(candidate)
            if candidate > longest:
                longest = candidate
            if candidate <= 0:
                return 0, payloads, longest, passes
        if candidate == before:
            return candidate, payloads, longest, passes
