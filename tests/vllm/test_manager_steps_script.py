"""benchmarks/vllm_manager_steps.py (both managers' step time inside vLLM's Scheduler) runs at
tiny sizes, on the shared-prefix workload and on a Mooncake-format trace, and reports that no
request cached fewer tokens with kvproof's manager."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm")

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "vllm_manager_steps.py"
SMALL = ["--num-blocks", "400", "--budget", "256", "--dcp", "1", "2", "--repeat", "1"]


def rows(stdout: str) -> list[list[str]]:
    return [line.split() for line in stdout.splitlines() if line[:3].strip().isdigit()]


def run(*args: str) -> list[list[str]]:
    proc = subprocess.run([sys.executable, str(SCRIPT), *args, *SMALL], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = rows(proc.stdout)
    assert [r[0] for r in table] == ["1", "2"], proc.stdout
    for dcp, steps, vllm_ms, ratio, cached_vllm, cached_kvproof, fewer in table:
        assert float(vllm_ms) > 0 and float(ratio[:-1]) > 0
        assert int(cached_kvproof) >= int(cached_vllm) > 0 and fewer == "0"
    return table


def test_shared_prefix_workload():
    run("--requests", "12", "--prefixes", "2", "--prefix-len", "64", "--suffix-len", "4", "16", "--output-len", "1", "4",
        "--group", "full_attention:16", "--group", "mamba:16")


def test_mooncake_trace(tmp_path):
    path = tmp_path / "trace.jsonl"
    lines = [{"timestamp": 50 * i, "input_length": 1030 + 8 * i, "output_length": 3, "hash_ids": [0, 1, 2 + i]}
             for i in range(8)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    run("--trace", str(path), "--requests", "8", "--group", "full_attention:16", "--group", "mamba:16")
