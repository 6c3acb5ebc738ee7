"""vLLM's schedulers with kvproof's checks installed: ``--scheduler-cls
kvproof.integrations.vllm.checked_scheduler.CheckedScheduler`` (or ``CheckedAsyncScheduler``, for
async scheduling, the default on GPUs).

At construction, after vLLM's own constructor: the engine's layout is read back into kvproof
(``kv_specs.layout_from_vllm``), vLLM's geometry is compared with kvproof's spec (per group:
effective block and block-table width; then S, H, the partial-hit rule and the cache-hit
alignment), and the manager checks are attached (``manager_checks``). A geometry violation stops
the engine before it serves anything.

The tier comes from ``KVPROOF_CONTRACTS`` (``cheap`` when unset: choosing this class asks for
checks), the action from ``KVPROOF_ON_VIOLATION`` (violations.py).
"""

from __future__ import annotations

import multiprocessing
import os
from typing import NoReturn, Optional

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from kvproof.integrations.vllm import stop_report
from kvproof.integrations.vllm.kv_specs import layout_from_vllm
from kvproof.integrations.vllm.manager_checks import ManagerChecker, attach
from kvproof.integrations.vllm.violations import ViolationSink, contracts_mode, logger
from kvproof.spec.layout import Layout


def check_geometry(scheduler, layout: Layout, sink: ViolationSink) -> None:
    """vLLM's sizes for this engine against kvproof's spec (``layout``). No state change."""
    vllm_config = scheduler.vllm_config
    max_len = vllm_config.model_config.max_model_len
    coordinator = scheduler.kv_cache_manager.coordinator
    for g, (group, manager, gl) in enumerate(zip(scheduler.kv_cache_config.kv_cache_groups,
                                                 coordinator.single_type_managers, layout.groups)):
        if manager.block_size != gl.effective_block_size:
            sink.report(
                "INV-GEOM-EFFECTIVE-BLOCK",
                f"group {g} ({gl.group.label}): vLLM's manager covers {manager.block_size} tokens per block, "
                f"kvproof's geometry {gl.effective_block_size} (DCP {layout.dcp})",
            )
        # The worker sizes its rows with exactly this call (gpu_model_runner.may_reinitialize_input_batch).
        rows = group.kv_cache_spec.max_num_blocks_per_req(vllm_config, max_len)
        if rows < gl.max_num_blocks_per_req:
            longest = rows * gl.effective_block_size
            sink.report(
                "INV-TABLE-WIDTH",
                f"group {g} ({gl.group.label}): vLLM sizes the block-table row at {rows:,} entries; kvproof's geometry "
                f"needs {gl.max_num_blocks_per_req:,} for max_model_len {max_len:,} at DCP {layout.dcp} -- a request "
                f"longer than {longest:,} tokens would write past its row",
                fix=f"serve with --max-model-len {longest:,} or less, or use a vLLM that sizes each group's row by "
                    "its own block size (a Mamba group's is not divided by DCP)",
            )
    if not scheduler.cache_config.enable_prefix_caching:
        return  # vLLM then hashes at S and never hits; H and the hit rule do not apply
    if scheduler.block_size != layout.scheduler_block_size:
        sink.report("INV-GEOM-SCHED-LCM",
                    f"vLLM's scheduler block size is {scheduler.block_size}, kvproof's {layout.scheduler_block_size}")
    if scheduler.hash_block_size != layout.hash_block_size:
        sink.report("INV-GEOM-HASH-DIVIDES",
                    f"vLLM hashes every {scheduler.hash_block_size} tokens, kvproof's geometry every {layout.hash_block_size}")
    partial = bool(getattr(coordinator, "enable_partial_hash_hits", False))
    if len(layout.groups) > 1 and partial != layout.partial_hash_hits:
        sink.report("INV-GEOM-PARTIAL-RULE",
                    f"vLLM {'allows' if partial else 'refuses'} partial hash hits; kvproof: {layout.partial.reason}")
    alignment = coordinator.single_type_managers[0].cache_hit_alignment_tokens if coordinator.single_type_managers else None
    if alignment is not None and alignment != layout.cache_hit_alignment:
        sink.report("INV-GEOM-HIT-ALIGN",
                    f"vLLM's hits land on multiples of {alignment}, kvproof's on multiples of {layout.cache_hit_alignment}")


def install_checks(scheduler, mode: Optional[str] = None, action: Optional[str] = None) -> Optional[ManagerChecker]:
    """Mutates ``scheduler`` (its manager instance gets wrappers): run the start-up checks and
    attach the manager checks, once. ``mode`` None reads ``KVPROOF_CONTRACTS`` (``cheap`` when
    unset); ``action`` None reads ``KVPROOF_ON_VIOLATION``. Raises ValueError when the checks
    cannot be installed (a cache group kvproof has no model of)."""
    existing = getattr(scheduler.kv_cache_manager, "_kvproof_checker", None)
    if existing is not None:
        return existing
    mode = contracts_mode(mode) or "cheap"
    try:
        layout = layout_from_vllm(scheduler.kv_cache_config, scheduler.vllm_config)
    except ValueError as e:
        _refuse(f"kvproof's checks cannot model this engine's KV cache ({e}): unset KVPROOF_CONTRACTS to serve it "
                "unchecked")
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ and multiprocessing.parent_process() is not None:
        logger.warning("kvproof: PROMETHEUS_MULTIPROC_DIR is not set, so kvproof's counters in this engine-core "
                       "process (kvproof_checked_steps_total, kvproof_violations_total) never reach /metrics; "
                       "violations are logged either way. Set it to an empty directory to count them in /metrics.")
    sink = ViolationSink(action)
    check_geometry(scheduler, layout, sink)
    checker = attach(scheduler.kv_cache_manager, layout, sink, slow=mode == "slow", scheduler=scheduler)
    logger.info("kvproof checks on (%s tier, on violation: %s) for %s", mode, sink.action,
                ", ".join(g.group.label for g in layout.groups))
    return checker


def _refuse(message: str) -> NoReturn:
    """Stop the engine at start: ``message`` (what and what to do) raised and recorded for the
    last line of vLLM's output (``stop_report``)."""
    stop_report.record(message)
    raise ValueError(message)


class CheckedScheduler(Scheduler):
    """vLLM's ``Scheduler`` with kvproof's checks (see the module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        install_checks(self)


class CheckedAsyncScheduler(AsyncScheduler):
    """vLLM's ``AsyncScheduler`` with kvproof's checks (see the module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        install_checks(self)
