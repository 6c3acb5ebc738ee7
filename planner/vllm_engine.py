"""One planning configuration through vLLM 0.33.0's own scheduler and KV-cache manager, driven by
hand on the CPU (:mod:`kvproof.integrations.vllm.engine_harness`), so a plan shows what vLLM
itself would do next to kvproof's numbers. Needs vLLM installed (``requirements/vllm.txt``).

The workload is fed lazily, as kvproof's replay does: a request is handed to vLLM the step
before it arrives, and when nothing is in flight the step counter jumps to the next arrival
(the skipped steps would schedule nothing, in vLLM as in kvproof).
"""

from __future__ import annotations

import functools
import time
from typing import Callable, Optional

from kvproof.extras import require
from kvproof.planner.memory import PoolPlan, largest_request, table_bytes_per_gpu
from kvproof.planner.run import ConfigReport, RunOptions, _per_layout_group, config_layout
from kvproof.sim.workload import Workload
from kvproof.spec.layout import LayoutConfig


#: The engines that run vLLM's Scheduler, as the plan names them in words.
ENGINE_NAMES = {"vllm": "vLLM", "kvproof-vllm": "kvproof's manager in vLLM"}


def _manager_class(engine: str, base: LayoutConfig):
    """The KV-cache manager class vLLM's Scheduler builds: None for vLLM's own; for kvproof's,
    its class with the options the plan's ``vllm serve`` command passes in ``KVPROOF_OPTIONS``."""
    if engine == "vllm":
        return None
    from kvproof.integrations.vllm import serving_options
    from kvproof.integrations.vllm.kvproof_manager import KvproofKVCacheManager
    from kvproof.planner.serve_command import kvproof_options

    return functools.partial(KvproofKVCacheManager, options=serving_options.parse(kvproof_options(base)))


def _scheduler(engine: str) -> dict:
    """The Scheduler class ``KVPROOF_MANAGER=kvproof`` serves with (its chunk split also ends at
    the checkpoint policy's stops, ``kvproof_scheduler``); stock vLLM's otherwise."""
    if engine == "vllm":
        return {}
    from kvproof.integrations.vllm.kvproof_scheduler import KvproofScheduler

    return {"scheduler_cls": KvproofScheduler}


def require_vllm() -> None:
    """Raise ``kvproof.extras.MissingExtra`` (naming the ``vllm`` extra and its install
    command) unless vLLM's scheduler side imports on the CPU platform; vLLM's own
    logging is turned down to errors, so the plan's stderr carries only the plan's messages."""
    require("vllm", "--engine vllm")


def run_config_vllm(
    workload: Workload,
    base: LayoutConfig,
    dcp: int,
    pool: PoolPlan,
    kv_memory_bytes: Optional[int],
    options: RunOptions,
    on_request_done: Optional[Callable[[], None]] = None,
    engine: str = "vllm",
) -> ConfigReport:
    """Replay ``workload`` at ``dcp`` in ``pool`` through vLLM's Scheduler, with vLLM's own
    KV-cache manager (``engine`` "vllm") or kvproof's under ``base``'s rules, as
    ``KVPROOF_MANAGER=kvproof`` serves it ("kvproof-vllm"). Raises ValueError when vLLM or
    kvproof's manager refuses the configuration or cannot schedule a request in the pool."""
    from kvproof.integrations.vllm.engine_harness import EngineHarness, HarnessStalled

    layout = config_layout(base, dcp, pool)
    expanded = tuple(g.group for g in layout.groups)
    fits = largest_request(expanded, dcp, pool.num_blocks - 1, base.max_model_len, options.max_num_batched_tokens)
    try:
        harness = EngineHarness(
            layout, pool.num_blocks, max_num_batched_tokens=options.max_num_batched_tokens,
            max_num_seqs=min(options.max_num_seqs, options.max_num_batched_tokens), use_eagle=options.use_eagle,
            manager_class=_manager_class(engine, base), **_scheduler(engine),
        )
    except ValueError as e:
        raise ValueError(f"{ENGINE_NAMES[engine]} at DCP {dcp}: {e}") from None
    started = time.perf_counter()
    prompt_len: dict[str, int] = {}
    prefill = 0
    source = workload.requests()
    upcoming = next(source, None)
    try:
        while upcoming is not None or harness.has_unfinished():
            if upcoming is not None and not harness.has_unfinished():
                harness.step_count = max(harness.step_count, upcoming.arrival - 1)  # skip idle steps
            batch = []
            while upcoming is not None and upcoming.arrival <= harness.step_count + 1:
                batch.append(upcoming)
                prompt_len[upcoming.id] = len(upcoming.prompt)
                upcoming = next(source, None)
            if batch:
                harness.add_trace(batch)
            record = harness.step()
            for rid, start, n in record.chunks:
                p = prompt_len[rid]
                if start < p:
                    prefill += min(start + n, p) - start
            for rid in record.finished:
                prompt_len.pop(rid, None)
                if on_request_done is not None:
                    on_request_done()
    except HarnessStalled as e:
        raise ValueError(f"{ENGINE_NAMES[engine]} at DCP {dcp}: {e}") from None
    except (AssertionError, RuntimeError) as e:  # vLLM refusing the configuration deep inside
        raise ValueError(f"{ENGINE_NAMES[engine]} at DCP {dcp} failed: {type(e).__name__}: {e}") from None
    result = harness.result()
    cached = result.num_cached_tokens
    return ConfigReport(
        dcp=dcp,
        kv_memory_bytes=kv_memory_bytes,
        num_blocks=pool.num_blocks,
        block_bytes=pool.block_bytes,
        hash_block_size=layout.hash_block_size,
        cache_hit_alignment=harness.kv_cache_config.cache_hit_alignment_tokens,
        requests=len(result.num_prompt_tokens),
        prompt_tokens=sum(result.num_prompt_tokens.values()),
        cached_tokens=sum(cached.values()),
        requests_with_hit=sum(1 for n in cached.values() if n > 0),
        prefill_tokens=prefill,
        cow_copies=result.copies,
        evictions=result.evictions,
        preemptions=result.preemptions,
        steps=harness.step_count,
        attention_cached_tokens=None,
        peak_blocks_per_group=None,
        table_bytes_per_group=_per_layout_group(table_bytes_per_gpu(layout, options.max_num_seqs), pool),
        largest_request=fits,
        violations=[],
        seconds=time.perf_counter() - started,
        engine=engine,
        eviction=base.eviction if engine == "kvproof-vllm" else "lru",
        checkpoints=base.checkpoints,
        notes=list(result.disagreements),
    )
