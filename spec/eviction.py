"""Eviction policies of the block pool, and what a cached block is worth.

Two policies choose which evictable cached block ``allocate`` reuses when no free uncached block
is left (the pool's model is ``spec.block_pool``; docs/coordinator.md, "Eviction"):

* ``lru`` -- vLLM's: the free queue's head, i.e. the least recently released (a request's blocks
  released tail first, so its tail goes first).
* ``compute`` -- Marconi's idea (MLSys 2025: FLOP efficiency combined with recency) made
  O(log n): a cached block released as the ``n``-th gets priority ``n + value`` (INV-EVICT-CLOCK),
  the pool evicts the lowest priority, ties to the earliest released (INV-EVICT-MIN), and only
  once no free uncached block is left (INV-EVICT-UNCACHED-FIRST). Values are in releases, so
  they trade directly against recency; value 0 for every block is LRU order exactly. Marconi's
  admission filter is not used: a Mamba state is cached only where a later request is known to
  resume (the retention policy, ``spec.retention``), which is already an admission rule.

What a block is worth. Prefilling token ``t`` costs ``c_tok + c_pair * t`` FLOPs (the weights,
and the attention layers' scores and weighted sum over the ``t`` tokens before it), so
recomputing ``[s, e)`` costs :func:`prefill_flops`. A hit of ``N`` tokens is a chain: attention
blocks over ``[0, N)`` in every attention group and, in a hybrid model, a Mamba state at exactly
``N`` in every Mamba group; it is worth nothing unless all of them are cached. So a released
block is valued by the chain it belongs to:

* a block no hit can use -- an attention block past the last Mamba state its request cached
  (``reach``): it is *dead*, value 0, evicted first;
* every other block of the chain (its attention blocks, its states): the chain's compute per
  block relative to one attention block at the start of a prompt (:func:`relative_efficiency`),
  mapped to releases by :func:`block_value`: one cache generation (the pool's size in blocks)
  plus ``weight`` generations per doubling. All of a chain's blocks get the same value, so
  within the chain release order decides (tail first, as under LRU).

The clock is the release count, not GreedyDual-Size's inflation (priority = the last evicted
priority + value): that clock advances only on eviction, so among blocks released between two
evictions any value difference would outrank recency. ``weight`` defaults to 0 (dead blocks
first, LRU among the rest): every positive weight measured lowered the hit rate at DCP 1 on
the Mooncake trace (``benchmarks/eviction_weight.py``, docs/benchmarks.md).

Bytes: every pool block is one page per layer of a vLLM group, padded to one page size
(``planner.memory``), so a Mamba state block and an attention block cost the same bytes and
FLOPs per block is FLOPs per byte times a constant.

Invariant ids: INV-EVICT-UNCACHED-FIRST, INV-EVICT-MIN, INV-EVICT-CLOCK, INV-EVICT-VALUE
(docs/spec.md, the eviction section).
"""

from __future__ import annotations

import dataclasses
import math

LRU = "lru"
COMPUTE = "compute"
POLICIES = (LRU, COMPUTE)


def parse_policy(text: str) -> str:
    """``lru`` or ``compute``; ValueError naming the value otherwise."""
    if text not in POLICIES:
        raise ValueError(f"eviction policy {text!r} must be one of {', '.join(POLICIES)}")
    return text


@dataclasses.dataclass(frozen=True)
class ComputeModel:
    """Prefill cost of one token at position ``t``: ``flops_per_token + flops_per_pair * t``.

    The default is a Kimi-K3-like model (docs/coordinator.md): 32e9 active parameters (2 FLOPs
    each per token), and 12 MLA layers of 64 heads whose absorbed scores (576 dims) and weighted
    sum (512 dims) cost ``2 * 64 * (576 + 512)`` FLOPs per layer per earlier token.
    """

    flops_per_token: float = 2 * 32e9
    flops_per_pair: float = 12 * 2 * 64 * (576 + 512)

    def __post_init__(self) -> None:
        for name in ("flops_per_token", "flops_per_pair"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} {v!r} must be a finite number >= 0")


DEFAULT_COMPUTE_MODEL = ComputeModel()


def prefill_flops(model: ComputeModel, start: int, end: int) -> float:
    """FLOPs to prefill tokens ``[start, end)`` after the ``start`` tokens before them (0 if
    the range is empty): sum of ``c_tok + c_pair * t`` over ``t`` in the range."""
    if end <= start:
        return 0.0
    pairs = (end * (end - 1) - start * (start - 1)) // 2
    return model.flops_per_token * (end - start) + model.flops_per_pair * pairs


#: How much a block's compute per byte counts against recency (Marconi's alpha): a chain whose
#: hits save twice the FLOPs per block of the reference stays ``weight`` cache generations longer.
DEFAULT_WEIGHT = 0.0


def relative_efficiency(model: ComputeModel, reach: int, blocks: int, unit_tokens: int) -> float:
    """FLOPs per pool block that a hit of ``reach`` tokens over ``blocks`` blocks saves, relative
    to the reference: one attention block of ``unit_tokens`` tokens at the start of a prompt."""
    if reach <= 0 or blocks <= 0:
        return 0.0
    return prefill_flops(model, 0, reach) / blocks / prefill_flops(model, 0, unit_tokens)


def block_value(model: ComputeModel, reach: int, blocks: int, unit_tokens: int, generation: int, weight: float = DEFAULT_WEIGHT) -> float:
    """The value (in releases) of each block of a chain whose hits reach ``reach`` tokens over
    ``blocks`` pool blocks: 0 for a chain no hit can use (a dead block), else one cache
    ``generation`` (the pool's block count) plus ``weight`` generations per doubling of the
    relative efficiency above 1 (INV-EVICT-VALUE: >= 0, and non-increasing along a chain)."""
    e = relative_efficiency(model, reach, blocks, unit_tokens)
    if e <= 0:
        return 0.0
    return generation * (1.0 + weight * math.log2(max(e, 1.0)))


def victims(free_order: tuple[int, ...], cached: set[int], priority: dict[int, float], n: int) -> tuple[int, ...]:
    """The ``n`` blocks the compute policy hands out (the spec of its choice, O(n log n)):
    free uncached blocks first in queue order (INV-EVICT-UNCACHED-FIRST), then evictable cached
    ones by ascending priority, ties to the earliest released, i.e. the earliest in the queue
    (INV-EVICT-MIN)."""
    uncached = [b for b in free_order if b not in cached]
    position = {b: i for i, b in enumerate(free_order)}
    ranked = sorted((b for b in free_order if b in cached), key=lambda b: (priority[b], position[b]))
    return tuple((uncached + ranked)[:n])
