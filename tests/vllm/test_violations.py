"""Where violations go (integrations/vllm/violations.py, stop_report.py): always-fatal ids refused
in log mode too, each distinct violation logged once with a running count, counters created only
by a process that counts, and the stop report's last line and exit status. No engine needed."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest

from kvproof.integrations.vllm import stop_report, violations
from kvproof.integrations.vllm.violations import ALWAYS_FATAL, DISTINCT_LOGGED, ViolationSink
from kvproof.spec.contracts import InvariantViolation

pytestmark = pytest.mark.vllm


@pytest.fixture
def logged(caplog):
    caplog.set_level(logging.ERROR, logger="vllm.kvproof")
    return lambda: [r.getMessage() for r in caplog.records if r.name == "vllm.kvproof"]


@pytest.mark.parametrize("inv_id", sorted(ALWAYS_FATAL))
def test_an_always_fatal_violation_stops_in_log_mode_too(logged, inv_id):
    sink = ViolationSink("log")
    with pytest.raises(InvariantViolation, match=f"^{inv_id}: step 3, request 'r': details$"):
        sink.report(inv_id, "step 3, request 'r': details")
    assert sink.counts[inv_id] == 1
    assert logged() == [f"kvproof {inv_id}: step 3, request 'r': details (always fatal: serving on would corrupt "
                        "memory or the pool)"]


def test_other_violations_are_logged_and_serving_goes_on(logged):
    sink = ViolationSink("log")
    sink.report("INV-COW-SOURCE-READY", "step 4, request 'r1': copy 5 -> 8 reads positions [8, 10)")
    assert logged() == ["kvproof INV-COW-SOURCE-READY: step 4, request 'r1': copy 5 -> 8 reads positions [8, 10)"]


def test_a_violation_found_again_at_every_step_is_one_violation_with_a_running_count(logged):
    sink = ViolationSink("log")
    for step in range(1, 1001):
        sink.report("INV-FREE-RELEASES", f"step {step}: blocks [7] are referenced but held by no request (leaked)")
    assert sink.counts["INV-FREE-RELEASES"] == 1 and len(sink.messages) == 1
    assert logged() == [
        "kvproof INV-FREE-RELEASES: step 1: blocks [7] are referenced but held by no request (leaked)",
        *[f"kvproof INV-FREE-RELEASES: seen {n} times so far; latest: step {n}: blocks [7] are referenced but held by "
          "no request (leaked)" for n in (10, 100, 1000)],
    ]


def test_many_distinct_violations_of_one_id_are_counted_not_each_logged(logged):
    sink = ViolationSink("log")
    for r in range(150):
        sink.report("INV-HIT-BOUND", f"step 2, request 'r{r}': hit 5 must be a multiple of 4")
    lines = logged()
    assert sink.counts["INV-HIT-BOUND"] == 150
    assert lines[:DISTINCT_LOGGED] == [f"kvproof INV-HIT-BOUND: step 2, request 'r{r}': hit 5 must be a multiple of 4"
                                       for r in range(DISTINCT_LOGGED)]
    assert lines[DISTINCT_LOGGED:] == [
        "kvproof INV-HIT-BOUND: 100 distinct violations so far, each counted (the first 10 logged); latest: step 2, "
        "request 'r99': hit 5 must be a multiple of 4"]


def test_raise_mode_records_the_id_and_what_to_do(monkeypatch, tmp_path):
    report = tmp_path / "report.txt"
    report.write_text("")
    monkeypatch.setenv(stop_report.ENV, str(report))
    with pytest.raises(InvariantViolation):
        ViolationSink("raise").report("INV-TABLE-WIDTH", "group 0: too narrow", fix="serve with --max-model-len 2,048")
    with pytest.raises(InvariantViolation):
        ViolationSink("log").report("INV-POOL-REF-NONNEG", "step 2: block 3 freed\ntwice")
    assert stop_report.recorded() == [
        "INV-TABLE-WIDTH: group 0: too narrow; to fix: serve with --max-model-len 2,048",
        f"INV-POOL-REF-NONNEG: step 2: block 3 freed twice; to fix: {violations.FIXES['INV-POOL-REF-NONNEG']}",
    ]
    assert stop_report.final_line(stop_report.recorded()).endswith("(and 1 more kvproof refusal(s) above)")


def _python(script: str, **env) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k not in (stop_report.ENV, "PROMETHEUS_MULTIPROC_DIR")}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env={**environment, **env},
                          capture_output=True, text=True, timeout=120)


def test_counters_appear_only_in_a_process_that_counts():
    """A process that loads the checks but never counts (vLLM's API server) registers no
    kvproof counter, so /metrics cannot show a 0 that means 'not visible from here'."""
    pytest.importorskip("prometheus_client")
    done = _python("""
        from prometheus_client import REGISTRY, generate_latest
        from kvproof.integrations.vllm.violations import ViolationSink
        sink = ViolationSink("log")
        print("before", b"kvproof_" in generate_latest(REGISTRY))
        sink.step_checked()
        print("after", b"kvproof_checked_steps_total 1.0" in generate_latest(REGISTRY))
    """)
    assert done.stdout.split() == ["before", "False", "after", "True"], done.stderr


def test_the_first_process_ends_with_the_line_and_status_1_after_everything_else(tmp_path):
    done = _python("""
        import atexit, sys
        from kvproof.integrations.vllm import stop_report
        assert stop_report.begin() and not stop_report.begin()  # the first process only
        atexit.register(print, "an exit handler that prints last", file=sys.stderr)
        stop_report.record("INV-TABLE-WIDTH: too narrow; to fix: less")
        raise RuntimeError("vLLM's engine failed")
    """, TMPDIR=str(tmp_path))
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert "RuntimeError: vLLM's engine failed" in lines and "an exit handler that prints last" in lines
    assert lines[-1] == "kvproof: INV-TABLE-WIDTH: too narrow; to fix: less"
    assert os.listdir(tmp_path) == []  # the report goes with its process


def test_without_a_stop_the_first_process_exits_as_it_would(tmp_path):
    done = _python("""
        from kvproof.integrations.vllm import stop_report
        stop_report.begin()
    """, TMPDIR=str(tmp_path))
    assert (done.returncode, done.stderr) == (0, "") and os.listdir(tmp_path) == []


def test_a_report_a_killed_server_left_is_removed_by_the_next(tmp_path):
    dead = _python("""
        import os
        from kvproof.integrations.vllm import stop_report
        stop_report.begin()
        print(os.environ[stop_report.ENV], flush=True)
        os._exit(9)  # as a SIGKILL: no exit handler runs
    """, TMPDIR=str(tmp_path)).stdout.strip()
    assert os.path.exists(dead)
    _python("from kvproof.integrations.vllm import stop_report; stop_report.begin()", TMPDIR=str(tmp_path))
    assert os.listdir(tmp_path) == []
