"""Apply-writes kernel: exact equality with the torch reference, and the in-kernel row bound
(the second line of defence behind BlockTables' host check)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvproof.kernels import host  # noqa: E402
from kvproof.kernels.apply_writes import StagedWrites  # noqa: E402
from kvproof.kernels.packed_tables import PackedTables  # noqa: E402


@st.composite
def write_batches(draw, max_groups: int = 4, max_rows: int = 12, allow_overflow: bool = False):
    """Random widths, random initial table contents and disjoint writes (at most one per row
    and group, as BlockTables stages them); with ``allow_overflow`` some end past their row."""
    widths = draw(st.lists(st.integers(1, 40), min_size=1, max_size=max_groups))
    rows = draw(st.integers(1, max_rows))
    seed = draw(st.integers(0, 2**32 - 1))
    writes = []
    for g, w in enumerate(widths):
        for r in draw(st.lists(st.integers(0, rows - 1), unique=True, max_size=rows)):
            start = draw(st.integers(0, w))
            limit = w + 5 if allow_overflow else w
            n = draw(st.integers(0, max(limit - start, 0)))
            writes.append((g, r, start, list(range(1000 * g + 10 * r, 1000 * g + 10 * r + n))))
    return widths, rows, seed, writes


def _tables(widths, rows, seed) -> PackedTables:
    t = PackedTables.zeros(widths, rows)
    t.storage.copy_(torch.randint(0, 1 << 30, t.storage.shape, generator=torch.Generator().manual_seed(seed)))
    return t


@settings(max_examples=30)
@given(batch=write_batches(allow_overflow=True))
def test_kernel_matches_reference(batch) -> None:
    widths, rows, seed, writes = batch
    staged = StagedWrites.from_lists(writes)
    kernel_t, ref_t = _tables(widths, rows, seed), _tables(widths, rows, seed)
    clipped_k = host.apply_writes(kernel_t, staged, backend="triton", check=False)
    clipped_r = host.apply_writes(ref_t, staged, backend="torch", check=False)
    assert torch.equal(kernel_t.storage, ref_t.storage)
    assert torch.equal(clipped_k, clipped_r)


@settings(max_examples=20)
@given(batch=write_batches())
def test_in_bound_writes_land_exactly(batch) -> None:
    widths, rows, seed, writes = batch
    t = _tables(widths, rows, seed)
    before = [t.group(g).clone() for g in range(len(widths))]
    assert not host.apply_writes(t, StagedWrites.from_lists(writes), backend="triton").any()
    for g, r, start, ids in writes:
        before[g][r, start : start + len(ids)] = torch.tensor(ids, dtype=torch.int32)
    for g in range(len(widths)):
        assert torch.equal(t.group(g), before[g])


def test_large_write_spans_many_loop_iterations() -> None:
    t = PackedTables.zeros([5000, 3], 2)
    ids = list(range(7, 7 + 4999))
    host.apply_writes(t, StagedWrites.from_lists([(0, 1, 1, ids), (1, 0, 0, [1, 2, 3])]), backend="triton")
    assert t.group(0)[1].tolist() == [0] + ids
    assert t.group(0)[0].sum() == 0 and t.group(1)[0].tolist() == [1, 2, 3]


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_overflowing_write_is_cut_at_the_row_end(backend: str) -> None:
    # INV-TABLE-WRITE-BOUND, second line: a write that got past the host check (here, staged
    # by hand) must not reach the next request's row.
    t = PackedTables.zeros([4, 2], 3)
    writes = StagedWrites.from_lists([(0, 1, 2, [5, 6, 7]), (1, 0, 0, [9])])
    with pytest.raises(RuntimeError, match=r"INV-TABLE-WRITE-BOUND: block table write for request 1, group 0 "
                                           r"exceeds row capacity \(5 > 4\)"):
        host.apply_writes(t, writes, backend=backend)
    assert t.group(0).tolist() == [[0, 0, 0, 0], [0, 0, 5, 6], [0, 0, 0, 0]]
    assert t.group(1).tolist() == [[9, 0], [0, 0], [0, 0]]


def test_no_writes_launches_nothing() -> None:
    t = PackedTables.zeros([4], 1)
    assert host.apply_writes(t, StagedWrites.from_lists([]), backend="triton").numel() == 0


@pytest.mark.gpu
def test_native_kernel_matches_reference(cuda_device) -> None:
    widths, rows = [129, 1025, 7], 512
    gen = torch.Generator().manual_seed(0)
    writes = []
    for g, w in enumerate(widths):
        for r in range(rows):
            start = int(torch.randint(0, w, (1,), generator=gen))
            n = int(torch.randint(0, w - start + 3, (1,), generator=gen))
            writes.append((g, r, start, torch.randint(0, 1 << 20, (n,), generator=gen).tolist()))
    ref = _tables(widths, rows, 1)
    gpu = PackedTables.zeros(widths, rows, cuda_device)
    gpu.storage.copy_(ref.storage)
    clipped_r = host.apply_writes(ref, StagedWrites.from_lists(writes), backend="torch", check=False)
    clipped_k = host.apply_writes(gpu, StagedWrites.from_lists(writes, cuda_device), backend="triton", check=False)
    assert torch.equal(gpu.storage.cpu(), ref.storage)
    assert torch.equal(clipped_k.cpu(), clipped_r)
