"""The ``vllm.general_plugins`` entry point (integrations/vllm/plugin.py) and the worker-side
checks it installs (worker_checks.py). ``register()`` patches vLLM's classes for the rest of a
process, so the tests that let it install run in a fresh Python process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import vllm  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.worker.block_table import MultiGroupBlockTable, SlotMappingMode  # noqa: E402
from vllm.v1.worker.gpu.block_table import BlockTables  # noqa: E402

from kvproof.integrations.vllm import plugin, worker_checks  # noqa: E402
from kvproof.integrations.vllm.violations import ViolationSink  # noqa: E402
from kvproof.spec.contracts import InvariantViolation  # noqa: E402


# --- register() without installing -----------------------------------------------------------------

def test_the_plugin_is_inert_without_the_switch(monkeypatch):
    monkeypatch.delenv("KVPROOF_CONTRACTS", raising=False)
    init = Scheduler.__init__
    plugin.register()
    assert Scheduler.__init__ is init and not plugin.installed()


@pytest.mark.parametrize("name, value, error", [
    ("KVPROOF_CONTRACTS", "on", "KVPROOF_CONTRACTS='on'; expected one of cheap, slow"),
    ("KVPROOF_ON_VIOLATION", "warn", "KVPROOF_ON_VIOLATION='warn'; expected one of raise, log"),
    ("KVPROOF_MANAGER", "sglang", "KVPROOF_MANAGER='sglang'; expected one of vllm, kvproof"),
    ("KVPROOF_OPTIONS", "eviction=fifo", "KVPROOF_OPTIONS: eviction='fifo' must be one of lru, compute"),
])
def test_bad_switch_values_fail_at_register(monkeypatch, name, value, error):
    from vllm.v1.core.sched import scheduler as scheduler_module

    monkeypatch.setenv("KVPROOF_CONTRACTS", "cheap")
    monkeypatch.setenv("KVPROOF_MANAGER", "kvproof")
    monkeypatch.setenv(name, value)
    init, manager = Scheduler.__init__, scheduler_module.KVCacheManager
    with pytest.raises(ValueError, match=error):
        plugin.register()
    assert Scheduler.__init__ is init and scheduler_module.KVCacheManager is manager and not plugin.installed()


def test_an_untested_vllm_version_is_refused(monkeypatch):
    monkeypatch.setenv("KVPROOF_CONTRACTS", "cheap")
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    init = Scheduler.__init__
    with pytest.raises(RuntimeError, match=r"vLLM 0\.34\.0 is not a version they were tested against \(0\.33\.0\)"):
        plugin.register()
    assert Scheduler.__init__ is init


# --- the worker-side checks (wrapped here by hand, not installed) ----------------------------------

def _v1_tables(widths):
    return MultiGroupBlockTable(max_num_reqs=2, max_num_batched_tokens=64, pin_memory=False, device=torch.device("cpu"),
                                block_sizes=[16] * len(widths), max_num_blocks=widths,
                                slot_mapping_modes=[SlotMappingMode.NONE] * len(widths))


@pytest.mark.parametrize("action", ["raise", "log"])
def test_v1_row_overflow_is_refused_before_any_group_is_written(action):
    """vLLM's V1 table bumps the row count, then numpy raises (docs/vllm-semantics.md §10.6);
    checked, the write is refused first and nothing changes -- in log mode too: a write past a
    row is always fatal (on a GPU it corrupts memory)."""
    tables = _v1_tables([8, 4])
    tables.add_row(([1, 2, 3], [4, 5, 6]), 0)
    append = worker_checks.checked_v1_append_row(MultiGroupBlockTable.append_row, ViolationSink(action))
    with pytest.raises(InvariantViolation, match=r"INV-TABLE-WRITE-BOUND: row 0, group 1: a write of 2 block ids at "
                                                 r"entry 3 ends at 5, past the row capacity of 4"):
        append(tables, ([7, 8], [9, 10]), 0)
    assert [int(t.num_blocks_per_row[0]) for t in tables.block_tables] == [3, 3]
    with pytest.raises(ValueError):  # control: vLLM alone
        tables.append_row(([7, 8], [9, 10]), 0)
    assert [int(t.num_blocks_per_row[0]) for t in tables.block_tables] == [5, 5]


class _StagedRow:
    """Stand-in for V2's pinned-memory StagedWriteTensor (not constructible on CPU)."""

    def __init__(self, width):
        self.gpu = torch.zeros(2, width, dtype=torch.int32)
        self.staged = []

    def stage_write(self, row, start, ids):
        self.staged.append((row, start, list(ids)))


