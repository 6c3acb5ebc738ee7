"""Integer helpers used by every geometry rule, each with the lemma it guarantees."""

from __future__ import annotations

import math

import icontract


@icontract.require(lambda a: a >= 0, error=lambda a: ValueError(f"cdiv numerator {a} must be >= 0"), enabled=True)
@icontract.require(lambda b: b > 0, error=lambda b: ValueError(f"cdiv divisor {b} must be > 0"), enabled=True)
@icontract.ensure(
    lambda a, b, result: result * b >= a > (result - 1) * b,
    "INV-ARITH-CDIV: cdiv(a, b) is the least k with k*b >= a",
    enabled=True,
)
def cdiv(a: int, b: int) -> int:
    """Ceiling division ``ceil(a / b)`` for ``a >= 0, b > 0``."""
    return cdiv_unchecked(a, b)


def cdiv_unchecked(a: int, b: int) -> int:
    """The ceiling division itself, without :func:`cdiv`'s contracts (they cost ~7 us a call,
    the division ~0.1 us): for the scheduler's hot path, whose callers pass token counts >= 0
    and block sizes > 0. Tested through :func:`cdiv`."""
    return -(-a // b)


@icontract.require(lambda x: x >= 0, error=lambda x: ValueError(f"floor_to value {x} must be >= 0"), enabled=True)
@icontract.require(lambda a: a > 0, error=lambda a: ValueError(f"floor_to alignment {a} must be > 0"), enabled=True)
@icontract.ensure(
    lambda x, a, result: result % a == 0 and result <= x < result + a,
    "INV-ARITH-FLOOR: floor_to(x, a) is the largest multiple of a that is <= x",
    enabled=True,
)
def floor_to(x: int, a: int) -> int:
    """Round ``x`` down to a multiple of ``a``."""
    return x - x % a


def lcm_all(values: tuple[int, ...]) -> int:
    """Least common multiple of positive ints (1 for the empty tuple)."""
    out = 1
    for v in values:
        out = out * v // math.gcd(out, v)
    return out


def gcd_all(values: tuple[int, ...]) -> int:
    """Greatest common divisor of positive ints (0 for the empty tuple)."""
    out = 0
    for v in values:
        out = math.gcd(out, v)
    return out
