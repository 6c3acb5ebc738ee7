"""Serve a trace through kvproof's scheduler and the tiny model on DCP ranks, and compare every
computed logit with a from-scratch recomputation.

Who schedules: rank 0 runs kvproof's :class:`~kvproof.impl.scheduler.Scheduler` and
:class:`~kvproof.impl.kv_cache_manager.KVCacheManager` and broadcasts each step's plan; every
rank (rank 0 included) executes it. This is vLLM's shape -- one scheduler, workers that see only
the plan -- so the workers cannot accidentally lean on scheduler state, and no rank can drift
from another (running the scheduler on every rank would need every rank's hashing, set and dict
orders to agree, which nothing here would check). The cost is one small broadcast per step.

Per step on rank 0: ``schedule()`` -> broadcast the :class:`WorkerStep` -> every rank runs
copies then the forward pass -> ``finish_step()`` keys what was written and appends the trace's
next output. Outputs come from the trace, never from the logits, so the served run and the
reference compute the same token sequences.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from kvproof.e2e.communicators import SingleRank
from kvproof.e2e.faults import Faults
from kvproof.e2e.model import ModelConfig, TinyHybridModel, layer_specs
from kvproof.e2e.paged_cache import bytes_per_block
from kvproof.e2e.ranks import spawn_ranks
from kvproof.e2e.reference import computed_tokens, reference_logits
from kvproof.e2e.worker import ChunkWork, Worker, WorkerStep
from kvproof.impl.kv_cache_manager import KVCacheManager
from kvproof.impl.request import Request
from kvproof.impl.scheduler import Scheduler, StepPlan
from kvproof.sim.trace import TraceRequest
from kvproof.spec.capacity import check_fits_alone
from kvproof.spec.layout import Layout, LayoutConfig, resolve_layout

#: Served and recomputed logits must agree to this (float64; only summation order differs).
TOLERANCE = 1e-9
#: Rank 0 tells the other ranks that scheduling failed and no step follows.
_ABORT = "abort"


@dataclasses.dataclass(frozen=True)
class E2EOptions:
    num_blocks: int = 256  # blocks in the pool (block 0 is the null block)
    max_num_batched_tokens: int = 2048  # token budget per step
    max_num_seqs: int = 64  # running requests, and request rows on each worker
    model: ModelConfig = ModelConfig()
    backend: str = "torch"  # block-table kernels: the torch references (Triton's interpreter is slow)
    max_steps: int = 100_000  # scheduler steps that run (idle stretches before an arrival are skipped)


@dataclasses.dataclass
class ServeOutput:
    """Rank 0's record of a served run: ``logits`` holds ``(request id, first position,
    logits [n, V])`` per computed chunk, in step order."""

    logits: list[tuple[str, int, torch.Tensor]]
    hits: dict[str, list[int]]  # request id -> prefix-cache hit of each admission
    requests: int
    cached_tokens: int
    cow_copies: int
    steps: int
    preemptions: int


@dataclasses.dataclass
class E2EResult:
    requests: int  # requests served to completion
    cached_tokens: int  # tokens served from the prefix cache, summed over every admission
    hits: dict[str, list[int]]  # request id -> prefix-cache hit of each admission (preemption: several)
    cow_copies: int  # block copies the coordinator ordered
    max_abs_diff: float  # largest |served - recomputed| over every computed logit
    steps: int
    preemptions: int
    served: dict[tuple[str, int], torch.Tensor]  # (request id, position) -> logits [V], first computation

    def summary(self) -> dict:
        return {"requests": self.requests, "cached_tokens": self.cached_tokens,
                "cow_copies": self.cow_copies, "max_abs_diff": self.max_abs_diff}


def build_model(layout: Layout, config: ModelConfig) -> TinyHybridModel:
    return TinyHybridModel(config, layer_specs(layout, config.layers_per_group))


class StepLimitError(ValueError):
    """The run needs more scheduler steps than ``E2EOptions.max_steps`` allows (a limit of this
    runner, not a violated invariant)."""


#: Memory of one rank process beyond its cache and tables (torch, gloo, the model): 25.6 MB
#: measured (PSS of forked ranks at DCP 16, docs/e2e.md "Limits"), rounded up.
RANK_PROCESS_BYTES = 48 << 20
#: The fork server, started once (about 300 MB resident, most of it shared with the caller).
FORK_SERVER_BYTES = 320 << 20
#: File descriptors per rank in the caller and per peer in each rank (pipes, gloo pairs): about
#: 2 measured at DCP 16, taken as 3, plus a margin.
FDS_PER_RANK, FDS_MARGIN = 3, 64


def memory_estimate(layout: Layout, options: E2EOptions) -> tuple[int, int]:
    """``(per rank, fixed)`` bytes of a run: each rank's cache (``num_blocks`` blocks), block
    tables (two int32 copies of every request row) and process; plus the fork server once for
    spawned ranks. DCP 1 runs in the caller, whose own memory is already in use."""
    model = options.model
    cache = options.num_blocks * bytes_per_block(layout, layer_specs(layout, model.layers_per_group), model)
    tables = 2 * 4 * options.max_num_seqs * sum(g.table_width for g in layout.groups)
    if layout.dcp == 1:
        return cache + tables, 0
    return cache + tables + RANK_PROCESS_BYTES, FORK_SERVER_BYTES


def max_ranks_by_descriptors() -> Optional[int]:
    """The most ranks the open-file limit allows (None where it cannot be read)."""
    try:
        import resource
    except ImportError:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else max((soft - FDS_MARGIN) // FDS_PER_RANK, 1)


def validate(trace: list[TraceRequest], layout: Layout, options: E2EOptions) -> None:
    """Raise ValueError naming the bad value for input the run cannot serve: before any rank
    starts, and in the caller's time (checks are O(requests))."""
    if options.num_blocks < 2:
        raise ValueError(f"num_blocks {options.num_blocks} must be >= 2 (block 0 is the null block)")
    if options.max_num_batched_tokens < 1:
        raise ValueError(f"max_num_batched_tokens {options.max_num_batched_tokens} must be >= 1")
    layer_specs(layout, options.model.layers_per_group)
    most = max_ranks_by_descriptors()
    if layout.dcp > 1 and most is not None and layout.dcp > most:
        raise ValueError(
            f"dcp {layout.dcp} needs about {FDS_PER_RANK * layout.dcp + FDS_MARGIN} open files (pipes and gloo "
            f"connections), more than this process may open (ulimit -n); expected dcp <= {most}"
        )
    KVCacheManager(layout, options.num_blocks)  # refuses what the scheduler side cannot model
    for t in trace:
        n = t.num_computed_tokens
        if n > layout.config.max_model_len:
            raise ValueError(f"request {t.id!r} needs {n} tokens > max_model_len {layout.config.max_model_len}")
        # Its prefill takes a step and every output after the first another one.
        if len(t.output) > options.max_steps:
            raise StepLimitError(
                f"request {t.id!r} has {len(t.output):,} outputs, one step each, beyond the e2e runner's limit "
                f"of {options.max_steps:,} scheduler steps"
            )
        check_fits_alone(layout, options.num_blocks, t.id, n)


