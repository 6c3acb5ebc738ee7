"""Optional Triton: the kernel modules import ``tl`` and ``jit`` from here so that they (and
their torch references) still import on a machine without Triton.

Without Triton, ``jit`` returns None in place of a kernel and ``tl`` is a stand-in whose
attributes are None, so that annotations such as ``tl.constexpr`` still evaluate; the host API
(:mod:`kvproof.kernels.host`) then runs the torch references.

Triton fixes interpreter-or-compiled when ``@triton.jit`` runs (it reads ``TRITON_INTERPRET``
then). So that the choice does not hang on import order -- a test suite may import Triton
before the kernel tests set the variable -- :func:`launchable` builds an interpreted twin of a
compiled kernel on demand when CPU tensors meet ``TRITON_INTERPRET=1``. A twin can call only
``triton.language`` builtins (``tl.load``, ``tl.where``, ``tl.maximum``, ``tl.atomic_max``...),
not the library's own ``@jit`` helpers (``tl.max``, ``tl.zeros_like``, ``tl.cdiv``), which stay
compiled; the kernels here keep to builtins for that reason.
"""

from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised in a subprocess test
    triton = None
    HAVE_TRITON = False

    class _MissingTritonLanguage:
        def __getattr__(self, name: str) -> None:
            return None

    tl = _MissingTritonLanguage()

_TRUE = ("1", "true", "yes", "on")
_interpreted_twins: dict[int, object] = {}


def jit(fn):
    """``triton.jit`` when Triton is installed, else None (the host falls back to torch)."""
    return triton.jit(fn) if HAVE_TRITON else None


def is_interpreted(kernel) -> bool:
    """Whether ``kernel`` was decorated under ``TRITON_INTERPRET=1``."""
    return kernel is not None and type(kernel).__name__ == "InterpretedFunction"


def interpret_requested() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for the interpreter now."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


def launchable(kernel, device_type: str):
    """The form of ``kernel`` that can run on tensors of ``device_type``, or None.

    An interpreted kernel runs anywhere (the interpreter stages device tensors through host
    memory); a compiled one needs CUDA, or on CPU an interpreted twin when
    ``TRITON_INTERPRET=1`` is set at call time.
    """
    if kernel is None:
        return None
    if is_interpreted(kernel):
        return kernel
    if device_type == "cuda":
        return kernel
    if device_type == "cpu" and interpret_requested():
        twin = _interpreted_twins.get(id(kernel))
        if twin is None:
            from triton.runtime.interpreter import InterpretedFunction

            twin = _interpreted_twins[id(kernel)] = InterpretedFunction(kernel.fn)
        return twin
    return None
