"""How much prefix reuse the traffic itself allows at a given granularity, independent of any
cache: every earlier request's tokens (prompt and outputs) are kept forever, and a prompt may
reuse its longest prefix, in whole ``unit``-token steps, that an earlier request also had.
Comparing a coarse unit with a fine one tells whether the hash unit throws reuse away.

Two ways to the same number:

* :func:`reusable_fraction` over tokens: prefixes are identified by chained Python hashes of
  ``unit``-token pieces (64-bit; a collision would only overstate reuse slightly). Only the
  first ``max_tokens`` prompt tokens are examined, so the probe stays cheap on long traces.
* :func:`mooncake_reusable_fraction` over a Mooncake trace's hash ids, whole: a prompt's longest
  prefix an earlier prompt had is where their id lists part (a trie of id lists; a partial last
  block matches as far as both have it), since equal ids are equal content and different ids
  differ from their first token (``sim.mooncake.block_tokens``); outputs are fresh tokens no
  prompt contains. Cheap enough for the full 145 M-token trace; the tests check that both agree.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

from kvproof.sim.mooncake import MOONCAKE_BLOCK, MooncakeRequest
from kvproof.sim.trace import TraceRequest
from kvproof.sim.workload import Workload

DEFAULT_MAX_TOKENS = 20_000_000


@dataclasses.dataclass(frozen=True)
class Reuse:
    """Per unit: reusable prompt tokens over prompt tokens, over the requests examined."""

    fractions: dict[int, float]
    #: Prompt tokens of the requests examined (all of them, unless the token probe stopped).
    examined_tokens: int


def workload_reuse(workload: Workload, units: tuple[int, ...]) -> Reuse:
    """The whole workload's reuse from its hash ids when it is a Mooncake trace, else from its
    tokens up to DEFAULT_MAX_TOKENS."""
    if workload.entries and all(isinstance(e.ref, MooncakeRequest) for e in workload.entries):
        return mooncake_reusable_fraction((e.ref for e in workload.entries), units)
    return reusable_fraction(workload.requests(), units)


def reusable_fraction(requests: Iterable[TraceRequest], units: tuple[int, ...], max_tokens: int = DEFAULT_MAX_TOKENS) -> Reuse:
    """The reuse of the requests up to the one that reaches ``max_tokens`` prompt tokens. A
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
    return _fractions(reused, total)


def _reuse(prompt_len: int, shared: int, units: tuple[int, ...], reused: dict[int, int]) -> None:
    """Add one prompt's reuse: its ``shared`` tokens, less the last token, in whole units."""
    usable = min(shared, prompt_len - 1)
    for u in units:
        reused[u] += usable - usable % u


def mooncake_reusable_fraction(requests: Iterable[MooncakeRequest], units: tuple[int, ...]) -> Reuse:
    """:func:`reusable_fraction` of the expanded requests, computed from their hash ids."""
    # Trie of id lists: node -> {id: [child node, most tokens of that block an earlier prompt had]}.
    root: dict = {}
    reused = dict.fromkeys(units, 0)
    total = 0
    for req in requests:
        lengths = _block_lengths(req)
        total += req.input_length
        node, shared, matching = root, 0, True
        for hash_id, length in zip(req.hash_ids, lengths):
            edge = node.get(hash_id)
            if matching:
                if edge is None:
                    matching = False
                else:
                    shared += min(length, edge[1])
                    matching = length == edge[1] == MOONCAKE_BLOCK
            if edge is None:
                edge = node[hash_id] = [{}, length]
            else:
                edge[1] = max(edge[1], length)
            node = edge[0]
        _reuse(req.input_length, shared, units, reused)
    return _fractions(reused, total)


def _fractions(reused: dict[int, int], total: int) -> Reuse:
    return Reuse({u: n / total if total else 0.0 for u, n in reused.items()}, total)


def _block_lengths(req: MooncakeRequest) -> Sequence[int]:
    """Tokens of each of the prompt's blocks: 512, the last one cut to the prompt's length."""
    last = req.input_length - MOONCAKE_BLOCK * (len(req.hash_ids) - 1)
    return [MOONCAKE_BLOCK] * (len(req.hash_ids) - 1) + [last]
