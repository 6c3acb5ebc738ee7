"""The ``vllm.general_plugins`` entry point: kvproof's manager and kvproof's checks inside every
vLLM process, without ``--scheduler-cls``.

vLLM loads general plugins once per process -- API server, engine core (before the executor,
KV-cache set-up and the scheduler), every worker (before the model runner) -- and calls
``register()``. It is inert unless ``KVPROOF_MANAGER=kvproof``, ``KVPROOF_CONTRACTS`` or
``KVPROOF_RECORD`` is set, so installing kvproof changes nothing in production.

``KVPROOF_RECORD=FILE`` (with either manager, with or without checks) records the engine's
finished requests as a Mooncake-format trace (``trace_recorder``; a path it cannot write, or a
file already holding data, stops the start naming the value).

``KVPROOF_MANAGER=kvproof`` (``vllm`` or unset: vLLM's own) binds the name vLLM's Scheduler
builds its manager with to kvproof's (``kvproof_manager.KvproofKVCacheManager``), after
validating ``KVPROOF_OPTIONS`` (``serving_options``), and wraps the Scheduler's chunk split so
that it also ends chunks where the options' checkpoint policy keeps states
(``kvproof_scheduler``); a Scheduler with a KV connector
(``--kv-transfer-config``: real connectors call vLLM's block-pool API), an async Scheduler or
speculative decoding over Mamba groups is refused at construction with one line saying what to
change. With it, ``KVPROOF_CONTRACTS`` keeps its worker-side checks below; on the scheduler side kvproof's manager runs its own
contracts (cheap always; ``slow`` turns on the slow tier, ``spec.contracts.set_slow``) in place
of the checks of vLLM's manager, which read vLLM's internals.

When ``KVPROOF_CONTRACTS`` is set (``cheap`` or ``slow``), ``register()``:

* refuses a vLLM version the checks were not tested against (they read vLLM internals);
* wraps ``Scheduler.__init__`` so that every scheduler vLLM builds (sync or async, or a
  subclass) gets the checks of ``checked_scheduler.install_checks`` -- start-up geometry, then
  the per-call manager checks;
* wraps the worker side (``worker_checks``): block-table writes of model runner V1 and V2,
  checked against each row's capacity for every group before anything is written, the
  copy-on-write batch before it runs, and the slot mappings against ``spec.placement`` on a
  sample of steps.

Any failure to install (a bad switch value, an untested version, a missing vLLM hook) raises
from ``register()``, which vLLM propagates: asking for checks that cannot be had stops the
engine at start. Calling ``register()`` again in the same process does nothing.

In the first process that loads it (``vllm serve``'s API server), ``register()`` also starts the
stop report (``stop_report``: why kvproof stopped vLLM, as the last line of its output, and a
non-zero exit status), and removes from ``PROMETHEUS_MULTIPROC_DIR`` the metric files of
processes no longer running, so that ``/metrics`` starts from zero instead of showing the
previous run's counts.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

from kvproof.integrations.vllm import TESTED_VLLM_VERSIONS, serving_options, stop_report, trace_recorder
from kvproof.integrations.vllm.violations import contracts_mode, logger, violation_action

MANAGERS = ("vllm", "kvproof")

_installed = False


def register() -> None:
    """vLLM's plugin hook (see the module docstring). Mutates vLLM's classes once per process
    when ``KVPROOF_MANAGER=kvproof`` or ``KVPROOF_CONTRACTS`` is set; does nothing otherwise."""
    global _installed
    mode = contracts_mode()
    kvproof_manager = manager_choice() == "kvproof"
    record = trace_recorder.recording_path()
    if (mode is None and not kvproof_manager and record is None) or _installed:
        return
    violation_action()  # a bad KVPROOF_ON_VIOLATION fails here, at start, not at the first violation
    if kvproof_manager:
        serving_options.from_environment()  # and a bad KVPROOF_OPTIONS
    if record is not None:  # and a path the recording cannot be written to (the first process creates it)
        trace_recorder.check_path(record, first=not os.environ.get(stop_report.ENV))
    import vllm

    if vllm.__version__ not in TESTED_VLLM_VERSIONS:
        if kvproof_manager:
            switch = "KVPROOF_MANAGER=kvproof asks for kvproof's manager"
        elif mode is not None:
            switch = f"KVPROOF_CONTRACTS={mode} asks for checks"
        else:
            switch = f"KVPROOF_RECORD={record} asks for a recording"
        raise RuntimeError(
            f"kvproof: {switch}, but vLLM {vllm.__version__} is not a version they "
            f"were tested against ({', '.join(TESTED_VLLM_VERSIONS)}); they read vLLM's internals. Install a "
            "tested vLLM or unset the switch."
        )
    if stop_report.begin():
        _forget_dead_processes_metrics()
    if kvproof_manager:
        _install_kvproof_manager(slow=mode == "slow")
    elif mode is not None:
        _install_scheduler_side()
    if mode is not None:
        _install_worker_side()
    if record is not None:
        _install_recorder(record)
    _installed = True


def manager_choice(value: Optional[str] = None) -> str:
    """The manager asked for (``KVPROOF_MANAGER`` unless ``value`` is given): ``vllm`` (also when
    unset) or ``kvproof``. Raises ValueError naming any other value."""
    raw = os.environ.get("KVPROOF_MANAGER", "") if value is None else value
    choice = raw.strip().lower() or "vllm"
    if choice not in MANAGERS:
        raise ValueError(f"KVPROOF_MANAGER={raw!r}; expected one of {', '.join(MANAGERS)} (or unset for vLLM's own)")
    return choice


def _forget_dead_processes_metrics() -> None:
    """Remove from ``PROMETHEUS_MULTIPROC_DIR`` the files of processes that no longer run
    (``<kind>_<pid>.db``, prometheus_client's names): a previous run's counts, which
    prometheus_client adds to this run's (it asks for the directory to be emptied between runs)."""
    folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not folder or not os.path.isdir(folder):
        return
    removed = 0
    for name in os.listdir(folder):
        pid = name[:-3].rpartition("_")[2] if name.endswith(".db") else ""
        if not (pid.isascii() and pid.isdigit()) or _running(int(pid)):
            continue
        try:
            os.unlink(os.path.join(folder, name))
            removed += 1
        except OSError:
            pass
    if removed:
        logger.warning("kvproof: removed %d metric file(s) of processes no longer running from "
                       "PROMETHEUS_MULTIPROC_DIR=%s (a previous run's counts); /metrics starts from zero", removed, folder)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OverflowError:  # no process has such a number
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _install_scheduler_side() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvproof.integrations.vllm.checked_scheduler import install_checks

    original = Scheduler.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        install_checks(self)  # a refusal there is in the stop report already

    __init__.__wrapped__ = original
    Scheduler.__init__ = __init__


def serving_refusal(vllm_config, kv_cache_config) -> Optional[str]:
    """Why kvproof's manager cannot serve a Scheduler of this configuration (one line, saying
    what to change), or None. Pure."""
    if vllm_config.kv_transfer_config is not None:
        refusal = "does not serve KV connectors (--kv-transfer-config is set):"
    elif getattr(vllm_config, "speculative_config", None) is not None and kv_cache_config.has_mamba_layers:
        # Its Mamba manager advances the state block through the draft slots; vLLM rolls rejected
        # drafts back behind it (found serving: INV-MAMBA-STATE-INDEX at the next keying).
        refusal = ("does not serve speculative decoding over Mamba groups (rejected drafts move the state back "
                   "a block): drop --speculative-config, or")
    else:
        return None
    return f"kvproof's manager {refusal} unset KVPROOF_MANAGER to serve with vLLM's manager"


def _install_kvproof_manager(slow: bool) -> None:
    from vllm.v1.core.sched import scheduler as scheduler_module

    from kvproof.integrations.vllm.kvproof_manager import KvproofKVCacheManager
    from kvproof.integrations.vllm.kvproof_scheduler import with_ladder
    from kvproof.spec.contracts import set_slow

    Scheduler = scheduler_module.Scheduler
    original = Scheduler.__init__

    def __init__(self, vllm_config, kv_cache_config, *args, **kwargs):
        message = serving_refusal(vllm_config, kv_cache_config)
        if message is not None:
            stop_report.record(message)
            raise ValueError(message)
        original(self, vllm_config, kv_cache_config, *args, **kwargs)
        logger.info("kvproof's KV-cache manager serves this engine's %s (%s)", type(self).__name__,
                    self.kv_cache_manager.options)

    def build(*args, **kwargs):
        try:
            return KvproofKVCacheManager(*args, **kwargs)
        except (ValueError, NotImplementedError) as e:  # what it cannot serve: the stop report's line
            stop_report.record(f"kvproof's manager cannot serve this engine: {e}; unset KVPROOF_MANAGER to serve "
                               "with vLLM's manager")
            raise

    __init__.__wrapped__ = original
    Scheduler.__init__ = __init__
    scheduler_module.KVCacheManager = build
    # The checkpoint policy's stops: vLLM's Scheduler owns the chunk split (kvproof_scheduler).
    Scheduler._mamba_block_aligned_split = with_ladder(Scheduler._mamba_block_aligned_split)
    if slow:
        set_slow(True)


def _install_recorder(path: str) -> None:
    """Every Scheduler of this process records its finished requests to ``path``
    (``trace_recorder``): it notes the first arrival in ``add_request`` and writes a line after
    ``_free_request`` (every finish: a stop, an abort). One engine per file: a data-parallel
    Scheduler is refused at construction (each engine would number blocks on its own)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    recorder = trace_recorder.TraceRecorder(path)
    init, add, free = Scheduler.__init__, Scheduler.add_request, Scheduler._free_request

    def __init__(self, vllm_config, *args, **kwargs):
        dp = vllm_config.parallel_config.data_parallel_size
        if dp > 1:
            message = (f"KVPROOF_RECORD records one engine, not {dp} data-parallel ones: serve with "
                       "--data-parallel-size 1, or unset KVPROOF_RECORD")
            stop_report.record(message)
            raise ValueError(message)
        init(self, vllm_config, *args, **kwargs)
        logger.info("kvproof records this engine's finished requests to %s (Mooncake format)", path)

    def add_request(self, request):
        recorder.arrived(request.arrival_time)
        return add(self, request)

    def _free_request(self, request, *args, **kwargs):
        result = free(self, request, *args, **kwargs)
        try:
            recorder.finished(request)
        except Exception as e:  # noqa: BLE001 -- a recorder fault must not stop serving
            recorder.stopped = f"KVPROOF_RECORD={path!r}: recording stopped: {type(e).__name__}: {e}"
            logger.warning("kvproof: %s; serving goes on", recorder.stopped)
        return result

    for name, wrapper, original in (("__init__", __init__, init), ("add_request", add_request, add),
                                    ("_free_request", _free_request, free)):
        wrapper.__wrapped__ = original
        setattr(Scheduler, name, wrapper)


def _install_worker_side() -> None:
    from vllm.v1.worker import block_table as v1_tables
    from vllm.v1.worker import utils as worker_utils
    from vllm.v1.worker.gpu import block_table as v2_tables

    from kvproof.integrations.vllm import worker_checks as wc
    from kvproof.integrations.vllm.violations import ViolationSink

    sink = ViolationSink()
    v1 = v1_tables.MultiGroupBlockTable
    v1.append_row = wc.checked_v1_append_row(v1.append_row, sink)
    v1.add_row = wc.checked_v1_add_row(v1.add_row, sink)
    v2 = v2_tables.BlockTables
    v1.compute_slot_mapping = wc.checked_v1_slot_mapping(v1.compute_slot_mapping, sink)
    v2.append_block_ids = wc.checked_v2_append_block_ids(v2.append_block_ids, sink)
    v2.compute_slot_mappings = wc.checked_v2_slot_mappings(v2.compute_slot_mappings, sink)
    copy = wc.checked_copy_blocks(worker_utils.copy_kv_cache_blocks_inplace, sink)
    worker_utils.copy_kv_cache_blocks_inplace = copy
    # The model runners import the function by name; patch the ones already imported (a worker
    # imports them after this runs and then picks up the wrapped function from utils).
    for name in ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner"):
        module = sys.modules.get(name)
        if module is not None:
            if not hasattr(module, "copy_kv_cache_blocks_inplace"):
                raise RuntimeError(f"kvproof: {name} no longer calls copy_kv_cache_blocks_inplace; cannot check copies")
            module.copy_kv_cache_blocks_inplace = copy


def installed() -> bool:
    """Whether ``register()`` installed the checks in this process."""
    return _installed

