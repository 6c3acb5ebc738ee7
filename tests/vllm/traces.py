"""Workloads shared by the tests that drive vLLM's real scheduler."""

from __future__ import annotations

import random

from kvproof.sim.trace import TraceRequest


def conversations(seed, num=3, turns=4, gap=60):
    """Multi-turn chats sharing a system prompt; each turn extends the previous prompt + output.
    Requests arrive ``gap`` steps apart, so none overlaps another."""
    rng = random.Random(seed)
    system = [rng.randrange(5000) for _ in range(rng.randrange(20, 90))]
    trace, arrival = [], 1
    for c in range(num):
        history = list(system)
        for t in range(turns):
            history += [rng.randrange(5000) for _ in range(rng.randrange(1, 40))]
            out = tuple(rng.randrange(5000) for _ in range(rng.randrange(0, 6)))
            trace.append(TraceRequest(f"c{c}t{t}", tuple(history), out, arrival))
            arrival += gap
            history += out
    return trace
