"""How much prefix reuse the traffic itself allows at a given granularity, independent of any
cache: every earlier request's tokens (prompt and outputs) are kept forever, and a prompt may
reuse its longest prefix, in whole ``unit``-token steps, that an earlier request also had.
Comparing a coarse unit with a fine one tells whether the hash unit throws reuse away.

Prefixes are identified by chained Python hashes of ``unit``-token pieces (64-bit; a collision
would only overstate reuse slightly). Only the first ``max_tokens`` prompt tokens of the
workload are examined, so the probe stays cheap on long traces.
"""

from __future__ import annotations

from typing import Iterable

from kvproof.sim.trace import TraceRequest

DEFAULT_MAX_TOKENS = 20_000_000


def reusable_fraction(requests: Iterable[TraceRequest], units: tuple[int, ...], max_tokens: int = DEFAULT_MAX_TOKENS) -> dict[int, float]:
    """Per unit: reusable prompt tokens over prompt tokens, over the examined requests. A
    prompt's last token is never reused (one token must be computed), as in a cache lookup."""
    seen: dict[int, set[int]] = {u: set() for u in units}
    reused = dict.fromkeys(units, 0)
    total = 0
    for req in requests:
        if total >= max_tokens:
            break
        prompt = req.prompt
        total += len(prompt)
        tokens = prompt + req.output
        for u in units:
            known = seen[u]
            bound = len(prompt) - 1
            h, hit, matching = 0, 0, True
            for end in range(u, len(tokens) + 1, u):
                h = hash((h, tokens[end - u:end]))
                if matching and end <= bound:
                    if h in known:
                        hit = end
                    else:
                        matching = False
                known.add(h)
            reused[u] += hit
    return {u: reused[u] / total if total else 0.0 for u in units}
