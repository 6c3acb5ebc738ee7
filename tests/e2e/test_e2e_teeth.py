"""The e2e check has teeth: each deliberate worker bug (kvproof.e2e.faults) is caught, by a
logit mismatch or by the block tables refusing the write."""

from __future__ import annotations

import pytest

from kvproof.e2e import TOLERANCE, E2EOptions, Faults, run_e2e
from kvproof.e2e.ranks import RankError
from kvproof.e2e.workloads import hybrid_workload

from .conftest import layout_config

OPTIONS = E2EOptions(num_blocks=96, max_num_batched_tokens=48)


def test_slot_mapping_of_the_wrong_rank_is_caught():
    r = run_e2e(hybrid_workload(), layout_config(dcp=2), OPTIONS, faults=Faults(slot_mapping_rank_shift=1))
    assert r.max_abs_diff > 1e-3 > TOLERANCE


@pytest.mark.parametrize("dcp", [1, 2])
def test_copies_after_the_forward_pass_are_caught(dcp):
    # The workload's request c copies a block at step start that request a writes in the same
    # step; copied late, c reads a stale block and then loses its own writes to the copy.
    r = run_e2e(hybrid_workload(), layout_config(dcp=dcp), OPTIONS, faults=Faults(copies_after_forward=True))
    assert r.cow_copies > 0
    assert r.max_abs_diff > 1e-3 > TOLERANCE


def test_mamba_rows_divided_by_dcp_are_refused_before_any_write():
    # max_model_len 64, Mamba block 8: rows need 8 entries; vLLM 0.33's rule gives
    # cdiv(64, 8 * 2) = 4, so the first request past 32 tokens overflows its row.
    config = layout_config(dcp=2, max_model_len=64)
    assert run_e2e(hybrid_workload(), config, OPTIONS).max_abs_diff <= TOLERANCE  # the right width serves
    with pytest.raises(RankError) as caught:
        run_e2e(hybrid_workload(), config, OPTIONS, faults=Faults(mamba_width_divided_by_dcp=True))
    assert caught.value.kind == "RuntimeError"
    assert "INV-TABLE-WRITE-BOUND" in caught.value.message
    assert "group 1 exceeds row capacity (5 > 4) [mamba:8]; nothing was staged" in caught.value.message
