"""Shadow checks on vLLM 0.33.0's scheduler-side KV-cache manager, against kvproof's spec.

``attach(kv_cache_manager, layout, sink)`` wraps, on that one instance (vLLM's classes are not
touched), the calls vLLM's ``Scheduler`` makes every step -- ``new_step_starts``,
``get_computed_blocks``, ``allocate_slots``, ``free``, ``take_kv_cache_block_copies`` -- and the
block pool's ``get_new_blocks`` / ``free_blocks``. Each wrapper calls vLLM's method unchanged and
then checks its result against the layout (sizes from ``kvproof.spec``, never re-derived here).

Cheap tier (every call, O(blocks touched)):

* lookups: the hit is on the cache-hit grid and inside the prompt (INV-HIT-BOUND), each group's
  block list realises it (INV-HIT-BLOCKS), a reported shared-prefix junction is sane
  (INV-JUNCTION);
* allocations: a failed one takes no block and orders no copy (INV-ALLOC-ATOMIC); a row never
  outgrows the worker's width (INV-TABLE-WIDTH); every copy-on-write source holds, when the
  step begins, exactly what the copy must carry, and no copy reads another's destination
  (INV-COW-SOURCE-READY); a Mamba chunk starts from a block holding the state after exactly
  its first token count (INV-CONTENT-STATE);
* frees: no reference count goes below zero (INV-POOL-REF-NONNEG); a freed request keeps no
  row in any group (INV-FREE-RELEASES).

Slow tier (once per step, whole state): pool conservation and the free queue
(INV-POOL-CONSERVE, INV-POOL-FREE-IFF-UNREF), every table entry referenced (INV-TABLE-HELD),
every referenced block held by a table or a pending copy (INV-FREE-RELEASES).

Readiness model (for INV-COW-SOURCE-READY and INV-CONTENT-STATE). The worker runs a step's
copies first, as one gather-then-scatter, then the forward pass; so what a copy or a Mamba
chunk reads is what the blocks held when the step began. The checker keeps, per block id,
how many leading positions of its span hold KV (attention) or the prefix length of the state
it holds (Mamba), *as of the start of the current step*: an allocation records the positions
the step's forward will write, and they are applied when the next step starts (for async
scheduling too: a step's copies run after the previous step's forward). A block handed out by
the pool holds nothing. A request freed while a step is being scheduled (preempted) writes
nothing in that step. A KV connector's tokens (``num_external_computed_tokens``) are its load's
writes: a synchronous load's with the step's own, an asynchronous load's once the worker side
reports it received and vLLM caches what arrived (INV-CONNECTOR-LOAD-ARRIVED).
"""

from __future__ import annotations

import functools
from typing import Optional

from kvproof.integrations.vllm.violations import ViolationSink
from kvproof.spec import arith, placement
from kvproof.spec.groups import GroupKind, MambaCacheMode
from kvproof.spec.layout import Layout

_KV, _STATE = 0, 1

# The spec's own functions without their icontract wrappers: on this path (every allocation of
# every step) the contract machinery costs more than the arithmetic, and the spec's tests check
# the contracts themselves.
cdiv = arith.cdiv.__wrapped__
table_index = placement.table_index.__wrapped__


