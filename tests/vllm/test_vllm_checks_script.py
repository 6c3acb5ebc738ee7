"""benchmarks/vllm_checks.py (the checks' overhead inside vLLM's Scheduler) runs at tiny sizes:
a speed table nobody can produce is not a benchmark."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm")

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "vllm_checks.py"
TINY = ["--requests", "12", "--prefixes", "2", "--prefix-len", "64", "--suffix-len", "4", "16",
        "--output-len", "1", "4", "--num-blocks", "400", "--budget", "256", "--dcp", "1", "2", "--repeat", "1"]


def test_overhead_benchmark_runs():
    env = {k: v for k, v in os.environ.items() if k != "KVPROOF_CONTRACTS"}
    proc = subprocess.run([sys.executable, str(SCRIPT), *TINY], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line[:3].strip().isdigit()]
    assert [r[0] for r in rows] == ["1", "2"]
    for dcp, steps, off, cheap, slow, violations in rows:
        assert int(steps) > 0 and float(off) > 0 and violations == "0"
        assert cheap.endswith("x") and slow.endswith("x") and float(cheap[:-1]) > 0
