"""Gather kernel: exact equality with the torch reference, and what the forward pass sees
(real rows' used entries, zeroed dummy and padding rows, untouched tails)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvproof.kernels import host  # noqa: E402
from kvproof.kernels.packed_tables import PackedTables  # noqa: E402
from kvproof.spec.placement import PAD_SLOT  # noqa: E402


@st.composite
def gathers(draw, max_rows: int = 64):
    widths = draw(st.lists(st.integers(1, 33), min_size=1, max_size=4))
    state_rows = draw(st.integers(1, 12))
    num_rows = draw(st.integers(0, max_rows))
    padded = num_rows + draw(st.integers(0, 4))
    idx = draw(st.lists(st.one_of(st.just(PAD_SLOT), st.integers(0, state_rows - 1)),
                        min_size=num_rows, max_size=num_rows))
    # Counts up to width + 2: a corrupt count must still never copy past the row.
    counts = [draw(st.lists(st.integers(0, w + 2), min_size=state_rows, max_size=state_rows)) for w in widths]
    return widths, state_rows, idx, padded, counts, draw(st.integers(0, 2**32 - 1))


def _setup(widths, state_rows, padded, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    tables = PackedTables.zeros(widths, state_rows)
    tables.storage.copy_(torch.randint(1, 1 << 30, tables.storage.shape, generator=gen))
    out = tables.like(rows=max(padded, 1))
    out.storage.copy_(torch.randint(1, 1 << 30, out.storage.shape, generator=gen))  # stale garbage
    if device != "cpu":
        tables = PackedTables(tables.storage.to(device), tables.offsets.to(device), tables.widths.to(device),
                              tables.widths_host, tables.rows)
        out = PackedTables(out.storage.to(device), out.offsets.to(device), out.widths.to(device),
                           out.widths_host, out.rows)
    return tables, out


def _run(widths, state_rows, idx, padded, counts, seed, backend, device="cpu"):
    tables, out = _setup(widths, state_rows, padded, seed, device)
    before = out.storage.clone()
    views = host.gather_block_tables(
        tables, torch.tensor(counts, dtype=torch.int32, device=device),
        torch.tensor(idx, dtype=torch.int32, device=device), padded, out, backend=backend,
    )
    return tables, out, before, views


@settings(max_examples=25)
@given(case=gathers())
def test_kernel_matches_reference(case) -> None:
    _, kernel_out, _, _ = _run(*case, backend="triton")
    _, ref_out, _, _ = _run(*case, backend="torch")
    assert torch.equal(kernel_out.storage, ref_out.storage)


@settings(max_examples=15)
@given(case=gathers(max_rows=16))
def test_forward_layout(case) -> None:
    widths, _, idx, padded, counts, _ = case
    tables, out, before, views = _run(*case, backend="triton")
    for g, w in enumerate(widths):
        old = before[int(out.offsets[g]) :][: out.rows * w].view(out.rows, w)
        assert views[g].shape == (padded, w)
        for b in range(padded):
            req = idx[b] if b < len(idx) else PAD_SLOT
            if req == PAD_SLOT:  # dummy and padding rows read the null block everywhere
                assert views[g][b].tolist() == [0] * w
                continue
            n = min(counts[g][req], w)
            assert torch.equal(views[g][b, :n], tables.group(g)[req, :n])
            assert torch.equal(views[g][b, n:], old[b, n:]), "entries past the count are left alone"
        assert torch.equal(out.group(g)[padded:], old[padded:]), "rows past the padded batch are untouched"


def test_rejects_too_few_padded_rows() -> None:
    tables, out = _setup([4], 2, 2, 0)
    with pytest.raises(ValueError, match="num_padded_rows 1 must lie in"):
        host.gather_block_tables(tables, torch.zeros((1, 2), dtype=torch.int32),
                                 torch.tensor([0, 1], dtype=torch.int32), 1, out)


@pytest.mark.gpu
def test_native_kernel_matches_reference(cuda_device) -> None:
    gen = torch.Generator().manual_seed(0)
    widths, state_rows, num_rows = [129, 2049, 7], 4096, 4000
    idx = torch.where(torch.rand(num_rows, generator=gen) < 0.1, PAD_SLOT,
                      torch.randperm(state_rows, generator=gen)[:num_rows]).tolist()
    counts = [torch.randint(0, w + 1, (state_rows,), generator=gen).tolist() for w in widths]
    case = (widths, state_rows, idx, 4096, counts, 3)
    _, kernel_out, _, _ = _run(*case, backend="triton", device=cuda_device)
    _, ref_out, _, _ = _run(*case, backend="torch")
    assert torch.equal(kernel_out.storage.cpu(), ref_out.storage)
