"""benchmarks/manager.py's kvproof side in two git revisions, in the same run: "no slower than
before" for a change to the scheduler-side hot path.

Each revision is unpacked (``git archive``) into a temporary folder and imported from there,
the installed checkout set aside, so both run the same benchmark code of their own tree.
``--measure wall`` (default): rounds alternate the revisions, one process each, and the best
ops/s of each is reported. ``--measure instructions``: the instructions of one replay under
valgrind's callgrind (the same replay's setup run alone is subtracted) -- deterministic, so it
answers on a loaded machine where wall time moves by several percent between rounds.

    python benchmarks/compare_revisions.py d31f859 HEAD
    python benchmarks/compare_revisions.py d31f859 HEAD --measure instructions --dcp 1 8 --eviction lru compute
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Run in a child: import kvproof from the unpacked tree, not from the installed checkout.
_CHILD = r"""
import gc, os, sys, time
tree, mode, dcp, eviction, repeat = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f)]
sys.path[:0] = [tree, os.path.join(tree, "kvproof", "benchmarks")]
import argparse
import manager
from workloads import add_workload_arguments, workload_from_args
from kvproof.spec.layout import LayoutConfig, resolve_layout
p = argparse.ArgumentParser()
add_workload_arguments(p)
args = p.parse_args([])
groups, trace = workload_from_args(args)
layout = resolve_layout(LayoutConfig(groups, dcp=dcp, max_model_len=1 << 20, eviction=eviction))
if mode == "drive":
    runs = [manager.measured(manager.run_kvproof, trace, layout, args.num_blocks, args.budget) for _ in range(repeat)]
    print(max(r["ops_per_s"] for r in runs))
"""


def unpack(rev: str, into: str) -> str:
    """``rev`` of this repository as an importable ``kvproof`` package under ``into``."""
    tree = os.path.join(into, "kvproof")
    os.makedirs(tree)
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
    for so in glob.glob(os.path.join(ROOT, "impl", "_sha256_stream*.so")):  # the native hash stream, built here
        shutil.copy(so, os.path.join(tree, "impl"))
    return into


def child(tree: str, mode: str, dcp: int, eviction: str, repeat: int, callgrind: bool) -> str:
    cmd = [sys.executable, "-c", _CHILD, tree, mode, str(dcp), eviction, str(repeat)]
    if callgrind:
        cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", *cmd]
    env = dict(os.environ, PYTHONHASHSEED="0")
    env.pop("ICONTRACT_SLOW", None)
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=tree)
    return out.stdout + out.stderr


def instructions(tree: str, dcp: int, eviction: str) -> int:
    """Instructions of one replay: the process with it minus the process without it."""
    def total(mode: str) -> int:
        return int(re.search(r"Collected : (\d+)", child(tree, mode, dcp, eviction, 1, True)).group(1))
    return total("drive") - total("setup")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before", help="the baseline revision")
    p.add_argument("after", help="the revision measured against it")
    p.add_argument("--dcp", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--eviction", nargs="+", default=["lru", "compute"])
    p.add_argument("--measure", choices=("wall", "instructions"), default="wall")
    p.add_argument("--rounds", type=int, default=3, help="wall: alternating rounds (one process per revision each)")
    p.add_argument("--repeat", type=int, default=3, help="wall: replays per process; the best is kept")
    args = p.parse_args(argv)
    if args.measure == "instructions" and shutil.which("valgrind") is None:
        p.error("--measure instructions needs valgrind on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        trees = {rev: unpack(rev, os.path.join(tmp, str(i))) for i, rev in enumerate((args.before, args.after))}
        unit = "ops/s (best)" if args.measure == "wall" else "M instructions"
        print(f"# kvproof side of benchmarks/manager.py (default workload), {unit}; ratio after / before "
              f"({'higher' if args.measure == 'wall' else 'lower'} is faster)")
        print(f"{'dcp':>3}  {'eviction':>8}  {args.before:>12}  {args.after:>12}  {'ratio':>6}")
        for dcp in args.dcp:
            for ev in args.eviction:
                if args.measure == "wall":
                    best = {rev: 0.0 for rev in trees}
                    for _ in range(args.rounds):
                        for rev, tree in trees.items():
                            best[rev] = max(best[rev], float(child(tree, "drive", dcp, ev, args.repeat, False)))
                    a, b = best[args.before], best[args.after]
                    print(f"{dcp:>3}  {ev:>8}  {a:>12,.0f}  {b:>12,.0f}  {b / a:>6.3f}", flush=True)
                else:
                    a, b = (instructions(trees[rev], dcp, ev) / 1e6 for rev in (args.before, args.after))
                    print(f"{dcp:>3}  {ev:>8}  {a:>12,.0f}  {b:>12,.0f}  {b / a:>6.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
