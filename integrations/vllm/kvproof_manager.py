"""kvproof's KV-cache manager in vLLM 0.33.0's Scheduler: ``KvproofKVCacheManager`` has the
surface the Scheduler and the engine use of vLLM's ``KVCacheManager``
(``manager_surface.SURFACE``; docs/vllm-manager-surface.md says what each use expects back),
backed by kvproof's facade (``impl.kv_cache_manager.KVCacheManager``: coordinator and pool).
``KVPROOF_MANAGER=kvproof`` makes the Scheduler build it (plugin.py); docs/vllm.md, "Serving
with kvproof's manager", is the operator's side.

When tokens are keyed. kvproof keys a block only once the forward pass has written it. At
any manager call a request's written tokens are ``num_computed_tokens - num_in_flight_tokens``
(the Scheduler raises both when it schedules and lowers ``num_in_flight_tokens`` when the step's
output returns), so every keying here uses that count:

* at ``new_step_starts`` (the top of ``schedule()``), for every request allocated since the
  last one. With sync scheduling the previous step's output has been processed by then, so this
  keys everything it wrote; with async scheduling (step N+1 is scheduled before step N returns)
  it keys what has returned, and the rest follows one step later;
* at ``cache_blocks``, which vLLM's ``update_from_output`` calls with that count after a step
  with drafts or async placeholders: accepted tokens are keyed as soon as they are known;
* at ``free``, before the blocks go back (a finished or preempted request's written tokens).

Never keyed: drafts, lookahead slots and placeholders, which have slots but no known token.
With async scheduling a Mamba state is keyed after the request's next step was allocated; where
that step writes the state's block in place it has copied the state out first, and the key goes
to the copy (``MambaManager``, ``MambaStep.copy``).

Requests. kvproof's managers read a request's id, token counts and chained block hashes; the
adapter hands them a view of vLLM's request (``_RequestView``) whose hashes are vLLM's own
(``request.block_hashes``, at the ``hash_block_size`` the Scheduler passes, with vLLM's cache
salt, LoRA and multimodal extra keys already in them), so kvproof's hash unit is vLLM's.

KV connectors. Tokens a connector writes (``num_external_computed_tokens``) get slots like
computed ones but are keyed only once vLLM says they are written: its ``cache_blocks`` call after
an async load (``delay_cache_blocks``) or after the step, or, for a load within a step, the first
keying with no step of the request in flight. Deferred frees (``pop_blocks_for_free``) and
per-group divergent hits (``get_computed_blocks_for_connector``) are refused, as are the
connectors' use of vLLM's block-pool API beyond ``get_num_free_blocks``, ``get_cached_block`` and
``hash_block_size``.

KV-cache events (``enable_kv_cache_events``): the pool records each key it attaches or drops
(``impl/key_log.py``); every keying turns the new keys into ``BlockStored`` events for its request
and ``take_events`` hands the Scheduler them with the ``BlockRemoved`` and ``AllBlocksCleared``
events since (``cache_events.py``; docs/vllm.md, "KV-cache events", says where they differ from
vLLM's).

Also refused, naming the argument: encoder tokens (cross-attention), hash lookahead tokens
over Mamba groups or with KV-cache events. Block-residency metrics (``--kv-cache-metrics``) are
vLLM's collector fed from kvproof's pool (``_Residency``). Block objects in the ``KVCacheBlocks``
it returns carry ``block_id`` and ``is_null`` only.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
from vllm.v1.kv_cache_interface import MambaSpec
from vllm.v1.metrics.stats import PrefixCacheStats

from kvproof.impl.coordinator import Hit
from kvproof.impl.key_log import KeyLog
from kvproof.impl.kv_cache_manager import KVCacheManager
from kvproof.impl.same_step import SameStepKeys
from kvproof.integrations.vllm import serving_options
from kvproof.integrations.vllm.cache_events import CacheEvents
from kvproof.integrations.vllm.kv_specs import group_for_spec
from kvproof.spec.checkpoints import turn_end_ladder
from kvproof.spec.layout import LayoutConfig, resolve_layout


class KvproofBlock:
    """What the Scheduler reads of a block object: its id (0 is the null block)."""

    __slots__ = ("block_id",)

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id

    @property
    def is_null(self) -> bool:
        return self.block_id == 0

    def __repr__(self) -> str:
        return f"KvproofBlock({self.block_id})"


class _HitBlocks(KVCacheBlocks):
    """``get_computed_blocks``'s blocks, carrying kvproof's hit for ``allocate_slots``."""

    def __init__(self, blocks, hit: Hit) -> None:
        super().__init__(blocks)
        self.hit = hit


class _RequestView:
    """A vLLM request as kvproof's managers read it. ``num_computed_tokens`` is the adapter's:
    set before each facade call (written tokens when keying, computed ones when allocating)."""

    __slots__ = ("request", "request_id", "num_computed_tokens", "num_cached_tokens", "external", "allocated_to",
                 "defer", "_hash_block_size")

    def __init__(self, request, hash_block_size: int) -> None:
        self.request = request
        self.request_id = request.request_id
        self.num_computed_tokens = 0
        self.num_cached_tokens = None
        #: Tokens a KV connector writes, not yet known to be written: ``(hit, delayed)``, keys stay
        #: at or below the hit until then (see ``KvproofKVCacheManager._key_written``).
        self.external: Optional[tuple[int, bool]] = None
        #: Known tokens the request's latest allocation computes (a same-step sharer's reach).
        self.allocated_to = 0
        #: Its lookup found more of its prefix being computed in this step than is keyed: its
        #: admission waits one step (``KvproofKVCacheManager.get_computed_blocks``).
        self.defer = False
        self._hash_block_size = hash_block_size

    @property
    def block_hashes(self):
        return self.request.block_hashes

    @property
    def hashed_len(self) -> int:
        return len(self.request.block_hashes) * self._hash_block_size

    @property
    def num_tokens(self) -> int:
        return self.request.num_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens


class _GroupSurface:
    """``coordinator.single_type_managers[g]``: what the Scheduler and engine read of a group,
    and the cached-block lookup vLLM's auxiliary-output connector makes through ``block_pool``."""

    __slots__ = ("block_size", "kv_cache_spec", "block_pool")

    def __init__(self, block_size: int, kv_cache_spec, block_pool: "_BlockPoolSurface") -> None:
        self.block_size = block_size
        self.kv_cache_spec = kv_cache_spec
        self.block_pool = block_pool


