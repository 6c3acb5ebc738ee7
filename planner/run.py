"""Run one planning configuration: a workload through kvproof's contract-checked scheduler and
KV-cache manager, in a pool sized like vLLM's, and what the run measured."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

from kvproof.impl.request import Request
from kvproof.impl.scheduler import Scheduler, StepPlan
from kvproof.planner.memory import PoolPlan, expand_groups, largest_request, table_bytes_per_gpu
from kvproof.sim.replay import replay
from kvproof.sim.workload import Workload
from kvproof.spec.layout import LayoutConfig, resolve_layout


@dataclasses.dataclass(frozen=True)
class RunOptions:
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    use_eagle: bool = False
    oracle: bool = False


@dataclasses.dataclass
class ConfigReport:
    """What one configuration measured; ``*_per_group`` lists follow the layout's groups."""

    dcp: int
    kv_memory_bytes: Optional[int]  # per GPU; None when the pool was given in blocks
    num_blocks: int
    block_bytes: int
    hash_block_size: int
    cache_hit_alignment: int
    requests: int
    prompt_tokens: int
    cached_tokens: int
    requests_with_hit: int
    prefill_tokens: int
    cow_copies: int
    evictions: int
    preemptions: int
    steps: int
    #: Attention groups alone: the hit they could restore at admission (the joint hit is
    #: lower when a Mamba group has no state there); None where the engine cannot say.
    attention_cached_tokens: Optional[int]
    peak_blocks_per_group: Optional[list[int]]
    table_bytes_per_group: list[int]
    largest_request: int
    violations: list[str]
    seconds: float
    engine: str = "kvproof"
    #: Engine remarks (vLLM: where its own geometry resolution differs from the layout's).
    notes: list[str] = dataclasses.field(default_factory=list)
    #: The pool's eviction policy (``spec.eviction``); vLLM's engine is always lru.
    eviction: str = "lru"
    #: The checkpoint policy (``spec.checkpoints``); vLLM's engine always places vLLM's.
    checkpoints: str = "vllm"
    #: Hit rate of the requests arriving before the middle request, and of the rest: a cold
    #: cache shows as a lower first half (None where the engine does not say).
    halves: Optional[tuple[float, float]] = None
    #: The most pool blocks all groups held at once (in use or cached), at most the pool; None
    #: where the engine does not say. Not the sum of ``peak_blocks_per_group``.
    peak_blocks: Optional[int] = None
    #: The attention block asked for with ``--block-size`` (None: the layout's own).
    block_size: Optional[int] = None

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def attention_hit_rate(self) -> Optional[float]:
        if self.attention_cached_tokens is None:
            return None
        return self.attention_cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def config_layout(base: LayoutConfig, dcp: int, pool: PoolPlan):
    """The layout a configuration replays: ``base`` at ``dcp``, each group repeated once per
    vLLM group it becomes. ValueError if the geometry is impossible."""
    return resolve_layout(dataclasses.replace(base, dcp=dcp, groups=expand_groups(base.groups, pool)))


def check_capacity(
    longest: int, base: LayoutConfig, dcp: int, pool: PoolPlan, options: RunOptions,
    remedy: str = "raise --kv-memory-gib or --num-blocks",
) -> int:
    """The longest request the pool holds alone (at most max-model-len); ValueError (ending
    with ``remedy``) unless a request of ``longest`` tokens fits both."""
    if longest > base.max_model_len:
        raise ValueError(f"the workload's longest request needs {longest:,} tokens > max_model_len {base.max_model_len:,}")
    layout = config_layout(base, dcp, pool)
    expanded = tuple(g.group for g in layout.groups)
    usable = pool.num_blocks - 1  # block 0 is the null block
    fits = largest_request(expanded, dcp, usable, base.max_model_len, options.max_num_batched_tokens)
    if fits < longest:
        raise ValueError(
            f"at DCP {dcp} the pool of {pool.num_blocks:,} blocks holds a request of at most {fits:,} tokens, "
            f"but the workload's longest needs {longest:,}; {remedy}"
        )
    return fits


