"""kvproof's manager against vLLM 0.33.0's own inside vLLM's real Scheduler (the engine harness,
integrations/vllm/engine_harness.py), on one workload, interleaved in the same run: the time of
``schedule()`` + ``update_from_output()`` per step (best of ``--repeat``; by default the
thread's CPU time, which other load on a shared machine moves far less than wall time), and per
request the prefix-cache hit each manager gave (kvproof never fewer tokens, or the run says which).
kvproof's manager runs with its cheap contracts on, as it serves.

    python benchmarks/vllm_manager_steps.py                          # 500 requests, DCP 1 2 4 8
    python benchmarks/vllm_manager_steps.py --requests 200 --dcp 1 --repeat 1
    python benchmarks/vllm_manager_steps.py --trace ../shared/traces/mooncake/conversation_trace.jsonl --requests 300 --dcp 1 8
"""

from __future__ import annotations

import gc
import logging
import os
import sys

os.environ.setdefault("VLLM_PLUGINS", "")
os.environ.pop("ICONTRACT_SLOW", None)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from workloads import harness_benchmark_args, workload_from_args  # noqa: E402

from kvproof.integrations.vllm.engine_harness import EngineHarness  # noqa: E402  (sets VLLM_TARGET_DEVICE)
from kvproof.integrations.vllm.kvproof_manager import KvproofKVCacheManager  # noqa: E402
from kvproof.spec.layout import LayoutConfig, resolve_layout  # noqa: E402

MANAGERS = {"vllm": None, "kvproof": KvproofKVCacheManager}


def run_once(trace, layout, args, manager_class):
    harness = EngineHarness(layout, args.num_blocks, max_num_batched_tokens=args.budget, manager_class=manager_class)
    gc.collect()
    return harness.run(trace)


def main(argv=None) -> int:
    args = harness_benchmark_args(__doc__, argv, clock=True)
    logging.getLogger("vllm").setLevel(logging.CRITICAL)
    groups, trace = workload_from_args(args)
    print(f"# vLLM 0.33.0 Scheduler, {len(trace)} requests, groups {', '.join(g.label for g in groups)}, "
          f"budget {args.budget}, {args.num_blocks} blocks; time = schedule() + update_from_output() "
          f"({args.clock} time), best of {args.repeat}")
    print(f"{'dcp':>3}  {'steps vllm/kvproof':>18}  {'vllm ms/step':>12}  {'kvproof':>8}  "
          f"{'cached vllm':>11}  {'kvproof':>9}  {'fewer':>5}")
    for dcp in args.dcp:
        layout = resolve_layout(LayoutConfig(groups, dcp=dcp, max_model_len=1 << 20))
        best, results = {m: float("inf") for m in MANAGERS}, {}
        for _ in range(args.repeat):
            for name, manager_class in MANAGERS.items():
                results[name] = run_once(trace, layout, args, manager_class)
                r = results[name]
                best[name] = min(best[name], r.scheduler_cpu_seconds if args.clock == "cpu" else r.scheduler_seconds)
        ours, theirs = results["kvproof"].num_cached_tokens, results["vllm"].num_cached_tokens
        fewer = [r for r, n in theirs.items() if ours[r] < n]
        steps = {m: results[m].num_steps for m in MANAGERS}
        vllm_ms = 1000 * best["vllm"] / steps["vllm"]
        kvproof_ms = 1000 * best["kvproof"] / steps["kvproof"]
        print(f"{dcp:>3}  {steps['vllm']:>8}/{steps['kvproof']:<9}  {vllm_ms:>12.3f}  {kvproof_ms / vllm_ms:>7.2f}x  "
              f"{sum(theirs.values()):>11}  {sum(ours.values()):>9}  {len(fewer):>5}", flush=True)
        for r in fewer[:5]:
            print(f"     fewer: {r} kvproof {ours[r]}, vLLM {theirs[r]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
