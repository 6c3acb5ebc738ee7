"""``kvproof e2e``: output shape, exit statuses, one-line errors, and the docs' example."""

from __future__ import annotations

import json
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from kvproof.cli.main import main
from kvproof.e2e import runner
from kvproof.e2e.workloads import hybrid_workload
from kvproof.sim.trace import dump_trace

ROOT = pathlib.Path(__file__).resolve().parents[2]
HYBRID = ["--group", "full_attention:4", "--group", "mamba:8", "--hash-block-size", "2", "--max-model-len", "128"]


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "hybrid.jsonl"
    path.write_text(dump_trace(hybrid_workload()))
    return str(path)


def test_json_at_dcp_2(capsys, trace):
    code = main(["e2e", trace, *HYBRID, "--dcp", "2", "--max-num-batched-tokens", "12", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert set(data) == {"requests", "cached_tokens", "cow_copies", "max_abs_diff"}
    assert data["requests"] == 6 and data["cached_tokens"] > 0 and data["cow_copies"] > 0
    assert data["max_abs_diff"] <= runner.TOLERANCE


def test_a_mismatch_exits_1(capsys, monkeypatch, trace):
    real = runner.run_e2e

    def off_by_a_bit(*args, **kwargs):
        result = real(*args, **kwargs)
        result.max_abs_diff = 1e-6
        return result

    monkeypatch.setattr(runner, "run_e2e", off_by_a_bit)
    assert main(["e2e", trace, *HYBRID]) == 1
    out, err = capsys.readouterr()
    assert "MISMATCH" in out and err.strip() == "kvproof e2e: max abs diff 1.000e-06 > 1e-09"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["/no/such.jsonl"], "cannot read trace '/no/such.jsonl': No such file or directory"),
        (["TRACE", "--group", "sliding_window:4:replicated"], "sliding-window groups are not supported"),
        (["TRACE", "--group", "full_attention:4", "--group", "mamba:8", "--mamba-cache-mode", "none"],
         "Mamba cache mode 'none' is not supported"),
        (["TRACE", *HYBRID, "--num-blocks", "1"], "num_blocks 1 must be >= 2"),
        (["TRACE", *HYBRID[:-1], "32"], "request 'a' needs 48 tokens > max_model_len 32"),
        # Refused before any rank starts: 48 tokens need 6 attention blocks and 1 Mamba block.
        (["TRACE", *HYBRID, "--dcp", "2", "--num-blocks", "6"], "needs at least 7 blocks even with the pool to itself"),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, trace, argv, message):
    argv = [trace if a == "TRACE" else a for a in argv]
    assert main(["e2e", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith("kvproof e2e: error: ") and message in err


def test_torch_is_imported_only_when_e2e_runs():
    code = "import sys, kvproof.cli.main; kvproof.cli.main.build_parser(); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr


def test_docs_example(capsys, monkeypatch):
    """docs/e2e.md's example: the output as shown, except the last digits of the difference
    (float64 summation order varies with the platform's math library)."""
    text = (ROOT / "docs" / "e2e.md").read_text()
    block = re.search(r"```text\n(\$ kvproof e2e .*?)```", text, re.S).group(1)
    command, _, expected = block.partition("\n")
    monkeypatch.chdir(ROOT)
    assert main(shlex.split(command)[2:]) == 0
    out = capsys.readouterr().out
    pattern = re.escape(expected).replace(re.escape("2.4e-15"), r"\d\.\de-1[4-6]")
    assert re.fullmatch(pattern, out), out
