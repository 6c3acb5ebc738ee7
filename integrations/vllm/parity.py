"""Cached tokens per request: kvproof's scheduler and manager against vLLM 0.33.0's real
``Scheduler`` (``engine_harness``), on the same trace, layout, retention and budget.

Two arrival modes:

* ``sequential``: each request arrives in the step after the previous one finished, so no two
  are ever in flight together. kvproof guarantees that it caches at least as many tokens as
  vLLM for every request in this mode (docs/spec.md, "Hit parity with vLLM"); the differential
  tests assert it and ``benchmarks/hit_parity.py`` tabulates it.
* ``trace``: the trace's own arrival steps (requests overlap). Hits may then differ either way
  (docs/coordinator.md names each class); totals and the per-request distribution are reported.

The kvproof side runs with the content oracle on: every reused token is checked on every DCP
rank, so a larger hit is never a wrong one.

``run_served`` is kvproof's manager inside vLLM's real Scheduler instead (as
``KVPROOF_MANAGER=kvproof`` serves it, the checkpoint policy's split included), with the same
oracle; against stock vLLM (``run_vllm``) a request behind must follow an earlier one ahead
(``behind_without_earlier_longer_hit`` lists those that do not).

In ``sequential`` mode a request may still be behind vLLM in two named ways, both the price of
kvproof reusing more earlier on (docs/coordinator.md, "Hit parity with vLLM 0.33.0"):
:meth:`Parity.explain_behind` checks that each request behind is one of them. Each run records
what it takes: every request's chunk ends, its junctions, and (vLLM) which request's chunk
produced the Mamba state a hit resumed from.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Sequence

from kvproof.impl.kv_cache_manager import KVCacheManager
from kvproof.impl.request import Request
from kvproof.impl.scheduler import Scheduler
from kvproof.integrations.vllm.engine_harness import EngineHarness, StepHook
from kvproof.oracle.content_oracle import ContentOracle
from kvproof.sim.drive import drain
from kvproof.sim.trace import TraceRequest
from kvproof.spec.groups import GroupKind
from kvproof.spec.layout import Layout
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id  # after engine_harness: the CPU platform

SEQUENTIAL, TRACE = "sequential", "trace"


@dataclasses.dataclass(frozen=True)
class ParityOptions:
    num_blocks: int = 8192
    max_num_batched_tokens: int = 2048
    use_eagle: bool = False
    long_prefill_token_threshold: int = 0
    arrivals: str = SEQUENTIAL


@dataclasses.dataclass
class EngineRun:
    """One engine's cached tokens per request, in trace order, and its step count; each
    request's chunk ends (in order) and the junctions its lookup reported (vLLM: its
    ``shared_prefix_boundary``); vLLM only: for a request whose hit resumed from a Mamba state,
    the request whose chunk produced that state and its length."""

    cached: dict[str, int]
    steps: int
    violations: list[str] = dataclasses.field(default_factory=list)
    chunk_ends: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    junctions: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    resumed_from: dict[str, tuple[str, int]] = dataclasses.field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.cached.values())


@dataclasses.dataclass
class Parity:
    kvproof: EngineRun
    vllm: EngineRun
    prompt_tokens: int

    def behind(self) -> list[tuple[str, int, int]]:
        """Requests where kvproof cached fewer tokens than vLLM: (id, kvproof, vLLM)."""
        return [(rid, self.kvproof.cached[rid], v) for rid, v in self.vllm.cached.items() if self.kvproof.cached[rid] < v]

    def ahead(self) -> list[tuple[str, int, int]]:
        return [(rid, self.kvproof.cached[rid], v) for rid, v in self.vllm.cached.items() if self.kvproof.cached[rid] > v]

    def explain_behind(self) -> dict[str, str | None]:
        """For each request behind vLLM, which named class it is in, or None if neither (a
        parity bug). vLLM resumed it from a Mamba state of length N that an earlier request P's
        chunk produced in vLLM, and kvproof's run of P has no chunk ending at N because:

        * ``longer hit``: kvproof's hit for P was longer than vLLM's: it reused tokens of P
          that vLLM recomputed, so P's chunks start elsewhere (past N, or on another grid of
          budget-sized chunks) and never end at N; or
        * ``shifted chunks``: kvproof ended one of P's chunks below N where vLLM did not, and
          its lookup for P reported junctions vLLM's did not (its attention keys reach
          further), so P's later chunks -- cut by the token budget -- end elsewhere.

        No state change."""
        out: dict[str, str | None] = {}
        for rid, _, _ in self.behind():
            producer = self.vllm.resumed_from.get(rid)
            out[rid] = None if producer is None else self._why_no_state(*producer)
        return out

    def _why_no_state(self, producer: str, n: int) -> str | None:
        kv_ends = self.kvproof.chunk_ends.get(producer, [])
        if n in kv_ends:
            return None  # kvproof computed that state too: not a schedule difference
        if self.kvproof.cached[producer] > self.vllm.cached[producer]:
            return "longer hit"
        vllm_ends = set(self.vllm.chunk_ends.get(producer, []))
        extra_stop = any(e < n and e not in vllm_ends for e in kv_ends)
        if extra_stop and self.kvproof.junctions.get(producer) != self.vllm.junctions.get(producer):
            return "shifted chunks"
        return None


def _arrivals(trace: Sequence[TraceRequest], mode: str):
    if mode not in (SEQUENTIAL, TRACE):
        raise ValueError(f"arrivals {mode!r}; expected {SEQUENTIAL!r} or {TRACE!r}")
    return mode == SEQUENTIAL


def run_kvproof(trace: Sequence[TraceRequest], layout: Layout, options: ParityOptions) -> EngineRun:
    """kvproof's scheduler and manager with the content oracle watching every step."""
    sequential = _arrivals(trace, options.arrivals)
    kv = KVCacheManager(layout, options.num_blocks, use_eagle=options.use_eagle)
    sched = Scheduler(kv, max_num_batched_tokens=options.max_num_batched_tokens,
                      long_prefill_token_threshold=options.long_prefill_token_threshold)
    oracle = ContentOracle(layout)
    requests = []
    ends: dict[str, list[int]] = {}
    junctions: dict[str, tuple[int, ...]] = {}  # each request's last admission hit's

    def make(t: TraceRequest, arrival: int) -> Request:
        r = Request(t.id, t.prompt, layout.hash_block_size, cache_salt=t.cache_salt, arrival=arrival,
                    expected_outputs=t.output)
        requests.append(r)
        return r

    def note_chunks(plan) -> None:
        for c in plan.chunks:
            ends.setdefault(c.request.request_id, []).append(c.start + c.num_tokens)
            if c.overwrite:
                junctions[c.request.request_id] = c.junctions

    if sequential:
        for t in trace:
            sched.add_request(make(t, sched.step + 1))
            drain(sched, oracle, note_chunks)
    else:
        for t in trace:
            sched.add_request(make(t, t.arrival))
        drain(sched, oracle, note_chunks)
    return EngineRun({r.request_id: r.num_cached_tokens or 0 for r in requests}, sched.step, list(oracle.violations),
                     ends, {r.request_id: junctions.get(r.request_id, ()) for r in requests})


