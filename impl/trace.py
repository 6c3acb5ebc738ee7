"""Request traces: JSON Lines, one request per line (docs/replay.md)::

    {"id": "r1", "prompt": [ints], "output": [ints], "arrival": 0, "cache_salt": null}

``arrival`` is the scheduler step at which the request arrives; ``output`` tokens are decoded
one per step. ``output``, ``arrival`` and ``cache_salt`` are optional (``[]``, ``0``, ``null``).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Iterable, Optional


class TraceError(ValueError):
    """A malformed trace line; the message names the line number and the problem."""


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    id: str
    prompt: tuple[int, ...]
    output: tuple[int, ...] = ()
    arrival: int = 0
    cache_salt: Optional[str] = None


_FIELDS = {"id", "prompt", "output", "arrival", "cache_salt"}


def _tokens(value, name: str, lineno: int, allow_empty: bool) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise TraceError(f"line {lineno}: {name!r} must be a list of non-negative integers")
    if not value and not allow_empty:
        raise TraceError(f"line {lineno}: {name!r} must hold at least one token")
    return tuple(value)


def parse_line(text: str, lineno: int) -> TraceRequest:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(f"line {lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"line {lineno}: expected a JSON object, got {type(obj).__name__}")
    unknown = set(obj) - _FIELDS
    if unknown:
        raise TraceError(f"line {lineno}: unknown field(s) {', '.join(sorted(unknown))}; expected {', '.join(sorted(_FIELDS))}")
    if "id" not in obj or not isinstance(obj["id"], str) or not obj["id"]:
        raise TraceError(f"line {lineno}: 'id' must be a non-empty string")
    if "prompt" not in obj:
        raise TraceError(f"line {lineno}: missing 'prompt'")
    arrival = obj.get("arrival", 0)
    if not isinstance(arrival, int) or isinstance(arrival, bool) or arrival < 0:
        raise TraceError(f"line {lineno}: 'arrival' {arrival!r} must be a non-negative integer step")
    salt = obj.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise TraceError(f"line {lineno}: 'cache_salt' {salt!r} must be a string or null")
    return TraceRequest(
        id=obj["id"],
        prompt=_tokens(obj["prompt"], "prompt", lineno, allow_empty=False),
        output=_tokens(obj.get("output", []), "output", lineno, allow_empty=True),
        arrival=arrival,
        cache_salt=salt,
    )


def parse_trace(lines: Iterable[str]) -> list[TraceRequest]:
    """Parse a trace; blank lines are skipped. Raises TraceError (line number, problem)."""
    out: list[TraceRequest] = []
    seen: dict[str, int] = {}
    for lineno, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        req = parse_line(text, lineno)
        if req.id in seen:
            raise TraceError(f"line {lineno}: duplicate request id {req.id!r} (first on line {seen[req.id]})")
        seen[req.id] = lineno
        out.append(req)
    return out


def read_trace(path: str) -> list[TraceRequest]:
    """Parse the trace file at ``path``. Raises ValueError naming the file (and for a malformed
    line, the line number and the problem)."""
    try:
        with open(path, encoding="utf-8") as f:
            return parse_trace(f)
    except OSError as e:
        raise ValueError(f"cannot read trace {path!r}: {e.strerror}") from None
    except TraceError as e:
        raise ValueError(f"{path}: {e}") from None


def dump_trace(requests: Iterable[TraceRequest]) -> str:
    return "".join(
        json.dumps({"id": r.id, "prompt": list(r.prompt), "output": list(r.output), "arrival": r.arrival, "cache_salt": r.cache_salt}) + "\n"
        for r in requests
    )
