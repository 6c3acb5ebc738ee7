"""Cache geometry under decode context parallelism (DCP): block sizes, hash granularity,
the partial-hash-hit rule and block-table widths.

Sizes have distinct names everywhere (docs/geometry.md):
- ``block_size``           physical tokens per block on one rank (the group's own);
- ``effective_block_size`` global tokens one block id covers: ``block_size * dcp`` when the
                           group is DCP-sharded, else ``block_size`` (B_g);
- ``scheduler_block_size`` lcm of all B_g (S);
- ``hash_block_size``      granularity of the chained request hashes (H); divides every
                           prefix-cacheable B_g;
- ``cache_hit_alignment``  granularity at which prefix-cache hits land (A = H or S).
"""

from __future__ import annotations

import dataclasses
import math

import icontract

from kvproof.spec.arith import cdiv, gcd_all, lcm_all
from kvproof.spec.groups import CacheGroup, GroupKind, MambaCacheMode
from kvproof.spec.placement import table_index

#: Bytes of one block-table entry (int32 block ids).
TABLE_ENTRY_BYTES = 4
#: Most blocks a pool may have: every block id must fit an int32 block-table entry.
MAX_NUM_BLOCKS = (1 << 31) - 1


# --------------------------------------------------------------------------------------------
# Block sizes
# --------------------------------------------------------------------------------------------


def _one_block_spans(group: CacheGroup, dcp: int, result: int) -> bool:
    """Positions 0 .. result-1 share block 0 of the row and position ``result`` opens block 1."""
    sharded = group.is_sharded
    return (
        result >= 1
        and table_index(result - 1, group.block_size, dcp, sharded) == 0
        and table_index(result, group.block_size, dcp, sharded) == 1
    )



@icontract.require(lambda dcp: dcp >= 1, error=lambda dcp: ValueError(f"dcp {dcp} must be >= 1"), enabled=True)
@icontract.require(
    lambda group: group.kind is not GroupKind.MAMBA or not group.is_sharded,
    "INV-GEOM-MAMBA-REPLICATED: Mamba state is replicated, so a Mamba block covers block_size "
    "tokens whatever the DCP size",
    error=lambda group: ValueError(
        f"INV-GEOM-MAMBA-REPLICATED: {group.label} is marked DCP-sharded; Mamba state is replicated on every rank"
    ),
    enabled=True,
)
@icontract.ensure(
    lambda group, dcp, result: _one_block_spans(group, dcp, result),
    "INV-GEOM-EFFECTIVE-BLOCK: B_g is the number of consecutive positions the placement puts in "
    "one block id (block_size * dcp for sharded groups, block_size otherwise)",
    enabled=True,
)
def effective_block_size(group: CacheGroup, dcp: int) -> int:
    """Global token positions covered by one block id of ``group`` (B_g)."""
    return group.block_size * dcp if group.is_sharded else group.block_size


@icontract.require(lambda groups: len(groups) > 0, error=lambda groups: ValueError("at least one cache group is required"), enabled=True)
@icontract.ensure(
    lambda groups, dcp, result: all(result % effective_block_size(g, dcp) == 0 for g in groups),
    "INV-GEOM-SCHED-LCM: every group's effective block size divides the scheduler block size",
    enabled=True,
)
def scheduler_block_size(groups: tuple[CacheGroup, ...], dcp: int) -> int:
    """S: the least token count that is a whole number of blocks in every group."""
    return lcm_all(tuple(effective_block_size(g, dcp) for g in groups))


def _cacheable_sizes(groups: tuple[CacheGroup, ...], dcp: int) -> tuple[int, ...]:
    return tuple(effective_block_size(g, dcp) for g in groups if g.prefix_cacheable)


def _hash_divides_cacheable(groups: tuple[CacheGroup, ...], dcp: int, result: int) -> bool:
    sizes = _cacheable_sizes(groups, dcp)
    return all(b % result == 0 for b in sizes) and scheduler_block_size(groups, dcp) % result == 0


