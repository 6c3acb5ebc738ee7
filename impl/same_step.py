"""The prefixes one scheduler step will key: a waiting request sharing one beyond its hit waits
a step rather than recompute what this step's forward pass is writing.

kvproof keys a block only after the forward pass that wrote it, so a request admitted in the
step that first computes its prefix would miss it. Both schedulers that drive kvproof's
manager -- its own (``impl/scheduler.py``) and vLLM's, through the adapter
(``integrations/vllm/kvproof_manager.py``) -- note each chunk they schedule here and ask, before
admitting a waiting request, whether this step keys a longer prefix of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from kvproof.impl.hashing import key_at

if TYPE_CHECKING:
    from kvproof.impl.kv_cache_manager import KVCacheManager
    from kvproof.impl.request import Request


class SameStepKeys:
    """One step's chunks (and, with async scheduling, the previous step's until its output
    returns), and (built on the first question) the group-0 keys of the lengths they key in
    every group (``KVCacheManager.keyed_lengths``). ``clear`` or ``retain`` at each step."""

    __slots__ = ("_kv", "_chunks", "_keyed")

    def __init__(self, kv: "KVCacheManager") -> None:
        self._kv = kv
        self._chunks: list[tuple["Request", int, int]] = []
        self._keyed: Optional[set[tuple[bytes, int]]] = None

    def clear(self) -> None:
        self._chunks = []
        self._keyed = None

    def retain(self, unkeyed: Callable[["Request", int], bool]) -> int:
        """Keep only the chunks ``unkeyed(req, end)`` says are not keyed yet, for the next step
        (with async scheduling a step's output, and so its keys, returns after the next step is
        scheduled); returns how many were kept."""
        self._chunks = [c for c in self._chunks if unkeyed(c[0], c[2])]
        self._keyed = None
        return len(self._chunks)

    def note(self, req: "Request", start: int, end: int) -> None:
        """``req`` computes ``[start, end)`` in this step. Only chunks that reach a new length on
        the hit grid can key anything (most decode steps do not)."""
        a = self._kv.alignment
        if end // a == start // a:
            return
        self._chunks.append((req, start, end))
        if self._keyed is not None:
            self._add(req, start, end)

    def _add(self, req: "Request", start: int, end: int) -> None:
        h = self._kv.hash_block_size
        # Group 0's key names the prefix: a set of them tells which prefixes this step keys.
        self._keyed.update(key_at(req.block_hashes, n, h, 0) for n in self._kv.keyed_lengths(req, start, end))

    def producer_in_flight(self, req: "Request", hit: int) -> bool:
        """Whether this step keys a prefix ``req`` shares beyond ``hit`` (and short of its last
        token, which it must compute). O(hit-grid lengths between the hit and the prompt end),
        nothing when the step keys nothing. No state change but the lazily built key set."""
        if self._keyed is None:
            self._keyed = set()
            for chunk in self._chunks:
                self._add(*chunk)
        keyed = self._keyed
        if not keyed:
            return False
        hashes, h, a = req.block_hashes, self._kv.hash_block_size, self._kv.alignment
        top = min(req.num_tokens - 1, len(hashes) * h) // a * a
        return any(key_at(hashes, n, h, 0) in keyed for n in range(top, hit, -a))
