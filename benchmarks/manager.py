"""Scheduler-side cost: a shared-prefix workload replayed through kvproof's KV-cache manager
(lookup on arrival, allocate per prefill chunk and per decode token, cache, free), cheap
contract tier only, for several DCP sizes.

Reports operations per second and microseconds per arrival lookup, and -- when vLLM 0.33 is
importable -- the same workload through vLLM's own KVCacheManager in the same run, as a ratio.
Both sides run ``--repeat`` times, interleaved, each after a full garbage collection; the best
run of each is reported.

    python benchmarks/manager.py                      # defaults: 2000 requests, DCP 1 2 4 8
    python benchmarks/manager.py --requests 500 --dcp 1 8
    python benchmarks/manager.py --eviction lru compute   # kvproof once per eviction policy
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

os.environ.pop("ICONTRACT_SLOW", None)  # staging configuration: cheap tier only

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from counting import CountingMixin, drive  # noqa: E402
from workloads import add_workload_arguments, workload_from_args  # noqa: E402

from kvproof.impl.kv_cache_manager import KVCacheManager  # noqa: E402
from kvproof.spec.eviction import LRU, POLICIES  # noqa: E402
from kvproof.spec.layout import ATTENTION_KEYS, LayoutConfig, resolve_layout  # noqa: E402


class CountingManager(CountingMixin, KVCacheManager):
    """kvproof's manager, counted as vLLM's is (benchmarks/counting.py)."""


def run_kvproof(trace, layout, num_blocks, budget):
    """One replay through kvproof's manager (its pool evicts by ``layout.config.eviction``)."""
    return drive(CountingManager(layout, num_blocks), trace, layout, budget)


def measured(run, *args) -> dict:
    """One timed run after a full collection, with the heap built so far frozen (as vLLM's
    engine does at start-up), so that collections of earlier runs' garbage stay out of it."""
    gc.collect()
    gc.freeze()
    try:
        return run(*args)
    finally:
        gc.unfreeze()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_arguments(p)
    p.add_argument("--repeat", type=int, default=3, help="runs per side, interleaved; the best is reported")
    p.add_argument("--no-vllm", action="store_true", help="skip the vLLM baseline even if vLLM is installed")
    p.add_argument("--eviction", nargs="+", choices=POLICIES, default=[LRU], help="kvproof's eviction policies (default lru)")
    p.add_argument("--attention-keys", choices=ATTENTION_KEYS, default=ATTENTION_KEYS[0],
                   help="kvproof's attention keying rule (the layout default first)")
    args = p.parse_args(argv)
    groups, trace = workload_from_args(args)
    baseline = None
    if not args.no_vllm:
        try:
            import vllm_baseline  # benchmarks/vllm_baseline.py
            baseline = vllm_baseline
        except ImportError as e:
            print(f"# vLLM baseline unavailable ({e}); kvproof only", file=sys.stderr)
    print(f"# {args.requests} requests, {args.prefixes} shared prefixes of {args.prefix_len} tokens, "
          f"groups {', '.join(g.label for g in groups)}, {args.num_blocks} blocks, budget {args.budget}, "
          f"attention keys {args.attention_keys}")
    header = f"{'dcp':>3}  {'eviction':>8}  {'ops':>8}  {'kvproof ops/s':>13}  {'us/lookup':>9}  {'hit rate':>8}"
    if baseline:
        header += f"  {'vLLM ops/s':>10}  {'vLLM us/lookup':>14}  {'speedup':>7}"
    print(header)
    for dcp in args.dcp:
        layouts = {e: resolve_layout(LayoutConfig(groups, dcp=dcp, max_model_len=1 << 20, eviction=e,
                                                  attention_keys=args.attention_keys)) for e in args.eviction}
        ours_runs: dict[str, list] = {e: [] for e in args.eviction}
        theirs_runs = []
        for _ in range(args.repeat):  # interleaved, so every side sees the same machine load
            for e, layout in layouts.items():
                ours_runs[e].append(measured(run_kvproof, trace, layout, args.num_blocks, args.budget))
            if baseline:
                theirs_runs.append(measured(baseline.run_vllm, trace, layouts[args.eviction[0]], args.num_blocks, args.budget))
        theirs = max(theirs_runs, key=lambda r: r["ops_per_s"]) if baseline else None
        for e in args.eviction:
            ours = max(ours_runs[e], key=lambda r: r["ops_per_s"])
            line = (f"{dcp:>3}  {e:>8}  {ours['ops']:>8}  {ours['ops_per_s']:>13,.0f}  {ours['us_per_lookup']:>9.1f}  "
                    f"{ours['hit_rate']:>8.1%}")
            if theirs:
                line += (f"  {theirs['ops_per_s']:>10,.0f}  {theirs['us_per_lookup']:>14.1f}  "
                         f"{ours['ops_per_s'] / theirs['ops_per_s']:>6.1f}x")
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