def _v2_tables(widths):
    tables = object.__new__(BlockTables)  # vLLM's own append_block_ids runs on these members
    tables.num_kv_cache_groups = len(widths)
    tables.num_blocks = type("Counts", (), {"np": np.zeros((len(widths), 2), dtype=np.int32)})()
    tables.block_tables = [_StagedRow(w) for w in widths]
    tables.redirect_writes_to_null_block = False
    return tables


def test_v2_overflow_in_a_later_group_stages_nothing_in_earlier_ones():
    tables = _v2_tables([8, 2])
    append = worker_checks.checked_v2_append_block_ids(BlockTables.append_block_ids, ViolationSink("raise"))
    with pytest.raises(InvariantViolation, match=r"INV-TABLE-WRITE-BOUND: request row 0, group 1: a write of 3 block "
                                                 r"ids at entry 0 ends at 3, past the row capacity of 2"):
        append(tables, 0, ([1, 2, 3], [4, 5, 6]), True)
    assert tables.block_tables[0].staged == [] and tables.num_blocks.np[0, 0] == 0
    with pytest.raises(RuntimeError, match="exceeds row capacity"):  # control: vLLM alone, group by group
        BlockTables.append_block_ids(tables, 0, ([1, 2, 3], [4, 5, 6]), True)
    assert tables.block_tables[0].staged == [(0, 0, [1, 2, 3])] and tables.num_blocks.np[0, 0] == 3


def test_a_chained_copy_batch_is_refused_before_it_runs():
    copied = []
    copy = worker_checks.checked_copy_blocks(lambda caches, n, copies: copied.extend(copies), ViolationSink("raise"))
    copy([], 16, [KVCacheBlockCopy(1, 2), KVCacheBlockCopy(3, 4)])
    with pytest.raises(InvariantViolation, match=r"INV-COW-SOURCE-READY: worker copy batch: copy 2 -> 3 writes block 3, "
                                                 r"which another copy of the batch reads"):
        copy([], 16, [KVCacheBlockCopy(5, 6), KVCacheBlockCopy(2, 3), KVCacheBlockCopy(3, 7)])
    assert len(copied) == 2


# --- the plugin through vLLM's own plugin loading, in a fresh process -------------------------------

_INSTALLED = textwrap.dedent("""
    import json, os
    from vllm.plugins import load_general_plugins
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker import block_table, utils
    from kvproof.integrations.vllm import plugin
    from kvproof.spec.contracts import InvariantViolation
    load_general_plugins()
    wrapped_init = Scheduler.__init__
    plugin.register()  # again: nothing changes
    report = {"installed": plugin.installed(), "idempotent": Scheduler.__init__ is wrapped_init,
              "scheduler": hasattr(Scheduler.__init__, "__wrapped__"),
              "tables": hasattr(block_table.MultiGroupBlockTable.append_row, "__wrapped__"),
              "slots": hasattr(block_table.MultiGroupBlockTable.compute_slot_mapping, "__wrapped__"),
              "copies": hasattr(utils.copy_kv_cache_blocks_inplace, "__wrapped__")}
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine
    from kvproof.integrations.vllm.tiny_model import tiny_model_dir
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=tiny_model_dir(), skip_tokenizer_init=True, block_size=4, prefix_match_unit=2,
        num_gpu_blocks_override=512, enable_prefix_caching=True, max_model_len=256, max_num_seqs=16,
        max_num_batched_tokens=64,
        distributed_executor_backend="kvproof.integrations.vllm.cpu_executor.CpuStagingExecutor"))
    core = engine.engine_core.engine_core
    report["checker"] = hasattr(core.scheduler.kv_cache_manager, "_kvproof_checker")
    report["manager"] = type(core.scheduler.kv_cache_manager).__name__
    report["split"] = hasattr(Scheduler._mamba_block_aligned_split, "__wrapped__")
    report["ladder"] = list(getattr(core.scheduler.kv_cache_manager, "ladder", ()))
    report["hits"] = {}
    requests, step = [("r0", 11, 1), ("r2", 17, 1), ("r1", 13, 2)], 0
    try:
        while requests or engine.has_unfinished_requests():
            step += 1
            for rid, n, arrival in [r for r in requests if r[2] <= step]:
                engine.add_request(rid, {"prompt_token_ids": [0] * n}, SamplingParams(max_tokens=1, ignore_eos=True))
                requests.remove((rid, n, arrival))
            for out in engine.step():
                if out.finished:
                    report["hits"][out.request_id] = out.num_cached_tokens
    except InvariantViolation as e:
        report["violation"] = str(e)
    engine.engine_core.shutdown()
    print("REPORT " + json.dumps(report))
""")


