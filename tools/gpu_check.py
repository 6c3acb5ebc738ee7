"""What only a GPU can check, in one run of under five minutes (docs/kernels.md, "On a GPU").

    python tools/gpu_check.py                 # on a CUDA machine: all three parts
    python tools/gpu_check.py --cpu           # dry run on a CPU (Triton's interpreter, tiny sizes)
    python tools/gpu_check.py --out DIR       # also write DIR/gpu_check.json

1. **Kernels against their references.** The ``gpu``-marked tests of tests/kernels: each Triton
   kernel compiled for the device, on random and odd shapes, equal (exactly) to its torch
   reference. ``--cpu`` runs the same files' interpreter tests on a small selection instead.
2. **The worker-side checks on vLLM's model runner V2 ``BlockTables``** (vLLM 0.33.0, on the
   device): kvproof's wrapper refuses an append that overflows group 1 before group 0 is staged
   (vLLM alone stages group 0 and advances its count: docs/vllm-semantics.md §10.6); vLLM's own
   slot-mapping kernel, checked on every call (``KVPROOF_CONTRACTS=slow``), agrees with
   ``spec.placement`` on every rank of DCP 1, 2 and 8, for a sharded and a replicated group, with a
   dummy row; and kvproof's kernel gives the same slots as vLLM's on the same rows. vLLM's
   tables need pinned memory, so ``--cpu`` reports this part as not run.
3. **Timings against launch latency.** benchmarks/kernels.py on a small sweep (``--cpu``: its
   ``--cpu-smoke``): each kernel's time beside an empty kernel's launch and the copy bandwidth.

Needs no package index: it runs what is installed (torch, triton; vLLM for part 2, reported as
missing otherwise) and this working tree. Exit status 0 when every part that ran passed, 1 when
a check failed, 2 when the machine cannot run it (no CUDA without ``--cpu``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Per-part wall-clock limits (seconds): together well inside five minutes.
LIMITS = {"kernels": 120, "vllm": 60, "timings": 100}


def _environment() -> dict:
    import torch

    env = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if env["cuda"]:
        env["device"] = torch.cuda.get_device_name(0)
    for name in ("triton", "vllm"):
        try:
            env[name] = __import__(name).__version__
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            env[name] = f"not importable ({type(e).__name__})"
    return env


def part_kernels(cpu: bool) -> dict:
    """Part 1 through pytest: the gpu-marked kernel tests (``--cpu``: interpreter tests)."""
    selection = ["-m", "not gpu", "-k", "reference or native or weird or random"] if cpu else ["-m", "gpu"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "tests/kernels", *selection]
    env = {**os.environ, "ICONTRACT_SLOW": "0"}
    if cpu:
        env["TRITON_INTERPRET"] = "1"
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=LIMITS["kernels"])
    except subprocess.TimeoutExpired:
        return {"ok": False, "detail": f"over {LIMITS['kernels']} s", "seconds": LIMITS["kernels"]}
    tail = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-300:]
    # On a GPU nothing may skip: a skipped gpu test would be a check that did not run.
    ok = done.returncode == 0 and (cpu or " skipped" not in tail) and " passed" in tail
    return {"ok": ok, "command": " ".join(cmd[2:]), "summary": tail, "seconds": round(time.monotonic() - start, 1)}


def part_vllm_tables(cpu: bool) -> dict:
    """Part 2 in process: vLLM's V2 ``BlockTables`` under kvproof's worker checks."""
    if cpu:
        return {"ok": True, "ran": False, "detail": "vLLM's V2 BlockTables need pinned memory (CUDA): not run on CPU"}
    os.environ["KVPROOF_CONTRACTS"] = "slow"  # check the slot mappings on every call
    try:
        import torch
        from vllm.v1.worker.gpu.block_table import BlockTables
    except Exception as e:  # noqa: BLE001 - a machine without vLLM: say so
        return {"ok": False, "ran": False, "detail": f"vLLM's BlockTables do not import: {type(e).__name__}: {e}"}
    from kvproof.integrations.vllm import worker_checks
    from kvproof.integrations.vllm.violations import ViolationSink
    from kvproof.kernels import host
    from kvproof.kernels.packed_tables import PackedTables
    from kvproof.spec.contracts import InvariantViolation

    start = time.monotonic()
    device = torch.device("cuda")
    findings = []
    block_sizes, widths = [4, 8], [6, 6]  # group 0 sharded (attention), group 1 replicated (Mamba)
    append = worker_checks.checked_v2_append_block_ids(BlockTables.append_block_ids, ViolationSink("raise"))
    slots = worker_checks.checked_v2_slot_mappings(BlockTables.compute_slot_mappings, ViolationSink("raise"))
    cases = 0
    for dcp in (1, 2, 8):
        for rank in range(dcp):
            for interleave in (1, 2):
                tables = BlockTables(block_sizes, 4, 64, widths, device, cp_size=dcp, cp_rank=rank,
                                     cp_interleave=interleave, dcp_sharded=[True, False])
                rows = ([[3, 5, 7], [9, 2]], [[11, 13], [4]])  # per request: per group ids
                for r, ids in enumerate(rows):
                    append(tables, r, tuple(ids), True)
                try:  # group 1 overflows (2 + 5 > 6): nothing may be staged, group 0's count kept
                    append(tables, 0, ([1], [1, 1, 1, 1, 1]), False)
                    findings.append(f"dcp {dcp} rank {rank}: an overflowing append was not refused")
                except InvariantViolation:
                    if int(tables.num_blocks.np[0, 0]) != 3:
                        findings.append(f"dcp {dcp} rank {rank}: group 0 advanced to {int(tables.num_blocks.np[0, 0])}")
                tables.apply_staged_writes()
                # Requests 1 and 0 with a dummy row between; positions stay inside every row
                # (6 entries of 4 tokens in group 0 at DCP 1), so only the placement is tested.
                idx = torch.tensor([1, -1, 0], dtype=torch.int32, device=device)
                qsl = torch.tensor([0, 12, 13, 33], dtype=torch.int32, device=device)
                positions = torch.tensor(list(range(12)) + [0] + list(range(20)), dtype=torch.int64, device=device)
                try:
                    got = slots(tables, idx, qsl, positions, 48)
                except InvariantViolation as e:
                    findings.append(f"dcp {dcp} rank {rank} interleave {interleave}: {e}")
                    continue
                # kvproof's own kernel on the same rows gives the same slots.
                packed = PackedTables.zeros(widths, 4, device)
                for g in range(2):
                    packed.group(g).copy_(tables.block_tables[g].gpu[:4, : widths[g]])
                ours, _ = host.compute_slot_mappings(
                    packed, torch.tensor(block_sizes, dtype=torch.int32, device=device),
                    host.sharded_flags([True, False], dcp, device), idx, qsl, positions, 48,
                    dcp_rank=rank, dcp=dcp, interleave=interleave, backend="triton")
                if not torch.equal(ours[:, :33].cpu(), got[:, :33].cpu()):
                    findings.append(f"dcp {dcp} rank {rank} interleave {interleave}: kvproof's slots differ from vLLM's")
                cases += 1
    torch.cuda.synchronize()
    return {"ok": not findings, "ran": True, "cases": cases, "findings": findings[:10],
            "seconds": round(time.monotonic() - start, 1)}


def part_timings(cpu: bool) -> dict:
    """Part 3: benchmarks/kernels.py on a small sweep, as JSON lines."""
    sweep = ["--cpu-smoke"] if cpu else ["--requests", "1,128,4096", "--groups", "2,4", "--warmup", "10", "--rep", "40"]
    cmd = [sys.executable, "benchmarks/kernels.py", *sweep, "--json"]
    start = time.monotonic()
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=LIMITS["timings"],
                              env={**os.environ, "ICONTRACT_SLOW": "0"})
    except subprocess.TimeoutExpired:
        return {"ok": False, "detail": f"over {LIMITS['timings']} s", "seconds": LIMITS["timings"]}
    rows = []
    for line in done.stdout.splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return {"ok": done.returncode == 0 and bool(rows or cpu), "command": " ".join(cmd[1:]), "rows": rows,
            "stderr": done.stderr[-500:] if done.returncode else "", "seconds": round(time.monotonic() - start, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="dry run without a GPU (interpreter, tiny sizes)")
    p.add_argument("--out", type=Path, help="a folder to write gpu_check.json to")
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu" if args.cpu else "cuda")
    os.environ.setdefault("VLLM_PLUGINS", "")  # the checks are wrapped by hand here
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; run with --cpu for the dry run", file=sys.stderr)
        return 2
    report = {"mode": "cpu dry run" if args.cpu else "gpu", "environment": _environment(), "parts": {}}
    start = time.monotonic()
    for name, part in (("kernels", part_kernels), ("vllm_block_tables", part_vllm_tables), ("timings", part_timings)):
        result = part(args.cpu)
        report["parts"][name] = result
        print(f"gpu_check: {name}: {'ok' if result['ok'] else 'FAILED'} "
              f"{result.get('summary') or result.get('detail') or ''}".rstrip(), flush=True)
    report["seconds"] = round(time.monotonic() - start, 1)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_check.json").write_text(text)
    return 0 if all(r["ok"] for r in report["parts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
