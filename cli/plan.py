"""``kvproof plan``: what hit rate, memory and block tables a hybrid model gets at each DCP size
on a workload (docs/plan.md). A thin command over :mod:`kvproof.planner`."""

from __future__ import annotations

import argparse
import json
import os
import sys

from kvproof.cli.errors import EXIT_OK, EXIT_PROPERTY_FAILED, fail_bad_input
from kvproof.cli.layout_args import add_layout_arguments, layout_config_from_args
from kvproof.cli.presets import PRESETS, Preset
from kvproof.planner.model_config import DEFAULT_BLOCK_SIZE, SHIPPED_MODELS
from kvproof.planner.recommend import OBJECTIVES
from kvproof.cli.values import (
    any_decimal,
    block_count,
    decimal,
    decimal_number,
    parse_decimal,
    parse_decimal_number,
    token_count,
)
from kvproof.spec.checkpoints import CHECKPOINT_POLICIES
from kvproof.spec.eviction import LRU, POLICIES

HELP = "plan hit rate, memory and block tables per DCP size on a workload (default: real Kimi chat traffic)"
PROG = "kvproof plan"
DEFAULT_PRESET = "kimi-k3"
DEFAULT_DCPS = (1, 2, 4, 8)
DEFAULT_KV_MEMORY_GIB = 40.0
#: The automatic memory sweep: the KV memory per GPU times these factors.
SWEEP_FACTORS = (1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2)
#: argparse types of plan's own counts (the others are cli/values.py's).
sequence_count = decimal(1 << 30, "each running request takes at least one token of a step's budget")
job_count = decimal(1024, "worker processes replaying at once")
tp_size = decimal(1024, "GPUs one layer is split over")
gpu_count = decimal(1 << 20, "GPUs of a deployment")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plan", help=HELP, description=HELP, conflict_handler="resolve")
    w = p.add_argument_group("workload (default: the first 1,000 requests of the Mooncake conversation trace)")
    w.add_argument("--trace", metavar="FILE", help="a trace in kvproof's JSON Lines or the Mooncake format (detected; "
                   "KVPROOF_RECORD=FILE vllm serve ... records your own traffic so)")
    w.add_argument("--limit", type=any_decimal, metavar="N", help="only the first N requests of the trace")
    w.add_argument("--step-ms", type=decimal_number, default=50.0, metavar="MS",
                   help="wall time of one scheduler step, mapping timestamps to steps (default 50)")
    w.add_argument("--generate", action="store_true", help="a generated multi-turn chat workload instead of a trace")
    w.add_argument("--requests", type=any_decimal, default=1000, help="generator: requests (default 1000)")
    w.add_argument("--system-prompts", type=any_decimal, default=8, help="generator: shared system prompts (default 8)")
    w.add_argument("--system-prompt-len", default="500-4000", metavar="LO-HI", help="generator: their lengths (default 500-4000)")
    w.add_argument("--suffix-len", default="20-1000", metavar="LO-HI", help="generator: unique user message lengths (default 20-1000)")
    w.add_argument("--continuation", type=decimal_number, default=0.5, metavar="P",
                   help="generator: probability that a request continues an earlier conversation (default 0.5)")
    w.add_argument("--output-len", default="20-600", metavar="LO-HI", help="generator: output lengths (default 20-600)")
    w.add_argument("--rate", type=decimal_number, default=4.0, help="generator: arrivals per second (default 4)")
    w.add_argument("--seed", type=any_decimal, default=0, help="generator: random seed (default 0)")
    add_layout_arguments(p, default_preset=DEFAULT_PRESET)
    p.add_argument("--dcp", default=",".join(map(str, DEFAULT_DCPS)), metavar="N[,N...]",
                   help="DCP sizes to compare (default 1,2,4,8)")
    p.add_argument("--block-size", metavar="N[,N...]",
                   help="attention block sizes to compare (tokens), each as vllm serve's --block-size: with --model "
                   "vLLM 0.33.0's raise for hybrid models applied; default the layout's own")
    p.add_argument("--eviction", default=LRU, metavar="POLICY[,POLICY...]",
                   help="eviction policies to compare side by side: lru (default, vLLM's), compute "
                   "(the least prefill compute lost per byte, aged by recency)")
    p.add_argument("--checkpoints", default=CHECKPOINT_POLICIES[0], metavar="POLICY[,POLICY...]",
                   help="checkpoint policies to compare (kvproof's engine, and with --engine vllm kvproof's manager in vLLM's Scheduler): vllm (default, vLLM 0.33.0's Mamba state "
                   "positions), reuse (also a ladder of states below each prompt's end, where a conversation's "
                   "next turn resumes); the first is the plan's, the others get their own table")
    md = p.add_argument_group("model (instead of --preset / --group and the byte figures)")
    md.add_argument("--model", metavar="DIR",
                    help="a Hugging Face model folder with its config.json, as vllm serve takes (or a shipped one: "
                    f"{', '.join(SHIPPED_MODELS)}): groups, block sizes and bytes per GPU as vLLM 0.33.0 would use")
    md.add_argument("--tensor-parallel-size", type=tp_size, metavar="N",
                    help="GPUs each layer is split over, as vllm serve's flag (default 1; needs --model)")
    m = p.add_argument_group("memory (default: 40 GiB per GPU, bytes from the preset or the model)")
    m.add_argument("--kv-memory-gib", type=decimal_number, metavar="GIB", help=f"KV memory per GPU (default {DEFAULT_KV_MEMORY_GIB:g})")
    m.add_argument("--num-blocks", type=block_count, help="the pool in blocks (null block included) instead of KV memory")
    m.add_argument("--bytes-per-token", type=any_decimal, help="one token of one attention layer on one GPU")
    m.add_argument("--bytes-per-state", type=any_decimal, help="one Mamba / linear-attention state of one layer on one GPU")
    m.add_argument("--layers", metavar="N[,N...]", help="layers per cache group, in --group order")
    m.add_argument("--memory-sweep", nargs="?", const="auto", metavar="GIB[,GIB...]",
                   help="also plan these KV memory sizes per GPU (default: 1/32 .. 1/2 of --kv-memory-gib)")
    rc = p.add_argument_group("recommendation")
    rc.add_argument("--objective", default="hit-rate", metavar="|".join(OBJECTIVES),
                    help="what to recommend for: the best hit rate (default), the most cached tokens per GiB of KV "
                    "memory over the deployment's GPUs, or the least memory reaching a hit rate X (e.g. target-hit=20)")
    rc.add_argument("--gpus", type=gpu_count, metavar="N",
                    help="GPUs the deployment may use (vLLM's DCP reuses the TP ranks: a model on TP GPUs takes TP "
                    "at every DCP size dividing TP)")
    r = p.add_argument_group("run")
    r.add_argument("--max-num-batched-tokens", type=token_count, default=8192, help="token budget per step (default 8192, as vLLM's server)")
    r.add_argument("--max-num-seqs", type=sequence_count, default=256, help="requests running at once (default 256)")
    r.add_argument("--eagle", action="store_true", help="EAGLE/MTP: hits drop one hash unit for the draft")
    r.add_argument("--no-partial-hash-hits", action="store_true", help="hits only on whole scheduler blocks")
    r.add_argument("--oracle", action="store_true",
                   help="also run the content oracle on every step (about 3x the CPU time and 5x the memory)")
    r.add_argument("--engine", choices=("kvproof", "vllm"), default="kvproof",
                   help="kvproof's contract-checked scheduler and manager (default); 'vllm' also runs what vllm serve "
                   "runs, on the CPU, side by side: vLLM 0.33.0's Scheduler with its own manager (stock vLLM) and "
                   "with kvproof's (KVPROOF_MANAGER=kvproof)")
    r.add_argument("--jobs", type=job_count, help="configurations replayed at once (default: one per core)")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object")
    o.add_argument("--plot", metavar="FILE.png", help="hit rate and memory against DCP size (needs matplotlib)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(run=run)


def _int_list(text: str, what: str, low: int, high: int, unique: bool = True) -> tuple[int, ...]:
    out = []
    for part in text.split(","):
        try:
            value = parse_decimal(part, what)
        except ValueError as e:
            raise ValueError(f"{e} (in {text!r})") from None
        if not low <= value <= high:
            raise ValueError(f"{what} {part!r} in {text!r} must be an integer in [{low}, {high}]")
        out.append(value)
    return tuple(dict.fromkeys(out)) if unique else tuple(out)


def _policy_list(text: str) -> tuple[str, ...]:
    """``lru,compute`` -> ('lru', 'compute'); ValueError naming a value that is no policy."""
    out = []
    for part in text.split(","):
        if part.strip() not in POLICIES:
            raise ValueError(f"eviction policy {part.strip()!r} in --eviction {text!r} must be one of {', '.join(POLICIES)}")
        out.append(part.strip())
    return tuple(dict.fromkeys(out))


def _checkpoint_list(text: str) -> tuple[str, ...]:
    """``vllm,reuse`` -> ('vllm', 'reuse'); ValueError naming a value that is no policy."""
    out = []
    for part in text.split(","):
        if part.strip() not in CHECKPOINT_POLICIES:
            raise ValueError(f"checkpoint policy {part.strip()!r} in --checkpoints {text!r} must be one of "
                             f"{', '.join(CHECKPOINT_POLICIES)}")
        out.append(part.strip())
    return tuple(dict.fromkeys(out))


def _range(text: str, what: str) -> tuple[int, int]:
    parts = text.split("-")
    if len(parts) == 1:
        parts = parts * 2
    try:
        if len(parts) != 2:
            raise ValueError
        return parse_decimal(parts[0], what), parse_decimal(parts[1], what)
    except ValueError:
        raise ValueError(f"{what} {text!r} must be LO-HI (or one length) in decimal digits, e.g. 100-2000") from None


def _gib_list(text: str, base: float) -> tuple[float, ...]:
    if text == "auto":
        return tuple(base * f for f in SWEEP_FACTORS)
    out = []
    for part in text.split(","):
        try:
            value = parse_decimal_number(part, "memory size")
        except ValueError:
            value = 0.0
        if value <= 0:
            raise ValueError(f"memory size {part!r} in --memory-sweep must be a positive decimal number of GiB")
        out.append(value)
    return tuple(dict.fromkeys(out))


def _workload(args: argparse.Namespace, max_len: int):
    from importlib import resources

    from kvproof.sim.workload import GeneratorSpec, generate, read_workload

    if args.generate:
        if args.trace is not None:
            raise ValueError("--generate and --trace exclude each other; give one workload")
        spec = GeneratorSpec(
            requests=args.requests, system_prompts=args.system_prompts,
            system_prompt_len=_range(args.system_prompt_len, "system prompt length"),
            suffix_len=_range(args.suffix_len, "suffix length"), continuation=args.continuation,
            output_len=_range(args.output_len, "output length"), rate=args.rate, seed=args.seed,
        )
        return generate(spec, args.step_ms, max_len)
    if args.trace is not None:
        return read_workload(args.trace, args.step_ms, args.limit)
    data = resources.files("kvproof.planner") / "data" / "mooncake_conversation_head1000.jsonl"
    with resources.as_file(data) as path:
        workload = read_workload(str(path), args.step_ms, args.limit)
    workload.description = (
        f"built-in: first {len(workload):,} requests of the Mooncake conversation trace (Kimi chat), "
        f"{args.step_ms:g} ms/step"
    )
    return workload


def _memory(args: argparse.Namespace, from_preset: bool):
    """Memory figures: flags override the preset's (a preset applies only to its own groups)."""
    from kvproof.planner.memory import ModelMemory

    preset = PRESETS[args.preset].memory if from_preset and args.preset else None
    if args.bytes_per_token is None and args.bytes_per_state is None and args.layers is None:
        return None if preset is None else ModelMemory(preset.layers, preset.bytes_per_token, preset.bytes_per_state)
    if args.layers is None and preset is None:
        raise ValueError("--layers is required with --bytes-per-token / --bytes-per-state for a layout without a preset")
    return ModelMemory(
        _int_list(args.layers, "layer count", 1, 10_000, unique=False) if args.layers is not None else preset.layers,
        args.bytes_per_token if args.bytes_per_token is not None else (preset.bytes_per_token if preset else 0),
        args.bytes_per_state if args.bytes_per_state is not None else (preset.bytes_per_state if preset else 0),
    )


def _model(args: argparse.Namespace):
    """The layout read from ``--model`` (None without it); it replaces every layout and byte flag."""
    from kvproof.planner.model_config import model_layout

    if args.model is None:
        if args.tensor_parallel_size is not None:
            raise ValueError("--tensor-parallel-size sizes a model's layers; it needs --model DIR")
        return None
    given = [flag for flag, value in (
        ("--preset", args.preset), ("--group", args.group), ("--bytes-per-token", args.bytes_per_token),
        ("--bytes-per-state", args.bytes_per_state), ("--layers", args.layers),
    ) if value is not None]
    if given:
        raise ValueError(f"--model gives the layout and the bytes per GPU; drop {', '.join(given)}")
    return model_layout(args.model, args.tensor_parallel_size if args.tensor_parallel_size is not None else 1,
                        _block_sizes(args)[0] if args.block_size is not None else DEFAULT_BLOCK_SIZE)


#: The largest block ``--block-size`` takes (tokens): vLLM's blocks are far smaller.
MAX_BLOCK_SIZE = 1 << 20


def _block_sizes(args: argparse.Namespace) -> tuple[int, ...]:
    return _int_list(args.block_size, "block size", 1, MAX_BLOCK_SIZE)


def _with_block_size(base, block: int, model, args: argparse.Namespace):
    """``base`` with every group's block at ``block`` (a Mamba group's too: in align mode vLLM
    gives it the attention block), or with ``--model`` at what vLLM makes of ``block``."""
    import dataclasses

    from kvproof.planner.model_config import model_layout

    if model is None:
        sizes = [block] * len(base.groups)
    else:
        sizes = [g.block_size for g in model_layout(args.model, model.tensor_parallel_size, block).groups]
    return dataclasses.replace(base, groups=tuple(dataclasses.replace(g, block_size=b) for g, b in zip(base.groups, sizes)))


def _block_configs(args: argparse.Namespace, base, model, dcps: tuple[int, ...]):
    """Each ``--block-size`` value with its layout, every one resolved at every DCP size first
    (ValueError naming the value). Empty without the flag."""
    from kvproof.spec.layout import resolve_layout
    import dataclasses

    if args.block_size is None:
        return ()
    out = []
    for b in _block_sizes(args):
        config = _with_block_size(base, b, model, args)
        for d in dcps:
            try:
                resolve_layout(dataclasses.replace(config, dcp=d))
            except ValueError as e:
                raise ValueError(f"--block-size {b} at DCP {d}: {e}") from None
        out.append((b, config))
    return tuple(out)


def _tensor_parallel_size(args: argparse.Namespace, model) -> int | None:
    """The GPUs the byte figures are per: the model's TP, a preset's, or unknown (bytes by hand)."""
    if model is not None:
        return model.tensor_parallel_size
    hand = args.group or args.bytes_per_token is not None or args.bytes_per_state is not None or args.layers is not None
    preset = PRESETS[args.preset].memory if args.preset and not hand else None
    return None if preset is None else preset.tensor_parallel_size


def build_request(args: argparse.Namespace):
    """Every flag checked and the workload read (validated) before any replay. ValueError if bad."""
    import dataclasses

    from kvproof.planner.memory import bytes_from_gib
    from kvproof.planner.plan import PlanRequest, default_jobs
    from kvproof.planner.run import RunOptions
    from kvproof.spec.layout import resolve_layout

    from kvproof.planner.recommend import Deployment, Objective

    model = _model(args)
    if args.preset is None and not args.group and model is None:
        args.preset = DEFAULT_PRESET
    objective = Objective.parse(args.objective)
    if args.gpus is not None and args.gpus < 1:
        raise ValueError(f"--gpus {args.gpus} must be >= 1")
    deployment = Deployment(_tensor_parallel_size(args, model), args.gpus)
    dcps = _int_list(args.dcp, "DCP size", 1, 1024)
    policies = _policy_list(args.eviction)
    checkpoints = _checkpoint_list(args.checkpoints)
    layout_args = argparse.Namespace(**{**vars(args), "dcp": dcps[0], "eviction": policies[0], "checkpoints": checkpoints[0]})
    model_preset = None if model is None else Preset(args.model, model.architecture, model.groups, 1, model.max_model_len)
    base = layout_config_from_args(layout_args, allow_partial_hash_hits=not args.no_partial_hash_hits, preset=model_preset)
    resolve_layout(base)
    blocks = _block_configs(args, base, model, dcps)
    if blocks:
        base = blocks[0][1]
        if len(blocks) > 1:
            for flag, given in (("--memory-sweep", args.memory_sweep is not None), ("--engine vllm", args.engine == "vllm"),
                                ("--checkpoints with several policies", len(checkpoints) > 1)):
                if given:
                    raise ValueError(f"--block-size {args.block_size}: several block sizes are compared at the stated "
                                     f"memory with kvproof's engine; drop {flag} or give one block size")
    for name in ("max_num_batched_tokens", "max_num_seqs"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if args.jobs is not None and args.jobs < 1:
        raise ValueError(f"--jobs {args.jobs} must be >= 1")
    memory = model.memory if model is not None else _memory(args, from_preset=not args.group)
    if args.num_blocks is not None and args.kv_memory_gib is not None:
        raise ValueError("--num-blocks and --kv-memory-gib exclude each other; size the pool one way")
    if args.num_blocks is not None:
        if args.num_blocks < 2:
            raise ValueError(f"--num-blocks {args.num_blocks} must be >= 2 (block 0 is the null block)")
        kv_bytes = None
    else:
        if memory is None:
            raise ValueError(
                "this layout has no memory figures: give --bytes-per-token, --bytes-per-state and --layers "
                "(or --num-blocks)"
            )
        kv_bytes = bytes_from_gib(args.kv_memory_gib if args.kv_memory_gib is not None else DEFAULT_KV_MEMORY_GIB)
    sweep = ()
    if args.memory_sweep is not None:
        if kv_bytes is None or memory is None:
            raise ValueError("--memory-sweep sizes pools from KV memory; it needs memory figures, not --num-blocks")
        sweep = tuple(bytes_from_gib(g) for g in _gib_list(args.memory_sweep, kv_bytes / 2**30))
        sweep = tuple(s for s in sweep if s != kv_bytes)
    workload = _workload(args, base.max_model_len)
    engines = ("kvproof",)
    if args.engine == "vllm":
        from kvproof.planner.vllm_engine import require_vllm

        require_vllm()
        if args.no_partial_hash_hits:
            raise ValueError("--engine vllm: vLLM 0.33.0 always allows partial hash hits; drop --no-partial-hash-hits")
        engines = ("kvproof", "vllm", "kvproof-vllm")
    options = RunOptions(args.max_num_batched_tokens, args.max_num_seqs, args.eagle, args.oracle)
    return PlanRequest(
        workload, dataclasses.replace(base, dcp=1), dcps, memory, kv_bytes, args.num_blocks, sweep, options,
        args.jobs or default_jobs(), engines=engines, policies=policies, checkpoints=checkpoints,
        model=model, objective=objective, deployment=deployment,
        serve_model=args.model if model is not None and os.path.isdir(args.model) else None,
        sweep_auto=args.memory_sweep == "auto",
        at_step_ms=_rebuild(args, base.max_model_len), step_ms=args.step_ms,
        block_size=blocks[0][0] if blocks else None,
        other_blocks=tuple((b, dataclasses.replace(c, dcp=1)) for b, c in blocks[1:]),
    )


def _rebuild(args: argparse.Namespace, max_len: int):
    """The workload at another step time (for the step-time sensitivity note), or None for a
    trace that can be read only once (a pipe, a FIFO)."""
    import stat

    if args.trace is not None and not args.generate:
        try:
            if not stat.S_ISREG(os.stat(args.trace).st_mode):
                return None
        except OSError:
            return None
    return lambda ms: _workload(argparse.Namespace(**{**vars(args), "step_ms": ms}), max_len)


def run(args: argparse.Namespace) -> int:
    from kvproof.impl.scheduler import CapacityError
    from kvproof.planner.plan import progress_bar, run_plan
    from kvproof.planner.report import plan_to_json, plan_to_text

    close = lambda: None  # noqa: E731
    try:
        if args.plot is not None:
            from kvproof.planner.plot import check_destination, require_matplotlib

            require_matplotlib()
            check_destination(args.plot)
        req = build_request(args)
        progress, close = progress_bar(not args.no_progress and sys.stderr.isatty())
        result = run_plan(req, progress)
        close()
        if args.plot is not None:
            from kvproof.planner.plot import save_plot

            title = f"kvproof plan: {', '.join(g.label for g in req.base.groups)}; {len(req.workload):,} requests"
            try:
                save_plot(args.plot, result.reports, result.sweep, title, result.vllm_reports)
            except OSError as e:
                raise ValueError(f"cannot write plot file {args.plot!r}: {e.strerror}") from None
    except (ValueError, CapacityError) as e:
        close()
        return fail_bad_input(PROG, str(e))
    print(json.dumps(plan_to_json(result), indent=2) if args.json else plan_to_text(result))
    if result.violations:
        print(f"{PROG}: {result.violations} invariant violation(s)", file=sys.stderr)
        return EXIT_PROPERTY_FAILED
    return EXIT_OK
