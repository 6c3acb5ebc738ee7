"""Shared switches and helpers for the contracts of every layer.

Contracts come in two tiers (docs/spec.md, "Tiers"):
- cheap: O(1) or O(blocks touched); always on, ``python -O`` or not;
- slow: whole-state checks; on while *the slow switch* is on.

The slow switch is the one place that says whether slow-tier checks run. It starts from the
environment (``ICONTRACT_SLOW=1``; the test suite sets it) and is read at call time, so it can
be flipped at any moment: :func:`set_slow`, or :func:`slow_checks` for a block. Each icontract
condition names its tier where it is declared (:func:`ensure`, :func:`snapshot` with ``tier=``);
a slow-tier condition costs one branch per call while the switch is off.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from typing import Callable, Iterator

_slow: bool = os.environ.get("ICONTRACT_SLOW", "").lower() not in ("", "0", "false", "no")


def slow() -> bool:
    """Whether slow-tier (whole-state) checks run now. No state change."""
    return _slow


def set_slow(on: bool) -> None:
    """Mutates the process-wide switch: slow-tier checks run from now on iff ``on``."""
    global _slow
    if not isinstance(on, bool):
        raise ValueError(f"the slow switch takes a bool, got {on!r}")
    _slow = on


@contextlib.contextmanager
def slow_checks(on: bool = True) -> Iterator[None]:
    """Turn the slow switch to ``on`` inside the block and back to what it was after."""
    before = _slow
    set_slow(on)
    try:
        yield
    finally:
        set_slow(before)


CHEAP = "cheap"
SLOW = "slow"
TIERS = (CHEAP, SLOW)


def ensure(condition: Callable, description: str, *, tier: str) -> Callable[[Callable], Callable]:
    """An icontract postcondition of tier ``tier`` (:data:`CHEAP`: always on; :data:`SLOW`:
    while the slow switch is on). Stacks with :func:`snapshot` and other :func:`ensure` in any
    order. After a call the cheap conditions are checked first (they name the broken rule most
    precisely), then the slow ones, each tier in icontract's order."""
    import icontract  # local: keeps this module import-light for the CLI

    return _declare(tier, lambda: icontract.ensure(condition, description, enabled=True))


def snapshot(capture: Callable, name: str, *, tier: str) -> Callable[[Callable], Callable]:
    """An icontract snapshot (``OLD.<name>``) taken only where conditions of tier ``tier`` run."""
    import icontract

    return _declare(tier, lambda: icontract.snapshot(capture, name=name, enabled=True))


def _declare(tier: str, make: Callable[[], Callable]) -> Callable[[Callable], Callable]:
    """A decorator adding the condition ``make`` builds, of ``tier``, to a function: it rebuilds
    the function's two variants -- cheap conditions only, and every condition -- from the bare
    function and all conditions declared on it so far, and picks one per call by the switch."""
    if tier not in TIERS:
        raise ValueError(f"contract tier {tier!r} must be one of {', '.join(TIERS)}")

    def add(fn: Callable) -> Callable:
        bare = getattr(fn, "__contract_bare__", fn)
        declared = [(tier, make), *getattr(fn, "__contract_tiers__", ())]  # top first
        always = _wrap(bare, [m for t, m in declared if t == CHEAP])
        everything = _wrap(_opaque(always, bare), [m for t, m in declared if t == SLOW])

        @functools.wraps(bare)
        def dispatch(*args, **kwargs):
            if _slow:
                return everything(*args, **kwargs)
            return always(*args, **kwargs)

        dispatch.__contract_bare__ = bare
        dispatch.__contract_tiers__ = tuple(declared)
        return dispatch

    return add


def _opaque(fn: Callable, like: Callable) -> Callable:
    """``fn`` behind a plain function with ``like``'s signature and no ``__wrapped__``, so that
    icontract gives conditions added over it a checker of their own instead of joining ``fn``'s."""

    def call(*args, **kwargs):
        return fn(*args, **kwargs)

    call.__signature__ = inspect.signature(like)
    call.__name__, call.__qualname__, call.__doc__ = like.__name__, like.__qualname__, like.__doc__
    return call


def _wrap(bare: Callable, makers: list) -> Callable:
    """``bare`` under the given icontract decorators (listed top first), applied bottom up."""
    wrapped = bare
    for make in reversed(makers):
        wrapped = make()(wrapped)
    return wrapped


class InvariantViolation(AssertionError):
    """A checked invariant did not hold. The message starts with the invariant id."""

    def __init__(self, inv_id: str, detail: str) -> None:
        super().__init__(f"{inv_id}: {detail}")
        self.inv_id = inv_id
        self.detail = detail


def check(condition: bool, inv_id: str, detail: str) -> None:
    """Raise :class:`InvariantViolation` naming ``inv_id`` unless ``condition`` holds.

    ``detail`` should name the request, the group and the numbers involved. Callers on hot
    paths build ``detail`` lazily (only after the condition failed).
    """
    if not condition:
        raise InvariantViolation(inv_id, detail)


def guard_like(real, body):
    """``body`` guarded by exactly the icontract pre- and postconditions of ``real``.

    Used by tests and proof canaries to show that a contract has teeth: a deliberately wrong
    formula with the same signature, guarded like the real one, must be rejected.
    """
    import icontract

    guarded = body
    for contract in reversed(getattr(real, "__postconditions__", [])):
        guarded = icontract.ensure(contract.condition, contract.description, enabled=True)(guarded)
    for group in getattr(real, "__preconditions__", []):
        for contract in reversed(group):
            guarded = icontract.require(contract.condition, contract.description, error=contract.error, enabled=True)(guarded)
    return guarded
