"""``kvproof e2e``: serve a trace with a tiny hybrid model through kvproof's scheduler, block
tables and slot mappings on DCP ranks (real processes, gloo), and compare every computed logit
with a recomputation from scratch (docs/e2e.md)."""

from __future__ import annotations

import argparse
import json
import sys

from kvproof.cli.errors import EXIT_OK, EXIT_PROPERTY_FAILED, fail_bad_input
from kvproof.cli.geometry import format_table
from kvproof.cli.layout_args import add_layout_arguments, layout_config_from_args

HELP = "serve a trace with a tiny hybrid model on DCP ranks and compare its logits with recomputation"
PROG = "kvproof e2e"
#: Errors of a rank that mean the input cannot be served (exit 2), not a failed check.
_BAD_INPUT_KINDS = ("ValueError", "CapacityError", "TraceError")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("e2e", help=HELP, description=HELP)
    p.add_argument("trace", metavar="TRACE.jsonl", help="one request per line: {id, prompt, output, arrival, cache_salt}")
    add_layout_arguments(p)
    p.add_argument("--num-blocks", type=int, default=256, help="blocks in the pool, the null block included (default 256)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step (default 2048)")
    p.add_argument("--no-partial-hash-hits", action="store_true", help="hits only on whole scheduler blocks")
    p.add_argument("--seed", type=int, default=0, help="seed of the model's random weights (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # torch is imported here only: the other subcommands work without it.
    import dataclasses

    from kvproof.e2e.dcp import RankError
    from kvproof.e2e.model import ModelConfig
    from kvproof.e2e.runner import TOLERANCE, E2EOptions, run_e2e
    from kvproof.impl.scheduler import CapacityError
    from kvproof.impl.trace import read_trace

    try:
        config = layout_config_from_args(args, allow_partial_hash_hits=not args.no_partial_hash_hits)
        trace = read_trace(args.trace)
        options = E2EOptions(
            num_blocks=args.num_blocks, max_num_batched_tokens=args.max_num_batched_tokens,
            model=dataclasses.replace(ModelConfig(), seed=args.seed),
        )
        result = run_e2e(trace, config, options)
    except (ValueError, CapacityError) as e:
        return fail_bad_input(PROG, str(e))
    except RankError as e:
        if e.kind in _BAD_INPUT_KINDS:
            return fail_bad_input(PROG, e.message)
        print(f"{PROG}: {e}", file=sys.stderr)
        return EXIT_PROPERTY_FAILED
    data = result.summary()
    ok = data["max_abs_diff"] <= TOLERANCE
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        rows = [
            ["requests served", f"{data['requests']:,}"],
            ["tokens served from cache", f"{data['cached_tokens']:,}"],
            ["copy-on-write copies", f"{data['cow_copies']:,}"],
            ["max |served - recomputed| logit", f"{data['max_abs_diff']:.1e}"],
        ]
        print(format_table(rows, right_align_from=1))
        print(f"\n{'ok' if ok else 'MISMATCH'}: served logits {'match' if ok else 'differ from'} recomputation "
              f"(tolerance {TOLERANCE:.0e}, DCP {config.dcp})")
    if not ok:
        print(f"{PROG}: max abs diff {data['max_abs_diff']:.3e} > {TOLERANCE:.0e}", file=sys.stderr)
        return EXIT_PROPERTY_FAILED
    return EXIT_OK
