"""Deliberate bugs the e2e runner can inject, so tests can show the check has teeth.

Each is a documented switch of :func:`kvproof.e2e.runner.run_e2e` (``faults=``), applied on
every rank; with all of them off (the default) the runner is the production path. None of
them touches kvproof's scheduler side: they break the worker exactly where real workers broke
(or, for ``rank_killed_at_step``, the process under it).
"""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Faults:
    #: Each rank computes its slot mappings as rank ``(rank + shift) % dcp``: KV lands in the
    #: local slots of positions another rank owns (needs DCP > 1 to change anything).
    slot_mapping_rank_shift: int = 0
    #: Run the step's block copies after the forward pass instead of before it: a request that
    #: hit inside a block reads its copy before the copy exists, and the late copy then
    #: overwrites what the step wrote.
    copies_after_forward: bool = False
    #: Size replicated (Mamba) rows by vLLM 0.33's rule ``cdiv(max_model_len, block_size * dcp)``
    #: instead of ``cdiv(max_model_len, block_size)``: a long request's row overflows, which
    #: the block tables refuse before staging anything (INV-TABLE-WRITE-BOUND).
    mamba_width_divided_by_dcp: bool = False
    #: ``(rank, step)``: that rank's process kills itself (SIGKILL) when the step arrives, as
    #: the out-of-memory killer would -- it reports nothing; its peers lose their connection.
    rank_killed_at_step: Optional[tuple[int, int]] = None

    @property
    def any(self) -> bool:
        return self != Faults()
