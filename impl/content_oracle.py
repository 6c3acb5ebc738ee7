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
segments ``[lo, hi)`` -- "the positions of [lo, hi) this rank owns hold the KV written by the
request whose token sequence is ``prefix``" -- so a write or a copy touches a few segments per
block. A read compares content *identities*: two requests' KV at position ``q`` agree iff their
token prefixes ``[0, q]`` (and cache salts) agree, which :class:`_Prefix` answers from an
identity kept every ``_ANCHOR`` tokens plus one C-level hash of at most ``_ANCHOR`` tokens; a
segment the reader wrote itself needs no hashing at all. A block already verified for a
reader is not checked again until its page is overwritten or copied into (``_changed``).
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
    bs: int  # physical block size on one rank
    span: int  # positions one row entry covers (B_g; the spec's effective block size)
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
        # (group, block) -> per rank: sorted, disjoint segments (lo, hi, prefix) of attention KV
        self._kv: dict[tuple[int, int], list[list[tuple[int, int, _Prefix]]]] = {}
        # (group, block) -> (prefix, n): the state after the first n tokens of prefix (every rank)
        self._states: dict[tuple[int, int], tuple[_Prefix, int]] = {}
        # (group, block) -> {request: row index} of the requests whose reads of it were verified
        self._readers: dict[tuple[int, int], dict[str, int]] = {}
        self.rows: dict[str, list[list[int]]] = {}
        self._prefixes: dict[str, _Prefix] = {}
        # (request, group) -> positions [0, n) verified, unchanged since (see _changed)
        self._verified: dict[tuple[str, int], int] = {}
        self.violations: list[str] = []

    # --- one step -------------------------------------------------------------------------------

    def run_step(self, plan) -> None:
        """Apply a scheduled step: rows, copies (batched), then each chunk's reads and writes."""
        work = []
        for chunk in plan.chunks:
            rid = chunk.request.request_id
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
                    work.append((chunk, rid, rows, self._prefix(chunk.request)))
                    continue
            for g, row in zip(self.groups, rows):
                if len(row) > g.width:
                    self._violation("INV-TABLE-WIDTH", f"request {rid!r}, group {g.gid}: row of {len(row)} entries > width {g.width}")
            work.append((chunk, rid, rows, self._prefix(chunk.request)))
        self._copy(plan.copies)
        for chunk, rid, rows, prefix in work:
            self._read_states(chunk, rid, rows, prefix)
        for chunk, rid, rows, prefix in work:
            self._write(chunk, rows, prefix)
        for chunk, rid, rows, prefix in work:
            self._read_attention(chunk, rid, rows, prefix)

    def forget(self, request) -> None:
        """Drop a finished or preempted request's row and identity (its blocks' contents stay)."""
        rid = request.request_id
        self.rows.pop(rid, None)
        self._prefixes.pop(rid, None)
        for g in self.groups:
            self._verified.pop((rid, g.gid), None)

    def _violation(self, inv: str, detail: str) -> None:
        self.violations.append(f"{inv}: {detail}")

    def _prefix(self, request) -> _Prefix:
        p = self._prefixes.get(request.request_id)
        if p is None or p.tokens is not request.token_ids:
            p = self._prefixes[request.request_id] = _Prefix(request.token_ids, request.cache_salt)
        return p

    # --- placement (spec.placement) -------------------------------------------------------------

    def _index(self, g: _Shape, position: int) -> int:
        """Row index of ``position`` (a Mamba state: of the last position it covers)."""
        if g.state and not g.cacheable:
            return 0
        return _table_index(position, g.bs, self.dcp, g.sharded)

    def _ranks(self, g: _Shape, lo: int, hi: int) -> range | list[int]:
        """The ranks that own at least one position of ``[lo, hi)``."""
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
        or None when they reach past the row. Entry i covers ``[i * span, (i + 1) * span)``
        (INV-SLOT-TABLE-INDEX), so only the two ends need the spec's ``table_index``."""
        first = _table_index(lo, g.bs, self.dcp, g.sharded)
        last = first if hi - lo == 1 else _table_index(hi - 1, g.bs, self.dcp, g.sharded)
        if last >= len(row):
            return None
        span = g.span
        if first == last:
            return ((first, row[first], lo, hi),)
        return [(i, row[i], max(lo, i * span), min(hi, (i + 1) * span)) for i in range(first, last + 1)]

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
        end = chunk.start + chunk.num_tokens
        for g, row in zip(self.groups, rows):
            if g.state:
                i = self._index(g, end - 1)
                if i < len(row):
                    self._states[(g.gid, row[i])] = (prefix, end)
                continue
            for _, blk, lo, hi in self._blocks(g, row, chunk.start, end) or ():
                key = (g.gid, blk)
                pages = self._kv.get(key)
                if pages is None:
                    pages = self._kv[key] = [[] for _ in range(self.dcp)]
                overwrote = False
                for r in self._ranks(g, lo, hi):
                    segs = pages[r]
                    last = segs[-1] if segs else None
                    if last is not None and last[2] is prefix and (last[1] == lo or (last[1] < lo and self._owns_none(g, r, last[1], lo))):
                        segs[-1] = (last[0], hi, prefix)  # our own KV continues: extend the segment
                    else:
                        overwrote |= self._put(g, r, segs, lo, hi, prefix)
                if overwrote:
                    self._changed(key)

    def _put(self, g: _Shape, rank: int, segs: list, lo: int, hi: int, prefix: _Prefix) -> bool:
        """Record that rank's positions of ``[lo, hi)`` now hold ``prefix``'s KV; True when this
        replaced something (earlier readers must be checked again)."""
        if segs:
            a, b, p = segs[-1]
            if b <= lo:  # an append past everything held: extend the last segment if it is ours
                if p is prefix and self._owns_none(g, rank, b, lo):
                    segs[-1] = (a, hi, p)
                else:
                    segs.append((lo, hi, prefix))
                return False
        kept = [s for s in segs if s[1] <= lo or s[0] >= hi]
        cut = [s for s in segs if not (s[1] <= lo or s[0] >= hi)]
        for a, b, p in cut:  # keep the parts outside [lo, hi)
            if a < lo:
                kept.append((a, lo, p))
            if b > hi:
                kept.append((hi, b, p))
        kept.append((lo, hi, prefix))
        kept.sort(key=lambda s: s[0])
        segs[:] = kept
        return bool(cut)

    # --- reads ----------------------------------------------------------------------------------

    def _read_states(self, chunk, rid: str, rows, prefix: _Prefix) -> None:
        start = chunk.start
        if start == 0:
            return
        for g, row in zip(self.groups, rows):
            if not g.state:
                continue
            i = self._index(g, start - 1)
            blk = row[i] if i < len(row) else None
            held = self._states.get((g.gid, blk))
            if held is None or held[1] != start or not _same(held[0], prefix, start - 1):
                self._violation(
                    "INV-CONTENT-STATE",
                    f"request {rid!r}, group {g.gid}, every rank: chunk at {start} reads state block {blk}, "
                    f"which does not hold the state after exactly this request's first {start} tokens",
                )
                return

    def _read_attention(self, chunk, rid: str, rows, prefix: _Prefix) -> None:
        end = chunk.start + chunk.num_tokens
        for g, row in zip(self.groups, rows):
            if g.state:
                continue
            first = max(0, chunk.start - g.window + 1) if g.window else 0
            verified = self._verified.get((rid, g.gid), 0)
            lo = max(first, verified)  # positions below `verified` were checked and not changed since
            if lo >= end:
                continue
            blocks = self._blocks(g, row, lo, end)
            if blocks is None:
                self._violation(
                    "INV-CONTENT-KV",
                    f"request {rid!r}, group {g.gid}: position {end - 1} reads row index {self._index(g, end - 1)}, "
                    f"past the {len(row)} entries the row holds",
                )
                return
            for i, blk, a, b in blocks:
                key = (g.gid, blk)
                bad = self._check_block(g, key, a, b, prefix)
                if bad is not None:
                    self._violation(
                        "INV-CONTENT-KV",
                        f"request {rid!r}, group {g.gid}, rank {bad[0]}: position {bad[1]} reads block {blk}, "
                        f"which does not hold this request's KV for it",
                    )
                    return
                readers = self._readers.get(key)
                if readers is None:
                    readers = self._readers[key] = {}
                readers[rid] = i
            self._verified[(rid, g.gid)] = end

    def _changed(self, key) -> None:
        """Block ``key``'s earlier contents may have changed: its readers check it again."""
        readers = self._readers.pop(key, None)
        if readers:
            span = self.groups[key[0]].span
            for rid, i in readers.items():
                k = (rid, key[0])
                if self._verified.get(k, 0) > i * span:
                    self._verified[k] = i * span

    def _check_block(self, g: _Shape, key, lo: int, hi: int, prefix: _Prefix) -> Optional[tuple[int, int]]:
        """None if every rank holds ``prefix``'s KV for its positions of ``[lo, hi)`` in block
        ``key``; else (rank, first position it lacks)."""
        pages = self._kv.get(key)
        for r in self._ranks(g, lo, hi):
            segs = pages[r] if pages else ()
            if segs and segs[-1][2] is prefix and segs[-1][0] <= lo and segs[-1][1] >= hi:
                continue  # the reader's own KV, written in one piece (decode, own prefill)
            at = lo  # every position below ``at`` that rank r owns is verified
            for a, b, p in segs:
                if b <= at or a >= hi:
                    continue
                hole = self._last_owned(g, r, at, a)  # an owned position in [at, a) holds nothing
                if hole is not None:
                    return r, hole
                q = self._last_owned(g, r, max(a, at), min(b, hi))  # chained identities: the last decides
                if q is not None and not _same(p, prefix, q):
                    return r, q
                at = min(b, hi)
                if at >= hi:
                    break
            hole = self._last_owned(g, r, at, hi)
            if hole is not None:
                return r, hole
        return None
