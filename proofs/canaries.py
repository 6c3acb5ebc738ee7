"""Canaries: seeded wrong versions of the spec, run through the same checkers as the real
obligations. Each must come back ``refuted``, with the counterexample kept in
``proofs/golden/<id>.txt``; a canary that is *not* refuted means a checker lost its teeth, and
``kvproof prove`` fails.
"""

from __future__ import annotations

from kvproof.proofs import geometry, placement
from kvproof.proofs.lemmas_arith import mamba_width_covers
from kvproof.proofs.registry import Obligation
from kvproof.proofs.z3kit import lemma_obligation
from kvproof.spec.arith import cdiv
from kvproof.spec.geometry import effective_block_size
from kvproof.spec.groups import CacheGroup, GroupKind, MambaCacheMode
from kvproof.spec.placement import slot_mapping


def old_mamba_width(dcp: int, block_size: int, max_len: int, spec_blocks: int) -> int:
    """SEEDED BUG (the upstream rule): the replicated Mamba row divided by DCP like a sharded one."""
    return cdiv(max_len, block_size * dcp) + spec_blocks


def partial_rule_strict_under_dcp(groups: tuple[CacheGroup, ...], dcp: int, hash_block_size: int) -> bool:
    """SEEDED BUG: the partial-hit rule with the TP comparison ``block_size > H`` under DCP too."""
    mamba_ok = any(
        g.kind is GroupKind.MAMBA and g.mamba_cache_mode is MambaCacheMode.ALIGN and g.block_size > hash_block_size
        for g in groups
    )
    coarse = any(
        g.prefix_cacheable and not g.kind.supports_fine_grained_lookup and effective_block_size(g, dcp) != hash_block_size
        for g in groups
    )
    return mamba_ok and not coarse


def slot_mapping_off_by_one_rank(positions, row, block_size, dcp, interleave, rank, sharded):
    """SEEDED BUG: rank r writes the positions that rank r + 1 owns."""
    return slot_mapping(positions, row, block_size, dcp, interleave, (rank + 1) % dcp, sharded)


OBLIGATIONS = (
    lemma_obligation(
        "CANARY-MAMBA-WIDTH-DIVIDED-BY-DCP", ("INV-TABLE-WIDTH",),
        "the old rule cdiv(L, bs*D) + Sp leaves the replicated Mamba row short when D > 1",
        mamba_width_covers(old_mamba_width, divided_by_dcp=True),
    ),
    Obligation(
        "CANARY-PARTIAL-STRICT-UNDER-DCP",
        ("INV-GEOM-PARTIAL-RULE",),
        "exhaustive",
        "a partial-hit rule with `block > H` under DCP turns partial hits off for K3 (MLA 256 + Mamba 256, DCP 2)",
        lambda budget: geometry.check_partial_complete(partial_rule_strict_under_dcp, budget),
    ),
    Obligation(
        "CANARY-SLOT-OFF-BY-ONE-RANK",
        ("INV-DCP-OWNER-UNIQUE", "INV-SLOT-INDEX-BOUND"),
        "exhaustive",
        "a slot mapping shifted by one rank writes positions its rank does not own",
        lambda budget: placement.check_slot_mapping(slot_mapping_off_by_one_rank, budget),
    ),
)
