"""``kvproof prove``: discharge every proof obligation and print the verdicts."""

from __future__ import annotations

import argparse
import json
import sys

from kvproof.cli.errors import EXIT_OK, EXIT_PROPERTY_FAILED, fail_bad_input
from kvproof.cli.values import decimal_number

HELP = "discharge the proof obligations (z3, CrossHair, exhaustive) and the canaries"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from kvproof.proofs.runner import DEFAULT_BUDGET, MAX_BUDGET

    p = subparsers.add_parser("prove", help=HELP, description=HELP)
    p.add_argument("--json", action="store_true", help="print a JSON list of {id, method, verdict, seconds, ...}")
    p.add_argument(
        "--budget", type=decimal_number, default=DEFAULT_BUDGET, metavar="SECONDS",
        help=f"deadline for the whole run, at most {MAX_BUDGET:.0f} (default {DEFAULT_BUDGET:.0f}); an "
        "obligation it cuts short fails as timeout or incomplete",
    )
    p.add_argument(
        "--only", action="append", default=[], metavar="ID",
        help="run only obligations whose id starts with ID (repeatable)",
    )
    p.set_defaults(run=run)


def format_results(results) -> str:
    rows = [["obligation", "method", "verdict", "time"]] + [
        [r.obligation.id, r.obligation.method, r.outcome.verdict + (" (FAILED)" if r.failed else ""),
         f"{r.seconds:.2f}s"]
        for r in results
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(c.rjust(w) if i == 3 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
             for row in rows]
    refuted = [r for r in results if r.outcome.counterexample]
    if refuted:
        lines.append("")
        lines += [f"counterexample {r.obligation.id}: {r.outcome.counterexample}" for r in refuted]
    broken = [r for r in results if r.failed and not r.outcome.counterexample]
    lines += [f"{r.obligation.id}: {r.outcome.verdict}: {r.outcome.detail}" for r in broken]
    failed = [r.obligation.id for r in results if r.failed]
    lines.append("")
    lines.append(
        f"{len(results)} obligations, {len(failed)} failed: {', '.join(failed)}" if failed
        else f"{len(results)} obligations, all as expected"
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from kvproof.extras import require

    require("proofs", "this command")  # before the runner imports z3; a MissingExtra: exit 2 (cli/guard.py)
    from kvproof.proofs.runner import MAX_BUDGET, run_all, select

    if not 0 < args.budget <= MAX_BUDGET:  # also refuses nan and inf
        return fail_bad_input(
            "kvproof prove", f"--budget {args.budget} must be a number of seconds in (0, {MAX_BUDGET:.0f}]"
        )
    try:
        obligations = select(args.only)
    except ValueError as e:
        return fail_bad_input("kvproof prove", str(e))

    def progress(i, result):  # stderr, so that stdout stays a clean table / JSON
        print(f"kvproof prove: [{i + 1}/{len(obligations)}] {result.obligation.id} {result.outcome.verdict} "
              f"({result.seconds:.1f}s)", file=sys.stderr, flush=True)

    results = run_all(obligations, args.budget, progress)
    if args.json:
        print(json.dumps([r.to_json() for r in results], indent=2))
    else:
        print(format_results(results))
    failed = [r for r in results if r.failed]
    for r in failed:  # stderr names each failure even when stdout is JSON
        print(f"kvproof prove: {r.obligation.id} did not hold as expected: {r.outcome.verdict}", file=sys.stderr)
    return EXIT_PROPERTY_FAILED if failed else EXIT_OK
