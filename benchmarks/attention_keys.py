"""Attention keys at every hash boundary against keys at chunk ends only: hits per
request and the memory the extra keys cost, on the Mooncake conversation trace, per DCP size.

For each DCP size both rules replay the same trace (kvproof's scheduler and manager, cheap
contracts, a pool that never evicts) and the script reports each rule's hit rate, how many
requests hit more / fewer tokens with every-hash keys, the peak prefix keys (with no eviction a
key is never dropped, so the peak is the count at the end), keys per attention block against
the bound ``B / H`` (``block_size * dcp / H``), and the keys' host memory: bytes per key
measured with tracemalloc on a pool holding real 32-byte hashes, times the count.

    python benchmarks/attention_keys.py --limit 2000 --group mla:256 --hash-block-size 256
    python benchmarks/attention_keys.py --limit 2000 --preset kimi-k3
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import sys
import tracemalloc

os.environ.pop("ICONTRACT_SLOW", None)  # cheap tier only, as served

from kvproof.cli.layout_args import parse_group  # noqa: E402
from kvproof.cli.presets import PRESETS  # noqa: E402
from kvproof.impl.block_pool import BlockPool  # noqa: E402
from kvproof.impl.kv_cache_manager import KVCacheManager  # noqa: E402
from kvproof.sim.replay import replay  # noqa: E402
from kvproof.sim.workload import read_workload  # noqa: E402
from kvproof.spec.layout import LayoutConfig, resolve_layout  # noqa: E402

TRACE = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "traces", "mooncake",
                     "conversation_trace.jsonl"))


def bytes_per_prefix_key(blocks: int = 2000, keys_per_block: int = 8) -> float:
    """Host bytes one prefix key costs in the pool (its key tuple and hash, the key-map entry,
    its holder list and its place in the block's prefix list), measured: a pool whose blocks
    carry ``keys_per_block`` keys against the same pool with one key per block."""
    def build(per_block: int) -> int:
        pool = BlockPool(blocks + 1)
        held = pool.allocate(blocks)
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for b in held:
            for i in range(1, per_block + 1):
                key = (hashlib.sha256(f"{b}/{i}".encode()).digest(), 0)
                pool.extend_partial(b, key, i)
        used = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        return used

    return (build(keys_per_block) - build(1)) / (blocks * (keys_per_block - 1))


def one(trace, config, num_blocks, budget):
    """Replay; returns the result, the prefix keys at the end (the peak: nothing is evicted)
    and the most keys one block carries."""
    seen: list[KVCacheManager] = []
    result = replay(trace, resolve_layout(config), num_blocks, max_num_batched_tokens=budget, oracle=False,
                    on_step=lambda plan, sched: seen.append(sched.kv) if not seen else None)
    pool = seen[0].pool
    most = max(len(pool.keys_of(b)) for b in range(1, pool.num_blocks))
    return result, pool.num_prefix_keys(), most


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=TRACE)
    p.add_argument("--limit", type=int, default=2000)
    p.add_argument("--group", action="append", help="as for kvproof geometry")
    p.add_argument("--preset", choices=sorted(PRESETS), help="a named layout instead of --group")
    p.add_argument("--hash-block-size", type=int)
    p.add_argument("--dcp", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--num-blocks", type=int, default=300_000, help="large enough that nothing is evicted")
    p.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    args = p.parse_args(argv)
    groups = PRESETS[args.preset].groups if args.preset else tuple(parse_group(g) for g in args.group or ["mla:256"])
    workload = read_workload(args.trace, limit=args.limit)
    per_key = bytes_per_prefix_key()
    print(f"# {workload.description}; groups {', '.join(g.label for g in groups)}, H {args.hash_block_size or 'derived'}, "
          f"{args.num_blocks:,} blocks, budget {args.budget}; one prefix key costs {per_key:.0f} host bytes (tracemalloc)")
    print(f"{'dcp':>3}  {'B/H':>4}  {'chunk-ends':>10}  {'every-hash':>10}  {'more':>5}  {'fewer':>5}  "
          f"{'prefix keys c-e':>15}  {'prefix keys e-h':>15}  {'most keys/block e-h':>19}  {'key MiB e-h':>11}")
    for dcp in args.dcp:
        base = LayoutConfig(groups, dcp=dcp, max_model_len=1 << 20, hash_block_size=args.hash_block_size)
        ce, ce_prefix, _ = one(workload.requests(), dataclasses.replace(base, attention_keys="chunk-ends"), args.num_blocks, args.budget)
        eh, eh_prefix, eh_most = one(workload.requests(), dataclasses.replace(base, attention_keys="every-hash"), args.num_blocks, args.budget)
        layout = resolve_layout(base)
        if ce.evictions or eh.evictions or ce.violations or eh.violations:
            print(f"# dcp {dcp}: evictions {ce.evictions}/{eh.evictions}, violations {ce.violations + eh.violations}; "
                  "raise --num-blocks", file=sys.stderr)
            return 1
        more = sum(e.num_cached_tokens > c.num_cached_tokens for e, c in zip(eh.requests, ce.requests))
        fewer = sum(e.num_cached_tokens < c.num_cached_tokens for e, c in zip(eh.requests, ce.requests))
        attn = next(g for g in layout.groups if g.group.kind.value in ("full_attention", "mla"))
        bound = attn.effective_block_size // layout.hash_block_size
        print(f"{dcp:>3}  {bound:>4}  {ce.hit_rate:>10.2%}  {eh.hit_rate:>10.2%}  {more:>5}  {fewer:>5}  "
              f"{ce_prefix:>15,}  {eh_prefix:>15,}  {eh_most:>19}  {eh_prefix * per_key / 2**20:>11.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
