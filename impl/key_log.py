"""The pool's key changes in order, for a host that reports them (vLLM's KV-cache events).

A pool built with a :class:`KeyLog` (``BlockPool(..., key_log=log)``) records every key it
attaches to a block and every key a block loses, one record per (block, key), in the order they
happen; a pool without one runs the plain :class:`~kvproof.impl.key_index.KeyIndex` and pays
nothing. Replaying the records (``STORED`` adds one holder of the key, ``REMOVED`` takes one away,
``CLEARED`` empties everything) gives each key's holder count in the pool at any point
(INV-EVENTS-REPLAY, tests/vllm/test_kv_events.py). A key that moves to another block
(``move_key``) or stays as a prefix key (``demote``) is no change and no record.
"""

from __future__ import annotations

from typing import Optional

from kvproof.impl.key_index import Key, KeyIndex

#: Record kinds: ``(STORED, key, num_tokens)``, ``(REMOVED, key, 0)``, ``(CLEARED, None, 0)``.
STORED, REMOVED, CLEARED = 0, 1, 2


class KeyLog:
    """Records not yet taken, oldest first."""

    __slots__ = ("records",)

    def __init__(self) -> None:
        self.records: list[tuple[int, Optional[Key], int]] = []

    def take(self) -> list[tuple[int, Optional[Key], int]]:
        """Mutates. The records so far, and an empty log."""
        records, self.records = self.records, []
        return records


class LoggedKeyIndex(KeyIndex):
    """A :class:`KeyIndex` that records what it attaches and drops in a :class:`KeyLog`."""

    __slots__ = ("log",)

    def __init__(self, num_blocks: int, log: KeyLog) -> None:
        super().__init__(num_blocks)
        self.log = log

    def attach(self, block: int, key: Key, num_tokens: int, holders: Optional[list[int]]) -> None:
        super().attach(block, key, num_tokens, holders)
        self.log.records.append((STORED, key, num_tokens))

    def add_prefix(self, block: int, key: Key, num_tokens: int) -> None:
        super().add_prefix(block, key, num_tokens)
        self.log.records.append((STORED, key, num_tokens))

    def drop(self, block: int) -> None:
        lost = [self.key[block], *(k for k, _ in self.prefixes.get(block, ()))]
        super().drop(block)
        self.log.records.extend((REMOVED, k, 0) for k in lost)

    def clear(self) -> None:
        super().clear()
        self.log.records.append((CLEARED, None, 0))
