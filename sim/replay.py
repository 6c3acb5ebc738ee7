"""Replay a trace through the scheduler loop and the KV-cache manager with the cheap checks on,
and (optionally) the content oracle watching each step.

The replay is lazy: a request's tokens are created when it arrives and dropped when it
finishes, and the trace may be any iterable of requests, consumed once and never materialised,
so memory follows the requests in flight, not the trace (the full Mooncake conversation trace
is 145 M prompt tokens). Steps in which nothing is waiting or running are skipped: the clock
jumps to the next arrival, so a request arriving at step 2,000,000 costs one step, not two
million.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Iterator, NamedTuple, Optional, Sequence

from kvproof.impl.kv_cache_manager import KVCacheManager
from kvproof.impl.request import Request
from kvproof.impl.scheduler import Scheduler, StepPlan
from kvproof.oracle.content_oracle import ContentOracle
from kvproof.sim.trace import TraceRequest
from kvproof.spec import contracts
from kvproof.spec.contracts import InvariantViolation
from kvproof.spec.layout import Layout


class StepLimitError(ValueError):
    """The replay reached the caller's step limit before every request finished (a limit the
    caller chose, not a broken invariant: the scheduler always makes progress)."""


class RequestOutcome(NamedTuple):
    """What a replay keeps of a request once its tokens are dropped."""

    request_id: str
    num_prompt_tokens: int
    num_cached_tokens: int  # the prefix-cache hit at its first scheduling (0 if never scheduled)
    num_preemptions: int


@dataclasses.dataclass
class ReplayResult:
    #: One outcome per request in trace order (empty when the caller passed keep_requests=False).
    requests: list[RequestOutcome]
    #: The last step's number; skipped idle steps count, so this is the simulated clock.
    steps: int
    cow_copies: int
    evictions: int
    preemptions: int
    violations: list[str]
    num_requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    requests_with_hit: int = 0
    #: Prompt positions the forward passes computed: prompt minus hits, plus any prompt
    #: recomputed after a preemption.
    prefill_tokens: int = 0
    #: Steps actually scheduled (``steps`` minus the skipped idle ones).
    steps_run: int = 0
    #: Per group, the most blocks it occupied at once (held by requests, or cached and not yet
    #: evicted), measured after each step's allocations: what the group's memory must hold.
    #: Retention trades this against hits (a Mamba state block is large).
    peak_blocks_per_group: tuple[int, ...] = ()
    #: The most blocks all groups occupied together at once, measured as the per-group peaks
    #: are: at most the pool (the per-group peaks need not coincide, so their sum may exceed it).
    peak_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        """Cached prompt tokens over prompt tokens, over the requests that were scheduled."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _in_arrival_order(trace: Iterable[TraceRequest]) -> Iterator[tuple[int, TraceRequest]]:
    """``(trace index, request)`` by arrival. A sequence is sorted (stably: equal arrivals keep
    their order, as the scheduler's queue does); any other iterable is streamed and must
    already be in arrival order (ValueError naming the first request that is not)."""
    if isinstance(trace, Sequence):
        yield from sorted(enumerate(trace), key=lambda it: it[1].arrival)
        return
    last: Optional[TraceRequest] = None
    for i, t in enumerate(trace):
        if last is not None and t.arrival < last.arrival:
            raise ValueError(
                f"request {t.id!r} arrives at step {t.arrival}, before the preceding request {last.id!r} "
                f"(step {last.arrival}); a streamed trace must be sorted by arrival"
            )
        last = t
        yield i, t