@icontract.require(lambda groups: len(groups) > 0, error=lambda groups: ValueError("at least one cache group is required"), enabled=True)
@icontract.ensure(
    lambda groups, dcp, result: _hash_divides_cacheable(groups, dcp, result),
    "INV-GEOM-HASH-DIVIDES: H divides every prefix-cacheable effective block size and S",
    enabled=True,
)
def hash_block_size(groups: tuple[CacheGroup, ...], dcp: int, explicit: int | None = None) -> int:
    """H: the granularity of the chained request hashes.

    - One group, or no prefix-cacheable group: H = S (a finer hash buys nothing) -- except
      that one full-attention / MLA group takes an ``explicit`` H dividing its block: its KV is
      append-only, so hits can land inside a block (kvproof's extension; vLLM hashes a lone
      group at its block size, so DCP, which multiplies the block, coarsens its hits).
    - Otherwise ``explicit`` if given (it must divide every prefix-cacheable B_g), else the
      gcd of the prefix-cacheable B_g.

    Deviation from vLLM 0.33, which sets H = S whenever a Mamba group is in mode ``none``:
    with a smaller prefix-cacheable attention block that H would not divide the attention
    block, breaking the one-key rule (a full-block key at every block end). Such a hybrid
    can never hit anyway -- no reusable state exists -- so kvproof keeps H = gcd.

    Raises ValueError naming ``explicit`` and the group it does not fit.
    """
    s = scheduler_block_size(groups, dcp)
    coarse_reason = None
    if len(groups) == 1:
        coarse_reason = "a single cache group hashes at its own block size"
    elif not _cacheable_sizes(groups, dcp):
        coarse_reason = "no group is prefix-cacheable"
    if coarse_reason is not None and explicit is not None and _lone_append_only(groups):
        coarse_reason = None  # a finer explicit H is validated below like any other
    if coarse_reason is not None:
        if explicit is not None and explicit != s:
            raise ValueError(
                f"hash_block_size {explicit} must equal the scheduler block size {s}: {coarse_reason}"
            )
        return s
    if explicit is None:
        return gcd_all(_cacheable_sizes(groups, dcp))
    if isinstance(explicit, bool) or not isinstance(explicit, int) or explicit <= 0:
        raise ValueError(f"hash_block_size {explicit!r} must be a positive integer")
    for i, g in enumerate(groups):
        b = effective_block_size(g, dcp)
        if g.prefix_cacheable and b % explicit != 0:
            raise ValueError(
                f"hash_block_size {explicit} does not divide effective block size {b} "
                f"of group {i} ({g.label}, dcp {dcp}); expected a divisor of {b}"
            )
    return explicit


# --------------------------------------------------------------------------------------------
# Partial hash hits
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PartialHitDecision:
    """Whether prefix hits may end inside a group block (at a hash boundary), and why.

    ``warning`` is set when partial hits were possible by the Mamba rule but a group that
    cannot do fine-grained lookup forced the fallback to block-aligned (S) hits.
    """

    enabled: bool
    reason: str
    warning: str | None = None


def _lone_append_only(groups: tuple[CacheGroup, ...]) -> bool:
    """One full-attention / MLA group: append-only KV, so any hash boundary inside a block is
    a valid hit end (the block holding a longer prefix holds every shorter one)."""
    return len(groups) == 1 and groups[0].kind in (GroupKind.FULL_ATTENTION, GroupKind.MLA)


def mamba_allows_partial_hits(group: CacheGroup, dcp: int, hash_block_size: int) -> bool:
    """The Mamba half of the rule: hash boundaries must fall strictly inside (TP) or on the
    grid of (DCP) an align-mode Mamba block.

    Without DCP the Mamba block must be strictly larger than H, else every hash boundary is a
    Mamba block boundary and partial hits add nothing. With DCP the sharded attention block
    is ``block_size * dcp > H``, so ``>=`` suffices.
    """
    if group.kind is not GroupKind.MAMBA or group.mamba_cache_mode is not MambaCacheMode.ALIGN:
        return False
    return group.block_size > hash_block_size if dcp == 1 else group.block_size >= hash_block_size


def _restores_every_hash_boundary(group: CacheGroup, dcp: int, hash_block_size: int) -> bool:
    """Whether ``group`` can hand back a prefix ending at every multiple N of H, judged from
    where the placement puts N: at a block boundary (N is the first position of a block id)
    every kind can; inside a block only a kind that can look up a partial block can. One period
    of the block grid (N up to the block's span times H) covers every case."""
    if group.kind.supports_fine_grained_lookup:
        return True
    sharded = group.is_sharded
    for k in range(1, group.block_size * (dcp if sharded else 1) + 1):
        n = k * hash_block_size
        if table_index(n, group.block_size, dcp, sharded) == table_index(n - 1, group.block_size, dcp, sharded):
            return False  # N - 1 and N share a block: the hit would end inside it
    return True


