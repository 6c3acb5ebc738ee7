"""The Mooncake trace format: real chat traffic whose prompts are chains of 512-token hash ids.

One request per line (the FAST'25 release, Apache-2.0; ``../shared/traces/mooncake/README.md``)::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

Equal ids mean equal token content, so two prompts share a prefix exactly as far as their id
lists agree; the last id covers the prompt's final ``input_length - 512 * (len(hash_ids) - 1)``
tokens. There is no token text, so each id is expanded into 512 deterministic tokens
(:func:`block_tokens`: injective, and a partial last block is a prefix of its id's tokens) and
each output into fresh tokens no prompt contains (:func:`output_tokens`).

Lines are parsed and expanded one at a time (:func:`iter_mooncake`, :func:`to_trace_request`):
the expanded trace is never held whole (the full file is 145 M prompt tokens).
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Optional

from kvproof.sim.trace import INT_LIMIT, TraceError, TraceRequest, decode_line, show_value, trace_lines
from kvproof.spec.arith import cdiv

#: Tokens per Mooncake hash id.
MOONCAKE_BLOCK = 512
#: Output tokens live above every prompt token (prompt tokens are ``id * 512 + j`` < 2**40).
OUTPUT_TOKEN_BASE = 1 << 40
#: Output tokens of request ``i`` are ``OUTPUT_TOKEN_BASE + i * OUTPUT_STRIDE + j``.
OUTPUT_STRIDE = 1 << 24
_MAX_HASH_ID = (OUTPUT_TOKEN_BASE // MOONCAKE_BLOCK) - 1

_FIELDS = frozenset({"timestamp", "input_length", "output_length", "hash_ids"})


@dataclasses.dataclass(frozen=True)
class MooncakeRequest:
    """One parsed line; ``index`` is its 0-based position among the file's requests."""

    index: int
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def is_mooncake_record(obj: object) -> bool:
    """Whether a decoded JSON line is in the Mooncake format (rather than kvproof's own)."""
    return isinstance(obj, dict) and "hash_ids" in obj


def _non_negative_int(obj: dict, name: str, lineno: int, upper: Optional[int] = None) -> int:
    value = obj.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TraceError(f"line {lineno}: {name!r} {show_value(value)} must be a non-negative integer")
    if upper is not None and value > upper:
        raise TraceError(f"line {lineno}: {name!r} {show_value(value)} is too large; expected at most {upper:,}")
    return value


def parse_mooncake_record(obj: object, lineno: int, index: int) -> MooncakeRequest:
    """Validate one decoded line. Raises TraceError naming the line and the field."""
    if not isinstance(obj, dict):
        raise TraceError(f"line {lineno}: expected a JSON object, got {type(obj).__name__}")
    missing, unknown = _FIELDS - set(obj), set(obj) - _FIELDS
    if missing or unknown:
        what = (f"missing {', '.join(sorted(missing))}" if missing else "") + (
            ("; " if missing and unknown else "") + (f"unknown {', '.join(sorted(unknown))}" if unknown else "")
        )
        raise TraceError(f"line {lineno}: Mooncake record has {what}; expected {', '.join(sorted(_FIELDS))}")
    timestamp = _non_negative_int(obj, "timestamp", lineno, upper=INT_LIMIT - 1)  # ms, as an int64 holds
    input_length = _non_negative_int(obj, "input_length", lineno)
    output_length = _non_negative_int(obj, "output_length", lineno, upper=OUTPUT_STRIDE - 1)
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= _MAX_HASH_ID for i in ids
    ):
        raise TraceError(f"line {lineno}: 'hash_ids' must be a list of integers in [0, {_MAX_HASH_ID}]")
    if input_length == 0:
        raise TraceError(f"line {lineno}: 'input_length' 0; a prompt must hold at least one token")
    expected = cdiv(input_length, MOONCAKE_BLOCK)
    if len(ids) != expected:
        raise TraceError(
            f"line {lineno}: {len(ids)} hash_ids for input_length {show_value(input_length)}; expected "
            f"{expected} (one per {MOONCAKE_BLOCK} tokens)"
        )
    return MooncakeRequest(index, timestamp, input_length, output_length, tuple(ids))


def iter_mooncake(path: str, limit: Optional[int] = None) -> Iterator[MooncakeRequest]:
    """The file's requests in order, parsed lazily (at most ``limit``; the file is read once, a
    gzip stream too: ``trace.trace_lines``). Raises ValueError naming the file, and for a bad
    line its number and field."""
    index = 0
    try:
        for lineno, raw in enumerate(trace_lines(path), start=1):
            if limit is not None and index >= limit:
                return
            if not raw.strip():
                continue
            yield parse_mooncake_record(decode_line(raw, lineno), lineno, index)
            index += 1
    except TraceError as e:
        raise ValueError(f"{path}: {e}") from None


def block_tokens(hash_id: int, count: int = MOONCAKE_BLOCK) -> range:
    """The first ``count`` tokens of the block named ``hash_id`` (injective over ids)."""
    start = hash_id * MOONCAKE_BLOCK
    return range(start, start + count)


def prompt_tokens(req: MooncakeRequest) -> list[int]:
    """The expanded prompt: every id's 512 tokens, the last one cut to the prompt's length."""
    out: list[int] = []
    last = len(req.hash_ids) - 1
    for i, hash_id in enumerate(req.hash_ids):
        out.extend(block_tokens(hash_id, req.input_length - MOONCAKE_BLOCK * last if i == last else MOONCAKE_BLOCK))
    return out


def output_tokens(req: MooncakeRequest) -> tuple[int, ...]:
    """Fresh output tokens, distinct from every prompt token and every other request's."""
    base = OUTPUT_TOKEN_BASE + req.index * OUTPUT_STRIDE
    return tuple(range(base, base + req.output_length))


def to_trace_request(req: MooncakeRequest, arrival: int) -> TraceRequest:
    """The request as kvproof replays it, arriving at scheduler step ``arrival``."""
    return TraceRequest(f"mc{req.index}", tuple(prompt_tokens(req)), output_tokens(req), arrival=arrival)
