"""benchmarks/plan.py runs (tiny size): a speed table nobody can produce is not a benchmark."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "plan.py"


def test_plan_benchmark_runs():
    env = {**os.environ, "ICONTRACT_SLOW": "0"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--limit", "5", "--dcp", "1,2", "--no-vllm"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| 1 ") or line.startswith("| 2 ")]
    assert [r[0].strip() for r in rows] == ["1", "2"]
    assert all(float(r[3].replace(",", "")) > 0 for r in rows)  # requests/s
