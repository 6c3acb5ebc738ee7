"""A derandomized run draws the same cases in every process, whatever modules earlier tests
imported (tests/conftest.py ``pin_local_constants``): the fixed-seed reach floors depend on it."""

from __future__ import annotations

import importlib
import sys

import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.internal.conjecture import providers

from . import conftest


def draws() -> list[int]:
    """The integers a derandomized property test draws (the same function source each call, so
    the same seed)."""
    seen: list[int] = []

    @settings(derandomize=True, max_examples=300, database=None)
    @given(st.integers(-(2 ** 40), 2 ** 40))
    def probe(n):
        seen.append(n)

    probe()
    return seen


def import_module_with_constants(tmp_path, monkeypatch, name: str, base: int) -> range:
    """A new local module whose literals (returned) Hypothesis would mix into generation; it
    stays in ``sys.modules`` until the test ends, as a module an earlier test imported would.
    Hypothesis's pool only grows, so each caller needs literals of its own (``base``)."""
    literals = range(base, base + 7919 * 200, 7919)
    (tmp_path / f"{name}.py").write_text("".join(f"C{i} = {n}\n" for i, n in enumerate(literals)))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, name, importlib.import_module(name))
    return literals


def test_pinned_draws_do_not_depend_on_what_was_imported(tmp_path, monkeypatch):
    monkeypatch.setattr(providers, "_get_local_constants", providers._get_local_constants)
    assert conftest.pin_local_constants()
    assert hasattr(providers._get_local_constants, "unpinned")
    before = draws()
    literals = import_module_with_constants(tmp_path, monkeypatch, "kvproof_probe_pinned", 5_000_000_003)
    after = draws()
    assert after == before
    assert not any(n in literals for n in after)


def test_without_the_pin_the_same_seed_draws_differently_once_a_module_is_imported(tmp_path, monkeypatch):
    # The check above has teeth: Hypothesis's own pool picks up the new module's literals.
    monkeypatch.setattr(providers, "_get_local_constants", providers._get_local_constants)
    if not conftest.pin_local_constants():
        pytest.skip("this Hypothesis has no local-constant pool")
    monkeypatch.setattr(providers, "_get_local_constants", providers._get_local_constants.unpinned)
    providers.CONSTANTS_CACHE.cache.clear()
    before = draws()
    literals = import_module_with_constants(tmp_path, monkeypatch, "kvproof_probe_unpinned", 7_000_000_001)
    after = draws()
    assert after != before
    assert any(n in literals for n in after)
