"""Shared switches and helpers for the contracts of every layer.

Contracts come in two tiers (docs/spec.md, "Tiers"):
- cheap: O(1) or O(blocks touched); always on, also in staging;
- slow: whole-state checks; on only when ``ICONTRACT_SLOW`` is set in the environment
  (the test suite sets it) or when a caller flips :data:`SLOW` explicitly.
"""

from __future__ import annotations

import os

#: Whole-state (slow-tier) checks are enabled. Read once at import: icontract binds
#: ``enabled=`` when the decorator runs, so flipping it later affects only ``_check()`` calls
#: that consult it at run time.
SLOW: bool = os.environ.get("ICONTRACT_SLOW", "").lower() not in ("", "0", "false", "no")


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
        guarded = icontract.ensure(contract.condition, contract.description)(guarded)
    for group in getattr(real, "__preconditions__", []):
        for contract in reversed(group):
            guarded = icontract.require(contract.condition, contract.description, error=contract.error)(guarded)
    return guarded