class _CoordinatorSurface:
    """``coordinator``: the groups, and whether hits may end inside a block."""

    def __init__(self, groups: tuple[_GroupSurface, ...], enable_partial_hash_hits: bool, blocks_needed) -> None:
        self.single_type_managers = groups
        self.enable_partial_hash_hits = enable_partial_hash_hits
        self._blocks_needed = blocks_needed

    def get_num_blocks_to_allocate(self, *, request_id: str, num_tokens: int, **ignored) -> int:
        """Blocks a running request still needs to reach ``num_tokens`` (the Scheduler asks for
        in-flight prefills when an async KV load reserves blocks for them); the other keywords
        describe a hit, which a running request no longer takes."""
        return self._blocks_needed(request_id, num_tokens)


class _BlockPoolSurface:
    """``block_pool``: the Scheduler returns copy-on-write retentions through ``free_blocks``;
    kvproof keeps its own until the next step (``KVCacheManager.begin_step``) and hands none out.
    ``get_num_free_blocks``, ``get_cached_block`` and ``hash_block_size``: what connectors and
    tests read of vLLM's pool."""

    def __init__(self, manager: KVCacheManager, blocks: list[KvproofBlock]) -> None:
        self._manager = manager
        self._blocks = blocks
        self.hash_block_size = manager.hash_block_size

    def get_num_free_blocks(self) -> int:
        return self._manager.num_free_blocks

    def get_cached_block(self, block_hash, kv_cache_group_ids) -> Optional[list]:
        """The block cached under ``block_hash`` in each group, or None if a group has none."""
        found = [self._manager.cached_block(block_hash, g) for g in kv_cache_group_ids]
        return None if None in found else [self._blocks[b] for b in found]

    def free_blocks(self, blocks) -> None:
        blocks = list(blocks)
        if blocks:
            raise ValueError(f"kvproof's manager hands out no blocks to free; got {blocks[:4]!r}")


