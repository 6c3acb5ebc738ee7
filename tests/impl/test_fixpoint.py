"""impl/fixpoint.py's edge cases (EXH-JOINT-FIXPOINT in proofs/joint_hit.py checks it against
``spec.joint_hit`` on every small configuration; these pin what it returns besides the hit)."""

from __future__ import annotations

from kvproof.impl.fixpoint import fixpoint


def test_the_fixpoint_of_no_candidate_asks_no_group():
    asked = []
    finder = lambda n: (asked.append(n), (n, "blocks"))[1]  # noqa: E731
    assert fixpoint([finder], 0) == (0, [None], 0, 0) and asked == []
    assert fixpoint([finder], 1) == (1, ["blocks"], 1, 1) and asked == [1]


def test_the_fixpoint_reports_the_longest_single_group_answer_and_its_passes():
    attention = lambda n: (min(n, 12), "a")  # noqa: E731
    mamba = lambda n: (8 if n >= 8 else 0, "m")  # noqa: E731
    assert fixpoint([attention, mamba], 16) == (8, ["a", "m"], 12, 2)
    assert fixpoint([attention, lambda n: (0, "none")], 16) == (0, ["a", "none"], 12, 1)
    assert fixpoint([lambda n: (0, "none")], 16) == (0, ["none"], 0, 1)  # no group restores anything
