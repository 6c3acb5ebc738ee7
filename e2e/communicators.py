"""The collectives the tiny model needs across DCP ranks: ``all_gather`` (attention partials and
their log-sum-exp) and ``broadcast_object`` (rank 0's scheduler plan).

:class:`GlooRanks` runs them over the default torch.distributed (gloo) process group that
:func:`kvproof.e2e.ranks.spawn_ranks` sets up in each rank; :class:`SingleRank` is the same
interface for DCP 1, in the calling process.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class SingleRank:
    """DCP 1 in the calling process: the collectives are identities."""

    rank = 0
    size = 1

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor]

    def broadcast_object(self, obj: Any) -> Any:
        return obj


class GlooRanks:
    """This process's rank in the default (gloo) process group."""

    def __init__(self) -> None:
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape on every rank), indexed by rank."""
        tensor = tensor.contiguous()
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(out, tensor)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (the others pass anything)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
