"""planner/model_config.py against vLLM 0.33.0's own code, for every shipped model at TP 1, 2
and 8: vLLM's ``ModelConfig`` (built from the same config.json) counts the layers and sizes the
attention heads, its KV specs turn them into page bytes, its model classes give the state
shapes and dtypes, and its platform's align rule raises the block. kvproof's figures must equal
each of them."""

from __future__ import annotations

import os
import types
from importlib import resources

import pytest

pytest.importorskip("vllm")

from kvproof.planner.model_config import SHIPPED_MODELS, model_layout  # noqa: E402


@pytest.fixture(scope="module")
def vllm_parts():
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig
    from vllm.model_executor.models import ModelRegistry
    from vllm.platforms.interface import Platform
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec

    return types.SimpleNamespace(**locals())


def _folder(name: str) -> str:
    return str(resources.files("kvproof.planner") / "data" / "models" / name)


def _vllm_block_size(v, vllm_config, monkeypatch) -> int:
    """The block vLLM's platform picks (``_align_hybrid_block_size``) with the GPU default
    backends: FlashAttention, FlashMLA for MLA. Which backends the model's layers would pick,
    and FlashInfer's GDN checkpoint alignment, need built layers: fixed here as docs/plan.md says."""
    import vllm.model_executor.layers.mamba.abstract as mamba_abstract

    if vllm_config.model_config.use_mla:
        from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend as backend
    else:
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend as backend
    monkeypatch.setattr(v.Platform, "_find_non_ssm_backends", classmethod(lambda cls, config: [backend]))
    monkeypatch.setattr(mamba_abstract, "get_mamba_prefill_checkpoint_alignment", lambda config: None)
    v.Platform._align_hybrid_block_size(vllm_config, backend)
    return vllm_config.cache_config.block_size


@pytest.mark.parametrize("tp", [1, 2, 8])
@pytest.mark.parametrize("name", SHIPPED_MODELS)
def test_every_figure_is_vllms(vllm_parts, monkeypatch, name, tp):
    v = vllm_parts
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    mine = model_layout(name, tp)
    mc = v.ModelConfig(model=_folder(name), skip_tokenizer_init=True, dtype="auto")
    pc = v.ParallelConfig(tensor_parallel_size=tp)
    assert mine.architecture == mc.architecture
    assert mine.max_model_len == mc.max_model_len

    heads = mc.get_num_kv_heads(pc)
    if mc.use_mla:
        page = v.MLAAttentionSpec(block_size=1, num_kv_heads=heads, head_size=mc.get_head_size(), dtype=mc.dtype,
                                  cache_dtype_str="auto")
    else:
        page = v.FullAttentionSpec(block_size=1, num_kv_heads=heads, head_size=mc.get_head_size(), dtype=mc.dtype)
    assert mine.memory.bytes_per_token == page.page_size_bytes

    layers = mc.hf_config.num_hidden_layers
    if hasattr(mc.hf_config, "is_kda_layer"):  # Kimi-Linear names its layers in its own way
        attention = sum(not mc.hf_config.is_kda_layer(i) for i in range(layers))
    else:
        attention = mc.get_num_layers_by_block_type(pc, "attention")
    assert sum(mine.memory.layers) == layers
    assert mine.memory.layers[0] == attention

    if not mc.is_hybrid:
        assert len(mine.groups) == 1 and mine.block_size == 16
        return
    vllm_config = types.SimpleNamespace(
        model_config=mc, parallel_config=pc, speculative_config=None,
        cache_config=v.CacheConfig(block_size=16, mamba_cache_mode="align"),
    )
    cls, _ = v.ModelRegistry.resolve_model_cls(mc.architecture, model_config=mc)
    state = v.MambaSpec(
        shapes=cls.get_mamba_state_shape_from_config(vllm_config),
        dtypes=cls.get_mamba_state_dtype_from_config(vllm_config),
        block_size=-1,
    )
    assert mine.memory.bytes_per_state == state.page_size_bytes
    block = _vllm_block_size(v, vllm_config, monkeypatch)
    assert [g.block_size for g in mine.groups] == [block, vllm_config.cache_config.mamba_block_size]

