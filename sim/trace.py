"""Request traces: JSON Lines, one request per line (docs/replay.md)::

    {"id": "r1", "prompt": [ints], "output": [ints], "arrival": 0, "cache_salt": null}

``arrival`` is the scheduler step at which the request arrives; ``output`` tokens are decoded
one per step. ``output``, ``arrival`` and ``cache_salt`` are optional (``[]``, ``0``, ``null``).
Token ids and arrivals are integers in ``[0, 2**63)`` (int64, what torch and the e2e model
take); ids and salts are Unicode text (no lone surrogates); a line is UTF-8.

A trace file is read once, front to back (:func:`trace_lines`): a pipe, ``/dev/stdin``, a FIFO
or a process substitution reads as a file does, and a gzip stream (``.gz``, recognised by its
first bytes) is decompressed on the way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import json
import zlib
from typing import Iterable, Iterator, Optional, Union

#: Token ids and arrival steps are below this (signed 64-bit integers).
INT_LIMIT = 1 << 63


class TraceError(ValueError):
    """A malformed trace line; the message names the line number, the field and the problem."""


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    id: str
    prompt: tuple[int, ...]
    output: tuple[int, ...] = ()
    arrival: int = 0
    cache_salt: Optional[str] = None

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV the run computes: the prompt and every output but the last (the KV of
        the last sampled token is never computed; docs/replay.md)."""
        return len(self.prompt) + max(len(self.output) - 1, 0)


_FIELDS = {"id", "prompt", "output", "arrival", "cache_salt"}


