"""benchmarks/kernels.py runs without a GPU: --cpu-smoke checks every kernel against its
reference in the interpreter, and a plain run says that timings need CUDA."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "kernels.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=300)


def test_cpu_smoke_matches_references() -> None:
    done = _run("--cpu-smoke", "--requests", "1,3", "--groups", "1,2")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 12  # 3 kernels x 2 batch sizes x 2 group counts
    assert all(line.endswith("matches reference: True") for line in lines)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the real benchmark")
def test_without_cuda_it_says_so() -> None:
    done = _run("--requests", "1")
    assert done.returncode == 0
    assert done.stdout.startswith("no CUDA device: the kernel timings need a GPU")


def test_bad_flags_exit_2_naming_the_value() -> None:
    done = _run("--requests", "0,4")
    assert done.returncode == 2
    assert "'0,4': expected positive integers" in done.stderr
