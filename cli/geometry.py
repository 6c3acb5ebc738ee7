"""``kvproof geometry``: block-table sizes per cache group and the derived sizes."""

from __future__ import annotations

import argparse
import json

from kvproof.cli.errors import EXIT_OK, fail_bad_input, printable
from kvproof.cli.layout_args import add_layout_arguments, given_layout_flags, layout_config_from_args
from kvproof.cli.presets import PRESETS
from kvproof.spec.layout import Layout, resolve_layout

HELP = "show block sizes, hash granularity, partial-hit rule and block-table widths per group"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("geometry", help=HELP, description=HELP)
    layout_flags = add_layout_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--list-presets", action="store_true", help="list the named layouts and exit (no layout flags)")
    p.set_defaults(run=run, layout_flags=layout_flags)


def layout_to_json(layout: Layout) -> dict:
    return {
        "groups": [
            {
                "index": g.index,
                "kind": g.group.kind.value,
                "block_size": g.group.block_size,
                "effective_block_size": g.effective_block_size,
                "dcp_sharded": g.group.is_sharded,
                "prefix_cacheable": g.group.prefix_cacheable,
                "max_num_blocks_per_req": g.max_num_blocks_per_req,
                "table_width": g.table_width,
                "table_row_bytes": g.table_row_bytes,
            }
            for g in layout.groups
        ],
        "dcp": layout.dcp,
        "interleave": layout.config.interleave,
        "max_model_len": layout.config.max_model_len,
        "scheduler_block_size": layout.scheduler_block_size,
        "hash_block_size": layout.hash_block_size,
        "partial_hash_hits": layout.partial_hash_hits,
        "partial_hash_hits_reason": layout.partial.reason,
        "cache_hit_alignment": layout.cache_hit_alignment,
        "warnings": list(layout.warnings),
    }


def format_table(rows: list[list[str]], right_align_from: int = 2) -> str:
    """Rows as aligned columns; a cell a terminal would not show as it is (a request id with a
    newline or an ANSI escape) appears quoted and escaped."""
    rows = [[printable(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        cells = [c.rjust(w) if i >= right_align_from else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def layout_to_text(layout: Layout) -> str:
    header = ["group", "kind", "block", "effective", "sharded", "max blocks/req", "table width", "row bytes"]
    rows = [header] + [
        [
            str(g.index),
            g.group.kind.value + ("" if g.group.prefix_cacheable else " (none)"),
            f"{g.group.block_size:,}",
            f"{g.effective_block_size:,}",
            "yes" if g.group.is_sharded else "no",
            f"{g.max_num_blocks_per_req:,}",
            f"{g.table_width:,}",
            f"{g.table_row_bytes:,}",
        ]
        for g in layout.groups
    ]
    c = layout.config
    summary = [
        f"dcp {c.dcp}, interleave {c.interleave}, max_model_len {c.max_model_len:,}",
        f"scheduler block size   {layout.scheduler_block_size:,}",
        f"hash block size        {layout.hash_block_size:,}",
        f"partial hash hits      {'on' if layout.partial_hash_hits else 'off'} ({layout.partial.reason})",
        f"cache-hit alignment    {layout.cache_hit_alignment:,}",
    ]
    out = format_table(rows) + "\n\n" + "\n".join(summary)
    for w in layout.warnings:
        out += f"\nwarning: {w}"
    return out


def run(args: argparse.Namespace) -> int:
    if args.list_presets:
        given = given_layout_flags(args, args.layout_flags)
        if given:  # they would be ignored: say so rather than list presets as if they were read
            return fail_bad_input("kvproof geometry", f"--list-presets takes no layout flags (got {', '.join(given)})")
        if args.json:
            print(json.dumps({name: p.summary for name, p in sorted(PRESETS.items())}, indent=2))
        else:
            for name, p in sorted(PRESETS.items()):
                print(f"{name:12}  {p.summary}")
        return EXIT_OK
    try:
        layout = resolve_layout(layout_config_from_args(args))
    except ValueError as e:
        return fail_bad_input("kvproof geometry", str(e))
    print(json.dumps(layout_to_json(layout), indent=2) if args.json else layout_to_text(layout))
    return EXIT_OK
