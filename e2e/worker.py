"""One DCP rank's worker: kvproof's block tables and slot mappings, the paged cache, and the
model's forward pass over one scheduler step.

A step arrives as a :class:`WorkerStep` (what a vLLM worker receives from the scheduler: new
rows or appended block ids per request, the step's block copies, the tokens to compute). The
worker then, in this order:

1. drops the rows of requests that finished or were preempted, stages each chunk's block ids
   (``overwrite`` for a (re)admitted request) and applies them in one launch;
2. runs the step's copies (copy-on-write) on its own memory, before any forward write;
3. runs the forward pass layer by layer over the whole batch: attention layers write K and V
   through this rank's slot mapping (PAD_SLOT where another rank owns a position), attend over
   the positions this rank owns -- read back through the block table -- and merge the ranks'
   partials exactly by log-sum-exp; recurrent layers read the state for the chunk's start at
   row ``cdiv(start, B) - 1`` and write the state for its end at ``cdiv(end, B) - 1``.
"""

from __future__ import annotations

import dataclasses
import os
import signal

import torch

from kvproof.e2e.faults import Faults
from kvproof.e2e.model import DTYPE, TinyHybridModel, merge_partials
from kvproof.e2e.paged_cache import PagedCache
from kvproof.kernels.block_table import BlockTables, TableGroup
from kvproof.spec.arith import cdiv
from kvproof.spec.groups import GroupKind
from kvproof.spec.layout import Layout
from kvproof.spec.placement import local_seq_len


@dataclasses.dataclass(frozen=True)
class ChunkWork:
    """One request's share of a step: compute positions ``[start, start + len(tokens))``."""

    request_id: str
    start: int
    tokens: tuple[int, ...]
    new_blocks: tuple[tuple[int, ...], ...]  # per group: ids to append (the whole row if overwrite)
    overwrite: bool


@dataclasses.dataclass(frozen=True)
class WorkerStep:
    step: int
    chunks: tuple[ChunkWork, ...]
    copies: tuple[tuple[int, int, int], ...]  # (group_id, src, dst), run before the forward pass
    released: tuple[str, ...]  # requests whose rows are dropped first (finished or preempted)


