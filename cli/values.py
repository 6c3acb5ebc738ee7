"""Numbers on the command line, for every command: plain decimal numbers only, and the caps on
sizes.

Python's ``int()`` also reads ``1_6``, ``+16``, `` 16 ``, ``１６`` (full-width) and ``١٦``
(Arabic-Indic digits) as 16, and ``float()`` reads ``1e3``, ``inf`` and ``nan``; a flag that
silently means something else than what was typed is refused instead. Every numeric flag, list
(``--dcp 1,2,4``) and range (``100-2000``) goes through :func:`parse_decimal` or
:func:`parse_decimal_number`. Lower bounds (``dcp 0``) are checked by the layer that owns the
value (spec, scheduler, planner), with its message; the caps here keep absurd sizes from
reaching arithmetic that overflows or memory that is not there (docs/replay.md, "Errors and
limits").
"""

from __future__ import annotations

import argparse
import re
from typing import Callable

from kvproof.spec.geometry import MAX_NUM_BLOCKS

_DECIMAL = re.compile(r"-?[0-9]+")
_DECIMAL_NUMBER = re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)")
#: More digits than any cap below: refused before int() (which refuses past 4300 digits).
_MAX_DIGITS = 24

#: Every token count (block size, window, lengths, budgets) is at most 2**30: the longest
#: context the geometry accepts (spec.layout.MAX_MODEL_LEN_LIMIT).
TOKEN_LIMIT = 1 << 30
#: Speculative blocks per Mamba group: one per speculative token; drafters propose a handful.
SPECULATIVE_BLOCKS_LIMIT = 128
#: torch seeds are unsigned 64-bit integers.
SEED_LIMIT = (1 << 64) - 1


def parse_decimal(text: str, what: str) -> int:
    """``text`` as a decimal integer (ASCII digits, optional leading '-'). ValueError naming
    ``what`` and the text otherwise."""
    if not _DECIMAL.fullmatch(text):
        raise ValueError(f"{what} {text!r} is not a decimal integer; expected digits 0-9 only")
    if len(text.lstrip("-")) > _MAX_DIGITS:
        raise ValueError(f"{what} {text[:12]}... ({len(text)} digits) is too large")
    return int(text)


def parse_decimal_number(text: str, what: str) -> float:
    """``text`` as a decimal number (ASCII digits with an optional '.' and leading '-'; no
    exponent, ``inf`` or ``nan``). ValueError naming ``what`` and the text otherwise."""
    if not _DECIMAL_NUMBER.fullmatch(text):
        raise ValueError(f"{what} {text!r} is not a decimal number; expected digits 0-9 with an optional '.'")
    if len(text.lstrip("-")) > _MAX_DIGITS:
        raise ValueError(f"{what} {text[:12]}... ({len(text)} characters) is too long")
    return float(text)


def check_at_most(value: int, limit: int, what: str, why: str) -> int:
    if value > limit:
        raise ValueError(f"{what} {value} is too large; expected at most {limit:,} ({why})")
    return value


def decimal(limit: int | None = None, why: str = "", minimum: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: a decimal integer, at most ``limit`` (``why`` says why) and at
    least ``minimum`` when given."""

    def parse(text: str) -> int:
        try:
            value = parse_decimal(text, "value")
            if minimum is not None and value < minimum:
                raise ValueError(f"value {value} is too small; expected at least {minimum}")
            return value if limit is None else check_at_most(value, limit, "value", why)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix("value ")) from None

    parse.__name__ = "decimal integer"
    return parse


def decimal_number(text: str) -> float:
    """An argparse ``type``: a decimal number (range: the layer that owns the value)."""
    try:
        return parse_decimal_number(text, "value")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("value ")) from None


decimal_number.__name__ = "decimal number"

#: argparse types of the numeric flags.
token_count = decimal(TOKEN_LIMIT, "2**30 tokens, the longest context kvproof accepts")
block_count = decimal(MAX_NUM_BLOCKS, "block ids are int32 in block tables")
speculative_count = decimal(SPECULATIVE_BLOCKS_LIMIT, "one block per speculative token")
seed_value = decimal(SEED_LIMIT, "torch seeds are unsigned 64-bit integers", minimum=0)
any_decimal = decimal()
