"""The step protocol, driven from outside the scheduler: written once for the tests, the vLLM
parity harness and the benchmarks.

A step of the KV-cache manager is ``begin_step``, then per scheduled request ``lookup`` (a
waiting request only) and ``allocate_slots``, then ``take_block_copies`` (run before the forward
pass), then, after it, each request's computed count advanced and ``cache``; ``free`` when a
request finishes or is preempted. ``kvproof.impl.scheduler.Scheduler`` runs that sequence for a
whole batch; :class:`Step` runs it for requests a caller picks by hand (a scenario), and
:func:`drain` runs the scheduler's own loop to the end, with the content oracle watching.

The driver makes the calls the scheduler makes and nothing else (a waiting request is admitted
on its hit, whose junctions the manager keeps), so a scenario driven by hand sees what a replay
sees.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple, Optional

if TYPE_CHECKING:  # types only: the driver calls the manager's verbs, nothing else of impl
    from kvproof.impl.coordinator import Hit
    from kvproof.impl.kv_cache_manager import KVCacheManager
    from kvproof.impl.request import Request
    from kvproof.impl.scheduler import Scheduler, StepPlan
    from kvproof.oracle.content_oracle import ContentOracle


class _Lookup:
    def __repr__(self) -> str:
        return "LOOKUP"


#: ``hit=LOOKUP`` (the default): a waiting request is looked up in the step, as the scheduler
#: does. ``hit=None`` allocates it without a hit; a ``Hit`` is used as given.
LOOKUP = _Lookup()


class Scheduled(NamedTuple):
    """What :meth:`Step.schedule` did: the hit the request was admitted with (None for a running
    request) and the block ids ``allocate_slots`` returned (None: the pool was short and nothing
    changed, so the step will not compute the request)."""

    hit: Optional[Hit]
    blocks: Optional[tuple[list[int], ...]]


class Step:
    """One scheduler step over requests a caller schedules by hand. Mutates the manager and the
    requests::

        with Step(kv) as step:
            step.schedule(request, 16)
        step.copies  # what the worker copied before the forward pass

    Entering begins the step; leaving it normally takes the copies and, for every request whose
    allocation succeeded, advances its computed tokens and caches it (after the forward pass).
    Leaving by an exception does neither: the manager stays mid-step, as the scheduler's would.
    """

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.copies: Optional[list] = None
        self._computed: list[tuple[Request, int]] = []

    def __enter__(self) -> "Step":
        self.kv.begin_step()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish()

    def schedule(self, request: Request, num_new_tokens: int, hit=LOOKUP) -> Scheduled:
        """Allocate ``num_new_tokens`` more tokens of ``request``: after its computed ones when
        it is running, else after its hit (``hit``: see :data:`LOOKUP`)."""
        kv = self.kv
        if kv.is_running(request):
            hit, start = None, request.num_computed_tokens
        else:
            if hit is LOOKUP:
                hit = kv.lookup(request)
            start = hit.num_tokens if hit is not None else 0
        blocks = kv.allocate_slots(request, num_new_tokens, hit)
        if blocks is not None:
            self._computed.append((request, start + num_new_tokens))
        return Scheduled(hit, blocks)

    def finish(self) -> list:
        """Take the step's copies, then run the forward pass's bookkeeping: each scheduled
        request's computed count advanced and its new contents cached. Returns the copies."""
        self.copies = self.kv.take_block_copies()
        for request, computed in self._computed:
            request.num_computed_tokens = computed
            self.kv.cache(request)
        self._computed = []
        return self.copies


class Chunk(NamedTuple):
    """One request's chunk run alone in a step (:func:`run_chunk`)."""

    hit: Optional[Hit]
    blocks: Optional[tuple[list[int], ...]]
    copies: list


def run_chunk(kv: KVCacheManager, request: Request, num_new_tokens: int, hit=LOOKUP) -> Chunk:
    """Mutates. One step that schedules ``num_new_tokens`` of ``request`` and nothing else."""
    with Step(kv) as step:
        scheduled = step.schedule(request, num_new_tokens, hit)
    return Chunk(scheduled.hit, scheduled.blocks, step.copies)


def run_chunks(kv: KVCacheManager, request: Request, chunks) -> list[Chunk]:
    """Mutates. ``request`` alone, one step per chunk size in ``chunks`` (looked up on its first);
    stops at the first chunk the pool cannot hold. Returns each step's :class:`Chunk`."""
    runs = []
    for n in chunks:
        runs.append(run_chunk(kv, request, n))
        if runs[-1].blocks is None:
            break
    return runs


def drain(sched: Scheduler, oracle: Optional[ContentOracle] = None,
          on_plan: Optional[Callable[[StepPlan], None]] = None) -> list[Request]:
    """Mutates. The scheduler's loop until nothing is pending, waiting or running: plan a step,
    let ``on_plan`` see it, let ``oracle`` check every read it makes, run it (``finish_step``),
    and let the oracle forget each finished request. Returns the requests finished, in order."""
    finished = []
    while sched.has_unfinished():
        plan = sched.schedule()
        if on_plan is not None:
            on_plan(plan)
        if oracle is not None:
            oracle.run_step(plan)
        done = sched.finish_step(plan)
        if oracle is not None:
            for request in done:
                oracle.forget(request)
        finished += done
    return finished