class _Residency:
    """vLLM's block-residency metrics (``--kv-cache-metrics``: ``KVCacheMetricsCollector``, which
    samples blocks and reports each sampled block's lifetime, idle time and reuse gaps when it
    is evicted), fed from kvproof's pool as vLLM's ``BlockPool`` feeds it: a block handed out
    ends its previous residency (with caching on) and starts a new one, a hit's touch is an
    access, a reset clears everything. A ``PoolObserver``."""

    __slots__ = ("_collector", "_blocks", "_caching")

    def __init__(self, collector, blocks: list[KvproofBlock], caching: bool) -> None:
        self._collector, self._blocks, self._caching = collector, blocks, caching

    def allocated(self, blocks: list[int]) -> None:
        collector, objects = self._collector, self._blocks
        for b in blocks:
            if self._caching:
                collector.on_block_evicted(objects[b])
            collector.on_block_allocated(objects[b])

    def touched(self, blocks: list[int]) -> None:
        for b in blocks:
            self._collector.on_block_accessed(self._blocks[b])

    def reset(self) -> None:
        self._collector.reset()


def _common_prefix(hashes, others) -> int:
    """How many leading block hashes two requests share (chained hashes: equal at i means equal
    below i, so a binary search finds it)."""
    low, high = 0, min(len(hashes), len(others))
    while low < high:
        mid = (low + high + 1) // 2
        if hashes[mid - 1] == others[mid - 1]:
            low = mid
        else:
            high = mid - 1
    return low


def _refuse_connector(what: str):
    raise NotImplementedError(f"kvproof's manager: {what} serves KV connectors, which it does not model")


def _refuse(argument: str, value) -> None:
    raise NotImplementedError(f"kvproof's manager does not serve {argument}={value!r}")


