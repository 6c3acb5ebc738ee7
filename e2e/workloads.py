"""Traces built so that one e2e run exercises every cache path (used by the tests and
docs/e2e.md; ``python -m kvproof.e2e.workloads`` prints them as a trace file)."""

from __future__ import annotations

from kvproof.sim.trace import TraceRequest, dump_trace

#: A shared "system prompt".
SYSTEM = tuple(range(500, 530))


def hybrid_workload() -> list[TraceRequest]:
    """Shared prefixes, a multi-turn continuation, chunked prefill, and same-step sharing.

    - ``a`` and ``b`` arrive together and share SYSTEM: ``b`` is admitted while ``a`` writes
      that prefix in the same step, so it cannot hit it (keys appear after the forward pass).
    - ``c`` arrives while ``a`` is still prefilling and shares ``a``'s first 42 tokens: with a
      budget of 48 tokens per step it is admitted in the step where ``a`` computes its last
      prompt token, hits 42 tokens -- inside the attention block ``a`` writes in that very
      step -- and copies that block (and the Mamba state) at step start.
    - ``d`` is ``a``'s next turn: ``a``'s prompt + outputs + new tokens; it hits the state
      ``a`` ended on (48 tokens, prompt and outputs).
    - ``e`` repeats ``b``'s prompt; ``f`` has ``b``'s prompt under another cache salt (no hit).
    """
    a_prompt = SYSTEM + tuple(range(40, 53))
    a_out = (7, 8, 9, 10, 11, 12)
    b_prompt = SYSTEM + (60, 61, 62, 63, 64)
    return [
        TraceRequest("a", a_prompt, a_out, 0),
        TraceRequest("b", b_prompt, (11, 12, 13), 0),
        TraceRequest("c", a_prompt[:42] + (70, 71, 72), (14, 15), 3),
        TraceRequest("d", a_prompt + a_out + (80, 81, 82), (16, 17, 18), 10),
        TraceRequest("e", b_prompt, (19, 20), 10),
        TraceRequest("f", b_prompt, (21,), 10, cache_salt="tenant-2"),
    ]


def preemption_workload() -> list[TraceRequest]:
    """Six requests that together need more blocks than a small pool holds (``num_blocks``
    30 with full_attention:4 + mamba:8): running requests get preempted and recomputed."""
    return [TraceRequest(f"r{i}", tuple(range(i, i + 30)), tuple(range(20)), 0) for i in range(6)]


if __name__ == "__main__":
    print(dump_trace(hybrid_workload()), end="")