def replay(
    trace: Iterable[TraceRequest],
    layout: Layout,
    num_blocks: int,
    max_num_batched_tokens: int = 2048,
    use_eagle: bool = False,
    oracle: bool = True,
    slow: bool = False,
    max_steps: Optional[int] = None,
    on_step: Optional[Callable[[StepPlan, Scheduler], None]] = None,
    on_finish: Optional[Callable[[Request], None]] = None,
    keep_requests: bool = True,
    max_num_seqs: int = 256,
) -> ReplayResult:
    """Run ``trace`` to completion. Mutates nothing it is given.

    An invariant violation stops the replay and is reported (with the oracle's findings) in
    ``violations``. Bad input raises: CapacityError (a request the pool can never hold),
    ValueError (a request longer than max_model_len, a streamed trace out of arrival order)
    and StepLimitError (``max_steps`` reached; None means no limit). ``slow`` turns the slow
    switch on for the replay (the slow-tier contracts of every call) and adds the whole-state
    checks (pool conservation, table references) after every step. ``on_step``
    sees each planned step before it runs; ``on_finish`` each finished request before its
    tokens are dropped.
    """
    kv = KVCacheManager(layout, num_blocks, use_eagle=use_eagle)
    sched = Scheduler(kv, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)
    watcher = ContentOracle(layout) if oracle else None
    max_len = layout.config.max_model_len
    hash_block_size = layout.hash_block_size
    result = ReplayResult([], 0, 0, 0, 0, [])
    outcomes: dict[int, RequestOutcome] = {}
    peak = [0] * len(layout.groups)
    peak_total = 0
    live: dict[str, tuple[int, Request]] = {}  # request id -> (trace index, request), until finished

    def record(index: int, req: Request) -> None:
        cached = req.num_cached_tokens
        if cached is not None:
            result.prompt_tokens += req.num_prompt_tokens
            result.cached_tokens += cached
            result.requests_with_hit += cached > 0
        if keep_requests:
            outcomes[index] = RequestOutcome(req.request_id, req.num_prompt_tokens, cached or 0, req.num_preemptions)

    source = _in_arrival_order(trace)
    upcoming = next(source, None)

    def admit(item: tuple[int, TraceRequest]) -> None:
        index, t = item
        if t.id in live:
            raise ValueError(f"request id {t.id!r} is already in flight; request ids must be unique")
        need = len(t.prompt) + max(len(t.output) - 1, 0)
        if need > max_len:
            raise ValueError(f"request {t.id!r} needs {need} tokens > max_model_len {max_len}")
        req = Request(t.id, t.prompt, hash_block_size, cache_salt=t.cache_salt, arrival=t.arrival, expected_outputs=t.output)
        live[t.id] = (index, req)
        result.num_requests += 1
        sched.add_request(req)

    try:
        with contracts.slow_checks(slow or contracts.slow()):
            while True:
                if upcoming is not None and not sched.has_unfinished():
                    admit(upcoming)  # idle: bring the next request in, then jump to its arrival
                    upcoming = next(source, None)
                    sched.skip_idle_steps()
                while upcoming is not None and upcoming[1].arrival <= sched.step + 1:
                    admit(upcoming)
                    upcoming = next(source, None)
                if not sched.has_unfinished():
                    break
                if max_steps is not None and sched.step >= max_steps:
                    unfinished = len(sched.pending) + len(sched.waiting) + len(sched.running)
                    raise StepLimitError(
                        f"replay reached its step limit of {max_steps} steps with {unfinished} request(s) "
                        "unfinished; raise the limit"
                    )
                plan = sched.schedule()
                result.steps_run += 1
                occupancy = kv.occupancy()
                for g, blocks in enumerate(occupancy):
                    if blocks > peak[g]:
                        peak[g] = blocks
                peak_total = max(peak_total, sum(occupancy))
                if not plan.chunks:
                    raise InvariantViolation(
                        "INV-REPLAY-PROGRESS",
                        f"step {plan.step} scheduled no token with {len(sched.waiting)} request(s) waiting "
                        f"and {len(sched.running)} running",
                    )
                for c in plan.chunks:
                    prompt = c.request.num_prompt_tokens
                    if c.start < prompt:
                        result.prefill_tokens += min(c.start + c.num_tokens, prompt) - c.start
                if watcher is not None:
                    watcher.run_step(plan)
                if on_step is not None:
                    on_step(plan, sched)
                for req in sched.finish_step(plan):
                    if watcher is not None:
                        watcher.forget(req)
                    if on_finish is not None:
                        on_finish(req)
                    index, _ = live.pop(req.request_id)
                    record(index, req)
                sched.finished.clear()  # drop finished requests' tokens and hashes
                if slow:
                    kv.check_state()
                if watcher is not None and watcher.violations:
                    break
    except InvariantViolation as e:
        result.violations.append(str(e))
    if watcher is not None:
        result.violations.extend(watcher.violations)
    for index, req in live.values():  # a replay stopped by a violation: report what ran
        record(index, req)
    result.requests = [outcomes[i] for i in sorted(outcomes)]
    result.steps = sched.step
    result.cow_copies = kv.num_copies
    result.evictions = kv.num_evictions
    result.preemptions = sched.num_preemptions
    result.peak_blocks_per_group = tuple(peak)
    result.peak_blocks = peak_total
    return result