class KvproofKVCacheManager:
    """kvproof's manager with the constructor and surface of vLLM 0.33.0's ``KVCacheManager``
    (see the module docstring). The layout is kvproof's own reading of ``kv_cache_config``
    (``kv_specs.group_for_spec``) under the ``KVPROOF_OPTIONS`` rules; a group kind kvproof has
    no manager for, or a geometry it disagrees with, raises ValueError at construction."""

    def __init__(
        self,
        kv_cache_config,
        max_model_len: int,
        scheduler_block_size: int,
        hash_block_size: int,
        max_in_flight_tokens: Optional[int] = None,
        enable_caching: bool = True,
        use_eagle: bool = False,
        num_hash_lookahead_tokens: int = 0,
        num_prefill_lookahead: int = 0,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        metrics_collector=None,
        watermark: float = 0.0,
        enable_mamba_shared_prefix_checkpoint: bool = False,
        options: Optional[serving_options.ServingOptions] = None,
    ) -> None:
        # max_in_flight_tokens sizes vLLM's sliding-window admission cap (blocks recycled while
        # a prefill runs); kvproof's admission counts what its own allocation takes, so it is
        # not needed. num_prefill_lookahead above 1 re-prefills an MTP tail kvproof does not model.
        if num_prefill_lookahead > 1:
            _refuse("num_prefill_lookahead", num_prefill_lookahead)
        # Hash lookahead (vLLM's default with EAGLE/MTP): a block's hash also covers the L tokens
        # after it and exists only once they do. kvproof keys and looks up vLLM's hashes, so
        # attention groups need nothing more; vLLM also moves Mamba checkpoints by L and puts the
        # L tokens in events' token ids, which kvproof does not model.
        if num_hash_lookahead_tokens and (enable_kv_cache_events or any(
                isinstance(g.kv_cache_spec, MambaSpec) for g in kv_cache_config.kv_cache_groups)):
            _refuse("num_hash_lookahead_tokens with Mamba groups or KV-cache events", num_hash_lookahead_tokens)
        if pcp_world_size != 1:
            _refuse("pcp_world_size", pcp_world_size)
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark {watermark!r} must be in [0, 1)")
        options = options if options is not None else serving_options.from_environment()
        groups = tuple(group_for_spec(g.kv_cache_spec, i) for i, g in enumerate(kv_cache_config.kv_cache_groups))
        layout = resolve_layout(LayoutConfig(
            groups, dcp=dcp_world_size, max_model_len=max_model_len, hash_block_size=hash_block_size,
            retention_interval=options.retention_interval(kv_cache_config.prefix_cache_retention_interval),
            shared_prefix_checkpoint=enable_mamba_shared_prefix_checkpoint,
            eviction=options.eviction, attention_keys=options.attention_keys, checkpoints=options.checkpoints,
        ))
        if layout.scheduler_block_size != scheduler_block_size:
            raise ValueError(f"kvproof's scheduler block size for this model is {layout.scheduler_block_size}, "
                             f"vLLM's Scheduler uses {scheduler_block_size}")
        self.options = options
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.log_stats = log_stats
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.enable_kv_cache_events = enable_kv_cache_events
        # Events only where something is keyed (as vLLM: no caching, no events).
        key_log = KeyLog() if enable_kv_cache_events and enable_caching else None
        self.manager = KVCacheManager(layout, kv_cache_config.num_blocks, use_eagle=use_eagle, key_log=key_log)
        self._hash_block_size = hash_block_size
        self._watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        self._blocks = [KvproofBlock(i) for i in range(kv_cache_config.num_blocks)]
        if metrics_collector is not None:  # --kv-cache-metrics: vLLM's collector, fed by kvproof's pool
            self.manager.pool.observer = _Residency(metrics_collector, self._blocks, enable_caching)
        specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
        self._events = CacheEvents(layout, specs, key_log) if key_log is not None else None
        self.block_pool = _BlockPoolSurface(self.manager, self._blocks)
        self.coordinator = _CoordinatorSurface(
            tuple(_GroupSurface(g.effective_block_size, spec, self.block_pool) for g, spec in zip(layout.groups, specs)),
            layout.partial_hash_hits,
            self._blocks_needed,
        )
        self.mamba_shared_prefix_checkpoint = self.manager.exact_junction
        #: The checkpoint policy's turn-end ladder, (rungs, unit), (0, 0) for none: the states
        #: retention keeps, and the stops kvproof's Scheduler (``kvproof_scheduler``) adds to
        #: vLLM's chunk split so that they are made.
        self.ladder = turn_end_ladder(layout)
        #: The groups whose new blocks the worker zeroes and whose rows cover token positions.
        self._attention_groups = tuple(i for i, spec in enumerate(specs) if not isinstance(spec, MambaSpec))
        self._has_mamba = len(self._attention_groups) < len(specs)
        self._new_block_ids: list[int] = []
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in specs))
        self._views: dict[str, _RequestView] = {}
        self._allocated: dict[str, _RequestView] = {}  # allocated since the last keying
        #: ``_allocated`` by first block hash (chained hashes: only requests equal there share a
        #: prefix), built by a step's first same-step sharing question; None until then.
        self._sharers: Optional[dict[bytes, dict[str, _RequestView]]] = None
        self._deferred: dict[str, int] = {}  # waiting request -> steps its admission waited for a producer
        #: Steps a sharer may wait for its producer's keys: one, or two while a step is in flight
        #: at the next one's start (async scheduling: its keys come after the next is scheduled).
        self._max_waits = 1
        self.num_producer_waits = 0  # admissions that waited a step for a prefix being computed
        self._same_step = SameStepKeys(self.manager)  # what this step's chunks will key

    # --- attributes -----------------------------------------------------------------------------

    @property
    def usage(self) -> float:
        """Used blocks over all blocks but the null block."""
        real = self.manager.num_blocks - 1
        return 1.0 - self.manager.num_free_blocks / real if real else 0.0

    # --- the step -------------------------------------------------------------------------------

    def new_step_starts(self) -> None:
        """Key what the requests allocated since the last step have written, then open the
        step (the previous step's copies are queued ahead of this step's work on every worker,
        so their sources may be released)."""
        for view in list(self._allocated.values()):
            self._key_written(view)
        self.manager.begin_step()
        views = self._views
        # A chunk of a step still in flight (async scheduling) keys its prefix once it returns.
        in_flight = self._same_step.retain(
            lambda view, end: end > view.num_computed_tokens and views.get(view.request_id) is view)
        self._max_waits = 2 if in_flight else 1
        self._sharers = None

    def _key_written(self, view: _RequestView, written: Optional[int] = None, final: bool = False) -> None:
        """Key ``written`` tokens (default: the request's computed minus in-flight ones).
        Tokens a connector loads count as written once vLLM says so (``final``: its
        ``cache_blocks`` call after the step or the async load), or, for a load within a
        step, once no step of the request is in flight."""
        request = view.request
        if written is None:
            written = request.num_computed_tokens - request.num_in_flight_tokens
        if view.external is not None:
            hit, delayed = view.external
            if final or (not delayed and request.num_in_flight_tokens == 0):
                view.external = None
            else:
                written = min(written, hit)
        view.num_computed_tokens = max(0, min(written, request.num_tokens))
        self.manager.cache(view)
        if self._events is not None:
            self._events.flush(view.request)  # the keys just attached are this request's
        if self._allocated.pop(view.request_id, None) is not None and self._sharers is not None and view.block_hashes:
            self._sharers.get(view.block_hashes[0], {}).pop(view.request_id, None)

    def _blocks_needed(self, request_id: str, num_tokens: int) -> int:
        view = self._views.get(request_id)
        return 0 if view is None else self.manager.blocks_needed(view, num_tokens)

    def _view(self, request) -> _RequestView:
        view = self._views.get(request.request_id)
        if view is None or view.request is not request:
            view = self._views[request.request_id] = _RequestView(request, self._hash_block_size)
        return view

    # --- lookup ---------------------------------------------------------------------------------

    def get_computed_blocks(self, request, max_cache_hit_length: Optional[int] = None):
        """``(blocks, num_computed_tokens, shared_prefix_boundary)``: kvproof's hit for a waiting
        request (at most ``num_tokens - 1``, or the cap), and where the request branches off
        cached content beyond it (the first of the hit's junctions; 0 if none). No state change."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0, 0
        view = self._view(request)
        hit = self.manager.lookup(view, bound=max_cache_hit_length)
        if self._events is not None and hit.num_tokens and getattr(request, "kv_cache_report_mode", None) == "full":
            self._events.reused(request, hit.num_tokens)
        # A prefix another request computes in this step is keyed once that step ran: vLLM's
        # manager lets the sharer hit it now (attention) or defers it a step (Mamba); kvproof's
        # lets it wait one step, once (two while the producer's step is in flight at the next
        # one's start: async scheduling), so it never caches fewer tokens than vLLM's would.
        view.defer = (self._deferred.get(view.request_id, 0) < self._max_waits
                      and self._same_step.producer_in_flight(view, hit.num_tokens))
        if self._has_mamba:
            shared = self._shared_this_step(view, max_cache_hit_length)
            if shared > max((hit.num_tokens, *hit.junctions)):
                hit = dataclasses.replace(hit, junctions=tuple(sorted((*hit.junctions, shared))))
        if not hit.num_tokens and not hit.junctions:
            return self.empty_kv_cache_blocks, 0, 0
        # A miss with junctions still travels to allocate_slots: retention keeps the states there.
        blocks = _HitBlocks(tuple([self._blocks[b] for b in ids] for ids in hit.blocks), hit)
        return blocks, hit.num_tokens, (hit.junctions[0] if hit.junctions else 0)

    def _shared_this_step(self, view: _RequestView, bound: Optional[int]) -> int:
        """How far ``view``'s prefix (on the hit grid, within the hit bound) is one that another
        request computes in this step. vLLM sees such a prefix at once (it keys at allocation)
        and stops the sharer's chunk there, so the Mamba state at that junction is kept for the
        next sharer; kvproof keys it only after the step, so it is found from the hashes."""
        hashes = view.block_hashes
        if not hashes:
            return 0
        if self._sharers is None:
            self._sharers = {}
            for other in self._allocated.values():
                self._note_sharer(other)
        limit = view.num_tokens - 1 if bound is None else min(bound, view.num_tokens - 1)
        shared = 0
        for other in self._sharers.get(hashes[0], {}).values():
            if other.request_id != view.request_id:
                common = _common_prefix(hashes, other.block_hashes) * self._hash_block_size
                shared = max(shared, min(common, other.allocated_to))
        shared = min(shared, limit)
        return shared - shared % self.manager.alignment

    def _note_sharer(self, view: _RequestView) -> None:
        if view.block_hashes:
            self._sharers.setdefault(view.block_hashes[0], {})[view.request_id] = view

    def get_computed_blocks_for_connector(self, request, max_cache_hit_length=None):
        _refuse_connector("get_computed_blocks_for_connector")

    def truncate_computed_blocks(self, blocks, num_computed_tokens):
        _refuse_connector("truncate_computed_blocks")

    def estimate_cached_tokens(self, request) -> int:
        """Prompt tokens the request's own keyed blocks cover in every group."""
        view = self._views.get(request.request_id)
        if view is None or not self.manager.is_running(view):
            return 0
        return min(self.manager.keyed_tokens(view), request.num_prompt_tokens)

    # --- allocation -----------------------------------------------------------------------------

    def allocate_slots(
        self,
        request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Optional[KVCacheBlocks] = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> Optional[KVCacheBlocks]:
        """Slots for ``num_new_tokens`` (drafts included) and ``num_lookahead_tokens`` more
        after the computed tokens (after the hit in ``new_computed_blocks`` for a waiting
        request), or None with nothing changed when they do not fit (a waiting request also
        leaves the watermark free, and with ``full_sequence_must_fit`` needs room for its whole
        known sequence). Returns the block ids the worker appends per group (an admitted
        request's whole row). Keys nothing: see the module docstring."""
        if num_encoder_tokens:
            _refuse("num_encoder_tokens", num_encoder_tokens)
        if num_new_tokens == 0 and num_external_computed_tokens == 0 and num_new_computed_tokens == 0:
            raise ValueError("num_new_tokens must be greater than 0 when there are no computed tokens to adopt")
        view = self._view(request)
        if view.request_id in self._allocated:
            # A second allocation in one step (vLLM's manager allows it): keying what is written
            # settles kvproof's step protocol for the first.
            self._key_written(view)
        running = self.manager.is_running(view)
        if running and not num_new_computed_tokens and new_computed_blocks is None:
            # The decode path: a running request grows from its computed tokens.
            hit = self.manager.coordinator.miss
            start = request.num_computed_tokens
        else:
            hit = self._hit_of(request, num_new_computed_tokens, new_computed_blocks, running)
            if view.defer and not running:  # waits a step for the prefix this step computes
                view.defer = False
                self._deferred[view.request_id] = self._deferred.get(view.request_id, 0) + 1
                self.num_producer_waits += 1
                return None
            start = request.num_computed_tokens if running else hit.num_tokens
        view.num_computed_tokens = start
        end = min(start + num_external_computed_tokens + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        if end <= start:
            _refuse("num_new_tokens (a step adopting a hit with no slot of its own)", num_new_tokens)
        if (reserved_blocks or not running) and not self._admissible(
                view, request, hit, end, running, full_sequence_must_fit, has_scheduled_reqs, reserved_blocks):
            return None
        rows = self.manager.reserve_slots(view, end - start, None if running else hit)
        if rows is None:
            return None
        self._allocated[view.request_id] = view
        if self._sharers is not None:
            self._note_sharer(view)
        self._deferred.pop(view.request_id, None)
        view.allocated_to = min(end, request.num_tokens)
        self._same_step.note(view, start, view.allocated_to)
        if num_external_computed_tokens:
            view.external = (start, delay_cache_blocks)
        if not any(rows):
            return self.empty_kv_cache_blocks
        new = rows if running else tuple(row[len(bl):] for row, bl in zip(rows, hit.blocks))
        loaded_end = start + num_external_computed_tokens  # a load writes these: not zeroed under it
        for g in self._attention_groups:
            first = len(hit.blocks[g]) if not running else 0
            skip_below = loaded_end if g in skip_zeroing_group_ids else 0
            size = self.coordinator.single_type_managers[g].block_size
            self._new_block_ids.extend(b for j, b in enumerate(new[g], start=first) if b and j * size >= skip_below)
        return KVCacheBlocks(tuple([self._blocks[b] for b in row] for row in rows))

    def _hit_of(self, request, num_new_computed_tokens: int, blocks, running: bool) -> Hit:
        hit = getattr(blocks, "hit", None)
        if blocks is None or blocks is self.empty_kv_cache_blocks:
            hit = self.manager.coordinator.miss
        elif hit is None:
            raise ValueError(f"request {request.request_id!r}: new_computed_blocks did not come from get_computed_blocks")
        if hit.num_tokens != num_new_computed_tokens:
            raise ValueError(f"request {request.request_id!r}: num_new_computed_tokens {num_new_computed_tokens} "
                             f"is not its hit's {hit.num_tokens}")
        if running and hit.num_tokens:
            raise ValueError(f"request {request.request_id!r} is running; a running request takes no hit")
        return hit

    def _admissible(self, view, request, hit: Hit, total: int, running: bool, full_sequence_must_fit: bool,
                    has_scheduled_reqs: bool, reserved_blocks: int) -> bool:
        """vLLM's gates: ``reserved_blocks`` stay free for in-flight prefills; a waiting request
        also leaves the watermark (when some request is already scheduled this step) and,
        optionally, needs room for its whole known sequence."""
        reserve = reserved_blocks + (self._watermark_blocks if has_scheduled_reqs and not running else 0)
        free = self.manager.num_free_blocks
        hit = None if running else hit
        if full_sequence_must_fit and not running:
            whole = min(request.num_tokens, self.max_model_len)
            if self.manager.blocks_needed(view, whole, hit) + reserve > free:
                return False
        return not reserve or self.manager.blocks_needed(view, total, hit) + reserve <= free

    # --- after the forward pass -----------------------------------------------------------------

    def cache_blocks(self, request, num_computed_tokens: int) -> None:
        """Key the request's blocks up to ``num_computed_tokens`` written tokens (vLLM passes
        ``num_computed_tokens - num_in_flight_tokens``). A no-op when caching is off."""
        view = self._views.get(request.request_id)
        if self.enable_caching and view is not None and self.manager.is_running(view):
            self._key_written(view, num_computed_tokens, final=True)

    def free(self, request) -> None:
        """Key what the request has written, then release its blocks (finished or preempted)."""
        self._deferred.pop(request.request_id, None)
        view = self._views.pop(request.request_id, None)
        if view is None or not self.manager.is_running(view):
            return
        if view.request_id in self._allocated:
            self._key_written(view)
        self.manager.free(view)

    def pop_blocks_for_free(self, request):
        _refuse_connector("pop_blocks_for_free (deferred frees)")

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int, num_prompt_tokens=None) -> None:
        """Release blocks the request no longer needs (outside a sliding window): kvproof does
        that when it keys, so this keys the processed tokens."""
        view = self._views.get(request_id)
        if view is not None and self.manager.is_running(view):
            self._key_written(view, processed_computed_tokens)

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """Zero the request's blocks from ``start_token`` (block-aligned) again: a failed async
        load left them unwritten."""
        for g, row in enumerate(self.get_block_ids(request_id)):
            if g in self._attention_groups:
                size = self.coordinator.single_type_managers[g].block_size
                if start_token % size:
                    raise ValueError(f"record_blocks_for_zeroing: start {start_token} is not a multiple of group {g}'s block size {size}")
                self._new_block_ids.extend(b for b in row[start_token // size:] if b)

    def evict_blocks(self, block_ids) -> None:
        """Drop the keys of blocks whose contents a failed load left invalid."""
        self.manager.evict(block_ids)

    def finalize_partial_tail_offloads(self, request) -> list:
        """Nothing without Mamba groups (vLLM offloads only Mamba boundary states); refused with
        them."""
        if len(self._attention_groups) < len(self.coordinator.single_type_managers):
            _refuse_connector("finalize_partial_tail_offloads (Mamba boundary states)")
        return []

    def get_block_ids_for_computed_tokens(self, request_id: str, num_computed_tokens: int) -> tuple[list[int], ...]:
        """``get_block_ids`` with the attention groups cut to the blocks covering the computed
        tokens."""
        managers = self.coordinator.single_type_managers
        return tuple(row[:-(-num_computed_tokens // managers[g].block_size)] if g in self._attention_groups else row
                     for g, row in enumerate(self.get_block_ids(request_id)))

    # --- what the Scheduler drains each step ------------------------------------------------------

    def take_kv_cache_block_copies(self):
        """The step's copy-on-write copies, and no retained block objects (kvproof keeps the
        sources itself until the next ``new_step_starts``). kvproof's copies name a group; one
        block id names the same block in every group's tensors, as in vLLM."""
        copies = self.manager.take_block_copies()
        return [KVCacheBlockCopy(src_block_id=src, dst_block_id=dst) for _, src, dst in copies], []

    def take_new_block_ids(self) -> list[int]:
        """Blocks allocated since the last call in the groups the worker zeroes (not Mamba)."""
        ids, self._new_block_ids = self._new_block_ids, []
        return ids

    def take_boundary_state_offloads(self) -> dict:
        """Nothing: boundary-state offloads are for KV connectors, which are not served."""
        return {}

    def take_events(self) -> list:
        """The KV-cache events since the last call, oldest first (empty when they are off)."""
        return self._events.take() if self._events is not None else []

    # --- reads ----------------------------------------------------------------------------------

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's whole table per group."""
        rows = self.get_block_ids(request_id)
        if not any(rows):
            return self.empty_kv_cache_blocks
        return KVCacheBlocks(tuple([self._blocks[b] for b in row] for row in rows))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        view = self._views.get(request_id)
        if view is None:
            return tuple([] for _ in self.coordinator.single_type_managers)
        return self.manager.block_table(view)

    # --- prefix-cache stats and reset -------------------------------------------------------------

    def record_prefix_cache_stats(self, request, num_hits: int) -> None:
        """As vLLM: one query of ``request.num_tokens`` tokens, unless stats are off or the
        request skipped the lookup."""
        if not self.log_stats or not self.enable_caching or request.skip_reading_prefix_cache:
            return
        self.prefix_cache_stats.record(num_tokens=request.num_tokens, num_hits=num_hits,
                                       preempted=request.num_preemptions > 0)

    def make_prefix_cache_stats(self) -> Optional[PrefixCacheStats]:
        """The stats since the last call (and a fresh set), or None when stats are off."""
        if not self.log_stats:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def reset_prefix_cache(self) -> bool:
        """Drop every key (``AllBlocksCleared`` with events on); False (nothing changed) while
        any block is held."""
        if not self.manager.reset_prefix_cache():
            return False
        if self.log_stats:
            self.prefix_cache_stats.reset = True
        return True