def run_e2e(
    trace: list[TraceRequest],
    config: LayoutConfig,
    options: E2EOptions = E2EOptions(),
    faults: Faults = Faults(),
    spawn: Optional[bool] = None,
) -> E2EResult:
    """Serve ``trace`` on ``config.dcp`` ranks and compare with the reference.

    ``spawn`` None: DCP 1 runs in this process, DCP > 1 on spawned gloo ranks; True forces
    processes even for DCP 1. Raises ValueError (bad input; StepLimitError past
    ``options.max_steps``), CapacityError (a request needs more than the pool), RankError (a
    spawned rank failed: its type name and message, or how it died)."""
    layout = resolve_layout(config)
    validate(trace, layout, options)
    # The tensors are tiny: torch's intra-op thread pool only adds synchronisation (about 15x
    # slower with 2 threads on a 2-core CI machine). Ranks run single-threaded too.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run_and_compare(trace, layout, config, options, faults, spawn)
    finally:
        torch.set_num_threads(threads)


def _run_and_compare(trace, layout: Layout, config: LayoutConfig, options: E2EOptions, faults: Faults, spawn) -> E2EResult:
    if layout.dcp == 1 and not spawn:
        out = serve(SingleRank(), trace, config, options, faults)
    else:
        out = spawn_ranks(serve, layout.dcp, (trace, config, options, faults))
    model = build_model(layout, options.model)
    reference = {t.id: reference_logits(model, computed_tokens(t.prompt, t.output)) for t in trace}
    worst = 0.0
    served: dict[tuple[str, int], torch.Tensor] = {}
    for rid, start, logits in out.logits:
        expected = reference[rid][start : start + logits.shape[0]]
        worst = max(worst, float((logits - expected).abs().max()))
        for i in range(logits.shape[0]):
            served.setdefault((rid, start + i), logits[i])
    return E2EResult(out.requests, out.cached_tokens, out.hits, out.cow_copies, worst, out.steps, out.preemptions, served)