def _run_fresh(script, **env):
    environment = {k: v for k, v in os.environ.items()
                   if k not in ("VLLM_PLUGINS", "KVPROOF_CONTRACTS", "KVPROOF_MANAGER", "KVPROOF_OPTIONS")}
    environment.update(VLLM_TARGET_DEVICE="cpu", VLLM_ENABLE_V1_MULTIPROCESSING="0", **env)
    done = subprocess.run([sys.executable, "-c", script], env=environment, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
    assert lines, done.stderr[-3000:]
    report = json.loads(lines[-1][len("REPORT "):])
    report["status"], report["last"] = done.returncode, (done.stderr.strip().splitlines() or [""])[-1]
    return report


def test_the_plugin_installs_every_check_through_vllms_plugin_loader():
    """KVPROOF_CONTRACTS=cheap and no --scheduler-cls: vLLM's loader runs register(), every
    scheduler gets the checks, the worker side is wrapped, and vLLM 0.33.0's copy of a block not
    yet written is reported inside the in-process engine."""
    report = _run_fresh(_INSTALLED, KVPROOF_CONTRACTS="cheap")
    assert report["installed"] and report["idempotent"] and report["scheduler"]
    assert report["tables"] and report["slots"] and report["copies"] and report["checker"]
    assert report["violation"].startswith("INV-COW-SOURCE-READY: step 4, request 'r1-")
    # The stop report: an offline engine's process also ends with the line, and status 1.
    assert report["status"] == 1 and report["last"].startswith("kvproof: " + report["violation"] + "; to fix: ")


def test_without_the_switch_the_installed_plugin_changes_nothing():
    """Nothing of vLLM is wrapped; what still stops this run is the staging executor's own check of
    the copy batch it is handed (the executor always checks: that is its job)."""
    report = _run_fresh(_INSTALLED)
    assert not report["installed"] and not report["scheduler"] and not report["tables"] and not report["checker"]
    assert not report["slots"] and not report["split"]
    assert report["violation"].startswith("INV-COW-SOURCE-READY: step 4: copy 5 -> 7 writes block 7, which another copy")


@pytest.mark.parametrize("contracts", [None, "slow"])
def test_kvproof_manager_serves_the_same_run_without_vllms_copy_hazard(contracts):
    """KVPROOF_MANAGER=kvproof: the engine's Scheduler builds kvproof's manager, and the run on
    which vLLM's manager copies a block not yet written (above) completes, every copy batch
    checked by the staging executor, every request served (with the worker-side checks on top
    under KVPROOF_CONTRACTS). r1 arrives while r2's chunk computes the zeros it shares, so it
    waits that step (``SameStepKeys``) and then hits 10 tokens (8 without the wait)."""
    env = {"KVPROOF_MANAGER": "kvproof"} | ({"KVPROOF_CONTRACTS": contracts} if contracts else {})
    report = _run_fresh(_INSTALLED, **env)
    assert report["installed"] and report["manager"] == "KvproofKVCacheManager" and not report["checker"]
    assert "violation" not in report and report["status"] == 0, report["last"]
    assert sorted(report["hits"]) == ["r0", "r1", "r2"] and report["hits"]["r1"] == 10
    assert report["tables"] == report["copies"] == (contracts is not None)
    assert report["split"] and report["ladder"] == [0, 0]  # the split is wrapped; vLLM's policy adds no stop


def test_kvproof_manager_with_checkpoints_reuse_serves_through_the_wrapped_split():
    """KVPROOF_OPTIONS=checkpoints=reuse: the Scheduler's chunk split carries the ladder (one rung
    on the checkpoint unit, the Mamba block 4 here) and the same run completes with no violation."""
    report = _run_fresh(_INSTALLED, KVPROOF_MANAGER="kvproof", KVPROOF_CONTRACTS="slow", KVPROOF_OPTIONS="checkpoints=reuse")
    assert report["installed"] and report["manager"] == "KvproofKVCacheManager" and report["split"]
    assert report["ladder"] == [1, 4]
    assert "violation" not in report and report["status"] == 0, report["last"]
    assert sorted(report["hits"]) == ["r0", "r1", "r2"]


def test_kvproofs_manager_refuses_connectors_and_drafts_over_mamba_naming_the_change():
    from types import SimpleNamespace

    from kvproof.integrations.vllm.kv_specs import kv_cache_config_for
    from kvproof.spec.groups import CacheGroup, GroupKind
    from kvproof.spec.layout import LayoutConfig, resolve_layout

    def config(*kinds):
        return kv_cache_config_for(resolve_layout(LayoutConfig(tuple(CacheGroup(k, 16) for k in kinds))), 64)

    plain, connector = SimpleNamespace(kv_transfer_config=None), SimpleNamespace(kv_transfer_config=object())
    hybrid, attention = config(GroupKind.FULL_ATTENTION, GroupKind.MAMBA), config(GroupKind.FULL_ATTENTION)
    assert "--kv-transfer-config" in plugin.serving_refusal(connector, attention)
    assert plugin.serving_refusal(plain, hybrid) is None  # controls
    assert plugin.serving_refusal(plain, attention) is None
    drafting = SimpleNamespace(kv_transfer_config=None, speculative_config=object())
    assert "drop --speculative-config" in plugin.serving_refusal(drafting, hybrid)
    assert plugin.serving_refusal(drafting, attention) is None  # served (test_vllm_serve.py)


_REFUSED = textwrap.dedent("""
    import json
    from vllm.engine.arg_utils import EngineArgs
    from vllm.plugins import load_general_plugins
    from vllm.v1.engine.llm_engine import LLMEngine
    from kvproof.integrations.vllm.tiny_model import tiny_model_dir
    load_general_plugins()
    report = {}
    for case, extra in (("async", {"async_scheduling": True}),
                        ("drafts", {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2,
                                                           "disable_lookahead_block_hashes": True}})):
        try:
            engine = LLMEngine.from_engine_args(EngineArgs(
                model=tiny_model_dir(), skip_tokenizer_init=True, block_size=16, num_gpu_blocks_override=256,
                enable_prefix_caching=True, max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=256,
                distributed_executor_backend="kvproof.integrations.vllm.cpu_executor.CpuStagingExecutor", **extra))
            report[case] = type(engine.engine_core.engine_core.scheduler).__name__
            engine.engine_core.shutdown()
        except Exception as e:
            report[case] = f"{type(e).__name__}: {e}"
    print("REPORT " + json.dumps(report), flush=True)
""")


def test_kvproofs_manager_serves_async_scheduling_and_refuses_drafts_over_mamba_when_vllm_builds_the_scheduler():
    """Through vLLM's engine (the hybrid tiny model): an engine with async scheduling gets
    vLLM's AsyncScheduler with kvproof's manager (served: test_kvproof_manager.py, test_vllm_serve.py);
    MTP drafts fail at Scheduler construction with the one line, and the stop report ends the
    output with it."""
    report = _run_fresh(_REFUSED, KVPROOF_MANAGER="kvproof")
    assert report["async"] == "AsyncScheduler"
    assert report["drafts"].startswith("ValueError: kvproof's manager does not serve speculative decoding over Mamba "
                                       "groups"), report["drafts"]
    assert report["last"] == "kvproof: " + report["drafts"][len("ValueError: "):]


_UNTESTED = textwrap.dedent("""
    import vllm
    vllm.__version__ = "0.34.0"
    from vllm.plugins import load_general_plugins
    try:
        load_general_plugins()  # what every vLLM process runs at start
    except RuntimeError as e:
        print("REPORT " + __import__("json").dumps({"error": str(e)}))
""")


def test_an_untested_version_stops_vllm_at_plugin_loading():
    report = _run_fresh(_UNTESTED, KVPROOF_CONTRACTS="slow")
    assert "vLLM 0.34.0 is not a version they were tested against" in report["error"]
