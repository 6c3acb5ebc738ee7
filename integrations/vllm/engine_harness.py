"""vLLM 0.33.0's real ``Scheduler`` driven by hand on a CPU, from a kvproof layout and trace.

What runs is vLLM's code, unchanged: ``vllm.v1.core.sched.scheduler.Scheduler`` (or a subclass
such as kvproof's checked scheduler) with its KV-cache manager, coordinator, single-type
managers, block pool, chunk-split rule and request hasher. Nothing else of vLLM's engine runs:
no model, no worker, no executor. The harness plays the engine core's loop --
``schedule()``, a stand-in ``ModelRunnerOutput``, ``update_from_output()`` -- and the stand-in
runner "samples" the trace's outputs.

Configuration (the recipe, docs/vllm.md):

* the ``VllmConfig`` comes from vLLM's own ``EngineArgs`` for a folder holding only a tiny
  hybrid ``config.json`` (``tiny_model.py``) with ``skip_tokenizer_init``, TP = DCP, prefix
  caching on, and the layout's options (retention interval, shared-prefix checkpoint,
  ``prefix_match_unit`` when the layout names H);
* the ``KVCacheConfig`` is built from the layout (``kv_specs.py``): one group per kvproof group,
  in kvproof's order, so group ids agree; vLLM's engine would derive it from the model;
* as ``EngineCore`` does after KV-cache setup, ``cache_config.num_gpu_blocks`` is the pool size
  and ``cache_config.block_size`` is set -- to the smallest align-mode Mamba block, because
  vLLM's chunk splitter reads that field as the Mamba block size (in a real engine the platform
  makes the two equal in align mode); without Mamba, to the smallest prefix-cacheable block;
* the Scheduler gets ``block_size`` = the layout's scheduler block S and ``hash_block_size`` =
  H, as ``EngineCore`` passes them. vLLM's own resolution of (S, H, A) from the same config is
  computed too and any difference is kept in ``disagreements`` (not fatal: the run is vLLM's).

EAGLE (``use_eagle``) means vLLM's EAGLE *block drop* only, with no draft tokens: the Scheduler
is built exactly as with a speculative config whose ``use_eagle_block_drop()`` is true, except
that the speculative config itself is absent (so no draft slots, no padding, no lookahead
slots). vLLM's ``Scheduler.__init__`` passes ``use_eagle=self.use_eagle_block_drop`` to the
``KVCacheManager`` it builds by the module-global name ``KVCacheManager``; the harness builds
the Scheduler with that name bound, for the duration of the constructor, to a factory forcing
``use_eagle=True``, then sets ``scheduler.use_eagle_block_drop = True`` (read by the chunk
splitter). ``num_hash_lookahead_tokens`` (L) is applied the same way -- to the manager, the
scheduler attribute and the request hasher -- and, as in vLLM, excludes the block drop.

Trace semantics equal kvproof's replay (docs/replay.md): before the s-th ``schedule()`` call
(s = 1, 2, ...) every request with ``arrival <= s`` is added, in trace order among equal
arrivals. A step whose chunk reaches the end of a request's known tokens samples its next
expected output; a request with k outputs has ``max_tokens = k`` (``ignore_eos``) and finishes
when ``output[k-1]`` is sampled. A request with no outputs (vLLM needs ``max_tokens >= 1``) is
finished right after its prefill completes, as kvproof does: the runner samples nothing for it
and the harness aborts it before the next step (``finish_requests``), so its tokens stay the
trace's.

A KV connector (``kv_transfer_config``, a ``KVTransferConfig``) is built by vLLM's Scheduler as
in a real engine, on its scheduler side only. The stand-in runner plays its worker side: every
asynchronous load is reported received (the runner output's
``kv_connector_output.finished_recving``) ``kv_load_steps`` steps after the step that started it
(1: that step's own output), every synchronous one lands within its step.

``async_scheduling`` plays vLLM's engine core with async scheduling (its batch queue of two):
the harness builds vLLM's ``AsyncScheduler`` and, each step, schedules step s and runs the
stand-in runner on it before ``update_from_output()`` settles step s - 1, so the Scheduler
allocates every step before the previous one's output returns. The runner knows its own samples
in order (a decode step's input is the token the step before sampled), as a GPU's does; a
sample vLLM discards (a step scheduled past a request's last output) is any token.

``kv_cache_metrics`` turns vLLM's block-residency metrics on as ``--kv-cache-metrics`` does, every
block sampled (``--kv-cache-metrics-sample 1.0``); the Scheduler's collector
(``scheduler.kv_metrics_collector``) keeps the eviction events until drained.

``kv_events`` turns KV-cache events on as ``--kv-events-config`` does (``enable_kv_cache_events``),
with a publisher that keeps each ``KVEventBatch`` the Scheduler publishes (``kv_event_batches``).

This module sets ``VLLM_TARGET_DEVICE=cpu`` unless the variable is already set (vLLM reads it
when it picks a platform); import it before anything else imports vLLM's platform.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import contextlib  # noqa: E402
import copy  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import time  # noqa: E402
from typing import Optional, Sequence  # noqa: E402

from vllm.config.kv_events import KVEventsConfig  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_request_block_hasher,
    init_none_hash,
    resolve_cache_hit_alignment_tokens,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched import scheduler as scheduler_module  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kvproof.integrations.vllm.kv_specs import kv_cache_config_for  # noqa: E402
from kvproof.integrations.vllm.tiny_model import tiny_model_dir  # noqa: E402
from kvproof.sim.trace import TraceRequest  # noqa: E402
from kvproof.spec.groups import GroupKind, MambaCacheMode  # noqa: E402
from kvproof.spec.layout import Layout  # noqa: E402


class HarnessStalled(RuntimeError):
    """vLLM can no longer make progress: a step scheduled nothing, nothing arrives later, and
    requests are still unfinished (they cannot fit in the pool), or the step limit was hit."""


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One ``schedule()`` call: what ran, in vLLM's scheduling order."""

    step: int
    #: (request id, first position computed, number of tokens)
    chunks: tuple[tuple[str, int, int], ...]
    #: copy-on-write copies (source block, destination block); vLLM's copies carry no group
    copies: tuple[tuple[int, int], ...]
    preempted: tuple[str, ...]
    finished: tuple[str, ...]
    #: real blocks with a reference right after ``schedule()``
    blocks_in_use: int