class Worker:
    """Mutable: request rows, block tables and cache memory of one rank. ``comm`` is this
    rank's communicator (:class:`~kvproof.e2e.communicators.GlooRanks` or ``SingleRank``)."""

    def __init__(
        self,
        layout: Layout,
        model: TinyHybridModel,
        comm,
        num_blocks: int,
        max_num_reqs: int,
        faults: Faults = Faults(),
        backend: str = "torch",
    ) -> None:
        self.layout, self.model, self.comm, self.faults = layout, model, comm, faults
        self.rank, self.dcp = comm.rank, layout.dcp
        self.interleave = layout.config.interleave
        self.cache = PagedCache(layout, model.layers, model.config, num_blocks)
        self.tables = self._build_tables(max_num_reqs, backend)
        self.rows: dict[str, int] = {}
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))
        # Tokens per state block index of each group (B_g: replicated, so never scaled by DCP).
        self.state_block = [g.effective_block_size for g in layout.groups]

    def _build_tables(self, max_num_reqs: int, backend: str) -> BlockTables:
        f = self.faults
        # The slot mapping's rank is the only place a rank's identity enters the tables.
        slot_rank = (self.rank + f.slot_mapping_rank_shift) % self.dcp
        if not f.mamba_width_divided_by_dcp:
            return BlockTables.from_layout(self.layout, max_num_reqs, dcp_rank=slot_rank, backend=backend)
        # vLLM 0.33's rule for every group (docs/vllm-semantics.md §6.3):
        # cdiv(max_len, block_size * dcp).
        max_len = self.layout.config.max_model_len
        groups = [
            TableGroup(
                cdiv(max_len, g.group.block_size * self.dcp) if g.group.kind is GroupKind.MAMBA else g.table_width,
                g.group.block_size, g.group.is_sharded, g.group.label,
            )
            for g in self.layout.groups
        ]
        return BlockTables(
            groups, max_num_reqs, dcp=self.dcp, dcp_rank=slot_rank,
            interleave=self.interleave, backend=backend,
        )

    # --- one step -------------------------------------------------------------------------------

    def execute(self, step: WorkerStep) -> torch.Tensor:
        """Mutates. Run one step; returns logits ``[T, V]`` of every computed token, chunks in
        order (identical on every rank)."""
        if self.faults.rank_killed_at_step == (self.rank, step.step):
            os.kill(os.getpid(), signal.SIGKILL)
        self._update_rows(step)
        if not self.faults.copies_after_forward:
            self.cache.copy_blocks(list(step.copies))
        logits = self._forward(step.chunks)
        if self.faults.copies_after_forward:
            self.cache.copy_blocks(list(step.copies))
        return logits

    def _update_rows(self, step: WorkerStep) -> None:
        for rid in step.released:
            row = self.rows.pop(rid, None)
            if row is not None:
                self.tables.clear_request(row)
                self.free_rows.append(row)
        for chunk in step.chunks:
            row = self.rows.get(chunk.request_id)
            if row is None:
                if not chunk.overwrite:
                    raise RuntimeError(f"request {chunk.request_id!r} appends blocks but has no row on rank {self.rank}")
                if not self.free_rows:
                    raise RuntimeError(f"rank {self.rank}: no free request row for {chunk.request_id!r}")
                row = self.rows[chunk.request_id] = self.free_rows.pop()
            self.tables.append_block_ids(row, chunk.new_blocks, chunk.overwrite)
        self.tables.apply_staged_writes()

    def _forward(self, chunks: tuple[ChunkWork, ...]) -> torch.Tensor:
        model = self.model
        if not chunks:  # an idle step (nothing arrived yet): every rank skips it alike
            return torch.empty(0, model.config.vocab_out, dtype=DTYPE)
        idx = [self.rows[c.request_id] for c in chunks]
        query_start = [0]
        for c in chunks:
            query_start.append(query_start[-1] + len(c.tokens))
        positions = torch.cat([torch.arange(c.start, c.start + len(c.tokens), dtype=torch.int64) for c in chunks])
        tokens = torch.tensor([t for c in chunks for t in c.tokens], dtype=torch.int64)
        slots = self.tables.compute_slot_mappings(idx, query_start, positions)  # [G, T]
        rows = [t.to(torch.int64).clone() for t in self.tables.gather(idx)]  # per group [B, W_g]
        key_index = {}  # group -> per chunk (blocks, offsets, global positions) of this rank's keys
        x = model.embed(tokens, positions)  # [T, d]
        for spec in model.layers:
            h = model.norm(x)
            g = spec.group
            if spec.recurrent:
                heads = self._recurrent(spec.index, g, h, chunks, rows[g], query_start)
            else:
                if g not in key_index:
                    key_index[g] = [self._local_keys(g, rows[g][b], c.start + len(c.tokens)) for b, c in enumerate(chunks)]
                heads = self._attention(spec.index, g, h, positions, slots[g], key_index[g], query_start)
            x = x + model.output(spec.index, heads)
        return model.logits(x)

    # --- attention ------------------------------------------------------------------------------

    def _local_keys(self, group: int, row: torch.Tensor, end: int) -> tuple[torch.Tensor, ...]:
        """Where this rank's keys among positions ``[0, end)`` live: block ids, offsets and
        global positions, int64 ``[L]`` each, read from the block-table ``row`` ``[W]``.
        Derived from the table and the placement rule, never from the slot mapping, so a wrong
        slot mapping shows up as keys that are not where attention looks for them."""
        gl = self.layout.groups[group]
        bs = gl.group.block_size
        if gl.group.is_sharded and self.dcp > 1:
            global_pos = owned_positions(end, bs, self.dcp, self.interleave, self.rank)
        else:
            global_pos = torch.arange(end, dtype=torch.int64)
        local = torch.arange(global_pos.numel(), dtype=torch.int64)
        return row[local // bs], local % bs, global_pos

    def _attention(self, layer, group, h, positions, slots, keys, query_start) -> torch.Tensor:
        """Paged attention of the batch: normed ``h`` ``[T, d]`` -> heads ``[T, H, Dh]``.

        Writes this rank's K/V through ``slots`` (int64 ``[T]``, PAD_SLOT where another rank
        owns the token), then attends each chunk's queries (global ``positions`` int64 ``[T]``;
        chunk ``b`` is ``[query_start[b], query_start[b + 1])``) over this rank's keys
        ``keys[b]`` (from :meth:`_local_keys`), then merges every rank's partial exactly."""
        model = self.model
        q, k, v = (model.project(layer, h, name) for name in ("q", "k", "v"))
        self.cache.write_kv(layer, slots, k, v)
        outs, lses = [], []
        for b, (blocks, offsets, key_pos) in enumerate(keys):
            lo, hi = query_start[b], query_start[b + 1]
            k_local, v_local = self.cache.read_kv(layer, blocks, offsets)
            out, lse = model.attention_partial(q[lo:hi], positions[lo:hi], k_local, v_local, key_pos)
            outs.append(out)
            lses.append(lse)
        out, lse = torch.cat(outs), torch.cat(lses)
        return merge_partials(self.comm.all_gather(out), self.comm.all_gather(lse))

    # --- recurrence -----------------------------------------------------------------------------

    def _recurrent(self, layer, group, h, chunks, rows, query_start) -> torch.Tensor:
        """Gated delta rule over each chunk: normed ``h`` ``[T, d]`` -> heads ``[T, H, Dh]``.

        ``rows``: the group's batch block table, int64 ``[B, W_g]``; chunk ``b``'s tokens are
        ``[query_start[b], query_start[b + 1])``. Reads every chunk's start state before
        writing any end state (a batched kernel's order); a chunk that ends in the block it
        started in updates that state in place."""
        model, c, b_g = self.model, self.model.config, self.state_block[group]
        q, k, v, decay, beta = model.recurrent_inputs(layer, h)
        starts = []
        for b, chunk in enumerate(chunks):
            if chunk.start == 0:
                starts.append(torch.zeros(c.heads, c.head_dim, c.head_dim, dtype=DTYPE))
            else:
                block = rows[b, cdiv(chunk.start, b_g) - 1].reshape(1)
                starts.append(self.cache.read_states(layer, block)[0])
        heads, finals, ends = [], [], []
        for b, chunk in enumerate(chunks):
            lo, hi = query_start[b], query_start[b + 1]
            out, final = model.delta_rule_scan(starts[b], q[lo:hi], k[lo:hi], v[lo:hi], decay[lo:hi], beta[lo:hi])
            heads.append(out)
            finals.append(final)
            ends.append(rows[b, cdiv(chunk.start + len(chunk.tokens), b_g) - 1])
        self.cache.write_states(layer, torch.stack(ends), torch.stack(finals))
        return torch.cat(heads)


def owned_positions(num_tokens: int, block_size: int, dcp: int, interleave: int, rank: int) -> torch.Tensor:
    """Global positions of the first ``num_tokens`` that ``rank`` stores for a DCP-sharded
    group, in local order: int64 ``[local_seq_len(num_tokens)]``, entry ``l`` is the position
    at local position ``l``. The inverse of :func:`kvproof.spec.placement.local_position`:
    with ``bs`` the block size, D ranks and interleave I, local ``l`` holds
    ``(l // bs) * bs * D + ((l % bs) // I) * I * D + rank * I + l % I``. Local order is
    position order, so a rank's keys below ``num_tokens`` are exactly its first
    ``local_seq_len`` local positions."""
    local = torch.arange(local_seq_len(num_tokens, rank, dcp, interleave), dtype=torch.int64)
    block, within = local // block_size, local % block_size
    run_start = (within // interleave) * interleave * dcp + rank * interleave
    return block * block_size * dcp + run_start + local % interleave
