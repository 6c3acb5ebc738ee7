"""A whole cache layout: groups plus DCP settings, validated and resolved into every derived
size (the values ``kvproof geometry`` prints and every other layer consumes)."""

from __future__ import annotations

import dataclasses

import icontract

from kvproof.spec.geometry import (
    TABLE_ENTRY_BYTES,
    PartialHitDecision,
    block_table_width,
    cache_hit_alignment,
    effective_block_size,
    hash_block_size,
    max_num_blocks_per_req,
    partial_hash_hits,
    scheduler_block_size,
)
from kvproof.spec.checkpoints import parse_checkpoints
from kvproof.spec.eviction import parse_policy
from kvproof.spec.groups import CacheGroup, GroupKind

#: Longest context the geometry accepts (2**30 tokens): far beyond any model, small enough
#: that block tables stay addressable with int32 entries.
MAX_MODEL_LEN_LIMIT = 1 << 30

#: Where an attention (full attention / MLA) block gets prefix-cache keys, for
#: ``LayoutConfig.attention_keys``: ``every-hash`` at every hash boundary the forward pass wrote
#: (the managers' keying rule, docs/spec.md), ``chunk-ends`` only at block ends and each step's
#: last hash boundary, ``prompt-tail`` only at block ends and the prompt's tail (vLLM 0.33.0's
#: rule: ``prompt - 1`` floored to the hash unit, ``prompt`` with EAGLE).
ATTENTION_KEYS = ("every-hash", "chunk-ends", "prompt-tail")


@dataclasses.dataclass(frozen=True)
class LayoutConfig:
    """What a user chooses. ``hash_block_size`` None means "derive it"."""

    groups: tuple[CacheGroup, ...]
    dcp: int = 1
    max_model_len: int = 8192
    hash_block_size: int | None = None
    interleave: int = 1
    allow_partial_hash_hits: bool = True
    #: Which Mamba / sliding-window states stay cached (vLLM's
    #: ``prefix_cache_retention_interval``): ``None`` keeps every chunk end ("dense"); ``0``
    #: (vLLM's production default) keeps only replay boundaries and shared-prefix junctions;
    #: ``K > 0`` also keeps one state per K-token segment (K a multiple of the scheduler block).
    retention_interval: int | None = 0
    #: Stop a prefill chunk exactly at a shared-prefix junction, not at the Mamba block below it
    #: (vLLM's ``enable_mamba_shared_prefix_checkpoint``).
    shared_prefix_checkpoint: bool = False
    #: Which evictable cached block the pool reuses first (``spec.eviction``): ``lru`` (vLLM's)
    #: or ``compute`` (the least prefill compute lost, aged GreedyDual-style).
    eviction: str = "lru"
    #: Which hash boundaries inside an attention block get a key (one of ``ATTENTION_KEYS``).
    #: Attention KV is append-only, so a key at every boundary only ever adds hits: a request
    #: diverging inside a block reuses up to its last common hash unit, not its last chunk end.
    attention_keys: str = "every-hash"
    #: Where Mamba states are made and kept beyond the retention rule (``spec.checkpoints``):
    #: ``vllm`` (vLLM 0.33.0's positions) or ``reuse`` (also the prompt's turn-end ladder).
    checkpoints: str = "vllm"


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    index: int
    group: CacheGroup
    effective_block_size: int
    max_num_blocks_per_req: int
    table_width: int

    @property
    def table_row_bytes(self) -> int:
        """Bytes of one request's block-table row (int32 entries)."""
        return self.table_width * TABLE_ENTRY_BYTES


@dataclasses.dataclass(frozen=True)
class Layout:
    config: LayoutConfig
    groups: tuple[GroupLayout, ...]
    scheduler_block_size: int
    hash_block_size: int
    partial: PartialHitDecision
    cache_hit_alignment: int
    warnings: tuple[str, ...]

    @property
    def dcp(self) -> int:
        return self.config.dcp

    @property
    def partial_hash_hits(self) -> bool:
        return self.partial.enabled

    def eagle_unit(self, group: GroupLayout) -> int:
        """Tokens an EAGLE draft recomputes at the end of a hit, which an attention ``group``
        must therefore cover beyond the hit: one hash block when hits may end inside the group's
        blocks (the cache-hit alignment is finer than its effective block), else one whole
        effective block (docs/coordinator.md, "The joint hit")."""
        return eagle_unit(group.effective_block_size, self.hash_block_size, self.cache_hit_alignment)