@dataclasses.dataclass
class HarnessResult:
    #: per request, vLLM's ``num_cached_tokens`` (the prefix-cache hit at first scheduling)
    num_cached_tokens: dict[str, int]
    num_prompt_tokens: dict[str, int]
    steps: list[StepRecord]
    copies: int
    preemptions: int
    #: cached blocks whose keys were dropped because the pool handed them out again
    evictions: int
    peak_blocks_in_use: int
    #: time inside ``schedule()`` + ``update_from_output()`` only
    scheduler_seconds: float
    #: the same, in this thread's CPU time (what other processes on a shared machine do not move)
    scheduler_cpu_seconds: float
    wall_seconds: float
    disagreements: list[str]

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def ms_per_step(self) -> float:
        return 1000.0 * self.scheduler_seconds / max(len(self.steps), 1)

    @property
    def hit_rate(self) -> float:
        prompt = sum(self.num_prompt_tokens.values())
        return sum(self.num_cached_tokens.values()) / prompt if prompt else 0.0


@dataclasses.dataclass
class _Scheduled:
    """A scheduled step until ``update_from_output()`` settles it."""

    step: int
    output: SchedulerOutput
    starts: dict[str, int]
    runner_output: ModelRunnerOutput
    no_outputs: list[str]
    blocks_in_use: int


