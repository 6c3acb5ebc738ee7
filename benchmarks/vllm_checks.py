"""What kvproof's checks cost inside vLLM: vLLM 0.33.0's real Scheduler (the engine harness,
integrations/vllm/engine_harness.py) replaying one workload with checks off, cheap and slow,
interleaved in the same run. The time measured is ``schedule()`` + ``update_from_output()``
only (the harness's stand-in runner and hooks are outside it); each mode runs ``--repeat``
times after a full garbage collection and its best run is reported, with ratios against "off".

    python benchmarks/vllm_checks.py                       # 500 requests, DCP 1 2 4 8
    python benchmarks/vllm_checks.py --requests 200 --dcp 2

Violations found on the way (vLLM 0.33.0's copy-on-write hazard can occur on overlapping
requests) are logged and counted, not raised, so every mode replays the whole workload.
"""

from __future__ import annotations

import gc
import logging
import os
import sys

os.environ.setdefault("VLLM_PLUGINS", "")  # the harness installs the checks itself, per mode
os.environ.pop("ICONTRACT_SLOW", None)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from workloads import harness_benchmark_args, workload_from_args  # noqa: E402

from kvproof.integrations.vllm.engine_harness import EngineHarness  # noqa: E402  (sets VLLM_TARGET_DEVICE)
from kvproof.integrations.vllm.checked_scheduler import install_checks  # noqa: E402
from kvproof.spec.layout import LayoutConfig, resolve_layout  # noqa: E402

MODES = ("off", "cheap", "slow")


def run_once(trace, layout, args, mode: str) -> tuple[float, int, int]:
    """(seconds in schedule + update_from_output, steps, violations) of one replay."""
    harness = EngineHarness(layout, args.num_blocks, max_num_batched_tokens=args.budget)
    checker = None if mode == "off" else install_checks(harness.scheduler, mode=mode, action="log")
    gc.collect()
    result = harness.run(trace)
    violations = sum(checker.sink.counts.values()) if checker is not None else 0
    return result.scheduler_seconds, result.num_steps, violations


def main(argv=None) -> int:
    args = harness_benchmark_args(__doc__, argv)
    logging.getLogger("vllm").setLevel(logging.CRITICAL)  # violation logs would swamp the table
    groups, trace = workload_from_args(args)
    print(f"# vLLM 0.33.0 Scheduler, {len(trace)} requests, groups {', '.join(g.label for g in groups)}, "
          f"budget {args.budget}, {args.num_blocks} blocks; time = schedule() + update_from_output(), best of {args.repeat}")
    print(f"{'dcp':>3}  {'steps':>6}  {'off ms/step':>11}  {'cheap':>6}  {'slow':>6}  {'violations':>10}")
    for dcp in args.dcp:
        layout = resolve_layout(LayoutConfig(groups, dcp=dcp, max_model_len=1 << 20))
        best = {m: float("inf") for m in MODES}
        steps = violations = 0
        for _ in range(args.repeat):
            for mode in MODES:
                seconds, steps, found = run_once(trace, layout, args, mode)
                best[mode] = min(best[mode], seconds)
                violations = max(violations, found)
        off = best["off"]
        print(f"{dcp:>3}  {steps:>6}  {1000 * off / steps:>11.3f}  {best['cheap'] / off:>5.2f}x  "
              f"{best['slow'] / off:>5.2f}x  {violations:>10}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
