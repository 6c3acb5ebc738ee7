"""The checkpoint policies served in vLLM 0.33.0's real Scheduler, request by request, against
stock vLLM (its Scheduler and manager).

    python benchmarks/checkpoints_vllm.py --requests 100 --dcp 1 8

The first requests of the Mooncake conversation trace (outputs cut to one token, as in
benchmarks/hit_parity.py), one after another, through vLLM's Scheduler three times: stock vLLM,
and kvproof's manager (``KVPROOF_MANAGER=kvproof``, content oracle on) under
``checkpoints=vllm`` and ``checkpoints=reuse``, in the Scheduler kvproof installs (its split ends
at the policy's stops). The kimi-k3 preset's groups (MLA 256 + linear-attention state 256),
retention 0, a pool that never evicts. No request may cache fewer tokens than with stock vLLM
except after an earlier request that cached more (the *earlier longer hit* class,
docs/coordinator.md): "outside" must be 0 (the exit status says so).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the table goes to stdout

from hit_parity import MOONCAKE, layout_for, mooncake_trace  # noqa: E402

from kvproof.integrations.vllm import serving_options  # noqa: E402
from kvproof.integrations.vllm.parity import ParityOptions, behind_without_earlier_longer_hit, run_served, run_vllm  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dcp", type=int, nargs="+", default=[1, 8])
    p.add_argument("--budget", type=int, default=2048, help="tokens per step (default 2048)")
    p.add_argument("--mooncake", type=pathlib.Path, default=MOONCAKE)
    p.add_argument("--requests", type=int, default=100)
    args = p.parse_args(argv)
    trace = mooncake_trace(args.mooncake, args.requests)
    prompt = sum(len(t.prompt) for t in trace)
    options = ParityOptions(num_blocks=200_000, max_num_batched_tokens=args.budget)
    print(f"# {len(trace)} requests, {prompt:,} prompt tokens, sequential, budget {args.budget}")
    print("| DCP | stock vLLM cached | kvproof, checkpoints=vllm | kvproof, checkpoints=reuse | reuse x stock | "
          "behind stock (reuse) | outside the class | ahead of stock (reuse) | violations | seconds |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    outside_total = 0
    for dcp in args.dcp:
        started = time.perf_counter()
        layout = layout_for(dcp, 0)
        stock = run_vllm(trace, layout, options).cached
        runs = {c: run_served(trace, layout, options, serving_options.parse(f"checkpoints={c}"))[0] for c in ("vllm", "reuse")}
        reuse = runs["reuse"].cached
        behind = [t.id for t in trace if reuse[t.id] < stock[t.id]]
        ahead = [t.id for t in trace if reuse[t.id] > stock[t.id]]
        outside = behind_without_earlier_longer_hit(trace, reuse, stock)
        outside_total += len(outside)
        total = sum(stock.values())
        print(f"| {dcp} | {total:,} ({total / prompt:.1%}) | {runs['vllm'].total:,} ({runs['vllm'].total / prompt:.1%}) | "
              f"{runs['reuse'].total:,} ({runs['reuse'].total / prompt:.1%}) | "
              f"{runs['reuse'].total / total:.2f} | {len(behind)} | {len(outside)} | {len(ahead)} | "
              f"{sum(len(r.violations) for r in runs.values())} | {time.perf_counter() - started:.0f} |"
              if total else f"| {dcp} | 0 | {runs['vllm'].total:,} | {runs['reuse'].total:,} | - | {len(behind)} | "
              f"{len(outside)} | {len(ahead)} | {sum(len(r.violations) for r in runs.values())} | "
              f"{time.perf_counter() - started:.0f} |", flush=True)
        if outside:
            print(f"#   behind stock vLLM outside the class: {outside[:5]}", file=sys.stderr)
    return 1 if outside_total else 0


if __name__ == "__main__":
    sys.exit(main())
