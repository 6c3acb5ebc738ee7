"""Replay speed of ``kvproof plan``: requests/s and prompt tokens/s of kvproof's engine (cheap
contract tier, no oracle) against vLLM 0.33.0's own scheduler (the engine harness) on the same
configurations, in the same run.

    python benchmarks/plan.py [--trace FILE] [--limit N] [--dcp 1,8] [--no-vllm]

Each configuration is the plan's default layout (kimi-k3, 40 GiB per GPU, budget 8,192) on the
first N requests of the trace (default: the built-in Mooncake slice), kvproof with the cheap
contract tier as ``kvproof plan`` runs it (``--oracle`` adds the content oracle). Times are process CPU
seconds, so other load on the machine moves them less than wall time.
"""

from __future__ import annotations

import argparse
import time

from kvproof.cli.presets import PRESETS
from kvproof.planner.memory import GIB, ModelMemory, plan_pool
from kvproof.planner.run import RunOptions, run_config
from kvproof.sim.workload import read_workload
from kvproof.spec.layout import LayoutConfig, resolve_layout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", help="a trace (default: the built-in Mooncake slice)")
    p.add_argument("--limit", type=int, default=200)
    p.add_argument("--dcp", default="1,8")
    p.add_argument("--no-vllm", action="store_true", help="kvproof only")
    p.add_argument("--oracle", action="store_true", help="kvproof with the content oracle")
    args = p.parse_args()
    if args.trace is None:
        from importlib import resources

        args.trace = str(resources.files("kvproof.planner") / "data" / "mooncake_conversation_head1000.jsonl")
    preset = PRESETS["kimi-k3"]
    base = LayoutConfig(preset.groups, dcp=1, max_model_len=preset.max_model_len)
    memory = ModelMemory(preset.memory.layers, preset.memory.bytes_per_token, preset.memory.bytes_per_state)
    pool = plan_pool(resolve_layout(base), memory, 40 * GIB)
    workload = read_workload(args.trace, 50.0, args.limit)
    engines = [("kvproof", run_config)]
    if not args.no_vllm:
        from kvproof.planner.vllm_engine import require_vllm, run_config_vllm

        require_vllm()
        engines.append(("vLLM 0.33.0", run_config_vllm))
    tokens = workload.prompt_tokens
    print(f"# {len(workload)} requests, {tokens:,} prompt tokens; kimi-k3, {pool.num_blocks:,} blocks; CPU seconds")
    print("| DCP | engine | hit rate | requests/s | prompt tokens/s | x vLLM |")
    print("|---|---|---|---|---|---|")
    for dcp in (int(d) for d in args.dcp.split(",")):
        rates = {}
        for name, run in engines:
            start = time.process_time()
            report = run(workload, base, dcp, pool, 40 * GIB, RunOptions(oracle=args.oracle))
            cpu = time.process_time() - start
            rates[name] = (report.hit_rate, len(workload) / cpu, tokens / cpu)
        base_rate = rates.get("vLLM 0.33.0", (0, 0, 0))[1]
        for name, (hit, rps, tps) in rates.items():
            ratio = f"{rps / base_rate:.2f}" if base_rate else "-"
            print(f"| {dcp} | {name} | {100 * hit:.1f} % | {rps:,.0f} | {tps:,.0f} | {ratio} |")


if __name__ == "__main__":
    main()
