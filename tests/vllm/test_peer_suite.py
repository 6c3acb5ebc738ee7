"""vLLM 0.33.0's own tests through tools/peer_suite.py: a bounded subset, run as CI can afford
it, must give the outcomes recorded in docs/vllm-peer-suite.md (the whole suite's table, written
by the runner; docs/vllm.md, "vLLM's own tests"). The first run on a machine fetches vLLM's sdist
(about 47 MB) and the suite's extra packages into the runner's cache.

Also the runner's own parts that need no sdist: the table round trip, the outcome of a test from
its phases, and the static reading of which vLLM internals a test touches."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.vllm

ROOT = pathlib.Path(__file__).resolve().parents[2]
RUNNER = ROOT / "tools" / "peer_suite.py"
TABLE = ROOT / "docs" / "vllm-peer-suite.md"

# Chosen to cover every kind of test in a bounded time (28 tests): manager built by the
# Scheduler, by the test, by both, or a block pool or nothing; on the tiny OPT, llava
# (multimodal: the tokenizer and torchvision stand-ins) and Qwen3-Next (hybrid, MTP) stand-ins;
# with a KV connector; and the one test that fails on a CPU.
SUBSET = (
    "test_schedule_partial_requests or test_no_mm_input_chunking or test_streaming_lookahead_hashes "
    "or test_kv_connector_basic or test_async_scheduling_pp_allows "
    "or (test_prefill and not combinations and not cadence) or test_decode or test_evict "
    "or test_hash_block_correct_reuse or test_computed_blocks_not_evicted or test_cache_blocks "
    "or test_pending_hisparse_spill_keeps or test_check_stop_min_tokens"
)
SCHEDULER = "tests/v1/core/test_scheduler.py::"


def _load_runner():
    spec = importlib.util.spec_from_file_location("peer_suite", RUNNER)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(RUNNER.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(RUNNER.parent))
    return module


runner = _load_runner()


def _run_subset(tmp_path, column: str, *args: str) -> dict:
    """The runner on a subset (``args``: its flags, ``--expect`` among them), which must exit
    0 (every outcome as recorded); ``column``'s results by test."""
    pytest.importorskip("vllm")
    out = tmp_path / "subset.json"
    result = subprocess.run([sys.executable, str(RUNNER), *args, "--json", str(out)],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(out.read_text())["columns"][column]


@pytest.mark.slow
def test_the_ci_subset_gives_the_recorded_stock_outcomes(tmp_path):
    stock = _run_subset(tmp_path, "stock", "-k", SUBSET, "--expect", str(TABLE))
    recorded = runner.read_table(str(TABLE))["stock"]
    assert {test: recorded[test] for test in stock} == {test: r["outcome"] for test, r in stock.items()}
    kinds = {runner.via(r["builds"]) for r in stock.values()}
    assert len(stock) == 28 and kinds == {"scheduler", "direct", "both", "pool", "none"}, (len(stock), kinds)
    assert stock[SCHEDULER + "test_no_mm_input_chunking[True]"]["outcome"] == "pass"  # llava
    assert stock[SCHEDULER + "test_streaming_lookahead_hashes_follow_recomputed_kv[reset]"]["outcome"] == "pass"  # Qwen3-Next
    assert stock[SCHEDULER + "test_async_scheduling_pp_allows_rescheduling_with_output_placeholders"]["outcome"] == "fail"


KVPROOF_TABLE = ROOT / "docs" / "vllm-peer-suite-kvproof-manager.md"
# Scheduler-built tests with kvproof's manager in the Scheduler: chunked prefill, preemption,
# stop handling, a KV connector's external tokens (sync and async loads), and the documented
# difference (a prefix keyed before its forward pass ran, which kvproof does not hit).
KVPROOF_SUBSET = (
    "test_schedule_partial_requests or test_kv_connector_unable_to_allocate or test_stop_via_update "
    "or test_preempt_during_execution or test_prefix_hit_is_capped_at_retained_auxiliary_outputs "
    "or test_kv_connector_handles_preemption"
)


@pytest.mark.slow
def test_the_ci_subset_with_kvproofs_manager_gives_the_recorded_outcomes(tmp_path):
    ours = _run_subset(tmp_path, "kvproof", "--manager", "kvproof", "--no-stock", "-k", KVPROOF_SUBSET,
                       "--expect", str(KVPROOF_TABLE))
    outcomes = {r["outcome"] for r in ours.values()}
    assert len(ours) >= 15 and outcomes == {"pass", "fail"}, (len(ours), outcomes)
    assert all(runner.via(r["builds"]) in ("scheduler", "both") for r in ours.values())
    local = ours[SCHEDULER + "test_prefix_hit_is_capped_at_retained_auxiliary_outputs[local]"]
    assert local["outcome"] == "fail" and "assert 80 == (80 - 64)" in local["reason"]


# vLLM's KV-connector tests with kvproof's checks on vLLM's manager: sync and async loads, a
# load that does not fit, preemption during a load, failed loads.
CHECKS_SUBSET = (
    "test_kv_connector_basic or test_kv_connector_unable_to_allocate or test_kv_connector_handles_preemption "
    "or test_external_prefix_cache_metrics or test_kv_connector_invalid_blocks"
)


@pytest.mark.slow
def test_the_connector_tests_pass_with_kvproofs_checks(tmp_path):
    checked = _run_subset(tmp_path, "stock+cheap", "--checks", "cheap", "--no-stock", "-k", CHECKS_SUBSET,
                          "--expect", str(TABLE))
    assert len(checked) >= 6 and {r["outcome"] for r in checked.values()} == {"pass"}, (len(checked), checked)


def test_a_table_reads_back_as_written(tmp_path):
    columns = {
        "stock": {"a.py::test_x[1]": {"outcome": "pass", "reason": "", "builds": ["scheduler"]},
                  "a.py::test_y": {"outcome": "fail", "reason": "AssertionError: x | y", "builds": ["direct"]}},
        "kvproof": {"a.py::test_x[1]": {"outcome": "error", "reason": "ValueError: no", "builds": ["scheduler"]},
                    "a.py::test_y": {"outcome": "skip", "reason": "needs a GPU", "builds": []}},
    }
    path = tmp_path / "t.md"
    runner.write_table(str(path), columns, {"a.py::test_y": ["block_pool", "ref_cnt"]}, "python tools/peer_suite.py")
    assert runner.read_table(str(path)) == {
        "stock": {"a.py::test_x[1]": "pass", "a.py::test_y": "fail"},
        "kvproof": {"a.py::test_x[1]": "error", "a.py::test_y": "skip"},
    }
    text = path.read_text()
    assert "| `a.py::test_y` | direct | block_pool, ref_cnt | fail | skip |" in text
    assert "| kvproof | `a.py::test_x[1]` | ValueError: no |" in text  # why each failing test fails


def test_a_difference_from_the_recorded_table_is_named(tmp_path, capsys):
    columns = {"stock": {"a.py::test_x": {"outcome": "fail", "reason": "boom", "builds": []}}}
    assert runner._compare({"stock": {"a.py::test_x": "pass"}}, columns) == 1
    assert "stock a.py::test_x: fail (boom), recorded pass" in capsys.readouterr().out
    assert runner._compare({"stock": {"a.py::test_x": "fail"}}, columns) == 0


@pytest.mark.parametrize(("phases", "outcome"), [
    ({"setup": ("passed", False), "call": ("passed", False), "teardown": ("passed", False)}, "pass"),
    ({"setup": ("failed", False)}, "error"),
    ({"setup": ("skipped", False)}, "skip"),
    ({"setup": ("passed", False), "call": ("failed", False)}, "fail"),
    ({"setup": ("passed", False), "call": ("skipped", True)}, "xfail"),
    ({"setup": ("passed", False), "call": ("passed", True)}, "xpass"),
    ({"setup": ("passed", False), "call": ("passed", False), "teardown": ("failed", False)}, "error"),
])
def test_a_test_s_outcome_follows_its_phases(phases, outcome):
    sys.path.insert(0, str(RUNNER.parent))
    try:
        import peer_suite_plugin
    finally:
        sys.path.remove(str(RUNNER.parent))
    assert peer_suite_plugin._outcome(phases) == outcome


def test_internal_reads_follow_fixtures_and_helpers(tmp_path):
    (tmp_path / "t.py").write_text(textwrap.dedent('''
        import pytest

        def _helper(m):
            return m.block_pool.get_num_free_blocks()

        @pytest.fixture
        def pool():
            return BlockPool(4)

        def test_reads_through_a_helper(manager):
            assert _helper(manager) == 3

        def test_builds_a_pool(pool):
            assert pool

        def test_reads_nothing_internal(scheduler):
            scheduler.kv_cache_manager.get_block_ids("r")

        class TestGroup:
            def test_method(self, x):
                x.coordinator.single_type_managers[0].req_to_blocks
    '''))
    assert runner.internal_reads(str(tmp_path), ["t.py"]) == {
        "t.py::test_reads_through_a_helper": ["get_num_free_blocks"],  # block_pool: vLLM's Scheduler reads it
        "t.py::test_builds_a_pool": ["BlockPool"],
        "t.py::test_reads_nothing_internal": [],
        "t.py::TestGroup::test_method": ["req_to_blocks"],
    }


def test_via_names_how_a_test_got_its_manager():
    assert runner.via(["scheduler"]) == "scheduler"
    assert runner.via(["direct", "pool", "scheduler"]) == "both"
    assert runner.via(["coordinator", "pool"]) == "coordinator"
    assert runner.via([]) == "none"
