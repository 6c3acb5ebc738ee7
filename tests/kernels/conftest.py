"""Kernel tests run the Triton kernels in Triton's interpreter on CPU tensors and compare them
with the torch references; tests marked ``gpu`` run them natively and skip without CUDA.

TRITON_INTERPRET: without CUDA it is set here, at import, before the kernels are decorated,
so that they are built for the interpreter. With CUDA the kernels stay compiled (for the
``gpu`` tests) and the module fixture below sets the variable while tests run, so that CPU
tensors get interpreted twins of the compiled kernels (kvproof.kernels._triton.launchable).
"""

from __future__ import annotations

import os

import pytest

try:
    import torch

    _HAVE_CUDA = torch.cuda.is_available()
except ImportError:  # the test modules skip themselves via importorskip
    _HAVE_CUDA = False

if not _HAVE_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module", autouse=True)
def _interpret_cpu_launches():
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    yield
    if old is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = old


@pytest.fixture
def cuda_device(monkeypatch):
    """The CUDA device for native-kernel tests; skips when there is none. TRITON_INTERPRET is
    unset while the test runs, so the kernels it launches are compiled in compiled mode."""
    if not _HAVE_CUDA:
        pytest.skip("needs a CUDA device")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return torch.device("cuda")
