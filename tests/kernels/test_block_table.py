"""BlockTables: staged appends against a list-of-lists model, atomic rejection across groups,
widths from the geometry spec, and the seed bug (a Mamba row divided by DCP)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule  # noqa: E402

from kvproof.kernels.block_table import BlockTables, TableGroup  # noqa: E402
from kvproof.spec.geometry import max_num_blocks_per_req  # noqa: E402
from kvproof.spec.groups import CacheGroup, GroupKind  # noqa: E402
from kvproof.spec.layout import LayoutConfig, resolve_layout  # noqa: E402
from kvproof.spec.placement import PAD_SLOT  # noqa: E402
from kvproof.spec.arith import cdiv  # noqa: E402

WIDTHS = (3, 5, 1)
ROWS = 4


class BlockTablesMachine(RuleBasedStateMachine):
    """Drives BlockTables and a model (one Python list per row and group) side by side."""

    def __init__(self) -> None:
        super().__init__()
        groups = [TableGroup(w, 4, i == 0, f"g{i}") for i, w in enumerate(WIDTHS)]
        self.bt = BlockTables(groups, ROWS, dcp=2)
        self.model = [[[] for _ in range(ROWS)] for _ in WIDTHS]
        self.next_id = 1

    def _ids(self, lengths: list[int]) -> list[list[int]]:
        out = []
        for n in lengths:
            out.append(list(range(self.next_id, self.next_id + n)))
            self.next_id += n
        return out

    @rule(row=st.integers(0, ROWS - 1), lengths=st.lists(st.integers(0, 6), min_size=3, max_size=3),
          overwrite=st.booleans())
    def append(self, row: int, lengths: list[int], overwrite: bool) -> None:
        ids = self._ids(lengths)
        counts_before = self.bt.num_blocks(row)
        fits = all((0 if overwrite else len(self.model[g][row])) + len(ids[g]) <= w for g, w in enumerate(WIDTHS))
        assert self.bt.can_append(row, ids, overwrite) == fits
        if not fits:
            with pytest.raises(RuntimeError, match=rf"block table write for request {row}, group \d+ "
                                                   r"exceeds row capacity \(\d+ > \d+\)"):
                self.bt.append_block_ids(row, ids, overwrite)
            # INV-TABLE-APPEND-ATOMIC: no group's count changed.
            assert self.bt.num_blocks(row) == counts_before
            return
        self.bt.append_block_ids(row, ids, overwrite)
        for g in range(len(WIDTHS)):
            self.model[g][row] = (list(ids[g]) if overwrite else self.model[g][row] + ids[g])

    @rule(row=st.integers(0, ROWS - 1))
    def clear(self, row: int) -> None:
        self.bt.clear_request(row)
        for g in range(len(WIDTHS)):
            self.model[g][row] = []

    @rule()
    def apply(self) -> None:
        self.bt.apply_staged_writes()
        for g in range(len(WIDTHS)):
            for r in range(ROWS):
                assert self.bt.row(g, r) == self.model[g][r]
        # The gather sees the same rows (device counts were published); batch row 0 is a dummy.
        views = self.bt.gather([PAD_SLOT] + list(range(1, ROWS)))
        for g, w in enumerate(WIDTHS):
            assert views[g][0].tolist() == [0] * w
            for r in range(1, ROWS):
                n = len(self.model[g][r])
                assert views[g][r, :n].tolist() == self.model[g][r]

    @invariant()
    def counts_match(self) -> None:
        self.bt._check()
        for r in range(ROWS):
            assert self.bt.num_blocks(r) == tuple(len(self.model[g][r]) for g in range(len(WIDTHS)))


TestBlockTablesMachine = BlockTablesMachine.TestCase
TestBlockTablesMachine.settings = settings(max_examples=15, stateful_step_count=15)


def test_overflow_message_names_request_group_and_numbers() -> None:
    bt = BlockTables([TableGroup(4, 16, True, "fa:16"), TableGroup(8, 16, False, "mamba:16")], 2)
    bt.append_block_ids(1, [[1, 2], [3]], overwrite=True)
    with pytest.raises(RuntimeError, match=r"^INV-TABLE-WRITE-BOUND: block table write for request 1, group 0 "
                                           r"exceeds row capacity \(5 > 4\)"):
        bt.append_block_ids(1, [[4, 5, 6], [7]], overwrite=False)


def test_rejection_is_atomic_across_groups() -> None:
    # vLLM 0.33 (docs/vllm-semantics.md §10.6) staged group 0 and advanced its count before group 1
    # overflowed.
    bt = BlockTables([TableGroup(4, 16, True), TableGroup(2, 16, False)], 1)
    bt.append_block_ids(0, [[1], [2]], overwrite=True)
    bt.apply_staged_writes()
    with pytest.raises(RuntimeError, match=r"request 0, group 1 exceeds row capacity \(3 > 2\)"):
        bt.append_block_ids(0, [[3], [4, 5]], overwrite=False)
    assert bt.num_blocks(0) == (1, 1)
    bt.apply_staged_writes()
    assert bt.row(0, 0) == [1] and bt.row(1, 0) == [2]
    assert bt.tables.group(0)[0].tolist() == [1, 0, 0, 0]


def test_overwrite_replaces_a_pending_append() -> None:
    bt = BlockTables([TableGroup(4, 16, True)], 1)
    bt.append_block_ids(0, [[1, 2, 3]], overwrite=True)
    bt.append_block_ids(0, [[4]], overwrite=False)
    bt.append_block_ids(0, [[9]], overwrite=True)  # the row was reassigned within the step
    bt.apply_staged_writes()
    assert bt.row(0, 0) == [9]


def test_bad_arguments_name_the_value() -> None:
    bt = BlockTables([TableGroup(4, 16, True)], 2)
    with pytest.raises(ValueError, match="request row 2 is out of range"):
        bt.append_block_ids(2, [[1]], overwrite=True)
    with pytest.raises(ValueError, match="block ids for 2 groups; expected 1"):
        bt.append_block_ids(0, [[1], [2]], overwrite=True)
    with pytest.raises(ValueError, match=r"idx_mapping\[1\] = 5"):
        bt.gather([0, 5])


def test_widths_come_from_the_geometry_spec() -> None:
    layout = resolve_layout(LayoutConfig(
        groups=(CacheGroup(GroupKind.FULL_ATTENTION, 16), CacheGroup(GroupKind.MAMBA, 64, num_speculative_blocks=3)),
        dcp=8, max_model_len=262_144,
    ))
    bt = BlockTables.from_layout(layout, 1)
    # docs/vllm-semantics.md §6.3: FA bs 16 under DCP 8 -> cdiv(262144, 128) = 2048 (already a
    # multiple of the entry alignment); Mamba bs 64 align, 3 speculative -> 4096 + 3, never divided
    # by DCP.
    assert bt.widths == (2048, 4099)
    for gl, w in zip(layout.groups, bt.widths):
        assert w >= max_num_blocks_per_req(gl.group, 8, 262_144)  # INV-TABLE-WIDTH


# ---------------------------------------------------------------------------------------------
# The seed bug: a replicated Mamba row sized as if DCP sharded it
# ---------------------------------------------------------------------------------------------

MAX_LEN = 1 << 20  # 1,048,576 tokens
DCP = 8
MAMBA_BS = 16


def _hybrid_layout():
    return resolve_layout(LayoutConfig(
        groups=(CacheGroup(GroupKind.FULL_ATTENTION, 1536), CacheGroup(GroupKind.MAMBA, MAMBA_BS)),
        dcp=DCP, max_model_len=MAX_LEN,
    ))


def _one_million_token_blocks(layout):
    fa = list(range(1, 1 + cdiv(MAX_LEN, 1536 * DCP)))
    mamba = list(range(100_000, 100_000 + cdiv(MAX_LEN, MAMBA_BS)))
    assert (len(fa), len(mamba)) == (86, 65_536)
    return [fa, mamba]


def test_seed_bug_old_width_rejects_before_any_write() -> None:
    layout = _hybrid_layout()
    old_width = cdiv(MAX_LEN, MAMBA_BS * DCP)  # the seed's rule: divided by DCP
    assert old_width == 8192
    fa = layout.groups[0]
    bt = BlockTables([TableGroup(fa.table_width, 1536, True, "full_attention:1536"),
                      TableGroup(old_width, MAMBA_BS, False, "mamba:16")], 2, dcp=DCP)
    with pytest.raises(RuntimeError, match=r"block table write for request 1, group 1 exceeds row capacity "
                                           r"\(65536 > 8192\)"):
        bt.append_block_ids(1, _one_million_token_blocks(layout), overwrite=True)
    bt.apply_staged_writes()
    assert bt.num_blocks(1) == (0, 0)
    assert int(bt.tables.storage.abs().sum()) == 0, "nothing was written to any row"


def test_seed_bug_correct_width_maps_the_last_position() -> None:
    layout = _hybrid_layout()
    assert [g.table_width for g in layout.groups] == [86, 65_536]
    fa, mamba = _one_million_token_blocks(layout)
    last = MAX_LEN - 1  # position 1,048,575
    for rank in (0, DCP - 1):
        bt = BlockTables.from_layout(layout, 2, dcp_rank=rank)
        bt.append_block_ids(1, [fa, mamba], overwrite=True)
        bt.apply_staged_writes()
        assert bt.row(1, 1) == mamba
        slots = bt.compute_slot_mappings([1], [0, 1], [last])
        # Mamba is replicated: every rank reads table index 1,048,575 // 16 = 65,535.
        assert last // MAMBA_BS == 65_535
        assert slots[1].tolist() == [mamba[65_535] * MAMBA_BS + last % MAMBA_BS]
        # Full attention: virtual block 85, offset 4,095 -> owner rank 7, local 131,071.
        expected_fa = fa[85] * 1536 + 131_071 % 1536 if rank == 7 else PAD_SLOT
        assert slots[0].tolist() == [expected_fa]


def test_seed_bug_slot_mapping_never_reads_past_the_old_row() -> None:
    # Had the 65,536 blocks got in some other way, the old 8,192-entry row would still not be
    # read past: the slot mapping of position 1,048,575 raises instead.
    bt = BlockTables([TableGroup(8192, MAMBA_BS, False, "mamba:16")], 1, dcp=DCP)
    bt.append_block_ids(0, [list(range(8192))], overwrite=True)
    bt.apply_staged_writes()
    with pytest.raises(IndexError, match=r"request 0 \(batch row 0\), group 0 \(mamba:16\) reads block-table "
                                         r"index 65535 but the row holds 8192 entries"):
        bt.compute_slot_mappings([0], [0, 1], [MAX_LEN - 1])


def test_mamba_mode_none_maps_every_position_to_its_one_state_block() -> None:
    from kvproof.spec.groups import MambaCacheMode

    groups = (CacheGroup(GroupKind.FULL_ATTENTION, 16), CacheGroup(GroupKind.MAMBA, 16, mamba_cache_mode=MambaCacheMode.NONE))
    layout = resolve_layout(LayoutConfig(groups, dcp=2, max_model_len=4096))
    assert [g.table_width for g in layout.groups] == [128, 1]
    bt = BlockTables.from_layout(layout, 1, dcp_rank=0)
    bt.append_block_ids(0, [[3, 4], [9]], overwrite=True)
    bt.apply_staged_writes()
    slots = bt.compute_slot_mappings([0], [0, 2], [0, 33])
    assert slots[1].tolist() == [9 * 4096, 9 * 4096 + 33]  # entry 0, never index 33 // 16
