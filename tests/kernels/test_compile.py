"""The kernels compile for NVIDIA GPUs (Triton frontend -> PTX -> cubin with the ptxas that
ships with Triton), even on a machine without one: compiled mode type-checks and specializes
things the interpreter lets through (scalar/vector mixes, int64 atomics, constexpr ints)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
triton = pytest.importorskip("triton")

from kvproof.kernels.apply_writes import apply_writes_kernel  # noqa: E402
from kvproof.kernels.gather_block_tables import gather_block_tables_kernel  # noqa: E402
from kvproof.kernels.slot_mapping import slot_mapping_kernel  # noqa: E402
from kvproof.spec.placement import PAD_SLOT  # noqa: E402

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    import triton.backends.nvidia  # noqa: F401
except ImportError:  # pragma: no cover - a Triton build without the NVIDIA backend
    pytest.skip("this Triton has no NVIDIA backend to compile for", allow_module_level=True)

pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")

POINTERS = {
    "apply_writes_kernel": {
        "table_ptr": "*i32", "group_offset_ptr": "*i64", "group_width_ptr": "*i32", "write_group_ptr": "*i32",
        "write_row_ptr": "*i32", "write_start_ptr": "*i32", "write_len_ptr": "*i32", "write_src_ptr": "*i32",
        "contents_ptr": "*i32", "clipped_ptr": "*i32",
    },
    "gather_block_tables_kernel": {
        "table_ptr": "*i32", "group_offset_ptr": "*i64", "group_width_ptr": "*i32", "num_blocks_ptr": "*i32",
        "idx_mapping_ptr": "*i32", "out_ptr": "*i32", "out_offset_ptr": "*i64",
    },
    "slot_mapping_kernel": {
        "table_ptr": "*i32", "group_offset_ptr": "*i64", "group_width_ptr": "*i32", "group_block_size_ptr": "*i32",
        "group_sharded_ptr": "*i32", "idx_mapping_ptr": "*i32", "query_start_ptr": "*i32", "positions_ptr": "*i64",
        "out_ptr": "*i64", "worst_index_ptr": "*i64",
    },
}


def _compile(kernel, constexprs: dict, arch: int) -> str:
    # Build a compiled-mode JITFunction from the raw function, whatever TRITON_INTERPRET says.
    fn = JITFunction(kernel.fn)
    types = POINTERS[fn.__name__]
    signature = {name: ("constexpr" if name in constexprs else types.get(name, "i32")) for name in fn.arg_names}
    compiled = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", arch, 32))
    return compiled.asm["ptx"]


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize(
    ("kernel", "constexprs"),
    [
        (apply_writes_kernel, {"BLOCK": 1024}),
        (gather_block_tables_kernel, {"PAD": PAD_SLOT, "BLOCK": 1024}),
        # Triton turns integer arguments equal to 1 into constants: the DCP-1 / one-row case.
        (gather_block_tables_kernel, {"PAD": PAD_SLOT, "BLOCK": 1024, "num_blocks_stride": 1, "num_rows": 1}),
        (slot_mapping_kernel, {"PAD": PAD_SLOT, "BLOCK": 256}),
        (slot_mapping_kernel, {"PAD": PAD_SLOT, "BLOCK": 256, "dcp": 1, "interleave": 1, "num_rows": 1}),
    ],
    ids=["apply", "gather", "gather-ones", "slots", "slots-dcp1"],
)
def test_kernel_compiles_to_ptx(kernel, constexprs: dict, arch: int, monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # compile as on a GPU machine
    assert ".entry" in _compile(kernel, constexprs, arch)
