"""cdiv and floor_to: values, refused input, and each postcondition clause firing on a body that
breaks exactly that clause (``guard_like``)."""

from __future__ import annotations

import icontract
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvproof.spec import arith
from kvproof.spec.contracts import guard_like


@given(st.integers(0, 10**6), st.integers(1, 10**4))
def test_cdiv_and_floor_to_values(a, b):
    assert arith.cdiv(a, b) == -(-a // b)
    assert arith.floor_to(a, b) == (a // b) * b


@pytest.mark.parametrize("a, b, expected", [(0, 1, 0), (0, 7, 0), (1, 1, 1), (7, 7, 1), (8, 7, 2), (14, 7, 2)])
def test_cdiv_at_the_edges(a, b, expected):
    assert arith.cdiv(a, b) == expected


@pytest.mark.parametrize("x, a, expected", [(0, 1, 0), (0, 4, 0), (3, 4, 0), (4, 4, 4), (7, 4, 4), (8, 4, 8)])
def test_floor_to_at_the_edges(x, a, expected):
    assert arith.floor_to(x, a) == expected


@pytest.mark.parametrize("call, message", [
    (lambda: arith.cdiv(-1, 2), "cdiv numerator -1 must be >= 0"),
    (lambda: arith.cdiv(1, 0), "cdiv divisor 0 must be > 0"),
    (lambda: arith.floor_to(-1, 2), "floor_to value -1 must be >= 0"),
    (lambda: arith.floor_to(1, 0), "floor_to alignment 0 must be > 0"),
])
def test_bad_input_is_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("body, args", [
    (lambda a, b: -(-a // b) - 1, (4, 2)),  # too small: result * b < a
    (lambda a, b: -(-a // b) + 1, (4, 2)),  # too large, exactly one step: a == (result - 1) * b
    (lambda a, b: -(-a // b) + 1, (0, 3)),
])
def test_cdiv_postcondition_fires(body, args):
    with pytest.raises(icontract.ViolationError, match="INV-ARITH-CDIV"):
        guard_like(arith.cdiv, body)(*args)


@pytest.mark.parametrize("body, args", [
    (lambda x, a: x, (5, 2)),  # not a multiple of a
    (lambda x, a: x - x % a + a, (5, 2)),  # above x
    (lambda x, a: x - x % a - a, (4, 2)),  # a whole step below: x == result + a
])
def test_floor_to_postcondition_fires(body, args):
    with pytest.raises(icontract.ViolationError, match="INV-ARITH-FLOOR"):
        guard_like(arith.floor_to, body)(*args)


def test_lcm_and_gcd_of_tuples():
    assert arith.lcm_all(()) == 1 and arith.gcd_all(()) == 0
    assert arith.lcm_all((4, 6, 10)) == 60 and arith.gcd_all((12, 18, 30)) == 6
