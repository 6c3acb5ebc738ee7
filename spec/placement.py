"""Where DCP puts each token: the owning rank of a position, per-rank local sequence lengths,
and the slot a position maps to given a block-table row.

Layout (vLLM 0.33, docs/vllm-semantics.md §7.2): a sharded block id covers the *virtual block* of
``V = block_size * dcp`` global positions. Positions go to ranks in runs of ``interleave``
(I) tokens, round robin; each rank stores its ``block_size`` positions of the virtual block
in its own page of the same block id. Replicated groups (Mamba) map every position on every
rank, indexing the row by ``position // block_size``.
"""

from __future__ import annotations

import icontract

from kvproof.spec.arith import cdiv

#: The one padding sentinel: "no slot" in slot mappings, "no row" in batch index maps.
PAD_SLOT = -1


def _valid_dcp(dcp: int, interleave: int) -> bool:
    return dcp >= 1 and interleave >= 1


@icontract.require(lambda position: position >= 0, error=lambda position: ValueError(f"position {position} must be >= 0"), enabled=True)
@icontract.require(
    lambda dcp, interleave: _valid_dcp(dcp, interleave),
    error=lambda dcp, interleave: ValueError(f"dcp {dcp} and interleave {interleave} must both be >= 1"),
    enabled=True,
)
@icontract.ensure(lambda dcp, result: 0 <= result < dcp, "INV-DCP-OWNER-RANGE: the owner is a rank in [0, dcp)", enabled=True)
def owner_rank(position: int, dcp: int, interleave: int) -> int:
    """The rank that stores ``position`` of a sharded group: runs of ``interleave`` tokens,
    round robin over ranks."""
    return (position // interleave) % dcp


@icontract.require(lambda position: position >= 0, error=lambda position: ValueError(f"position {position} must be >= 0"), enabled=True)
@icontract.require(
    lambda block_size, interleave: block_size >= 1 and interleave >= 1 and block_size % interleave == 0,
    error=lambda block_size, interleave: ValueError(
        f"interleave {interleave} must divide block size {block_size}"
    ),
    enabled=True,
)
@icontract.require(lambda dcp: dcp >= 1, error=lambda dcp: ValueError(f"dcp {dcp} must be >= 1"), enabled=True)
@icontract.ensure(
    lambda position, block_size, dcp, result: 0
    <= result - (position // (block_size * dcp)) * block_size
    < block_size,
    "INV-DCP-LOCAL-IN-BLOCK: a position's local offset stays inside its virtual block's local page",
    enabled=True,
)
def local_position(position: int, block_size: int, dcp: int, interleave: int) -> int:
    """Position of a sharded token in its owner's local sequence."""
    virtual = block_size * dcp
    vblock, offset = divmod(position, virtual)
    return vblock * block_size + (offset // (interleave * dcp)) * interleave + offset % interleave


@icontract.require(lambda num_tokens: num_tokens >= 0, error=lambda num_tokens: ValueError(f"num_tokens {num_tokens} must be >= 0"), enabled=True)
@icontract.require(lambda dcp, rank: 0 <= rank < dcp, error=lambda dcp, rank: ValueError(f"rank {rank} must lie in [0, dcp {dcp})"), enabled=True)
@icontract.require(lambda interleave: interleave >= 1, error=lambda interleave: ValueError(f"interleave {interleave} must be >= 1"), enabled=True)
@icontract.ensure(
    lambda num_tokens, dcp, interleave, result: 0 <= result <= cdiv(num_tokens, dcp * interleave) * interleave,
    "INV-DCP-LOCAL-LEN-BOUND: no rank holds more than its share of whole interleave runs",
    enabled=True,
)
def local_seq_len(num_tokens: int, rank: int, dcp: int, interleave: int) -> int:
    """How many of the positions ``[0, num_tokens)`` rank ``rank`` owns."""
    full_rounds, rest = divmod(num_tokens, dcp * interleave)
    return full_rounds * interleave + min(max(rest - rank * interleave, 0), interleave)


@icontract.require(lambda num_tokens: num_tokens >= 0, error=lambda num_tokens: ValueError(f"num_tokens {num_tokens} must be >= 0"), enabled=True)
@icontract.require(
    lambda dcp, interleave: _valid_dcp(dcp, interleave),
    error=lambda dcp, interleave: ValueError(f"dcp {dcp} and interleave {interleave} must both be >= 1"),
    enabled=True,
)
@icontract.ensure(
    lambda num_tokens, result: sum(result) == num_tokens,
    "INV-DCP-LOCAL-LEN-SUM: the ranks' local lengths add up to the sequence length",
    enabled=True,
)
@icontract.ensure(
    lambda interleave, result: all(result[r] >= result[r + 1] for r in range(len(result) - 1))
    and max(result) - min(result) <= interleave,
    "INV-DCP-LOCAL-LEN-BALANCE: local lengths are non-increasing by rank and differ by at most I",
    enabled=True,
)
def local_seq_lens(num_tokens: int, dcp: int, interleave: int) -> tuple[int, ...]:
    """Local lengths of a ``num_tokens`` sequence on every rank."""
    return tuple(local_seq_len(num_tokens, r, dcp, interleave) for r in range(dcp))


@icontract.require(lambda position: position >= 0, error=lambda position: ValueError(f"position {position} must be >= 0"), enabled=True)
@icontract.require(lambda block_size: block_size >= 1, error=lambda block_size: ValueError(f"block_size {block_size} must be >= 1"), enabled=True)
@icontract.require(lambda dcp: dcp >= 1, error=lambda dcp: ValueError(f"dcp {dcp} must be >= 1"), enabled=True)
@icontract.ensure(
    lambda position, block_size, dcp, sharded, result: result * (block_size * dcp if sharded else block_size)
    <= position
    < (result + 1) * (block_size * dcp if sharded else block_size),
    "INV-SLOT-TABLE-INDEX: entry ``result`` covers the position: a sharded block id spans the "
    "block_size * dcp positions of a virtual block, a replicated one block_size positions",
    enabled=True,
)
def table_index(position: int, block_size: int, dcp: int, sharded: bool) -> int:
    """The block-table index the slot mapping of ``position`` reads (on its owner rank; every
    rank for a replicated group)."""
    return position // (block_size * dcp) if sharded and dcp > 1 else position // block_size


def slot_for_position(
    position: int,
    row: tuple[int, ...],
    block_size: int,
    dcp: int,
    interleave: int,
    rank: int,
    sharded: bool,
) -> int:
    """The slot (``block_id * block_size + offset``) ``position`` is written to on ``rank``,
    or :data:`PAD_SLOT` when another rank owns it.

    Raises IndexError naming the index and the row width when the row is too short
    (INV-SLOT-INDEX-BOUND): a slot mapping never reads past its row.
    """
    if sharded and dcp > 1:
        if owner_rank(position, dcp, interleave) != rank:
            return PAD_SLOT
        local = local_position(position, block_size, dcp, interleave)
    else:
        local = position
    index = local // block_size
    if index >= len(row):
        raise IndexError(
            f"INV-SLOT-INDEX-BOUND: position {position} reads block-table index {index} "
            f"but the row holds {len(row)} entries"
        )
    return row[index] * block_size + local % block_size


@icontract.require(
    lambda block_size, dcp, interleave: block_size >= 1 and _valid_dcp(dcp, interleave),
    error=lambda block_size, dcp, interleave: ValueError(
        f"block_size {block_size}, dcp {dcp} and interleave {interleave} must all be >= 1"
    ),
    enabled=True,
)
@icontract.require(
    lambda positions: len(set(positions)) == len(positions),
    error=lambda positions: ValueError("positions must be distinct"),
    enabled=True,
)
@icontract.ensure(
    lambda result: len({s for s in result if s != PAD_SLOT}) == sum(1 for s in result if s != PAD_SLOT),
    "INV-DCP-SLOT-DISTINCT: one rank never maps two positions to the same slot",
    enabled=True,
)
def slot_mapping(
    positions: tuple[int, ...],
    row: tuple[int, ...],
    block_size: int,
    dcp: int,
    interleave: int,
    rank: int,
    sharded: bool,
) -> tuple[int, ...]:
    """Slots of ``positions`` (distinct, in ascending order of position) on ``rank``.

    Assumes the row's block ids are distinct, as a block pool hands them out."""
    return tuple(slot_for_position(p, row, block_size, dcp, interleave, rank, sharded) for p in positions)


@icontract.require(lambda position: position >= 0, error=lambda position: ValueError(f"position {position} must be >= 0"), enabled=True)
@icontract.require(
    lambda block_size, dcp, interleave: block_size >= 1 and _valid_dcp(dcp, interleave) and block_size % interleave == 0,
    error=lambda block_size, dcp, interleave: ValueError(
        f"block_size {block_size}, dcp {dcp} and interleave {interleave} must be >= 1, interleave dividing block_size"
    ),
    enabled=True,
)
@icontract.ensure(
    lambda dcp, sharded, result: len(result) == (1 if sharded and dcp > 1 else dcp),
    "INV-DCP-OWNER-UNIQUE: a sharded position lives on exactly one rank, a replicated one on all",
    enabled=True,
)
def owning_ranks(position: int, block_size: int, dcp: int, interleave: int, sharded: bool) -> tuple[int, ...]:
    """The ranks whose slot mapping keeps ``position`` (each rank decides on its own)."""
    row = tuple(range(position // block_size + 1))  # a row wide enough for any mapping
    return tuple(
        r for r in range(dcp)
        if slot_for_position(position, row, block_size, dcp, interleave, r, sharded) != PAD_SLOT
    )
