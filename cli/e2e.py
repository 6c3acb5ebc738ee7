"""``kvproof e2e``: serve a trace with a tiny hybrid model through kvproof's scheduler, block
tables and slot mappings on DCP ranks (real processes, gloo), and compare every computed logit
with a recomputation from scratch (docs/e2e.md)."""

from __future__ import annotations

import argparse
import json
import sys

from kvproof.cli.errors import EXIT_OK, EXIT_PROPERTY_FAILED, fail_bad_input, one_line
from kvproof.cli.geometry import format_table
from kvproof.cli.layout_args import add_layout_arguments, layout_config_from_args
from kvproof.cli.limits import available_memory
from kvproof.cli.values import block_count, seed_value, token_count

HELP = "serve a trace with a tiny hybrid model on DCP ranks and compare its logits with recomputation"
PROG = "kvproof e2e"
#: Errors of a rank that mean the input cannot be served (exit 2), not a failed check.
_BAD_INPUT_KINDS = ("ValueError", "CapacityError", "TraceError", "StepLimitError")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("e2e", help=HELP, description=HELP)
    p.add_argument("trace", metavar="TRACE.jsonl", help="one request per line: {id, prompt, output, arrival, cache_salt}")
    add_layout_arguments(p)
    p.add_argument("--num-blocks", type=block_count, default=256,
                   help="blocks in the pool, the null block included (default 256)")
    p.add_argument("--max-num-batched-tokens", type=token_count, default=2048, help="token budget per step (default 2048)")
    p.add_argument("--no-partial-hash-hits", action="store_true", help="hits only on whole scheduler blocks")
    p.add_argument("--seed", type=seed_value, default=0, help="seed of the model's random weights, 0 to 2**64-1 (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # torch is imported here only: the other subcommands work without it.
    import dataclasses

    from kvproof.extras import require

    require("kernels", "this command")  # a MissingExtra: exit 2 (cli/guard.py)

    from kvproof.e2e.ranks import RankError
    from kvproof.e2e.model import ModelConfig
    from kvproof.e2e.runner import TOLERANCE, E2EOptions, run_e2e
    from kvproof.impl.scheduler import CapacityError
    from kvproof.sim.trace import read_trace
    from kvproof.spec.layout import resolve_layout

    try:
        config = layout_config_from_args(args, allow_partial_hash_hits=not args.no_partial_hash_hits)
        options = E2EOptions(
            num_blocks=args.num_blocks, max_num_batched_tokens=args.max_num_batched_tokens,
            model=dataclasses.replace(ModelConfig(), seed=args.seed),
        )
        layout = resolve_layout(config)
        check_machine(layout, options)
        trace = read_trace(args.trace)
        result = run_e2e(trace, config, options)
    except (ValueError, CapacityError) as e:
        return fail_bad_input(PROG, str(e))
    except TimeoutError as e:
        return fail_bad_input(PROG, f"{e} (the e2e runner's time limit)")
    except RankError as e:
        if e.kind in _BAD_INPUT_KINDS:
            return fail_bad_input(PROG, e.message)
        print(f"{PROG}: {one_line(str(e))}", file=sys.stderr)
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


def check_machine(layout, options) -> None:
    """Raise ValueError if the run would need more memory than this machine has available (the
    ranks' processes, caches and block tables; ``e2e.runner.memory_estimate``)."""
    from kvproof.e2e.runner import memory_estimate

    available = available_memory()
    per_rank, fixed = memory_estimate(layout, options)
    need = fixed + layout.dcp * per_rank
    if available is None or need <= available:
        return
    most_dcp = (available - fixed) // per_rank if available > fixed else 0
    hint = f"expected dcp <= {most_dcp:,} at these sizes" if 1 <= most_dcp < layout.dcp else \
        "lower --num-blocks or --max-model-len"
    raise ValueError(
        f"dcp {layout.dcp} with num_blocks {options.num_blocks:,} needs about {need / 1e9:.1f} GB ({layout.dcp:,} "
        f"rank(s) of {per_rank / 1e6:,.0f} MB: process, cache and block tables), but this machine has "
        f"{available / 1e9:.1f} GB available; {hint}"
    )
