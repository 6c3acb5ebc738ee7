"""Shared switches and helpers for the contracts of every layer.

Contracts come in two tiers (docs/spec.md, "Tiers"):
- cheap: O(1) or O(blocks touched); always on, ``python -O`` or not;
- slow: whole-state checks; on while *the slow switch* is on.

The slow switch is the one place that says whether slow-tier checks run. It starts from the
environment (``ICONTRACT_SLOW=1``; the test suite sets it) and is read at call time, so it can
be flipped at any moment: :func:`set_slow`, or :func:`slow_checks` for a block. Slow-tier
icontract conditions are attached with :func:`slow_tier`, whose wrapper costs one branch per
call while the switch is off.
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


def slow_tier(checked: Callable) -> Callable:
    """Make the icontract conditions stacked under this decorator slow-tier: they run only while
    the slow switch is on, decided at each call; with it off a call costs one branch more than
    the bare function. Give those conditions ``enabled=True`` so that ``python -O`` does not
    remove them when the switch asks for them. Cheap conditions go above this decorator."""
    bare = inspect.unwrap(checked)

    @functools.wraps(bare)
    def dispatch(*args, **kwargs):
        if _slow:
            return checked(*args, **kwargs)
        return bare(*args, **kwargs)

    return dispatch


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
    import icontract  # local: keeps this module import-light for the CLI

    guarded = body
    for contract in reversed(getattr(real, "__postconditions__", [])):
        guarded = icontract.ensure(contract.condition, contract.description, enabled=True)(guarded)
    for group in getattr(real, "__preconditions__", []):
        for contract in reversed(group):
            guarded = icontract.require(contract.condition, contract.description, error=contract.error, enabled=True)(guarded)
    return guarded
