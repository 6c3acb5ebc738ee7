"""Slot-mapping kernel: exact equality with the torch reference (Triton interpreter on CPU,
natively with the ``gpu`` marker), agreement with the pure-Python spec
(kvproof.spec.placement.slot_for_position), and the per-rank DCP invariants."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvproof.kernels import host  # noqa: E402
from kvproof.kernels.packed_tables import PackedTables  # noqa: E402
from kvproof.spec.placement import PAD_SLOT, slot_for_position  # noqa: E402


@dataclasses.dataclass
class Case:
    """One rank-independent slot-mapping input: tables, batch and DCP settings."""

    tables: PackedTables
    block_sizes: list[int]
    sharded: list[bool]
    idx_mapping: list[int]
    query_start: list[int]
    positions: list[int]
    num_padded_tokens: int
    dcp: int
    interleave: int

    def run(self, rank: int, backend: str, device: str | torch.device = "cpu"):
        t = self.tables if torch.device(device) == self.tables.device else _to(self.tables, device)
        return host.compute_slot_mappings(
            t,
            torch.tensor(self.block_sizes, dtype=torch.int32, device=device),
            host.sharded_flags(self.sharded, self.dcp, device),
            torch.tensor(self.idx_mapping, dtype=torch.int32, device=device),
            torch.tensor(self.query_start, dtype=torch.int32, device=device),
            torch.tensor(self.positions, dtype=torch.int64, device=device),
            self.num_padded_tokens,
            dcp_rank=rank, dcp=self.dcp, interleave=self.interleave, backend=backend, check=False,
        )

    def tokens(self):
        """``(batch row, token index, position)`` of every token in the batch."""
        for b in range(len(self.idx_mapping)):
            for t in range(self.query_start[b], self.query_start[b + 1]):
                yield b, t, self.positions[t]


def _to(tables: PackedTables, device) -> PackedTables:
    return dataclasses.replace(
        tables, storage=tables.storage.to(device), offsets=tables.offsets.to(device), widths=tables.widths.to(device)
    )


def make_case(
    seed: int, *, dcp: int, interleave: int, groups: list[tuple[int, bool, int]], num_rows: int,
    max_query: int, dummy_rate: float = 0.15, overshoot: float = 1.1, extra_pad: int = 3,
) -> Case:
    """``groups``: ``(block_size, sharded, width)``. Block ids are distinct within a group, each
    request appears in at most one batch row, and positions run consecutively from a random
    start that usually (not always: ``overshoot``) stays inside every row."""
    gen = torch.Generator().manual_seed(seed)
    num_state_rows = num_rows + 2
    tables = PackedTables.zeros([w for _, _, w in groups], num_state_rows)
    for g, (_, _, w) in enumerate(groups):
        n = num_state_rows * w
        ids = torch.randperm(2 * n, generator=gen)[:n] + 1
        tables.group(g).copy_(ids.view(num_state_rows, w).to(torch.int32))
    rows = torch.randperm(num_state_rows, generator=gen)[:num_rows]
    dummy = torch.rand(num_rows, generator=gen) < dummy_rate
    idx_mapping = torch.where(dummy, PAD_SLOT, rows).tolist()
    capacity = min(w * bs * (dcp if sh else 1) for bs, sh, w in groups)
    query_start, positions = [0], []
    for _ in range(num_rows):
        n = int(torch.randint(0, max_query + 1, (1,), generator=gen))
        start = int(torch.randint(0, max(int(capacity * overshoot) - n, 1), (1,), generator=gen))
        positions.extend(range(start, start + n))
        query_start.append(query_start[-1] + n)
    return Case(
        tables, [bs for bs, _, _ in groups], [sh for _, sh, _ in groups], idx_mapping, query_start,
        positions, query_start[-1] + extra_pad, dcp, interleave,
    )


@st.composite
def cases(draw, max_rows: int, max_query: int = 4, max_groups: int = 4) -> Case:
    dcp = draw(st.integers(1, 8))
    interleave = draw(st.integers(1, 8))
    groups = []
    for _ in range(draw(st.integers(1, max_groups))):
        sharded = draw(st.booleans())
        # A sharded group's block size is a multiple of the interleave (validate_config);
        # a replicated one is free. Widths are small and often odd.
        bs = interleave * draw(st.integers(1, 3)) if sharded else draw(st.integers(1, 16))
        groups.append((bs, sharded, draw(st.integers(1, 9))))
    return make_case(
        draw(st.integers(0, 2**32 - 1)), dcp=dcp, interleave=interleave, groups=groups,
        # Half the batches are small, so that a run stays fast in the interpreter.
        num_rows=draw(st.one_of(st.integers(1, min(32, max_rows)), st.integers(1, max_rows))),
        max_query=max_query,
    )


def assert_same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert torch.equal(a[0].cpu(), b[0].cpu()), "slots differ"
    assert torch.equal(a[1].cpu(), b[1].cpu()), "out-of-row records differ"


# ---------------------------------------------------------------------------------------------
# Kernel == reference
# ---------------------------------------------------------------------------------------------


@settings(max_examples=8)
@given(case=cases(max_rows=512, max_query=2), data=st.data())
def test_kernel_matches_reference(case: Case, data) -> None:
    rank = data.draw(st.integers(0, case.dcp - 1), label="rank")
    assert_same(case.run(rank, "triton"), case.run(rank, "torch"))


def test_kernel_matches_reference_big_batch() -> None:
    # 512 decode rows plus prefill chunks, three groups (sharded FA and MLA, replicated
    # Mamba) under DCP 8 with interleave 4: the shape of a real hybrid batch.
    groups = [(16, True, 33), (64, True, 9), (16, False, 257)]
    case = make_case(7, dcp=8, interleave=4, groups=groups, num_rows=512, max_query=3, overshoot=1.02)
    assert_same(case.run(5, "triton"), case.run(5, "torch"))


def test_long_prefill_crosses_many_loop_iterations() -> None:
    # One row of 3,000 tokens: the kernel's token loop runs many BLOCK iterations.
    case = make_case(3, dcp=4, interleave=2, groups=[(8, True, 200), (16, False, 300)], num_rows=1,
                     max_query=0, extra_pad=5)
    case.positions = list(range(100, 3100))
    case.query_start = [0, 3000]
    case.num_padded_tokens = 3005
    assert_same(case.run(1, "triton"), case.run(1, "torch"))


# ---------------------------------------------------------------------------------------------
# Kernel == pure-Python spec, and the bound check
# ---------------------------------------------------------------------------------------------


@settings(max_examples=15)
@given(case=cases(max_rows=24, max_query=6), data=st.data())
def test_kernel_matches_spec(case: Case, data) -> None:
    rank = data.draw(st.integers(0, case.dcp - 1), label="rank")
    slots, worst = case.run(rank, "triton")
    for g, (bs, sharded) in enumerate(zip(case.block_sizes, case.sharded)):
        table = case.tables.group(g)
        expected_worst = [-1] * len(case.idx_mapping)
        for b, t, p in case.tokens():
            req = case.idx_mapping[b]
            if req == PAD_SLOT:
                assert slots[g, t] == PAD_SLOT
                continue
            row = tuple(table[req].tolist())
            try:
                expected = slot_for_position(p, row, bs, case.dcp, case.interleave, rank, sharded)
            except IndexError:  # INV-SLOT-INDEX-BOUND: the kernel pads and records the index
                expected = PAD_SLOT
                index = p // bs if not (sharded and case.dcp > 1) else (
                    (p // (bs * case.dcp)) * bs + (p % (bs * case.dcp)) // (case.interleave * case.dcp)
                    * case.interleave + p % case.interleave
                ) // bs
                expected_worst[b] = max(expected_worst[b], index)
            assert slots[g, t] == expected, (g, b, p)
        assert worst[g].tolist() == expected_worst
        assert (slots[g, case.query_start[-1]:] == PAD_SLOT).all(), "tokens past the batch are padding"


@pytest.mark.parametrize(
    ("interleave", "rank", "expected"),
    [
        (1, 0, [20, -1, 21, -1, 22, -1, 23, -1, 36, -1, 37, -1, 38, -1, 39, -1]),
        (1, 1, [-1, 20, -1, 21, -1, 22, -1, 23, -1, 36, -1, 37, -1, 38, -1, 39]),
        (2, 0, [20, 21, -1, -1, 22, 23, -1, -1, 36, 37, -1, -1, 38, 39, -1, -1]),
    ],
)
def test_reference_worked_examples(interleave: int, rank: int, expected: list[int]) -> None:
    # docs/vllm-semantics.md §7.2: table [5, 9, 2], block size 4, DCP 2, positions 0..15.
    tables = PackedTables.zeros([3], 1)
    tables.group(0)[0] = torch.tensor([5, 9, 2], dtype=torch.int32)
    case = Case(tables, [4], [True], [0], [0, 16], list(range(16)), 16, 2, interleave)
    for backend in ("triton", "torch"):
        slots, worst = case.run(rank, backend)
        assert slots[0].tolist() == expected
        assert worst.tolist() == [[-1]]


def test_out_of_row_read_raises_naming_request_group_index_width() -> None:
    # Block size 4, width 3: position 12 reads index 3 of a 3-entry row.
    tables = PackedTables.zeros([3, 8], 2)
    case = Case(tables, [4, 4], [False, False], [PAD_SLOT, 1], [0, 2, 4], [0, 99, 11, 12], 4, 1, 1)
    for backend in ("triton", "torch"):
        slots, worst = case.run(0, backend)
        assert worst.tolist() == [[-1, 3], [-1, -1]]  # the dummy row (batch row 0) reads nothing
        assert slots[0].tolist() == [-1, -1, 0 * 4 + 3, -1]
        with pytest.raises(IndexError, match=r"INV-SLOT-INDEX-BOUND: .*request 1 \(batch row 1\), group 0 "
                                             r"\(mamba:4\) reads block-table index 3 but the row holds 3 entries"):
            host.raise_if_out_of_row(worst, torch.tensor(case.idx_mapping), tables.widths_host, ["mamba:4", "fa"])


def test_persistent_error_buffer_stays_clean() -> None:
    # The kernel touches worst_index only on an error; after raising, the host refills it so
    # that the next step (with no error) reports none.
    tables = PackedTables.zeros([2], 1)
    worst = torch.full((1, 4), -1, dtype=torch.int64)
    args = (tables, torch.tensor([4], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
            torch.tensor([0], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32))
    for backend in ("triton", "torch"):
        with pytest.raises(IndexError, match="reads block-table index 2 but the row holds 2 entries"):
            host.compute_slot_mappings(*args, torch.tensor([8]), 1, backend=backend, worst_index=worst)
        assert (worst == -1).all()
        slots, _ = host.compute_slot_mappings(*args, torch.tensor([7]), 1, backend=backend, worst_index=worst)
        assert slots.tolist() == [[3]] and (worst == -1).all()


# ---------------------------------------------------------------------------------------------
# Per-rank invariants
# ---------------------------------------------------------------------------------------------


@settings(max_examples=10)
@given(case=cases(max_rows=16, max_query=6, max_groups=3))
def test_per_rank_invariants(case: Case) -> None:
    per_rank = [case.run(rank, "triton") for rank in range(case.dcp)]
    for g, sharded in enumerate(case.sharded):
        mapped = torch.stack([slots[g] for slots, _ in per_rank])  # [D, T_pad]
        kept = mapped != PAD_SLOT
        if sharded and case.dcp > 1:
            # INV-DCP-OWNER-UNIQUE: a sharded position is kept by at most one rank, and by
            # exactly one unless its row is a dummy or too short (then every rank pads it).
            assert (kept.sum(0) <= 1).all()
            for b, t, _ in case.tokens():
                out_of_row = any(int(w[g, b]) >= 0 for _, w in per_rank)
                if case.idx_mapping[b] != PAD_SLOT and not out_of_row:
                    assert kept[:, t].sum() == 1, (g, b, t)
        else:
            # Replicated groups (and DCP 1): every rank maps every position identically.
            assert (mapped == mapped[0]).all()
        for rank in range(case.dcp):
            # INV-DCP-SLOT-DISTINCT: one rank never maps two tokens to the same slot.
            s = mapped[rank][kept[rank]]
            assert s.unique().numel() == s.numel(), (g, rank)


# ---------------------------------------------------------------------------------------------
# Native GPU
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_native_kernel_matches_reference(cuda_device, seed: int) -> None:
    groups = [(16, True, 129), (64, True, 17), (16, False, 1025), (7, False, 5)]
    case = make_case(seed, dcp=8, interleave=2, groups=groups, num_rows=4096, max_query=3)
    for rank in (0, 7):
        assert_same(case.run(rank, "triton", cuda_device), case.run(rank, "torch"))
