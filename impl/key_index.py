"""The block pool's key index: which cache keys each block carries, and which blocks hold each key.

A block's primary key names the longest prefix it holds (``ntok`` tokens); an attention block
may keep shorter ones as prefix keys (``spec.block_pool``, INV-POOL-PREFIX-KEYS). A key can be
held by several blocks (two requests computed the same prefix); a lookup returns the oldest
holder. The index knows nothing of reference counts or free blocks (the pool's job); it only
moves keys, and never validates: the pool checks its callers' input before it calls in.
"""

from __future__ import annotations

from typing import Hashable, Optional

from kvproof.spec.contracts import check

Key = Hashable


class KeyIndex:
    """Keys of blocks ``0 .. num_blocks-1``. Per-block state in lists indexed by block id."""

    __slots__ = ("key", "ntok", "prefixes", "holders")

    def __init__(self, num_blocks: int) -> None:
        #: The block's primary key, None if it is uncached.
        self.key: list[Optional[Key]] = [None] * num_blocks
        #: Prefix length its primary key covers; 0 iff it has none.
        self.ntok = [0] * num_blocks
        #: block -> its prefix keys as (key, ntok), shortest first; only blocks that have some.
        self.prefixes: dict[int, list[tuple[Key, int]]] = {}
        #: key -> the blocks holding it (as primary or prefix key), oldest first.
        self.holders: dict[Key, list[int]] = {}

    # --- queries (no state change) -------------------------------------------------------------

    def keys_of(self, block: int) -> tuple[tuple[Key, int], ...]:
        """Every key of ``block`` with the prefix length it names, longest (the primary) first."""
        if self.key[block] is None:
            return ()
        return ((self.key[block], self.ntok[block]),) + tuple(reversed(self.prefixes.get(block, ())))

    def holds(self, block: int, key: Key, holders: Optional[list[int]]) -> bool:
        """Whether ``block`` carries ``key`` already; ``holders`` is the key's holder list or None."""
        return self.key[block] == key or (holders is not None and block in holders)

    def length_of(self, key: Key, holder: int) -> int:
        """The prefix length ``key`` names on ``holder`` (its primary, or one of its prefix keys)."""
        if self.key[holder] == key:
            return self.ntok[holder]
        return next(n for k, n in self.prefixes[holder] if k == key)

    def num_prefix_keys(self) -> int:
        """Prefix keys held beside primary keys. O(blocks with some)."""
        return sum(len(p) for p in self.prefixes.values())

    # --- changes (mutate) ----------------------------------------------------------------------

    def attach(self, block: int, key: Key, num_tokens: int, holders: Optional[list[int]]) -> None:
        """Name a block that has no primary key by ``key``; ``holders`` is the key's current
        holder list or None."""
        self.key[block] = key
        self.ntok[block] = num_tokens
        if holders is None:
            self.holders[key] = [block]
        else:
            holders.append(block)

    def add_prefix(self, block: int, key: Key, num_tokens: int) -> None:
        """Give ``block`` one more prefix key, longer than those it has (below a primary still to come)."""
        self.prefixes.setdefault(block, []).append((key, num_tokens))
        found = self.holders.get(key)
        if found is None:
            self.holders[key] = [block]
        else:
            found.append(block)

    def demote(self, block: int) -> None:
        """Make the block's primary key one of its prefix keys (it stays in the index): the
        earlier prefix stays valid in append-only KV."""
        self.prefixes.setdefault(block, []).append((self.key[block], self.ntok[block]))
        self.key[block] = None
        self.ntok[block] = 0

    def drop(self, block: int) -> None:
        """Drop every key of ``block``: its primary and its prefix keys."""
        extra = self.prefixes.pop(block, None)
        for k in [self.key[block], *(k for k, _ in extra or ())]:
            found = self.holders[k]
            if len(found) == 1:
                del self.holders[k]
            else:
                found.remove(block)
        self.key[block] = None
        self.ntok[block] = 0

    def move(self, src: int, dst: int) -> None:
        """Move src's keys, their lengths and their places among each key's holders to dst (which has none)."""
        moved = self.prefixes.pop(src, None)
        for k in [self.key[src], *(k for k, _ in moved or ())]:
            holders = self.holders[k]
            holders[holders.index(src)] = dst
        if moved:
            self.prefixes[dst] = moved
        self.key[dst], self.ntok[dst] = self.key[src], self.ntok[src]
        self.key[src], self.ntok[src] = None, 0

    def clear(self) -> None:
        """Drop every key (the lists keep their identity: the compute queue reads ``key``)."""
        n = len(self.key)
        self.key[:] = [None] * n
        self.ntok[:] = [0] * n
        self.prefixes.clear()
        self.holders.clear()

    # --- the whole-index check (slow tier) -----------------------------------------------------

    def check(self) -> None:
        """Every key a block carries is listed under it with one length, and only those
        (INV-POOL-KEY-CONSISTENT, INV-POOL-KEY-LENGTH, INV-POOL-PREFIX-KEYS); InvariantViolation otherwise."""
        key, ntok = self.key, self.ntok
        carried: dict[tuple[int, Key], int] = {}
        for b in range(len(key)):
            check((key[b] is None) == (ntok[b] == 0) and ntok[b] >= 0, "INV-POOL-KEY-CONSISTENT", f"block {b} has key {key[b]!r} with ntok {ntok[b]}")
            if key[b] is not None:
                carried[b, key[b]] = ntok[b]
        for b, extra in self.prefixes.items():
            lengths = [n for _, n in extra]
            check(key[b] is not None and lengths == sorted(set(lengths)) and all(0 < n < ntok[b] for n in lengths)
                  and len({k for k, _ in extra} | {key[b]}) == len(extra) + 1,
                  "INV-POOL-PREFIX-KEYS", f"block {b} has prefix keys of lengths {lengths} beside a primary of {ntok[b]}")
            for k, n in extra:
                carried[b, k] = n
        listed = 0
        for k, blocks in self.holders.items():
            check(len(blocks) > 0 and len(set(blocks)) == len(blocks), "INV-POOL-KEY-CONSISTENT",
                  f"key {k!r} is in the map with holders {blocks}")
            lengths = []
            for b in blocks:
                check((b, k) in carried, "INV-POOL-KEY-CONSISTENT", f"key {k!r} lists block {b}, which does not carry it")
                lengths.append(carried[b, k])
            listed += len(blocks)
            check(len(set(lengths)) == 1, "INV-POOL-KEY-LENGTH", f"key {k!r} is held with lengths {lengths} by blocks {blocks}")
        check(listed == len(carried), "INV-POOL-KEY-CONSISTENT", f"blocks carry {len(carried)} keys but the key map lists {listed}")
