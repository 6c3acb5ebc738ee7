"""Scheduler-side cost: a shared-prefix workload replayed through kvproof's KV-cache manager
(lookup on arrival, allocate per prefill chunk and per decode token, cache, free), cheap
contract tier only, for several DCP sizes.

Reports operations per second and microseconds per arrival lookup, and -- when vLLM 0.33 is
importable -- the same workload through vLLM's own KVCacheManager in the same run, as a ratio.
Both sides run ``--repeat`` times, interleaved, each after a full garbage collection; the best
run of each is reported.

    python benchmarks/manager.py                      # defaults: 2000 requests, DCP 1 2 4 8
    python benchmarks/manager.py --requests 500 --dcp 1 8
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

os.environ.pop("ICONTRACT_SLOW", None)  # staging configuration: cheap tier only

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from workloads import shared_prefix_workload  # noqa: E402

from kvproof.cli.layout_args import parse_group  # noqa: E402
from kvproof.impl.kv_cache_manager import KVCacheManager  # noqa: E402
from kvproof.impl.request import Request  # noqa: E402
from kvproof.impl.scheduler import Scheduler  # noqa: E402
from kvproof.spec.layout import LayoutConfig, resolve_layout  # noqa: E402


class CountingManager(KVCacheManager):
    """Counts manager operations -- lookups, allocations (per prefill chunk and per decode
    token) and frees; caching is part of an allocation's cost, as in vLLM -- and times lookups."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ops = 0
        self.lookups = 0
        self.lookup_ns = 0

    def lookup(self, request):
        t = time.perf_counter_ns()
        hit = super().lookup(request)
        self.lookup_ns += time.perf_counter_ns() - t
        self.lookups += 1
        self.ops += 1
        return hit

    def allocate_slots(self, *args, **kwargs):
        self.ops += 1
        return super().allocate_slots(*args, **kwargs)

    def free(self, request):
        self.ops += 1
        return super().free(request)


def run_kvproof(trace, layout, num_blocks, budget):
    kv = CountingManager(layout, num_blocks)
    sched = Scheduler(kv, max_num_batched_tokens=budget)
    for t in trace:
        sched.add_request(Request(t.id, t.prompt, layout.hash_block_size, arrival=t.arrival, expected_outputs=t.output))
    start = time.perf_counter()
    while sched.has_unfinished():
        sched.finish_step(sched.schedule())
    seconds = time.perf_counter() - start
    cached = sum(r.num_cached_tokens or 0 for r in sched.finished)
    prompt = sum(r.num_prompt_tokens for r in sched.finished)
    return {
        "ops": kv.ops, "seconds": seconds, "ops_per_s": kv.ops / seconds,
        "us_per_lookup": kv.lookup_ns / max(kv.lookups, 1) / 1000, "hit_rate": cached / prompt,
        "copies": kv.num_copies, "steps": sched.step,
    }


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
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--prefixes", type=int, default=20)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, nargs=2, default=(32, 256))
    p.add_argument("--output-len", type=int, nargs=2, default=(8, 64))
    p.add_argument("--arrivals-per-step", type=int, default=8)
    p.add_argument("--group", action="append", help="as for kvproof geometry (default full_attention:64, mamba:64)")
    p.add_argument("--dcp", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--num-blocks", type=int, default=20000)
    p.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=3, help="runs per side, interleaved; the best is reported")
    p.add_argument("--no-vllm", action="store_true", help="skip the vLLM baseline even if vLLM is installed")
    args = p.parse_args(argv)
    groups = tuple(parse_group(g) for g in (args.group or ["full_attention:64", "mamba:64"]))
    trace = shared_prefix_workload(
        args.requests, args.prefixes, args.prefix_len, tuple(args.suffix_len), tuple(args.output_len),
        args.arrivals_per_step, seed=args.seed,
    )
    baseline = None
    if not args.no_vllm:
        try:
            import vllm_baseline  # benchmarks/vllm_baseline.py
            baseline = vllm_baseline
        except ImportError as e:
            print(f"# vLLM baseline unavailable ({e}); kvproof only", file=sys.stderr)
    print(f"# {args.requests} requests, {args.prefixes} shared prefixes of {args.prefix_len} tokens, "
          f"groups {', '.join(g.label for g in groups)}, {args.num_blocks} blocks, budget {args.budget}")
    header = f"{'dcp':>3}  {'ops':>8}  {'kvproof ops/s':>13}  {'us/lookup':>9}  {'hit rate':>8}"
    if baseline:
        header += f"  {'vLLM ops/s':>10}  {'vLLM us/lookup':>14}  {'speedup':>7}"
    print(header)
    for dcp in args.dcp:
        layout = resolve_layout(LayoutConfig(groups, dcp=dcp, max_model_len=1 << 20))
        ours_runs, theirs_runs = [], []
        for _ in range(args.repeat):  # interleaved, so both sides see the same machine load
            ours_runs.append(measured(run_kvproof, trace, layout, args.num_blocks, args.budget))
            if baseline:
                theirs_runs.append(measured(baseline.run_vllm, trace, layout, args.num_blocks, args.budget))
        ours = max(ours_runs, key=lambda r: r["ops_per_s"])
        line = (f"{dcp:>3}  {ours['ops']:>8}  {ours['ops_per_s']:>13,.0f}  {ours['us_per_lookup']:>9.1f}  "
                f"{ours['hit_rate']:>8.1%}")
        if baseline:
            theirs = max(theirs_runs, key=lambda r: r["ops_per_s"])
            line += (f"  {theirs['ops_per_s']:>10,.0f}  {theirs['us_per_lookup']:>14.1f}  "
                     f"{ours['ops_per_s'] / theirs['ops_per_s']:>6.1f}x")
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