# --- what every rank runs -----------------------------------------------------------------------


def serve(comm, trace: list[TraceRequest], config: LayoutConfig, options: E2EOptions, faults: Faults) -> Optional[ServeOutput]:
    """One rank's whole run (module-level so spawned ranks can unpickle it). Rank 0 schedules
    and returns the record; the other ranks execute the broadcast steps and return None."""
    layout = resolve_layout(config)
    model = build_model(layout, options.model)
    worker = Worker(layout, model, comm, options.num_blocks, options.max_num_seqs, faults, options.backend)
    if comm.rank != 0:
        while True:
            step = comm.broadcast_object(None)
            if step is None or step == _ABORT:
                return None
            worker.execute(step)
    return _schedule_and_serve(comm, trace, layout, options, worker)


def _schedule_and_serve(comm, trace, layout: Layout, options: E2EOptions, worker: Worker) -> ServeOutput:
    kv = KVCacheManager(layout, options.num_blocks)
    sched = Scheduler(kv, options.max_num_batched_tokens, options.max_num_seqs)
    for t in trace:
        sched.add_request(Request(
            t.id, t.prompt, layout.hash_block_size, cache_salt=t.cache_salt, arrival=t.arrival, expected_outputs=t.output,
        ))
    out = ServeOutput([], {}, 0, 0, 0, 0, 0)
    released: list[str] = []  # finished in the previous step: their rows go first
    executed = 0
    while True:
        try:
            if not sched.has_unfinished():
                plan = None
            elif executed >= options.max_steps:
                raise StepLimitError(
                    f"the run did not finish within the e2e runner's limit of {options.max_steps:,} scheduler steps"
                )
            else:
                _skip_idle_steps(sched)
                plan = sched.schedule()
                executed += 1
        except BaseException:
            comm.broadcast_object(_ABORT)  # no rank has entered the step: end them cleanly
            raise
        step = None if plan is None else _worker_step(plan, released)
        comm.broadcast_object(step)
        if step is None:
            break
        logits = worker.execute(step)
        first = 0
        for chunk in step.chunks:
            n = len(chunk.tokens)
            out.logits.append((chunk.request_id, chunk.start, logits[first : first + n].clone()))
            first += n
            if chunk.overwrite:  # an admission: it starts after its prefix-cache hit
                out.cached_tokens += chunk.start
                out.hits.setdefault(chunk.request_id, []).append(chunk.start)
        out.cow_copies += len(step.copies)
        released = [r.request_id for r in sched.finish_step(plan)]
        out.requests += len(released)
    out.steps, out.preemptions = sched.step, sched.num_preemptions
    return out


def _skip_idle_steps(sched: Scheduler) -> None:
    """Mutates. With nothing running or waiting, move the clock to just before the next
    arrival: the steps in between would schedule nothing (a request arriving at step 10**6
    costs one step, not a million)."""
    if not sched.running and not sched.waiting and sched.pending and sched.pending[0].arrival > sched.step + 1:
        sched.step = sched.pending[0].arrival - 1


def _worker_step(plan: StepPlan, finished: list[str]) -> WorkerStep:
    """What the workers need of a plan: plain tuples, picklable, no scheduler objects."""
    chunks = tuple(
        ChunkWork(
            c.request.request_id, c.start, tuple(c.request.token_ids[c.start : c.start + c.num_tokens]),
            tuple(tuple(ids) for ids in c.new_blocks), c.overwrite,
        )
        for c in plan.chunks
    )
    released = tuple(finished) + tuple(r.request_id for r in plan.preempted)
    return WorkerStep(plan.step, chunks, tuple(plan.copies), released)