class StepHook:
    """Per-step callbacks (no-ops here; subclass and override). Hooks observe; they must not
    change the scheduler's state."""

    def scheduled(self, harness: "EngineHarness", step: int, output: SchedulerOutput) -> None:
        """After ``schedule()``, before the stand-in runner and ``update_from_output()``."""

    def sampled(self, harness: "EngineHarness", output: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        """After the stand-in runner sampled the step, before the next step is scheduled (and,
        with ``async_scheduling``, before the Scheduler sees the samples)."""

    def updated(self, harness: "EngineHarness", record: StepRecord, output: SchedulerOutput,
                runner_output: ModelRunnerOutput) -> None:
        """After ``update_from_output()`` (and the abort of finished zero-output requests);
        ``runner_output`` is what the stand-in runner returned for the step."""


def chunk_split_block_size(layout: Layout) -> int:
    """What the harness puts in ``cache_config.block_size``: the smallest align-mode Mamba block
    (vLLM's chunk splitter reads the field as the Mamba block size), else the smallest
    prefix-cacheable block, as ``EngineCore`` sets it."""
    mamba = [g.group.block_size for g in layout.groups
             if g.group.kind is GroupKind.MAMBA and g.group.mamba_cache_mode is MambaCacheMode.ALIGN]
    if mamba:
        return min(mamba)
    cacheable = [g.group.block_size for g in layout.groups if g.group.prefix_cacheable]
    return min(cacheable or [g.group.block_size for g in layout.groups])


@functools.lru_cache(maxsize=32)
def _engine_config(dcp: int, max_model_len: int, block_size: int, max_num_batched_tokens: int,
                   max_num_seqs: int, long_prefill_token_threshold: int, retention_interval: Optional[int],
                   shared_prefix_checkpoint: bool, prefix_match_unit: Optional[int]):
    """vLLM's own ``VllmConfig`` for the tiny hybrid model (cached: callers deep-copy it).
    Raises ValueError with vLLM's reason when vLLM rejects the options."""
    args = EngineArgs(
        model=tiny_model_dir(),
        skip_tokenizer_init=True,
        tensor_parallel_size=dcp,
        decode_context_parallel_size=dcp,
        max_model_len=max_model_len,
        block_size=block_size,
        num_gpu_blocks_override=1,  # replaced by the pool size, as EngineCore does
        enable_prefix_caching=True,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        long_prefill_token_threshold=long_prefill_token_threshold,
        prefix_cache_retention_interval=retention_interval,
        enable_mamba_shared_prefix_checkpoint=shared_prefix_checkpoint,
        prefix_match_unit=prefix_match_unit,
    )
    try:
        return args.create_engine_config()
    except ValueError as e:  # pydantic's ValidationError is a ValueError; keep vLLM's reason only
        reasons = [err.get("msg", "") for err in e.errors()] if hasattr(e, "errors") else [str(e)]
        raise ValueError(f"vLLM rejects the engine options: {'; '.join(reasons)}") from None


@contextlib.contextmanager
def _manager_factory(manager_class: Optional[type], **forced):
    """Bind ``vllm.v1.core.sched.scheduler.KVCacheManager`` (the name the Scheduler's
    constructor calls) to ``manager_class`` (None: what the name is bound to now) with ``forced``
    keyword arguments overridden, for the duration of the block."""
    original = scheduler_module.KVCacheManager
    if manager_class is None and not forced:
        yield
        return
    built = manager_class or original

    def build(*args, **kwargs):
        kwargs.update(forced)
        return built(*args, **kwargs)

    scheduler_module.KVCacheManager = build
    try:
        yield
    finally:
        scheduler_module.KVCacheManager = original


class _RecordingPublisher:
    """The Scheduler's KV-event publisher, keeping each batch instead of sending it."""

    def __init__(self, batches: list) -> None:
        self.batches = batches

    def publish(self, batch) -> None:
        self.batches.append(batch)

    def shutdown(self) -> None:
        pass


class EngineHarness:
    """One vLLM Scheduler over one pool, fed a kvproof trace step by step.

    ``run(trace)`` does everything; ``add_trace`` / ``step`` / ``result`` expose the loop for
    lockstep drivers. ``scheduler`` is the vLLM scheduler (for hooks and inspection).
    """

    def __init__(
        self,
        layout: Layout,
        num_blocks: int,
        *,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: Optional[int] = None,
        use_eagle: bool = False,
        long_prefill_token_threshold: int = 0,
        num_hash_lookahead_tokens: int = 0,
        scheduler_cls: type = Scheduler,
        manager_class: Optional[type] = None,
        hooks: Sequence[StepHook] = (),
        kv_transfer_config=None,
        kv_load_steps: int = 1,
        kv_events: bool = False,
        async_scheduling: bool = False,
        kv_cache_metrics: bool = False,
    ) -> None:
        if max_num_seqs is None:
            max_num_seqs = min(256, max_num_batched_tokens)  # vLLM requires seqs <= batched tokens
        for name, value, low in (("num_blocks", num_blocks, 2), ("max_num_batched_tokens", max_num_batched_tokens, 1),
                                 ("max_num_seqs", max_num_seqs, 1), ("long_prefill_token_threshold", long_prefill_token_threshold, 0),
                                 ("num_hash_lookahead_tokens", num_hash_lookahead_tokens, 0),
                                 ("kv_load_steps", kv_load_steps, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} {value!r} must be an integer >= {low}")
        if use_eagle and num_hash_lookahead_tokens:
            raise ValueError(
                f"use_eagle with num_hash_lookahead_tokens {num_hash_lookahead_tokens}: vLLM turns the EAGLE block "
                "drop off when hashes look ahead; expected one of the two"
            )
        if not layout.config.allow_partial_hash_hits:
            raise ValueError("vLLM 0.33's KVCacheManager always allows partial hash hits; "
                             "a layout with allow_partial_hash_hits=False has no vLLM counterpart")
        if async_scheduling:
            if scheduler_cls is not Scheduler:
                raise ValueError("async_scheduling builds vLLM's AsyncScheduler; expected no scheduler_cls, "
                                 f"got {scheduler_cls!r}")
            scheduler_cls = AsyncScheduler
        self.async_scheduling = async_scheduling
        self.layout = layout
        self.num_blocks = num_blocks
        self.hooks = tuple(hooks)
        cfg = layout.config
        self.vllm_config = copy.deepcopy(_engine_config(
            layout.dcp, cfg.max_model_len, min(g.group.block_size for g in layout.groups), max_num_batched_tokens,
            max_num_seqs, long_prefill_token_threshold, cfg.retention_interval, cfg.shared_prefix_checkpoint,
            cfg.hash_block_size,
        ))
        self.vllm_config.kv_transfer_config = kv_transfer_config
        if kv_cache_metrics:  # --kv-cache-metrics --kv-cache-metrics-sample 1.0: every block tracked
            self.vllm_config.observability_config.kv_cache_metrics = True
            self.vllm_config.observability_config.kv_cache_metrics_sample = 1.0
        if kv_events:  # --kv-events-config '{"enable_kv_cache_events": true}', published below
            self.vllm_config.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        self.kv_load_steps = kv_load_steps
        self._load_started: dict[str, int] = {}  # request -> the step its asynchronous load started
        cache_config = self.vllm_config.cache_config
        cache_config.num_gpu_blocks = num_blocks
        cache_config.block_size = chunk_split_block_size(layout)
        self.kv_cache_config = kv_cache_config_for(layout, num_blocks)
        self.kv_cache_config.prefix_cache_retention_interval = cfg.retention_interval
        self.disagreements = self._resolve_geometry()
        forced = {}
        if use_eagle:
            forced["use_eagle"] = True
        if num_hash_lookahead_tokens:
            forced["num_hash_lookahead_tokens"] = num_hash_lookahead_tokens
        with _manager_factory(manager_class, **forced):
            self.scheduler = scheduler_cls(
                vllm_config=self.vllm_config,
                kv_cache_config=self.kv_cache_config,
                structured_output_manager=StructuredOutputManager(self.vllm_config),
                block_size=layout.scheduler_block_size,
                hash_block_size=layout.hash_block_size,
            )
        #: With ``kv_events``, every ``KVEventBatch`` the Scheduler published, in order.
        self.kv_event_batches: list = []
        if kv_events:
            self.scheduler.kv_event_publisher = _RecordingPublisher(self.kv_event_batches)
        if use_eagle:
            self.scheduler.use_eagle_block_drop = True
        if num_hash_lookahead_tokens:
            self.scheduler.num_hash_lookahead_tokens = num_hash_lookahead_tokens
        hash_fn = get_hash_fn_by_name(cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)  # what EngineCore does once prefix caching is on
        self._block_hasher = get_request_block_hasher(layout.hash_block_size, hash_fn, num_hash_lookahead_tokens)
        self._manager_class = manager_class
        self._vllm_evictions = 0
        if manager_class is None:
            self._count_evictions()
        self.step_count = 0
        self._pending: list[TraceRequest] = []
        self._expected: dict[str, tuple[int, ...]] = {}
        self._cached: dict[str, int] = {}
        self._prompt_len: dict[str, int] = {}
        self._records: list[StepRecord] = []
        self._copies = self._preemptions = 0
        self._peak = 0
        self._scheduler_seconds = self._scheduler_cpu_seconds = 0.0
        self._wall_start: Optional[float] = None
        self._unsampled: dict[str, int] = {}  # request -> samples the runner made that vLLM has not seen
        self._in_flight: Optional[_Scheduled] = None  # async_scheduling: the step whose output is pending

    @property
    def kv_cache_manager(self):
        return self.scheduler.kv_cache_manager

    @property
    def evictions(self) -> int:
        """Cached blocks whose keys were dropped because the pool handed them out again (kvproof's
        manager counts its own)."""
        if self._manager_class is None:
            return self._vllm_evictions
        return self.kv_cache_manager.manager.num_evictions

    # --- set-up ---------------------------------------------------------------------------------

    def _resolve_geometry(self) -> list[str]:
        """vLLM's own (S, H, A) for this config; differences from the layout's, as text. Also
        records A in the KV config, as EngineCore does (with vLLM's rule, never kvproof's)."""
        out = []
        try:
            s, h = resolve_kv_cache_block_sizes(self.kv_cache_config, self.vllm_config)
        except ValueError as e:
            out.append(f"vLLM rejects the block sizes: {e}")
            s, h = self.layout.scheduler_block_size, self.layout.hash_block_size
        if (s, h) != (self.layout.scheduler_block_size, self.layout.hash_block_size):
            out.append(f"(S, H): vLLM {(s, h)}, kvproof {(self.layout.scheduler_block_size, self.layout.hash_block_size)}")
        a = resolve_cache_hit_alignment_tokens(
            self.kv_cache_config, self.vllm_config, self.layout.scheduler_block_size, self.layout.hash_block_size)
        self.kv_cache_config.cache_hit_alignment_tokens = a
        if a != self.layout.cache_hit_alignment:
            out.append(f"cache-hit alignment: vLLM {a}, kvproof {self.layout.cache_hit_alignment}")
        return out

    def _count_evictions(self) -> None:
        """Observe (not change) the pool: count cached blocks dropped when handed out again."""
        pool = self.kv_cache_manager.block_pool
        evict = pool._maybe_evict_cached_block

        def counted(block):
            evicted = evict(block)
            self._vllm_evictions += evicted
            return evicted

        pool._maybe_evict_cached_block = counted

    def add_trace(self, trace: Sequence[TraceRequest]) -> None:
        """Mutates. Queue ``trace``'s requests for their arrival steps. Raises ValueError naming a
        request vLLM cannot run as the trace asks (duplicate id, too long for max_model_len)."""
        limit = self.layout.config.max_model_len
        for t in trace:
            if t.id in self._expected:
                raise ValueError(f"duplicate request id {t.id!r}")
            if not t.prompt:
                raise ValueError(f"request {t.id!r}: prompt must hold at least one token")
            # vLLM stops a request once num_tokens reaches max_model_len, so all k outputs are
            # sampled only if prompt + k <= max_model_len.
            if len(t.prompt) + max(len(t.output), 1) > limit:
                raise ValueError(
                    f"request {t.id!r}: {len(t.prompt)} prompt tokens + {max(len(t.output), 1)} outputs exceed "
                    f"max_model_len {limit}; vLLM would stop it early"
                )
            self._expected[t.id] = tuple(t.output)
        self._pending.extend(trace)
        self._pending.sort(key=lambda t: t.arrival)  # stable: equal arrivals keep trace order

    def _vllm_request(self, t: TraceRequest) -> Request:
        return Request(
            request_id=t.id,
            prompt_token_ids=list(t.prompt),
            sampling_params=SamplingParams(max_tokens=max(len(t.output), 1), ignore_eos=True),
            pooling_params=None,
            arrival_time=float(t.arrival),
            cache_salt=t.cache_salt,
            block_hasher=self._block_hasher,
        )

    # --- the loop -------------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return bool(self._pending) or self._in_flight is not None or self.scheduler.has_unfinished_requests()

    def step(self) -> Optional[StepRecord]:
        """Mutates. One engine-core step: arrivals, ``schedule()``, the stand-in runner, then
        ``update_from_output()`` and the abort of requests with no outputs whose prefill ended.
        With ``async_scheduling`` the update is the previous step's (its record is returned;
        None for the first step), and this step's follows in the next call (or in this one, if
        it scheduled nothing)."""
        if self._wall_start is None:
            self._wall_start = time.perf_counter()
        self.step_count += 1
        s = self.step_count
        sched = self.scheduler
        while self._pending and self._pending[0].arrival <= s:
            t = self._pending.pop(0)
            self._prompt_len[t.id] = len(t.prompt)
            sched.add_request(self._vllm_request(t))
        t0, c0 = time.perf_counter(), time.thread_time()
        out = sched.schedule()
        self._scheduler_seconds += time.perf_counter() - t0
        self._scheduler_cpu_seconds += time.thread_time() - c0
        in_use = self.num_blocks - 1 - self.kv_cache_manager.block_pool.get_num_free_blocks()
        self._peak = max(self._peak, in_use)
        starts = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
        for n in out.scheduled_new_reqs:
            if n.req_id not in self._cached:
                self._cached[n.req_id] = sched.requests[n.req_id].prefill_stats.num_cached_tokens
        cached_reqs = out.scheduled_cached_reqs
        starts.update(zip(cached_reqs.req_ids, cached_reqs.num_computed_tokens))
        for hook in self.hooks:
            hook.scheduled(self, s, out)
        runner_output, no_outputs = self._sample(out)
        for hook in self.hooks:
            hook.sampled(self, out, runner_output)
        this = _Scheduled(s, out, starts, runner_output, no_outputs, in_use)
        if not self.async_scheduling:
            return self._settle(this)
        previous, self._in_flight = self._in_flight, this
        record = self._settle(previous) if previous is not None else None
        if out.total_num_scheduled_tokens == 0:  # nothing to overlap with: settle it now too
            self._in_flight = None
            # Stalled only if settling the step before freed nothing to schedule next time.
            record = self._settle(this, stalls=previous is None)
        return record

    def _settle(self, step: "_Scheduled", stalls: bool = True) -> StepRecord:
        """Mutates. ``update_from_output()`` for ``step``, the abort of its zero-output requests,
        its record and the hooks' ``updated``; raises HarnessStalled (if ``stalls``) when it
        scheduled nothing and nothing else can happen."""
        s, out, runner_output, no_outputs = step.step, step.output, step.runner_output, step.no_outputs
        sched = self.scheduler
        t0, c0 = time.perf_counter(), time.thread_time()
        engine_outputs = sched.update_from_output(out, runner_output)
        self._scheduler_seconds += time.perf_counter() - t0
        self._scheduler_cpu_seconds += time.thread_time() - c0
        unsampled = self._unsampled
        for rid, tokens in zip(runner_output.req_ids, runner_output.sampled_token_ids):
            if tokens:
                unsampled[rid] -= 1
                if not unsampled[rid]:
                    del unsampled[rid]
        if no_outputs:
            sched.finish_requests(no_outputs, RequestStatus.FINISHED_ABORTED)
        finished = [o.request_id for outs in engine_outputs.values() for o in outs.outputs if o.finish_reason is not None]
        finished.extend(no_outputs)
        copies = tuple((c.src_block_id, c.dst_block_id) for c in (out.kv_cache_block_copies or ()))
        record = StepRecord(
            step=s,
            chunks=tuple((rid, step.starts[rid], n) for rid, n in out.num_scheduled_tokens.items()),
            copies=copies,
            preempted=tuple(sorted(out.preempted_req_ids)),
            finished=tuple(finished),
            blocks_in_use=step.blocks_in_use,
        )
        self._records.append(record)
        self._copies += len(copies)
        self._preemptions += len(out.preempted_req_ids)
        for hook in self.hooks:
            hook.updated(self, record, out, runner_output)
        if (stalls and out.total_num_scheduled_tokens == 0 and not self._pending and not self._load_started
                and self._in_flight is None and runner_output.kv_connector_output is None
                and sched.has_unfinished_requests()):
            waiting = sorted(r.request_id for r in sched.requests.values() if not r.is_finished())
            raise HarnessStalled(
                f"step {s}: vLLM scheduled nothing and nothing arrives later; requests {waiting} cannot be "
                f"scheduled with {self.num_blocks} blocks"
            )
        return record

    def _sample(self, out: SchedulerOutput) -> tuple[ModelRunnerOutput, list[str]]:
        """The stand-in runner: a request whose chunk reaches the end of the tokens the runner
        knows (vLLM's, and its own samples vLLM has not seen yet) samples its next expected
        output (nothing for a request with no outputs, returned to abort)."""
        req_ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        no_outputs = []
        unsampled = self._unsampled
        for rid in req_ids:
            req = self.scheduler.requests[rid]
            token: list[int] = []
            ahead = unsampled.get(rid, 0)
            if req.num_computed_tokens >= req.num_tokens + ahead:
                expected, k = self._expected[rid], req.num_output_tokens + ahead
                if expected:
                    token = [expected[k] if k < len(expected) else expected[-1]]  # past the last: vLLM discards it
                    unsampled[rid] = ahead + 1
                else:
                    no_outputs.append(rid)
            sampled.append(token)
        runner_output = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={rid: i for i, rid in enumerate(req_ids)}, sampled_token_ids=sampled,
        )
        if self.scheduler.connector is not None:
            started = self._load_started
            for r in self.scheduler.requests.values():
                if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                    started.setdefault(r.request_id, self.step_count)
            arrived = {rid for rid, s in started.items() if self.step_count - s + 1 >= self.kv_load_steps}
            for rid in arrived:
                del started[rid]
            if arrived:
                runner_output.kv_connector_output = KVConnectorOutput(finished_recving=arrived)
        return runner_output, no_outputs

    def run(self, trace: Sequence[TraceRequest], max_steps: int = 1_000_000) -> HarnessResult:
        """Mutates. Run ``trace`` to completion and return the result. Raises HarnessStalled if
        vLLM stops making progress or ``max_steps`` steps do not finish it."""
        self.add_trace(trace)
        while self.has_unfinished():
            if self.step_count >= max_steps:
                raise HarnessStalled(f"no completion after {max_steps} steps")
            self.step()
        return self.result()

    def result(self) -> HarnessResult:
        wall = time.perf_counter() - self._wall_start if self._wall_start is not None else 0.0
        return HarnessResult(
            num_cached_tokens=dict(self._cached),
            num_prompt_tokens=dict(self._prompt_len),
            steps=list(self._records),
            copies=self._copies,
            preemptions=self._preemptions,
            evictions=self.evictions,
            peak_blocks_in_use=self._peak,
            scheduler_seconds=self._scheduler_seconds,
            scheduler_cpu_seconds=self._scheduler_cpu_seconds,
            wall_seconds=wall,
            disagreements=list(self.disagreements),
        )
