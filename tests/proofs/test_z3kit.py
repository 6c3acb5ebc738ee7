"""The z3 harness: a wrong claim is refuted with the least counterexample, a model that no
longer mirrors the spec is an error (not a stale proof), and a counterexample is replayed."""

from __future__ import annotations

import z3

from kvproof.proofs.registry import ERROR, PROVED, REFUTED
from kvproof.proofs.z3kit import Lemma, check_lemma, divmod_def, grid
from kvproof.spec.arith import cdiv


def _cdiv_lemma(claim, model_sign=-1, spec=cdiv):
    return Lemma(
        inputs=("a", "b"),
        domain=lambda v: z3.And(v.a >= 0, v.b >= 1),
        definitions=lambda v: z3.And(divmod_def(-v.a, v.b, v.nq, v.nr), v.c == model_sign * v.nq),
        steps=(claim,),
        spec_values=lambda x: dict(zip(("nq", "nr"), divmod(-x["a"], x["b"]))) | {"c": spec(x["a"], x["b"])},
        samples=grid(a=range(0, 10), b=range(1, 5)),
    )


def test_true_claim_is_proved():
    assert check_lemma(_cdiv_lemma(lambda v: v.c * v.b >= v.a), 5).verdict == PROVED


def test_false_claim_is_refuted_with_the_least_counterexample():
    # c * b == a fails first at a = 1, b = 2 (a = 0 and every b = 1 satisfy it).
    outcome = check_lemma(_cdiv_lemma(lambda v: v.c * v.b == v.a), 5)
    assert outcome.verdict == REFUTED
    assert outcome.counterexample == "a=1 b=2"


def test_model_that_disagrees_with_the_spec_is_an_error():
    outcome = check_lemma(_cdiv_lemma(lambda v: v.c * v.b >= v.a, spec=lambda a, b: a // b), 5)
    assert outcome.verdict == ERROR
    assert "disagrees with the spec" in outcome.detail


def test_fidelity_is_live_on_a_real_lemma(monkeypatch):
    """A spec change the lemma does not mirror (here: local positions shifted by one) makes
    the lemma an error instead of a proof about a formula the code no longer computes."""
    from kvproof.proofs import lemmas_placement

    real = lemmas_placement.local_position
    monkeypatch.setattr(lemmas_placement, "local_position", lambda p, bs, dcp, il: real(p, bs, dcp, il) + 1)
    outcome = check_lemma(lemmas_placement.LOCAL_DIGITS, 5)
    assert outcome.verdict == ERROR and "disagrees with the spec" in outcome.detail