def eagle_unit(block_size: int, hash_block_size: int, cache_hit_alignment: int) -> int:
    """Tokens below its coverage at which an attention group's hit ends with EAGLE (the draft
    recomputes them): one hash block when hits may land inside the group's blocks (alignment
    below the effective block ``block_size``), else one whole block."""
    return hash_block_size if cache_hit_alignment < block_size else block_size


def _positive_int(name: str, value: object, upper: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} {value!r} must be a positive integer")
    if upper is not None and value > upper:
        raise ValueError(f"{name} {value} is too large; expected at most {upper}")


def validate_config(config: LayoutConfig) -> None:
    """Raise ValueError (naming the bad value and what was expected) for an unusable layout."""
    if not config.groups:
        raise ValueError("at least one cache group is required")
    _positive_int("dcp", config.dcp, upper=1024)
    _positive_int("max_model_len", config.max_model_len, upper=MAX_MODEL_LEN_LIMIT)
    _positive_int("interleave", config.interleave)
    parse_policy(config.eviction)
    parse_checkpoints(config.checkpoints)
    if config.attention_keys not in ATTENTION_KEYS:
        raise ValueError(f"attention_keys {config.attention_keys!r} must be one of {', '.join(ATTENTION_KEYS)}")
    for i, g in enumerate(config.groups):
        if g.kind is GroupKind.MAMBA and g.dcp_sharded:
            raise ValueError(
                f"group {i} ({g.label}) is marked DCP-sharded; Mamba state is replicated on every rank"
            )
        if config.dcp > 1 and g.kind is GroupKind.SLIDING_WINDOW and g.is_sharded:
            raise ValueError(
                f"group {i} ({g.label}) is a DCP-sharded sliding window under dcp {config.dcp}; "
                "expected a replicated sliding-window group (add ':replicated')"
            )
        if config.dcp > 1 and g.is_sharded and g.block_size % config.interleave != 0:
            raise ValueError(
                f"interleave {config.interleave} does not divide block size {g.block_size} of group {i} "
                f"({g.label}); expected a divisor of {g.block_size}"
            )


def _check_retention(config: LayoutConfig, scheduler_block: int) -> None:
    r = config.retention_interval
    if r is None:
        return
    if isinstance(r, bool) or not isinstance(r, int) or r < 0:
        raise ValueError(f"retention_interval {r!r} must be None (dense), 0 or a positive multiple of the scheduler block")
    sparse_groups = any(g.kind in (GroupKind.MAMBA, GroupKind.SLIDING_WINDOW) for g in config.groups)
    if r and not sparse_groups:
        raise ValueError(
            f"retention_interval {r} has no effect without a Mamba or sliding-window group; expected 0 or none"
        )
    if r % scheduler_block:
        raise ValueError(
            f"retention_interval {r} must be a multiple of the scheduler block size {scheduler_block}"
        )


@icontract.ensure(
    lambda result: all(
        gl.table_width >= gl.max_num_blocks_per_req for gl in result.groups
    ),
    "INV-TABLE-WIDTH: padding never shrinks a row below max_num_blocks_per_req",
)
def resolve_layout(config: LayoutConfig) -> Layout:
    """Validate ``config`` and derive every size. Pure; raises ValueError on bad input."""
    validate_config(config)
    groups, dcp = config.groups, config.dcp
    s = scheduler_block_size(groups, dcp)
    h = hash_block_size(groups, dcp, config.hash_block_size)
    partial = partial_hash_hits(groups, dcp, h, config.allow_partial_hash_hits)
    a = cache_hit_alignment(s, h, partial.enabled)
    _check_retention(config, s)
    warnings = [partial.warning] if partial.warning else []
    for i, g in enumerate(groups):
        if not g.prefix_cacheable:
            warnings.append(f"group {i} ({g.label}) is in Mamba cache mode 'none': its state is never prefix-cached")
    rows = []
    for i, g in enumerate(groups):
        n = max_num_blocks_per_req(g, dcp, config.max_model_len)
        rows.append(
            GroupLayout(
                index=i,
                group=g,
                effective_block_size=effective_block_size(g, dcp),
                max_num_blocks_per_req=n,
                table_width=block_table_width(n, g.block_size, g.token_alignment),
            )
        )
    return Layout(config, tuple(rows), s, h, partial, a, tuple(warnings))
