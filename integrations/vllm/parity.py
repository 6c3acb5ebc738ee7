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
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from kvproof.impl.content_oracle import ContentOracle
from kvproof.impl.kv_cache_manager import KVCacheManager
from kvproof.impl.request import Request
from kvproof.impl.scheduler import Scheduler
from kvproof.impl.trace import TraceRequest
from kvproof.integrations.vllm.engine_harness import EngineHarness
from kvproof.spec.layout import Layout

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
    """One engine's cached tokens per request, in trace order, and its step count."""

    cached: dict[str, int]
    steps: int
    violations: list[str] = dataclasses.field(default_factory=list)

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

    def make(t: TraceRequest, arrival: int) -> Request:
        r = Request(t.id, t.prompt, layout.hash_block_size, cache_salt=t.cache_salt, arrival=arrival,
                    expected_outputs=t.output)
        requests.append(r)
        return r

    def drain() -> None:
        while sched.has_unfinished():
            plan = sched.schedule()
            oracle.run_step(plan)
            for done in sched.finish_step(plan):
                oracle.forget(done)

    if sequential:
        for t in trace:
            sched.add_request(make(t, sched.step + 1))
            drain()
    else:
        for t in trace:
            sched.add_request(make(t, t.arrival))
        drain()
    return EngineRun({r.request_id: r.num_cached_tokens or 0 for r in requests}, sched.step, list(oracle.violations))


def run_vllm(trace: Sequence[TraceRequest], layout: Layout, options: ParityOptions) -> EngineRun:
    """vLLM 0.33.0's real Scheduler on the same trace (``engine_harness``)."""
    sequential = _arrivals(trace, options.arrivals)
    harness = EngineHarness(
        layout, options.num_blocks, max_num_batched_tokens=options.max_num_batched_tokens,
        use_eagle=options.use_eagle, long_prefill_token_threshold=options.long_prefill_token_threshold,
    )
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
    return EngineRun({t.id: result.num_cached_tokens[t.id] for t in trace}, harness.step_count)


def compare(trace: Sequence[TraceRequest], layout: Layout, options: ParityOptions = ParityOptions()) -> Parity:
    """Both engines on ``trace``; no state is shared between them."""
    return Parity(run_kvproof(trace, layout, options), run_vllm(trace, layout, options),
                  sum(len(t.prompt) for t in trace))
