"""The ``vllm serve`` command line that runs a planned configuration in vLLM 0.33.0, and the
plan's settings it cannot reproduce (docs/plan.md, "Recommendations and diagnoses").

Each flag is vLLM's own spelling of one plan setting; tests/vllm/test_serve_command_vllm.py
parses the command with vLLM's argument parser and checks every engine argument it sets. The
rules stock vLLM lacks (keys at every hash boundary, compute-aware eviction, the ``reuse``
checkpoint policy) are served by
kvproof's manager inside vLLM: the command then starts with ``KVPROOF_MANAGER=kvproof`` and,
where kvproof's defaults differ from the plan's, ``KVPROOF_OPTIONS`` (its grammar is
``integrations/vllm/serving_options.py``'s; tests parse the value back with it).
"""

from __future__ import annotations

import dataclasses
import shlex
from typing import Optional

from kvproof.integrations.vllm.serving_options import ENV as OPTIONS_ENV, RULE_SETS
from kvproof.spec.groups import GroupKind, MambaCacheMode
from kvproof.spec.layout import LayoutConfig

#: What ``vllm serve`` takes when the plan was not given a model folder.
MODEL_PLACEHOLDER = "<model>"


MANAGERS = ("auto", "vllm", "kvproof")
#: kvproof's manager's defaults (what needs no option) and stock vLLM 0.33.0's choices.
KVPROOF_DEFAULTS = RULE_SETS["kvproof"]
STOCK_RULES = RULE_SETS["vllm"]


@dataclasses.dataclass(frozen=True)
class ServeCommand:
    argv: tuple[str, ...]
    #: The plan's settings this command does not reproduce.
    not_reproduced: tuple[str, ...]
    #: Environment the command needs: kvproof's manager and its options (empty: stock vLLM).
    env: tuple[tuple[str, str], ...] = ()

    def text(self) -> str:
        prefix = "".join(f"{name}={shlex.quote(value)} " for name, value in self.env)
        return prefix + shlex.join(self.argv).replace(shlex.quote(MODEL_PLACEHOLDER), MODEL_PLACEHOLDER)


def kvproof_rules(config: LayoutConfig) -> dict[str, str]:
    """The plan's rules that stock vLLM lacks, by ``KVPROOF_OPTIONS`` name (empty: stock vLLM
    serves the configuration as planned)."""
    return {k: v for k, v in _rules(config).items() if v != STOCK_RULES[k]}


def kvproof_options(config: LayoutConfig) -> str:
    """``KVPROOF_OPTIONS``'s value for kvproof's manager serving ``config``'s rules ("" for its
    defaults)."""
    return ",".join(f"{k}={v}" for k, v in _rules(config).items() if v != KVPROOF_DEFAULTS[k])


def _rules(config: LayoutConfig) -> dict[str, str]:
    return {name: getattr(config, name) for name in STOCK_RULES}


def stock_config(config: LayoutConfig) -> LayoutConfig:
    """``config`` under stock vLLM 0.33.0's rules, what ``serve_command(..., manager="vllm")``
    serves: vLLM's rule set (``RULE_SETS["vllm"]``: keys at block ends and prompt tails, LRU),
    vLLM's Mamba state positions, partial hash hits on, and an attention-only layout hashed per
    block. Pure."""
    attention_only = not any(g.kind is GroupKind.MAMBA for g in config.groups)
    return dataclasses.replace(
        config, **STOCK_RULES, allow_partial_hash_hits=True,
        hash_block_size=None if attention_only else config.hash_block_size,
    )


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
    manager: str = "auto",
    requested_block_size: Optional[int] = None,
) -> ServeCommand:
    """``config`` at ``dcp`` on ``tensor_parallel_size`` GPUs. ``block_size_from_model``: the
    layout's block sizes are the ones vLLM derives from the model itself, so no ``--block-size``
    unless ``requested_block_size`` says which one was asked for (vLLM raises it as the layout did).
    ``manager``: "vllm" (vLLM's own: kvproof's rules in ``config`` not reproduced), "kvproof", or
    "auto" (kvproof's where ``config`` has rules stock vLLM lacks)."""
    if manager not in MANAGERS:
        raise ValueError(f"manager {manager!r} must be one of {', '.join(MANAGERS)}")
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
    elif attention and requested_block_size is not None:
        argv += ["--block-size", str(requested_block_size)]
    if mamba:
        if any(g.mamba_cache_mode is MambaCacheMode.NONE for g in mamba):
            argv += ["--no-enable-prefix-caching"]
        if config.hash_block_size is not None:
            argv += ["--prefix-match-unit", str(config.hash_block_size)]
        if config.retention_interval != 0:
            argv += ["--prefix-cache-retention-interval", "None" if config.retention_interval is None else str(config.retention_interval)]
        if config.shared_prefix_checkpoint:
            argv += ["--enable-mamba-shared-prefix-checkpoint"]
    missing, env = [], []
    rules = kvproof_rules(config)
    if manager == "vllm":
        if "attention_keys" in rules:
            missing.append(f"--attention-keys {config.attention_keys} (vLLM keys only block ends and the prompt tail)")
        if "eviction" in rules:
            missing.append(f"--eviction {config.eviction} (vLLM evicts the least recently used)")
        if "checkpoints" in rules:
            missing.append(f"--checkpoints {config.checkpoints} (vLLM keeps Mamba states at its own positions only)")
    elif rules or manager == "kvproof":
        env.append(("KVPROOF_MANAGER", "kvproof"))
        options = kvproof_options(config)
        if options:
            env.append((OPTIONS_ENV, options))
    if not config.allow_partial_hash_hits:
        missing.append("--no-partial-hash-hits (vLLM 0.33.0 always allows partial hash hits)")
    if config.checkpoints != "vllm":
        missing.append(f"--checkpoints {config.checkpoints} (vLLM's Scheduler places vLLM's Mamba states)")
    if eagle:
        missing.append("--eagle (add your draft model as vllm serve's --speculative-config)")
    if config.hash_block_size is not None and not mamba:
        missing.append(f"--hash-block-size {config.hash_block_size} (vLLM hashes attention-only models per block)")
    return ServeCommand(tuple(argv), tuple(missing), tuple(env))
