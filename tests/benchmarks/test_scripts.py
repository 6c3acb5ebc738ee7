"""The scheduler-side benchmark scripts run (tiny sizes): a speed table nobody can produce is
not a benchmark."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
TINY = ["--requests", "12", "--prefixes", "2", "--prefix-len", "64", "--suffix-len", "4", "16",
        "--output-len", "1", "4", "--num-blocks", "400", "--budget", "256", "--dcp", "1", "2"]


def _load(name):
    """A benchmark script as a module (benchmarks/ is not a package; its scripts import their
    siblings, and manager.py, which drops ICONTRACT_SLOW when imported, stays out)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run(script, *args):
    return subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True, timeout=300)


def test_manager_benchmark_runs():
    proc = run("manager.py", *TINY, "--repeat", "1", "--no-vllm")
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line[:3].strip().isdigit()]
    assert [r[0] for r in rows] == ["1", "2"] and all(float(r[2].replace(",", "")) > 0 for r in rows)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
def test_vllm_baseline_script_runs():
    proc = run("vllm_baseline.py", *TINY)
    assert proc.returncode == 0, proc.stderr
    assert "dense" in proc.stdout


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
def test_run_vllm_reports_run_kvproof_keys():
    from kvproof.cli.layout_args import parse_group
    from kvproof.sim.trace import TraceRequest
    from kvproof.spec.layout import LayoutConfig, resolve_layout

    vb = _load("vllm_baseline")
    layout = resolve_layout(LayoutConfig((parse_group("full_attention:64"), parse_group("mamba:64")),
                                         dcp=2, max_model_len=1 << 20))
    prefix = tuple(range(512))
    trace = [TraceRequest(f"r{i}", prefix + tuple(range(1000 * i, 1000 * i + 40 + i)), tuple(range(5)),
                          arrival=i // 2) for i in range(12)]
    out = vb.run_vllm(trace, layout, 2000, 1024)
    assert set(out) == {"ops", "seconds", "ops_per_s", "us_per_lookup", "hit_rate", "copies", "steps"}
    # lookups + one allocation per prefill chunk / decode step + frees: at least 12 * (1 + 5 + 1)
    assert out["ops"] >= 12 * 7
    assert 0 < out["hit_rate"] < 1


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
def test_both_benchmark_sides_count_the_same_calls():
    """benchmarks/manager.py's two columns share one counting mixin and one driver."""
    vb = _load("vllm_baseline")
    assert vb.CountingVllmAdapter.__mro__[1].__name__ == "CountingMixin"
    assert {"lookup", "allocate_slots", "free"} <= set(vars(vb.CountingMixin))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
def test_hit_parity_benchmark_runs():
    proc = run("hit_parity.py", "--generated-requests", "6", "--mooncake", "no-such-trace.jsonl", "--dcp", "2")
    assert proc.returncode == 0, proc.stderr
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| generated")]
    assert len(rows) == 4  # 2 retentions x 2 arrival modes
    for row in rows:
        cells = [c.strip() for c in row]
        if cells[1] == "sequential":
            assert cells[9] == "0"  # requests behind vLLM
        assert cells[11] == "0"  # content-oracle violations


MOONCAKE = BENCHMARKS.parents[1] / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"


@pytest.mark.skipif(not MOONCAKE.exists(), reason="the Mooncake trace (../shared/traces/mooncake/) is not next to this checkout")
def test_oracle_benchmark_runs():
    proc = run("oracle.py", "--requests", "3", "--repeat", "1")
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.split()[:1] in (["off"], ["on"])}
    assert float(rows["off"][2]) == 1.0 and float(rows["on"][1]) > 0


def test_key_at_benchmark_runs():
    proc = run("key_at.py", "--calls", "1000", "--repeat", "1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("key_at ") and "per key" in proc.stdout
