"""Hit rate of the compute eviction policy against lru for several values of its weight
(Marconi's alpha, ``spec.eviction.DEFAULT_WEIGHT``), on the Mooncake conversation trace with the
kimi-k3 preset: why the default weight is 0 (docs/benchmarks.md, "Eviction that weighs what a
hit saves"). Each point is one ``kvproof plan`` configuration (``planner.run.run_config``).

    python benchmarks/eviction_weight.py --limit 1000 --points 1:10 8:5 --weights 0 0.5 1
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from kvproof.cli.presets import PRESETS
from kvproof.planner.memory import ModelMemory, bytes_from_gib, plan_pool
from kvproof.planner.run import RunOptions, run_config
from kvproof.sim.workload import read_workload
from kvproof.spec import eviction
from kvproof.spec.layout import LayoutConfig, resolve_layout

TRACE = "../shared/traces/mooncake/conversation_trace.jsonl"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=TRACE)
    p.add_argument("--limit", type=int, default=1000)
    p.add_argument("--points", nargs="+", default=["1:10", "8:5"], metavar="DCP:GIB", help="DCP size and KV GiB per GPU")
    p.add_argument("--weights", nargs="+", type=float, default=[0.0, 0.5, 1.0])
    args = p.parse_args(argv)
    preset = PRESETS["kimi-k3"]
    memory = ModelMemory(preset.memory.layers, preset.memory.bytes_per_token, preset.memory.bytes_per_state)
    workload = read_workload(args.trace, 50.0, args.limit)
    print(f"{'DCP':>3}  {'GiB':>5}  {'policy':>14}  {'hit rate':>8}  {'prefill tokens':>14}")
    for point in args.points:
        dcp, gib = int(point.split(":")[0]), float(point.split(":")[1])
        runs = [("lru", None)] + [("compute", w) for w in args.weights]
        for policy, weight in runs:
            if weight is not None:
                eviction.DEFAULT_WEIGHT = weight  # read by each new EvictionValuer
            base = LayoutConfig(groups=preset.groups, dcp=1, max_model_len=preset.max_model_len, eviction=policy)
            pool = plan_pool(resolve_layout(dataclasses.replace(base, dcp=dcp)), memory, bytes_from_gib(gib))
            r = run_config(workload, base, dcp, pool, bytes_from_gib(gib), RunOptions())
            label = policy if weight is None else f"compute w={weight:g}"
            print(f"{dcp:>3}  {gib:>5g}  {label:>14}  {100 * r.hit_rate:>7.2f}%  {r.prefill_tokens:>14,}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
