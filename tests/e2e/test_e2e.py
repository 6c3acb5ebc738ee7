"""Served logits equal recomputation: kvproof's scheduler, block tables and slot mappings
driving a tiny hybrid model on 1, 2 and 4 real DCP ranks (docs/e2e.md)."""

from __future__ import annotations

import pytest

from kvproof.e2e import TOLERANCE, E2EOptions, run_e2e
from kvproof.e2e.workloads import hybrid_workload, preemption_workload

from .conftest import layout_config

#: 48 tokens per step: chunked prefill, and the admission timing the workload relies on.
OPTIONS = E2EOptions(num_blocks=96, max_num_batched_tokens=48)


@pytest.fixture(scope="module")
def served():
    """The hybrid workload at DCP 1, 2 and 4 (the last two on spawned gloo ranks)."""
    return {dcp: run_e2e(hybrid_workload(), layout_config(dcp=dcp), OPTIONS) for dcp in (1, 2, 4)}


@pytest.mark.parametrize("dcp", [1, 2, 4])
def test_served_logits_equal_recomputation(served, dcp):
    r = served[dcp]
    assert r.requests == 6
    assert r.max_abs_diff <= TOLERANCE
    assert r.cached_tokens > 0 and r.cow_copies > 0
    # The cases the workload is built for (kvproof.e2e.workloads.hybrid_workload):
    assert r.hits["b"] == [0]  # admitted with a, in the step that writes the shared prefix
    assert r.hits["c"] == [42]  # inside the attention block a writes in the same step
    assert r.hits["d"] == [48]  # a's next turn: prompt + outputs
    assert r.hits["e"] == [34]  # b's prompt again: all but its last token (prefix keys)
    assert r.hits["f"] == [0]  # another cache salt: no hit


def test_dcp_sizes_give_the_same_logits(served):
    one = served[1].served
    for dcp in (2, 4):
        other = served[dcp].served
        assert other.keys() == one.keys()
        assert max(float((other[k] - one[k]).abs().max()) for k in one) <= 1e-12


@pytest.mark.parametrize(
    "groups, hash_block_size, interleave",
    [
        (("full_attention:8", "mamba:8"), None, 1),  # K3-like: equal blocks, scaled down from 256
        (("full_attention:4", "mamba:8"), 2, 2),  # DCP interleave 2
        (("mla:8", "full_attention:4", "mamba:8"), 2, 1),  # two attention groups sharing memory slots
    ],
    ids=["k3-like", "interleave-2", "two-attention-groups"],
)
def test_other_geometries_at_dcp_2(groups, hash_block_size, interleave):
    config = layout_config(groups, dcp=2, hash_block_size=hash_block_size, interleave=interleave)
    r = run_e2e(hybrid_workload(), config, OPTIONS)
    assert r.max_abs_diff <= TOLERANCE
    assert r.cached_tokens > 0


def test_preempted_requests_are_recomputed_exactly():
    r = run_e2e(preemption_workload(), layout_config(dcp=2, hash_block_size=None),
                E2EOptions(num_blocks=30, max_num_batched_tokens=64))
    assert r.preemptions > 0 and r.requests == 6
    assert r.max_abs_diff <= TOLERANCE


def test_one_rank_in_a_spawned_process_matches_in_process(served):
    r = run_e2e(hybrid_workload(), layout_config(dcp=1), OPTIONS, spawn=True)
    assert r.served.keys() == served[1].served.keys()
    assert max(float((r.served[k] - served[1].served[k]).abs().max()) for k in r.served) == 0.0