def _hash_boundary_inside_a_mamba_block(groups: tuple[CacheGroup, ...], dcp: int, hash_block_size: int) -> bool:
    """Some align-mode Mamba group has a multiple of H strictly inside one of its blocks (TP), or,
    under DCP, a block that is a whole number (>= 1) of hash blocks."""
    for g in groups:
        if g.kind is not GroupKind.MAMBA or g.mamba_cache_mode is not MambaCacheMode.ALIGN:
            continue
        if dcp == 1 and any(n % hash_block_size == 0 for n in range(1, g.block_size)):
            return True
        if dcp > 1 and g.block_size % hash_block_size == 0:
            return True
    return False


def _hash_boundary_inside_the_only_attention_block(groups: tuple[CacheGroup, ...], dcp: int, hash_block_size: int) -> bool:
    """The layout is one full-attention / MLA group and a multiple of H lies strictly inside one
    of its blocks (between two positions the placement puts in the same block)."""
    if len(groups) != 1 or groups[0].kind not in (GroupKind.FULL_ATTENTION, GroupKind.MLA):
        return False
    g = groups[0]
    return any(
        table_index(n, g.block_size, dcp, g.is_sharded) == table_index(n - 1, g.block_size, dcp, g.is_sharded)
        for n in range(hash_block_size, g.block_size * dcp + 1, hash_block_size)
    )


def _partial_rule_holds(groups, dcp, hash_block_size, allow, result) -> bool:
    """INV-GEOM-PARTIAL-RULE from first principles: hits at hash granularity are on only if asked
    for, only if every prefix-cacheable group can hand back a prefix ending at every multiple of
    H, and only if a group gains from them: a Mamba group, or a lone attention group whose
    blocks a hash boundary falls inside."""
    if not result.enabled:
        return True
    return (
        allow
        and all(_restores_every_hash_boundary(g, dcp, hash_block_size) for g in groups if g.prefix_cacheable)
        and (
            _hash_boundary_inside_a_mamba_block(groups, dcp, hash_block_size)
            or _hash_boundary_inside_the_only_attention_block(groups, dcp, hash_block_size)
        )
    )


@icontract.ensure(
    lambda groups, dcp, hash_block_size, allow, result: _partial_rule_holds(groups, dcp, hash_block_size, allow, result),
    "INV-GEOM-PARTIAL-RULE: partial hits only when asked for, when every prefix-cacheable group can "
    "restore a prefix ending at any multiple of H, and when an align Mamba block holds a hash "
    "boundary strictly inside it (TP) or is a whole number of hash blocks (DCP), or a hash "
    "boundary falls inside a block of the only group, an attention one",
    enabled=True,
)
@icontract.ensure(
    lambda groups, dcp, hash_block_size, result: not result.enabled
    or all(effective_block_size(g, dcp) % hash_block_size == 0 for g in groups if g.prefix_cacheable),
    "INV-GEOM-PARTIAL-GRID: with partial hits on, every hash boundary inside a block lies on "
    "the hash grid of every prefix-cacheable group (H divides each B_g)",
    enabled=True,
)
def partial_hash_hits(
    groups: tuple[CacheGroup, ...], dcp: int, hash_block_size: int, allow: bool = True
) -> PartialHitDecision:
    """Decide whether prefix-cache hits may land at hash (H) granularity."""
    if not allow:
        return PartialHitDecision(False, "partial hash hits turned off by the caller")
    if _lone_append_only(groups) and hash_block_size < effective_block_size(groups[0], dcp):
        return PartialHitDecision(
            True, f"one append-only attention group hashed finer than its block: hits land on multiples of the hash block size {hash_block_size}"
        )
    if not any(mamba_allows_partial_hits(g, dcp, hash_block_size) for g in groups):
        cmp = ">" if dcp == 1 else ">="
        return PartialHitDecision(
            False, f"no align-mode Mamba group with block size {cmp} hash block size {hash_block_size}"
        )
    coarse = [
        (i, g) for i, g in enumerate(groups)
        if g.prefix_cacheable
        and not g.kind.supports_fine_grained_lookup
        and effective_block_size(g, dcp) != hash_block_size
    ]
    if coarse:
        names = ", ".join(f"group {i} ({g.label}, effective block {effective_block_size(g, dcp)})" for i, g in coarse)
        warning = (
            f"falling back to block-aligned prefix-cache hits: {names} cannot look up hits finer "
            f"than its block and its effective block size differs from the hash block size {hash_block_size}"
        )
        return PartialHitDecision(False, warning, warning)
    return PartialHitDecision(True, f"hits land on multiples of the hash block size {hash_block_size}")