def show_value(value: object, limit: int = 40) -> str:
    """``repr(value)``, cut to ``limit`` characters (an error line stays one readable line)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _where(lineno: int, rid: Optional[str]) -> str:
    return f"line {lineno}" + (f" (request {show_value(rid)})" if rid is not None else "")


def _tokens(value, name: str, lineno: int, rid: str, allow_empty: bool) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise TraceError(f"{_where(lineno, rid)}: {name!r} must be a list of token ids, got {type(value).__name__}")
    # Fast path (a million-token prompt): one pass with built-in predicates.
    if not all(type(t) is int and 0 <= t < INT_LIMIT for t in value):
        i, bad = next((i, t) for i, t in enumerate(value) if not (type(t) is int and 0 <= t < INT_LIMIT))
        raise TraceError(
            f"{_where(lineno, rid)}: {name!r} token {show_value(bad)} at index {i} is not a token id; "
            f"expected an integer with 0 <= id < 2**63"
        )
    if not value and not allow_empty:
        raise TraceError(f"{_where(lineno, rid)}: {name!r} must hold at least one token")
    return tuple(value)


def _text(value: str, name: str, lineno: int, rid: Optional[str]) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise TraceError(
            f"{_where(lineno, rid)}: {name!r} {show_value(value)} is not valid Unicode "
            f"(lone surrogate at index {e.start}); expected text"
        ) from None
    return value


def _no_duplicate_keys(pairs: list) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise TraceError(f"field {show_value(dup)} appears twice in one object")
    return obj


def decode_line(raw: Union[bytes, str], lineno: int) -> object:
    """One line (bytes: UTF-8) as JSON, each key at most once. Raises TraceError naming the line."""
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TraceError(f"line {lineno}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1})") from None
    try:
        return json.loads(raw, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as e:
        raise TraceError(f"line {lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
    except TraceError as e:
        raise TraceError(f"line {lineno}: {e}") from None
    except RecursionError:
        raise TraceError(f"line {lineno}: JSON nested too deeply; expected one flat object per request") from None
    except ValueError:  # Python refuses integer literals of more than 4300 digits
        raise TraceError(f"line {lineno}: an integer of thousands of digits; expected token ids and steps "
                         "below 2**63") from None


def parse_line(text: Union[bytes, str], lineno: int) -> TraceRequest:
    """One line (bytes: UTF-8) -> TraceRequest. Raises TraceError naming the line and field."""
    return request_from_object(decode_line(text, lineno), lineno)


def request_from_object(obj: object, lineno: int) -> TraceRequest:
    """A decoded line -> TraceRequest. Raises TraceError naming the line and field."""
    if not isinstance(obj, dict):
        raise TraceError(f"line {lineno}: expected a JSON object, got {type(obj).__name__}")
    unknown = set(obj) - _FIELDS
    if unknown:
        raise TraceError(f"line {lineno}: unknown field(s) {', '.join(sorted(map(show_value, unknown)))}; "
                         f"expected {', '.join(sorted(_FIELDS))}")
    if "id" not in obj or not isinstance(obj["id"], str) or not obj["id"]:
        raise TraceError(f"line {lineno}: 'id' must be a non-empty string")
    rid = _text(obj["id"], "id", lineno, None)
    if "prompt" not in obj:
        raise TraceError(f"{_where(lineno, rid)}: missing 'prompt'")
    arrival = obj.get("arrival", 0)
    if type(arrival) is not int or not 0 <= arrival < INT_LIMIT:
        raise TraceError(f"{_where(lineno, rid)}: 'arrival' {show_value(arrival)} must be a scheduler step, an integer with "
                         "0 <= step < 2**63")
    salt = obj.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise TraceError(f"{_where(lineno, rid)}: 'cache_salt' {show_value(salt)} must be a string or null")
    return TraceRequest(
        id=rid,
        prompt=_tokens(obj["prompt"], "prompt", lineno, rid, allow_empty=False),
        output=_tokens(obj.get("output", []), "output", lineno, rid, allow_empty=True),
        arrival=arrival,
        cache_salt=None if salt is None else _text(salt, "cache_salt", lineno, rid),
    )


def parse_trace(lines: Iterable[Union[bytes, str]]) -> list[TraceRequest]:
    """Parse a trace; blank lines are skipped. Raises TraceError (line number, field, problem)."""
    out: list[TraceRequest] = []
    seen: dict[str, int] = {}
    for lineno, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        req = parse_line(text, lineno)
        if req.id in seen:
            raise TraceError(f"line {lineno}: duplicate request id {show_value(req.id)} (first on line {seen[req.id]})")
        seen[req.id] = lineno
        out.append(req)
    return out


_GZIP_MAGIC = b"\x1f\x8b"


@contextlib.contextmanager
def _opened(path: str) -> Iterator:
    """``path`` opened for reading bytes, through gzip when its first two bytes say so (peeked,
    so a pipe is not read twice)."""
    with open(path, "rb") as f:
        if f.peek(2)[:2] == _GZIP_MAGIC:
            with gzip.GzipFile(fileobj=f, mode="rb") as g:
                yield g
        else:
            yield f


def trace_lines(path: str) -> Iterator[bytes]:
    """The lines of the file at ``path``, read once (any readable stream; gzip decompressed).
    Raises ValueError naming the file when it cannot be read, or its gzip stream is damaged."""
    try:
        with _opened(path) as f:
            yield from f
    except gzip.BadGzipFile as e:
        raise ValueError(f"{path}: not a valid gzip stream ({e})") from None
    except OSError as e:
        raise ValueError(f"cannot read trace {path!r}: {e.strerror or e}") from None
    except (EOFError, zlib.error) as e:  # EOFError: the compressed stream stops before its end
        raise ValueError(f"{path}: the gzip stream is damaged or cut short ({e})") from None


def read_trace(path: str) -> list[TraceRequest]:
    """Parse the trace file at ``path`` (read once; see :func:`trace_lines`). Raises ValueError
    naming the file (and for a malformed line, the line number, the field and the problem),
    also for a trace that holds no request."""
    try:
        trace = parse_trace(trace_lines(path))
    except TraceError as e:
        raise ValueError(f"{path}: {e}") from None
    if not trace:
        raise ValueError(f"{path}: the trace holds no request")
    return trace


def dump_trace(requests: Iterable[TraceRequest]) -> str:
    return "".join(
        json.dumps({"id": r.id, "prompt": list(r.prompt), "output": list(r.output), "arrival": r.arrival, "cache_salt": r.cache_salt}) + "\n"
        for r in requests
    )
