"""A temporary directory too long for a Unix socket (a deep TMPDIR, as pytest's own) does not
break the rank processes' fork server: its socket goes under /tmp instead."""

from __future__ import annotations

import os
import signal
import tempfile

import pytest

pytest.importorskip("torch")

from kvproof import leftovers  # noqa: E402
from kvproof.e2e import ranks  # noqa: E402


def test_a_long_temporary_directory_moves_the_socket_under_tmp(tmp_path, monkeypatch):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    assert ranks._socket_dir_base() == "/tmp" and tempfile.tempdir == str(deep)


def test_a_short_temporary_directory_is_used_as_it_is(monkeypatch):
    short = tempfile.mkdtemp(prefix="k", dir="/tmp")
    try:
        monkeypatch.setattr(tempfile, "tempdir", short)
        assert ranks._socket_dir_base() == short
    finally:
        os.rmdir(short)


def test_without_a_writable_tmp_the_error_names_the_directory(tmp_path, monkeypatch):
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(ValueError, match=r"is too long for the rank processes' Unix socket .* set TMPDIR to a shorter"):
        ranks._socket_dir_base()


def test_the_socket_directory_names_its_owner_and_fits_a_socket_path():
    path = ranks._socket_temp_dir()
    name = os.path.basename(path)
    assert name.startswith(ranks.SOCKET_DIR_PREFIX + leftovers.owner_tag())
    assert len(os.fsencode(path)) + ranks._SOCKET_SUFFIX <= ranks._SOCKET_PATH_MAX


def test_ranks_start_with_ctrl_c_ignored():
    """A rank forked by the fork server begins with SIGINT ignored, before any kvproof code runs
    in it: a Ctrl-C to the process group while ranks start cannot print a half traceback
    ("Process kvproof-rank-0:") or end a rank the caller has not decided to stop. The child
    here raises SIGINT at itself as its first act; ignored, it exits 0."""
    ctx = ranks.rank_context()
    if ctx.get_start_method() != "forkserver":
        pytest.skip("ranks are spawned, not forked, on this platform")
    p = ctx.Process(target=signal.raise_signal, args=(signal.SIGINT,))
    p.start()
    p.join(30)
    assert p.exitcode == 0
