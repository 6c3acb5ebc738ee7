"""Request workloads shared by the scheduler-side benchmarks (no hard-coded sizes: every
number is a parameter with a default)."""

from __future__ import annotations

import random

from kvproof.impl.trace import TraceRequest


def shared_prefix_workload(
    num_requests: int = 2000,
    num_prefixes: int = 20,
    prefix_len: int = 1024,
    suffix_len: tuple[int, int] = (32, 256),
    output_len: tuple[int, int] = (8, 64),
    arrivals_per_step: int = 8,
    vocab: int = 32000,
    seed: int = 0,
) -> list[TraceRequest]:
    """``num_requests`` requests, each a random shared prefix (system prompt) plus a unique
    suffix, arriving ``arrivals_per_step`` per scheduler step."""
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(vocab) for _ in range(prefix_len)) for _ in range(num_prefixes)]
    out = []
    for i in range(num_requests):
        suffix = tuple(rng.randrange(vocab) for _ in range(rng.randint(*suffix_len)))
        outputs = tuple(rng.randrange(vocab) for _ in range(rng.randint(*output_len)))
        out.append(TraceRequest(f"r{i}", rng.choice(prefixes) + suffix, outputs, arrival=i // arrivals_per_step))
    return out
