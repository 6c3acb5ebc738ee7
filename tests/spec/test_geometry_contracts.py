"""Every geometry and placement contract can fire: a deliberately wrong formula guarded by
the real function's contracts (``guard_like``), or a corrupted helper, is rejected with the
invariant id in the message."""

from __future__ import annotations

import icontract
import pytest

from kvproof.spec import arith, geometry, layout, placement
from kvproof.spec.contracts import guard_like
from kvproof.spec.groups import CacheGroup, GroupKind

FA = CacheGroup(GroupKind.FULL_ATTENTION, 16)
MAMBA = CacheGroup(GroupKind.MAMBA, 16)


def fires(inv_id: str):
    return pytest.raises(icontract.ViolationError, match=inv_id)


def test_old_width_rule_is_rejected_by_inv_table_width():
    """The upstream bug: Mamba width divided by DCP (8,192 rows for a 1M context at DCP 8)."""
    def old_rule(group, dcp, max_len):
        return arith.cdiv(max_len, group.block_size * dcp)

    wrong = guard_like(geometry.max_num_blocks_per_req, old_rule)
    assert wrong(FA, 8, 1_048_576) == 8_192  # attention is fine under the old rule
    with fires("INV-TABLE-WIDTH"):
        wrong(MAMBA, 8, 1_048_576)


def test_speculative_blocks_forgotten_is_rejected():
    wrong = guard_like(geometry.max_num_blocks_per_req, lambda group, dcp, max_len: arith.cdiv(max_len, group.block_size))
    with fires("INV-TABLE-WIDTH"):
        wrong(CacheGroup(GroupKind.MAMBA, 16, num_speculative_blocks=2), 1, 64)


def test_padding_that_shrinks_a_row_is_rejected(monkeypatch):
    monkeypatch.setattr(layout, "block_table_width", lambda n, bs, a: max(n - 1, 0))
    with fires("INV-TABLE-WIDTH"):
        layout.resolve_layout(layout.LayoutConfig((FA, MAMBA), dcp=2, max_model_len=1024))


def test_table_pad_contract():
    wrong = guard_like(geometry.block_table_width, lambda num_blocks, block_size, token_alignment: num_blocks + 200)
    with fires("INV-TABLE-PAD"):
        wrong(9, 16, 128)
    with pytest.raises(ValueError, match="token_alignment -1"):
        geometry.block_table_width(0, 1, -1)


