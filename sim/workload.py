"""Workloads for planning: a trace file (kvproof's JSON Lines or the Mooncake format, detected
per file) or a generated multi-turn chat workload, replayed lazily.

A :class:`Workload` holds one compact entry per request (arrival step, lengths, and what is
needed to build its tokens: the line's text, Mooncake hash ids, or generator segments) sorted by
arrival. :meth:`Workload.requests` builds each request's tokens only when the replay asks for
it, so the expanded trace is never held whole. Reading a file reads it once and validates every
line up front: a malformed line fails before any replay work, with its number.

**Step-time model.** The scheduler counts steps, traces count milliseconds. Every scheduler
step is taken to last ``step_ms`` milliseconds of wall time, whatever it computes, so a request
stamped ``t`` ms arrives at step ``floor(t / step_ms)`` (and idle steps are skipped). A fixed
step is a simplification: a real step grows with the tokens it computes. It decides only how
many requests overlap in time, hence how much they compete for the pool; with a pool that
never evicts, the hit rate does not depend on it. kvproof-format traces carry arrival steps
already and ignore ``step_ms``.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import random
from typing import Callable, Iterator, NamedTuple, Optional

from kvproof.sim.mooncake import MooncakeRequest, is_mooncake_record, parse_mooncake_record, to_trace_request
from kvproof.sim.trace import (
    TraceError,
    TraceRequest,
    decode_line,
    parse_line,
    request_from_object,
    show_value,
    trace_lines,
)

KVPROOF_FORMAT = "kvproof"
MOONCAKE_FORMAT = "mooncake"
#: Longest scheduler step the model accepts (an hour); shortest a microsecond.
MAX_STEP_MS = 3_600_000.0
MIN_STEP_MS = 0.001


class Entry(NamedTuple):
    """One request, compactly: enough to order, size and later build it."""

    arrival: int
    prompt_len: int
    output_len: int
    ref: object  # format-specific: the line's text, a MooncakeRequest, generator segments


@dataclasses.dataclass
class Workload:
    """Requests in arrival order (stable: equal arrivals keep the source's order)."""

    description: str
    entries: list[Entry]
    build: Callable[[Entry], TraceRequest]

    def __len__(self) -> int:
        return len(self.entries)

    def requests(self) -> Iterator[TraceRequest]:
        """A fresh pass over the requests, each built when it is asked for."""
        build = self.build
        for e in self.entries:
            yield build(e)

    @property
    def prompt_tokens(self) -> int:
        return sum(e.prompt_len for e in self.entries)

    @property
    def longest_request(self) -> int:
        """Most tokens any request holds: its prompt and every output but the last."""
        return max((e.prompt_len + max(e.output_len - 1, 0) for e in self.entries), default=0)


def step_of(timestamp_ms: float, step_ms: float) -> int:
    """The scheduler step at which a request stamped ``timestamp_ms`` arrives."""
    return math.floor(timestamp_ms / step_ms)


def check_step_ms(step_ms: float) -> float:
    if not isinstance(step_ms, (int, float)) or not math.isfinite(step_ms) or not MIN_STEP_MS <= step_ms <= MAX_STEP_MS:
        raise ValueError(f"step time {step_ms!r} ms must be a number in [{MIN_STEP_MS}, {MAX_STEP_MS:.0f}]")
    return float(step_ms)


def _check_limit(limit: Optional[int]) -> None:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"request limit {limit!r} must be a positive integer")


# --- trace files ----------------------------------------------------------------------------


def read_workload(path: str, step_ms: float = 50.0, limit: Optional[int] = None) -> Workload:
    """The trace at ``path``, at most ``limit`` requests in file order; the format (kvproof's or
    Mooncake's) is that of its first non-blank line. The file is read once, front to back, and
    every line validated now (``trace.trace_lines``: a pipe, a FIFO or a gzip stream reads as a
    file does); each request keeps its line's text, parsed again when the replay asks for it.
    Raises ValueError naming the file, line and field, also for a trace without requests."""
    check_step_ms(step_ms)
    _check_limit(limit)
    entries: list[Entry] = []
    fmt = None
    seen: dict[str, int] = {}
    try:
        for lineno, raw in enumerate(trace_lines(path), start=1):
            if limit is not None and len(entries) >= limit:
                break
            if not raw.strip():
                continue
            obj = decode_line(raw, lineno)
            if fmt is None:
                fmt = MOONCAKE_FORMAT if is_mooncake_record(obj) else KVPROOF_FORMAT
            if fmt == MOONCAKE_FORMAT:
                r = parse_mooncake_record(obj, lineno, len(entries))
                entries.append(Entry(step_of(r.timestamp_ms, step_ms), r.input_length, r.output_length, r))
                continue
            req = request_from_object(obj, lineno)
            if req.id in seen:
                raise TraceError(f"line {lineno}: duplicate request id {show_value(req.id)} (first on line {seen[req.id]})")
            seen[req.id] = lineno
            entries.append(Entry(req.arrival, len(req.prompt), len(req.output), (raw, lineno)))
    except TraceError as e:
        raise ValueError(f"{path}: {e}") from None
    if not entries:
        raise ValueError(f"{path}: the trace holds no request")
    entries.sort(key=lambda e: e.arrival)
    if fmt == MOONCAKE_FORMAT:
        return Workload(f"{path} (Mooncake format, {len(entries):,} requests, {step_ms:g} ms per step)", entries,
                        _build_mooncake)
    return Workload(f"{path} (kvproof format, {len(entries):,} requests)", entries, _build_kvproof)


