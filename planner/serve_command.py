"""The ``vllm serve`` command line that runs a planned configuration on stock vLLM 0.33.0, and
the plan's rules it cannot reproduce (docs/plan.md, "Recommendations and diagnoses").

Each flag is vLLM's own spelling of one plan setting; tests/vllm/test_serve_command_vllm.py
parses the command with vLLM's argument parser and checks every engine argument it sets.
"""

from __future__ import annotations

import dataclasses
import shlex
from typing import Optional

from kvproof.spec.groups import GroupKind, MambaCacheMode
from kvproof.spec.layout import LayoutConfig

#: What ``vllm serve`` takes when the plan was not given a model folder.
MODEL_PLACEHOLDER = "<model>"


@dataclasses.dataclass(frozen=True)
class ServeCommand:
    argv: tuple[str, ...]
    #: The plan's settings no stock ``vllm serve`` flag reproduces (kvproof's own rules).
    not_reproduced: tuple[str, ...]

    def text(self) -> str:
        return shlex.join(self.argv).replace(shlex.quote(MODEL_PLACEHOLDER), MODEL_PLACEHOLDER)


def serve_command(
    config: LayoutConfig,
    dcp: int,
    tensor_parallel_size: int,
    kv_memory_bytes: Optional[int],
    max_num_batched_tokens: int,
    max_num_seqs: int,
    model: Optional[str] = None,
    block_size_from_model: bool = False,
    eagle: bool = False,
) -> ServeCommand:
    """``config`` at ``dcp`` on ``tensor_parallel_size`` GPUs. ``block_size_from_model``: the
    layout's block sizes are the ones vLLM derives from the model itself, so no ``--block-size``."""
    argv = ["vllm", "serve", model or MODEL_PLACEHOLDER, "--tensor-parallel-size", str(tensor_parallel_size)]
    if dcp > 1:
        argv += ["--decode-context-parallel-size", str(dcp)]
        if config.interleave != 1:
            argv += ["--dcp-kv-cache-interleave-size", str(config.interleave)]
    if kv_memory_bytes is not None:
        argv += ["--kv-cache-memory-bytes", str(kv_memory_bytes)]
    argv += ["--max-num-batched-tokens", str(max_num_batched_tokens), "--max-num-seqs", str(max_num_seqs)]
    attention = [g for g in config.groups if g.kind.is_attention]
    mamba = [g for g in config.groups if g.kind is GroupKind.MAMBA]
    if attention and not block_size_from_model:
        argv += ["--block-size", str(attention[0].block_size)]
    if mamba:
        if any(g.mamba_cache_mode is MambaCacheMode.NONE for g in mamba):
            argv += ["--no-enable-prefix-caching"]
        if config.hash_block_size is not None:
            argv += ["--prefix-match-unit", str(config.hash_block_size)]
        if config.retention_interval != 0:
            argv += ["--prefix-cache-retention-interval", "None" if config.retention_interval is None else str(config.retention_interval)]
        if config.shared_prefix_checkpoint:
            argv += ["--enable-mamba-shared-prefix-checkpoint"]
    missing = []
    if config.attention_keys != "chunk-ends":
        missing.append(f"--attention-keys {config.attention_keys} (vLLM keys each step's last hash boundary only)")
    if config.eviction != "lru":
        missing.append(f"--eviction {config.eviction} (vLLM evicts the least recently used)")
    if eagle:
        missing.append("--eagle (add your draft model as vllm serve's --speculative-config)")
    if config.hash_block_size is not None and not mamba:
        missing.append(f"--hash-block-size {config.hash_block_size} (vLLM hashes attention-only models per block)")
    return ServeCommand(tuple(argv), tuple(missing))
