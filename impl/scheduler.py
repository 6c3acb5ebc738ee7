"""A minimal scheduler loop: FCFS admission under a token budget, chunked prefill by the Mamba
chunk-split rule, one-token decode, and preemption when the pool is full.

Each step: running requests first (decode one token, or their next prefill chunk), then
waiting requests in arrival order while the budget and the pool allow (no skipping: FCFS).
When a running request cannot get blocks, the most recently admitted running request that
has not been scheduled in this step is preempted (its blocks freed, re-queued at the front,
recomputed from its next cache lookup); if none is left, the request preempts itself.

Outputs follow the trace (docs/replay.md): prefill ends by sampling ``output[0]``; each later
step computes the previous output token and samples the next; a request with k outputs finishes
when ``output[k-1]`` is sampled, so the KV of its last output token is never computed.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import operator
from typing import Optional

from kvproof.impl.kv_cache_manager import KVCacheManager
from kvproof.impl.request import Request
from kvproof.impl.chunk_split import ChunkSplitter
from kvproof.impl.same_step import SameStepKeys
from kvproof.spec.checkpoints import turn_end_ladder
from kvproof.spec.chunk_split import SplitRule
from kvproof.spec.groups import GroupKind, MambaCacheMode


_arrival = operator.attrgetter("arrival")


class CapacityError(ValueError):
    """A request can never be scheduled: it needs more blocks than the whole pool holds.
    ``request_id`` names it."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id


@dataclasses.dataclass
class ScheduledChunk:
    request: Request
    start: int  # first position computed in this step
    num_tokens: int
    new_blocks: tuple[list[int], ...]  # per group: entries to append to the worker row
    overwrite: bool  # a (re)admitted request: ``new_blocks`` is its whole row
    junctions: tuple[int, ...] = ()  # a (re)admitted request's: its hit's (``Hit.junctions``)