@icontract.ensure(
    lambda scheduler_size, hash_block_size, result: scheduler_size % result == 0 and result % hash_block_size == 0,
    "INV-GEOM-HIT-ALIGN: H divides the cache-hit alignment A, and A divides S",
    enabled=True,
)
def cache_hit_alignment(scheduler_size: int, hash_block_size: int, partial: bool) -> int:
    """A: hits land on multiples of H with partial hits, else on whole scheduler blocks."""
    return hash_block_size if partial else scheduler_size


# --------------------------------------------------------------------------------------------
# Block-table widths
# --------------------------------------------------------------------------------------------


def table_entries_needed(group: CacheGroup, dcp: int, num_tokens: int) -> int:
    """The most block-table entries a request of ``num_tokens`` tokens can occupy in ``group``.

    Demand, stated from where the placement (``spec.placement.table_index``) puts positions,
    not from how widths are sized: one entry past the largest row index of any position below
    ``num_tokens`` -- the last position's, since a later position never maps to an earlier
    block -- plus the speculative blocks a Mamba group appends. Mamba ``none`` overwrites one
    running state in place: one entry (plus speculative).
    """
    speculative = group.num_speculative_blocks if group.kind is GroupKind.MAMBA else 0
    if group.kind is GroupKind.MAMBA and group.mamba_cache_mode is MambaCacheMode.NONE:
        return 1 + speculative
    return table_index(num_tokens - 1, group.block_size, dcp, group.is_sharded) + 1 + speculative


def _width_covers_demand(group: CacheGroup, dcp: int, max_len: int, result: int) -> bool:
    return result >= table_entries_needed(group, dcp, max_len)


@icontract.require(lambda max_len: max_len > 0, error=lambda max_len: ValueError(f"max_model_len {max_len} must be > 0"), enabled=True)
@icontract.require(lambda dcp: dcp >= 1, error=lambda dcp: ValueError(f"dcp {dcp} must be >= 1"), enabled=True)
@icontract.ensure(
    _width_covers_demand,
    "INV-TABLE-WIDTH: the row holds every entry a request of max_len tokens can use "
    "(replicated Mamba: ceil(max_len / block_size) + speculative, never divided by DCP)",
    enabled=True,
)
def max_num_blocks_per_req(group: CacheGroup, dcp: int, max_len: int) -> int:
    """Row length of the worker block table for ``group``.

    Sharded attention: ``cdiv(max_len, block_size * dcp)``. Mamba align:
    ``cdiv(max_len, block_size) + num_speculative_blocks`` -- replicated state is indexed by
    global position on every rank, so DCP never divides it. Mamba none: ``1 + speculative``.
    """
    if group.kind is GroupKind.MAMBA:
        if group.mamba_cache_mode is MambaCacheMode.NONE:
            return 1 + group.num_speculative_blocks
        return cdiv(max_len, group.block_size) + group.num_speculative_blocks
    return cdiv(max_len, effective_block_size(group, dcp))


@icontract.require(lambda num_blocks: num_blocks >= 0, error=lambda num_blocks: ValueError(f"num_blocks {num_blocks} must be >= 0"), enabled=True)
@icontract.require(lambda block_size: block_size > 0, error=lambda block_size: ValueError(f"block_size {block_size} must be > 0"), enabled=True)
@icontract.require(
    lambda token_alignment: token_alignment is None or token_alignment > 0,
    error=lambda token_alignment: ValueError(f"token_alignment {token_alignment} must be None or > 0"),
    enabled=True,
)
@icontract.ensure(
    lambda num_blocks, block_size, token_alignment, result: num_blocks <= result
    and (token_alignment is None or result < num_blocks + token_alignment // math.gcd(token_alignment, block_size)),
    "INV-TABLE-PAD: the padded width is the least multiple of the entry alignment >= num_blocks",
    enabled=True,
)
def block_table_width(num_blocks: int, block_size: int, token_alignment: int | None) -> int:
    """Pad a row length so that ``width * block_size`` is a multiple of ``token_alignment``
    tokens where possible: entries are padded to ``token_alignment / gcd(token_alignment,
    block_size)``. Mamba tables are not padded (``token_alignment`` None)."""
    if token_alignment is None:
        return num_blocks
    step = token_alignment // math.gcd(token_alignment, block_size)
    return cdiv(num_blocks, step) * step
