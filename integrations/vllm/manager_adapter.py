"""vLLM 0.33.0's own scheduler-side KV-cache manager behind kvproof's manager interface, so the
same workload can be replayed through both by the same driver (kvproof's ``Scheduler``).

What runs is vLLM's code, unchanged: ``vllm.v1.core.kv_cache_manager.KVCacheManager`` with its
hybrid coordinator, single-type managers and block pool, and vLLM's request block hasher. The
adapter only translates:

* a kvproof :class:`~kvproof.spec.layout.Layout` into a ``KVCacheConfig`` (one
  ``KVCacheGroupSpec`` per kvproof group, ``kvproof.integrations.vllm.kv_specs``) plus the
  constructor arguments vLLM's ``Scheduler`` would pass (scheduler block size, hash block size,
  DCP size, caching on, no EAGLE);
* each kvproof ``Request`` into one long-lived ``vllm.v1.request.Request`` fed the same tokens;
* kvproof's step protocol (``begin_step / lookup / allocate_slots / take_block_copies / cache /
  free``) into the calls vLLM's ``Scheduler.schedule`` makes (``new_step_starts /
  get_computed_blocks / allocate_slots / take_kv_cache_block_copies / free``).

Semantics are vLLM's, not kvproof's: vLLM keys blocks inside ``allocate_slots`` (before the
forward pass), so ``cache()`` is a no-op here, and hit lengths can differ from kvproof's (see
docs/coordinator.md, "Deviations from vLLM 0.33.0").

Nothing from vLLM's engine is built: the scheduler-side modules need no ``VllmConfig``. The only
stand-ins are the tensor-shape fields of the specs (head counts, dtypes, Mamba state shapes),
which the scheduler side never reads except to compute page sizes nothing here uses.

Used by the differentials (tests/vllm/test_vllm_differential.py, tests/vllm/test_engine_harness.py)
and the manager benchmark (benchmarks/vllm_baseline.py, benchmarks/manager.py):

    python benchmarks/manager.py --requests 300 --dcp 1 2     # prints both columns
"""

from __future__ import annotations

from typing import Optional

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request as VllmRequest
from vllm.v1.request import RequestStatus

from kvproof.impl.request import Request
from kvproof.integrations.vllm.kv_specs import kv_cache_config_for
from kvproof.spec.layout import Layout

#: vLLM's default ``prefix_caching_hash_algo`` (pickle + SHA-256). The NONE_HASH seed is then the
#: fixed "vllm-none-hash" string unless PYTHONHASHSEED is set (docs/vllm-semantics.md §2.1).
HASH_ALGO = "sha256"


# --- small views over vLLM's pool and coordinator (the adapter's queries read them) -------------

class _PoolView:
    """``pool.num_blocks`` / ``pool.num_free`` over vLLM's BlockPool (block 0 is its null block,
    as in kvproof, so the counts mean the same thing)."""

    __slots__ = ("_pool",)

    def __init__(self, pool) -> None:
        self._pool = pool

    @property
    def num_blocks(self) -> int:
        return self._pool.num_gpu_blocks

    @property
    def num_free(self) -> int:
        return self._pool.get_num_free_blocks()


class _CoordinatorView:
    """What the adapter's queries read (``use_eagle``, ``exact_junction``, ``alignment``), plus
    vLLM's own coordinator for inspection. vLLM's coordinator has neither attribute of its own."""

    __slots__ = ("use_eagle", "exact_junction", "vllm", "alignment", "partial_hash_hits")

    def __init__(self, coordinator, use_eagle: bool) -> None:
        self.use_eagle = use_eagle
        # vLLM 0.33.0 ends a chunk at the exact shared-prefix junction only with EAGLE
        # (docs/vllm-semantics.md); this baseline runs without it.
        self.exact_junction = False
        self.vllm = coordinator
        self.partial_hash_hits = bool(getattr(coordinator, "enable_partial_hash_hits", False))
        self.alignment = coordinator.scheduler_block_size
        managers = coordinator.single_type_managers
        if managers:
            self.alignment = managers[0].cache_hit_alignment_tokens