class ManagerChecker:
    """The checks on one vLLM ``KVCacheManager`` (attached with :func:`attach`)."""

    def __init__(self, kvm, layout: Layout, sink: ViolationSink, slow: bool = False, scheduler=None) -> None:
        self.kvm = kvm
        self.layout = layout
        self.sink = sink
        self.slow = slow
        self.scheduler = scheduler
        self.pool = kvm.block_pool
        self.managers = kvm.coordinator.single_type_managers
        if len(self.managers) != len(layout.groups):
            raise ValueError(f"vLLM has {len(self.managers)} KV-cache groups, the layout {len(layout.groups)}")
        groups = layout.groups
        self.block = [g.effective_block_size for g in groups]
        self.width = [g.max_num_blocks_per_req for g in groups]
        self.label = [g.group.label for g in groups]
        self.state_group = [g.group.kind is GroupKind.MAMBA for g in groups]
        self.align_state = [g.group.kind is GroupKind.MAMBA and g.group.mamba_cache_mode is MambaCacheMode.ALIGN
                            for g in groups]
        self.cacheable = [g.group.prefix_cacheable for g in groups]
        self.alignment = layout.cache_hit_alignment
        self._groups = [(g, m, self.block[g], self.width[g], self.state_group[g], self.align_state[g])
                        for g, m in enumerate(self.managers)]
        self.step = 0
        self.num_copies = 0
        self._filled: dict[int, int] = {}  # block id -> leading positions of its span with KV
        self._state: dict[int, int] = {}  # block id -> prefix length of the state it holds
        self._writes: dict[str, list[tuple[int, int, int, int]]] = {}  # request -> (kind, block, a, b)
        #: request -> (kind, block, a, b, first position of the block's span): a KV connector's
        #: asynchronous load in flight, then (``_arrived``) reported received by the worker side,
        #: applied when vLLM caches what arrived (``_cache_blocks``).
        self._loads: dict[str, list[tuple[int, int, int, int, int]]] = {}
        self._arrived: dict[str, list[tuple[int, int, int, int, int]]] = {}
        self._copies: list[tuple[int, int, int]] = []  # this step: (src, dst, tokens the dst may keep)
        self._copy_src: dict[int, int] = {}  # dst -> src, this step
        self._copy_srcs: set[int] = set()
        self._holder: dict[int, str] = {}  # block id -> the request whose row took it last (names a leak)
        self._unchecked_copies = 0
        self._scheduling = False
        self._request: Optional[str] = None
        self._wrap()

    # --- wiring ---------------------------------------------------------------------------------

    def _wrap(self) -> None:
        kvm, pool = self.kvm, self.pool
        for name in ("new_step_starts", "get_computed_blocks", "allocate_slots", "cache_blocks", "free",
                     "take_kv_cache_block_copies"):
            setattr(kvm, name, _bind(getattr(self, "_" + name), getattr(kvm, name)))
        # Where the worker side's finished_recving reaches the Scheduler (vLLM-internal); without
        # it (a manager checked alone) vLLM's cache_blocks is taken as the arrival.
        self._sees_arrivals = self.scheduler is not None and hasattr(self.scheduler, "_update_from_kv_xfer_finished")
        if self._sees_arrivals:
            self.scheduler._update_from_kv_xfer_finished = _bind(self._kv_xfer_finished,
                                                                 self.scheduler._update_from_kv_xfer_finished)
        pool.get_new_blocks = _bind(self._get_new_blocks, pool.get_new_blocks)
        pool.free_blocks = _bind(self._free_blocks, pool.free_blocks)
        kvm._kvproof_checker = self

    def _where(self, request_id: Optional[str] = None) -> str:
        rid = request_id if request_id is not None else self._request
        return f"step {self.step}" + (f", request {rid!r}" if rid is not None else "")

    # --- the step -------------------------------------------------------------------------------

    def _new_step_starts(self, original) -> None:
        """The previous step's copies and forward pass have run (or will, before this step's
        copies): apply them to the readiness model, then let vLLM start the step."""
        self._apply_step()
        if self.slow:
            self.check_whole_state()
        self.step += 1
        self._scheduling = True
        self.sink.step_checked()
        return original()

    def _apply_step(self) -> None:
        filled, state = self._filled, self._state
        gathered = [(dst, min(filled.get(src, 0), keep), state.get(src)) for src, dst, keep in self._copies]
        for dst, n, s in gathered:  # one gather-then-scatter, as the worker runs it
            filled[dst] = n
            if s is None:
                state.pop(dst, None)
            else:
                state[dst] = s
        for writes in self._writes.values():
            for kind, blk, a, b in writes:
                if kind == _STATE:
                    state[blk] = a
                elif filled.get(blk, 0) >= a:
                    filled[blk] = max(filled.get(blk, 0), b)
        self._writes.clear()
        self._copies.clear()
        self._copy_src.clear()
        self._copy_srcs.clear()

    def _take_kv_cache_block_copies(self, original):
        copies, retained = original()
        if len(copies) != self._unchecked_copies:
            self.sink.report(
                "INV-COW-SOURCE-READY",
                f"step {self.step}: vLLM hands the worker {len(copies)} copies, but {self._unchecked_copies} were "
                "ordered by allocations the checker saw; the others were not checked",
            )
        self._unchecked_copies = 0
        self.num_copies += len(copies)
        self._scheduling = False
        return copies, retained

    # --- lookups --------------------------------------------------------------------------------

    def _get_computed_blocks(self, original, request, max_cache_hit_length=None):
        blocks, hit, junction = original(request, max_cache_hit_length)
        limit = request.num_tokens - 1 if max_cache_hit_length is None else min(max_cache_hit_length, request.num_tokens - 1)
        if hit % self.alignment or hit > limit:
            self.sink.report(
                "INV-HIT-BOUND",
                f"{self._where(request.request_id)}: hit {hit} must be a multiple of the cache-hit alignment "
                f"{self.alignment} and at most {limit} (num_tokens - 1 = {request.num_tokens - 1})",
            )
        for g, group_blocks in enumerate(blocks.blocks):
            want = cdiv(hit, self.block[g]) if self.cacheable[g] else 0
            if len(group_blocks) != want or (want and group_blocks[-1].is_null):
                self.sink.report(
                    "INV-HIT-BLOCKS",
                    f"{self._where(request.request_id)}, group {g} ({self.label[g]}): a hit of {hit} tokens needs "
                    f"{want} entries ending in a real block (effective block {self.block[g]}), got "
                    f"{[b.block_id for b in group_blocks]}",
                )
        if junction and not (hit < junction <= limit and junction % self.alignment == 0):
            self.sink.report(
                "INV-JUNCTION",
                f"{self._where(request.request_id)}: shared-prefix junction {junction} must lie above the hit {hit}, "
                f"at most {limit}, on the cache-hit grid of {self.alignment}",
            )
        return blocks, hit, junction

    # --- allocation -----------------------------------------------------------------------------

    def _allocate_slots(self, original, request, num_new_tokens, num_new_computed_tokens=0,
                        new_computed_blocks=None, num_lookahead_tokens=0, num_external_computed_tokens=0,
                        *args, **kwargs):
        rid = request.request_id
        self._request = rid
        free_before = self.pool.get_num_free_blocks()
        before = [(len(m._pending_cow_copies), len(m.req_to_blocks.get(rid, ()))) for m in self.managers]
        loaded_from = request.num_computed_tokens + num_new_computed_tokens  # a connector writes [loaded_from, start)
        start = loaded_from + num_external_computed_tokens
        delayed = kwargs.get("delay_cache_blocks", args[0] if args else False)
        try:
            result = original(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                              num_lookahead_tokens, num_external_computed_tokens, *args, **kwargs)
        finally:
            self._request = None
        if result is None:
            self._check_failed_allocation(rid, free_before, before)
            return None
        end = start + num_new_tokens
        writes = self._writes.get(rid)
        if writes is None:
            writes = self._writes[rid] = []
        loads: list[tuple[int, int, int, int, int]] = []
        forward: list[tuple[int, int, int, int]] = []
        for g, m, block, width, state, align in self._groups:
            row = m.req_to_blocks.get(rid)
            if not row:
                continue
            for b in row[before[g][1]:]:  # the entries this call added
                if not b.is_null:
                    self._holder[b.block_id] = rid
            if len(row) > width:
                self.sink.report(
                    "INV-TABLE-WIDTH",
                    f"{self._where(rid)}, group {g} ({self.label[g]}): the row grows to {len(row):,} entries, "
                    f"past the worker's width of {width:,}",
                )
            pending, seen = m._pending_cow_copies, before[g][0]
            if len(pending) > seen:
                for src, dst in pending[seen:]:
                    self._check_copy(g, rid, src.block_id, dst.block_id, start)
            if state:
                if align:  # the chunk reads the state at `start` and leaves the one at `end`
                    if start > loaded_from:  # the connector loads the state the chunk reads
                        loads.append((_STATE, row[table_index(start - 1, block, 1, False)].block_id, start, 0, start))
                    elif start:
                        self._check_state_read(g, rid, row, start)
                    if end > start:
                        forward.append((_STATE, row[table_index(end - 1, block, 1, False)].block_id, end, 0))
                continue
            if start > loaded_from:
                for j in range(table_index(loaded_from, block, 1, False), table_index(start - 1, block, 1, False) + 1):
                    b = row[j]
                    if not b.is_null:
                        lo = j * block
                        loads.append((_KV, b.block_id, max(loaded_from - lo, 0), min(start - lo, block), lo))
            if end > start:
                for j in range(table_index(start, block, 1, False), table_index(end - 1, block, 1, False) + 1):
                    b = row[j]
                    if not b.is_null:
                        lo = j * block
                        forward.append((_KV, b.block_id, max(start - lo, 0), min(end - lo, block)))
        if delayed and loads:  # written when the load finishes: vLLM then caches what arrived
            self._loads.setdefault(rid, []).extend(loads)
        else:  # a synchronous load lands before this step's forward pass reads it
            writes.extend(w[:4] for w in loads)
        writes.extend(forward)
        return result

    def _kv_xfer_finished(self, original, kv_connector_output):
        for rid in kv_connector_output.finished_recving or ():
            loads = self._loads.pop(rid, None)
            if loads is not None:
                self._arrived[rid] = loads
        return original(kv_connector_output)

    def _cache_blocks(self, original, request, num_computed_tokens: int):
        """After an asynchronous load vLLM caches the ``num_computed_tokens`` it counts as loaded
        (fewer after a failed load): what arrived is readable from then on. Caching a load the
        worker side has not reported received is INV-CONNECTOR-LOAD-ARRIVED (the request would
        compute on, and publish, KV that is not there yet)."""
        rid = request.request_id
        if rid in self._loads and not self._sees_arrivals:
            self._arrived[rid] = self._loads.pop(rid)
        elif rid in self._loads:
            self.sink.report(
                "INV-CONNECTOR-LOAD-ARRIVED",
                f"{self._where(rid)}: vLLM caches {num_computed_tokens} computed tokens while the connector's load "
                "into its blocks is still in flight (no finished_recving for it yet)",
            )
            self._loads.pop(rid)
        loads = self._arrived.pop(rid, None)
        if loads:
            filled, state = self._filled, self._state
            for kind, blk, a, b, lo in loads:
                if kind == _STATE:
                    if num_computed_tokens >= a:
                        state[blk] = a
                else:
                    b = min(b, num_computed_tokens - lo)
                    if b > a and filled.get(blk, 0) >= a:
                        filled[blk] = max(filled.get(blk, 0), b)
        return original(request, num_computed_tokens)

    def _check_failed_allocation(self, rid, free_before, before) -> None:
        """vLLM releases blocks outside a window before it knows whether the allocation fits
        (``remove_skipped_blocks``); anything more is a change a failed call must not make."""
        grew = [g for g, m in enumerate(self.managers) if len(m.req_to_blocks.get(rid, ())) > before[g][1]]
        copied = [g for g, m in enumerate(self.managers) if len(m._pending_cow_copies) > before[g][0]]
        free_after = self.pool.get_num_free_blocks()
        if free_after < free_before or grew or copied:
            self.sink.report(
                "INV-ALLOC-ATOMIC",
                f"{self._where(rid)}: allocate_slots returned None but took {max(free_before - free_after, 0)} blocks, "
                f"grew the rows of groups {grew} and ordered copies in groups {copied}",
            )

    def _check_copy(self, g: int, rid: str, src: int, dst: int, hit: int) -> None:
        """A copy-on-write of a partial hit of ``hit`` tokens in group ``g``, run when the step
        begins: ``src`` must then hold what the copy carries to ``dst``."""
        self._unchecked_copies += 1
        where = f"{self._where(rid)}, group {g} ({self.label[g]}): copy {src} -> {dst}"
        if src in self._copy_src or dst in self._copy_srcs or dst in self._copy_src:
            self.sink.report("INV-COW-SOURCE-READY",
                             f"{where} chains with another copy of this step (the worker runs them as one batch)")
        block = self.block[g]
        if self.state_group[g]:
            held = self._state.get(src)
            if held != hit:
                has = "no state" if held is None else f"the state after {held} tokens"
                self.sink.report(
                    "INV-COW-SOURCE-READY",
                    f"{where} must carry the state after {hit} tokens, but block {src} holds {has} when the step begins",
                )
            keep = block
        else:
            first = hit // block * block
            keep = hit - first
            held = self._filled.get(src, 0)
            if held < keep:
                self.sink.report(
                    "INV-COW-SOURCE-READY",
                    f"{where} reads positions [{first}, {hit}) of block {src}, which holds only [{first}, {first + held}) "
                    f"when the step begins (the rest is written by this step's forward pass, after the copy)",
                )
        self._copies.append((src, dst, keep))
        self._copy_src[dst] = src
        self._copy_srcs.add(src)

    def _check_state_read(self, g: int, rid: str, row, start: int) -> None:
        """A Mamba chunk starting at ``start`` > 0 reads the state at row index
        ``cdiv(start, B) - 1``, which must hold the state after exactly ``start`` tokens when
        the step begins (directly, or as the destination of one of this step's copies)."""
        idx = table_index(start - 1, self.block[g], 1, False)  # where the state after `start` tokens lives
        blk = row[idx].block_id if idx < len(row) else None
        source = self._copy_src.get(blk, blk)
        held = self._state.get(source)
        if held != start:
            has = "no state" if held is None else f"the state after {held} tokens"
            via = f" (copied from block {source})" if source != blk else ""
            self.sink.report(
                "INV-CONTENT-STATE",
                f"{self._where(rid)}, group {g} ({self.label[g]}): the chunk starting at {start} reads block {blk} "
                f"at row index {idx}{via}, which holds {has} when the step begins",
            )

    # --- freeing --------------------------------------------------------------------------------

    def _free(self, original, request) -> None:
        rid = request.request_id
        self._request = rid
        if self._scheduling:  # preempted while this step is scheduled: its forward never runs
            self._writes.pop(rid, None)
        self._loads.pop(rid, None)  # a load still in flight is abandoned with the blocks
        self._arrived.pop(rid, None)
        try:
            original(request)
        finally:
            self._request = None
        kept = [g for g, m in enumerate(self.managers) if rid in m.req_to_blocks]
        if kept:
            self.sink.report("INV-FREE-RELEASES", f"{self._where(rid)}: after free the request still has rows in groups {kept}")

    # --- the pool -------------------------------------------------------------------------------

    def _get_new_blocks(self, original, num_blocks):
        blocks = original(num_blocks)
        for b in blocks:  # handed out: whatever the block held is gone
            self._filled.pop(b.block_id, None)
            self._state.pop(b.block_id, None)
        return blocks

    def _free_blocks(self, original, ordered_blocks) -> None:
        blocks = list(ordered_blocks)
        seen: dict[int, int] = {}
        for b in blocks:
            if b.is_null or (b.pool is not None and b.pool is not self.pool):
                continue
            n = seen[b.block_id] = seen.get(b.block_id, 0) + 1
            if b.ref_cnt < n:
                self.sink.report(
                    "INV-POOL-REF-NONNEG",
                    f"{self._where()}: block {b.block_id} is freed {'again ' if n > 1 else ''}with reference count "
                    f"{b.ref_cnt - n + 1}; it would drop to {b.ref_cnt - n}",
                )
        return original(blocks)

    # --- slow tier ------------------------------------------------------------------------------

    def check_whole_state(self) -> None:
        """Whole pool and every table, O(num_blocks + table entries); no state change."""
        pool = self.pool
        queue, node = [], pool.free_block_queue.fake_free_list_head.next_free_block
        while node is not None and node is not pool.free_block_queue.fake_free_list_tail:
            queue.append(node)
            node = node.next_free_block
        in_queue_referenced = [b.block_id for b in queue if b.ref_cnt != 0 or b.is_null]
        if in_queue_referenced:
            self.sink.report("INV-POOL-FREE-IFF-UNREF",
                             f"{self._where()}: blocks {in_queue_referenced[:8]} are in the free queue with references")
        unreferenced = sum(1 for b in pool.blocks if not b.is_null and b.ref_cnt == 0)
        if len(queue) != pool.get_num_free_blocks() or unreferenced != len(queue):
            self.sink.report(
                "INV-POOL-CONSERVE",
                f"{self._where()}: {unreferenced} unreferenced blocks, {len(queue)} in the free queue, "
                f"free counter {pool.get_num_free_blocks()}",
            )
        holders: dict[int, int] = {}
        for m in self.managers:
            for row in m.req_to_blocks.values():
                for b in row:
                    if not b.is_null:
                        holders[b.block_id] = holders.get(b.block_id, 0) + 1
        short = [(bid, n, pool.blocks[bid].ref_cnt) for bid, n in holders.items() if pool.blocks[bid].ref_cnt < n]
        if short:
            bid, n, ref = short[0]
            self.sink.report("INV-TABLE-HELD", f"{self._where()}: block {bid} is in {n} rows but has reference count {ref}")
        kept = {b.block_id for _, blocks in getattr(self.scheduler, "deferred_frees", ()) for b in blocks}
        leaked = [b.block_id for b in pool.blocks
                  if not b.is_null and b.ref_cnt > 0 and b.block_id not in holders and b.block_id not in kept]
        if leaked:
            holders = [f"block {b} by request {self._holder[b]!r}" for b in leaked[:8] if b in self._holder]
            last = f"; last held: {', '.join(holders)}" if holders else ""
            self.sink.report("INV-FREE-RELEASES",
                             f"{self._where()}: blocks {leaked[:8]} are referenced but held by no request (leaked{last})")


def _bind(check, original):
    """``check`` with vLLM's method as its first argument (a C-level partial: no extra frame)."""
    call = functools.partial(check, original)
    call.__wrapped__ = original
    return call


def attach(kvm, layout: Layout, sink: ViolationSink, slow: bool = False, scheduler=None) -> ManagerChecker:
    """Mutates ``kvm`` (instance attributes only): install the checks, once. Returns the checker."""
    existing = getattr(kvm, "_kvproof_checker", None)
    if existing is not None:
        return existing
    return ManagerChecker(kvm, layout, sink, slow=slow, scheduler=scheduler)
