"""What both sides of benchmarks/manager.py count, and the loop that drives them: one module
imported by kvproof's side and vLLM's (benchmarks/vllm_baseline.py), so the two columns count
the same calls under the same driver."""

from __future__ import annotations

import time

from kvproof.impl.request import Request
from kvproof.impl.scheduler import Scheduler
from kvproof.sim.drive import drain


class CountingMixin:
    """Counts manager operations -- lookups, allocations (per prefill chunk and per decode
    token) and frees; caching is part of an allocation's cost, as in vLLM -- and times lookups.
    Mix in before the manager class."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ops = 0
        self.lookups = 0
        self.lookup_ns = 0

    def lookup(self, request):
        t = time.perf_counter_ns()
        hit = super().lookup(request)
        self.lookup_ns += time.perf_counter_ns() - t
        self.lookups += 1
        self.ops += 1
        return hit

    def allocate_slots(self, *args, **kwargs):
        self.ops += 1
        return super().allocate_slots(*args, **kwargs)

    def free(self, request):
        self.ops += 1
        return super().free(request)


def drive(kv, trace, layout, budget: int, on_request=None) -> dict:
    """Replay ``trace`` through kvproof's scheduler over the counting manager ``kv`` and time it.

    Requests are built (and their prompts hashed) before the clock starts; ``on_request`` sees
    each one first (vLLM's adapter builds its mirror request there)."""
    sched = Scheduler(kv, max_num_batched_tokens=budget)
    for t in trace:
        req = Request(t.id, t.prompt, layout.hash_block_size, arrival=t.arrival, expected_outputs=t.output)
        if on_request is not None:
            on_request(req)
        sched.add_request(req)
    start = time.perf_counter()
    drain(sched)
    seconds = time.perf_counter() - start
    cached = sum(r.num_cached_tokens or 0 for r in sched.finished)
    prompt = sum(r.num_prompt_tokens for r in sched.finished)
    return {
        "ops": kv.ops, "seconds": seconds, "ops_per_s": kv.ops / seconds,
        "us_per_lookup": kv.lookup_ns / max(kv.lookups, 1) / 1000, "hit_rate": cached / prompt,
        "copies": kv.num_copies, "steps": sched.step,
    }
