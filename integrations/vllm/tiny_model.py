"""A model folder holding only a tiny hybrid ``config.json`` (Qwen3-Next: gated-delta-net linear
attention + full attention), which is all vLLM needs to build an engine configuration and the
real KV-cache specs of a hybrid model on a machine without weights or a GPU.

Sizes are chosen so that every DCP size in 1, 2, 4, 8 is accepted with TP = DCP: one KV head
(vLLM requires TP > KV heads for DCP), head counts divisible by 8. ``max_position_embeddings``
is the largest context kvproof's geometry accepts, so any layout's ``max_model_len`` is valid.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile

from kvproof.spec.layout import MAX_MODEL_LEN_LIMIT

TINY_QWEN3_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 8,
    "linear_num_value_heads": 8,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "decoder_sparse_step": 1,
    "max_position_embeddings": MAX_MODEL_LEN_LIMIT,
    "rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.25, "rope_type": "default"},
    "eos_token_id": 1023,
    "torch_dtype": "bfloat16",
}


#: The same model with full attention in every layer (no Mamba group).
ATTENTION_ONLY = {"layer_types": ["full_attention", "full_attention"]}


def write_tiny_model(directory: str, overrides: dict | None = None) -> str:
    """Mutates the file system: writes ``config.json`` (:data:`TINY_QWEN3_NEXT`, updated with
    ``overrides``, e.g. :data:`ATTENTION_ONLY`) into ``directory`` (created if needed). Returns
    ``directory``."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(TINY_QWEN3_NEXT | (overrides or {}), f, indent=1)
    return directory


_process_dir: str | None = None


def tiny_model_dir() -> str:
    """A per-process temporary model folder (written once, removed at exit)."""
    global _process_dir
    if _process_dir is None:
        _process_dir = write_tiny_model(tempfile.mkdtemp(prefix="kvproof-tiny-qwen3-next-"))
        atexit.register(shutil.rmtree, _process_dir, True)
    return _process_dir
