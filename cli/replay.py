"""``kvproof replay``: a request trace through the contract-checked scheduler and KV-cache
manager, with the content oracle watching every step."""

from __future__ import annotations

import argparse
import json
import sys

from kvproof.cli.errors import EXIT_OK, EXIT_PROPERTY_FAILED, fail_bad_input, one_line
from kvproof.cli.geometry import format_table
from kvproof.cli.layout_args import add_layout_arguments, layout_config_from_args
from kvproof.cli.limits import REPLAY_BYTES_PER_BLOCK, check_memory
from kvproof.cli.values import block_count, token_count

HELP = "replay a JSON Lines request trace through the contract-checked scheduler and KV-cache manager"
PROG = "kvproof replay"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("replay", help=HELP, description=HELP)
    p.add_argument("trace", metavar="TRACE.jsonl", help="one request per line: {id, prompt, output, arrival, cache_salt}")
    add_layout_arguments(p)
    p.add_argument("--num-blocks", type=block_count, default=4096,
                   help="blocks in the pool, the null block included (default 4096)")
    p.add_argument("--max-num-batched-tokens", type=token_count, default=2048, help="token budget per step (default 2048)")
    p.add_argument("--eagle", action="store_true", help="EAGLE/MTP: hits drop one hash unit for the draft")
    p.add_argument("--no-partial-hash-hits", action="store_true", help="hits only on whole scheduler blocks")
    p.add_argument("--no-oracle", action="store_true", help="skip the content oracle (faster; structural checks stay on)")
    p.add_argument("--slow", action="store_true", help="also run the whole-state checks after every step (slow tier)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from kvproof.sim.replay import replay
    from kvproof.impl.scheduler import CapacityError
    from kvproof.sim.trace import read_trace
    from kvproof.spec.capacity import check_fits_alone
    from kvproof.spec.layout import resolve_layout

    try:
        layout = resolve_layout(layout_config_from_args(args, allow_partial_hash_hits=not args.no_partial_hash_hits))
        if args.num_blocks < 2:
            raise ValueError(f"num_blocks {args.num_blocks} must be >= 2 (block 0 is the null block)")
        if args.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens {args.max_num_batched_tokens} must be >= 1")
        check_memory("--num-blocks", args.num_blocks, REPLAY_BYTES_PER_BLOCK, 0, "the block pool")
        trace = read_trace(args.trace)
        for t in trace:  # before any work: a request the pool can never hold fails here, not at step 10**5
            check_fits_alone(layout, args.num_blocks, t.id, t.num_computed_tokens)
        result = replay(
            trace, layout, args.num_blocks, args.max_num_batched_tokens,
            use_eagle=args.eagle, oracle=not args.no_oracle, slow=args.slow,
        )
    except (ValueError, CapacityError) as e:
        return fail_bad_input(PROG, str(e))
    data = {
        "requests": [
            {"id": r.request_id, "num_prompt_tokens": r.num_prompt_tokens, "num_cached_tokens": r.num_cached_tokens or 0}
            for r in result.requests
        ],
        "totals": {
            "hit_rate": round(result.hit_rate, 6),
            "cow_copies": result.cow_copies,
            "evictions": result.evictions,
            "preemptions": result.preemptions,
            "steps": result.steps,
            "steps_run": result.steps_run,
            "peak_blocks_per_group": list(result.peak_blocks_per_group),
        },
        "violations": result.violations,
    }
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        rows = [["request", "prompt tokens", "cached tokens"]] + [
            [r["id"], f"{r['num_prompt_tokens']:,}", f"{r['num_cached_tokens']:,}"] for r in data["requests"]
        ]
        print(format_table(rows, right_align_from=1))
        t = data["totals"]
        print(
            f"\nhit rate {t['hit_rate']:.1%}, {t['cow_copies']} copy-on-write copies, {t['evictions']} evictions, "
            f"{t['preemptions']} preemptions, {t['steps']} steps"
        )
        labels = ", ".join(f"{g.group.label} {n:,}" for g, n in zip(layout.groups, result.peak_blocks_per_group))
        print(f"peak blocks held per group (in use or cached): {labels}")
        if result.violations:
            print(f"\n{len(result.violations)} violation(s):")
            for v in result.violations:
                print(f"  {one_line(v)}")
        else:
            print("no violations")
    if result.violations:
        print(f"{PROG}: {len(result.violations)} invariant violation(s)", file=sys.stderr)
        return EXIT_PROPERTY_FAILED
    return EXIT_OK
