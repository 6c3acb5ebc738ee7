"""The geometry flags shared by ``geometry``, ``replay`` and ``e2e``: parse them into a
:class:`~kvproof.spec.layout.LayoutConfig`."""

from __future__ import annotations

import argparse
import dataclasses

from kvproof.cli.presets import DEFAULT_PRESET, PRESETS
from kvproof.spec.groups import KIND_NAMES, MAMBA_MODE_NAMES, CacheGroup, GroupKind, parse_kind, parse_mamba_mode
from kvproof.spec.layout import LayoutConfig


def parse_group(text: str) -> CacheGroup:
    """``KIND:BLOCK_SIZE[:replicated|:sharded][:window=N]`` -> CacheGroup (ValueError if bad)."""
    parts = text.split(":")
    if len(parts) < 2:
        raise ValueError(f"group {text!r} must look like KIND:BLOCK_SIZE, e.g. full_attention:16")
    kind = parse_kind(parts[0])
    try:
        block_size = int(parts[1])
    except ValueError:
        raise ValueError(f"block size {parts[1]!r} in group {text!r} must be a positive integer") from None
    sharded, window = None, None
    for opt in parts[2:]:
        if opt in ("replicated", "sharded"):
            sharded = opt == "sharded"
        elif opt.startswith("window="):
            try:
                window = int(opt.removeprefix("window="))
            except ValueError:
                raise ValueError(f"window {opt!r} in group {text!r} must be window=N with N a positive integer") from None
        else:
            raise ValueError(f"unknown option {opt!r} in group {text!r}; expected replicated, sharded or window=N")
    if kind is GroupKind.SLIDING_WINDOW and window is None:
        window = 4 * block_size
    return CacheGroup(kind, block_size, dcp_sharded=sharded, sliding_window=window)


def add_layout_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("cache layout")
    g.add_argument(
        "--group", action="append", metavar="KIND:BLOCK_SIZE",
        help=f"a cache group (repeatable); KIND one of {', '.join(KIND_NAMES)}; options "
        "':replicated' / ':sharded' and ':window=N' may follow",
    )
    g.add_argument("--preset", choices=sorted(PRESETS), help=f"a named layout (default {DEFAULT_PRESET} when no --group)")
    g.add_argument("--dcp", type=int, help="decode context parallel size (ranks sharding attention KV)")
    g.add_argument("--max-model-len", type=int, help="longest request, in tokens")
    g.add_argument("--hash-block-size", type=int, help="hash granularity H (default: derived)")
    g.add_argument("--mamba-cache-mode", choices=MAMBA_MODE_NAMES, help="cache mode of every Mamba group")
    g.add_argument("--num-speculative-blocks", type=int, help="speculative state blocks of every Mamba group")
    g.add_argument("--interleave", type=int, default=1, help="DCP interleave size I (tokens per rank run)")
    g.add_argument(
        "--retention-interval", default="0", metavar="{none,0,K}",
        help="which Mamba states stay cached: 'none' every chunk end; 0 (default, as in vLLM) replay "
        "boundaries and shared-prefix junctions only; K also one per K-token segment",
    )
    g.add_argument(
        "--shared-prefix-checkpoint", action="store_true",
        help="end a prefill chunk exactly at a shared-prefix junction (default: at the Mamba block below it)",
    )


def parse_retention(text: str) -> int | None:
    """``none`` -> None (dense), else a non-negative integer (ValueError naming the value)."""
    if text == "none":
        return None
    if not text.isascii() or not text.isdigit():
        raise ValueError(f"retention interval {text!r} must be 'none' or a non-negative integer")
    return int(text)


def layout_config_from_args(args: argparse.Namespace, allow_partial_hash_hits: bool = True) -> LayoutConfig:
    """Build the layout: a preset's values, overridden by explicit flags. ValueError if bad."""
    preset = PRESETS[args.preset or DEFAULT_PRESET] if (args.preset or not args.group) else None
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
    return LayoutConfig(
        groups=groups,
        dcp=dcp,
        max_model_len=max_len,
        hash_block_size=args.hash_block_size,
        interleave=args.interleave,
        allow_partial_hash_hits=allow_partial_hash_hits,
        retention_interval=parse_retention(args.retention_interval),
        shared_prefix_checkpoint=args.shared_prefix_checkpoint,
    )
