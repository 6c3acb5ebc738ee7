"""What the machine can hold, and what a pool can never hold: both refused before any work."""

from __future__ import annotations

import gc
import json
import tracemalloc

import pytest

from kvproof.cli import limits
from kvproof.cli.main import main
from kvproof.impl.kv_cache_manager import KVCacheManager
from kvproof.oracle.content_oracle import ContentOracle
from kvproof.spec.groups import CacheGroup, GroupKind
from kvproof.spec.layout import LayoutConfig, resolve_layout


@pytest.mark.parametrize("groups", [
    (CacheGroup(GroupKind.FULL_ATTENTION, 16), CacheGroup(GroupKind.MAMBA, 16)),
    (CacheGroup(GroupKind.FULL_ATTENTION, 16), CacheGroup(GroupKind.SLIDING_WINDOW, 16, dcp_sharded=False,
                                                         sliding_window=64), CacheGroup(GroupKind.MAMBA, 16)),
])
def test_replay_bytes_per_block_covers_the_real_peak(groups):
    """REPLAY_BYTES_PER_BLOCK bounds what ``kvproof replay`` allocates per block (pool, managers,
    oracle) at its peak, so the memory check never lets through a pool that does not fit."""
    layout = resolve_layout(LayoutConfig(groups=groups, dcp=2))
    n = 50_000  # large enough that the per-block cost, not fixed overhead, dominates
    gc.collect()
    tracemalloc.start()
    try:
        kv, oracle = KVCacheManager(layout, n), ContentOracle(layout)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del kv, oracle
    assert peak / n <= limits.REPLAY_BYTES_PER_BLOCK
    assert peak / n > limits.REPLAY_BYTES_PER_BLOCK / 2  # an estimate, not a blanket allowance


def test_check_memory_names_the_flag_the_need_and_the_most_that_fits():
    limits.check_memory("--num-blocks", 1000, 100, 0, "the pool", available=100_000)
    with pytest.raises(ValueError) as caught:
        limits.check_memory("--num-blocks", 2_000_000, 100, 50_000_000, "the pool", available=100_000_000)
    assert str(caught.value) == ("--num-blocks 2,000,000 needs about 0.2 GB (the pool), but this machine has 0.1 GB "
                                 "available; expected --num-blocks <= 500,000")


def test_available_memory_is_known_on_linux():
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc/meminfo")
    available = limits.available_memory()
    assert available is not None and available > 0


def test_a_request_the_pool_can_never_hold_is_refused_before_any_step(capsys, tmp_path, monkeypatch):
    """A 100k-token prompt with a 16-token budget was refused only after every
    chunk up to the pool's end had run (37 s); now before the replay starts."""
    import kvproof.sim.replay

    def must_not_run(*args, **kwargs):
        raise AssertionError("replay started although the request can never fit")

    monkeypatch.setattr(kvproof.sim.replay, "replay", must_not_run)
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"id": "long", "prompt": list(range(100_000)), "output": [1]}) + "\n")
    code = main(["replay", str(path), "--group", "full_attention:16", "--group", "mamba:16",
                 "--max-num-batched-tokens", "16", "--num-blocks", "4096"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err == (
        "kvproof replay: error: request 'long' (100,000 tokens) needs at least 6,251 blocks even with the pool to "
        "itself (group 0 full_attention:16: 6,250, group 1 mamba:16: 1), but num_blocks 4,096 leaves 4,095 "
        "(block 0 is the null block); expected num_blocks >= 6,252\n"
    )


def test_a_request_that_fits_exactly_is_not_refused(capsys, tmp_path):
    """Attention holds exactly its blocks, so a pool of the rule's size runs: the check refuses
    only what can never fit (with Mamba, chunk transitions may need more: tests/spec/test_capacity.py)."""
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"id": "r", "prompt": list(range(60)), "output": [1, 2]}) + "\n")
    # 61 computed tokens: 4 blocks of 16 and 2 of 32 -> 7 blocks with the null one.
    argv = ["replay", str(path), "--group", "full_attention:16", "--group", "mla:32", "--max-num-batched-tokens", "16"]
    assert main([*argv, "--num-blocks", "6"]) == 2
    assert "needs at least 6 blocks" in capsys.readouterr().err
    assert main([*argv, "--num-blocks", "7"]) == 0
