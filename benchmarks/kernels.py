"""Time the block-table kernels (apply staged writes, gather, slot mapping) on a GPU.

Every size is a flag. For each batch size (requests) and group count the script builds
tables sized by the geometry spec, times each kernel with ``triton.testing.do_bench`` and
reports the bytes it must move per second against two yardsticks measured in the same run:
the device's copy bandwidth (a large ``torch`` copy) and the launch-latency floor (an empty
Triton kernel). With vLLM importable it also times vLLM's own ``BlockTables`` on the same
inputs; any mismatch of its API is reported, not fatal.

    python benchmarks/kernels.py                         # GPU: the default sweep
    python benchmarks/kernels.py --requests 1,4096 --groups 2 --json
    python benchmarks/kernels.py --cpu-smoke             # no GPU: a tiny interpreter pass

Without CUDA (and without ``--cpu-smoke``) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    def int_list(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers")
        return values

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--requests", type=int_list, default=[1, 16, 128, 1024, 4096], help="batch sizes (requests per step)")
    p.add_argument("--groups", type=int_list, default=[1, 2, 4, 8], help="cache-group counts")
    p.add_argument("--kinds", default="full_attention,mamba",
                   help="group kinds, cycled to each group count (full_attention, mla, mamba)")
    p.add_argument("--attention-block-size", type=int, default=16, help="physical block size of attention groups")
    p.add_argument("--mamba-block-size", type=int, default=16, help="block size of (replicated) Mamba groups")
    p.add_argument("--dcp", type=int, default=8, help="DCP world size")
    p.add_argument("--dcp-rank", type=int, default=0, help="the rank whose slot mapping is timed")
    p.add_argument("--interleave", type=int, default=1, help="DCP interleave size I")
    p.add_argument("--max-model-len", type=int, default=131_072, help="sizes the rows (geometry spec)")
    p.add_argument("--context-len", type=int, default=8192, help="tokens already in each request")
    p.add_argument("--query-len", type=int, default=1, help="new tokens per request per step (1 = decode)")
    p.add_argument("--append-blocks", type=int, default=1, help="blocks appended per request and group per step")
    p.add_argument("--copy-mib", type=int, default=512, help="size of the copy that measures bandwidth")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up time (ms)")
    p.add_argument("--rep", type=int, default=100, help="do_bench measuring time (ms)")
    p.add_argument("--no-vllm", action="store_true", help="do not time vLLM's kernels even if it is installed")
    p.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="without a GPU: run every kernel once at tiny sizes in Triton's interpreter")
    args = p.parse_args(argv)
    if args.context_len + args.query_len > args.max_model_len:
        p.error(f"--context-len {args.context_len} + --query-len {args.query_len} exceeds --max-model-len {args.max_model_len}")
    if not 0 <= args.dcp_rank < args.dcp:
        p.error(f"--dcp-rank {args.dcp_rank} must lie in [0, {args.dcp})")
    return args


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


def build_layout(args, num_groups: int):
    from kvproof.spec.groups import CacheGroup, GroupKind
    from kvproof.spec.layout import LayoutConfig, resolve_layout

    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    groups = []
    for i in range(num_groups):
        kind = GroupKind(kinds[i % len(kinds)])
        bs = args.mamba_block_size if kind is GroupKind.MAMBA else args.attention_block_size
        groups.append(CacheGroup(kind, bs))
    return resolve_layout(LayoutConfig(groups=tuple(groups), dcp=args.dcp, max_model_len=args.max_model_len,
                                       interleave=args.interleave))


class Inputs:
    """Tables with ``num_reqs`` requests of ``context_len`` tokens, one step's staged writes,
    the batch (every request, shuffled) and its positions -- all on ``device``."""

    def __init__(self, args, layout, num_reqs: int, device):
        import torch

        from kvproof.kernels import host
        from kvproof.kernels.apply_writes import StagedWrites
        from kvproof.kernels.packed_tables import PackedTables
        from kvproof.spec.arith import cdiv

        gen = torch.Generator().manual_seed(num_reqs * 131 + len(layout.groups))
        self.layout = layout
        self.num_reqs = num_reqs
        widths = [g.table_width for g in layout.groups]
        self.tables = PackedTables.zeros(widths, num_reqs, device)
        self.tables.storage.copy_(torch.randint(1, 1 << 24, self.tables.storage.shape, generator=gen))
        self.out = self.tables.like()
        used = [min(cdiv(args.context_len + args.query_len, g.effective_block_size), g.table_width) for g in layout.groups]
        self.num_blocks = torch.tensor([[u] * num_reqs for u in used], dtype=torch.int32, device=device)
        self.used = used
        self.idx_mapping = torch.randperm(num_reqs, generator=gen).to(torch.int32).to(device)
        q = args.query_len
        self.query_start = (torch.arange(num_reqs + 1, dtype=torch.int32) * q).to(device)
        self.positions = (args.context_len + torch.arange(q, dtype=torch.int64)).repeat(num_reqs).to(device)
        self.num_tokens = num_reqs * q
        self.block_sizes = torch.tensor([g.group.block_size for g in layout.groups], dtype=torch.int32, device=device)
        self.sharded = host.sharded_flags([g.group.is_sharded for g in layout.groups], args.dcp, device)
        # Persistent outputs, as a worker keeps them (and CUDA graphs need them).
        self.slots = torch.empty((len(widths), max(self.num_tokens, 1)), dtype=torch.int64, device=device)
        self.worst = torch.full((len(widths), num_reqs), -1, dtype=torch.int64, device=device)
        # A decode step's appends: ``append_blocks`` new ids at the end of every row, kept in
        # bounds (the step's columns are overwritten each time, which is what we time).
        writes = []
        for g, w in enumerate(widths):
            n = min(args.append_blocks, w)
            start = min(used[g], w - n)
            for r in range(num_reqs):
                writes.append((g, r, start, list(range(r * n + 1, r * n + 1 + n))))
        self.writes = StagedWrites.from_lists(writes, device)
        self.append_ids = sum(min(args.append_blocks, w) for w in widths) * num_reqs


def bytes_moved(inputs: Inputs, args) -> dict[str, int]:
    """Bytes each kernel must read plus write (its useful traffic, not cache-line traffic)."""
    n_writes = inputs.writes.num_writes
    apply = inputs.append_ids * 8 + n_writes * (4 * 4 + 8 + 4)  # ids in+out, metadata, flag
    gather = sum(inputs.used) * inputs.num_reqs * 8 + inputs.num_reqs * len(inputs.used) * 8
    slots = 0
    for g in inputs.layout.groups:
        local = inputs.num_tokens if not (g.group.is_sharded and args.dcp > 1) else inputs.num_tokens // args.dcp
        slots += inputs.num_tokens * (8 + 8) + local * 4  # positions in, slots out, table reads
    slots += (inputs.num_reqs + 1) * 8 * len(inputs.used)
    return {"apply_writes": apply, "gather": gather, "slot_mapping": slots}


# ---------------------------------------------------------------------------------------------
# Timed calls
# ---------------------------------------------------------------------------------------------


def kernel_calls(inputs: Inputs, args, backend: str):
    from kvproof.kernels import host

    return {
        "apply_writes": lambda: host.apply_writes(inputs.tables, inputs.writes, backend=backend, check=False),
        "gather": lambda: host.gather_block_tables(
            inputs.tables, inputs.num_blocks, inputs.idx_mapping, inputs.num_reqs, inputs.out, backend=backend),
        "slot_mapping": lambda: host.compute_slot_mappings(
            inputs.tables, inputs.block_sizes, inputs.sharded, inputs.idx_mapping, inputs.query_start,
            inputs.positions, inputs.num_tokens, dcp_rank=args.dcp_rank, dcp=args.dcp,
            interleave=args.interleave, backend=backend, check=False, out=inputs.slots,
            worst_index=inputs.worst),
    }


def vllm_calls(inputs: Inputs, args, device):
    """vLLM's BlockTables on the same batch, or a string saying why it cannot be timed.

    vLLM sizes every row ``cdiv(max_len, block_size * cp_size)`` in the versions whose
    constructor takes no per-group sharding, so replicated groups get rows too short for the
    context; its timings are then of the same kernels on shorter rows."""
    if args.no_vllm:
        return "skipped (--no-vllm)"
    try:
        import inspect

        import torch
        from vllm.v1.worker.gpu.block_table import BlockTables as VllmBlockTables
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        return f"not available ({type(e).__name__}: {e})"
    try:
        known = {
            "block_sizes": [g.group.block_size for g in inputs.layout.groups],
            "max_num_reqs": inputs.num_reqs,
            "max_num_batched_tokens": max(inputs.num_tokens, 1),
            "max_model_len": args.max_model_len,
            "device": device,
            "cp_size": args.dcp,
            "cp_rank": args.dcp_rank,
            "cp_interleave": args.interleave,
            "dcp_sharded": [g.group.is_sharded for g in inputs.layout.groups],
        }
        params = inspect.signature(VllmBlockTables.__init__).parameters
        missing = [n for n, p in params.items() if n != "self" and p.default is p.empty and n not in known]
        if missing:
            return f"API differs (constructor needs {', '.join(missing)})"
        vbt = VllmBlockTables(**{n: v for n, v in known.items() if n in params})
        widths = [int(t.gpu.shape[1]) for t in vbt.block_tables] if hasattr(vbt, "block_tables") else None
        for r in range(inputs.num_reqs):
            ids = tuple(list(range(1, 1 + min(u, widths[g] if widths else u))) for g, u in enumerate(inputs.used))
            vbt.append_block_ids(r, ids, overwrite=True)
        vbt.apply_staged_writes()
        positions = inputs.positions
        if widths:  # keep vLLM's unchecked reads inside its (possibly shorter) rows
            cap = min(w * g.group.block_size * args.dcp for w, g in zip(widths, inputs.layout.groups))
            positions = positions % max(cap, 1)

        def append_and_apply():
            for r in range(inputs.num_reqs):
                vbt.append_block_ids(r, tuple([1] * args.append_blocks for _ in inputs.used), overwrite=False)
                for g in range(len(inputs.used)):  # keep counts in bounds across repetitions
                    vbt.num_blocks.np[g, r] -= args.append_blocks
            vbt.apply_staged_writes()

        calls = {
            "apply_writes": append_and_apply,
            "gather": lambda: vbt.gather_block_tables(inputs.idx_mapping),
            "slot_mapping": lambda: vbt.compute_slot_mappings(inputs.idx_mapping, inputs.query_start, positions),
        }
        for fn in calls.values():
            fn()
        torch.cuda.synchronize()
        return calls
    except Exception as e:  # noqa: BLE001 - report, never fail the benchmark
        return f"API differs ({type(e).__name__}: {e})"


def yardsticks(args, device) -> dict[str, float]:
    """Copy bandwidth (bytes/s) and the launch floor (device us per launch, host us per launch)."""
    import torch
    import triton
    from triton.testing import do_bench

    @triton.jit
    def _empty_kernel(x_ptr):  # x_ptr: unused; the launch itself is what is timed
        pass

    n = args.copy_mib << 20
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src), warmup=args.warmup, rep=args.rep)
    empty_ms = do_bench(lambda: _empty_kernel[(1,)](src), warmup=args.warmup, rep=args.rep)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(1000):
        _empty_kernel[(1,)](src)
    torch.cuda.synchronize()
    host_us = (time.perf_counter() - t0) * 1e3
    return {"copy_bytes_per_s": 2 * n / (copy_ms * 1e-3), "launch_us": empty_ms * 1e3, "launch_host_us": host_us}


# ---------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------


def run_gpu(args) -> list[dict]:
    import torch
    from triton.testing import do_bench

    device = torch.device("cuda")
    floor = yardsticks(args, device)
    rows = [{"kind": "yardstick", "device": torch.cuda.get_device_name(device), **floor}]
    for num_groups in args.groups:
        layout = build_layout(args, num_groups)
        for num_reqs in args.requests:
            inputs = Inputs(args, layout, num_reqs, device)
            moved = bytes_moved(inputs, args)
            ours = kernel_calls(inputs, args, "triton")
            theirs = vllm_calls(inputs, args, device)
            for name, fn in ours.items():
                ms = do_bench(fn, warmup=args.warmup, rep=args.rep)
                row = {
                    "kind": "kernel", "kernel": name, "requests": num_reqs, "groups": num_groups,
                    "us": ms * 1e3, "bytes": moved[name], "bytes_per_s": moved[name] / (ms * 1e-3),
                }
                row["copy_bw_fraction"] = row["bytes_per_s"] / floor["copy_bytes_per_s"]
                row["x_launch_floor"] = row["us"] / floor["launch_us"]
                if isinstance(theirs, dict):
                    row["vllm_us"] = do_bench(theirs[name], warmup=args.warmup, rep=args.rep) * 1e3
                else:
                    row["vllm"] = theirs
                rows.append(row)
    return rows


def run_cpu_smoke(args) -> list[dict]:
    """Every kernel once per tiny configuration in Triton's interpreter, checked against the
    torch reference (so that this script is itself tested without a GPU)."""
    import torch

    args.requests = [min(r, 4) for r in args.requests[:2]]
    args.groups = [min(g, 2) for g in args.groups[:2]]
    args.max_model_len, args.context_len = 4096, min(args.context_len, 1000)
    args.query_len = min(args.query_len, 4)
    rows = []
    for num_groups in sorted(set(args.groups)):
        layout = build_layout(args, num_groups)
        for num_reqs in sorted(set(args.requests)):
            inputs, twin = Inputs(args, layout, num_reqs, "cpu"), Inputs(args, layout, num_reqs, "cpu")
            results = {}
            for (name, fn), ref in zip(kernel_calls(inputs, args, "triton").items(),
                                       kernel_calls(twin, args, "torch").values()):
                t0 = time.perf_counter()
                got = fn()
                us = (time.perf_counter() - t0) * 1e6
                want = ref()
                same = all(torch.equal(a, b) for a, b in zip(_flat(got), _flat(want)))
                same = same and torch.equal(inputs.tables.storage, twin.tables.storage)
                same = same and torch.equal(inputs.out.storage, twin.out.storage)
                results[name] = same
                rows.append({"kind": "smoke", "kernel": name, "requests": num_reqs, "groups": num_groups,
                             "interpreter_us": us, "matches_reference": same})
            if not all(results.values()):
                raise SystemExit(f"kernel differs from its reference: {results}")
    return rows


def _flat(value):
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flat(v)]
    return [value]


def print_table(rows: list[dict]) -> None:
    for r in rows:
        if r["kind"] == "yardstick":
            print(f"device {r['device']}: copy {r['copy_bytes_per_s'] / 1e9:.0f} GB/s, "
                  f"empty-kernel launch {r['launch_us']:.1f} us (device), {r['launch_host_us']:.1f} us (host)")
            print(f"{'kernel':<13} {'reqs':>5} {'groups':>6} {'us':>9} {'GB/s':>8} {'% copy':>7} "
                  f"{'x floor':>8} {'vLLM us':>9}")
        elif r["kind"] == "kernel":
            vllm = f"{r['vllm_us']:9.1f}" if "vllm_us" in r else f"{'-':>9}"
            print(f"{r['kernel']:<13} {r['requests']:>5} {r['groups']:>6} {r['us']:9.1f} "
                  f"{r['bytes_per_s'] / 1e9:8.2f} {100 * r['copy_bw_fraction']:6.2f}% {r['x_launch_floor']:8.1f} {vllm}")
        else:
            print(f"{r['kernel']:<13} reqs {r['requests']:>2} groups {r['groups']}: interpreter "
                  f"{r['interpreter_us'] / 1e3:7.1f} ms, matches reference: {r['matches_reference']}")
    notes = {r["vllm"] for r in rows if "vllm" in r}
    for note in sorted(notes):
        print(f"vLLM: {note}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported
    try:
        import torch
        import triton  # noqa: F401
    except ImportError as e:
        print(f"benchmarks/kernels.py needs torch and triton ({e}); install kvproof[kernels]", file=sys.stderr)
        return 2
    if args.cpu_smoke:
        rows = run_cpu_smoke(args)
    elif not torch.cuda.is_available():
        print("no CUDA device: the kernel timings need a GPU. Run this on a CUDA machine "
              "(pip install -e .; torch and triton), or pass --cpu-smoke for a tiny interpreter check.")
        return 0
    else:
        rows = run_gpu(args)
    if args.json:
        for r in rows:
            print(json.dumps(r))
    else:
        print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
