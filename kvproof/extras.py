"""Optional extras: what a command needs beyond kvproof's own dependencies, and the one line that
says how to install it.

A command that needs an extra calls :func:`require` before any work; the :class:`MissingExtra` it
raises is bad input to the ``kvproof`` command, handled in one place for every subcommand
(``cli/guard.py``'s ``run_command``: exit 2, one line naming the extra and the exact install
command), never a bug (exit 70). The names are pyproject.toml's ``[project.optional-dependencies]``.
kvproof is installed from a checkout (it is not on a package index), so the commands run there.
"""

from __future__ import annotations

import dataclasses
import importlib
import os


@dataclasses.dataclass(frozen=True)
class Extra:
    """``modules`` must import for the extra to count as installed (``environment`` is set,
    unless already set, before they are imported)."""

    name: str
    what: str
    modules: tuple[str, ...]
    install: str
    environment: tuple[tuple[str, str], ...] = ()


EXTRAS = {
    e.name: e
    for e in (
        Extra("proofs", "z3 and CrossHair", ("z3", "crosshair"),
              'pip install -c requirements/constraints.txt ".[proofs]"'),
        Extra("kernels", "torch", ("torch",), 'pip install -c requirements/constraints.txt ".[kernels]"'),
        Extra("plot", "matplotlib", ("matplotlib",), 'pip install -c requirements/constraints.txt ".[plot]"'),
        # On a CPU machine; on a GPU machine `pip install ".[vllm]"` (docs/vllm.md).
        # vLLM's scheduler side on the CPU platform (kvproof.integrations.vllm.engine_harness),
        # with its log lines kept out of the command's output.
        Extra("vllm", "vLLM 0.33.0", ("vllm.v1.core.sched.scheduler",),
              "pip install -c requirements/constraints.txt -r requirements/vllm.txt && pip install --no-deps vllm==0.33.0",
              environment=(("VLLM_TARGET_DEVICE", "cpu"), ("VLLM_LOGGING_LEVEL", "ERROR"))),
    )
}


class MissingExtra(Exception):
    """An optional extra a command needs does not import. Not a ValueError: a command's own
    bad-input handling does not see it, ``run_command`` reports it."""


def message(name: str, needed_by: str) -> str:
    """The one line naming the missing extra ``name`` and its install command."""
    e = EXTRAS[name]
    return f"{needed_by} needs the '{e.name}' extra ({e.what}), which does not import; in a kvproof checkout run: {e.install}"


def require(name: str, needed_by: str) -> None:
    """Raise :class:`MissingExtra` unless every module of the extra ``name`` imports (no other
    state change than those imports and the extra's environment defaults)."""
    e = EXTRAS[name]
    for variable, value in e.environment:
        os.environ.setdefault(variable, value)
    for module in e.modules:
        try:
            importlib.import_module(module)
        except Exception:  # ImportError, or a broken install failing inside its own imports (never ours)
            raise MissingExtra(message(name, needed_by)) from None
