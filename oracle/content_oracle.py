"""The content oracle: what every block really holds, on every DCP rank.

Structural checks (ref counts, keys) cannot see a copy of the wrong bytes. The oracle replays a
step the way the worker would -- block-table rows, copies at step start as one batched
gather-then-scatter, forward writes -- and records, per rank, whose KV each block holds; every
read of the forward pass is then checked: attention must find, for every position it attends
to, the KV of exactly this request's prefix up to that position; a Mamba chunk must start from
the state of exactly the prefix before it. A wrong hit, a copy from a block that is not ready, a
chained copy, a freed block still in use, or a table that is too narrow all show up here.

Where a position lives comes from the spec (``spec.placement``): its row entry is
``table_index`` and, in a sharded group, its rank is ``owner_rank``. The oracle has no
placement formula of its own.

Cost: O(blocks touched) per step, not O(tokens). A block's page on a rank is a short list of
segments -- "the slots [lo, hi) of this block that this rank owns hold the KV of positions
base + slot written by the request whose token sequence is ``prefix``" -- so a write or a copy
touches a few segments per block. Ownership of a slot is that of its position (``owner_rank``;
a block spans whole rounds of interleave runs, so it does not depend on ``base``). A read
compares content *identities*: two requests' KV at position ``q`` agree iff their token
prefixes ``[0, q]`` (and cache salts) agree, which :class:`_Prefix` answers from an identity
kept every ``_ANCHOR`` tokens plus one C-level hash of at most ``_ANCHOR`` tokens; a segment
the reader wrote itself needs no hashing at all. A block already verified for a reader is not
checked again until its page is overwritten or copied into (``_changed``), and what a chunk
wrote in this step is read back unchecked unless a write or a copy of the step replaced it.
"""

from __future__ import annotations

import inspect
from typing import NamedTuple, Optional

from kvproof.spec import placement
from kvproof.spec.groups import GroupKind
from kvproof.spec.layout import Layout

# The spec's own functions without their contract wrappers: called once per block touched, where
# icontract's ~10 us per call would dominate. Their contracts are proved (docs/proofs.md).
_table_index = inspect.unwrap(placement.table_index)
_owner_rank = inspect.unwrap(placement.owner_rank)

#: Tokens between two stored prefix identities (the most one identity query hashes).
_ANCHOR = 256


class _Prefix:
    """Identities of the prefixes of one request's token sequence (read-only use of ``tokens``,
    which the request only ever appends to)."""

    __slots__ = ("tokens", "anchors")

    def __init__(self, tokens: list[int], salt: Optional[str]) -> None:
        self.tokens = tokens
        self.anchors = [hash(("salt", salt))]  # anchors[k]: identity of tokens [0, k * _ANCHOR)

    def at(self, q: int) -> int:
        """Identity of the prefix ``[0, q]`` (salt included)."""
        k = q // _ANCHOR
        anchors, tokens = self.anchors, self.tokens
        while len(anchors) <= k:
            j = len(anchors) - 1
            anchors.append(hash((anchors[j], tuple(tokens[j * _ANCHOR:(j + 1) * _ANCHOR]))))
        return hash((anchors[k], tuple(tokens[k * _ANCHOR:q + 1])))


def _same(a: _Prefix, b: _Prefix, q: int) -> bool:
    """Whether two sequences agree on ``[0, q]``, so that their KV (or state) there is the same."""
    return a is b or a.at(q) == b.at(q)


class _Shape(NamedTuple):
    gid: int
    state: bool  # Mamba: one state per block; else attention KV
    block_size: int  # per-rank block size b_g: slots of one block on one rank
    effective_block_size: int  # B_g: positions one row entry covers (b_g x DCP when sharded)
    sharded: bool  # DCP shards its positions over ranks (dcp > 1)
    cacheable: bool  # Mamba none keeps one running state at row index 0
    width: int  # worker row width
    window: int  # sliding window in tokens, 0 for full attention


