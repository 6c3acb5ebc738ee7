"""The geometry flags shared by ``geometry``, ``replay`` and ``e2e``: parse them into a
:class:`~kvproof.spec.layout.LayoutConfig`."""

from __future__ import annotations

import argparse
import dataclasses

from kvproof.cli.presets import DEFAULT_PRESET, PRESETS, Preset
from kvproof.cli.values import TOKEN_LIMIT, any_decimal, check_at_most, parse_decimal, speculative_count, token_count
from kvproof.spec.checkpoints import CHECKPOINT_POLICIES
from kvproof.spec.eviction import LRU, POLICIES
from kvproof.spec.groups import KIND_NAMES, MAMBA_MODE_NAMES, CacheGroup, GroupKind, parse_kind, parse_mamba_mode
from kvproof.spec.layout import ATTENTION_KEYS, LayoutConfig


def parse_group(text: str) -> CacheGroup:
    """``KIND:BLOCK_SIZE[:replicated|:sharded][:window=N]`` -> CacheGroup (ValueError if bad)."""
    parts = text.split(":")
    if len(parts) < 2:
        raise ValueError(f"group {text!r} must look like KIND:BLOCK_SIZE, e.g. full_attention:16")
    kind = parse_kind(parts[0])
    block_size = _size(parts[1], "block size", text)
    sharded, window = None, None
    seen: set[str] = set()
    for opt in parts[2:]:
        name = opt.partition("=")[0] if opt.startswith("window=") else opt
        if name in seen or (name in ("replicated", "sharded") and seen & {"replicated", "sharded"}):
            raise ValueError(f"option {opt!r} in group {text!r} repeats or contradicts an earlier one; expected each once")
        seen.add(name)
        if opt in ("replicated", "sharded"):
            sharded = opt == "sharded"
        elif opt.startswith("window="):
            window = _size(opt.removeprefix("window="), "window", text)
        else:
            raise ValueError(f"unknown option {opt!r} in group {text!r}; expected replicated, sharded or window=N")
    if kind is GroupKind.SLIDING_WINDOW and window is None:
        window = 4 * block_size
    try:
        return CacheGroup(kind, block_size, dcp_sharded=sharded, sliding_window=window)
    except ValueError as e:
        raise ValueError(f"group {text!r}: {e}") from None


def _size(value: str, name: str, group: str) -> int:
    """A token count inside ``--group``: decimal, at most TOKEN_LIMIT (lower bound: CacheGroup)."""
    try:
        return check_at_most(parse_decimal(value, name), TOKEN_LIMIT, name,
                             "2**30 tokens, the longest context kvproof accepts")
    except ValueError as e:
        raise ValueError(f"group {group!r}: {e}") from None


def add_layout_arguments(parser: argparse.ArgumentParser, default_preset: str = DEFAULT_PRESET) -> list[argparse.Action]:
    """Add the layout flags (``default_preset``: the layout the command uses without ``--preset``
    or ``--group``, as its help says); returns their actions (to tell which ones were given)."""
    g = parser.add_argument_group("cache layout")
    actions: list[argparse.Action] = []

    def add(*names: str, **kwargs) -> None:
        actions.append(g.add_argument(*names, **kwargs))

    add(
        "--group", action="append", metavar="KIND:BLOCK_SIZE",
        help=f"a cache group (repeatable); KIND one of {', '.join(KIND_NAMES)}; options "
        "':replicated' / ':sharded' and ':window=N' may follow",
    )
    add("--preset", choices=sorted(PRESETS),
        help=f"a named layout (default {default_preset} when no --group; not combined with --group)")
    add("--dcp", type=any_decimal, help="decode context parallel size (ranks sharding attention KV)")
    add("--max-model-len", type=token_count, help="longest request, in tokens")
    add("--hash-block-size", type=token_count, help="hash granularity H (default: derived)")
    add("--mamba-cache-mode", choices=MAMBA_MODE_NAMES, help="cache mode of every Mamba group")
    add("--num-speculative-blocks", type=speculative_count, help="speculative state blocks of every Mamba group")
    add("--interleave", type=token_count, default=1, help="DCP interleave size I (tokens per rank run)")
    add(
        "--retention-interval", default="0", metavar="{none,0,K}",
        help="which Mamba states stay cached: 'none' every chunk end; 0 (default, as in vLLM) replay "
        "boundaries and shared-prefix junctions only; K also one per K-token segment",
    )
    add("--eviction", choices=POLICIES, default=LRU,
        help="which evictable cached block the pool reuses first: 'lru' (default, vLLM's) or 'compute' "
        "(the least prefill compute lost per byte, aged by recency; docs/coordinator.md)")
    add(
        "--attention-keys", choices=ATTENTION_KEYS, default=ATTENTION_KEYS[0],
        help="which hash boundaries inside a full-attention / MLA block get a prefix-cache key: every-hash "
        "(default) every one the forward pass wrote; chunk-ends only each step's last one; prompt-tail only the prompt's tail (vLLM 0.33.0's rule)",
    )
    add("--checkpoints", choices=CHECKPOINT_POLICIES, default=CHECKPOINT_POLICIES[0],
        help="where Mamba states are made and kept: 'vllm' (default) vLLM 0.33.0's positions; 'reuse' also a "
        "ladder of states below each prompt's end, where a conversation's next turn resumes (docs/coordinator.md)")
    add(
        "--shared-prefix-checkpoint", action="store_true",
        help="end a prefill chunk exactly at a shared-prefix junction (default: at the Mamba block below it)",
    )
    return actions


