"""Cached tokens, kvproof against vLLM 0.33.0's real scheduler, request by request.

    python benchmarks/hit_parity.py                          # both workloads, DCP 1 2 4 8, retention none and 0
    python benchmarks/hit_parity.py --mooncake-requests 200 --dcp 1 8

Two workloads, each replayed by kvproof (scheduler, manager, content oracle on) and by vLLM
0.33.0's own ``Scheduler`` (``kvproof.integrations.vllm.engine_harness``), with the same layout,
retention, budget and pool (large enough that nothing is evicted):

* ``generated``: the planner's multi-turn chat generator (shared system prompts, continuations
  that extend an earlier prompt and its answer);
* ``mooncake``: the first requests of the Mooncake conversation trace (real Kimi chat traffic,
  ``../shared/traces/mooncake/``). Its later prompts never contain an earlier answer (they are
  hash ids of prompt text only), so outputs are cut to one token: no decode step could change a
  hit, and the replay takes a few steps per request instead of hundreds.

Sequential arrivals (each request after the previous one finished): kvproof must cache at least
as many tokens as vLLM for every request, except in the two named classes where an earlier
request reused more in kvproof ("unexplained" must be 0; docs/spec.md, "Hit parity with vLLM"). The generated workload is also run with its own overlapping arrivals, where the two may
differ either way (docs/coordinator.md names the classes). The layout is the kimi-k3 preset's
groups (MLA 256 + linear-attention state 256) at each DCP size.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import pathlib
import sys
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the table goes to stdout

from kvproof.cli.presets import PRESETS  # noqa: E402
from kvproof.integrations.vllm.parity import SEQUENTIAL, TRACE, ParityOptions, compare  # noqa: E402
from kvproof.sim.mooncake import iter_mooncake, to_trace_request  # noqa: E402
from kvproof.sim.workload import GeneratorSpec, generate  # noqa: E402
from kvproof.spec.layout import LayoutConfig, resolve_layout  # noqa: E402

MOONCAKE = pathlib.Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"
#: A smaller chat than the planner's default, so vLLM's scheduler replays it in minutes.
GENERATED = GeneratorSpec(requests=200, system_prompts=4, system_prompt_len=(200, 1500), suffix_len=(20, 400),
                          continuation=0.5, output_len=(4, 48), rate=4.0, seed=0)


def generated_trace(requests: int):
    return list(generate(dataclasses.replace(GENERATED, requests=requests), max_tokens=1 << 20).requests())


def mooncake_trace(path: pathlib.Path, limit: int):
    """The first ``limit`` requests, one output token each (see the module docstring)."""
    out = []
    for req in itertools.islice(iter_mooncake(str(path)), limit):
        t = to_trace_request(dataclasses.replace(req, output_length=1), arrival=0)
        out.append(t)
    return out


def layout_for(dcp: int, retention, shared_prefix_checkpoint: bool = False):
    groups = PRESETS["kimi-k3"].groups
    return resolve_layout(LayoutConfig(groups, dcp=dcp, max_model_len=1 << 20, retention_interval=retention,
                                       shared_prefix_checkpoint=shared_prefix_checkpoint))


def unexplained(parity) -> list[str]:
    """Requests behind vLLM outside the named classes (``Parity.explain_behind``): parity bugs."""
    return [rid for rid, why in parity.explain_behind().items() if why is None]


def row(name, arrivals, dcp, retention, parity, seconds):
    k, v = parity.kvproof.total, parity.vllm.total
    behind, ahead = parity.behind(), parity.ahead()
    bugs = unexplained(parity) if arrivals == SEQUENTIAL else []
    ret = "none" if retention is None else str(retention)
    print(f"| {name} | {arrivals} | {dcp} | {ret} | {parity.prompt_tokens:,} | {v:,} | {k:,} | "
          f"{v / parity.prompt_tokens:.1%} | {k / parity.prompt_tokens:.1%} | {len(behind)} | "
          f"{len(bugs) if arrivals == SEQUENTIAL else '-'} | {len(ahead)} | "
          f"{len(parity.kvproof.violations)} | {seconds:.0f} |", flush=True)
    if bugs:
        print(f"#   BEHIND, unexplained (a parity bug): {bugs[:5]}", file=sys.stderr)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dcp", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--budget", type=int, default=2048, help="tokens per step (default 2048)")
    p.add_argument("--mooncake", type=pathlib.Path, default=MOONCAKE, help="the Mooncake trace (skipped if absent)")
    p.add_argument("--mooncake-requests", type=int, default=1000)
    p.add_argument("--generated-requests", type=int, default=GENERATED.requests)
    p.add_argument("--no-generated", action="store_true")
    p.add_argument("--eagle", action="store_true", help="both engines with EAGLE's block drop")
    p.add_argument("--shared-prefix-checkpoint", action="store_true", help="stop chunks exactly at junctions")
    args = p.parse_args(argv)
    workloads = []
    if not args.no_generated:
        workloads.append(("generated", generated_trace(args.generated_requests), (SEQUENTIAL, TRACE)))
    if args.mooncake.exists():
        workloads.append(("mooncake", mooncake_trace(args.mooncake, args.mooncake_requests), (SEQUENTIAL,)))
    else:
        print(f"# {args.mooncake} not found: Mooncake rows skipped", file=sys.stderr)
    print("| workload | arrivals | DCP | retention | prompt tokens | vLLM cached | kvproof cached | vLLM | kvproof | "
          "requests behind | unexplained | requests ahead | violations | seconds |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    bugs_total = 0
    for (name, trace, modes), dcp, retention in itertools.product(workloads, args.dcp, (None, 0)):
        for arrivals in modes:
            options = ParityOptions(num_blocks=200_000, max_num_batched_tokens=args.budget, arrivals=arrivals,
                                    use_eagle=args.eagle)
            start = time.perf_counter()
            parity = compare(trace, layout_for(dcp, retention, args.shared_prefix_checkpoint), options)
            row(name, arrivals, dcp, retention, parity, time.perf_counter() - start)
            if arrivals == SEQUENTIAL:
                bugs_total += len(unexplained(parity))
    return 1 if bugs_total else 0


if __name__ == "__main__":
    sys.exit(main())
