"""A small harness for z3 lemmas about the spec's integer formulas.

Why steps: z3 cannot decide integer division by a *variable* in one shot (nonlinear
arithmetic times out), but it proves each fact of a pen-and-paper proof in milliseconds once
every ``a // b`` and ``a % b`` is spelled as a quotient/remainder pair (``a == q*b + r,
0 <= r < b``). A :class:`Lemma` is therefore a short proof script: the spec's formulas as
definitions, then facts each proved from the definitions and the facts before it, the last
fact being the claim. Every fact holds for *all* integers in the domain, so the chain is a
proof for all integers, not a sample.

Why a fidelity check: the definitions restate the spec in z3. Before proving anything, the
lemma runs the spec itself on small inputs and checks that its values satisfy the definitions
(quotient/remainder pairs have unique solutions, so this pins the model to the code). A spec
change that the model does not mirror becomes a verdict ``error`` instead of a stale proof.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import signal
import socket
import threading
import time
from typing import Callable, Iterable, Iterator, Mapping

import z3

from kvproof.proofs.registry import ERROR, PROVED, REFUTED, TIMEOUT, Obligation, Outcome


class Vars:
    """z3 integer variables by attribute: ``v.p``, ``v.dcp`` (created on first use)."""

    def __init__(self) -> None:
        self._vars: dict[str, z3.ArithRef] = {}

    def __getattr__(self, name: str) -> z3.ArithRef:
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self._vars:
            self._vars[name] = z3.Int(name)
        return self._vars[name]

    def items(self):
        return self._vars.items()


def divmod_def(n, d, q, r) -> z3.BoolRef:
    """``q, r == divmod(n, d)`` for ``d > 0`` (Python's floor division)."""
    return z3.And(n == q * d + r, 0 <= r, r < d)


def clamp(x, lo, hi) -> z3.ArithRef:
    """``min(max(x, lo), hi)`` for ``lo <= hi``."""
    return z3.If(x < lo, lo, z3.If(x > hi, hi, x))


Formula = Callable[[Vars], z3.BoolRef]

#: What one step may take, whatever the budget (the steps take 0.1-13 s on a loaded 2-core
#: machine): fixed, so that the verdict does not depend on --budget; the budget's deadline only
#: cuts it shorter, and then the verdict says ``timeout``.
STEP_SECONDS = 60.0


@dataclasses.dataclass(frozen=True)
class Lemma:
    """A claim about spec formulas, proved in steps (see the module docstring).

    ``inputs``       free variables, in the order a counterexample lists (and minimises) them;
    ``domain``       their range (the spec's preconditions);
    ``definitions``  the spec's formulas, one equation per derived variable;
    ``steps``        facts proved in order; the last one is the claim;
    ``spec_values``  runs the spec on concrete inputs and returns every derived variable;
    ``samples``      concrete inputs for the fidelity check;
    ``describe``     optional: a sentence for a counterexample, from inputs + spec values.
    """

    inputs: tuple[str, ...]
    domain: Formula
    definitions: Formula
    steps: tuple[Formula, ...]
    spec_values: Callable[[dict[str, int]], dict[str, int]]
    samples: Callable[[], Iterable[dict[str, int]]]
    describe: Callable[[dict[str, int]], str] | None = None


def grid(**ranges: Iterable[int]) -> Callable[[], Iterable[dict[str, int]]]:
    """Samples: every combination of the given per-input values."""

    def gen():
        names = list(ranges)
        for values in itertools.product(*(list(ranges[n]) for n in names)):
            yield dict(zip(names, values))

    return gen


def _holds(formula: z3.BoolRef, values: Mapping[str, int], v: Vars) -> bool:
    subs = [(var, z3.IntVal(values[name])) for name, var in v.items() if name in values]
    return z3.is_true(z3.simplify(z3.substitute(formula, *subs)))


def _fidelity(lemma: Lemma, v: Vars) -> Outcome | None:
    """Run the spec on the samples; None when it agrees with the model everywhere.

    All samples, whatever the budget (a few hundred, under a second): a verdict must not
    depend on how far a slow machine got."""
    # Only the definitions: refuting the claim is z3's job (a canary shows z3 can).
    domain, definitions = lemma.domain(v), lemma.definitions(v)
    checked = 0
    for sample in lemma.samples():
        if not _holds(domain, sample, v):  # the domain names inputs only, so this decides
            continue
        values = {**sample, **lemma.spec_values(dict(sample))}
        if not _holds(definitions, values, v):
            return Outcome(ERROR, detail=f"z3 model disagrees with the spec at {_fmt(lemma, values)}")
        checked += 1
    has_model = not z3.is_true(z3.simplify(definitions))
    if has_model and checked == 0:
        return Outcome(ERROR, detail="the fidelity check ran the spec on no sample")
    return None


def _fmt(lemma: Lemma, values: Mapping[str, int]) -> str:
    inputs = " ".join(f"{n}={values[n]}" for n in lemma.inputs)
    if lemma.describe is None:
        return inputs
    return f"{inputs}: {lemma.describe(dict(values))}"


#: z3's reason for a check that a signal cancelled: its own SIGINT handler, or
#: ``Context.interrupt`` (called by :class:`_SignalWatch` on any other signal).
_INTERRUPTED = ("interrupted from keyboard", "interrupted")


class _SignalWatch:
    """Makes a z3 check stop on a signal. z3 runs in C, and Python runs its signal handlers only
    between bytecodes, so a SIGTERM would wait for the check (up to ``STEP_SECONDS``). While a
    check runs, Python's wakeup descriptor is a socket this thread reads: a signal with a
    Python handler wakes it, it interrupts z3, and the handler runs once the check returns.
    (SIGINT needs none of this: z3 cancels the check on its own.) Started once, on first use."""

    _lock = threading.Lock()
    _instance: "_SignalWatch | None" = None

    def __init__(self) -> None:
        self.reader, self.writer = socket.socketpair()
        self.writer.setblocking(False)
        self.active = False
        threading.Thread(target=self._watch, name="kvproof-z3-signals", daemon=True).start()

    def _watch(self) -> None:
        while self.reader.recv(64):
            with self._lock:
                if self.active:
                    z3.main_ctx().interrupt()

    @classmethod
    @contextlib.contextmanager
    def during_check(cls) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            watch = cls._instance
            watch.active = True
        previous = signal.set_wakeup_fd(watch.writer.fileno(), warn_on_full_buffer=False)
        try:
            yield
        finally:
            signal.set_wakeup_fd(previous)
            with cls._lock:
                watch.active = False


def _check(s: z3.Solver) -> z3.CheckSatResult:
    """``s.check()``, stopped by Ctrl-C or SIGTERM: a check a signal cancelled raises
    KeyboardInterrupt (or the signal's own handler raises first), never a verdict ``timeout``."""
    with _SignalWatch.during_check():
        result = s.check()
    if result == z3.unknown and s.reason_unknown() in _INTERRUPTED:
        raise KeyboardInterrupt(s.reason_unknown())
    return result


def _solver(timeout_ms: int) -> z3.Solver:
    s = z3.Solver()
    # Fixed seeds: the same z3 build gives the same models (and so the same minimal
    # counterexample) on every run.
    s.set("timeout", max(1, timeout_ms), "random_seed", 0)
    return s


def _minimal_counterexample(lemma: Lemma, v: Vars, s: z3.Solver) -> dict[str, int]:
    """Lexicographically least counterexample over ``inputs`` (each minimised in turn).

    The least element of the counterexample set does not depend on which model z3 found
    first, which is what lets golden files pin it.
    """
    fixed: dict[str, int] = {}
    for name in lemma.inputs:
        var = getattr(v, name)
        best = s.model().eval(var, model_completion=True).as_long()
        for _ in range(256):  # each round lowers `best`; small domains end in a few rounds
            s.push()
            s.add(var < best)
            if _check(s) != z3.sat:
                s.pop()
                break
            best = s.model().eval(var, model_completion=True).as_long()
            s.pop()
        s.add(var == best)
        if _check(s) != z3.sat:  # cannot happen (best came from a model); keep it honest
            break
        fixed[name] = best
    return fixed


def check_lemma(lemma: Lemma, budget: float) -> Outcome:
    """Verdict for ``lemma``; ``budget`` seconds is a deadline, not a share to spread."""
    start = time.monotonic()
    v = Vars()
    bad = _fidelity(lemma, v)
    if bad is not None:
        return bad
    base = z3.And(lemma.domain(v), lemma.definitions(v))
    proved: list[z3.BoolRef] = []
    for i, step in enumerate(lemma.steps):
        left = budget - (time.monotonic() - start)
        s = _solver(int(1000 * max(0.0, min(STEP_SECONDS, left))))
        s.add(base, *proved, z3.Not(step(v)))
        result = _check(s)
        reason = s.reason_unknown() if result == z3.unknown else ""
        if result == z3.unsat:
            proved.append(step(v))
            continue
        if i == len(lemma.steps) - 1 and result == z3.sat:
            return _refuted(lemma, v, s)
        # An intermediate step failed: look for a counterexample to the claim itself.
        s = _solver(int(1000 * max(0.0, min(STEP_SECONDS, budget - (time.monotonic() - start)))))
        s.add(base, z3.Not(lemma.steps[-1](v)))
        if _check(s) == z3.sat:
            return _refuted(lemma, v, s)
        if result == z3.unknown:
            return Outcome(TIMEOUT, detail=f"step {i + 1} of {len(lemma.steps)} timed out ({reason})")
        # The step is false somewhere the claim is not: the proof script, not the spec, is wrong.
        return Outcome(ERROR, detail=f"step {i + 1} of {len(lemma.steps)} does not follow from the steps before it")
    return Outcome(PROVED, detail=f"{len(lemma.steps)} steps, for all integers in the domain")


def _refuted(lemma: Lemma, v: Vars, s: z3.Solver) -> Outcome:
    inputs = _minimal_counterexample(lemma, v, s)
    values = {**inputs, **lemma.spec_values(dict(inputs))}
    # Replay on the spec itself: a counterexample that only the model believes is a bug here.
    if not _holds(lemma.definitions(v), values, v) or _holds(lemma.steps[-1](v), values, v):
        return Outcome(ERROR, detail=f"z3 counterexample does not replay on the spec: {_fmt(lemma, values)}")
    return Outcome(REFUTED, counterexample=_fmt(lemma, values))


def check_lemmas(lemmas: tuple[Lemma, ...], budget: float) -> Outcome:
    """Proved when every lemma is; otherwise the first lemma's verdict that is not. ``budget``
    is a deadline for all of them."""
    deadline = time.monotonic() + budget
    steps = 0
    for i, lemma in enumerate(lemmas):
        outcome = check_lemma(lemma, deadline - time.monotonic())
        if outcome.verdict != PROVED:
            prefix = f"lemma {i + 1} of {len(lemmas)}: " if len(lemmas) > 1 else ""
            return dataclasses.replace(outcome, detail=prefix + outcome.detail)
        steps += len(lemma.steps)
    return Outcome(PROVED, detail=f"{steps} steps, for all integers in the domain")


def lemma_obligation(id: str, invariants: tuple[str, ...], statement: str, *lemmas: Lemma):
    """An :class:`~kvproof.proofs.registry.Obligation` discharged by proving ``lemmas``."""
    return Obligation(id, invariants, "z3", statement, lambda budget: check_lemmas(lemmas, budget))