@dataclasses.dataclass
class StepPlan:
    step: int
    chunks: list[ScheduledChunk]
    copies: list[tuple[int, int, int]]  # (group_id, src, dst), run on every rank first
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    """``long_prefill_token_threshold`` (vLLM's): when more than one request is running or
    waiting, no chunk takes more than that many tokens (0: no cap).

    A waiting request whose prefix another request computes in this very step, further than the
    cache can give it now, waits for the next step: keys appear only after the forward pass, so
    admitting it now would recompute what the cache holds one step later (vLLM 0.33.0 defers a
    same-step Mamba hit the same way). ``num_producer_waits`` counts those waits.
    """

    def __init__(
        self, kv: KVCacheManager, max_num_batched_tokens: int = 2048, max_num_seqs: int = 256,
        long_prefill_token_threshold: int = 0,
    ) -> None:
        if max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens {max_num_batched_tokens} must be > 0")
        if max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs {max_num_seqs} must be > 0")
        if long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold {long_prefill_token_threshold} must be >= 0")
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.pending: list[Request] = []  # not yet arrived, sorted by arrival
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.num_preemptions = 0
        self.num_producer_waits = 0
        self.step = 0
        # this step's chunks and the prefixes they will key (hittable after the step)
        self._same_step = SameStepKeys(kv)
        self._splitter = _splitter_for(kv, max_num_batched_tokens, long_prefill_token_threshold)

    def add_request(self, request: Request) -> None:
        bisect.insort(self.pending, request, key=_arrival)  # stable: equal arrivals keep order

    def has_unfinished(self) -> bool:
        return bool(self.pending or self.waiting or self.running)

    # --- one step -------------------------------------------------------------------------------

    def _chunk_end(self, request: Request, start: int, num_new: int, junctions: Optional[tuple[int, ...]] = None) -> int:
        """Where this step's chunk ends (``start``: the request waits for a later step).
        ``junctions``: those of the hit a waiting request is admitted on (None: a running
        request, whose admission hit's the manager keeps)."""
        if start + 1 == len(request.token_ids) or self._splitter is None:
            return start + num_new  # a decode step, or no Mamba state to place
        if junctions is None:
            junctions = self.kv.junctions(request)
        return self._splitter.end(start, num_new, request.num_tokens, request.num_prompt_tokens, junctions)

    def _chunk_cap(self) -> int:
        """Tokens one chunk may take this step before the budget: the long-prefill threshold
        applies only when another request competes for the step."""
        t = self.long_prefill_token_threshold
        return t if t and len(self.running) + len(self.waiting) > 1 else self.max_num_batched_tokens

    def schedule(self) -> StepPlan:
        """Mutates. Plan one step; the caller runs it (copies, then the forward pass) and then
        calls :meth:`finish_step`."""
        self.step += 1
        self.kv.begin_step()
        while self.pending and self.pending[0].arrival <= self.step:
            self.waiting.append(self.pending.pop(0))
        budget = self.max_num_batched_tokens
        cap = self._chunk_cap()
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []
        scheduled: set[str] = set()
        self._same_step.clear()
        queue = list(self.running)
        i = 0
        while i < len(queue) and budget > 0:
            req = queue[i]
            start = req.num_computed_tokens
            end = self._chunk_end(req, start, min(len(req.token_ids) - start, cap, budget))
            if end == start:
                i += 1  # no block-aligned chunk fits what is left of the budget
                continue
            blocks = self.kv.allocate_slots(req, end - start)
            while blocks is None:
                victim = next((r for r in reversed(queue) if r.request_id not in scheduled), None)
                if victim is None or victim is req and len(scheduled) == 0 and len(queue) == 1:
                    end, blocks = self._shorter_chunk(req, start, end)
                    break
                self._preempt(victim, preempted)
                queue.remove(victim)
                if victim is req:
                    break
                blocks = self.kv.allocate_slots(req, end - start)
            if blocks is None:
                continue
            chunks.append(ScheduledChunk(req, start, end - start, blocks, overwrite=False))
            self._same_step.note(req, start, end)
            scheduled.add(req.request_id)
            budget -= end - start
            i += 1
        self.running = [r for r in queue]
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            admitted = self._admit(req, min(cap, budget), alone=not self.running and not chunks)
            if admitted is None:
                break  # FCFS: the head waits (for budget for an aligned chunk, or for blocks)
            self.waiting.popleft()
            self.running.append(req)
            chunks.append(admitted)
            self._same_step.note(req, admitted.start, admitted.start + admitted.num_tokens)
            budget -= admitted.num_tokens
        return StepPlan(self.step, chunks, self.kv.take_block_copies(), preempted)

    def _admit(self, req: Request, limit: int, alone: bool) -> ScheduledChunk | None:
        """Mutates unless it returns None. Look ``req`` up and allocate its first chunk (at most
        ``limit`` tokens). When it is ``alone`` in the step and its hit costs more blocks than
        the pool has, fall back to cheaper hits (``KVCacheManager.cheaper_hits``): a request
        that fits an empty pool without a hit is always admitted. Raises CapacityError when
        not even that fits."""
        hit = self.kv.lookup(req)
        if self._same_step.producer_in_flight(req, hit.num_tokens):
            self.num_producer_waits += 1
            return None
        fallbacks = self.kv.cheaper_hits(req, hit) if alone else iter(())
        while True:
            start = hit.num_tokens
            end = self._chunk_end(req, start, min(req.num_tokens - start, limit), hit.junctions)
            if end == start:
                return None
            blocks = self.kv.allocate_slots(req, end - start, hit)
            if blocks is not None:
                return ScheduledChunk(req, start, end - start, blocks, overwrite=True, junctions=hit.junctions)
            hit = next(fallbacks, None)
            if hit is None:
                if alone:
                    raise CapacityError(
                        req.request_id,
                        f"request {req.request_id!r} cannot get blocks for {end} tokens even with the pool to itself "
                        f"({self.kv.num_blocks - 1} blocks, {self.kv.num_free_blocks} free); raise --num-blocks",
                    )
                return None

    def _shorter_chunk(self, req: Request, start: int, end: int) -> tuple[int, tuple[list[int], ...]]:
        """Mutates (allocates). ``req`` has the pool to itself and cannot get blocks up to
        ``end``: the longest shorter chunk that fits. A shorter step can need fewer blocks at
        once (a sliding window's block that leaves the window, the Mamba state read and the one
        written), so a request that fits the pool alone keeps progressing whatever chunk
        boundaries its hit left it. Raises CapacityError when not even one token fits."""
        for n in range(end - start - 1, 0, -1):
            shorter = self._chunk_end(req, start, n)
            if start < shorter < end:
                blocks = self.kv.allocate_slots(req, shorter - start)
                if blocks is not None:
                    return shorter, blocks
        raise CapacityError(
            req.request_id,
            f"request {req.request_id!r} cannot get blocks for {end} tokens even with the pool to itself "
            f"({self.kv.num_blocks - 1} blocks); raise --num-blocks",
        )

    def _preempt(self, request: Request, preempted: list[Request]) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        preempted.append(request)

    def finish_step(self, plan: StepPlan) -> list[Request]:
        """Mutates. The plan's forward pass ran: advance computed tokens, key the new contents,
        sample (append the trace's next output), and free finished requests."""
        done = []
        for chunk in plan.chunks:
            req = chunk.request
            req.num_computed_tokens = chunk.start + chunk.num_tokens
            self.kv.cache(req)
            if req.num_computed_tokens == len(req.token_ids):
                k, expected = req.num_outputs, req.expected_outputs
                if k < len(expected):
                    req.append_output(expected[k])
                    k += 1
                if k >= len(expected):
                    done.append(req)
        for req in done:
            self.kv.free(req)
            self.running.remove(req)
            self.finished.append(req)
        return done

    def skip_idle_steps(self) -> int:
        """Mutates. With nothing waiting or running, move the clock to just before the next
        pending arrival (the steps between would schedule nothing). Returns the steps skipped."""
        if self.waiting or self.running or not self.pending:
            return 0
        skipped = max(self.pending[0].arrival - 1 - self.step, 0)
        self.step += skipped
        return skipped


def _splitter_for(kv: KVCacheManager, budget: int, threshold: int) -> ChunkSplitter | None:
    """The chunk-split rule when the layout keeps Mamba states in align mode (else None)."""
    layout = kv.layout
    mamba = [
        g.group.block_size for g in layout.groups
        if g.group.kind is GroupKind.MAMBA and g.group.mamba_cache_mode is MambaCacheMode.ALIGN
    ]
    if not mamba:
        return None
    partial_tail = layout.partial_hash_hits and layout.hash_block_size < layout.scheduler_block_size
    # Under sparse retention the states it keeps for replay must be materialised: stop there.
    sparse = layout.config.retention_interval is not None
    rule = SplitRule(
        mamba_block_size=min(mamba),
        hash_block_size=layout.hash_block_size,
        max_prefill_tokens=min(budget, threshold) if threshold else budget,
        partial_tail=partial_tail,
        eagle_drop=kv.use_eagle,
        shared_prefix_checkpoint=partial_tail and kv.exact_junction,
        scheduler_block_size=layout.scheduler_block_size if sparse else 0,
        replay_alignment=layout.cache_hit_alignment if sparse else 0,
    )
    rungs, unit = turn_end_ladder(layout)
    return ChunkSplitter(dataclasses.replace(rule, rungs=rungs, rung_unit=unit))
