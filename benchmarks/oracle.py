"""The content oracle's cost on real traffic: the first requests of the Mooncake conversation
trace (../shared/traces/mooncake/) replayed through the scheduler and the KV-cache manager, with
the oracle off (the baseline) and on, in the same run.

Requests arrive at scheduler step ``timestamp_ms // --ms-per-step``; outputs are decoded one
token per step. Cheap contract tier only (the slow switch off), as in staging. Both variants run
``--repeat`` times, interleaved, each after a full garbage collection; the best run of each is
reported, with the ratio. CPU seconds of this process are the measure (on a machine shared with
other jobs, wall time mostly measures their load); wall seconds are printed beside them.

    python benchmarks/oracle.py                          # 200 requests, kimi-k3
    python benchmarks/oracle.py --requests 50 --repeat 1
"""

from __future__ import annotations

import argparse
import gc
import os
import pathlib
import sys
import time

os.environ.pop("ICONTRACT_SLOW", None)  # staging configuration: cheap tier only

from kvproof.cli.presets import PRESETS  # noqa: E402
from kvproof.sim.mooncake import iter_mooncake, to_trace_request  # noqa: E402
from kvproof.sim.replay import replay  # noqa: E402
from kvproof.spec.layout import LayoutConfig, resolve_layout  # noqa: E402

TRACE = pathlib.Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"


def mooncake_workload(path: str, requests: int, ms_per_step: int):
    return [to_trace_request(r, arrival=r.timestamp_ms // ms_per_step) for r in iter_mooncake(path, limit=requests)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=str(TRACE), help="a Mooncake-format trace (default: the shared conversation trace)")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--preset", default="kimi-k3", choices=sorted(PRESETS))
    parser.add_argument("--ms-per-step", type=int, default=50, help="trace milliseconds per scheduler step (default 50)")
    parser.add_argument("--num-blocks", type=int, default=16384)
    parser.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens (default 8192)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)

    preset = PRESETS[args.preset]
    layout = resolve_layout(LayoutConfig(preset.groups, dcp=preset.dcp, max_model_len=preset.max_model_len))
    trace = mooncake_workload(args.trace, args.requests, args.ms_per_step)
    prompt_tokens = sum(len(t.prompt) for t in trace)
    output_tokens = sum(len(t.output) for t in trace)
    best = {False: float("inf"), True: float("inf")}
    wall = {False: float("inf"), True: float("inf")}
    for _ in range(args.repeat):
        for oracle in (False, True):
            gc.collect()
            start, start_wall = time.process_time(), time.perf_counter()
            result = replay(trace, layout, args.num_blocks, args.budget, oracle=oracle)
            best[oracle] = min(best[oracle], time.process_time() - start)
            wall[oracle] = min(wall[oracle], time.perf_counter() - start_wall)
            if result.violations:
                print(f"violations with oracle={oracle}: {result.violations[:3]}", file=sys.stderr)
                return 1
    print(f"{len(trace)} requests, {prompt_tokens:,} prompt tokens, {output_tokens:,} output tokens, "
          f"preset {args.preset}, {result.steps:,} steps, hit rate {result.hit_rate:.1%}")
    print(f"{'oracle':<8} {'cpu s':>8} {'x off':>7} {'wall s':>8} {'x off':>7}")
    for oracle in (False, True):
        print(f"{'on' if oracle else 'off':<8} {best[oracle]:>8.2f} {best[oracle] / best[False]:>7.2f} "
              f"{wall[oracle]:>8.2f} {wall[oracle] / wall[False]:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