def run_config(
    workload: Workload,
    base: LayoutConfig,
    dcp: int,
    pool: PoolPlan,
    kv_memory_bytes: Optional[int],
    options: RunOptions,
    on_request_done: Optional[Callable[[], None]] = None,
) -> ConfigReport:
    """Replay ``workload`` at ``dcp`` in ``pool``. Raises ValueError / CapacityError for input
    the configuration cannot serve (checked before the replay where it can be)."""
    fits = check_capacity(workload.longest_request, base, dcp, pool, options)
    layout = config_layout(base, dcp, pool)
    attention = any(g.group.kind.is_attention and g.group.prefix_cacheable for g in layout.groups)
    counted: set[str] = set()
    attention_cached = 0
    managers: list = []

    def on_step(plan: StepPlan, sched: Scheduler) -> None:
        """At a request's first admission: what the attention groups alone could restore. One
        pass suffices: full attention / MLA hits are downward closed and go first, so they
        accept whatever a sliding-window group (last) lowers the length to. Reads the
        managers, changes nothing."""
        nonlocal attention_cached
        if not managers:
            managers.extend(sorted(
                (m for m in sched.kv.managers if m.group.kind.is_attention and m.group.prefix_cacheable),
                key=lambda m: not m.group.kind.supports_fine_grained_lookup,
            ))
        align = sched.kv.alignment
        for c in plan.chunks:
            req = c.request
            if c.overwrite and req.request_id not in counted and req.num_preemptions == 0:
                counted.add(req.request_id)
                n = min(req.num_tokens - 1, req.hashed_len)
                n -= n % align
                for m in managers:
                    if n <= 0:
                        break
                    n, _ = m.find_hit(req, n)
                attention_cached += max(n, 0)

    middle = workload.entries[len(workload.entries) // 2].arrival if workload.entries else 0
    halves = [[0, 0], [0, 0]]  # [cached, prompt] before the middle arrival, and from it

    def on_finish(req: Request) -> None:
        counted.discard(req.request_id)
        if req.num_cached_tokens is not None:
            half = halves[req.arrival >= middle]
            half[0] += req.num_cached_tokens
            half[1] += req.num_prompt_tokens
        if on_request_done is not None:
            on_request_done()

    started = time.perf_counter()
    result = replay(
        workload.requests(), layout, pool.num_blocks, options.max_num_batched_tokens,
        use_eagle=options.use_eagle, oracle=options.oracle, on_step=on_step if attention else None,
        on_finish=on_finish, keep_requests=False, max_num_seqs=options.max_num_seqs,
    )
    seconds = time.perf_counter() - started
    tables = table_bytes_per_gpu(layout, options.max_num_seqs)
    return ConfigReport(
        dcp=dcp,
        kv_memory_bytes=kv_memory_bytes,
        num_blocks=pool.num_blocks,
        block_bytes=pool.block_bytes,
        hash_block_size=layout.hash_block_size,
        cache_hit_alignment=layout.cache_hit_alignment,
        requests=result.num_requests,
        prompt_tokens=result.prompt_tokens,
        cached_tokens=result.cached_tokens,
        requests_with_hit=result.requests_with_hit,
        prefill_tokens=result.prefill_tokens,
        cow_copies=result.cow_copies,
        evictions=result.evictions,
        preemptions=result.preemptions,
        steps=result.steps,
        attention_cached_tokens=attention_cached if attention else result.cached_tokens,
        peak_blocks_per_group=_per_layout_group(result.peak_blocks_per_group, pool),
        table_bytes_per_group=_per_layout_group(tables, pool),
        largest_request=fits,
        violations=result.violations,
        seconds=seconds,
        eviction=base.eviction,
        checkpoints=base.checkpoints,
        halves=tuple(c / n if n else 0.0 for c, n in halves),
        peak_blocks=result.peak_blocks,
    )


def _per_layout_group(values: tuple[int, ...], pool: PoolPlan) -> list[int]:
    """Sum an expanded layout's per-group values back onto the user's groups."""
    out, i = [], 0
    for m in pool.vllm_groups:
        out.append(sum(values[i:i + m]))
        i += m
    return out
