"""Spawned gloo ranks: collectives work, and the first error of any rank reaches the caller."""

from __future__ import annotations

import pytest
import torch

from kvproof.e2e.ranks import RankError, spawn_ranks


def _gather_ranks(comm):
    return [int(t.item()) for t in comm.all_gather(torch.tensor([comm.rank]))], comm.broadcast_object(comm.rank + 10)


def _fail_on_rank_1(comm):
    if comm.rank == 1:
        raise ValueError("rank 1 refuses")
    comm.all_gather(torch.zeros(1))  # rank 0 waits here until rank 1 is gone


def test_collectives_across_three_ranks():
    assert spawn_ranks(_gather_ranks, 3, ()) == ([0, 1, 2], 10)


def test_the_failing_rank_is_reported_not_its_peer():
    with pytest.raises(RankError) as caught:
        spawn_ranks(_fail_on_rank_1, 2, ())
    assert (caught.value.rank, caught.value.kind, caught.value.message) == (1, "ValueError", "rank 1 refuses")