class ContentOracle:
    """Watches scheduled steps (``run_step``) and collects violations (``violations``, strings
    starting with the invariant id). Mutates only its own model; never the plan."""

    def __init__(self, layout: Layout) -> None:
        self.dcp = layout.dcp
        self.interleave = layout.config.interleave
        self.groups = [
            _Shape(
                g.index, g.group.kind is GroupKind.MAMBA, g.group.block_size, g.effective_block_size,
                g.group.is_sharded and layout.dcp > 1,
                g.group.prefix_cacheable, g.table_width, g.group.sliding_window or 0,
            )
            for g in layout.groups
        ]
        self._state_groups = [g for g in self.groups if g.state]
        self._kv_groups = [g for g in self.groups if not g.state]
        # (group, block) -> per rank: sorted, disjoint segments (lo, hi, prefix, base): the slots
        # lo..hi-1 of the block hold prefix's KV of positions base + slot (base: the row index
        # times the effective block size, for the request that wrote them)
        self._kv: dict[tuple[int, int], list[list[tuple[int, int, _Prefix, int]]]] = {}
        # (group, block) -> (prefix, n): the state after the first n tokens of prefix (every rank)
        self._states: dict[tuple[int, int], tuple[_Prefix, int]] = {}
        # (group, block) -> {request: row index} of the requests whose reads of it were verified
        self._readers: dict[tuple[int, int], dict[str, int]] = {}
        self.rows: dict[str, list[list[int]]] = {}
        self._prefixes: dict[str, _Prefix] = {}
        # blocks whose earlier contents changed in the running step (see _changed)
        self._changed_now: set[tuple[int, int]] = set()
        # (request, group) -> positions [0, n) verified, unchanged since (see _changed)
        self._verified: dict[tuple[str, int], int] = {}
        self.violations: list[str] = []

    # --- one step -------------------------------------------------------------------------------

    def run_step(self, plan) -> None:
        """Apply a scheduled step: rows, copies (batched), then each chunk's reads and writes."""
        self._changed_now.clear()
        work = []
        prefixes = self._prefixes
        for chunk in plan.chunks:
            req = chunk.request
            rid = req.request_id
            prefix = prefixes.get(rid)
            if prefix is None or prefix.tokens is not req.token_ids:
                prefix = prefixes[rid] = _Prefix(req.token_ids, req.cache_salt)
            if chunk.overwrite or rid not in self.rows:
                rows = self.rows[rid] = [list(b) for b in chunk.new_blocks]
                for g in self.groups:
                    self._verified.pop((rid, g.gid), None)
            else:
                rows = self.rows[rid]
                grew = False
                for row, new in zip(rows, chunk.new_blocks):
                    if new:
                        row.extend(new)
                        grew = True
                if not grew:  # a decode step: the row widths were checked when they last grew
                    work.append((chunk, rid, rows, prefix))
                    continue
            for g, row in zip(self.groups, rows):
                if len(row) > g.width:
                    self._violation("INV-TABLE-WIDTH", f"request {rid!r}, group {g.gid}: row of {len(row)} entries > width {g.width}")
            work.append((chunk, rid, rows, prefix))
        self._copy(plan.copies)
        for chunk, rid, rows, prefix in work:
            self._read_states(chunk, rid, rows, prefix)
        for chunk, rid, rows, prefix in work:
            self._write(chunk, rows, prefix)
        for chunk, rid, rows, prefix in work:
            self._read_attention(chunk, rid, rows, prefix)

    def keep_state(self, request, n: int) -> None:
        """After a step that ran draft tokens: the request's Mamba state blocks hold the state
        after exactly its first ``n`` tokens (the recurrence kernel keeps the state after each
        draft position; the last accepted one becomes the request's state, where the next chunk
        reads it). ``request.token_ids`` holds at least ``n`` tokens."""
        rid = request.request_id
        rows = self.rows.get(rid)
        if rows is None:
            return
        prefix = self._prefixes.get(rid)
        if prefix is None or prefix.tokens is not request.token_ids:
            prefix = self._prefixes[rid] = _Prefix(request.token_ids, request.cache_salt)
        for g in self._state_groups:
            row = rows[g.gid]
            i = _table_index(n - 1, g.block_size, self.dcp, False) if g.cacheable else 0
            if i < len(row):
                self._states[(g.gid, row[i])] = (prefix, n)

    def forget(self, request) -> None:
        """Drop a finished or preempted request's row and identity (its blocks' contents stay)."""
        rid = request.request_id
        self.rows.pop(rid, None)
        self._prefixes.pop(rid, None)
        for g in self.groups:
            self._verified.pop((rid, g.gid), None)

    def _violation(self, inv: str, detail: str) -> None:
        self.violations.append(f"{inv}: {detail}")

    # --- placement (spec.placement) -------------------------------------------------------------

    def _ranks(self, g: _Shape, lo: int, hi: int):
        """The ranks that own at least one position (or slot) of ``[lo, hi)``."""
        if not g.sharded or hi - lo >= self.interleave * self.dcp:
            return range(self.dcp)
        il = self.interleave
        if hi - lo == 1:
            return (_owner_rank(lo, self.dcp, il),)
        return sorted({_owner_rank(p, self.dcp, il) for p in range(lo, hi, il)} | {_owner_rank(hi - 1, self.dcp, il)})

    def _last_owned(self, g: _Shape, rank: int, lo: int, hi: int) -> Optional[int]:
        """The last position of ``[lo, hi)`` that ``rank`` holds, or None. Ownership is constant
        on each run of ``interleave`` positions, so the last ``dcp`` runs decide."""
        if lo >= hi:
            return None
        if not g.sharded:
            return hi - 1
        il, p = self.interleave, hi - 1
        if hi - lo == 1:  # the common case: one slot between two of a rank's decode writes
            return p if _owner_rank(p, self.dcp, il) == rank else None
        for _ in range(self.dcp):
            if p < lo:
                return None
            if _owner_rank(p, self.dcp, il) == rank:
                return p
            p = (p // il) * il - 1  # the last position of the run before
        return None

    def _owns_none(self, g: _Shape, rank: int, lo: int, hi: int) -> bool:
        return self._last_owned(g, rank, lo, hi) is None

    def _blocks(self, g: _Shape, row: list[int], lo: int, hi: int):
        """(row index, block, first, end) for each row entry the positions ``[lo, hi)`` fall in,
        or None when they reach past the row. Entry i covers ``[i * B_g, (i + 1) * B_g)``
        (INV-SLOT-TABLE-INDEX), so only the two ends need the spec's ``table_index``."""
        first = _table_index(lo, g.block_size, self.dcp, g.sharded)
        last = first if hi - lo == 1 else _table_index(hi - 1, g.block_size, self.dcp, g.sharded)
        if last >= len(row):
            return None
        b = g.effective_block_size
        if first == last:
            return ((first, row[first], lo, hi),)
        return [(i, row[i], max(lo, i * b), min(hi, (i + 1) * b)) for i in range(first, last + 1)]

    # --- copies and writes ----------------------------------------------------------------------

    def _copy(self, copies) -> None:
        # Batched gather-then-scatter, as the worker runs it: every source is read before any
        # destination is written, so a chained copy reads stale contents.
        gathered = [
            (gid, dst, [list(r) for r in self._kv[(gid, src)]] if (gid, src) in self._kv else None,
             self._states.get((gid, src)))
            for gid, src, dst in copies
        ]
        for gid, dst, kv, state in gathered:
            key = (gid, dst)
            self._changed(key)
            if kv is None:
                self._kv.pop(key, None)
            else:
                self._kv[key] = kv
            if state is None:
                self._states.pop(key, None)
            else:
                self._states[key] = state

    def _write(self, chunk, rows, prefix: _Prefix) -> None:
        start, end = chunk.start, chunk.start + chunk.num_tokens
        dcp = self.dcp
        for g in self._state_groups:
            row = rows[g.gid]
            i = _table_index(end - 1, g.block_size, dcp, False) if g.cacheable else 0
            if i < len(row):
                self._states[(g.gid, row[i])] = (prefix, end)
        for g in self._kv_groups:
            row = rows[g.gid]
            if end - start == 1:  # a decode step: one position, one block, its owner rank(s)
                i = _table_index(start, g.block_size, dcp, g.sharded)
                blocks = ((i, row[i], start, end),) if i < len(row) else ()
            else:
                blocks = self._blocks(g, row, start, end) or ()
            for i, blk, lo, hi in blocks:
                key = (g.gid, blk)
                pages = self._kv.get(key)
                if pages is None:
                    pages = self._kv[key] = [[] for _ in range(dcp)]
                base = i * g.effective_block_size
                lo, hi = lo - base, hi - base  # offsets in the block: what the slots are
                overwrote = False
                for r in self._ranks(g, lo, hi):
                    segs = pages[r]
                    k = len(segs) - 1 if segs and segs[-1][0] < lo else _segment_before(segs, lo)
                    if k is not None:
                        a, b, p, at_base = segs[k]
                        if (p is prefix and at_base == base and (k + 1 == len(segs) or segs[k + 1][0] >= hi)
                                and (b == lo or (b < lo and self._owns_none(g, r, b, lo)))):
                            segs[k] = (a, hi, prefix, base)  # our own KV continues: extend the segment
                            continue
                    overwrote |= self._put(segs, lo, hi, prefix, base)
                if overwrote:
                    self._changed(key)

    @staticmethod
    def _put(segs: list, lo: int, hi: int, prefix: _Prefix, base: int) -> bool:
        """Record that a rank's slots ``[lo, hi)`` of a block now hold ``prefix``'s KV for the
        positions ``base + offset``; True when this replaced something (its readers check again).
        A slot holds one position whatever request wrote it: a block reused for another request
        or another row index loses what the new write covers."""
        kept = [s for s in segs if s[1] <= lo or s[0] >= hi]
        cut = [s for s in segs if not (s[1] <= lo or s[0] >= hi)]
        for a, b, p, old in cut:  # keep the parts outside [lo, hi)
            if a < lo:
                kept.append((a, lo, p, old))
            if b > hi:
                kept.append((hi, b, p, old))
        kept.append((lo, hi, prefix, base))
        kept.sort(key=_first)
        segs[:] = kept
        return bool(cut)

    # --- reads ----------------------------------------------------------------------------------

    def _read_states(self, chunk, rid: str, rows, prefix: _Prefix) -> None:
        start = chunk.start
        if start == 0:
            return
        for g in self._state_groups:
            row = rows[g.gid]
            i = _table_index(start - 1, g.block_size, self.dcp, False) if g.cacheable else 0
            blk = row[i] if i < len(row) else None
            held = self._states.get((g.gid, blk))
            if held is None or held[1] != start or not (held[0] is prefix or _same(held[0], prefix, start - 1)):
                self._violation(
                    "INV-CONTENT-STATE",
                    f"request {rid!r}, group {g.gid}, every rank: chunk at {start} reads state block {blk}, "
                    f"which does not hold the state after exactly this request's first {start} tokens",
                )
                return

    def _read_attention(self, chunk, rid: str, rows, prefix: _Prefix) -> None:
        end = chunk.start + chunk.num_tokens
        for g in self._kv_groups:
            row = rows[g.gid]
            first = max(0, chunk.start - g.window + 1) if g.window else 0
            verified = self._verified.get((rid, g.gid), 0)
            lo = max(first, verified)  # positions below `verified` were checked and not changed since
            if lo >= end:
                continue
            blocks = self._blocks(g, row, lo, end)
            if blocks is None:
                self._violation(
                    "INV-CONTENT-KV",
                    f"request {rid!r}, group {g.gid}: position {end - 1} reads row index {_table_index(end - 1, g.block_size, self.dcp, g.sharded)}, "
                    f"past the {len(row)} entries the row holds",
                )
                return
            own = lo >= chunk.start  # every position read was written by this chunk, this step
            for i, blk, a, b in blocks:
                key = (g.gid, blk)
                # What this chunk just wrote holds its KV unless another write or a copy of this
                # step replaced it since: those go through _changed.
                bad = None if own and key not in self._changed_now else self._check_block(g, key, a, b, prefix, i * g.effective_block_size)
                if bad is not None:
                    self._violation(
                        "INV-CONTENT-KV",
                        f"request {rid!r}, group {g.gid}, rank {bad[0]}: position {bad[1]} reads block {blk}, "
                        f"which does not hold this request's KV for it",
                    )
                    return
                readers = self._readers.get(key)
                if readers is None:
                    self._readers[key] = {rid: i}
                elif readers.get(rid) != i:
                    readers[rid] = i
            self._verified[(rid, g.gid)] = end

    def _changed(self, key) -> None:
        """Block ``key``'s earlier contents may have changed: its readers check it again."""
        self._changed_now.add(key)
        readers = self._readers.pop(key, None)
        if readers:
            b = self.groups[key[0]].effective_block_size
            for rid, i in readers.items():
                k = (rid, key[0])
                if self._verified.get(k, 0) > i * b:
                    self._verified[k] = i * b

    def _check_block(self, g: _Shape, key, lo: int, hi: int, prefix: _Prefix, base: int) -> Optional[tuple[int, int]]:
        """None if every rank holds ``prefix``'s KV for its positions of ``[lo, hi)`` in block
        ``key``, whose slot 0 is position ``base``; else (rank, a position it lacks)."""
        pages = self._kv.get(key)
        lo, hi = lo - base, hi - base
        for r in self._ranks(g, lo, hi):
            segs = pages[r] if pages else ()
            k = len(segs) - 1 if segs and segs[-1][0] <= lo else _segment_before(segs, lo + 1)
            if k is not None:
                a, b, p, at_base = segs[k]
                if p is prefix and at_base == base and b >= hi:
                    continue  # the reader's own KV, written in one piece (decode, own prefill)
            at = lo  # every slot below ``at`` that rank r owns is verified
            for a, b, p, at_base in segs:
                if b <= at or a >= hi:
                    continue
                hole = self._last_owned(g, r, at, a)  # an owned slot in [at, a) holds nothing
                if hole is not None:
                    return r, base + hole
                q = self._last_owned(g, r, max(a, at), min(b, hi))  # chained identities: the last decides
                if q is not None and (at_base != base or not _same(p, prefix, base + q)):
                    return r, base + q
                at = min(b, hi)
                if at >= hi:
                    break
            hole = self._last_owned(g, r, at, hi)
            if hole is not None:
                return r, base + hole
        return None


def _first(segment: tuple) -> int:
    return segment[0]


def _segment_before(segs: list, offset: int) -> Optional[int]:
    """Index of the last segment starting below ``offset`` (segments are sorted), or None. The
    one sought is nearly always the last or the one before."""
    for k in range(len(segs) - 1, -1, -1):
        if segs[k][0] < offset:
            return k
    return None