class VllmHit:
    """What ``lookup`` returns: kvproof's ``Hit`` shape (``num_tokens``) carrying vLLM's
    ``KVCacheBlocks`` and the shared-prefix boundary that ``get_computed_blocks`` reports."""

    __slots__ = ("num_tokens", "blocks", "shared_prefix_boundary", "junctions")

    def __init__(self, num_tokens: int, blocks: KVCacheBlocks, shared_prefix_boundary: int) -> None:
        self.num_tokens = num_tokens
        self.blocks = blocks
        self.shared_prefix_boundary = shared_prefix_boundary
        # kvproof's Scheduler stops prefill chunks at the junctions a hit reports; vLLM's at its one.
        self.junctions = (shared_prefix_boundary,) if shared_prefix_boundary else ()

    def __repr__(self) -> str:
        return f"VllmHit({self.num_tokens})"


# --- the adapter -------------------------------------------------------------------------------

class VllmManagerAdapter:
    """vLLM 0.33.0's ``KVCacheManager`` with kvproof's manager interface.

    Only the sync, connector-less, non-speculative path of vLLM's ``Scheduler`` is mirrored:
    no KV connector, no async scheduling (so ``num_in_flight_tokens`` is 0 between steps and
    CoW retentions are released as soon as the copies are taken, as ``_free_cow_retained_blocks``
    does when ``defer_block_free`` is False), ``num_lookahead_tokens`` 0, watermark 0.
    """

    def __init__(
        self,
        layout: Layout,
        num_blocks: int,
        max_num_batched_tokens: int = 8192,
        full_sequence_must_fit: bool = True,
        retention_interval: Optional[int] = None,
    ) -> None:
        if not layout.config.allow_partial_hash_hits:
            # KVCacheManager does not forward allow_partial_hash_hits to its coordinator.
            raise ValueError("vLLM 0.33's KVCacheManager always allows partial hash hits; "
                             "a layout with allow_partial_hash_hits=False has no vLLM counterpart")
        self.layout = layout
        config = kv_cache_config_for(layout, num_blocks)
        config.prefix_cache_retention_interval = retention_interval
        hash_fn = get_hash_fn_by_name(HASH_ALGO)
        init_none_hash(hash_fn)  # what EngineCore does once prefix caching is on
        self._block_hasher = get_request_block_hasher(layout.hash_block_size, hash_fn)
        # The arguments vLLM's Scheduler passes (scheduler.py:352-370), for one engine with no
        # speculative decoding: max_in_flight_tokens = 1 concurrent batch x the token budget.
        self.vkv = KVCacheManager(
            kv_cache_config=config,
            max_model_len=layout.config.max_model_len,
            scheduler_block_size=layout.scheduler_block_size,
            hash_block_size=layout.hash_block_size,
            max_in_flight_tokens=max_num_batched_tokens,
            enable_caching=True,
            use_eagle=False,
            dcp_world_size=layout.dcp,
            pcp_world_size=1,
        )
        self.pool = _PoolView(self.vkv.block_pool)
        self.coordinator = _CoordinatorView(self.vkv.coordinator, use_eagle=False)
        config.cache_hit_alignment_tokens = self.coordinator.alignment
        # vLLM's scheduler_reserve_full_isl (default True): a waiting request is admitted only
        # if its whole known sequence fits, not just the first chunk.
        self.full_sequence_must_fit = full_sequence_must_fit
        self.num_copies = 0
        self._step = 0
        self._mirror: dict[str, VllmRequest] = {}
        self._running: set[str] = set()
        # kvproof's partial-hit rule and vLLM's must agree, or the shared driver would split
        # chunks for a rule vLLM does not apply. Recorded, not fatal: the run is still vLLM's.
        self.disagreements: list[str] = []
        if self.coordinator.partial_hash_hits != layout.partial_hash_hits:
            self.disagreements.append(
                f"partial hash hits: vLLM {self.coordinator.partial_hash_hits}, kvproof {layout.partial_hash_hits}")
        if self.coordinator.alignment != layout.cache_hit_alignment:
            self.disagreements.append(
                f"cache-hit alignment: vLLM {self.coordinator.alignment}, kvproof {layout.cache_hit_alignment}")

    @property
    def step(self) -> int:
        return self._step

    # --- the queries kvproof's Scheduler reads (as KVCacheManager answers them) -----------------

    @property
    def alignment(self) -> int:
        return self.coordinator.alignment

    @property
    def hash_block_size(self) -> int:
        return self.layout.hash_block_size

    @property
    def use_eagle(self) -> bool:
        return self.coordinator.use_eagle

    @property
    def exact_junction(self) -> bool:
        return self.coordinator.exact_junction

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    # --- request mirroring -----------------------------------------------------------------

    def register(self, request: Request) -> VllmRequest:
        """Create (or return) the vLLM request mirroring ``request``. Building it hashes the
        prompt, so callers that time the run register requests first, as kvproof hashes its
        prompts when a ``Request`` is constructed."""
        vreq = self._mirror.get(request.request_id)
        if vreq is None:
            vreq = VllmRequest(
                request_id=request.request_id,
                prompt_token_ids=list(request.token_ids[: request.num_prompt_tokens]),
                sampling_params=SamplingParams(max_tokens=max(1, len(request.expected_outputs))),
                pooling_params=None,
                arrival_time=float(request.arrival),
                cache_salt=request.cache_salt,
                block_hasher=self._block_hasher,
            )
            self._mirror[request.request_id] = vreq
        return self._sync(request, vreq)

    def _sync(self, request: Request, vreq: VllmRequest) -> VllmRequest:
        """Append the outputs kvproof sampled since we last saw ``request`` (vLLM appends them
        in ``update_from_output``, which rehashes), so both requests hold the same tokens."""
        have = vreq.num_tokens
        if have < request.num_tokens:
            vreq.append_output_token_ids(request.token_ids[have:])
        return vreq

    def _vreq(self, request: Request) -> VllmRequest:
        vreq = self._mirror.get(request.request_id)
        if vreq is None:
            return self.register(request)
        if vreq.num_tokens != request.num_tokens:
            self._sync(request, vreq)
        return vreq

    def is_running(self, request: Request) -> bool:
        return request.request_id in self._running

    # --- the step protocol ------------------------------------------------------------------

    def begin_step(self) -> None:
        """``Scheduler.schedule`` starts with ``kv_cache_manager.new_step_starts()`` (it resets
        the Mamba managers' same-step bookkeeping)."""
        self.vkv.new_step_starts()
        self._step += 1

    def lookup(self, request: Request) -> VllmHit:
        """``get_computed_blocks`` as the waiting-queue path calls it (no side effects); the
        scheduler stores the returned shared-prefix boundary on the request."""
        vreq = self._vreq(request)
        blocks, num_hit, boundary = self.vkv.get_computed_blocks(vreq)
        vreq.shared_prefix_boundary = boundary
        return VllmHit(num_hit, blocks, boundary)

    def junctions(self, request: Request) -> tuple[int, ...]:
        """The shared-prefix boundary of the request's latest lookup (vLLM keeps it on its
        request), as kvproof's ``KVCacheManager.junctions``: where its prefill chunks stop."""
        vreq = self._mirror.get(request.request_id)
        boundary = vreq.shared_prefix_boundary if vreq is not None else 0
        return (boundary,) if boundary else ()

    def cheaper_hits(self, request: Request, hit: VllmHit):
        """None: vLLM's scheduler has no fallback; a request that cannot afford its hit waits."""
        return iter(())

    def keyed_lengths(self, request: Request, start: int, end: int) -> tuple[int, ...]:
        """None: vLLM registers keys inside ``allocate_slots``, so a same-step sharer already
        sees them (and vLLM defers a same-step Mamba hit itself); the driver never waits."""
        return ()

    def allocate_slots(self, request: Request, num_new_tokens: int, hit: Optional[VllmHit] = None):
        """vLLM's ``allocate_slots`` as ``Scheduler.schedule`` calls it: for a running request
        with just the new-token count, for a waiting one with the hit's tokens and blocks (and
        the full-sequence admission gate). Keys are registered inside, before the forward pass.

        Returns, per group, the block ids the worker appends (the whole row for a newly admitted
        request, which vLLM's scheduler fetches with ``get_blocks``), or None when out of blocks.
        """
        vreq = self._vreq(request)
        rid = request.request_id
        if rid in self._running:
            if hit is not None and hit.num_tokens:
                raise ValueError(f"request {rid!r} is running; a running request takes no hit")
            vreq.num_computed_tokens = request.num_computed_tokens
            new_blocks = self.vkv.allocate_slots(vreq, num_new_tokens)
            if new_blocks is None:
                return None
            return new_blocks.get_block_ids()
        # Waiting (new or preempted): vLLM keeps num_computed_tokens 0 until admission and
        # passes the local hit separately.
        vreq.num_computed_tokens = 0
        num_hit = hit.num_tokens if hit is not None else 0
        new_blocks = self.vkv.allocate_slots(
            vreq,
            num_new_tokens,
            num_new_computed_tokens=num_hit,
            new_computed_blocks=hit.blocks if hit is not None else None,
            full_sequence_must_fit=self.full_sequence_must_fit,
            has_scheduled_reqs=bool(self._running),
        )
        if new_blocks is None:
            return None
        vreq.status = RequestStatus.RUNNING
        vreq.num_computed_tokens = num_hit
        self._running.add(rid)
        # The kvproof Scheduler reads these from the manager, as with kvproof's own.
        request.num_computed_tokens = num_hit
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_hit
        return self.vkv.get_blocks(rid).get_block_ids()

    def take_block_copies(self) -> list:
        """The step's CoW copies (``KVCacheBlockCopy(src, dst)``; vLLM's copies carry no group:
        one pool, so a block id names one block in every layer's tensor).

        Also the per-step drains vLLM's scheduler does at the end of ``schedule`` whatever the
        configuration: boundary-state offloads and new block ids for zeroing (both grow without
        bound otherwise). CoW retentions are released at once, as in sync mode."""
        self.vkv.take_boundary_state_offloads()
        copies, retained = self.vkv.take_kv_cache_block_copies()
        if copies:
            self.vkv.block_pool.free_blocks(retained)
        self.vkv.take_new_block_ids()
        self.num_copies += len(copies)
        return copies

    def cache(self, request: Request) -> None:
        """No-op: vLLM caches inside ``allocate_slots`` (that is the design kvproof deviates
        from). Its scheduler's only other ``cache_blocks`` call is for speculative/placeholder
        outputs, which this driver does not produce."""

    def free(self, request: Request) -> None:
        """``kv_cache_manager.free`` -- for a finished request and for a preempted one alike."""
        rid = request.request_id
        vreq = self._mirror.get(rid)
        if vreq is None:
            return
        self.vkv.free(vreq)
        self._running.discard(rid)
        if request.num_outputs >= len(request.expected_outputs):
            # Finished: vLLM's scheduler drops the request object too.
            del self._mirror[rid]
        else:
            vreq.status = RequestStatus.PREEMPTED
            vreq.num_computed_tokens = 0
            vreq.num_preemptions += 1

    # --- inspection (tests) ---------------------------------------------------------------------

    def block_table(self, request: Request) -> tuple[list[int], ...]:
        return tuple(self.vkv.get_block_ids(request.request_id))
