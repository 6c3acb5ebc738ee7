"""Request workloads shared by the scheduler-side benchmarks (no hard-coded sizes: every
number is a parameter with a default)."""

from __future__ import annotations

import random

from kvproof.sim.trace import TraceRequest


def shared_prefix_workload(
    num_requests: int = 2000,
    num_prefixes: int = 20,
    prefix_len: int = 1024,
    suffix_len: tuple[int, int] = (32, 256),
    output_len: tuple[int, int] = (8, 64),
    arrivals_per_step: int = 8,
    vocab: int = 32000,
    seed: int = 0,
) -> list[TraceRequest]:
    """``num_requests`` requests, each a random shared prefix (system prompt) plus a unique
    suffix, arriving ``arrivals_per_step`` per scheduler step."""
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(vocab) for _ in range(prefix_len)) for _ in range(num_prefixes)]
    out = []
    for i in range(num_requests):
        suffix = tuple(rng.randrange(vocab) for _ in range(rng.randint(*suffix_len)))
        outputs = tuple(rng.randrange(vocab) for _ in range(rng.randint(*output_len)))
        out.append(TraceRequest(f"r{i}", rng.choice(prefixes) + suffix, outputs, arrival=i // arrivals_per_step))
    return out


def add_workload_arguments(parser) -> None:
    """The workload and layout flags every scheduler-side benchmark takes."""
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--prefixes", type=int, default=20)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--suffix-len", type=int, nargs=2, default=(32, 256))
    parser.add_argument("--output-len", type=int, nargs=2, default=(8, 64))
    parser.add_argument("--arrivals-per-step", type=int, default=8)
    parser.add_argument("--group", action="append", help="as for kvproof geometry (default full_attention:64, mamba:64)")
    parser.add_argument("--dcp", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--num-blocks", type=int, default=20000)
    parser.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", metavar="FILE",
                        help="a Mooncake-format trace instead (its first --requests requests at their arrival times; "
                             "groups default to the kimi-k3 preset's), e.g. ../shared/traces/mooncake/conversation_trace.jsonl")
    parser.add_argument("--ms-per-step", type=int, default=50, help="with --trace: trace milliseconds per scheduler step")


def harness_benchmark_args(doc: str, argv=None, requests: int = 500, clock: bool = False):
    """The flags of the benchmarks that replay a workload through vLLM's Scheduler (the engine
    harness): the workload's, ``--requests`` defaulting to ``requests``, ``--repeat`` and, with
    ``clock``, ``--clock``."""
    import argparse

    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    add_workload_arguments(p)
    p.set_defaults(requests=requests)
    p.add_argument("--repeat", type=int, default=3, help="runs per configuration; the best is reported")
    if clock:
        p.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                       help="the scheduler thread's CPU time (default) or wall time")
    return p.parse_args(argv)


def workload_from_args(args):
    """``(groups, trace)`` for the flags of :func:`add_workload_arguments`."""
    from kvproof.cli.layout_args import parse_group

    if args.trace:
        from kvproof.cli.presets import PRESETS
        from kvproof.sim.mooncake import iter_mooncake, to_trace_request

        groups = tuple(parse_group(g) for g in args.group) if args.group else PRESETS["kimi-k3"].groups
        trace = [to_trace_request(r, arrival=r.timestamp_ms // args.ms_per_step)
                 for r in iter_mooncake(args.trace, limit=args.requests)]
        return groups, trace
    groups = tuple(parse_group(g) for g in (args.group or ["full_attention:64", "mamba:64"]))
    trace = shared_prefix_workload(
        args.requests, args.prefixes, args.prefix_len, tuple(args.suffix_len), tuple(args.output_len),
        args.arrivals_per_step, seed=args.seed,
    )
    return groups, trace
