"""A temporary directory too long for a Unix socket (a deep TMPDIR, as pytest's own) does not
break the rank processes' fork server: its socket goes under /tmp instead."""

from __future__ import annotations

import os
import tempfile

import pytest

pytest.importorskip("torch")

from kvproof.e2e import dcp  # noqa: E402


def test_a_long_temporary_directory_moves_the_socket_under_tmp(tmp_path, monkeypatch):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    made = []
    monkeypatch.setattr(dcp.multiprocessing.util, "get_temp_dir", lambda: made.append(tempfile.gettempdir()) or "x")
    dcp._socket_temp_dir()
    assert made == ["/tmp"] and tempfile.tempdir == str(deep)  # restored


def test_a_short_temporary_directory_is_used_as_it_is(monkeypatch):
    short = tempfile.mkdtemp(prefix="k", dir="/tmp")
    try:
        monkeypatch.setattr(tempfile, "tempdir", short)
        made = []
        monkeypatch.setattr(dcp.multiprocessing.util, "get_temp_dir", lambda: made.append(tempfile.gettempdir()) or "x")
        dcp._socket_temp_dir()
        assert made == [short]
    finally:
        os.rmdir(short)


def test_without_a_writable_tmp_the_error_names_the_directory(tmp_path, monkeypatch):
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(ValueError, match=r"is too long for the rank processes' Unix socket .* set TMPDIR to a shorter"):
        dcp._socket_temp_dir()
