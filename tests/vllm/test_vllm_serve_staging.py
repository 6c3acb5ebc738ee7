"""Staging inside a real ``vllm serve`` (docs/vllm.md, "When kvproof stops vLLM"), with faults
seeded into vLLM's own code through a second general plugin (``serving.fault_plugin_dir``). Two
servers, each checked for several behaviours at once: every start costs tens of seconds.

* the seed bug (vLLM's old block-table width, every group divided by DCP) refused at start: the
  output ends with one ``kvproof:`` line naming INV-TABLE-WIDTH and the fix, status 1;
* log mode, the seed bug and a leaked block, no ``--num-gpu-blocks-override`` and no
  PROMETHEUS_MULTIPROC_DIR: the executor stages a stated GPU memory; a warning says the counters
  cannot reach /metrics, which shows none rather than zeros; the leak is reported once with a
  running count, naming the request that last held the block; a request longer than the narrow
  row stops the engine with INV-TABLE-WRITE-BOUND although the mode is log, before the write;
  ``vllm serve`` exits 1 and its output ends with the kvproof line.

A reused metrics directory is test_vllm_serve.py's case (a server that serves clean)."""

from __future__ import annotations

import os
import random
import re
import shutil
import tempfile
import urllib.error

import pytest

pytestmark = pytest.mark.vllm

pytest.importorskip("vllm")
pytest.importorskip("psutil")

from .serving import Server, last_line  # noqa: E402


@pytest.fixture
def short_tmp():
    """A TMPDIR short enough for vLLM's IPC sockets (a Unix socket's path holds 107 bytes; pytest's
    own folders, under xdist, are longer)."""
    path = tempfile.mkdtemp(prefix="kvp-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_start_up_refusal_ends_vllms_output_with_one_kvproof_line():
    server = Server(2, env={"KVPROOF_ON_VIOLATION": "raise"}, faults="pre-fix-width")
    try:
        code = server.wait(600)
        output = server.output()
    finally:
        _, left = server.stop()
    assert code == 1 and left == []
    assert "Traceback" in output  # vLLM's own tracebacks stay, above the line
    assert last_line(output) == (
        "kvproof: INV-TABLE-WIDTH: group 0 (mamba:16): vLLM sizes the block-table row at 128 entries; kvproof's "
        "geometry needs 256 for max_model_len 4,096 at DCP 2 -- a request longer than 2,048 tokens would write past "
        "its row; to fix: serve with --max-model-len 2,048 or less, or use a vLLM that sizes each group's row by its "
        "own block size (a Mamba group's is not divided by DCP)")


def test_log_mode_counts_a_leak_once_and_still_refuses_a_corrupting_write(short_tmp):
    tmp = short_tmp
    server = Server(2, env={"KVPROOF_CONTRACTS": "slow", "KVPROOF_STAGING_GPU_MEMORY": "256MiB", "TMPDIR": str(tmp)},
                    metrics_dir=False, num_blocks=None, faults="pre-fix-width,leak")
    rng = random.Random(21)
    try:
        server.wait_until_up()
        metrics = server.metrics()
        for _ in range(12):  # short requests: the first one freed leaks a block, found at every step after
            server.complete([rng.randrange(1000) for _ in range(50)], 3)
        with pytest.raises(urllib.error.HTTPError) as failed:  # longer than the narrow row holds
            server.complete([rng.randrange(1000) for _ in range(2100)], 2)
        code = server.wait(300)
        output = server.output()
    finally:
        _, left = server.stop()
    assert failed.value.code == 500 and code == 1 and left == []
    # The stop report goes with its server (vLLM leaves its own sockets there, as in any run).
    assert not [name for name in os.listdir(tmp) if name.startswith("kvproof-")], os.listdir(tmp)
    kvproof = [line for line in output.splitlines() if "kvproof" in line]

    # Item 11: a stated GPU memory, not 1 TiB.
    assert any("the CPU staging executor stages 0.25 GiB (KVPROOF_STAGING_GPU_MEMORY) of GPU memory per rank; "
               "gpu_memory_utilization 0.92 gives the KV cache 0.23 GiB" in line for line in kvproof), kvproof
    # Item 12: said at start; and /metrics shows no kvproof counter stuck at zero.
    assert any("PROMETHEUS_MULTIPROC_DIR is not set, so kvproof's counters in this engine-core process" in line
               for line in kvproof)
    assert not [line for line in metrics.splitlines() if line.startswith("kvproof_")]
    # Item 13: one line when first found, one at ten occurrences; the request that held the block named.
    leaks = [line for line in kvproof if "kvproof INV-FREE-RELEASES" in line]
    assert len(leaks) == 2, leaks
    assert re.search(r"kvproof INV-FREE-RELEASES: step \d+: blocks \[(\d+)\] are referenced but held by no request "
                     r"\(leaked; last held: block \1 by request 'cmpl-[0-9a-f-]+'\)$", leaks[0]), leaks[0]
    assert "kvproof INV-FREE-RELEASES: seen 10 times so far; latest: step" in leaks[1]
    # Item 10: logged as always fatal, and the engine stopped before the write.
    assert any("kvproof INV-TABLE-WRITE-BOUND: row 0, group 0: a write of 3 block ids at entry 128 ends at 131, past "
               "the row capacity of 128; nothing was written (always fatal" in line for line in kvproof)
    assert "could not broadcast" not in output and "out of bounds" not in output  # vLLM's own write (numpy) never ran
    # Item 14: the last line, and status 1.
    assert last_line(output).startswith("kvproof: INV-TABLE-WRITE-BOUND: row 0, group 0: a write of 3 block ids at "
                                        "entry 128 ends at 131, past the row capacity of 128; nothing was written; "
                                        "to fix: this request is longer than vLLM's block-table row holds")