def test_cdiv_and_floor_contracts():
    with fires("INV-ARITH-CDIV"):
        guard_like(arith.cdiv, lambda a, b: a // b)(7, 2)
    with fires("INV-ARITH-FLOOR"):
        guard_like(arith.floor_to, lambda x, a: x - x % a + a)(7, 2)


def test_effective_block_contracts():
    with fires("INV-GEOM-EFFECTIVE-BLOCK"):
        guard_like(geometry.effective_block_size, lambda group, dcp: group.block_size)(FA, 4)
    # A Mamba group wrongly marked sharded is refused: its state is replicated.
    with pytest.raises(ValueError, match="INV-GEOM-MAMBA-REPLICATED: mamba:16 is marked DCP-sharded"):
        geometry.effective_block_size(CacheGroup(GroupKind.MAMBA, 16, dcp_sharded=True), 4)


def test_scheduler_block_contract(monkeypatch):
    monkeypatch.setattr(geometry, "lcm_all", lambda values: max(values))
    with fires("INV-GEOM-SCHED-LCM"):
        geometry.scheduler_block_size((CacheGroup(GroupKind.FULL_ATTENTION, 6), CacheGroup(GroupKind.MAMBA, 4)), 1)


def test_hash_divides_contract(monkeypatch):
    monkeypatch.setattr(geometry, "gcd_all", lambda values: max(values))
    with fires("INV-GEOM-HASH-DIVIDES"):
        geometry.hash_block_size((CacheGroup(GroupKind.FULL_ATTENTION, 6), CacheGroup(GroupKind.MAMBA, 4)), 1)


def test_partial_rule_with_strict_inequality_under_dcp_is_the_old_bug_not_a_contract_breach():
    """The old rule (strict '>' also under DCP) is *more* conservative, so it never breaks
    INV-GEOM-PARTIAL-RULE; it loses the K3 hit instead (tests/impl and proofs canary show
    that). Enabling partial hits where the rule forbids them does fire."""
    groups = (CacheGroup(GroupKind.FULL_ATTENTION, 256), CacheGroup(GroupKind.MAMBA, 256))
    always_on = guard_like(
        geometry.partial_hash_hits,
        lambda groups, dcp, hash_block_size, allow=True: geometry.PartialHitDecision(True, "always"),
    )
    with fires("INV-GEOM-PARTIAL-RULE"):
        always_on(groups, 1, 256)  # TP with Mamba block == H: must stay block-aligned
    swa = groups + (CacheGroup(GroupKind.SLIDING_WINDOW, 512, dcp_sharded=False, sliding_window=1024),)
    with fires("INV-GEOM-PARTIAL-RULE"):
        always_on(swa, 2, 256)  # a coarse-lookup group with block != H forces the fallback
    with fires("INV-GEOM-PARTIAL-RULE"):
        always_on((CacheGroup(GroupKind.MLA, 256),), 8, 2048)  # one attention group hashed at its block: nothing inside
    with fires("INV-GEOM-PARTIAL-RULE"):
        always_on((CacheGroup(GroupKind.MLA, 16), CacheGroup(GroupKind.FULL_ATTENTION, 32)), 1, 16)  # not a lone group


def test_partial_grid_contract():
    groups = (CacheGroup(GroupKind.FULL_ATTENTION, 6), CacheGroup(GroupKind.MAMBA, 8))
    with fires("INV-GEOM-PARTIAL-GRID"):
        # hash size 4 does not divide the 6-token attention block
        geometry.partial_hash_hits(groups, 1, 4)


def test_hit_alignment_contract():
    with fires("INV-GEOM-HIT-ALIGN"):
        guard_like(geometry.cache_hit_alignment, lambda scheduler_size, hash_block_size, partial: hash_block_size * 3)(512, 256, True)


def test_placement_contracts(monkeypatch):
    with fires("INV-DCP-OWNER-RANGE"):
        guard_like(placement.owner_rank, lambda position, dcp, interleave: position // interleave)(9, 2, 1)
    with fires("INV-DCP-LOCAL-IN-BLOCK"):
        guard_like(placement.local_position, lambda position, block_size, dcp, interleave: position)(17, 4, 2, 1)
    with fires("INV-DCP-LOCAL-LEN-BOUND"):
        guard_like(placement.local_seq_len, lambda num_tokens, rank, dcp, interleave: num_tokens)(13, 0, 8, 1)
    with fires("INV-SLOT-TABLE-INDEX"):
        guard_like(placement.table_index, lambda position, block_size, dcp, sharded: position // block_size)(40, 4, 2, True)


def test_local_len_sum_and_balance_contracts(monkeypatch):
    monkeypatch.setattr(placement, "local_seq_len", lambda n, r, d, i: n // d)
    with fires("INV-DCP-LOCAL-LEN-SUM"):
        placement.local_seq_lens(13, 8, 1)
    monkeypatch.setattr(placement, "local_seq_len", lambda n, r, d, i: [5, 1][r])
    with fires("INV-DCP-LOCAL-LEN-BALANCE"):
        placement.local_seq_lens(6, 2, 1)


def test_slot_mapping_distinct_and_owner_unique(monkeypatch):
    real = placement.slot_for_position
    monkeypatch.setattr(placement, "slot_for_position", lambda p, row, bs, d, i, r, sh: row[0] * bs)
    with fires("INV-DCP-SLOT-DISTINCT"):
        placement.slot_mapping((0, 1, 2, 3), (5,), 4, 1, 1, 0, False)
    with fires("INV-DCP-OWNER-UNIQUE"):
        placement.owning_ranks(3, 4, 2, 1, True)  # every rank claims a sharded position
    monkeypatch.setattr(placement, "slot_for_position", real)
    assert placement.owning_ranks(3, 4, 2, 1, True) == (1,)


def test_slot_mapping_never_reads_past_the_row():
    with pytest.raises(IndexError, match="INV-SLOT-INDEX-BOUND: position 16 reads block-table index 4 but the row holds 4"):
        placement.slot_for_position(16, (1, 2, 3, 4), 4, 1, 1, 0, sharded=False)
