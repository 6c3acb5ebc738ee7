"""Replay a trace through the scheduler loop and the KV-cache manager with every check on, and
(optionally) the content oracle watching each step."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from kvproof.impl.content_oracle import ContentOracle
from kvproof.impl.kv_cache_manager import KVCacheManager
from kvproof.impl.request import Request
from kvproof.impl.scheduler import Scheduler, StepPlan
from kvproof.impl.trace import TraceRequest
from kvproof.spec import contracts
from kvproof.spec.contracts import InvariantViolation
from kvproof.spec.layout import Layout


@dataclasses.dataclass
class ReplayResult:
    requests: list[Request]
    steps: int
    cow_copies: int
    evictions: int
    preemptions: int
    violations: list[str]

    @property
    def hit_rate(self) -> float:
        prompt = sum(r.num_prompt_tokens for r in self.requests)
        cached = sum(r.num_cached_tokens or 0 for r in self.requests)
        return cached / prompt if prompt else 0.0


def replay(
    trace: list[TraceRequest],
    layout: Layout,
    num_blocks: int,
    max_num_batched_tokens: int = 2048,
    use_eagle: bool = False,
    oracle: bool = True,
    slow: bool = False,
    max_steps: int = 1_000_000,
    on_step: Optional[Callable[[StepPlan, Scheduler], None]] = None,
) -> ReplayResult:
    """Run ``trace`` to completion. An invariant violation stops the replay and is reported
    (with the oracle's findings) in ``violations``; CapacityError propagates (bad input).
    ``slow`` turns the slow switch on for the replay (the slow-tier contracts of every call) and
    adds the whole-state checks (pool conservation, table references) after every step."""
    kv = KVCacheManager(layout, num_blocks, use_eagle=use_eagle)
    sched = Scheduler(kv, max_num_batched_tokens=max_num_batched_tokens)
    requests = [
        Request(t.id, t.prompt, layout.hash_block_size, cache_salt=t.cache_salt, arrival=t.arrival, expected_outputs=t.output)
        for t in trace
    ]
    for r in requests:
        if r.num_prompt_tokens + max(len(r.expected_outputs) - 1, 0) > layout.config.max_model_len:
            raise ValueError(
                f"request {r.request_id!r} needs {r.num_prompt_tokens + max(len(r.expected_outputs) - 1, 0)} tokens "
                f"> max_model_len {layout.config.max_model_len}"
            )
        sched.add_request(r)
    watcher = ContentOracle(layout) if oracle else None
    violations: list[str] = []
    try:
        with contracts.slow_checks(slow or contracts.slow()):
            while sched.has_unfinished():
                if sched.step >= max_steps:
                    violations.append(f"INV-REPLAY-PROGRESS: no completion after {max_steps} steps")
                    break
                plan = sched.schedule()
                if watcher is not None:
                    watcher.run_step(plan)
                if on_step is not None:
                    on_step(plan, sched)
                for req in sched.finish_step(plan):
                    if watcher is not None:
                        watcher.forget(req)
                if slow:
                    kv._check()
                if watcher is not None and watcher.violations:
                    break
    except InvariantViolation as e:
        violations.append(str(e))
    if watcher is not None:
        violations.extend(watcher.violations)
    return ReplayResult(requests, sched.step, kv.num_copies, kv.pool.num_evictions, sched.num_preemptions, violations)
