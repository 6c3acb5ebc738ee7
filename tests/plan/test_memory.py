"""Pool sizing as vLLM's KV planner does it: checked by hand on small numbers, against vLLM
0.33.0's own planning functions (marker vllm), and the largest request by replaying it."""

from __future__ import annotations

import types

import pytest

from kvproof.impl.scheduler import CapacityError
from kvproof.sim.replay import replay
from kvproof.sim.trace import TraceRequest
from kvproof.planner.memory import (
    GIB, ModelMemory, expand_groups, largest_request, plan_pool, request_blocks, vllm_attention_block_size,
)
from kvproof.spec.groups import CacheGroup, GroupKind, MambaCacheMode
from kvproof.spec.layout import LayoutConfig, resolve_layout

FA, MLA, MAMBA = GroupKind.FULL_ATTENTION, GroupKind.MLA, GroupKind.MAMBA


def test_pool_by_hand():
    # FA block 16 x 256 bytes = 4,096-byte page; Mamba state 4,000 bytes, padded to 4,096.
    # 4 FA + 10 Mamba layers: groups of 4 (10 >= 1.5 x 4), so FA is 1 vLLM group and Mamba 3
    # (4 + 4 + 2 layers, two padding layers); a block is 4 x 4,096 bytes.
    layout = resolve_layout(LayoutConfig((CacheGroup(FA, 16), CacheGroup(MAMBA, 16))))
    pool = plan_pool(layout, ModelMemory((4, 10), 256, 4000), kv_memory_bytes=GIB)
    assert (pool.page_bytes, pool.padded_page_bytes, pool.group_size, pool.vllm_groups) == ((4096, 4000), 4096, 4, (1, 3))
    assert pool.block_bytes == 16384 and pool.num_blocks == GIB // 16384
    assert [g.kind for g in expand_groups((CacheGroup(FA, 16), CacheGroup(MAMBA, 16)), pool)] == [FA, MAMBA, MAMBA, MAMBA]
    # 5 FA + 6 Mamba: 6 < 1.5 x 5, so groups of 6 (one padding layer for FA), one vLLM group each.
    assert plan_pool(layout, ModelMemory((5, 6), 256, 4000), num_blocks=10).vllm_groups == (1, 1)


def test_attention_block_vllm_would_choose():
    mem = ModelMemory((1, 3), 1152, 271_360)  # the kimi-k3 preset: 256 x 1,152 >= 271,360
    assert vllm_attention_block_size(CacheGroup(MLA, 256), mem, mem.bytes_per_state) == 256
    assert vllm_attention_block_size(CacheGroup(MLA, 16), mem, mem.bytes_per_state) == 256  # MLA aligns to 128
    qwen = ModelMemory((1, 3), 2048, 1_097_728)
    assert vllm_attention_block_size(CacheGroup(FA, 16), qwen, qwen.bytes_per_state) == 544  # 16 x cdiv(1,097,728, 32,768)


@pytest.mark.parametrize("bad, message", [
    (ModelMemory((4,), 256, 4000), "1 layer count\\(s\\) for 2 cache group\\(s\\)"),
    (ModelMemory((4, 0), 256, 4000), "layer count 0 of group 1"),
    (ModelMemory((4, 4), 0, 4000), "bytes per token is 0"),
    (ModelMemory((4, 4), 256, 1 << 50), "bytes per state 1125899906842624 must be an integer in"),
])
def test_bad_memory_figures(bad, message):
    layout = resolve_layout(LayoutConfig((CacheGroup(FA, 16), CacheGroup(MAMBA, 16))))
    with pytest.raises(ValueError, match=message):
        plan_pool(layout, bad, kv_memory_bytes=GIB)


@pytest.mark.parametrize("groups, dcp", [
    ((CacheGroup(FA, 4),), 1),
    ((CacheGroup(FA, 4),), 2),
    ((CacheGroup(FA, 4), CacheGroup(MAMBA, 8)), 1),
    ((CacheGroup(FA, 4), CacheGroup(MAMBA, 8), CacheGroup(MAMBA, 8)), 2),
])
def test_the_largest_request_runs_alone_in_the_pool(groups, dcp):
    """The reported size replays without a capacity error; with attention only (no Mamba
    headroom) one token more does not fit."""
    layout = resolve_layout(LayoutConfig(groups, dcp=dcp, max_model_len=4096))
    num_blocks = 40
    n = largest_request(groups, dcp, num_blocks - 1, 4096, 64)
    assert 0 < n < 4096 and request_blocks(groups, dcp, n + 1, 64) > num_blocks - 1

    def one(tokens: int):
        return replay([TraceRequest("big", tuple(range(tokens - 1)), (7, 8))], layout, num_blocks, 64, oracle=False)

    assert one(n).violations == []
    if all(g.kind is FA for g in groups):
        with pytest.raises(CapacityError):
            one(n + 1)


@pytest.mark.vllm
def test_pool_matches_vllm_planner():
    """vLLM 0.33.0's own page unification, grouping, bytes per block and per-request usage on
    the same figures (vLLM imported, never re-typed)."""
    torch = pytest.importorskip("torch")
    planning = pytest.importorskip("vllm.v1.core.kv_cache_planning")
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    for fa_layers, mamba_layers, state in ((4, 10, 4000), (5, 6, 4096), (12, 36, 3000), (3, 28, 1000)):
        fa = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)  # 256 B/token
        mb = MambaSpec(block_size=16, shapes=((state // 4,),), dtypes=(torch.float32,), mamba_cache_mode="align")
        specs = {f"fa{i}": fa for i in range(fa_layers)} | {f"m{i}": mb for i in range(mamba_layers)}
        groups = planning._get_kv_cache_groups_uniform_page_size(planning.unify_kv_cache_spec_page_size(specs))
        layout = resolve_layout(LayoutConfig((CacheGroup(FA, 16), CacheGroup(MAMBA, 16)), dcp=2, max_model_len=1000))
        pool = plan_pool(layout, ModelMemory((fa_layers, mamba_layers), 256, state), kv_memory_bytes=GIB)
        vllm_groups = (
            sum(isinstance(g.kv_cache_spec, FullAttentionSpec) for g in groups),
            sum(isinstance(g.kv_cache_spec, MambaSpec) for g in groups),
        )
        assert pool.vllm_groups == vllm_groups
        assert pool.block_bytes == planning._get_kv_cache_bytes_per_block(groups, planning.KVCacheLayout.BLHNC)
        config = types.SimpleNamespace(
            model_config=types.SimpleNamespace(max_model_len=1000),
            parallel_config=types.SimpleNamespace(decode_context_parallel_size=2),
            cache_config=types.SimpleNamespace(mamba_cache_mode="align"),
            max_in_flight_tokens=8192,
        )
        vllm_blocks = sum(g.kv_cache_spec.max_memory_usage_bytes(config) // g.kv_cache_spec.page_size_bytes for g in groups)
        expanded = expand_groups((CacheGroup(FA, 16), CacheGroup(MAMBA, 16, mamba_cache_mode=MambaCacheMode.ALIGN)), pool)
        assert request_blocks(expanded, 2, 1000, 8192) == vllm_blocks
