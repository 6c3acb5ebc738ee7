"""vLLM 0.33.0's own KV-cache manager under kvproof's driver, counted as kvproof's is: the vLLM
column of benchmarks/manager.py, and stand-alone vLLM's whole result for the same workload.

The adapter itself (vLLM's ``KVCacheManager`` behind kvproof's manager interface) is
``kvproof.integrations.vllm.manager_adapter``; this file adds the counting and the entry points.

    python benchmarks/manager.py --requests 300 --dcp 1 2     # prints both columns
    python benchmarks/vllm_baseline.py --requests 300         # vLLM's side in full
"""

from __future__ import annotations

import os
import sys
from typing import Optional

# vLLM is optional for kvproof: importing this module without it raises ImportError, which
# benchmarks/manager.py turns into "kvproof only".
from kvproof.integrations.vllm.manager_adapter import VllmManagerAdapter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/ is not a package
from counting import CountingMixin, drive  # noqa: E402


# --- the benchmark entry point -------------------------------------------------------------------

class CountingVllmAdapter(CountingMixin, VllmManagerAdapter):
    """vLLM's manager, counted as kvproof's is (benchmarks/counting.py)."""


def run_vllm(trace, layout, num_blocks, budget, *, retention_interval: Optional[int] = None,
             full_sequence_must_fit: bool = True) -> dict:
    """``run_kvproof`` (benchmarks/manager.py) with vLLM's manager: same driver, same trace,
    same keys. Mirror requests are built (and their prompts hashed) before the clock starts, as
    kvproof's requests are."""
    kv = CountingVllmAdapter(
        layout, num_blocks, max_num_batched_tokens=budget,
        full_sequence_must_fit=full_sequence_must_fit, retention_interval=retention_interval,
    )
    for msg in kv.disagreements:
        print(f"# vLLM vs kvproof layout: {msg}", file=sys.stderr)
    return drive(kv, trace, layout, budget, on_request=kv.register)


# --- stand-alone: vLLM's side of benchmarks/manager.py in full -----------------------------------

def main(argv=None) -> int:
    """benchmarks/manager.py prints kvproof's hit rate only; this prints vLLM's whole result
    for the same workload, with dense retention (what kvproof implements) and with vLLM's
    production default ``prefix_cache_retention_interval=0``."""
    import argparse

    from workloads import add_workload_arguments, workload_from_args

    from kvproof.spec.layout import LayoutConfig, resolve_layout

    p = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    add_workload_arguments(p)
    args = p.parse_args(argv)
    groups, trace = workload_from_args(args)
    print(f"# vLLM 0.33 manager, {args.requests} requests, groups {', '.join(g.label for g in groups)}; "
          f"ops = lookup+allocate_slots+free")
    print(f"{'dcp':>3}  {'retention':>9}  {'ops':>7}  {'ops/s':>8}  {'us/lookup':>9}  {'hit rate':>8}  "
          f"{'copies':>6}  {'steps':>5}")
    for dcp in args.dcp:
        layout = resolve_layout(LayoutConfig(groups, dcp=dcp, max_model_len=1 << 20))
        for retention in (None, 0):
            r = run_vllm(trace, layout, args.num_blocks, args.budget, retention_interval=retention)
            label = "dense" if retention is None else str(retention)
            print(f"{dcp:>3}  {label:>9}  {r['ops']:>7}  {r['ops_per_s']:>8,.0f}  {r['us_per_lookup']:>9.1f}  "
                  f"{r['hit_rate']:>8.1%}  {r['copies']:>6}  {r['steps']:>5}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
