"""The content oracle: what every block really holds, on every DCP rank.

Structural checks (ref counts, keys) cannot see a copy of the wrong bytes. The oracle replays a
step the way the worker would -- block-table rows, copies at step start as one batched
gather-then-scatter, forward writes through the DCP slot mapping -- and records, per rank, which
prefix each KV slot and each state block was computed for. Every read of the forward pass is
then checked: attention must find, for every position it attends to, the KV of exactly this
request's prefix up to that position; a Mamba chunk must start from the state of exactly the
prefix before it. A wrong hit, a copy from a block that is not ready, a chained copy, a freed
block still in use, or a table that is too narrow all show up here as a violation.
"""

from __future__ import annotations

from typing import NamedTuple

from kvproof.spec.groups import GroupKind
from kvproof.spec.layout import Layout


class _Shape(NamedTuple):
    gid: int
    state: bool  # Mamba: one state per block; else attention KV per slot
    bs: int  # physical block size on one rank
    block: int  # global tokens per block id (B_g)
    sharded: bool  # DCP shards its positions (dcp > 1)
    width: int  # worker row width
    window: int  # sliding window in tokens, 0 for full attention


class ContentOracle:
    def __init__(self, layout: Layout) -> None:
        self.dcp = layout.dcp
        self.interleave = layout.config.interleave
        self.groups = []
        for g in layout.groups:
            state = g.group.kind is GroupKind.MAMBA
            block = g.effective_block_size
            if state and not g.group.prefix_cacheable:
                block = 1 << 62
            self.groups.append(_Shape(
                g.index, state, g.group.block_size, block, g.group.is_sharded and layout.dcp > 1,
                g.table_width, g.group.sliding_window or 0,
            ))
        # per rank: (group, block) -> {local offset: prefix id} (attention) or prefix id (state)
        self.kv = [dict() for _ in range(self.dcp)]
        self.rows: dict[str, list[list[int]]] = {}
        self._ids: dict[str, list[int]] = {}
        self.violations: list[str] = []

    # --- prefix identities ----------------------------------------------------------------------

    def prefix_ids(self, request) -> list[int]:
        """``ids[p]`` names the token prefix ``[0, p]`` (and the cache salt)."""
        ids = self._ids.get(request.request_id)
        if ids is None:
            ids = self._ids[request.request_id] = []
        prev = ids[-1] if ids else hash(("salt", request.cache_salt))
        for tok in request.token_ids[len(ids):]:
            prev = hash((prev, tok))
            ids.append(prev)
        return ids

    # --- one step -------------------------------------------------------------------------------

    def run_step(self, plan) -> None:
        """Apply a scheduled step: rows, copies (batched), then each chunk's reads and writes."""
        for chunk in plan.chunks:
            rid = chunk.request.request_id
            if chunk.overwrite or rid not in self.rows:
                self.rows[rid] = [list(b) for b in chunk.new_blocks]
            else:
                for row, new in zip(self.rows[rid], chunk.new_blocks):
                    row.extend(new)
            for g, row in zip(self.groups, self.rows[rid]):
                if len(row) > g.width:
                    self._violation("INV-TABLE-WIDTH", f"request {rid!r}, group {g.gid}: row of {len(row)} entries > width {g.width}")
        self._copy(plan.copies)
        for chunk in plan.chunks:
            self._read_states(chunk)
        for chunk in plan.chunks:
            self._write(chunk)
        for chunk in plan.chunks:
            self._read_attention(chunk)

    def forget(self, request) -> None:
        self.rows.pop(request.request_id, None)
        self._ids.pop(request.request_id, None)

    def _violation(self, inv: str, detail: str) -> None:
        self.violations.append(f"{inv}: {detail}")

    def _copy(self, copies) -> None:
        # Batched gather-then-scatter, as the worker runs it: every source is read before any
        # destination is written, so a chained copy reads stale contents.
        for kv in self.kv:
            gathered = [(gid, dst, kv.get((gid, src))) for gid, src, dst in copies]
            for gid, dst, content in gathered:
                kv[(gid, dst)] = dict(content) if isinstance(content, dict) else content

    def _slot(self, p, g: _Shape, row):
        """(rank or None for all ranks, block id, local offset) of position ``p``."""
        bs = g.bs
        if g.sharded:
            virtual = bs * self.dcp
            vb, off = divmod(p, virtual)
            owner = (off // self.interleave) % self.dcp
            local = (off // (self.interleave * self.dcp)) * self.interleave + off % self.interleave
            return owner, row[vb], local
        return None, row[p // g.block], p % bs

    def _write(self, chunk) -> None:
        req = chunk.request
        ids = self.prefix_ids(req)
        end = chunk.start + chunk.num_tokens
        for g, row in zip(self.groups, self.rows[req.request_id]):
            if g.state:
                blk = row[-(-end // g.block) - 1]
                for kv in self.kv:
                    kv[(g.gid, blk)] = ids[end - 1]
                continue
            for p in range(chunk.start, end):
                rank, blk, off = self._slot(p, g, row)
                for r in (range(self.dcp) if rank is None else (rank,)):
                    page = self.kv[r].get((g.gid, blk))
                    if page is None:  # never written on this rank, or copied from such a page
                        page = self.kv[r][(g.gid, blk)] = {}
                    page[off] = ids[p]

    def _read_states(self, chunk) -> None:
        req, start = chunk.request, chunk.start
        if start == 0:
            return
        ids = self.prefix_ids(req)
        for g, row in zip(self.groups, self.rows[req.request_id]):
            if not g.state:
                continue
            blk = row[-(-start // g.block) - 1]
            for r, kv in enumerate(self.kv):
                if kv.get((g.gid, blk)) != ids[start - 1]:
                    self._violation(
                        "INV-CONTENT-STATE",
                        f"request {req.request_id!r}, group {g.gid}, rank {r}: chunk at {start} reads state block {blk}, "
                        f"which does not hold the state after exactly this request's first {start} tokens",
                    )
                    return

    def _read_attention(self, chunk) -> None:
        req = chunk.request
        ids = self.prefix_ids(req)
        end = chunk.start + chunk.num_tokens
        for g, row in zip(self.groups, self.rows[req.request_id]):
            if g.state:
                continue
            first = max(0, chunk.start - g.window + 1) if g.window else 0
            for p in range(first, end):
                rank, blk, off = self._slot(p, g, row)
                for r in (range(self.dcp) if rank is None else (rank,)):
                    if (self.kv[r].get((g.gid, blk)) or {}).get(off) != ids[p]:
                        self._violation(
                            "INV-CONTENT-KV",
                            f"request {req.request_id!r}, group {g.gid}, rank {r}: position {p} reads block {blk} "
                            f"offset {off}, which does not hold this request's KV for it",
                        )
                        return