def _build_mooncake(e: Entry) -> TraceRequest:
    req: MooncakeRequest = e.ref  # type: ignore[assignment]
    return to_trace_request(req, e.arrival)


def _build_kvproof(e: Entry) -> TraceRequest:
    raw, lineno = e.ref  # type: ignore[misc]
    return parse_line(raw, lineno)


# --- the generator ---------------------------------------------------------------------------

#: Token spaces of the generator's segments (disjoint, so equal tokens mean equal content).
_SYSTEM_BASE = 0
_USER_BASE = 1 << 40
_OUTPUT_BASE = 1 << 48
_SEGMENT_STRIDE = 1 << 24  # longest segment the generator may draw
#: Conversations a continuation may pick from (the most recent ones).
_OPEN_CONVERSATIONS = 64
MAX_GENERATED_REQUESTS = 10_000_000


@dataclasses.dataclass(frozen=True)
class GeneratorSpec:
    """A multi-turn chat workload. Each request is either a new conversation (one of
    ``system_prompts`` shared system prompts, then a unique user message) or, with probability
    ``continuation``, the next turn of one of the 64 most recent conversations: its whole
    previous prompt and answer, then a new unique message. Lengths are drawn uniformly from
    the inclusive ranges; arrivals are a Poisson process of ``rate`` requests per second.
    A continuation may arrive while the turn it continues is still running; it then reuses
    only what is cached by then."""

    requests: int = 1000
    system_prompts: int = 8
    system_prompt_len: tuple[int, int] = (500, 4000)
    suffix_len: tuple[int, int] = (20, 1000)
    continuation: float = 0.5
    output_len: tuple[int, int] = (20, 600)
    rate: float = 4.0
    seed: int = 0

    def validate(self) -> None:
        """Raise ValueError naming the parameter that is out of range."""
        def count(name: str, value: object, low: int, high: int) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{name} {value!r} must be an integer in [{low}, {high}]")

        count("requests", self.requests, 1, MAX_GENERATED_REQUESTS)
        count("system prompts", self.system_prompts, 0, 1_000_000)
        for name, (low, high), least in (
            ("system prompt length", self.system_prompt_len, 1),
            ("suffix length", self.suffix_len, 1),
            ("output length", self.output_len, 1),
        ):
            count(f"{name} lower bound", low, least, _SEGMENT_STRIDE - 1)
            count(f"{name} upper bound", high, low, _SEGMENT_STRIDE - 1)
        if not isinstance(self.continuation, (int, float)) or not 0.0 <= self.continuation <= 1.0:
            raise ValueError(f"continuation probability {self.continuation!r} must be in [0, 1]")
        if not isinstance(self.rate, (int, float)) or not math.isfinite(self.rate) or not 0 < self.rate <= 1e6:
            raise ValueError(f"arrival rate {self.rate!r} must be a number in (0, 1e6] requests per second")
        count("seed", self.seed, 0, (1 << 63) - 1)


def _segments_len(segments: tuple[tuple[int, int], ...]) -> int:
    return sum(n for _, n in segments)


def generate(spec: GeneratorSpec, step_ms: float = 50.0, max_tokens: Optional[int] = None) -> Workload:
    """Draw the workload (deterministic in ``spec.seed``). Conversations that would grow past
    ``max_tokens`` (prompt plus output) start afresh instead. Raises ValueError on a bad spec."""
    spec.validate()
    check_step_ms(step_ms)
    rng = random.Random(spec.seed)
    system = [
        (_SYSTEM_BASE + k * _SEGMENT_STRIDE, rng.randint(*spec.system_prompt_len)) for k in range(spec.system_prompts)
    ]
    recent: collections.deque[tuple[tuple[int, int], ...]] = collections.deque(maxlen=_OPEN_CONVERSATIONS)
    entries: list[Entry] = []
    clock_ms = 0.0
    for i in range(spec.requests):
        clock_ms += rng.expovariate(spec.rate) * 1000.0
        user = (_USER_BASE + i * _SEGMENT_STRIDE, rng.randint(*spec.suffix_len))
        out_len = rng.randint(*spec.output_len)
        prompt: tuple[tuple[int, int], ...] = ()
        if recent and rng.random() < spec.continuation:
            prompt = recent[rng.randrange(len(recent))] + (user,)
        if not prompt or (max_tokens is not None and _segments_len(prompt) + out_len - 1 > max_tokens):
            prompt = ((system[rng.randrange(len(system))],) if system else ()) + (user,)
        if max_tokens is not None and _segments_len(prompt) + out_len - 1 > max_tokens:
            raise ValueError(
                f"generated request {i} needs {_segments_len(prompt) + out_len - 1} tokens > max_model_len "
                f"{max_tokens}; shorten the generator's lengths"
            )
        output = (_OUTPUT_BASE + i * _SEGMENT_STRIDE, out_len)
        recent.append(prompt + (output,))
        entries.append(Entry(step_of(clock_ms, step_ms), _segments_len(prompt), out_len, (f"g{i}", prompt, output)))

    def build(e: Entry) -> TraceRequest:
        rid, prompt, (out_start, out_len) = e.ref  # type: ignore[misc]
        tokens: list[int] = []
        for start, n in prompt:
            tokens.extend(range(start, start + n))
        return TraceRequest(rid, tuple(tokens), tuple(range(out_start, out_start + out_len)), arrival=e.arrival)

    return Workload(
        f"generated: {spec.requests:,} requests, {spec.system_prompts} system prompts, continuation "
        f"{spec.continuation:g}, {spec.rate:g} requests/s, seed {spec.seed}",
        entries,
        build,
    )
