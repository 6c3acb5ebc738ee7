"""kvproof layouts and vLLM's KV-cache configurations, both ways.

``kv_cache_config_for``: a kvproof :class:`~kvproof.spec.layout.Layout` as vLLM's
``KVCacheConfig``, one ``KVCacheGroupSpec`` per kvproof group, in kvproof's group order, so group
ids agree between the two. The specs carry stand-in tensor shapes: vLLM's scheduler side reads
only block sizes, the DCP flag and the Mamba cache mode; page sizes derived from the shapes
never reach block accounting.

``layout_from_vllm``: the kvproof layout of a running engine's ``KVCacheConfig`` and
``VllmConfig`` -- what the checks compare vLLM against. Only the *choices* are read from vLLM
(group kinds, per-rank block sizes, DCP, context length, options); every derived size comes
from kvproof's geometry spec.
"""

from __future__ import annotations

import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)

from kvproof.spec.groups import CacheGroup, GroupKind, MambaCacheMode
from kvproof.spec.layout import Layout, LayoutConfig, resolve_layout

# Shape stand-ins for the specs (see the module docstring).
_ATTN_SHAPE = dict(num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
_MAMBA_SHAPE = dict(shapes=((1, 64),), dtypes=(torch.float32,))


def spec_for_group(group: CacheGroup):
    """The vLLM ``KVCacheSpec`` a model with this kvproof group would report.

    Raises ValueError for a group vLLM 0.33 cannot run with prefix caching (a Mamba group in
    mode ``none``)."""
    sharded = group.is_sharded
    if group.kind is GroupKind.FULL_ATTENTION:
        return FullAttentionSpec(block_size=group.block_size, dcp_sharded=sharded, **_ATTN_SHAPE)
    if group.kind is GroupKind.MLA:
        return MLAAttentionSpec(block_size=group.block_size, dcp_sharded=sharded, **_ATTN_SHAPE)
    if group.kind is GroupKind.SLIDING_WINDOW:
        return SlidingWindowSpec(
            block_size=group.block_size, sliding_window=group.sliding_window, dcp_sharded=sharded, **_ATTN_SHAPE
        )
    if group.kind is GroupKind.MAMBA:
        if group.mamba_cache_mode is not MambaCacheMode.ALIGN:
            # vLLM forces mode 'none' only with prefix caching off, and MambaManager asserts
            # caching => align; a cached 'none' group is not a configuration vLLM can run.
            raise ValueError(f"{group.label}: vLLM 0.33 prefix caching needs Mamba cache mode 'align'")
        return MambaSpec(
            block_size=group.block_size, mamba_cache_mode="align",
            num_speculative_blocks=group.num_speculative_blocks, **_MAMBA_SHAPE,
        )
    raise ValueError(f"no vLLM spec for group kind {group.kind!r}")


def kv_cache_config_for(layout: Layout, num_blocks: int) -> KVCacheConfig:
    """The ``KVCacheConfig`` of ``layout`` with ``num_blocks`` blocks (block 0 is vLLM's null
    block, as kvproof's). No tensors: nothing on the scheduler side allocates memory.

    ``hash_block_size`` is recorded as EngineCore records it. ``prefix_cache_retention_interval``
    stays at the dataclass default ``None`` (dense) and ``cache_hit_alignment_tokens`` unset:
    callers set them (vLLM's engine copies the first from ``CacheConfig`` and computes the
    second with its own rule, never kvproof's)."""
    groups = [KVCacheGroupSpec([f"layer.{g.index}"], spec_for_group(g.group)) for g in layout.groups]
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups, hash_block_size=layout.hash_block_size,
    )


def group_for_spec(spec, index: int) -> CacheGroup:
    """The kvproof group of one vLLM ``KVCacheSpec``. Raises ValueError for a spec kvproof has no
    model of (the checks then cannot be installed)."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        spec = next(iter(spec.kv_cache_specs.values()))  # vLLM asserts its layers agree
    # Exact types: subclasses (RSWA, sink, sliding-window MLA, ...) behave differently.
    kind = {
        FullAttentionSpec: GroupKind.FULL_ATTENTION,
        MLAAttentionSpec: GroupKind.MLA,
        SlidingWindowSpec: GroupKind.SLIDING_WINDOW,
        MambaSpec: GroupKind.MAMBA,
    }.get(type(spec))
    if kind is None:
        raise ValueError(
            f"KV-cache group {index} has a {type(spec).__name__}; kvproof models full attention, MLA, "
            "sliding window and Mamba groups only"
        )
    if kind is GroupKind.MAMBA:
        return CacheGroup(kind, spec.block_size, mamba_cache_mode=MambaCacheMode(spec.mamba_cache_mode),
                          num_speculative_blocks=spec.num_speculative_blocks)
    window = spec.sliding_window if kind is GroupKind.SLIDING_WINDOW else None
    return CacheGroup(kind, spec.block_size, dcp_sharded=spec.dcp_sharded, sliding_window=window)


def layout_from_vllm(kv_cache_config: KVCacheConfig, vllm_config) -> Layout:
    """The kvproof layout of an engine: its groups in vLLM's order, its DCP size and interleave,
    its context length, the hash unit the user asked for (``prefix_match_unit``; None lets
    kvproof derive H), its retention interval and shared-prefix-checkpoint option. Pure; raises
    ValueError naming what kvproof cannot model or rejects."""
    groups = tuple(group_for_spec(g.kv_cache_spec, i) for i, g in enumerate(kv_cache_config.kv_cache_groups))
    cache, parallel = vllm_config.cache_config, vllm_config.parallel_config
    return resolve_layout(LayoutConfig(
        groups,
        dcp=parallel.decode_context_parallel_size,
        max_model_len=vllm_config.model_config.max_model_len,
        hash_block_size=cache.prefix_match_unit,
        interleave=parallel.cp_kv_cache_interleave_size,
        retention_interval=kv_cache_config.prefix_cache_retention_interval,
        shared_prefix_checkpoint=cache.enable_mamba_shared_prefix_checkpoint,
    ))