class _Schedule(StepHook):
    """Records, in vLLM's run, each request's chunk ends and ``shared_prefix_boundary``, the
    request whose chunk first produced each Mamba state key (a state exists only where a chunk
    ends), and for each hit the producer of the state it resumed from. Observes only."""

    def __init__(self, layout: Layout) -> None:
        self.mamba = [g.index for g in layout.groups if g.group.kind is GroupKind.MAMBA and g.group.prefix_cacheable]
        self.h = layout.hash_block_size
        self.ends: dict[str, list[int]] = {}
        self.junctions: dict[str, tuple[int, ...]] = {}
        self.producer: dict[object, tuple[str, int]] = {}
        self.resumed_from: dict[str, tuple[str, int]] = {}

    def _state_key(self, request, n: int):
        return make_block_hash_with_group_id(request.block_hashes[n // self.h - 1], self.mamba[0])

    def scheduled(self, harness, step, output) -> None:
        if not self.mamba:
            return
        for new in output.scheduled_new_reqs:
            request = harness.scheduler.requests[new.req_id]
            hit = request.prefill_stats.num_cached_tokens
            if new.req_id not in self.junctions:
                self.junctions[new.req_id] = (request.shared_prefix_boundary,) if request.shared_prefix_boundary else ()
                if hit and hit % self.h == 0 and self._state_key(request, hit) in self.producer:
                    self.resumed_from[new.req_id] = self.producer[self._state_key(request, hit)]

    def updated(self, harness, record, output, runner_output) -> None:
        pool = harness.kv_cache_manager.block_pool
        for rid, start, n in record.chunks:
            end = start + n
            self.ends.setdefault(rid, []).append(end)
            request = harness.scheduler.requests.get(rid)
            if not self.mamba or request is None or end % self.h or end // self.h > len(request.block_hashes):
                continue
            key = self._state_key(request, end)
            if key not in self.producer and pool.cached_block_hash_to_block.get_one_block(key) is not None:
                self.producer[key] = (rid, end)


def _drive(harness: EngineHarness, trace: Sequence[TraceRequest], sequential: bool) -> dict[str, int]:
    """Run ``trace`` through ``harness`` (sequential: each request in the step after the previous
    one finished); cached tokens per request, in trace order."""
    if sequential:
        for t in trace:
            harness.add_trace([dataclasses.replace(t, arrival=harness.step_count + 1)])
            while harness.has_unfinished():
                harness.step()
    else:
        harness.add_trace(trace)
        while harness.has_unfinished():
            harness.step()
    result = harness.result()
    return {t.id: result.num_cached_tokens[t.id] for t in trace}


def run_vllm(trace: Sequence[TraceRequest], layout: Layout, options: ParityOptions) -> EngineRun:
    """vLLM 0.33.0's real Scheduler on the same trace (``engine_harness``)."""
    sequential = _arrivals(trace, options.arrivals)
    schedule = _Schedule(layout)
    harness = EngineHarness(
        layout, options.num_blocks, max_num_batched_tokens=options.max_num_batched_tokens,
        use_eagle=options.use_eagle, long_prefill_token_threshold=options.long_prefill_token_threshold,
        hooks=[schedule],
    )
    cached = _drive(harness, trace, sequential)
    return EngineRun(cached, harness.step_count,
                     chunk_ends=schedule.ends, junctions=schedule.junctions, resumed_from=schedule.resumed_from)


class _Chunks(StepHook):
    """Each request's chunk ends in order. Observes only."""

    def __init__(self) -> None:
        self.ends: dict[str, list[int]] = {}

    def updated(self, harness, record, output, runner_output) -> None:
        for rid, start, n in record.chunks:
            self.ends.setdefault(rid, []).append(start + n)


def run_served(trace: Sequence[TraceRequest], layout: Layout, options: ParityOptions, serving,
               scheduler_cls: Optional[type] = None, hooks: Sequence[StepHook] = ()) -> tuple[EngineRun, EngineHarness]:
    """kvproof's manager under ``serving`` (``serving_options.ServingOptions``) inside vLLM's real
    Scheduler, as ``KVPROOF_MANAGER=kvproof`` serves it (``kvproof_scheduler.KvproofScheduler``
    unless ``scheduler_cls`` is given), with the content oracle on every step (the worker model);
    the run, and the harness (its manager, for inspection)."""
    from kvproof.integrations.vllm.kvproof_manager import KvproofKVCacheManager
    from kvproof.integrations.vllm.kvproof_scheduler import KvproofScheduler
    from kvproof.integrations.vllm.worker_model import OracleHook

    chunks, oracle = _Chunks(), OracleHook(layout)
    harness = EngineHarness(
        layout, options.num_blocks, max_num_batched_tokens=options.max_num_batched_tokens,
        use_eagle=options.use_eagle, long_prefill_token_threshold=options.long_prefill_token_threshold,
        scheduler_cls=scheduler_cls or KvproofScheduler,
        manager_class=functools.partial(KvproofKVCacheManager, options=serving), hooks=[chunks, oracle, *hooks],
    )
    cached = _drive(harness, trace, _arrivals(trace, options.arrivals))
    return EngineRun(cached, harness.step_count, list(oracle.worker.violations), chunks.ends), harness


def behind_without_earlier_longer_hit(trace: Sequence[TraceRequest], ours: dict[str, int], stock: dict[str, int]) -> list[str]:
    """Requests caching fewer tokens in ``ours`` than in ``stock`` with no earlier request caching
    more: outside the named class *earlier longer hit* (docs/coordinator.md: an earlier request
    resumed further, so it did not recompute the prefix whose chunk ends left, in the other run,
    the state this one resumes from). Pure."""
    out, ahead = [], False
    for t in trace:
        if ours[t.id] < stock[t.id] and not ahead:
            out.append(t.id)
        ahead = ahead or ours[t.id] > stock[t.id]
    return out


def compare(trace: Sequence[TraceRequest], layout: Layout, options: ParityOptions = ParityOptions()) -> Parity:
    """Both engines on ``trace``; no state is shared between them."""
    return Parity(run_kvproof(trace, layout, options), run_vllm(trace, layout, options),
                  sum(len(t.prompt) for t in trace))
