"""Host API: backend choice, the torch fallback without Triton, interpreted twins of compiled
kernels, and BlockTables giving the same answers on either backend."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kvproof.kernels import host  # noqa: E402
from kvproof.kernels.block_table import BlockTables, TableGroup  # noqa: E402
from kvproof.spec.placement import PAD_SLOT  # noqa: E402


def _run_python(code: str, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", host.BACKEND_ENV)}
    environ.update(env)
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=environ, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_auto_uses_triton_on_cpu_under_the_interpreter() -> None:
    assert host.resolve_backend("cpu") == "triton"


def test_backend_names_are_checked(monkeypatch) -> None:
    with pytest.raises(ValueError, match="kernel backend 'cuda' is unknown; expected one of auto, triton, torch"):
        host.resolve_backend("cpu", "cuda")
    monkeypatch.setenv(host.BACKEND_ENV, "torch")
    assert host.resolve_backend("cpu") == "torch"


def _exercise(bt: BlockTables):
    bt.append_block_ids(0, [[1, 2, 3], [7]], overwrite=True)
    bt.append_block_ids(2, [[4], [8, 9]], overwrite=True)
    bt.apply_staged_writes()
    bt.append_block_ids(0, [[5], []], overwrite=False)
    bt.apply_staged_writes()
    views = bt.gather([2, PAD_SLOT, 0], num_padded_rows=4)
    slots = bt.compute_slot_mappings([0, 2], [0, 5, 7], [0, 1, 2, 3, 19, 0, 17], num_padded_tokens=9)
    return bt.tables.storage.clone(), [v.clone() for v in views], slots


def test_block_tables_agree_across_backends() -> None:
    groups = [TableGroup(6, 4, True, "fa:4"), TableGroup(5, 4, False, "mamba:4")]
    a = _exercise(BlockTables(groups, 4, dcp=2, dcp_rank=1, interleave=2, backend="triton"))
    b = _exercise(BlockTables(groups, 4, dcp=2, dcp_rank=1, interleave=2, backend="torch"))
    assert torch.equal(a[0], b[0])
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
    assert torch.equal(a[2], b[2])


def test_falls_back_to_torch_without_triton() -> None:
    out = _run_python("""
        import sys
        sys.modules["triton"] = None  # as if Triton were not installed
        from kvproof.kernels import host
        from kvproof.kernels.block_table import BlockTables, TableGroup
        assert not host.triton_runs_on("cpu")
        bt = BlockTables([TableGroup(4, 2, False, "mamba:2")], 1)
        assert bt.backend == "torch"
        bt.append_block_ids(0, [[3, 4]], overwrite=True)
        bt.apply_staged_writes()
        print(bt.compute_slot_mappings([0], [0, 3], [0, 1, 2]).tolist())
        try:
            host.resolve_backend("cpu", "triton")
        except ValueError as e:
            print(e)
    """)
    assert out.splitlines() == [
        "[[6, 7, 8]]",
        "kernel backend 'triton' cannot run on device cpu: Triton is not installed",
    ]


def test_interpreted_twin_when_triton_was_imported_first() -> None:
    # Triton imported (kernels compiled) before TRITON_INTERPRET is set: CPU tensors still
    # reach the kernels, through interpreted twins, once the variable is set.
    out = _run_python("""
        import os
        from kvproof.kernels import host
        from kvproof.kernels.block_table import BlockTables, TableGroup
        print(host.resolve_backend("cpu"))
        os.environ["TRITON_INTERPRET"] = "1"
        bt = BlockTables([TableGroup(3, 4, True, "fa:4")], 1, dcp=2)
        assert bt.backend == "triton"
        bt.append_block_ids(0, [[5, 9, 2]], overwrite=True)
        bt.apply_staged_writes()
        print(bt.compute_slot_mappings([0], [0, 3], [0, 1, 2]).tolist())
    """)
    assert out.splitlines() == ["torch", "[[20, -1, 21]]"]


@pytest.mark.gpu
def test_native_block_tables_match_cpu_reference(cuda_device) -> None:
    groups = [TableGroup(6, 4, True, "fa:4"), TableGroup(5, 4, False, "mamba:4")]
    a = _exercise(BlockTables(groups, 4, dcp=2, dcp_rank=1, interleave=2, device=cuda_device))
    b = _exercise(BlockTables(groups, 4, dcp=2, dcp_rank=1, interleave=2, backend="torch"))
    assert torch.equal(a[0].cpu(), b[0])
    assert all(torch.equal(x.cpu(), y) for x, y in zip(a[1], b[1]))
    assert torch.equal(a[2].cpu(), b[2])