def given_layout_flags(args: argparse.Namespace, actions: list[argparse.Action]) -> list[str]:
    """The layout flags ``args`` sets to something other than their defaults."""
    return [a.option_strings[0] for a in actions if getattr(args, a.dest) != a.default]


def parse_retention(text: str) -> int | None:
    """``none`` -> None (dense), else a non-negative integer (ValueError naming the value)."""
    if text == "none":
        return None
    if not text.isascii() or not text.isdigit():
        raise ValueError(f"retention interval {text!r} must be 'none' or a non-negative integer")
    return check_at_most(parse_decimal(text, "retention interval"), TOKEN_LIMIT, "retention interval",
                         "2**30 tokens, the longest context kvproof accepts")


def layout_config_from_args(
    args: argparse.Namespace, allow_partial_hash_hits: bool = True, preset: Preset | None = None,
) -> LayoutConfig:
    """Build the layout: a preset's values (``preset``, e.g. one read from a model folder, or
    ``--preset``), overridden by explicit flags. ValueError if bad."""
    if args.preset and args.group:
        raise ValueError(
            f"--group cannot be combined with --preset {args.preset}: a preset fixes its groups; drop --preset "
            "to give the groups yourself, or drop --group (--dcp and --max-model-len override a preset's)"
        )
    if preset is None and (args.preset or not args.group):
        preset = PRESETS[args.preset or DEFAULT_PRESET]
    groups = tuple(parse_group(t) for t in args.group) if args.group else preset.groups
    dcp = args.dcp if args.dcp is not None else (preset.dcp if preset else 1)
    max_len = args.max_model_len if args.max_model_len is not None else (preset.max_model_len if preset else 8192)
    overrides = {}
    if args.mamba_cache_mode is not None:
        overrides["mamba_cache_mode"] = parse_mamba_mode(args.mamba_cache_mode)
    if args.num_speculative_blocks is not None:
        if args.num_speculative_blocks < 0:
            raise ValueError(f"num_speculative_blocks {args.num_speculative_blocks} must be >= 0")
        overrides["num_speculative_blocks"] = args.num_speculative_blocks
    if overrides:
        groups = tuple(dataclasses.replace(g, **overrides) if g.kind is GroupKind.MAMBA else g for g in groups)
    if isinstance(dcp, int) and 1 <= dcp <= 1024:  # out-of-range DCP sizes are the spec's to refuse
        for i, g in enumerate(groups):
            if g.is_sharded and g.block_size * dcp > TOKEN_LIMIT:
                raise ValueError(
                    f"group {i} ({g.label}) covers {g.block_size * dcp:,} tokens per block at dcp {dcp}; expected at "
                    f"most {TOKEN_LIMIT:,} (2**30 tokens, the longest context kvproof accepts)"
                )
    return LayoutConfig(
        groups=groups,
        dcp=dcp,
        max_model_len=max_len,
        hash_block_size=args.hash_block_size,
        interleave=args.interleave,
        allow_partial_hash_hits=allow_partial_hash_hits,
        retention_interval=parse_retention(args.retention_interval),
        shared_prefix_checkpoint=args.shared_prefix_checkpoint,
        eviction=args.eviction,
        attention_keys=args.attention_keys,
        checkpoints=args.checkpoints,
    )
