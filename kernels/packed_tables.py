"""All groups' block tables in one flat int32 buffer, so that one kernel launch can serve
every group although the groups' row widths differ.

Group ``g``'s table is the ``[rows, widths[g]]`` row-major block of ``storage`` that starts at
``offsets[g]``. A kernel reaches entry ``(g, row, col)`` at
``offsets[g] + row * widths[g] + col`` and is correct only for ``col < widths[g]``: that is
the bound every kernel here checks (INV-TABLE-WRITE-BOUND, INV-SLOT-INDEX-BOUND).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch


@dataclasses.dataclass(frozen=True)
class PackedTables:
    """``rows`` rows per group, group ``g`` ``widths[g]`` entries wide (int32 block ids).

    ``storage``: int32 ``[sum_g rows * widths[g]]``; ``offsets``: int64 ``[G]`` first entry of
    each group's table; ``widths``: int32 ``[G]`` row widths, on the storage's device;
    ``widths_host``: the same widths as Python ints (no device sync to read them).
    """

    storage: torch.Tensor
    offsets: torch.Tensor
    widths: torch.Tensor
    widths_host: tuple[int, ...]
    rows: int

    @classmethod
    def zeros(cls, widths: Sequence[int], rows: int, device: torch.device | str = "cpu") -> PackedTables:
        """A zero-filled table of ``rows`` rows per group."""
        widths_host = tuple(int(w) for w in widths)
        if not widths_host:
            raise ValueError("at least one group width is required")
        for g, w in enumerate(widths_host):
            if w < 1:
                raise ValueError(f"row width {w} of group {g} must be >= 1")
        if rows < 1:
            raise ValueError(f"row count {rows} must be >= 1")
        starts = [0]
        for w in widths_host[:-1]:
            starts.append(starts[-1] + rows * w)
        total = starts[-1] + rows * widths_host[-1]
        return cls(
            storage=torch.zeros(total, dtype=torch.int32, device=device),
            offsets=torch.tensor(starts, dtype=torch.int64, device=device),
            widths=torch.tensor(widths_host, dtype=torch.int32, device=device),
            widths_host=widths_host,
            rows=rows,
        )

    @property
    def num_groups(self) -> int:
        return len(self.widths_host)

    @property
    def device(self) -> torch.device:
        return self.storage.device

    def group(self, g: int) -> torch.Tensor:
        """Group ``g``'s table as a ``[rows, widths[g]]`` view (shares memory)."""
        start = sum(self.rows * w for w in self.widths_host[:g])
        w = self.widths_host[g]
        return self.storage[start : start + self.rows * w].view(self.rows, w)

    def like(self, rows: int | None = None) -> PackedTables:
        """A zero-filled table with the same widths (and ``rows`` rows, default the same)."""
        return PackedTables.zeros(self.widths_host, self.rows if rows is None else rows, self.device)

    def clone(self) -> PackedTables:
        return dataclasses.replace(self, storage=self.storage.clone())
